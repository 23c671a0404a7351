"""Tensor parallelism (issue 15): TP 2/3 ranks over gloo give TP 1's outputs.

Float32 noise floor, measured before choosing the tolerance (2026-12-01, this 2-core
machine): splitting o_proj/down/embedding sums over ranks and all-reducing them changes the
summation order; the full-vocabulary logprobs of TP 2 differ from TP 1 by at most
~5e-6 on the tiny random models here (~1e-5 on SmolLM2, 30 layers), so 1e-4 is well above
the noise and far below any real error (a wrong shard is off by > 0.1).
"""

from __future__ import annotations

import asyncio
import os
import signal
import time

import httpx
import pytest
import torch
import transformers

from pagedserve import LLM, SamplingParams
from pagedserve.args import EngineArgs
from pagedserve.distributed.sharding import kv_head_range, shard_config, shard_weights
from pagedserve.engine.async_engine import AsyncLLM
from pagedserve.engine.request_stream import EngineClosedError, EngineStepError
from pagedserve.entrypoints.openai.app import build_app
from pagedserve.entrypoints.openai.serving_engine import ServingContext
from pagedserve.executor.base import EngineDeadError


def _tiny_gemma3(path):
    """Gemma 3 with 4 q heads and ONE KV head (replicated over TP 2), an odd vocabulary
    (97: the last rank's shard is padded), tied embeddings and logit soft-capping."""
    torch.manual_seed(1)
    config = transformers.Gemma3TextConfig(
        vocab_size=97, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=1, head_dim=16, max_position_embeddings=128,
        query_pre_attn_scalar=16, sliding_window=8, final_logit_softcapping=30.0,
        rope_parameters={"sliding_attention": {"rope_type": "default", "rope_theta": 1e4},
                         "full_attention": {"rope_type": "default", "rope_theta": 1e6}},
        pad_token_id=0, bos_token_id=1, eos_token_id=2)
    model = transformers.Gemma3ForCausalLM(config).eval()
    with torch.no_grad():
        for p in model.parameters():
            p.normal_(0, 0.2)
    model.save_pretrained(path)
    return path


# A 12-token shared prefix (prefix caching), prompts longer than the step budget (chunked
# prefill), a pool too small for all of them at once (preemption), and n=2 (copy-on-write).
PROMPTS = [[1] + [7, 3, 11, 5, 8, 13, 21, 4, 9, 6, 10] + [20 + i] * (3 + 3 * i) for i in range(6)]
ENGINE = {"dtype": "float32", "skip_tokenizer_init": True, "block_size": 4, "max_model_len": 64,
          "num_gpu_blocks_override": 16, "max_num_batched_tokens": 16, "max_num_seqs": 4}


GREEDY = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True)


def _params(vocab: int) -> list[SamplingParams]:
    full = {"temperature": 0, "max_tokens": 12, "ignore_eos": True, "logprobs": vocab}
    return [SamplingParams(**full, prompt_logprobs=vocab if i == 0 else None, n=2 if i == 1 else 1)
            for i in range(len(PROMPTS))]


def _run(path, vocab: int, **kwargs) -> tuple[list, int]:
    llm = LLM(str(path), max_logprobs=vocab, **ENGINE, **kwargs)
    try:
        outs = llm.generate([{"prompt_token_ids": p} for p in PROMPTS], _params(vocab),
                            use_tqdm=False)
        return outs, llm.engine.scheduler.num_preemptions
    finally:
        llm.engine.shutdown()


def _assert_same(ref, got, tol: float = 1e-4) -> None:
    worst = 0.0
    for a, b in zip(ref, got, strict=True):
        for ca, cb in zip(a.outputs, b.outputs, strict=True):
            assert ca.token_ids == cb.token_ids
            for pa, pb in zip(ca.logprobs, cb.logprobs, strict=True):
                assert pa.keys() == pb.keys()
                worst = max(worst, max(abs(pa[t].logprob - pb[t].logprob) for t in pa))
        for pa, pb in zip(a.prompt_logprobs or [], b.prompt_logprobs or [], strict=True):
            if pa is not None:
                worst = max(worst, max(abs(pa[t].logprob - pb[t].logprob) for t in pa))
    assert worst < tol, worst


@pytest.fixture(scope="module")
def gemma_path(tmp_path_factory):
    return _tiny_gemma3(tmp_path_factory.mktemp("tiny_gemma3"))


