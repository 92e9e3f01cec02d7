"""Which kernels run the runtime's hot loops: the one place that decides, from ``MEMOPT_KERNELS``.

``MEMOPT_KERNELS`` is read once, when memopt is imported:
- unset (the default): the fused C kernels (``memopt.runtime.native``) on contiguous CPU tensors; on CUDA tensors the
  Triton kernels (``memopt.runtime.triton_fewbit``, ``triton_stash``, ``triton_stash_extras``, ``triton_bn``), each
  family once it has passed its first-use check on that device and dtype (``memopt.runtime.verify``: the family's
  code path run once on a tiny input with Triton and with plain PyTorch, compared as the tests compare them). The
  tests check the kernels bit for bit under Triton's CPU interpreter; a GPU, driver or Triton release may compile
  them differently, or not at all, and a default must not be the first run of a kernel, so the check runs first. A
  family that fails it (does not compile, raises, or differs) takes plain PyTorch there, with one warning; anything
  else (no triton, other devices) takes plain PyTorch as before;
- ``triton``: the Triton kernels for every op they take (float32/bfloat16/float16 values, their codes and masks;
  real or fake tensors), no check; CPU tensors only under ``TRITON_INTERPRET=1`` (the interpreter: what the tests
  use). Few-bit backward (``fewbit_triton``) and the stash's codecs (``stash_triton``): the BN chain's x̂ code with its
  bin sums, a residual chain's z code and the plain path's rebuild of x̂ / z codes (``memopt.stash.grid``,
  ``memopt.stash.ops``), the BN backward from the x̂ code (``memopt.stash.bn``), max-pool window offsets
  (``memopt.stash.pool``), dropout / ``where`` 1-bit masks and the generic stash's groups (``memopt.stash.generic``),
  the consumers' rebuild of act(z) and the chain's activation mask in backward (``memopt.stash.ops``,
  ``memopt.stash.grid.exact_mask``), a residual chain's side ends (``memopt.stash.grid._ends``), and the
  activation's backward inside the BN backward where g is not needed at full size (``memopt.stash.ops``). These
  take precedence over the C kernels; the rest of the stash (the channels' extremes, the activation's backward
  of the chains that keep g) runs the C kernels on CPU and plain PyTorch on CUDA;
- ``native``: no Triton (and no check); the C kernels where they apply (as before Triton existed);
- ``torch``: plain PyTorch everywhere, the C kernels too left out (the reference path; ``MEMOPT_NATIVE=0`` still
  skips only the C kernels).
Every path writes the same codes and gradients, except the BN backward's per-channel sums, whose order differs
between the paths (the C kernel sums in double, the Triton one in a fixed order of float32 parts), so its
gradients agree to float32 rounding (tests/runtime/test_triton_fewbit.py, test_triton_stash.py, test_triton_bn.py,
test_native.py); the switch trades speed and build requirements, not results (beyond that rounding). ``forced``
overrides it inside a block (tests). Under the cost model's fake tensors the path real tensors would take allocates
its outputs and runs nothing (the estimated peak is the measured one); by default that is the Triton path where the
family's check has already passed, else the plain path (no check runs on fake tensors). Other tensor subclasses take
the plain path.
"""
from __future__ import annotations

import contextlib
import os
from typing import Dict, Iterator, Optional

import torch
from torch._subclasses.fake_tensor import FakeTensor

from memopt.core.errors import MemoptError
from memopt.runtime import triton_fewbit, triton_stash, verify

CHOICES = ("triton", "native", "torch")


def parse(raw: Optional[str]) -> Optional[str]:
    """The choice ``MEMOPT_KERNELS`` names (None: unset or empty, the default)."""
    value = (raw or "").strip().lower()
    if not value:
        return None
    if value not in CHOICES:
        raise MemoptError(f"MEMOPT_KERNELS={raw!r} is not one of {', '.join(CHOICES)}; set one of those, or unset it "
                          f"for the default (the C kernels on CPU tensors, the Triton kernels on CUDA ones once they "
                          f"pass their first-use check)")
    return value


_choice = parse(os.environ.get("MEMOPT_KERNELS"))


def choice() -> Optional[str]:
    """The kernels asked for: 'triton', 'native', 'torch', or None (the default)."""
    return _choice


