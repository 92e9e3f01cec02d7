"""One training step of an optimized module beside eager PyTorch's, for tests: the forward bit for bit, the
gradients by cosine."""
from __future__ import annotations

from typing import Any

import torch
from torch import nn


def forward_identical_gradients_close(om: nn.Module, model: nn.Module, reference: nn.Module, x: Any,
                                      least: float = 0.99) -> None:
    """Assert that ``om`` (built from ``model``) gives ``reference``'s (an untouched copy of ``model``) training
    forward on ``x`` bit for bit, from the same generator state (dropout draws as eager's), and then, under a loss
    other than the plan's (``logsumexp`` over the last dimension), every parameter's gradient a cosine of at least
    ``least`` (the fidelity gate's default bar) with eager's."""
    torch.manual_seed(1)
    out = om(x)
    after = torch.get_rng_state()
    torch.manual_seed(1)
    ref = reference(x)
    assert torch.equal(out, ref), "the forward differs from eager's"
    assert torch.equal(after, torch.get_rng_state()), "the forward drew other random numbers than eager's"
    out.logsumexp(-1).mean().backward()
    ref.logsumexp(-1).mean().backward()
    for (name, p), q in zip(model.named_parameters(), reference.parameters()):
        cosine = torch.nn.functional.cosine_similarity(p.grad.flatten().double(), q.grad.flatten().double(), 0)
        assert cosine >= least, f"{name}: gradient cosine {cosine.item():.4f} < {least}"
