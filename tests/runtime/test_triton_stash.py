"""The stash's Triton kernels (memopt/runtime/triton_stash.py, triton_stash_extras.py) against the plain path, bit
for bit: codes, bin sums, rebuilt values, offsets, masks, groups, and a whole model's gradients.

They run in triton's CPU interpreter (TRITON_INTERPRET=1 per test, as tests/runtime/test_triton_fewbit.py does).
``MEMOPT_KERNELS=torch`` is the reference; the Triton runs leave the C kernels out (``native.disabled``) where the
comparison reaches code that has no Triton version: the C BN backward sums in another order than the plain one.
"""
import copy

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch._subclasses.fake_tensor import FakeTensorMode

import memopt
from conftest import requires_cuda
from memopt.cost_model.storage import LiveStorageTracker
from memopt.runtime import kernels, native, triton_fewbit, triton_stash, triton_stash_extras as extras
from memopt.runtime.bitpack import pack_bits, unpack_bits
from memopt.stash import generic, grid as G
from memopt.stash.ops import ChainSpec, bn_act_stash
from memopt.stash.pool import max_pool2d_indices_only, pool_indices, pool_offsets

requires_triton = pytest.mark.skipif(not triton_fewbit.AVAILABLE, reason=f"triton does not import here "
                                                                         f"({triton_fewbit.IMPORT_ERROR})")
pytestmark = pytest.mark.filterwarnings("ignore:invalid value encountered:RuntimeWarning")
FLOATS = [torch.float32, torch.bfloat16, torch.float16]


@pytest.fixture
def interpret(monkeypatch):
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    yield


def _run(choice, fn):
    """fn() with MEMOPT_KERNELS=choice (the C kernels off under triton: see the module docstring)."""
    torch.manual_seed(0)
    generic._GENERATORS.clear()  # stochastic rounding's private generator restarts at its seed
    with kernels.forced(choice), (native.disabled() if choice == "triton" else _nothing()):
        return fn()


class _nothing:
    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return False


def _same(a, b, what=""):
    """Equal bit for bit (NaN payloads aside), same dtype, shape and strides; tuples, lists and None too."""
    if isinstance(a, (tuple, list)):
        assert len(a) == len(b), what
        for i, (x, y) in enumerate(zip(a, b)):
            _same(x, y, f"{what}[{i}]")
        return
    if a is None or not isinstance(a, torch.Tensor):
        assert a == b, what
        return
    assert (a.shape, a.dtype, a.stride()) == (b.shape, b.dtype, b.stride()), what
    if not a.is_floating_point():
        assert torch.equal(a, b), what
        return
    assert torch.equal(a.isnan(), b.isnan()), what
    ints = {8: torch.int64, 4: torch.int32, 2: torch.int16}[a.element_size()]
    keep = ~a.isnan()
    assert torch.equal(a[keep].view(ints), b[keep].view(ints)), what


def _both(fn):
    plain, fused = _run("torch", fn), _run("triton", fn)
    return plain, fused


def _chain_input(shape, dtype, layout, seed=0, special=True):
    torch.manual_seed(seed)
    x = (torch.randn(shape) * 2 + 0.3)
    if special and x.numel() > 8:
        x.view(-1)[3] = 40.0  # far past the window: clipped, and where K reaches out, followed
        x.view(-1)[5] = -0.0
    x = x.to(dtype)
    return x.contiguous(memory_format=torch.channels_last) if layout == "channels_last" else x


def _stats(x, affine_dtype=torch.float32):
    c = x.shape[1]
    torch.manual_seed(1)
    weight = (torch.rand(c) + 0.5).to(device=x.device, dtype=affine_dtype)
    bias = (torch.randn(c) * 0.5).to(device=x.device, dtype=affine_dtype)
    out, mean, invstd, _, _ = G.batch_norm_train(x, weight, bias, None, None, None, 0.1, 1e-5)
    return weight, bias, mean, invstd, out


