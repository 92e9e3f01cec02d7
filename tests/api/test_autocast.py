"""bfloat16 autocast on CPU: rewritten ops take the dtypes autocast gives them, the forward stays
bit-identical and training works."""
import copy

import pytest
import torch
import torch.nn.functional as F

import memopt
from memopt.testing.zoo import build


@pytest.mark.parametrize("name", ["tiny_resnet", "vit", "mlp"])
def test_bf16_autocast_forward_is_identical_and_gradients_agree(name):
    model, x = build(name)
    reference = copy.deepcopy(model)
    om = memopt.optimize(model, example_inputs=x)
    assert any(u["chosen"]["technique"] != "exact" for u in om.plan.units)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        torch.manual_seed(0)
        out = om(x)
        torch.manual_seed(0)
        ref = reference(x)
    assert out.dtype == ref.dtype == torch.bfloat16 and torch.equal(out, ref)
    out.float().logsumexp(-1).mean().backward()
    ref.float().logsumexp(-1).mean().backward()
    for (pname, p), q in zip(model.named_parameters(), reference.parameters()):
        assert p.grad.dtype == q.grad.dtype and torch.isfinite(p.grad).all(), pname
        if q.grad.norm() > 0:
            # measured worst per-parameter cosine: 0.980 (tiny_resnet, 4-bit stash), 0.999 (vit), 0.992 (mlp)
            assert F.cosine_similarity(p.grad.flatten().double(), q.grad.flatten().double(), dim=0) > 0.95, pname


@pytest.mark.parametrize("name", ["tiny_resnet", "vit", "mlp"])
def test_plans_are_keyed_by_autocast_and_estimates_equal_measurement(name, one_thread):
    model, x = build(name)
    om = memopt.optimize(model, example_inputs=x)  # planned without autocast
    fp32 = om.plan
    assert not any(line.startswith("autocast") for line in fp32.input_signature)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        om(x)  # a training forward under autocast: captured and planned again
        plan = om.plan
        real = memopt.measure(om, x)
        stock = memopt.measure(model, x)
        est = memopt.estimate(model, x)
    assert plan is not fp32 and plan.input_signature[-1] == "autocast cpu: bfloat16"
    # bytes counted at autocast's dtypes: fewer for the CNN, more for the ViT (its bfloat16 weight
    # copies and float32 casts for LayerNorm/softmax are saved as well), as measured
    assert plan.estimated_saved_bytes != fp32.estimated_saved_bytes
    # tolerance 0: the cost model runs under the caller's autocast state, with the float32 statistics
    # real BatchNorm kernels keep for bfloat16 inputs (cost_model/fake.py RealDtypes), and measure
    # empties autocast's cast cache before its step
    assert (real.saved_bytes, real.peak_bytes) == (plan.estimated_saved_bytes, plan.estimated_peak_bytes)
    assert (stock.saved_bytes, stock.peak_bytes) == (est.saved_bytes, est.peak_bytes)
    assert (stock.saved_bytes, stock.peak_bytes) == (plan.baseline_saved_bytes, plan.baseline_peak_bytes)
    om(x)  # outside autocast the float32 plan is used again
    assert om.plan is fp32
