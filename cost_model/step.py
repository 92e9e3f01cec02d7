"""The training step both the estimator (fake tensors) and ``memopt.measure`` (real) simulate."""
from __future__ import annotations

from typing import Any, Callable, Optional

import torch
from torch.utils._pytree import tree_flatten

LossFn = Callable[[Any], torch.Tensor]


def default_loss(output: Any) -> torch.Tensor:
    """Sum of every floating-point tensor that requires grad in the model's output (any pytree)."""
    terms = [t.sum() for t in tree_flatten(output)[0]
             if isinstance(t, torch.Tensor) and t.is_floating_point() and t.requires_grad]
    if not terms:
        raise ValueError("the model's output has no floating-point tensor that requires grad, so there "
                         "is nothing to train; pass loss_fn=... that returns a scalar loss")
    loss = terms[0]
    for t in terms[1:]:
        loss = loss + t
    return loss


def compute_loss(output: Any, loss_fn: Optional[LossFn]) -> torch.Tensor:
    loss = (loss_fn or default_loss)(output)
    if not isinstance(loss, torch.Tensor) or loss.numel() != 1:
        raise ValueError(f"loss_fn must return a scalar tensor, got {type(loss).__name__} "
                         f"{tuple(getattr(loss, 'shape', ()))}")
    return loss
