"""A residual BatchNorm + ReLU chain's backward writes the residual's gradient over the incoming one where autograd
handed that to it alone (``memopt.stash.residual.owned_gradient``): the same gradients, one full-size tensor fewer;
a gradient someone else still holds is never written."""
import pytest
import torch
import torchvision
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

import memopt
import memopt.stash.ops as ops
from memopt.stash.residual import owned_gradient


class _Twice(torch.autograd.Function):
    """Doubles in backward, over the incoming gradient where ``owned_gradient`` says it may."""

    @staticmethod
    def forward(ctx, x):
        return x * 2

    @staticmethod
    def backward(ctx, grad):
        owned = owned_gradient(grad)
        _Twice.seen.append(owned)
        return grad.mul_(2) if owned else grad * 2


@pytest.mark.parametrize("how", ["product", "sum of two uses", "add of two", "user's gradient", "retained",
                                 "expanded"])
def test_written_over_only_where_nothing_else_sees_it(how):
    torch.manual_seed(0)
    x = torch.randn(4, 8, requires_grad=True)
    given = torch.randn(4, 8)
    kept = given.clone()
    _Twice.seen = []
    if how == "product":
        (_Twice.apply(x) * 3).sum().backward()
        want = torch.full((4, 8), 6.0)
    elif how == "sum of two uses":
        y = _Twice.apply(x)
        (y * 3 + y * 5).sum().backward()
        want = torch.full((4, 8), 16.0)
    elif how == "add of two":  # the same gradient goes to both inputs of the add
        (_Twice.apply(x) + x * 1).sum().backward()
        want = torch.full((4, 8), 3.0)
    elif how == "user's gradient":
        _Twice.apply(x).backward(given)
        want = kept * 2
        assert not _Twice.seen[0]
    elif how == "retained":
        y = _Twice.apply(x)
        y.retain_grad()
        (y * 3).sum().backward()
        want = torch.full((4, 8), 6.0)
        assert torch.equal(y.grad, torch.full((4, 8), 3.0))  # what retain_grad keeps is not written over
    else:  # sum's gradient is a scalar expanded
        _Twice.apply(x).sum().backward()
        want = torch.full((4, 8), 2.0)
        assert not _Twice.seen[0]
    assert torch.equal(x.grad, want) and torch.equal(given, kept)
    assert _Twice.seen[0] == (how in ("product", "sum of two uses")) or how == "retained"


class _Allocated(TorchDispatchMode):
    """Bytes of every tensor the ops under it return that did not exist before (the storages they make)."""

    def __init__(self):
        super().__init__()
        self.bytes = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        before = {t.untyped_storage().data_ptr() for t in tree_leaves((args, kwargs)) if isinstance(t, torch.Tensor)}
        out = func(*args, **(kwargs or {}))
        for t in tree_leaves(out):
            if isinstance(t, torch.Tensor) and t.untyped_storage().data_ptr() not in before:
                self.bytes += t.untyped_storage().nbytes()
        return out


def _model():
    torch.manual_seed(0)
    model = torchvision.models.resnet18(num_classes=10)
    x = torch.randn(4, 3, 64, 64)
    return model, x, memopt.optimize(model, example_inputs=x, config=memopt.Config(fidelity=None))


def _step(model, om, x, dtype):
    model.zero_grad(set_to_none=True)
    torch.manual_seed(1)
    with torch.autocast("cpu", dtype=torch.bfloat16, enabled=dtype == torch.bfloat16):
        out = om(x)
    with _Allocated() as made:
        out.float().logsumexp(1).sum().backward()
    return {n: p.grad.clone() for n, p in model.named_parameters()}, made.bytes


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_written_over_gives_the_same_gradients_with_less_memory(monkeypatch, dtype):
    model, x, om = _model()
    written = []
    real = ops.owned_gradient
    monkeypatch.setattr(ops, "owned_gradient", lambda g: written.append(real(g)) or written[-1])
    over, made_over = _step(model, om, x, dtype)
    assert any(written)  # the chains after a residual were handed their gradient alone
    monkeypatch.setattr(ops, "owned_gradient", lambda g: False)
    fresh, made_fresh = _step(model, om, x, dtype)
    for name in fresh:
        assert torch.equal(over[name], fresh[name]), name
    # each residual chain written over makes no full-size g: at least the smallest one (layer4's) fewer
    assert made_fresh - made_over >= 4 * 512 * 2 * 2 * (2 if dtype == torch.bfloat16 else 4)


def test_a_gradient_the_user_holds_is_not_written_over():
    model, x, om = _model()
    out = om(x)
    given = torch.randn_like(out)
    kept = given.clone()
    out.backward(given)
    assert torch.equal(given, kept)


def test_g_into_must_match_grad():
    from memopt.runtime import native

    if not native.applies(torch.empty(1)):
        pytest.skip("the native kernels are not built here")
    shape = torch.Size((2, 3, 4))
    with pytest.raises(ValueError, match=r"g_into must be a contiguous tensor of grad's shape and dtype, with grad "
                                         r"and keep_g"):
        native.bn_backward(torch.zeros(6, dtype=torch.uint8), 2, shape, torch.zeros(3, 4), None, torch.ones(3),
                           torch.ones(3), grad=torch.zeros(shape), g_into=torch.zeros(shape, dtype=torch.bfloat16))
