"""Output text of the whole engine (issue 12, items 3-5): stop strings while streaming, the
last partial UTF-8 character, prompts that end inside a character, text of stop tokens.

Expected values come from the tokenizer's own ``decode`` of the generated token ids and the
stated rules; every request is also run step by step (what a stream sees) and checked
against its non-streamed twin from ``LLM.generate``.
"""

from __future__ import annotations

import itertools
import os

import pytest

from pagedserve import SamplingParams

PARTIAL_PROMPT = [19556, 905, 15107, 230]  # "Hello world " + 3 of the 4 bytes of 🌍


def stepwise(llm, prompt, params: SamplingParams):
    """Run one request step by step; return its final output after checking that the text
    at every step is a prefix of the next (so stream deltas add up) and that the final
    output equals the non-streamed twin's."""
    engine, rid = llm.engine, f"stepwise-{next(_ids)}"
    engine.add_request(rid, prompt, params)
    texts, final = [], None
    while engine.has_unfinished_requests():
        for out in engine.step():
            assert out.request_id == rid
            texts.append(out.outputs[0].text)
            final = out
    assert final.finished
    for a, b in itertools.pairwise(texts):
        assert b.startswith(a), (a, b)
    twin = llm.generate([prompt], params, use_tqdm=False)[0].outputs[0]
    got = final.outputs[0]
    assert (got.text, got.token_ids, got.finish_reason, got.stop_reason) == (
        twin.text, twin.token_ids, twin.finish_reason, twin.stop_reason)
    return final


_ids = itertools.count()


@pytest.fixture(scope="module")
def tok(llm):
    return llm.get_tokenizer()


def test_stop_string_longer_than_the_text_so_far(llm, tok):
    params = SamplingParams(temperature=0, max_tokens=40, stop=["DEFGHIJ"])
    out = stepwise(llm, "Here is the English alphabet: ABC", params).outputs[0]
    assert tok.decode(out.token_ids).startswith("DEFGHIJ")  # the stop really occurs
    assert (out.text, out.finish_reason, out.stop_reason) == ("", "stop", "DEFGHIJ")


def test_last_partial_character_is_flushed(llm, tok):
    params = SamplingParams(temperature=0, max_tokens=40)
    out = stepwise(llm, "My favourite emojis are 🎉👍", params).outputs[0]
    assert out.finish_reason == "length"
    want = tok.decode(out.token_ids)
    assert want.endswith("\ufffd")  # the 40th token ends inside a character
    assert out.text == want


def test_prompt_ending_inside_a_character(llm, tok):
    params = SamplingParams(temperature=0, max_tokens=8)
    out = stepwise(llm, {"prompt_token_ids": PARTIAL_PROMPT}, params).outputs[0]
    full, prompt_text = tok.decode(PARTIAL_PROMPT + out.token_ids), tok.decode(PARTIAL_PROMPT)
    common = os.path.commonprefix([full, prompt_text])
    assert full.endswith("\ufffd") and common == "Hello world "
    assert out.text == full[len(common):]
    assert prompt_text[: len(prompt_text) - out.prompt_text_trim] == common  # echo's prefix


def test_stop_token_id_adds_no_text(llm, tok):
    prompt = "The theory of relativity was developed by"
    params = SamplingParams(temperature=0, max_tokens=30, stop_token_ids=[260])
    out = stepwise(llm, prompt, params).outputs[0]
    assert tok.decode([260]) == " the"
    assert out.token_ids[-1] == 260 and (out.finish_reason, out.stop_reason) == ("stop", 260)
    assert out.text == tok.decode(out.token_ids[:-1]) and not out.text.endswith(" the")
    params = SamplingParams(temperature=0, max_tokens=30, stop_token_ids=[260],
                            include_stop_str_in_output=True)
    out = stepwise(llm, prompt, params).outputs[0]
    assert out.token_ids[-1] == 260 and out.text == tok.decode(out.token_ids)


def test_eos_adds_no_text_unless_ignored(llm, tok):
    prompt = {"prompt_token_ids": list(tok.apply_chat_template(
        [{"role": "user", "content": "Say OK."}], add_generation_prompt=True, tokenize=True,
        return_dict=False))}
    eos = tok.eos_token_id
    params = SamplingParams(temperature=0, max_tokens=64, skip_special_tokens=False)
    out = stepwise(llm, prompt, params).outputs[0]
    assert out.token_ids[-1] == eos and out.finish_reason == "stop"
    assert out.text == tok.decode(out.token_ids[:-1], skip_special_tokens=False)
    assert not out.text.endswith("<|im_end|>")

    params = SamplingParams(temperature=0, max_tokens=64, skip_special_tokens=False,
                            include_stop_str_in_output=True)
    kept = stepwise(llm, prompt, params).outputs[0]
    assert kept.token_ids == out.token_ids and kept.text == out.text + "<|im_end|>"

    # With ignore_eos, EOS is an ordinary token: it keeps its text.
    n = len(out.token_ids) + 2
    params = SamplingParams(temperature=0, max_tokens=n, skip_special_tokens=False,
                            ignore_eos=True)
    ignored = stepwise(llm, prompt, params).outputs[0]
    assert ignored.token_ids[: len(out.token_ids)] == out.token_ids
    assert ignored.finish_reason == "length"
    assert ignored.text == tok.decode(ignored.token_ids, skip_special_tokens=False)
    assert "<|im_end|>" in ignored.text
