"""The C++ decode step (worker/cpu_decode.py, csrc/decode_layers_cpu.cpp) against the
Python layers it replaces: bit-equal logprobs and tokens, and which models it serves."""

from __future__ import annotations

import pytest

from pagedserve import LLM, SamplingParams
from pagedserve.cpu_ops import cpu_ops_available
from pagedserve.quantization.base import KIND_FLOAT, KIND_INT8
from pagedserve.worker.cpu_decode import CpuDecodeLayers

pytestmark = pytest.mark.skipif(not cpu_ops_available(), reason="C++ CPU kernels unavailable")

# Each way a projection can hold its weight: GGUF blocks (the default, float32 and
# bfloat16), int8 rows (SmoothQuant: every Linear), float weights only (packed for the
# fixed-order GEMM); and int8 over a bfloat16 KV cache (--kv-cache-dtype bfloat16).
ENGINES = {"gguf-float32": {"dtype": "float32"}, "gguf-bfloat16": {"dtype": "bfloat16"},
           "int8": {"dtype": "float32", "quantization": "int8"},
           "none": {"dtype": "float32", "quantization": "none"},
           "kv-bf16": {"dtype": "float32", "quantization": "int8", "kv_cache_dtype": "bfloat16"}}
KINDS = {"gguf-float32": None, "gguf-bfloat16": None,
         "int8": [KIND_INT8] * 4,
         "none": [KIND_FLOAT] * 4,
         "kv-bf16": [KIND_INT8] * 4}
REQUESTS = 8  # steps of 8 rows down to 1 (no kernel changes with the row count)


@pytest.fixture(scope="module", params=list(ENGINES))
def engine(request):
    # no prefix caching: the second run must prefill exactly as the first
    return request.param, LLM(max_model_len=512, kv_cache_memory_bytes=128 << 20,
                              enable_prefix_caching=False, **ENGINES[request.param])


def test_decode_layers_equal_the_python_layers(engine, chat_prompts, monkeypatch):
    """Eight requests decoding together (steps of 8 rows, then fewer as requests of other
    lengths finish), up to 24 tokens each with their top-3 logprobs: the same floats both
    ways."""
    name, llm = engine
    model = llm.engine.executor.driver_worker.model
    fast = model.cpu_decode
    assert fast is not None
    kinds = KINDS[name] or [int(p.method.qtype) for p in (
        model.layers[0].self_attn.qkv_proj, model.layers[0].self_attn.o_proj,
        model.layers[0].mlp.gate_up_proj, model.layers[0].mlp.down_proj)]
    assert fast.kinds[:4] == kinds
    rows = []
    run = CpuDecodeLayers.__call__
    monkeypatch.setattr(CpuDecodeLayers, "__call__",
                        lambda self, *args: rows.append(args[1].shape[0]) or run(self, *args))
    params = [SamplingParams(temperature=0, max_tokens=5 + i, ignore_eos=True, logprobs=3)
              for i in range(REQUESTS)]
    prompts = [{"prompt_token_ids": chat_prompts[i % len(chat_prompts)]}
               for i in range(REQUESTS)]
    ours = llm.generate(prompts, params, use_tqdm=False)
    monkeypatch.setattr(model, "cpu_decode", None)
    ref = llm.generate(prompts, params, use_tqdm=False)
    assert sorted(set(rows)) == list(range(1, REQUESTS + 1))  # every step after the prefill
    for a, b in zip(ours, ref):
        assert a.outputs[0].token_ids == b.outputs[0].token_ids
        assert a.outputs[0].logprobs == b.outputs[0].logprobs


def test_only_qualifying_models_get_it(tiny_llama, tmp_path):
    """A plain Llama gets it whatever holds its weights; one with q/k/v biases (which the
    C++ step does not add) runs the Python layers."""
    tiny = LLM(str(tiny_llama[0]), skip_tokenizer_init=True, dtype="float32",
               kv_cache_memory_bytes=16 << 20)
    assert tiny.engine.executor.driver_worker.model.cpu_decode is not None
    import transformers

    config = transformers.LlamaConfig(
        vocab_size=96, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, attention_bias=True)
    transformers.LlamaForCausalLM(config).save_pretrained(tmp_path)
    biased = LLM(str(tmp_path), skip_tokenizer_init=True, dtype="float32",
                 kv_cache_memory_bytes=16 << 20)
    assert biased.engine.executor.driver_worker.model.cpu_decode is None
    assert biased.engine.executor.driver_worker.model.layers[0].self_attn.qkv_proj.bias is not None
