"""memopt/stash/grads.py with ``chunks``: the weight gradient summed over batch ranges, each rebuilt from its own
slice of the codes (``Rows``); the input and bias gradients as the one-call result, bit for bit; the chain's and
the generic stash's row rebuilds equal to rows of the whole rebuild; and what chunks lower and what they don't."""
import types

import pytest
import torch
import torch.nn.functional as F

from memopt.cost_model.storage import LiveStorageTracker
from memopt.stash.generic import _rebuild, group_quantize
from memopt.stash.grads import Rows, conv_grads, linear_grads, matmul_grads, row_ranges
from memopt.stash.ops import ChainSpec, _chain_rows, bn_act_stash

_ONE_CALL = torch.ops.aten.convolution_backward


def _rows(x):
    return Rows(lambda: x.clone(), lambda a, b: x[a:b].clone())


def _one_call(grad, x, w, has_bias):
    return _ONE_CALL(grad, x, w, [w.shape[0]] if has_bias else None, [1, 1], [1, 1], [1, 1], False, [0, 0], 1,
                     [True, True, has_bias])


def test_row_ranges_cover_the_rows_once():
    assert row_ranges(10, 3) == [(0, 4), (4, 8), (8, 10)]
    assert row_ranges(3, 8) == [(0, 1), (1, 2), (2, 3)]
    assert row_ranges(5, 1) == [(0, 5)]


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.bfloat16])
@pytest.mark.parametrize("chunks", [2, 3, 5])
def test_conv_chunks_keep_input_and_bias_gradients_and_sum_the_weight_gradient(dtype, chunks):
    torch.manual_seed(0)
    x, w = torch.randn(5, 6, 9, 9, dtype=dtype), torch.randn(8, 6, 3, 3, dtype=dtype)
    grad = torch.randn_like(F.conv2d(x, w, None, 1, 1))
    want = _one_call(grad, x, w, True)
    got = conv_grads(grad, _rows(x), w, 1, 1, 1, 1, True, chunks=chunks)
    assert torch.equal(got[0], want[0]) and got[0].stride() == want[0].stride()
    assert torch.equal(got[2], want[2])
    tol = {torch.float64: 1e-12, torch.float32: 1e-5, torch.bfloat16: 2e-2}[dtype]
    assert torch.allclose(got[1].double(), want[1].double(), rtol=tol, atol=tol * want[1].abs().max().item())
    none = conv_grads(grad, _rows(x), w, 1, 1, 1, 1, False, need_input=False, chunks=chunks)
    assert none[0] is None and none[2] is None  # (the weight gradient: CPU kernels may split sums per thread)
    assert torch.allclose(none[1].double(), got[1].double(), rtol=tol, atol=tol * want[1].abs().max().item())


def test_conv_chunks_fall_back_to_one_piece_where_the_stand_in_does_not_apply():
    torch.manual_seed(0)
    x = torch.randn(4, 6, 9, 9).contiguous(memory_format=torch.channels_last)  # may select another kernel
    w = torch.randn(8, 6, 3, 3)
    grad = torch.randn_like(F.conv2d(x, w, None, 1, 1))
    want = _one_call(grad, x, w, True)
    got = conv_grads(grad, Rows(lambda: x.clone(memory_format=torch.channels_last),
                                lambda a, b: x[a:b].clone(memory_format=torch.channels_last)), w, 1, 1, 1, 1, True,
                     chunks=2)
    for a, b in zip(got, want):
        assert torch.equal(a, b)
    # a rebuild without row slices (part None) is one piece too
    got = conv_grads(grad, Rows(lambda: x.contiguous(), None), w, 1, 1, 1, 1, True, chunks=4)
    assert torch.equal(got[1], _one_call(grad, x.contiguous(), w, True)[1])


@pytest.mark.parametrize("chunks", [2, 4])
def test_linear_and_matmul_chunks(chunks):
    torch.manual_seed(0)
    x, w = torch.randn(6, 10, 32, dtype=torch.float64), torch.randn(12, 32, dtype=torch.float64)
    grad = torch.randn(6, 10, 12, dtype=torch.float64)
    grad_in, grad_w, grad_b = linear_grads(grad, _rows(x), w, True, chunks=chunks)
    assert torch.equal(grad_in, grad.matmul(w)) and torch.equal(grad_b, grad.reshape(-1, 12).sum(0))
    assert torch.allclose(grad_w, grad.reshape(-1, 12).t() @ x.reshape(-1, 32), rtol=1e-12, atol=1e-12)
    wt = w.t().contiguous()
    grad_in, grad_w = matmul_grads(grad, _rows(x), wt, chunks=chunks)
    assert torch.equal(grad_in, grad.matmul(wt.t()))
    assert torch.allclose(grad_w, x.reshape(-1, 32).t() @ grad.reshape(-1, 12), rtol=1e-12, atol=1e-12)


