"""Token ids and throughput of the shared workload, to compare a refactor before and after.

Runs the 64 requests of ``smollm2_workload_64.jsonl`` (token ids fed as they are, greedy,
``ignore_eos``, each request's ``max_tokens``) through ``pagedserve.LLM`` in ONE
``generate`` call, as ``pagedserve bench throughput --dataset-name workload`` queues them,
and writes a JSON file: the engine kwargs, the resolved dtype, the CPU, the wall seconds
of ``generate``, output tokens/s and every request's output token ids (request order).
Only the public API is used, so the same file runs against an old checkout
(``PYTHONPATH=/path/to/old``; ``pagedserve_file`` in the JSON says which code ran).

    python benchmarks/workload_ids.py --path default --out old.json
    python benchmarks/workload_ids.py --compare old.json new.json

``--compare`` prints how many requests have identical ids (and the first difference) and
the throughput ratio B/A. An engine that fails to start is recorded (``error``, exit
status 1), so that old and new can be seen to fail alike. On a shared machine the
throughput is noisy: alternate old and new runs.
"""

from __future__ import annotations

import argparse
import json
import pathlib
import subprocess
import time

PATHS = {
    "default": {},
    "none": {"quantization": "none", "dtype": "float32"},
    "int8": {"quantization": "int8"},
    # tensor parallel: SmolLM2's 9 query / 3 KV heads split over 3 ranks, not 2 (mp
    # processes; 3 ranks share 2 cores here)
    "tp3": {"tensor_parallel_size": 3},
}
WORKLOAD = (pathlib.Path(__file__).resolve().parents[2] / "shared" / "data"
            / "smollm2_workload_64.jsonl")
FLAGS = ("avx2", "avx512f", "avx512_vnni", "avx512_bf16")


def cpu_info() -> dict:
    """``lscpu``'s model name and the flags that pick kernels and the ``auto`` dtype."""
    out = subprocess.run(["lscpu"], check=False, capture_output=True, text=True).stdout
    info = dict(line.split(":", 1) for line in out.splitlines() if ":" in line)
    flags = set(info.get("Flags", "").split())
    return {"model_name": info.get("Model name", "").strip(),
            "flags": {f: f in flags for f in FLAGS},
            "amx": sorted(f for f in flags if f.startswith("amx"))}


def run(path: str, workload: pathlib.Path) -> dict:
    import pagedserve  # before torch: it sets GOMP_SPINCOUNT, as the CLI does
    from pagedserve import LLM, SamplingParams

    with open(workload) as f:
        recs = [json.loads(line) for line in f if line.strip()]
    kwargs = PATHS[path]
    head = {"path": path, "engine_kwargs": kwargs, "pagedserve_file": pagedserve.__file__,
            "workload": str(workload), "cpu": cpu_info()}
    try:
        llm = LLM(**kwargs)
    except (ValueError, RuntimeError, OSError) as e:  # recorded: old and new may fail alike
        return {**head, "error": f"{type(e).__name__}: {e}"}
    prompts = [{"prompt_token_ids": r["prompt_token_ids"]} for r in recs]
    params = [SamplingParams(temperature=0.0, ignore_eos=True, max_tokens=r["max_tokens"])
              for r in recs]
    start = time.perf_counter()
    outs = llm.generate(prompts, params, use_tqdm=False)
    wall = time.perf_counter() - start
    ids = [list(o.outputs[0].token_ids) for o in outs]
    n_out = sum(map(len, ids))
    # The engine's resolved dtype (auto -> bfloat16 with AVX512-BF16/AMX, else float32);
    # not part of the public API, hence the fallback.
    dtype = getattr(getattr(llm, "engine", None), "dtype", None)
    return {
        **head, "resolved_dtype": None if dtype is None else str(dtype).removeprefix("torch."),
        "num_requests": len(recs),
        "prompt_tokens": sum(len(r["prompt_token_ids"]) for r in recs),
        "output_tokens": n_out, "expected_output_tokens": sum(r["max_tokens"] for r in recs),
        "wall_s": wall, "output_tokens_per_s": n_out / wall, "token_ids": ids,
    }


def compare(a_file: str, b_file: str) -> int:
    a, b = (json.loads(pathlib.Path(f).read_text()) for f in (a_file, b_file))
    if "error" in a or "error" in b:
        print(f"A error: {a.get('error')}\nB error: {b.get('error')}")
        print(f"same error: {'yes' if a.get('error') == b.get('error') else 'no'}")
        return 1
    same = sum(x == y for x, y in zip(a["token_ids"], b["token_ids"]))
    n = max(len(a["token_ids"]), len(b["token_ids"]))
    print(f"identical ids: {same}/{n} requests")
    for i, (x, y) in enumerate(zip(a["token_ids"], b["token_ids"])):
        if x != y:
            pos = next((j for j, (p, q) in enumerate(zip(x, y)) if p != q), min(len(x), len(y)))
            print(f"first difference: request {i}, position {pos} "
                  f"(A {x[pos:pos + 5]} vs B {y[pos:pos + 5]})")
            break
    ratio = b["output_tokens_per_s"] / a["output_tokens_per_s"]
    print(f"throughput B/A: {ratio:.3f} ({b['output_tokens_per_s']:.1f} / "
          f"{a['output_tokens_per_s']:.1f} output tok/s)")
    return 0 if same == n else 1


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--path", choices=list(PATHS), default="default")
    ap.add_argument("--out", help="JSON file to write")
    ap.add_argument("--workload", default=str(WORKLOAD))
    ap.add_argument("--compare", nargs=2, metavar=("A.json", "B.json"))
    args = ap.parse_args()
    if args.compare:
        return compare(*args.compare)
    if not args.out:
        ap.error("--out is required (or --compare A B)")
    result = run(args.path, pathlib.Path(args.workload))
    with open(args.out, "w") as f:
        json.dump(result, f)
    if "error" in result:
        print(f"{args.path}: engine failed: {result['error']}")
        return 1
    print(f"{args.path}: {result['output_tokens']} output tokens in {result['wall_s']:.2f} s, "
          f"{result['output_tokens_per_s']:.1f} tok/s, dtype {result['resolved_dtype']}, "
          f"pagedserve from {result['pagedserve_file']}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
