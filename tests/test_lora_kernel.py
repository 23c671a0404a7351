"""Multi-LoRA units without a model (issue 30): the grouped kernel
``torch.ops.pagedserve.lora_add`` against a float64 reference (fused shards, per-slot
ranks, rows without an adapter untouched, float32 and bfloat16 outputs) and its row
invariance; ``LoRAStack``'s PyTorch path (the one off CPU) against the same reference;
the scheduler's first-come-first-served admission across adapters (``max_loras``); the
``LoRAConfig`` limits.

The engine side (PEFT as the reference) is in test_lora.py.
"""

from __future__ import annotations

import pytest
import torch

from pagedserve.config import SchedulerConfig
from pagedserve.core.kv_cache_manager import KVCacheManager
from pagedserve.core.scheduler import Scheduler
from pagedserve.cpu_ops import load_cpu_ops
from pagedserve.lora.adapter import LoRATarget, ProjectionLoRA
from pagedserve.lora.config import LoRAConfig
from pagedserve.lora.layers import LoRAStack
from pagedserve.request import Request
from pagedserve.sampling_params import SamplingParams

# A fused q/k/v-like projection: three shards of 24, 8 and 8 output columns, K = 50 (not a
# multiple of the kernel's 16-wide dot product: its tail runs too), four slots of width
# R = 6 with ranks 6, 2, 0 (an adapter that leaves this projection alone) and 5.
SHARDS = (24, 8, 8)
N = sum(SHARDS)
K = 50
R = 6
RANKS = [6, 2, 0, 5]
COLS = [0, 24, 32, 40]
# 9 rows: slots of every kind, -1 (no adapter) among them, the same slot in distant rows
SLOTS = [0, -1, 3, 1, 0, 2, -1, 3, 1]


