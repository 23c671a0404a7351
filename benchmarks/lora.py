"""Multi-LoRA serving, measured: the shared workload with adapters vs without, one engine,
one run.

    python benchmarks/lora.py make-adapters --out /tmp/adapters --num 8 --rank 16
    python benchmarks/lora.py compare --adapters /tmp/adapters/* --rounds 2
    python benchmarks/lora.py lone --adapters /tmp/adapters/adapter-0

``make-adapters`` writes PEFT LoRA adapters (``adapter_config.json`` +
``adapter_model.safetensors``, the files ``PeftModel.save_pretrained`` writes) with random
weights for the bundled model (or ``--model``): all seven projections (q, k, v, o, gate,
up, down) of every layer, rank ``--rank``, ``lora_alpha`` = 2 x rank. The values are random
(A uniform as PEFT's Kaiming init, B normal): what is measured is the cost of the term, not
what it says.

``compare``: one engine (``--enable-lora``, ``--max-loras`` = number of adapters), the
workload with no adapter and with request i on adapter ``i mod N``, alternating
``--rounds`` times; prints output tokens/s of each run, the best-run ratio (target >= 0.8)
and the mean decode-only step time of each, whose difference is the LoRA share of a step.
``lone``: one request alone (a workload prompt, ``--max-tokens`` greedy tokens), without
and with the first adapter, alternating; prints decode tokens/s of each. The machine's CPU
model and flags are printed first.
"""

from __future__ import annotations

import argparse
import json
import math
import pathlib
import subprocess

import pagedserve  # noqa: F401  (before torch: it sets GOMP_SPINCOUNT, as the CLI does)

MODULES = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


def cpu_line() -> str:
    out = subprocess.run(["lscpu"], check=False, capture_output=True, text=True).stdout
    info = dict(line.split(":", 1) for line in out.splitlines() if ":" in line)
    flags = set(info.get("Flags", "").split())
    keep = sorted(f for f in flags if f.startswith(("avx512", "amx")) or f in ("avx2", "fma"))
    return f"{info.get('Model name', '?').strip()}; flags: {' '.join(keep)}"


def make_adapters(model: str | None, out: pathlib.Path, num: int, rank: int, seed: int) -> None:
    import torch
    from safetensors.torch import save_file

    from pagedserve.args import EngineArgs
    from pagedserve.model_loader.model_config import ModelConfig

    config = ModelConfig.from_args(EngineArgs(model=model)).hf_config
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    q, kv = config.num_attention_heads * head_dim, config.num_key_value_heads * head_dim
    h, inter = config.hidden_size, config.intermediate_size
    shapes = {"q_proj": (h, q), "k_proj": (h, kv), "v_proj": (h, kv), "o_proj": (q, h),
              "gate_proj": (h, inter), "up_proj": (h, inter), "down_proj": (inter, h)}
    gen = torch.Generator().manual_seed(seed)
    for n in range(num):
        tensors = {}
        for layer in range(config.num_hidden_layers):
            for module, (k, width) in shapes.items():
                key = f"base_model.model.model.layers.{layer}.{'self_attn' if module in MODULES[:4] else 'mlp'}.{module}"
                bound = 1 / math.sqrt(k)
                tensors[f"{key}.lora_A.weight"] = (torch.rand(rank, k, generator=gen) * 2 - 1) * bound
                tensors[f"{key}.lora_B.weight"] = torch.randn(width, rank, generator=gen) * 0.01
        folder = out / f"adapter-{n}"
        folder.mkdir(parents=True, exist_ok=True)
        save_file(tensors, folder / "adapter_model.safetensors")
        (folder / "adapter_config.json").write_text(json.dumps({
            "peft_type": "LORA", "r": rank, "lora_alpha": 2 * rank, "target_modules": list(MODULES),
            "bias": "none", "use_rslora": False, "use_dora": False, "modules_to_save": None,
            "task_type": "CAUSAL_LM"}, indent=1))
        print(f"wrote {folder}")


