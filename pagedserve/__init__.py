"""pagedserve: a paged-KV-cache, continuously batching LLM inference and serving engine.

``LLM`` is imported on first use (PEP 562 module ``__getattr__``): it pulls in torch and
the model code, which ``pagedserve --help`` and other light imports of the package do not
need.
"""

from __future__ import annotations

import os
from typing import TYPE_CHECKING

# PyTorch's OpenMP workers (libgomp) spin-wait for the next parallel region for 300,000
# pauses (~5 ms on this project's Xeon VMs), then sleep until a futex call wakes them. In
# minutes when the host was busy that wake-up was slow: the shared workload ran at 84-149
# output tok/s by default against 154-231 with workers that never sleep (alternating
# runs); in quiet minutes the two were equal (benchmarks/README.md). 10M pauses, ~0.17 s
# on those VMs (Intel's OpenMP spins 200 ms, KMP_BLOCKTIME), keeps them awake through a
# step's Python work and still lets an idle engine's workers sleep. libgomp reads the
# variable when torch loads, so it applies where pagedserve is imported first (the CLI,
# scripts importing it before torch); a value the user set wins.
os.environ.setdefault("GOMP_SPINCOUNT", "10000000")

from pagedserve.lora.request import LoRARequest
from pagedserve.outputs import CompletionOutput, Logprob, RequestOutput
from pagedserve.sampling_params import SamplingParams, StructuredOutputsParams
from pagedserve.version import __version__

if TYPE_CHECKING:
    from pagedserve.entrypoints.llm import LLM

__all__ = [
    "LLM",
    "CompletionOutput",
    "LoRARequest",
    "Logprob",
    "RequestOutput",
    "SamplingParams",
    "StructuredOutputsParams",
    "__version__",
]


def __getattr__(name: str):
    if name == "LLM":
        from pagedserve.entrypoints.llm import LLM

        return LLM
    raise AttributeError(f"module 'pagedserve' has no attribute {name!r}")
