"""Batched sampler: expected values are computed by hand or with plain torch ops."""

import math

import pytest
import torch

from pagedserve.sample.sampler import Sampler, SamplingBatch, make_generator, noise_seed
from pagedserve.sampling_params import SamplingParams

SAMPLER = Sampler()


def build(params, prompts=None, outputs=None, eos=None, vocab=5):
    b = len(params)
    return SamplingBatch.build(params, prompts or [[]] * b, outputs or [[]] * b,
                               eos, vocab, "cpu")


def test_greedy_is_argmax():
    logits = torch.randn(7, 50, generator=torch.Generator().manual_seed(0))
    out = SAMPLER(logits, build([SamplingParams(temperature=0)] * 7, vocab=50))
    assert torch.equal(out.sampled_token_ids, logits.argmax(-1))
    assert out.topk_token_ids is None and out.sampled_ranks is None


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_half_precision_logits_sample_as_their_float32_copy(dtype):
    """Logits in the LM head's dtype: greedy rows (taken without a float32 copy), a penalty
    and logprobs give what their float32 copy gives (ties broken by the first index)."""
    logits = (torch.randn(6, 300, generator=torch.Generator().manual_seed(1)) * 4).round()
    logits = logits.to(dtype)
    for params in ([SamplingParams(temperature=0)] * 6,
                   [SamplingParams(temperature=0, logprobs=3)] * 6,
                   [SamplingParams(temperature=0, presence_penalty=1.0)] * 6):
        outputs = [[i, 2 * i] for i in range(6)]
        got = SAMPLER(logits, build(params, outputs=outputs, vocab=300))
        ref = SAMPLER(logits.float(), build(params, outputs=outputs, vocab=300))
        for name, value in vars(ref).items():
            assert (value is None and getattr(got, name) is None) \
                or torch.equal(getattr(got, name), value), name
    assert torch.equal(SAMPLER(logits, build([SamplingParams(temperature=0)] * 6, vocab=300))
                       .sampled_token_ids, logits.float().argmax(-1))


# Hand-computed: logits [2, -1, 0.5, 3, -2], prompt [0], output [1, 1, 3].
LOGITS = [2.0, -1.0, 0.5, 3.0, -2.0]


@pytest.mark.parametrize("kw,expected", [
    # seen = {0, 1, 3}: 2/2, -1*2, -, 3/2, -
    ({"repetition_penalty": 2.0}, [1.0, -2.0, 0.5, 1.5, -2.0]),
    # counts: tok1 x2, tok3 x1
    ({"frequency_penalty": 0.5}, [2.0, -2.0, 0.5, 2.5, -2.0]),
    ({"presence_penalty": 0.25}, [2.0, -1.25, 0.5, 2.75, -2.0]),
    ({"repetition_penalty": 2.0, "frequency_penalty": 0.5, "presence_penalty": 0.25},
     [1.0, -3.25, 0.5, 0.75, -2.0]),
    ({"presence_penalty": -1.0}, [2.0, 0.0, 0.5, 4.0, -2.0]),
])
def test_penalties_hand_computed(kw, expected):
    # Row 1 is a neutral row with a longer output: padding must not leak into row 0.
    params = [SamplingParams(**kw), SamplingParams()]
    batch = build(params, prompts=[[0], [2, 2, 4, 4]], outputs=[[1, 1, 3], [4, 4, 4, 4, 2]])
    logits = torch.tensor([LOGITS, LOGITS])
    out = Sampler.process_logits(logits, batch)
    torch.testing.assert_close(out[0], torch.tensor(expected))
    torch.testing.assert_close(out[1], torch.tensor(LOGITS))
    assert logits[0].tolist() == LOGITS  # the caller's logits are untouched


def test_penalties_change_greedy_choice():
    batch = build([SamplingParams(temperature=0, repetition_penalty=2.0)], outputs=[[3]])
    assert SAMPLER(torch.tensor([LOGITS]), batch).sampled_token_ids.tolist() == [0]


