"""pagedserve: a paged-KV-cache, continuously batching LLM inference and serving engine."""

from pagedserve.entrypoints.llm import LLM
from pagedserve.outputs import CompletionOutput, Logprob, RequestOutput
from pagedserve.sampling_params import SamplingParams

__version__ = "0.1.0"
__all__ = ["LLM", "CompletionOutput", "Logprob", "RequestOutput", "SamplingParams", "__version__"]
