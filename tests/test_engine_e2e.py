"""End-to-end: the engine on the bundled SmolLM2 model against Hugging Face transformers."""

from __future__ import annotations

import pytest
from conftest import hf_greedy

from pagedserve import LLM, SamplingParams

MAX_TOKENS = 32


@pytest.fixture(scope="module")
def reference(hf_model, chat_prompts, llm):
    eos = llm.get_tokenizer().eos_token_id
    return [hf_greedy(hf_model, p, MAX_TOKENS, eos) for p in chat_prompts]


def _token_prompts(prompts):
    return [{"prompt_token_ids": p} for p in prompts]


def test_greedy_batch_matches_transformers(llm, chat_prompts, reference):
    params = SamplingParams(temperature=0, max_tokens=MAX_TOKENS)
    outputs = llm.generate(_token_prompts(chat_prompts), params, use_tqdm=False)
    for out, ref in zip(outputs, reference):
        assert out.outputs[0].token_ids == ref
        assert out.outputs[0].finish_reason == ("stop" if len(ref) < MAX_TOKENS else "length")
    assert {len(r) for r in reference} != {MAX_TOKENS}, "some prompt should stop at eos"
    stats = llm.kv_cache_stats()
    assert stats.used_blocks == 0 and stats.free_blocks == stats.total_blocks


def test_batch_invariance(llm, chat_prompts, reference):
    params = SamplingParams(temperature=0, max_tokens=MAX_TOKENS)
    for prompt, ref in zip(chat_prompts[::3], reference[::3]):
        alone = llm.generate(_token_prompts([prompt]), params, use_tqdm=False)[0]
        assert alone.outputs[0].token_ids == ref


def test_text_matches_tokenizer_decode(llm, chat_prompts):
    outs = llm.generate(_token_prompts(chat_prompts[:3]),
                        SamplingParams(temperature=0, max_tokens=16), use_tqdm=False)
    tok = llm.get_tokenizer()
    for out in outs:
        assert out.outputs[0].text == tok.decode(out.outputs[0].token_ids, skip_special_tokens=True)


def test_preemption_keeps_outputs_exact(chat_prompts, reference, llm):
    # 9 prompts of 31-67 tokens growing by up to 32 each need ~50 blocks of 16 tokens
    # together; 16 blocks force running requests to be preempted and recomputed.
    small = LLM(dtype="float32", quantization="none", num_gpu_blocks_override=16, max_model_len=128,
                enable_prefix_caching=False)
    params = SamplingParams(temperature=0, max_tokens=MAX_TOKENS)
    outputs = small.generate(_token_prompts(chat_prompts), params, use_tqdm=False)
    assert small.engine.scheduler.num_preemptions > 0
    for out, ref in zip(outputs, reference):
        assert out.outputs[0].token_ids == ref
    stats = small.kv_cache_stats()
    assert stats.free_blocks == stats.total_blocks == 16
    small.engine.kv_cache_manager.check_integrity()


def test_seeded_sampling_independent_of_batch(llm, chat_prompts):
    seeded = SamplingParams(temperature=1.0, top_p=0.9, seed=1234, max_tokens=24)
    alone = llm.generate(_token_prompts([chat_prompts[2]]), seeded, use_tqdm=False)[0]
    others = SamplingParams(temperature=1.0, max_tokens=24)
    batch = llm.generate(
        _token_prompts([chat_prompts[0], chat_prompts[2], chat_prompts[5]]),
        [others, seeded, SamplingParams(temperature=0.7, seed=7, max_tokens=24)],
        use_tqdm=False,
    )
    assert batch[1].outputs[0].token_ids == alone.outputs[0].token_ids
    assert batch[1].outputs[0].text == alone.outputs[0].text


def test_seeded_n_samples_differ_and_fix_the_set(llm, chat_prompts):
    """n > 1 with a seed: sample i is drawn with seed + i (vLLM's ``ParentRequest`` rule), so
    the n samples differ from each other, the set is the same on every run, and each
    sample equals the n = 1 request with that seed, alone or beside other requests."""
    tok = llm.get_tokenizer()
    prompt = {"prompt_token_ids": list(tok.apply_chat_template(
        [{"role": "user", "content": "Write a one-line slogan for a bakery."}],
        add_generation_prompt=True, tokenize=True, return_dict=False))}
    params = SamplingParams(n=4, temperature=0.9, seed=7, max_tokens=30)
    first = llm.generate([prompt], params, use_tqdm=False)[0].outputs
    texts = [c.text for c in first]
    assert len(set(texts)) == 4, texts
    again = llm.generate(_token_prompts(chat_prompts[:2]) + [prompt],
                         [SamplingParams(temperature=1.0, max_tokens=20)] * 2 + [params],
                         use_tqdm=False)[2].outputs
    assert [c.token_ids for c in again] == [c.token_ids for c in first]
    for i, sample in enumerate(first):
        single = SamplingParams(temperature=0.9, seed=7 + i, max_tokens=30)
        alone = llm.generate([prompt], single, use_tqdm=False)[0].outputs[0]
        assert alone.token_ids == sample.token_ids


