"""simulator.validation.costs: the simulator's own cost figures, on tiny sizes."""

from __future__ import annotations

import json

import pytest

from simulator.validation import costs
def test_costs_prints_every_figure_as_its_last_line(capsys):
    result = costs.main(["--repeats", "1", "--batch", "2", "--decode-tokens", "20", "--requests", "20",
                         "--decisions", "10"])
    assert json.loads(capsys.readouterr().out.strip().splitlines()[-1]) == result
    for name in ("decode_us_per_token", "request_ms_1_replica", "route_us_1_replicas", "route_us_64_replicas",
                 "route_us_1000_replicas"):
        assert result[name] > 0, name


def test_costs_refuses_sizes_below_one():
    with pytest.raises(SystemExit, match="--requests must be >= 1"):
        costs.parse_args(["--requests", "0"])
