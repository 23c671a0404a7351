"""Turns a ``SchedulerOutput`` into one flat forward pass and samples the next tokens.

Per step it builds, with no Python loop over tokens: ``input_ids`` and ``positions``
``[num_tokens]``, ``slot_mapping`` ``[num_tokens]``, ``block_tables``
``[num_seqs, max_blocks]``, ``query_start_loc`` ``[num_seqs + 1]`` and ``seq_lens``
``[num_seqs]``. Sequences with one new token (decodes) go first so the attention backend
can batch them. Only the rows that are sampled get logits. A pure-decode step replays a
CUDA graph when the engine captured them (``decode_graphs``, see ``cuda_graphs.py``).
"""

from __future__ import annotations

import itertools
from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from pagedserve.attention import AttentionMetadata
from pagedserve.core.scheduler import SchedulerOutput
from pagedserve.lora.manager import LoRAManager
from pagedserve.request import Request
from pagedserve.sample.sampler import Sampler, SamplingBatch, logsumexp_rows
from pagedserve.sampling_params import SamplingParams
from pagedserve.spec_decode.drafter import Drafter
from pagedserve.spec_decode.rejection import accept_one_hot, accept_sampled
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
    """Per request id: the new tokens (accepted drafts, then one sampled token), their
    logprobs (if asked), prompt logprobs ``(first_position, [TokenLogprobs of prompt tokens
    first_position+1 ...])`` and the draft tokens proposed for the next step."""

    sampled: dict[str, list[int]] = field(default_factory=dict)
    logprobs: dict[str, list[TokenLogprobs]] = field(default_factory=dict)
    prompt_logprobs: dict[str, tuple[int, list[TokenLogprobs]]] = field(default_factory=dict)
    spec_token_ids: dict[str, list[int]] = field(default_factory=dict)


