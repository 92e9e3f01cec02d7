"""Fused CPU kernels for packing and the stash's codecs: ``memopt/runtime/kernels.c``, compiled on first use.

The plain-PyTorch codecs (``memopt/stash/grid.py``, ``memopt/runtime/bitpack.py``) take several full-size
elementwise passes per chain (subtract, scale, divide, ceil, clamp, select, shift, or ...); each C kernel
here does one pass with the same float32 arithmetic in the same order, so the codes and rebuilt values are
bit-identical to the plain path (tests/runtime/test_native.py) and only the BN backward's per-channel sums are
accumulated in another order (float lanes, then double). The backward also keeps less: no full-size x̂ or
byte mask (the saved 1-bit mask is read a block at a time). ResNet-50 step time with and without them:
docs/results/stash/stash_memory.md.

The kernels run on contiguous CPU tensors only (float32 where a float is read; bfloat16 too where autocast
gives it: the forward's codes, activation mask and extremes, the BN backward's gradients, each widened or
narrowed a block at a time); everything else (CUDA, float16, strided views) takes the plain path. The library
is built with the system's C compiler (``$CC``, else ``cc`` / ``gcc``; ``-O3 -march=native -ffp-contract=off
-fno-trapping-math -fopenmp``) into ``$MEMOPT_CACHE_DIR`` (default ``~/.cache/memopt``), once per source, flags
and CPU. Without a working
compiler memopt warns once (quoting the compiler's error) and uses the plain path: same codes, slower;
``MEMOPT_NATIVE=0`` chooses the plain path without building anything, as ``MEMOPT_KERNELS=torch`` does
(``memopt.runtime.kernels``, which also decides when few-bit backward runs its Triton kernels instead).

Under a ``FakeTensorMode`` (the cost model) a wrapper allocates exactly the outputs the kernel would fill
and runs nothing, so the estimated peak is the measured one on either path.
"""
from __future__ import annotations

import contextlib
import ctypes
import hashlib
import math
import os
import platform
import shutil
import subprocess
import tempfile
import warnings
from pathlib import Path
from typing import Iterator, NamedTuple, Optional, Sequence, Tuple

import torch
from torch._subclasses.fake_tensor import FakeTensor

from memopt.runtime import kernels

__all__ = ["PackedMask", "available", "applies", "disabled", "pack", "unpack", "encode", "rebuild", "mask_from_codes",
           "bn_backward", "act_mask", "channel_extremes", "chain_grid"]

_SOURCE = Path(__file__).with_name("kernels.c")
# built into the same library: the generic stash's group codecs and few-bit backward (native_generic.py)
_SOURCES = (_SOURCE, Path(__file__).with_name("kernels_generic.c"))
_FLAGS = ["-O3", "-march=native", "-ffp-contract=off", "-fno-math-errno", "-fno-trapping-math", "-fopenmp", "-shared", "-fPIC"]
_ACTS = {"identity": 0, "relu": 1, "relu6": 2, "leaky_relu": 3}

_lib: Optional[ctypes.CDLL] = None
_tried = False
_enabled = os.environ.get("MEMOPT_NATIVE", "1") != "0"

_P, _I64, _I, _F = ctypes.c_void_p, ctypes.c_int64, ctypes.c_int, ctypes.c_float
_SIGNATURES = {
    "mo_pack": [_P, _I64, _I, _P, _I64, _I],
    "mo_unpack": [_P, _I64, _I64, _I, _P, _I],
    "mo_encode": [_P, _I, _I64, _I64, _I64, _P, _P, _P, _P, _P, _P, _P, _P, _I, _I, _P, _I64, _P, _I, _I],
    "mo_rebuild": [_P, _I64, _I, _I64, _I64, _I64, _P, _I, _I, _P, _I, _P, _I, _F, _P, _I, _I],
    "mo_mask_from_codes": [_P, _I64, _I, _I64, _I64, _I64, _P, _P, _I, _I],
    "mo_act_mask": [_P, _I, _I64, _I, _P, _I],
    "mo_bn_backward": [_P, _I64, _I, _I64, _I64, _I64, _P, _I, _I, _P, _I, _P, _P, _I, _F, _P, _P, _P, _P, _P, _P, _F, _P,
                       _P, _I, _I],
    "mo_channel_extremes": [_P, _I, _P, _I64, _I64, _I64, _P, _I],
    "mo_chain_grid": [_I64, _P, _P, _P, _P, _P, _P, _I, _I, _F, _F, _F, _I, _I, _I, _I, _P, _P, _P, _P],
    "mo_compare": [_P, _P, _I64, _P, _P, _I],
}


