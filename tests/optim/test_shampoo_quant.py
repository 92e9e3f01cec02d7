"""4-bit Shampoo's numerics: code books, block-wise quantization, Björck, QR iteration, inverse roots."""
import itertools
import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from memopt.optim.linalg import bjorck, eigh_inverse_root, inverse_root, subspace_step
from memopt.optim.quant import QuantSpec, codebook, dequantize, nearest_code, quantize


pytestmark = pytest.mark.usefixtures("one_thread")


def _orthogonal(n, seed, dtype=torch.float64):
    g = torch.Generator().manual_seed(seed)
    return torch.linalg.qr(torch.randn(n, n, generator=g, dtype=dtype)).Q


def _spd(n, seed, spread=1e4, dtype=torch.float64):
    q = _orthogonal(n, seed, dtype)
    lam = torch.logspace(0, math.log10(spread), n, dtype=dtype)
    return (q * lam) @ q.T, q, lam


# --- code books ---------------------------------------------------------------------------------

def test_linear2_codebook_is_the_published_signed_squares():
    book = codebook("linear2", 4)
    xs = [-1 + 2 * j / 15 for j in range(16)]
    xs[7] = 0.0  # the middle entry is forced to 0
    expected = torch.tensor([math.copysign(x * x, x) for x in xs], dtype=torch.float32)
    assert torch.equal(book, expected)
    assert book[0] == -1 and book[-1] == 1 and (book == 0).sum() == 1
    assert torch.all(book[1:] > book[:-1])


def test_dynamic_tree_codebook():
    book = codebook("dynamic", 4)
    positive = torch.tensor([0.01, 0.055, 0.1, 0.325, 0.55, 0.775, 1.0])
    assert book.numel() == 15  # 2^4 codes, the would-be -0 unused
    assert torch.allclose(book[8:], positive) and torch.allclose(book[:7], -positive.flip(0))
    assert book[7] == 0
    big = codebook("dynamic", 8)
    assert big.numel() == 255 and torch.all(big[1:] > big[:-1])
    assert big.abs().min() == 0 and big.max() == 1 and big[big > 0].min().item() == pytest.approx(1e-6)  # 10^-6 * 1: 7 decades
    assert codebook("linear2", 8).numel() == 256


def test_codebook_errors():
    with pytest.raises(ValueError, match=r"quant_map='uniform' is not known"):
        codebook("uniform", 4)
    with pytest.raises(ValueError, match=r"bits must be an int in 1..8, got 9"):
        codebook("linear2", 9)
    with pytest.raises(ValueError, match=r"bits=1 is too few"):
        codebook("dynamic", 1)


# --- nearest code -------------------------------------------------------------------------------

def _brute(x, book):
    return (x[..., None] - book).abs().argmin(-1)


@settings(max_examples=60, deadline=None)
@given(values=st.lists(st.floats(-1, 1, width=32), min_size=1, max_size=200),
       quant_map=st.sampled_from(["linear2", "dynamic"]), bits=st.sampled_from([2, 3, 4, 8]))
def test_nearest_code_equals_brute_force(values, quant_map, bits):
    book = codebook(quant_map, bits)
    x = torch.tensor(values, dtype=torch.float32)
    assert torch.equal(nearest_code(x, book), _brute(x, book))


@pytest.mark.parametrize("quant_map", ["linear2", "dynamic"])
def test_nearest_code_at_and_around_every_midpoint(quant_map):
    # the hard cases: exact ties and the floats on either side of each midpoint
    book = codebook(quant_map, 4)
    mids = (book[1:] + book[:-1]) / 2
    x = torch.cat([mids, torch.nextafter(mids, torch.tensor(2.0)), torch.nextafter(mids, torch.tensor(-2.0)), book])
    assert torch.equal(nearest_code(x, book), _brute(x, book))


# --- block-wise quantization --------------------------------------------------------------------

def _max_half_gap(book):
    return ((book[1:] - book[:-1]) / 2).max().item()


