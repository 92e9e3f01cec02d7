"""Which ATen ops allocate a tensor of a given size: the tests' check that a backward writes no full-size
temporary beyond the ones it must."""
from __future__ import annotations


import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten


class Allocations(TorchDispatchMode):
    """Records (op name, dtype) of every new tensor of ``numel`` elements made inside the block; views and in-place
    ops (an expanded ones, autograd's detach, Triton's interpreter's ``set_``) share a given storage and are not
    counted."""

    def __init__(self, numel: int) -> None:
        super().__init__()
        self.numel, self.made = numel, []  # type: int, List[Tuple[str, torch.dtype]]

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        given = {t.untyped_storage().data_ptr() for t in tree_flatten((args, kwargs))[0] if isinstance(t, torch.Tensor)}
        for t in tree_flatten(out)[0]:
            if isinstance(t, torch.Tensor) and t.numel() == self.numel and t.untyped_storage().data_ptr() not in given:
                self.made.append((func.__name__, t.dtype))
        return out
