"""Random-generator states for replaying random ops (dropout) in backward or in a check: the CPU
generator's state, then that of each CUDA device the tensors live on (dropout on a GPU draws from the
device's generator). Shared by recomputed blocks (``memopt/recompute/ops.py``), reversible segments
(``memopt/reversible/ops.py``), coded ops (``memopt/stash/coded.py``) and their plan-time check
(``memopt/reversible/check.py``).

While a draw source is active (``drawing_from``: a recomputed block's range given its rows of the draws its first
forward kept, ``memopt/recompute/draws.py``), ops inside draw nothing from the generators, so a state is no use to
an op that replays its draws in its own backward: ``rng_state`` then returns a marker of the source and its position
instead, and ``replayed_rng`` of that marker has the source give the same draws again from that position."""
from __future__ import annotations

import contextlib
import threading
from typing import Dict, Iterator, List, Optional, Sequence

import torch
from torch.utils.weak import WeakIdKeyDictionary

_ACTIVE = threading.local()  # .source: the draw source the forward running on this thread draws from
_SOURCES: Dict[int, "object"] = {}  # key -> active draw source (a backward may run on another thread)
# marker (an empty tensor, saved in place of a state; its values are never read, fake ones have none) -> (source
# key, position)
_MARKERS = WeakIdKeyDictionary()


@contextlib.contextmanager
def drawing_from(source) -> Iterator[None]:
    """Make ``source`` (with ``position() -> int`` and ``from_position(int)``, a context manager) the draw source of
    this thread's ops while the body runs."""
    previous = getattr(_ACTIVE, "source", None)
    _ACTIVE.source = source
    _SOURCES[id(source)] = source
    try:
        yield
    finally:
        _ACTIVE.source = previous
        _SOURCES.pop(id(source), None)


def drawing() -> bool:
    """Whether a draw source (``drawing_from``) serves this thread's draws now."""
    return getattr(_ACTIVE, "source", None) is not None


def cuda_devices(tensors: Sequence[torch.Tensor]) -> List[int]:
    """Indices of the CUDA devices ``tensors`` live on, sorted."""
    return sorted({t.device.index or 0 for t in tensors if t.is_cuda})


def rng_state(tensors: Sequence[torch.Tensor]) -> List[torch.Tensor]:
    """The CPU generator's state, then each of ``cuda_devices(tensors)``'s; under a draw source, its marker."""
    source = getattr(_ACTIVE, "source", None)
    if source is not None:
        marker = torch.empty(0, dtype=torch.uint8)
        _MARKERS[marker] = (id(source), source.position())
        return [marker]
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
    if states and states[0] in _MARKERS:
        key, position = _MARKERS[states[0]]
        source = _SOURCES.get(key)
        if source is None:
            raise RuntimeError("memopt: an op replays the draws of a recomputed block's range after that range's "
                               "backward ended; build the block's RecomputeSpec with chunks=1")
        with source.from_position(position):
            yield
        return
    with torch.random.fork_rng(devices=cuda_devices(tensors), enabled=states is not None):
        if states is not None:
            set_rng_state(states, tensors)
        yield
