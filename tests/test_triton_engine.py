"""The whole engine on the Triton backend, on a tiny random-weight Llama.

Without CUDA it runs under Triton's interpreter on CPU (``TRITON_INTERPRET=1``, set in
conftest.py before triton is imported); with CUDA the ``cuda``-marked tests run the
compiled kernels. Greedy tokens must equal the CPU torch backend's and transformers' own.
"""

from __future__ import annotations

import pytest
import torch

CUDA = torch.cuda.is_available()
pytest.importorskip("triton")  # TRITON_INTERPRET=1 is set in conftest.py when there is no GPU

from conftest import hf_greedy

from pagedserve import LLM, SamplingParams
from pagedserve.attention import triton_attn
from pagedserve.attention.triton_attn import TritonAttention
from pagedserve.config import CacheConfig
from pagedserve.worker import kv_cache

BLOCK_SIZE = 4
MAX_TOKENS = 6
interpreted = pytest.mark.skipif(
    not triton_attn.INTERPRET, reason="kernels compiled for CUDA; CPU needs TRITON_INTERPRET=1")
needs_cuda = pytest.mark.skipif(not CUDA, reason="needs a CUDA device")


@pytest.fixture(scope="module")
def prompts():
    gen = torch.Generator().manual_seed(torch.seed() % 2**31)
    shared = torch.randint(0, 96, (10,), generator=gen).tolist()
    return [
        torch.randint(0, 96, (5,), generator=gen).tolist(),
        shared + torch.randint(0, 96, (13,), generator=gen).tolist(),  # 23: chunked
        torch.randint(0, 96, (2,), generator=gen).tolist(),
        shared + torch.randint(0, 96, (3,), generator=gen).tolist(),  # shares 2 blocks
    ]


def _engine(path, backend: str, device: str = "cpu") -> LLM:
    # A 16-token step budget splits the 23-token prompt into chunks that end mid-block.
    return LLM(str(path), skip_tokenizer_init=True, dtype="float32", device=device,
               attention_backend=backend, block_size=BLOCK_SIZE, num_gpu_blocks_override=48,
               max_model_len=64, max_num_batched_tokens=16, max_num_seqs=4)


def _greedy(llm: LLM, prompts) -> tuple[list[list[int]], list[float]]:
    """Greedy tokens of each prompt, and the logprobs of every chosen token (these move
    with any attention error, where argmax may not)."""
    params = SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True, logprobs=1)
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    tokens = [o.outputs[0].token_ids for o in outs]
    logprobs = [lp[t].logprob for o in outs for t, lp in zip(o.outputs[0].token_ids,
                                                              o.outputs[0].logprobs)]
    return tokens, logprobs


def _check_same(got, expected) -> None:
    assert got[0] == expected[0]
    assert got[1] == pytest.approx(expected[1], abs=1e-4)


@interpreted
def test_engine_greedy_matches_torch_and_transformers(tiny_llama, prompts, monkeypatch):
    path, hf_model = tiny_llama
    seen = []  # (cached tokens, new tokens) of every sequence the kernels saw
    forward = TritonAttention.forward

    def spy(self, query, kv_cache, meta, scale, sliding_window=None):
        seen.extend((s - q, q) for s, q in zip(meta.seq_lens_list, meta.query_lens_list))
        return forward(self, query, kv_cache, meta, scale, sliding_window)

    monkeypatch.setattr(TritonAttention, "forward", spy)
    llm = _engine(path, "triton")
    expected = _greedy(_engine(path, "torch"), prompts)
    _check_same(_greedy(llm, prompts), expected)
    # Again in reverse order: now the shared prefix comes from the prefix cache.
    rev = _greedy(_engine(path, "torch"), prompts[::-1])
    _check_same(_greedy(llm, prompts[::-1]), rev)
    assert rev[0] == expected[0][::-1]
    assert expected[0] == [hf_greedy(hf_model, p, MAX_TOKENS, None) for p in prompts]
    assert any(q == 1 for _, q in seen), "decodes"
    assert any(q > 1 and c % BLOCK_SIZE for c, q in seen), "a chunk after a mid-block prefix"
    assert llm.kv_cache_stats().prefix_cache_hits > 0
    stats = llm.kv_cache_stats()
    assert stats.used_blocks == 0 and stats.free_blocks == stats.total_blocks


