"""Exact b-bit packing of small integer codes: an LSB-first bit stream of ceil(n*b/8) bytes.

Element i occupies stream bits [i*b, (i+1)*b), least significant bit first; stream bit s lives
in byte s // 8 at bit s % 8. For b in {1, 2, 4, 8} a byte holds 8/b whole codes, combined with
shifts in uint8. Otherwise eight codes of b bits fill exactly b bytes: the group's 8*b-bit
little-endian word is sum(code_j << b*j), split into b bytes. Transient memory is about n bytes.
Plain torch, any device; contiguous CPU tensors take a fused kernel (``memopt/runtime/native.py``)
that writes the same bytes in one pass.
"""
from __future__ import annotations

import math

import torch

from memopt.runtime import native
from memopt.core.validation import check_bits


def packed_nbytes(n: int, bits: int) -> int:
    """Bytes that ``n`` codes of ``bits`` bits occupy: ceil(n*bits/8)."""
    return math.ceil(n * bits / 8)


def pack_bits(codes: torch.Tensor, bits: int) -> torch.Tensor:
    """Pack integer ``codes`` (any shape, values in [0, 2**bits)) into a flat uint8 tensor."""
    check_bits(bits, "bits")
    if codes.dtype in (torch.uint8, torch.bool) and native.applies(codes):
        return native.pack(codes, bits)  # one pass, no temporaries
    flat = codes.reshape(-1).to(torch.uint8)
    n = flat.numel()
    if 8 % bits == 0:  # whole codes per byte: shift-or in uint8, no 64-bit words
        per = 8 // bits
        nbytes = -(-n // per)
        if nbytes * per != n:
            flat = torch.cat([flat, flat.new_zeros(nbytes * per - n)])
        grouped = flat.view(nbytes, per)
        out = grouped[:, 0].clone()
        for j in range(1, per):
            out |= grouped[:, j] << (bits * j)
        return out
    groups = -(-n // 8)
    if groups * 8 != n:
        flat = torch.cat([flat, flat.new_zeros(groups * 8 - n)])
    grouped = flat.view(groups, 8)
    word = grouped[:, 0].to(torch.int64)
    for j in range(1, 8):
        word |= grouped[:, j].to(torch.int64) << (bits * j)
    out = torch.empty(groups, bits, dtype=torch.uint8, device=codes.device)
    for k in range(bits):
        out[:, k] = (word >> (8 * k)) & 0xFF
    nbytes = packed_nbytes(n, bits)
    # the last group may hold bytes past the stream's end: copy so the storage is exactly nbytes
    return out.view(-1) if out.numel() == nbytes else out.view(-1)[:nbytes].clone()


def unpack_bits(packed: torch.Tensor, bits: int, n: int) -> torch.Tensor:
    """Inverse of ``pack_bits``: the first ``n`` codes as a flat uint8 tensor."""
    check_bits(bits, "bits")
    if packed.dtype != torch.uint8 or packed.dim() != 1:
        raise ValueError(f"packed must be a flat uint8 tensor, got {packed.dtype} of shape {tuple(packed.shape)}")
    if packed.numel() != packed_nbytes(n, bits):
        raise ValueError(f"packed has {packed.numel()} bytes but {n} codes of {bits} bits need "
                         f"{packed_nbytes(n, bits)}")
    if native.applies(packed):
        return native.unpack(packed, bits, n)
    if 8 % bits == 0:
        per, mask = 8 // bits, (1 << bits) - 1
        out = torch.empty(packed.numel(), per, dtype=torch.uint8, device=packed.device)
        for j in range(per):
            out[:, j] = (packed >> (bits * j)) & mask
        return out.view(-1)[:n]
    groups = -(-n // 8)
    if groups * bits != packed.numel():
        packed = torch.cat([packed, packed.new_zeros(groups * bits - packed.numel())])
    grouped = packed.view(groups, bits)
    word = grouped[:, 0].to(torch.int64)
    for k in range(1, bits):
        word |= grouped[:, k].to(torch.int64) << (8 * k)
    out = torch.empty(groups, 8, dtype=torch.uint8, device=packed.device)
    mask = (1 << bits) - 1
    for j in range(8):
        out[:, j] = (word >> (bits * j)) & mask
    return out.view(-1)[:n]