def _peak(fn, keep):
    tracker = LiveStorageTracker(preexisting=keep)
    with tracker:
        fn()
    return tracker.peak, tracker.peak_in_weight_grad


def test_chunks_lower_a_bf16_rebuild_through_float32_and_the_tracker_sees_where_the_peak_is():
    """Autocast's case: the rebuild gives float32, converted to the gradient's bf16. In one piece both copies are
    alive at the weight gradient (6 bytes per value against the input gradient's 2); in 4 chunks a quarter."""
    torch.manual_seed(0)
    x32, w = torch.randn(8, 16, 24, 24), torch.randn(16, 16, 1, 1, dtype=torch.bfloat16)
    grad = torch.randn(8, 16, 24, 24, dtype=torch.bfloat16)
    rows = Rows(lambda: x32.clone(), lambda a, b: x32[a:b].clone())
    one, in_weight_grad = _peak(lambda: conv_grads(grad, rows, w, 1, 0, 1, 1, False), [x32, w, grad])
    four, _ = _peak(lambda: conv_grads(grad, rows, w, 1, 0, 1, 1, False, chunks=4), [x32, w, grad])
    n = x32.numel()
    assert in_weight_grad and one >= 6 * n
    assert four <= 2 * n + 6 * n // 4 + 4096, (four, n)
    # float32 and a rebuild of one buffer: the input gradient is as large, chunks cannot lower the peak
    g32, w32 = grad.float(), w.float()
    one, _ = _peak(lambda: conv_grads(g32, rows, w32, 1, 0, 1, 1, False), [x32, w32, g32])
    four, _ = _peak(lambda: conv_grads(g32, rows, w32, 1, 0, 1, 1, False, chunks=4), [x32, w32, g32])
    wbytes = w32.numel() * 4
    assert one == 4 * n + wbytes + 4  # the input gradient, the weight gradient, the stand-in
    assert one <= four <= one + wbytes  # and a chunk's share of the weight gradient before it is added


@pytest.mark.parametrize("bits", [1, 2, 4, 8])
@pytest.mark.parametrize("act", ["relu", "identity"])
def test_a_chains_row_rebuild_equals_rows_of_its_whole_rebuild(bits, act):
    torch.manual_seed(0)
    x = torch.randn(6, 5, 4, 4)
    weight, bias = torch.rand(5) + 0.5, torch.randn(5)
    rm, rv, nbt = torch.zeros(5), torch.ones(5), torch.tensor(0)
    y, packed, mask, affine, zero = bn_act_stash(x, weight, bias, rm, rv, nbt, None, ChainSpec(act=act, bits=bits))
    rows = _chain_rows(packed, mask, affine, zero, bits, y.shape, act, (), torch.float32)
    whole = rows.whole()
    assert rows.part is not None
    for a, b in row_ranges(6, 4):
        assert torch.equal(rows.part(a, b), whole[a:b])
    # a row whose mask bits do not end on a byte: one piece only
    y, packed, mask, affine, zero = bn_act_stash(torch.randn(4, 3, 3), torch.ones(3), torch.zeros(3), torch.zeros(3),
                                                 torch.ones(3), torch.tensor(0), None, ChainSpec(act="relu", bits=bits))
    assert _chain_rows(packed, mask, affine, zero, bits, y.shape, "relu", (), torch.float32).part is None


@pytest.mark.parametrize("bits,group", [(8, 64), (4, 32), (8, 7)])
@pytest.mark.parametrize("channels_last", [False, True])
def test_a_generic_row_rebuild_equals_rows_of_its_whole_rebuild(bits, group, channels_last):
    torch.manual_seed(0)
    x = torch.randn(6, 8, 4, 7)
    if channels_last:
        x = x.contiguous(memory_format=torch.channels_last)
    packed, params = group_quantize(x, bits, group, False)
    ctx = types.SimpleNamespace(shape=x.shape, stride=x.stride(), dtype=x.dtype, bits=bits, group=group)
    rows = _rebuild(ctx, packed, params)
    whole = rows.whole()
    if (8 * 4 * 7) % group:  # a row's codes end inside a group
        assert rows.part is None
        return
    for a, b in row_ranges(6, 4):
        part = rows.part(a, b)
        assert torch.equal(part, whole[a:b]) and part.stride() == whole[a:b].stride()
    ctx.stride = x.transpose(0, 1).contiguous().transpose(0, 1).stride()  # rows not outermost in memory
    assert _rebuild(ctx, packed, params).part is None