def test_tp2_matches_tp1_llama(tiny_llama):
    path, _ = tiny_llama
    ref, preempted_ref = _run(path, 96)
    got, preempted = _run(path, 96, tensor_parallel_size=2)
    assert preempted_ref > 0 and preempted == preempted_ref  # the same schedule
    assert ref[0].prompt_logprobs is not None and len(ref[1].outputs) == 2
    _assert_same(ref, got)


def test_tp2_replicated_kv_head_gemma3(gemma_path):
    ref, _ = _run(gemma_path, 97)
    got, _ = _run(gemma_path, 97, tensor_parallel_size=2, distributed_executor_backend="mp")
    _assert_same(ref, got)


def test_refuses_sizes_that_do_not_divide(tiny_llama, gemma_path, monkeypatch):
    """Refused before any rank starts (no process to spawn and tear down)."""
    from pagedserve.executor.multiproc import MultiprocExecutor

    monkeypatch.setattr(MultiprocExecutor, "__init__",
                        lambda *args: pytest.fail("ranks started before the checks"))
    with pytest.raises(ValueError, match="tensor_parallel_size 3 does not divide the "
                                         "model's 4 attention heads"):
        LLM(str(tiny_llama[0]), tensor_parallel_size=3, skip_tokenizer_init=True)
    with pytest.raises(ValueError, match="'uni' runs one rank; tensor_parallel_size is 2"):
        LLM(str(gemma_path), tensor_parallel_size=2, distributed_executor_backend="uni")
    with pytest.raises(ValueError, match="distributed_executor_backend must be one of uni, "
                                         "mp, ray; got 'nccl'"):
        LLM(str(gemma_path), distributed_executor_backend="nccl")
    with pytest.raises(ValueError, match="data_parallel_size > 1 runs replicas"):
        LLM(str(gemma_path), data_parallel_size=2, skip_tokenizer_init=True)
    config = transformers.LlamaConfig(num_attention_heads=8, num_key_value_heads=6,
                                      intermediate_size=64)
    with pytest.raises(ValueError, match="tensor_parallel_size 4 and the model's 6 KV heads"):
        shard_config(config, 4)


def test_kv_heads_split_or_replicated():
    config = transformers.LlamaConfig(num_attention_heads=8, num_key_value_heads=2)
    assert [kv_head_range(config, r, 2) for r in range(2)] == [(0, 1), (1, 1)]
    # 4 ranks, 2 KV heads: q heads 0-3 (ranks 0, 1) read KV head 0, q heads 4-7 KV head 1
    assert [kv_head_range(config, r, 4) for r in range(4)] == [(0, 1), (0, 1), (1, 1), (1, 1)]
    local = shard_config(config, 4)
    assert (local.num_attention_heads, local.num_key_value_heads, local.head_dim) == (2, 1, 512)


def test_shards_put_back_together_are_the_checkpoint():
    """Row shards (q, k, gate), column shards (o, down) and padded vocabulary shards
    concatenate to the full tensors; a row-parallel bias is added once (rank 0)."""
    config = transformers.LlamaConfig(vocab_size=7, hidden_size=8, intermediate_size=6,
                                      num_attention_heads=4, num_key_value_heads=2)
    full = {
        "model.layers.0.self_attn.q_proj.weight": torch.randn(8, 8),
        "model.layers.0.self_attn.k_proj.weight": torch.randn(4, 8),
        "model.layers.0.self_attn.o_proj.weight": torch.randn(8, 8),
        "model.layers.0.self_attn.o_proj.bias": torch.randn(8),
        "model.layers.0.mlp.gate_proj.weight": torch.randn(6, 8),
        "model.layers.0.mlp.down_proj.weight": torch.randn(8, 6),
        "model.embed_tokens.weight": torch.randn(7, 8),
        "model.norm.weight": torch.randn(8),
    }
    shards = [dict(shard_weights(full.items(), config, r, 2)) for r in range(2)]
    for name, tensor in full.items():
        parts = [s[name] for s in shards]
        if "o_proj.weight" in name or "down_proj" in name:
            assert torch.equal(torch.cat(parts, dim=1), tensor)
        elif "bias" in name:
            assert torch.equal(parts[0], tensor) and not parts[1].any()
        elif "norm" in name:
            assert all(torch.equal(p, tensor) for p in parts)
        else:
            whole = torch.cat(parts)
            assert torch.equal(whole[: tensor.shape[0]], tensor) and not whole[tensor.shape[0]:].any()


