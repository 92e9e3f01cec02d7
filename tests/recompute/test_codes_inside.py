"""Codes inside blocks recomputed from codes (``RecomputeConfig.codes_inside``): the stash and few-bit rewrite the
block's own graph, so backward's second forward keeps codes too. Forward and buffers bit-identical (BatchNorm
statistics updated once though the stash's BN op replaces the module inside the block), estimate = measurement
and a lower peak than the block recomputed as it is, gradients close to autograd's."""
import copy

import pytest
import torch
from torch import nn

import memopt
from memopt.core.meta import DECISION_KEY
from memopt.testing.zoo import build
from test_recompute_codes import _cosine, _step  # the same step and cosine as recompute from codes


def _config(inside: bool, bits=8) -> memopt.Config:
    return memopt.Config(recompute=memopt.RecomputeConfig(segments=None, bits=bits, codes_inside=inside),
                         fidelity=None)


def _recomputed(om):
    gm = om.graph_module
    return [(n, getattr(gm, n.args[0].target)) for n in gm.graph.nodes
            if (n.meta.get(DECISION_KEY) or {}).get("technique") == "recompute"]


def _memopt_ops(sub):
    return [n.name for n in sub.graph.nodes if n.op == "call_function"
            and getattr(n.target, "__module__", "").startswith("memopt.")]


# tiny_resnet: BN -> ReLU chains inside every block (the stash's BN op updates the running statistics);
# vit: LayerNorm, attention, GELU MLP inside every block (the generic stash's codes, few-bit GELU)
@pytest.mark.parametrize("name,least", [("tiny_resnet", 0.95), ("vit", 0.995)])
def test_forward_and_buffers_bit_identical_gradients_close_and_ops_coded_inside(name, least):
    model, x = build(name)
    reference = copy.deepcopy(model)
    om = memopt.optimize(model, example_inputs=x, config=_config(True), optimizer="sgd")
    blocks = _recomputed(om)
    assert blocks
    for node, sub in blocks:
        inside = node.meta[DECISION_KEY]["inside"]
        assert inside and set(inside) <= {n.name for n in sub.graph.nodes}, node.name
        assert _memopt_ops(sub), node.name  # the block's graph itself holds the rewritten ops
        assert f"inside it {len(inside)} ops keep codes" in node.meta[DECISION_KEY]["reason"]
    for _ in range(2):  # the second step starts from the statistics the first left
        out, ref = _step(om, x), _step(reference, x)
        assert torch.equal(out, ref)
        for (bname, b), c in zip(model.named_buffers(), reference.buffers()):
            assert torch.equal(b, c), bname  # updated once per step, not again by backward's second forward
    for (pname, p), q in zip(model.named_parameters(), reference.parameters()):
        assert _cosine(p.grad, q.grad) > least, pname


@pytest.mark.parametrize("name", ["tiny_resnet", "vit"])
def test_estimate_equals_measurement_and_the_peak_falls(name):
    model, x = build(name)
    inside = memopt.optimize(model, example_inputs=x, config=_config(True), optimizer="sgd")
    measured = memopt.measure(inside, x, optimizer="sgd")
    assert measured.saved_bytes == inside.plan.estimated_saved_bytes
    assert measured.peak_bytes == inside.plan.estimated_peak_bytes
    plain = memopt.optimize(copy.deepcopy(model), example_inputs=x, config=_config(False), optimizer="sgd")
    assert not any(node.meta[DECISION_KEY]["inside"] for node, _ in _recomputed(plain))
    assert inside.plan.estimated_peak_bytes < plain.plan.estimated_peak_bytes
    assert inside.plan.estimated_saved_bytes == plain.plan.estimated_saved_bytes  # the boundary codes only


def test_exact_recomputation_never_codes_inside():
    model, x = build("vit")
    om = memopt.optimize(model, example_inputs=x, config=_config(True, bits=None), optimizer="sgd")
    blocks = _recomputed(om)
    assert blocks and not any(_memopt_ops(sub) for _, sub in blocks)
    assert not any(node.meta[DECISION_KEY].get("inside") for node, _ in blocks)


class _Block(nn.Module):
    def __init__(self):
        super().__init__()
        self.bn = nn.BatchNorm1d(32)
        self.fc = nn.Linear(32, 32)

    def forward(self, x):
        return x + self.fc(torch.relu(self.bn(x)))


def test_a_batch_norm_module_inside_a_block_recomputed_from_codes_updates_its_statistics_once():
    # the module form (nothing rewrites the block's inside here); the stash's functional BN op inside a block is
    # tiny_resnet's case above. Neither bumps the statistics' version counters: they are found by name
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 32), nn.Sequential(_Block(), _Block()), nn.Linear(32, 4))
    x = torch.randn(16, 8)
    reference = copy.deepcopy(model)
    config = memopt.Config(recompute=memopt.RecomputeConfig(segments=None, bits=8), fidelity=None, stash=None,
                           fewbit=None)
    om = memopt.optimize(model, example_inputs=x, config=config, optimizer="sgd")
    gm = om.graph_module
    blocks = [getattr(gm, n.args[0].target) for n in gm.graph.nodes
              if (n.meta.get(DECISION_KEY) or {}).get("technique") == "recompute"]
    assert blocks
    for _ in range(2):
        assert torch.equal(_step(om, x), _step(reference, x))
        for (bname, b), c in zip(model.named_buffers(), reference.buffers()):
            assert torch.equal(b, c), bname


def test_codes_inside_must_be_a_bool():
    with pytest.raises(ValueError, match=r"RecomputeConfig.codes_inside must be True or False, got 1"):
        memopt.RecomputeConfig(codes_inside=1)