def _cpu_id() -> str:
    """What ``-march=native`` depends on: the CPU's model and feature flags."""
    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError:
        return platform.processor()
    keep = [line for line in text.splitlines() if line.startswith(("model name", "flags", "Features"))]
    return "\n".join(sorted(set(keep)))


def _compiler() -> Optional[str]:
    for name in (os.environ.get("CC"), "cc", "gcc"):
        if name and shutil.which(name):
            return shutil.which(name)
    return None


def _build() -> ctypes.CDLL:
    cc = _compiler()
    if cc is None:
        raise RuntimeError("no C compiler found ($CC, cc, gcc)")
    key = hashlib.sha256(b"\0".join([*(s.read_bytes() for s in _SOURCES), " ".join(_FLAGS).encode(), cc.encode(),
                                     platform.machine().encode(), _cpu_id().encode()])).hexdigest()[:16]
    cache = Path(os.environ.get("MEMOPT_CACHE_DIR") or Path.home() / ".cache" / "memopt")
    try:
        cache.mkdir(parents=True, exist_ok=True)
    except OSError:
        cache = Path(tempfile.gettempdir()) / "memopt-cache"
        cache.mkdir(parents=True, exist_ok=True)
    target = cache / f"stash_kernels-{key}.so"
    if not target.exists():
        # built under a private name, then renamed: parallel test workers never load a half-written file
        fd, tmp = tempfile.mkstemp(suffix=".so", dir=cache)
        os.close(fd)
        try:
            done = subprocess.run([cc, *_FLAGS, *map(str, _SOURCES), "-o", tmp, "-lm"], capture_output=True, text=True)
            if done.returncode != 0:
                raise RuntimeError(f"{cc} failed: {done.stderr.strip()[-800:]}")
            os.replace(tmp, target)
        finally:
            if os.path.exists(tmp):
                os.unlink(tmp)
    lib = ctypes.CDLL(str(target))
    for name, args in _SIGNATURES.items():
        getattr(lib, name).argtypes = args
        getattr(lib, name).restype = None
    return lib


def _library() -> Optional[ctypes.CDLL]:
    global _lib, _tried
    if not _tried:
        _tried = True
        try:
            _lib = _build()
        except Exception as error:  # no compiler, no OpenMP, a read-only disk: the plain path still works
            names = ", ".join(s.name for s in _SOURCES)
            warnings.warn(f"memopt: the fused CPU stash kernels ({names}) could not be built ({error}); "
                          f"using plain PyTorch ops instead (same codes, slower). Set MEMOPT_NATIVE=0 to skip "
                          f"building them.", RuntimeWarning, stacklevel=3)
    return _lib


def available() -> bool:
    """Whether the kernels are enabled and built (building them now if needed)."""
    return _enabled and kernels.native_allowed() and _library() is not None


@contextlib.contextmanager
def disabled() -> Iterator[None]:
    """Use the plain-PyTorch codecs inside this block (for comparisons and tests)."""
    global _enabled
    before, _enabled = _enabled, False
    try:
        yield
    finally:
        _enabled = before


def applies(*tensors: torch.Tensor, float_dtype: bool = False, bf16: bool = False) -> bool:
    """Whether the kernels take these tensors: contiguous, on the CPU (real or fake), float32 where
    ``float_dtype`` (or bfloat16 too with ``bf16``: the kernels that widen their input a block at a time,
    ``encode``, ``act_mask``, ``channel_extremes``), and the library built."""
    floats = (torch.float32, torch.bfloat16) if bf16 else (torch.float32,)
    for t in tensors:
        if t.device.type != "cpu" or not t.is_contiguous() or (float_dtype and t.dtype not in floats):
            return False
        if type(t) not in (torch.Tensor, torch.nn.Parameter, FakeTensor):
            return False
    return _enabled and kernels.native_allowed() and _library() is not None


