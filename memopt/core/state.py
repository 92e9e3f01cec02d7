"""Run real forwards without leaving a trace: parameters, buffers, grads, RNG and mode restored."""
from __future__ import annotations

import torch
from torch import nn


class preserved_state:
    """Context manager: snapshot of parameters, buffers, grads, RNG state and train/eval mode."""

    def __init__(self, model: nn.Module) -> None:
        self.model = model

    def __enter__(self) -> "preserved_state":
        self.values = [(t, t.detach().clone()) for t in list(self.model.parameters()) + list(self.model.buffers())]
        self.grads = [(p, p.grad) for p in self.model.parameters()]
        self.rng = torch.get_rng_state()
        self.cuda_rng = torch.cuda.get_rng_state_all() if torch.cuda.is_available() else None
        self.training = self.model.training
        return self

    def __exit__(self, *exc) -> None:
        with torch.no_grad():
            for t, v in self.values:
                if t.grad_fn is not None and not t._is_view():
                    # an in-place update with grad enabled (a buffer updated outside no_grad by a traced graph)
                    # left autograd history on it: a later backward would run through it a second time
                    t.detach_()
                t.copy_(v)
        for p, g in self.grads:
            p.grad = g
        torch.set_rng_state(self.rng)
        if self.cuda_rng is not None:
            torch.cuda.set_rng_state_all(self.cuda_rng)
        self.model.train(self.training)


def share_module_state(target: nn.Module, model: nn.Module) -> None:
    """Make ``target`` hold ``model``'s own parameter, buffer and child dicts (the same objects, not
    copies): what is added to or replaced on one is on the other, ``state_dict`` keys are the
    model's, and whoever swaps the model's tensors (torch.export, torch.func) swaps them for both."""
    for name in ("_parameters", "_buffers", "_non_persistent_buffers_set", "_modules"):
        object.__setattr__(target, name, getattr(model, name))
