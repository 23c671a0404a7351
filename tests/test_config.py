"""Configuration resolution: dtype and device choices."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch

from pagedserve import config


@pytest.mark.parametrize(("flags", "expected"), [
    ({"avx2", "fma"}, torch.float32),
    ({"avx2", "avx512f", "avx512_bf16"}, torch.bfloat16),
    ({"avx2", "amx_bf16", "amx_tile"}, torch.bfloat16),
])
def test_auto_dtype_on_cpu_follows_native_bf16(monkeypatch, flags, expected):
    monkeypatch.setattr(config, "cpu_flags", lambda: flags)
    assert config.resolve_dtype("auto", "cpu") == expected


def test_auto_dtype_on_cuda_is_bfloat16(monkeypatch):
    monkeypatch.setattr(config, "cpu_flags", lambda: set())
    assert config.resolve_dtype("auto", "cuda") == torch.bfloat16


def test_explicit_and_bad_dtype():
    assert config.resolve_dtype("float16", "cpu") == torch.float16
    with pytest.raises(ValueError, match="dtype"):
        config.resolve_dtype("float64", "cpu")


def test_cpu_flags_reads_this_machine():
    flags = config.cpu_flags()
    assert isinstance(flags, set)
    with open("/proc/cpuinfo") as f:
        assert any(line.startswith("flags") for line in f) == bool(flags)


@pytest.mark.parametrize("preset, expected", [(None, "10000000"), ("300000", "300000")])
def test_import_sets_openmp_spin_count_unless_the_user_did(preset, expected):
    """``import pagedserve`` (before torch) lengthens libgomp's spin-wait; a user's value wins."""
    env = {k: v for k, v in os.environ.items() if k != "GOMP_SPINCOUNT"}
    if preset is not None:
        env["GOMP_SPINCOUNT"] = preset
    code = "import os, pagedserve, sys; sys.stdout.write(os.environ['GOMP_SPINCOUNT'])"
    result = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True,
                            text=True, check=True)
    assert result.stdout == expected
