"""memopt.measure: ground truth that leaves the model as it was."""
import pytest
import torch

import memopt
from conftest import requires_cuda
from memopt.cost_model.storage import LiveStorageTracker
from memopt.testing.zoo import build


def test_measure_restores_parameters_buffers_grads_and_rng():
    model, inputs = build("cnn")
    state = {k: v.clone() for k, v in model.state_dict().items()}
    model.eval()
    rng = torch.get_rng_state()
    m = memopt.measure(model, inputs, optimizer="adam")
    assert m.saved_bytes > 0 and m.peak_bytes > m.saved_bytes
    assert all(torch.equal(v, state[k]) for k, v in model.state_dict().items())
    assert all(p.grad is None for p in model.parameters())
    assert torch.equal(torch.get_rng_state(), rng)
    assert not model.training


def test_tracker_counts_new_storages_once_and_frees_them():
    x = torch.randn(256)
    with LiveStorageTracker(preexisting=[x]) as tracker:
        a = x * 2  # 1 KiB
        b = a.view(16, 16)  # a view: same storage, not counted again
        x.add_(1)  # in place on a pre-existing tensor: not counted
        del a, b
        c = x + 1  # a freed, c allocated: current stays 1 KiB
    assert tracker.peak == 1024
    assert tracker.current == 1024
    del c


def test_loss_fn_is_used_and_checked():
    model, inputs = build("multi_io")
    m = memopt.measure(model, inputs, loss_fn=lambda out: out["logits"].square().mean())
    assert m.saved_bytes > 0
    with pytest.raises(ValueError, match="loss_fn must return a scalar tensor"):
        memopt.measure(model, inputs, loss_fn=lambda out: out["logits"])


@requires_cuda
def test_cuda_measure_uses_the_caching_allocator():
    model, inputs = build("tiny_resnet")
    model, inputs = model.cuda(), inputs.cuda()
    m = memopt.measure(model, inputs)
    assert m.method == "torch.cuda.max_memory_allocated"
    est = memopt.estimate(model, inputs)
    assert abs(est.saved_bytes - m.saved_bytes) <= 0.01 * m.saved_bytes


def test_measure_as_the_first_call_of_an_optimized_module_plans_outside_its_hooks():
    model, inputs = build("tiny_resnet")
    om = memopt.optimize(model)  # nothing captured yet: measure's forward is the first
    m = memopt.measure(om, inputs)
    assert m.saved_bytes == om.plan.estimated_saved_bytes < om.plan.baseline_saved_bytes
