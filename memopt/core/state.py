"""Run real forwards without leaving a trace: parameters, buffers, grads, RNG and mode restored."""
from __future__ import annotations

import random
import sys

from typing import List, Tuple

import torch
from torch import nn


class preserved_rng:
    """Context manager: the generators model code draws from as they were: torch's (CPU and CUDA), Python's
    ``random`` and numpy's global one (Hugging Face Wav2Vec2 / HuBERT pick SpecAugment's masked spans with numpy in
    training mode). Planning runs the user's forward for real (the capture check, the fidelity gate): a forward
    that plans must draw what eager's would."""

    def __enter__(self) -> "preserved_rng":
        self.rng = torch.get_rng_state()
        self.cuda_rng = torch.cuda.get_rng_state_all() if torch.cuda.is_available() else None
        self.python_rng = random.getstate()
        numpy = sys.modules.get("numpy")  # only when the process uses numpy already
        self.numpy_rng = (numpy, numpy.random.get_state()) if numpy is not None else None
        return self

    def __exit__(self, *exc) -> None:
        torch.set_rng_state(self.rng)
        if self.cuda_rng is not None:
            torch.cuda.set_rng_state_all(self.cuda_rng)
        random.setstate(self.python_rng)
        if self.numpy_rng is not None:
            self.numpy_rng[0].random.set_state(self.numpy_rng[1])


class preserved_state:
    """Context manager: snapshot of parameters, buffers, grads, RNG state and train/eval mode. The RNGs are torch's
    (CPU and CUDA) and also Python's ``random`` and numpy's global one, which model code draws from too (Hugging Face
    Wav2Vec2 / HuBERT pick SpecAugment's masked spans with numpy in training mode): every real forward memopt runs
    starts from the same draws, so two steps it compares differ only by what it compares, and the user's streams
    are left where they were."""

    def __init__(self, model: nn.Module, tensors: bool = True) -> None:
        self.model = model
        self.tensors = tensors  # False: parameters and buffers are not put back (a throwaway copy's step)

    def __enter__(self) -> "preserved_state":
        self.values = [(t, t.detach().clone()) for t in list(self.model.parameters()) + list(self.model.buffers())
                       ] if self.tensors else []
        self.grads = [(p, p.grad) for p in self.model.parameters()]
        self.generators = preserved_rng().__enter__()
        self.flags = module_flags(self.model)
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
        self.generators.__exit__(*exc)
        restore_flags(self.flags)


class preserved_buffers:
    """Context manager: every buffer of ``module`` as it was. Rewriting a graph reads module attributes, and
    reading a parametrised weight (``torch.nn.utils.parametrizations.spectral_norm``) in training mode runs its
    power iteration, which updates the buffers ``_u`` / ``_v`` in place."""

    def __init__(self, module: nn.Module) -> None:
        self.module = module

    def __enter__(self) -> "preserved_buffers":
        self.values = [(b, b.detach().clone()) for b in self.module.buffers()]
        return self

    def __exit__(self, *exc) -> None:
        with torch.no_grad():
            for b, v in self.values:
                if not torch.equal(b, v):
                    b.copy_(v)


def module_flags(model: nn.Module) -> List[Tuple[nn.Module, bool]]:
    """Every submodule's training flag: fine-tuning code freezes some (``bn.eval()`` while the rest trains), and
    ``model.train(mode)`` would overwrite them all, so memopt restores each one, never only the top-level flag."""
    return [(m, m.training) for m in model.modules()]


def restore_flags(flags: List[Tuple[nn.Module, bool]]) -> None:
    for module, flag in flags:
        module.training = flag


def train_as_user(model: nn.Module) -> None:
    """Put ``model`` in the mode its training step runs in: as the user left it when it is training (a frozen
    BatchNorm stays frozen), else what ``model.train()`` gives. Callers restore ``module_flags`` afterwards."""
    if not model.training:
        model.train(True)


def share_module_state(target: nn.Module, model: nn.Module) -> None:
    """Make ``target`` hold ``model``'s own parameter, buffer and child dicts (the same objects, not
    copies): what is added to or replaced on one is on the other, ``state_dict`` keys are the
    model's, and whoever swaps the model's tensors (torch.export, torch.func) swaps them for both."""
    for name in ("_parameters", "_buffers", "_non_persistent_buffers_set", "_modules"):
        object.__setattr__(target, name, getattr(model, name))
