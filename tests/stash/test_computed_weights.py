"""Weights computed from parameters alone (weight standardisation, weight norm): their ops' inputs are coded by the
generic stash, the weight itself recomputed in backward instead of kept (``passes/stash/weights.py``)."""
from __future__ import annotations

import copy
import dataclasses

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import memopt
from memopt.core.storage import storage_key
from memopt.cost_model.storage import SavedTensorRecorder
from memopt.stash.weights import WeightOpSpec, weight_op_recomputed


class StdConv(nn.Conv2d):
    """timm's ScaledStdConv2d, written out: the weight standardised per output channel in every forward."""

    def __init__(self, cin, cout, k, **kw):
        super().__init__(cin, cout, k, padding=k // 2, **kw)
        self.gain = nn.Parameter(torch.rand(cout, 1, 1, 1) + 0.5)
        self.scale = self.weight[0].numel() ** -0.5

    def forward(self, x):
        weight = F.batch_norm(self.weight.reshape(1, self.out_channels, -1), None, None,
                              weight=(self.gain * self.scale).view(-1), training=True, momentum=0.0,
                              eps=1e-6).reshape_as(self.weight)
        return F.conv2d(x, weight, self.bias, self.stride, self.padding, self.dilation, self.groups)


class NormFree(nn.Module):
    def __init__(self, width=24):
        super().__init__()
        self.stem = StdConv(3, width, 3)
        self.convs = nn.ModuleList(StdConv(width, width, 3) for _ in range(3))
        self.v = nn.Parameter(torch.randn(10, width))  # weight norm, written out
        self.g = nn.Parameter(torch.rand(10, 1) + 0.5)

    def forward(self, x):
        x = self.stem(x)
        for conv in self.convs:
            x = x + conv(F.gelu(x)) * 0.2
        return F.linear(x.mean((2, 3)), self.g * self.v / self.v.norm(dim=1, keepdim=True))


def _grads(model):
    return {n: p.grad.clone() for n, p in model.named_parameters()}


def _step(model, x):
    torch.manual_seed(1)
    out = model(x)
    out.square().sum().backward()
    return out


@pytest.mark.parametrize("coded", [False, True])
def test_the_op_keeps_no_weight_and_its_gradients_match_autograd(coded):
    torch.manual_seed(0)
    conv = StdConv(6, 8, 3)
    recipe = torch.fx.symbolic_trace(lambda w, g: F.batch_norm(w.reshape(1, 8, -1), None, None, (g * 0.1).view(-1),
                                                                training=True, eps=1e-6).reshape_as(w))
    x = torch.randn(2, 6, 9, 9, requires_grad=True)
    ref_conv, ref_x = copy.deepcopy(conv), x.detach().clone().requires_grad_()
    weight = recipe(ref_conv.weight, ref_conv.gain)
    ref = F.conv2d(ref_x, weight, ref_conv.bias, 1, 1)
    packed = params = None
    if coded:
        from memopt.stash.generic import EncodeSpec, generic_encode
        packed, params = generic_encode(x, EncodeSpec(8, 256))
    spec = WeightOpSpec("conv", (1, 1, 1, 1), 8 if coded else None, 256, "conv")
    with SavedTensorRecorder() as rec:
        out = weight_op_recomputed(spec, recipe, x, conv.bias, packed, params, conv.weight, conv.gain)
    assert torch.equal(out, ref)
    state = {storage_key(t) for t in conv.parameters()}
    kept = sorted(s.nbytes for s in rec.saved if s.key not in state)
    assert kept == (sorted([packed.numel(), params.numel() * 4]) if coded else [x.numel() * 4])  # no weight copy
    g = torch.randn_like(out)
    out.backward(g)
    ref.backward(g)
    assert torch.equal(x.grad, ref_x.grad) and torch.equal(conv.bias.grad, ref_conv.bias.grad)
    for name in ("weight", "gain"):
        mine, theirs = getattr(conv, name).grad, getattr(ref_conv, name).grad
        if coded:
            assert F.cosine_similarity(mine.flatten(), theirs.flatten(), 0) > 0.999
        else:
            assert torch.equal(mine, theirs), name


def test_weight_standardised_and_weight_norm_models_keep_no_computed_weights():
    torch.manual_seed(0)
    model, x = NormFree().train(), torch.randn(2, 3, 16, 16)
    reference = copy.deepcopy(model)
    om = memopt.optimize(model, example_inputs=x)
    reweighted = [n for n in om.plan.nodes if n.op == "weight_op_recomputed"]
    assert len(reweighted) == 5  # four standardised convs and the weight-normed linear
    assert all(n.technique == "stash" and "recomputed in backward" in n.reason for n in reweighted)
    assert torch.equal(_step(om, x), _step(reference, x))
    mine, ref = _grads(model), _grads(reference)
    for name, g in ref.items():
        assert F.cosine_similarity(mine[name].flatten(), g.flatten(), 0) > 0.99, name
    # what the model keeps: no computed weight, and less than the exact graph with the generic stash alone
    stock = memopt.measure(reference, x).saved_bytes
    kept = memopt.measure(om, x).saved_bytes
    without = memopt.optimize(copy.deepcopy(reference), example_inputs=x, config=memopt.Config(
        stash=memopt.StashConfig(recompute_weights=False)))
    assert kept < memopt.measure(without, x).saved_bytes < stock
    weights = sum(m.weight.numel() * 4 for m in [model.stem, *model.convs])
    assert memopt.measure(without, x).saved_bytes - kept >= weights


def test_exact_recomputation_is_bit_identical_over_steps():
    """Without the generic stash only the weights are recomputed: every gradient and update equals autograd's."""
    torch.manual_seed(0)
    model, x = NormFree().train(), torch.randn(2, 3, 16, 16)
    reference = copy.deepcopy(model)
    config = memopt.Config(stash=memopt.StashConfig(generic=False, coded_ops=()), fewbit=None, recompute=None)
    om = memopt.optimize(model, example_inputs=x, config=config)
    assert sum(n.op == "weight_op_recomputed" for n in om.plan.nodes) == 5
    opts = [torch.optim.SGD(m.parameters(), lr=0.1) for m in (model, reference)]
    for _ in range(3):
        for opt in opts:
            opt.zero_grad()
        assert torch.equal(_step(om, x), _step(reference, x))
        assert all(torch.equal(a.grad, b.grad) for a, b in zip(model.parameters(), reference.parameters()))
        for opt in opts:
            opt.step()


class Shared(nn.Module):
    """A standardised weight read twice, and one with random noise: neither can be recomputed by one op."""

    def __init__(self):
        super().__init__()
        self.w = nn.Parameter(torch.randn(8, 8))
        self.v = nn.Parameter(torch.randn(8, 8))
        self.s = nn.Parameter(torch.ones(8))

    def forward(self, x):
        x = x * self.s  # needs a gradient: the linears keep their weights
        w = self.w / self.w.norm()
        v = self.v + 0.01 * torch.randn_like(self.v)
        return F.linear(F.linear(x, w).relu(), w) + F.linear(x, v)


def test_recipes_read_twice_or_random_are_kept_and_the_report_says_why():
    torch.manual_seed(0)
    model, x = Shared().train(), torch.randn(4, 8)
    om = memopt.optimize(model, example_inputs=x, config=memopt.Config(
        stash=memopt.StashConfig(generic=False, coded_ops=()), fewbit=None))
    reasons = {n.name: n.reason for n in om.plan.nodes if n.op == "linear"}
    assert not any(n.op == "weight_op_recomputed" for n in om.plan.nodes)
    assert reasons["linear"] == reasons["linear_1"] == \
        "stash: its computed weight is kept: truediv, a step of its weight's recipe, is also read by linear", reasons
    assert reasons["linear_2"] == "stash: its computed weight is kept: randn_like draws random numbers", reasons


class WeightNormed(nn.Module):
    """Weight norm by ``nn.utils.parametrizations`` (HF Wav2Vec2's positional conv, HiFi-GAN, EnCodec)."""

    def __init__(self):
        super().__init__()
        self.conv = nn.utils.parametrizations.weight_norm(nn.Conv1d(16, 16, 9, padding=4, groups=4), dim=2)
        self.fc = nn.utils.parametrizations.weight_norm(nn.Linear(16, 16))

    def forward(self, x):
        x = x * 2.0
        return self.fc(F.gelu(self.conv(x)).transpose(1, 2)) + x.transpose(1, 2)


@pytest.mark.parametrize("generic", [False, True])
def test_parametrized_modules_recompute_their_weight(generic):
    torch.manual_seed(0)
    model, x = WeightNormed().train(), torch.randn(4, 16, 40, requires_grad=True)
    reference = copy.deepcopy(model)
    config = memopt.Config(stash=memopt.StashConfig(generic=generic, coded_ops=()), fewbit=None)
    om = memopt.optimize(model, example_inputs=x, config=config)
    assert [n.op for n in om.plan.nodes if "recomputed in backward" in n.reason] == ["weight_op_recomputed"] * 2
    x2 = x.detach().clone().requires_grad_()
    assert torch.equal(_step(om, x), _step(reference, x2))
    assert torch.equal(x.grad, x2.grad)  # input gradients never see the codes
    for (name, p), q in zip(model.named_parameters(), reference.parameters()):
        if generic:
            assert F.cosine_similarity(p.grad.flatten(), q.grad.flatten(), 0) > 0.99, name
        else:
            assert torch.equal(p.grad, q.grad), name
    kept = memopt.measure(om, x).saved_bytes
    off = memopt.optimize(copy.deepcopy(reference), example_inputs=x, config=dataclasses.replace(
        config, stash=dataclasses.replace(config.stash, recompute_weights=False)))
    weights = (model.conv.weight.numel() + model.fc.weight.numel()) * 4
    assert memopt.measure(off, x).saved_bytes - kept >= weights


class MatmulComputed(nn.Module):
    """``x @ w`` with ``w`` computed from a parameter (Hugging Face Falcon has one): a weight op of the generic
    stash, which must not be rewritten a second time as a coded product of two activations."""

    def __init__(self):
        super().__init__()
        self.fc, self.w = nn.Linear(16, 32), nn.Parameter(torch.randn(32, 24))

    def forward(self, x):
        return torch.matmul(F.gelu(self.fc(x)), self.w / self.w.norm(dim=0, keepdim=True))


def test_a_matmul_with_a_computed_weight_is_rewritten_once():
    torch.manual_seed(0)
    model, x = MatmulComputed().train(), torch.randn(4, 10, 16)
    reference = copy.deepcopy(model)
    om = memopt.optimize(model, example_inputs=x)
    ops = [n.op for n in om.plan.nodes if n.technique == "stash"]
    assert "matmul_from_codes" in ops and "coded_call" not in ops, ops
    assert torch.equal(_step(om, x), _step(reference, x))
    for name, g in _grads(reference).items():
        assert F.cosine_similarity(_grads(model)[name].flatten(), g.flatten(), 0) > 0.99, name
