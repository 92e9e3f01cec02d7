"""Exact b-bit packing of small integer codes: an LSB-first bit stream of ceil(n*b/8) bytes.

Element i occupies stream bits [i*b, (i+1)*b), least significant bit first; stream bit s lives
in byte s // 8 at bit s % 8. For b in {1, 2, 4, 8} a byte holds a whole number of codes and the
packing is a shift-and-sum over groups of 8/b codes; other widths go through an explicit bit
stream. Everything is plain torch, so it runs on any device.
"""
from __future__ import annotations

import math

import torch


def packed_nbytes(n: int, bits: int) -> int:
    """Bytes that ``n`` codes of ``bits`` bits occupy: ceil(n*bits/8)."""
    return math.ceil(n * bits / 8)


def _check_bits(bits: int) -> None:
    if not isinstance(bits, int) or isinstance(bits, bool) or not 1 <= bits <= 8:
        raise ValueError(f"bits must be an int in 1..8, got {bits!r}")


def pack_bits(codes: torch.Tensor, bits: int) -> torch.Tensor:
    """Pack integer ``codes`` (any shape, values in [0, 2**bits)) into a flat uint8 tensor."""
    _check_bits(bits)
    flat = codes.reshape(-1).to(torch.uint8)
    n = flat.numel()
    nbytes = packed_nbytes(n, bits)
    if bits == 8:
        return flat.clone()
    if 8 % bits == 0:
        per_byte = 8 // bits
        padded = torch.zeros(nbytes * per_byte, dtype=torch.uint8, device=flat.device)
        padded[:n] = flat
        shifts = torch.arange(0, 8, bits, dtype=torch.uint8, device=flat.device)
        return (padded.view(nbytes, per_byte) << shifts).sum(dim=1, dtype=torch.uint8)
    positions = torch.arange(bits, dtype=torch.uint8, device=flat.device)
    stream = torch.zeros(nbytes * 8, dtype=torch.uint8, device=flat.device)
    stream[: n * bits] = ((flat.unsqueeze(1) >> positions) & 1).reshape(-1)
    weights = torch.arange(8, dtype=torch.uint8, device=flat.device)
    return (stream.view(nbytes, 8) << weights).sum(dim=1, dtype=torch.uint8)


def unpack_bits(packed: torch.Tensor, bits: int, n: int) -> torch.Tensor:
    """Inverse of ``pack_bits``: the first ``n`` codes as a flat uint8 tensor."""
    _check_bits(bits)
    if packed.dtype != torch.uint8 or packed.dim() != 1:
        raise ValueError(f"packed must be a flat uint8 tensor, got {packed.dtype} of shape {tuple(packed.shape)}")
    if packed.numel() != packed_nbytes(n, bits):
        raise ValueError(f"packed has {packed.numel()} bytes but {n} codes of {bits} bits need "
                         f"{packed_nbytes(n, bits)}")
    if bits == 8:
        return packed[:n].clone()
    mask = (1 << bits) - 1
    if 8 % bits == 0:
        shifts = torch.arange(0, 8, bits, dtype=torch.uint8, device=packed.device)
        return ((packed.unsqueeze(1) >> shifts) & mask).reshape(-1)[:n]
    weights = torch.arange(8, dtype=torch.uint8, device=packed.device)
    stream = ((packed.unsqueeze(1) >> weights) & 1).reshape(-1)[: n * bits].view(n, bits)
    positions = torch.arange(bits, dtype=torch.uint8, device=packed.device)
    return (stream << positions).sum(dim=1, dtype=torch.uint8)
