"""Tokenizer loading for HF model directories and GGUF files (with an on-disk cache)."""

from __future__ import annotations

import hashlib
import json
import logging
import os
import pathlib
import shutil
import tempfile

import transformers

logger = logging.getLogger(__name__)


def cache_dir() -> pathlib.Path:
    """${PAGEDSERVE_CACHE_DIR:-${XDG_CACHE_HOME:-~/.cache}/pagedserve}."""
    if root := os.environ.get("PAGEDSERVE_CACHE_DIR"):
        return pathlib.Path(root)
    xdg = os.environ.get("XDG_CACHE_HOME") or pathlib.Path.home() / ".cache"
    return pathlib.Path(xdg) / "pagedserve"


# Bumped when what a cache entry holds changes, so that older entries are not read.
_CACHE_FORMAT = 2


def _cache_key(path: pathlib.Path) -> str:
    st = path.stat()
    ident = f"{_CACHE_FORMAT}\0{path.resolve()}\0{st.st_size}\0{st.st_mtime_ns}"
    return f"{path.stem}-{hashlib.sha256(ident.encode()).hexdigest()[:16]}"


def load_tokenizer(path: pathlib.Path) -> transformers.PreTrainedTokenizerBase:
    """Load the tokenizer of a HF model directory, or the one embedded in a GGUF file.

    A GGUF tokenizer is converted by transformers (`gguf_file=`, ~8 s) once, then saved with
    its chat template (metadata key tokenizer.chat_template) under
    cache_dir()/tokenizers/<file stem>-<hash of absolute path, size, mtime> and loaded from
    there (~0.3 s). The cache entry is written to a temporary directory and renamed into
    place, so concurrent loaders never see a partial one. Raises OSError/ValueError from
    transformers if the files cannot be read.
    """
    path = pathlib.Path(path)
    if not path.is_file():
        return transformers.AutoTokenizer.from_pretrained(path)
    cached = cache_dir() / "tokenizers" / _cache_key(path)
    if (cached / "tokenizer_config.json").is_file():
        return _load_cached(cached)
    tokenizer = transformers.AutoTokenizer.from_pretrained(path.parent, gguf_file=path.name)
    try:
        _save_atomically(tokenizer, cached)
    except OSError as err:  # the cache is best effort
        logger.warning("could not cache the tokenizer in %s: %s", cached, err)
    return tokenizer


def _load_cached(cached: pathlib.Path) -> transformers.PreTrainedTokenizerBase:
    """The class saved in ``tokenizer_config.json`` loads the entry; AutoTokenizer does the
    same, but looking a name up first imports transformers' whole model registry (0.7 s of
    a 5 s start-up), so the generic ``TokenizersBackend`` (what SmolLM2's GGUF tokenizer
    converts to) is loaded directly and only other classes go through AutoTokenizer."""
    saved = json.loads((cached / "tokenizer_config.json").read_text(encoding="utf-8"))
    if saved.get("tokenizer_class") == transformers.TokenizersBackend.__name__:
        return transformers.TokenizersBackend.from_pretrained(cached)
    return transformers.AutoTokenizer.from_pretrained(cached)


def _save_atomically(tokenizer: transformers.PreTrainedTokenizerBase, dest: pathlib.Path) -> None:
    dest.parent.mkdir(parents=True, exist_ok=True)
    tmp = pathlib.Path(tempfile.mkdtemp(prefix=".tmp-", dir=dest.parent))
    try:
        tokenizer.save_pretrained(tmp)
        _add_added_tokens_decoder(tokenizer, tmp / "tokenizer_config.json")
        try:
            os.replace(tmp, dest)
        except OSError:
            if not dest.is_dir():  # else another process won the race: fine
                raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def _add_added_tokens_decoder(tokenizer: transformers.PreTrainedTokenizerBase,
                              config_file: pathlib.Path) -> None:
    """Write the added (special) tokens into ``tokenizer_config.json`` as
    ``added_tokens_decoder``, as transformers 4 saved them (5 leaves them to
    ``tokenizer.json`` alone). Without them, loading parses all of ``tokenizer.json`` in Python (0.15 s for SmolLM2) just to
    read its ``added_tokens``, on top of the Rust parse of the same file."""
    config = json.loads(config_file.read_text(encoding="utf-8"))
    config["added_tokens_decoder"] = {str(index): token.__getstate__()
                                      for index, token in tokenizer.added_tokens_decoder.items()}
    config_file.write_text(json.dumps(config, indent=2, ensure_ascii=False), encoding="utf-8")


def encode_text(tokenizer, text: str, add_special_tokens: bool = True) -> list[int]:
    """Token ids of ``text``. Raises ``ValueError`` for text that is not valid Unicode
    (a lone surrogate such as ``"\\ud800"``, which JSON can carry but UTF-8 cannot)."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as e:
        raise ValueError(f"the prompt is not valid Unicode: {e.reason} at position {e.start}") from e
    return list(tokenizer.encode(text, add_special_tokens=add_special_tokens))
