"""The stash's other codecs as Triton kernels: max-pool window offsets (``memopt.stash.pool``), 1-bit masks
(dropout, ``where``), the generic stash's groups (``memopt.stash.generic``) and the data's grid ends
(``memopt.stash.grid._ends``: per channel x̂'s least and greatest and, in a residual chain, on either side of
the mask, which were two reductions over x in PyTorch, a full-size float temporary and two masked reductions).

Why: on CUDA each is a chain of small PyTorch kernels launched from Python: the offsets are a floor division,
a remainder and several integer multiplies and adds over the int64 indices before packing (and again backward);
packing a mask is a cast, a pad and eight shift-ors; the generic stash reduces each group, then subtracts,
divides, rounds, clamps, casts and packs, and backward unpacks, multiplies and adds per group. Here each way
is one launch (two to code the generic stash: the groups' minimum and step, then the codes), with no host
synchronisation and no data-dependent Python branch.

Bit-identical to the plain path:
- offsets: the same integer arithmetic (floor divisions of non-negative values), packed in the indices'
  logical order whatever their layout; indices rebuilt as int64 (N, C, OH*OW), as ``pool_indices`` returns;
- masks: ``t != 0`` (a bool is its byte) in the tensor's logical order, strides of any sign or 0 included
  (a broadcast ``where`` condition); unpacked as uint8 0/1 bytes, as ``unpack_bits`` gives;
- groups: min and max with NaN propagated (``torch.aminmax``), step (max - min) / (2^K - 1) and
  t = (v - min) / max(step, FLT_MIN) with IEEE divisions, round half to even (``torch.round``) or, stochastic,
  floor(t + u) with u drawn by the caller's generator in the plain path's calls and shapes, clamp, a NaN coded 0
  (PyTorch's cast gives 0); rebuilt as code * step + min (no FMA: ``enable_fp_fusion=False``) and rounded once to
  the output's dtype, bfloat16 by hand (round to nearest even) because the interpreter's cast truncates.
One difference, documented: where a group's minimum is a signed zero whose sign the reductions order
differently, a rebuilt zero may carry the other sign.

Under fake tensors nothing is launched; the same outputs are allocated (``memopt.runtime.triton_stash``).
"""
from __future__ import annotations

import math
from typing import Callable, Optional, Sequence, Tuple

import torch

from memopt.runtime import triton_fewbit
from memopt.runtime.layout import memory_order
from memopt.runtime.triton_stash import _geometry, ncs
from memopt.runtime.triton_fewbit import tl, triton

_sum = triton_fewbit._sum
_min = tl.standard._elementwise_min if triton_fewbit.AVAILABLE else None
_max = tl.standard._elementwise_max if triton_fewbit.AVAILABLE else None
MAX_RANK = 4
_NONZERO, _POOL = 0, 1


def _walk_pack(src_ptr, out_ptr, n, nbytes, s1, s2, s3, t0, t1, t2, t3, width, kw, sh, sw, ph, pw, dh, dw,
               BITS: tl.constexpr, MODE: tl.constexpr, GROUPS: tl.constexpr):
    # one program: GROUPS groups of 8 elements of the (at most 4-D) logical index space -> GROUPS * BITS bytes
    pid = tl.program_id(0).to(tl.int64)
    group = pid * GROUPS + tl.arange(0, GROUPS).to(tl.int64)
    lane = tl.arange(0, 8)
    idx = group[:, None] * 8 + lane[None, :]
    valid = idx < n
    i3 = idx % s3
    rest = idx // s3
    i2 = rest % s2
    rest = rest // s2
    i1 = rest % s1
    i0 = rest // s1
    value = tl.load(src_ptr + (i0 * t0 + i1 * t1 + i2 * t2 + i3 * t3), mask=valid, other=0)
    if MODE == 0:  # a mask: nonzero is 1
        code = (value != 0).to(tl.int64)
    else:  # ATen's flat max-pool index -> the maximum's place in its window (i2, i3: the output row, column)
        drow = value // width - (i2 * sh - ph)
        dcol = value % width - (i3 * sw - pw)
        qrow = drow // dh
        qrow = qrow - (qrow * dh > drow).to(tl.int64)  # floor, whichever way // rounds
        qcol = dcol // dw
        qcol = qcol - (qcol * dw > dcol).to(tl.int64)
        code = qrow * kw + qcol
    code = tl.where(valid, code, 0).to(tl.int64) & ((1 << BITS) - 1)
    word = tl.reduce(code << (lane[None, :] * BITS).to(tl.int64), 1, _sum)
    out_offs = group[:, None] * BITS + lane[None, :]
    byte = (word[:, None] >> (lane[None, :] * 8).to(tl.int64)) & 0xFF
    tl.store(out_ptr + out_offs, byte.to(tl.uint8), mask=(lane[None, :] < BITS) & (out_offs < nbytes))


