"""The stash's per-channel grids and codecs (``memopt/stash/ops.py``): where each x̂ / z code's bins lie,
coding in place, the code books a code is rebuilt from (bin midpoints, or at K <= ``MEAN_BITS`` the mean of the
values each bin coded), and the activations' exact masks."""
from __future__ import annotations

import math
from typing import Optional, Tuple

import torch
import torch.nn.functional as F

from memopt.runtime import kernels, native, triton_stash, triton_stash_extras
from memopt.runtime.bitpack import pack_bits, unpack_bits
from memopt.stash.generic import _unpack_mask
from memopt.stash.stats import _per_channel, batch_slices, cpu_selects, keep_where, select_u8, xhat_std

# Half-width of the grid in standard deviations, per K (the paper: 3 for K = 4 and 8): the least weight-gradient
# error of a pre-activation ResNet-20 (bench_stash_depth), wider at larger K, where clipping dominates
# (memopt/stash/README.md, "Why the defaults"); K = 1, 3, 5, 7 interpolated.
# False: every split window keeps its outer ends at ±WINDOWS[K+1] (the "merged" grid of bench_stash_gradients)
DATA_ENDS = True

WINDOWS = {1: 1.5, 2: 2.0, 3: 2.5, 4: 3.0, 5: 3.25, 6: 3.5, 7: 3.75, 8: 4.0}

# How far past its window an outer end may follow the data, as a multiple of the window, per K. Trained
# activations grow tails far beyond ±WINDOWS, which clipping at the window costs dearly; at 8 bits the bins stay
# fine when the window reaches out to the data (256 bins over 16 std: 1/16 std). At 4 bits a wider window for
# every channel lost parameters (its bins coarser everywhere), but following a channel's extreme where it lies
# far out pays (``REACH_PAST``). Measurements: docs/results/stash/stash_trained.md, stash_trained_224.md,
# stash_oracle.md, and memopt/stash/README.md, "Why the defaults".
# The ends are each channel's extremes, already computed for the split grids.
REACH = {8: 4.0, 4: 2.0}
# Where K reaches out, an outer end follows the data only where its end lies more than this many windows out;
# nearer, values past the window clip into the outer bin (rebuilt at their mean). Gaussian channels at init
# (extremes 3.5-4.5 std) gained nothing from reaching out; 1.3 windows (4.2 std at K = 4) leaves them alone and
# still reaches trained heavy tails (memopt/stash/README.md, "Why the defaults").
REACH_PAST = {4: 1.3}

# Up to this K each bin rebuilds at the mean of the values it coded (``StashConfig.bin_means``), not at its
# midpoint: the best value for the bin's elements in squared error, exact for a bin holding one repeated value
# (real images' flat backgrounds), and the mean of a clipped outer bin's tail instead of its edge (see
# docs/results/stash/stash_trained_224.md, with and without the means). The means cost 2^K floats per side and
# channel (128 bytes per channel for a split 4-bit code); at K = 8, 2 KiB per channel, where the bins are fine
# enough without them. A code gets them only where they cost at most MEAN_SHARE of its packed bytes (at 4 bits
# split: channels of at least 512 elements): on small feature maps the means would cost more than the codes,
# while a smaller share left out feature maps where they mattered (memopt/stash/README.md, "Why the defaults").
MEAN_BITS = 4
MEAN_SHARE = 0.5
# The means are taken over every MEAN_STRIDE-th element (by its index in the tensor): summing every element cost
# a measurable share of a step, a quarter of them in one strided pass nothing measurable, for slightly worse
# gradients (memopt/stash/README.md, "Why the defaults"). A bin of one repeated value still rebuilds it exactly;
# elsewhere it is the mean of a quarter of the bin's values.
MEAN_STRIDE = 4
# A value's offset inside its bin, t = (v - lo) / w - k, is summed as the integer 2^20 t truncated toward zero
# (a bias of less than 2^-20 of a bin): integers add exactly in any order, so the means are the same on the fused
# and plain paths and on any thread count. t is clamped to +-2^16 bins (a value that far outside the window is
# counted as if it lay there).
OFFSET_ONE = float(1 << 20)
OFFSET_MAX = float(1 << 16)


