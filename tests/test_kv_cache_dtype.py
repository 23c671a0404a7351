"""``--kv-cache-dtype bfloat16`` under a float32 model: the cache stores K/V rounded to
bfloat16 and attention reads them widened to float32, so the reference is transformers in
float32 with a KV cache that rounds what it stores the same way."""

from __future__ import annotations

import pytest
import torch

from pagedserve import LLM, SamplingParams
from pagedserve.args import EngineArgs
from pagedserve.config import resolve_kv_cache_dtype

MAX_TOKENS = 24


def test_resolve_kv_cache_dtype():
    assert resolve_kv_cache_dtype("auto", torch.float32) is torch.float32
    assert resolve_kv_cache_dtype("auto", torch.bfloat16) is torch.bfloat16
    assert resolve_kv_cache_dtype("bfloat16", torch.float32) is torch.bfloat16
    with pytest.raises(ValueError, match="kv_cache_dtype must be one of auto, bfloat16; "
                                         "got 'fp8'"):
        resolve_kv_cache_dtype("fp8", torch.float32)


def test_cli_flag():
    import argparse

    parser = EngineArgs.add_cli_args(argparse.ArgumentParser())
    assert parser.parse_args(["--kv-cache-dtype", "bfloat16"]).kv_cache_dtype == "bfloat16"
    assert parser.parse_args([]).kv_cache_dtype == "auto"


@pytest.fixture(scope="module")
def bf16_kv_llm():
    return LLM(dtype="float32", quantization="none", kv_cache_dtype="bfloat16",
               kv_cache_memory_bytes=256 << 20)


def rounding_cache():
    """transformers' DynamicCache storing K/V rounded to bfloat16 (and back to float32)."""
    from transformers import DynamicCache

    class BFloat16RoundingCache(DynamicCache):
        def update(self, key_states, value_states, layer_idx, *args, **kwargs):
            return super().update(key_states.to(torch.bfloat16).float(),
                                  value_states.to(torch.bfloat16).float(),
                                  layer_idx, *args, **kwargs)

    return BFloat16RoundingCache()


def test_cache_is_bfloat16_and_holds_twice_the_blocks(bf16_kv_llm, llm):
    engine = bf16_kv_llm.engine
    assert {c.dtype for c in engine.executor.driver_worker.model_runner.kv_caches} == {torch.bfloat16}
    # half the float32 engine's bytes per block: twice the blocks in the same budget
    per_block = engine.executor.driver_worker.memory_profile.bytes_per_block
    assert per_block * 2 == llm.engine.executor.driver_worker.memory_profile.bytes_per_block
    assert engine.num_blocks == (256 << 20) // per_block
    assert engine.cache_config_info()["cache_dtype"] == "bfloat16"


def teacher_forced(hf_model, ids: list[int], cache) -> torch.Tensor:
    """transformers' float32 log-probabilities ``[len(ids), vocab]`` over ``ids``."""
    with torch.no_grad():
        logits = hf_model(input_ids=torch.tensor([ids]), cache=cache, use_cache=True).logits
    return torch.log_softmax(logits[0].float(), -1)


def test_greedy_stays_within_rounding_of_transformers(bf16_kv_llm, hf_model, chat_prompts):
    """All prompts decoding together (the C++ decode layers), scored by transformers with
    the same rounding. Not to the token: K/V computed by two GEMMs differ by ~1e-6, enough
    to round some elements to neighbouring bfloat16 values, which moved logprobs by up to
    0.017 here (float32 without rounding: 1e-4). So each logprob must agree within 0.05,
    and each token be the reference's argmax or within 0.05 of it (a near-tie)."""
    params = SamplingParams(temperature=0, max_tokens=MAX_TOKENS, logprobs=0, ignore_eos=True)
    outs = bf16_kv_llm.generate([{"prompt_token_ids": p} for p in chat_prompts], params,
                                use_tqdm=False)
    for out, prompt in zip(outs, chat_prompts):
        tokens = out.outputs[0].token_ids
        ref = teacher_forced(hf_model, prompt + list(tokens), rounding_cache())
        ref = ref[len(prompt) - 1 : -1]  # the distributions each token was drawn from
        ours = torch.tensor([lp[t].logprob for lp, t in zip(out.outputs[0].logprobs, tokens)])
        chosen = ref[torch.arange(len(tokens)), torch.tensor(tokens)]
        torch.testing.assert_close(ours, chosen, atol=0.05, rtol=0)
        assert float((ref.max(-1).values - chosen).max()) < 0.05


def test_prompt_logprobs_stay_within_rounding_of_transformers(bf16_kv_llm, hf_model,
                                                              chat_prompts):
    """A prefill attends over the rounded K/V of its own tokens, as the rounding cache.
    Within 0.05 plus 0.5% of the logprob: an unlikely token's logit is large, and a K/V
    element rounded to the neighbouring bfloat16 moves it more (a token at -15.36 was off
    by 0.040 with one order of attention's float32 sums and 0.075 with another, the
    likelier tokens of the prompt by at most 0.035 with both)."""
    prompt = chat_prompts[7]
    out = bf16_kv_llm.generate([{"prompt_token_ids": prompt}],
                               SamplingParams(max_tokens=1, prompt_logprobs=0),
                               use_tqdm=False)[0]
    ref = teacher_forced(hf_model, prompt, rounding_cache())
    ref = ref[torch.arange(len(prompt) - 1), torch.tensor(prompt[1:])]
    ours = torch.tensor([out.prompt_logprobs[i][prompt[i]].logprob
                         for i in range(1, len(prompt))])
    torch.testing.assert_close(ours, ref, atol=0.05, rtol=0.005)
