"""Sound capture (issue 21): under Config.exact() memopt trains exactly as eager PyTorch, over 3 steps —
outputs, buffers after each step, every gradient — and keeps no more bytes; where capture would change the
model, memopt keeps the construct, falls back per submodule, or refuses, and says why."""
import copy
import logging
import random

import numpy as np
import pytest
import torch
import torch.utils.checkpoint as cp
from torch import nn

import memopt
from memopt.capture.trace import FunctionCall, capture
from memopt.capture.soundness import attribute_fingerprint, batch_slice, check_capture


class STE(torch.autograd.Function):
    """Straight-through estimator: round forward, identity backward."""

    @staticmethod
    def forward(ctx, x):
        return torch.round(x)

    @staticmethod
    def backward(ctx, g):
        return g


class GradReverse(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x):
        return x.view_as(x)

    @staticmethod
    def backward(ctx, g):
        return -g


class SignReLU(torch.autograd.Function):
    """A memory-saving ReLU: keeps a bool mask instead of its float input."""

    @staticmethod
    def forward(ctx, x):
        mask = x > 0
        ctx.save_for_backward(mask)
        return x * mask

    @staticmethod
    def backward(ctx, g):
        (mask,) = ctx.saved_tensors
        return g * mask


class FunctionNet(nn.Module):
    def __init__(self, function):
        super().__init__()
        self.function = function
        self.a, self.b = nn.Linear(8, 16), nn.Linear(16, 4)

    def forward(self, x):
        return self.b(self.function.apply(self.a(x)))


class Counter(nn.Module):
    """In-place buffer updates in forward: a counter, and an EMA under no_grad."""

    def __init__(self):
        super().__init__()
        self.a = nn.Linear(8, 4)
        self.register_buffer("count", torch.zeros((), dtype=torch.long))
        self.register_buffer("ema", torch.zeros(4))

    def forward(self, x):
        y = self.a(x)
        self.count += 1
        with torch.no_grad():
            self.ema.mul_(0.9).add_(y.mean(0), alpha=0.1)
        return y


class Checkpointed(nn.Module):
    def __init__(self):
        super().__init__()
        self.stem = nn.Linear(32, 64)
        self.blocks = nn.ModuleList(nn.Sequential(nn.Linear(64, 64), nn.Tanh()) for _ in range(4))

    def forward(self, x):
        x = torch.relu(self.stem(x))
        for block in self.blocks:
            x = cp.checkpoint(block, x, use_reentrant=False)
        return x


class Flagged(nn.Module):
    def __init__(self):
        super().__init__()
        self.a = nn.Linear(8, 4)
        self.scale, self.flip = 1.0, False

    def forward(self, x):
        y = self.a(x) * self.scale
        return -y if self.flip else y


class SideEffect(nn.Module):
    def __init__(self):
        super().__init__()
        self.a = nn.Linear(8, 4)
        self.calls = 0

    def forward(self, x):
        self.calls += 1
        return self.a(x)


def _three_steps(model, x, config=None, mutate=None):
    """Train ``model`` through memopt and a deep copy eagerly side by side; assert bit-identical results."""
    reference = copy.deepcopy(model)
    om = memopt.optimize(model, example_inputs=x, config=config or memopt.Config.exact())
    for step in range(3):
        if mutate is not None and step == 1:
            mutate(model)
            mutate(reference)
        torch.manual_seed(step)
        out = om(x)
        torch.manual_seed(step)
        ref = reference(x)
        out.sum().backward()
        ref.sum().backward()
        assert torch.equal(out, ref), f"step {step}: outputs differ"
        for (name, p), q in zip(model.named_parameters(), reference.parameters()):
            assert torch.equal(p.grad, q.grad), f"step {step}: gradient of {name} differs"
        for (name, b), c in zip(model.named_buffers(), reference.buffers()):
            assert torch.equal(b, c), f"step {step}: buffer {name} differs"
    return om, reference


@pytest.mark.parametrize("function", [STE, GradReverse, SignReLU])
def test_custom_autograd_functions_stay_whole(function):
    torch.manual_seed(0)
    model, x = FunctionNet(function), torch.randn(6, 8)
    om, reference = _three_steps(model, x)
    assert om.plan.capture == "symbolic_trace"
    calls = [m for m in om.graph_module.modules() if isinstance(m, FunctionCall)]
    assert [c.function for c in calls] == [function]
    assert memopt.measure(om, x).saved_bytes <= memopt.measure(reference, x).saved_bytes


