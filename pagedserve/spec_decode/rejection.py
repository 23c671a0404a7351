"""Verification of draft tokens: which drafts a request keeps, and the token after them.

Row ``j`` of a request verifying drafts ``d_1 .. d_s`` is the target's distribution ``p_j``
for the token after ``d_1 .. d_j`` (row 0: after the request's last token), and ``t_j`` the
token the sampler draws there, exactly as decoding one token at a time would draw it.

- A draft without a distribution (n-gram, or a greedy request's argmax draft) is one-hot:
  ``d_{j+1}`` is kept while it equals ``t_j``; the first mismatch ``t_j`` ends the step,
  and when every draft is kept, the bonus token ``t_s`` follows. This is rejection sampling
  with a one-hot ``q`` (keep ``d`` with probability ``p(d)``; otherwise a token from ``p``
  without ``d``), and it yields the very tokens of one-at-a-time decoding: greedy is exact,
  and a seeded request samples what it would sample alone.
- A draft sampled from a distribution ``q_j`` (a draft model on a sampling request) is kept
  with probability ``min(1, p_j(d) / q_j(d))``; at the first rejection the token comes from
  ``norm(max(0, p_j - q_j))`` and the step ends (Leviathan, Kalman & Matias, "Fast Inference
  from Transformers via Speculative Decoding", ICML 2023, Algorithm 1; Chen et al.,
  "Accelerating Large Language Model Decoding with Speculative Sampling", 2023). The
  tokens are then distributed exactly as the target's. A seeded request's uniforms and
  resampling noise are keyed by (seed, output position), so the result is reproducible.
"""

from __future__ import annotations

import torch

from pagedserve.sample.sampler import make_generator, noise_seed

# Keys the uniforms and resampling noise apart from the sampler's own noise stream.
_ACCEPT_SALT = 0x5EED_ACCE
_RESAMPLE_SALT = 0x5EED_5A3B
_DRAFT_SALT = 0x5EED_D4AF


def accept_one_hot(drafts: list[int], targets: list[int]) -> list[int]:
    """The tokens a request appends: the drafts equal to the target token of their row,
    then the first target that differs (or the bonus ``targets[len(drafts)]``).

    ``targets`` has one more entry than ``drafts``; raises ``ValueError`` otherwise.
    """
    if len(targets) != len(drafts) + 1:
        raise ValueError(f"{len(drafts)} drafts need {len(drafts) + 1} targets; got {len(targets)}")
    for j, draft in enumerate(drafts):
        if draft != targets[j]:
            return [*drafts[:j], targets[j]]
    return [*drafts, targets[-1]]


def accept_sampled(drafts: list[int], target_probs: torch.Tensor, draft_probs: torch.Tensor,
                   bonus: int, seed: int | None, position: int) -> list[int]:
    """Rejection sampling of drafts drawn from ``draft_probs`` (see the module docstring).

    Args:
        drafts: ``d_1 .. d_s``.
        target_probs: ``[s + 1, V]`` float32, row j the target's sampling distribution
            after ``d_1 .. d_j`` (temperature, top-k, top-p, min-p applied).
        draft_probs: ``[s, V]`` float32, row j the distribution ``d_{j+1}`` was drawn from.
        bonus: the target's sample from row s, appended when every draft is kept.
        seed: the request's seed (None: the global generator).
        position: the output index of ``d_1`` (keys a seeded request's random numbers).

    Returns the tokens to append. Raises ``ValueError`` on mismatched shapes.
    """
    s = len(drafts)
    if target_probs.shape[0] != s + 1 or draft_probs.shape[0] != s:
        raise ValueError(f"{s} drafts need [{s + 1}, V] target and [{s}, V] draft probs; got "
                         f"{list(target_probs.shape)} and {list(draft_probs.shape)}")
    for j, draft in enumerate(drafts):
        p, q = target_probs[j], draft_probs[j]
        u = torch.rand(1, generator=_generator(seed, _ACCEPT_SALT, position + j, p.device),
                       device=p.device)
        if float(u) * float(q[draft]) < float(p[draft]):  # u < p/q, no division by zero
            continue
        return [*drafts[:j], _sample_residual(p, q, seed, position + j)]
    return [*drafts, bonus]


def sample_draft(q: torch.Tensor, seed: int | None, position: int) -> int:
    """A draft token from the draft's distribution ``q`` ``[V]`` for output index
    ``position`` (a seeded request's noise keyed by both, apart from the target's)."""
    return _race(q, _generator(seed, _DRAFT_SALT, position, q.device))


def _race(weights: torch.Tensor, generator: torch.Generator | None) -> int:
    """A token drawn with probability proportional to ``weights`` ``[V]`` (>= 0, not all
    zero) by the exponential race ``argmax(w / E)``, ``E ~ Exp(1)``: no normalizer."""
    noise = torch.empty_like(weights).exponential_(generator=generator)
    return int((weights / noise).argmax())


def _sample_residual(p: torch.Tensor, q: torch.Tensor, seed: int | None, position: int) -> int:
    """A token from ``norm(max(0, p - q))`` ``[V]``; from ``p`` itself where the residual
    is empty (p == q up to rounding)."""
    residual = (p - q).clamp_(min=0)
    if not bool(residual.any()):
        residual = p
    return _race(residual, _generator(seed, _RESAMPLE_SALT, position, p.device))


def _generator(seed: int | None, salt: int, position: int, device) -> torch.Generator | None:
    """A seeded request's generator for one purpose and position; None (global) unseeded."""
    return None if seed is None else make_generator(noise_seed(seed ^ salt, position), device)
