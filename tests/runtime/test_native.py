"""The fused CPU kernels (memopt/runtime/native.py, kernels.c) against the plain-PyTorch codecs they replace:
the same packed bytes, codes and rebuilt values bit for bit, the BN backward up to summation order, the same
memory estimate, and a loud fallback when they cannot be built."""
import contextlib
import copy
import warnings

import pytest
import torch
from torch import nn

import memopt
from memopt.cost_model.storage import LiveStorageTracker
from memopt.runtime import native
from memopt.runtime.bitpack import pack_bits, unpack_bits
from memopt.stash.ops import ChainSpec, _Stash, bn_act_stash
from memopt.testing.zoo import build

pytestmark = pytest.mark.skipif(not native.available(), reason="the fused kernels could not be built here")


def _both(fn):
    """fn() with the kernels, then with the plain path."""
    torch.manual_seed(0)
    fused = fn()
    with native.disabled():
        torch.manual_seed(0)
        plain = fn()
    return fused, plain


@pytest.mark.parametrize("bits", range(1, 9))
def test_pack_and_unpack_write_the_plain_paths_bytes(bits):
    for n in (1, 7, 8, 9, 16383, 16384, 16385, 40001):
        codes = torch.randint(0, 1 << bits, (n,), dtype=torch.uint8)
        fused, plain = _both(lambda: pack_bits(codes, bits))
        assert torch.equal(fused, plain), n
        assert torch.equal(unpack_bits(fused, bits, n), codes)
        with native.disabled():
            assert torch.equal(unpack_bits(fused, bits, n), codes)


def _chain(act, residual, bits, shape, dtype=torch.float32, tails=False, means=False):
    """One BN -> [+ r | + BN2(x2)] -> act chain: (outputs, saved tensors, gradients, rebuilt consumer input);
    ``tails``: heavy-tailed inputs (a log-normal scale per element), whose extremes lie far past the window;
    ``means``: bins rebuilt at their means (``StashConfig.bin_means``)."""
    def run():
        torch.manual_seed(1)
        c = shape[1]
        x = torch.randn(shape) * 2 + 0.5
        if tails:
            x = x * torch.randn(shape).exp()
        x = x.to(dtype).requires_grad_()
        bn, bn2 = nn.BatchNorm2d(c), nn.BatchNorm2d(c)
        with torch.no_grad():
            for b in (bn, bn2):
                b.weight.copy_(torch.randn(c))
                b.bias.copy_(torch.randn(c) * 0.5)
        extra = {}
        r = None
        if residual == "tensor":
            r = torch.relu(torch.randn(shape) * (torch.randn(shape).exp() * 3 if tails else 1)).to(dtype)
            r.requires_grad_()
        elif residual == "bn":
            x2 = torch.randn(shape).to(dtype).requires_grad_()
            extra = dict(x2=x2, weight2=bn2.weight, bias2=bn2.bias, running_mean2=bn2.running_mean,
                         running_var2=bn2.running_var, num_batches_tracked2=bn2.num_batches_tracked)
        params = (0.1,) if act == "leaky_relu" else ()
        y, codes, mask, affine, zero = bn_act_stash(x, bn.weight, bn.bias, bn.running_mean, bn.running_var,
                                                    bn.num_batches_tracked, r,
                                                    ChainSpec(act, bits, act_params=params, residual=r is not None,
                                                              joined=bool(extra), momentum2=0.1, means=means),
                                                    **extra)
        saved = [t.detach().clone() for t in y.grad_fn.saved_tensors if t is not None]
        rebuilt = _Stash.rebuild(codes, mask, affine, zero, bits, torch.Size(shape), act, params) \
            if codes.numel() else torch.zeros(0)
        torch.manual_seed(2)
        y.backward(torch.randn_like(y))
        leaves = [x, bn.weight, bn.bias] + ([r] if r is not None else []) + \
            ([extra["x2"], bn2.weight, bn2.bias] if extra else [])
        return y.detach(), [codes, mask, affine, zero], saved, [t.grad for t in leaves], rebuilt, \
            [bn.running_mean, bn.running_var, bn2.running_mean, bn2.running_var]
    return _both(run)


