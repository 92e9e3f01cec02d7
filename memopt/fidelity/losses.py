"""The fidelity gate's losses: random projections of the outputs, the outputs' own direction, the user's loss.

Why several: a plan's gradient error lies in some directions of the output more than others; a parameter can pass
under one projection and miss under another, so the gate confirms a plan on several independent ones (gate.py's
MARGIN and MAX_PROJECTIONS), and on the loss that trains when the user gives it.
"""
from __future__ import annotations

from typing import Any, Callable, List, Optional

import torch

from memopt.core.errors import MemoptError
from memopt.cost_model.step import default_loss, output_tensors


class RandomProjection:
    """The loss of the gate's steps: each floating output times fixed random weights, summed. A plain sum would
    hide errors (through a training-mode BatchNorm or a softmax its gradient is partly exactly zero); a real
    loss weighs outputs unevenly, as these weights do. The same weights serve the exact and rewritten steps."""

    def __init__(self, seed: int = 0) -> None:
        self.generator = torch.Generator().manual_seed(seed)
        self.weights: List[torch.Tensor] = []

    def __call__(self, output: Any) -> torch.Tensor:
        terms = [t for t in output_tensors(output) if t.is_floating_point() and t.requires_grad]
        if not terms:
            return default_loss(output)  # says what is wrong
        while len(self.weights) < len(terms):
            t = terms[len(self.weights)]
            self.weights.append(torch.randn(t.shape, generator=self.generator, dtype=torch.float32).to(t))
        return sum((t * w).sum() for t, w in zip(terms, self.weights))


class OwnDirection:
    """The loss ``sum(t^2) / 2`` over the floating outputs, whose output gradient is the output itself: the
    direction of the losses users write on the output's values (a squared error, a norm penalty, a regression head),
    which a fixed random projection does not weigh. A plan can pass every random projection and miss this one: a
    BN-ReLU CNN whose 4-bit chains kept cosine 0.998 under two projections gave 0.98 under ``out.square().mean()``
    (tests/builder/test_user_module.py)."""

    def __call__(self, output: Any) -> torch.Tensor:
        terms = [t for t in output_tensors(output) if t.is_floating_point() and t.requires_grad]
        if not terms:
            return default_loss(output)  # says what is wrong
        return sum(t.float().square().sum() / 2 for t in terms)


def projection(index: int) -> Any:
    """The gate's ``index``-th loss: a random projection first (it drives the repair), the output's own direction
    second (every passing plan is confirmed on it), further random projections after."""
    return OwnDirection() if index == 1 else RandomProjection(seed=index)


class UserLoss:
    """``memopt.optimize(..., loss_fn=)``: the loss that trains, checked beside the projections (a plan's error can
    lie in the direction that loss weighs). Run on the gate's slice: a loss that cannot take it says how to fix it."""

    def __init__(self, loss_fn: Callable[[Any], Any], where: str) -> None:
        self.loss_fn, self.where = loss_fn, where

    def __call__(self, output: Any) -> torch.Tensor:
        try:
            loss = self.loss_fn(output)
        except Exception as error:  # noqa: BLE001 - said once, with the fix
            raise MemoptError(
                f"loss_fn raised on the output of the fidelity gate's slice ({self.where}): "
                f"{type(error).__name__}: {str(error).splitlines()[0][:200] if str(error) else ''}. The gate runs the "
                f"loss on the first samples only: index the targets by the output's length (lambda out: "
                f"F.cross_entropy(out, y[:len(out)])), or leave loss_fn out") from None
        return loss  # a non-scalar one is refused by compute_loss, as in every step


def gate_losses(loss_fn: Optional[Callable[[Any], Any]], where: str) -> Callable[[int], Any]:
    """The gate's ``index``-th loss (``projection``), with the user's own loss second when there is one."""
    if loss_fn is None:
        return projection
    return lambda index: projection(0) if index == 0 else UserLoss(loss_fn, where) if index == 1 else \
        projection(index - 1)
