"""Incremental detokenizer on the bundled SmolLM2 tokenizer (byte-level BPE)."""

import itertools
import os

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import pagedserve.detokenizer as detok_mod
from pagedserve.detokenizer import IncrementalDetokenizer, _StreamDecoder, _WindowDecoder
from pagedserve.sampling_params import SamplingParams
from pagedserve.tokenizer import load_tokenizer

TEXT = "Hello 😀 世界! 日本語のテキスト 🎉🇫🇷 naïve café<|im_end|> done"


@pytest.fixture(scope="module")
def tok(model_path):
    """The bundled model's tokenizer, found the way the package finds it."""
    return load_tokenizer(model_path)


@pytest.fixture(params=["stream", "window"])
def path(request, monkeypatch):
    """Run each test on both decoders: DecodeStream and the prefix/read-offset window."""
    if request.param == "window":
        monkeypatch.setattr(detok_mod, "DecodeStream", None)
    return request.param


def feed(det, ids):
    """Feed tokens one by one; return the streamed deltas (not finished)."""
    deltas = []
    for t in ids:
        det.update([t])
        deltas.append(det.get_next_output_text(finished=False, delta=True))
    return deltas


@pytest.mark.parametrize("skip", [True, False])
def test_matches_full_decode_and_never_emits_half_chars(tok, path, skip):
    ids = tok.encode(TEXT)
    # The text really splits multi-byte characters across tokens.
    assert any("\ufffd" in tok.decode([t]) for t in ids)
    prompt = tok.encode("Write something: ")
    det = IncrementalDetokenizer(tok, prompt, SamplingParams(skip_special_tokens=skip))
    expected_cls = _StreamDecoder if path == "stream" else _WindowDecoder
    assert isinstance(det.decoder, expected_cls)
    deltas = feed(det, ids)
    assert not any("\ufffd" in d for d in deltas)
    assert det.output_text == tok.decode(ids, skip_special_tokens=skip)
    assert "".join(deltas) + det.get_next_output_text(True, True) == det.output_text
    assert ("<|im_end|>" in det.output_text) is not skip


def test_multi_token_update_and_non_delta(tok, path):
    ids = tok.encode(TEXT)
    det = IncrementalDetokenizer(tok, [], SamplingParams())
    for i in range(0, len(ids), 3):
        assert det.update(ids[i:i + 3]) is None
    assert det.output_text == tok.decode(ids, skip_special_tokens=True)
    assert det.get_next_output_text(False, False) == det.output_text  # no stop: no hold-back


def test_stop_string_spanning_tokens(tok, path):
    ids = tok.encode("Hello world, how are you?")
    stop = "lo wor"
    assert not any(stop in tok.decode([t]) for t in ids)  # it spans a token boundary
    det = IncrementalDetokenizer(tok, [], SamplingParams(stop=["zzz", stop]))
    found = [det.update([t]) for t in ids[:3]]
    assert stop in found
    assert det.output_text == "Hel"
    assert det.get_next_output_text(True, True) == "Hel"

    det = IncrementalDetokenizer(
        tok, [], SamplingParams(stop=[stop], include_stop_str_in_output=True))
    assert det.update(ids) == stop
    assert det.output_text == "Hello wor"
    assert det.stop_buffer_length == 0


def test_earliest_stop_string_wins(tok):
    det = IncrementalDetokenizer(tok, [], SamplingParams(stop=["you", "how"]))
    assert det.update(tok.encode("Hello world, how are you?")) == "how"
    assert det.output_text == "Hello world, "