def _runs(*tensors: torch.Tensor) -> bool:
    """False under the cost model's fake tensors: the outputs are allocated, nothing is computed."""
    return not any(isinstance(t, FakeTensor) for t in tensors)


def _ptr(t: Optional[torch.Tensor]) -> Optional[int]:
    return None if t is None else t.data_ptr()


# below this many elements a kernel runs on one thread: waking the pool costs more than the work
_PARALLEL_FROM = 1 << 16


def _threads(n: int) -> int:
    return max(1, torch.get_num_threads()) if n >= _PARALLEL_FROM else 1


def _geometry(shape: Sequence[int]) -> Tuple[int, int, int]:
    """(elements, channels, elements per channel and sample) of an (N, C, ...) tensor."""
    return math.prod(shape), shape[1] if len(shape) > 1 else 1, math.prod(shape[2:])


def _book(book: torch.Tensor) -> Tuple[torch.Tensor, int, int]:
    """What the kernels decode from, per channel: a code book (``memopt.stash.grid.code_book``: C x sides x 2^K),
    or a grid's rows (2 x sides, C: lo, w per side; the midpoints, computed in the kernel), transposed to C x rows.
    Returns (table, whether it is a book, whether it has two sides)."""
    if book.dim() == 3:
        return book.float().contiguous(), 1, int(book.shape[1] == 2)
    return book.float().t().contiguous(), 0, int(book.shape[0] == 4)


def _rows(grid: torch.Tensor) -> list:
    """A grid's rows (lo0, w0[, lo1, w1]) as contiguous float32, the missing side as None."""
    rows = [r.float().contiguous() for r in grid]
    return rows if len(rows) == 4 else rows + [None, None]


class PackedMask(NamedTuple):
    """An activation mask kept as its 1-bit stream (``pack_bits(mask, 1)``): the backward kernels read it a
    block at a time, so no full-size byte mask exists at the backward peak."""
    bits: torch.Tensor

    def unpacked(self, shape: torch.Size) -> torch.Tensor:
        # the 1-bit stream is LSB-first in bytes (memopt.runtime.bitpack); shifts work on any device
        n = shape.numel()
        if applies(self.bits):
            codes = unpack(self.bits, 1, n)
        else:
            shifts = torch.arange(8, device=self.bits.device, dtype=torch.uint8)
            codes = ((self.bits.unsqueeze(-1) >> shifts) & 1).reshape(-1)[:n]
        return codes.view(shape).view(torch.bool)


def _u8(mask) -> Optional[torch.Tensor]:
    if mask is None:
        return None
    if isinstance(mask, PackedMask):
        return mask.bits
    return (mask.view(torch.uint8) if mask.dtype == torch.bool else mask.to(torch.uint8)).contiguous()


def _is_bits(mask) -> int:
    return int(isinstance(mask, PackedMask))


def pack(codes: torch.Tensor, bits: int) -> torch.Tensor:
    """``bitpack.pack_bits`` for contiguous uint8 (or bool) CPU codes, in one pass."""
    flat = codes.reshape(-1)
    flat = flat.view(torch.uint8) if flat.dtype == torch.bool else flat
    n = flat.numel()
    nbytes = (n * bits + 7) // 8
    out = torch.empty(nbytes, dtype=torch.uint8)
    if _runs(flat) and n:
        _library().mo_pack(flat.data_ptr(), n, bits, out.data_ptr(), nbytes, _threads(n))
    return out


def unpack(packed: torch.Tensor, bits: int, n: int) -> torch.Tensor:
    """``bitpack.unpack_bits`` on the CPU, in one pass."""
    out = torch.empty(n, dtype=torch.uint8)
    if _runs(packed) and n:
        _library().mo_unpack(packed.data_ptr(), packed.numel(), n, bits, out.data_ptr(), _threads(n))
    return out


def _wide(x: torch.Tensor) -> int:
    """The kernels' ``x_bf16`` flag: 1 for a bfloat16 input (widened a block at a time), 0 for float32; any other
    dtype is refused (the kernels would read its bytes as float32)."""
    if x.dtype not in (torch.float32, torch.bfloat16):
        raise ValueError(f"memopt.runtime.native: the input must be float32 or bfloat16, got {x.dtype}; convert it "
                         f"or take the plain path (check native.applies(x, float_dtype=True, bf16=True) first)")
    return int(x.dtype == torch.bfloat16)