# (a downsample BN joins only a chain with an activation: passes/stash/chains.py _second_bn)
CASES = [(act, residual, bits) for act in ("relu", "relu6", "leaky_relu", "identity")
         for residual in (None, "tensor", "bn") for bits in (2, 4) if (act, residual) != ("identity", "bn")] + \
        [("relu", None, 3), ("relu", "tensor", 8), ("relu", "bn", 8)]


@pytest.mark.slow
@pytest.mark.parametrize("act, residual, bits", CASES)
@pytest.mark.parametrize("shape", [(6, 5, 7, 9), (3, 4, 1, 1), (8, 6, 33, 35)])  # the last spans several blocks
def test_chain_codes_and_rebuilt_inputs_are_bit_identical_and_gradients_agree(act, residual, bits, shape):
    fused, plain = _chain(act, residual, bits, shape)
    (y, outs, saved, grads, rebuilt, stats), (y_p, outs_p, saved_p, grads_p, rebuilt_p, stats_p) = fused, plain
    assert torch.equal(y, y_p)
    for a, b in zip(outs + saved + stats, outs_p + saved_p + stats_p):
        assert a.dtype == b.dtype and torch.equal(a, b)
    assert torch.equal(rebuilt, rebuilt_p)
    for a, b in zip(grads, grads_p):
        # only the per-channel sums of the BN backward run in another order (double there)
        assert torch.allclose(a, b, rtol=1e-4, atol=1e-5 * b.abs().max().item()), (a - b).abs().max()


@pytest.mark.slow
@pytest.mark.parametrize("bits", [4, 8])
@pytest.mark.parametrize("act, residual", [(act, residual) for act in ("relu", "relu6", "leaky_relu", "identity")
                                           for residual in (None, "tensor", "bn") if (act, residual) != ("identity", "bn")])
def test_grids_that_reach_out_to_heavy_tails_are_bit_identical(act, residual, bits):
    # at 4 and 8 bits the outer ends follow the data past the window (stash_grid.REACH, at 4 bits only where the
    # data end past REACH_PAST windows): the same grids on both paths
    fused, plain = _chain(act, residual, bits, (8, 6, 33, 35), tails=True)
    (y, outs, saved, grads, rebuilt, stats), (y_p, outs_p, saved_p, grads_p, rebuilt_p, stats_p) = fused, plain
    assert torch.equal(y, y_p) and torch.equal(rebuilt, rebuilt_p)
    for a, b in zip(outs + saved + stats, outs_p + saved_p + stats_p):
        assert a.dtype == b.dtype and torch.equal(a, b)
    for a, b in zip(grads, grads_p):
        assert torch.allclose(a, b, rtol=1e-4, atol=1e-5 * b.abs().max().item()), (a - b).abs().max()


@pytest.mark.slow
@pytest.mark.parametrize("act, residual, bits", [case for case in CASES if case[2] <= 4])
@pytest.mark.parametrize("tails", [False, True], ids=["normal", "tails"])
def test_bin_means_are_bit_identical_on_both_paths(act, residual, bits, tails):
    # the means come from integer sums (stash_grid.add_bin_sums, mo_encode): the same code books on both paths,
    # for every code a chain keeps (x̂, the downsample's x̂, z), with clipped tails too
    fused, plain = _chain(act, residual, bits, (8, 6, 33, 35), tails=tails, means=True)
    (y, outs, saved, grads, rebuilt, stats), (y_p, outs_p, saved_p, grads_p, rebuilt_p, stats_p) = fused, plain
    assert torch.equal(y, y_p) and torch.equal(rebuilt, rebuilt_p)
    for a, b in zip(outs + saved + stats, outs_p + saved_p + stats_p):
        assert a.dtype == b.dtype and torch.equal(a, b)
    books = [t for t in saved if t.dim() == 3]  # (C, sides, 2^K): the means were taken
    assert books and all(t.shape[0] == 6 and t.shape[2] == 1 << bits for t in books)
    if residual is not None:  # z's code book goes to the consumers
        assert outs[2].shape == (6, 1, 1 << bits)
    for a, b in zip(grads, grads_p):
        assert torch.allclose(a, b, rtol=1e-4, atol=1e-5 * b.abs().max().item()), (a - b).abs().max()


