"""Our C++ kernels for CPU (``csrc/*.cpp``), registered as ``torch.ops.pagedserve.*``.

All sources build into one library with ``torch.utils.cpp_extension`` on first use (about
a minute on two cores; ``setup.sh`` does it once), cached under torch's extensions folder
and keyed by the sources (``csrc/*.h`` included) and this CPU's instruction-set flags (they
are compiled with ``-march=native``).
"""

from __future__ import annotations

import functools
import hashlib
import logging
from pathlib import Path

import torch

from pagedserve.config import cpu_flags

logger = logging.getLogger(__name__)

_CSRC = Path(__file__).parent / "csrc"
_SOURCES = sorted(_CSRC.glob("*.cpp"))
_HEADERS = sorted(_CSRC.glob("*.h"))  # included by the sources: part of the build's key


@functools.cache
def sources_digest() -> str:
    """A digest of the kernels' sources (``csrc/*.cpp`` and ``*.h``), 12 hex digits: what
    a cached kernel timing (``quantization/kernel_choice.py``) was measured on."""
    digest = hashlib.sha256()
    for source in _SOURCES + _HEADERS:
        digest.update(source.read_bytes())
    return digest.hexdigest()[:12]


@functools.cache
def load_cpu_ops():
    """Compile (first time) and load the kernels; returns ``torch.ops.pagedserve``.
    Raises RuntimeError/OSError if the toolchain is missing."""
    from torch.utils.cpp_extension import load

    # The checkout's path is part of the name: torch rebuilds an extension whose sources
    # moved, so two checkouts sharing one name would rebuild each other's kernels.
    digest = hashlib.sha256(" ".join(sorted(cpu_flags())).encode())
    digest.update(str(Path(__file__).parent.resolve()).encode())
    digest.update(sources_digest().encode())
    load(
        name=f"pagedserve_cpu_ops_{digest.hexdigest()[:12]}",
        sources=[str(s) for s in _SOURCES],
        extra_cflags=["-O3", "-march=native", "-fopenmp", "-ffast-math"],
        extra_ldflags=["-fopenmp"],
        is_python_module=False,
        verbose=False,
    )
    return torch.ops.pagedserve


@functools.cache
def cpu_ops_available() -> bool:
    """True if the kernels build and load here (logs why not otherwise, once)."""
    try:
        load_cpu_ops()
    except (RuntimeError, OSError, ImportError) as e:
        logger.warning("C++ CPU kernels unavailable, using PyTorch ops: %s", e)
        return False
    return True


def cpu_layer_ops(x: torch.Tensor):
    """``torch.ops.pagedserve`` for a CPU tensor when the kernels are available, else
    None (the caller then runs its PyTorch version)."""
    return load_cpu_ops() if x.device.type == "cpu" and cpu_ops_available() else None