def test_partial_stop_string_is_held_back_then_released(tok, path):
    ids = tok.encode("abc hello world xyz")
    det = IncrementalDetokenizer(tok, [], SamplingParams(stop=["hello world"]))
    streamed = ""
    for t in ids:
        stop = det.update([t])
        streamed += det.get_next_output_text(finished=stop is not None, delta=True)
        assert "hel" not in streamed
        if stop:
            break
    assert stop == "hello world" and streamed == det.output_text == "abc "

    # No stop: the last len(stop) - 1 chars wait until the request finishes.
    det = IncrementalDetokenizer(tok, [], SamplingParams(stop=["STOP!"]))
    streamed = "".join(feed(det, tok.encode("plain text here")))
    assert streamed == "plain text here"[:-4]
    assert det.get_next_output_text(False, False) == streamed
    assert det.get_next_output_text(True, True) == "here"
    assert det.get_next_output_text(True, True) == ""
    assert det.get_next_output_text(True, False) == "plain text here"


def test_min_tokens_defers_stop_strings(tok):
    ids = tok.encode("Hello world, Hello world")
    det = IncrementalDetokenizer(tok, [], SamplingParams(stop=["Hello"], min_tokens=2))
    results = [det.update([t]) for t in ids]
    second = next(i for i in range(1, len(ids)) if "Hello" in tok.decode([ids[i]]))
    assert results.index("Hello") == second  # the first "Hello" is within min_tokens
    assert det.output_text == "Hello world, "


def test_stop_terminated_drops_eos_text(tok):
    ids = tok.encode("Hi there") + [tok.eos_token_id]
    det = IncrementalDetokenizer(tok, [], SamplingParams(skip_special_tokens=False))
    det.update(ids[:-1])
    det.update(ids[-1:], stop_terminated=True)
    assert det.output_text == "Hi there" and det.output_token_ids == ids
    det = IncrementalDetokenizer(tok, [], SamplingParams(
        skip_special_tokens=False, include_stop_str_in_output=True))
    det.update(ids, stop_terminated=True)
    assert det.output_text == "Hi there<|im_end|>"


def test_adjacent_special_tokens_without_spaces(tok, path):
    ids = [1, 2, 1] + tok.encode("ok")
    params = SamplingParams(skip_special_tokens=False, spaces_between_special_tokens=False)
    det = IncrementalDetokenizer(tok, [], params)
    feed(det, ids)
    assert det.output_text == "<|im_start|><|im_end|><|im_start|>ok"


def test_no_text_without_detokenize_or_tokenizer(tok):
    for det in (IncrementalDetokenizer(tok, [1], SamplingParams(detokenize=False)),
                IncrementalDetokenizer(None, [1], SamplingParams())):
        assert det.update(tok.encode("Hello")) is None
        assert det.output_text == "" and det.get_next_output_text(True, True) == ""
        assert det.output_token_ids == tok.encode("Hello")


# -- stop strings while streaming (issue 12, item 3) -----------------------------------------


def cumulative(det, ids, finish=True):
    """Feed tokens one by one as the output processor does; return the text that may be sent
    after each token (``delta=False``), the last entry after the request finished."""
    sent = []
    for t in ids:
        stop = det.update([t])
        if stop is not None:
            return [*sent, det.get_next_output_text(True, False)]
        sent.append(det.get_next_output_text(False, False))
    if finish:
        det.finish()
    return [*sent, det.get_next_output_text(True, False)]


def test_stop_longer_than_the_text_so_far_sends_nothing(tok, path):
    # The tokens: "ABC" then "DEF" "GH" "I" "J". "DEFGH" is shorter than the
    # 6-character hold-back; a negative slice end used to send "DEFG".
    ids = [33203, 23960, 57, 58]
    assert tok.decode(ids) == "DEFGHIJ"
    det = IncrementalDetokenizer(tok, tok.encode("Here is the English alphabet: ABC"),
                                 SamplingParams(stop=["DEFGHIJ"]))
    assert cumulative(det, ids) == ["", "", "", ""]
    assert det.stop_string == "DEFGHIJ" and det.output_text == ""