def encode(x: torch.Tensor, grid: torch.Tensor, bits: int, *, mean: Optional[torch.Tensor] = None,
           scale: Optional[torch.Tensor] = None, mask: Optional[torch.Tensor] = None,
           zero_code: Optional[torch.Tensor] = None, positive_not_le: bool = False,
           sums: Optional[torch.Tensor] = None, sum_stride: int = 1) -> torch.Tensor:
    """Packed codes of ``(x - mean) * scale`` (or of ``x``; float32 or bfloat16) on ``grid`` (rows lo0, w0[, lo1,
    w1], widths already clamped), split by ``mask``; with ``zero_code`` the sign fix of a z code
    (``memopt.stash.ops.BNActStash``);
    with ``sums`` (``memopt.stash.grid.new_bin_sums``) the fixed-point offset in its bin of each element whose
    index is a multiple of ``sum_stride``, and their counts, are added there (``memopt.stash.grid.add_bin_sums``,
    the same integers)."""
    n, channels, inner = _geometry(x.shape)
    nbytes = (n * bits + 7) // 8
    out = torch.empty(nbytes, dtype=torch.uint8)
    wide = _wide(x)
    lo0, w0, lo1, w1 = _rows(grid)
    per = [None if t is None else t.float().contiguous() for t in (mean, scale)]
    zc = None if zero_code is None else zero_code.to(torch.int32).contiguous()
    m = _u8(mask) if lo1 is not None else None
    if _runs(x) and n:
        _library().mo_encode(x.data_ptr(), wide, n, channels, inner, _ptr(per[0]), _ptr(per[1]), _ptr(lo0), _ptr(w0),
                             _ptr(lo1), _ptr(w1), _ptr(m), _ptr(zc), int(positive_not_le), bits, out.data_ptr(),
                             nbytes, _ptr(sums), int(sum_stride), _threads(n))
    return out


