"""Alone vs batched, per path: does a request get the same answer whatever else runs?

The first 12 held-out chats (MT-Bench turn-1 questions without reference answers, as
``quant_accuracy.py`` picks them), greedy, 64 tokens, ``logprobs=1``: all 12 in one
``generate`` call, then each alone (prefix cache warm from the batch, the way a server
meets a repeated question). Prints, per path, how many of the 12 got identical token ids
and bit-identical logprobs (the sampled token's and the top one), with this CPU's flags.

    PYTHONPATH=. python benchmarks/batch_invariance.py [--paths exact default ...]

A benchmark, not a test (``tests/test_batch_invariance.py`` asserts the property).
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))
from quant_accuracy import DATA, chat_ids, load_texts

from pagedserve import LLM, SamplingParams
from pagedserve.config import cpu_flags

PATHS = {
    "exact": {"dtype": "float32", "quantization": "none"},
    "default-float32": {"dtype": "float32"},
    "default": {},
    "bfloat16-exact": {"dtype": "bfloat16", "quantization": "none"},
    "int8": {"quantization": "int8"},
    "int8-kv-bf16": {"quantization": "int8", "kv_cache_dtype": "bfloat16"},
}
PARAMS = SamplingParams(temperature=0, max_tokens=64, ignore_eos=True, logprobs=1)


def answer(output) -> tuple:
    c = output.outputs[0]
    return c.token_ids, [sorted(lp.items()) for lp in c.logprobs]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--paths", nargs="+", choices=list(PATHS), default=list(PATHS))
    parser.add_argument("--chats", type=int, default=12)
    args = parser.parse_args()
    flags = sorted(f for f in cpu_flags() if f.startswith(("avx", "amx")))
    print(f"CPU flags: {' '.join(flags)}")
    _, held_out = load_texts(DATA)
    for name in args.paths:
        llm = LLM(**PATHS[name])
        tok = llm.get_tokenizer()
        prompts = [{"prompt_token_ids": chat_ids(tok, [{"role": "user", "content": q}], True)}
                   for q in held_out[: args.chats]]
        batched = [answer(o) for o in llm.generate(prompts, PARAMS, use_tqdm=False)]
        alone = [answer(llm.generate([p], PARAMS, use_tqdm=False)[0]) for p in prompts]
        ids = sum(a[0] == b[0] for a, b in zip(alone, batched))
        bits = sum(a == b for a, b in zip(alone, batched))
        dtype = llm.engine.model_config.dtype
        print(f"{name:16s} ({dtype}): ids alone == batched {ids}/{len(prompts)}, "
              f"logprobs bit-equal {bits}/{len(prompts)}", flush=True)
        del llm


if __name__ == "__main__":
    main()
