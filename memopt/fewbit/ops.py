"""Few-bit backward at run time: one autograd Function for every pointwise activation.

Forward computes the original activation out of place (bit-identical output, the input is never
overwritten), codes each element with b bits and keeps, through ``ctx.save_for_backward``, only
the packed codes (ceil(n*b/8) bytes) and, for table ops, the 2**b float32 levels (exact ops keep
their two levels as Python floats). Backward is ``levels[code] * grad``.

Codes: for piecewise-linear ops (relu, leaky_relu, hardtanh, ...) an exact 1-bit mask built with
the same comparisons as PyTorch's own backward; for the others the piece index of the optimal
table (``memopt.fewbit.tables``), from ``bucketize`` over the internal borders (a value equal to a
border goes to the lower piece). A non-finite input poisons the levels with NaN, so parameter
gradients come out non-finite as they would in stock PyTorch (and AMP's GradScaler skips the step).

Kernels (``memopt.runtime.kernels``, ``MEMOPT_KERNELS``): by default CUDA tensors take two Triton kernels
(``memopt.runtime.triton_fewbit``: encode + pack in forward, unpack + gather + scale in backward, instead of a
dozen small PyTorch kernels); contiguous float32 CPU tensors take the fused C kernels of
``memopt.runtime.native_generic`` (``fewbit_encode``: the pieces counted and packed in one pass, where the plain
path makes a comparison and an add per border; ``fewbit_scale`` in backward); everything else takes the plain path
below, the reference. All write the same codes and gradients (tests/runtime/test_triton_fewbit.py,
tests/runtime/test_native_generic.py).
"""
from __future__ import annotations

import functools
import struct
from typing import Callable, NamedTuple, Optional, Tuple

import torch
from torch._subclasses.fake_tensor import FakeTensor

from memopt.core.errors import MemoptError
from memopt.fewbit.activations import Params, get_activation
from memopt.core.leaf import graph_leaf, spec_of
from memopt.runtime import kernels, native_generic, triton_fewbit
from memopt.runtime.bitpack import pack_bits, packed_nbytes, unpack_bits
from memopt.runtime.layout import memory_order, memory_order_perm

SUPPORTED_DTYPES = (torch.float32, torch.bfloat16, torch.float16)  # table ops
EXACT_DTYPES = SUPPORTED_DTYPES + (torch.float64,)  # exact masks also take float64 (gradcheck)
# Above this many borders (5 bits and more) the plain path's binary search (``bucketize``) beats one comparison per
# border; it puts NaN in the top piece, where the comparisons put it in piece 0. Every kernel follows the same rule.
SCANNED_BORDERS = 15


def _encode(x: torch.Tensor, borders: Tuple[float, ...]) -> torch.Tensor:
    """The piece index of every element: the number of borders strictly below it (a value equal
    to a border goes to the lower piece). Borders are rounded to ``x``'s dtype first, so the
    pieces are those of the dtype the activation lives in."""
    # rounded here, not by torch.tensor(..., dtype): torch 2.11 rounds float64 -> float16 through float32
    # (twice), 2.14 directly, so the pieces would depend on the torch version
    rounded = _rounded(x.dtype, tuple(borders))
    if len(borders) > SCANNED_BORDERS:
        return torch.bucketize(x, torch.tensor(rounded, dtype=x.dtype, device=x.device), out_int32=True)
    codes = (x > rounded[0]).to(torch.uint8)
    for border in rounded[1:]:
        codes += x > border
    return codes


def _round_to(dtype: torch.dtype, value: float) -> float:
    """``value`` rounded to nearest-even in ``dtype``, in plain Python (this runs under fake tensors too)."""
    if dtype == torch.float16:
        return struct.unpack("<e", struct.pack("<e", value))[0]
    single = struct.unpack("<f", struct.pack("<f", value))[0]
    if dtype != torch.bfloat16:
        return single
    bits = struct.unpack("<I", struct.pack("<f", single))[0]
    bits = ((bits + 0x7FFF + ((bits >> 16) & 1)) & 0xFFFF0000) & 0xFFFFFFFF
    return struct.unpack("<f", struct.pack("<I", bits))[0]


