"""The BatchNorm backward from a K-bit x̂ code (``memopt.stash.bn.bn_backward``) as two Triton launches.

Why: on CUDA the plain backward unpacks the code with PyTorch's shifts and masks, rebuilds x̂ at full size in
float32, scales and centres it (a mean, a subtraction), sums g x̂ a batch slice at a time and forms the input
gradient with four more full-size passes: a dozen launches and a full-size x̂ beside g at the backward's peak.
Here the first launch reads the code (and the mask that picks a split code's side) and g once and writes, per
channel and batch part, the sums of x̂ and of g x̂; the second reads them again and writes the input gradient. No
full-size x̂ exists, and nothing waits on the host: the per-channel constants between the launches are a few
tensor ops on C values.

Same values as the plain path up to the order of the sums: x̂ = (book entry or grid midpoint) * std per element,
exactly as ``memopt.stash.grid._from_codes`` and the ``mul_`` after it; the centred x̂ and the input gradient
((x̂ - m) a + g - b) s with the plain path's rounding after each step (no FMA contraction); the per-channel sums
are float32 partial sums over parts of the batch, added in a fixed order (deterministic, not PyTorch's order), so
m, sum(g x̂) and with them the gradients can differ from the plain path in the last bits, as the C kernel's double
sums do (``memopt.runtime.native.bn_backward``). The code itself is never written here: codes stay
bit-identical to the plain path.

With ``act`` the two launches also apply the chain's activation backward where they read g (keep where the
mask is set; LeakyReLU's slope rounded in g's own dtype, bf16 rounded to nearest even by hand because Triton's
interpreter truncates that downcast) and the first sums g: no full-size g, no float32 copy of a bf16 g, and the
1-bit mask read as its stream.

Under the cost model's fake tensors nothing is launched; the same outputs are allocated.
"""
from __future__ import annotations

from typing import Optional, Tuple

import torch

from memopt.runtime import native, triton_fewbit, triton_stash
from memopt.runtime.triton_fewbit import tl, triton
from memopt.runtime.triton_stash import _geometry, ncs

_sum = triton_fewbit._sum
MAX_PARTS = 32  # batch parts per channel in the first launch: programs enough for a GPU, sums in a fixed order


def _xhat_of_codes(codes_ptr, m_ptr, table_ptr, xstd_ptr, idx, c, valid, C, nbytes,
                   BITS: tl.constexpr, SPLIT: tl.constexpr, MASK_BITS: tl.constexpr, BOOK: tl.constexpr):
    # a device function: x̂ of logical elements idx (channel c), the code's book entry or grid midpoint times the
    # channel's std (``triton_stash``'s device functions); both kernels call it as ``_xhat``, bound by ``_bind``
    code = triton_stash._code(codes_ptr, idx, valid, nbytes, BITS)
    side = code * 0
    if SPLIT:
        side = triton_stash._bit(m_ptr, idx, valid, MASK_BITS)
    value = triton_stash._value(table_ptr, code, side, c, valid, C, BITS, SPLIT, BOOK)
    return value * tl.load(xstd_ptr + c, mask=valid, other=0.0)


def _act_grad_of(g_ptr, off, m_ptr, idx, valid, slope, ACT: tl.constexpr, MASK_BITS: tl.constexpr):
    # a device function: the BN output's gradient g (float32) from the gradient at g_ptr + off: as read (ACT 0),
    # or the activation's backward applied as it is read: kept where the mask is set, else 0 (ACT 1: ReLU,
    # ReLU6) or times the slope rounded in the gradient's own dtype (ACT 2: LeakyReLU), as
    # ``memopt.stash.grid._act_backward`` followed by ``.float()``
    g = tl.load(g_ptr + off, mask=valid, other=0.0)
    if ACT == 0:
        return g.to(tl.float32)
    keep = triton_stash._bit(m_ptr, idx, valid, MASK_BITS) != 0
    if ACT == 1:
        return tl.where(keep, g.to(tl.float32), 0.0)
    low = g.to(tl.float32) * slope
    if g.dtype == tl.bfloat16:  # to nearest even by hand: Triton's interpreter truncates a bf16 downcast
        word = low.to(tl.int32, bitcast=True)
        word = (word + 0x7FFF + ((word >> 16) & 1)) & -65536
        low = tl.where(low != low, low, word.to(tl.float32, bitcast=True))
    elif g.dtype != tl.float32:
        low = low.to(g.dtype).to(tl.float32)
    return tl.where(keep, g.to(tl.float32), low)


_xhat, _act_grad = _xhat_of_codes, _act_grad_of


def _bind() -> None:
    """Bind ``_xhat`` to the device function of the current ``TRITON_INTERPRET`` mode: a kernel compiled for a GPU
    can call only a jitted function (a plain one runs only in the interpreter), and the jitted form depends on the
    mode (``triton_fewbit.device``); the same object each time, as the compiler's record of globals requires."""
    global _xhat, _act_grad
    triton_stash.bind()
    _xhat, _act_grad = triton_fewbit.device(_xhat_of_codes), triton_fewbit.device(_act_grad_of)