def test_ignore_eos_runs_to_max_tokens(llm, hf_model, chat_prompts):
    out = llm.generate(_token_prompts([chat_prompts[0]]),
                       SamplingParams(temperature=0, max_tokens=40, ignore_eos=True),
                       use_tqdm=False)[0]
    assert out.outputs[0].token_ids == hf_greedy(hf_model, chat_prompts[0], 40, None)
    assert out.outputs[0].finish_reason == "length"


def test_logprobs_match_reference(llm, hf_model, chat_prompts):
    import torch

    prompt = chat_prompts[1]
    out = llm.generate(_token_prompts([prompt]),
                       SamplingParams(temperature=0, max_tokens=4, logprobs=3, prompt_logprobs=2),
                       use_tqdm=False)[0]
    comp = out.outputs[0]
    ids = torch.tensor([prompt + comp.token_ids])
    with torch.no_grad():
        ref = torch.log_softmax(hf_model(ids).logits[0].float(), dim=-1)
    n = len(prompt)
    # float32 sums in another order than transformers': 1e-4, plus 1e-5 of the logprob (a
    # prompt token at -15.49 moved 1.1e-4 when attention's V sums were regrouped)
    close = lambda value: pytest.approx(value, abs=1e-4, rel=1e-5)
    for i, tok in enumerate(comp.token_ids):
        assert comp.logprobs[i][tok].logprob == close(float(ref[n - 1 + i, tok]))
        assert comp.logprobs[i][tok].rank == 1
        assert len(comp.logprobs[i]) == 3
    assert comp.cumulative_logprob == pytest.approx(
        sum(float(ref[n - 1 + i, t]) for i, t in enumerate(comp.token_ids)), abs=1e-3)
    assert out.prompt_logprobs[0] is None
    for pos in range(1, n):
        entry = out.prompt_logprobs[pos]
        assert entry[prompt[pos]].logprob == close(float(ref[pos - 1, prompt[pos]]))


def test_stop_string_cut(llm):
    out = llm.chat([{"role": "user", "content": "Count from 1 to 10, separated by commas."}],
                   SamplingParams(temperature=0, max_tokens=40), use_tqdm=False)[0]
    text = out.outputs[0].text
    assert "5" in text, text
    stop_out = llm.chat([{"role": "user", "content": "Count from 1 to 10, separated by commas."}],
                        SamplingParams(temperature=0, max_tokens=40, stop=["5"]),
                        use_tqdm=False)[0]
    comp = stop_out.outputs[0]
    assert comp.text == text[: text.index("5")]
    assert comp.finish_reason == "stop" and comp.stop_reason == "5"


@pytest.mark.parametrize("kwargs, field", [
    ({"max_tokens": 0}, "max_tokens"),
    ({"temperature": -1}, "temperature"),
    ({"top_p": 0}, "top_p"),
    ({"top_p": 1.5}, "top_p"),
])
def test_bad_sampling_params(kwargs, field):
    with pytest.raises(ValueError, match=field):
        SamplingParams(**kwargs)


def test_bad_prompts_rejected_and_nothing_queued(llm):
    with pytest.raises(ValueError, match="empty"):
        llm.generate({"prompt_token_ids": []})
    with pytest.raises(ValueError, match="max_model_len"):
        llm.generate({"prompt_token_ids": [1] * 10}, SamplingParams(max_tokens=llm.engine.max_model_len))
    with pytest.raises(ValueError, match="vocabulary"):
        llm.generate({"prompt_token_ids": [1, 10**9]})
    # A bad prompt in a batch rejects the batch before anything runs.
    with pytest.raises(ValueError):
        llm.generate(["fine", {"prompt_token_ids": []}])
    assert not llm.engine.has_unfinished_requests()


@pytest.mark.parametrize("field", ["max_model_len", "max_num_batched_tokens"])
def test_zero_limits_are_rejected_not_defaulted(field):
    """0 is a bad value, not "unset": it must not fall back to the default."""
    with pytest.raises(ValueError, match=f"{field} must be >= 1; got 0"):
        LLM(**{field: 0})
