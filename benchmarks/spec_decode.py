"""Speculative decoding, measured: spec on vs off in one run, same prompts, greedy.

    python benchmarks/spec_decode.py lone --method ngram --dataset copy-edit
    python benchmarks/spec_decode.py lone --method ngram --dataset mt-bench --num-prompts 20
    python benchmarks/spec_decode.py sweep --method self --batch-sizes 1 2 4 8 16 32

``lone``: each prompt alone (one request at a time), ``--max-tokens`` greedy tokens; per
request the decode rate = (output tokens - 1) / (finish - first token), and the mean of
those rates and the total output tokens / total decode seconds are printed for the engine
without and with speculation, plus the acceptance rate and whether every output is token
for token the same. ``sweep``: the first B requests of the shared workload together
(``max_tokens`` = min(their own, ``--max-tokens``)), output tokens/s without and with
speculation for each batch size B: the batch size from which speculation loses is the one
``disable_by_batch_size`` should take. Runs alternate off / on per point; the machine's
CPU model and flags are printed first.

Without speculation the engine is the path the drafts are checked by: for ``self`` that is
the exact path (``--quantization none``), for the others ``--quantization`` as given.
"""

from __future__ import annotations

import argparse
import json
import os
import pathlib
import subprocess
import time

import pagedserve  # noqa: F401  (before torch: it sets GOMP_SPINCOUNT, as the CLI does)
from pagedserve import LLM, SamplingParams
from pagedserve.benchmarks import datasets
from pagedserve.benchmarks.spec_stats import spec_decode_report

WORKLOAD = datasets.DEFAULT_DATA_DIR / "smollm2_workload_64.jsonl"


def cpu_line() -> str:
    out = subprocess.run(["lscpu"], check=False, capture_output=True, text=True).stdout
    info = dict(line.split(":", 1) for line in out.splitlines() if ":" in line)
    flags = [f for f in info.get("Flags", "").split()
             if f in ("avx2", "avx512f", "avx512_vnni", "avx512_bf16", "amx_bf16")]
    return (f"{info.get('Model name', '').strip()}, family {info.get('CPU family', '?').strip()} "
            f"model {info.get('Model', '?').strip()}; {os.cpu_count()} cores; "
            f"flags {' '.join(flags)}")


def engines(args) -> tuple[dict, dict]:
    """Engine kwargs without and with speculation."""
    base = {"dtype": args.dtype}
    if args.quantization:
        base["quantization"] = args.quantization
    spec = {"method": args.method, "num_speculative_tokens": args.k}
    if args.method == "draft_model":
        spec["model"] = args.draft_model
    if args.method == "ngram":
        spec.update(prompt_lookup_min=args.prompt_lookup_min,
                    prompt_lookup_max=args.prompt_lookup_max)
    off = dict(base, quantization="none") if args.method == "self" else base
    return off, dict(base, speculative_config=spec)


def prompts(args, tokenizer) -> list[list[int]]:
    if args.dataset == "copy-edit":
        samples = datasets.copy_edit_samples(datasets.COPY_EDIT_FILE, tokenizer, args.max_tokens)
    elif args.dataset == "mt-bench":
        d = datasets.DEFAULT_DATA_DIR
        samples = datasets.mt_bench_samples(d / "mt_bench_question.jsonl",
                                            d / "mt_bench_model_answer_gpt-4o.jsonl", tokenizer)
    else:
        raise ValueError(f"dataset must be copy-edit or mt-bench; got {args.dataset!r}")
    return [s.prompt_token_ids for s in samples[: args.num_prompts]]


def run_lone(llm: LLM, ids: list[list[int]], max_tokens: int) -> dict:
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens)
    llm.generate([{"prompt_token_ids": ids[0]}], params, use_tqdm=False)  # warm up
    start_stats = llm.engine.spec_decoding_stats()
    rates, tokens, seconds, outputs = [], 0, 0.0, []
    for prompt in ids:
        out = llm.generate([{"prompt_token_ids": prompt}], params, use_tqdm=False)[0]
        m, n = out.metrics, len(out.outputs[0].token_ids)
        outputs.append(list(out.outputs[0].token_ids))
        if n > 1:
            decode = m.finished_time - m.first_token_time
            rates.append((n - 1) / decode)
            tokens += n - 1
            seconds += decode
    return {"mean_decode_tok_s": sum(rates) / len(rates), "decode_tok_s": tokens / seconds,
            "outputs": outputs,
            "spec": spec_decode_report(start_stats, llm.engine.spec_decoding_stats())}


