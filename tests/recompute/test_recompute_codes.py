"""Recompute from codes: a block keeps its gradient-carrying inputs as K-bit codes and runs again from them in
backward. Forward bit-identical, estimate = measurement, gradients close to autograd's (and gated), inputs
without gradient kept as they are (the default plan's peak-first step: tests/passes/test_peak_first.py)."""
import copy

import pytest
import torch
from torch import nn

import memopt
from memopt.recompute.ops import RecomputeSpec, recompute_block, recompute_from_codes
from memopt.testing.zoo import build

CODED = memopt.Config(recompute=memopt.RecomputeConfig(segments=None, bits=8), stash=None, fewbit=None,
                      fidelity=None)
EXACT = memopt.Config(recompute=memopt.RecomputeConfig(segments=None), stash=None, fewbit=None)


def _step(model, x, seed=0):
    torch.manual_seed(seed)
    out = model(x)
    out.logsumexp(-1).mean().backward()
    return out


def _cosine(a, b):
    return torch.nn.functional.cosine_similarity(a.flatten().double(), b.flatten().double(), 0).item()


# the least cosine without the gate: BatchNorm at batch 4 magnifies the rebuilt input's error in its bias gradients
@pytest.mark.parametrize("name,least", [("tiny_resnet", 0.95), ("vit", 0.999)])
def test_forward_and_buffers_are_bit_identical_and_gradients_close(name, least):
    model, x = build(name)
    reference = copy.deepcopy(model)
    om = memopt.optimize(model, example_inputs=x, config=CODED, optimizer="sgd")
    chosen = [u["chosen"] for u in om.plan.units if u["chosen"]["technique"] == "recompute"]
    assert chosen and all(c["bits"] == 8 and c["fidelity"] > 0 for c in chosen)  # lossy: the gate would check it
    out, ref = _step(om, x), _step(reference, x)
    assert torch.equal(out, ref)
    for (bname, b), c in zip(model.named_buffers(), reference.buffers()):
        assert torch.equal(b, c), bname
    for (pname, p), q in zip(model.named_parameters(), reference.parameters()):
        assert _cosine(p.grad, q.grad) > least, pname


@pytest.mark.parametrize("name", ["tiny_resnet", "vit"])
def test_estimate_equals_measurement_and_keeps_less_than_exact_recompute(name):
    model, x = build(name)
    coded = memopt.optimize(model, example_inputs=x, config=CODED, optimizer="sgd")
    measured = memopt.measure(coded, x, optimizer="sgd")
    assert measured.saved_bytes == coded.plan.estimated_saved_bytes
    assert measured.peak_bytes == coded.plan.estimated_peak_bytes
    exact = memopt.optimize(copy.deepcopy(model), example_inputs=x, config=EXACT, optimizer="sgd")
    assert coded.plan.estimated_saved_bytes < exact.plan.estimated_saved_bytes


class _Block(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(16, 16)

    def forward(self, x, table):
        return x + torch.tanh(self.fc(x)) * table


def test_only_inputs_that_carry_gradient_are_coded():
    block = _Block()
    x = torch.randn(64, 16, requires_grad=True)
    table = torch.randn(64, 16)  # a rotary table / mask: no gradient, shared by blocks
    spec = RecomputeSpec(False, "block", 8, 256)
    out = recompute_from_codes(block, spec, x, table)
    saved = {tuple(t.shape): t.dtype for t in out.grad_fn.saved_tensors}
    assert saved[(64, 16)] == torch.float32  # the table, as it is
    assert torch.uint8 in saved.values()  # x, as codes
    assert torch.equal(out, recompute_block(block, RecomputeSpec(False, "block"), x, table))
    out.sum().backward()
    grad = x.grad.clone()
    x.grad = None
    (x + torch.tanh(block.fc(x)) * table).sum().backward()
    assert _cosine(grad, x.grad) > 0.999


def test_codes_of_a_bf16_input_rebuild_bf16():
    block = _Block().to(torch.bfloat16)
    x = torch.randn(64, 16, dtype=torch.bfloat16, requires_grad=True)
    out = recompute_from_codes(block, RecomputeSpec(False, "block", 8, 256), x, torch.ones(64, 16,
                                                                                          dtype=torch.bfloat16))
    out.float().sum().backward()
    assert x.grad.dtype == torch.bfloat16 and torch.isfinite(x.grad).all()


def test_bad_bits_are_refused_with_the_range():
    with pytest.raises(ValueError, match=r"RecomputeConfig.bits must be an int in 1..8, got 12"):
        memopt.RecomputeConfig(bits=12)
    with pytest.raises(ValueError, match=r"time_allowance must be a finite number of stock steps >= 1, got 0.5"):
        memopt.RecomputeConfig(time_allowance=0.5)
    with pytest.raises(ValueError, match=r"peak_first_gain must be a fraction in \(0, 1\), got 1.5"):
        memopt.RecomputeConfig(peak_first_gain=1.5)


def test_the_gate_checks_coded_recomputation():
    model, x = build("tiny_resnet")
    reference = copy.deepcopy(model)
    config = memopt.Config(recompute=memopt.RecomputeConfig(segments=None, bits=8), stash=None, fewbit=None)
    om = memopt.optimize(model, example_inputs=x, config=config, optimizer="sgd")
    report = om.plan.fidelity
    assert report is not None and report["passed"]
    assert torch.equal(_step(om, x), _step(reference, x))
