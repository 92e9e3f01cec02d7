"""The stash's bin means (StashConfig.bin_means, memopt/stash/grid.py MEAN_BITS): each bin rebuilds at the
mean of the values it coded, taken from exact integer sums; small channels keep the midpoints."""
import contextlib

import pytest
import torch
from torch import nn

import memopt
from memopt.cost_model.storage import SavedTensorRecorder
from memopt.runtime import native
from memopt.stash.ops import ChainSpec, _Stash, bn_act_stash
from memopt.stash.grid import MEAN_BITS, MEAN_STRIDE, wants_means, x_code
from memopt.stash.stats import _xhat_std


def _bn(c: int) -> nn.BatchNorm2d:
    """A fresh BatchNorm with γ, β drawn from a fixed seed (the same for every call)."""
    g = torch.Generator().manual_seed(3)
    bn = nn.BatchNorm2d(c)
    with torch.no_grad():
        bn.weight.copy_(torch.rand(c, generator=g) + 0.5)
        bn.bias.copy_(torch.rand(c, generator=g) - 0.5)
    return bn


def _run(x, bits=4, means=True, act="relu", residual=None):
    """A BN -> [+ r] -> act chain with ``_bn``: (output, codes, mask, affine, zero, bn, saved bytes)."""
    bn = _bn(x.shape[1])
    with SavedTensorRecorder() as rec:
        out = bn_act_stash(x, bn.weight, bn.bias, bn.running_mean, bn.running_var, bn.num_batches_tracked, residual,
                           ChainSpec(act, bits, residual=residual is not None, means=means))
    return (*out, bn, sum(s.nbytes for s in rec.saved))


def _levels(shape, levels=(-1.3, -0.2, 0.4, 1.1, 2.5)):
    """Every element one of a few values (a real image's flat areas): each lands in a bin of its own."""
    torch.manual_seed(0)
    return torch.tensor(levels)[torch.randint(len(levels), shape)].requires_grad_()


@pytest.mark.parametrize("use_native", [True, False], ids=["fused", "plain"])
def test_repeated_values_rebuild_exactly_and_give_the_exact_weight_gradient(use_native):
    shape = (8, 3, 16, 16)
    errors = {}
    for means in (True, False):
        x = _levels(shape)
        with contextlib.nullcontext() if use_native else native.disabled():
            y, codes, mask, affine, zero, bn, _ = _run(x, means=means)
            rebuilt = _Stash.rebuild(codes, mask, affine, zero, 4, torch.Size(shape), "relu", ())
            g = torch.randn(shape, generator=torch.Generator().manual_seed(1))
            y.backward(g)
        xr = x.detach().clone().requires_grad_()
        ref_bn = _bn(3)
        ref = torch.relu(ref_bn(xr))
        ref.backward(g)
        assert torch.equal(y, ref)  # the forward never changes
        errors[means] = ((rebuilt - ref).abs().max().item(),
                         ((bn.weight.grad - ref_bn.weight.grad).norm() / ref_bn.weight.grad.norm()).item(),
                         ((x.grad - xr.grad).norm() / xr.grad.norm()).item())
    # with the means each bin rebuilds its one value (up to 2^-21 of a bin and float rounding); the midpoints
    # are off by up to half a bin
    assert errors[True][0] < 1e-5 * ref.abs().max().item() < errors[False][0]
    assert errors[True][1] < 1e-5 < errors[False][1]  # the BN weight gradient: exact up to rounding
    assert errors[True][2] < 1e-5 < errors[False][2]  # the input gradient's variance term too


