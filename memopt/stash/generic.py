"""Generic K-bit stash and compact exact extras, at run time.

Generic stash (inputs of conv / linear / matmul-with-a-parameter that no BatchNorm chain covers):
``generic_encode`` codes a tensor once, in its own memory order, in groups of G elements (default
256): each group keeps its minimum and its step (max - min) / (2^K - 1) in float32 (8 bytes per
group) and one K-bit code per element, rounded to the nearest level (deterministic, the default)
or stochastically (floor(v + u), u ~ U[0, 1) from a private generator, so the model's own RNG
stream, and with it dropout, is untouched). Every consumer of the tensor (the q, k and v projections
of one LayerNorm output share one code) runs its original forward op and keeps, through
``ctx.save_for_backward``, the codes, the group parameters and its weight. Backward rebuilds the
input for the weight gradient only (approximate); the input gradient needs only the weight (exact).

Compact extras, exact: ``dropout_1bit`` keeps the dropout mask as 1 bit per element (CPU dropout
keeps a float noise tensor, CUDA a bool mask), ``where_1bit`` keeps a boolean condition as 1 bit.
Packing is ``memopt.runtime.bitpack`` (shared with few-bit and the BN-chain stash).
"""
from __future__ import annotations

from typing import Dict, NamedTuple, Optional, Tuple

import torch
import torch.nn.functional as F

from memopt.core.errors import MemoptError
from memopt.core.leaf import graph_leaf, spec_of
from memopt.runtime import kernels, native_generic, triton_stash_extras
from memopt.runtime.bitpack import pack_bits, unpack_bits
from memopt.runtime.layout import memory_order, rebuilt_stride
from memopt.stash.grads import Rows, conv_grads, linear_grads, matmul_grads

_GENERATORS: Dict[str, torch.Generator] = {}
SEED = 0x5EED


def _generator(device: torch.device) -> Optional[torch.Generator]:
    """A private generator per device for stochastic rounding (None under fake tensors: any values do)."""
    key = str(device)
    if key not in _GENERATORS:
        try:
            _GENERATORS[key] = torch.Generator(device=device).manual_seed(SEED)
        except RuntimeError:
            return None
    return _GENERATORS[key]


def _noise(shape, device) -> torch.Tensor:
    """Stochastic rounding's uniform draws, from the private generator (the global one where none exists)."""
    gen = _generator(device)
    return torch.rand(shape, generator=gen, device=device) if gen is not None else torch.rand(shape, device=device)


def _pack_mask(mask: torch.Tensor) -> torch.Tensor:
    """``pack_bits(mask, 1)``: one Triton launch where ``memopt.runtime.kernels`` says so, the same bytes."""
    if kernels.stash_triton(mask, "1-bit mask"):
        return triton_stash_extras.pack_mask(mask)
    return pack_bits(mask, 1)


def _unpack_mask(packed: torch.Tensor, shape: torch.Size) -> torch.Tensor:
    """The 0/1 bytes of ``_pack_mask``'s mask, viewed as ``shape``."""
    if kernels.stash_triton(packed, "1-bit mask"):
        return triton_stash_extras.unpack_mask(packed, shape.numel()).view(shape)
    return unpack_bits(packed, 1, shape.numel()).view(shape)


def _code_groups(v: torch.Tensor, bits: int, stochastic: bool) -> Tuple[torch.Tensor, torch.Tensor]:
    """Codes (uint8, flat) and [min; step] per group of the rows of ``v`` (groups x G, float32)."""
    lo, hi = torch.aminmax(v, dim=1)
    step = (hi - lo) / ((1 << bits) - 1)
    t = (v - lo[:, None]).div_(step.clamp_min(torch.finfo(torch.float32).tiny)[:, None])
    if stochastic:
        t.add_(_noise(t.shape, t.device)).floor_()
    else:
        t.round_()
    return t.clamp_(0, (1 << bits) - 1).to(torch.uint8).view(-1), torch.stack([lo, step])


