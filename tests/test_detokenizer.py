"""Incremental detokenizer on the bundled SmolLM2 tokenizer (byte-level BPE)."""

import pytest

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
