from __future__ import annotations

import pytest

from model_worker import SamplingParams, SamplingParamsError


@pytest.mark.parametrize("kwargs,param", [
    ({"max_tokens": 0}, "max_tokens"), ({"max_tokens": 1.5}, "max_tokens"), ({"max_tokens": True}, "max_tokens"),
    ({"temperature": -0.1}, "temperature"), ({"temperature": float("nan")}, "temperature"),
    ({"temperature": "1"}, "temperature"), ({"top_p": 0.0}, "top_p"), ({"top_p": 1.5}, "top_p"),
    ({"top_k": -2}, "top_k"), ({"top_k": 2.0}, "top_k"), ({"seed": -1}, "seed"), ({"seed": "7"}, "seed"),
    ({"stop": [""]}, "stop"), ({"stop": [1]}, "stop"), ({"stop_token_ids": [-1]}, "stop_token_ids"),
    ({"ignore_eos": "yes"}, "ignore_eos"),
])
def test_invalid_values_raise_naming_the_parameter(kwargs, param):
    with pytest.raises(SamplingParamsError) as info:
        SamplingParams(**kwargs)
    assert info.value.param == param
    assert param in str(info.value)
    assert isinstance(info.value, ValueError)


def test_normalisation():
    params = SamplingParams(stop="###", top_k=-1, temperature=0)
    assert params.stop == ["###"] and params.top_k == 0 and params.greedy


def test_numerically_unsafe_values_are_clamped_to_safe_ones():
    """float32 sampling turns a temperature or top_p below its resolution into NaN or an empty
    nucleus: such values become the ones that mean the same thing."""
    from contracts.sampling import GREEDY_BELOW_TEMPERATURE, MIN_TOP_P

    assert SamplingParams(temperature=1e-300).greedy
    assert SamplingParams(temperature=GREEDY_BELOW_TEMPERATURE / 2).temperature == 0.0
    assert SamplingParams(temperature=GREEDY_BELOW_TEMPERATURE).temperature == GREEDY_BELOW_TEMPERATURE
    assert SamplingParams(top_p=1e-300).top_p == MIN_TOP_P
    assert SamplingParams(top_p=0.5).top_p == 0.5


@pytest.mark.parametrize("kwargs", [
    {"stop": ["x"] * 33}, {"stop": ["y" * 257]}, {"stop_token_ids": list(range(257))},
])
def test_stop_lists_are_capped(kwargs):
    """Stop lists are capped, and the refusal never echoes the list: a huge stop list in one request
    slows every request batched with it."""
    (param,) = kwargs
    with pytest.raises(SamplingParamsError) as info:
        SamplingParams(**kwargs)
    assert info.value.param == param and "at most" in str(info.value)
    assert len(str(info.value)) < 300, "the error never echoes the whole list"