def kinks(weight: Optional[torch.Tensor], bias: Optional[torch.Tensor], xstd: torch.Tensor):
    """Where a chain's activation kinks lie on x̂ / std: (γσ, where it is nonzero (False for NaN), τ = -β/(γσ),
    τ6 = (6 - β)/(γσ)); τ and τ6 are finite placeholders where γσ = 0."""
    gamma = weight.float() if weight is not None else torch.ones_like(xstd)
    beta = bias.float() if bias is not None else torch.zeros_like(xstd)
    scale = gamma * xstd
    ok = scale.abs() > torch.finfo(torch.float32).tiny  # False for NaN too
    safe = torch.where(ok, scale, torch.ones_like(scale))
    return scale, ok, -beta / safe, (6 - beta) / safe



def x_grid_half(bits: int, split: bool) -> float:
    """Half-width of the x̂ window: WINDOWS for the grid's effective bits (K + 1 when split by the mask)."""
    return WINDOWS[min(bits + 1, 8)] if split else WINDOWS[bits]


def x_grid_reach(bits: int, split: bool) -> float:
    """How far an outer end may move out to the data's end (``REACH``; the window's own edge where K has none)."""
    return x_grid_half(bits, split) * REACH.get(bits, 1.0)


def x_grid_past(bits: int, split: bool) -> float:
    """Where the data's end must lie before an outer end follows it past the window (``REACH_PAST``; the window's
    own edge where K has none)."""
    return x_grid_half(bits, split) * REACH_PAST.get(bits, 1.0)


def follow_ends(ends: torch.Tensor, half: float, past: float, reach: float) -> torch.Tensor:
    """Where each outer end may go: the data's end clamped to ±reach where it lies beyond ±past, else to ±half
    (NaN stays NaN, the window's edge is then kept)."""
    limit = torch.where(ends.abs() > past, reach, half)
    return torch.minimum(torch.maximum(ends, -limit), limit)


def reaches(bits: int, split: bool) -> bool:
    """Whether the x̂ grid depends on the data (``_ends``, kept with the codes): split grids (``DATA_ENDS``) and,
    where K reaches out (``REACH``), grids over one window too."""
    return (split and DATA_ENDS) or bits in REACH


def _ends(x, mean, invstd, xstd, mask, inner: bool) -> torch.Tensor:
    """Per channel, where the sides' values of x̂/std end: rows (lo0, hi0, lo1, hi1), side 0 where the mask is
    false. Without ``inner`` every end is the channel's extreme (one cheap reduction over ``x``: each side's
    values lie inside them; ``_grid`` uses them only where the window would end at ±h); with it (a residual
    chain) the inner ends hi0, lo1 are each side's own, two masked reductions over a float temporary
    (+inf / -inf for an empty side). NaN where the channel has a NaN."""
    nd = x.dim()
    dims = [d for d in range(nd) if d != 1]
    scale = invstd / xstd.clamp_min(1e-12)
    if kernels.stash_triton(x, "grid ends") and torch.result_type(x, mean) == torch.float32:  # one pass, no temporary
        return triton_stash_extras.channel_ends(x, mean, scale, mask if inner else None)
    lo, hi = ((v.float() - mean) * scale for v in (x.amin(dims), x.amax(dims)))
    if not inner:
        return torch.stack([lo, hi, lo, hi])
    u = (x - _per_channel(mean, nd)).float().mul_(_per_channel(scale, nd))
    if not cpu_selects(u):
        lo1 = u.masked_fill(~mask, math.inf).amin(dims)
        hi0 = u.masked_fill_(mask, -math.inf).amax(dims)
        return torch.stack([lo, hi0, lo1, hi])
    # each side's extreme with the other side pushed to ±BIG by a lerp (exact), a slice at a time; an extreme
    # of ±BIG means the side is empty (±inf, as before)
    big = torch.tensor(torch.finfo(torch.float32).max, device=u.device)
    lo1 = hi0 = None
    for s in batch_slices(u):
        m = mask[s].to(torch.float32)
        lo_s, hi_s = torch.lerp(big, u[s], m).amin(dims), torch.lerp(u[s], -big, m).amax(dims)
        lo1 = lo_s if lo1 is None else torch.minimum(lo1, lo_s)
        hi0 = hi_s if hi0 is None else torch.maximum(hi0, hi_s)
    lo1 = lo1.masked_fill(lo1 == big, math.inf)
    hi0 = hi0.masked_fill(hi0 == -big, -math.inf)
    return torch.stack([lo, hi0, lo1, hi])