@functools.lru_cache(maxsize=512)
def _rounded(dtype: torch.dtype, borders: Tuple[float, ...]) -> Tuple[float, ...]:
    """Every border rounded to ``dtype`` (``_round_to``), once per table and dtype: a few-bit op's borders are its
    table's, the same every step, and an 8-bit table's 255 roundings in Python cost more per call than coding a
    small activation."""
    return tuple(_round_to(dtype, b) for b in borders)


# The exact masks of memopt.fewbit.activations as the Triton encoder takes them: (kind, low bound, high bound or
# None) from the params; the same comparisons (tests/runtime/test_triton_fewbit.py checks every op, NaN included).
_MASK_BOUNDS = {
    "relu": lambda p: (triton_fewbit.OUTSIDE_CLOSED, 0.0, None),
    "relu6": lambda p: (triton_fewbit.OUTSIDE_CLOSED, 0.0, 6.0),
    "hardtanh": lambda p: (triton_fewbit.OUTSIDE_CLOSED, p["min_val"], p["max_val"]),
    "leaky_relu": lambda p: (triton_fewbit.INSIDE_OPEN, 0.0, None),
    "hardsigmoid": lambda p: (triton_fewbit.INSIDE_OPEN, -3.0, 3.0),
    "threshold": lambda p: (triton_fewbit.OUTSIDE_CLOSED, p["threshold"], None),
}


def _triton_encode(dense: torch.Tensor, name: str, params: Params, bits: int, borders: Tuple[float, ...],
                   levels: Tuple[float, ...]):
    """The Triton forward: (packed codes, levels poisoned by a non-finite input, or None for a mask)."""
    dtype, device, fake = dense.dtype, dense.device, isinstance(dense, FakeTensor)
    if name in _MASK_BOUNDS:
        kind, low, high = _MASK_BOUNDS[name](dict(params))
        high = None if high is None else _round_to(dtype, float(high))
        return triton_fewbit.encode_mask(dense, bits, kind, _round_to(dtype, float(low)), high), None
    rounded = _rounded(dtype, tuple(borders))
    return triton_fewbit.encode_table(dense, triton_fewbit.constants(rounded, device, fake),
                                      triton_fewbit.constants(levels, device, fake), bits,
                                      nan_top=len(borders) > SCANNED_BORDERS)


def _contiguous_strides(shape) -> list:
    """Row-major strides of ``shape``: where the codes of the dense (memory-order) view sit; computed, not read
    off a tensor, because the Triton backward never unpacks the codes into one."""
    strides, step = [], 1
    for size in reversed(shape):
        strides.insert(0, step)
        step *= size
    return strides


CHUNK = 1 << 20  # elements per slice of the backward gather: bounds its int64 index to 8 MiB
ENCODE_CHUNK = 1 << 20  # elements per slice of the forward's encode (a multiple of 8: whole bytes of packed codes)


def _float_sum(dense: torch.Tensor) -> torch.Tensor:
    """The float32 sum of ``dense`` (a tensor whose memory is dense in some order, ``memory_order``). On the CPU,
    ATen's ``sum(dtype=float32)`` of a bf16 / fp16 tensor first copies all of it to float32, inside the op where no
    tracker sees it: at a transformer's bf16 GELU, twice the activation at the forward's peak; there the sums of
    ``ENCODE_CHUNK``-element slices instead."""
    flat = dense.reshape(-1)
    if dense.dtype == torch.float32 or dense.device.type != "cpu" or flat.numel() <= ENCODE_CHUNK:
        return dense.sum(dtype=torch.float32)
    return torch.stack([flat[a:a + ENCODE_CHUNK].sum(dtype=torch.float32)
                        for a in range(0, flat.numel(), ENCODE_CHUNK)]).sum()


def _packed_codes(dense: torch.Tensor, encode: Callable[[torch.Tensor], torch.Tensor], bits: int) -> torch.Tensor:
    """``pack_bits(encode(dense), bits)`` a slice of ``ENCODE_CHUNK`` elements at a time: the same bytes (packing
    is local to each 8 codes, and every slice but the last is a multiple of 8), but the encode's temporaries (a
    comparison per border, the codes before packing: a byte per element each) are a slice's, not the activation's
    size, beside the activation's own output at the forward's peak."""
    flat = dense.reshape(-1)
    n = flat.numel()
    if n <= ENCODE_CHUNK:
        return pack_bits(encode(flat), bits)
    out = torch.empty(packed_nbytes(n, bits), dtype=torch.uint8, device=dense.device)
    for start in range(0, n, ENCODE_CHUNK):
        part = pack_bits(encode(flat[start:start + ENCODE_CHUNK]), bits)
        first = start // 8 * bits
        out[first:first + part.numel()].copy_(part)
    return out