CHAINS = [("relu", True, False), ("relu", True, True), ("relu6", True, False), ("identity", False, False),
          ("leaky_relu", True, False)]


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
    scale = G._per_channel(invstd / xstd.clamp_min(1e-12), nd)

    def code(lo, width):
        v = (x - G._per_channel(mean, nd)).mul_(scale)
        return G._code_(v, G._per_channel(lo, nd), G._per_channel(width.clamp_min(torch.finfo(torch.float32).tiny),
                                                                   nd), 1 << bits, keep_r=True)

    (c1, r1), (c0, r0) = code(grid[2], grid[3]), code(grid[0], grid[1])
    codes = G.select_u8(mask, c1, c0)
    G.add_bin_sums(sums, torch.where(mask, r1, r0), codes, mask, bits, stride=stride)
    return pack_bits(codes, bits)


@requires_triton
def test_bin_sums_every_stride_and_non_finite_values(interpret):
    x = _chain_input((3, 4, 10, 10), torch.float32, "contiguous")
    x[0, 1, 2, 3], x[1, 2, 0, 0], x[2, 3, 1, 1] = float("nan"), float("inf"), -float("inf")
    weight, bias, mean, invstd, z = _stats(x)
    xstd = G._xhat_std(invstd, 1e-5)
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
    code, r = G._code_(z.to(torch.float32, copy=True), G._per_channel(origin, nd), G._per_channel(zwidth, nd),
                       1 << bits, keep_r=True)
    zc = G._per_channel(zero_code, nd).to(torch.uint8)
    codes = G.select_u8(positive, torch.maximum(code, zc), torch.minimum(code, zc - 1))
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


class _Net(nn.Module):
    """conv-BN-ReLU-max-pool stem, a residual block with a downsample-free skip, dropout and a linear head."""

    def __init__(self, c=8):
        super().__init__()
        self.conv0, self.bn0 = nn.Conv2d(3, c, 3, padding=1, bias=False), nn.BatchNorm2d(c)
        self.pool = nn.MaxPool2d(3, 2, 1)
        self.conv1, self.bn1 = nn.Conv2d(c, c, 3, padding=1, bias=False), nn.BatchNorm2d(c)
        self.conv2, self.bn2 = nn.Conv2d(c, c, 3, padding=1, bias=False), nn.BatchNorm2d(c)
        self.conv3, self.bn3 = nn.Conv2d(c, c, 3, padding=1, bias=False), nn.BatchNorm2d(c)
        self.drop, self.fc = nn.Dropout(0.2), nn.Linear(c, 5)

    def forward(self, x):
        x = self.pool(F.relu(self.bn0(self.conv0(x))))
        y = F.relu(self.bn2(self.conv2(F.relu(self.bn1(self.conv1(x))))) + x)
        y = F.relu(self.bn3(self.conv3(y)))
        return self.fc(self.drop(y.mean((2, 3))))


@requires_triton
@pytest.mark.parametrize("bits, generic_on", [(4, False), (2, True)])  # 8 bits: test_x_code_matches_...
def test_a_small_cnn_trains_one_step_with_bit_identical_gradients(interpret, monkeypatch, bits, generic_on):
    launched = set()
    real = triton_fewbit._launch
    monkeypatch.setattr(triton_fewbit, "_launch", lambda kernel, *a, **k: launched.add(kernel.__name__) or real(
        kernel, *a, **k))
    torch.manual_seed(0)
    model, x = _Net().train(), torch.randn(4, 3, 24, 24).contiguous(memory_format=torch.channels_last)
    config = memopt.Config(stash=memopt.StashConfig(bits=bits, generic=generic_on, min_per_channel=8), fewbit=None,
                           fidelity=None)

    def step():
        m = copy.deepcopy(model)
        om = memopt.optimize(m, example_inputs=x, config=config)
        torch.manual_seed(3)
        om(x).square().sum().backward()
        grads = [p.grad for p in m.parameters()] + list(m.buffers())
        # saved bytes measured = estimated (the cost model's fake tensors take this path, launching nothing)
        assert memopt.measure(om, x).saved_bytes == om.plan.estimated_saved_bytes
        return grads, om.plan

    (plain, plan), (fused, _) = _both(step)
    _same(plain, fused)
    # every stash codec with a Triton version ran: chain codes and rebuilds, pool offsets, the dropout mask
    want = {"_chain_encode", "_chain_decode", "_walk_pack", "_walk_unpack"}
    assert launched >= want | ({"_group_params", "_group_encode", "_group_decode"} if generic_on else set())
    ops = [(n.op, n.reason.split(":")[0]) for n in plan.nodes if n.technique == "stash"]
    assert ("bn_act_stash", "BN + residual + relu") in ops and ("dropout_1bit", "dropout mask kept as 1 bit per "
                                                                "element (exact)") in ops, ops
    # the stem's max-pool fused into its chain, or (with the generic stash) on its own
    assert ("bn_act_stash", "BN + relu + max-pool") in ops or ("max_pool2d_indices_only", "keeps only its argmax "
                                                                "indices (exact)") in ops, ops


