"""Replay the autocast state of a forward when backward recomputes part of it.

Backward usually runs outside the user's ``torch.autocast`` block, so an op recomputed there
would run in float32 while the forward ran it in bfloat16 / float16: a reversible segment would
subtract a different ``H(V)`` than it added, and a recomputed block would differentiate a
different function. Forward records the state; backward recomputes under the same one.

Without autocast's cache of casts: inside a user's ``torch.autocast`` region (a backward run inside it, as some
training loops do) a nested region does not empty the cache when it exits, and the cache keeps every cast of a
leaf that requires grad, with its source, until the outermost region exits. The inputs a backward rebuilds are
such leaves, so every recomputed block's rebuilt inputs and their casts would stay alive to the end of the
backward. A cast is a pure function of its source: the values are the same with or without the cache.
"""
from __future__ import annotations

import contextlib
from typing import Iterator, Tuple

import torch

_DEVICE_TYPES = ("cpu", "cuda")
AutocastState = Tuple[Tuple[str, bool, torch.dtype], ...]


def autocast_state() -> AutocastState:
    """(device type, enabled, dtype) for every device type autocast knows here."""
    return tuple((device, torch.is_autocast_enabled(device), torch.get_autocast_dtype(device))
                 for device in _DEVICE_TYPES)


@contextlib.contextmanager
def replayed_autocast(state: AutocastState) -> Iterator[None]:
    """Run the body under exactly ``state`` (enabled or disabled per device type), caching no cast."""
    with contextlib.ExitStack() as stack:
        for device, enabled, dtype in state:
            if device == "cuda" and not enabled and not torch.cuda.is_available():
                continue
            stack.enter_context(torch.autocast(device, dtype=dtype, enabled=enabled, cache_enabled=False))
        yield
