"""passes/stash/chunks.py: weight gradients over batch chunks, chosen by the cost model's step where the
peak falls inside one (autocast's float32 rebuild of a bf16 input), left alone where it does not; estimate equal
to the measurement, the forward bit-identical, the plan re-applied with its chunks.

The C kernels rebuild a chain's output straight in bf16 (no float32 copy, so the peak leaves the weight gradient);
the plain-PyTorch rebuild, which a machine without a C compiler takes (and CUDA's Triton rebuild likewise), goes
through float32: the bf16 tests run on that path (``plain_rebuild``: ``kernels.forced("torch")``), where chunks
still lower the peak."""
import pytest
import torch
from torch import nn

import memopt
from memopt.cost_model.analysis import annotate
from memopt.passes.stash.chunks import chunk_to_fit, chunks_of, consumers, set_chunks
from memopt.runtime import kernels
from memopt.testing.zoo import build


@pytest.fixture
def plain_rebuild():
    with kernels.forced("torch"):
        yield


class Widening(nn.Module):
    """A BN-ReLU chain feeding a 1x1 conv that widens 16 -> 256 channels: the conv's output gradient is the
    largest tensor of the backward, so the peak is that conv's backward, and under bf16 autocast its weight
    gradient (the chain's output rebuilt in float32, then in bf16) is the top of it."""

    def __init__(self):
        super().__init__()
        self.c1, self.bn, self.c2 = nn.Conv2d(3, 16, 3, padding=1), nn.BatchNorm2d(16), nn.Conv2d(16, 256, 1)

    def forward(self, x):
        return self.c2(torch.relu(self.bn(self.c1(x)))).mean((2, 3))


class DeepWidening(Widening):
    """Widening after four more conv-BN-ReLU layers: activations stock keeps in full and memopt codes, so the
    step's peak (the widening conv's weight gradient) is one only chunks bring under stock's."""

    def __init__(self):
        super().__init__()
        self.body = nn.Sequential(*[m for _ in range(4) for m in (nn.Conv2d(16, 16, 3, padding=1),
                                                                   nn.BatchNorm2d(16), nn.ReLU())])

    def forward(self, x):
        return self.c2(self.body(torch.relu(self.bn(self.c1(x))))).mean((2, 3))


def _bf16():
    return torch.autocast("cpu", torch.bfloat16)


def _optimize(model, x, **kw):
    with _bf16():
        return memopt.optimize(model, example_inputs=x, optimizer="sgd", config=memopt.Config(fidelity=None), **kw)


def _estimate(gm, x):
    with _bf16():
        return annotate(gm, (x,), {}, optimizer="sgd")


def _grads(model, x):
    model.zero_grad(set_to_none=True)
    with _bf16():
        out = model(x)
    out.float().square().sum().backward()
    return out, {n: p.grad.clone() for n, p in model.named_parameters()}


def test_the_default_plan_chunks_where_the_peak_is_a_weight_gradient_and_measures_what_it_estimates(plain_rebuild):
    torch.manual_seed(0)
    x = torch.randn(8, 3, 32, 32)
    om = _optimize(Widening(), x)
    gm = om.graph_module
    assert om.plan.weight_grad_chunks > 1 and chunks_of(gm) == om.plan.weight_grad_chunks
    assert all(n.kwargs.get("chunks") == om.plan.weight_grad_chunks for n in consumers(gm))
    with _bf16():
        measured = memopt.measure(om, x, optimizer="sgd")
    assert measured.peak_bytes == om.plan.estimated_peak_bytes
    chunked = _estimate(gm, x)
    assert not chunked.breakdown["peak_in_weight_grad"]
    set_chunks(gm, 1)
    whole = _estimate(gm, x)
    assert whole.breakdown["peak_in_weight_grad"] and whole.peak_bytes > chunked.peak_bytes
    assert "weight gradients from codes in batch chunks" in om.report()


def test_chunks_leave_the_forward_bit_identical_and_the_gradients_at_rounding(plain_rebuild):
    torch.manual_seed(0)
    x = torch.randn(8, 3, 32, 32)
    model = Widening()
    om = _optimize(model, x)
    torch.manual_seed(1)
    out_chunked, chunked = _grads(om, x)
    set_chunks(om.graph_module, 1)
    torch.manual_seed(1)
    out_whole, whole = _grads(om, x)
    assert torch.equal(out_chunked, out_whole)
    for name, g in whole.items():
        cos = torch.nn.functional.cosine_similarity(g.flatten().float(), chunked[name].flatten().float(), 0)
        assert cos > 0.9999, (name, cos)


def test_no_chunks_where_the_peak_is_elsewhere():
    model, x = build("tiny_resnet")  # float32: the chains' backwards are the peak, not a weight gradient
    om = memopt.optimize(model, example_inputs=x, config=memopt.Config(fidelity=None))
    assert consumers(om.graph_module) and om.plan.weight_grad_chunks == 1
    assert chunks_of(om.graph_module) == 1


def test_a_budget_only_chunks_can_meet_is_met_with_them(plain_rebuild):
    torch.manual_seed(0)
    x = torch.randn(8, 3, 32, 32)
    om = _optimize(DeepWidening(), x)
    chunked = om.plan.estimated_peak_bytes
    set_chunks(om.graph_module, 1)
    whole = _estimate(om.graph_module, x).peak_bytes
    assert om.plan.baseline_peak_bytes > (chunked + whole) / 2  # stock does not fit the budget below either
    budget = (chunked + whole) / 2 / 2 ** 20
    with _bf16():  # the budget for the step's tensors alone (no measured reserve beside them: a toy model's MiB)
        planned = memopt.optimize(DeepWidening(), example_inputs=x, optimizer="sgd", budget_mb=budget,
                                  config=memopt.Config(fidelity=None, workspace_mb=0))
    assert planned.plan.estimated_peak_bytes <= budget * 2 ** 20
    # the budget is met either with chunks or by leaving the widening conv's input exact (no rebuild at all); a
    # plan that rebuilds it in one piece is the ``whole`` estimate, over the budget
    widening = [n.name for n in consumers(planned.graph_module) if n.name.startswith("c2")]
    assert planned.plan.weight_grad_chunks > 1 or not widening, widening


def test_a_plan_is_re_applied_with_its_chunks(tmp_path, plain_rebuild):
    torch.manual_seed(0)
    x = torch.randn(8, 3, 32, 32)
    om = _optimize(Widening(), x)
    path = tmp_path / "plan.json"
    om.plan.save(path)
    with _bf16():
        again = memopt.optimize(Widening(), example_inputs=x, optimizer="sgd", plan=memopt.Plan.load(path))
    assert chunks_of(again.graph_module) == om.plan.weight_grad_chunks > 1


def test_chunk_to_fit_keeps_nothing_that_does_not_lower_the_peak():
    torch.manual_seed(0)
    x = torch.randn(8, 3, 32, 32)
    model = Widening()
    om = memopt.optimize(model, example_inputs=x, optimizer="sgd", config=memopt.Config(fidelity=None))  # float32
    gm = om.graph_module
    before = annotate(gm, (x,), {}, optimizer="sgd")
    after, chosen = chunk_to_fit(gm, before, None, lambda g: annotate(g, (x,), {}, optimizer="sgd"))
    assert chosen == 1 and chunks_of(gm) == 1 and after.peak_bytes == before.peak_bytes


def test_set_chunks_refuses_a_bad_count():
    gm = _optimize(Widening(), torch.randn(4, 3, 8, 8)).graph_module
    with pytest.raises(ValueError, match=r"weight-gradient chunks must be an int >= 1, got 0"):
        set_chunks(gm, 0)
