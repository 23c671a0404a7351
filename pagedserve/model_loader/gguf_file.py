"""GGUF files: header reading, config from metadata, weights with HF names (dequantized, or
as raw blocks for the kernels of `quantization/gguf.py`).

Format: https://github.com/ggml-org/ggml/blob/master/docs/gguf.md. The header (metadata and
tensor infos) is parsed here with `struct` because `gguf.GGUFReader` builds a numpy view
per token of the vocabulary (~3 s for SmolLM2); constants and dequantization come from
the `gguf` package.
"""

from __future__ import annotations

import functools
import io
import logging
import os
import pathlib
import struct
from collections.abc import Collection, Iterable, Iterator
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
from gguf import GGML_QUANT_SIZES, GGUF_DEFAULT_ALIGNMENT, GGUF_MAGIC, GGMLQuantizationType
from gguf import GGUFValueType as VT
from gguf.quants import dequantize, quant_shape_to_byte_shape
from transformers import PretrainedConfig

from pagedserve.cpu_ops import cpu_ops_available, load_cpu_ops

logger = logging.getLogger(__name__)

# GGUF general.architecture -> the Hugging Face architecture we build a config for.
GGUF_ARCHITECTURES = {"llama": "LlamaForCausalLM", "gemma3": "Gemma3ForCausalLM"}
SUPPORTED_ARCHITECTURES = tuple(GGUF_ARCHITECTURES)
_Q = GGMLQuantizationType
SUPPORTED_TYPES = (_Q.F32, _Q.F16, _Q.BF16, _Q.Q4_0, _Q.Q4_1, _Q.Q5_0, _Q.Q8_0, _Q.Q4_K,
                   _Q.Q5_K, _Q.Q6_K, _Q.MXFP4, _Q.NVFP4)

_SCALAR = {VT.UINT8: "B", VT.INT8: "b", VT.UINT16: "H", VT.INT16: "h", VT.UINT32: "I",
           VT.INT32: "i", VT.FLOAT32: "f", VT.BOOL: "?", VT.UINT64: "Q", VT.INT64: "q",
           VT.FLOAT64: "d"}

# GGUF tensor name (without "blk.N.") -> HF module name, per architecture
# (gguf.constants MODEL_TENSORS and llama.cpp's convert_hf_to_gguf.py).
_COMMON_LAYER_NAMES = {
    "attn_norm": "input_layernorm",
    "attn_q": "self_attn.q_proj", "attn_k": "self_attn.k_proj", "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "ffn_gate": "mlp.gate_proj", "ffn_up": "mlp.up_proj", "ffn_down": "mlp.down_proj",
}
_LAYER_NAMES = {
    "llama": {**_COMMON_LAYER_NAMES, "ffn_norm": "post_attention_layernorm"},
    "gemma3": {
        **_COMMON_LAYER_NAMES,
        "attn_q_norm": "self_attn.q_norm", "attn_k_norm": "self_attn.k_norm",
        "post_attention_norm": "post_attention_layernorm",
        "ffn_norm": "pre_feedforward_layernorm", "post_ffw_norm": "post_feedforward_layernorm",
    },
}
_TOP_NAMES = {"token_embd": "model.embed_tokens", "output_norm": "model.norm", "output": "lm_head"}


@dataclass(frozen=True)
class TensorInfo:
    """One tensor of a GGUF file. `shape` is in PyTorch order (rows first), i.e. the
    reverse of GGUF's `ne` dims; `offset` is the absolute byte offset in the file."""

    name: str
    shape: tuple[int, ...]
    qtype: GGMLQuantizationType
    offset: int

    @property
    def nbytes(self) -> int:
        block_size, type_size = GGML_QUANT_SIZES[self.qtype]
        return int(np.prod(self.shape)) * type_size // block_size


@dataclass(frozen=True)
class GGUFHeader:
    """Metadata key/values (arrays as lists) and tensor infos of a GGUF file."""

    metadata: dict[str, Any]
    tensors: list[TensorInfo]


_U64 = struct.Struct("<Q")