def test_a_memory_saving_function_keeps_what_it_saves_under_every_config():
    torch.manual_seed(0)
    model, x = FunctionNet(SignReLU), torch.randn(6, 8)
    stock = memopt.measure(copy.deepcopy(model), x).saved_bytes
    for config in (memopt.Config.exact(), memopt.Config()):
        om = memopt.optimize(copy.deepcopy(model), example_inputs=x, config=config)
        assert memopt.measure(om, x).saved_bytes <= stock


class ShapeBranch(FunctionNet):  # not fx-traceable (control flow on a shape), so torch.export captures it
    def forward(self, x):
        h = self.function.apply(self.a(x))
        if x.shape[0] > 2:
            h = h * 2
        return self.b(h)


@pytest.mark.parametrize("function", [STE, GradReverse, SignReLU])
def test_export_keeps_a_custom_function_whole(function):
    """Export would trace the Function's forward (STE's gradient would be zero, GradReverse's of the wrong sign):
    it is one opaque operator while export traces, then a FunctionCall running the Function's own backward."""
    captured = capture(ShapeBranch(function), (torch.randn(4, 8),), {})
    assert captured.method == "export"
    calls = [m for m in captured.graph_module.modules() if isinstance(m, FunctionCall)]
    assert [c.function for c in calls] == [function]
    torch.manual_seed(0)
    model, x = ShapeBranch(function), torch.randn(4, 8)
    om, reference = _three_steps(model, x)  # bit-identical outputs, gradients and buffers, three steps
    assert om.plan.capture == "export"
    assert memopt.measure(om, x).saved_bytes <= memopt.measure(reference, x).saved_bytes


class ScaledPair(torch.autograd.Function):
    """Two outputs, a float and an int argument, a hand-written backward that differs from autograd's."""

    @staticmethod
    def forward(ctx, x, scale, power):
        ctx.save_for_backward(x)
        ctx.scale, ctx.power = scale, power
        return x * scale, x.pow(power)

    @staticmethod
    def backward(ctx, g1, g2):
        (x,) = ctx.saved_tensors
        return g1 * ctx.scale + g2 * 0.5, None, None


class PairNet(ShapeBranch):
    def __init__(self):
        super().__init__(ScaledPair)

    def forward(self, x):
        h, p = ScaledPair.apply(self.a(x), 0.5, 2)
        if x.shape[0] > 2:
            h = h + p
        return self.b(h)


def test_export_keeps_a_function_with_two_outputs_and_number_arguments_whole():
    torch.manual_seed(0)
    model, x = PairNet(), torch.randn(4, 8)
    om, _ = _three_steps(model, x)
    assert om.plan.capture == "export"
    assert [m.function for m in om.graph_module.modules() if isinstance(m, FunctionCall)] == [ScaledPair]


class Configured(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, options):
        ctx.negate = options["negate"]
        return x.clone()

    @staticmethod
    def backward(ctx, g):
        return -g if ctx.negate else g, None


def test_export_refuses_a_custom_function_it_cannot_keep_whole_and_says_why():
    class OptionsBranch(ShapeBranch):
        def forward(self, x):
            h = Configured.apply(self.a(x), {"negate": True})
            if x.shape[0] > 2:
                h = h * 2
            return self.b(h)

    with pytest.raises(memopt.TraceError, match=r"torch.export inlines the custom autograd Function Configured "
                                                r"\(.*test_soundness.py:\d+; its argument 1 \(dict\) cannot be an "
                                                r"operator argument\): its own backward would not run"):
        capture(OptionsBranch(STE), (torch.randn(4, 8),), {})
    model, x = OptionsBranch(STE), torch.randn(4, 8)
    om, _ = _three_steps(model, x)  # falls back per submodule: the Function runs in the model's own forward
    assert om.plan.capture == "per-submodule"


def test_buffer_updates_and_no_grad_regions_are_kept_and_optimize_leaves_state_alone():
    torch.manual_seed(0)
    model, x = Counter(), torch.randn(6, 8)
    om = memopt.optimize(model, example_inputs=x, config=memopt.Config.exact())
    assert model.count.item() == 0 and torch.equal(model.ema, torch.zeros(4)) and model.ema.grad_fn is None
    assert om.plan.capture == "symbolic_trace"
    model2 = Counter()
    model2.load_state_dict(model.state_dict())
    _three_steps(model2, x)
    assert model2.count.item() == 3 and model2.ema.grad_fn is None


