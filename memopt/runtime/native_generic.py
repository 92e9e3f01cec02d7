"""Fused CPU kernels for the generic stash's group codes and few-bit codes and backward:
``memopt/runtime/kernels_generic.c``, built into the library of ``memopt.runtime.native`` (same compiler, flags and
cache; the same fallback when it cannot be built).

On the CPU the plain path (``memopt.stash.generic.group_quantize`` / ``group_dequantize``, few-bit backward's
``_scale_by_levels`` in ``memopt.fewbit.ops``) is a dozen small PyTorch kernels per tensor: ``aminmax``, subtract,
divide, round, clamp, cast and pack to code it; unpack, copy, multiply and add to rebuild it; unpack, an int64
index, ``take`` and multiply for few-bit backward. Each kernel here is one pass over the tensor, parallel over
spans that start on a byte of the code stream, with the same float32 arithmetic in the same order, so the packed
codes, the groups' [min; step], the rebuilt values and the gradients are bit-identical to the plain path
(tests/runtime/test_native_generic.py; the rules kept are listed at the top of kernels_generic.c).

What they take (``applies``): contiguous CPU tensors, float32 values (the callers convert other dtypes first,
or rebuild through a float32 temporary, exactly as the plain path does), not under ``MEMOPT_KERNELS=torch`` or
``MEMOPT_NATIVE=0``. Stochastic rounding stays on the plain path (its draws come from a torch generator). Under
the cost model's fake tensors the wrappers allocate the outputs the kernels would fill and run nothing.
"""
from __future__ import annotations

import ctypes
from typing import Optional, Tuple

import torch
from torch._subclasses.fake_tensor import FakeTensor

from memopt.runtime import native

__all__ = ["applies", "group_encode", "group_decode", "fewbit_scale", "fewbit_encode", "encodable", "decodable",
           "compare"]

_P, _I64, _I = ctypes.c_void_p, ctypes.c_int64, ctypes.c_int
_SIGNATURES = {
    "mo_group_encode": [_P, _I, _I64, _I64, _I, _P, _P, _I],
    "mo_group_decode": [_P, _I64, _I64, _I, _P, _P, _P, _I],
    "mo_fewbit_scale": [_P, _I64, _I, _P, _P, _P, _I],
    "mo_fewbit_encode": [_P, _I, _I64, _P, _I, _I, _I, _P, _I],
}
_typed: Optional[ctypes.CDLL] = None


def _library() -> ctypes.CDLL:
    """``native``'s library with this file's functions typed (once)."""
    global _typed
    lib = native._library()
    if lib is not _typed:
        for name, args in _SIGNATURES.items():
            getattr(lib, name).argtypes = args
            getattr(lib, name).restype = None
        _typed = lib
    return lib


def applies(*tensors: torch.Tensor, float_dtype: bool = False, bf16: bool = False) -> bool:
    """``native.applies``: contiguous CPU tensors (real or fake; float32 where ``float_dtype``, or bfloat16 too with
    ``bf16``: ``group_encode``, ``fewbit_encode``) and the library built, not under ``MEMOPT_KERNELS=torch``."""
    return native.applies(*tensors, float_dtype=float_dtype, bf16=bf16)


def _valid(bits: int, group: int) -> bool:
    return isinstance(bits, int) and 1 <= bits <= 8 and isinstance(group, int) and group >= 1


def encodable(flat: torch.Tensor, bits: int, group: int) -> bool:
    """Whether ``group_encode`` takes ``flat`` (a 1-D float32 or bfloat16 tensor in the memory order the codes
    follow); other arguments (bits outside 1..8, a group under 1) take the plain path, which raises the error."""
    return _valid(bits, group) and flat.dim() == 1 and applies(flat, float_dtype=True, bf16=True)


