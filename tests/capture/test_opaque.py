"""Python functions a symbolic trace keeps whole (``torch.fx.wrap``): torchvision's Swin wraps its attention so,
and memopt saw neither the ops inside nor what they keep for backward (Swin saved 1.6x where its export graph
saves 3.7x). Such a model is captured by torch.export instead when that works and passes the capture check."""
import copy
import logging

import torch
import torch.nn.functional as F
from torch import fx, nn

import memopt
from memopt.capture.trace import capture, opaque_functions


def gelu_mlp(x, w1, w2):
    return F.linear(F.gelu(F.linear(x, w1)), w2)


class Scaled(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, options):
        ctx.factor = options["factor"]
        return ctx.factor * x

    @staticmethod
    def backward(ctx, grad):
        return ctx.factor * grad, None


def with_function(x, w1, w2):
    # a custom autograd Function taking a dict: torch.export cannot keep it whole as an operator, would inline it
    # (its own backward would not run) and is refused
    return F.linear(F.gelu(Scaled.apply(F.linear(x, w1), {"factor": 2.0})), w2)


fx.wrap("gelu_mlp")
fx.wrap("with_function")


class Wrapped(nn.Module):
    def __init__(self, function):
        super().__init__()
        self.w1, self.w2 = nn.Parameter(torch.randn(64, 16) / 4), nn.Parameter(torch.randn(16, 64) / 8)
        self.function = function

    def forward(self, x):
        return x + (gelu_mlp if self.function == "gelu_mlp" else with_function)(x, self.w1, self.w2)


def test_the_symbolic_trace_names_the_functions_it_kept_whole():
    model, x = Wrapped("gelu_mlp"), torch.randn(32, 16)
    assert opaque_functions(capture(model, (x,), {}).graph_module) == [f"{__name__}.gelu_mlp"]


def _optimized(function: str, caplog):
    """(om, the log messages) of the default plan of ``Wrapped(function)``, whose forward matches eager's."""
    torch.manual_seed(0)
    model, x = Wrapped(function).train(), torch.randn(32, 16)
    with caplog.at_level(logging.INFO, logger="memopt"):
        om = memopt.optimize(model, example_inputs=x)
    assert torch.equal(om(x), model(x))
    return om, [r.getMessage() for r in caplog.records]


def test_a_model_with_a_wrapped_function_is_captured_by_export_and_rewritten_inside(caplog):
    om, messages = _optimized("gelu_mlp", caplog)
    assert om.plan.capture == "export"
    assert any(n.technique == "fewbit" for n in om.plan.nodes)  # the GELU inside is reached
    assert any(f"symbolic_trace kept {__name__}.gelu_mlp whole" in m and "torch.export instead" in m
               for m in messages)


def test_where_export_is_refused_the_symbolic_trace_serves(caplog):
    om, messages = _optimized("with_function", caplog)
    assert om.plan.capture == "symbolic_trace"
    assert any("keeping the symbolic trace" in m and "custom autograd Function Scaled" in m for m in messages)


def test_the_fidelity_gate_measures_the_export_graph_the_plan_rewrites():
    """The gate ran its steps on a symbolic trace of the slice while the plan named the export graph's nodes: no
    unit was rewritten there, every gradient matched, and a 1-bit GELU plan passed unchecked."""
    crushed = memopt.Config(fewbit=memopt.FewBitConfig(bits=1), stash=None, reversible=None)
    for batch in (32, 4):  # a slice the gate captures again by export, and a batch it runs whole
        torch.manual_seed(0)
        model, x = Wrapped("gelu_mlp").train(), torch.randn(batch, 16)
        om = memopt.optimize(model, example_inputs=x, config=crushed)
        assert om.plan.capture == "export"
        report = om.plan.fidelity
        assert report["changes"] and report["changes"][0].startswith("fewbit")  # the 1-bit GELU missed
        assert report["passed"] and report["worst"]["cosine"] < 1.0  # measured on a rewritten graph


@torch.library.custom_op("memopt_test::scaled_tanh", mutates_args=())
def scaled_tanh(x: torch.Tensor, scale: float) -> torch.Tensor:
    return torch.tanh(x) * scale


@scaled_tanh.register_fake
def _(x, scale):
    return torch.empty_like(x)


def _scaled_tanh_setup(ctx, inputs, output):
    ctx.save_for_backward(output)
    ctx.scale = inputs[1]


def _scaled_tanh_backward(ctx, grad):
    (out,) = ctx.saved_tensors
    return grad * (ctx.scale - out * out / ctx.scale), None


scaled_tanh.register_autograd(_scaled_tanh_backward, setup_context=_scaled_tanh_setup)


class CustomOpModel(nn.Module):
    """A torch.library operator with registered autograd (Hugging Face's MoE grouped matmul fallback is one), in a
    forward the symbolic trace cannot follow (an in-place write): captured by torch.export."""

    def __init__(self):
        super().__init__()
        self.a, self.b = nn.Linear(8, 16), nn.Linear(16, 4)

    def forward(self, x):
        h = scaled_tanh(self.a(x), 2.0).clone()
        h[:, 0] = 0.0
        return self.b(h)


def test_a_custom_operator_with_registered_autograd_stays_one_node_under_export():
    """torch.library runs such an operator's autograd through a Function it generates; export keeps the operator
    whole, so that Function is not inlined and the capture must not be refused for it (it was: Mixtral fell back to
    per-submodule capture)."""
    torch.manual_seed(0)
    model, x = CustomOpModel().train(), torch.randn(6, 8)
    reference = copy.deepcopy(model)
    om = memopt.optimize(model, example_inputs=x, config=memopt.Config.exact())
    assert om.plan.capture == "export"
    graph = om._memopt_last.graph_module.graph
    op = torch.ops.memopt_test.scaled_tanh.default
    assert [n.target for n in graph.nodes if "scaled_tanh" in str(n.target)] == [op]
    for seed in range(2):
        torch.manual_seed(seed)
        om(x).square().sum().backward()
        torch.manual_seed(seed)
        reference(x).square().sum().backward()
        for p, q in zip(model.parameters(), reference.parameters()):
            assert torch.equal(p.grad, q.grad)
            p.grad = q.grad = None
