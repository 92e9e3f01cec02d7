"""The BN-chain stash's codecs (``memopt.stash.grid``) as Triton kernels: one launch codes, one rebuilds.

Why: on CUDA the plain codecs are chains of small PyTorch kernels launched from Python, a batch slice at a time
(subtract the mean, scale, subtract the grid's origin, divide, ceil, clamp, the same again for the other side of a
split code, a select, then the shifts and ors of packing; bin means add a float temporary, an index tensor and two
``index_add_``), each a full read or write of the tensor. Here the x̂ code (or a z code) of a whole tensor is one
launch that reads x (and the 1-bit-worth mask) once and writes the packed bytes, adding the bins' fixed-point
offsets with integer atomics, and the rebuild is one launch that reads the codes (packed or not) and writes the
float32 values; a consumer's rebuild of act(z) (``rebuild_act``) and the activation's mask read from a z code
(``mask_from_codes``) are one launch each too. No host synchronisation and no data-dependent Python branch.

Bit-identical to the plain path (and to the C kernels, ``memopt.runtime.native``):
- codes: v = (x - mean) * (invstd / max(xstd, 1e-12)) in float32 (x̂ codes; a z code is coded as it is; where x
  and its BN statistics are both bfloat16 or float16, each step rounded to that dtype, as the plain path's
  in-place ops do), then r = (v - lo) / max(w, FLT_MIN) (x̂ codes clamp the width, z codes do not) and
  k = clamp(ceil(r) - 1, 0, 2^K - 1) with the side's (lo, w) where the code is split by the mask; a NaN codes 0,
  as PyTorch's float -> uint8 cast and the C kernels give. Divisions are ``div_rn`` (IEEE, as PyTorch's), and
  kernels are launched without FMA contraction (``enable_fp_fusion=False``) so every product is rounded before its
  sum, as in PyTorch;
- a z code's sign fix: positive z (``not z <= 0`` after ReLU / ReLU6, ``z > 0`` otherwise) to codes >= j, the rest
  below (``memopt.stash.ops.BNActStash``);
- bin means: every ``stride``-th element by its index in the tensor adds the integer 2^20 clamp(r - k, ±2^16)
  (truncated toward zero) and a count of 1 where r - k is finite, at its channel, side and code: integers add
  exactly in any order, so the atomics' order does not matter (``memopt.stash.grid.add_bin_sums``);
- act(z): the C kernel's ``activation_at`` element for element (ReLU: z < 0 ? 0 : z inside the mask, 0 outside;
  ReLU6 6 outside where z > 3; LeakyReLU the slope times z outside where z is not > 0), a NaN kept inside;
- rebuild: the code book's entry (bin means), or the midpoint (k + 0.5) * w + lo, the side chosen by the mask
  (the plain path's CPU ``lerp`` by a 0/1 mask selects exactly when both sides' rows are finite, which a grid's
  always are);
- packing: the LSB-first stream of ``memopt.runtime.bitpack``, in the tensor's logical (row-major) order whatever
  its layout (channels_last is read through its strides).

Under the cost model's fake tensors nothing is launched: the same outputs are allocated, so the estimated peak is
the one measured on this path. Kernels are made and launched through ``memopt.runtime.triton_fewbit`` (one place
that wraps them per value of ``TRITON_INTERPRET`` and counts launches); pool offsets, 1-bit masks and the generic
stash's groups are in ``memopt.runtime.triton_stash_extras``.
"""
from __future__ import annotations

from typing import Optional, Tuple

import torch

from memopt.runtime import triton_fewbit
from memopt.runtime.triton_fewbit import AVAILABLE, tl, triton

# what the stash's Triton kernels read: floats (x, z, dropout noise), codes and masks, max-pool indices
DTYPES = (torch.float32, torch.bfloat16, torch.float16, torch.uint8, torch.bool, torch.int64)
_sum = triton_fewbit._sum


