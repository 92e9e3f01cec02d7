"""Storage identity and live-memory tracking, shared by the estimator and `memopt.measure`.

Autograd keeps *storages* alive, not tensor views: q, k and v that are views of one qkv buffer
cost one buffer, and a small view keeps its whole base alive. Everything here therefore keys on
the storage, never on the tensor.

Two traps shape this file:
- a storage's address is reused as soon as it is freed, so a key is only valid while we keep a
  reference to the storage. We keep *weak* references (``StorageWeakRef``): a weak reference
  keeps the StorageImpl object (and so its address, our key) reserved without keeping its data
  alive, so keys stay unique and lifetimes stay those of the real run;
- the peak must be measured over real lifetimes, so ``LiveStorageTracker`` asks which storages have died
  whenever the bytes it counts could be a new peak (see its docstring for why not after every op).
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

    After each op that could raise the peak, the tracker drops the storages that have died and records the sum
    of those still alive; ``peak`` is the largest such sum. Storages that existed before the mode was
    entered (parameters, inputs, optimizer state) must be passed as ``preexisting``: they are never
    counted, even when an in-place op or a view (``weight.t()``) returns them again. Callers add
    their bytes themselves. Works on real and on fake tensors alike, so the estimator and the
    measurement use one rule.

    Why the sweep is lazy: asking every live storage whether it died after every op made the cost model
    quadratic in the step's ops (a third of ``optimize()``'s time on a MobileNetV3). The bytes counted without
    a sweep are an upper bound of those alive (deaths are only ever subtracted), so while that bound is at most
    the peak no op can set a new peak and the sweep waits; when it exceeds the peak, a sweep makes it exact
    before the peak is taken. A storage that died but was not yet swept keeps its key: our weak reference keeps
    the StorageImpl object (not its data, which is freed at once) reserved, so no new storage gets its address.

    A storage is identified by (address, creation number). ``at_peak`` lists (identity, bytes, phase) of the
    storages alive at the peak, from a history of births and the sweep at which each death was seen; ``phase``
    is whatever the caller set in ``tracker.phase`` when each was created. ``peak_in_weight_grad``: whether the
    peak fell while a weight gradient read a rebuilt input (``memopt.core.phase``), where batch chunks can lower
    it; ``peak_in_recompute``: while a recomputed block's backward ran, where running it over batch chunks can.
    """

    def __init__(self, preexisting: Iterable[torch.Tensor] = ()) -> None:
        super().__init__()
        self._preexisting_refs = [StorageWeakRef(t.untyped_storage()) for t in preexisting]
        self._preexisting = {r.cdata for r in self._preexisting_refs}
        self._live: Dict[int, tuple] = {}  # key -> (weakref, its record in _history)
        self._history: List[list] = []  # [key, creation number, nbytes, phase, sweep at which it was seen dead]
        self._created = 0
        self._sweeps = 0
        self._upper = 0  # the bytes of the storages in _live: an upper bound of the live bytes until a sweep
        self._peak_at = (0, 0)  # (creation number, sweep) at the peak
        self.phase = ""
        self.peak = 0
        self.peak_in_weight_grad = False
        self.peak_in_recompute = False

    @property
    def current(self) -> int:
        """The bytes alive now (exact: sweeps first)."""
        self._sweep()
        return self._upper

    @property
    def at_peak(self) -> List[tuple]:
        created, sweep = self._peak_at
        return [((key, number), nbytes, phase) for key, number, nbytes, phase, died in self._history
                if number <= created and (died is None or died > sweep)]

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
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
            record = [ref.cdata, self._created, nbytes, self.phase, None]
            self._history.append(record)
            self._live[ref.cdata] = (ref, record)
            self._upper += nbytes

    def _sweep(self) -> None:
        self._sweeps += 1
        expired = _EXPIRED
        dead = [k for k in self._live if expired(k)]
        for k in dead:
            record = self._live.pop(k)[1]
            self._upper -= record[2]
            record[4] = self._sweeps

    def _note_peak(self) -> None:
        if self._upper <= self.peak:  # an upper bound of the live bytes: no new peak possible
            return
        self._sweep()
        if self._upper > self.peak:
            self._take_peak()

    def _take_peak(self) -> None:
        self.peak = self._upper
        self._peak_at = (self._created, self._sweeps)
        self.peak_in_weight_grad = phase.in_weight_grad_from_codes()
        self.peak_in_recompute = phase.in_recompute_backward()

    def reset_peak(self) -> None:
        self._sweep()
        self._take_peak()

    def identity(self, t: torch.Tensor):
        """(address, creation number) of a live tracked storage, or None. No sweep needed: a tracked key is not
        reused while its entry holds the weak reference (see the class docstring)."""
        key = storage_key(t)
        entry = self._live.get(key)
        return None if entry is None else (key, entry[1][1])


_EXPIRED = torch.Storage._expired  # StorageWeakRef.expired without the method call, on the key (its cdata)


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