def decodable(packed: torch.Tensor, params: torch.Tensor, bits: int, group: int, n: int) -> bool:
    """Whether ``group_decode`` takes these codes of ``n`` values: a flat uint8 stream of the right length and float32
    [2, groups] parameters; anything else takes the plain path (which raises on a mismatch)."""
    groups = -(-n // group) if _valid(bits, group) else -1
    return (groups >= 0 and packed.dtype == torch.uint8 and packed.dim() == 1
            and packed.numel() == (n * bits + 7) // 8 and params.dtype == torch.float32
            and tuple(params.shape) == (2, groups) and applies(packed, params))


def _runs(*tensors: torch.Tensor) -> bool:
    return native._runs(*tensors)


def group_encode(flat: torch.Tensor, bits: int, group: int) -> Tuple[torch.Tensor, torch.Tensor]:
    """``memopt.stash.generic.group_quantize`` with nearest rounding, of a contiguous 1-D float32 or bfloat16 CPU
    tensor (a bf16 one widened a span at a time: the codes of its float32 copy, without the copy): (packed codes,
    float32 [2, groups] of min and step), groups of ``group`` elements, the last one short."""
    wide = native._wide(flat)
    n = flat.numel()
    ngroups = -(-n // group)
    out = torch.empty((n * bits + 7) // 8, dtype=torch.uint8)
    params = torch.empty(2, ngroups, dtype=torch.float32)
    if _runs(flat) and n:
        _library().mo_group_encode(flat.data_ptr(), wide, n, group, bits, out.data_ptr(), params.data_ptr(),
                                   native._threads(n))
    return out, params


def group_decode(packed: torch.Tensor, params: torch.Tensor, bits: int, group: int, out: torch.Tensor) -> torch.Tensor:
    """``memopt.stash.generic.group_dequantize``'s values, code * step + min per group, written into ``out`` (a
    contiguous float32 CPU tensor in the codes' order, of as many elements as were coded); returns ``out``."""
    n = out.numel()
    if _runs(packed, params, out) and n:
        _library().mo_group_decode(packed.data_ptr(), n, group, bits, params[0].data_ptr(), params[1].data_ptr(),
                                   out.data_ptr(), native._threads(n))
    return out


def fewbit_scale(packed: torch.Tensor, bits: int, grad: torch.Tensor, levels: torch.Tensor) -> torch.Tensor:
    """Few-bit backward of a table op, ``grad * levels[code]`` (``memopt.fewbit.ops._scale_by_levels``) for a
    contiguous float32 ``grad`` whose codes are in its own (logical) order, as a new contiguous tensor. ``levels``
    (float32) is padded to 2^bits entries (NaN) so that no code reads past it."""
    n = grad.numel()
    out = torch.empty(grad.shape, dtype=torch.float32)
    table = torch.full((1 << bits,), float("nan"), dtype=torch.float32)
    count = min(levels.numel(), 1 << bits)
    if _runs(packed, grad, levels) and n:
        table[:count] = levels.reshape(-1)[:count]
        _library().mo_fewbit_scale(packed.data_ptr(), n, bits, table.data_ptr(), grad.data_ptr(), out.data_ptr(),
                                   native._threads(n))
    return out


def fewbit_encode(flat: torch.Tensor, borders: Tuple[float, ...], bits: int, nan_top: bool) -> torch.Tensor:
    """Few-bit forward's packed pieces of a contiguous 1-D float32 or bfloat16 (widened a chunk at a time) CPU tensor
    (``memopt.fewbit.ops._packed_codes`` of
    ``_encode``): per value the number of ``borders`` (ascending, float32 values) strictly below it; NaN in the top
    piece where ``nan_top`` (as ``bucketize`` puts it), else in piece 0 (as comparisons do). One pass where the plain
    path makes a comparison and an add per border."""
    wide = native._wide(flat)
    n = flat.numel()
    out = torch.empty((n * bits + 7) // 8, dtype=torch.uint8)
    if _runs(flat) and n:
        table = torch.tensor(borders, dtype=torch.float32)
        _library().mo_fewbit_encode(flat.data_ptr(), wide, n, table.data_ptr(), len(borders), bits,
                                    len(borders) if nan_top else 0, out.data_ptr(), native._threads(n))
    return out


def compare(g: torch.Tensor, a: torch.Tensor) -> Optional[Tuple[float, float, float, float]]:
    """(sum g², sum a², sum g·a, sum (a - g)²) of two float32 tensors of one shape, in double, from one pass
    (``mo_compare``; the fidelity gate's ``parameter_fidelity`` took a float64 copy of each and four reductions);
    None where the kernel does not take them (the caller computes them in PyTorch). The sums are in a fixed
    order whatever the thread count."""
    if g.shape != a.shape or not (applies(g, a, float_dtype=True) and type(g) is not FakeTensor
                                  and type(a) is not FakeTensor):
        return None
    n = g.numel()
    partial = torch.empty(4 * max(1, -(-n // 65536)), dtype=torch.float64)
    out = torch.zeros(4, dtype=torch.float64)
    if n:
        _library().mo_compare(g.data_ptr(), a.data_ptr(), n, partial.data_ptr(), out.data_ptr(),
                              native._threads(n))
    gg, aa, ga, dd = out.tolist()
    return gg, aa, ga, dd
