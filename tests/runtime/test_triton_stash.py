"""The stash's Triton kernels (memopt/runtime/triton_stash.py, triton_stash_extras.py) against the plain path, bit
for bit: codes, bin sums, rebuilt values, offsets, masks, groups, and a whole model's gradients.

They run in triton's CPU interpreter (TRITON_INTERPRET=1 per test, as tests/runtime/test_triton_fewbit.py does).
``MEMOPT_KERNELS=torch`` is the reference; the Triton runs leave the C kernels out (``native.disabled``) where the
comparison reaches code that has no Triton version: the C BN backward sums in another order than the plain one.
"""

import pytest
import torch
import torch.nn.functional as F

from conftest import requires_cuda
from memopt.runtime import kernels, triton_stash, triton_stash_extras as extras
from memopt.runtime.bitpack import pack_bits, unpack_bits
from memopt.stash import generic, grid as G
from memopt.stash import stats as S
from memopt.stash.pool import max_pool2d_indices_only, pool_indices, pool_offsets
from triton_stash_helpers import FLOATS, _both, _chain_input, _same, _stats, interpret, requires_triton  # noqa: F401 (interpret: a fixture)

pytestmark = pytest.mark.filterwarnings("ignore:invalid value encountered:RuntimeWarning")

CHAINS = [("relu", True, False), ("relu", True, True), ("relu6", True, False), ("identity", False, False),
          ("leaky_relu", True, False)]


@pytest.mark.slow
@requires_triton
@pytest.mark.parametrize("bits", [1, 2, 4, 8])
@pytest.mark.parametrize("act, split, residual", CHAINS)
def test_x_code_matches_the_plain_path(interpret, bits, act, split, residual):
    for shape, dtype, layout, means in [((4, 3, 9, 7), torch.float32, "contiguous", True),
                                        ((3, 5, 6, 11), torch.float32, "channels_last", True),
                                        ((2, 4, 5, 5), torch.bfloat16, "channels_last", False),
                                        ((3, 2, 7, 9), torch.float16, "contiguous", True),
                                        ((5, 6), torch.float32, "contiguous", False),
                                        ((3, 4, 37), torch.float32, "contiguous", True)]:
        x = _chain_input(shape, dtype, layout)
        for affine_dtype in {torch.float32, dtype}:  # statistics in float32, or in x's own low precision
            weight, bias, mean, invstd, z = _stats(x, affine_dtype)
            mask = G._mask(z, act, (0.1,))

            def code():
                return G.x_code(x, weight, bias, mean, invstd, 1e-5, mask, bits, act, split, residual,
                                affine=not residual, means=means)

            plain, fused = _both(code)
            _same(plain, fused, f"x_code {shape} {dtype} {layout} {affine_dtype}")


def _x_plain(x, mean, invstd, xstd, grid, mask, bits, sums, stride):
    """memopt.stash.grid._x_codes in one slice, its bin sums taken every ``stride``-th element."""
    nd = x.dim()
    scale = S._per_channel(invstd / xstd.clamp_min(1e-12), nd)

    def code(lo, width):
        v = (x - S._per_channel(mean, nd)).mul_(scale)
        return G._code_(v, S._per_channel(lo, nd), S._per_channel(width.clamp_min(torch.finfo(torch.float32).tiny),
                                                                   nd), 1 << bits, keep_r=True)

    (c1, r1), (c0, r0) = code(grid[2], grid[3]), code(grid[0], grid[1])
    codes = S.select_u8(mask, c1, c0)
    G.add_bin_sums(sums, torch.where(mask, r1, r0), codes, mask, bits, stride=stride)
    return pack_bits(codes, bits)