def test_logit_bias_added():
    p = SamplingParams(temperature=0, logit_bias={4: 100.0, 0: -0.5})
    out = Sampler.process_logits(torch.tensor([LOGITS]), build([p]))
    torch.testing.assert_close(out[0], torch.tensor([1.5, -1.0, 0.5, 3.0, 98.0]))
    assert SAMPLER(torch.tensor([LOGITS]), build([p])).sampled_token_ids.tolist() == [4]
    with pytest.raises(ValueError, match="logit_bias"):
        build([SamplingParams(logit_bias={5: 1.0})])


def test_min_tokens_masks_eos_and_stop_ids():
    logits = torch.tensor([[0.0, 1.0, 2.0, 9.0, 8.0]] * 4)  # eos = 3, stop id 4
    p = SamplingParams(temperature=0, min_tokens=2, stop_token_ids=[4])
    batch = build([p, p, p, p.clone()], outputs=[[], [1], [1, 1], [1, 1, 1]], eos=3)
    assert SAMPLER(logits, batch).sampled_token_ids.tolist() == [2, 2, 3, 3]
    # vLLM: with ignore_eos, EOS is not a stop token, so min_tokens leaves it alone.
    q = SamplingParams(temperature=0, min_tokens=2, ignore_eos=True, stop_token_ids=[4])
    assert SAMPLER(logits[:1], build([q], eos=3)).sampled_token_ids.tolist() == [3]


@pytest.mark.parametrize("kw", [{"top_k": 1}, {"top_p": 1e-6}, {"top_k": 1, "top_p": 0.9}])
def test_degenerate_filters_equal_greedy(kw):
    logits = torch.randn(16, 40, generator=torch.Generator().manual_seed(1)) * 3
    out = SAMPLER(logits, build([SamplingParams(temperature=1.0, **kw)] * 16, vocab=40))
    assert torch.equal(out.sampled_token_ids, logits.argmax(-1))


def sample_counts(probs, params, n=4000, vocab=4):
    logits = torch.tensor(probs).log().expand(n, vocab).contiguous()
    torch.manual_seed(0)
    ids = SAMPLER(logits, build([params] * n, vocab=vocab)).sampled_token_ids
    return torch.bincount(ids, minlength=vocab).tolist()


def test_top_k_top_p_min_p_support():
    probs = [0.5, 0.3, 0.15, 0.05]
    # top_k=3 drops 0.05; top_p=0.6 drops the tail with cumulative mass <= 0.4 (0.05, 0.15);
    # min_p=0.35 drops p < 0.175.
    for kw, kept in [({"top_k": 3}, 3), ({"top_p": 0.6}, 2), ({"min_p": 0.35}, 2)]:
        counts = sample_counts(probs, SamplingParams(**kw))
        assert all(c > 0 for c in counts[:kept]) and sum(counts[kept:]) == 0, (kw, counts)


def chi_square(counts, probs):
    n = sum(counts)
    return sum((c - n * p) ** 2 / (n * p) for c, p in zip(counts, probs))


@pytest.mark.parametrize("temperature", [1.0, 0.5])
def test_empirical_distribution_matches_softmax(temperature):
    logits = torch.tensor([1.0, 0.2, -0.5, 2.0, 0.0, -1.0])
    expected = torch.softmax(logits / temperature, -1).tolist()
    n = 20000
    torch.manual_seed(0)
    batch = build([SamplingParams(temperature=temperature)] * n, vocab=6)
    ids = SAMPLER(logits.expand(n, 6).contiguous(), batch).sampled_token_ids
    # df = 5: the 99.9% quantile of chi-square is 20.5
    assert chi_square(torch.bincount(ids, minlength=6).tolist(), expected) < 20.5


def test_seeded_rows_follow_the_distribution():
    logits = torch.tensor([1.0, 0.2, -0.5, 2.0, 0.0, -1.0])
    n = 3000
    batch = build([SamplingParams(seed=1000 + i) for i in range(n)], vocab=6)
    ids = SAMPLER(logits.expand(n, 6).contiguous(), batch).sampled_token_ids
    counts = torch.bincount(ids, minlength=6).tolist()
    assert chi_square(counts, torch.softmax(logits, -1).tolist()) < 20.5