class _Cursor:
    def __init__(self, buf: bytes | memoryview):
        self.buf, self.pos = buf, 0

    def unpack(self, fmt: str) -> Any:
        (value,) = struct.unpack_from("<" + fmt, self.buf, self.pos)
        self.pos += struct.calcsize(fmt)
        return value

    def string(self) -> str:
        n = self.unpack("Q")
        self.pos += n
        return bytes(self.buf[self.pos - n:self.pos]).decode("utf-8", errors="replace")

    def strings(self, count: int) -> list[str]:
        """``count`` strings in one loop: a tokenizer's vocabulary and merges are ~100k of
        them, and a method call per string cost most of the header's parse time."""
        buf, pos, items = self.buf, self.pos, []
        for _ in range(count):
            (n,) = _U64.unpack_from(buf, pos)
            pos += 8
            items.append(str(buf[pos:pos + n], "utf-8", "replace"))
            pos += n
        self.pos = pos
        return items

    def value(self, vtype: int) -> Any:
        if vtype == VT.STRING:
            return self.string()
        if vtype == VT.ARRAY:
            item_type, count = self.unpack("I"), self.unpack("Q")
            if item_type in _SCALAR:  # numeric arrays in one go
                fmt = "<" + _SCALAR[item_type] * count
                items = list(struct.unpack_from(fmt, self.buf, self.pos))
                self.pos += struct.calcsize(fmt)
                return items
            if item_type == VT.STRING:
                return self.strings(count)
            return [self.value(item_type) for _ in range(count)]
        return self.unpack(_SCALAR[VT(vtype)])


def read_header(path: pathlib.Path) -> GGUFHeader:
    """Parse the metadata and tensor infos of a GGUF v2/v3 little-endian file (~0.1 s).

    The loader reads it for the config, the weights and the GGUF blocks: it is parsed once
    per file version (cached by path, size and modification time), so treat it as
    read-only. Raises ValueError if the file is not GGUF, is big-endian or has an
    unsupported version.
    """
    stat = os.stat(path)
    return _read_header(str(path), stat.st_size, stat.st_mtime_ns)


@functools.lru_cache(maxsize=4)
def _read_header(path: str, size: int, mtime_ns: int) -> GGUFHeader:
    with open(path, "rb") as f:
        head = f.read(24)
        if len(head) < 24 or struct.unpack_from("<I", head)[0] != GGUF_MAGIC:
            raise ValueError(f"{path} is not a GGUF file (bad magic)")
        version = struct.unpack_from("<I", head, 4)[0]
        if version not in (2, 3):
            raise ValueError(f"{path}: GGUF version {version} (byte order or version not "
                             "supported; expected little-endian v2 or v3)")
        n_tensors, n_kv = struct.unpack_from("<QQ", head, 8)
        f.seek(0)
        buf, size = b"", 1 << 22
        while True:  # the header is a few MB at most: grow the buffer until it parses
            buf += f.read(size - len(buf))
            try:
                return _parse_header(buf, n_tensors, n_kv)
            except struct.error:
                if len(buf) < size:
                    raise ValueError(f"{path}: truncated GGUF header") from None
                size *= 4


