"""Turns a ``SchedulerOutput`` into one flat forward pass and samples the next tokens.

Per step it builds, with no Python loop over tokens: ``input_ids`` and ``positions``
``[num_tokens]``, ``slot_mapping`` ``[num_tokens]``, ``block_tables``
``[num_seqs, max_blocks]``, ``query_start_loc`` ``[num_seqs + 1]`` and ``seq_lens``
``[num_seqs]``. Sequences with one new token (decodes) go first so the attention backend
can batch them. Only the rows that are sampled get logits. A pure-decode step replays a
CUDA graph when the engine captured them (``decode_graphs``, see ``cuda_graphs.py``).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from pagedserve.attention import AttentionMetadata
from pagedserve.core.scheduler import SchedulerOutput
from pagedserve.request import Request
from pagedserve.sample.sampler import Sampler, SamplingBatch, logsumexp_rows
from pagedserve.sampling_params import SamplingParams
from pagedserve.structured_output import GrammarBitmask
from pagedserve.worker.cuda_graphs import DecodeGraphs


@dataclass
class TokenLogprobs:
    """Logprob data of one position: the chosen token and the top-k alternatives."""

    token_id: int
    logprob: float
    rank: int
    top_ids: list[int]
    top_logprobs: list[float]


@dataclass
class ModelRunnerOutput:
    """Per request id: the sampled token, its logprobs (if asked) and prompt logprobs
    ``(first_position, [TokenLogprobs of prompt tokens first_position+1 ...])``."""

    sampled: dict[str, int] = field(default_factory=dict)
    logprobs: dict[str, TokenLogprobs] = field(default_factory=dict)
    prompt_logprobs: dict[str, tuple[int, list[TokenLogprobs]]] = field(default_factory=dict)


class ModelRunner:
    """``grammar_bitmask(requests)`` gives the structured-output bitmask of the rows to
    sample (``requests[i]`` = row i), or None when no row is constrained."""

    def __init__(self, model, block_size: int, device: str, vocab_size: int,
                 eos_token_id: int | None,
                 grammar_bitmask: Callable[[list[Request]], GrammarBitmask | None] | None = None
                 ) -> None:
        self.model = model
        self.kv_caches: list[torch.Tensor] = []  # set once the pool is sized
        self.decode_graphs: DecodeGraphs | None = None  # set after the pool (CUDA graphs)
        self.block_size = block_size
        self.device = device
        self.vocab_size = vocab_size
        self.eos_token_id = eos_token_id
        self.grammar_bitmask = grammar_bitmask or (lambda requests: None)
        self.sampler = Sampler()

    @torch.inference_mode()
    def execute_model(self, sched: SchedulerOutput) -> ModelRunnerOutput:
        order = sorted(range(len(sched.requests)), key=lambda i: sched.num_scheduled_tokens[i] != 1)
        requests = [sched.requests[i] for i in order]
        query_lens = [sched.num_scheduled_tokens[i] for i in order]
        tables = [sched.block_tables[i] for i in order]
        input_ids, positions, meta = self._prepare_inputs(requests, query_lens, tables)
        self.copy_blocks(sched.blocks_to_copy)

        hidden = self._forward(input_ids, positions, meta)

        out = ModelRunnerOutput()
        ends = meta.query_start_loc[1:].tolist()
        sampling = [
            i for i, r in enumerate(requests)
            if r.num_computed_tokens + query_lens[i] == r.num_tokens
        ]
        for i, r in enumerate(requests):
            if r.sampling_params.prompt_logprobs is not None:
                self._prompt_logprobs(r, query_lens[i], hidden[ends[i] - query_lens[i] : ends[i]], out)
        if sampling:
            # A request's forked samples draw from the same logits row as it does.
            rows = [(i, r) for i in sampling for r in (requests[i], *sched.forks.get(requests[i].request_id, ()))]
            logits = self.model.compute_logits(hidden[[ends[i] - 1 for i, _ in rows]])
            self._sample([r for _, r in rows], logits, out)
        return out

    def _forward(self, input_ids: torch.Tensor, positions: torch.Tensor,
                 meta: AttentionMetadata) -> torch.Tensor:
        """Hidden states ``[num_tokens, hidden_size]``: from a CUDA graph for a pure-decode
        step that fits the captured sizes, else from an eager forward."""
        graphs = self.decode_graphs
        if graphs is not None and meta.num_decodes == meta.num_seqs <= graphs.max_batch_size:
            return graphs.run(input_ids, positions, meta)
        return self.model(input_ids, positions, self.kv_caches, meta)

    def copy_blocks(self, pairs: list[tuple[int, int]]) -> None:
        """Copy-on-write: block ``src`` -> block ``dst`` in every layer's K and V."""
        if not pairs:
            return
        src = torch.tensor([p[0] for p in pairs], device=self.device)
        dst = torch.tensor([p[1] for p in pairs], device=self.device)
        for cache in self.kv_caches:
            cache[:, dst] = cache[:, src]

    @torch.inference_mode()
    def profile_run(self, num_tokens: int, max_num_seqs: int, max_model_len: int,
                    kv_caches: list[torch.Tensor]) -> None:
        """One forward over ``num_tokens`` dummy prompt tokens (as few sequences as
        ``max_model_len`` allows) plus logits and a vocabulary sort for up to
        ``max_num_seqs`` rows: the largest step the engine will run, so the caller can
        measure its peak activation memory. ``kv_caches`` must hold
        ``cdiv(num_tokens, block_size) + num_sequences`` blocks."""
        lens = [min(max_model_len, num_tokens - i) for i in range(0, num_tokens, max_model_len)]
        requests, tables, next_block = [], [], 0
        for i, n in enumerate(lens):
            requests.append(Request(f"profile-{i}", [0] * n, SamplingParams(max_tokens=1), None))
            num_blocks = -(-n // self.block_size)
            tables.append(list(range(next_block, next_block + num_blocks)))
            next_block += num_blocks
        input_ids, positions, meta = self._prepare_inputs(requests, lens, tables)
        hidden = self.model(input_ids, positions, kv_caches, meta)
        logits = self.model.compute_logits(hidden[: min(max_num_seqs, num_tokens)])
        torch.sort(logits, dim=-1)

    def _prepare_inputs(self, requests: list[Request], query_lens: list[int],
                        tables: list[list[int]]):
        dev = self.device
        starts = [r.num_computed_tokens for r in requests]
        token_ids = [t for r, s, n in zip(requests, starts, query_lens)
                     for t in r.all_token_ids[s : s + n]]
        seq_lens = [s + n for s, n in zip(starts, query_lens)]
        num_tokens = len(token_ids)

        q_lens = torch.tensor(query_lens, dtype=torch.int64)
        query_start_loc = torch.zeros(len(requests) + 1, dtype=torch.int64)
        torch.cumsum(q_lens, 0, out=query_start_loc[1:])
        seq_idx = torch.repeat_interleave(torch.arange(len(requests)), q_lens)
        # position of token t = its sequence's start + (t - first row of that sequence)
        offsets = torch.tensor(starts, dtype=torch.int64) - query_start_loc[:-1]
        positions = torch.arange(num_tokens, dtype=torch.int64) + offsets[seq_idx]

        max_blocks = max(len(t) for t in tables)
        block_tables = torch.zeros(len(requests), max_blocks, dtype=torch.int64)
        for i, t in enumerate(tables):
            block_tables[i, : len(t)] = torch.tensor(t, dtype=torch.int64)
        bs = self.block_size
        slot_mapping = block_tables[seq_idx, positions // bs] * bs + positions % bs

        meta = AttentionMetadata(
            slot_mapping=slot_mapping.to(dev),
            query_start_loc=query_start_loc.to(dev),
            seq_lens=torch.tensor(seq_lens, dtype=torch.int64, device=dev),
            block_tables=block_tables.to(dev),
            query_lens_list=query_lens,
            seq_lens_list=seq_lens,
            num_decodes=sum(1 for n in query_lens if n == 1),
            block_size=bs,
        )
        input_ids = torch.tensor(token_ids, dtype=torch.int64, device=dev)
        return input_ids, positions.to(dev), meta

    def _sample(self, requests: list[Request], logits: torch.Tensor, out: ModelRunnerOutput) -> None:
        batch = SamplingBatch.build(
            [r.sampling_params for r in requests],
            [r.prompt_token_ids for r in requests],
            [r.output_token_ids for r in requests],
            self.eos_token_id, self.vocab_size, logits.device, self.grammar_bitmask(requests),
        )
        result = self.sampler(logits, batch)
        token_ids = result.sampled_token_ids.tolist()
        for i, r in enumerate(requests):
            out.sampled[r.request_id] = token_ids[i]
        if result.topk_token_ids is None:
            return
        lps, ranks = result.sampled_logprobs.tolist(), result.sampled_ranks.tolist()
        top_ids, top_lps = result.topk_token_ids.tolist(), result.topk_logprobs.tolist()
        for i, r in enumerate(requests):
            k = r.sampling_params.logprobs
            if k is not None:
                out.logprobs[r.request_id] = TokenLogprobs(
                    token_ids[i], lps[i], ranks[i], top_ids[i][:k], top_lps[i][:k])

    def _prompt_logprobs(self, request: Request, num_new: int, hidden: torch.Tensor,
                         out: ModelRunnerOutput) -> None:
        """Logprobs of prompt tokens ``start+1 .. start+num_new`` from this chunk's rows."""
        start = request.num_computed_tokens
        num_rows = min(num_new, request.num_prompt_tokens - 1 - start)
        if num_rows <= 0:
            return
        logits = self.model.compute_logits(hidden[:num_rows])
        logprobs = logits - logsumexp_rows(logits)[:, None]  # a row's bits whatever the chunk
        targets = torch.tensor(request.prompt_token_ids[start + 1 : start + 1 + num_rows],
                               device=logprobs.device)
        chosen = logprobs.gather(1, targets[:, None])
        ranks = (logprobs > chosen).sum(-1) + 1
        k = request.sampling_params.prompt_logprobs
        top = logprobs.topk(k, dim=-1) if k > 0 else None
        entries = []
        for j in range(num_rows):
            entries.append(TokenLogprobs(
                int(targets[j]), float(chosen[j]), int(ranks[j]),
                top.indices[j].tolist() if top else [], top.values[j].tolist() if top else []))
        out.prompt_logprobs[request.request_id] = (start, entries)