@requires_triton
def test_launches_per_stash_node_are_few_and_fixed(interpret, monkeypatch):
    launches = []
    real = triton_fewbit._launch

    def counted(kernel, grid, *args, **meta):
        launches.append(kernel.__name__)
        real(kernel, grid, *args, **meta)

    monkeypatch.setattr(triton_fewbit, "_launch", counted)
    x = _chain_input((4, 8, 10, 10), torch.float32, "contiguous", special=False)
    c = x.shape[1]
    args = [torch.ones(c, requires_grad=True), torch.zeros(c, requires_grad=True), torch.zeros(c), torch.ones(c), None]
    with kernels.forced("triton"), native.disabled():
        for spec, forward, backward in [
                (ChainSpec("relu", 4, means=True), ["_chain_encode"], ["_chain_decode"]),
                (ChainSpec("relu", 8, pool=(3, 2, 1, 1, False)), ["_walk_pack", "_chain_encode"],
                 ["_walk_unpack", "_chain_decode"])]:
            launches.clear()
            leaf = x.clone().requires_grad_()
            y = bn_act_stash(leaf, *args, None, spec)[0]
            assert launches == forward, spec
            launches.clear()
            y.sum().backward()
            assert launches == backward, spec
        launches.clear()
        packed, params = generic.generic_encode(x, 4, 256, False)
        generic.group_dequantize(packed, params, 4, 256, x)
        assert launches == ["_group_params", "_group_encode", "_group_decode"]
        launches.clear()
        generic.dropout_1bit(x.clone().requires_grad_(), 0.5).sum().backward()
        assert launches == ["_walk_pack", "_walk_unpack"]


@requires_triton
def test_fake_tensors_allocate_what_the_kernels_allocate_and_launch_nothing(interpret, monkeypatch):
    # the cost model runs this path on fake tensors: the same outputs, no launch
    def shapes(make, fake):
        if fake:
            monkeypatch.setattr(triton_fewbit, "_kernel", lambda fn: pytest.fail(f"launched {fn.__name__}"))
        with kernels.forced("triton"), native.disabled():
            x = make()
            c = x.shape[1]
            w, b = torch.ones(c), torch.zeros(c)
            _, mean, invstd, _, _ = G.batch_norm_train(x, w, b, None, None, None, 0.1, 1e-5)
            outs = G.x_code(x, w, b, mean, invstd, 1e-5, x > 0, 4, "relu", True, False, affine=True, means=True)
            packed, params = generic.group_quantize(x, 3, 256, False)
            more = [packed, params, generic.group_dequantize(packed, params, 3, 256, x),
                    extras.pack_mask(x > 0), G._from_codes(torch.zeros(x.shape, dtype=torch.uint8), x > 0, outs[1])]
        return [(tuple(t.shape), t.dtype, t.stride()) for t in [*outs[:2], outs[3], outs[4], *more]]

    real = shapes(lambda: torch.randn(2, 8, 16, 16).contiguous(memory_format=torch.channels_last), False)
    with FakeTensorMode():
        fake = shapes(lambda: torch.randn(2, 8, 16, 16).contiguous(memory_format=torch.channels_last), True)
    assert real == fake


def test_the_default_and_native_keep_the_plain_path(interpret):
    x = torch.randn(4)
    for choice in (None, "native", "torch"):
        with kernels.forced(choice):
            assert not kernels.stash_triton(x, "x̂ code")
    with kernels.forced("triton"):
        assert not kernels.stash_triton(x.double(), "x̂ code")  # float64: the plain path
        assert kernels.stash_triton(x, "x̂ code") == triton_fewbit.AVAILABLE