def row_group(row: int, group: int) -> int:
    """Elements per group for a tensor whose rows (the blocks a norm normalises together, contiguous in memory)
    hold ``row`` elements, so that no group mixes two rows: a whole row when it is shorter than ``group``, else
    the largest size up to ``group`` that tiles a row (``group`` when none is at least half of it). A group's
    step follows its widest row; a norm divides each row by that row's own std, so a row of small values (a
    transformer's class token beside patch tokens, a channel of small activations) coded with a wide one would
    rebuild with an error many times its std. Rows under 16 elements keep ``group`` (8 bytes per group)."""
    if row < 16:
        return group
    if row <= group:
        return row
    parts = -(-row // group)
    for more in range(parts, 2 * parts + 1):
        if row % more == 0:
            return row // more
    return group


def group_quantize(x: torch.Tensor, bits: int, group: int, stochastic: bool) -> Tuple[torch.Tensor, torch.Tensor]:
    """(packed codes, float32 [2, groups] of min and step) of ``x`` in its memory order."""
    if kernels.stash_triton(x, "generic stash code"):  # two launches, the same codes, steps and noise draws
        return triton_stash_extras.group_encode(x, bits, group, (lambda shape: _noise(shape, x.device))
                                                if stochastic else None)
    flat = memory_order(x.detach())[0].reshape(-1)
    if not stochastic and native_generic.encodable(flat, bits, group):  # one fused pass, the same codes and params
        return native_generic.group_encode(flat, bits, group)  # a bf16 one without its full-size float32 copy
    flat = flat if flat.dtype == torch.float32 else flat.float()
    n = flat.numel()
    if not n:  # nothing to code (the C path gives the same empty codes and parameters)
        return torch.empty(0, dtype=torch.uint8, device=x.device), torch.empty(2, 0, device=x.device)
    full = n // group * group
    codes, params = _code_groups(flat[:full].view(-1, group), bits, stochastic) if full else (None, None)
    if full < n:
        tail_codes, tail_params = _code_groups(flat[full:].view(1, -1), bits, stochastic)
        codes = tail_codes if codes is None else torch.cat([codes, tail_codes])
        params = tail_params if params is None else torch.cat([params, tail_params], 1)
    return pack_bits(codes, bits), params


DECODE_SLICE = 1 << 20  # values per float32 temporary when the rebuilt tensor is not float32


def _decode_through_float32(packed: torch.Tensor, params: torch.Tensor, bits: int, group: int, flat: torch.Tensor
                            ) -> None:
    """The C decode into ``flat`` (bf16 / fp16: autocast's inputs) through a float32 temporary of at most
    ``DECODE_SLICE`` values, a slice of whole groups at a time: the same values and the same rounding to ``flat``'s
    dtype as one full-size float32 temporary, which would be twice the rebuilt tensor's own size."""
    n = flat.numel()
    step = max(group * 8, DECODE_SLICE // (group * 8) * group * 8)  # whole groups, whole bytes of codes
    tmp = torch.empty(min(step, n), dtype=torch.float32, device=flat.device)
    for a in range(0, n, step):
        b = min(a + step, n)
        codes = packed[a * bits // 8:(b * bits + 7) // 8]
        v = native_generic.group_decode(codes, params[:, a // group:-(-b // group)].contiguous(), bits, group,
                                        tmp[:b - a])
        flat[a:b].copy_(v)


def group_dequantize(packed: torch.Tensor, params: torch.Tensor, bits: int, group: int, like: torch.Tensor
                     ) -> torch.Tensor:
    """The tensor ``group_quantize`` coded, rebuilt at its levels with the shape, dtype and layout of ``like``
    (a tensor or an empty tensor of the original's strides)."""
    if kernels.stash_triton(like, "generic stash rebuild"):  # one launch, the same values
        return triton_stash_extras.group_decode(packed, params, bits, group, like)
    out = torch.empty_like(like)
    dense, _ = memory_order(out)
    n = out.numel()
    direct = out.dtype == torch.float32  # rebuild in place, else through one float32 temporary
    if native_generic.decodable(packed, params, bits, group, n) and native_generic.applies(dense):
        if direct:
            native_generic.group_decode(packed, params, bits, group, dense.view(-1))
        else:
            _decode_through_float32(packed, params, bits, group, dense.view(-1))
        return out
    codes = unpack_bits(packed, bits, n)
    v = dense.view(-1) if direct else torch.empty(n, dtype=torch.float32, device=out.device)
    full = n // group * group
    if full:
        v[:full].view(-1, group).copy_(codes[:full].view(-1, group)).mul_(params[1, :full // group, None]) \
            .add_(params[0, :full // group, None])
    if full < n:
        v[full:].copy_(codes[full:]).mul_(params[1, -1]).add_(params[0, -1])
    if not direct:
        dense.view(-1).copy_(v)  # dense is out in its own memory order: same storage
    return out


def own_output(out: torch.Tensor) -> torch.Tensor:
    """``out`` as a tensor of its own when the op returned a view (``F.linear`` of some 3-D inputs): autograd
    refuses in-place updates of a view made inside a custom Function, which the graph may do next (Hugging
    Face Wav2Vec2 does); the copy has the same values and strides."""
    if not out._is_view():
        return out
    copy = torch.empty_strided(out.shape, out.stride(), dtype=out.dtype, device=out.device)
    return copy.copy_(out)


def _check_backward(node: str) -> None:
    if torch.is_grad_enabled():
        raise MemoptError(f"double backward (create_graph=True) through the stash node {node} is not supported; "
                          f"exclude it with memopt.StashConfig(deny=(...)) or set StashConfig(generic=False)")


def rows_rebuild(packed: torch.Tensor, params: torch.Tensor, bits: int, group: int, shape, stride,
                 dtype: torch.dtype) -> Rows:
    """The tensor ``group_quantize`` coded (``shape``, ``stride``), rebuilt in ``dtype`` whole, or rows
    ``[a, b)`` of its first dimension from their slice of the codes (``part``: the same values as those rows of
    the whole rebuild), where that dimension is outermost in the codes' memory order and a row's codes end on a
    group and a byte (``part`` None elsewhere)."""
    def whole() -> torch.Tensor:
        like = torch.empty_strided(shape, stride, dtype=dtype, device=packed.device)
        return group_dequantize(packed, params, bits, group, like)
    m = shape[1:].numel() if len(shape) > 1 else 0
    if not m or stride[0] != m or m % group or (m * bits) % 8:
        return Rows(whole, None)

    def part(a: int, b: int) -> torch.Tensor:
        like = torch.empty_strided((b - a, *shape[1:]), stride, dtype=dtype, device=packed.device)
        return group_dequantize(packed[a * m * bits // 8:b * m * bits // 8],
                                params[:, a * m // group:b * m // group].contiguous(), bits, group, like)
    return Rows(whole, part)


def _rebuild(ctx, packed, params, compute: Optional[torch.dtype] = None) -> Rows:
    """The consumer's input rebuilt whole, or by rows (``rows_rebuild``).

    ``compute``: the dtype the consumer's backward reads the input in (the gradient's). A float32 input that
    autocast cast to bf16 / fp16 for the op is rebuilt straight into that dtype, through float32 a slice at a time
    (``group_dequantize``): the same values as the float32 rebuild cast down, without the full-size float32
    tensor and its copy."""
    dtype = compute if ctx.dtype == torch.float32 and compute in (torch.bfloat16, torch.float16) else ctx.dtype
    return rows_rebuild(packed, params, ctx.bits, ctx.group, ctx.shape, ctx.stride, dtype)


def _keep(ctx, x: torch.Tensor, bits: int, group: int, node: str, chunks: int) -> None:
    stride = rebuilt_stride(x)  # codes follow x's memory order when dense, else its logical order
    ctx.shape, ctx.stride, ctx.dtype, ctx.bits, ctx.group, ctx.node = x.shape, stride, x.dtype, bits, group, node
    ctx.chunks = chunks


class LinearFromCodes(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, weight, bias, packed, params, bits, group, node, chunks):
        ctx.save_for_backward(packed, params, weight)
        _keep(ctx, x, bits, group, node, chunks)
        ctx.has_bias = bias is not None
        return own_output(F.linear(x, weight, bias))

    @staticmethod
    def backward(ctx, grad):
        _check_backward(ctx.node)
        packed, params, weight = ctx.saved_tensors
        grads = linear_grads(grad, _rebuild(ctx, packed, params, grad.dtype), weight, ctx.has_bias,
                             ctx.needs_input_grad[0], ctx.chunks)
        return (*grads, None, None, None, None, None, None)


class ConvFromCodes(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, weight, bias, packed, params, bits, group, node, stride, padding, dilation, groups, chunks):
        conv = {3: F.conv1d, 4: F.conv2d, 5: F.conv3d}[x.dim()]
        ctx.save_for_backward(packed, params, weight)
        _keep(ctx, x, bits, group, node, chunks)
        ctx.conv = (stride, padding, dilation, groups, bias is not None)
        return own_output(conv(x, weight, bias, stride, padding, dilation, groups))

    @staticmethod
    def backward(ctx, grad):
        _check_backward(ctx.node)
        packed, params, weight = ctx.saved_tensors
        grads = conv_grads(grad, _rebuild(ctx, packed, params, grad.dtype), weight, *ctx.conv, ctx.needs_input_grad[0],
                           ctx.chunks)
        return (*grads, None, None, None, None, None, None, None, None, None, None)


class MatmulFromCodes(torch.autograd.Function):
    """``x @ w`` with ``w`` a 2-D parameter: the gradient to ``x`` is ``grad @ wᵀ`` (exact)."""

    @staticmethod
    def forward(ctx, x, weight, packed, params, bits, group, node, chunks):
        ctx.save_for_backward(packed, params, weight)
        _keep(ctx, x, bits, group, node, chunks)
        return own_output(torch.matmul(x, weight))

    @staticmethod
    def backward(ctx, grad):
        _check_backward(ctx.node)
        packed, params, weight = ctx.saved_tensors
        grad_in, grad_w = matmul_grads(grad, _rebuild(ctx, packed, params, grad.dtype), weight, ctx.needs_input_grad[0],
                                       ctx.chunks)
        return grad_in, grad_w, None, None, None, None, None, None


class Dropout1Bit(torch.autograd.Function):
    """Dropout computed by the very ops stock PyTorch runs (same RNG draws, same output bits), keeping
    its mask as 1 bit per element and the kept elements' scale as a 0-dim tensor."""

    @staticmethod
    def forward(ctx, x, p):
        if x.is_cuda:  # ATen's fused kernel, as F.dropout uses on CUDA
            out, mask = torch.ops.aten.native_dropout(x, p, True)
            scale = torch.zeros(0, device=x.device)  # the scale is 1/(1-p), a constant (ctx.p)
        else:  # ATen's _dropout_impl: a noise tensor of 0 and 1/(1-p), multiplied in
            noise = torch.empty_like(x).bernoulli_(1 - p).div_(1 - p)  # x's layout, as ATen's
            out = x * noise
            mask = noise != 0
            del noise
            scale = torch.ones((), dtype=x.dtype, device=x.device).div_(1 - p)
        ctx.save_for_backward(_pack_mask(mask), scale)
        ctx.shape, ctx.stride, ctx.cuda, ctx.p = mask.shape, mask.stride(), x.is_cuda, p
        return out

    @staticmethod
    def backward(ctx, grad):
        packed, scale = ctx.saved_tensors
        mask = _unpack_mask(packed, ctx.shape)
        if ctx.cuda:
            return torch.ops.aten.native_dropout_backward(grad, mask.bool(), 1.0 / (1.0 - ctx.p)), None
        # the noise rebuilt bit for bit, in its own layout (the product's layout, and later sums, follow it)
        noise = torch.empty_strided(ctx.shape, ctx.stride, dtype=grad.dtype, device=grad.device).copy_(mask)
        return grad * noise.mul_(scale), None


class Where1Bit(torch.autograd.Function):
    """``torch.where(cond, a, b)`` keeping the boolean condition as 1 bit per element (of its own shape)."""

    @staticmethod
    def forward(ctx, cond, a, b):
        ctx.save_for_backward(_pack_mask(cond))
        ctx.shape = cond.shape
        return torch.where(cond, a, b)

    @staticmethod
    def backward(ctx, grad):
        (packed,) = ctx.saved_tensors
        cond = _unpack_mask(packed, ctx.shape).view(torch.bool)  # 0/1 bytes: a view, no copy
        # as ATen's where backward; the engine sums a broadcast gradient back to its operand's shape
        grad_a = torch.where(cond, grad, 0) if ctx.needs_input_grad[1] else None
        grad_b = torch.where(cond, 0, grad) if ctx.needs_input_grad[2] else None
        return None, grad_a, grad_b


class EncodeSpec(NamedTuple):
    """``generic_encode``'s parameters: one typed constant in the graph (fx re-creates NamedTuples in printed,
    pickled and re-traced graphs), read by name (``EncodeSpec.of(node)``). ``bits``: K; ``group``: elements per
    (min, step) pair; ``stochastic``: stochastic rounding instead of nearest."""

    bits: int
    group: int
    stochastic: bool = False

    of = classmethod(spec_of)  # EncodeSpec.of(node): a generic_encode call's


class FromCodesSpec(NamedTuple):
    """The non-tensor parameters of ``linear_from_codes``, ``conv_from_codes`` and ``matmul_from_codes``, as
    ``EncodeSpec``: ``bits`` and ``group`` of the input's codes, ``node``: the original node's text (for errors),
    ``conv``: (stride, padding, dilation, groups) of a conv, () otherwise."""

    bits: int
    group: int
    node: str = ""
    conv: tuple = ()

    of = classmethod(spec_of)  # FromCodesSpec.of(node): a *_from_codes call's


@graph_leaf
def generic_encode(x, spec: EncodeSpec):
    """(packed codes, [min; step] per group) of ``x`` for the generic stash; nothing here requires grad."""
    return group_quantize(x, spec.bits, spec.group, spec.stochastic)


def _needs_codes(x: torch.Tensor, weight: torch.Tensor) -> bool:
    return torch.is_grad_enabled() and (x.requires_grad or weight.requires_grad)


@graph_leaf
def linear_from_codes(x, weight, bias, packed, params, spec: FromCodesSpec, chunks: int = 1):
    """``F.linear(x, weight, bias)`` keeping ``x`` as group codes; the weight gradient over ``chunks`` row ranges."""
    if not _needs_codes(x, weight):
        return F.linear(x, weight, bias)
    return LinearFromCodes.apply(x, weight, bias, packed, params, spec.bits, spec.group, spec.node, chunks)


@graph_leaf
def conv_from_codes(x, weight, bias, packed, params, spec: FromCodesSpec, chunks: int = 1):
    """The conv of ``x`` keeping ``x`` as group codes; the weight gradient over ``chunks`` batch ranges."""
    if not _needs_codes(x, weight):
        return {3: F.conv1d, 4: F.conv2d, 5: F.conv3d}[x.dim()](x, weight, bias, *spec.conv)
    return ConvFromCodes.apply(x, weight, bias, packed, params, spec.bits, spec.group, spec.node, *spec.conv, chunks)


@graph_leaf
def matmul_from_codes(x, weight, packed, params, spec: FromCodesSpec, chunks: int = 1):
    """``x @ weight`` keeping ``x`` as group codes; the weight gradient over ``chunks`` row ranges."""
    if not _needs_codes(x, weight):
        return torch.matmul(x, weight)
    return MatmulFromCodes.apply(x, weight, packed, params, spec.bits, spec.group, spec.node, chunks)


@graph_leaf
def dropout_1bit(x, p: float):
    """``F.dropout(x, p, training=True)`` with a 1-bit mask for backward (0 < p < 1)."""
    if not (torch.is_grad_enabled() and x.requires_grad):
        return F.dropout(x, p, True)
    return Dropout1Bit.apply(x, p)


@graph_leaf
def where_1bit(cond, a, b):
    """``torch.where(cond, a, b)`` keeping ``cond`` as 1 bit per element."""
    if not torch.is_grad_enabled():
        return torch.where(cond, a, b)
    return Where1Bit.apply(cond, a, b)
