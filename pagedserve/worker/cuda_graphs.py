"""Pure-decode steps replayed from CUDA graphs, one graph per captured batch size.

A decode step runs ~15 kernels per layer for one token per sequence: for small batches
the GPU waits on the host launching them. ``DecodeGraphs`` records the model's forward
once per batch size of ``capture_sizes`` (vLLM's list: 1, 2, 4, 8, 16, 24, ...) over
static input buffers, and replays it. A step of ``n`` decodes is copied into the first
``n`` rows of the buffers and padded up to the next captured size ``bs``; rows
``n..bs-1`` are padding, harmless by construction::

    input_ids, positions   stale but valid (a token id, a position < max_model_len)
    slot_mapping           -1: the KV write kernel skips the row, no cache slot changes
    seq_lens               1: attention reads one key, slot 0 of block_tables[row, 0]
    block_tables           [bs_max, cdiv(max_model_len, block_size)]; stale or 0 entries,
                           valid block ids either way

Their hidden states are dropped. Attention runs with ``max_decode_seq_len =
max_model_len``, so the Triton decode kernels launch the same split layout at every
replay whatever the context lengths (see ``attention/triton_attn.py``). Only the forward
is captured: logits and sampling stay eager, on the real rows.

Without captured graphs (``capture`` not called: CPU, tests) ``run`` calls the model
eagerly on the same static buffers and padded metadata, so everything but the replay
itself is testable on CPU.
"""

from __future__ import annotations

import torch

from pagedserve.attention import AttentionMetadata

_MAX_CAPTURE_SIZE = 256
_SIZES = [1, 2, 4, *range(8, _MAX_CAPTURE_SIZE + 1, 8)]


def capture_sizes(max_num_seqs: int) -> list[int]:
    """Batch sizes to capture: 1, 2, 4, then multiples of 8, up to the first size that
    holds ``min(max_num_seqs, 256)`` sequences. ``capture_sizes(5) == [1, 2, 4, 8]``.

    Raises ``ValueError`` if ``max_num_seqs < 1``.
    """
    if max_num_seqs < 1:
        raise ValueError(f"max_num_seqs must be >= 1; got {max_num_seqs}")
    limit = min(max_num_seqs, _MAX_CAPTURE_SIZE)
    return [s for s in _SIZES if s < limit] + [next(s for s in _SIZES if s >= limit)]


class DecodeGraphs:
    """Static decode inputs, and one CUDA graph of the model's forward per batch size.

    Args:
        model: the model; ``model(input_ids, positions, kv_caches, meta)`` -> hidden
            states ``[num_tokens, hidden_size]``.
        kv_caches: the per-layer cache tensors the graphs will read and write (their
            addresses are baked into the graphs: never reallocate them).
        sizes: batch sizes, ascending (``capture_sizes``).
        max_model_len: longest sequence in tokens: sets the block-table width and the
            decode split layout.
        block_size: tokens per KV block.
        device: where the buffers live.
    """

    def __init__(self, model, kv_caches: list[torch.Tensor], sizes: list[int],
                 max_model_len: int, block_size: int, device: str) -> None:
        self.model = model
        self.kv_caches = kv_caches
        self.sizes = sizes
        self.max_model_len = max_model_len
        self.block_size = block_size
        self.device = device
        n = sizes[-1]
        width = -(-max_model_len // block_size)
        self.input_ids = torch.zeros(n, dtype=torch.int64, device=device)
        self.positions = torch.zeros(n, dtype=torch.int64, device=device)
        self.slot_mapping = torch.full((n,), -1, dtype=torch.int64, device=device)
        self.seq_lens = torch.ones(n, dtype=torch.int64, device=device)
        self.block_tables = torch.zeros(n, width, dtype=torch.int64, device=device)
        self.query_start_loc = torch.arange(n + 1, dtype=torch.int64, device=device)
        self.graphs: dict[int, torch.cuda.CUDAGraph] = {}
        self.outputs: dict[int, torch.Tensor] = {}  # each graph's hidden states [bs, hidden]

    @property
    def max_batch_size(self) -> int:
        return self.sizes[-1]

    def padded_size(self, num_seqs: int) -> int:
        """The smallest size ``>= num_seqs``. Raises ``ValueError`` past the largest."""
        for size in self.sizes:
            if size >= num_seqs:
                return size
        raise ValueError(f"{num_seqs} sequences exceed the largest batch size {self.sizes[-1]}")

    @torch.inference_mode()
    def capture(self) -> None:
        """Record one graph per size, largest first, all in one memory pool (vLLM's
        order: smaller graphs reuse the larger ones' memory). Each size first runs once
        eagerly, to compile its kernel variants outside the capture. Every row is padding
        meanwhile, so capturing changes no cache slot. CUDA only."""
        pool = None
        with torch.cuda.device(self.device):  # graphs capture the current device's stream
            for bs in reversed(self.sizes):
                self._forward(bs, [1] * bs)
                torch.cuda.synchronize()
                graph = torch.cuda.CUDAGraph()
                with torch.cuda.graph(graph, pool=pool):
                    self.outputs[bs] = self._forward(bs, [1] * bs)
                pool = graph.pool()
                self.graphs[bs] = graph
            torch.cuda.synchronize()

    def run(self, input_ids: torch.Tensor, positions: torch.Tensor,
            meta: AttentionMetadata) -> torch.Tensor:
        """Hidden states ``[n, hidden_size]`` of a pure-decode step of ``n`` sequences
        (``n <= max_batch_size``; ``input_ids``, ``positions`` ``[n]``): replayed from the
        graph of the padded size, or run eagerly on the static buffers if none was
        captured. The result is a view into a static buffer, valid until the next call."""
        n = meta.num_seqs
        bs = self.padded_size(n)
        self.input_ids[:n].copy_(input_ids)
        self.positions[:n].copy_(positions)
        self.slot_mapping[:n].copy_(meta.slot_mapping)
        self.seq_lens[:n].copy_(meta.seq_lens)
        self.block_tables[:n, : meta.block_tables.shape[1]].copy_(meta.block_tables)
        self.slot_mapping[n:bs].fill_(-1)  # padding rows write nothing ...
        self.seq_lens[n:bs].fill_(1)  # ... and attend to one valid slot
        graph = self.graphs.get(bs)
        if graph is None:
            return self._forward(bs, meta.seq_lens_list + [1] * (bs - n))[:n]
        graph.replay()
        return self.outputs[bs][:n]

    def _forward(self, bs: int, seq_lens_list: list[int]) -> torch.Tensor:
        """The model on the first ``bs`` rows of the static buffers."""
        meta = AttentionMetadata(
            slot_mapping=self.slot_mapping[:bs],
            query_start_loc=self.query_start_loc[: bs + 1],
            seq_lens=self.seq_lens[:bs],
            block_tables=self.block_tables[:bs],
            query_lens_list=[1] * bs,
            seq_lens_list=seq_lens_list,
            num_decodes=bs,
            block_size=self.block_size,
            max_decode_seq_len=self.max_model_len,
        )
        return self.model(self.input_ids[:bs], self.positions[:bs], self.kv_caches, meta)