def _grid(weight, bias, xstd: torch.Tensor, bits: int, act: str, split: bool,
          ends: Optional[torch.Tensor] = None, residual: bool = False) -> torch.Tensor:
    """Per-channel bins of the x̂ code, in units of x̂'s std: rows (lo, width), 2^K bins from lo; when
    ``split``, rows (lo, width) for the elements whose mask is false, then for those where it is true.
    Without a residual the two sides meet at τ = -β/(γσ), the kink, clamped to the window [-h, h];
    ReLU6's true side ends where z = 6, its false side (below 0 or above 6) keeps the whole window. A
    channel with γσ = 0 (or NaN statistics) keeps the whole window on both sides. With a residual the
    sides overlap by data: the false side ends at its largest value, the true side starts at its least
    (from ``ends``, clamped to the window). ``ends`` (``_ends``): every end that would be the window's
    (-h or h) is instead where that side's values end when that lies inside the window, so a side whose
    values stop short of ±h gets finer bins; values beyond ±h still clip (a window widened to the data's
    extremes had bins coarser than the clipping cost on ResNet-50 at random init: memopt/stash/README.md,
    "Why the defaults"), except where K reaches out (``REACH``: K = 8, and K = 4 where the data end
    past ``REACH_PAST`` windows), whose outer ends, and the edges of a grid over one window, follow the data out
    to ±reach (``follow_ends``)."""
    bins, half, reach = 1 << bits, x_grid_half(bits, split), x_grid_reach(bits, split)
    past = x_grid_past(bits, split)
    lo, hi = torch.full_like(xstd, -half), torch.full_like(xstd, half)
    if not split:
        if ends is not None and reach > half:  # each edge moves out to the data's end, at most to ±reach
            e = follow_ends(ends, half, past, reach)  # NaN stays NaN: not finite, the window's edge is kept
            fin = torch.isfinite(e)
            lo = torch.where(fin[0] & (e[0] < lo), e[0], lo)
            hi = torch.where(fin[3] & (e[3] > hi), e[3], hi)
        return torch.stack([lo, (hi - lo) / bins])
    if residual:
        lo0, hi0, lo1, hi1 = lo, ends[1].clamp(-half, half), ends[2].clamp(-half, half), hi
    else:
        scale, ok, tau, tau6 = kinks(weight, bias, xstd)
        tau = torch.where(ok, tau, lo).clamp(-half, half)
        if act == "relu6":
            tau6 = torch.where(ok, tau6, hi).clamp(-half, half)
            lo1, hi1, lo0, hi0 = torch.minimum(tau, tau6), torch.maximum(tau, tau6), lo, hi
        else:
            pos = scale > 0
            lo1, hi1 = torch.where(pos, tau, lo), torch.where(pos, hi, tau)
            lo0, hi0 = torch.where(pos, lo, tau), torch.where(pos, tau, hi)
        lo1, hi1, lo0, hi0 = (torch.where(ok, v, d) for v, d in ((lo1, lo), (hi1, hi), (lo0, lo), (hi0, hi)))
    if ends is not None and DATA_ENDS:
        ends = follow_ends(ends, half, past, reach)  # NaN stays NaN: not finite, the window's end is kept
        fin = torch.isfinite(ends)
        lo0 = torch.where((lo0 <= -half) & fin[0], ends[0], lo0)
        hi0 = torch.where((hi0 >= half) & fin[1], ends[1], hi0)
        lo1 = torch.where((lo1 <= -half) & fin[2], ends[2], lo1)
        hi1 = torch.where((hi1 >= half) & fin[3], ends[3], hi1)
    return torch.stack([lo0, (hi0 - lo0) / bins, lo1, (hi1 - lo1) / bins])