def test_dummy_load_format(tiny_llama):
    path, hf_model = tiny_llama
    llm = LLM(str(path), skip_tokenizer_init=True, dtype="float32", device="cpu",
              load_format="dummy", num_gpu_blocks_override=32, max_model_len=64)
    weight = llm.engine.executor.driver_worker.model.embed_tokens.weight
    assert weight.abs().max() <= 1e-3 and weight.std() > 1e-4
    assert not torch.allclose(weight, hf_model.model.embed_tokens.weight)
    tokens, _ = _greedy(llm, [[1, 2, 3]])
    assert len(tokens[0]) == MAX_TOKENS
    with pytest.raises(ValueError, match="load_format"):
        LLM(str(path), skip_tokenizer_init=True, device="cpu", load_format="pt",
            num_gpu_blocks_override=32, max_model_len=64)


def test_cuda_kv_budget_arithmetic(monkeypatch):
    """The sizing formula with torch.cuda faked: u * total - in use - activation peak."""
    gib = 1 << 30
    calls = []
    monkeypatch.setattr(torch.cuda, "synchronize", lambda device=None: None)
    monkeypatch.setattr(torch.cuda, "empty_cache", lambda: calls.append("empty"))
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda device=None: (100 * gib, 140 * gib))
    total, budget, source = kv_cache.cuda_kv_budget(CacheConfig(gpu_memory_utilization=0.5),
                                                    3 * gib, "cuda")
    assert (total, budget, source) == (140 * gib, 70 * gib - 40 * gib - 3 * gib,
                                       "gpu_memory_utilization")
    assert calls == ["empty"]  # cached blocks are returned before free memory is read
    _, budget, _ = kv_cache.cuda_kv_budget(CacheConfig(), 0, "cuda")
    assert budget == int(0.9 * 140 * gib) - 40 * gib  # vLLM's default utilization

    allocated = [5 * gib]
    monkeypatch.setattr(torch.cuda, "reset_peak_memory_stats", lambda device=None: None)
    monkeypatch.setattr(torch.cuda, "memory_allocated", lambda device=None: allocated[0])
    monkeypatch.setattr(torch.cuda, "max_memory_allocated", lambda device=None: 8 * gib)
    assert kv_cache.measure_cuda_peak(lambda: None, "cuda") == 3 * gib


@pytest.mark.cuda
@needs_cuda
def test_engine_on_cuda_matches_cpu_and_transformers(tiny_llama, prompts):
    path, hf_model = tiny_llama
    llm = _engine(path, "auto", "cuda")
    assert llm.engine.executor.driver_worker.model_runner.device.startswith("cuda")
    for order in (prompts, prompts[::-1]):
        expected = _greedy(_engine(path, "torch", "cpu"), order)
        _check_same(_greedy(llm, order), expected)
        assert expected[0] == [hf_greedy(hf_model, p, MAX_TOKENS, None) for p in order]


@pytest.mark.cuda
@needs_cuda
def test_cuda_memory_sizing_on_device(tiny_llama):
    """Real sizing on the device: the pool fits in u * total minus what is in use."""
    path, _ = tiny_llama
    u = 0.02
    llm = LLM(str(path), skip_tokenizer_init=True, dtype="float32", device="cuda",
              block_size=16, gpu_memory_utilization=u, max_model_len=64)
    prof = llm.engine.executor.driver_worker.memory_profile
    assert prof.source == "gpu_memory_utilization"
    assert 0 < prof.peak_activation < prof.total
    assert 0 < prof.kv_budget < u * prof.total
    assert llm.engine.num_blocks == prof.kv_budget // prof.bytes_per_block
    free, total = torch.cuda.mem_get_info()
    # weights, context and pool (allocations round up to 2 MiB); the activations come and go
    assert total - free <= u * total + (16 << 20)
    assert len(_greedy(llm, [[1, 2, 3]])[0][0]) == MAX_TOKENS