def test_the_code_book_holds_each_bins_mean_and_the_midpoint_of_an_empty_bin():
    # the mean over the elements whose index is a multiple of MEAN_STRIDE
    # heavy tails: values past the window clip into the outer bins, whose means lie outside them
    torch.manual_seed(2)
    shape = (16, 4, 12, 12)
    x = torch.randn(shape) * torch.randn(shape).exp()
    mean, var = x.mean((0, 2, 3)), x.var((0, 2, 3), unbiased=False)
    invstd, eps, bits = (var + 1e-5).rsqrt(), 1e-5, 4
    mask = x > mean.view(1, -1, 1, 1)  # a split code: side 1 where the mask is set
    weight, bias = torch.ones(4), torch.zeros(4)
    packed, grid, _, _, book = x_code(x, weight, bias, mean, invstd, eps, mask, bits, "relu", True, False,
                                      means=True)
    assert book.shape == (4, 2, 16)
    from memopt.runtime.bitpack import unpack_bits
    codes = unpack_bits(packed, bits, x.numel()).view(shape).long()
    v = ((x - mean.view(1, -1, 1, 1)) * (invstd / _xhat_std(invstd, eps)).view(1, -1, 1, 1)).double()
    sampled = (torch.arange(x.numel()) % MEAN_STRIDE == 0).view(shape)
    clipped = 0
    for c in range(4):
        for side in (0, 1):
            lo, w = grid[2 * side, c].item(), grid[2 * side + 1, c].item()
            for k in range(16):
                at = (codes[:, c] == k) & (mask[:, c] == bool(side)) & sampled[:, c]
                want = v[:, c][at].mean().item() if at.any() else lo + (k + 0.5) * w
                assert abs(book[c, side, k].item() - want) <= 1e-5 * w + 1e-6 * abs(want), (c, side, k)
                clipped += int(at.any() and not lo + k * w - 1e-6 <= want <= lo + (k + 1) * w + 1e-6)
    assert clipped > 0  # some outer bin's mean lies past its edge: the tail's mean, not the window's end


def test_small_channels_keep_midpoints_and_large_ones_pay_exactly_their_code_book():
    bits = 4
    small = torch.randn(2, 4, 4, 4)  # 32 elements per channel: the means would cost more than the codes
    assert not wants_means(True, bits, 2, 32)
    assert _run(small.clone(), means=True)[-1] == _run(small.clone(), means=False)[-1]
    large = torch.randn(8, 4, 16, 16)
    assert wants_means(True, bits, 2, 2048)
    with_means, without = (_run(large.clone(), means=m)[-1] for m in (True, False))
    assert with_means - without == 4 * 2 * (1 << bits) * 4  # C x sides x 2^K float32
    # at 8 bits no means (the bins are fine enough; 2 KiB per channel)
    assert MEAN_BITS == 4 and not wants_means(True, 8, 2, 10 ** 9)
    assert _run(large.clone(), bits=8, means=True)[-1] == _run(large.clone(), bits=8, means=False)[-1]


def test_a_residual_chains_z_code_hands_its_means_to_the_consumers():
    shape = (8, 3, 16, 16)
    r = torch.relu(_levels(shape, (0.0, 0.7, 1.9)).detach())
    err = {}
    for means in (True, False):
        y, codes, mask, affine, zero, bn, _ = _run(_levels(shape), means=means, residual=r)
        assert affine.shape == ((3, 1, 16) if means else (2, 3))  # z's code book (one side), else its grid
        rebuilt = _Stash.rebuild(codes, mask, affine, zero, 4, torch.Size(shape), "relu", ()).detach()
        y = y.detach()
        err[means] = (rebuilt - y).square().mean().item()
    assert err[True] < 0.5 * err[False]  # 15 distinct z in 15 bins: most bins rebuild their one value


def test_config_and_report():
    with pytest.raises(ValueError, match=r"StashConfig.bin_means must be True or False, got 1"):
        memopt.StashConfig(bin_means=1)
    model = nn.Sequential(nn.Conv2d(3, 8, 3, padding=1), nn.BatchNorm2d(8), nn.ReLU(), nn.Conv2d(8, 4, 3))
    x = torch.randn(4, 3, 32, 32)  # 4096 elements per channel: the means pay
    reasons = {}
    for on in (True, False):
        om = memopt.optimize(model, example_inputs=x,
                             config=memopt.Config(stash=memopt.StashConfig(bin_means=on), fewbit=None))
        reasons[on] = [n.reason for n in om.plan.nodes if n.technique == "stash" and n.op == "bn_act_stash"]
        real = memopt.measure(om, x)
        assert real.saved_bytes == om.plan.estimated_saved_bytes and real.peak_bytes == om.plan.estimated_peak_bytes
    assert reasons[True] and all("bins rebuilt at their means" in r for r in reasons[True])
    assert reasons[False] and not any("means" in r for r in reasons[False])
