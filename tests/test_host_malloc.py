"""keep_freed_host_memory: a step's freed activations are reused by the next step instead of
being page-faulted in again (counted with getrusage's minor faults, in a fresh process each,
since the setting is process-wide)."""

from __future__ import annotations

import os
import platform
import subprocess
import sys

import pytest

# Steps of a 1B model's prefill in miniature: a 64 MiB and a 32 MiB activation, one freed
# before a third is taken; prints whether the setting applied and the last 4 steps' faults.
STEPS = r"""
import resource, sys, torch
from pagedserve.worker.host_malloc import keep_freed_host_memory
applied = keep_freed_host_memory() if sys.argv[1] == "keep" else False
def faults():
    return resource.getrusage(resource.RUSAGE_SELF).ru_minflt
counts = []
for _ in range(12):
    before = faults()
    gate_up = torch.empty(2048, 16384, dtype=torch.bfloat16).fill_(1)
    act = torch.empty(2048, 8192, dtype=torch.bfloat16).fill_(2)
    del gate_up
    down = torch.empty(2048, 2048).fill_(0)
    del act, down
    counts.append(faults() - before)
print(applied, sum(counts[-4:]))
"""
PAGES_OF_64_MIB = (64 << 20) // os.sysconf("SC_PAGE_SIZE")

pytestmark = pytest.mark.skipif(platform.libc_ver()[0] != "glibc",
                                reason="mallopt is glibc's")


def run_steps(mode: str, **env: str) -> tuple[bool, int]:
    out = subprocess.run([sys.executable, "-c", STEPS, mode], capture_output=True, text=True,
                         check=True, env={**os.environ, **env}).stdout.split()
    return out[0] == "True", int(out[1])


def test_freed_activations_are_reused_without_page_faults():
    applied, faults = run_steps("keep")
    assert applied
    assert faults < PAGES_OF_64_MIB // 16  # not one of the 64 MiB blocks faulted in again


def test_glibc_defaults_fault_the_same_steps_in_again():
    # the control: what the setting changes (glibc 2.36's defaults)
    applied, faults = run_steps("default")
    assert not applied
    assert faults >= PAGES_OF_64_MIB


def test_a_users_malloc_variable_wins():
    applied, _ = run_steps("keep", MALLOC_TOP_PAD_=str(1 << 20))
    assert not applied
