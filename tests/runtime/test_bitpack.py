"""Bit packing: exact round trip, exact size, LSB-first layout, checked against a Python reference."""
import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from conftest import requires_cuda
from memopt.runtime.bitpack import pack_bits, packed_nbytes, unpack_bits


def reference_pack(codes, bits):
    stream = []
    for c in codes:
        stream += [(c >> j) & 1 for j in range(bits)]
    stream += [0] * (-len(stream) % 8)
    return [sum(stream[i + j] << j for j in range(8)) for i in range(0, len(stream), 8)]


@settings(max_examples=60, deadline=None)
@given(bits=st.integers(1, 8), data=st.data())
def test_pack_matches_the_reference_bit_stream_and_round_trips(bits, data):
    codes = data.draw(st.lists(st.integers(0, 2**bits - 1), min_size=0, max_size=70))
    t = torch.tensor(codes, dtype=torch.uint8)
    packed = pack_bits(t, bits)
    assert packed.dtype == torch.uint8 and packed.numel() == math.ceil(len(codes) * bits / 8)
    assert packed.tolist() == reference_pack(codes, bits)
    assert unpack_bits(packed, bits, len(codes)).tolist() == codes


@pytest.mark.parametrize("bits", range(1, 9))
def test_large_tensors_of_any_shape(bits):
    codes = torch.randint(0, 2**bits, (3, 5, 7, 11), dtype=torch.uint8)
    packed = pack_bits(codes, bits)
    assert packed.numel() == packed_nbytes(codes.numel(), bits)
    assert torch.equal(unpack_bits(packed, bits, codes.numel()).view(codes.shape), codes)


def test_bad_arguments_are_refused():
    with pytest.raises(ValueError, match="bits must be an int in 1..8, got 9"):
        pack_bits(torch.zeros(3, dtype=torch.uint8), 9)
    with pytest.raises(ValueError, match="bits must be an int in 1..8, got 0"):
        unpack_bits(torch.zeros(3, dtype=torch.uint8), 0, 3)
    with pytest.raises(ValueError, match="packed has 1 bytes but 3 codes of 3 bits need 2"):
        unpack_bits(torch.zeros(1, dtype=torch.uint8), 3, 3)


@requires_cuda
@pytest.mark.parametrize("bits", [1, 3, 4, 8])
def test_cuda_matches_cpu(bits):
    codes = torch.randint(0, 2**bits, (1000,), dtype=torch.uint8)
    assert torch.equal(pack_bits(codes.cuda(), bits).cpu(), pack_bits(codes, bits))