def compare(args: argparse.Namespace) -> None:
    from pagedserve.args import EngineArgs
    from pagedserve.benchmarks import datasets
    from pagedserve.benchmarks.throughput import lora_requests, run
    from pagedserve.engine.llm_engine import LLMEngine

    print(cpu_line())
    engine = LLMEngine(EngineArgs(model=args.model, dtype=args.dtype, quantization=args.quantization,
                                  enable_lora=True, max_loras=len(args.adapters),
                                  max_lora_rank=args.max_lora_rank, lora_dtype=args.lora_dtype))
    dataset = argparse.ArgumentParser()
    datasets.add_dataset_args(dataset)
    ns = dataset.parse_args(["--dataset-name", "workload"])
    samples = datasets.get_samples(ns, engine.tokenizer, engine.hf_config.vocab_size,
                                   engine.max_model_len)
    with_loras = lora_requests(args.adapters, len(samples))
    for lora in with_loras[: len(args.adapters)]:  # read once, before anything is timed
        engine.add_lora(lora)
    runs = {"base": [], "lora": []}
    for _ in range(args.rounds):
        for name, loras in (("base", None), ("lora", with_loras)):
            r = run(engine, samples, use_tqdm=False, loras=loras)
            runs[name].append(r)
            print(f"{name:5s} {r['output_tokens_per_second']:7.1f} output tok/s, decode-only "
                  f"step {r['decode_step_time'] * 1e3:.1f} ms (mean of {r['num_decode_steps']})")
    best = {k: max(v, key=lambda r: r["output_tokens_per_second"]) for k, v in runs.items()}
    ratio = best["lora"]["output_tokens_per_second"] / best["base"]["output_tokens_per_second"]
    base_step = min(r["decode_step_time"] for r in runs["base"])
    lora_step = min(r["decode_step_time"] for r in runs["lora"])
    print(f"with {len(args.adapters)} adapters / without: {ratio:.3f} (best of {args.rounds}); "
          f"decode-only step {base_step * 1e3:.1f} ms base + {(lora_step - base_step) * 1e3:.1f} "
          f"ms LoRA ({(lora_step - base_step) / lora_step:.0%} of the step)")


def lone(args: argparse.Namespace) -> None:
    import time

    from pagedserve import LLM, LoRARequest, SamplingParams
    from pagedserve.benchmarks import datasets

    print(cpu_line())
    llm = LLM(args.model, dtype=args.dtype, quantization=args.quantization, enable_lora=True,
              max_lora_rank=args.max_lora_rank, lora_dtype=args.lora_dtype,
              enable_prefix_caching=False)
    record = json.loads((datasets.DEFAULT_DATA_DIR / "smollm2_workload_64.jsonl")
                        .read_text().splitlines()[0])
    prompt = {"prompt_token_ids": record["prompt_token_ids"]}
    first = SamplingParams(temperature=0, max_tokens=1, ignore_eos=True)
    params = SamplingParams(temperature=0, max_tokens=args.max_tokens, ignore_eos=True)
    lora = LoRARequest("lora-0", 1, args.adapters[0])
    best = {"base": 0.0, "lora": 0.0}
    for _ in range(args.rounds):
        for name, request in (("base", None), ("lora", lora)):
            t0 = time.perf_counter()
            llm.generate(prompt, first, use_tqdm=False, lora_request=request)
            t1 = time.perf_counter()
            llm.generate(prompt, params, use_tqdm=False, lora_request=request)
            t2 = time.perf_counter()
            rate = (args.max_tokens - 1) / ((t2 - t1) - (t1 - t0))
            best[name] = max(best[name], rate)
            print(f"{name:5s} lone request: {rate:6.1f} decode tok/s")
    print(f"lone request with an adapter / without: {best['lora'] / best['base']:.3f} "
          f"(best of {args.rounds})")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    sub = parser.add_subparsers(dest="command", required=True)
    make = sub.add_parser("make-adapters")
    make.add_argument("--model", default=None)
    make.add_argument("--out", type=pathlib.Path, required=True)
    make.add_argument("--num", type=int, default=8)
    make.add_argument("--rank", type=int, default=16)
    make.add_argument("--seed", type=int, default=0)
    cmp = sub.add_parser("compare")
    cmp.add_argument("--model", default=None)
    cmp.add_argument("--adapters", nargs="+", required=True)
    cmp.add_argument("--dtype", default="auto")
    cmp.add_argument("--quantization", default=None)
    cmp.add_argument("--max-lora-rank", type=int, default=16)
    cmp.add_argument("--lora-dtype", default="auto")
    cmp.add_argument("--rounds", type=int, default=2)
    solo = sub.add_parser("lone")
    for option, default in (("--model", None), ("--dtype", "auto"), ("--quantization", None)):
        solo.add_argument(option, default=default)
    solo.add_argument("--adapters", nargs="+", required=True)
    solo.add_argument("--max-lora-rank", type=int, default=16)
    solo.add_argument("--lora-dtype", default="auto")
    solo.add_argument("--max-tokens", type=int, default=128)
    solo.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args()
    if args.command == "make-adapters":
        make_adapters(args.model, args.out, args.num, args.rank, args.seed)
    else:
        {"compare": compare, "lone": lone}[args.command](args)


if __name__ == "__main__":
    main()
