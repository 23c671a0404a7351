"""The bfloat16 pair kernel (``vdpbf16ps`` chains, ``csrc/fixed_order_gemm_cpu.cpp``), its
AMX twin (``TDPBF16PS`` tiles, ``csrc/amx_tiles.h``) and the once-per-machine choice between
them and the FMA kernel (``quantization/kernel_choice.py``).

The pair and AMX kernels are checked against the float64 product (bfloat16 products are exact in
float32, so only the float32 additions and the final rounding differ) and for batch
invariance; the choice for being timed once, written, and read back unchanged.
"""

from __future__ import annotations

import json
import time

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from test_batch_invariance import assert_rows_invariant

from pagedserve.cpu_ops import cpu_ops_available, load_cpu_ops
from pagedserve.quantization import int8, kernel_choice, none

pytestmark = pytest.mark.skipif(not cpu_ops_available(), reason="C++ CPU kernels unavailable")


def pairs_available() -> bool:
    return load_cpu_ops().pair_linear_available()


needs_pairs = pytest.mark.skipif(not cpu_ops_available() or not pairs_available(),
                                 reason="this CPU has no AVX512-BF16")
needs_amx = pytest.mark.skipif(
    not cpu_ops_available() or not load_cpu_ops().amx_tiles_available(),
    reason="this CPU has no AMX")


def assert_near_float64(out: torch.Tensor, x: torch.Tensor, weight: torch.Tensor) -> None:
    """``out`` within what a float32 sum of K exact products may carry (K ulps of the
    products' magnitude), then one rounding to bfloat16 (half an ulp: 2**-8 relative), of
    the float64 product ``x @ weight.T``."""
    exact = x.double() @ weight.double().T
    sums = x.shape[1] * torch.finfo(torch.float32).eps * (x.double().abs() @ weight.double().abs().T)
    assert bool(((out.double() - exact).abs() <= sums * (1 + 2**-8) + exact.abs() * 2**-8).all())


