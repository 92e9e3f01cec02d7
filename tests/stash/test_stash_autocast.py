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


def _largest_allocation(fn) -> int:
    """The largest single allocation ATen makes inside ``fn``, its ops' own internal buffers included (what a
    ``TorchDispatchMode`` does not see: the profiler's memory events)."""
    from torch.profiler import ProfilerActivity, profile
    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        fn()
    return max((e.self_cpu_memory_usage for e in prof.events()), default=0)


@pytest.mark.skipif(not native.applies(torch.zeros(1)), reason="the C kernels are not built here")
@pytest.mark.parametrize("residual", [False, True])
def test_a_bf16_chains_forward_makes_no_full_size_float32_tensor(residual):
    # a residual chain codes z with its per-channel std and mean; ATen's mean(dtype=float32) of a bf16 tensor first
    # copies all of it to float32 (the forward's peak of a bf16 ResNet-50, unseen by the cost model's tracker):
    # here every float32 temporary is a batch slice's
    torch.manual_seed(0)
    x = torch.randn(16, 64, 64, 64).to(torch.bfloat16)
    c = x.shape[1]
    r = torch.randn(x.shape).to(torch.bfloat16) if residual else None

    def forward():
        return bn_act_stash(x, torch.rand(c) + 0.5, torch.randn(c), torch.zeros(c), torch.ones(c),
                            torch.tensor(0), r, ChainSpec("relu", 4, residual=residual))
    full_float32 = x.numel() * 4
    assert _largest_allocation(forward) <= full_float32 // 2  # bf16 outputs (half of it) and slices
    y32 = bn_act_stash(x.float(), torch.rand(c) + 0.5, torch.randn(c), torch.zeros(c), torch.ones(c),
                       torch.tensor(0), None if r is None else r.float(), ChainSpec("relu", 4, residual=residual))[0]
    assert y32.dtype == torch.float32  # the check sees float32 tensors of that size where they are made:
    assert _largest_allocation(lambda: y32.mean([0, 2, 3], dtype=torch.float32) + x.float().sum()) >= full_float32
