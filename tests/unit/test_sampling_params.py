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
