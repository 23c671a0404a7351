"""SamplingParams: vLLM defaults, normalisation, and a ValueError naming each bad field."""

import pytest

from pagedserve.sampling_params import SamplingParams, SamplingType


def test_defaults_match_vllm():
    p = SamplingParams()
    assert (p.n, p.temperature, p.top_p, p.top_k, p.min_p) == (1, 1.0, 1.0, 0, 0.0)
    assert (p.presence_penalty, p.frequency_penalty, p.repetition_penalty) == (0.0, 0.0, 1.0)
    assert p.max_tokens == 16 and p.min_tokens == 0 and p.seed is None
    assert p.stop == [] and p.stop_token_ids == [] and p.logit_bias is None
    assert p.logprobs is None and p.prompt_logprobs is None
    assert p.detokenize and p.skip_special_tokens and p.spaces_between_special_tokens
    assert not p.ignore_eos and not p.include_stop_str_in_output
    assert p.sampling_type is SamplingType.RANDOM and not p.is_greedy


def test_normalisation_and_types():
    p = SamplingParams(stop="###", stop_token_ids=[5, 7], temperature=0, top_k=-1,
                       logit_bias={"12": 5, 3: -100.0}, max_tokens=None)
    assert p.stop == ["###"] and p.stop_token_ids == [5, 7]
    assert isinstance(p.temperature, float) and p.is_greedy
    assert p.sampling_type is SamplingType.GREEDY
    assert p.logit_bias == {12: 5.0, 3: -100.0}
    assert p.max_tokens is None
    assert SamplingParams(temperature=1e-6).is_greedy
    assert SamplingParams(seed=3).sampling_type is SamplingType.RANDOM_SEED


def test_clone_is_deep():
    p = SamplingParams(stop=["a"], logit_bias={1: 2.0})
    q = p.clone()
    q.stop.append("b")
    q.logit_bias[2] = 1.0
    q.max_tokens = 99
    assert p.stop == ["a"] and p.logit_bias == {1: 2.0} and p.max_tokens == 16
    assert q == SamplingParams(stop=["a", "b"], logit_bias={1: 2.0, 2: 1.0}, max_tokens=99)


@pytest.mark.parametrize("field,value", [
    ("n", 0), ("n", 1.0), ("n", True),
    ("presence_penalty", -2.5), ("presence_penalty", 2.01),
    ("frequency_penalty", 3.0), ("frequency_penalty", "0.5"),
    ("repetition_penalty", 0.0), ("repetition_penalty", -1.0),
    ("temperature", -1), ("temperature", float("nan")), ("temperature", None),
    ("top_p", 0.0), ("top_p", 1.5),
    ("top_k", -2), ("top_k", 2.0), ("top_k", False),
    ("min_p", -0.1), ("min_p", 1.1),
    ("seed", 1.5), ("seed", "1"),
    ("max_tokens", 0), ("max_tokens", -3), ("max_tokens", 2.0),
    ("min_tokens", -1),
    ("logprobs", -1), ("logprobs", True), ("prompt_logprobs", -2),
    ("stop", ""), ("stop", ["ok", ""]), ("stop", [3]),
    ("stop_token_ids", [-1]), ("stop_token_ids", ["2"]),
    ("logit_bias", {1: 101}), ("logit_bias", {1: -100.5}), ("logit_bias", {"x": 1}),
    ("logit_bias", {-1: 1}), ("logit_bias", [1, 2]),
    ("ignore_eos", 1), ("detokenize", "yes"), ("skip_special_tokens", None),
    ("truncate_prompt_tokens", 0), ("truncate_prompt_tokens", -2),
    ("truncate_prompt_tokens", 1.0),
])
def test_invalid_value_names_field(field, value):
    with pytest.raises(ValueError, match=field) as info:
        SamplingParams(**{field: value})
    if field in ("temperature", "top_p", "min_p", "n") and isinstance(value, (int, float)):
        assert str(value) in str(info.value) or repr(value) in str(info.value)


def test_range_message_is_specific():
    with pytest.raises(ValueError, match=r"temperature must be >= 0; got -1"):
        SamplingParams(temperature=-1)
    with pytest.raises(ValueError, match=r"top_p must be in \(0, 1\]; got 1.5"):
        SamplingParams(top_p=1.5)


def test_cross_field_checks():
    with pytest.raises(ValueError, match="min_tokens"):
        SamplingParams(min_tokens=5, max_tokens=4)
    SamplingParams(min_tokens=4, max_tokens=4)
    SamplingParams(min_tokens=100, max_tokens=None)
    with pytest.raises(ValueError, match="detokenize"):
        SamplingParams(stop=["x"], detokenize=False)
