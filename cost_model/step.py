"""The training step both the estimator (fake tensors) and ``memopt.measure`` (real) simulate."""
from __future__ import annotations

import dataclasses
from typing import Any, Callable, List, Optional

import torch
from torch.utils._pytree import tree_flatten

LossFn = Callable[[Any], torch.Tensor]


def output_tensors(output: Any) -> List[torch.Tensor]:
    """Every tensor in a model's output: any pytree (tuples, lists, dicts, NamedTuples, HF ModelOutput), with
    dataclass instances opened field by field (pytree leaves them whole)."""
    found = []
    for leaf in tree_flatten(output)[0]:
        if isinstance(leaf, torch.Tensor):
            found.append(leaf)
        elif dataclasses.is_dataclass(leaf) and not isinstance(leaf, type):
            found.extend(output_tensors([getattr(leaf, f.name) for f in dataclasses.fields(leaf)]))
    return found


def default_loss(output: Any) -> torch.Tensor:
    """Sum of every floating-point tensor that requires grad in the model's output."""
    terms = [t.sum() for t in output_tensors(output) if t.is_floating_point() and t.requires_grad]
    if not terms:
        raise ValueError(f"the model's output ({type(output).__name__}) has no floating-point tensor that requires "
                         f"grad, so there is nothing to train; memopt.optimize plans a step on the sum of the "
                         f"floating outputs: return the logits or the loss from forward (memopt.estimate and "
                         f"memopt.measure also take loss_fn=... returning a scalar)")
    loss = terms[0]
    for t in terms[1:]:
        loss = loss + t
    return loss


def compute_loss(output: Any, loss_fn: Optional[LossFn]) -> torch.Tensor:
    loss = (loss_fn or default_loss)(output)
    if not isinstance(loss, torch.Tensor) or loss.numel() != 1:
        kind = "Tensor" if isinstance(loss, torch.Tensor) else type(loss).__name__  # not FakeTensor: the user's view
        raise ValueError(f"loss_fn must return a scalar tensor, got {kind} {tuple(getattr(loss, 'shape', ()))}; "
                         f"reduce it (.mean() or .sum())")
    return loss
