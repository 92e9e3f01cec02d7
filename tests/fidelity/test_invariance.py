"""Parameters whose exact gradient is zero by construction through a softmax over the keys (memopt/fidelity/invariant_params.py):
an attention key's bias adds q·b to every key's score of a query, the same number, which the softmax takes out
(timm EfficientFormerV2's ``attn.k.bn.bias`` failed the fidelity gate on a gradient that is rounding noise).
Every listed parameter's float64 gradient must be ~0, and every parameter left out must have a real one."""
import math

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.fx.passes.shape_prop import ShapeProp

from memopt.capture.trace import capture
from memopt.fidelity.invariant_params import invariant_parameters


class LinearAttention(nn.Module):
    """BERT's eager attention (view, transpose, q @ k^T, scale, additive mask, softmax over the keys), or SDPA.
    ``softmax_dim``: -2 softmaxes over the queries instead (the key bias is then not cancelled). ``leak``: k is
    also added to the output (a path that escapes)."""

    def __init__(self, sdpa=False, softmax_dim=-1, leak=False, heads=2, d=8):
        super().__init__()
        self.q, self.k, self.v, self.o = (nn.Linear(heads * d, heads * d) for _ in range(4))
        self.heads, self.d, self.sdpa, self.softmax_dim, self.leak = heads, d, sdpa, softmax_dim, leak

    def forward(self, x):
        b, n, _ = x.shape
        split = lambda t: t.view(b, n, self.heads, self.d).transpose(1, 2)  # noqa: E731
        q, k, v = split(self.q(x)), split(self.k(x)), split(self.v(x))
        if self.sdpa:
            y = F.scaled_dot_product_attention(q, k, v)
        else:
            scores = torch.matmul(q, k.transpose(-1, -2)) / math.sqrt(self.d)
            y = torch.matmul((scores + torch.zeros(n)).softmax(dim=self.softmax_dim), v)
        y = y.transpose(1, 2).reshape(b, n, self.heads * self.d)
        return self.o(y + k.transpose(1, 2).reshape(b, n, -1) if self.leak else y)


class ConvAttention(nn.Module):
    """EfficientFormerV2's attention: q, k, v from conv + BatchNorm, keys reshaped from channels x positions,
    learned position biases, a 1x1 "talking heads" conv over the heads before the softmax."""

    def __init__(self, heads=2, d=4, hw=4):
        super().__init__()
        conv_bn = lambda: nn.Sequential(nn.Conv2d(8, heads * d, 1), nn.BatchNorm2d(heads * d))  # noqa: E731
        self.q, self.k, self.v = conv_bn(), conv_bn(), conv_bn()
        self.talk = nn.Conv2d(heads, heads, 1)
        self.pos = nn.Parameter(torch.randn(heads, hw * hw, hw * hw))
        self.heads, self.d, self.n = heads, d, hw * hw

    def forward(self, x):
        b = x.shape[0]
        q = self.q(x).reshape(b, self.heads, -1, self.n).permute(0, 1, 3, 2)
        k = self.k(x).reshape(b, self.heads, -1, self.n).permute(0, 1, 2, 3)
        v = self.v(x).reshape(b, self.heads, -1, self.n).permute(0, 1, 3, 2)
        attn = self.talk((q @ k) * self.d ** -0.5 + self.pos).softmax(dim=-1)
        return (attn @ v).transpose(2, 3).reshape(b, -1, 4, 4)


def _listed(model, x):
    gm = capture(model, (x,), {}).graph_module
    ShapeProp(gm).propagate(x)
    return invariant_parameters(gm)


