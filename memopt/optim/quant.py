"""Block-wise low-bit quantization of matrices, as 4-bit Shampoo stores its preconditioner state.

A matrix M of shape (r, c) is cut, row by row, into blocks of ``block_size`` contiguous elements
(the last block of a row may be shorter; a block never spans two rows). Each block b keeps one
fp32 scale s_b = max |M_ij| over the block, and each element the index of the nearest entry of a
code book C (sorted, inside [-1, 1]) to M_ij / s_b:

    code_ij = argmin_k |M_ij / s_b - C_k|      (ties go to the lower index, as ``torch.argmin``)
    deq(M)_ij = C[code_ij] * s_b

Codes are packed as one LSB-first bit stream over the whole matrix (``memopt.runtime.bitpack``: two
4-bit codes per byte), so odd sizes cost ceil(r*c*bits/8) bytes and no byte is shared by two
rows' worth of bookkeeping. At 4 bits with blocks of 64 this is 4 + 32/64 = 4.5 bits per element,
7.1x smaller than fp32. Stored Vᵀ row-major, a block lies inside one eigenvector.

Code books (``quant_map``):
- "linear2" (signed squares): x_j = -1 + 2j/(2^b - 1), j = 0..2^b-1, with x_{2^(b-1)-1} forced
  to 0; entry sign(x_j) * x_j^2. Dense near 0, where most eigenvector entries are. 2^b entries.
- "dynamic" (dynamic tree, Dettmers 2016): one sign bit, then e leading zeros (a decimal exponent,
  value scale 10^-e) ended by an indicator 1, then f = b-2-e linear fraction bits spreading
  2^f values over (0.1, 1]: 10^-e * (0.1 + 0.9 (k+1) / 2^f). All-zero body = 0; the pattern that
  would be -0 is unused, so the book has 2^b - 1 distinct entries, -1 and 1 included.
All functions are plain torch and run on any device, and on fake tensors (no data-dependent
Python control flow), so the cost model can simulate them.
"""
from __future__ import annotations

from dataclasses import dataclass
from functools import cache

import torch
import torch.nn.functional as F
from torch._guards import detect_fake_mode

from memopt.runtime.bitpack import pack_bits, packed_nbytes, unpack_bits
from memopt.core.validation import check_bits

QUANT_MAPS = ("linear2", "dynamic")


@cache
def _codebook_values(quant_map: str, bits: int) -> tuple[float, ...]:
    # Python floats, not tensors: a cached tensor would leak between fake and real modes.
    if quant_map == "linear2":
        n = 2 ** bits
        xs = [-1.0 + 2.0 * j / (n - 1) for j in range(n)]
        xs[2 ** (bits - 1) - 1] = 0.0
        values = [(1.0 if x >= 0 else -1.0) * x * x for x in xs]
    elif quant_map == "dynamic":
        magnitudes = []
        for e in range(bits - 1):
            f = bits - 2 - e
            magnitudes += [10.0 ** -e * (0.1 + 0.9 * (k + 1) / 2 ** f) for k in range(2 ** f)]
        values = [0.0] + magnitudes + [-m for m in magnitudes]
    else:
        raise ValueError(f"quant_map={quant_map!r} is not known; use one of {QUANT_MAPS}")
    return tuple(sorted(values))


def codebook(quant_map: str, bits: int, device: torch.device | str = "cpu") -> torch.Tensor:
    """The sorted fp32 code book ``quant_map`` ("linear2" or "dynamic") for ``bits`` bits."""
    check_bits(bits, "bits")
    if quant_map == "dynamic" and bits < 2:
        raise ValueError(f"bits={bits!r} is too few for the dynamic-tree code book; use 2..8")
    return torch.tensor(_codebook_values(quant_map, bits), dtype=torch.float32, device=device)