@requires_triton
def test_forcing_triton_on_a_cpu_tensor_outside_the_interpreter_names_the_fix(monkeypatch):
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    message = (r"MEMOPT_KERNELS=triton but the stash's generic stash code has a CPU input, which Triton runs only "
               r"in its interpreter; set TRITON_INTERPRET=1 \(tests\), or MEMOPT_KERNELS=native")
    with kernels.forced("triton"), pytest.raises(memopt.MemoptError, match=message):
        generic.group_quantize(torch.randn(10), 4, 256, False)


@requires_triton
def test_bad_arguments_are_refused_with_the_fix(interpret):
    x = torch.randn(2, 3, 4)
    rows4 = torch.zeros(4, 3)
    with pytest.raises(ValueError, match=r"a split grid \(4 rows\) needs the mask that picks each element's side; "
                                         r"got mask=None for x of shape \(2, 3, 4\)"):
        triton_stash.encode(x, rows4, 4)
    with pytest.raises(ValueError, match=r"sums must be new_bin_sums\(3, 1, 4\) of shape \(2, 3, 16\), got "
                                         r"\(2, 3, 8\)"):
        triton_stash.encode(x, rows4[:2], 4, sums=torch.zeros(2, 3, 8, dtype=torch.int64))
    with pytest.raises(ValueError, match=r"a code book for 2-bit codes has 4 entries per side, got 8"):
        triton_stash.rebuild(torch.zeros(6, dtype=torch.uint8), 2, x.shape, torch.zeros(3, 1, 8))
    with pytest.raises(ValueError, match=r"packed has 5 bytes but 24 codes of 2 bits need 6; pass the codes"):
        extras.group_decode(torch.zeros(5, dtype=torch.uint8), torch.zeros(2, 1), 2, 256, x)
    with pytest.raises(ValueError, match=r"group must be at least 1 element, got 0"):
        extras.group_encode(x, 4, 0)


def test_without_triton_forcing_it_is_an_error_naming_the_fix(monkeypatch):
    # (tests/runtime/test_triton_fewbit.py imports and trains memopt with `import triton` failing)
    monkeypatch.setattr(triton_stash, "AVAILABLE", False)
    monkeypatch.setattr(triton_fewbit, "IMPORT_ERROR", "ImportError: no triton")
    with kernels.forced(None):
        assert not kernels.stash_triton(torch.randn(3), "generic stash code")
    message = (r"MEMOPT_KERNELS=triton but `import triton` failed \(ImportError: no triton\) for the stash's generic "
               r"stash code; install triton, or set MEMOPT_KERNELS=native \(or unset it\)")
    with kernels.forced("triton"), pytest.raises(memopt.MemoptError, match=message):
        generic.group_quantize(torch.randn(300), 4, 256, False)


@requires_triton
@pytest.mark.parametrize("means", [False, True])
def test_fake_tensors_estimate_the_measured_peak(interpret, monkeypatch, means):
    # one chain node forward and backward on the Triton path, measured, then estimated on fake tensors. The real
    # run launches nothing either: the interpreter re-announces every argument's storage through aten.set_ and
    # keeps arguments alive in reference cycles, which a GPU launch does not; a launch allocates nothing, so the
    # peak is the wrappers' and the ops' around them (the values, never read for a size, do not matter)
    monkeypatch.setattr(triton_fewbit, "_launch", lambda *args, **meta: None)

    def peak(make):
        x = make()
        c = x.shape[1]
        params = [torch.ones(c, requires_grad=True), torch.zeros(c, requires_grad=True)]
        grad = torch.ones(x.shape)
        tracker = LiveStorageTracker([x, grad, *params])
        with tracker, kernels.forced("triton"), native.disabled():
            y = bn_act_stash(x, *params, None, None, None, None, ChainSpec("relu", 4, means=means))[0]
            torch.autograd.grad(y, [x, *params], grad)
        return tracker.peak, sorted(e[1] for e in tracker.at_peak)

    def make():
        return torch.randn(4, 8, 16, 16).requires_grad_()

    real = peak(make)
    with FakeTensorMode():
        assert peak(make) == real


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
