"""The default rewrite leaves a training forward bit-identical on small timm / torchvision models (issue 39).

Each model, randomly initialised, runs one training forward eagerly and through ``memopt.optimize`` (default
``Config()``) at batch 4 / 64x64 and batch 2 / 32x32: outputs and every buffer (BatchNorm running statistics and
counters) must be ``torch.equal``. The two sizes matter: at 32x32 the late stages' BatchNorms are small enough to
stay exact (``StashConfig.min_per_channel``), at 64x64 they are rewritten, and iFormer's forward differed there
only (a chain's residual sum laid out channels-last where eager's is contiguous: ``memopt.stash.residual.residual_sum``).
"""
import copy

import pytest
import torch

import memopt

# (library, name): a handful of small, BatchNorm-heavy models with residual adds in mixed layouts
MODELS = [("timm", "iformer_t"), ("timm", "resnet18"), ("torchvision", "resnet18"),
          ("timm", "mobilenetv3_small_050"), ("timm", "efficientnet_lite0"), ("timm", "convnext_atto"),
          ("timm", "repvit_m0_9")]
SIZES = [(4, 64), (2, 32)]


def _model(library: str, name: str) -> torch.nn.Module:
    if library == "timm":
        timm = pytest.importorskip("timm")
        if not timm.is_model(name):
            pytest.skip(f"timm {timm.__version__} has no model {name!r}")
        return timm.create_model(name, pretrained=False)
    models = pytest.importorskip("torchvision.models")
    if not hasattr(models, name):
        pytest.skip(f"torchvision has no model {name!r}")
    return getattr(models, name)(weights=None)


@pytest.mark.slow
@pytest.mark.parametrize("batch,size", SIZES, ids=[f"b{b}_{s}x{s}" for b, s in SIZES])
@pytest.mark.parametrize("library,name", MODELS, ids=[f"{lib}-{name}" for lib, name in MODELS])
def test_default_forward_is_bit_identical(one_thread, library, name, batch, size):
    torch.manual_seed(0)
    model = _model(library, name).train()
    reference = copy.deepcopy(model)
    x = torch.randn(batch, 3, size, size)
    om = memopt.optimize(model, example_inputs=x)
    torch.manual_seed(1)
    out = om(x)
    torch.manual_seed(1)
    expected = reference(x)
    assert out.shape == expected.shape
    assert torch.equal(out, expected), f"output differs by up to {(out - expected).abs().max().item():.3g}"
    differing = [n for (n, a), (_, b) in zip(model.named_buffers(), reference.named_buffers()) if not torch.equal(a, b)]
    assert not differing, f"{len(differing)} buffers differ, the first {differing[:4]}"