def nearest_code(x: torch.Tensor, book: torch.Tensor) -> torch.Tensor:
    """Index (int64) of the entry of the sorted ``book`` nearest to each element of ``x``.

    Exact: equal to ``(x[..., None] - book).abs().argmin(-1)`` (same arithmetic, same tie rule),
    in O(K) cheap passes for small books (O(log K) ``bucketize`` for large ones). Counting the
    midpoints below x finds the cell; the midpoints are rounded, so the two neighbours are
    compared by the brute-force distance as well. Counting in int32 and gathering with
    ``index_select`` is 2-3x faster than ``bucketize`` and ``book[idx]`` (576x576, 4 bits, measured).
    """
    mids = (book[1:] + book[:-1]) / 2
    if book.numel() <= 16:
        mid = torch.zeros(x.shape, dtype=torch.int32, device=x.device)
        for m in mids.unbind():
            mid += x > m
    else:
        mid = torch.bucketize(x, mids, out_int32=True)
    lo = (mid - 1).clamp_min(0)
    hi = (mid + 1).clamp_max(book.numel() - 1)

    def value(i: torch.Tensor) -> torch.Tensor:
        return book.index_select(0, i.reshape(-1)).view(i.shape)

    best = hi
    best_d = (x - value(hi)).abs()
    for cand in (mid, lo):  # lower indices last, with <=, so ties go to the lowest index
        d = (x - value(cand)).abs()
        take = d <= best_d
        best = torch.where(take, cand, best)
        best_d = torch.where(take, d, best_d)
    return best.long()


