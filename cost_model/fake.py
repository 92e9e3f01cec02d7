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


def _fake_like(t: torch.Tensor, mode: FakeTensorMode, device: torch.device) -> torch.Tensor:
    with mode:
        out = torch.empty_strided(tuple(t.shape), tuple(t.stride()), dtype=t.dtype, device=device)
    return out


def fake_copy(gm: fx.GraphModule, args: tuple, kwargs: dict, mode: FakeTensorMode,
              device: torch.device) -> Tuple[fx.GraphModule, tuple, dict]:
    """Deep copy of ``gm`` with every parameter and buffer fake on ``device``, and fake inputs."""
    memo: Dict[int, Any] = {}
    for p in gm.parameters():
        memo[id(p)] = nn.Parameter(_fake_like(p, mode, device), requires_grad=p.requires_grad)
    for b in gm.buffers():
        memo[id(b)] = _fake_like(b, mode, device)
    for name, value in gm.__dict__.items():  # plain tensor attributes (export's lifted constants)
        if isinstance(value, torch.Tensor) and id(value) not in memo:
            memo[id(value)] = _fake_like(value, mode, device)
    fake_gm = copy.deepcopy(gm, memo)

    def to_fake(x):
        if isinstance(x, torch.Tensor):
            fake = _fake_like(x, mode, device)
            return fake.requires_grad_(x.requires_grad) if fake.is_floating_point() else fake
        return x

    return fake_gm, tree_map(to_fake, args), tree_map(to_fake, kwargs)
