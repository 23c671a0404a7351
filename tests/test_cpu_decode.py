"""The C++ decode step (models/cpu_decode.py, csrc/decode_layers_cpu.cpp) against the
Python layers it replaces: bit-equal logprobs and tokens, and which models it serves."""

from __future__ import annotations

import pytest

from pagedserve import LLM, SamplingParams
from pagedserve.cpu_ops import cpu_ops_available
from pagedserve.models.cpu_decode import CpuDecodeLayers

pytestmark = pytest.mark.skipif(not cpu_ops_available(), reason="C++ CPU kernels unavailable")


@pytest.fixture(scope="module", params=["float32", "bfloat16"])
def llm_gguf(request):
    # no prefix caching: the second run must prefill exactly as the first
    return LLM(dtype=request.param, max_model_len=512, kv_cache_memory_bytes=128 << 20,
               enable_prefix_caching=False)


def test_decode_layers_equal_the_python_layers(llm_gguf, chat_prompts, monkeypatch):
    """Five requests decoding together (steps of 5 rows, then fewer as requests of other
    lengths finish), up to 24 tokens each with their top-3 logprobs: the same floats both
    ways."""
    model = llm_gguf.engine.model
    fast = model.cpu_decode
    assert fast is not None
    rows = []
    run = CpuDecodeLayers.__call__
    monkeypatch.setattr(CpuDecodeLayers, "__call__",
                        lambda self, *args: rows.append(args[1].shape[0]) or run(self, *args))
    params = [SamplingParams(temperature=0, max_tokens=24 - 3 * i, ignore_eos=True, logprobs=3)
              for i in range(5)]
    prompts = [{"prompt_token_ids": p} for p in chat_prompts[:5]]
    ours = llm_gguf.generate(prompts, params, use_tqdm=False)
    monkeypatch.setattr(model, "cpu_decode", None)
    ref = llm_gguf.generate(prompts, params, use_tqdm=False)
    assert sorted(set(rows)) == [1, 2, 3, 4, 5]  # every step after the prefill
    for a, b in zip(ours, ref):
        assert a.outputs[0].token_ids == b.outputs[0].token_ids
        assert a.outputs[0].logprobs == b.outputs[0].logprobs


def test_only_qualifying_engines_get_it(llm, tiny_llama):
    """The exact engine and a safetensors model have no GGUF blocks: Python layers."""
    assert llm.engine.model.cpu_decode is None  # --quantization none
    tiny = LLM(str(tiny_llama[0]), skip_tokenizer_init=True, dtype="float32",
               kv_cache_memory_bytes=16 << 20)
    assert tiny.engine.model.cpu_decode is None