@pytest.mark.slow
def test_timm_batchnormact_counts_batches_as_stock():
    timm = pytest.importorskip("timm")
    torch.manual_seed(0)
    model, x = timm.create_model("regnetx_002", num_classes=10), torch.randn(2, 3, 32, 32)
    fresh = copy.deepcopy(model)
    om, _ = _three_steps(model, x)
    assert om.plan.capture == "symbolic_trace"
    tracked = [b for n, b in model.named_buffers() if n.endswith("num_batches_tracked")]
    assert tracked and all(int(b) == 3 for b in tracked)
    # the default plan stashes the fused BatchNorms (memopt/capture/fused_norms.py): forward and buffers stay stock's
    reference = copy.deepcopy(fresh)
    om = memopt.optimize(fresh, example_inputs=x)
    assert any(u["chosen"]["technique"] == "stash" for u in om.plan.units)
    for step in range(3):
        torch.manual_seed(step)
        out = om(x)
        torch.manual_seed(step)
        assert torch.equal(out, reference(x))
        out.sum().backward()
    for (name, b), c in zip(fresh.named_buffers(), reference.buffers()):
        assert torch.equal(b, c), name


def test_user_checkpointing_is_never_undone():
    torch.manual_seed(0)
    model, x = Checkpointed(), torch.randn(16, 32, requires_grad=True)
    stock = memopt.measure(copy.deepcopy(model), x).saved_bytes
    for config in (memopt.Config.exact(), memopt.Config()):
        om = memopt.optimize(copy.deepcopy(model), example_inputs=x, config=config)
        assert om.plan.capture == "per-submodule"
        assert memopt.measure(om, x).saved_bytes <= stock
        reasons = {s["path"]: s["why"] for s in om.plan.submodules}
        assert "torch.utils.checkpoint" in reasons["blocks.0"]
    _three_steps(model, x)


def test_changed_python_attributes_are_guarded(caplog):
    torch.manual_seed(0)
    with caplog.at_level(logging.WARNING, logger="memopt"):
        _three_steps(Flagged(), torch.randn(6, 8), mutate=lambda m: setattr(m, "flip", True))
        _three_steps(Flagged(), torch.randn(6, 8), mutate=lambda m: setattr(m, "scale", 0.5))
    assert "Flagged changed since it was captured (flip: False -> True)" in caplog.text
    assert "(scale: 1.0 -> 0.5)" in caplog.text


def test_forward_with_python_side_effects_is_not_captured_whole():
    model, x = SideEffect(), torch.randn(6, 8)
    om, _ = _three_steps(model, x)
    assert om.plan.capture == "per-submodule"
    assert om.plan.submodules[0]["why"] == "forward changes Python attributes calls: 0 -> 1"


def test_the_check_runs_on_a_slice_and_the_plan_says_which():
    model, x = FunctionNet(STE), torch.randn(32, 8)
    om = memopt.optimize(model, example_inputs=x)
    assert om.plan.soundness["checked"] is True
    assert om.plan.soundness["slice"] == "the first 4 of 32 samples"
    assert om.plan.soundness["captured_saved_bytes"] <= om.plan.soundness["eager_saved_bytes"]
    args, kwargs, which = batch_slice((torch.randn(3, 2),), {"mask": torch.ones(3)})
    assert which == "the whole example batch" and args[0].shape[0] == 3


def test_the_check_is_skipped_on_meta_inputs_and_catches_a_wrong_graph():
    model = FunctionNet(STE)
    gm = capture(model, (torch.randn(4, 8),), {}).graph_module
    skipped = check_capture(model, gm, "symbolic_trace", (torch.randn(4, 8, device="meta"),), {})
    assert not skipped.checked and "meta" in skipped.slice
    # a graph traced through the Function (what capture did before) is refused, with the parameters named
    traced = torch.fx.symbolic_trace(model)
    with pytest.raises(memopt.TraceError, match=r"gradients differ: a.weight, a.bias"):
        check_capture(model, traced, "symbolic_trace", (torch.randn(4, 8),), {})


def test_fingerprint_sees_submodule_training_flags():
    model = Checkpointed()
    before = attribute_fingerprint(model)
    model.blocks[0].eval()
    assert attribute_fingerprint(model) != before


def test_outputs_of_any_pytree_type_train():
    import dataclasses

    @dataclasses.dataclass
    class Output:
        logits: torch.Tensor
        extra: dict

    class DataclassNet(nn.Module):
        def __init__(self):
            super().__init__()
            self.a = nn.Linear(8, 4)

        def forward(self, x):
            y = self.a(x)
            return Output(torch.relu(y), {"doubled": y * 2})

    model, x = DataclassNet(), torch.randn(6, 8)
    om = memopt.optimize(model, example_inputs=x)
    out = om(x)
    assert isinstance(out, Output) and om.plan.soundness["checked"]
    from memopt.cost_model.step import default_loss

    with pytest.raises(ValueError, match=r"memopt.optimize plans a step on the sum of the floating outputs: return "
                                         r"the logits or the loss from forward"):
        default_loss({"ids": torch.ones(3, dtype=torch.long)})