STOP_TEXTS = ["Hello world, how are you? I am fine, thank you.",
              "ABCDEFGHIJKLMNOPQRSTUVWXYZ abc abcabc", "日本語のテキスト 🎉🇫🇷 naïve café"]


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(text=st.sampled_from(STOP_TEXTS), data=st.data())
def test_sent_text_is_always_a_prefix_of_the_final_text(tok, path, text, data):
    """Whatever the stop strings: what was sendable at any step is a prefix of what is
    sendable later and of the final text. The final text is the full decode of the shortest
    output prefix that contains a stop string, cut at the earliest one (ties: list order).
    Prefixes that end inside a character are skipped: their token's text (with any complete
    characters before the partial one) is only emitted, and searched, once the character
    completes."""
    spans = st.tuples(st.integers(0, len(text) - 1), st.integers(1, 12))
    stops = data.draw(st.lists(spans.map(lambda s: text[s[0]:s[0] + s[1]]) | st.text(
        "abcxyz ", min_size=1, max_size=8), min_size=1, max_size=3))
    include = data.draw(st.booleans())
    ids = tok.encode(text)
    det = IncrementalDetokenizer(tok, [], SamplingParams(stop=stops,
                                                         include_stop_str_in_output=include))
    sent = cumulative(det, ids)
    for a, b in itertools.pairwise(sent):
        assert b.startswith(a), (a, b)
    want = tok.decode(ids)
    for k in range(1, len(ids) + 1):
        prefix = tok.decode(ids[:k])
        if prefix.endswith("\ufffd"):
            continue
        hits = [(prefix.find(s), s) for s in stops if s in prefix]
        if hits:
            idx, s = min(hits, key=lambda h: h[0])
            want = prefix[: idx + len(s) if include else idx]
            break
    assert sent[-1] == det.output_text == want


# -- UTF-8: pending bytes at the end, prompts that end inside a character (item 4) -----------


@pytest.mark.parametrize("skip", [True, False])
def test_finish_flushes_an_incomplete_last_character(tok, path, skip):
    ids = tok.encode("My favourite emojis are 🎉👍")[:-1]  # the last byte of 👍 is missing
    want = tok.decode(ids, skip_special_tokens=skip)
    assert want.endswith("\ufffd")
    det = IncrementalDetokenizer(tok, tok.encode("Say:"),
                                 SamplingParams(skip_special_tokens=skip))
    sent = cumulative(det, ids)
    assert "\ufffd" not in sent[-2]  # not before the end
    assert sent[-1] == det.output_text == want
    assert det.finish() is None and det.output_text == want  # idempotent


def _lcp_rule(tok, prompt, output):
    """(completion text, echo prefix) by the rule: decode(prompt + output) minus its
    longest common prefix with decode(prompt)."""
    full, prompt_text = tok.decode(prompt + output), tok.decode(prompt)
    common = os.path.commonprefix([full, prompt_text])
    return full[len(common):], common


PARTIAL_PROMPT = [19556, 905, 15107, 230]  # "Hello world " + 3 of the 4 bytes of 🌍


@pytest.mark.parametrize("output", [
    [231, 10813, 230, 226],  # completes 🌍, then 🌈
    [231, 10813, 230],  # completes 🌍, ends inside the next emoji
    [81, 10813],  # "a": the prompt's bytes stay invalid
    [],  # nothing generated (a stop token that adds no text)
    [230],  # a byte that cannot continue the character
])
def test_prompt_ending_inside_a_character(tok, path, output):
    text, echo = _lcp_rule(tok, PARTIAL_PROMPT, output)
    det = IncrementalDetokenizer(tok, PARTIAL_PROMPT, SamplingParams())
    sent = cumulative(det, output)
    assert sent[-1] == det.output_text == text
    prompt_text = tok.decode(PARTIAL_PROMPT)
    assert prompt_text[: len(prompt_text) - det.prompt_text_trim] == echo
    assert "Hello" not in text and not text.startswith(" ")


def test_prompt_ending_inside_a_character_stop_string(tok, path):
    # Stop strings are searched in the completion only, never in the prompt's tail.
    det = IncrementalDetokenizer(tok, PARTIAL_PROMPT, SamplingParams(stop=[" "]))
    assert cumulative(det, [231, 10813, 230, 226]) == ["🌍", "🌍", "🌍", "🌍🌈", "🌍🌈"]
    assert det.stop_string is None
