"""memopt/core/counters.py: what a build did, counted per kind and kept in the plan (``om.plan.build``)."""
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
    assert inner == {"traces": 0, "cost_model_runs": 0, "pass_runs": 0, "real_steps": 2, "graph_copies": 0,
                     "seconds": inner["seconds"]}
    assert outer["seconds"] >= inner["seconds"] >= 0


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
    exact = memopt.optimize(model, example_inputs=torch.randn(8, 8), config=memopt.Config.exact())
    assert exact.plan.build["real_steps"] < build["real_steps"]  # no fidelity gate without lossy units
