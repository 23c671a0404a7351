"""Batched token sampler: one vectorized pass over the rows that sample this step.

Follows vLLM v1's ``Sampler`` (``vllm/v1/sample/sampler.py``) in order and semantics:

1. log-probabilities from the RAW logits (vLLM's default ``raw_logprobs`` mode);
2. ``logit_bias`` (added), ``min_tokens`` (EOS and stop tokens -> -inf);
3. penalties: repetition (prompt + output tokens), frequency and presence (output tokens);
3b. structured outputs: the grammar bitmask of the constrained rows only (-inf where a
   token is not allowed; -inf commutes with the temperature division that follows);
4. greedy rows take the argmax; the others: / temperature, min_p, top_k, top_p, then the
   exponential race ``argmax(probs / q)``, ``q ~ Exp(1)``, which draws from ``probs``
   exactly, taken in log space as ``argmax(x - log q)`` (the Gumbel-max trick: the
   softmax's normalizer is the same for every token of a row, so it is never computed).

Every row's result is a function of that row alone, bit for bit, whatever the batch
(batch invariance): the normalizers of logprobs and top_p come from ``logsumexp_rows``
(one summation order per row, where ``torch.logsumexp`` changes it with the row count),
min_p compares logits (``x < max + log(min_p)``, no softmax), and a seeded row's noise for
output token ``i`` is drawn from a generator seeded with ``noise_seed(seed, i)``: the same
sample alone, batched, after preemption, or (a draft's verification) out of order.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from pagedserve.cpu_ops import cpu_layer_ops
from pagedserve.sampling_params import SAMPLING_EPS, SamplingParams
from pagedserve.structured_output.bitmask import GrammarBitmask, apply_grammar_bitmask

_MASK64 = (1 << 64) - 1
_ARGMAX_DTYPES = (torch.float32, torch.bfloat16, torch.float16)  # row_argmax's


def _splitmix64(z: int) -> int:
    """SplitMix64's output function (Steele, Lea & Flood, "Fast splittable pseudorandom
    number generators", OOPSLA 2014): a bijection of 64-bit integers that scatters nearby
    inputs."""
    z = (z + 0x9E3779B97F4A7C15) & _MASK64
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & _MASK64
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & _MASK64
    return z ^ (z >> 31)


def noise_seed(seed: int, position: int) -> int:
    """The generator seed of the noise for output token ``position`` (0-based) of a request
    seeded ``seed``: a function of the two alone, so that token's sample never depends on
    the batch, on preemption, or on how many draws came before."""
    return _splitmix64(_splitmix64(seed & _MASK64) ^ position)


def make_generator(seed: int, device: torch.device | str) -> torch.Generator:
    """A ``torch.Generator`` on ``device`` seeded with ``seed``."""
    gen = torch.Generator(device=device)
    gen.manual_seed(seed)
    return gen


def logsumexp_rows(x: torch.Tensor) -> torch.Tensor:
    """``log(sum(exp(x), -1))`` of float32 ``x`` ``[B, V]`` -> ``[B]``. On CPU each row in
    one summation order whatever B (``torch.ops.pagedserve.row_logsumexp``,
    ``csrc/logsumexp_cpu.cpp``); elsewhere ``torch.logsumexp``."""
    ops = cpu_layer_ops(x)
    return ops.row_logsumexp(x) if ops is not None else torch.logsumexp(x, dim=-1)


def _pad(rows: list[list[int]], pad: int, device: torch.device | str) -> torch.Tensor:
    """[B, max_len] int64, right-padded with ``pad`` (at least one column)."""
    width = max(1, max((len(r) for r in rows), default=0))
    out = torch.full((len(rows), width), pad, dtype=torch.int64)
    for i, r in enumerate(rows):
        if r:
            out[i, : len(r)] = torch.tensor(r, dtype=torch.int64)
    return out.to(device)


def _bin_counts(tokens: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """Token counts [B, V] int64 of padded ids [B, L] (pad id = vocab_size is dropped)."""
    counts = torch.zeros(tokens.shape[0], vocab_size + 1, dtype=torch.int64, device=tokens.device)
    counts.scatter_add_(1, tokens, torch.ones_like(tokens))
    return counts[:, :vocab_size]


@dataclass
class SamplingBatch:
    """Per-row sampling state of one step; rows = sequences that sample this step (B).

    Attributes:
        temperature: [B] float32; greedy rows hold 1.0 (they take the argmax anyway).
        top_p, min_p: [B] float32.
        top_k: [B] int64, 0 = off (-1 normalised to 0, values above V clamped to V).
        presence_penalty, frequency_penalty, repetition_penalty: [B] float32.
        seeds: per row, the request's seed, or None (unseeded rows draw from the global
            generator; greedy rows draw nothing).
        positions: per row, the index of the output token being sampled (its number of
            output tokens so far), which keys a seeded row's noise (``noise_seed``).
        greedy: [B] bool, rows that take the argmax.
        prompt_token_ids: [B, Lp] int64 padded with V, or None when no row has a
            repetition penalty. output_token_ids: [B, Lo] int64 padded with V, or None
            when no row has a penalty.
        min_tokens_rows, min_tokens_ids: int64 index pairs set to -inf (min_tokens).
        bias_rows, bias_ids, bias_values: sparse logit_bias entries (int64, int64, float32).
        grammar: bitmask of the rows with a structured-output grammar, or None.
        max_num_logprobs: largest ``logprobs`` of the batch (at most V), or None if none.
        all_greedy, all_random, no_penalties, no_top_k, no_top_p, no_min_p: skip flags.
        vocab_size: V, the width of the logits this batch is for.
    """

    temperature: torch.Tensor
    top_p: torch.Tensor
    top_k: torch.Tensor
    min_p: torch.Tensor
    presence_penalty: torch.Tensor
    frequency_penalty: torch.Tensor
    repetition_penalty: torch.Tensor
    seeds: list[int | None]
    positions: list[int]
    greedy: torch.Tensor
    prompt_token_ids: torch.Tensor | None
    output_token_ids: torch.Tensor | None
    min_tokens_rows: torch.Tensor | None
    min_tokens_ids: torch.Tensor | None
    bias_rows: torch.Tensor | None
    bias_ids: torch.Tensor | None
    bias_values: torch.Tensor | None
    grammar: GrammarBitmask | None
    max_num_logprobs: int | None
    all_greedy: bool
    all_random: bool
    no_penalties: bool
    no_top_k: bool
    no_top_p: bool
    no_min_p: bool
    vocab_size: int

    @property
    def processes_logits(self) -> bool:
        """Whether ``Sampler.process_logits`` changes any row (bias, min_tokens, penalties
        or a grammar)."""
        return self.bias_rows is not None or self.min_tokens_rows is not None \
            or not self.no_penalties or self.grammar is not None

    @classmethod
    def build(cls, params: list[SamplingParams], prompt_token_ids: list[list[int]],
              output_token_ids: list[list[int]], eos_token_id: int | None, vocab_size: int,
              device: torch.device | str, grammar: GrammarBitmask | None = None
              ) -> SamplingBatch:
        """Gather the rows' parameters into tensors on ``device``.

        ``min_tokens`` masks ``stop_token_ids`` and, unless ``ignore_eos`` (then EOS is an
        ordinary token, as in vLLM's ``all_stop_token_ids``), ``eos_token_id``; not on a
        row whose grammar allows nothing but stop tokens (``grammar.stop_only``), which
        would otherwise have no token left.
        Raises ``ValueError`` if the lists differ in length or a ``logit_bias`` /
        ``stop_token_ids`` id is outside [0, vocab_size).
        """
        b = len(params)
        if not len(prompt_token_ids) == len(output_token_ids) == b:
            raise ValueError("params, prompt_token_ids and output_token_ids must have the "
                             f"same length; got {b}, {len(prompt_token_ids)}, "
                             f"{len(output_token_ids)}")

        def f32(vals: list[float]) -> torch.Tensor:
            return torch.tensor(vals, dtype=torch.float32, device=device)

        greedy = [p.is_greedy for p in params]
        top_k = [min(max(p.top_k, 0), vocab_size) for p in params]
        rep = [p.repetition_penalty for p in params]
        freq = [p.frequency_penalty for p in params]
        pres = [p.presence_penalty for p in params]
        no_rep = all(abs(r - 1.0) < SAMPLING_EPS for r in rep)
        no_penalties = no_rep and all(abs(x) < SAMPLING_EPS for x in freq + pres)

        mt_rows: list[int] = []
        mt_ids: list[int] = []
        bias_rows: list[int] = []
        bias_ids: list[int] = []
        bias_vals: list[float] = []
        grammar_done = set() if grammar is None else {
            int(r) for r, done in zip(grammar.rows, grammar.stop_only) if done}
        for i, p in enumerate(params):
            if len(output_token_ids[i]) < p.min_tokens and i not in grammar_done:
                stops = set(p.stop_token_ids or [])
                if eos_token_id is not None and not p.ignore_eos:
                    stops.add(eos_token_id)
                mt_rows += [i] * len(stops)
                mt_ids += sorted(stops)
            for tok, val in (p.logit_bias or {}).items():
                bias_rows.append(i)
                bias_ids.append(tok)
                bias_vals.append(val)
        for name, ids in (("stop_token_ids", mt_ids), ("logit_bias", bias_ids)):
            bad = [t for t in ids if not 0 <= t < vocab_size]
            if bad:
                raise ValueError(f"{name} token ids must be in [0, {vocab_size}); got {bad}")

        def i64(vals: list[int]) -> torch.Tensor | None:
            return torch.tensor(vals, dtype=torch.int64, device=device) if vals else None

        logprobs = [p.logprobs for p in params if p.logprobs is not None]
        return cls(
            temperature=f32([1.0 if g else p.temperature for g, p in zip(greedy, params)]),
            top_p=f32([p.top_p for p in params]),
            top_k=torch.tensor(top_k, dtype=torch.int64, device=device),
            min_p=f32([p.min_p for p in params]),
            presence_penalty=f32(pres),
            frequency_penalty=f32(freq),
            repetition_penalty=f32(rep),
            seeds=[None if g else p.seed for g, p in zip(greedy, params)],
            positions=[len(out) for out in output_token_ids],
            greedy=torch.tensor(greedy, dtype=torch.bool, device=device),
            prompt_token_ids=None if no_rep else _pad(prompt_token_ids, vocab_size, device),
            output_token_ids=None if no_penalties else _pad(output_token_ids, vocab_size, device),
            min_tokens_rows=i64(mt_rows),
            min_tokens_ids=i64(mt_ids),
            bias_rows=i64(bias_rows),
            bias_ids=i64(bias_ids),
            bias_values=f32(bias_vals) if bias_vals else None,
            grammar=grammar,
            max_num_logprobs=min(max(logprobs), vocab_size) if logprobs else None,
            all_greedy=all(greedy),
            all_random=not any(greedy),
            no_penalties=no_penalties,
            no_top_k=all(k == 0 for g, k in zip(greedy, top_k) if not g),
            no_top_p=all(p.top_p >= 1.0 for p in params if not p.is_greedy),
            no_min_p=all(p.min_p <= 0.0 for p in params if not p.is_greedy),
            vocab_size=vocab_size,
        )


@dataclass
class SamplerOutput:
    """Result of one sampling step.

    Attributes:
        sampled_token_ids: [B] int64.
        sampled_logprobs: [B] float32, log-softmax of the RAW logits at the sampled token;
            None if no logprobs asked.
        topk_token_ids: [B, K] int64, K = max requested ``logprobs`` (None if none asked).
        topk_logprobs: [B, K] float32, raw log-softmax values of ``topk_token_ids``.
        sampled_ranks: [B] int64, 1-based rank of the sampled token in the raw
            distribution (ties count against it, as vLLM); None if no logprobs asked.
    """

    sampled_token_ids: torch.Tensor
    sampled_logprobs: torch.Tensor | None
    topk_token_ids: torch.Tensor | None
    topk_logprobs: torch.Tensor | None
    sampled_ranks: torch.Tensor | None


def argmax_rows(x: torch.Tensor) -> torch.Tensor:
    """``x [B, V]`` -> ``[B]`` int64: each row's first maximal index, as ``argmax`` (a NaN
    counts as the maximum). On CPU ``torch.ops.pagedserve.row_argmax`` (``csrc/argmax_cpu.cpp``:
    the maximum in vectors, then its first index; float32, bfloat16 or float16); elsewhere
    ``max``, which returns the same index and ran 2.7x faster than ``argmax`` on CPU."""
    ops = cpu_layer_ops(x)
    if ops is not None and x.dtype in _ARGMAX_DTYPES and x.size(-1) > 0 and x.stride(-1) == 1:
        return ops.row_argmax(x)
    return x.max(dim=-1).indices


class Sampler:
    """Stateless batched sampler; see the module docstring for the order of operations."""

    def __call__(self, logits: torch.Tensor, batch: SamplingBatch) -> SamplerOutput:
        """Sample one token per row of ``logits`` [B, V] (any float dtype, cast to float32).

        Raises ``ValueError`` if ``logits`` is not [len(batch), batch.vocab_size].
        """
        raw, sampled = self.sample(logits, batch)
        return self.logprobs(raw, sampled, batch.max_num_logprobs)

    def sample(self, logits: torch.Tensor, batch: SamplingBatch
               ) -> tuple[torch.Tensor, torch.Tensor]:
        """The raw logits ``[B, V]`` (float32, or ``logits`` themselves where every row is
        greedy and nothing processes them) and one sampled token per row ``[B]`` int64,
        without logprobs (``logprobs`` adds them). Raises ``ValueError`` as ``__call__``."""
        if logits.dim() != 2 or logits.shape != (len(batch.seeds), batch.vocab_size):
            raise ValueError(f"logits must be [{len(batch.seeds)}, {batch.vocab_size}]; "
                             f"got {list(logits.shape)}")
        # As vLLM's sampler: processed and sampled in float32. A greedy batch with nothing
        # to process takes the argmax of the model's own logits: the index of their float32
        # copy, without writing it (a decode step of 64 rows: 12.6 MB).
        raw = logits if batch.all_greedy and not batch.processes_logits else logits.float()
        x = self.process_logits(raw, batch)
        return raw, argmax_rows(x) if batch.all_greedy else self._sample(x, batch)

    @staticmethod
    def logprobs(raw: torch.Tensor, token_ids: torch.Tensor, max_num_logprobs: int | None
                 ) -> SamplerOutput:
        """The ``SamplerOutput`` of ``token_ids`` [B] chosen from ``raw`` [B, V] (any float
        dtype, taken in float32): their raw logprobs and ranks and the top
        ``max_num_logprobs`` (None: no logprobs, and no softmax over the vocabulary)."""
        if max_num_logprobs is None:
            return SamplerOutput(token_ids, None, None, None, None)
        raw = raw.float()
        lse = logsumexp_rows(raw)
        top_vals, topk_ids = raw.topk(max_num_logprobs, dim=-1)
        chosen_raw = raw.gather(1, token_ids[:, None])
        ranks = (raw >= chosen_raw).sum(dim=-1)
        return SamplerOutput(token_ids, chosen_raw[:, 0] - lse, topk_ids, top_vals - lse[:, None],
                             ranks)

    @staticmethod
    def process_logits(raw: torch.Tensor, batch: SamplingBatch) -> torch.Tensor:
        """logit_bias, min_tokens, penalties, grammar bitmask on float32 ``raw`` [B, V]
        -> [B, V].

        Returns ``raw`` itself when nothing applies, else a new tensor (``raw`` untouched).
        """
        x = raw.clone() if batch.processes_logits else raw
        if batch.bias_rows is not None:
            x.index_put_((batch.bias_rows, batch.bias_ids), batch.bias_values, accumulate=True)
        if batch.min_tokens_rows is not None:
            x[batch.min_tokens_rows, batch.min_tokens_ids] = float("-inf")
        if not batch.no_penalties:
            x = Sampler._penalties(x, batch)
        if batch.grammar is not None:
            apply_grammar_bitmask(x, batch.grammar)
        return x

    @staticmethod
    def _penalties(x: torch.Tensor, batch: SamplingBatch) -> torch.Tensor:
        """Repetition, frequency and presence penalties; ``x`` [B, V] is modified."""
        vocab = x.shape[1]
        out_counts = _bin_counts(batch.output_token_ids, vocab)
        out_mask = out_counts > 0
        if batch.prompt_token_ids is not None:
            seen = out_mask | (_bin_counts(batch.prompt_token_ids, vocab) > 0)
            pen = torch.where(seen, batch.repetition_penalty[:, None], 1.0)
            x = torch.where(x > 0, x / pen, x * pen)
        x -= batch.frequency_penalty[:, None] * out_counts
        x -= batch.presence_penalty[:, None] * out_mask
        return x

    @staticmethod
    def sampling_logits(x: torch.Tensor, batch: SamplingBatch) -> torch.Tensor:
        """Processed logits [B, V] -> the logits a random row samples from (their softmax
        is its distribution): / temperature, then min_p, top_k, top_p (-inf outside)."""
        x = x / batch.temperature[:, None]
        if not batch.no_min_p:
            # probs < min_p * max(probs)  <=>  x < max(x) + log(min_p): no normalizer needed
            floor = x.amax(dim=-1, keepdim=True) + batch.min_p[:, None].log()
            x = x.masked_fill(x < floor, float("-inf"))
        if not (batch.no_top_k and batch.no_top_p):
            x = _top_k_top_p(x, None if batch.no_top_k else batch.top_k,
                             None if batch.no_top_p else batch.top_p)
        return x

    @staticmethod
    def _sample(x: torch.Tensor, batch: SamplingBatch) -> torch.Tensor:
        """Temperature, min_p, top_k, top_p, then the exponential race; argmax for greedy."""
        greedy_ids = None if batch.all_random else argmax_rows(x)
        x = Sampler.sampling_logits(x, batch)
        log_q = _exponential_noise(x, batch).log_()
        sampled = argmax_rows(x - log_q)
        if greedy_ids is not None:
            sampled = torch.where(batch.greedy, greedy_ids, sampled)
        return sampled


def _exponential_noise(x: torch.Tensor, batch: SamplingBatch) -> torch.Tensor:
    """``q ~ Exp(1)`` shaped like ``x`` ``[B, V]``: a seeded row's from its own generator
    seeded with ``noise_seed(seed, position)``, the other rows' from the global one."""
    q = torch.empty_like(x)
    seeded = [i for i, s in enumerate(batch.seeds) if s is not None]
    if len(seeded) < len(batch.seeds):
        q.exponential_()
    for i in seeded:
        gen = make_generator(noise_seed(batch.seeds[i], batch.positions[i]), x.device)
        q[i].exponential_(generator=gen)
    return q


def _top_k_top_p(x: torch.Tensor, k: torch.Tensor | None, p: torch.Tensor | None) -> torch.Tensor:
    """vLLM's ``apply_top_k_top_p``: sort ascending, mask, scatter back.

    top_k keeps every token tied with the k-th largest logit; k == 0 is off. top_p masks
    the low tail whose cumulative probability is <= 1 - p, always keeping the top token.
    """
    x_sort, idx = x.sort(dim=-1, descending=False)
    vocab = x.shape[1]
    if k is not None:
        k_eff = torch.where(k > 0, k, vocab)
        kth = x_sort.gather(1, (vocab - k_eff)[:, None])
        x_sort = x_sort.masked_fill(x_sort < kth, float("-inf"))
    if p is not None:
        probs = (x_sort - logsumexp_rows(x_sort)[:, None]).exp_()
        cum = probs.cumsum(dim=-1)
        mask = cum <= 1 - p[:, None]
        mask[:, -1] = False
        x_sort = x_sort.masked_fill(mask, float("-inf"))
    return torch.empty_like(x).scatter_(1, idx, x_sort)
