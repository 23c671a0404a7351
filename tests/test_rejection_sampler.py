"""Rejection sampling of speculative decoding (issue 29): the output is the target's
distribution, whatever the draft's.

Unit level (``spec_decode/rejection.py``), on hand-written distributions over V = 6 tokens
with tokens where q > p, where q = 0 < p and where p = 0 < q: drafts drawn with
``sample_draft`` over seeds 0..N-1 at a fixed position, verified by ``accept_sampled``; the
expected frequencies (p, the accepted part min(p, q) / alpha, the residual
norm(max(0, p - q)), the acceptance rates alpha = sum_x min(p(x), q(x))) are worked out by
hand in the constants below. Plus ``accept_one_hot`` hand cases, the ``ValueError`` of both,
and seeded reproducibility.

End to end: two tiny random Llamas over 16 tokens (target p, draft q: different seeds) run
by pagedserve with ``draft_model`` speculation, k = 2, one seeded sampling request per seed;
the reference is transformers on the same weights, the exact distribution of the output
tokens by enumerating every history (16^3 continuations in one batch). A chi-square test
(fixed threshold, fixed seeds: deterministic) compares each position's frequencies, and
those of consecutive pairs, with it, at temperature 1 and at temperature 0.8 with top_k 4;
the acceptance counters are checked against rates computed from p and q. See ``e2e`` for
which path makes which position.
"""

from __future__ import annotations

import functools
import math
from collections import Counter

import pytest
import torch

from pagedserve.spec_decode.rejection import accept_one_hot, accept_sampled, sample_draft

P_MIN = 1e-3  # chi-square: fail below this p-value (seeds are fixed, so it is deterministic)
Z_MAX = 4.5  # binomial counts: fail beyond this many standard deviations


def chi_square(observed: list[int], probs: list[float]) -> tuple[float, int, float]:
    """Pearson's chi-square of ``observed`` counts against ``probs``: (statistic, degrees of
    freedom, p-value). Cells with an expected count under 5 are pooled into one (merged with
    the smallest other cell while still under 5). A cell of probability 0 must be empty."""
    n = sum(observed)
    for count, prob in zip(observed, probs):
        assert prob > 0 or count == 0, f"{count} draws of a token of probability 0"
    cells = sorted((n * prob, count) for count, prob in zip(observed, probs) if prob > 0)
    small = [c for c in cells if c[0] < 5]
    cells = [c for c in cells if c[0] >= 5]
    if small:
        pooled = (sum(e for e, _ in small), sum(o for _, o in small))
        while pooled[0] < 5 and cells:
            e, o = cells.pop(0)
            pooled = (pooled[0] + e, pooled[1] + o)
        cells.append(pooled)
    stat = sum((o - e) ** 2 / e for e, o in cells)
    df = len(cells) - 1
    assert df >= 1
    pvalue = float(torch.special.gammaincc(torch.tensor(df / 2, dtype=torch.float64),
                                           torch.tensor(stat / 2, dtype=torch.float64)))
    return stat, df, pvalue


def assert_distributed(tokens: list[int], probs: list[float], what: str) -> float:
    counts = Counter(tokens)
    observed = [counts.get(t, 0) for t in range(len(probs))]
    assert sum(observed) == len(tokens), f"{what}: a token outside the vocabulary"
    stat, df, pvalue = chi_square(observed, probs)
    print(f"{what}: n={len(tokens)} chi2={stat:.2f} df={df} p={pvalue:.4f}")
    n = len(tokens)
    worst = sorted(range(len(probs)), key=lambda t: -abs(observed[t] - n * probs[t]))[:4]
    assert pvalue > P_MIN, (f"{what}: chi2 = {stat:.1f}, df = {df}, p = {pvalue:.2e}; largest "
                            "gaps (token: observed vs expected) " + ", ".join(
                                f"{t}: {observed[t]} vs {n * probs[t]:.1f}" for t in worst))
    return pvalue


def assert_binomial(count: int, n: int, prob: float, what: str) -> None:
    sd = math.sqrt(n * prob * (1 - prob))
    z = (count - n * prob) / sd
    print(f"{what}: {count}/{n} expected {n * prob:.1f} z={z:+.2f}")
    assert abs(z) < Z_MAX, f"{what}: {count} of {n}, expected {n * prob:.1f} (z = {z:.1f})"