def test_tp3_smollm2_matches_tp1(llm, chat_prompts):
    """The bundled SmolLM2 (9 heads, 3 KV heads) over 3 ranks: TP 1's greedy outputs."""
    params = SamplingParams(temperature=0, max_tokens=8)
    prompts = [{"prompt_token_ids": p} for p in chat_prompts[1:3]]
    ref = llm.generate(prompts, params, use_tqdm=False)
    tp3 = LLM(dtype="float32", kv_cache_memory_bytes=64 << 20, tensor_parallel_size=3,
              max_model_len=256)
    try:
        got = tp3.generate(prompts, params, use_tqdm=False)
    finally:
        tp3.engine.shutdown()
    assert [o.outputs[0].token_ids for o in got] == [o.outputs[0].token_ids for o in ref]


@pytest.fixture
def long_model(tmp_path):
    """A tiny Llama with room for long generations (4096 positions)."""
    torch.manual_seed(0)
    config = transformers.LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64,
                                      num_hidden_layers=2, num_attention_heads=2,
                                      num_key_value_heads=2, max_position_embeddings=4096)
    transformers.LlamaForCausalLM(config).save_pretrained(tmp_path)
    return str(tmp_path)


def test_killed_rank_fails_requests_and_health(long_model):
    """SIGKILL of rank 1 mid-request: the request ends with an error naming the rank, the
    server's /health (the real route, over ASGI) answers 503, new requests are refused."""
    engine = AsyncLLM.from_engine_args(EngineArgs(
        model=long_model, dtype="float32", skip_tokenizer_init=True,
        num_gpu_blocks_override=512, tensor_parallel_size=2))
    (rank,) = engine.engine.executor.procs
    app = build_app(ServingContext(engine=engine, served_model_name="m", model_aliases={"m"},
                                   model_root=long_model, tokenizer=None, max_model_len=4096))
    long = SamplingParams(max_tokens=4000, ignore_eos=True)

    async def main():
        transport = httpx.ASGITransport(app=app)
        async with httpx.AsyncClient(transport=transport, base_url="http://test") as http:
            assert (await http.get("/health")).status_code == 200
            stream = await engine.add_request("r", {"prompt_token_ids": [1, 2, 3]}, long)
            await stream.get()  # the request runs
            os.kill(rank.pid, signal.SIGKILL)
            t0 = time.monotonic()
            with pytest.raises(EngineStepError, match=r"engine is dead: tensor-parallel "
                                                      r"rank 1 \(pid \d+\) exited with code -9"):
                async for _ in stream:
                    pass
            while (await http.get("/health")).status_code != 503:
                assert time.monotonic() - t0 < 30, "/health still 200 after 30 s"
                await asyncio.sleep(0.1)
            with pytest.raises(EngineClosedError):
                await engine.add_request("r2", {"prompt_token_ids": [1]}, long)

    try:
        asyncio.run(main())
    finally:
        engine.shutdown()


def test_hung_rank_fails_the_step_after_the_timeout(tiny_llama):
    """A rank that stops answering (SIGSTOP) fails the next step after
    ``distributed_timeout``; the engine is then dead for good."""
    llm = LLM(str(tiny_llama[0]), **ENGINE, tensor_parallel_size=2, distributed_timeout=3)
    (rank,) = llm.engine.executor.procs
    os.kill(rank.pid, signal.SIGSTOP)
    try:
        with pytest.raises(EngineDeadError, match="--distributed-timeout 3 s"):
            llm.generate([{"prompt_token_ids": PROMPTS[0]}], GREEDY, use_tqdm=False)
        assert not llm.engine.is_healthy()
        with pytest.raises(EngineDeadError):  # no later step runs
            llm.generate([{"prompt_token_ids": PROMPTS[0]}], GREEDY, use_tqdm=False)
    finally:
        rank.kill()
        llm.engine.shutdown()


@pytest.fixture(scope="session")
def ray_cluster():
    """One Ray cluster of two nodes ("machines") on this machine, 1 CPU each, shared by the
    Ray tests."""
    ray = pytest.importorskip("ray")
    from ray.cluster_utils import Cluster

    cluster = Cluster(initialize_head=True, head_node_args={"num_cpus": 1})
    cluster.add_node(num_cpus=1)
    ray.init(address=cluster.address)
    yield cluster
    ray.shutdown()
    cluster.shutdown()


