"""Fake copies of a captured graph and its inputs: shapes, dtypes and saves with no memory.

The user's module is never touched: parameters and buffers are replaced by fake tensors through
the ``deepcopy`` memo, so the copy allocates no real storage even for a 7B-parameter model.
"""
from __future__ import annotations

import copy
from typing import Any, Dict, Tuple

import torch
from torch import fx, nn
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.utils._pytree import tree_map
from torch.utils._python_dispatch import TorchDispatchMode


def _fake_like(t: torch.Tensor, mode: FakeTensorMode, device: torch.device) -> torch.Tensor:
    with mode:
        out = torch.empty_strided(tuple(t.shape), tuple(t.stride()), dtype=t.dtype, device=device)
    return out


def fake_copy(gm: fx.GraphModule, args: tuple, kwargs: dict, mode: FakeTensorMode,
              device: torch.device) -> Tuple[fx.GraphModule, tuple, dict]:
    """Deep copy of ``gm`` with every parameter and buffer fake on ``device`` (0-dim integer buffers: real
    copies), and fake inputs."""
    memo: Dict[int, Any] = {}
    for p in gm.parameters():
        memo[id(p)] = nn.Parameter(_fake_like(p, mode, device), requires_grad=p.requires_grad)
    for b in gm.buffers():
        # a 0-dim integer buffer stays real (a copy): BatchNorm(momentum=None) reads its batch counter as a Python
        # float, which a fake tensor cannot give
        memo[id(b)] = b.detach().clone() if b.dim() == 0 and not b.is_floating_point() else _fake_like(b, mode, device)
    # plain tensor attributes: export's lifted constants on the graph module, and on the model's own modules the
    # tensors hooks compute (the old torch.nn.utils.weight_norm / spectral_norm set ``weight`` as a non-leaf,
    # which deepcopy refuses)
    for module in gm.modules():
        for value in module.__dict__.values():
            if isinstance(value, torch.Tensor) and id(value) not in memo:
                memo[id(value)] = _fake_like(value, mode, device)
    fake_gm = copy.deepcopy(gm, memo)

    def to_fake(x):
        if isinstance(x, torch.Tensor):
            fake = _fake_like(x, mode, device)
            return fake.requires_grad_(x.requires_grad) if fake.is_floating_point() else fake
        return x

    return fake_gm, tree_map(to_fake, args), tree_map(to_fake, kwargs)


class RealDtypes(TorchDispatchMode):
    """Dtypes where PyTorch's fake (meta) kernels disagree with its real kernels, fixed on the fly.

    ``native_batch_norm`` on a bfloat16/float16 input with float32 weight or running statistics (what
    ``torch.autocast`` gives a BatchNorm) returns float32 ``save_mean``/``save_invstd`` from the real CPU
    and CUDA kernels (they accumulate in float32), but in the input's dtype from the meta kernel, so
    autograd would keep half the bytes it really keeps (measured: 2,240 bytes on TinyResNet, batch 4).
    Entered inside a ``FakeTensorMode``; the new tensors are fake too.
    """

    _BATCH_NORMS = ("native_batch_norm", "_native_batch_norm_legit", "_native_batch_norm_legit_functional")

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        if func.overloadpacket.__name__ in self._BATCH_NORMS and isinstance(out, tuple) and len(out) >= 3:
            x, stats = args[0], [a for a in args[1:5] if isinstance(a, torch.Tensor)]
            if x.dtype in (torch.bfloat16, torch.float16) and any(s.dtype == torch.float32 for s in stats) \
                    and out[1].dtype != torch.float32:
                out = (out[0], out[1].to(torch.float32), out[2].to(torch.float32), *out[3:])
        return out
