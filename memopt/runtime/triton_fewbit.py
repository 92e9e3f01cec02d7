"""Few-bit backward's hot loops as two Triton kernels: encode + pack in forward, unpack + gather + scale in backward.

Why: on CUDA the plain path (``memopt.fewbit.ops``) is a chain of small PyTorch kernels launched from Python (one
comparison and one add per border, shifts and ors per packed byte, a float32 sum, a host-to-device copy of the
levels, then unpack, gather and multiply in backward), each a full read or write of the tensor. Here forward is one
launch that reads x once and writes ceil(n*b/8) bytes, and backward one launch that reads the codes and the gradient
once and writes the input gradient; no host synchronisation and no data-dependent Python branch.

Bit-identical to the plain path:
- codes: the number of borders strictly below x, compared in float32 against borders already rounded to x's dtype
  (exact in float32), found by binary lifting over the sorted borders; a NaN gets code 0, as ``x > border`` gives,
  or, with more than 15 borders, the top code, as ``torch.bucketize`` (the plain path's choice there) gives;
- masks: the comparisons of ``memopt.fewbit.activations`` against bounds rounded to x's dtype, NaN included;
- packing: the LSB-first stream of ``memopt.runtime.bitpack`` (eight codes of b bits fill b bytes, any b);
- backward: the product is formed in float32 and rounded once to the gradient's dtype, as PyTorch's CPU and CUDA
  kernels do (both factors are exact in float32, so the float32 product is exact for half types); bfloat16 is
  rounded by hand (round to nearest even) because the interpreter's float32 -> bfloat16 cast truncates.
One difference, documented: a table op's levels are poisoned with NaN when a block's float32 sum of x is not finite
(any NaN or inf element), where the plain path tests the sum of the whole tensor, which also overflows when finite
values sum past 3.4e38.

Under the cost model's fake tensors nothing is launched: the same outputs are allocated (as ``memopt.runtime.native``
does), so the estimated peak is the one measured on this path, which allocates less than the plain one.

Kernels are wrapped with ``triton.jit`` on first use, once per value of ``TRITON_INTERPRET``: the interpreter runs
them on CPU tensors (the tests), the compiler on CUDA ones. Without triton, ``AVAILABLE`` is False and nothing here
may be called (``memopt.runtime.kernels`` decides).
"""
from __future__ import annotations

import math
import os
from typing import Callable, Dict, Optional, Sequence, Tuple

import torch
from torch._subclasses.fake_tensor import FakeTensor

try:  # optional: memopt must import and run without triton (the plain path is the reference)
    import triton
    import triton.language as tl
    IMPORT_ERROR = ""
except Exception as error:  # ImportError, or a broken install that fails while importing
    triton = tl = None
    IMPORT_ERROR = f"{type(error).__name__}: {error}"

AVAILABLE = triton is not None
DTYPES = (torch.float32, torch.bfloat16, torch.float16)
MAX_RANK = 4  # dimensions the backward kernel walks after merging; more (rare) take the plain path

# mask kinds (``encode_mask``): the code is NOT(x <= lo OR x >= hi), NaN passing (relu, relu6, hardtanh,
# threshold), or x > lo AND x < hi, NaN blocked (leaky_relu, hardsigmoid); hi None leaves its test out
OUTSIDE_CLOSED, INSIDE_OPEN = 1, 2
_TABLE = 0
# tl.sum's own combiner, called through tl.reduce: tl.sum and tl.zeros are JIT functions made when triton is imported,
# which the interpreter cannot call unless TRITON_INTERPRET was set by then; builtins work either way
_sum = tl.standard._sum_combine if AVAILABLE else None


def interpreting() -> bool:
    """Whether triton runs kernels in its CPU interpreter (``TRITON_INTERPRET=1``), read now, not at import."""
    if not AVAILABLE:
        return False
    knobs = getattr(triton, "knobs", None)  # triton >= 3.4; older ones read the variable directly
    if knobs is not None:
        return bool(knobs.runtime.interpret)
    return os.environ.get("TRITON_INTERPRET", "0").lower() in ("1", "true", "on", "yes")