@requires_triton
def test_bin_sums_every_stride_and_non_finite_values(interpret):
    x = _chain_input((3, 4, 10, 10), torch.float32, "contiguous")
    x[0, 1, 2, 3], x[1, 2, 0, 0], x[2, 3, 1, 1] = float("nan"), float("inf"), -float("inf")
    weight, bias, mean, invstd, z = _stats(x)
    xstd = S._xhat_std(invstd, 1e-5)
    grid = G._grid(weight, bias, xstd, 4, "relu", True, G._ends(x, mean, invstd, xstd, z > 0, False))
    for stride in (1, 2, 4, 7):
        want, got = G.new_bin_sums(4, 2, 4, "cpu"), G.new_bin_sums(4, 2, 4, "cpu")
        with kernels.forced("torch"):
            codes = _x_plain(x, mean, invstd, xstd, grid, z > 0, 4, want, stride)
        with kernels.forced("triton"):
            packed = triton_stash.encode(x, grid, 4, mean=mean, invstd=invstd, xstd=xstd, mask=z > 0, sums=got,
                                         sum_stride=stride)
        assert torch.equal(packed, codes)
        assert torch.equal(want, got), stride
        # channels 1-3 hold a NaN or an inf: NaN statistics, nothing counted; channel 0 every stride-th element
        counts = [sum(1 for i in range(0, x.numel(), stride) if i // 100 % 4 == 0), 0, 0, 0]
        assert want[1].sum(1).tolist() == counts, stride


def _z_plain(z, origin, zwidth, zero_code, bits, relu_like, sums):
    """memopt.stash.ops.BNActStash's plain z code (one batch slice: the whole tensor)."""
    nd = z.dim()
    positive = ~(z <= 0) if relu_like else z > 0
    code, r = G._code_(z.to(torch.float32, copy=True), S._per_channel(origin, nd), S._per_channel(zwidth, nd),
                       1 << bits, keep_r=True)
    zc = S._per_channel(zero_code, nd).to(torch.uint8)
    codes = S.select_u8(positive, torch.maximum(code, zc), torch.minimum(code, zc - 1))
    if sums is not None:
        G.add_bin_sums(sums, r, codes, None, bits)
    return pack_bits(codes, bits)


@requires_triton
@pytest.mark.parametrize("bits", [1, 3, 4, 8])
@pytest.mark.parametrize("dtype, layout", [(torch.float32, "contiguous"), (torch.bfloat16, "channels_last"),
                                           (torch.float16, "contiguous")])
def test_a_residual_z_code_matches_the_plain_path(interpret, bits, dtype, layout):
    z = _chain_input((3, 4, 7, 5), dtype, layout)
    z[0, 1, 2, 3] = 0.0
    c = z.shape[1]
    zwidth = torch.rand(c) * 0.3 + 0.05
    zero_code = torch.randint(1, 1 << bits, (c,), dtype=torch.int32) if bits > 1 else torch.ones(c, dtype=torch.int32)
    origin = -zero_code.float() * zwidth
    for relu_like in (True, False):
        want, got = G.new_bin_sums(c, 1, bits, "cpu"), G.new_bin_sums(c, 1, bits, "cpu")
        with kernels.forced("torch"):
            plain = _z_plain(z, origin, zwidth, zero_code, bits, relu_like, want)
        with kernels.forced("triton"):
            fused = triton_stash.encode(z, torch.stack([origin, zwidth]), bits, zero_code=zero_code,
                                        positive_not_le=relu_like, sums=got, sum_stride=G.MEAN_STRIDE)
        assert torch.equal(plain, fused) and torch.equal(want, got), relu_like


@requires_triton
@pytest.mark.parametrize("bits", [1, 2, 4, 8])
def test_rebuild_from_rows_and_books_matches_the_plain_path(interpret, bits):
    torch.manual_seed(0)
    for shape in [(4, 3, 9, 7), (5, 6), (2, 3, 1), (2, 3, 0)]:  # an empty batch: BatchNorm refuses it
        c = shape[1]
        codes = torch.randint(0, 1 << bits, shape, dtype=torch.uint8)
        mask = torch.rand(shape) > 0.5
        rows4 = torch.stack([torch.randn(c), torch.rand(c) * 0.4, torch.randn(c), torch.rand(c) * 0.2])
        books = [torch.randn(c, 2, 1 << bits), torch.randn(c, 1, 1 << bits)]
        for grid in [rows4, rows4[:2], *books]:
            split = grid.shape[0] == 4 if grid.dim() == 2 else grid.shape[1] == 2
            m = mask if split else None
            plain, fused = _both(lambda: G._from_codes(codes, m, grid))
            _same(plain, fused, f"{shape} {tuple(grid.shape)}")
            packed = pack_bits(codes, bits)
            with kernels.forced("triton"):
                _same(plain, triton_stash.rebuild(packed, bits, shape, grid, m))
                if split:
                    _same(plain, triton_stash.rebuild(packed, bits, shape, grid, pack_bits(mask, 1), mask_bits=True))


POOLS = [((2, 3, 9, 11), 3, 2, 1, 1, False), ((2, 3, 9, 11), 3, 2, 1, 1, True), ((1, 2, 8, 8), 2, 2, 0, 1, False),
         ((2, 2, 13, 12), 3, 1, 1, 2, True), ((1, 1, 5, 6), (2, 3), (1, 2), (1, 0), 1, False),
         ((2, 3, 20, 20), 5, 3, 2, 1, False)]


@requires_triton
@pytest.mark.parametrize("shape, kernel, stride, padding, dilation, ceil_mode", POOLS)
@pytest.mark.parametrize("dtype, layout", [(torch.float32, "contiguous"), (torch.float32, "channels_last"),
                                           (torch.bfloat16, "contiguous")])
def test_max_pool_offsets_and_gradients_match_the_plain_path(interpret, shape, kernel, stride, padding, dilation,
                                                             ceil_mode, dtype, layout):
    x = _chain_input(shape, dtype, layout, special=False)
    grad = torch.randn(F.max_pool2d(x, kernel, stride, padding, dilation, ceil_mode).shape).to(dtype)

    def run():
        out, indices = F.max_pool2d(x, kernel, stride, padding, dilation, ceil_mode=ceil_mode, return_indices=True)
        packed, meta = pool_offsets(x.shape, out, indices, kernel, stride, padding, dilation)
        rebuilt = pool_indices(packed, meta, x.device)
        assert torch.equal(rebuilt, indices.reshape(rebuilt.shape))
        leaf = x.detach().clone().requires_grad_()
        max_pool2d_indices_only(leaf, kernel, stride, padding, dilation, ceil_mode).backward(grad)
        return packed, rebuilt, leaf.grad

    plain, fused = _both(run)
    _same(plain, fused)


@requires_triton
@pytest.mark.parametrize("mask", ["random", "broadcast", "transposed", "six_dims", "float", "empty", "odd"])
def test_one_bit_masks_pack_and_unpack_as_bitpack_does(interpret, mask):
    torch.manual_seed(0)
    m = {"random": lambda: torch.rand(3, 5, 7) > 0.5, "broadcast": lambda: (torch.rand(4, 1, 6) > 0.5).expand(4, 5, 6),
         "transposed": lambda: (torch.rand(6, 9) > 0.5).t(),
         "six_dims": lambda: torch.rand(2, 3, 2, 3, 2, 5)[..., ::2] > .5,
         "float": lambda: torch.randn(7, 3).relu(), "empty": lambda: torch.zeros(0, 3) > 0,
         "odd": lambda: torch.rand(13) > 0.5}[mask]()
    want = pack_bits(m != 0, 1)
    with kernels.forced("triton"):
        got = extras.pack_mask(m)
        assert torch.equal(want, got)
        assert torch.equal(extras.unpack_mask(got, m.numel()), unpack_bits(want, 1, m.numel()))


@requires_triton
@pytest.mark.parametrize("dtype", FLOATS)
@pytest.mark.parametrize("shape", [(4, 6, 5), (2, 3, 4, 5), (0, 4)])
def test_dropout_and_where_gradients_match_the_plain_path(interpret, dtype, shape):
    x = torch.randn(shape).to(dtype)
    a, b = torch.randn(shape).to(dtype), torch.randn(shape[-1]).to(dtype)
    cond = torch.rand(shape[-1:]) > 0.5  # broadcast against a and b

    def run():
        leaf = x.clone().requires_grad_()
        y = generic.dropout_1bit(leaf, 0.3)
        y.backward(torch.ones_like(y))
        la, lb = a.clone().requires_grad_(), b.clone().requires_grad_()
        w = generic.where_1bit(cond, la, lb)
        w.backward(torch.ones_like(w) * 0.5)
        return y, leaf.grad, w, la.grad, lb.grad

    plain, fused = _both(run)
    _same(plain, fused)


@requires_triton
@pytest.mark.parametrize("dtype", FLOATS)
@pytest.mark.parametrize("stochastic", [False, True])
def test_generic_groups_match_the_plain_path(interpret, dtype, stochastic):
    torch.manual_seed(0)
    cases = [(torch.randn(4, 8, 5, 7), 256, 4), (torch.randn(1001), 100, 3), (torch.randn(3, 17), 256, 2),
             (torch.randn(2, 6, 4, 4).contiguous(memory_format=torch.channels_last), 64, 8),
             (torch.randn(9, 40).t(), 7, 1)]
    for x, group, bits in cases:
        x = x.to(dtype)
        if x.numel() > 300 and x.is_contiguous():  # a NaN poisons its group, an inf its group's step
            x.view(-1)[[3, 600]] = torch.tensor([float("nan"), float("inf")]).to(dtype)

        def run():
            packed, params = generic.group_quantize(x, bits, group, stochastic)
            return packed, params, generic.group_dequantize(packed, params, bits, group, x)

        plain, fused = _both(run)
        _same(plain, fused, f"{tuple(x.shape)} {group} {bits}")
    empty = torch.zeros(0, 5, dtype=dtype)  # the plain path fails on it (the pass never codes an empty tensor)
    with kernels.forced("triton"):
        packed, params = generic.group_quantize(empty, 4, 256, stochastic)
        assert packed.shape == (0,) and params.shape == (2, 0)
        _same(generic.group_dequantize(packed, params, 4, 256, empty), empty)



@requires_cuda
@requires_triton
@pytest.mark.parametrize("dtype", FLOATS)
def test_cuda_codecs_match_the_plain_path(dtype):
    # compiled on the GPU: the comparisons above on CUDA tensors, where the default is plain PyTorch
    x = _chain_input((4, 6, 9, 7), dtype, "channels_last").cuda()
    for affine_dtype in {torch.float32, dtype}:
        weight, bias, mean, invstd, z = _stats(x, affine_dtype)
        for act, split, residual in CHAINS:
            mask = G._mask(z, act, (0.1,))
            for bits in (1, 4, 8):
                plain, fused = _both(lambda: G.x_code(x, weight, bias, mean, invstd, 1e-5, mask, bits, act, split,
                                                      residual, affine=not residual, means=True))
                _same(plain, fused, f"{act} {bits} {affine_dtype}")
                codes = unpack_bits(fused[0], bits, x.numel()).view(x.shape)
                book = fused[4] if fused[4] is not None else fused[1]
                _same(*_both(lambda: G._from_codes(codes, mask if split else None, book)))
    for shape, kernel, stride, padding, dilation, ceil_mode in POOLS:
        xp = _chain_input(shape, dtype, "channels_last", special=False).cuda()

        def pool():
            out, indices = F.max_pool2d(xp, kernel, stride, padding, dilation, ceil_mode=ceil_mode,
                                        return_indices=True)
            packed, meta = pool_offsets(xp.shape, out, indices, kernel, stride, padding, dilation)
            return packed, pool_indices(packed, meta, xp.device)

        _same(*_both(pool))
    cond = torch.rand(x.shape[-1], device="cuda") > 0.5  # broadcast against x

    def masks():
        leaf, other = x.clone().requires_grad_(), x.clone().requires_grad_()
        y = generic.dropout_1bit(leaf, 0.3)
        y.backward(torch.ones_like(y))
        w = generic.where_1bit(cond, other, torch.zeros((), dtype=dtype, device="cuda"))
        w.backward(torch.ones_like(w))
        return y, leaf.grad, w, other.grad

    _same(*_both(masks))
    for stochastic in (False, True):
        def groups():
            packed, params = generic.group_quantize(x, 4, 256, stochastic)
            return packed, params, generic.group_dequantize(packed, params, 4, 256, x)

        _same(*_both(groups))


@requires_triton
@pytest.mark.parametrize("bits", [1, 2, 4, 8])
@pytest.mark.parametrize("act", ["relu", "relu6", "leaky_relu", "identity"])
def test_a_chains_rebuilt_activation_and_mask_match_the_plain_path(interpret, bits, act):
    from memopt.stash.ops import _Stash  # the consumers' rebuild of act(z)
    torch.manual_seed(0)
    for shape in [(4, 3, 9, 7), (5, 6), (2, 3, 0)]:
        c = shape[1]
        codes = torch.randint(0, 1 << bits, shape, dtype=torch.uint8)
        packed = pack_bits(codes, bits)
        mask = torch.rand(shape) > 0.5
        zero_code = torch.randint(0, 1 << bits, (c,), dtype=torch.int32)
        rows = torch.stack([torch.randn(c) * 4, torch.rand(c) * 2])  # midpoints spread across 0, 3 and 6
        rows4 = torch.cat([rows, torch.stack([torch.randn(c) * 4, torch.rand(c)])])
        for affine in [rows, rows4, torch.randn(c, 1, 1 << bits) * 4, torch.randn(c, 2, 1 << bits) * 4]:
            split = affine.shape[0] == 4 if affine.dim() == 2 else affine.shape[1] == 2
            sources = [pack_bits(mask, 1)] if split else [pack_bits(mask, 1), torch.empty(0, dtype=torch.uint8)]
            if act == "identity" and split:
                continue  # an identity chain keeps no mask: its code is never split
            for mask_packed in sources:
                args = (packed, mask_packed, affine, zero_code, bits, torch.Size(shape), act, (0.1,))
                plain, fused = _both(lambda: _Stash.rebuild(*args))
                _same(plain, fused, f"{shape} {tuple(affine.shape)} mask={mask_packed.numel()}")
        plain, fused = _both(lambda: G.exact_mask(torch.empty(0, dtype=torch.uint8), packed, zero_code, bits,
                                                  torch.Size(shape)))
        _same(plain, fused, f"mask from the code {shape}")
        plain, fused = _both(lambda: G.exact_mask(pack_bits(mask, 1), packed, zero_code, bits, torch.Size(shape)))
        _same(plain, fused, f"1-bit mask {shape}")


@requires_triton
@pytest.mark.parametrize("dtype, layout", [(torch.float32, "contiguous"), (torch.float32, "channels_last"),
                                           (torch.bfloat16, "contiguous")])
def test_the_data_ends_of_a_grid_match_the_plain_path(interpret, dtype, layout):
    x = _chain_input((37, 4, 5, 3), dtype, layout)  # more samples than side_ends' parts
    mask = x > 0.3
    mask[:, 2] = False  # channel 2: an empty masked side (+inf)
    x[1, 3, 2, 1] = float("nan")  # channel 3: NaN at both ends, as the plain path gives
    mean = x.float().mean((0, 2, 3)).nan_to_num()
    invstd = torch.rand(4) + 0.5
    xstd = torch.rand(4) + 0.5
    for inner in (True, False):  # a residual chain's sides, else the channel's extremes (both from one pass)
        plain, fused = _both(lambda: G._ends(x, mean, invstd, xstd, mask, inner))
        _same(plain, fused, f"inner={inner}")
        assert fused[:, 3].isnan().all()
        if inner:
            assert fused[2, 2] == float("inf")  # channel 2's masked side is empty
        else:  # every end is the channel's extreme
            assert torch.equal(fused[:2, :3], fused[2:, :3])