def _scale_by_levels(grad: torch.Tensor, codes: torch.Tensor, levels: torch.Tensor) -> torch.Tensor:
    """``grad * levels[codes]`` in slices, so the gather's int64 index never costs 8 bytes/element at once."""
    out = torch.empty_like(grad, memory_format=torch.contiguous_format)
    flat_out, flat_grad, flat_codes = out.view(-1), grad.reshape(-1), codes.reshape(-1)
    for start in range(0, flat_out.numel(), CHUNK):
        stop = start + CHUNK
        torch.mul(flat_grad[start:stop], levels.take(flat_codes[start:stop].long()), out=flat_out[start:stop])
    return out


class _FewBit(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x: torch.Tensor, name: str, params: Params, bits: int, borders: Tuple[float, ...],
                levels: Tuple[float, ...], node: str) -> torch.Tensor:
        act = get_activation(name)
        y = act(x, params)
        dense, perm = memory_order(x)
        ctx.shape, ctx.perm, ctx.bits, ctx.exact, ctx.node, ctx.levels = dense.shape, perm, bits, act.exact, node, levels
        ctx.grad_layout = act.grad_layout
        ctx.triton = kernels.fewbit_triton(x, node) and (not act.exact or name in _MASK_BOUNDS)
        if ctx.triton:
            packed, level_t = _triton_encode(dense, name, params, bits, borders, levels)
            ctx.save_for_backward(*([packed] if level_t is None else [packed, level_t]))
            return y
        if act.exact:  # the two levels are Python floats; only the mask is kept
            kwargs = dict(params)
            ctx.save_for_backward(_packed_codes(dense, lambda part: act.mask(part, kwargs), bits))
            return y
        if len(borders) < 1 << bits and native_generic.applies(dense, float_dtype=True, bf16=True):  # one pass
            packed = native_generic.fewbit_encode(dense.reshape(-1), list(_rounded(dense.dtype, tuple(borders))),
                                                  bits, nan_top=len(borders) > SCANNED_BORDERS)
        else:
            packed = _packed_codes(dense, lambda part: _encode(part, borders), bits)
        # copied to the device once per table (triton_fewbit.constants), not per call: a host-to-device copy of a
        # Python list makes a CUDA host wait; tensor subclasses (fake, functional) get a fresh tensor of their mode
        level_t = (triton_fewbit.constants(levels, x.device) if type(x) is torch.Tensor
                   else torch.tensor(levels, dtype=torch.float32, device=x.device))
        # One float32 sum, no host sync: NaN and inf propagate into it, so a non-finite input
        # poisons the levels with NaN (finite activations would need a sum above 3e38 to trip it).
        finite = torch.isfinite(_float_sum(dense))
        level_t = torch.where(finite, level_t, torch.full_like(level_t, float("nan")))
        ctx.save_for_backward(packed, level_t)
        return y

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        if torch.is_grad_enabled():
            raise MemoptError(f"double backward (create_graph=True) through the few-bit node {ctx.node} is not "
                              f"supported: its backward is a b-bit approximation with no derivative of its own. "
                              f"Exclude the node with memopt.FewBitConfig(deny=(...)) or set Config(fewbit=None).")
        packed, *table = ctx.saved_tensors
        inverse = sorted(range(len(ctx.perm)), key=ctx.perm.__getitem__)
        if ctx.triton and grad.dtype in triton_fewbit.DTYPES and type(grad) in (torch.Tensor, FakeTensor):
            grad_x = _triton_backward(ctx, grad, packed, table, inverse)
            if grad_x is not None:
                return grad_x, None, None, None, None, None, None
        if not ctx.exact and _native_scales(ctx, grad, packed, table[0]):  # one fused pass, the same gradient
            return native_generic.fewbit_scale(packed, ctx.bits, grad, table[0]), None, None, None, None, None, None
        codes = unpack_bits(packed, ctx.bits, grad.numel()).view(ctx.shape).permute(inverse)
        if ctx.exact:  # where, not multiply: a masked-out inf/NaN gradient gives 0, as in PyTorch
            low, high = ctx.levels
            # laid out as PyTorch's own backward lays it out (like the gradient or like the input, where the
            # codes live): another layout made later reductions (a BatchNorm backward) sum in another order
            mask = codes.bool()
            dense = grad.permute(memory_order_perm(grad)).is_contiguous()  # else its layout ties: the input decides
            grad_x = torch.empty_like(grad if ctx.grad_layout and dense else mask, dtype=grad.dtype)
            torch.where(mask, grad * high if high != 1.0 else grad, grad * low if low else grad.new_zeros(()),
                        out=grad_x)
        else:
            grad_x = _scale_by_levels(grad, codes, table[0].to(grad.dtype))
        return grad_x, None, None, None, None, None, None


