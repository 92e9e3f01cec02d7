"""A chain's backward under bf16 / fp16 autocast on the CPU: the fused C kernel reads a bf16 output gradient as it
is and writes g and the input gradient in bf16 (ReLU / ReLU6: the same g as the plain path's bf16 where then
.float()), so it makes no full-size float32 tensor; an fp16 one goes in as its float32 copy. Gradients as the plain
path's to float32 rounding."""
import pytest
import torch

from memopt.runtime import kernels, native
from memopt.stash.ops import ChainSpec, bn_act_stash
from memopt.testing.allocations import Allocations


def _step(dtype, act, residual):
    torch.manual_seed(0)
    x = (torch.randn(4, 8, 6, 6) * 2 + 0.3).to(dtype).requires_grad_()
    c = x.shape[1]
    weight, bias = (torch.rand(c) + 0.5).requires_grad_(), torch.randn(c).requires_grad_()
    r = torch.randn(x.shape).to(dtype).requires_grad_() if residual else None
    y = bn_act_stash(x, weight, bias, torch.zeros(c), torch.ones(c), torch.tensor(0), r,
                     ChainSpec(act, 4, residual=residual))[0]
    grad = torch.randn(y.shape).to(dtype)
    with Allocations(x.numel()) as seen:
        y.backward(grad)
    return [t.grad for t in (x, weight, bias, r) if t is not None], seen.made


@pytest.mark.skipif(not native.applies(torch.zeros(1)), reason="the C kernels are not built here")
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("act,residual", [("relu", False), ("relu6", False), ("relu", True)])
def test_the_fused_kernel_takes_a_low_precision_output_gradient(dtype, act, residual):
    fused, made = _step(dtype, act, residual)
    with kernels.forced("torch"):
        plain, plain_made = _step(dtype, act, residual)
    if dtype == torch.bfloat16:  # the kernel's g (the residual's gradient) and grad_x, both bf16: nothing else
        assert made == [("empty.memory_format", dtype)] * (2 if residual else 1), made
    else:  # fp16: the float32 copy of grad_y first (no unpacked mask, no activation backward in dtype before it),
        # the kernel's grad_x (and g: the residual's gradient), then their copies in dtype
        assert made[0] == ("_to_copy.default", torch.float32), made
        assert [d for _, d in made] == ([torch.float32] * 3 + [dtype] * 2 if residual else
                                        [torch.float32] * 2 + [dtype]), made
    assert len(made) < len(plain_made), (made, plain_made)
    for a, b in zip(fused, plain):
        assert a.dtype == b.dtype
        assert torch.allclose(a.float(), b.float(), rtol=1e-2, atol=1e-2 * b.float().abs().max().item())