# The two bfloat16 layouts beside FMA: (packing op, K's step, the packed shape for n, k)
LAYOUTS = {"pairs": ("pack_linear_weight_pairs", 1,
                     lambda n, k: ((n + 63) // 64, (k + 1) // 2, 64, 2)),
           "amx": ("pack_linear_weight_amx", 32,
                   lambda n, k: ((n + 63) // 64, k // 32, 16, 64, 2))}


@pytest.mark.parametrize("layout", [pytest.param("pairs", marks=needs_pairs),
                                    pytest.param("amx", marks=needs_amx)])
@settings(max_examples=12, deadline=None)
@given(m=st.integers(1, 300), n=st.sampled_from([1, 63, 64, 200, 960]),
       k=st.sampled_from([1, 2, 97, 576, 1537]), seed=st.integers(0, 2**31))
def test_kernel_matches_float64_and_is_row_invariant(layout, m, n, k, seed):
    """Any N (tails of a 64-column panel), any K (pairs: odd, the last pair half zero;
    AMX: rounded up to its steps of 32), any M (AMX: tails of 16-row tiles)."""
    pack, k_step, shape = LAYOUTS[layout]
    k = -(-k // k_step) * k_step
    gen = torch.Generator().manual_seed(seed)
    weight = torch.randn(n, k, generator=gen).bfloat16()
    x = torch.randn(m, k, generator=gen).bfloat16()
    ops = load_cpu_ops()
    packed = getattr(ops, pack)(weight)
    assert packed.shape == shape(n, k)
    multiply = lambda rows: ops.fixed_order_linear(rows, packed, n)
    out = multiply(x)
    assert out.dtype == torch.bfloat16 and out.shape == (m, n)
    assert_near_float64(out, x, weight)
    assert_rows_invariant(multiply, x)


@pytest.mark.parametrize("layout, name, bad_weight, error", [
    pytest.param("pairs", "pair", torch.randn(64, 32), "weight must be a bfloat16",
                 marks=needs_pairs),
    pytest.param("amx", "AMX", torch.randn(64, 48).bfloat16(), "K a multiple of 32",
                 marks=needs_amx)])
def test_kernel_rejects_what_it_cannot_multiply(layout, name, bad_weight, error):
    pack = getattr(load_cpu_ops(), LAYOUTS[layout][0])
    multiply = load_cpu_ops().fixed_order_linear
    packed = pack(torch.randn(64, 32).bfloat16())
    with pytest.raises(RuntimeError, match=f"{name}-packed weights take bfloat16 rows"):
        multiply(torch.randn(2, 32), packed, 64)
    with pytest.raises(RuntimeError, match="x has K = 64 and N = 64"):
        multiply(torch.randn(2, 64).bfloat16(), packed, 64)
    with pytest.raises(RuntimeError, match="x has K = 32 and N = 65"):
        multiply(torch.randn(2, 32).bfloat16(), packed, 65)
    with pytest.raises(RuntimeError, match=error):
        pack(bad_weight)
    assert multiply(torch.empty(0, 32).bfloat16(), packed, 64).shape == (0, 64)


@pytest.fixture
def fresh_cache(monkeypatch, tmp_path):
    """An empty cache directory and no choice remembered in this process."""
    monkeypatch.setenv("PAGEDSERVE_CACHE_DIR", str(tmp_path))
    kernel_choice.bf16_layout.cache_clear()
    int8.int8_kernel.cache_clear()
    yield tmp_path / "kernel_choice.json"
    kernel_choice.bf16_layout.cache_clear()
    int8.int8_kernel.cache_clear()


@needs_pairs
def test_choice_is_timed_once_then_read_back(fresh_cache, monkeypatch):
    """The first choice is the faster layout by the timing; it is written under this
    machine's key and a later start reads it without timing again, even where a new
    timing would say otherwise."""
    monkeypatch.setattr(kernel_choice, "_time_layouts", lambda w: {"fma": 2.0, "pairs": 1.0})
    assert kernel_choice.bf16_layout(96, 64) == "pairs"
    cached = json.loads(fresh_cache.read_text())
    assert cached == {kernel_choice.machine_key(): {"96x64": "pairs"}}
    kernel_choice.bf16_layout.cache_clear()

    def must_not_time(weight):
        raise AssertionError("a cached choice was timed again")

    monkeypatch.setattr(kernel_choice, "_time_layouts", must_not_time)
    assert kernel_choice.bf16_layout(96, 64) == "pairs"
    # another machine key (thread count) is another entry, timed on its own
    monkeypatch.setattr(kernel_choice, "_time_layouts", lambda w: {"fma": 1.0, "pairs": 2.0})
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(threads + 1)
        kernel_choice.bf16_layout.cache_clear()
        assert kernel_choice.bf16_layout(96, 64) == "fma"
    finally:
        torch.set_num_threads(threads)
    assert len(json.loads(fresh_cache.read_text())) == 2


@needs_pairs
def test_real_timing_runs_every_layout_of_this_cpu(fresh_cache):
    """Timed for real: every layout this CPU has runs. (Which of pairs and FMA wins is the
    CPU's: pairs by ~1.8x on a Zen 5 EPYC, FMA by ~1.2x on an AMX Xeon.) Where AMX runs,
    its tiles do 16 times the products of ``vdpbf16ps`` per instruction and win at 128 +
    16 rows of a 1536 x 576 weight (~7x on the Xeon)."""
    times = kernel_choice._time_layouts(torch.randn(1536, 576, dtype=torch.bfloat16))
    amx = load_cpu_ops().amx_tiles_available()
    assert set(times) == {"fma", "pairs"} | ({"amx"} if amx else set())
    assert all(t > 0 for t in times.values())
    if amx:
        assert times["amx"] < min(times["fma"], times["pairs"])


@needs_pairs
def test_pack_weight_follows_the_choice(fresh_cache):
    """``pack_weight`` packs a bfloat16 weight in the cached layout (float32 always FMA),
    and ``float_linear`` gives the float64 product's value either way."""
    gen = torch.Generator().manual_seed(3)
    weight = torch.randn(100, 96, generator=gen).bfloat16()
    x = torch.randn(3, 7, 96, generator=gen).bfloat16()
    layouts = [("pairs", 4), ("fma", 3)]
    if load_cpu_ops().amx_tiles_available():
        layouts.append(("amx", 5))
    for layout, dims in layouts:
        fresh_cache.write_text(json.dumps({kernel_choice.machine_key(): {"100x96": layout}}))
        kernel_choice.bf16_layout.cache_clear()
        packed = none.pack_weight(weight)
        assert packed.dim() == dims
        with torch.no_grad():
            out = none.float_linear(x, weight, None, packed).reshape(21, 100)
        assert_near_float64(out, x.reshape(21, 96), weight)
    assert none.pack_weight(weight.float()).dim() == 3


def test_without_the_pair_kernel_the_choice_is_fma(fresh_cache, monkeypatch):
    """Where the build has no AVX512-BF16 nothing is timed or written."""
    class NoPairs:
        @staticmethod
        def pair_linear_available():
            return False

    monkeypatch.setattr(kernel_choice, "load_cpu_ops", lambda: NoPairs)
    assert kernel_choice.bf16_layout(64, 64) == "fma"
    assert not fresh_cache.exists()


def test_routes_are_timed_by_the_geometric_mean_over_row_counts():
    """A route 2x faster at a decode step's 16 rows beats one 1.3x faster at a prefill
    chunk's 128 (a sum of the times would pick the second), and each route's figure is the
    geometric mean of its best calls (sleeps of known length stand in for products)."""
    lengths = {"decode_fast": {16: 0.002, 128: 0.013}, "chunk_fast": {16: 0.004, 128: 0.010}}
    routes = {name: (lambda x, by_rows=by_rows: time.sleep(by_rows[x.shape[0]]))
              for name, by_rows in lengths.items()}
    times = kernel_choice.time_routes(routes, 8)
    assert min(times, key=times.get) == "decode_fast"
    for name, by_rows in lengths.items():
        assert times[name] == pytest.approx((by_rows[16] * by_rows[128]) ** 0.5, rel=0.25)


@pytest.mark.skipif(not load_cpu_ops().packed_int8_available(),
                    reason="no AVX512-VNNI or AVX2 here")
def test_int8_choice_is_timed_once_and_quantize_weight_follows_it(fresh_cache, monkeypatch):
    """The int8 product is chosen like a bfloat16 layout (timed once, cached beside it under
    its own name) and ``quantize_weight`` packs the weight only where "packed" or "amx" won."""
    time_int8 = int8._time_int8  # the real timing, for the end
    monkeypatch.setattr(int8, "_time_int8", lambda w: {"int_mm": 2.0, "packed": 1.0})
    assert int8.int8_kernel(96, 64) == "packed"
    assert json.loads(fresh_cache.read_text()) == {
        kernel_choice.machine_key(): {"int8 96x64": "packed"}}
    assert int8.quantize_weight(torch.randn(96, 64)).packed.shape == (2, 17, 64, 4)
    monkeypatch.setattr(int8, "_time_int8", lambda w: {"int_mm": 1.0, "packed": 2.0})
    assert int8.quantize_weight(torch.randn(96, 64)).packed is not None  # read back, not retimed
    assert int8.quantize_weight(torch.randn(64, 64)).packed is None  # a new shape: int_mm won
    monkeypatch.setattr(int8, "_time_int8", lambda w: {"int_mm": 2.0, "packed": 3.0, "amx": 1.0})
    if load_cpu_ops().amx_tiles_available():
        assert int8.quantize_weight(torch.randn(96, 128)).packed.shape == (2, 3, 16, 64, 4)
    for k, amx in ((96, False), (128, load_cpu_ops().amx_tiles_available())):
        times = time_int8(torch.randint(-127, 128, (128, k), dtype=torch.int8))
        assert set(times) == {"int_mm", "packed"} | ({"amx"} if amx else set())
        assert all(t > 0 for t in times.values())