def _encode_pack(x_ptr, out_ptr, borders_ptr, levels_ptr, n, nbytes, nborders, nlevels, lo, hi,
                 BITS: tl.constexpr, STEPS: tl.constexpr, MODE: tl.constexpr, HAS_HI: tl.constexpr,
                 NAN_TOP: tl.constexpr, NLEVELS: tl.constexpr, GROUPS: tl.constexpr):
    # one program: GROUPS groups of 8 elements -> GROUPS * BITS bytes (the group's 8*BITS-bit word, LSB first)
    pid = tl.program_id(0).to(tl.int64)
    group = pid * GROUPS + tl.arange(0, GROUPS).to(tl.int64)
    lane = tl.arange(0, 8)
    offs = group[:, None] * 8 + lane[None, :]
    valid = offs < n
    x = tl.load(x_ptr + offs, mask=valid, other=0.0).to(tl.float32)
    if MODE == 0:
        code = tl.full([GROUPS, 8], 0, tl.int32)
        for s in tl.static_range(STEPS):  # binary lifting: code = number of borders < x (borders sorted)
            cand = code + (1 << (STEPS - 1 - s))
            border = tl.load(borders_ptr + (cand - 1), mask=valid & (cand <= nborders), other=float("inf"))
            code = tl.where(x > border, cand, code)
        if NAN_TOP:
            code = tl.where(x != x, nborders, code)
        # non-finite input (a block's float32 sum is NaN or inf): poison the levels, as the plain path does
        total = tl.reduce(tl.reduce(tl.where(valid, x, 0.0), 1, _sum), 0, _sum)
        k = tl.arange(0, NLEVELS)
        bad = tl.full([NLEVELS], 0.0, tl.float32) + (total - total)  # 0 if finite, else NaN
        tl.store(levels_ptr + k, bad, mask=(k < nlevels) & (bad != 0.0))
    elif MODE == 1:
        blocked = x <= lo
        if HAS_HI:
            blocked = blocked | (x >= hi)
        code = tl.where(blocked, 0, 1)
    else:
        passed = x > lo
        if HAS_HI:
            passed = passed & (x < hi)
        code = tl.where(passed, 1, 0)
    code = tl.where(valid, code, 0).to(tl.int64)
    word = tl.reduce(code << (lane[None, :] * BITS).to(tl.int64), 1, _sum)  # disjoint bit fields: sum == or
    out_offs = group[:, None] * BITS + lane[None, :]
    byte = (word[:, None] >> (lane[None, :] * 8).to(tl.int64)) & 0xFF
    tl.store(out_ptr + out_offs, byte.to(tl.uint8), mask=(lane[None, :] < BITS) & (out_offs < nbytes))


def _unpack_scale(packed_ptr, grad_ptr, out_ptr, levels_ptr, n, nbytes,
                  s1, s2, s3, g0, g1, g2, g3, c0, c1, c2, c3, o0, o1, o2, o3, low, high,
                  BITS: tl.constexpr, EXACT: tl.constexpr, HIGH_ONE: tl.constexpr, LOW_ZERO: tl.constexpr,
                  OUT_BF16: tl.constexpr, BLOCK: tl.constexpr):
    # one program: BLOCK elements of the (merged, at most 4-D) index space, in the output's memory order
    idx = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK).to(tl.int64)
    valid = idx < n
    i3 = idx % s3
    rest = idx // s3
    i2 = rest % s2
    rest = rest // s2
    i1 = rest % s1
    i0 = rest // s1
    code_at = i0 * c0 + i1 * c1 + i2 * c2 + i3 * c3
    bit = code_at * BITS
    byte = bit >> 3
    lo_byte = tl.load(packed_ptr + byte, mask=valid, other=0).to(tl.int32)
    hi_byte = tl.load(packed_ptr + byte + 1, mask=valid & (byte + 1 < nbytes), other=0).to(tl.int32)
    code = ((lo_byte | (hi_byte << 8)) >> (bit & 7).to(tl.int32)) & ((1 << BITS) - 1)
    g = tl.load(grad_ptr + (i0 * g0 + i1 * g1 + i2 * g2 + i3 * g3), mask=valid, other=0.0).to(tl.float32)
    if EXACT:  # where, not multiply: a masked-out inf/NaN gradient gives 0 (or low * it), as PyTorch's backward
        on = g if HIGH_ONE else g * high
        off = tl.full([BLOCK], 0.0, tl.float32) if LOW_ZERO else g * low
        value = tl.where(code != 0, on, off)
    else:  # levels rounded to the gradient's dtype first, as the plain path's levels.to(grad.dtype)
        level = tl.load(levels_ptr + code, mask=valid, other=0.0)
        if OUT_BF16:  # round to nearest even by hand (c10::round_to_nearest_even; a NaN level stays NaN)
            lb = level.to(tl.uint32, bitcast=True)
            lb = ((lb + 0x7FFF + ((lb >> 16) & 1)) >> 16) << 16
            level = tl.where(level != level, level, lb.to(tl.float32, bitcast=True))
        else:
            level = level.to(out_ptr.dtype.element_ty).to(tl.float32)
        value = g * level
    at = i0 * o0 + i1 * o1 + i2 * o2 + i3 * o3
    if OUT_BF16:  # by hand, as above; NaN -> 0x7FC0 as c10 gives
        vb = value.to(tl.uint32, bitcast=True)
        vb = tl.where(value != value, 0x7FC0, (vb + 0x7FFF + ((vb >> 16) & 1)) >> 16)
        tl.store(out_ptr + at, vb.to(tl.uint16).to(tl.bfloat16, bitcast=True), mask=valid)
    else:
        tl.store(out_ptr + at, value.to(out_ptr.dtype.element_ty), mask=valid)