def _chain_encode(x_ptr, m_ptr, out_ptr, mean_ptr, invstd_ptr, xstd_ptr, grid_ptr, zc_ptr, sums_ptr,
                  n, C, S, xn, xc, xs, mn, mc, ms, nbytes, stride_sum,
                  BITS: tl.constexpr, CENTRE: tl.constexpr, SPLIT: tl.constexpr, ZERO: tl.constexpr,
                  POS_NOT_LE: tl.constexpr, SUMS: tl.constexpr, LOWP: tl.constexpr, GROUPS: tl.constexpr):
    # one program: GROUPS groups of 8 logical elements -> GROUPS * BITS bytes; element (b, c, s) of the (N, C, S)
    # view read through its strides
    pid = tl.program_id(0).to(tl.int64)
    group = pid * GROUPS + tl.arange(0, GROUPS).to(tl.int64)
    lane = tl.arange(0, 8)
    idx = group[:, None] * 8 + lane[None, :]
    valid = idx < n
    s = idx % S
    rest = idx // S
    c = rest % C
    b = rest // C
    x = tl.load(x_ptr + (b * xn + c * xc + s * xs), mask=valid, other=0.0).to(tl.float32)
    v = x
    if CENTRE:  # x̂ / its std: (x - mean) * (invstd / max(xstd, 1e-12)), NaN kept
        sd = tl.load(xstd_ptr + c, mask=valid, other=1.0)
        sd = tl.where(sd < 1e-12, 1e-12, sd)
        scale = tl.math.div_rn(tl.load(invstd_ptr + c, mask=valid, other=1.0), sd)
        v = x - tl.load(mean_ptr + c, mask=valid, other=0.0)
        # LOWP: x and its BN statistics in bfloat16 (1) or float16 (2): the plain path's in-place ops round every
        # step to that dtype, here by hand (bfloat16 to nearest even: the interpreter's cast truncates)
        if LOWP == 1:
            u = v.to(tl.uint32, bitcast=True)
            v = tl.where(v != v, v, (((u + 0x7FFF + ((u >> 16) & 1)) >> 16) << 16).to(tl.float32, bitcast=True))
        elif LOWP == 2:
            v = v.to(tl.float16).to(tl.float32)
        v = v * scale
        if LOWP == 1:
            u = v.to(tl.uint32, bitcast=True)
            v = tl.where(v != v, v, (((u + 0x7FFF + ((u >> 16) & 1)) >> 16) << 16).to(tl.float32, bitcast=True))
        elif LOWP == 2:
            v = v.to(tl.float16).to(tl.float32)
    lo = tl.load(grid_ptr + c, mask=valid, other=0.0)
    w = tl.load(grid_ptr + C + c, mask=valid, other=1.0)
    side = tl.full([GROUPS, 8], 0, tl.int32)
    if SPLIT:
        side = (tl.load(m_ptr + (b * mn + c * mc + s * ms), mask=valid, other=0) != 0).to(tl.int32)
        lo = tl.where(side != 0, tl.load(grid_ptr + 2 * C + c, mask=valid, other=0.0), lo)
        w = tl.where(side != 0, tl.load(grid_ptr + 3 * C + c, mask=valid, other=1.0), w)
    if CENTRE:
        w = tl.where(w < 1.1754943508222875e-38, 1.1754943508222875e-38, w)  # clamp_min(FLT_MIN), NaN kept
    r = v - lo
    if LOWP == 1:
        u = r.to(tl.uint32, bitcast=True)
        r = tl.where(r != r, r, (((u + 0x7FFF + ((u >> 16) & 1)) >> 16) << 16).to(tl.float32, bitcast=True))
    elif LOWP == 2:
        r = r.to(tl.float16).to(tl.float32)
    r = tl.math.div_rn(r, w)
    if LOWP == 1:
        u = r.to(tl.uint32, bitcast=True)
        r = tl.where(r != r, r, (((u + 0x7FFF + ((u >> 16) & 1)) >> 16) << 16).to(tl.float32, bitcast=True))
    elif LOWP == 2:
        r = r.to(tl.float16).to(tl.float32)
    q = tl.math.ceil(r) - 1.0
    q = tl.where(q > 0.0, q, 0.0)  # NaN -> 0
    top = ((1 << BITS) - 1) * 1.0
    q = tl.where(q < top, q, top)
    code = q.to(tl.int32)
    if ZERO:  # rounding never flips a sign: positive z to codes >= j, the rest below
        j = tl.load(zc_ptr + c, mask=valid, other=1)
        if POS_NOT_LE:
            positive = (x > 0.0) | (x != x)
        else:
            positive = x > 0.0
        code = tl.where(positive, tl.maximum(code, j), tl.minimum(code, j - 1))
    if SUMS:
        t = r - code.to(tl.float32)
        finite = tl.abs(t) < float("inf")
        t = tl.where(finite, t, 0.0)
        t = tl.where(t < -65536.0, -65536.0, tl.where(t > 65536.0, 65536.0, t))
        fixed = (t * 1048576.0).to(tl.int64)
        width = (1 << BITS) * (2 if SPLIT else 1)
        at = c * width + code + (side << BITS)
        pick = valid & (idx % stride_sum == 0)
        tl.atomic_add(sums_ptr + at, fixed, mask=pick)
        tl.atomic_add(sums_ptr + C * width + at, finite.to(tl.int64), mask=pick)
    code = tl.where(valid, code, 0).to(tl.int64)
    word = tl.reduce(code << (lane[None, :] * BITS).to(tl.int64), 1, _sum)  # disjoint bit fields: sum == or
    out_offs = group[:, None] * BITS + lane[None, :]
    byte = (word[:, None] >> (lane[None, :] * 8).to(tl.int64)) & 0xFF
    tl.store(out_ptr + out_offs, byte.to(tl.uint8), mask=(lane[None, :] < BITS) & (out_offs < nbytes))


