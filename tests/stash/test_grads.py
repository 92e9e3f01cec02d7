"""memopt/stash/grads.py: the weight gradient before the input gradient, the rebuilt input released between
them, and the input gradient bit-identical to the one-call result."""
import itertools

import pytest
import torch
import torch.nn.functional as F

from memopt.cost_model.storage import LiveStorageTracker
from memopt.stash.grads import conv_grads, linear_grads, matmul_grads

_CONVS = {1: F.conv1d, 2: F.conv2d, 3: F.conv3d}
_ONE_CALL = torch.ops.aten.convolution_backward


def _one_call(grad, x, w, stride, padding, dilation, groups, has_bias):
    dims = x.dim() - 2
    return _ONE_CALL(grad, x, w, [w.shape[0]] if has_bias else None, [stride] * dims, [padding] * dims,
                     [dilation] * dims, False, [0] * dims, groups, [True, True, has_bias])


CASES = list(itertools.product((1, 2, 3), ((8, 16, 1), (16, 16, 16), (12, 6, 3)), (1, 2), (False, True),
                               (torch.float32, torch.bfloat16, torch.float64)))


@pytest.mark.parametrize("dims,channels,stride,channels_last,dtype", CASES)
def test_conv_grads_equal_one_call(dims, channels, stride, channels_last, dtype):
    if channels_last and dims == 1:
        pytest.skip("no channels-last format for 1-d convs")
    torch.manual_seed(0)
    cin, cout, groups = channels
    x = torch.randn(3, cin, *(7,) * dims, dtype=dtype)
    w = torch.randn(cout, cin // groups, *(3,) * dims, dtype=dtype)
    if channels_last:
        fmt = torch.channels_last if dims == 2 else torch.channels_last_3d
        x, w = x.contiguous(memory_format=fmt), w.contiguous(memory_format=fmt)
    grad = torch.randn_like(_CONVS[dims](x, w, None, stride, 1, 1, groups))
    want = _one_call(grad, x, w, stride, 1, 1, groups, True)
    got = conv_grads(grad, lambda: x.clone(), w, stride, 1, 1, groups, True)
    for a, b in zip(got, want):
        assert torch.equal(a, b) and a.stride() == b.stride()
    no_input = conv_grads(grad, lambda: x.clone(), w, stride, 1, 1, groups, True, need_input=False)
    assert no_input[0] is None and torch.equal(no_input[1], want[1]) and torch.equal(no_input[2], want[2])


def _peak(fn, keep):
    tracker = LiveStorageTracker(preexisting=keep)
    with tracker:
        out = fn()
    return tracker.peak, out


def test_conv_rebuilt_input_released_before_input_gradient():
    torch.manual_seed(0)
    x, w = torch.randn(4, 32, 24, 24), torch.randn(32, 32, 3, 3)
    grad = torch.randn_like(F.conv2d(x, w, None, 1, 1))
    peak, (grad_in, grad_w, _) = _peak(lambda: conv_grads(grad, lambda: x.clone(), w, 1, 1, 1, 1, False), [x, w, grad])
    full = x.numel() * x.element_size()
    # one full-size tensor at a time (the rebuilt input, then the input gradient), plus the weight gradient and
    # the one element that stands in for the input
    assert peak <= full + grad_w.numel() * 4 + x.element_size() < 2 * full, peak
    assert torch.equal(grad_in, _one_call(grad, x, w, 1, 1, 1, 1, False)[0])


def test_linear_and_matmul_rebuilt_input_released_before_input_gradient():
    torch.manual_seed(0)
    x, w = torch.randn(8, 64, 96), torch.randn(48, 96)
    grad = torch.randn(8, 64, 48)
    peak, (grad_in, grad_w, grad_b) = _peak(lambda: linear_grads(grad, lambda: x.clone(), w, True), [x, w, grad])
    full = x.numel() * 4
    assert peak < 2 * full, peak
    assert torch.equal(grad_in, grad.matmul(w))
    assert torch.allclose(grad_w, grad.reshape(-1, 48).t() @ x.reshape(-1, 96))
    assert torch.equal(grad_b, grad.reshape(-1, 48).sum(0))
    wt = w.t().contiguous()
    peak, (grad_in, grad_w) = _peak(lambda: matmul_grads(grad, lambda: x.clone(), wt), [x, wt, grad])
    assert peak < 2 * full, peak
    assert torch.equal(grad_in, grad.matmul(wt.t()))
    assert matmul_grads(grad, x, wt, need_input=False)[0] is None