def _parse_header(buf: bytes, n_tensors: int, n_kv: int) -> GGUFHeader:
    cur = _Cursor(memoryview(buf))
    cur.pos = 24
    metadata = {}
    for _ in range(n_kv):
        key = cur.string()
        metadata[key] = cur.value(cur.unpack("I"))
    infos = []
    for _ in range(n_tensors):
        name = cur.string()
        dims = [cur.unpack("Q") for _ in range(cur.unpack("I"))]
        infos.append((name, tuple(reversed(dims)), cur.unpack("I"), cur.unpack("Q")))
    align = int(metadata.get("general.alignment", GGUF_DEFAULT_ALIGNMENT))
    data_start = -(-cur.pos // align) * align
    tensors = [TensorInfo(n, s, _Q(t), data_start + o) for n, s, t, o in infos]
    return GGUFHeader(metadata, tensors)


def check_tensor_type(name: str, qtype: GGMLQuantizationType | int) -> None:
    """Raise ValueError naming the tensor if `qtype` is not in SUPPORTED_TYPES."""
    if qtype not in SUPPORTED_TYPES:
        try:
            found = _Q(qtype).name
        except ValueError:
            found = f"unknown type {int(qtype)}"
        supported = ", ".join(t.name for t in SUPPORTED_TYPES)
        raise ValueError(f"GGUF tensor {name!r} has type {found}, which is not supported "
                         f"(supported: {supported})")


def _architecture(header: GGUFHeader, path: pathlib.Path) -> str:
    arch = header.metadata.get("general.architecture")
    if arch not in SUPPORTED_ARCHITECTURES:
        raise ValueError(f"{path}: GGUF architecture {arch!r} is not supported "
                         f"(supported: {', '.join(SUPPORTED_ARCHITECTURES)})")
    return arch


def gguf_config(path: pathlib.Path, header: GGUFHeader | None = None) -> PretrainedConfig:
    """Build a transformers config (a LlamaConfig's fields, or a Gemma3TextConfig) from GGUF
    metadata (keys as written by llama.cpp's convert_hf_to_gguf.py / gguf.constants.Keys).
    Raises ValueError for architectures other than SUPPORTED_ARCHITECTURES."""
    header = header or read_header(path)
    arch = _architecture(header, path)
    md = header.metadata

    def get(key: str, default: Any = None) -> Any:
        return md.get(f"{arch}.{key}", default)

    hidden, n_head = get("embedding_length"), get("attention.head_count")
    names = {t.name for t in header.tensors}
    common = {
        "architectures": [GGUF_ARCHITECTURES[arch]],
        "vocab_size": get("vocab_size") or len(md.get("tokenizer.ggml.tokens", ())),
        "hidden_size": hidden,
        "intermediate_size": get("feed_forward_length"),
        "num_hidden_layers": get("block_count"),
        "num_attention_heads": n_head,
        "num_key_value_heads": get("attention.head_count_kv", n_head),
        "head_dim": get("attention.key_length") or get("rope.dimension_count") or hidden // n_head,
        "rms_norm_eps": float(get("attention.layer_norm_rms_epsilon", 1e-6)),
        "max_position_embeddings": get("context_length", 2048),
        "attention_bias": "blk.0.attn_q.bias" in names,
        "tie_word_embeddings": "output.weight" not in names,
        "bos_token_id": md.get("tokenizer.ggml.bos_token_id"),
        "eos_token_id": md.get("tokenizer.ggml.eos_token_id"),
        "pad_token_id": md.get("tokenizer.ggml.padding_token_id"),
    }
    rope = {"rope_type": "default", "rope_theta": float(get("rope.freq_base", 10000.0))}
    rope.update(_rope_scaling(get))
    if arch == "gemma3":
        return _gemma3_config(get, common, rope)
    if "rope_freqs.weight" in names:
        logger.warning("%s: ignoring rope_freqs.weight (llama3-style rope factors are not "
                       "reconstructed)", path)
    return _llama_config(common, rope)


def _llama_config(common: dict[str, Any], rope: dict[str, Any]) -> PretrainedConfig:
    """A ``PretrainedConfig`` with the fields of a ``LlamaConfig`` (its defaults for those
    GGUF does not carry), usable by transformers' ``LlamaForCausalLM`` as is. Why
    not a ``LlamaConfig``: importing it pulls in transformers' model-loading stack
    (``torch.distributed.tensor``, sympy), 1.1 s of a 5 s start-up."""
    config = PretrainedConfig(hidden_act="silu", mlp_bias=False, attention_dropout=0.0,
                              initializer_range=0.02, pretraining_tp=1,
                              rope_parameters=rope, **common)
    config.model_type = "llama"
    return config


def _gemma3_config(get, common: dict[str, Any], rope: dict[str, Any]) -> PretrainedConfig:
    """Gemma 3 as llama.cpp runs it: every 6th layer global, local layers with rope base
    10000 and no scaling, softmax scale 1/sqrt(head_dim) (1/sqrt(hidden/heads) for the 62-layer
    27B model)."""
    scalar = common["head_dim"]
    if common["num_hidden_layers"] == 62:
        scalar = common["hidden_size"] // common["num_attention_heads"]
    from transformers import Gemma3TextConfig

    return Gemma3TextConfig(
        sliding_window=get("attention.sliding_window"),
        query_pre_attn_scalar=scalar,
        final_logit_softcapping=get("final_logit_softcapping"),
        attn_logit_softcapping=get("attn_logit_softcapping"),
        rope_parameters={"full_attention": rope,
                         "sliding_attention": {"rope_type": "default", "rope_theta": 10000.0}},
        **common,
    )


def _rope_scaling(get) -> dict[str, Any]:
    kind = get("rope.scaling.type", "none")
    factor = get("rope.scaling.factor") or get("rope.scale_linear")
    if kind == "none" and factor and factor != 1.0:
        kind = "linear"  # older files only carry rope.scale_linear
    if kind in ("none", None):
        return {}
    out = {"rope_type": kind, "factor": float(factor or 1.0)}
    if (orig := get("rope.scaling.original_context_length")) is not None:
        out["original_max_position_embeddings"] = int(orig)
    if (attn := get("rope.scaling.attn_factor")) is not None:
        out["attention_factor"] = float(attn)
    return out


def unpermute_qk(w: torch.Tensor, n_head: int) -> torch.Tensor:
    """Inverse of `LlamaModel.permute` in llama.cpp's convert_hf_to_gguf.py.

    llama.cpp stores each head's rows as interleaved (x0, x_d/2, x1, ...) pairs for its
    rotary kernel; HF keeps halves. `w`: [n_head * head_dim, ...] (weight or bias); pass
    n_head = num_attention_heads for attn_q and num_key_value_heads for attn_k.
    """
    return w.reshape(n_head, -1, 2, *w.shape[1:]).transpose(1, 2).reshape(w.shape)


def hf_name(gguf_name: str, arch: str = "llama") -> str | None:
    """Map a GGUF tensor name to the HF parameter name of `arch`'s model (None if it has none)."""
    parts = gguf_name.split(".")
    layer_names = _LAYER_NAMES[arch]
    if parts[0] == "blk" and parts[2] in layer_names:
        return f"model.layers.{parts[1]}.{layer_names[parts[2]]}.{parts[3]}"
    if parts[0] in _TOP_NAMES and len(parts) == 2:
        return f"{_TOP_NAMES[parts[0]]}.{parts[1]}"
    return None


def iter_gguf_weights(path: pathlib.Path, dtype: torch.dtype, skip: Collection[str] = ()
                      ) -> Iterator[tuple[str, torch.Tensor]]:
    """Yield (HF name, tensor) for every weight, dequantized to float32 (Q4_1 and Q8_0 by
    our C++ op ``dequantize_gguf_blocks`` where the kernels build, the rest and otherwise
    by ``gguf.quants``; both bit-equal) then cast to `dtype`. Shapes are HF's
    [out_features, in_features]. Undone on the way: llama's Q/K row permutation; gemma3's
    "+1" on norm weights (HF stores ``w``, llama.cpp ``1 + w``). Names in `skip` are not
    read.

    Raises ValueError for unsupported architectures, quantization types or tensor names,
    or a truncated file.
    """
    header, arch, config = _checked_header(path)
    with open(path, "rb", buffering=0) as f:
        for info in header.tensors:
            name = hf_name(info.name, arch)
            if name is None or name in skip:
                continue
            raw = _read_bytes(f, info)
            if info.qtype in (_Q.Q4_1, _Q.Q8_0) and cpu_ops_available():
                tensor = load_cpu_ops().dequantize_gguf_blocks(
                    torch.from_numpy(raw).view(-1, raw.shape[-1]), int(info.qtype))
                tensor = tensor.view(info.shape)
            else:
                tensor = torch.from_numpy(dequantize(raw, info.qtype))
            tensor = _hf_row_order(tensor, info.name, arch, config)
            if arch == "gemma3" and info.name.endswith("norm.weight"):
                tensor = tensor - 1
            yield name, tensor.to(dtype).contiguous()


def _read_bytes(f: io.RawIOBase, info: TensorInfo) -> np.ndarray:
    """The bytes of tensor `info`, uint8 of its byte shape (``quant_shape_to_byte_shape``),
    read from `f` in one call: faster than copying them out of a memory map, which takes a
    page fault per 4 KiB. Raises ValueError if the file ends first."""
    raw = np.empty(quant_shape_to_byte_shape(info.shape, info.qtype), dtype=np.uint8)
    f.seek(info.offset)
    if f.readinto(raw) != raw.nbytes:
        raise ValueError(f"{f.name}: truncated GGUF file (tensor {info.name!r})")
    return raw


def iter_gguf_blocks(path: pathlib.Path, qtypes: Iterable[GGMLQuantizationType],
                     ) -> Iterator[tuple[str, GGMLQuantizationType, torch.Tensor]]:
    """Yield (HF name, type, blocks) for the 2-D weights stored as one of `qtypes`, still
    quantized: blocks is uint8 ``[rows, K / block_size * type_size]``, each row the GGUF
    blocks of one output row, rows in HF order (llama's Q/K un-permutation is a row
    permutation, applied to whole rows of blocks). Read from the file.

    Raises ValueError as `iter_gguf_weights`.
    """
    header, arch, config = _checked_header(path)
    qtypes = set(qtypes)
    with open(path, "rb", buffering=0) as f:
        for info in header.tensors:
            name = hf_name(info.name, arch)
            if name is None or info.qtype not in qtypes or len(info.shape) != 2:
                continue
            rows = torch.from_numpy(_read_bytes(f, info))
            yield name, info.qtype, _hf_row_order(rows, info.name, arch, config).contiguous()


def _checked_header(path: pathlib.Path) -> tuple[GGUFHeader, str, PretrainedConfig]:
    """Header, architecture and config of a file whose tensors all have supported types
    and known names (checked before any slow work; ValueError otherwise)."""
    header = read_header(path)
    arch = _architecture(header, path)
    for info in header.tensors:
        check_tensor_type(info.name, info.qtype)
        if hf_name(info.name, arch) is None and info.name != "rope_freqs.weight":
            raise ValueError(f"{path}: unknown GGUF tensor {info.name!r} for a {arch} model")
    return header, arch, gguf_config(path, header)


def _hf_row_order(rows: torch.Tensor, gguf_name: str, arch: str,
                  config: PretrainedConfig) -> torch.Tensor:
    """Undo llama.cpp's Q/K row permutation (llama only); other tensors pass unchanged."""
    if arch == "llama" and ".attn_q." in gguf_name:
        return unpermute_qk(rows, config.num_attention_heads)
    if arch == "llama" and ".attn_k." in gguf_name:
        return unpermute_qk(rows, config.num_key_value_heads)
    return rows
