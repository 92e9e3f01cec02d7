"""memopt/core/counters.py: what a build did, counted per kind and kept in the plan (``om.plan.build``)."""
import time

import pytest
import torch
from torch import nn

import memopt
from memopt.core import counters


def test_a_tally_counts_what_runs_inside_it_and_nested_tallies_both_count():
    counters.count("traces")  # no tally open: nothing to count into, no error
    with counters.tally() as outer:
        counters.count("traces")
        with counters.tally() as inner:
            counters.count("real_steps", 2)
        counters.count("graph_copies")
    assert outer["traces"] == 1 and outer["real_steps"] == 2 and outer["graph_copies"] == 1
    assert {k: inner[k] for k in counters.KINDS} == {"traces": 0, "cost_model_runs": 0, "pass_runs": 0,
                                                     "real_steps": 2, "graph_copies": 0}
    assert set(inner) == set(counters.KINDS) | {f"{k}_s" for k in counters.KINDS} | {"seconds", "other_s"}
    assert outer["seconds"] >= inner["seconds"] >= 0


def _busy(seconds: float) -> None:
    end = time.perf_counter() + seconds
    while time.perf_counter() < end:
        pass


def test_each_second_is_booked_to_the_innermost_timed_kind_and_the_parts_add_up():
    with counters.tally() as t:
        _busy(0.02)  # other
        with counters.timed("pass_runs"):
            _busy(0.03)
            with counters.timed("cost_model_runs"):  # a cost-model run inside a pass run is the cost model's
                _busy(0.05)
            _busy(0.03)
    assert t["pass_runs"] == 1 and t["cost_model_runs"] == 1
    assert 0.05 <= t["cost_model_runs_s"] < 0.05 + 0.04
    assert 0.06 <= t["pass_runs_s"] < 0.06 + 0.04
    assert t["other_s"] >= 0.019
    parts = sum(t[f"{k}_s"] for k in counters.KINDS) + t["other_s"]
    assert abs(parts - t["seconds"]) <= 0.005


def test_a_tally_opened_inside_a_timed_call_gets_only_what_ran_inside_it():
    with counters.tally() as outer:
        with counters.timed("real_steps"):
            _busy(0.05)
            with counters.tally() as inner:  # a re-plan inside a step
                _busy(0.02)
    assert inner["real_steps"] == 0 and 0.02 <= inner["real_steps_s"] < 0.04
    assert outer["real_steps"] == 1 and 0.07 <= outer["real_steps_s"] < 0.11


def test_a_decorated_function_is_counted_and_timed_once_per_call():
    @counters.counted("traces")
    def trace(x):
        _busy(0.01)
        return x + 1

    with counters.tally() as t:
        assert trace(1) == 2 and trace(2) == 3
    assert t["traces"] == 2 and t["traces_s"] >= 0.02
    with pytest.raises(ValueError, match="unknown build count kind 'trace'"):
        counters.counted("trace")


def test_an_unknown_kind_is_refused_with_the_kinds():
    with pytest.raises(ValueError, match="unknown build count kind 'trace'; one of traces, cost_model_runs"):
        counters.count("trace")


def test_the_plan_records_what_its_build_did():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 16), nn.BatchNorm1d(16), nn.ReLU(), nn.Linear(16, 4))
    om = memopt.optimize(model, example_inputs=torch.randn(8, 8))
    build = om.plan.build
    assert build["traces"] >= 1 and build["cost_model_runs"] >= 2 and build["pass_runs"] >= 1
    assert build["real_steps"] >= 2  # the capture check's eager and captured steps at least
    assert build["seconds"] > 0
    assert build["real_steps_s"] > 0 and build["cost_model_runs_s"] > 0 and build["traces_s"] > 0
    assert abs(sum(build[f"{k}_s"] for k in counters.KINDS) + build["other_s"] - build["seconds"]) < 0.01
    exact = memopt.optimize(model, example_inputs=torch.randn(8, 8), config=memopt.Config.exact())
    assert exact.plan.build["real_steps"] < build["real_steps"]  # no fidelity gate without lossy units