def _stack(seed: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """A, Bt, ranks, shard_cols in the kernel's layout. The rows of A and Bt past each
    slot's rank hold large garbage: the kernel must stop at the rank (its contract)."""
    gen = torch.Generator().manual_seed(seed)
    slots = len(RANKS)
    a = torch.randn(slots, len(SHARDS) * R, K, generator=gen) * 0.3
    bt = torch.randn(slots, R, N, generator=gen) * 0.3
    for s, rank in enumerate(RANKS):
        for i in range(len(SHARDS)):
            a[s, i * R + rank : (i + 1) * R] = 1e3
        bt[s, rank:] = -1e3
    return a, bt, torch.tensor(RANKS), torch.tensor(COLS)


def _reference(out: torch.Tensor, x: torch.Tensor, slots: list[int], a, bt) -> torch.Tensor:
    """``out + (x @ A[s]^T) @ Bt[s]`` per row in float64, shard by shard: columns of shard
    i read A's rows ``[i * R, i * R + rank)``; rows of slot -1 unchanged."""
    want = out.double().clone()
    for t, s in enumerate(slots):
        if s < 0:
            continue
        rank = RANKS[s]
        for i in range(len(SHARDS)):
            lo, hi = COLS[i], COLS[i + 1]
            h = x[t].double() @ a[s, i * R : i * R + rank].double().T
            want[t, lo:hi] += h @ bt[s, :rank, lo:hi].double()
    return want


def _inputs(dtype: torch.dtype, seed: int = 1, rows: int = len(SLOTS)):
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(rows, K, generator=gen).to(dtype)
    out = torch.randn(rows, N, generator=gen).to(dtype)
    return out, x


@pytest.mark.parametrize("weights", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_lora_add_matches_float64_reference(dtype, weights):
    """Outputs in float32 and bfloat16, adapters held in float32 and bfloat16
    (``--lora-dtype``; the reference reads the same rounded values)."""
    ops = load_cpu_ops()
    a, bt, ranks, cols = _stack(0)
    a, bt = a.to(weights), bt.to(weights)
    out, x = _inputs(dtype)
    base = out.clone()
    want = _reference(out, x, SLOTS, a, bt)
    ops.lora_add(out, x, torch.tensor(SLOTS), a, bt, ranks, cols)
    assert out.dtype == dtype
    # the term is summed in float32 and rounded once into out's dtype
    tol = {"atol": 1e-5, "rtol": 1e-5} if dtype == torch.float32 else {"atol": 2e-2, "rtol": 8e-3}
    torch.testing.assert_close(out.double(), want, **tol)
    for t, s in enumerate(SLOTS):
        if s < 0 or RANKS[s] == 0:  # no adapter, or one that leaves this projection alone
            assert torch.equal(out[t], base[t]), t
        else:
            assert not torch.equal(out[t], base[t]), t  # the term is not negligible
    # a rank-2 slot's term is not its rank-6 neighbour's: the slots really differ
    assert not torch.allclose(out[3], base[3]) and not torch.allclose(out[2], base[2])


def test_lora_add_strided_out_rows():
    """``out`` may be a view with a row stride wider than N (a slice of a bigger buffer):
    only its own columns change."""
    ops = load_cpu_ops()
    a, bt, ranks, cols = _stack(2)
    wide, x = _inputs(torch.float32, seed=3)
    buffer = torch.randn(len(SLOTS), N + 7, generator=torch.Generator().manual_seed(4))
    buffer[:, :N] = wide
    before = buffer.clone()
    out = buffer[:, :N]
    assert out.stride(0) == N + 7
    ops.lora_add(out, x, torch.tensor(SLOTS), a, bt, ranks, cols)
    torch.testing.assert_close(out.double(), _reference(wide, x, SLOTS, a, bt),
                               atol=1e-5, rtol=1e-5)
    assert torch.equal(buffer[:, N:], before[:, N:])


@pytest.mark.parametrize("weights", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_lora_add_rows_invariant(dtype, weights):
    """A row's result alone equals its result in any batch (other rows, other slots, other
    order), bit for bit."""
    ops = load_cpu_ops()
    a, bt, ranks, cols = _stack(5)
    a, bt = a.to(weights), bt.to(weights)
    rows = 37  # more rows than one parallel chunk
    out, x = _inputs(dtype, seed=6, rows=rows)
    slots = torch.tensor([SLOTS[(7 * t) % len(SLOTS)] for t in range(rows)])

    def run(idx: torch.Tensor) -> torch.Tensor:
        o = out[idx].clone()
        ops.lora_add(o, x[idx].contiguous(), slots[idx], a, bt, ranks, cols)
        return o

    whole = run(torch.arange(rows))
    alone = torch.cat([run(torch.tensor([t])) for t in range(rows)])
    assert torch.equal(whole, alone)
    perm = torch.randperm(rows, generator=torch.Generator().manual_seed(7))
    assert torch.equal(run(perm), whole[perm])
    assert torch.equal(torch.cat([run(torch.arange(0, 5)), run(torch.arange(5, rows))]), whole)
    # and the result is the reference's, so invariance is not that of a no-op
    tol = {"atol": 1e-5, "rtol": 1e-5} if dtype == torch.float32 else {"atol": 2e-2, "rtol": 8e-3}
    torch.testing.assert_close(whole.double(), _reference(out, x, slots.tolist(), a, bt), **tol)


def test_lora_add_rejects_mismatched_shapes():
    ops = load_cpu_ops()
    a, bt, ranks, cols = _stack(0)
    out, x = _inputs(torch.float32)
    with pytest.raises(RuntimeError, match="rows of out, x, slots differ"):
        ops.lora_add(out, x, torch.tensor(SLOTS[:-1]), a, bt, ranks, cols)
    with pytest.raises(RuntimeError, match="A has"):
        ops.lora_add(out, x, torch.tensor(SLOTS), a[:, :-1].contiguous(), bt, ranks, cols)
    with pytest.raises(RuntimeError, match="both float32 or bfloat16"):
        ops.lora_add(out, x, torch.tensor(SLOTS), a.double(), bt.double(), ranks, cols)
    with pytest.raises(RuntimeError, match="both float32 or bfloat16"):
        ops.lora_add(out, x, torch.tensor(SLOTS), a.bfloat16(), bt, ranks, cols)


def _projection(gen: torch.Generator, rank: int, shards: set[int]) -> ProjectionLoRA:
    """A ``ProjectionLoRA`` (adapter.py's layout: shard i's A in rows [i*rank, (i+1)*rank),
    zeros for a shard the adapter leaves alone) targeting ``shards``."""
    a = torch.zeros(len(SHARDS) * rank, K)
    bt = torch.zeros(rank, N)
    for i in shards:
        a[i * rank : (i + 1) * rank] = torch.randn(rank, K, generator=gen) * 0.3
        bt[:, COLS[i] : COLS[i + 1]] = torch.randn(rank, SHARDS[i], generator=gen) * 0.3
    return ProjectionLoRA(a, bt, rank)


@pytest.mark.parametrize("cpu_kernel", [True, False], ids=["cpu-kernel", "torch"])
def test_stack_slots_match_reference(cpu_kernel, monkeypatch):
    """``LoRAStack.set_slot`` puts an adapter of lower rank than the slots into the wide
    layout, and ``add`` (the C++ kernel on CPU, PyTorch products per slot elsewhere) adds
    each row's term of its own slot: ``x @ A_i^T @ Bt_i`` per shard i."""
    if not cpu_kernel:
        monkeypatch.setattr("pagedserve.lora.layers.cpu_layer_ops", lambda x: None)
    target = LoRATarget("layers.0.self_attn.qkv_proj", K, ("q", "k", "v"), SHARDS)
    stack = LoRAStack(target, max_loras=3, max_rank=R, device=torch.device("cpu"))
    gen = torch.Generator().manual_seed(8)
    loras = [_projection(gen, 4, {0, 1, 2}), _projection(gen, 2, {0, 2}), None]
    for slot, lora in enumerate(loras):
        stack.set_slot(slot, lora)
    assert stack.ranks.tolist() == [4, 2, 0]
    slots = [1, -1, 0, 2, 0, 1]
    out, x = _inputs(torch.float32, seed=9, rows=len(slots))
    base = out.clone()
    want = out.double().clone()
    for t, s in enumerate(slots):
        if s >= 0 and loras[s] is not None:
            lora = loras[s]
            for i in range(len(SHARDS)):
                a = lora.a[i * lora.rank : (i + 1) * lora.rank].double()
                want[t, COLS[i] : COLS[i + 1]] += (x[t].double() @ a.T) @ \
                    lora.bt[:, COLS[i] : COLS[i + 1]].double()
    stack.add(out, x, torch.tensor(slots))
    torch.testing.assert_close(out.double(), want, atol=1e-5, rtol=1e-5)
    assert torch.equal(out[1], base[1]) and torch.equal(out[3], base[3])  # -1, empty slot
    assert not torch.allclose(out[0], base[0]) and not torch.allclose(out[2], base[2])
    # emptying a slot removes its term
    stack.set_slot(0, None)
    again = base.clone()
    stack.add(again, x, torch.tensor([0] * len(slots)))
    assert torch.equal(again, base)


# -- the scheduler: first come, first served across adapters -------------------------------

BS = 4


def _request(rid: str, lora_id: int, max_tokens: int = 2) -> Request:
    return Request(rid, list(range(100, 108)), SamplingParams(max_tokens=max_tokens,
                                                              ignore_eos=True),
                   eos_token_id=2, lora_id=lora_id, lora_name=f"a{lora_id}" if lora_id else None)


def _scheduler(max_loras: int) -> Scheduler:
    return Scheduler(SchedulerConfig(max_model_len=64), KVCacheManager(64, BS, False),
                     None, max_loras)


def _step(sched: Scheduler) -> tuple[list[str], set[int]]:
    """One step as the engine runs it (a sampled token for each request that reached its
    end); the scheduled request ids and the adapters the step used."""
    out = sched.schedule()
    sampled = {}
    for req, n in zip(out.requests, out.num_scheduled_tokens):
        if req.num_computed_tokens + n == req.num_tokens:
            sampled[req.request_id] = [7]
    adapters = {r.lora_id for r in out.requests if r.lora_id}
    sched.update_from_output(out, sampled)
    return [r.request_id for r in out.requests], adapters


def test_admission_is_fcfs_across_adapters():
    """max_loras=1, waiting: A1 (adapter 1), B (adapter 2), A2 (adapter 1). A2's adapter is
    in use, yet A2 is not admitted ahead of B; B runs once adapter 1's requests finish, and
    A2 after B."""
    sched = _scheduler(max_loras=1)
    for r in (_request("A1", 1), _request("B", 2), _request("A2", 1)):
        sched.add_request(r)
    history = []
    while sched.has_unfinished_requests():
        scheduled, adapters = _step(sched)
        assert len(adapters) <= 1
        history.append(scheduled)
        assert len(history) < 20
    first = {rid: next(i for i, s in enumerate(history) if rid in s) for rid in ("A1", "B", "A2")}
    last = {rid: max(i for i, s in enumerate(history) if rid in s) for rid in ("A1", "B", "A2")}
    assert history[0] == ["A1"]
    assert first["B"] > last["A1"]  # B waited for adapter 1 to go
    assert first["A2"] > first["B"]  # A2 did not jump ahead of B
    assert first["A2"] > last["B"]   # and adapter 1 came back only after B finished


def test_same_adapter_and_base_requests_join():
    """The limit counts adapters, not requests: with max_loras=1 the requests of the
    running adapter and of the base model are admitted together; a second adapter waits,
    and so does everybody behind it."""
    sched = _scheduler(max_loras=1)
    for r in (_request("base", 0, 4), _request("A1", 1, 4), _request("A2", 1, 4),
              _request("B", 2, 4), _request("base2", 0, 4)):
        sched.add_request(r)
    scheduled, adapters = _step(sched)
    assert scheduled == ["base", "A1", "A2"] and adapters == {1}
    assert [r.request_id for r in sched.waiting] == ["B", "base2"]


def test_two_slots_admit_two_adapters():
    sched = _scheduler(max_loras=2)
    for r in (_request("A", 1), _request("B", 2), _request("C", 3), _request("A2", 1)):
        sched.add_request(r)
    scheduled, adapters = _step(sched)
    assert scheduled == ["A", "B"] and adapters == {1, 2}
    assert [r.request_id for r in sched.waiting] == ["C", "A2"]


def test_lora_config_limits():
    assert LoRAConfig(2, 8, None).cpu_capacity == 2
    assert LoRAConfig(2, 8, 5).cpu_capacity == 5
    with pytest.raises(ValueError, match="max_cpu_loras"):
        LoRAConfig(max_loras=3, max_lora_rank=8, max_cpu_loras=2)
    for bad in ({"max_loras": 0}, {"max_lora_rank": 0}, {"max_loras": True}):
        with pytest.raises(ValueError, match=next(iter(bad))):
            LoRAConfig(**bad)
    with pytest.raises(ValueError, match="lora_dtype must be one of auto, float32, bfloat16"):
        LoRAConfig(lora_dtype="float16")
    assert LoRAConfig().stack_dtype(torch.bfloat16) == torch.bfloat16  # auto: the model's
    assert LoRAConfig(lora_dtype="bfloat16").stack_dtype(torch.float32) == torch.bfloat16