def test_chi_square_helper():
    # df = 2: the survival function is exp(-x / 2).
    stat, df, pvalue = chi_square([50, 30, 20], [1 / 3, 1 / 3, 1 / 3])
    assert df == 2
    assert stat == pytest.approx((50 - 100 / 3) ** 2 * 3 / 100 + (30 - 100 / 3) ** 2 * 3 / 100
                                 + (20 - 100 / 3) ** 2 * 3 / 100)
    assert pvalue == pytest.approx(math.exp(-stat / 2), rel=1e-9)
    # df = 1: erfc(sqrt(x / 2)); the two cells of expected 2 and 3 pool into one of 5.
    stat, df, pvalue = chi_square([88, 12, 0], [0.95, 0.02, 0.03])
    assert (df, stat) == (1, pytest.approx((88 - 95) ** 2 / 95 + (12 - 5) ** 2 / 5))
    assert pvalue == pytest.approx(math.erfc(math.sqrt(stat / 2)), rel=1e-9)
    with pytest.raises(AssertionError, match="probability 0"):
        chi_square([5, 1], [1.0, 0.0])


# -- unit level: hand-written p and q over V = 6 -------------------------------------------

#         token:  0     1     2     3     4     5
P0 = [0.30, 0.05, 0.25, 0.25, 0.15, 0.00]
Q0 = [0.10, 0.30, 0.20, 0.00, 0.15, 0.25]  # q > p at 1 and 5 (p = 0), q = 0 < p at 3
ALPHA0 = 0.50  # sum min(p, q) = .10 + .05 + .20 + 0 + .15 + 0
ACCEPTED0 = [0.2, 0.1, 0.4, 0.0, 0.3, 0.0]  # min(p, q) / ALPHA0
RESIDUAL0 = [0.4, 0.0, 0.1, 0.5, 0.0, 0.0]  # max(0, p - q) = .20, 0, .05, .25, 0, 0; / .50
P1 = [0.05, 0.40, 0.10, 0.05, 0.30, 0.10]
Q1 = [0.20, 0.20, 0.20, 0.20, 0.10, 0.10]
ALPHA1 = 0.60  # .05 + .20 + .10 + .05 + .10 + .10
RESIDUAL1 = [0.0, 0.5, 0.0, 0.0, 0.5, 0.0]  # 0, .20, 0, 0, .20, 0; / .40
P2 = [0.10, 0.10, 0.10, 0.20, 0.20, 0.30]  # the bonus row of s = 2 (and row 1 of s = 1)
TARGET = torch.tensor([P0, P1, P2])
DRAFT = torch.tensor([Q0, Q1])
N = 15_000
POSITION = 7


@functools.cache
def verify_many(s: int) -> list[tuple[list[int], int, list[int]]]:
    """(drafts, bonus, appended tokens) of seeds 0..N-1 verifying ``s`` drafts at output
    position POSITION; draft j drawn from q_j with ``sample_draft`` as the drafter does,
    the bonus from p_s by an independent generator (the model runner's sampler draws it)."""
    bonus = torch.multinomial(TARGET[s], N, replacement=True,
                              generator=torch.Generator().manual_seed(12345)).tolist()
    runs = []
    for seed in range(N):
        drafts = [sample_draft(DRAFT[j], seed, POSITION + j) for j in range(s)]
        tokens = accept_sampled(drafts, TARGET[: s + 1], DRAFT[:s], bonus[seed], seed, POSITION)
        runs.append((drafts, bonus[seed], tokens))
    return runs


def num_accepted(drafts: list[int], tokens: list[int]) -> int:
    """Drafts kept: every token but the last is a draft (asserted)."""
    assert 1 <= len(tokens) <= len(drafts) + 1
    assert tokens[:-1] == drafts[: len(tokens) - 1]
    return len(tokens) - 1


