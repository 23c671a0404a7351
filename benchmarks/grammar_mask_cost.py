"""What structured outputs add to one engine step, measured alone: filling the grammar
bitmask of 64 constrained rows (one xgrammar matcher each, inside a JSON string) and
applying it to [64, 49152] float32 logits (SmolLM2's vocabulary), on one thread.

Compare with the decode-step time of 64 sequences from ``pagedserve bench throughput``
(the same machine, the same minute): on a shared machine a ratio of two throughput runs
is mostly noise, while this cost is small and direct.

    .venv/bin/python benchmarks/grammar_mask_cost.py
"""

from __future__ import annotations

import time

import torch

from pagedserve.benchmarks.throughput import BENCH_SCHEMA
from pagedserve.models.loader import resolve_model_path
from pagedserve.request import Request
from pagedserve.sampling_params import SamplingParams, StructuredOutputsParams
from pagedserve.structured_output import StructuredOutputManager, apply_grammar_bitmask
from pagedserve.tokenizer import load_tokenizer

ROWS, VOCAB, REPEATS = 64, 49152, 30


def main() -> None:
    torch.set_num_threads(1)
    tok = load_tokenizer(resolve_model_path(None))
    manager = StructuredOutputManager(tok, VOCAB, [tok.eos_token_id])
    params = SamplingParams(structured_outputs=StructuredOutputsParams(json=BENCH_SCHEMA))
    requests = [Request(str(i), [1], params, tok.eos_token_id, grammar=g)
                for i, g in enumerate(manager.request_grammars(params, ROWS))]
    for r in requests:  # inside the string: the widest masks of this schema
        for t in tok.encode('{"answer": "The', add_special_tokens=False):
            r.append_output_token(t)
            r.grammar.accept(t, r.num_output_tokens)
    logits = torch.randn(ROWS, VOCAB)
    apply_grammar_bitmask(logits.clone(), manager.grammar_bitmask(requests))  # warm-up
    t0 = time.perf_counter()
    for _ in range(REPEATS):
        mask = manager.grammar_bitmask(requests)
    t1 = time.perf_counter()
    for _ in range(REPEATS):
        logits.clone()
    t2 = time.perf_counter()
    for _ in range(REPEATS):
        apply_grammar_bitmask(logits.clone(), mask)
    t3 = time.perf_counter()
    clone = (t2 - t1) / REPEATS
    print(f"fill {ROWS} rows: {(t1 - t0) / REPEATS * 1e3:.2f} ms; apply to [{ROWS}, {VOCAB}]: "
          f"{((t3 - t2) / REPEATS - clone) * 1e3:.2f} ms; the sampler's copy of the logits "
          f"(made whenever a row is processed): {clone * 1e3:.2f} ms")


if __name__ == "__main__":
    main()
