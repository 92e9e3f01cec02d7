"""What the stash benchmarks share (and no other technique's): the naive quantized-activation baseline of
bench_stash_depth and bench_stash_training, and the trained models of bench_stash_trained and bench_stash_oracle."""
from __future__ import annotations

import copy

import torch
import torch.nn.functional as F
from torch import nn

from memopt.stash.ops import WINDOWS


# ---------------------------------------------------------------- naive quantized activations
class _NaiveQuantReLU(torch.autograd.Function):
    """relu(q(z)) where q is the K-bit per-channel grid over mean ± h·σ, with the stash's own
    half-width h for K (WINDOWS), so both methods quantize alike; straight-through backward."""

    @staticmethod
    def forward(ctx, z, bits):
        dims = [d for d in range(z.dim()) if d != 1]  # every dimension but the channels
        half = WINDOWS[bits]
        std, mean = torch.std_mean(z, dim=dims, keepdim=True, correction=0)
        width = 2 * half * std.clamp_min(1e-12) / (1 << bits)
        lo = mean - half * std
        code = torch.floor((z - lo) / width).clamp(0, (1 << bits) - 1)
        zq = lo + (code + 0.5) * width
        ctx.save_for_backward(zq > 0)
        return torch.relu(zq)

    @staticmethod
    def backward(ctx, grad):
        (mask,) = ctx.saved_tensors
        return grad * mask, None


class NaiveReLU(nn.Module):
    def __init__(self, bits: int) -> None:
        super().__init__()
        self.bits = bits

    def forward(self, z):
        return _NaiveQuantReLU.apply(z, self.bits)


def naive_copy(model: nn.Module, bits: int) -> nn.Module:
    naive = copy.deepcopy(model)
    for module in naive.modules():
        for name, child in module.named_children():
            if isinstance(child, nn.ReLU):
                setattr(module, name, NaiveReLU(bits))
    return naive


# ---------------------------------------------------------------- models after stock training steps
def upsampled_digits(size: int):
    from sklearn.datasets import load_digits

    data = load_digits()
    x = torch.tensor(data.images, dtype=torch.float32).unsqueeze(1) / 16.0
    x = F.interpolate(x, size=(size, size), mode="bilinear", align_corners=False).repeat(1, 3, 1, 1)
    return (x - x.mean()) / x.std(), torch.tensor(data.target)


def train_sgd(model, x, y, steps: int, batch: int, generator) -> float:
    opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    loss = torch.tensor(float("nan"))
    for _ in range(steps):
        idx = torch.randint(0, len(x), (batch,), generator=generator)
        loss = F.cross_entropy(model(x[idx]), y[idx])
        opt.zero_grad()
        loss.backward()
        opt.step()
    return loss.item()


def trained_case(name: str, steps: int, data_x, data_y, batch: int):
    """(model, last training loss, x, y): torchvision ``name`` at random init (seed 0) after ``steps`` stock SGD
    steps on the data, and a fresh batch drawn after them."""
    import torchvision

    torch.manual_seed(0)
    generator = torch.Generator().manual_seed(0)
    model = getattr(torchvision.models, name)(weights=None).train()
    loss = train_sgd(model, data_x, data_y, steps, batch, generator)
    idx = torch.randint(0, len(data_x), (batch,), generator=generator)
    return model, loss, data_x[idx], data_y[idx]