def test_tp2_over_two_ray_nodes_matches_tp1(tiny_llama, ray_cluster):
    """Rank 0 (this process) on the head node, rank 1 as an actor on the other node; the
    actor runs this checkout's pagedserve."""
    import ray

    import pagedserve

    path, _ = tiny_llama
    ref, _ = _run(path, 96)
    llm = LLM(str(path), max_logprobs=96, **ENGINE, tensor_parallel_size=2,
              distributed_executor_backend="ray")
    try:
        executor = llm.engine.executor
        head = ray_cluster.head_node.node_id
        assert executor.rank_nodes[0] == head != executor.rank_nodes[1]
        (actor,) = executor.actors
        assert ray.get(actor.node_id.remote()) == executor.rank_nodes[1]
        assert ray.get(actor.package_file.remote()) == pagedserve.__file__
        got = llm.generate([{"prompt_token_ids": p} for p in PROMPTS], _params(96),
                           use_tqdm=False)
    finally:
        llm.engine.shutdown()
    _assert_same(ref, got)


def test_dp2_ray_replicas_on_two_nodes(tiny_llama, ray_cluster):
    """Two data-parallel replicas as Ray actors, one per node; both serve, outputs as one
    engine's."""
    from pagedserve.engine.data_parallel import DataParallelLLM

    path = str(tiny_llama[0])
    prompts = [{"prompt_token_ids": p} for p in PROMPTS]
    ref = [o.outputs[0].token_ids for o in LLM(path, **ENGINE).generate(
        prompts, GREEDY, use_tqdm=False)]
    args = EngineArgs(model=path, **ENGINE, data_parallel_size=2,
                      distributed_executor_backend="ray")
    dp = DataParallelLLM(args)
    try:
        assert len(set(dp.replica_nodes)) == 2

        async def main():
            async def one(i):
                async for out in dp.generate(prompts[i], GREEDY, f"r{i}"):
                    final = out
                return final.outputs[0].token_ids
            return await asyncio.gather(*(one(i) for i in range(len(prompts))))

        assert asyncio.run(main()) == ref
    finally:
        dp.shutdown()


def test_ray_fails_at_once_when_the_cluster_has_too_few_cpus(tiny_llama, ray_cluster):
    """4 ranks on a cluster of 2 CPUs could never be placed: a RuntimeError naming both
    numbers before any actor starts, not after the 600 s start-up timeout."""
    start = time.monotonic()
    with pytest.raises(RuntimeError, match=r"^4 tensor-parallel ranks need 4 CPUs of the Ray "
                                           r"cluster \(one each\); it has 2 \(\d+ free\)"):
        LLM(str(tiny_llama[0]), **ENGINE, tensor_parallel_size=4,
            distributed_executor_backend="ray")
    assert time.monotonic() - start < 120  # the placement group's wait is 600 s


def test_local_ray_declares_a_cpu_per_rank(monkeypatch):
    """With no cluster to join, the local Ray instance gets max(cores, ranks) logical CPUs
    (so 3 ranks start on 2 cores, as with mp); with RAY_ADDRESS, ray.init's own rules."""
    ray = pytest.importorskip("ray")
    from pagedserve.executor import ray_executor

    calls = []

    def fake_init(**kwargs):
        calls.append(kwargs)
        if kwargs.get("address") == "auto":
            raise ConnectionError("Could not find any running Ray instance.")

    monkeypatch.setattr(ray, "is_initialized", lambda: False)
    monkeypatch.setattr(ray, "init", fake_init)
    monkeypatch.delenv("RAY_ADDRESS", raising=False)
    cores = len(os.sched_getaffinity(0))
    env = ray_executor.actor_runtime_env()
    for ranks, declared in [(cores + 1, cores + 1), (1, cores)]:
        calls.clear()
        ray_executor.init_ray(ranks)
        assert calls == [{"address": "auto", "runtime_env": env},
                         {"num_cpus": declared, "runtime_env": env}]
    monkeypatch.setenv("RAY_ADDRESS", "10.0.0.1:6379")
    calls.clear()
    ray_executor.init_ray(cores + 1)
    assert calls == [{"runtime_env": env}]
