"""A test helper that fails on the ops that would make a CUDA host wait for the device (issue 41).

A training step on CUDA should queue kernels and return: the host never reads a value back. Ops that read one
(``.item()``, ``bool(t)``, ``.tolist()``, ``torch.equal``), whose output shape depends on the values (``nonzero``,
``masked_select``, ``unique``, boolean-mask indexing, ``bincount``, ``repeat_interleave`` without
``output_size``), or copy between host and device (``.cpu()``, ``.numpy()``, ``torch.tensor(data, device=...)``)
synchronise it. ``no_host_sync`` records them while a step runs on CPU tensors standing in for CUDA ones (no GPU
needed): a dispatch mode sees the ATen ops, a function mode the Python-level copies, which run no ATen op on a CPU
tensor. Each finding names the op, why it would synchronise, and where it ran (the stack, memopt's frames first).

What a CPU stand-in cannot show: a ``.to(device)`` between host and device (every tensor is on the host), branches
taken only on CUDA (``x.is_cuda``), and synchronisations inside a CUDA kernel's own implementation of an op that is
asynchronous on the CPU. Ops on meta and fake tensors are never counted: they read no values.
"""
from __future__ import annotations

import contextlib
import traceback
from dataclasses import dataclass, field
from pathlib import Path
from typing import Iterator, List, Optional, Tuple

import torch
from torch.overrides import TorchFunctionMode
from torch.utils._python_dispatch import TorchDispatchMode, _disable_current_modes

aten = torch.ops.aten
_READS = {aten._local_scalar_dense.default: "reads a value back to the host (.item(), bool(t), int(t), float(t))",
          aten.item.default: "reads a value back to the host (.item())",
          aten.equal.default: "torch.equal returns a Python bool read back from the device",
          aten.is_nonzero.default: "bool(t) reads a value back to the host"}
_INDEX_PUTS = {aten.index_put.default, aten.index_put_.default, aten._index_put_impl_.default}
_HISTC = {aten.histc.default, aten.histc.out}
_COPIES = {"tolist": "Tensor.tolist() copies to the host", "numpy": "Tensor.numpy() copies to the host",
           "cpu": "Tensor.cpu() copies to the host (when the tensor is on CUDA)",
           "new_tensor": "Tensor.new_tensor(data) copies Python data to the tensor's device (a blocking copy)"}
_TORCH = str(Path(torch.__file__).parent) + "/"
_THIS = __file__


@dataclass
class Sync:
    op: str  # "aten.nonzero.default", "Tensor.tolist"
    why: str
    stack: List[str] = field(default_factory=list)  # innermost last, this module's frames left out

    @property
    def where(self) -> str:
        """The innermost frame in memopt (or passes / cost_model), else the innermost frame."""
        inside = [f for f in self.stack if "/memopt/" in f or "/passes/" in f or "/cost_model/" in f]
        return (inside or self.stack or ["?"])[-1]

    def __str__(self) -> str:
        return f"{self.op} at {self.where}: {self.why}"


class HostSyncError(AssertionError):
    """Ops that would synchronise a CUDA host ran where none may (``no_host_sync(strict=True)``)."""


def _counts(t) -> bool:
    """A tensor with values on the host or a GPU (not meta, not fake)."""
    return isinstance(t, torch.Tensor) and t.device.type in ("cpu", "cuda") and type(t) in (torch.Tensor,
                                                                                             torch.nn.Parameter)


def _flat(args, kwargs) -> list:
    return torch.utils._pytree.tree_leaves((args, kwargs or {}))