def code_book(grid: torch.Tensor, bits: int, sums: Optional[torch.Tensor] = None) -> torch.Tensor:
    """The values a code rebuilds as, per channel and side: shape (C, sides, 2^K) from ``grid``'s rows (lo, w per
    side, as in ``_grid``): the midpoint lo + (k + ½)·w, or with ``sums`` (``new_bin_sums`` after coding) the
    mean of the values bin k coded, lo + (k + t̄)·w, t̄ their mean offset (½ for an empty bin). The float32
    arithmetic of the midpoints is the one the kernels used before code books (the same values)."""
    sides = grid.shape[0] // 2
    lo, width = grid[0::2].t().unsqueeze(-1), grid[1::2].t().unsqueeze(-1)
    k = torch.arange(1 << bits, dtype=torch.float32, device=grid.device)
    if sums is None:
        return (k + 0.5) * width + lo
    total, count = (v.view(-1, sides, 1 << bits) for v in sums)
    mean = (total.double() / (count.double() * OFFSET_ONE)).float()
    return (k + torch.where(count > 0, mean, 0.5)) * width + lo


def wants_means(means: bool, bits: int, sides: int, per_channel: int) -> bool:
    """Whether a code of ``per_channel`` elements per channel gets its bins' means: asked for, K <= MEAN_BITS and
    the means' float32 (sides x 2^K per channel) at most MEAN_SHARE of the packed codes."""
    return means and bits <= MEAN_BITS and sides * (4 << bits) <= MEAN_SHARE * per_channel * bits / 8


def new_bin_sums(channels: int, sides: int, bits: int, device) -> torch.Tensor:
    """Zeroed accumulators for ``add_bin_sums`` / ``native.encode``: (2, C, sides * 2^K) int64, the fixed-point
    offsets' sums, then the counts."""
    return torch.zeros(2, channels, sides << bits, dtype=torch.int64, device=device)


def add_bin_sums(sums: torch.Tensor, r: torch.Tensor, codes: torch.Tensor, side: Optional[torch.Tensor],
                 bits: int, start: int = 0, stride: int = MEAN_STRIDE) -> None:
    """Adds to ``sums`` the offset t = r - k (r = (v - lo) / w before rounding up, k its final code) of each element
    whose index in the whole tensor (``start``: that of the first here) is a multiple of ``stride``, as 2^20 t
    truncated toward zero (t clamped to ±2^16; not finite: not counted), at its channel, side and code: what
    ``mo_encode`` adds (``OFFSET_ONE``)."""
    channels, width = sums.shape[1], sums.shape[2]
    inner = math.prod(r.shape[2:])
    first = (-start) % stride
    pick = slice(first, None, stride)
    t = (r.reshape(-1)[pick] - codes.reshape(-1)[pick].to(torch.float32))
    finite = torch.isfinite(t)
    fixed = t.clamp_(-OFFSET_MAX, OFFSET_MAX).mul_(OFFSET_ONE).masked_fill_(~finite, 0).to(torch.int64)
    # each picked element's channel from its flat index (no full-size index tensor)
    channel = torch.arange(first, r.numel(), stride, device=r.device).div_(inner, rounding_mode="floor") % channels
    at = codes.reshape(-1)[pick].to(torch.int64) + channel * width
    if side is not None:
        at += side.reshape(-1)[pick].to(torch.int64) << bits
    sums[0].view(-1).index_add_(0, at, fixed)
    sums[1].view(-1).index_add_(0, at, finite.to(torch.int64))