def test_a_submodule_captured_alone_never_codes_an_input_the_code_around_it_keeps():
    class Gate(nn.Module):
        def forward(self, g, u):
            return nn.functional.silu(g) * u

    class Outer(nn.Module):
        def __init__(self):
            super().__init__()
            self.lin, self.gate, self.out = nn.Linear(8, 32), Gate(), nn.Linear(16, 4)

        def forward(self, x):
            h = self.lin(x)
            g, u = h.chunk(2, -1)
            if h.sum() > -1e9:  # control flow on a tensor value: captured per submodule
                h = h + 0
            return self.out(self.gate(g, u) * g)  # the code around the submodule keeps g too

    torch.manual_seed(0)
    model, x = Outer(), torch.randn(16, 8)
    stock = memopt.measure(copy.deepcopy(model), x).saved_bytes
    om = memopt.optimize(model, example_inputs=x, config=memopt.Config(fidelity=None))
    assert om.plan.capture == "per-submodule"
    assert memopt.measure(om, x).saved_bytes <= stock
    # the gated unit silu(g) * u runs as one coded op that keeps g and u as they are (inputs of the submodule)
    reasons = [n.reason for n in om.plan.nodes if n.reason.startswith("coded gated")]
    assert reasons and all("keeps its inputs as they are" in r for r in reasons)


class NumpyDropout(nn.Module):
    """Drops hidden features picked with numpy's global RNG in training, as HF Wav2Vec2 / HuBERT pick SpecAugment's
    masked spans."""

    def __init__(self):
        super().__init__()
        self.a, self.b = nn.Sequential(nn.Linear(8, 64), nn.GELU(), nn.Linear(64, 64), nn.GELU()), nn.Linear(64, 4)

    def forward(self, x):
        h = self.a(x)
        if self.training:
            h = h * torch.from_numpy(np.random.rand(64) > 0.3).to(h.dtype)
        return self.b(h)


def test_draws_from_numpy_are_neither_baked_into_the_graph_nor_taken_from_the_user(caplog):
    """The symbolic trace fixes numpy's draw as a constant: the capture check, whose steps draw from their own seed,
    sees the outputs differ and captures per submodule (the model's forward draws for real). The steps memopt
    compares draw alike (the whole-model fidelity gate passes; it failed on every draw before), and the user's
    numpy and Python streams are where they were."""
    torch.manual_seed(0)
    model, x = NumpyDropout().train(), torch.randn(32, 8)
    reference = copy.deepcopy(model)
    np.random.seed(5)
    random.seed(5)
    states = np.random.get_state()[1].copy(), random.getstate()
    with caplog.at_level(logging.INFO, logger="memopt"):
        om = memopt.optimize(model, example_inputs=x)
    assert (np.random.get_state()[1] == states[0]).all() and random.getstate() == states[1]
    assert om.plan.capture == "per-submodule"
    assert "the training forward's outputs differ (a value the trace fixed as a constant: a draw from torch " \
           "with no tensor argument (torch.randn(8, 8)), from Python's or numpy's RNG" in caplog.text
    assert om.plan.fidelity["passed"]
    for step in range(2):
        np.random.seed(step)
        out = om(x)
        np.random.seed(step)
        assert torch.equal(out, reference(x))


class TorchNoise(nn.Module):
    """Adds noise drawn by torch from a shape alone: the symbolic trace evaluates the draw once, as a constant."""

    def __init__(self):
        super().__init__()
        self.a, self.b = nn.Linear(8, 16), nn.Linear(16, 4)

    def forward(self, x):
        return self.b(self.a(x) + 0.1 * torch.randn(16))


def test_a_torch_draw_the_trace_baked_in_is_caught_though_the_trace_drew_from_the_same_state(caplog):
    """Capture puts torch's RNG back after tracing, so the baked constant equals what an eager step from that state
    draws: the check compares from another state and sees the difference (before, the model ran on its first draw
    for every step)."""
    torch.manual_seed(0)
    model, x = TorchNoise().train(), torch.randn(4, 8)
    reference = copy.deepcopy(model)
    with caplog.at_level(logging.INFO, logger="memopt"):
        om = memopt.optimize(model, example_inputs=x)
    assert "a draw from torch with no tensor argument" in caplog.text
    assert om.plan.capture == "per-submodule"
    for step in range(2):
        torch.manual_seed(step)
        out = om(x)
        torch.manual_seed(step)
        assert torch.equal(out, reference(x))
