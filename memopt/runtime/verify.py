"""First-use checks of the Triton kernels: with ``MEMOPT_KERNELS`` unset, a kernel family runs on a device and dtype
only after it has run there once on a small probe input and matched the plain path.

Why: the kernels are checked bit for bit by the tests, but a GPU, driver or Triton release the tests never saw may
compile them differently, or not at all; a default must not be the first run of a kernel. So the first time a family
would run on a device (and dtype), its probe (``PROBES``) runs the real memopt code path on a tiny input twice: with
the Triton kernels and with plain PyTorch (``MEMOPT_KERNELS=torch``'s path, the C kernels left out). It passes when
every output is the same bit for bit (NaN where NaN), except the outputs a family names in ``close``: the BN
backward's, whose per-channel sums run in another order (``memopt.runtime.kernels``), which must agree to float32
rounding (``CLOSE`` of the largest plain value, or one unit in the last place of a half-precision output). The
verdict is kept for the process, per (family, device, dtype); a codec that reads codes, masks or indices is keyed as
float32 (its kernels do not depend on a value dtype; the float32 probe runs them). A family that fails to compile,
raises or differs stays on the plain path there (the same results, slower), with one ``KernelCheckWarning`` naming the
family, the device, the dtype, the difference and the fix.

What a probe never does: run on fake tensors (the cost model: ``verdict`` gives the cached verdict, else the plain
path's decision, so an estimate made before the first real step follows the plain path; ``kernels.prepare`` checks
ahead), record into an autograd graph (probes call the Functions' forward and backward directly, under ``no_grad``),
consume the user's RNG streams (inputs come from a private generator, the global CPU and CUDA states are restored,
and the stash's private stochastic-rounding generator is restored by its probe), or recurse (while probing,
``probing()`` says which path runs, on this thread, and the predicates follow it). A check is put off (plain path,
no verdict) while a dispatch mode is active, a CUDA graph is being captured, or ``torch.compile`` traces: its
comparisons read values back to the host. Verdicts are not kept on disk: a check costs each family one run on a tiny
input per process (the kernels' compiles, which Triton caches on disk itself), while a verdict on disk would stay
true only if keyed on the kernels' and probes' sources as well as the GPU, driver, torch and triton versions.

Probes run memopt.fewbit / memopt.stash code, layers above this one: ``memopt.kernel_probes`` registers them
(``register``) when memopt is imported. A family without a probe is never verified: the plain path.
"""
from __future__ import annotations

import contextlib
import threading
import warnings
from dataclasses import dataclass
from typing import Callable, Dict, Iterator, Mapping, Optional, Tuple

import torch
from torch._subclasses.fake_tensor import FakeTensor

# the phrases the stash's callers pass to ``kernels.stash_triton``, by kernel family
FAMILY_OF = {
    "x̂ code": "chain", "grid ends": "chain", "z code": "chain", "rebuild of an x̂ or z code": "chain",
    "rebuild of a chain's activation": "chain", "activation mask of a z code": "chain",
    "BatchNorm backward from the x̂ code": "bn", "BatchNorm + activation backward": "bn",
    "max-pool offsets": "pool",
    "1-bit mask": "mask",
    "generic stash code": "generic", "generic stash rebuild": "generic",
}
FEWBIT = "fewbit"  # ``kernels.fewbit_triton``'s family
CLOSE = 2e-5  # float32 rounding of the BN backward's sums, relative to the largest plain value (as the tests allow)

Outputs = Mapping[str, Optional[torch.Tensor]]


@dataclass(frozen=True)
class Probe:
    family: str
    what: str  # for messages: "few-bit backward's encode and scale kernels"
    run: Callable[[torch.device, torch.dtype], Outputs]  # the family's code path on a tiny input: named outputs
    close: Tuple[str, ...] = ()  # outputs compared to float32 rounding instead of bit for bit


class KernelCheckWarning(UserWarning):
    """A Triton kernel family failed its first-use check; memopt runs plain PyTorch for it there."""


PROBES: Dict[str, Probe] = {}
_verdicts: Dict[tuple, bool] = {}
_lock = threading.RLock()
_local = threading.local()


def register(family: str, what: str, run: Callable[[torch.device, torch.dtype], Outputs],
             close: Tuple[str, ...] = ()) -> None:
    """Registers (or replaces) ``family``'s probe."""
    PROBES[family] = Probe(family, what, run, tuple(close))


def family_of(what: str) -> str:
    """The kernel family of a stash phrase (an unknown phrase is its own family, which has no probe)."""
    return FAMILY_OF.get(what, what)


def probing() -> Optional[str]:
    """'triton' or 'torch' while a probe runs on this thread (the path the predicates then take), else None."""
    return getattr(_local, "choice", None)


@contextlib.contextmanager
def probe_as(choice: str) -> Iterator[None]:
    """Inside this block, on this thread, the predicates take ``choice``'s path ('triton' or 'torch') and the C
    kernels stay out: what a probe compares. Probes may nest it (inputs made on the plain path)."""
    before, _local.choice = probing(), choice
    try:
        yield
    finally:
        _local.choice = before


def eligible(device: torch.device) -> bool:
    """Whether the default may run Triton kernels on ``device`` once a family passes its check there: CUDA devices.
    Tests redirect it (CPU tensors under ``TRITON_INTERPRET=1``) to take the same path."""
    return device.type == "cuda"


def _key(family: str, x: torch.Tensor) -> tuple:
    return family, x.device.type, x.device.index, _dtype(x)


def _dtype(x: torch.Tensor) -> torch.dtype:
    return x.dtype if x.dtype.is_floating_point else torch.float32


