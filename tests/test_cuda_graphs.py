"""Decode steps through ``DecodeGraphs``: padding, static buffers, the fixed split layout.

Without CUDA nothing is captured and ``DecodeGraphs.run`` calls the model eagerly on its
static buffers (the Triton kernels interpreted on CPU): everything but the replay. The
``cuda``-marked test replays real graphs and compares them with ``enforce_eager=True``.
"""

from __future__ import annotations

import argparse

import pytest
import torch

CUDA = torch.cuda.is_available()
pytest.importorskip("triton")  # TRITON_INTERPRET=1 is set in conftest.py when there is no GPU

from pagedserve import LLM, SamplingParams
from pagedserve.args import EngineArgs
from pagedserve.attention import triton_attn
from pagedserve.worker.cuda_graphs import DecodeGraphs, capture_sizes

BLOCK_SIZE = 4
MAX_MODEL_LEN = 64


def test_capture_sizes():
    assert capture_sizes(1) == [1]
    assert capture_sizes(3) == [1, 2, 4]
    assert capture_sizes(5) == [1, 2, 4, 8]
    assert capture_sizes(8) == [1, 2, 4, 8]
    assert capture_sizes(9) == [1, 2, 4, 8, 16]
    assert capture_sizes(1000)[-3:] == [240, 248, 256]
    with pytest.raises(ValueError, match="max_num_seqs"):
        capture_sizes(0)


def test_enforce_eager_flag():
    parser = EngineArgs.add_cli_args(argparse.ArgumentParser())
    assert EngineArgs.from_cli_args(parser.parse_args(["--enforce-eager"])).enforce_eager
    assert not EngineArgs.from_cli_args(parser.parse_args([])).enforce_eager


def _engine(path, device: str = "cpu", **kwargs) -> LLM:
    return LLM(str(path), skip_tokenizer_init=True, dtype="float32", device=device,
               attention_backend="triton", block_size=BLOCK_SIZE, num_gpu_blocks_override=64,
               max_model_len=MAX_MODEL_LEN, max_num_batched_tokens=16, max_num_seqs=8, **kwargs)


def _greedy(llm: LLM, prompts, max_tokens: list[int]):
    """Greedy tokens of each prompt and the logprob of every chosen token."""
    params = [SamplingParams(temperature=0, max_tokens=n, ignore_eos=True, logprobs=1)
              for n in max_tokens]
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    tokens = [o.outputs[0].token_ids for o in outs]
    logprobs = [lp[t].logprob for o in outs
                for t, lp in zip(o.outputs[0].token_ids, o.outputs[0].logprobs)]
    return tokens, logprobs


@pytest.fixture
def checked_runs(monkeypatch):
    """Spy on ``DecodeGraphs.run``: records ``(num_seqs, padded size)`` of every call and
    checks that the call changed no KV cache slot but the real rows' own."""
    calls = []
    run = DecodeGraphs.run

    def spy(self, input_ids, positions, meta):
        before = [cache.clone() for cache in self.kv_caches]
        hidden = run(self, input_ids, positions, meta)
        written = meta.slot_mapping.tolist()
        for old, new in zip(before, self.kv_caches):
            keep = torch.ones(old.shape[1] * old.shape[2], dtype=torch.bool)
            keep[written] = False
            keep = keep.to(old.device)
            assert torch.equal(old.flatten(1, 2)[:, keep], new.flatten(1, 2)[:, keep])
        calls.append((meta.num_seqs, self.padded_size(meta.num_seqs)))
        return hidden

    monkeypatch.setattr(DecodeGraphs, "run", spy)
    return calls


def _prompts(n: int, max_len: int) -> list[list[int]]:
    """``n`` random prompts of 1..max_len tokens."""
    gen = torch.Generator().manual_seed(torch.seed() % 2**31)
    return [torch.randint(0, 96, (int(k),), generator=gen).tolist()
            for k in torch.randint(1, max_len + 1, (n,), generator=gen)]


# (prompts, max_tokens): all prompts fit one 16-token step, so every later step is a pure
# decode of the requests still running (3 -> 4; 5 -> 8, then 4 and 3 -> 4); a lone long
# context leaves most of the decode splits empty (4 splits of 16 tokens for 64).
def _cases():
    return [(_prompts(3, 5), [5, 5, 5]), (_prompts(5, 3), [6, 6, 5, 4, 6]),
            (_prompts(1, 14), [8])]


@pytest.mark.skipif(not triton_attn.INTERPRET, reason="CPU needs TRITON_INTERPRET=1")
def test_padded_decode_matches_eager(tiny_llama, checked_runs):
    path, _ = tiny_llama
    eager = _engine(path)
    assert eager.engine.executor.driver_worker.model_runner.decode_graphs is None  # never on CPU
    llm = _engine(path)
    runner = llm.engine.executor.driver_worker.model_runner
    runner.decode_graphs = DecodeGraphs(runner.model, runner.kv_caches, capture_sizes(8),
                                        MAX_MODEL_LEN, BLOCK_SIZE, "cpu")
    for prompts, max_tokens in _cases():
        got = _greedy(llm, prompts, max_tokens)
        expected = _greedy(eager, prompts, max_tokens)
        assert got[0] == expected[0]
        assert got[1] == pytest.approx(expected[1], abs=1e-4)
    assert {(1, 1), (3, 4), (4, 4), (5, 8)} <= set(checked_runs)
    stats = llm.kv_cache_stats()
    assert stats.used_blocks == 0 and stats.free_blocks == stats.total_blocks


@pytest.mark.cuda
@pytest.mark.skipif(not CUDA, reason="needs a CUDA device")
def test_cuda_graphs_match_enforce_eager(tiny_llama, checked_runs):
    path, _ = tiny_llama
    eager = _engine(path, "cuda", enforce_eager=True)
    assert eager.engine.executor.driver_worker.model_runner.decode_graphs is None
    llm = _engine(path, "cuda")
    graphs = llm.engine.executor.driver_worker.model_runner.decode_graphs
    assert sorted(graphs.graphs) == [1, 2, 4, 8]
    for prompts, max_tokens in [*_cases(), (_prompts(8, 2), [12] * 8)]:
        got = _greedy(llm, prompts, max_tokens)
        expected = _greedy(eager, prompts, max_tokens)
        assert got[0] == expected[0]
        assert got[1] == pytest.approx(expected[1], abs=1e-4)
    assert {(1, 1), (3, 4), (4, 4), (5, 8), (8, 8)} <= set(checked_runs)
