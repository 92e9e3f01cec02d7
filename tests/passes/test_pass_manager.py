"""The pass manager: registry by config type, lint/recompile after each pass, errors name the pass."""
from dataclasses import dataclass
from typing import Optional

import pytest
import torch
from torch import fx

import memopt
from memopt.cost_model.op_registry import op_kind
from memopt.passes.base import PassContext, PassResult, register_pass, registered_pass
from memopt.passes.manager import passes_for, run_passes
from memopt.capture.trace import capture
from memopt.testing.zoo import build


class _ExactTanh(torch.autograd.Function):
    """tanh with its backward from the saved output: exact, as a stand-in for a real technique."""

    @staticmethod
    def forward(ctx, x):
        y = torch.tanh(x)
        ctx.save_for_backward(y)
        return y

    @staticmethod
    def backward(ctx, grad):
        (y,) = ctx.saved_tensors
        return grad * (1 - y * y)


def exact_tanh(x):
    return _ExactTanh.apply(x)


@dataclass(frozen=True)
class _TanhConfig:
    enabled: bool = True


@register_pass(_TanhConfig, "test_exact_tanh")
def _tanh_pass(gm: fx.GraphModule, cfg: _TanhConfig, ctx: PassContext) -> PassResult:
    modules = dict(gm.named_modules())
    modified = False
    for node in list(gm.graph.nodes):
        if op_kind(node, modules) == "tanh":
            with gm.graph.inserting_after(node):
                new = gm.graph.call_function(exact_tanh, tuple(node.args))
            node.replace_all_uses_with(new)
            gm.graph.erase_node(node)
            modified = True
    return PassResult(gm, modified)


@dataclass(frozen=True)
class _Holder:
    tanh: Optional[_TanhConfig] = _TanhConfig()
    other: Optional[int] = None


def test_registry_selects_passes_from_config_fields():
    assert registered_pass(_TanhConfig).name == "test_exact_tanh"
    assert [name for name, _, _ in passes_for(_Holder())] == ["test_exact_tanh"]
    assert passes_for(_Holder(tanh=None)) == []
    assert [name for name, _, _ in passes_for(memopt.Config())] == ["reversible", "recompute", "stash", "fewbit"]
    assert passes_for(memopt.Config.exact()) == []
    with pytest.raises(ValueError, match="already registered"):
        register_pass(_TanhConfig, "again")(_tanh_pass)


def test_pass_rewrites_recompiles_and_keeps_forward_exact():
    model, inputs = build("mlp")
    gm = capture(model, (inputs,), {}).graph_module
    expected = model(inputs)
    gm, records = run_passes(gm, passes_for(_Holder()))
    assert [(r.name, r.modified) for r in records] == [("test_exact_tanh", True)]
    assert "exact_tanh" in gm.code  # recompiled
    assert torch.equal(gm(inputs), expected)


def test_a_failing_pass_is_named():
    def broken(gm, cfg, ctx):
        raise RuntimeError("boom at node fc1")

    model, inputs = build("mlp")
    gm = capture(model, (inputs,), {}).graph_module
    with pytest.raises(memopt.PassError, match=r"pass 'broken' failed: RuntimeError: boom at node fc1"):
        run_passes(gm, [("broken", broken, None)])


def test_a_pass_that_breaks_the_graph_is_caught_by_lint():
    def dangling(gm, cfg, ctx):
        node = next(n for n in gm.graph.nodes if n.op == "call_module")
        node.args = (fx.Node(gm.graph, "ghost", "placeholder", "ghost", (), {}),)  # not in the graph
        return PassResult(gm, True)

    model, inputs = build("mlp")
    gm = capture(model, (inputs,), {}).graph_module
    with pytest.raises(memopt.PassError, match="pass 'dangling' failed"):
        run_passes(gm, [("dangling", dangling, None)])


def test_a_pass_must_return_pass_result():
    model, inputs = build("mlp")
    gm = capture(model, (inputs,), {}).graph_module
    with pytest.raises(memopt.PassError, match="must return PassResult, got MLPGraph"):
        run_passes(gm, [("sloppy", lambda gm, cfg, ctx: gm, None)])
