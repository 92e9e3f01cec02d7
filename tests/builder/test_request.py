"""The build's Request and Session (memopt/builder/request.py): what the user asked is frozen, the steps share one
session, and no builder function goes back to threading (args, kwargs, config, ...) by hand."""
import ast
import dataclasses
from pathlib import Path

import pytest
import torch
from torch import nn

import memopt
from memopt.builder import pipeline
from memopt.builder.request import Request, Session

BUILDER = Path(memopt.__file__).parent / "builder"


def _model():
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(8, 16), nn.GELU(), nn.Linear(16, 4))


def test_request_is_frozen_and_names_the_model():
    request = Request(_model(), (torch.randn(4, 8),), {}, memopt.Config())
    assert request.name == "Sequential" and request.budget_bytes is None and request.plan is None
    with pytest.raises(dataclasses.FrozenInstanceError):
        request.budget_bytes = 1 << 20


def test_session_target_is_the_budget_less_the_workspace_reserve():
    config = memopt.Config(workspace_mb=3)
    request = Request(_model(), (torch.randn(4, 8),), {}, config, budget_bytes=100 << 20)
    built = pipeline.build(request)
    session = Session(request, built.method, built.baseline)
    assert session.target == (100 << 20) - config.workspace_bytes(built.baseline.device) == (97 << 20)
    assert Session(dataclasses.replace(request, budget_bytes=None), built.method, built.baseline).target is None


def test_build_of_a_request_equals_optimize():
    """``pipeline.build(Request(...))`` is what ``optimize`` runs: the same plan and estimate."""
    x = torch.randn(4, 8)
    built = pipeline.build(Request(_model(), (x,), {}, memopt.Config()))
    om = memopt.optimize(_model(), example_inputs=x)
    assert built.plan.estimated_peak_bytes == om.plan.estimated_peak_bytes
    assert built.plan.chosen_units() == om.plan.chosen_units()


def test_no_builder_function_threads_the_request_by_hand():
    """A function of memopt/builder/ that takes the example inputs and the config as loose parameters takes few
    others: the rest of what the user asked travels in the Request, what a capture found in the Session."""
    crowded = []
    for path in sorted(BUILDER.glob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                a = node.args
                names = [x.arg for x in a.posonlyargs + a.args + a.kwonlyargs if x.arg not in ("self", "cls")]
                if {"args", "kwargs", "config"} <= set(names) and len(names) > 6:
                    crowded.append(f"{path.name}:{node.lineno} {node.name} ({len(names)} parameters)")
    assert not crowded, crowded