def _from_codes(codes: torch.Tensor, mask: Optional[torch.Tensor], grid: torch.Tensor) -> torch.Tensor:
    """The rebuilt values in one float buffer: from a code book (3-D, ``code_book``: each element its channel's,
    and with two sides its side's by ``mask``), or bin midpoints lo + (k + ½)·width per channel (rows of
    ``grid`` as in ``_grid``); with four rows each element takes its side's grid by ``mask``. A slice of the
    batch at a time (so the per-element indices and grids never cost a full-size temporary)."""
    if kernels.stash_triton(codes, "rebuild of an x̂ or z code"):  # one launch, the same values
        return triton_stash.from_codes(codes, mask, grid)
    nd = codes.dim()
    if grid.dim() == 3:
        channels, sides, bins = grid.shape
        flat = grid.reshape(-1)
        base = _per_channel(torch.arange(channels, device=codes.device) * (sides * bins), nd)
        out = torch.empty(codes.shape, dtype=torch.float32, device=codes.device)
        for s in batch_slices(codes):
            at = codes[s].to(torch.int64) + base
            if sides == 2:
                at += mask[s].to(torch.int64) * bins
            out[s] = flat[at]
        return out
    out = codes.to(torch.float32).add_(0.5)
    if grid.shape[0] == 2:
        return out.mul_(_per_channel(grid[1], nd)).add_(_per_channel(grid[0], nd))
    lo0, w0, lo1, w1 = (_per_channel(g, nd) for g in grid)
    cpu = cpu_selects(out)
    for s in batch_slices(out):
        if cpu:  # lerp by the mask as 0/1: exact selections
            m = mask[s].to(torch.float32)
            out[s].mul_(torch.lerp(w0, w1, m)).add_(torch.lerp(lo0, lo1, m))
        else:
            out[s].mul_(torch.where(mask[s], w1, w0)).add_(torch.where(mask[s], lo1, lo0))
    return out


def plain_rebuild(packed: torch.Tensor, mask_packed: torch.Tensor, affine: torch.Tensor, zero_code: torch.Tensor,
                  bits: int, shape: torch.Size, act: str, params: Tuple[float, ...]) -> torch.Tensor:
    """``_Stash.rebuild`` in plain PyTorch ops (no C kernels, not CUDA): float32."""
    codes = unpack_bits(packed, bits, shape.numel()).view(shape)
    if act == "identity":
        return _from_codes(codes, None, affine)
    mask = _decode_mask(mask_packed, codes, zero_code, shape)
    z = _from_codes(codes, mask, affine)
    del codes
    # the activation of the rebuilt z, with the (exact) mask deciding which side of the kink
    if act == "relu6":  # outside the mask: 6 above the kinks' midpoint, else 0
        high = z > 3
        z = keep_where(z.clamp_(0, 6), mask, out=z)
        return z.add_(high.logical_and_(~mask), alpha=6.0)
    if act == "leaky_relu":
        return torch.where(mask, z.clamp_min(0), z.clamp_max_(0).mul_(params[0]))
    return keep_where(z.clamp_min_(0), mask, out=z)


def _code_(v: torch.Tensor, origin, width, bins: int, keep_r: bool = False):
    """Bin k covers (origin + k*width, origin + (k+1)*width]; values beyond the window clip.
    Works in place on ``v`` (a float32 temporary of the caller's): forward peaks matter too. With ``keep_r``
    (codes, r): ``v`` holds r = (v - origin) / width afterwards, for ``add_bin_sums``."""
    r = v.sub_(origin).div_(width)
    if keep_r:
        return r.ceil().sub_(1).clamp_(0, bins - 1).to(torch.uint8), r
    return r.ceil_().sub_(1).clamp_(0, bins - 1).to(torch.uint8)


def _mask(z: torch.Tensor, act: str, params: Tuple[float, ...]) -> Optional[torch.Tensor]:
    """Where the activation passes the gradient (with slope 1), with ATen's own comparisons."""
    if act == "identity":
        return None
    if native.applies(z, float_dtype=True, bf16=True):
        return native.act_mask(z, act)
    if act == "relu6":
        return ~((z <= 0) | (z >= 6))
    if act == "leaky_relu":
        return z > 0
    return ~(z <= 0)