def _packed_code(codes_ptr, idx, valid, nbytes, BITS: tl.constexpr):
    # device function: the K bits of element idx from the LSB-first stream (they may straddle two bytes)
    bit = idx * BITS
    byte = bit >> 3
    lo_byte = tl.load(codes_ptr + byte, mask=valid, other=0).to(tl.int32)
    hi_byte = tl.load(codes_ptr + byte + 1, mask=valid & (byte + 1 < nbytes), other=0).to(tl.int32)
    return ((lo_byte | (hi_byte << 8)) >> (bit & 7).to(tl.int32)) & ((1 << BITS) - 1)


def _mask_bit(m_ptr, idx, valid, MASK_BITS: tl.constexpr):
    # device function: element idx of a mask, 0/1 bytes or (MASK_BITS) its 1-bit stream, as int32 0/1
    if MASK_BITS:
        return (tl.load(m_ptr + (idx >> 3), mask=valid, other=0).to(tl.int32) >> (idx & 7).to(tl.int32)) & 1
    return (tl.load(m_ptr + idx, mask=valid, other=0) != 0).to(tl.int32)


def _code_value(table_ptr, code, side, c, valid, C, BITS: tl.constexpr, SPLIT: tl.constexpr, BOOK: tl.constexpr):
    # device function: the value of code k on its channel c and side: a book (C, sides, 2^K) entry, or the grid
    # rows' (lo0, w0[, lo1, w1] x C) midpoint (k + 1/2) w + lo, rounded after each step
    if BOOK:
        return tl.load(table_ptr + c * ((1 << BITS) * (2 if SPLIT else 1)) + (side << BITS) + code, mask=valid,
                       other=0.0)
    lo = tl.load(table_ptr + c, mask=valid, other=0.0)
    w = tl.load(table_ptr + C + c, mask=valid, other=0.0)
    if SPLIT:
        lo = tl.where(side != 0, tl.load(table_ptr + 2 * C + c, mask=valid, other=0.0), lo)
        w = tl.where(side != 0, tl.load(table_ptr + 3 * C + c, mask=valid, other=0.0), w)
    return (code.to(tl.float32) + 0.5) * w + lo


# the kernels call the device functions by these names, bound to their jitted form by ``bind`` before a launch
_code, _bit, _value = _packed_code, _mask_bit, _code_value


def bind() -> None:
    """Bind the device functions to their jitted form for the current ``TRITON_INTERPRET`` mode: a kernel compiled
    for a GPU can call only jitted functions (a plain one runs only in the interpreter), and the jitted form
    depends on the mode (``triton_fewbit.device``); the same objects each time, as the compiler requires."""
    global _code, _bit, _value
    _code, _bit, _value = (triton_fewbit.device(f) for f in (_packed_code, _mask_bit, _code_value))