def _native_scales(ctx, grad: torch.Tensor, packed: torch.Tensor, levels: torch.Tensor) -> bool:
    """Whether a table op's backward runs the fused C kernel (``memopt.runtime.native_generic``): float32, contiguous
    CPU tensors, the codes in the gradient's order (the input was contiguous), levels float32 as
    ``levels.to(grad.dtype)`` would leave them; else the plain path below."""
    return (grad.dtype == torch.float32 and levels.dtype == torch.float32 and packed.dtype == torch.uint8
            and packed.dim() == 1 and ctx.perm == tuple(range(len(ctx.perm))) and tuple(grad.shape) == tuple(ctx.shape)
            and packed.numel() == (grad.numel() * ctx.bits + 7) // 8 and 1 <= ctx.bits <= 8
            and native_generic.applies(grad, levels, packed))


def _triton_backward(ctx, grad: torch.Tensor, packed: torch.Tensor, table: list, inverse: list):
    """The Triton backward into the layout the plain path gives (below), or None where its kernel cannot walk
    the layouts (more than four dimensions once merged)."""
    dense_strides = _contiguous_strides(ctx.shape)
    code_strides = [dense_strides[inverse[d]] for d in range(len(inverse))]
    if ctx.exact:
        dense = grad.permute(memory_order_perm(grad)).is_contiguous()
        out = (torch.empty_like(grad) if ctx.grad_layout and dense else
               torch.empty(ctx.shape, dtype=grad.dtype, device=grad.device).permute(inverse))
    else:
        out = torch.empty(grad.shape, dtype=grad.dtype, device=grad.device)
    if not triton_fewbit.scale_fits(grad, out, code_strides):
        return None
    if ctx.exact:
        low, high = ctx.levels
        return triton_fewbit.unpack_scale(packed, ctx.bits, grad, code_strides, out, low=low, high=high)
    return triton_fewbit.unpack_scale(packed, ctx.bits, grad, code_strides, out, levels=table[0])


class FewBitSpec(NamedTuple):
    """``fewbit_activation``'s parameters: one typed constant in the graph (fx re-creates NamedTuples in printed,
    pickled and re-traced graphs), read by name (``FewBitSpec.of(node)``).

    Attributes:
        name: the activation (``memopt.fewbit.activations.ACTIVATIONS``).
        params: its hyper-parameters, sorted (name, value) pairs.
        bits: b, the bits of each element's code.
        borders, levels: the table's internal borders and its 2**b levels (an exact mask: no borders, 2 levels).
        node: the original node's text, for errors (None: the activation's name).
    """

    name: str
    params: Params
    bits: int
    borders: Tuple[float, ...]
    levels: Tuple[float, ...]
    node: Optional[str] = None

    of = classmethod(spec_of)  # FewBitSpec.of(node): a fewbit_activation call's


@graph_leaf
def fewbit_activation(x: torch.Tensor, spec: FewBitSpec) -> torch.Tensor:
    """``spec.name(x, **spec.params)`` whose backward keeps ``spec.bits`` bits per element (called by rewritten
    graphs)."""
    allowed = EXACT_DTYPES if get_activation(spec.name).exact else SUPPORTED_DTYPES
    if x.dtype not in allowed:
        raise MemoptError(f"few-bit node {spec.node}: input dtype {x.dtype} is not supported "
                          f"({[str(d) for d in allowed]}); the pass leaves such nodes exact")
    if not x.requires_grad or not torch.is_grad_enabled():
        return get_activation(spec.name)(x, spec.params)
    return _FewBit.apply(x, spec.name, spec.params, spec.bits, spec.borders, spec.levels, spec.node or spec.name)