def _activation(z: torch.Tensor, act: str, params: Tuple[float, ...], inplace: bool = False) -> torch.Tensor:
    """The chain's activation; ``inplace`` overwrites ``z`` (the same kernel, the same values)."""
    if act in ("relu6", "leaky_relu"):
        return F.relu6(z, inplace=inplace) if act == "relu6" else F.leaky_relu(z, params[0], inplace=inplace)
    return z if act == "identity" else (torch.relu_(z) if inplace else torch.relu(z))


def _act_backward(grad: torch.Tensor, mask: Optional[torch.Tensor], act: str, params: Tuple[float, ...]) -> torch.Tensor:
    if act == "identity":
        return grad
    return torch.where(mask, grad, grad * params[0]) if act == "leaky_relu" else keep_where(grad, mask)


def _decode_mask(mask_packed: torch.Tensor, codes: Optional[torch.Tensor], zero_code: torch.Tensor,
                 shape: torch.Size) -> torch.Tensor:
    """The exact activation mask: stored as 1 bit, or read from a z code whose zero is a bin edge."""
    if mask_packed.numel():  # 0/1 bytes viewed as bool, no copy; one Triton launch where the kernels say so
        return _unpack_mask(mask_packed, shape).view(torch.bool)
    return codes >= _per_channel(zero_code, len(shape))


def x_code(x, weight, bias, mean, invstd, eps: float, mask, bits: int, act: str, split: bool, residual: bool,
           affine: bool = False, means: bool = False, xstd: Optional[torch.Tensor] = None):
    """A chain's x̂ code and what goes with it: (packed codes, grid (rows lo0, w0[, lo1, w1]), whether the grid
    depends on the data (then it is saved, else backward rebuilds it), what consumers rebuild z = β + γσ·x̂ from
    (only with ``affine``): rows per side (β + γσ·lo, γσ·w) or, with the means, a code book of z, and the x̂
    code book (``code_book``: with ``means`` and K <= MEAN_BITS the bins' means, else None: the midpoints)).
    A residual chain's grid ends where each side's values end (``_ends`` inner); otherwise an outer end at the
    window's edge moves to the data's end (``DATA_ENDS``). On a contiguous float32 or bfloat16 CPU tensor (widened
    a block at a time: what the plain path's type promotion reads): two fused passes (extremes, codes and bin sums)
    and one call for the per-channel constants (``memopt/runtime/native.py``: the extremes of x map to those of x̂
    because x -> (x - mean) * scale is monotonic in float32), the same values as the plain path below. ``xstd``:
    x̂'s std per channel (``xhat_std``, computed here when not given)."""
    data = residual or reaches(bits, split)
    xstd = xhat_std(x, invstd, eps) if xstd is None else xstd  # ``xstd``: the caller's, which backward reads
    sides = 2 if split else 1
    per_channel = x.numel() // max(1, x.shape[1])
    sums = new_bin_sums(x.shape[1], sides, bits, x.device) if wants_means(means, bits, sides, per_channel) else None
    triton = kernels.stash_triton(x, "x̂ code")  # the codes and bin sums in one launch (the grid as below)
    if not triton and native.applies(x, float_dtype=True, bf16=True) and (mask is None or mask.is_contiguous()):
        raw = native.channel_extremes(x, mask if residual else None) if data else None
        scale, grid, enc, rows = native.chain_grid(invstd, xstd, weight, bias, mean, raw, residual, bits,
                                                   x_grid_half(bits, split), x_grid_reach(bits, split),
                                                   x_grid_past(bits, split), split,
                                                   act == "relu6", residual, DATA_ENDS, affine and sums is None)
        codes = native.encode(x, enc, bits, mean=mean, scale=scale, mask=mask, sums=sums, sum_stride=MEAN_STRIDE)
    else:
        ends = _ends(x, mean, invstd, xstd, mask, residual) if data else None
        grid = _grid(weight, bias, xstd, bits, act, split, ends, residual=residual)
        rows = None
        if affine and sums is None:
            # consumers rebuild z = γ σ x̂ + β from the x̂ code (σ = xstd): per side lo_z = β + γσ·lo, w_z = γσ·w
            gs, b = _z_affine(weight, bias, xstd)
            rows = torch.stack([b + gs * grid[0], gs * grid[1]] + ([b + gs * grid[2], gs * grid[3]]
                                                                   if len(grid) == 4 else []))
        codes = triton_stash.encode(x, grid, bits, mean=mean, invstd=invstd, xstd=xstd, mask=mask, sums=sums,
                                    sum_stride=MEAN_STRIDE) if triton else \
            pack_bits(_x_codes(x, mean, invstd, xstd, grid, mask, 1 << bits, sums), bits)
    book = None if sums is None else code_book(grid, bits, sums)
    if affine and book is not None:
        gs, b = _z_affine(weight, bias, xstd)
        rows = b.view(-1, 1, 1) + gs.view(-1, 1, 1) * book
    return codes, grid, data, rows, book