@pytest.mark.parametrize("act, residual, bits, means", [("relu", None, 4, False), ("relu", "tensor", 4, True),
                                                        ("relu", "bn", 8, False), ("relu6", "tensor", 2, False),
                                                        ("leaky_relu", None, 3, True)])
def test_bfloat16_chains_take_the_kernels_and_code_what_the_plain_path_codes(act, residual, bits, means):
    # autocast's bf16 activations go through the forward kernels (widened a block at a time): before, they took
    # the plain path (several full-size passes per chain: 3.6x stock's step on ResNet-50 in bf16)
    calls = []
    real = native.encode

    def counting(*args, **kwargs):
        calls.append(args[0].dtype)
        return real(*args, **kwargs)
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(native, "encode", counting)
        fused, plain = _chain(act, residual, bits, (8, 6, 33, 35), dtype=torch.bfloat16, tails=True, means=means)
    assert torch.bfloat16 in calls
    (y, outs, saved, grads, rebuilt, stats), (y_p, outs_p, saved_p, grads_p, rebuilt_p, stats_p) = fused, plain
    assert y.dtype == torch.bfloat16 and torch.equal(y, y_p) and torch.equal(rebuilt, rebuilt_p)
    for a, b in zip(outs + saved + stats, outs_p + saved_p + stats_p):
        assert a.dtype == b.dtype and torch.equal(a, b)
    for a, b in zip(grads, grads_p):
        assert a.dtype == b.dtype
        assert torch.allclose(a.float(), b.float(), rtol=1e-2, atol=1e-2 * b.abs().max().item()), (a - b).abs().max()