def test_sample_draft_follows_q():
    for j in range(2):
        draws = [sample_draft(DRAFT[j], seed, POSITION) for seed in range(N // 4)]
        assert_distributed(draws, DRAFT[j].tolist(), f"sample_draft q{j}")


@pytest.mark.parametrize("s", [1, 2])
def test_accept_sampled_first_token_is_p0(s):
    runs = verify_many(s)
    firsts = [tokens[0] for _, _, tokens in runs]
    assert_distributed(firsts, P0, f"s={s}: first token")
    accepted = [n for n in (num_accepted(d, t) for d, _, t in runs)]
    # The two branches separately: a kept draft ~ min(p, q) / alpha, a resampled token ~
    # norm(max(0, p - q)); the resample path ran (about half the seeds).
    kept = [t[0] for (_, _, t), n in zip(runs, accepted) if n >= 1]
    resampled = [t[0] for (_, _, t), n in zip(runs, accepted) if n == 0]
    assert len(resampled) > N // 4
    assert_distributed(kept, ACCEPTED0, f"s={s}: kept first draft")
    assert_distributed(resampled, RESIDUAL0, f"s={s}: resampled first token")
    assert_binomial(len(kept), N, ALPHA0, f"s={s}: first draft kept")


def test_accept_sampled_one_draft_bonus():
    runs = verify_many(1)
    all_kept = [(d, b, t) for d, b, t in runs if len(t) == 2]
    for drafts, bonus, tokens in all_kept:
        assert tokens == [drafts[0], bonus]
    for drafts, _, tokens in runs:
        if len(tokens) == 1:
            assert tokens[0] != drafts[0]  # a rejected draft is never resampled: p <= q there
    assert_binomial(len(all_kept), N, ALPHA0, "s=1: all accepted (bonus)")


def test_accept_sampled_two_drafts():
    runs = verify_many(2)
    accepted = [num_accepted(d, t) for d, _, t in runs]
    for (drafts, bonus, tokens), n in zip(runs, accepted):
        if n == 2:
            assert tokens == [*drafts, bonus]
    # How many drafts are kept: 0 w.p. 1 - a0, 1 w.p. a0 (1 - a1), 2 w.p. a0 a1.
    expected = [1 - ALPHA0, ALPHA0 * (1 - ALPHA1), ALPHA0 * ALPHA1]
    assert_distributed(accepted, expected, "s=2: number accepted")
    assert_binomial(accepted.count(2), N, ALPHA0 * ALPHA1, "s=2: all accepted (bonus)")
    # After a kept first draft the second token follows p1 (rows given, not conditioned on
    # the first draft here), its resampled branch the residual of row 1.
    seconds = [t[1] for t, n in zip((r[2] for r in runs), accepted) if n >= 1]
    assert_distributed(seconds, P1, "s=2: second token")
    resampled = [t[1] for t, n in zip((r[2] for r in runs), accepted) if n == 1]
    assert len(resampled) > N // 10
    assert_distributed(resampled, RESIDUAL1, "s=2: resampled second token")


def test_accept_sampled_hand_cases():
    seeds = range(200)
    # p(0) >= q(0): always kept; p(5) = 0 < q(5): never kept, resampled from {0, 2, 3}.
    for seed in seeds:
        assert accept_sampled([0], TARGET[:2], DRAFT[:1], 4, seed, POSITION) == [0, 4]
        tokens = accept_sampled([5], TARGET[:2], DRAFT[:1], 4, seed, POSITION)
        assert len(tokens) == 1 and tokens[0] in (0, 2, 3)
        # p0(2) = .25 >= q0(2) = .20 and p1(1) = .40 >= q1(1) = .20: both always kept.
        assert accept_sampled([2, 1], TARGET, DRAFT, 3, seed, POSITION) == [2, 1, 3]
        # p1(0) = .05 < q1(0) = .20: kept 1 time in 4, else resampled from {1, 4}.
        tokens = accept_sampled([2, 0], TARGET, DRAFT, 3, seed, POSITION)
        assert tokens in ([2, 0, 3], [2, 1], [2, 4])
    # q == p: every draft is kept (u < 1), whatever it is.
    same = torch.tensor([P1, P1, P2])
    for seed in seeds:
        drafts = [sample_draft(same[0], seed, 0), sample_draft(same[1], seed, 1)]
        assert accept_sampled(drafts, same, same[:2], 5, seed, 0) == [*drafts, 5]
    # No drafts: the bonus alone.
    assert accept_sampled([], TARGET[:1], DRAFT[:0], 2, 0, 0) == [2]


def test_accept_sampled_seeded_reproducible():
    def run(seed, position):
        drafts = [sample_draft(DRAFT[j], seed, position + j) for j in range(2)]
        return drafts, accept_sampled(drafts, TARGET, DRAFT, 1, seed, position)

    assert run(7, 3) == run(7, 3)
    assert all(run(seed, 5) == run(seed, 5) for seed in range(20))
    by_seed = {repr(run(seed, 5)) for seed in range(50)}
    by_position = {repr(run(7, position)) for position in range(50)}
    assert len(by_seed) > 5 and len(by_position) > 5
    # Unseeded: the global generator, reproducible through torch.manual_seed.
    torch.manual_seed(0)
    first = [accept_sampled([1], TARGET[:2], DRAFT[:1], 4, None, 0) for _ in range(100)]
    torch.manual_seed(0)
    again = [accept_sampled([1], TARGET[:2], DRAFT[:1], 4, None, 0) for _ in range(100)]
    assert first == again
    # p0(1) = .05 < q0(1) = .30: kept w.p. 1/6 (then the bonus), else 0, 2 or 3.
    assert {tuple(t) for t in first} == {(1, 4), (0,), (2,), (3,)}


def test_accept_sampled_shapes():
    with pytest.raises(ValueError, match="2 drafts need"):
        accept_sampled([1, 2], TARGET[:2], DRAFT, 0, 0, 0)  # target rows: 2, not 3
    with pytest.raises(ValueError, match="2 drafts need"):
        accept_sampled([1, 2], TARGET, DRAFT[:1], 0, 0, 0)  # draft rows: 1, not 2
    with pytest.raises(ValueError, match="1 drafts need"):
        accept_sampled([1], TARGET, DRAFT[:1], 0, 0, 0)


def test_accept_one_hot():
    assert accept_one_hot([], [5]) == [5]
    assert accept_one_hot([1, 2, 3], [1, 2, 3, 4]) == [1, 2, 3, 4]
    assert accept_one_hot([1, 2, 3], [7, 2, 3, 4]) == [7]
    assert accept_one_hot([1, 2, 3], [1, 9, 3, 4]) == [1, 9]
    assert accept_one_hot([1, 2, 3], [1, 2, 8, 4]) == [1, 2, 8]
    assert accept_one_hot([4, 4], [4, 4, 4]) == [4, 4, 4]
    with pytest.raises(ValueError, match="3 drafts need 4 targets; got 3"):
        accept_one_hot([1, 2, 3], [1, 2, 3])
    with pytest.raises(ValueError, match="2 drafts need 3 targets; got 1"):
        accept_one_hot([1, 2], [1])
    with pytest.raises(ValueError, match="0 drafts need 1 targets; got 0"):
        accept_one_hot([], [])


# -- end to end: a tiny random target and draft through the engine ------------------------

VOCAB = 16
K = 2
MAX_TOKENS = K + 2
PROMPT = [3, 7, 11]
NUM_REQUESTS = 3000


def build_llama(path, seed: int):
    """A 1-layer random Llama over VOCAB tokens, weights ~ N(0, 0.3) (lm_head N(0, 0.18)):
    next-token distributions far from uniform, yet with several likely tokens."""
    import transformers

    config = transformers.LlamaConfig(
        vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
        tie_word_embeddings=False)
    torch.manual_seed(seed)
    model = transformers.LlamaForCausalLM(config).eval()
    with torch.no_grad():
        for param in model.parameters():
            if param.dim() == 2:
                param.normal_(0, 0.3)
        model.lm_head.weight.mul_(0.6)
    model.save_pretrained(path, safe_serialization=True)
    return model


def next_token_probs(logits: torch.Tensor, temperature: float = 1.0, top_k: int = VOCAB
                     ) -> list[torch.Tensor]:
    """``[P0 [V], P1 [V, V], P2 [V, V, V], P3 [V, V, V, V]]`` float64: P_j[h] is the
    distribution of output token j after the history h of j output tokens (the prompt
    first), from ``logits`` of all VOCAB^3 continuations (``all_logits``): softmax of the
    ``top_k`` largest logits / ``temperature``, 0 elsewhere."""
    x = logits.double() / temperature
    kth = x.topk(top_k, dim=-1).values[..., -1:]
    x = x.masked_fill(x < kth, float("-inf"))
    probs = x.softmax(-1).view(VOCAB, VOCAB, VOCAB, len(PROMPT) + 3, VOCAB)
    last = len(PROMPT) - 1
    return [probs[0, 0, 0, last], probs[:, 0, 0, last + 1], probs[:, :, 0, last + 2],
            probs[:, :, :, last + 3]]


def all_logits(model) -> torch.Tensor:
    """transformers' logits ``[V^3, len(PROMPT) + 3, V]`` of the prompt followed by every
    3 tokens (a, b, c), in one batch."""
    grid = torch.cartesian_prod(*[torch.arange(VOCAB)] * 3)  # [V^3, 3], (a, b, c)
    ids = torch.cat([torch.tensor(PROMPT).expand(len(grid), -1), grid], dim=1)
    with torch.no_grad():
        return model(ids).logits


@pytest.fixture(scope="module")
def e2e(tmp_path_factory):
    """Seeded requests 0..NUM_REQUESTS-1 of MAX_TOKENS = k + 2 = 4 tokens on one prompt.

    Which step makes each output token (0-based; ``max_drafts`` lets a step verify at most
    ``max_tokens - num_output - 1`` drafts, so a bonus stays within ``max_tokens``):
    - token 0: the prefill's sample (then the draft model proposes 2 drafts);
    - tokens 1, 2: the two drafts, verified in one step: a kept draft, or a resample from
      norm(max(0, p - q)) at the first rejection; when both are kept, token 3 is that
      step's BONUS (hence max_tokens = 4: with 3 there would be one draft only);
    - after a rejection at token 1: one draft for token 2, kept or resampled, and token 3
      its bonus; after a rejection at token 2: token 3 is a plain sample.
    So tokens 1..3 mix accepted drafts, resampled tokens and bonus tokens; every path
    runs (checked by the acceptance counters).
    """
    from pagedserve import LLM, SamplingParams

    target_dir = tmp_path_factory.mktemp("target")
    draft_dir = tmp_path_factory.mktemp("draft")
    target = build_llama(target_dir, seed=1)
    draft = build_llama(draft_dir, seed=2)
    llm = LLM(model=str(target_dir), dtype="float32", skip_tokenizer_init=True,
              quantization="none", block_size=16, max_model_len=64, max_num_seqs=256,
              max_num_batched_tokens=1024,  # >= 256 x (k + 1): no step cuts drafts short
              num_gpu_blocks_override=600,  # a block per request: no preemption
              # every step drafts, whatever the batch (None: never disabled)
              speculative_config={"method": "draft_model", "model": str(draft_dir),
                                  "num_speculative_tokens": K, "disable_by_batch_size": None})
    params = [SamplingParams(temperature=1.0, max_tokens=MAX_TOKENS, ignore_eos=True, seed=i)
              for i in range(NUM_REQUESTS)]
    outputs = llm.generate([{"prompt_token_ids": PROMPT}] * NUM_REQUESTS, params,
                           use_tqdm=False)
    tokens = [list(o.outputs[0].token_ids) for o in outputs]
    return {"llm": llm, "params": params, "tokens": tokens,
            "stats": llm.engine.spec_decoding_stats(), "kv": llm.kv_cache_stats(),
            "target_logits": all_logits(target), "draft_logits": all_logits(draft)}


def joint_of(probs: list[torch.Tensor]) -> torch.Tensor:
    """The exact joint distribution ``[V] * 4`` of the four output tokens."""
    joint = (probs[0][:, None, None, None] * probs[1][:, :, None, None]
             * probs[2][:, :, :, None] * probs[3])
    assert float(joint.sum()) == pytest.approx(1.0, abs=1e-9)
    return joint


def assert_matches_joint(tokens: list[list[int]], joint: torch.Tensor, what: str) -> None:
    """Each position's frequencies, and those of consecutive pairs (V^2 cells, the rare
    ones pooled: the dependence between tokens), against ``joint``'s."""
    assert all(len(t) == MAX_TOKENS for t in tokens)
    for j in range(MAX_TOKENS):
        marginal = joint.sum(dim=[d for d in range(MAX_TOKENS) if d != j])
        assert_distributed([t[j] for t in tokens], marginal.tolist(), f"{what} token {j}")
    for j in range(MAX_TOKENS - 1):
        pair = joint.sum(dim=[d for d in range(MAX_TOKENS) if d not in (j, j + 1)])
        assert_distributed([t[j] * VOCAB + t[j + 1] for t in tokens],
                           pair.flatten().tolist(), f"{what} tokens {j},{j + 1}")


def test_e2e_token_frequencies_match_target(e2e):
    assert_matches_joint(e2e["tokens"], joint_of(next_token_probs(e2e["target_logits"])), "e2e")


def test_e2e_top_k_temperature(e2e):
    """temperature 0.8, top_k 4: p and q both 0 outside their own top 4, so drafts outside
    the target's top 4 (p = 0 < q) are always rejected; the output is the target's still."""
    from pagedserve import SamplingParams

    llm, n = e2e["llm"], NUM_REQUESTS // 3
    params = [SamplingParams(temperature=0.8, top_k=4, max_tokens=MAX_TOKENS, ignore_eos=True,
                             seed=10_000 + i) for i in range(n)]
    before = llm.engine.spec_decoding_stats()
    outputs = llm.generate([{"prompt_token_ids": PROMPT}] * n, params, use_tqdm=False)
    after = llm.engine.spec_decoding_stats()
    drafted = after.num_draft_tokens - before.num_draft_tokens
    accepted = after.num_accepted_tokens - before.num_accepted_tokens
    assert drafted >= 2 * n and 0 < accepted < drafted  # resampling ran here too
    joint = joint_of(next_token_probs(e2e["target_logits"], temperature=0.8, top_k=4))
    assert_matches_joint([list(o.outputs[0].token_ids) for o in outputs], joint, "top_k")


def test_e2e_acceptance_counters(e2e):
    """The counters follow from p and q alone (see ``e2e`` for the steps): per request, one
    step verifies 2 drafts, and after a rejection of the first (probability rho) one more
    verifies 1; the first draft position is kept w.p. pi0, the second w.p. pi1. So the
    draft model's q as the engine computes it must be the draft checkpoint's."""
    p, q = next_token_probs(e2e["target_logits"]), next_token_probs(e2e["draft_logits"])
    stats, n = e2e["stats"], NUM_REQUESTS
    kept1 = torch.minimum(p[1], q[1])  # [a, x]: d1 = x drawn and kept after token 0 = a
    resampled1 = p[1] - kept1  # [a, y]: d1 rejected and y resampled
    alpha2 = torch.minimum(p[2], q[2]).sum(-1)  # [a, b]: the next draft kept after (a, b)
    rho = float(p[0] @ resampled1.sum(-1))
    pi0 = float(p[0] @ (kept1 + resampled1 * alpha2).sum(-1))
    pi1 = float(p[0] @ (kept1 * alpha2).sum(-1))
    print(f"rho={rho:.3f} pi0={pi0:.3f} pi1={pi1:.3f} {stats}")
    assert stats.num_spec_tokens == K
    assert stats.num_draft_tokens - stats.num_drafts == n  # 2 + r drafts in 1 + r steps
    assert_binomial(stats.num_drafts - n, n, rho, "e2e first draft rejected")
    assert_binomial(stats.num_accepted_tokens_per_pos[0], n, pi0, "e2e kept at position 0")
    assert_binomial(stats.num_accepted_tokens_per_pos[1], n, pi1, "e2e kept at position 1")
    assert stats.num_accepted_tokens == sum(stats.num_accepted_tokens_per_pos)
    # Resampling ran, and so did full acceptance (a bonus after 2 kept drafts).
    assert 0 < stats.num_accepted_tokens < stats.num_draft_tokens
    assert stats.num_accepted_tokens_per_pos[1] > 0
    kv = e2e["kv"]
    assert kv.free_blocks + kv.cached_blocks == kv.total_blocks and kv.used_blocks == 0


def test_e2e_seeded_reproducible(e2e):
    """The same seeds again, in another order and batch: the same tokens."""
    from pagedserve import SamplingParams

    llm, tokens = e2e["llm"], e2e["tokens"]
    ids = list(range(299, -1, -1))
    params = [SamplingParams(temperature=1.0, max_tokens=MAX_TOKENS, ignore_eos=True, seed=i)
              for i in ids]
    again = llm.generate([{"prompt_token_ids": PROMPT}] * len(ids), params, use_tqdm=False)
    assert [list(o.outputs[0].token_ids) for o in again] == [tokens[i] for i in ids]
    assert len({tuple(tokens[i]) for i in ids}) > 100  # the seeds matter
