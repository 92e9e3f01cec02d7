"""timm models across families, pretrained=False: optimize, identical forward, a training step."""
import copy

import pytest
import torch

import memopt

timm = pytest.importorskip("timm")

MODELS = {  # small inputs keep the suite fast; the families are what matters
    "resnet26d": ({}, (2, 3, 32, 32)),  # ResNet-D
    "efficientnet_b0": ({}, (2, 3, 32, 32)),
    "convnext_atto": ({}, (2, 3, 32, 32)),
    "deit_tiny_patch16_224": ({"img_size": 32}, (2, 3, 32, 32)),  # ViT / DeiT
    "mixer_s32_224": ({"img_size": 64}, (2, 3, 64, 64)),  # MLP-Mixer
}


@pytest.mark.slow
@pytest.mark.parametrize("name", sorted(MODELS))
def test_optimize_and_train(name):
    kwargs, shape = MODELS[name]
    torch.manual_seed(0)
    model = timm.create_model(name, pretrained=False, num_classes=10, **kwargs).train()
    x = torch.randn(*shape)
    reference = copy.deepcopy(model)
    om = memopt.optimize(model, example_inputs=x, optimizer="sgd")
    assert om.plan.estimated_saved_bytes < om.plan.baseline_saved_bytes
    torch.manual_seed(1)
    out = om(x)
    torch.manual_seed(1)
    assert torch.equal(out, reference(x))
    out.logsumexp(1).mean().backward()
    assert all(p.grad is None or torch.isfinite(p.grad).all() for p in model.parameters())
    assert memopt.measure(om, x, optimizer="sgd").saved_bytes == om.plan.estimated_saved_bytes