def _z_affine(weight, bias, xstd):
    """(γσ, β) per channel: z = β + γσ·(x̂ / σ), σ = x̂'s std (γ = 1, β = 0 without affine parameters)."""
    gs = (weight.float() if weight is not None else torch.ones_like(xstd)) * xstd
    return gs, (bias.float() if bias is not None else torch.zeros_like(xstd))


def exact_mask(mask_packed: torch.Tensor, codes_packed: torch.Tensor, zero_code: torch.Tensor, bits: int,
               shape: torch.Size, as_bits: bool = False):
    """The activation's exact mask in backward: its 1-bit copy, else read from the z code (``_decode_mask``);
    ``as_bits`` (the fused kernels): a ``native.PackedMask`` (the stream, or one made from the code)."""
    if as_bits:
        if mask_packed.numel():
            return native.PackedMask(mask_packed)
        return native.mask_from_codes(codes_packed, bits, shape, zero_code, as_bits=True)
    if mask_packed.numel():
        return _decode_mask(mask_packed, None, zero_code, shape)
    if kernels.stash_triton(codes_packed, "activation mask of a z code"):  # one launch, the same mask
        return triton_stash.mask_from_codes(codes_packed, bits, shape, zero_code)
    if native.applies(codes_packed):
        return native.mask_from_codes(codes_packed, bits, shape, zero_code)
    return _decode_mask(mask_packed, unpack_bits(codes_packed, bits, shape.numel()).view(shape), zero_code, shape)


def _x_codes(x, mean, invstd, xstd, grid, mask, bins: int, sums: Optional[torch.Tensor] = None) -> torch.Tensor:
    """Codes of x̂ / its std (float32, as the statistics are) on ``grid``; a constant channel codes noise
    that rebuilds times 0. A split grid codes each side and keeps the side the mask says. With ``sums``
    (``new_bin_sums``) each element's offset in its bin is added there (``add_bin_sums``)."""
    nd = x.dim()
    scale = _per_channel(invstd / xstd.clamp_min(1e-12), nd)
    tiny = torch.finfo(torch.float32).tiny
    keep = sums is not None

    def code(s, lo, width):
        return _code_((x[s] - _per_channel(mean, nd)).mul_(scale), _per_channel(lo, nd),
                      _per_channel(width.clamp_min(tiny), nd), bins, keep_r=keep)

    # a batch slice at a time: the float temporaries stay slice-sized (a full-size one set ResNet-50's forward
    # peak at batch 32 before; tools/peak_location.py finds such places)
    codes = torch.empty_like(x, dtype=torch.uint8)
    for s in batch_slices(x):
        if grid.shape[0] == 2:
            out = code(s, grid[0], grid[1])
            codes[s], r = out if keep else (out, None)
        elif keep:
            (c1, r1), (c0, r0) = code(s, grid[2], grid[3]), code(s, grid[0], grid[1])
            r = torch.where(mask[s], r1, r0)
            codes[s] = select_u8(mask[s], c1, c0)
        else:
            codes[s] = select_u8(mask[s], code(s, grid[2], grid[3]), code(s, grid[0], grid[1]))
        if keep:
            add_bin_sums(sums, r, codes[s], mask[s] if grid.shape[0] == 4 else None, int(bins).bit_length() - 1,
                         start=s.start * x[0].numel())
    return codes
