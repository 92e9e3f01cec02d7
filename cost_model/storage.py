"""Storage identity and live-memory tracking, shared by the estimator and `memopt.measure`.

Autograd keeps *storages* alive, not tensor views: q, k and v that are views of one qkv buffer
cost one buffer, and a small view keeps its whole base alive. Everything here therefore keys on
the storage, never on the tensor.

Two traps shape this file:
- a storage's address is reused as soon as it is freed, so a key is only valid while we keep a
  reference to the storage. We keep *weak* references (``StorageWeakRef``): a weak reference
  keeps the StorageImpl object (and so its address, our key) reserved without keeping its data
  alive, so keys stay unique and lifetimes stay those of the real run;
- the peak must be measured over real lifetimes, so ``LiveStorageTracker`` asks after every op
  which storages have died.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Dict, Iterable, List, Optional

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.multiprocessing.reductions import StorageWeakRef
from torch.utils._pytree import tree_flatten

from memopt.core.storage import distinct_bytes, storage_key, storage_nbytes  # noqa: F401  (part of this module's API)
from memopt.core import phase


@dataclass
class SavedTensor:
    """One tensor that autograd packed for backward, in the order it was packed."""

    key: int
    nbytes: int
    shape: tuple
    dtype: torch.dtype
    ref: StorageWeakRef  # reserves the key (address) without keeping the data alive


class SavedTensorRecorder:
    """Context manager recording every tensor autograd saves (via ``saved_tensors_hooks``).

    The pack hook returns the tensor itself, so autograd keeps exactly what it would keep without
    the hook. Only the innermost pair of saved-tensor hooks is active in PyTorch, so a model that
    installs its own hooks (or uses checkpointing) hides its saves from this recorder.
    """

    def __init__(self) -> None:
        self.saved: List[SavedTensor] = []
        self._ctx = torch.autograd.graph.saved_tensors_hooks(self._pack, self._unpack)

    def _pack(self, tensor: torch.Tensor) -> torch.Tensor:
        ref = StorageWeakRef(tensor.untyped_storage())
        self.saved.append(SavedTensor(ref.cdata, storage_nbytes(tensor), tuple(tensor.shape), tensor.dtype, ref))
        return tensor

    @staticmethod
    def _unpack(tensor: torch.Tensor) -> torch.Tensor:
        return tensor

    def take(self) -> List[SavedTensor]:
        """Return the saves recorded since the last call and start a new batch."""
        out, self.saved = self.saved, []
        return out

    def __enter__(self) -> "SavedTensorRecorder":
        self._ctx.__enter__()
        return self

    def __exit__(self, *exc) -> None:
        self._ctx.__exit__(*exc)


def distinct_saved_bytes(saved: Iterable[SavedTensor], exclude_keys: Iterable[int] = ()) -> int:
    """Bytes of the distinct storages in ``saved``, leaving out ``exclude_keys`` (parameters, buffers)."""
    excluded = set(exclude_keys)
    seen: Dict[int, int] = {}
    for s in saved:
        if s.key not in excluded:
            seen[s.key] = s.nbytes
    return sum(seen.values())


class LiveStorageTracker(TorchDispatchMode):
    """Counts the bytes of every storage created by an op while the mode is active, over its life.

    After each op the tracker drops the storages that have died and records the sum of those
    still alive; ``peak`` is the largest such sum. Storages that existed before the mode was
    entered (parameters, inputs, optimizer state) must be passed as ``preexisting``: they are never
    counted, even when an in-place op or a view (``weight.t()``) returns them again. Callers add
    their bytes themselves. Works on real and on fake tensors alike, so the estimator and the
    measurement use one rule.

    Weak references are dropped as soon as a storage dies: a ``StorageWeakRef`` keeps the freed
    storage's memory reserved, so holding them all would grow the process by every byte the step
    ever allocated. A storage is identified by (address, creation number), which stays unique
    after its address is reused. ``at_peak`` lists (identity, bytes, phase) of the storages alive
    at the peak; ``phase`` is whatever the caller set in ``tracker.phase`` when each was created.
    ``peak_in_weight_grad``: whether the peak fell while a weight gradient read a rebuilt input
    (``memopt.core.phase``), where batch chunks can lower it.
    """

    def __init__(self, preexisting: Iterable[torch.Tensor] = ()) -> None:
        super().__init__()
        self._preexisting_refs = [StorageWeakRef(t.untyped_storage()) for t in preexisting]
        self._preexisting = {r.cdata for r in self._preexisting_refs}
        self._live: Dict[int, tuple] = {}  # key -> (weakref, nbytes, creation number, phase)
        self._created = 0
        self.phase = ""
        self.current = 0
        self.peak = 0
        self.at_peak: List[tuple] = []
        self.peak_in_weight_grad = False

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        self._sweep()  # first: a storage that died inside this op may have lent its address to an output
        for t in tree_flatten(_unmasked(func, args, kwargs, out))[0]:
            if isinstance(t, torch.Tensor):
                self._add(t)
        self._note_peak()
        return out

    def _add(self, t: torch.Tensor) -> None:
        try:
            storage = t.untyped_storage()
        except (RuntimeError, NotImplementedError):  # tensors without storage (e.g. sparse)
            return
        ref = StorageWeakRef(storage)
        if ref.cdata not in self._live and ref.cdata not in self._preexisting:
            nbytes = int(storage.nbytes())
            self._created += 1
            self._live[ref.cdata] = (ref, nbytes, self._created, self.phase)
            self.current += nbytes

    def _sweep(self) -> None:
        dead = [k for k, entry in self._live.items() if entry[0].expired()]
        for k in dead:
            self.current -= self._live.pop(k)[1]

    def _note_peak(self) -> None:
        if self.current > self.peak:
            self.peak = self.current
            self.at_peak = [((k, e[2]), e[1], e[3]) for k, e in self._live.items()]
            self.peak_in_weight_grad = phase.in_weight_grad_from_codes()

    def reset_peak(self) -> None:
        self._sweep()
        self.peak = self.current
        self.at_peak = [((k, e[2]), e[1], e[3]) for k, e in self._live.items()]
        self.peak_in_weight_grad = phase.in_weight_grad_from_codes()

    def identity(self, t: torch.Tensor):
        """(address, creation number) of a live tracked storage, or None."""
        self._sweep()
        entry = self._live.get(storage_key(t))
        return None if entry is None else (storage_key(t), entry[2])


_MASK_INDEX: Dict[Any, Optional[int]] = {}  # op -> position of its output_mask argument (None: none)


def _unmasked(func, args, kwargs, out):
    """``out`` without the outputs that the op's ``output_mask`` turns off. Real kernels return
    undefined tensors there, but some fake (meta) kernels allocate them anyway: the fake
    ``native_batch_norm_backward`` returns a full grad_input for a BN whose input needs no grad."""
    if not isinstance(out, tuple):
        return out
    if func not in _MASK_INDEX:
        names = [a.name for a in func._schema.arguments] if hasattr(func, "_schema") else []
        _MASK_INDEX[func] = names.index("output_mask") if "output_mask" in names else None
    index = _MASK_INDEX[func]
    if index is None:
        return out
    mask = (kwargs or {}).get("output_mask", args[index] if index < len(args) else None)
    if mask is None or len(mask) != len(out):
        return out
    return tuple(o for o, keep in zip(out, mask) if keep)
