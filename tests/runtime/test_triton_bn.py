"""The BatchNorm backward from an x̂ code in two Triton launches (memopt/runtime/triton_bn.py) against the plain
path (memopt/stash/bn.py with MEMOPT_KERNELS=torch) and a float64 reference, in triton's CPU interpreter.

Its sums run in another (fixed) order than PyTorch's, so values agree to float32 rounding, not bit for bit."""
import pytest
import torch

from memopt.runtime import kernels, native, triton_bn, triton_fewbit
from memopt.runtime.bitpack import pack_bits
from memopt.stash import bn, grid as G
from triton_stash_helpers import interpret, requires_triton  # noqa: F401 (interpret: a fixture)


def _case(shape, bits, grid_kind, seed=0):
    torch.manual_seed(seed)
    c = shape[1]
    codes = torch.randint(0, 1 << bits, shape, dtype=torch.uint8)
    mask = torch.rand(shape) > 0.4
    grids = {"rows2": torch.stack([torch.randn(c) - 1, torch.rand(c) * 0.4 + 0.1]),
             "rows4": torch.stack([torch.randn(c) - 1, torch.rand(c) * 0.4 + 0.1, torch.randn(c), torch.rand(c) * 0.2]),
             "book2": torch.randn(c, 2, 1 << bits), "book1": torch.randn(c, 1, 1 << bits)}
    grid = grids[grid_kind]
    split = grid.shape[0] == 4 if grid.dim() == 2 else grid.shape[1] == 2
    g = torch.randn(shape)
    return dict(g=g, sum_g=g.sum([d for d in range(len(shape)) if d != 1]), x_codes=pack_bits(codes, bits),
                mask=mask if split else None, grid=grid, weight=torch.rand(c) + 0.5, invstd=torch.rand(c) + 0.5,
                xstd=torch.rand(c) * 0.2 + 0.9, bits=bits, shape=torch.Size(shape)), codes


def _plain(case):
    with kernels.forced("torch"), native.disabled():
        return bn.bn_backward(**case)


def _reference(case, codes):
    """float64: x̂ from the code, centred, and the textbook BatchNorm input gradient."""
    shape = case["shape"]
    nd = len(shape)
    dims = [d for d in range(nd) if d != 1]
    per = [1, -1] + [1] * (nd - 2)
    with kernels.forced("torch"):
        xhat = G._from_codes(codes, case["mask"], case["grid"]).double() * case["xstd"].double().view(per)
    xhat = xhat - xhat.mean(dims, keepdim=True)
    g = case["g"].double()
    count = shape.numel() // shape[1]
    sum_gx = (g * xhat).sum(dims)
    scale = (case["weight"].double() * case["invstd"].double()).view(per)
    grad_x = (g - g.sum(dims, keepdim=True) / count - xhat * sum_gx.view(per) / count) * scale
    return grad_x, sum_gx


def _close(a, b, reference, what):
    assert a.shape == b.shape and a.dtype == b.dtype == torch.float32 and a.is_contiguous(), what
    tolerance = 1e-5 * reference.abs().max().item() + 1e-30
    assert (a.double() - reference).abs().max().item() <= tolerance, what
    assert (b.double() - reference).abs().max().item() <= tolerance, what


@pytest.mark.slow
@requires_triton
@pytest.mark.parametrize("bits", [1, 2, 4, 8])
@pytest.mark.parametrize("grid_kind", ["rows2", "rows4", "book2", "book1"])
def test_triton_bn_backward_matches_the_plain_path_and_float64(interpret, bits, grid_kind):
    for shape in [(4, 3, 9, 7), (5, 6), (3, 2, 4, 5, 3), (37, 3, 1)]:  # 2-D, 3-D, more samples than MAX_PARTS
        case, codes = _case(shape, bits, grid_kind)
        want_x, want_w = _reference(case, codes)
        plain = _plain(case)
        with kernels.forced("triton"), native.disabled():
            fused = bn.bn_backward(**case)
        _close(plain[0], fused[0], want_x, f"grad_x {shape}")
        _close(plain[1], fused[1], want_w, f"sum_gx {shape}")


