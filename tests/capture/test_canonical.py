"""Fused norm-act modules (timm's BatchNormAct2d and the like) are captured as stock BatchNorm calls, so the
stash's chains match them; the capture stays bit-identical to eager (memopt/capture/fused_norms.py)."""
import copy

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import memopt
from memopt.capture.fused_norms import proxy_name
from memopt.capture.trace import capture


class BatchNormAct(nn.BatchNorm2d):
    """timm's BatchNormAct2d in miniature: stock BatchNorm2d's forward pasted, then drop and act."""

    def __init__(self, channels, eps_in_call=None):
        super().__init__(channels)
        self.drop, self.act = nn.Identity(), nn.ReLU()
        self.eps_in_call = eps_in_call

    def forward(self, x):
        if self.training:
            self.num_batches_tracked.add_(1)
        x = F.batch_norm(x, self.running_mean, self.running_var, self.weight, self.bias, self.training,
                         self.momentum, self.eps if self.eps_in_call is None else self.eps_in_call)
        return self.act(self.drop(x))


class Net(nn.Module):
    def __init__(self, eps_in_call=None):
        super().__init__()
        self.conv1, self.bn1 = nn.Conv2d(3, 8, 3, padding=1, bias=False), BatchNormAct(8, eps_in_call)
        self.conv2, self.bn2 = nn.Conv2d(8, 8, 3, padding=1, bias=False), BatchNormAct(8, eps_in_call)
        self.head = nn.Linear(8, 4)

    def forward(self, x):
        h = self.bn2(self.conv2(self.bn1(self.conv1(x))))
        return self.head(h.mean((2, 3)))


def _targets(gm):
    return [n.target for n in gm.graph.nodes if n.op in ("call_module", "call_function")]


def test_fused_batch_norms_are_captured_as_stock_ones_sharing_the_models_tensors():
    model = Net().train()
    gm = capture(model, (torch.randn(2, 3, 8, 8),), {}).graph_module
    targets = _targets(gm)
    assert F.batch_norm not in targets and "bn1.drop" not in targets
    assert proxy_name("bn1") in targets and proxy_name("bn2") in targets
    twin = gm.get_submodule(proxy_name("bn1"))
    assert type(twin) is nn.BatchNorm2d and twin.weight is model.bn1.weight
    assert twin.running_mean is model.bn1.running_mean and twin.num_batches_tracked is model.bn1.num_batches_tracked
    assert not any(n.op == "call_method" and n.target == "add_" for n in gm.graph.nodes)


def test_the_default_plan_stashes_them_and_matches_eager_bit_for_bit_under_the_exact_config():
    torch.manual_seed(0)
    model, x = Net(), torch.randn(4, 3, 16, 16)
    reference = copy.deepcopy(model)
    om = memopt.optimize(model, example_inputs=x)
    assert om.plan.soundness["checked"]
    assert {u["chosen"]["technique"] for u in om.plan.units} >= {"stash"}
    assert om.plan.estimated_saved_bytes < om.plan.baseline_saved_bytes / 2
    exact = memopt.optimize(copy.deepcopy(reference), example_inputs=x, config=memopt.Config.exact())
    twin = copy.deepcopy(reference)
    for fn in (exact, twin):
        fn(x).square().sum().backward()
    exact_model = exact.original_module if hasattr(exact, "original_module") else exact
    for (name, a), b in zip(exact_model.named_parameters(), twin.parameters()):
        assert torch.equal(a.grad, b.grad), name
    for (name, a), b in zip(exact_model.named_buffers(), twin.buffers()):
        assert torch.equal(a, b), name
    assert int(exact_model.bn1.num_batches_tracked) == 1  # counted once, as in eager


def test_a_call_that_differs_from_the_modules_settings_is_left_as_it_is():
    model = Net(eps_in_call=1e-3).train()  # F.batch_norm with another eps than the module's
    gm = capture(model, (torch.randn(2, 3, 8, 8),), {}).graph_module
    assert F.batch_norm in _targets(gm) and proxy_name("bn1") not in _targets(gm)


@pytest.mark.slow
def test_timm_batch_norm_act_models_get_the_stash():
    timm = pytest.importorskip("timm")
    torch.manual_seed(0)
    model = timm.create_model("regnetx_002", pretrained=False, num_classes=10).train()
    om = memopt.optimize(model, example_inputs=torch.randn(2, 3, 64, 64), config=memopt.Config(fidelity=None))
    assert om.plan.soundness["checked"]
    assert sum(u["chosen"]["technique"] == "stash" for u in om.plan.units) >= 5
    assert om.plan.baseline_saved_bytes > 2 * om.plan.estimated_saved_bytes