_jitted: Dict[Tuple[str, bool], Callable] = {}


def _kernel(fn: Callable) -> Callable:
    """``triton.jit(fn)``, made on first use and again if ``TRITON_INTERPRET`` changed (the decorator reads it)."""
    key = (fn.__name__, interpreting())
    if key not in _jitted:
        _jitted[key] = triton.jit(fn)
    return _jitted[key]


def device(fn: Callable) -> Callable:
    """``triton.jit(fn)`` for a device function (called from kernels, never launched itself), made once per value
    of ``TRITON_INTERPRET`` as ``_kernel`` does: the interpreter calls the interpreted form, a GPU compile
    needs the jitted one (a plain Python function there is refused)."""
    key = ("device " + fn.__name__, interpreting())
    if key not in _jitted:
        _jitted[key] = triton.jit(fn)
    return _jitted[key]


def _launch(fn: Callable, grid: Tuple[int], *args, **meta) -> None:
    """Every launch of kernel ``fn`` goes through here (one place to count them:
    tests/runtime/test_triton_fewbit.py); none on fake tensors."""
    if not any(isinstance(a, FakeTensor) for a in args):
        _kernel(fn)[grid](*args, **meta)


def _groups(t: torch.Tensor) -> int:
    # the interpreter pays per program, the GPU wants many: 32768 elements per program on the CPU, 1024 on a GPU
    return 4096 if t.device.type == "cpu" else 128


_constants: Dict[Tuple[Tuple[float, ...], str], torch.Tensor] = {}


def constants(values: Tuple[float, ...], device: torch.device, fake: bool = False) -> torch.Tensor:
    """``values`` as float32 on ``device``, copied there once per table (no host-to-device copy, so no host
    synchronisation, per call); read-only: callers clone what a kernel writes. ``fake``: a fresh tensor made in
    the current fake mode (the cost model), never cached."""
    if fake:
        return torch.empty(len(values), dtype=torch.float32, device=device)
    key = (tuple(values), str(device))
    if key not in _constants:
        _constants[key] = torch.tensor(values, dtype=torch.float32, device=device)
    return _constants[key]


def encode_table(dense: torch.Tensor, borders: torch.Tensor, levels: torch.Tensor, bits: int,
                 nan_top: bool) -> Tuple[torch.Tensor, torch.Tensor]:
    """Packed codes of a contiguous ``dense`` against sorted float32 ``borders`` (already rounded to its dtype), and
    a copy of the float32 ``levels`` set to NaN where some element of ``dense`` is not finite."""
    if borders.numel() >= 1 << bits or levels.numel() > 1 << bits:
        raise ValueError(f"a {bits}-bit table has at most {(1 << bits) - 1} borders and {1 << bits} levels, got "
                         f"{borders.numel()} and {levels.numel()}; pass the table made for {bits} bits")
    n = dense.numel()
    nbytes = (n * bits + 7) // 8
    out = torch.empty(nbytes, dtype=torch.uint8, device=dense.device)
    level_t = levels.clone()
    if n:
        groups = _groups(dense)
        steps = max(1, math.ceil(math.log2(borders.numel() + 1)))
        _launch(_encode_pack, (triton.cdiv(n, groups * 8),), dense, out, borders, level_t, n, nbytes,
                borders.numel(), level_t.numel(), 0.0, 0.0, BITS=bits, STEPS=steps, MODE=_TABLE, HAS_HI=False,
                NAN_TOP=nan_top, NLEVELS=triton.next_power_of_2(level_t.numel()), GROUPS=groups)
    return out, level_t