def lone(args) -> None:
    off_kw, on_kw = engines(args)
    results = {}
    for name, kw in (("off", off_kw), ("on", on_kw)):
        llm = LLM(**kw)
        ids = prompts(args, llm.get_tokenizer())
        results[name] = run_lone(llm, ids, args.max_tokens)
        del llm
    off, on = results["off"], results["on"]
    same = sum(a == b for a, b in zip(off["outputs"], on["outputs"]))
    spec = on["spec"]
    print(f"{args.dataset}, {len(off['outputs'])} prompts alone, {args.max_tokens} tokens max, "
          f"{args.method} k={args.k}")
    for name, r in results.items():
        print(f"  spec {name:3s}: decode {r['decode_tok_s']:.1f} tok/s "
              f"(mean of requests {r['mean_decode_tok_s']:.1f})")
    print(f"  speed-up {on['decode_tok_s'] / off['decode_tok_s']:.2f}x; identical outputs "
          f"{same}/{len(off['outputs'])}; acceptance rate {spec['acceptance_rate']:.3f}, mean "
          f"acceptance length {spec['mean_acceptance_length']:.2f}")
    if args.output_json:
        pathlib.Path(args.output_json).write_text(json.dumps(
            {"args": vars(args), "cpu": cpu_line(), **{k: {kk: vv for kk, vv in v.items()
             if kk != "outputs"} for k, v in results.items()}, "identical": same}, indent=2))


def sweep(args) -> None:
    off_kw, on_kw = engines(args)
    with open(WORKLOAD) as f:
        recs = [json.loads(line) for line in f if line.strip()]
    llms = {"off": LLM(**off_kw), "on": LLM(**on_kw)}
    print(f"workload prefix, {args.method} k={args.k}, max_tokens <= {args.max_tokens}")
    print("batch  off tok/s  on tok/s  on/off  acceptance")
    for b in args.batch_sizes:
        batch = [{"prompt_token_ids": r["prompt_token_ids"]} for r in recs[:b]]
        params = [SamplingParams(temperature=0.0, ignore_eos=True,
                                 max_tokens=min(r["max_tokens"], args.max_tokens)) for r in recs[:b]]
        rate, acc = {}, None
        for name, llm in llms.items():
            llm.generate(batch[:1], params[:1], use_tqdm=False)  # warm
            start_stats = llm.engine.spec_decoding_stats()
            t0 = time.perf_counter()
            outs = llm.generate(batch, params, use_tqdm=False)
            rate[name] = sum(len(o.outputs[0].token_ids) for o in outs) / (time.perf_counter() - t0)
            if name == "on":
                acc = spec_decode_report(start_stats, llm.engine.spec_decoding_stats())
        ratio = rate["on"] / rate["off"]
        print(f"{b:5d}  {rate['off']:9.1f}  {rate['on']:8.1f}  {ratio:6.2f}  "
              f"{acc['acceptance_rate'] if acc and acc['acceptance_rate'] is not None else float('nan'):.3f}",
              flush=True)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("mode", choices=["lone", "sweep"])
    p.add_argument("--method", default="ngram", choices=["ngram", "self", "draft_model"])
    p.add_argument("--k", type=int, default=4, help="num_speculative_tokens")
    p.add_argument("--draft-model", default=None, help="draft_model: its path")
    p.add_argument("--prompt-lookup-min", type=int, default=None, help="ngram (default 5)")
    p.add_argument("--prompt-lookup-max", type=int, default=None, help="ngram (default 5)")
    p.add_argument("--dtype", default="float32")
    p.add_argument("--quantization", default=None, help="the target's (not with self)")
    p.add_argument("--dataset", default="copy-edit", choices=["copy-edit", "mt-bench"])
    p.add_argument("--num-prompts", type=int, default=None)
    p.add_argument("--max-tokens", type=int, default=192)
    p.add_argument("--batch-sizes", type=int, nargs="+", default=[1, 2, 4, 8, 16, 32])
    p.add_argument("--output-json", default=None)
    args = p.parse_args()
    print(cpu_line())
    (lone if args.mode == "lone" else sweep)(args)


if __name__ == "__main__":
    main()
