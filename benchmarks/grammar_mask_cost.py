"""What structured outputs add to one engine step, measured alone: filling the grammar
bitmask of 64 constrained rows (one xgrammar matcher each) and applying it to [64, 49152]
float32 logits (SmolLM2's vocabulary) with our CPU kernel and with xgrammar's, in two
states of the bench's JSON schema: inside a string (almost every token allowed) and right
after ``{`` (only the key's opening quote allowed).

Compare with the decode-step time of 64 sequences from ``pagedserve bench throughput``
(the same machine, the same minute): on a shared machine a ratio of two throughput runs
is mostly noise, while this cost is small and direct.

    .venv/bin/python benchmarks/grammar_mask_cost.py
"""

from __future__ import annotations

import time

import torch
import xgrammar as xgr

from pagedserve.benchmarks.throughput import BENCH_SCHEMA
from pagedserve.model_loader.files import resolve_model_path
from pagedserve.request import Request
from pagedserve.sampling_params import SamplingParams, StructuredOutputsParams
from pagedserve.structured_output import StructuredOutputManager, apply_grammar_bitmask
from pagedserve.tokenizer import load_tokenizer

ROWS, VOCAB, REPEATS = 64, 49152, 30


def _ms(fn, setup=lambda: None) -> float:
    """Mean milliseconds of ``fn(a)``, each ``a`` made beforehand by ``setup()``."""
    args = [setup() for _ in range(REPEATS)]
    t0 = time.perf_counter()
    for a in args:
        fn(a)
    return (time.perf_counter() - t0) / REPEATS * 1e3


def main() -> None:
    tok = load_tokenizer(resolve_model_path(None))
    manager = StructuredOutputManager(tok, VOCAB, [tok.eos_token_id])
    params = SamplingParams(structured_outputs=StructuredOutputsParams(json=BENCH_SCHEMA))
    logits = torch.randn(ROWS, VOCAB)
    print(f"per step, {ROWS} constrained rows, vocabulary {VOCAB}, "
          f"{torch.get_num_threads()} torch threads:")
    for state, text in (("after '{'", "{"), ("inside the string", '{"answer": "The')):
        requests = [Request(str(i), [1], params, tok.eos_token_id, grammar=g)
                    for i, g in enumerate(manager.request_grammars(params, ROWS))]
        for r in requests:
            for t in tok.encode(text, add_special_tokens=False):
                r.append_output_token(t)
                r.grammar.accept(t, r.num_output_tokens)
        mask = manager.grammar_bitmask(requests)
        allowed = sum((w & 0xFFFFFFFF).bit_count() for w in mask.bitmask[0].tolist())
        # (the lambdas run inside _ms, in this iteration: defaults bind its values anyway)
        fill = _ms(lambda _, rs=requests: manager.grammar_bitmask(rs))
        ours = _ms(lambda x, m=mask: apply_grammar_bitmask(x, m), logits.clone)
        theirs = _ms(lambda x, m=mask: xgr.apply_token_bitmask_inplace(x, m.bitmask),
                     logits.clone)
        print(f"  {state} ({allowed} tokens allowed): fill {fill:.2f} ms; apply: ours "
              f"{ours:.2f} ms, xgrammar's {theirs:.2f} ms")
    print(f"  the sampler's copy of the logits (made whenever a row is processed): "
          f"{_ms(lambda _: logits.clone()):.2f} ms")


if __name__ == "__main__":
    main()