@requires_triton
def test_layouts_packed_masks_and_the_exact_override(interpret):
    case, codes = _case((4, 5, 6, 7), 4, "book2")
    want_x, want_w = _reference(case, codes)
    with kernels.forced("triton"), native.disabled():
        base = bn.bn_backward(**case)
        # g in channels_last, the mask as its 1-bit stream: the same values
        last = dict(case, g=case["g"].contiguous(memory_format=torch.channels_last),
                    mask=native.PackedMask(pack_bits(case["mask"], 1)))
        other = bn.bn_backward(**last)
        assert torch.equal(base[0], other[0]) and torch.equal(base[1], other[1])
        # the exact override: channels where it is set take its value, and grad_x's variance term follows it
        exact = (torch.arange(5, dtype=torch.float32), torch.tensor([True, False, True, False, False]))
        overridden = bn.bn_backward(**case, exact=exact)
    _close(base[0], other[0], want_x, "grad_x")
    assert torch.equal(overridden[1][exact[1]], exact[0][exact[1]])
    assert torch.equal(overridden[1][~exact[1]], base[1][~exact[1]])
    with kernels.forced("torch"), native.disabled():
        plain = bn.bn_backward(**case, exact=exact)
    assert torch.allclose(overridden[0], plain[0], rtol=1e-5, atol=1e-5 * plain[0].abs().max().item())


@requires_triton
def test_two_launches_and_errors_that_name_the_fix(interpret, monkeypatch):
    launches = []
    real = triton_fewbit._launch
    monkeypatch.setattr(triton_fewbit, "_launch", lambda kernel, *a, **k: launches.append(kernel.__name__) or real(
        kernel, *a, **k))
    case, _ = _case((4, 3, 9, 7), 4, "rows4")
    with kernels.forced("triton"), native.disabled():
        bn.bn_backward(**case)
    assert launches == ["_bn_sums", "_bn_grad"]
    args = (case["g"], case["sum_g"], case["x_codes"], 4, case["shape"])
    scale = case["weight"] * case["invstd"]
    with pytest.raises(ValueError, match=r"a split x̂ code \(four rows\) needs the mask .* got mask=None for shape "
                                         r"\(4, 3, 9, 7\)"):
        triton_bn.bn_backward(*args, case["grid"], None, case["xstd"], scale)
    with pytest.raises(ValueError, match=r"a code book for 4-bit codes has 16 entries per side, got 8 \(shape "
                                         r"\(3, 1, 8\)\); pass the book code_book made for 4 bits"):
        triton_bn.bn_backward(*args, torch.randn(3, 1, 8), None, case["xstd"], scale)


def _act_case(shape, act, dtype, grid_kind="rows4", packed=False):
    case, codes = _case(shape, 4, grid_kind)
    torch.manual_seed(1)
    mask = torch.rand(shape) > 0.5
    grad_y = (torch.randn(shape) * 3).to(dtype)
    if act in ("relu", "relu6"):  # where a ReLU drops them: 0, as its backward gives
        grad_y.view(-1)[:3] = torch.tensor([float("nan"), float("inf"), -0.0]).to(dtype)
        mask.view(-1)[:2] = False
    case["mask"] = mask
    slope = 0.01 if act == "leaky_relu" else 0.0
    g = G._act_backward(grad_y, mask if act != "identity" else None, act, (slope,)).float()
    want = dict(case, g=g, sum_g=g.sum([d for d in range(len(shape)) if d != 1]))
    given = native.PackedMask(pack_bits(mask, 1)) if packed else mask
    return case, codes, grad_y, given, slope, want


