"""Recomputed blocks: bit-identical forward, exact gradients, BatchNorm statistics updated once,
dropout replayed, honest bytes, refusals with reasons, and the planner's last resort."""
import copy

import pytest
import torch
from torch import nn

import memopt
from memopt.recompute.ops import RecomputeSpec, recompute_block
from memopt.testing.zoo import ZOO, build

ALL = memopt.Config(recompute=memopt.RecomputeConfig(segments=None), stash=None, fewbit=None)


def _step(model, x, seed=0):
    torch.manual_seed(seed)
    out = model(x)
    out.logsumexp(-1).mean().backward()
    return out


@pytest.mark.parametrize("name", ["tiny_resnet", "preact_resnet20", "vit", "resnet18", "mobilenet_v2"])
def test_forward_gradients_and_buffers_are_exact(name):
    if ZOO[name].needs_torchvision:
        pytest.importorskip("torchvision")
    model, x = build(name)
    reference = copy.deepcopy(model)
    om = memopt.optimize(model, example_inputs=x, config=ALL, optimizer="sgd")
    assert any(u["chosen"]["technique"] == "recompute" for u in om.plan.units)
    out, ref = _step(om, x), _step(reference, x)
    assert torch.equal(out, ref)
    for (pname, p), q in zip(model.named_parameters(), reference.parameters()):
        assert torch.equal(p.grad, q.grad), pname
    for (bname, b), c in zip(model.named_buffers(), reference.buffers()):
        assert torch.equal(b, c), f"{bname}: running statistics must be updated once per step"


def test_dropout_inside_a_block_is_replayed():
    model, x = build("vit")
    for m in model.modules():
        if isinstance(m, nn.Dropout):
            m.p = 0.5
    reference = copy.deepcopy(model)
    om = memopt.optimize(model, example_inputs=x, config=ALL)
    assert torch.equal(_step(om, x, seed=3), _step(reference, x, seed=3))
    for p, q in zip(model.parameters(), reference.parameters()):
        assert torch.equal(p.grad, q.grad)


@pytest.mark.parametrize("name", ["tiny_resnet", "vit"])
def test_estimate_equals_measurement(name):
    model, x = build(name)
    om = memopt.optimize(model, example_inputs=x, config=ALL, optimizer="sgd")
    measured = memopt.measure(om, x, optimizer="sgd")
    assert measured.saved_bytes == om.plan.estimated_saved_bytes < om.plan.baseline_saved_bytes
    assert measured.peak_bytes == om.plan.estimated_peak_bytes


class _Block(nn.Module):
    def __init__(self):
        super().__init__()
        self.a, self.b = nn.Linear(6, 6), nn.Linear(6, 6)

    def forward(self, x):
        return self.b(torch.tanh(self.a(x))) + x


def test_gradcheck_in_double_precision():
    block = _Block().double()
    x = torch.randn(3, 6, dtype=torch.float64, requires_grad=True)
    assert torch.autograd.gradcheck(lambda t: recompute_block(block, RecomputeSpec(False, "block"), t), (x,))


def test_double_backward_is_refused():
    block = _Block()
    x = torch.randn(3, 6, requires_grad=True)
    with pytest.raises(RuntimeError, match="double backward through the recomputed block block is not supported"):
        torch.autograd.grad(recompute_block(block, RecomputeSpec(False, "block"), x).sum(), x, create_graph=True)


def test_only_non_leaf_members_of_containers_are_blocks():
    model, x = nn.Sequential(nn.Linear(4, 4), nn.ReLU(), nn.Sequential(nn.Linear(4, 4), nn.Tanh())), torch.randn(2, 4)

    class Uses(nn.Module):
        def __init__(self):
            super().__init__()
            self.seq = model

        def forward(self, x):
            h = self.seq[0](x)
            return self.seq[2](h) + h  # seq.0 is a leaf module, not a block; seq.2 is one
    om = memopt.optimize(Uses(), example_inputs=x, config=ALL)
    assert [u["chosen"]["unit"] for u in om.plan.units] == ["seq_2"]