def verdict(family: str, x: torch.Tensor) -> bool:
    """Whether ``family``'s Triton kernels run by default on ``x``'s device and dtype: checked on first use there
    (real tensors), the cached verdict under fake tensors (none yet: False, the plain path's decision)."""
    if not eligible(x.device):
        return False
    key = _key(family, x)
    known = _verdicts.get(key)
    if known is not None:
        return known
    if isinstance(x, FakeTensor) or not _may_probe(x.device):
        return False
    with _lock:
        if key not in _verdicts:
            _verdicts[key] = check(family, x.device, _dtype(x))
        return _verdicts[key]


def check_all(device: torch.device, dtypes=(torch.float32,)) -> Dict[str, bool]:
    """Checks every family on ``device`` for ``dtypes`` now (those not checked yet): {family: passed for every dtype}.
    ``kernels.prepare`` calls it where the default would take Triton."""
    device = torch.device(device)
    if device.type == "cuda" and device.index is None:
        device = torch.device("cuda", torch.cuda.current_device())
    passed = {}
    for family in PROBES:
        results = []
        for dtype in dtypes:
            key = (family, device.type, device.index, dtype)
            with _lock:
                if key not in _verdicts:
                    _verdicts[key] = check(family, device, dtype)
            results.append(_verdicts[key])
        passed[family] = all(results)
    return passed


def verdicts() -> Dict[tuple, bool]:
    """The verdicts so far: (family, device type, device index, dtype) -> passed."""
    return dict(_verdicts)


def forget() -> None:
    """Drops every verdict (tests): the next use checks again."""
    _verdicts.clear()


def _may_probe(device: torch.device) -> bool:
    if torch._C._len_torch_dispatch_stack() or torch.compiler.is_compiling():
        return False
    return not (device.type == "cuda" and torch.cuda.is_current_stream_capturing())


def check(family: str, device: torch.device, dtype: torch.dtype) -> bool:
    """Runs ``family``'s probe on ``device`` and ``dtype`` on both paths: True when they agree, else False after one
    warning naming the difference (or the exception's first line) and the fix."""
    probe = PROBES.get(family)
    if probe is None:
        return False
    try:
        with _quiet(device):
            with probe_as("triton"):
                got = probe.run(device, dtype)
            with probe_as("torch"):
                want = probe.run(device, dtype)
            problem = difference(got, want, probe.close)
    except Exception as error:  # a kernel that fails to compile or raises: the plain path, never the user's error
        lines = str(error).strip().splitlines()
        problem = f"{type(error).__name__}: {lines[0] if lines else ''}".rstrip(": ")
    if problem is None:
        return True
    warnings.warn(f"memopt: the Triton kernels for {probe.what} (kernel family {family!r}) failed their first-use "
                  f"check on {_device_name(device)}, {dtype}: {problem.rstrip('.')}. memopt runs plain PyTorch for "
                  f"them there in this process (the same results, slower). Set MEMOPT_KERNELS=native (or torch) to "
                  f"skip the check and this warning, or report it to memopt's maintainers with this message",
                  KernelCheckWarning, stacklevel=2)
    return False


@contextlib.contextmanager
def _quiet(device: torch.device) -> Iterator[None]:
    """No autograd graph, the global RNG states as they were (CPU, and the device's where CUDA)."""
    devices = [device.index if device.index is not None else torch.cuda.current_device()] \
        if device.type == "cuda" else []
    with torch.random.fork_rng(devices=devices), torch.no_grad():
        yield


def _device_name(device: torch.device) -> str:
    if device.type != "cuda":
        return str(device)
    try:
        return f"{device} ({torch.cuda.get_device_name(device)})"
    except Exception:
        return str(device)


def difference(got: Outputs, want: Outputs, close: Tuple[str, ...] = ()) -> Optional[str]:
    """None where the Triton outputs ``got`` equal the plain ``want`` (bit for bit, NaN where NaN; the names in
    ``close`` to float32 rounding), else what differs first."""
    for name, b in want.items():
        a = got.get(name)
        if a is None or b is None:
            if a is not b:
                return f"{name} is {'missing' if a is None else 'extra'} on the Triton path"
            continue
        if (a.shape, a.dtype) != (b.shape, b.dtype):
            return (f"{name} has shape {tuple(a.shape)} and dtype {a.dtype}, the plain path {tuple(b.shape)} and "
                    f"{b.dtype}")
        if not a.numel():
            continue
        if a.dtype.is_floating_point:
            nan = a.isnan()
            if not torch.equal(nan, b.isnan()):
                return f"{name} has NaN at {int((nan != b.isnan()).sum())} places the plain path does not"
            a, b = a[~nan], b[~nan]
        diff = (a.double() - b.double()).abs()
        worst = float(diff.max()) if diff.numel() else 0.0
        if name in close:
            scale = float(b.double().abs().max()) if b.numel() else 0.0
            ulp = torch.finfo(b.dtype).eps if b.dtype in (torch.float16, torch.bfloat16) else 0.0
            allowed = scale * max(CLOSE, ulp)
            if worst > allowed:
                return f"{name}: max abs diff {worst:.3g} from the plain path, past float32 rounding ({allowed:.3g})"
        elif not _bitwise_equal(a, b):
            return f"{name}: max abs diff {worst:.3g} from the plain path (expected bit-identical)"
    return None


def _bitwise_equal(a: torch.Tensor, b: torch.Tensor) -> bool:
    ints = {8: torch.int64, 4: torch.int32, 2: torch.int16, 1: torch.uint8}
    if a.dtype.is_floating_point:  # +0 and -0 told apart
        return torch.equal(a.contiguous().view(ints[a.element_size()]), b.contiguous().view(ints[b.element_size()]))
    return torch.equal(a, b)
