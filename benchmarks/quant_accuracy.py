"""Accuracy of the inexact paths against exact float32 on held-out text: the default GGUF
kernels (4-bit weights, 8-bit activations) and ``--quantization int8`` (W8A8).

For each variant (float32 with dequantized weights, the GGUF kernels, int8 with and
without the LM head in int8, optionally bfloat16, and optionally float32 and int8 over a
bfloat16 KV cache, ``--kv-cache-dtype bfloat16``) it prints:

- perplexity of the bundled model on MT-Bench's GPT-4 reference answers (30 questions, turn
  1, chat-formatted with the tokenizer's template; only the answer tokens are scored), from
  the engine's ``prompt_logprobs``;
- the largest |logprob difference| from float32 over those answer tokens;
- greedy agreement with float32 on held-out chat prompts (MT-Bench turn-1 questions without
  reference answers, ids 81-100 and 131-160): the fraction of prompts whose first k
  generated tokens all equal float32's, for k = 1, 8, 32, and the mean common prefix length.

    PYTHONPATH=. python benchmarks/quant_accuracy.py [--model PATH] [--bf16] [--kv-bf16]
        [--chats 50]

A benchmark, not a test: it prints figures (``benchmarks/README.md`` records them).
"""

from __future__ import annotations

import argparse
import gc
import json
import math
from pathlib import Path

from pagedserve import LLM, SamplingParams
from pagedserve.quantization.none import FloatWeight

DATA = Path(__file__).resolve().parents[2] / "shared" / "data"
REFERENCES = "mt_bench_reference_answer_gpt-4.jsonl"
QUESTIONS = "mt_bench_question.jsonl"
GREEDY_TOKENS = 32


def load_texts(data: Path) -> tuple[list[tuple[str, str]], list[str]]:
    """(question, reference answer) pairs, and the questions that have no reference."""
    questions = {q["question_id"]: q["turns"][0]
                 for q in map(json.loads, (data / QUESTIONS).read_text().splitlines())}
    answers = {a["question_id"]: a["choices"][0]["turns"][0]
               for a in map(json.loads, (data / REFERENCES).read_text().splitlines())}
    pairs = [(questions[i], answers[i]) for i in sorted(answers)]
    held_out = [questions[i] for i in sorted(questions) if i not in answers]
    return pairs, held_out


def chat_ids(tokenizer, messages: list[dict], add_generation_prompt: bool) -> list[int]:
    return list(tokenizer.apply_chat_template(
        messages, add_generation_prompt=add_generation_prompt, tokenize=True, return_dict=False))


def scored_prompts(tokenizer, pairs: list[tuple[str, str]]) -> list[tuple[list[int], int]]:
    """Token ids of each chat (user question, assistant answer) and where the answer starts."""
    out = []
    for question, answer in pairs:
        user = [{"role": "user", "content": question}]
        start = len(chat_ids(tokenizer, user, True))
        ids = chat_ids(tokenizer, user + [{"role": "assistant", "content": answer}], False)
        out.append((ids, start))
    return out


def answer_logprobs(llm: LLM, prompts: list[tuple[list[int], int]]) -> list[float]:
    """Natural-log probabilities of every answer token, in order."""
    params = SamplingParams(max_tokens=1, prompt_logprobs=0, temperature=0)
    outs = llm.generate([{"prompt_token_ids": ids} for ids, _ in prompts], params,
                        use_tqdm=False)
    lps = []
    for out, (ids, start) in zip(outs, prompts):
        lps += [out.prompt_logprobs[i][ids[i]].logprob for i in range(start, len(ids))]
    return lps


def greedy(llm: LLM, chats: list[str]) -> list[list[int]]:
    tok = llm.get_tokenizer()
    prompts = [{"prompt_token_ids": chat_ids(tok, [{"role": "user", "content": c}], True)}
               for c in chats]
    params = SamplingParams(max_tokens=GREEDY_TOKENS, temperature=0, ignore_eos=True)
    return [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)]


def common_prefix(a: list[int], b: list[int]) -> int:
    return next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))


def make_llm(model: str | None, variant: str) -> LLM:
    """One engine per variant: "float32" (dequantized weights, no GGUF kernels), "gguf"
    (the default), "int8", "int8-fp32-head" (the tied LM head left in float32), "bfloat16";
    a "+kv-bf16" suffix: over a bfloat16 KV cache."""
    variant, _, kv = variant.partition("+")
    dtype = "bfloat16" if variant == "bfloat16" else "float32"
    quant = "int8" if variant.startswith("int8") else "gguf" if variant == "gguf" else "none"
    llm = LLM(model, dtype=dtype, quantization=quant, max_model_len=2048,
              kv_cache_dtype="bfloat16" if kv == "kv-bf16" else "auto")
    if variant == "int8-fp32-head":
        model = llm.engine.executor.driver_worker.model
        model.tie_lm_head()  # back to the float32 embedding
        model.lm_head.method = FloatWeight()
    return llm


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default=None, help="model path (default: the bundled one)")
    parser.add_argument("--data", type=Path, default=DATA, help="folder of the MT-Bench files")
    parser.add_argument("--chats", type=int, default=50, help="held-out chat prompts (<= 50)")
    parser.add_argument("--bf16", action="store_true", help="also measure bfloat16")
    parser.add_argument("--kv-bf16", action="store_true",
                        help="also measure float32 and int8 over a bfloat16 KV cache")
    parser.add_argument("--variants", nargs="+", default=None,
                        help="only these variants (float32 first: it is the reference)")
    args = parser.parse_args()
    pairs, held_out = load_texts(args.data)
    chats = held_out[: args.chats]
    variants = args.variants or (
        ["float32", "gguf", "int8", "int8-fp32-head"] + (["bfloat16"] if args.bf16 else [])
        + (["float32+kv-bf16", "int8+kv-bf16"] if args.kv_bf16 else []))
    base_lps = base_tokens = None
    print(f"{'variant':16s} {'ppl':>8s} {'vs fp32':>8s} {'max|dlp|':>9s} "
          f"{'agree@1':>8s} {'agree@8':>8s} {'agree@32':>9s} {'mean prefix':>12s}")
    for variant in variants:
        llm = make_llm(args.model, variant)
        prompts = scored_prompts(llm.get_tokenizer(), pairs)
        lps = answer_logprobs(llm, prompts)
        tokens = greedy(llm, chats)
        del llm
        gc.collect()
        if base_lps is None:
            base_lps, base_tokens = lps, tokens
        ppl, base_ppl = (math.exp(-sum(v) / len(v)) for v in (lps, base_lps))
        max_diff = max(abs(a - b) for a, b in zip(lps, base_lps))
        prefixes = [common_prefix(a, b) for a, b in zip(tokens, base_tokens)]
        agree = [sum(p >= k for p in prefixes) / len(prefixes) for k in (1, 8, GREEDY_TOKENS)]
        print(f"{variant:16s} {ppl:8.4f} {ppl / base_ppl - 1:+8.2%} {max_diff:9.4f} "
              f"{agree[0]:8.2f} {agree[1]:8.2f} {agree[2]:9.2f} "
              f"{sum(prefixes) / len(prefixes):12.1f}", flush=True)
    print(f"{len(base_lps)} answer tokens scored from {len(pairs)} reference answers; "
          f"{len(chats)} held-out chats, {GREEDY_TOKENS} greedy tokens each")


if __name__ == "__main__":
    main()