def test_planner_recomputes_when_nothing_else_fits():
    model, x = build("vit")  # few-bit and the stash off: only recomputation can lower the peak
    config = memopt.Config(fewbit=None, stash=None)
    baseline = memopt.estimate(model, x, optimizer="sgd").peak_bytes
    om = memopt.optimize(model, 0.97 * baseline / 2 ** 20, example_inputs=x, config=config, optimizer="sgd")
    assert "recompute" in {u["chosen"]["technique"] for u in om.plan.units}
    assert om.plan.estimated_peak_bytes <= 0.97 * baseline
    assert memopt.measure(om, x, optimizer="sgd").peak_bytes == om.plan.estimated_peak_bytes
    with pytest.raises(memopt.BudgetError):
        memopt.optimize(model, 0.97 * baseline / 2 ** 20, example_inputs=x,
                        config=memopt.Config(fewbit=None, stash=None, recompute=None), optimizer="sgd")


@pytest.mark.slow
def test_planner_does_not_recompute_when_the_other_techniques_fit():
    model, x = build("tiny_resnet")
    default = memopt.optimize(model, example_inputs=x, optimizer="sgd").plan.estimated_peak_bytes
    om = memopt.optimize(model, default / 2 ** 20, example_inputs=x, optimizer="sgd")
    assert "recompute" not in {u["chosen"]["technique"] for u in om.plan.units}