@dataclass(frozen=True)
class QuantSpec:
    """How a matrix is quantized: ``bits`` per code (1..8), ``block_size`` elements per fp32
    scale (64 by default, as published), code book ``quant_map`` ("linear2" default, or "dynamic")."""

    bits: int = 4
    block_size: int = 64
    quant_map: str = "linear2"

    def __post_init__(self) -> None:
        check_bits(self.bits, "bits")
        if not isinstance(self.block_size, int) or isinstance(self.block_size, bool) or self.block_size < 1:
            raise ValueError(f"block_size={self.block_size!r} must be a positive int (64 is published)")
        if self.quant_map not in QUANT_MAPS:
            raise ValueError(f"quant_map={self.quant_map!r} is not known; use one of {QUANT_MAPS}")

    def nbytes(self, rows: int, cols: int) -> int:
        """Bytes of the packed codes plus the fp32 scales of a (rows, cols) matrix."""
        return packed_nbytes(rows * cols, self.bits) + 4 * rows * -(-cols // self.block_size)


def _block_scales(m: torch.Tensor, block_size: int) -> torch.Tensor:
    rows, cols = m.shape
    nblocks = -(-cols // block_size)
    padded = F.pad(m.abs(), (0, nblocks * block_size - cols))  # zeros never raise a max
    return padded.view(rows, nblocks, block_size).amax(-1)


def _expand(scales: torch.Tensor, block_size: int, cols: int) -> torch.Tensor:
    return scales.repeat_interleave(block_size, dim=1)[:, :cols]


def quantize(m: torch.Tensor, spec: QuantSpec) -> tuple[torch.Tensor, torch.Tensor]:
    """Quantize a 2-D matrix: (packed uint8 codes of ceil(r*c*bits/8) bytes, fp32 scales (r, nblocks))."""
    if m.dim() != 2:
        raise ValueError(f"quantize takes a matrix, got shape {tuple(m.shape)}")
    m = m.float()
    scales = _block_scales(m, spec.block_size)
    # an all-zero block keeps scale 0 (dequantizes to 0); dividing by 1 there avoids 0/0
    safe = torch.where(scales > 0, scales, torch.ones_like(scales))
    x = m / _expand(safe, spec.block_size, m.shape[1])  # |x| <= 1 exactly: division is correctly rounded
    codes = nearest_code(x, codebook(spec.quant_map, spec.bits, m.device))
    return pack_bits(codes, spec.bits), scales


_BYTE_TABLES: dict[tuple[str, int, torch.device], torch.Tensor] = {}
# The integer type as wide as one row of ``_byte_table`` (8 // bits fp32 values). Why: ``index_select``
# copies scalars several times faster than short rows on CPU, so the table is gathered as integers and
# the result read back as fp32: bit-identical values, the same transient bytes. Rows of 2 and 1 bits
# (16 and 32 bytes) have no integer type that wide and take the row gather.
_TABLE_ROW_AS_INT = {8: torch.int32, 4: torch.int64}


def _byte_table(quant_map: str, bits: int, device: torch.device, real: bool = False) -> torch.Tensor:
    """(256, 8 // bits): the code-book values of the codes packed in each possible byte, in
    ``memopt.runtime.bitpack``'s order (code j of a byte in bits [j*bits, (j+1)*bits)); for 4 and 8
    bits each row's bytes read as one integer (``_TABLE_ROW_AS_INT``), shape (256,).

    Cached per device for real tensors (building it cost 0.2 ms of a 2 ms MLP step); never under
    a fake-tensor mode, where a cached real tensor would mix with fake ones. ``real``: the caller's
    codes are a plain tensor, so no fake mode is at work and the check for one (a sizeable part of
    a small matrix's dequantization) is skipped. A 65536-entry table over byte pairs would halve
    the gathers but is 1 MiB, which the cost model would count as a transient at every simulated
    step while a real run builds it once: its estimate would no longer be exact."""
    key = (quant_map, bits, torch.device(device))
    table = _BYTE_TABLES.get(key)
    if table is not None and (real or detect_fake_mode() is None):
        return table
    book = codebook(quant_map, bits, device)
    byte = torch.arange(256, device=device)
    mask = (1 << bits) - 1
    book = F.pad(book, (0, mask + 1 - book.numel()))  # codes a book of fewer entries never emits
    table = torch.stack([book[(byte >> (bits * j)) & mask] for j in range(8 // bits)], 1)
    if bits in _TABLE_ROW_AS_INT:  # cached as integers, so a step runs no view op on the cached storage
        table = table.view(_TABLE_ROW_AS_INT[bits]).view(256)
    if type(table) is torch.Tensor:  # a real tensor, not a fake one
        _BYTE_TABLES[key] = table
    return table


def _scale_blocks(values: torch.Tensor, scales: torch.Tensor, block_size: int) -> torch.Tensor:
    """``values`` (rows, cols), a fresh tensor, times each block's scale, in place: the whole blocks
    broadcast their scale, the short last block of each row apart. Why in place: a second n x n
    buffer (or an expanded copy of the scales) costs as much as the gather itself."""
    rows, cols = values.shape
    whole = cols // block_size
    cut = whole * block_size
    if cut == cols:  # whole blocks only (the common case): one broadcast multiply
        return values.view(rows, whole, block_size).mul_(scales.unsqueeze(-1)).view(rows, cols)
    if whole:
        values[:, :cut].unflatten(1, (whole, block_size)).mul_(scales[:, :whole, None])
    if cut < cols:
        values[:, cut:].mul_(scales[:, whole:])
    return values


def dequantize(packed: torch.Tensor, scales: torch.Tensor, shape: tuple[int, int], spec: QuantSpec) -> torch.Tensor:
    """Inverse of ``quantize`` up to rounding: an fp32 matrix of ``shape``."""
    rows, cols = shape
    if 8 % spec.bits == 0:
        # one gather per byte through a 256-entry table; the roots take this path at every step
        table = _byte_table(spec.quant_map, spec.bits, packed.device, real=type(packed) is torch.Tensor)
        values = table.index_select(0, packed.int())
        if spec.bits in _TABLE_ROW_AS_INT:  # integers holding a table row each: read back as fp32
            values = values.view(torch.float32)
        values = values.view(-1)[:rows * cols]
    else:
        book = codebook(spec.quant_map, spec.bits, packed.device)
        values = book[unpack_bits(packed, spec.bits, rows * cols).long()]
    return _scale_blocks(values.view(rows, cols), scales, spec.block_size)