def encode_mask(dense: torch.Tensor, bits: int, kind: int, lo: float, hi: Optional[float]) -> torch.Tensor:
    """Packed 0/1 codes of a contiguous ``dense``: ``kind`` OUTSIDE_CLOSED or INSIDE_OPEN against the bounds
    ``lo`` and ``hi`` (None: no upper test), both already rounded to its dtype."""
    n = dense.numel()
    nbytes = (n * bits + 7) // 8
    out = torch.empty(nbytes, dtype=torch.uint8, device=dense.device)
    if n:
        groups = _groups(dense)
        _launch(_encode_pack, (triton.cdiv(n, groups * 8),), dense, out, out, out, n, nbytes, 0, 0,
                float(lo), 0.0 if hi is None else float(hi), BITS=bits, STEPS=1, MODE=kind, HAS_HI=hi is not None,
                NAN_TOP=False, NLEVELS=1, GROUPS=groups)
    return out


def _merged(shape: Sequence[int], *strides: Sequence[int]) -> Tuple[list, list]:
    """Size-1 dimensions dropped, the rest ordered by the last stride list (the output's, outermost first) and
    merged where every tensor steps through them as one: the fewest dimensions to walk."""
    dims = sorted((d for d in range(len(shape)) if shape[d] != 1), key=lambda d: -strides[-1][d])
    sizes, steps = [], []
    for d in dims:
        if sizes and all(step[-1] == s[d] * shape[d] for step, s in zip(steps, strides)):
            sizes[-1] *= shape[d]
            for step, s in zip(steps, strides):
                step[-1] = s[d]
        else:
            sizes.append(shape[d])
            steps = [step + [s[d]] for step, s in zip(steps, strides)] if steps else [[s[d]] for s in strides]
    return sizes, steps or [[] for _ in strides]


def scale_fits(grad: torch.Tensor, out: torch.Tensor, code_strides: Sequence[int]) -> bool:
    """Whether the backward kernel can walk these layouts (at most ``MAX_RANK`` dimensions once merged)."""
    return len(_merged(grad.shape, grad.stride(), code_strides, out.stride())[0]) <= MAX_RANK


def unpack_scale(packed: torch.Tensor, bits: int, grad: torch.Tensor, code_strides: Sequence[int],
                 out: torch.Tensor, levels: Optional[torch.Tensor] = None, low: float = 0.0,
                 high: float = 1.0) -> torch.Tensor:
    """``out = grad * levels[code]`` (``levels`` given) or ``where(code, grad * high, grad * low)``, the code of
    each element read from ``packed`` at the offset ``code_strides`` give; ``out`` any layout ``grad.shape``."""
    n = grad.numel()
    if not n:
        return out
    sizes, (gs, cs, os_) = _merged(grad.shape, grad.stride(), code_strides, out.stride())
    if len(sizes) > MAX_RANK:
        raise ValueError(f"unpack_scale walks at most {MAX_RANK} merged dimensions, got {len(sizes)} "
                         f"(shape {tuple(grad.shape)}); check scale_fits first and take the plain path")
    pad = MAX_RANK - len(sizes)
    sizes, gs, cs, os_ = [1] * pad + sizes, [0] * pad + gs, [0] * pad + cs, [0] * pad + os_
    block = _groups(grad) * 8
    exact = levels is None
    _launch(_unpack_scale, (triton.cdiv(n, block),), packed, grad, out, packed if exact else levels, n,
            packed.numel(), sizes[1], sizes[2], sizes[3], *gs, *cs, *os_, float(low), float(high), BITS=bits,
            EXACT=exact, HIGH_ONE=high == 1.0, LOW_ZERO=low == 0.0, OUT_BF16=out.dtype == torch.bfloat16,
            BLOCK=block)
    return out