def _why(func, args, kwargs) -> Optional[str]:
    """Why ``func`` on these arguments would synchronise a CUDA host, or None."""
    kwargs = kwargs or {}
    if func in _READS:
        return _READS[func]
    if func in _INDEX_PUTS or func is aten.index.Tensor:
        indices = args[1] if len(args) > 1 else kwargs.get("indices", ())
        if any(isinstance(i, torch.Tensor) and i.dtype in (torch.bool, torch.uint8) for i in indices or ()):
            return "indexing with a boolean mask runs nonzero (the output shape depends on the values)"
        return None
    if func is aten.repeat_interleave.Tensor:
        return None if kwargs.get("output_size") is not None else \
            "repeat_interleave without output_size (the output shape depends on the values)"
    if func is aten.one_hot.default:
        classes = args[1] if len(args) > 1 else kwargs.get("num_classes", -1)
        return "one_hot without num_classes reads the largest value" if classes < 0 else None
    if func in _HISTC:
        low, high = (list(args[2:4]) + [0, 0])[:2] if len(args) > 2 else (kwargs.get("min", 0), kwargs.get("max", 0))
        return "histc without a range reads the extremes back" if low == high else None
    if torch.Tag.dynamic_output_shape in func.tags:
        return "its output shape depends on the values"
    if torch.Tag.data_dependent_output in func.tags:
        return "its output is read back to the host"
    return None


def _stack() -> List[str]:
    """The caller's stack, innermost last: torch's own frames and this module's left out."""
    return [f"{f.filename}:{f.lineno} in {f.name}" for f in traceback.extract_stack()
            if not f.filename.startswith(_TORCH) and f.filename != _THIS]


class _Ops(TorchDispatchMode):
    def __init__(self, found: List[Sync]):
        super().__init__()
        self.found = found

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if any(_counts(t) for t in _flat(args, kwargs)):
            why = _why(func, args, kwargs)
            if why is not None:
                self.found.append(Sync(str(func), why, _stack()))
        return func(*args, **(kwargs or {}))


class _Copies(TorchFunctionMode):
    def __init__(self, found: List[Sync]):
        super().__init__()
        self.found = found

    def __torch_function__(self, func, types, args=(), kwargs=None):
        name = getattr(func, "__name__", "")
        kwargs = kwargs or {}
        why = None
        if name in _COPIES and args and _counts(args[0]):
            why = _COPIES[name]
        elif func in (torch.tensor, torch.as_tensor) and kwargs.get("device") is not None \
                and torch.device(kwargs["device"]).type in ("cpu", "cuda") and not isinstance(args[0], torch.Tensor):
            why = "a tensor made from Python data on the compute device: a blocking host-to-device copy on CUDA"
        if why is not None:
            self.found.append(Sync(f"Tensor.{name}" if name in _COPIES else f"torch.{name}", why, _stack()))
        return func(*args, **kwargs)


@contextlib.contextmanager
def no_host_sync(strict: bool = True) -> Iterator[List[Sync]]:
    """Records, inside this block, every op that would synchronise a CUDA host (``Sync``: op, why, stack) into the
    list it yields; with ``strict`` it then raises ``HostSyncError`` listing them (op, memopt frame, reason)."""
    found: List[Sync] = []
    with _Copies(found), _Ops(found):
        yield found
    if strict and found:
        raise HostSyncError(report(found))


@contextlib.contextmanager
def unwatched() -> Iterator[None]:
    """Inside this block nothing is recorded (nor any other mode seen): for work that on CUDA queues and returns, but
    runs on the host here, e.g. a Triton launch under the interpreter, which computes with NumPy."""
    with _disable_current_modes(), torch._C.DisableTorchFunction():
        yield


def report(found: List[Sync], frames: int = 6) -> str:
    """The findings, one paragraph each: the op, why, and the innermost ``frames`` frames of its stack."""
    seen: List[Tuple[str, str]] = []
    lines = [f"{len(found)} op(s) that would synchronise a CUDA host ran:"]
    for sync in found:
        key = (sync.op, sync.where)
        if key in seen:
            continue
        seen.append(key)
        count = sum(1 for s in found if (s.op, s.where) == key)
        lines.append(f"- {sync} ({count}x)")
        lines.extend(f"    {frame}" for frame in sync.stack[-frames:])
    return "\n".join(lines)