@pytest.mark.slow
@requires_triton
@pytest.mark.parametrize("act", ["relu", "relu6", "leaky_relu", "identity"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_the_activation_backward_applied_as_g_is_read(interpret, act, dtype):
    """act=...: g is never written; grad_x, sum g x̂ and sum g as the plain path's activation backward, its
    float32 copy and the BN backward give them, to float32 rounding (sums in another order)."""
    for shape, grid_kind, packed in [((4, 3, 9, 7), "rows4", False), ((37, 5), "book2", True),
                                     ((3, 2, 4, 5, 3), "rows2", False)]:
        case, codes, grad_y, mask, slope, want = _act_case(shape, act, dtype, grid_kind, packed)
        if act == "identity" and grid_kind != "rows2" and grid_kind != "book1":
            continue  # a chain without an activation has no split code
        with kernels.forced("torch"), native.disabled():
            plain_x, plain_w = bn.bn_backward(**want)
        scale = bn.gamma_invstd(case["weight"], case["invstd"])
        with kernels.forced("triton"), native.disabled():
            grad_x, sum_gx, sum_g = triton_bn.bn_backward(
                grad_y, None, case["x_codes"], 4, case["shape"], case["grid"], mask if act != "identity" else None,
                case["xstd"], scale, act=act, slope=slope)
        assert torch.allclose(sum_g, want["sum_g"], rtol=1e-5, atol=1e-5 * want["g"].abs().max().item())
        for got, ref in ((grad_x, plain_x), (sum_gx, plain_w)):
            assert got.dtype == torch.float32 and torch.isfinite(got).all()
            assert torch.allclose(got, ref, rtol=1e-5, atol=2e-5 * ref.abs().max().item()), (act, dtype, shape)


@requires_triton
def test_the_fused_activation_backward_errors_name_the_fix(interpret):
    case, _, grad_y, mask, _, _ = _act_case((4, 3, 9, 7), "relu", torch.float32)
    args = (case["x_codes"], 4, case["shape"], case["grid"])
    scale = case["weight"] * case["invstd"]
    with pytest.raises(ValueError, match=r"applies the backward of \['identity', 'leaky_relu', 'relu', 'relu6'\], "
                                         r"got act='gelu'"):
        triton_bn.bn_backward(grad_y, None, *args, mask, case["xstd"], scale, act="gelu")
    with pytest.raises(ValueError, match=r"takes sum_g exactly when act is None .* got act='relu' and sum_g given"):
        triton_bn.bn_backward(grad_y, case["sum_g"], *args, mask, case["xstd"], scale, act="relu")
    with pytest.raises(ValueError, match=r"a split x̂ code \(four rows\) needs the mask"):
        triton_bn.bn_backward(grad_y, None, *args, None, case["xstd"], scale, act="relu")
    with pytest.raises(ValueError, match=r"the relu backward needs the mask"):
        triton_bn.bn_backward(grad_y, None, *args[:3], case["grid"][:2], None, case["xstd"], scale, act="relu")


@requires_triton
@pytest.mark.parametrize("act", ["relu", "leaky_relu"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_keep_g_writes_the_activation_backward_bit_for_bit_in_the_first_launch(interpret, monkeypatch, act, dtype):
    """keep_g (a chain whose residual or second BN takes g): g in grad_y's dtype, the plain path's
    ``_act_backward`` bits, from the first launch; a later BN reads that g in its own dtype (no float32 copy)."""
    launches = []
    real = triton_fewbit._launch
    monkeypatch.setattr(triton_fewbit, "_launch", lambda kernel, *a, **k: launches.append(kernel.__name__) or real(
        kernel, *a, **k))
    case, _, grad_y, mask, slope, want = _act_case((4, 3, 9, 7), act, dtype, packed=True)
    scale = bn.gamma_invstd(case["weight"], case["invstd"])
    args = (case["x_codes"], 4, case["shape"], case["grid"], mask, case["xstd"], scale)
    with kernels.forced("triton"), native.disabled():
        grad_x, sum_gx, sum_g, g = triton_bn.bn_backward(grad_y, None, *args, act=act, slope=slope, keep_g=True)
        alone = triton_bn.bn_backward(grad_y, None, *args, act=act, slope=slope)
        assert launches == ["_bn_sums", "_bn_grad"] * 2
        again = triton_bn.bn_backward(g, sum_g, *args)  # g as the second BN reads it: bf16 as it is
        wide = triton_bn.bn_backward(g.float(), sum_g, *args)
    assert g.dtype == dtype and g.is_contiguous()
    assert torch.equal(g, G._act_backward(grad_y, want["mask"], act, (slope,)))
    for a, b in zip((grad_x, sum_gx, sum_g), alone):  # keeping g changes nothing else
        assert torch.equal(a, b)
    for a, b in zip(again, wide):
        assert torch.equal(a, b)
    with pytest.raises(ValueError, match=r"keep_g=True\) writes the g it makes from the activation's gradient"):
        triton_bn.bn_backward(grad_y, sum_g, *args, keep_g=True)