def _chain_decode(codes_ptr, m_ptr, table_ptr, out_ptr, n, C, S, nbytes,
                  BITS: tl.constexpr, PACKED: tl.constexpr, SPLIT: tl.constexpr, MASK_BITS: tl.constexpr,
                  BOOK: tl.constexpr, BLOCK: tl.constexpr):
    # one program: BLOCK elements in logical order, each from its channel's book entry or grid midpoint
    idx = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK).to(tl.int64)
    valid = idx < n
    c = (idx // S) % C
    if PACKED:
        code = _code(codes_ptr, idx, valid, nbytes, BITS)
    else:
        code = tl.load(codes_ptr + idx, mask=valid, other=0).to(tl.int32)
    side = code * 0
    if SPLIT:
        side = _bit(m_ptr, idx, valid, MASK_BITS)
    tl.store(out_ptr + idx, _value(table_ptr, code, side, c, valid, C, BITS, SPLIT, BOOK), mask=valid)


# where a rebuilt activation's mask comes from (``rebuild_act``): none (identity), 0/1 bytes, a 1-bit stream, or
# the z code itself (k >= zero_code[c])
_FROM_NONE, _FROM_BYTES, _FROM_BITS, _FROM_CODE = 0, 1, 2, 3
_ACTS = {"identity": 0, "relu": 1, "relu6": 2, "leaky_relu": 3}


def _chain_rebuild(codes_ptr, m_ptr, table_ptr, zc_ptr, out_ptr, n, C, S, nbytes, slope,
                   BITS: tl.constexpr, SPLIT: tl.constexpr, SOURCE: tl.constexpr, BOOK: tl.constexpr,
                   ACT: tl.constexpr, MASK_ONLY: tl.constexpr, BLOCK: tl.constexpr):
    # one program: BLOCK elements in logical order: act(z) with z from the book or grid midpoint on the mask's side
    # (the C kernel's activation_at, element for element); MASK_ONLY: just the mask k >= zero_code as 0/1 bytes
    idx = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK).to(tl.int64)
    valid = idx < n
    c = (idx // S) % C
    code = _code(codes_ptr, idx, valid, nbytes, BITS)
    on = code * 0 + 1
    if SOURCE == 1:
        on = _bit(m_ptr, idx, valid, False)
    elif SOURCE == 2:
        on = _bit(m_ptr, idx, valid, True)
    elif SOURCE == 3:
        on = (code >= tl.load(zc_ptr + c, mask=valid, other=0)).to(tl.int32)
    if MASK_ONLY:
        tl.store(out_ptr + idx, on.to(tl.uint8), mask=valid)
    else:
        z = _value(table_ptr, code, on if SPLIT else code * 0, c, valid, C, BITS, SPLIT, BOOK)
        kept = tl.where(z < 0.0, 0.0, z)
        if ACT == 1:
            z = tl.where(on != 0, kept, 0.0)
        elif ACT == 2:
            z = tl.where(on != 0, tl.where(kept > 6.0, 6.0, kept), tl.where(z > 3.0, 6.0, 0.0))
        elif ACT == 3:
            z = tl.where(on != 0, kept, tl.where(z > 0.0, 0.0, z) * slope)
        tl.store(out_ptr + idx, z, mask=valid)


def ncs(t: torch.Tensor) -> Tuple[torch.Tensor, Tuple[int, int, int]]:
    """``t`` (N, C, ...) and the strides that walk it as (N, C, S), S its other dimensions flattened: its own
    strides where they merge (contiguous, channels_last), else a contiguous copy's (gapped views, rare)."""
    shape, stride = t.shape, t.stride()
    dims = [d for d in range(2, t.dim()) if shape[d] != 1]
    if any(stride[a] != stride[b] * shape[b] for a, b in zip(dims, dims[1:])):
        t = t.contiguous()
        stride = t.stride()
    step = stride[dims[-1]] if dims else 0
    return t, (stride[0], stride[1] if t.dim() > 1 else 0, step)


def _geometry(shape) -> Tuple[int, int, int]:
    """(elements, channels, elements per channel and sample) of an (N, C, ...) shape."""
    n = shape.numel()
    channels = shape[1] if len(shape) > 1 else 1
    return n, channels, max(1, n // max(1, shape[0] * channels)) if n else 1


def encode(x: torch.Tensor, grid: torch.Tensor, bits: int, *, mean: Optional[torch.Tensor] = None,
           invstd: Optional[torch.Tensor] = None, xstd: Optional[torch.Tensor] = None,
           mask: Optional[torch.Tensor] = None, zero_code: Optional[torch.Tensor] = None,
           positive_not_le: bool = False, sums: Optional[torch.Tensor] = None, sum_stride: int = 1) -> torch.Tensor:
    """Packed K-bit codes of ``x`` (N, C, ...; any layout) on ``grid`` (rows lo0, w0[, lo1, w1] x C, float32):
    with ``mean``, ``invstd`` and ``xstd`` an x̂ code (``memopt.stash.grid._x_codes``: x centred and scaled, widths
    clamped to FLT_MIN), split by ``mask`` where the grid has four rows; with ``zero_code`` a z code's sign fix
    (``memopt.stash.ops.BNActStash``). ``sums`` (``memopt.stash.grid.new_bin_sums``, int64, added to in place):
    the bin means' fixed-point offsets and counts of every ``sum_stride``-th element."""
    n, channels, inner = _geometry(x.shape)
    nbytes = (n * bits + 7) // 8
    out = torch.empty(nbytes, dtype=torch.uint8, device=x.device)
    split = grid.shape[0] == 4
    centre = mean is not None
    if centre and (invstd is None or xstd is None):
        raise ValueError("encode(mean=...) codes x̂ = (x - mean) * invstd / xstd: pass invstd and xstd too")
    if split and mask is None:
        raise ValueError(f"a split grid (4 rows) needs the mask that picks each element's side; got mask=None for "
                         f"x of shape {tuple(x.shape)}: pass the activation's mask, or a 2-row grid")
    if sums is not None and sums.shape != (2, channels, (2 if split else 1) << bits):
        raise ValueError(f"sums must be new_bin_sums({channels}, {2 if split else 1}, {bits}) of shape "
                         f"{(2, channels, (2 if split else 1) << bits)}, got {tuple(sums.shape)}")
    if not n:
        return out
    xv, (xn, xc, xs) = ncs(x)
    mv, (mn, mc, ms) = ncs(mask.view(torch.uint8) if mask.dtype == torch.bool else mask) if split else (out, (0, 0, 0))
    per = [t.float().contiguous() if t is not None else out for t in (mean, invstd, xstd)]
    table = grid.float().contiguous()
    zc = zero_code.to(torch.int32).contiguous() if zero_code is not None else out
    # the dtype the plain path centres in: x's with statistics of its own low precision, else float32
    lowp = {torch.bfloat16: 1, torch.float16: 2}.get(torch.result_type(x, mean), 0) if centre else 0
    groups = triton_fewbit._groups(x)
    triton_fewbit._launch(_chain_encode, (triton.cdiv(n, groups * 8),), xv, mv, out, *per, table, zc,
                          sums if sums is not None else out, n, channels, inner, xn, xc, xs, mn, mc, ms, nbytes,
                          int(sum_stride), BITS=bits, CENTRE=centre, SPLIT=split, ZERO=zero_code is not None,
                          POS_NOT_LE=bool(positive_not_le), SUMS=sums is not None, LOWP=lowp, GROUPS=groups,
                          enable_fp_fusion=False)
    return out


def _decode(source: torch.Tensor, packed: bool, bits: int, shape: torch.Size, grid: torch.Tensor,
            mask: Optional[torch.Tensor], mask_bits: bool) -> torch.Tensor:
    n, channels, inner = _geometry(shape)
    out = torch.empty(shape, dtype=torch.float32, device=source.device)
    book = grid.dim() == 3
    split = grid.shape[1] == 2 if book else grid.shape[0] == 4
    if book and grid.shape[2] != 1 << bits:
        raise ValueError(f"a code book for {bits}-bit codes has {1 << bits} entries per side, got "
                         f"{grid.shape[2]} (shape {tuple(grid.shape)}); pass the book code_book made for {bits} bits")
    if split and mask is None:
        raise ValueError(f"a split code ({'two sides' if book else 'four rows'}) needs the mask that picks each "
                         f"element's side; got mask=None for shape {tuple(shape)}")
    if not n:
        return out
    m = out
    if split:
        m = mask.view(torch.uint8) if mask.dtype == torch.bool else mask
        m = m if m.is_contiguous() else m.contiguous()
    block = triton_fewbit._groups(source) * 8
    bind()
    triton_fewbit._launch(_chain_decode, (triton.cdiv(n, block),), source, m, grid.float().contiguous(), out, n,
                          channels, inner, source.numel(), BITS=bits, PACKED=packed, SPLIT=split,
                          MASK_BITS=mask_bits, BOOK=book, BLOCK=block, enable_fp_fusion=False)
    return out


def from_codes(codes: torch.Tensor, mask: Optional[torch.Tensor], grid: torch.Tensor) -> torch.Tensor:
    """``memopt.stash.grid._from_codes``: float32 values of unpacked uint8 ``codes`` (N, C, ...) from a code book
    (C, sides, 2^K) or grid rows (lo0, w0[, lo1, w1] x C), the side from the bool ``mask``."""
    bins = grid.shape[2] if grid.dim() == 3 else 256
    bits = max(1, (bins - 1).bit_length())
    dense = codes if codes.is_contiguous() else codes.contiguous()
    return _decode(dense, False, bits, codes.shape, grid, mask, False)


def rebuild(packed: torch.Tensor, bits: int, shape: torch.Size, grid: torch.Tensor,
            mask: Optional[torch.Tensor] = None, mask_bits: bool = False) -> torch.Tensor:
    """Unpack and ``from_codes`` in one launch: the float32 values of ``shape`` coded in ``packed``; ``mask`` a bool
    tensor of ``shape`` or, with ``mask_bits``, its 1-bit stream (``pack_bits(mask, 1)``)."""
    return _decode(packed, True, bits, torch.Size(shape), grid, mask, mask_bits)


def _rebuild_launch(packed, bits, shape, table, mask, zero_code, act, slope, mask_only):
    n, channels, inner = _geometry(shape)
    out = torch.empty(shape, dtype=torch.uint8 if mask_only else torch.float32, device=packed.device)
    book = table is not None and table.dim() == 3
    split = not mask_only and (table.shape[1] == 2 if book else table.shape[0] == 4)
    source = _FROM_CODE if mask is None and zero_code is not None else (
        _FROM_NONE if mask is None else (_FROM_BITS if mask.dtype == torch.uint8 and mask.numel() != n else
                                         _FROM_BYTES))
    if split and source == _FROM_NONE:
        raise ValueError(f"a split code needs the mask that picks each element's side; got neither a mask nor a "
                         f"zero code for shape {tuple(shape)}")
    if not n:
        return out
    m = out if mask is None else (mask.view(torch.uint8) if mask.dtype == torch.bool else mask).contiguous()
    zc = out if zero_code is None else zero_code.to(torch.int32).contiguous()
    block = triton_fewbit._groups(packed) * 8
    rows = out if mask_only else table.float().contiguous()  # the mask alone reads no table
    bind()
    triton_fewbit._launch(_chain_rebuild, (triton.cdiv(n, block),), packed, m, rows, zc, out,
                          n, channels, inner, packed.numel(), float(slope), BITS=bits, SPLIT=split, SOURCE=source,
                          BOOK=book, ACT=_ACTS[act], MASK_ONLY=mask_only, BLOCK=block, enable_fp_fusion=False)
    return out


def rebuild_act(packed: torch.Tensor, bits: int, shape: torch.Size, affine: torch.Tensor, act: str,
                slope: float = 0.0, *, mask: Optional[torch.Tensor] = None,
                zero_code: Optional[torch.Tensor] = None) -> torch.Tensor:
    """``memopt.stash.ops._Stash.rebuild`` in one launch: act(z) (float32, ``shape``) from the packed z code on
    ``affine`` (grid rows or a code book), the exact mask from ``mask`` (bool / 0-1 bytes of ``shape``, or its
    1-bit stream as uint8 of (n + 7) // 8 bytes), else from the code (k >= ``zero_code``), else none (identity)."""
    return _rebuild_launch(packed, bits, torch.Size(shape), affine, mask, zero_code, act, slope, False)


def mask_from_codes(packed: torch.Tensor, bits: int, shape: torch.Size, zero_code: torch.Tensor) -> torch.Tensor:
    """``memopt.stash.grid._decode_mask`` from a z code: k >= ``zero_code`` per channel, a bool tensor of ``shape``
    (one launch)."""
    return _rebuild_launch(packed, bits, torch.Size(shape), None, None, zero_code, "identity", 0.0,
                           True).view(torch.bool)


__all__ = ["AVAILABLE", "DTYPES", "encode", "from_codes", "rebuild", "rebuild_act", "mask_from_codes", "ncs"]
