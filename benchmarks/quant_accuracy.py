"""Accuracy of the inexact paths against exact float32 on held-out text: the default GGUF
kernels (4-bit weights, 8-bit activations), ``--quantization int8`` (W8A8) and
``--quantization mxfp4|nvfp4`` (FP4 weights, 8-bit activations).

For each variant (float32 with dequantized weights, the GGUF kernels, int8 with and
without the LM head in int8, optionally bfloat16, and optionally float32 and int8 over a
bfloat16 KV cache, ``--kv-cache-dtype bfloat16``; with ``--fp4``: mxfp4 and nvfp4 through
the kernel, and three weight-only requantizations computed in float32: every Linear's
weight quantized and dequantized again as MXFP4, NVFP4, and ggml's round-to-nearest Q4_0)
it prints:

- perplexity of the bundled model on MT-Bench's GPT-4 reference answers (30 questions, turn
  1, chat-formatted with the tokenizer's template; only the answer tokens are scored), from
  the engine's ``prompt_logprobs``;
- the largest |logprob difference| from float32 over those answer tokens;
- with ``--fp4``, first: each requantization's weight error per kind of Linear,
  ||W - deq(q(W))|| / ||W|| (Frobenius), mean and max over the model's layers;
- greedy agreement with float32 on held-out chat prompts (MT-Bench turn-1 questions without
  reference answers, ids 81-100 and 131-160): the fraction of prompts whose first k
  generated tokens all equal float32's, for k = 1, 8, 32, and the mean common prefix length.

    PYTHONPATH=. python benchmarks/quant_accuracy.py [--model PATH] [--bf16] [--kv-bf16]
        [--fp4] [--chats 50]

A benchmark, not a test: it prints figures (``benchmarks/README.md`` records them).
"""

from __future__ import annotations

import argparse
import gc
import json
import math
from pathlib import Path

import torch
from gguf import GGMLQuantizationType
from gguf.quants import dequantize, quantize
from torch import nn

from pagedserve import LLM, SamplingParams
from pagedserve.quantization.base import Linear
from pagedserve.quantization.fp4_formats import (
    dequantize_mxfp4,
    dequantize_nvfp4,
    quantize_mxfp4,
    quantize_nvfp4,
)
from pagedserve.quantization.none import FloatWeight, pack_weight

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
    """The chat's token ids in the model's chat format; a base model without one (Gemma 3
    270M) gets the turns as plain text, a blank line after each."""
    if tokenizer.chat_template is None:
        text = "".join(m["content"] + "\n\n" for m in messages)
        return tokenizer.encode(text if add_generation_prompt or not messages else text[:-2])
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


def q4_0_round_trip(w: torch.Tensor) -> torch.Tensor:
    """ggml's Q4_0 (round to nearest, d = the signed max / -8) and back, by gguf-py."""
    q4_0 = GGMLQuantizationType.Q4_0
    return torch.from_numpy(dequantize(quantize(w.numpy(), q4_0), q4_0).copy())


# Weight-only requantizations: float32 weight [N, K] -> its quantized form dequantized.
REQUANTIZED = {
    "mxfp4-weights": lambda w: dequantize_mxfp4(quantize_mxfp4(w)),
    "nvfp4-weights": lambda w: dequantize_nvfp4(*quantize_nvfp4(w)),
    "q4_0-weights": q4_0_round_trip,
}


def requantize(llm: LLM, round_trip) -> None:
    """Every Linear's weight replaced by ``round_trip(weight)``, its packed copy too (in
    place: the fused decode step holds them); the tied LM head gets a weight of its own
    (the embedding stays as it was)."""
    model = llm.engine.executor.driver_worker.model
    for layer in model.modules():
        if not isinstance(layer, Linear):
            continue
        new = round_trip(layer.weight.detach().float()).to(layer.weight.dtype)
        if layer is model.lm_head:
            layer.weight = nn.Parameter(new, requires_grad=False)
            layer.method = FloatWeight(pack_weight(new))
            continue
        layer.weight.data.copy_(new)
        if layer.method.packed is not None:
            layer.method.packed.copy_(pack_weight(new))


def weight_errors(llm: LLM) -> None:
    """Print each requantization's relative weight error per kind of Linear."""
    model = llm.engine.executor.driver_worker.model
    kinds: dict[str, list[torch.Tensor]] = {}
    for name, layer in model.named_modules():
        if isinstance(layer, Linear):
            kinds.setdefault(name.split(".")[-1], []).append(layer.weight.detach().float())
    print(f"{'weight error':16s} " + " ".join(f"{k:>17s}" for k in kinds))
    for variant, round_trip in REQUANTIZED.items():
        cells = []
        for weights in kinds.values():
            errs = [float((round_trip(w) - w).norm() / w.norm()) for w in weights]
            cells.append(f"{sum(errs) / len(errs):8.4f}/{max(errs):8.4f}")
        print(f"{variant:16s} " + " ".join(cells))
    print("(each cell: mean / max over the layers of ||W - deq(q(W))|| / ||W||)")


def make_llm(model: str | None, variant: str) -> LLM:
    """One engine per variant: "float32" (dequantized weights, no GGUF kernels), "gguf"
    (the default), "int8", "int8-fp32-head" (the tied LM head left in float32), "mxfp4",
    "nvfp4", "bfloat16", one of ``REQUANTIZED``; a "+kv-bf16" suffix: over a bfloat16 KV
    cache."""
    variant, _, kv = variant.partition("+")
    dtype = "bfloat16" if variant == "bfloat16" else "float32"
    quant = ("int8" if variant.startswith("int8") else variant
             if variant in ("gguf", "mxfp4", "nvfp4") else "none")
    llm = LLM(model, dtype=dtype, quantization=quant, max_model_len=2048,
              kv_cache_dtype="bfloat16" if kv == "kv-bf16" else "auto")
    if variant in REQUANTIZED:
        requantize(llm, REQUANTIZED[variant])
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
    parser.add_argument("--fp4", action="store_true",
                        help="also measure mxfp4, nvfp4 and the weight-only requantizations")
    parser.add_argument("--variants", nargs="+", default=None,
                        help="only these variants (float32 first: it is the reference)")
    args = parser.parse_args()
    pairs, held_out = load_texts(args.data)
    chats = held_out[: args.chats]
    variants = args.variants or (
        ["float32", "gguf", "int8", "int8-fp32-head"] + (["bfloat16"] if args.bf16 else [])
        + (["float32+kv-bf16", "int8+kv-bf16"] if args.kv_bf16 else [])
        + (["mxfp4", "nvfp4", *REQUANTIZED] if args.fp4 else []))
    base_lps = base_tokens = None
    print(f"{'variant':16s} {'ppl':>8s} {'vs fp32':>8s} {'max|dlp|':>9s} "
          f"{'agree@1':>8s} {'agree@8':>8s} {'agree@32':>9s} {'mean prefix':>12s}")
    for variant in variants:
        llm = make_llm(args.model, variant)
        if variant == "float32" and args.fp4:
            weight_errors(llm)
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