def run_seeded(seed, position, others, steps=6, vocab=32):
    """Sample `steps` tokens for a seeded row placed at `position` among `others` rows
    (seeded or not, other temperatures and top_k), its output growing by a token a step."""
    step_logits = torch.randn(steps, vocab, generator=torch.Generator().manual_seed(7))
    tokens = []
    for s in range(steps):
        rows = list(torch.randn(others, vocab))
        rows.insert(position, step_logits[s])
        params = [SamplingParams(temperature=0.9 if i % 3 else 1.3, top_k=10 * (i % 2),
                                 seed=100 + i if i % 2 else None) for i in range(others)]
        params.insert(position, SamplingParams(temperature=1.0, seed=seed))
        outputs = [[1] * (s + i) for i in range(others)]
        outputs.insert(position, tokens)
        out = SAMPLER(torch.stack(rows), build(params, outputs=outputs, vocab=vocab))
        tokens = tokens + [int(out.sampled_token_ids[position])]
    return tokens


def test_seeded_row_independent_of_batch():
    alone = run_seeded(42, 0, 0)
    assert run_seeded(42, 0, 0) == alone
    assert run_seeded(42, 3, 5) == alone
    assert run_seeded(42, 5, 5) == alone
    assert run_seeded(43, 0, 0) != alone  # another seed gives another sequence


def test_seeded_noise_is_keyed_by_seed_and_position():
    """The noise for output token i is drawn from noise_seed(seed, i): the same token at
    position i however many draws came before (a preempted and recomputed request, a
    speculated one), another position another draw; the mix scatters neighbours."""
    logits = torch.zeros(1, 64)  # uniform: the token is the noise's argmin
    def token(seed, position):
        batch = build([SamplingParams(seed=seed)], outputs=[[7] * position], vocab=64)
        return int(SAMPLER(logits, batch).sampled_token_ids[0])
    expected = int(torch.empty(64).exponential_(
        generator=make_generator(noise_seed(9, 5), "cpu")).argmin())
    assert token(9, 5) == expected == token(9, 5)
    assert len({token(9, i) for i in range(12)}) > 6
    assert len({noise_seed(s, i) for s in range(50) for i in range(50)}) == 2500
    assert noise_seed(-1, 0) == noise_seed((1 << 64) - 1, 0)  # seeds as 64-bit integers


def test_logprobs_are_raw_log_softmax_with_ranks():
    g = torch.Generator().manual_seed(3)
    logits = torch.randn(4, 30, generator=g) * 2
    params = [SamplingParams(logprobs=3, temperature=0.7, repetition_penalty=1.5),
              SamplingParams(logprobs=0, temperature=0, logit_bias={5: 50.0}),
              SamplingParams(logprobs=5, top_k=4, presence_penalty=1.0),
              SamplingParams(temperature=0, min_tokens=3)]
    batch = build(params, prompts=[[1, 2]] * 4, outputs=[[3, 5, 5]] * 4, eos=0, vocab=30)
    assert batch.max_num_logprobs == 5
    out = SAMPLER(logits, batch)
    ref = torch.log_softmax(logits, -1)
    ids = out.sampled_token_ids
    assert ids[1] == 5  # the bias decides the sample, not the reported logprob
    torch.testing.assert_close(out.sampled_logprobs, ref.gather(1, ids[:, None])[:, 0])
    top_vals, top_ids = ref.topk(5, dim=-1)
    assert torch.equal(out.topk_token_ids, top_ids)
    torch.testing.assert_close(out.topk_logprobs, top_vals)
    expected_ranks = [1 + int((ref[i] > ref[i, ids[i]]).sum()) for i in range(4)]
    assert out.sampled_ranks.tolist() == expected_ranks
    assert out.sampled_ranks[3] == 1  # greedy without processing picks rank 1


def test_logprobs_zero_gives_empty_topk():
    out = SAMPLER(torch.randn(2, 5), build([SamplingParams(logprobs=0)] * 2))
    assert out.topk_token_ids.shape == (2, 0) and out.sampled_ranks.shape == (2,)
    assert math.isfinite(float(out.sampled_logprobs.sum()))


def test_shape_checked_and_empty_batch():
    with pytest.raises(ValueError, match="logits must be"):
        SAMPLER(torch.randn(2, 6), build([SamplingParams()] * 2))
    out = SAMPLER(torch.randn(0, 5), build([]))
    assert out.sampled_token_ids.shape == (0,)