@pytest.mark.parametrize("n", [1, 40001])
def test_bfloat16_inputs_give_the_float32_copys_masks_extremes_and_codes(n):
    torch.manual_seed(0)
    x = (torch.randn(n, 3, 7, 5) * 4).to(torch.bfloat16)
    x[0, 1, 2, 2], x[-1, 2, 0, 0], x[0, 0, 0, 0] = float("nan"), 6.0, 0.0
    wide = x.float()
    for act in ("relu", "relu6", "leaky_relu"):
        assert torch.equal(native.act_mask(x, act), native.act_mask(wide, act))
    mask = torch.rand(x.shape) > 0.5
    torch.testing.assert_close(native.channel_extremes(x, mask), native.channel_extremes(wide, mask), rtol=0, atol=0,
                               equal_nan=True)
    grid = torch.stack([torch.full((3,), -2.0), torch.full((3,), 0.25), torch.full((3,), -1.0), torch.full((3,), 0.5)])
    mean, scale = torch.randn(3), torch.rand(3) + 0.5
    for rows, m in ((grid[:2], None), (grid, mask)):
        sums, sums_w = (torch.zeros(2, 3, len(rows) // 2 * 16, dtype=torch.int64) for _ in range(2))
        assert torch.equal(native.encode(x, rows, 4, mean=mean, scale=scale, mask=m, sums=sums, sum_stride=3),
                           native.encode(wide, rows, 4, mean=mean, scale=scale, mask=m, sums=sums_w, sum_stride=3))
        assert torch.equal(sums, sums_w)
    zero = torch.tensor([3, 5, 8], dtype=torch.int32)
    assert torch.equal(native.encode(x, grid[:2], 4, zero_code=zero, positive_not_le=True),
                       native.encode(wide, grid[:2], 4, zero_code=zero, positive_not_le=True))
    with pytest.raises(ValueError, match=r"must be float32 or bfloat16, got torch.float16; convert it"):
        native.act_mask(x.half(), "relu")


@pytest.mark.parametrize("act, residual, means", [("relu", None, False), ("relu", "tensor", True),
                                                  ("relu6", "tensor", False), ("leaky_relu", None, True),
                                                  ("identity", "tensor", False)])
def test_a_bf16_rebuild_is_the_float32_rebuild_narrowed_with_no_float32_copy(act, residual, means):
    # a consumer under autocast reads its rebuilt input in bf16: the kernel narrows each block as it writes it
    torch.manual_seed(0)
    shape = (8, 6, 33, 35)  # several blocks
    x = torch.randn(shape) * 3
    r = torch.relu(torch.randn(shape)) if residual else None
    bn = nn.BatchNorm2d(6)
    params = (0.1,) if act == "leaky_relu" else ()
    y, codes, mask, affine, zero = bn_act_stash(x, bn.weight, bn.bias, bn.running_mean, bn.running_var,
                                                bn.num_batches_tracked, r,
                                                ChainSpec(act, 4, act_params=params, residual=r is not None,
                                                          means=means))
    wide = _Stash.rebuild(codes, mask, affine, zero, 4, torch.Size(shape), act, params)
    tracker = LiveStorageTracker(preexisting=[codes, mask, affine, zero])
    with tracker:
        narrow = _Stash.rebuild(codes, mask, affine, zero, 4, torch.Size(shape), act, params, torch.bfloat16)
    assert narrow.dtype == torch.bfloat16 and torch.equal(narrow, wide.to(torch.bfloat16))
    assert tracker.peak <= 2 * narrow.numel() + 4096, tracker.peak  # the bf16 tensor and per-channel tables only
    with native.disabled():
        assert torch.equal(_Stash.rebuild(codes, mask, affine, zero, 4, torch.Size(shape), act, params,
                                          torch.bfloat16), narrow)
    with pytest.raises(ValueError, match=r"out_dtype must be float32 or bfloat16, got torch.float16"):
        native.rebuild(codes, 4, torch.Size(shape), affine, "relu", out_dtype=torch.float16)


@pytest.mark.parametrize("means", [False, True], ids=["midpoints", "means"])
def test_nan_and_inf_inputs_give_stocks_non_finite_gradients(means):
    def run():
        x = torch.randn(16, 3, 16, 16) if means else torch.randn(4, 3, 5, 5)  # the means need large channels
        x[0, 1, 2, 2] = float("nan")
        x[1, 2, 0, 0] = float("inf")
        x.requires_grad_()
        bn = nn.BatchNorm2d(3)
        y = bn_act_stash(x, bn.weight, bn.bias, bn.running_mean, bn.running_var, bn.num_batches_tracked, None,
                         ChainSpec("relu", 4, means=means))[0]
        assert any(t is not None and t.dim() == 3 for t in y.grad_fn.saved_tensors) == means
        y.backward(torch.ones_like(y))
        return x.grad, bn.weight.grad
    (gx, gw), (gx_p, gw_p) = _both(run)
    for a, b in ((gx, gx_p), (gw, gw_p)):
        assert torch.equal(torch.isfinite(a), torch.isfinite(b))
        assert torch.allclose(a[torch.isfinite(a)], b[torch.isfinite(b)], rtol=1e-4, atol=1e-6)
    assert not torch.isfinite(gw[1:]).any() and torch.isfinite(gw[0])


@pytest.mark.slow
@pytest.mark.parametrize("name", ["tiny_resnet", "preact_resnet20", "mobilenet_v2"])
def test_model_gradients_agree_and_the_estimate_is_the_measurement_on_both_paths(name):
    if name == "mobilenet_v2":
        pytest.importorskip("torchvision")
    model, x = build(name)
    results = []
    for use in (True, False):
        m = copy.deepcopy(model)
        with contextlib.nullcontext() if use else native.disabled():
            om = memopt.optimize(m, example_inputs=x, config=memopt.Config(fewbit=None, fidelity=None,
                                                                                 recompute=None))
            real = memopt.measure(om, x)  # no recomputation: the plan is the same on both paths
            assert real.peak_bytes == om.plan.estimated_peak_bytes
            assert real.saved_bytes == om.plan.estimated_saved_bytes
            torch.manual_seed(0)
            out = om(x)
            out.backward(torch.randn_like(out))
        results.append((out.detach(), [p.grad for p in m.parameters()], real))
    (out, grads, real), (out_p, grads_p, real_p) = results
    assert torch.equal(out, out_p)
    assert real.saved_bytes == real_p.saved_bytes  # the same codes; the peak may differ (fewer temporaries)
    assert real.peak_bytes <= real_p.peak_bytes
    # parameters whose exact gradient is numerically zero (a BN bias whose paths all reach a 1x1 conv into a
    # training-mode BN: MobileNetV2's projections) hold only rounding noise, different on each path
    floor = 1e-3 * torch.stack([b.norm() for b in grads_p]).median()
    for a, b in zip(grads, grads_p):
        if b.norm() > floor:
            assert ((a - b).norm() / b.norm()).item() < 1e-4


def test_without_a_compiler_memopt_warns_once_and_uses_the_plain_path(monkeypatch, tmp_path):
    monkeypatch.setattr(native, "_lib", None)
    monkeypatch.setattr(native, "_tried", False)
    monkeypatch.setenv("CC", str(tmp_path / "no-such-cc"))
    monkeypatch.setattr(native, "_compiler", lambda: None)
    with pytest.warns(RuntimeWarning, match=r"could not be built \(no C compiler found.*plain PyTorch ops"):
        assert not native.available()
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert not native.available()  # once
        codes = torch.randint(0, 16, (100,), dtype=torch.uint8)
        assert torch.equal(unpack_bits(pack_bits(codes, 4), 4, 100), codes)


def test_a_failing_compiler_is_quoted(monkeypatch, tmp_path):
    fake_cc = tmp_path / "cc"
    fake_cc.write_text("#!/bin/sh\necho 'error: unsupported option' >&2\nexit 1\n")
    fake_cc.chmod(0o755)
    monkeypatch.setattr(native, "_lib", None)
    monkeypatch.setattr(native, "_tried", False)
    monkeypatch.setattr(native, "_compiler", lambda: str(fake_cc))
    monkeypatch.setenv("MEMOPT_CACHE_DIR", str(tmp_path / "cache"))
    with pytest.warns(RuntimeWarning, match="error: unsupported option"):
        assert not native.available()
    assert not list((tmp_path / "cache").glob("*.so"))  # nothing half-written is left to load


def test_fake_tensors_get_the_outputs_and_no_kernel_runs():
    from torch._subclasses.fake_tensor import FakeTensorMode

    with FakeTensorMode():
        x = torch.empty(4, 3, 5, 5)
        packed = native.encode(x, torch.zeros(2, 3), 4, mean=torch.zeros(3), scale=torch.ones(3))
        out = native.rebuild(packed, 4, x.shape, torch.zeros(2, 3), "relu", mask=torch.ones(4, 3, 5, 5,
                                                                                            dtype=torch.bool))
    assert packed.shape == (150,) and packed.dtype == torch.uint8
    assert out.shape == x.shape and out.dtype == torch.float32


@pytest.mark.parametrize("act", ["relu", "relu6", "leaky_relu"])
@pytest.mark.parametrize("packed_mask", [False, True], ids=["byte_mask", "bit_mask"])
@pytest.mark.parametrize("book", [False, True], ids=["rows", "book"])
def test_bn_backward_without_a_full_size_g_gives_the_same_bits(act, packed_mask, book):
    # keep_g=False (chains whose g nobody else needs) makes g a block at a time in both passes
    torch.manual_seed(0)
    shape, bits = (3, 5, 67, 71), 4  # several blocks, runs that straddle them
    c = shape[1]
    x, grad = torch.randn(shape), torch.randn(shape)
    mask = x > 0.2
    grid = torch.stack([torch.full((c,), -3.0), torch.full((c,), 0.4), torch.zeros(c), torch.full((c,), 0.4)])
    packed = native.encode(x, grid, bits, mask=mask)
    table = torch.randn(c, 2, 1 << bits) if book else grid
    m = native.PackedMask(pack_bits(mask.flatten().to(torch.uint8), 1)) if packed_mask else mask
    xstd, scale = torch.rand(c) + 0.5, torch.randn(c)
    kw = dict(grad=grad, act=act, slope=0.1 if act == "leaky_relu" else 0.0)
    kept = native.bn_backward(packed, bits, torch.Size(shape), table, m, xstd, scale, **kw)
    not_kept = native.bn_backward(packed, bits, torch.Size(shape), table, m, xstd, scale, keep_g=False, **kw)
    assert not_kept[2] is None and kept[2] is not None
    for a, b in zip(kept[:2] + kept[3:], not_kept[:2] + not_kept[3:]):
        assert torch.equal(a, b)
    with pytest.raises(ValueError, match="needs grad and a mask"):
        native.bn_backward(packed, bits, torch.Size(shape), table, None, xstd, scale, keep_g=False, **kw)


@pytest.mark.parametrize("act", ["relu", "relu6"])
@pytest.mark.parametrize("keep_g", [True, False])
@pytest.mark.parametrize("threads", [1, 2])
def test_bn_backward_reads_and_writes_bf16_as_the_float32_copies_would(act, keep_g, threads):
    # autocast's bf16 grad in, bf16 g and grad_x out: the same bits as widening grad first and narrowing after
    torch.manual_seed(1)
    shape, bits = (3, 5, 67, 71), 4  # several blocks, runs that straddle them
    c = shape[1]
    x = torch.randn(shape)
    grad = torch.randn(shape).mul_(1e3).to(torch.bfloat16)  # values whose float32 grad_x needs rounding
    mask = x > 0.2
    grid = torch.stack([torch.full((c,), -3.0), torch.full((c,), 0.4), torch.zeros(c), torch.full((c,), 0.4)])
    packed = native.encode(x, grid, bits, mask=mask)
    xstd, scale = torch.rand(c) + 0.5, torch.randn(c)
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        wide = native.bn_backward(packed, bits, torch.Size(shape), grid, mask, xstd, scale, grad=grad.float(),
                                  act=act, keep_g=keep_g)
        narrow = native.bn_backward(packed, bits, torch.Size(shape), grid, mask, xstd, scale, grad=grad, act=act,
                                    keep_g=keep_g, out_dtype=torch.bfloat16)
    finally:
        torch.set_num_threads(before)
    assert narrow[0].dtype == torch.bfloat16 and torch.equal(narrow[0], wide[0].to(torch.bfloat16))
    assert torch.equal(narrow[1], wide[1]) and torch.equal(narrow[3], wide[3])  # the sums are the float32 ones
    if keep_g:
        assert narrow[2].dtype == torch.bfloat16 and torch.equal(narrow[2].float(), wide[2])  # exact: a selection
    # a bf16 g as the input (the downsample BN's), written over by its own grad_x
    g = narrow[2] if keep_g else (grad * mask).to(torch.bfloat16)
    expected = native.bn_backward(packed, bits, torch.Size(shape), grid, mask, xstd, scale, g=g.float(),
                                  sum_g=wide[3])
    into = g.clone()
    got = native.bn_backward(packed, bits, torch.Size(shape), grid, mask, xstd, scale, g=into, sum_g=wide[3], out=into)
    assert got[0] is into and torch.equal(into, expected[0].to(torch.bfloat16))
    assert torch.equal(got[1], expected[1])


def test_bf16_narrowing_rounds_to_nearest_even_as_torch_does():
    # ties, the largest finite values, infinities, subnormals and NaN through the kernel's narrowing
    shape = (1, 1, 40000)
    codes = native.encode(torch.zeros(shape), torch.stack([torch.full((1,), -1.0), torch.full((1,), 0.25)]), 3)
    gen = torch.Generator().manual_seed(2)
    bits_ = torch.randint(-(2 ** 31), 2 ** 31 - 1, (shape[-1],), generator=gen, dtype=torch.int64).to(torch.int32)
    g = bits_.view(torch.float32).view(shape).clone()
    g.view(-1)[:6] = torch.tensor([1 + 2 ** -8, 1 + 3 * 2 ** -8, 3.4e38, float("inf"), 1e-40, float("nan")])
    # the BN backward with scale 1 and zero sums is grad_x = g exactly: the narrowing alone is seen
    out = native.bn_backward(codes, 3, torch.Size(shape), torch.stack([torch.zeros(1), torch.zeros(1)]), None,
                             torch.zeros(1), torch.ones(1), g=g, sum_g=torch.zeros(1), exact=(torch.zeros(1),
                             torch.ones(1, dtype=torch.bool)), out_dtype=torch.bfloat16)[0]
    finite = ~g.isnan()
    assert torch.equal(out[finite], g[finite].to(torch.bfloat16))
    assert out.isnan().sum() == g.isnan().sum()