def _bn_sums(codes_ptr, m_ptr, table_ptr, xstd_ptr, g_ptr, part_ptr, kept_ptr, N, C, S, gn, gc, gs, nbytes, parts,
             slope, BITS: tl.constexpr, SPLIT: tl.constexpr, MASK_BITS: tl.constexpr, BOOK: tl.constexpr,
             ACT: tl.constexpr, KEEP_G: tl.constexpr, BLOCK: tl.constexpr):
    # program (c, p): channel c over samples p, p + parts, ...; writes sum x̂, sum g x̂ and sum g at [0|1|2, c, p],
    # and with KEEP_G g itself (contiguous, in kept_ptr's dtype: the activation's backward is exact in it)
    c = tl.program_id(0).to(tl.int64)
    p = tl.program_id(1).to(tl.int64)
    lane = tl.arange(0, BLOCK).to(tl.int64)
    cv = c + lane * 0  # the channel as a block: per-channel loads take the elements' mask
    acc_x = tl.full([BLOCK], 0.0, tl.float32)
    acc_gx = tl.full([BLOCK], 0.0, tl.float32)
    acc_g = tl.full([BLOCK], 0.0, tl.float32)
    for b in range(p, N, parts):
        for s0 in range(0, S, BLOCK):
            s = s0 + lane
            valid = s < S
            idx = (b * C + c) * S + s
            xhat = _xhat(codes_ptr, m_ptr, table_ptr, xstd_ptr, idx, cv, valid, C, nbytes, BITS, SPLIT, MASK_BITS,
                         BOOK)
            g = _act_grad(g_ptr, b * gn + c * gc + s * gs, m_ptr, idx, valid, slope, ACT, MASK_BITS)
            if KEEP_G:
                tl.store(kept_ptr + idx, g.to(kept_ptr.dtype.element_ty), mask=valid)
            acc_x += tl.where(valid, xhat, 0.0)
            acc_gx += tl.where(valid, g * xhat, 0.0)
            acc_g += tl.where(valid, g, 0.0)
    tl.store(part_ptr + c * parts + p, tl.reduce(acc_x, 0, _sum))
    tl.store(part_ptr + (C + c) * parts + p, tl.reduce(acc_gx, 0, _sum))
    tl.store(part_ptr + (2 * C + c) * parts + p, tl.reduce(acc_g, 0, _sum))


