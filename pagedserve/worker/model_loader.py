"""Build a model and load its weights: the architecture from the registry, this rank's
shard under tensor parallelism, the checkpoint's weights, then the quantization method's
processing and, on CPU, the fused decode step.

As vLLM's ``model_loader`` (``initialize_model`` -> ``load_weights`` ->
``process_weights_after_loading``): the one place that puts a model, its weights and a
quantization method together; the worker calls it once per model it runs.
"""

from __future__ import annotations

import logging
import pathlib
from collections.abc import Callable

import torch
from torch import nn

from pagedserve.args import EngineArgs
from pagedserve.attention import AttentionBackend, AttentionMetadata
from pagedserve.distributed.group import RankGroup
from pagedserve.distributed.sharding import make_tensor_parallel, shard_config, shard_weights
from pagedserve.model_loader.files import iter_weights
from pagedserve.models.registry import get_model_class
from pagedserve.quantization import get_quantization_method
from pagedserve.quantization.base import LoadContext
from pagedserve.worker.cpu_decode import CpuDecodeLayers
from pagedserve.worker.host_malloc import release_freed_memory
from pagedserve.worker.kv_cache import allocate_kv_caches

logger = logging.getLogger(__name__)


def load_model(args: EngineArgs, hf_config, model_path: pathlib.Path, device: str,
               dtype: torch.dtype, backend: AttentionBackend, max_model_len: int,
               group: RankGroup | None, tokenizer: Callable[[], object]) -> nn.Module:
    """Build the model and load its weights (``args.load_format``), processed by the
    quantization method of ``args.quantization`` (``quantization/``).

    With ``group`` (tensor parallel), this rank's shard: built from ``shard_config``, read
    through ``shard_weights``, wrapped by ``make_tensor_parallel``. ``tokenizer()`` returns
    the tokenizer (a method's calibration text needs it). Raises ``ValueError`` for a bad
    ``load_format`` or ``quantization``.
    """
    tp = 1 if group is None else group.world_size
    method = get_quantization_method(args.quantization, model_path, device, tp)
    with torch.device(device):
        model = get_model_class(hf_config)(shard_config(hf_config, tp), backend, max_model_len)
        for param in model.parameters():  # loading writes them: allocated, never touched
            param.data = torch.empty_like(param, dtype=dtype)
        model.to(dtype)  # the buffers (rotary tables)
        if group is not None:
            model = make_tensor_parallel(model, group, hf_config.vocab_size)
    inner = model if group is None else model.model
    prefill = None if group is not None else (
        lambda ids: prefill_once(inner, hf_config, ids))  # a shard cannot run alone
    ctx = LoadContext(model_path, device, dtype, max_model_len, tokenizer, prefill)
    if args.load_format == "dummy":  # vLLM's name: random weights, for benchmarks
        for param in model.parameters():
            param.data.uniform_(-1e-3, 1e-3)
    elif args.load_format == "auto":
        # The weights a method keeps as the file stores them are never read into float.
        weights = iter_weights(model_path, dtype, skip=method.take_stored_weights(inner, ctx))
        if group is not None:
            weights = shard_weights(weights, hf_config, group.rank, tp)
        model.load_weights(weights)
    else:
        raise ValueError(f"load_format must be auto or dummy; got {args.load_format!r}")
    logger.info("quantization %s: %s", method.name, method.process_model(inner, ctx))
    if group is None:  # its layers, not the tensor-parallel ones with their all-reduces
        model.cpu_decode = CpuDecodeLayers.build(model)
    release_freed_memory()
    return model.eval()


@torch.inference_mode()
def prefill_once(model: nn.Module, kv_config, ids: list[int], block_size: int = 16
                 ) -> torch.Tensor:
    """One forward over ``ids`` as a single prompt, into a scratch KV cache of its own
    (shaped by ``kv_config``); returns the final hidden states ``[len(ids), hidden_size]``.
    A calibration's pass, before the engine's KV cache exists."""
    device = next(model.parameters()).device
    dtype = model.norm.weight.dtype
    n, blocks = len(ids), -(-len(ids) // block_size)
    caches = allocate_kv_caches(kv_config, blocks, block_size, dtype, str(device))
    meta = AttentionMetadata(
        slot_mapping=torch.arange(n, device=device),
        query_start_loc=torch.tensor([0, n], device=device),
        seq_lens=torch.tensor([n], device=device),
        block_tables=torch.arange(blocks, device=device)[None],
        query_lens_list=[n], seq_lens_list=[n], num_decodes=0, block_size=block_size)
    return model(torch.tensor(ids, device=device), torch.arange(n, device=device), caches, meta)
