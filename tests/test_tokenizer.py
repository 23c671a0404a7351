"""Tokenizer loading: GGUF tokenizer equals transformers' and survives the on-disk cache."""

import time

import pytest
import transformers

from pagedserve import tokenizer as tok_mod
from pagedserve.model_loader.files import resolve_model_path

TEXTS = ["Hello world", "héllo wörld — 日本語 🤖🎉 naïve café",
         "  def f(x):\n\treturn x**2  # spaces\n", "<|im_start|>user\nhi<|im_end|>"]
CHAT = [{"role": "user", "content": "What is 2+2?"},
        {"role": "assistant", "content": "4, of course 🙂"}]


@pytest.fixture(scope="module")
def gguf_path():
    return resolve_model_path(None)


@pytest.fixture(scope="module")
def reference(gguf_path):
    return transformers.AutoTokenizer.from_pretrained(gguf_path.parent, gguf_file=gguf_path.name)


@pytest.fixture(scope="module")
def loads(gguf_path, tmp_path_factory):
    """(cold tokenizer, cold seconds, warm tokenizer, warm seconds, cache dir)."""
    cache = tmp_path_factory.mktemp("cache")
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("PAGEDSERVE_CACHE_DIR", str(cache))
        t0 = time.perf_counter()
        cold = tok_mod.load_tokenizer(gguf_path)
        t1 = time.perf_counter()
        warm = tok_mod.load_tokenizer(gguf_path)
        t2 = time.perf_counter()
    return cold, t1 - t0, warm, t2 - t1, cache


@pytest.mark.parametrize("which", [0, 2])
def test_token_ids_match_transformers(loads, reference, which):
    tok = loads[which]
    for text in TEXTS:
        ids = tok(text).input_ids
        assert ids == reference(text).input_ids, text
        assert tok.decode(ids) == text
    assert (tok.eos_token, tok.eos_token_id) == ("<|im_end|>", 2)
    assert len(tok) == len(reference) == 49152
    assert tok.added_tokens_decoder == reference.added_tokens_decoder
    assert tok.special_tokens_map == reference.special_tokens_map


@pytest.mark.parametrize("which", [0, 2])
def test_chat_template_matches_transformers(loads, reference, which):
    tok = loads[which]
    assert tok.chat_template == reference.chat_template
    for gen in (False, True):
        text = tok.apply_chat_template(CHAT, tokenize=False, add_generation_prompt=gen)
        assert text == reference.apply_chat_template(CHAT, tokenize=False,
                                                     add_generation_prompt=gen)
    assert text.startswith("<|im_start|>system\n")  # SmolLM2's default system prompt
    assert text.endswith("<|im_start|>assistant\n")


def test_cache_is_used_and_clean(loads):
    _, cold_s, _, warm_s, cache = loads
    entries = list((cache / "tokenizers").iterdir())
    assert len(entries) == 1 and not entries[0].name.startswith(".tmp")
    assert entries[0].name.startswith("SmolLM2-135M-Instruct.Q4_1-")
    assert (entries[0] / "tokenizer.json").is_file()
    assert warm_s < cold_s / 3, (cold_s, warm_s)


def test_cache_key_changes_with_file(tmp_path):
    path = tmp_path / "m.gguf"
    path.write_bytes(b"a")
    key = tok_mod._cache_key(path)
    path.write_bytes(b"ab")
    assert tok_mod._cache_key(path) != key


def test_cache_dir_env(monkeypatch, tmp_path):
    monkeypatch.delenv("PAGEDSERVE_CACHE_DIR", raising=False)
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    assert tok_mod.cache_dir() == tmp_path / "pagedserve"
    monkeypatch.setenv("PAGEDSERVE_CACHE_DIR", str(tmp_path / "x"))
    assert tok_mod.cache_dir() == tmp_path / "x"


def test_hf_directory(reference, tmp_path):
    reference.save_pretrained(tmp_path)
    tok = tok_mod.load_tokenizer(tmp_path)
    assert [tok(t).input_ids for t in TEXTS] == [reference(t).input_ids for t in TEXTS]
