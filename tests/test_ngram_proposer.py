"""N-gram proposer (issue 29): prompt lookup with vLLM v1's choice of match.

The reference is a brute force over every n-gram length (longest first) and every start
(earliest first); random short sequences over 2-5 symbols make matches of every length
common. Hand examples: vLLM's docstring case, the ``max_model_len`` cap, no match, too
short, and the longest match winning over an earlier shorter one.
"""

from __future__ import annotations

import random

import numpy as np
import pytest

from pagedserve.spec_decode.ngram import NgramProposer


def reference_propose(tokens: list[int], k: int, min_n: int, max_n: int,
                      max_model_len: int) -> list[int]:
    k = min(k, max_model_len - len(tokens))
    if len(tokens) < min_n or k <= 0:
        return []
    for n in range(min(max_n, len(tokens)), min_n - 1, -1):
        suffix = tokens[len(tokens) - n:]
        for start in range(len(tokens) - n):
            if tokens[start:start + n] == suffix:
                return tokens[start + n:start + n + k]
    return []


@pytest.mark.parametrize("seed", range(8))
def test_matches_brute_force(seed):
    rng = random.Random(seed)
    for _ in range(500):
        alphabet = rng.randint(2, 5)
        tokens = [rng.randrange(alphabet) for _ in range(rng.randint(0, 40))]
        min_n = rng.randint(1, 4)
        max_n = rng.randint(min_n, 7)
        k = rng.randint(1, 6)
        max_model_len = rng.randint(max(1, len(tokens) - 2), len(tokens) + 8)
        proposer = NgramProposer(k, min_n, max_n, max_model_len)
        want = reference_propose(tokens, k, min_n, max_n, max_model_len)
        assert proposer.propose(tokens) == want, (tokens, k, min_n, max_n, max_model_len)
        assert proposer.propose(np.array(tokens, dtype=np.int32)) == want


def test_vllm_docstring_example():
    # [4, 2, 3] does not recur; [2, 3] does, at index 1; three tokens follow it
    assert NgramProposer(4, 2, 3, 100).propose([1, 2, 3, 4, 2, 3]) == [4, 2, 3]


def test_longest_match_beats_earlier_shorter_one():
    # [7, 8] occurs at 0 (then 1) and [6, 7, 8] at 3 (then 2): the 3-gram wins
    tokens = [7, 8, 1, 6, 7, 8, 2, 6, 7, 8]
    assert NgramProposer(2, 1, 3, 100).propose(tokens) == [2, 6]
    assert NgramProposer(2, 1, 2, 100).propose(tokens) == [1, 6]


def test_earliest_occurrence_and_overlap_with_suffix():
    assert NgramProposer(3, 1, 1, 100).propose([5, 1, 5, 2, 5]) == [1, 5, 2]
    # a run: the longest earlier occurrence of [9, 9, 9] overlaps the suffix
    assert NgramProposer(5, 1, 4, 100).propose([9, 9, 9, 9]) == [9]


def test_max_model_len_caps_the_proposal():
    tokens = [1, 2, 3, 4, 5, 1, 2]
    assert NgramProposer(4, 1, 2, 100).propose(tokens) == [3, 4, 5, 1]
    assert NgramProposer(4, 1, 2, 9).propose(tokens) == [3, 4]
    assert NgramProposer(4, 1, 2, 7).propose(tokens) == []


def test_no_match_and_too_short():
    assert NgramProposer(4, 1, 3, 100).propose([1, 2, 3, 4]) == []
    assert NgramProposer(4, 2, 3, 100).propose([1, 2, 3, 1]) == []  # only a 1-gram recurs
    assert NgramProposer(4, 3, 3, 100).propose([1, 1]) == []
    assert NgramProposer(4, 1, 3, 100).propose([]) == []


@pytest.mark.parametrize("args, field", [
    ((0, 1, 3, 100), "num_speculative_tokens"),
    ((4, 0, 3, 100), "prompt_lookup_min"),
    ((4, 3, 2, 100), "prompt_lookup_max"),
    ((4, 1, 3, 0), "max_model_len"),
])
def test_bad_config(args, field):
    with pytest.raises(ValueError, match=field):
        NgramProposer(*args)