class _Pair(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(4, 4)

    def forward(self, x):
        inner = self.fc(x)
        return torch.tanh(inner), inner


class _Leaks(nn.Module):
    """Block 0 hands out an inner value too: two values used outside, so it stays exact."""

    def __init__(self):
        super().__init__()
        self.blocks = nn.ModuleList([_Pair(), nn.Sequential(nn.Linear(4, 4))])

    def forward(self, x):
        h, inner = self.blocks[0](x)
        return self.blocks[1](h) + inner


def test_a_block_whose_inner_value_is_used_outside_stays_exact_with_the_reason():
    om = memopt.optimize(_Leaks(), example_inputs=torch.randn(2, 4), config=ALL)
    assert [u["chosen"]["unit"] for u in om.plan.units] == ["blocks_1"]
    reasons = {n.name: n.reason for n in om.plan.nodes}
    assert reasons["blocks_0_fc"] == "recompute: 2 of its values are used outside it (one is needed)"


def test_units_next_to_a_recomputed_block_say_why_they_stay_exact():
    from memopt.builder.pipeline import _explain_exact

    def option(technique, unit, bits=None, freed=0):
        return {"technique": technique, "bits": bits, "unit": unit, "freed_bytes": freed, "fidelity": 0.0, "time": 0.0}
    units = [
        {"name": "recompute:layers_0", "nodes": ["layers_0_conv1", "layers_0_bn2", "layers_0_relu_1"],
         "chosen": option("recompute", "layers_0"), "alternatives": []},
        # the chain ends in block 0 and feeds block 1's conv: recomputing block 0 leaves the conv exact
        {"name": "stash:layers_0_bn2", "nodes": ["layers_0_bn2", "layers_0_relu_1", "layers_1_conv1"],
         "chosen": option("exact", ""), "alternatives": [option("exact", ""), option("stash", "layers_0_bn2", 4, 100)]},
        {"name": "stash:layers_2_bn1", "nodes": ["layers_2_bn1"],
         "chosen": option("exact", ""), "alternatives": [option("exact", ""), option("stash", "layers_2_bn1", 4, 100)]},
    ]
    decisions = {}
    _explain_exact(decisions, units)
    assert decisions["layers_1_conv1"]["reason"] == ("planner: part of this unit lies in the recomputed block "
                                                     "layers_0, so the rest stays exact")
    assert "layers_0_bn2" not in decisions  # inside the recomputed block: no node of its own any more
    assert decisions["layers_2_bn1"]["reason"] == "planner: the budget is met without it (stash@4 frees 100 B)"


class _MaskedBlock(nn.Module):
    def __init__(self, d=16):
        super().__init__()
        self.fc1, self.fc2 = nn.Linear(d, 2 * d), nn.Linear(2 * d, d)

    def forward(self, x, attn_mask=None, scale=1.0):
        h = torch.nn.functional.gelu(self.fc1(x))
        if attn_mask is not None:
            h = h.masked_fill(attn_mask, 0.0)
        return x + self.fc2(h) * scale


class _Masked(nn.Module):
    """As timm's ViTs: the forward takes attn_mask=None and hands it to every block (fx keeps it an input)."""

    def __init__(self):
        super().__init__()
        self.blocks = nn.ModuleList(_MaskedBlock() for _ in range(3))

    def forward(self, x, attn_mask=None):
        for i, block in enumerate(self.blocks):
            x = block(x, attn_mask, x.shape[-1] / 16)
        return x


def test_blocks_reading_a_none_input_or_a_size_are_recomputed_exactly():
    torch.manual_seed(0)
    model, x = _Masked(), torch.randn(4, 8, 16)
    reference = copy.deepcopy(model)
    om = memopt.optimize(model, example_inputs=x, config=ALL, optimizer="sgd")
    assert om.plan.capture == "symbolic_trace"  # attn_mask left at its None: traced as None, not as an input
    assert sum(u["chosen"]["technique"] == "recompute" for u in om.plan.units) == 3
    out, ref = _step(om, x), _step(reference, x)
    assert torch.equal(out, ref)
    for (name, p), q in zip(model.named_parameters(), reference.parameters()):
        assert torch.equal(p.grad, q.grad), name
    assert memopt.measure(om, x).saved_bytes == om.plan.estimated_saved_bytes
    mask = torch.rand(4, 8, 32) > 0.5  # passed: another input signature, captured again with the mask
    model.zero_grad(), reference.zero_grad()
    torch.manual_seed(0)
    out = om(x, attn_mask=mask)
    assert torch.equal(out, reference(x, attn_mask=mask))


def test_recompute_passes_values_that_hold_no_tensor_through():
    block = _MaskedBlock()
    x = torch.randn(2, 3, 16, requires_grad=True)
    out = recompute_block(block, RecomputeSpec(False, "block"), x, None, 0.5)
    ref = block(x, None, 0.5)
    assert torch.equal(out, ref)
    g = torch.randn_like(out)
    got = torch.autograd.grad(out, [x, *block.parameters()], g)
    want = torch.autograd.grad(ref, [x, *block.parameters()], g)
    assert all(torch.equal(a, b) for a, b in zip(got, want))


class _InPlaceFirst(nn.Module):
    """Blocks whose first op writes the block's input: an in-place dropout (ATen ``dropout_`` in an export graph,
    as torchvision EfficientNet's classifier has) and ``add_`` (a method call in a symbolic trace, ATen ``add_`` in
    an export graph)."""

    def __init__(self):
        super().__init__()
        self.blocks = nn.Sequential(nn.Sequential(nn.Dropout(0.2, inplace=True), nn.Linear(4, 4)), _AddsInPlace())

    def forward(self, x):
        return self.blocks(x * 2)


class _AddsInPlace(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(4, 4)

    def forward(self, x):
        x.add_(1)
        return self.fc(x)


@pytest.mark.parametrize("capture", ["symbolic_trace", "export"])
def test_blocks_that_write_their_input_in_place_are_never_recomputed(capture):
    from memopt.capture.trace import capture as symbolic, export_capture
    from memopt.cost_model.analysis import annotate
    from memopt.passes.recompute import find_blocks, why_not
    model, x = _InPlaceFirst().train(), torch.randn(2, 4)
    gm = (symbolic if capture == "symbolic_trace" else export_capture)(model, (x,), {}).graph_module
    annotate(gm, (x,), {}, device="cpu")  # what the pass reads: which values are tensors
    reasons = {b.name: why_not(b) for b in find_blocks(gm)}
    assert reasons and all(isinstance(r, str) and "modifies an input of the block in place" in r
                           for r in reasons.values()), reasons
    om = memopt.optimize(copy.deepcopy(model), example_inputs=x, config=ALL)  # every block asked for: none taken
    assert "recompute" not in om.plan.chosen_units()