def _bn_grad(codes_ptr, m_ptr, table_ptr, xstd_ptr, g_ptr, consts_ptr, out_ptr, n, C, S, gn, gc, gs, nbytes, slope,
             BITS: tl.constexpr, SPLIT: tl.constexpr, MASK_BITS: tl.constexpr, BOOK: tl.constexpr,
             ACT: tl.constexpr, BLOCK: tl.constexpr):
    # one program: BLOCK logical elements; grad_x = ((x̂ - m) a + g - b) s per channel (consts rows m, a, b, s)
    idx = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK).to(tl.int64)
    valid = idx < n
    s = idx % S
    c = (idx // S) % C
    b = idx // (S * C)
    xhat = _xhat(codes_ptr, m_ptr, table_ptr, xstd_ptr, idx, c, valid, C, nbytes, BITS, SPLIT, MASK_BITS, BOOK)
    g = _act_grad(g_ptr, b * gn + c * gc + s * gs, m_ptr, idx, valid, slope, ACT, MASK_BITS)
    m = tl.load(consts_ptr + c, mask=valid, other=0.0)
    a = tl.load(consts_ptr + C + c, mask=valid, other=0.0)
    sub = tl.load(consts_ptr + 2 * C + c, mask=valid, other=0.0)
    scale = tl.load(consts_ptr + 3 * C + c, mask=valid, other=0.0)
    tl.store(out_ptr + idx, ((xhat - m) * a + g - sub) * scale, mask=valid)


ACTS = {"identity": 0, "relu": 1, "relu6": 1, "leaky_relu": 2}  # the activation backward the kernels apply


def bn_backward(g: torch.Tensor, sum_g: Optional[torch.Tensor], packed: torch.Tensor, bits: int, shape: torch.Size,
                book: torch.Tensor, mask, xstd: torch.Tensor, scale: torch.Tensor,
                exact: Optional[Tuple[torch.Tensor, torch.Tensor]] = None, act: Optional[str] = None,
                slope: float = 0.0, keep_g: bool = False):
    """(grad_x, sum of g times centred x̂) of ``memopt.stash.bn.bn_backward`` from ``g`` (float32, any layout),
    its per-channel ``sum_g``, the packed x̂ code, its ``book`` (C, sides, 2^K) or grid rows (lo0, w0[, lo1, w1]
    x C), ``mask`` (bool tensor, a ``PackedMask``, or None without a split), ``xstd`` and ``scale`` (γ / σ) per
    channel; ``exact`` (values, where to use them) replaces the weight gradient's sum where set. grad_x is float32,
    contiguous, as the plain path's.

    With ``act`` (a key of ``ACTS``), ``g`` is the gradient of the chain's activation output instead (any float
    dtype: bf16 / fp16 under autocast), ``sum_g`` is None, and the activation's backward (``mask``: where its
    input was kept; ``slope`` for LeakyReLU) is applied where g is read, in both launches: no full-size g, no
    float32 copy. Returns (grad_x, sum g x̂ centred, sum g), sum g from the first launch's partial sums; with
    ``keep_g`` also g, written by the first launch in the incoming gradient's dtype and contiguous (what a chain
    with a residual or a second BN needs: the activation's backward, bit for bit, with no launch of its own).
    A g without ``act`` is read in its own dtype (a bf16 g widens exactly: no float32 copy)."""
    n, channels, inner = _geometry(shape)
    out = torch.empty(shape, dtype=torch.float32, device=g.device)
    is_book = book.dim() == 3
    split = book.shape[1] == 2 if is_book else book.shape[0] == 4
    act_code = 0 if act is None else ACTS.get(act)
    if act_code is None:
        raise ValueError(f"bn_backward applies the backward of {sorted(ACTS)}, got act={act!r}; apply another "
                         f"activation's backward first and pass act=None")
    if keep_g and act is None:
        raise ValueError("bn_backward(keep_g=True) writes the g it makes from the activation's gradient: pass act "
                         "(with the mask), or keep the g you passed")
    if (sum_g is None) != (act is not None):
        raise ValueError(f"bn_backward takes sum_g exactly when act is None (it sums g itself after the "
                         f"activation's backward); got act={act!r} and sum_g {'None' if sum_g is None else 'given'}")
    if (split or act_code) and mask is None:
        what = f"a split x̂ code ({'two sides' if is_book else 'four rows'})" if split else f"the {act} backward"
        raise ValueError(f"{what} needs the mask that picks each element's side; got mask=None for shape "
                         f"{tuple(shape)}")
    if is_book and book.shape[2] != 1 << bits:
        raise ValueError(f"a code book for {bits}-bit codes has {1 << bits} entries per side, got {book.shape[2]} "
                         f"(shape {tuple(book.shape)}); pass the book code_book made for {bits} bits")
    samples = shape[0] if len(shape) else 1
    parts = max(1, min(MAX_PARTS, samples))
    partial = torch.zeros(3, channels, parts, dtype=torch.float32, device=g.device)
    m, mask_bits = out, False
    if split or act_code:
        mask_bits = isinstance(mask, native.PackedMask)  # its 1-bit stream
        m = mask.bits if mask_bits else (mask.view(torch.uint8) if mask.dtype == torch.bool else mask)
        m = m if m.is_contiguous() else m.contiguous()
    gv, (gn, gc, gs) = ncs(g if g.is_floating_point() else g.float())
    kept = torch.empty(shape, dtype=g.dtype, device=g.device) if keep_g else out  # out: an unused pointer
    table = book.float().contiguous()
    std = xstd.float().contiguous()
    meta = dict(BITS=bits, SPLIT=split, MASK_BITS=mask_bits, BOOK=is_book, ACT=act_code, enable_fp_fusion=False)
    keep = dict(KEEP_G=bool(keep_g))
    block = 1024 if g.device.type != "cpu" else triton.next_power_of_2(max(1, min(inner, 4096)))
    _bind()
    if n:
        triton_fewbit._launch(_bn_sums, (channels, parts), packed, m, table, std, gv, partial, kept, samples,
                              channels, inner, gn, gc, gs, packed.numel(), parts, float(slope), BLOCK=block, **meta,
                              **keep)
    if act is not None:
        sum_g = partial[2].sum(1)
    count = n // channels if channels else 1
    xmean = partial[0].sum(1) / count
    sum_gx = partial[1].sum(1) - xmean * sum_g.float()  # sum g (x̂ - m): m is about 0, nothing cancels
    if exact is not None:
        sum_gx = torch.where(exact[1], exact[0].float(), sum_gx)
    consts = torch.stack([xmean, -sum_gx / count, sum_g.float() / count, scale.float()]).contiguous()
    if n:
        grid_block = triton_fewbit._groups(packed) * 8
        triton_fewbit._launch(_bn_grad, (triton.cdiv(n, grid_block),), packed, m, table, std, gv, consts, out, n,
                              channels, inner, gn, gc, gs, packed.numel(), float(slope), BLOCK=grid_block, **meta)
    if act is None:
        return out, sum_gx
    return (out, sum_gx, sum_g, kept) if keep_g else (out, sum_gx, sum_g)


__all__ = ["bn_backward"]
