"""Random-generator states for replaying random ops (dropout) in backward or in a check: the CPU
generator's state, then that of each CUDA device the tensors live on (dropout on a GPU draws from the
device's generator). Shared by recomputed blocks (``memopt/recompute/ops.py``), reversible segments
(``memopt/reversible/ops.py``) and their plan-time check (``memopt/reversible/check.py``)."""
from __future__ import annotations

import contextlib
from typing import Iterator, List, Optional, Sequence

import torch


def cuda_devices(tensors: Sequence[torch.Tensor]) -> List[int]:
    """Indices of the CUDA devices ``tensors`` live on, sorted."""
    return sorted({t.device.index or 0 for t in tensors if t.is_cuda})


def rng_state(tensors: Sequence[torch.Tensor]) -> List[torch.Tensor]:
    """The CPU generator's state, then each of ``cuda_devices(tensors)``'s."""
    return [torch.get_rng_state()] + [torch.cuda.get_rng_state(d) for d in cuda_devices(tensors)]


def set_rng_state(states: List[torch.Tensor], tensors: Sequence[torch.Tensor]) -> None:
    """Inverse of ``rng_state`` for tensors on the same devices."""
    torch.set_rng_state(states[0])
    for device, state in zip(cuda_devices(tensors), states[1:]):
        torch.cuda.set_rng_state(state, device)


@contextlib.contextmanager
def replayed_rng(states: Optional[List[torch.Tensor]], tensors: Sequence[torch.Tensor]) -> Iterator[None]:
    """Run the body from the generator ``states`` (``rng_state(tensors)``), leaving the generators as they were;
    ``None``: nothing to replay, nothing touched."""
    with torch.random.fork_rng(devices=cuda_devices(tensors), enabled=states is not None):
        if states is not None:
            set_rng_state(states, tensors)
        yield