@contextlib.contextmanager
def forced(value: Optional[str]) -> Iterator[None]:
    """Use ``value`` (one of ``CHOICES``, or None for the default) inside this block instead of MEMOPT_KERNELS."""
    global _choice
    before, _choice = _choice, parse(value)
    try:
        yield
    finally:
        _choice = before


def native_allowed() -> bool:
    """Whether the fused C kernels may run (``native.applies`` asks): all but ``MEMOPT_KERNELS=torch`` and the
    Triton kernels' first-use checks (``memopt.runtime.verify``, which compare Triton with plain PyTorch)."""
    return _choice != "torch" and verify.probing() is None


def fewbit_triton(x: torch.Tensor, node: str) -> bool:
    """Whether few-bit node ``node`` runs its Triton kernels on input ``x``. With ``MEMOPT_KERNELS=triton`` a
    tensor they cannot take on this machine (triton missing, a CPU tensor outside the interpreter) is an error
    naming the fix, not a silent fallback; a dtype or tensor type they do not take (float64, subclasses)
    takes the plain path, which gives the same results. Fake tensors (the cost model) take the path the real ones
    would, which allocates the same outputs and launches nothing. By default: once the family has passed its
    first-use check on ``x``'s device and dtype (module docstring)."""
    return _triton_takes(x, triton_fewbit.DTYPES, triton_fewbit.AVAILABLE, f"few-bit node {node}", verify.FEWBIT)


def stash_triton(x: torch.Tensor, what: str) -> bool:
    """Whether the stash codec ``what`` (a phrase for errors: "the x̂ code", "max-pool offsets") runs its Triton
    kernels (``memopt.runtime.triton_stash``, ``triton_stash_extras``) on ``x``, the tensor it reads. The rules of
    ``fewbit_triton``: with ``MEMOPT_KERNELS=triton`` a tensor they cannot take on this machine is an error naming
    the fix; a dtype or tensor type they do not take (float64, subclasses) takes the plain path (the same
    results); fake tensors take the path real ones would (same allocations, no launch). By default: once the
    phrase's kernel family (``verify.FAMILY_OF``) has passed its first-use check on ``x``'s device and dtype."""
    return _triton_takes(x, triton_stash.DTYPES, triton_stash.AVAILABLE, f"the stash's {what}",
                         verify.family_of(what))


def prepare(device, dtypes=(torch.float32,)) -> Dict[str, bool]:
    """Runs the Triton kernels' first-use checks on ``device`` for ``dtypes`` now, where the default would take Triton
    there (``MEMOPT_KERNELS`` unset, triton imported, an eligible device; else nothing runs: {}), so that an estimate
    on fake tensors made afterwards follows the path the real step takes: {family: passed}."""
    device = torch.device(device)
    if _choice is not None or not triton_fewbit.AVAILABLE or not verify.eligible(device) \
            or not verify._may_probe(device):
        return {}
    return verify.check_all(device, dtypes)


def _triton_takes(x: torch.Tensor, dtypes, available: bool, subject: str, family: str) -> bool:
    """The rules both predicates share; ``subject`` names the node or codec in errors, ``family`` its kernels'
    first-use check (``memopt.runtime.verify``)."""
    probe = verify.probing()
    takes = type(x) in (torch.Tensor, torch.nn.Parameter, FakeTensor) and x.dtype in dtypes
    if probe is not None:  # a first-use check runs on this thread: the path it compares, never another check
        return probe == "triton" and takes
    if _choice in ("native", "torch") or not takes:
        return False
    if _choice is None:
        return available and verify.verdict(family, x)
    if not available:
        raise MemoptError(f"MEMOPT_KERNELS=triton but `import triton` failed ({triton_fewbit.IMPORT_ERROR}) for "
                          f"{subject}; install triton, or set MEMOPT_KERNELS=native (or unset it)")
    if x.device.type == "cpu" and not triton_fewbit.interpreting():
        raise MemoptError(f"MEMOPT_KERNELS=triton but {subject} has a CPU input, which Triton runs only in its "
                          f"interpreter; set TRITON_INTERPRET=1 (tests), or MEMOPT_KERNELS=native for the C kernels "
                          f"on CPU (or unset it)")
    return True
