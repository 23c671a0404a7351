"""Engine arguments: one dataclass shared by ``LLM(...)`` and the command line (vLLM's names)."""

from __future__ import annotations

import argparse
from dataclasses import dataclass, fields

# The help of --quantization; README.md (Models) quotes it word for word (a test checks).
QUANTIZATION_HELP = (
    "unset or gguf: on CPU with one rank, the Q4_1, Q8_0, MXFP4 and NVFP4 weights of a .gguf "
    "model stay GGUF blocks that every step multiplies by directly, with the activations "
    "rounded to 8 bits per block of 32 (in any --dtype; not token-exact); int8: W8A8, "
    "weights quantized per output channel at load after SmoothQuant, activations per token "
    "(CPU only; not exact); mxfp4, nvfp4: every Linear in that 4-bit float format, "
    "quantized at load unless the .gguf file stores it so, multiplied as the GGUF blocks are "
    "(on CUDA by a Triton kernel; not exact); none: dequantized weights only (exact with --dtype float32)")


@dataclass
class EngineArgs:
    """Everything that configures an engine. Field names are vLLM's engine arguments."""

    model: str | None = None
    tokenizer: str | None = None
    skip_tokenizer_init: bool = False
    dtype: str = "auto"
    device: str = "auto"
    seed: int = 0
    block_size: int = 16
    kv_cache_dtype: str = "auto"
    max_num_seqs: int = 256
    max_num_batched_tokens: int | None = None
    max_model_len: int | None = None
    gpu_memory_utilization: float | None = None
    kv_cache_memory_bytes: int | None = None
    memory_budget: int | None = None
    num_gpu_blocks_override: int | None = None
    enable_prefix_caching: bool = True
    enable_chunked_prefill: bool = True
    max_logprobs: int = 20
    attention_backend: str = "auto"
    load_format: str = "auto"
    quantization: str | None = None
    scheduling: str = "continuous"
    enforce_eager: bool = False
    tensor_parallel_size: int = 1
    data_parallel_size: int = 1
    distributed_executor_backend: str | None = None
    distributed_timeout: float = 300.0
    # vLLM's StructuredOutputsConfig as a dict; only "backend" ("auto" or "xgrammar").
    structured_outputs_config: dict | None = None
    # vLLM's SpeculativeConfig as a dict or its JSON text (config.SpeculativeConfig).
    speculative_config: dict | str | None = None
    # LoRA adapters (lora/): vLLM's names and defaults
    enable_lora: bool = False
    max_loras: int = 1
    max_lora_rank: int = 16
    max_cpu_loras: int | None = None
    lora_dtype: str = "auto"

    @staticmethod
    def add_cli_args(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
        """Add the engine flags (``--block-size`` etc.) to ``parser``."""
        d = EngineArgs()
        parser.add_argument("--tokenizer", default=None,
                            help="tokenizer path if not the model's own")
        parser.add_argument("--dtype", default=d.dtype,
                            choices=["auto", "float32", "bfloat16", "float16", "half", "float"],
                            help="compute and KV cache dtype (auto: bfloat16 on CUDA and on CPUs "
                                 "with native bf16 (AVX512-BF16, AMX), else float32)")
        parser.add_argument("--device", default=d.device, help="auto, cpu or cuda")
        parser.add_argument("--seed", type=int, default=d.seed,
                            help="seed of the random generator for unseeded sampling")
        parser.add_argument("--block-size", type=int, default=d.block_size,
                            help="tokens per KV cache block")
        parser.add_argument("--kv-cache-dtype", default=d.kv_cache_dtype,
                            choices=["auto", "bfloat16"],
                            help="KV cache storage dtype (auto: the model's dtype; bfloat16: "
                                 "half a float32 model's cache bytes, attention still in "
                                 "float32; not exact)")
        parser.add_argument("--max-num-seqs", type=int, default=d.max_num_seqs,
                            help="most sequences in one engine step")
        parser.add_argument("--max-num-batched-tokens", type=int, default=None,
                            help="most tokens (prefill + decode) in one engine step "
                                 "(default: 2048)")
        parser.add_argument("--max-model-len", type=int, default=None,
                            help="longest sequence, prompt + output, in tokens (default: the model's)")
        parser.add_argument("--gpu-memory-utilization", type=float, default=None,
                            help="fraction of device memory the engine may use (weights, "
                                 "activations and KV cache)")
        parser.add_argument("--kv-cache-memory-bytes", type=int, default=None,
                            help="bytes for the KV cache, overriding memory-based sizing")
        parser.add_argument("--memory-budget", type=int, default=None, metavar="BYTES",
                            help="CPU: bytes the whole process may hold (interpreter, weights, "
                                 "activations, KV cache); the KV cache takes what the rest "
                                 "leaves")
        parser.add_argument("--num-gpu-blocks-override", type=int, default=None,
                            help="fixed number of KV blocks (testing)")
        parser.add_argument("--enable-prefix-caching", action=argparse.BooleanOptionalAction,
                            default=d.enable_prefix_caching, help="automatic prefix caching")
        parser.add_argument("--enable-chunked-prefill", action=argparse.BooleanOptionalAction,
                            default=d.enable_chunked_prefill,
                            help="split long prompts across steps")
        parser.add_argument("--max-logprobs", type=int, default=d.max_logprobs,
                            help="most logprobs a request may ask for")
        parser.add_argument("--attention-backend", default=d.attention_backend,
                            help="auto, cpu, torch, reference or triton (auto: triton on "
                                 "CUDA, the C++ kernel 'cpu' on CPU when it builds, else torch)")
        parser.add_argument("--load-format", default=d.load_format, choices=["auto", "dummy"],
                            help="auto: read the checkpoint; dummy: random weights of the "
                                 "model's shapes (benchmarks)")
        parser.add_argument("--quantization", "-q", default=None,
                            choices=["gguf", "int8", "mxfp4", "none", "nvfp4"],
                            help=QUANTIZATION_HELP)
        parser.add_argument("--scheduling", default=d.scheduling,
                            choices=["continuous", "static"],
                            help="continuous batching, or static batches (a baseline: a "
                                 "batch runs until its last request finishes before the "
                                 "next is admitted)")
        parser.add_argument("--enforce-eager", action="store_true",
                            help="always run the model eagerly: no CUDA graphs of decode steps "
                                 "(captured on CUDA with the triton attention backend)")
        parser.add_argument("--tensor-parallel-size", "-tp", type=int,
                            default=d.tensor_parallel_size,
                            help="ranks the model is split over (Megatron-style: attention "
                                 "heads and MLP rows; must divide the attention heads)")
        parser.add_argument("--data-parallel-size", "-dp", type=int,
                            default=d.data_parallel_size,
                            help="engine replicas behind one server (serve only); each "
                                 "request goes to the replica with the fewest waiting, then "
                                 "running requests")
        parser.add_argument("--distributed-executor-backend", default=None,
                            choices=["uni", "mp", "ray"],
                            help="where the ranks run: uni (this process; the default for "
                                 "one rank), mp (processes on this machine; the default for "
                                 "more), ray (Ray actors, on a Ray cluster when one is found "
                                 "through RAY_ADDRESS or `ray start`, else a local one)")
        parser.add_argument("--distributed-timeout", type=float, default=d.distributed_timeout,
                            help="seconds a rank may take for one collective before the "
                                 "engine declares it hung and stops (default: 300)")
        parser.add_argument("--structured-outputs-config.backend", default="auto",
                            dest="structured_outputs_backend", choices=["auto", "xgrammar"],
                            help="engine of structured outputs (response_format, "
                                 "structured_outputs, tools): auto and xgrammar both mean "
                                 "xgrammar")
        parser.add_argument("--speculative-config", default=None,
                            help="speculative decoding as JSON, vLLM's fields: "
                                 "{\"method\": \"ngram\" | \"draft_model\" | \"self\", "
                                 "\"num_speculative_tokens\": k, ...} (see README)")
        parser.add_argument("--enable-lora", action="store_true",
                            help="serve LoRA adapters (PEFT directories) on the base model")
        parser.add_argument("--max-loras", type=int, default=d.max_loras,
                            help="most adapters one step may use (default: 1)")
        parser.add_argument("--max-lora-rank", type=int, default=d.max_lora_rank,
                            help="the largest adapter rank served (default: 16)")
        parser.add_argument("--max-cpu-loras", type=int, default=None,
                            help="adapters kept loaded in memory, least recently used "
                                 "evicted (default: --max-loras)")
        parser.add_argument("--lora-dtype", default=d.lora_dtype,
                            choices=["auto", "float32", "bfloat16"],
                            help="dtype the adapters are held in (auto: the model's); "
                                 "bfloat16 halves the bytes a step reads per adapter")
        return parser

    @classmethod
    def from_cli_args(cls, args: argparse.Namespace) -> EngineArgs:
        kwargs = {f.name: getattr(args, f.name) for f in fields(cls) if hasattr(args, f.name)}
        if hasattr(args, "structured_outputs_backend"):
            kwargs["structured_outputs_config"] = {"backend": args.structured_outputs_backend}
        return cls(**kwargs)

    @property
    def structured_outputs_backend(self) -> str:
        """The structured-outputs backend; raises ``ValueError`` for unknown config keys."""
        config = dict(self.structured_outputs_config or {})
        unknown = sorted(set(config) - {"backend"})
        if unknown:
            raise ValueError(f"structured_outputs_config: unknown keys {unknown}; known: "
                             "['backend']")
        return config.get("backend", "auto")
