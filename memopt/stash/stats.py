"""Per-channel statistics of the stash's chains and the CPU elementwise helpers they and ``grid.py`` share:
training BatchNorm as the module runs it, z's std and mean, x̂'s std, batch slices that keep float temporaries
slice-sized, and exact selections that stay vectorised on the CPU."""
from __future__ import annotations

from typing import Optional, Tuple

import torch
from torch._subclasses.fake_tensor import is_fake


def batch_norm_train(x, weight, bias, running_mean, running_var, num_batches_tracked, momentum, eps):
    """Training-mode BatchNorm as ``nn.BatchNorm*d`` runs it (same kernel; running statistics updated once):
    (output, batch mean, inverse std, reserve, backend index), the last two for its stock backward."""
    if num_batches_tracked is not None:
        num_batches_tracked.add_(1)
    factor = momentum if momentum is not None else 1.0 / float(num_batches_tracked)
    return torch.ops.aten._batch_norm_impl_index(x, weight, bias, running_mean, running_var, True, factor, eps,
                                                 torch.backends.cudnn.enabled)


def _per_channel(t: torch.Tensor, ndim: int) -> torch.Tensor:
    return t.view(1, -1, *([1] * (ndim - 2)))


# torch.where and masked_fill with a bool mask are not vectorised on CPU: on a ResNet-50 layer1 tensor they
# are several to tens of times slower than the uint8 arithmetic, threshold_backward on the mask and lerp by the
# 0/1 mask used below (python -m tools.bench.stash.bench_cpu_selects -> docs/results/stash/stash_cpu_ops.md).
# All replacements are exact
# selections; a lerp by 0 or 1 returns one end exactly (ATen computes b + 0·(a - b) and a - (a - b)·0) when both
# ends are finite.


def cpu_selects(t: torch.Tensor) -> bool:
    """Whether to replace where / masked_fill: on CPU only. A GPU runs each as one fast kernel, and there
    the replacements' extra kernels and batch slices cost launches (an H200 ResNet-50 step was slower with
    them: docs/results/cuda/cuda.md, run 2)."""
    return t.device.type == "cpu"


def select_u8(mask: torch.Tensor, a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """``torch.where(mask, a, b)`` for uint8 codes; on CPU (a - b) * mask + b, wrapping mod 256 (exact),
    in place on ``a`` when it has the result's shape."""
    if not cpu_selects(a):
        return torch.where(mask, a, b)
    out = a.sub_(b) if a.shape == mask.shape else a - b
    return out.mul_(mask.view(torch.uint8)).add_(b)


def batch_slices(t: torch.Tensor):
    """Slices of the first dimension of about 2^20 elements each (2^24 on a GPU, where each slice costs kernel
    launches): a float temporary made one slice at a time never costs a full-size one."""
    step = max(1, (1 << (20 if cpu_selects(t) else 24)) // max(1, t[0].numel()))
    return [slice(i, i + step) for i in range(0, t.shape[0], step)]


def keep_where(t: torch.Tensor, mask: torch.Tensor, out: Optional[torch.Tensor] = None) -> torch.Tensor:
    """``torch.where(mask, t, 0)`` (into ``out``, which may be ``t``): ATen's threshold_backward on the mask as
    0/1 on CPU, so a NaN or inf in ``t`` where the mask is false gives 0, as a ReLU backward does."""
    if not cpu_selects(t):
        return torch.where(mask, t, 0) if out is None else out.masked_fill_(~mask, 0)
    out = torch.empty_like(t) if out is None else out
    for s in batch_slices(t):
        torch.ops.aten.threshold_backward.grad_input(t[s], mask[s].to(t.dtype), 0.5, grad_input=out[s])
    return out


def channel_std_mean(z: torch.Tensor) -> Tuple[torch.Tensor, torch.Tensor]:
    """Per-channel (dim 1) population std and mean in float32. On CPU the mean, then the squared deviations a
    batch slice at a time: faster than std_mean there (docs/results/stash/stash_cpu_ops.md) and without the full-size
    output the batch-norm kernel's statistics would cost at the forward peak. Elsewhere std_mean, one kernel."""
    dims = [d for d in range(z.dim()) if d != 1]
    if not cpu_selects(z):
        std, mu = torch.std_mean(z, dim=dims, correction=0)
        return std.float(), mu.float()
    count = max(1, z.numel() // z.shape[1])
    if z.dtype == torch.float32:
        mu = z.mean(dims, dtype=torch.float32)
    else:  # bf16 / fp16 (autocast): ATen's mean with dtype=float32 first copies the whole tensor to float32 (on a
        # bf16 ResNet-50 the forward's peak, a copy no tracker sees); the slices' float32 sums instead
        mu = sum(z[s].sum(dims, dtype=torch.float32) for s in batch_slices(z)) / count
    m = _per_channel(mu, z.dim())
    var = sum((z[s].float() - m).square_().sum(dims) for s in batch_slices(z)) / count
    return var.sqrt(), mu


def _xhat_std(invstd: torch.Tensor, eps: float) -> torch.Tensor:
    """Per-channel std of x̂ = (x - mean) * invstd from invstd alone: sqrt(var / (var + eps)) = sqrt(1 - eps·invstd²),
    1 up to eps, about 0 in a (nearly) constant channel (a dead ReLU before the BN): the code is of x̂ / std, so
    such a channel rebuilds as 0, not a bin midpoint (a false BN weight gradient). Below 8 ulps of 1 it is invstd's
    rounding: 0. NaN statistics give NaN, so NaN channels rebuild (and get gradients) NaN as in stock."""
    var = 1 - eps * invstd.float().square()
    return var.masked_fill(var <= 8 * torch.finfo(torch.float32).eps, 0.0).sqrt()  # NaN stays NaN


RATIO_FROM_DATA = 1e-2  # var / (var + eps) below which 1 - eps·invstd² is mostly cancellation (error ~2e-7)


def xhat_std(x: torch.Tensor, invstd: torch.Tensor, eps: float) -> torch.Tensor:
    """x̂'s std as the chain codes with it (saved for backward): ``_xhat_std``, but the data's std times invstd where
    var < 1% of eps, where 1 - eps·invstd² is rounding (HF MobileViT at init: every code clipped, BN weight gradient
    exactly 0). CPU reduces only when needed, GPU / fake always (no sync); same allocations, so estimate = measured."""
    xstd = _xhat_std(invstd, eps)
    low = (1 - eps * invstd.float().square()) < RATIO_FROM_DATA  # False for NaN: that std stays NaN
    if x.device.type != "cpu" or is_fake(x) or bool(low.any()):
        var = x.var([d for d in range(x.dim()) if d != 1], correction=0)
    else:
        var = torch.zeros(x.shape[1], dtype=x.dtype, device=x.device)  # what the reduction would allocate
    return torch.where(low, var.float().sqrt() * invstd.float(), xstd)
