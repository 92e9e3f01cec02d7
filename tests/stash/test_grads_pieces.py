"""memopt/stash/grads.py on the CPU: a conv's input gradient over batch pieces (``input_pieces``), where its input
is rebuilt from codes, so that oneDNN's blocked-layout copies inside ``convolution_backward`` are a piece's; the
weight gradient over at least as many chunks; an input given as a tensor (an exact recomputation) in one call."""
import pytest
import torch
import torch.nn.functional as F
from torch.utils._python_dispatch import TorchDispatchMode

import memopt.stash.grads as grads
from memopt.stash.grads import Rows, conv_grads, input_pieces, kernel_pieces

_ONE_CALL = torch.ops.aten.convolution_backward
MiB = 2 ** 20


class _Calls(TorchDispatchMode):
    """The output masks of every ``convolution_backward`` call, with the batch of its incoming gradient."""

    def __init__(self):
        super().__init__()
        self.calls = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func is _ONE_CALL.default:
            self.calls.append((args[0].shape[0], tuple(args[-1])))
        return func(*args, **(kwargs or {}))


def _case(stride=1, has_bias=True, batch=12):
    torch.manual_seed(0)
    x, w = torch.randn(batch, 6, 10, 10), torch.randn(8, 6, 3, 3)
    b = torch.randn(8) if has_bias else None
    grad = torch.randn_like(F.conv2d(x, w, b, stride, 1))
    want = _ONE_CALL(grad, x, w, [8] if has_bias else None, [stride] * 2, [1, 1], [1, 1], False, [0, 0], 1,
                     [True, True, has_bias])
    return x, w, grad, want


def test_input_pieces_bound_each_piece_by_the_larger_gradient(monkeypatch):
    grad = torch.empty(96, 64, 32, 32)  # 24 MiB
    assert input_pieces(grad, torch.Size((96, 256, 32, 32))) == 6  # the 96 MiB input gradient in 16 MiB pieces
    assert input_pieces(grad, torch.Size((96, 16, 32, 32))) == 2  # the incoming 24 MiB
    assert input_pieces(grad[:1], torch.Size((1, 256, 32, 32))) == 1  # one sample is one piece
    assert input_pieces(grad.to("meta"), torch.Size((96, 256, 32, 32))) == 1  # off the CPU: one call
    monkeypatch.setattr(grads, "PIECE_BYTES", 1)
    assert input_pieces(grad, torch.Size((96, 256, 32, 32))) == 96  # at most the batch


@pytest.mark.parametrize("stride", [1, 2])
@pytest.mark.parametrize("has_bias", [True, False])
@pytest.mark.parametrize("rows", [True, False])
def test_codes_take_pieces_with_the_one_call_s_gradients(monkeypatch, stride, has_bias, rows):
    x, w, grad, want = _case(stride, has_bias)
    piece = 4 * max(x[0].numel(), grad[0].numel()) * 4  # four samples of the larger gradient a piece: 3 pieces
    monkeypatch.setattr(grads, "PIECE_BYTES", piece)
    rebuild = Rows(lambda: x.clone(), lambda a, b: x[a:b].clone()) if rows else (lambda: x.clone())
    with _Calls() as seen:
        got = conv_grads(grad, rebuild, w, stride, 1, 1, 1, has_bias)
    inputs = [n for n, mask in seen.calls if mask[0]]
    assert inputs == [4, 4, 4]  # the input gradient a piece at a time
    weights = [n for n, mask in seen.calls if mask[1]]
    assert weights == ([4, 4, 4] if rows else [12])  # the weight gradient in as many chunks where rows are rebuilt
    assert got[0].shape == want[0].shape and got[0].stride() == want[0].stride()
    # a piece may run another oneDNN implementation than the whole batch: rounding, not more
    assert torch.allclose(got[0], want[0], rtol=1e-5, atol=1e-5)
    assert torch.allclose(got[1], want[1], rtol=1e-5, atol=1e-4)
    if has_bias:
        assert torch.allclose(got[2], want[2], rtol=1e-5, atol=1e-5)
    else:
        assert got[2] is None


def test_an_input_given_as_a_tensor_is_one_call(monkeypatch):
    x, w, grad, want = _case()
    monkeypatch.setattr(grads, "PIECE_BYTES", 4 * grad[0].numel() * 4)
    with _Calls() as seen:
        got = conv_grads(grad, x, w, 1, 1, 1, 1, True)
    assert [n for n, mask in seen.calls if mask[0]] == [12]  # the recomputed-weight ops' exact path keeps its bits
    for a, b in zip(got, want):
        assert torch.equal(a, b)


def test_without_an_input_gradient_only_the_weight_is_chunked(monkeypatch):
    x, w, grad, want = _case()
    monkeypatch.setattr(grads, "PIECE_BYTES", 6 * grad[0].numel() * 4)
    with _Calls() as seen:
        got = conv_grads(grad, Rows(lambda: x.clone(), lambda a, b: x[a:b].clone()), w, 1, 1, 1, 1, False,
                         need_input=False)
    assert got[0] is None and got[2] is None
    assert [n for n, mask in seen.calls if mask[1]] == [6, 6] and not [m for _, m in seen.calls if m[0]]
    assert torch.allclose(got[1], want[1], rtol=1e-5, atol=1e-4)


def test_pieces_keep_the_whole_batch_s_kernel():
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # a single-threaded 1x1 conv takes oneDNN only from 16 samples up
    try:
        like, weight = torch.empty(1).expand(40, 256, 8, 8), torch.empty(64, 256, 1, 1)
        args = ([1, 1], [0, 0], [1, 1], False, [0, 0], 1)
        select = torch._C._select_conv_backend
        if select(like, weight, None, *args, None) == select(like[:4], weight, None, *args, None):
            pytest.skip("this build picks the same conv kernel at every batch")
        assert kernel_pieces(like, weight, args, 8) == [(0, 20), (20, 40)]  # 8, 7, ... pieces: under 16 samples
        assert kernel_pieces(like[:20], weight, args, 8) == [(0, 20)]  # no split keeps the kernel: one call
        assert kernel_pieces(like, weight, args, 1) == [(0, 40)]
    finally:
        torch.set_num_threads(threads)
