"""The accounting rule: custom autograd Functions keep tensors only through save_for_backward."""
import pytest
import torch

import memopt
from conftest import call, zoo_params
from memopt.testing.audit import custom_functions, hidden_ctx_tensors
from memopt.testing.zoo import build


class _Hides(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x):
        ctx.kept = x * 1  # a tensor as a ctx attribute: invisible to saved-tensor hooks, what the audit must catch
        return x * 2

    @staticmethod
    def backward(ctx, grad):
        return grad * 2


class _Honest(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x):
        ctx.save_for_backward(x)
        ctx.scale = 2.0
        return x * 2

    @staticmethod
    def backward(ctx, grad):
        return grad * 2


def test_audit_finds_a_tensor_kept_as_ctx_attribute():
    x = torch.randn(3, requires_grad=True)
    assert hidden_ctx_tensors(_Hides.apply(x).sin()) == ["_HidesBackward.kept"]
    assert hidden_ctx_tensors(_Honest.apply(x).sin()) == []
    assert len(custom_functions(_Honest.apply(x) + _Hides.apply(x))) == 2


@pytest.mark.parametrize("name", zoo_params())
def test_no_rewritten_zoo_model_hides_tensors_in_ctx(name):
    model, inputs = build(name)
    om = memopt.optimize(model, example_inputs=inputs)
    assert hidden_ctx_tensors(call(om, inputs)) == []
