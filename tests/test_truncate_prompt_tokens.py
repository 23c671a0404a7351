"""``SamplingParams.truncate_prompt_tokens`` offline (vLLM's semantics: keep the last k
prompt tokens; -1 means max_model_len; k > max_model_len is a ValueError naming the field)."""

from __future__ import annotations

import pytest

from pagedserve import SamplingParams

# 120 token ids of ordinary words (any ids would do; these keep the text readable).
WORDS = " ".join(f"word{i}" for i in range(200))


@pytest.fixture(scope="module")
def long_ids(llm):
    ids = llm.get_tokenizer().encode(WORDS)[:120]
    assert len(ids) == 120
    return ids


def test_keeps_the_last_k_tokens(llm, long_ids):
    greedy = SamplingParams(temperature=0, max_tokens=8)
    cut = llm.generate({"prompt_token_ids": long_ids},
                       SamplingParams(temperature=0, max_tokens=8, truncate_prompt_tokens=16),
                       use_tqdm=False)[0]
    direct = llm.generate({"prompt_token_ids": long_ids[-16:]}, greedy, use_tqdm=False)[0]
    assert cut.prompt_token_ids == long_ids[-16:]
    assert cut.outputs[0].token_ids == direct.outputs[0].token_ids
    assert cut.outputs[0].text == direct.outputs[0].text


def test_text_prompt_and_short_prompt(llm, long_ids):
    tok = llm.get_tokenizer()
    text = tok.decode(long_ids)
    params = SamplingParams(temperature=0, max_tokens=2, truncate_prompt_tokens=16)
    out = llm.generate(text, params, use_tqdm=False)[0]
    assert out.prompt_token_ids == tok.encode(text)[-16:]
    assert out.prompt is None  # the text no longer matches the ids kept
    short = llm.generate("Hello there", params, use_tqdm=False)[0]
    assert short.prompt == "Hello there" and short.prompt_token_ids == tok.encode("Hello there")


def test_minus_one_and_too_large(llm, long_ids):
    max_len = llm.engine.max_model_len
    # -1 keeps max_model_len tokens: a short prompt is untouched; a longer one is cut to
    # exactly max_model_len, which leaves no room to generate (as in vLLM).
    out = llm.generate({"prompt_token_ids": long_ids},
                       SamplingParams(temperature=0, max_tokens=1, truncate_prompt_tokens=-1),
                       use_tqdm=False)[0]
    assert out.prompt_token_ids == long_ids
    ids = (long_ids * (max_len // len(long_ids) + 2))[: max_len + 10]
    with pytest.raises(ValueError, match=f"the prompt has {max_len} tokens"):
        llm.generate({"prompt_token_ids": ids},
                     SamplingParams(max_tokens=1, truncate_prompt_tokens=-1), use_tqdm=False)
    with pytest.raises(ValueError, match=r"^truncate_prompt_tokens must be <= max_model_len"):
        llm.generate("Hi", SamplingParams(truncate_prompt_tokens=max_len + 1), use_tqdm=False)
    stats = llm.kv_cache_stats()
    assert stats.used_blocks == 0  # nothing was left queued by the rejected requests