def rebuild(packed: torch.Tensor, bits: int, shape: torch.Size, book: torch.Tensor, act: str, slope: float = 0.0,
            *, mask: Optional[torch.Tensor] = None, zero_code: Optional[torch.Tensor] = None,
            out_dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """act(z) from z's code book or grid rows (``_book``; ``stash._Stash.rebuild``) as a new tensor of ``shape``:
    the side and the activation's branch from ``mask``, else from the code (``k >= zero_code``). ``out_dtype``
    float32, or bfloat16 (the float32 values narrowed a block at a time: ``.to(torch.bfloat16)`` of the float32
    result, without it: a consumer under autocast takes the rebuilt input in bf16)."""
    if out_dtype not in _BN_DTYPES:
        raise ValueError(f"native.rebuild: out_dtype must be float32 or bfloat16, got {out_dtype}; rebuild in "
                         f"float32 and convert")
    n, channels, inner = _geometry(shape)
    out = torch.empty(shape, dtype=out_dtype)
    table, is_book, split = _book(book)
    m, zc = _u8(mask), None if zero_code is None else zero_code.to(torch.int32).contiguous()
    if _runs(packed) and n:
        _library().mo_rebuild(packed.data_ptr(), packed.numel(), bits, n, channels, inner, table.data_ptr(), is_book,
                              split, _ptr(m), _is_bits(mask), _ptr(zc), _ACTS[act], float(slope), out.data_ptr(),
                              int(out_dtype == torch.bfloat16), _threads(n))
    return out


def mask_from_codes(packed: torch.Tensor, bits: int, shape: torch.Size, zero_code: torch.Tensor,
                    as_bits: bool = False):
    """The exact mask of a z code, ``codes >= zero_code`` per channel: a bool tensor of ``shape``, or with
    ``as_bits`` a ``PackedMask`` (n / 8 bytes)."""
    n, channels, inner = _geometry(shape)
    out = torch.empty((n + 7) // 8 if as_bits else shape, dtype=torch.uint8)
    zc = zero_code.to(torch.int32).contiguous()
    if _runs(packed) and n:
        _library().mo_mask_from_codes(packed.data_ptr(), packed.numel(), bits, n, channels, inner, zc.data_ptr(),
                                      out.data_ptr(), int(as_bits), _threads(n))
    return PackedMask(out) if as_bits else out.view(torch.bool)


_BN_DTYPES = (torch.float32, torch.bfloat16)  # what mo_bn_backward reads and writes (TYPE_* in kernels.c)


def bn_backward(packed: torch.Tensor, bits: int, shape: torch.Size, book: torch.Tensor, mask, xstd: torch.Tensor,
                gamma_invstd: torch.Tensor, *, g: Optional[torch.Tensor] = None, sum_g: Optional[torch.Tensor] = None,
                grad: Optional[torch.Tensor] = None, act: str = "relu", slope: float = 0.0,
                exact: Optional[Tuple[torch.Tensor, torch.Tensor]] = None, out: Optional[torch.Tensor] = None,
                solve: Optional[torch.Tensor] = None, top: float = 0.0, keep_g: bool = True,
                out_dtype: torch.dtype = torch.float32, g_into: Optional[torch.Tensor] = None
                ) -> Tuple[torch.Tensor, torch.Tensor, Optional[torch.Tensor], torch.Tensor]:
    """``stash._bn_backward`` in two passes over the code with no full-size x̂ (``mo_bn_backward``; x̂ / std from the
    code ``book`` or grid rows: ``_book``): from ``g`` and
    its per-channel ``sum_g``, or from ``grad``, the gradient arriving at the activation, whose
    backward through ``mask`` (a bool tensor or a ``PackedMask``) gives g and sum_g in the same first pass. The
    input gradient goes to ``out`` (which may be ``g``: each element is read before it is written), else to a new
    tensor of ``out_dtype``.
    ``grad``, ``g`` and ``out`` may be float32 or bfloat16: a bf16 one is widened (and g, grad_x narrowed, rounding
    to nearest even) a block at a time in the kernel, so autocast's backward makes no full-size float32 copy. A g
    made from a bf16 ``grad`` is bf16 (exact where the activation's backward is a selection: ReLU, ReLU6); the sums
    and the input gradient are the float32 ones the plain path's ``.float()`` / ``.to(bfloat16)`` give.
    ``solve`` (with ``grad``): the scale identity's rows (R, β, γ, threshold, sign, ok) per channel
    (``memopt.stash.identity.solve_rows``): the weight gradient is solved in between the two passes, ``top`` (6 for
    ReLU6, else 0) times the clipped elements' gradient summed in the first.
    ``keep_g`` False (with ``grad`` and a mask): g is not returned (None) and never exists at full size; each
    pass makes it a block at a time (a full-size write and read fewer, the same grad_x).
    ``g_into`` (with ``grad``, ``keep_g``, grad's dtype): g is written there, which may be ``grad`` itself (each
    element is read before it is written, and the second pass reads g only), except with ``solve`` at a nonzero
    ``top``, whose clipped sums read grad after the first pass.
    Returns (grad_x, sum of g times centred x̂, g, sum_g)."""
    n, channels, inner = _geometry(shape)
    table, is_book, split = _book(book)
    m = _u8(mask)
    if not keep_g and (grad is None or mask is None):
        raise ValueError("bn_backward(keep_g=False) needs grad and a mask: g is made from them a block at a time")
    for name, t in (("grad", grad), ("g", g), ("out", out)):
        if t is not None and t.dtype not in _BN_DTYPES:
            raise ValueError(f"native.bn_backward: {name} must be float32 or bfloat16, got {t.dtype}; convert it or "
                             f"use memopt.stash.bn.bn_backward, which falls back to the plain path")
    if out is None and out_dtype not in _BN_DTYPES:
        raise ValueError(f"native.bn_backward: out_dtype must be float32 or bfloat16, got {out_dtype}")
    if g_into is not None and (grad is None or not keep_g or g_into.dtype != grad.dtype or g_into.shape != shape
                               or not g_into.is_contiguous() or (g_into is grad and solve is not None and top)):
        raise ValueError("native.bn_backward: g_into must be a contiguous tensor of grad's shape and dtype, with "
                         "grad and keep_g, and not grad itself where solve clips (top != 0)")
    if grad is not None:
        g = (g_into if g_into is not None else torch.empty(shape, dtype=grad.dtype)) if keep_g else None
        sum_g = torch.empty(channels, dtype=torch.float32)
    else:
        sum_g = sum_g.float().contiguous()
    exact_val, exact_ok = (None, None) if exact is None else (exact[0].float().contiguous(),
                                                              exact[1].to(torch.uint8).contiguous())
    sum_gx = torch.empty(channels, dtype=torch.float32)
    out = torch.empty(shape, dtype=out_dtype) if out is None else out
    types = sum(flag for t, flag in ((grad, 1), (g, 2), (out, 4)) if t is not None and t.dtype == torch.bfloat16)
    solve_c = None if solve is None else solve.float().contiguous()
    per = [t.float().contiguous() for t in (xstd, gamma_invstd)]
    if _runs(packed, *([] if g is None else [g])) and n:
        _library().mo_bn_backward(packed.data_ptr(), packed.numel(), bits, n, channels, inner, table.data_ptr(), is_book,
                                  split, _ptr(m), _is_bits(mask), per[0].data_ptr(), _ptr(grad),
                                  _ACTS[act], float(slope), _ptr(g), sum_g.data_ptr(), per[1].data_ptr(),
                                  _ptr(exact_val), _ptr(exact_ok), _ptr(solve_c), float(top), out.data_ptr(),
                                  sum_gx.data_ptr(), types, _threads(n))
    return out, sum_gx, g, sum_g


def act_mask(z: torch.Tensor, act: str) -> torch.Tensor:
    """``memopt.stash.grid._mask`` (ReLU / ReLU6 / LeakyReLU) of a float32 or bfloat16 tensor in one pass, as
    bool."""
    out = torch.empty(z.shape, dtype=torch.uint8)
    wide = _wide(z)
    if _runs(z) and z.numel():
        _library().mo_act_mask(z.data_ptr(), wide, z.numel(), _ACTS[act], out.data_ptr(), _threads(z.numel()))
    return out.view(torch.bool)


def channel_extremes(x: torch.Tensor, mask: Optional[torch.Tensor] = None) -> torch.Tensor:
    """Per channel of a float32 or bfloat16 ``x``: rows (least, greatest where the mask is 0, least where it is 1,
    greatest) in one pass (without a mask rows 1 and 2 are ±inf); an empty side gives ±inf, a NaN channel NaN."""
    n, channels, inner = _geometry(x.shape)
    out = torch.empty(4, channels, dtype=torch.float32)
    wide = _wide(x)
    if _runs(x) and n:
        _library().mo_channel_extremes(x.data_ptr(), wide, _ptr(_u8(mask)), n, channels, inner, out.data_ptr(),
                                       _threads(n))
    return out


def chain_grid(invstd: torch.Tensor, xstd: torch.Tensor, weight: Optional[torch.Tensor], bias: Optional[torch.Tensor],
               mean: torch.Tensor, raw: Optional[torch.Tensor], inner: bool, bits: int, half: float, reach: float,
               past: float, split: bool, relu6: bool, residual: bool, data_ends: bool, affine: bool
               ) -> Tuple[torch.Tensor, torch.Tensor, torch.Tensor, Optional[torch.Tensor]]:
    """A chain's per-channel constants in one call (``memopt.stash.grid.x_code``): the encode scale, the grid,
    the grid as the encoder takes it (widths at least FLT_MIN) and, with ``affine``, the consumers' rows."""
    channels = invstd.numel()
    rows = 4 if split else 2
    per = [None if t is None else t.detach().float().contiguous() for t in (invstd, xstd, weight, bias, mean, raw)]
    scale = torch.empty(channels)
    grid, enc = torch.empty(rows, channels), torch.empty(rows, channels)
    aff = torch.empty(rows, channels) if affine else None
    if _runs(invstd, mean) and channels:
        _library().mo_chain_grid(channels, per[0].data_ptr(), per[1].data_ptr(), _ptr(per[2]), _ptr(per[3]),
                                 per[4].data_ptr(), _ptr(per[5]), int(inner), bits, float(half), float(reach),
                                 float(past), int(split), int(relu6), int(residual), int(data_ends), scale.data_ptr(),
                                 grid.data_ptr(), enc.data_ptr(), _ptr(aff))
    return scale, grid, enc, aff