def _float64_grads(model, x):
    model = model.double()
    model.zero_grad()
    out = model(x.double())
    (out * torch.randn(out.shape, dtype=torch.float64, generator=torch.Generator().manual_seed(0))).sum().backward()
    norms = {name: float(p.grad.norm()) for name, p in model.named_parameters()}
    median = sorted(norms.values())[len(norms) // 2]
    return {name: norm / median for name, norm in norms.items()}  # beside the median gradient


@pytest.mark.parametrize("sdpa", [False, True])
def test_a_linear_key_bias_is_listed_and_its_float64_gradient_is_zero(sdpa):
    torch.manual_seed(0)
    model, x = LinearAttention(sdpa=sdpa).train(), torch.randn(2, 5, 16)
    listed = _listed(model, x)
    assert set(listed) == {"k.bias"}, listed
    assert "softmax over the keys" in listed["k.bias"]
    grads = _float64_grads(model, x)
    assert grads["k.bias"] < 1e-12
    assert min(g for name, g in grads.items() if name != "k.bias") > 1e-6


@pytest.mark.parametrize("kwargs", [{"softmax_dim": -2}, {"leak": True}])
def test_a_key_bias_a_softmax_does_not_cancel_is_not_listed(kwargs):
    torch.manual_seed(0)
    model, x = LinearAttention(**kwargs).train(), torch.randn(2, 5, 16)
    assert _listed(model, x) == {}
    assert _float64_grads(model, x)["k.bias"] > 1e-6


def test_conv_batchnorm_keys_through_talking_heads_are_listed():
    torch.manual_seed(0)
    model, x = ConvAttention().train(), torch.randn(2, 8, 4, 4)
    listed = _listed(model, x)
    # the key BN's bias, the key conv's bias (cancelled by that BN already), the talking-heads conv's bias (it
    # adds one number per head to every score)
    assert {"k.1.bias", "talk.bias"} <= set(listed), listed
    assert not {"q.1.bias", "v.1.bias", "pos"} & set(listed)
    grads = _float64_grads(model, x)
    assert all(grads[name] < 1e-12 for name in listed)
    assert min(g for name, g in grads.items() if name not in listed and name.endswith("bias")) > 1e-6


def test_without_shapes_nothing_is_listed_through_a_reshape():
    torch.manual_seed(0)
    model, x = LinearAttention().train(), torch.randn(2, 5, 16)
    assert invariant_parameters(capture(model, (x,), {}).graph_module) == {}


class Cancel(nn.Module):
    """``w * (a(x) - b(x))`` with a and b within 0.1% of each other on inputs near 1000: in bfloat16 the difference
    is rounding, so w's gradient under autocast is unrelated to its float32 one; a's and b's are not."""

    def __init__(self):
        super().__init__()
        self.a, self.b = nn.Linear(8, 8), nn.Linear(8, 8)
        with torch.no_grad():
            self.b.weight.copy_(self.a.weight * 1.001)
            self.b.bias.copy_(self.a.bias)
        self.w = nn.Parameter(torch.ones(8))

    def forward(self, x):
        return self.w * (self.a(x) - self.b(x))


def test_under_autocast_a_gradient_that_is_bf16_rounding_is_listed_apart():
    from memopt.fidelity.gate import RandomProjection, autocast_noise
    from memopt.capture.soundness import training_step

    torch.manual_seed(0)
    model, x = Cancel().train(), 1000 + torch.randn(4, 8)
    rng = torch.Generator().manual_seed(0).get_state()
    names = [n for n, _ in model.named_parameters()]
    with torch.autocast("cpu", dtype=torch.bfloat16):
        exact = training_step(model, model, (x,), {}, rng, RandomProjection(0)).grads
        noisy = autocast_noise(model, (x,), {}, rng, RandomProjection(0), names, exact, 1e-3, 0.99)
    assert set(noisy) == {"w"} and "under autocast" in noisy["w"], noisy
    assert autocast_noise(model, (x,), {}, rng, RandomProjection(0), names, exact, 1e-3, 0.99) is None  # off


def test_under_autocast_a_gradient_that_is_zero_in_float32_is_listed_apart():
    """BN -> ReLU -> depthwise conv -> training BN with the first BN's bias at 0 (init): ReLU passes the first
    BN's scale through, the second BN cancels it, so its float32 gradient is ~0; under bf16 rounding lifts it above
    the "tiny" rule, and the gate chased it (timm MobileNetV3 under autocast)."""
    from memopt.fidelity.gate import RandomProjection, autocast_noise
    from memopt.capture.soundness import training_step

    torch.manual_seed(0)
    model = nn.Sequential(nn.Conv2d(3, 8, 1), nn.BatchNorm2d(8), nn.ReLU(), nn.Conv2d(8, 8, 3, groups=8),
                          nn.BatchNorm2d(8), nn.ReLU(), nn.Conv2d(8, 4, 1)).train()
    x = torch.randn(2, 3, 12, 12)
    rng = torch.Generator().manual_seed(0).get_state()
    names = [n for n, _ in model.named_parameters()]
    with torch.autocast("cpu", dtype=torch.bfloat16):
        exact = training_step(model, model, (x,), {}, rng, RandomProjection(0)).grads
        noisy = autocast_noise(model, (x,), {}, rng, RandomProjection(0), names, exact, 1e-3, 0.99)
    assert "1.weight" in noisy and "float32 gradient is below" in noisy["1.weight"], noisy
    assert "4.weight" not in noisy and "6.weight" not in noisy


def test_under_autocast_a_model_that_cannot_run_in_float32_lists_nothing_apart():
    """A submodule captured on its own receives bf16 activations (HF Wav2Vec2's feature projection): with autocast
    off its step fails, and the gate must go on without the rule instead of failing optimize()."""
    from memopt.fidelity.gate import RandomProjection, autocast_noise
    from memopt.capture.soundness import training_step

    model, x = nn.Linear(8, 4), torch.randn(3, 8, dtype=torch.bfloat16)
    rng = torch.Generator().manual_seed(0).get_state()
    with torch.autocast("cpu", dtype=torch.bfloat16):
        exact = training_step(model, model, (x,), {}, rng, RandomProjection(0)).grads
        assert autocast_noise(model, (x,), {}, rng, RandomProjection(0), ["weight", "bias"], exact, 1e-3, 0.99) == {}