def _walk_unpack(packed_ptr, out_ptr, n, nbytes, oh, ow, width, kw, sh, sw, ph, pw, dh, dw,
                 BITS: tl.constexpr, MODE: tl.constexpr, BLOCK: tl.constexpr):
    # one program: BLOCK codes -> uint8 0/1 (a mask) or ATen's int64 flat max-pool index
    idx = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK).to(tl.int64)
    valid = idx < n
    bit = idx * BITS
    byte = bit >> 3
    lo_byte = tl.load(packed_ptr + byte, mask=valid, other=0).to(tl.int32)
    hi_byte = tl.load(packed_ptr + byte + 1, mask=valid & (byte + 1 < nbytes), other=0).to(tl.int32)
    code = ((lo_byte | (hi_byte << 8)) >> (bit & 7).to(tl.int32)) & ((1 << BITS) - 1)
    if MODE == 0:
        tl.store(out_ptr + idx, code.to(tl.uint8), mask=valid)
    else:
        off = code.to(tl.int64)
        col = idx % ow
        row = (idx // ow) % oh
        index = (row * sh - ph + (off // kw) * dh) * width + col * sw - pw + (off % kw) * dw
        tl.store(out_ptr + idx, index, mask=valid)


def _group_params(x_ptr, params_ptr, n, G, ngroups, BITS: tl.constexpr, ROWS: tl.constexpr, BLOCK: tl.constexpr):
    # one program: ROWS groups of G elements (the last may be short): their minimum and step, NaN propagated
    row = tl.program_id(0).to(tl.int64) * ROWS + tl.arange(0, ROWS).to(tl.int64)
    col = tl.arange(0, BLOCK).to(tl.int64)
    offs = row[:, None] * G + col[None, :]
    valid = (col[None, :] < G) & (offs < n) & (row[:, None] < ngroups)
    x = tl.load(x_ptr + offs, mask=valid, other=0.0).to(tl.float32)
    lo = tl.reduce(tl.where(valid, x, float("inf")), 1, _min)
    hi = tl.reduce(tl.where(valid, x, -float("inf")), 1, _max)
    nan = tl.reduce(tl.where(valid & (x != x), 1, 0), 1, _max)
    lo = tl.where(nan != 0, float("nan"), lo)
    hi = tl.where(nan != 0, float("nan"), hi)
    step = tl.math.div_rn(hi - lo, tl.full([ROWS], (1 << BITS) - 1, tl.float32))  # div_rn takes no scalar
    tl.store(params_ptr + row, lo, mask=row < ngroups)
    tl.store(params_ptr + ngroups + row, step, mask=row < ngroups)


def _group_encode(x_ptr, params_ptr, noise_ptr, tail_ptr, out_ptr, n, G, ngroups, full, nbytes,
                  BITS: tl.constexpr, STOCHASTIC: tl.constexpr, GROUPS: tl.constexpr):
    # one program: GROUPS groups of 8 elements (packing groups, not quantisation groups) -> GROUPS * BITS bytes
    pid = tl.program_id(0).to(tl.int64)
    group = pid * GROUPS + tl.arange(0, GROUPS).to(tl.int64)
    lane = tl.arange(0, 8)
    idx = group[:, None] * 8 + lane[None, :]
    valid = idx < n
    x = tl.load(x_ptr + idx, mask=valid, other=0.0).to(tl.float32)
    g = idx // G
    lo = tl.load(params_ptr + g, mask=valid, other=0.0)
    step = tl.load(params_ptr + ngroups + g, mask=valid, other=1.0)
    step = tl.where(step < 1.1754943508222875e-38, 1.1754943508222875e-38, step)  # clamp_min(FLT_MIN), NaN kept
    t = tl.math.div_rn(x - lo, step)
    if STOCHASTIC:
        u = tl.load(noise_ptr + idx, mask=valid & (idx < full), other=0.0)
        u = tl.where(idx < full, u, tl.load(tail_ptr + (idx - full), mask=valid & (idx >= full), other=0.0))
        q = tl.math.floor(t + u)
    else:  # round half to even
        f = tl.math.floor(t)
        d = t - f
        odd = (f - 2.0 * tl.math.floor(f * 0.5)) != 0.0
        q = tl.where((d > 0.5) | ((d == 0.5) & odd), f + 1.0, f)
    q = tl.where(q > 0.0, q, 0.0)  # NaN -> 0
    top = ((1 << BITS) - 1) * 1.0
    code = tl.where(q < top, q, top).to(tl.int32)
    code = tl.where(valid, code, 0).to(tl.int64)
    word = tl.reduce(code << (lane[None, :] * BITS).to(tl.int64), 1, _sum)
    out_offs = group[:, None] * BITS + lane[None, :]
    byte = (word[:, None] >> (lane[None, :] * 8).to(tl.int64)) & 0xFF
    tl.store(out_ptr + out_offs, byte.to(tl.uint8), mask=(lane[None, :] < BITS) & (out_offs < nbytes))


def _group_decode(packed_ptr, params_ptr, out_ptr, n, G, ngroups, nbytes,
                  BITS: tl.constexpr, OUT_BF16: tl.constexpr, BLOCK: tl.constexpr):
    idx = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK).to(tl.int64)
    valid = idx < n
    bit = idx * BITS
    byte = bit >> 3
    lo_byte = tl.load(packed_ptr + byte, mask=valid, other=0).to(tl.int32)
    hi_byte = tl.load(packed_ptr + byte + 1, mask=valid & (byte + 1 < nbytes), other=0).to(tl.int32)
    code = ((lo_byte | (hi_byte << 8)) >> (bit & 7).to(tl.int32)) & ((1 << BITS) - 1)
    g = idx // G
    value = code.to(tl.float32) * tl.load(params_ptr + ngroups + g, mask=valid, other=0.0) \
        + tl.load(params_ptr + g, mask=valid, other=0.0)
    if OUT_BF16:  # round to nearest even by hand; NaN -> 0x7FC0 as c10 gives
        vb = value.to(tl.uint32, bitcast=True)
        vb = tl.where(value != value, 0x7FC0, (vb + 0x7FFF + ((vb >> 16) & 1)) >> 16)
        tl.store(out_ptr + idx, vb.to(tl.uint16).to(tl.bfloat16, bitcast=True), mask=valid)
    else:
        tl.store(out_ptr + idx, value.to(out_ptr.dtype.element_ty), mask=valid)


def _channel_ends(x_ptr, m_ptr, mean_ptr, scale_ptr, part_ptr, N, C, S, xn, xc, xs, mn, mc, ms, parts,
                  INNER: tl.constexpr, BLOCK: tl.constexpr):
    # program (c, p): channel c over samples p, p + parts, ...: the least and greatest x (float32) and, with INNER,
    # of u = (x - mean) * scale the least where the mask is set and the greatest where it is not (NaN propagated);
    # written at [row, c, p] as rows (lo, -hi0, lo1, -hi), so that one amin over the parts reduces every row.
    # lo and hi go through (v - mean) * scale here, per part: the map is monotonic in float32 (scale >= 0), so the
    # least of the parts' images is the image of the least x, as the plain path computes it.
    c = tl.program_id(0).to(tl.int64)
    p = tl.program_id(1).to(tl.int64)
    lane = tl.arange(0, BLOCK).to(tl.int64)
    cv = c + lane * 0
    mean = tl.load(mean_ptr + cv)
    scale = tl.load(scale_ptr + cv)
    lo = tl.full([BLOCK], float("inf"), tl.float32)
    hi = tl.full([BLOCK], -float("inf"), tl.float32)
    lo1 = tl.full([BLOCK], float("inf"), tl.float32)
    hi0 = tl.full([BLOCK], -float("inf"), tl.float32)
    nan = tl.full([BLOCK], 0, tl.int32)
    for b in range(p, N, parts):
        for s0 in range(0, S, BLOCK):
            s = s0 + lane
            valid = s < S
            v = tl.load(x_ptr + b * xn + c * xc + s * xs, mask=valid, other=0.0).to(tl.float32)
            nan = tl.where(valid & (v != v), 1, nan)  # the channel's NaN reaches every end (as on the plain path)
            lo = tl.where(valid & (v < lo), v, lo)
            hi = tl.where(valid & (v > hi), v, hi)
            if INNER:
                u = (v - mean) * scale
                on = tl.load(m_ptr + b * mn + c * mc + s * ms, mask=valid, other=0) != 0
                lo1 = tl.where(valid & on & (u < lo1), u, lo1)
                hi0 = tl.where(valid & (~on) & (u > hi0), u, hi0)
    seen_nan = tl.reduce(nan, 0, _max) != 0
    lo_u = (tl.reduce(lo, 0, _min) - tl.load(mean_ptr + c)) * tl.load(scale_ptr + c)
    hi_u = (tl.reduce(hi, 0, _max) - tl.load(mean_ptr + c)) * tl.load(scale_ptr + c)
    if INNER:
        lo1_u = tl.reduce(lo1, 0, _min)
        hi0_u = tl.reduce(hi0, 0, _max)
    else:  # every end is the channel's extreme
        lo1_u = lo_u
        hi0_u = hi_u
    tl.store(part_ptr + c * parts + p, tl.where(seen_nan, float("nan"), lo_u))
    tl.store(part_ptr + (C + c) * parts + p, tl.where(seen_nan, float("nan"), -hi0_u))
    tl.store(part_ptr + (2 * C + c) * parts + p, tl.where(seen_nan, float("nan"), lo1_u))
    tl.store(part_ptr + (3 * C + c) * parts + p, tl.where(seen_nan, float("nan"), -hi_u))


def _merged(shape: Sequence[int], stride: Sequence[int]) -> Tuple[list, list]:
    """Size-1 dimensions dropped and neighbours merged where one stride steps through both, logical order kept:
    the fewest dimensions that walk the tensor row-major."""
    sizes, steps = [], []
    for size, step in zip(shape, stride):
        if size == 1:
            continue
        if sizes and steps[-1] == step * size:
            sizes[-1] *= size
            steps[-1] = step
        else:
            sizes.append(size)
            steps.append(step)
    return sizes, steps


def _pack_mask(src: torch.Tensor, sizes: list, steps: list, n: int) -> torch.Tensor:
    nbytes = (n + 7) // 8
    out = torch.empty(nbytes, dtype=torch.uint8, device=src.device)
    if n:
        pad = MAX_RANK - len(sizes)
        sizes, steps = [1] * pad + sizes, [0] * pad + steps
        groups = triton_fewbit._groups(src)
        triton_fewbit._launch(_walk_pack, (triton.cdiv(n, groups * 8),), src, out, n, nbytes, *sizes[1:], *steps,
                              *(1,) * 8, BITS=1, MODE=_NONZERO, GROUPS=groups)
    return out


def pack_mask(mask: torch.Tensor) -> torch.Tensor:
    """``pack_bits(mask != 0, 1)``: 1 bit per element of ``mask`` (any shape, layout, dtype) in logical order."""
    src = mask.view(torch.uint8) if mask.dtype == torch.bool else mask
    sizes, steps = _merged(src.shape, src.stride())
    if len(sizes) > MAX_RANK:  # more dimensions than the kernel walks (rare): one logical-order copy, as reshape
        src = src.reshape(-1)
        sizes, steps = _merged(src.shape, src.stride())
    return _pack_mask(src, sizes, steps, mask.numel())


def unpack_mask(packed: torch.Tensor, n: int) -> torch.Tensor:
    """``unpack_bits(packed, 1, n)``: n uint8 0/1 bytes."""
    return _unpack(packed, 1, n, torch.empty(n, dtype=torch.uint8, device=packed.device), (1,) * 10)


def _unpack(packed: torch.Tensor, bits: int, n: int, out: torch.Tensor, geometry: tuple) -> torch.Tensor:
    if (n * bits + 7) // 8 != packed.numel():
        raise ValueError(f"packed has {packed.numel()} bytes but {n} codes of {bits} bits need {(n * bits + 7) // 8}; "
                         f"pass the stream packed for these {n} elements")
    if n:
        block = triton_fewbit._groups(packed) * 8
        triton_fewbit._launch(_walk_unpack, (triton.cdiv(n, block),), packed, out, n, packed.numel(), *geometry,
                              BITS=bits, MODE=_NONZERO if out.dtype == torch.uint8 else _POOL, BLOCK=block)
    return out


def pool_offsets(indices: torch.Tensor, meta: tuple) -> torch.Tensor:
    """``memopt.stash.pool.pool_offsets``'s packed window offsets of ATen's max-pool ``indices`` (N, C, OH, OW,
    any layout); ``meta`` = (input shape, output shape, bits, kw, sh, sw, ph, pw, dh, dw)."""
    if indices.dim() != 4:
        raise ValueError(f"max-pool indices must be 4-D (N, C, OH, OW), got shape {tuple(indices.shape)}; "
                         f"give max_pool2d a batched 4-D input")
    shape, _, bits, kw, sh, sw, ph, pw, dh, dw = meta
    n = indices.numel()
    nbytes = (n * bits + 7) // 8
    out = torch.empty(nbytes, dtype=torch.uint8, device=indices.device)
    if n:
        _, c, oh, ow = indices.shape
        groups = triton_fewbit._groups(indices)
        triton_fewbit._launch(_walk_pack, (triton.cdiv(n, groups * 8),), indices, out, n, nbytes, c, oh, ow,
                              *indices.stride(), shape[-1], kw, sh, sw, ph, pw, dh, dw, BITS=bits, MODE=_POOL,
                              GROUPS=groups)
    return out


def pool_indices(packed: torch.Tensor, meta: tuple) -> torch.Tensor:
    """``memopt.stash.pool.pool_indices``: ATen's flat int64 max-pool indices (N, C, OH*OW) from the offsets."""
    shape, out_shape, bits, kw, sh, sw, ph, pw, dh, dw = meta
    n, c, oh, ow = out_shape
    out = torch.empty(n, c, oh * ow, dtype=torch.int64, device=packed.device)
    return _unpack(packed, bits, n * c * oh * ow, out, (oh, ow, shape[-1], kw, sh, sw, ph, pw, dh, dw))


def group_encode(x: torch.Tensor, bits: int, group: int,
                 noise: Optional[Callable[[Tuple[int, int]], torch.Tensor]] = None
                 ) -> Tuple[torch.Tensor, torch.Tensor]:
    """``memopt.stash.generic.group_quantize``: (packed codes, float32 [2, groups] of min and step) of ``x`` in its
    memory order, groups of ``group`` elements (the last may be short). ``noise(shape)``: stochastic rounding's
    uniform draws, called as the plain path draws them (the full groups' (groups, G), then the tail's (1, rest))."""
    if group < 1:
        raise ValueError(f"group must be at least 1 element, got {group}; use StashConfig(group_size=256)")
    flat = memory_order(x.detach())[0].reshape(-1)
    n = flat.numel()
    ngroups = -(-n // group)
    full = n // group * group
    params = torch.empty(2, ngroups, dtype=torch.float32, device=x.device)
    nbytes = (n * bits + 7) // 8
    out = torch.empty(nbytes, dtype=torch.uint8, device=x.device)
    draws = [noise((full // group, group)) if full else None, noise((1, n - full)) if full < n else None] \
        if noise is not None else [None, None]
    if not n:
        return out, params
    block = triton.next_power_of_2(group)
    rows = max(1, min(64, 4096 // block)) if x.device.type != "cpu" else max(1, min(1024, 65536 // block))
    triton_fewbit._launch(_group_params, (triton.cdiv(ngroups, rows),), flat, params, n, group, ngroups, BITS=bits,
                          ROWS=rows, BLOCK=block)
    # the full groups' draws and the tail's; a missing one's pointer is never read: the other stands in (float32)
    stand_in = next((d for d in draws if d is not None), out)
    stoch = [(d if d is not None else stand_in).reshape(-1) for d in draws]
    groups = triton_fewbit._groups(flat)
    triton_fewbit._launch(_group_encode, (triton.cdiv(n, groups * 8),), flat, params, *stoch, out, n, group, ngroups,
                          full, nbytes, BITS=bits, STOCHASTIC=noise is not None, GROUPS=groups)
    return out, params


def group_decode(packed: torch.Tensor, params: torch.Tensor, bits: int, group: int, like: torch.Tensor
                 ) -> torch.Tensor:
    """``memopt.stash.generic.group_dequantize``: the coded tensor rebuilt with the shape, dtype and layout of
    ``like`` (dense strides), each value code * step + min of its group, rounded once to the dtype."""
    out = torch.empty_like(like)
    dense, _ = memory_order(out)
    n = out.numel()
    if (n * bits + 7) // 8 != packed.numel():
        raise ValueError(f"packed has {packed.numel()} bytes but {n} codes of {bits} bits need {(n * bits + 7) // 8}; "
                         f"pass the codes group_quantize made for this tensor")
    if n:
        block = triton_fewbit._groups(packed) * 8
        triton_fewbit._launch(_group_decode, (triton.cdiv(n, block),), packed, params.float().contiguous(), dense,
                              n, group, params.shape[1], packed.numel(), BITS=bits,
                              OUT_BF16=out.dtype == torch.bfloat16, BLOCK=block, enable_fp_fusion=False)
    return out


def channel_ends(x: torch.Tensor, mean: torch.Tensor, scale: torch.Tensor, mask: Optional[torch.Tensor] = None
                 ) -> torch.Tensor:
    """``memopt.stash.grid._ends``: per channel of x (N, C, ...; any layout) rows (lo, hi0, lo1, hi) of
    u = (x - mean) * scale (float32): lo and hi the channel's least and greatest, and with ``mask`` (a residual
    chain) hi0 the greatest where the mask is not set and lo1 the least where it is (-inf / +inf for an empty
    side), else hi0 = hi and lo1 = lo; NaN where the channel has a NaN. One launch over x and one over a few
    parts (no full-size temporary, no per-channel extremes in PyTorch). Min and max are exact in any order, and
    lo, hi are the images of the least and greatest x: the same values as the plain path."""
    n, channels, inner = _geometry(x.shape)
    samples = x.shape[0] if x.dim() else 1
    parts = max(1, min(32, samples))
    partial = torch.empty(4, channels, parts, dtype=torch.float32, device=x.device)
    if not n:
        return torch.stack([partial.new_full((channels,), v) for v in (math.inf, -math.inf, math.inf, -math.inf)])
    xv, (xn, xc, xs) = ncs(x)
    if mask is None:
        mv, (mn, mc, ms) = xv, (0, 0, 0)  # not read
    else:
        mv, (mn, mc, ms) = ncs(mask.view(torch.uint8) if mask.dtype == torch.bool else mask)
    block = 1024 if x.device.type != "cpu" else triton.next_power_of_2(max(1, min(inner, 4096)))
    triton_fewbit._launch(_channel_ends, (channels, parts), xv, mv, mean.float().contiguous(),
                          scale.float().contiguous(), partial, samples, channels, inner, xn, xc, xs, mn, mc, ms, parts,
                          INNER=mask is not None, BLOCK=block, enable_fp_fusion=False)
    ends = partial.amin(-1)  # a part's NaN carries through (amin propagates it)
    ends[1::2].neg_()
    return ends


__all__ = ["pack_mask", "unpack_mask", "pool_offsets", "pool_indices", "group_encode", "group_decode",
           "channel_ends"]