@pytest.mark.parametrize("shape", [(1, 1), (3, 5), (7, 65), (65, 127), (64, 64), (33, 200)])
@pytest.mark.parametrize("quant_map", ["linear2", "dynamic"])
def test_round_trip_bound_and_sizes_for_odd_shapes(shape, quant_map):
    spec = QuantSpec(4, 64, quant_map)
    m = torch.randn(*shape, generator=torch.Generator().manual_seed(sum(shape)))
    packed, scales = quantize(m, spec)
    rows, cols = shape
    nblocks = -(-cols // 64)
    assert packed.dtype == torch.uint8 and packed.numel() == math.ceil(rows * cols / 2)  # two codes per byte
    assert scales.shape == (rows, nblocks) and scales.dtype == torch.float32
    assert packed.untyped_storage().nbytes() + scales.untyped_storage().nbytes() == spec.nbytes(rows, cols)
    back = dequantize(packed, scales, shape, spec)
    # each element is within half the widest code gap of its own block's scale
    scale_per_elem = scales.repeat_interleave(64, 1)[:, :cols]
    bound = scale_per_elem * _max_half_gap(codebook(quant_map, 4)) * (1 + 1e-6)
    assert torch.all((back - m).abs() <= bound)
    # and the codes are exactly the nearest ones to m / scale
    codes_again, _ = quantize(back, spec)
    assert torch.equal(codes_again, packed)  # dequantized values are fixed points


def test_scales_are_per_row_block_so_rows_do_not_share_a_block():
    spec = QuantSpec(4, 64, "linear2")
    m = torch.randn(3, 40, generator=torch.Generator().manual_seed(0))
    m[1] *= 1e6  # a huge row must not coarsen its (short, 40-element) neighbours
    back = dequantize(*quantize(m, spec), (3, 40), spec)
    for r in (0, 2):
        assert (back[r] - m[r]).abs().max() <= m[r].abs().max() * _max_half_gap(codebook("linear2", 4)) * 1.000001


def test_zero_blocks_and_identity_are_exact():
    spec = QuantSpec(4, 64, "linear2")
    for m in (torch.zeros(5, 70), torch.eye(130)):
        back = dequantize(*quantize(m, spec), tuple(m.shape), spec)
        assert torch.equal(back, m)


def test_eight_bit_is_finer_than_four_bit():
    m = torch.randn(100, 100, generator=torch.Generator().manual_seed(1))
    errors = {}
    for bits in (4, 8):
        spec = QuantSpec(bits, 64, "linear2")
        errors[bits] = (dequantize(*quantize(m, spec), (100, 100), spec) - m).norm() / m.norm()
    assert errors[8] < errors[4] / 8


@pytest.mark.parametrize("bits", [2, 3, 4, 8])
def test_round_trip_at_other_bit_widths(bits):
    # 3 bits does not divide a byte: the generic unpacking path; the others use the byte table
    spec = QuantSpec(bits, 64, "dynamic")
    m = torch.randn(7, 99, generator=torch.Generator().manual_seed(bits))
    packed, scales = quantize(m, spec)
    assert packed.numel() == math.ceil(7 * 99 * bits / 8)
    back = dequantize(packed, scales, (7, 99), spec)
    book = codebook("dynamic", bits)
    codes = nearest_code(m / scales.repeat_interleave(64, 1)[:, :99], book)
    assert torch.equal(back, book[codes] * scales.repeat_interleave(64, 1)[:, :99])


@pytest.mark.parametrize("quant_map,bits", [("linear2", 1), ("linear2", 2), ("linear2", 4), ("linear2", 8),
                                           ("dynamic", 2), ("dynamic", 4), ("dynamic", 8)])
def test_byte_table_gather_equals_the_code_book_lookup(quant_map, bits):
    # 4 and 8 bits gather the byte table's rows as int64 / int32 scalars, 1 and 2 bits as rows; an odd
    # size leaves the last byte part padding. Every path must give the code book's values exactly,
    # and run on fake tensors (the cost model) with the real result's shape and dtype.
    from torch._subclasses.fake_tensor import FakeTensorMode

    spec = QuantSpec(bits, 16, quant_map)
    m = torch.randn(5, 37, generator=torch.Generator().manual_seed(bits))
    packed, scales = quantize(m, spec)
    back = dequantize(packed, scales, (5, 37), spec)
    scale = scales.repeat_interleave(16, 1)[:, :37]
    book = codebook(quant_map, bits)
    assert torch.equal(back, book[nearest_code(m / scale, book)] * scale)
    with FakeTensorMode() as mode:
        fake = dequantize(mode.from_tensor(packed), mode.from_tensor(scales), (5, 37), spec)
    assert fake.shape == back.shape and fake.dtype == back.dtype


def test_order_1200_costs_4_5_bits_per_element():
    assert QuantSpec().nbytes(1200, 1200) == 1200 * 1200 // 2 + 1200 * 19 * 4
    assert 4 * 1200 * 1200 / QuantSpec().nbytes(1200, 1200) == pytest.approx(7.1, abs=0.01)


def test_quant_spec_errors():
    with pytest.raises(ValueError, match=r"block_size=0 must be a positive int"):
        QuantSpec(4, 0)
    with pytest.raises(ValueError, match=r"quant_map='nf4' is not known"):
        QuantSpec(4, 64, "nf4")
    with pytest.raises(ValueError, match=r"quantize takes a matrix, got shape \(4,\)"):
        quantize(torch.ones(4), QuantSpec())


# --- Björck, QR iteration, inverse root ---------------------------------------------------------

def _orth_error(v):
    return (v.T @ v - torch.eye(v.shape[1], dtype=v.dtype)).norm().item()


def test_bjorck_converges_quadratically():
    q = _orthogonal(64, 0)
    v = q + 1e-2 * torch.randn(64, 64, generator=torch.Generator().manual_seed(1), dtype=torch.float64)
    errors = [_orth_error(bjorck(v, k)) for k in range(5)]
    assert errors[0] > 0.1
    for before, after in itertools.pairwise(errors[:4]):
        assert after < 2 * before ** 2  # quadratic: each step squares the error (up to a small constant)
    assert errors[4] < 1e-12
    assert torch.equal(bjorck(v, 0), v)


def test_bjorck_rectifies_4bit_eigenvectors_towards_the_true_ones():
    q = _orthogonal(256, 2, torch.float32)
    spec = QuantSpec()
    v = dequantize(*quantize(q.T.contiguous(), spec), (256, 256), spec).T
    rectified = bjorck(v, 4)
    assert _orth_error(rectified) < 1e-4 and _orth_error(v) > 0.1
    assert (rectified - q).norm() < (v - q).norm()


def test_inverse_root_matches_eigh_in_float64():
    a, q, lam = _spd(50, 3)
    eps = 1e-6
    reference = eigh_inverse_root(a, eps)
    # reference by hand: (λ + eps·max λ)^(-1/4) on the true eigenvectors
    by_hand = (q * (lam + eps * lam.max()) ** -0.25) @ q.T
    assert torch.allclose(reference, by_hand, rtol=1e-9, atol=1e-12)
    assert torch.allclose(inverse_root(q, lam, eps), by_hand, rtol=1e-9, atol=1e-12)
    # its 4th power inverts A plus the relative ridge
    ridged = a + eps * lam.max() * torch.eye(50, dtype=a.dtype)
    assert torch.allclose(torch.linalg.matrix_power(reference, 4) @ ridged, torch.eye(50, dtype=a.dtype), atol=1e-8)


def test_warm_started_qr_iteration_converges_to_the_eigh_inverse_root():
    a, _, lam = _spd(40, 4, spread=1e3)
    v = torch.eye(40, dtype=torch.float64)  # the optimizer's start: eps·I has eigenvectors I
    vals = torch.ones(40, dtype=torch.float64)
    for _ in range(300):
        v, vals = subspace_step(a, v, vals)
    assert torch.allclose(vals.sort().values, lam, rtol=1e-6)
    assert torch.allclose(inverse_root(v, vals, 1e-6), eigh_inverse_root(a, 1e-6), rtol=1e-5, atol=1e-8)


def test_qr_iteration_keeps_exact_eigenvectors_and_tracks_a_slow_change():
    a, q, lam = _spd(30, 5, spread=1e2)
    p, vals = subspace_step(a, q, lam)
    order = lam.argsort(descending=True)  # the columns come back by descending eigenvalue
    assert torch.allclose(p.abs(), q[:, order].abs(), atol=1e-10) and torch.allclose(vals, lam[order], rtol=1e-10)
    g = torch.randn(30, 8, generator=torch.Generator().manual_seed(6), dtype=torch.float64)
    a2 = 0.95 * a + 0.05 * g @ g.T  # one statistic update
    p2, vals2 = subspace_step(a2, q, lam)
    reference = eigh_inverse_root(a2, 1e-6)
    one_step = (inverse_root(p2, vals2, 1e-6) - reference).norm() / reference.norm()
    stale = (inverse_root(q, lam, 1e-6) - reference).norm() / reference.norm()
    assert one_step < stale / 1.5 and one_step < 0.03
    # the order matters: warm-started in ascending order, one step is worse than not moving at all
    p3, vals3 = subspace_step(a2, q, -lam)
    assert (inverse_root(p3, vals3, 1e-6) - reference).norm() / reference.norm() > stale