class ModelRunner:
    """``grammar_bitmask(rows)`` gives the structured-output bitmask of the rows to sample
    (``rows[i]`` = (request, its draft tokens before row i)), or None when no row is
    constrained."""

    def __init__(self, model, block_size: int, device: str, vocab_size: int,
                 eos_token_id: int | None,
                 grammar_bitmask: Callable[[list[tuple[Request, list[int]]]],
                                           GrammarBitmask | None] | None = None
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
        self.drafter: Drafter | None = None  # set by the worker (speculative decoding)
        # A draft model's own KV cache: the same block ids, so block copies copy it too.
        self.draft_kv_caches: list[torch.Tensor] = []
        self.lora: LoRAManager | None = None  # set by the worker (LoRA adapters)

    @torch.inference_mode()
    def execute_model(self, sched: SchedulerOutput) -> ModelRunnerOutput:
        # Decodes and verifications first, prompt chunks last.
        order = sorted(range(len(sched.requests)), key=lambda i: (
            sched.num_scheduled_tokens[i] != 1
            and sched.requests[i].request_id not in sched.spec_token_ids))
        requests = [sched.requests[i] for i in order]
        query_lens = [sched.num_scheduled_tokens[i] for i in order]
        tables = [sched.block_tables[i] for i in order]
        drafts = [sched.spec_token_ids.get(r.request_id, []) for r in requests]
        starts = [r.num_computed_tokens for r in requests]
        new_tokens = [(r.all_token_ids[c:] + d)[:n]
                      for r, c, n, d in zip(requests, starts, query_lens, drafts)]
        step = self.prepare_inputs(*_split_verifications(new_tokens, starts, tables, drafts))
        if self.lora is not None:  # token order is the requests' (splitting keeps it)
            self.lora.prepare_step([r.lora_id for r in requests], query_lens)
        self.copy_blocks(sched.blocks_to_copy)

        hidden = self._forward(*step)
        if self.drafter is not None:
            self.drafter.after_forward(self, step)

        out = ModelRunnerOutput()
        ends = list(itertools.accumulate(query_lens))  # each request's rows end here
        for i, r in enumerate(requests):
            if r.sampling_params.prompt_logprobs is not None:
                self._prompt_logprobs(r, query_lens[i], hidden[ends[i] - query_lens[i] : ends[i]], out)
        sampling = [i for i, r in enumerate(requests)
                    if starts[i] + query_lens[i] == r.num_tokens + len(drafts[i])]
        if not sampling:
            return out
        # One row per token to sample: a verifying request's row j follows its first j
        # drafts; a request's forked samples draw from its row.
        rows, hidden_rows = [], []
        for i in sampling:
            d = drafts[i]
            for j in range(len(d) + 1):
                rows.append((requests[i], d[:j]))
                hidden_rows.append(ends[i] - len(d) - 1 + j)
            for child in sched.forks.get(requests[i].request_id, ()):
                rows.append((child, []))
                hidden_rows.append(ends[i] - 1)
        self._sample(rows, self.model.compute_logits(hidden[hidden_rows]), out)
        if self.drafter is not None and sched.speculate:
            sampled = [requests[i] for i in sampling if requests[i].request_id not in sched.forks]
            out.spec_token_ids = self.drafter.propose(
                self, step, sampled, out.sampled, dict(zip(
                    (r.request_id for r in sched.requests), sched.block_tables)))
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
        for cache in self.kv_caches + self.draft_kv_caches:
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
        input_ids, positions, meta = self.prepare_inputs([[0] * n for n in lens],
                                                         [0] * len(lens), tables)
        hidden = self.model(input_ids, positions, kv_caches, meta)
        logits = self.model.compute_logits(hidden[: min(max_num_seqs, num_tokens)]).float()
        torch.sort(logits, dim=-1)

    def prepare_inputs(self, new_tokens: list[list[int]], starts: list[int],
                       tables: list[list[int]]
                       ) -> tuple[torch.Tensor, torch.Tensor, AttentionMetadata]:
        """The flat forward pass of sequences whose ``new_tokens[i]`` start at position
        ``starts[i]`` (the tokens before have their K/V in the blocks of ``tables[i]``):
        ``input_ids`` and ``positions`` ``[num_tokens]`` and the attention metadata."""
        # Built as Python lists, then one tensor each: at a decode step the torch ops that
        # derived them from one another cost more in dispatch than in arithmetic.
        query_lens = [len(t) for t in new_tokens]
        seq_lens = [s + n for s, n in zip(starts, query_lens)]
        positions = [p for s, e in zip(starts, seq_lens) for p in range(s, e)]
        bs = self.block_size
        slot_mapping = [table[p // bs] * bs + p % bs
                        for table, s, e in zip(tables, starts, seq_lens) for p in range(s, e)]
        max_blocks = max(len(t) for t in tables)

        def tensor(values: list) -> torch.Tensor:
            return torch.tensor(values, dtype=torch.int64, device=self.device)

        meta = AttentionMetadata(
            slot_mapping=tensor(slot_mapping),
            query_start_loc=tensor([0, *itertools.accumulate(query_lens)]),
            seq_lens=tensor(seq_lens),
            # one tensor from padded lists: a tensor per table cost 4x more (0.27 ms at 64)
            block_tables=tensor([t + [0] * (max_blocks - len(t)) for t in tables]),
            query_lens_list=query_lens,
            seq_lens_list=seq_lens,
            num_decodes=sum(1 for n in query_lens if n == 1),
            block_size=bs,
        )
        return tensor([t for tokens in new_tokens for t in tokens]), tensor(positions), meta

    def _sample(self, rows: list[tuple[Request, list[int]]], logits: torch.Tensor,
                out: ModelRunnerOutput) -> None:
        """Sample every row (``(request, its drafts before the row)``; a request's rows are
        adjacent), verify the drafts (``spec_decode/rejection.py``) and record each
        request's new tokens with their logprobs, as if decoded one at a time."""
        requests = [r for r, _ in rows]
        batch = SamplingBatch.build(
            [r.sampling_params for r in requests],
            [r.prompt_token_ids for r in requests],
            [r.output_token_ids + drafts for r, drafts in rows],
            self.eos_token_id, self.vocab_size, logits.device, self.grammar_bitmask(rows),
        )
        raw, targets = self.sampler.sample(logits, batch)
        chosen = targets.tolist()  # becomes the token each row contributes
        spans = _spans(requests)
        draft_probs = self._draft_probs(spans, rows)  # random rows': raw is float32 then
        probs = None if not draft_probs else Sampler.sampling_logits(
            Sampler.process_logits(raw, batch), batch).softmax(-1)
        for request, start, end in spans:
            drafts = rows[end - 1][1]
            q = draft_probs.get(request.request_id)
            if q is None:
                tokens = accept_one_hot(drafts, chosen[start:end])
            else:
                tokens = accept_sampled(drafts, probs[start:end], q, chosen[end - 1],
                                        request.sampling_params.seed, request.num_output_tokens)
            chosen[start : start + len(tokens)] = tokens
            out.sampled[request.request_id] = tokens
        if batch.max_num_logprobs is None:
            return
        result = self.sampler.logprobs(raw, torch.tensor(chosen, device=raw.device),
                                       batch.max_num_logprobs)
        lps, ranks = result.sampled_logprobs.tolist(), result.sampled_ranks.tolist()
        top_ids, top_lps = result.topk_token_ids.tolist(), result.topk_logprobs.tolist()
        for request, start, _ in spans:
            k = request.sampling_params.logprobs
            if k is not None:
                out.logprobs[request.request_id] = [
                    TokenLogprobs(t, lps[start + j], ranks[start + j], top_ids[start + j][:k],
                                  top_lps[start + j][:k])
                    for j, t in enumerate(out.sampled[request.request_id])]

    def _draft_probs(self, spans: list[tuple[Request, int, int]],
                     rows: list[tuple[Request, list[int]]]) -> dict[str, torch.Tensor]:
        """Request id -> ``[s, V]`` distributions its ``s`` drafts were sampled from, for
        the sampling requests whose drafter drew them so (the others verify one-hot)."""
        if self.drafter is None:
            return {}
        found = {}
        for request, _, end in spans:
            num_drafts = len(rows[end - 1][1])
            if num_drafts and not request.sampling_params.is_greedy:
                q = self.drafter.draft_probs(request.request_id, num_drafts)
                if q is not None:
                    found[request.request_id] = q
        return found

    def _prompt_logprobs(self, request: Request, num_new: int, hidden: torch.Tensor,
                         out: ModelRunnerOutput) -> None:
        """Logprobs of prompt tokens ``start+1 .. start+num_new`` from this chunk's rows."""
        start = request.num_computed_tokens
        num_rows = min(num_new, request.num_prompt_tokens - 1 - start)
        if num_rows <= 0:
            return
        logits = self.model.compute_logits(hidden[:num_rows]).float()
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


def _spans(requests: list[Request]) -> list[tuple[Request, int, int]]:
    """``(request, start, end)`` of each run of rows of one request."""
    spans = []
    for i, r in enumerate(requests):
        if spans and spans[-1][0] is r:
            spans[-1] = (r, spans[-1][1], i + 1)
        else:
            spans.append((r, i, i + 1))
    return spans


def _split_verifications(new_tokens: list[list[int]], starts: list[int],
                         tables: list[list[int]], drafts: list[list[int]]
                         ) -> tuple[list[list[int]], list[int], list[list[int]]]:
    """The step's sequences with each verifying request's k + 1 tokens as k + 1 one-token
    sequences over its block table (row j at position ``start + j``, which attends to the
    K/V of rows 0..j written in the same pass): the step stays a decode batch for the
    attention backends and the fused CPU step, and every row computes the bits a causal
    chunk's row would (every kernel is row-invariant). Token order is unchanged."""
    out_tokens, out_starts, out_tables = [], [], []
    for tokens, start, table, d in zip(new_tokens, starts, tables, drafts):
        pieces = [[t] for t in tokens] if d else [tokens]
        for j, piece in enumerate(pieces):
            out_tokens.append(piece)
            out_starts.append(start + j)
            out_tables.append(table)
    return out_tokens, out_starts, out_tables
