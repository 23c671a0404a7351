"""pagedserve: a paged-KV-cache, continuously batching LLM inference and serving engine.

``LLM`` is imported on first use (PEP 562 module ``__getattr__``): it pulls in torch and
the model code, which ``pagedserve --help`` and other light imports of the package do not
need.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from pagedserve.outputs import CompletionOutput, Logprob, RequestOutput
from pagedserve.sampling_params import SamplingParams, StructuredOutputsParams

if TYPE_CHECKING:
    from pagedserve.entrypoints.llm import LLM

__version__ = "0.1.0"
__all__ = ["LLM", "CompletionOutput", "Logprob", "RequestOutput", "SamplingParams",
           "StructuredOutputsParams", "__version__"]


def __getattr__(name: str):
    if name == "LLM":
        from pagedserve.entrypoints.llm import LLM

        return LLM
    raise AttributeError(f"module 'pagedserve' has no attribute {name!r}")
