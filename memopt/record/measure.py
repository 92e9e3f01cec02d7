"""``memopt.measure``: the ground truth. Runs real training steps and reports what they kept.

Saved activations: every tensor autograd packs during a real forward (``saved_tensors_hooks``),
storages counted once, parameters and buffers left out, the model's inputs and extras included.

Peak memory of one steady-state training step (forward, backward and, when an optimizer is given,
its step, after one warm-up step that creates the optimizer state):
- on CUDA: ``torch.cuda.max_memory_allocated`` over the step (everything the caching allocator
  handed out, in its 512-byte blocks, cuDNN/cuBLAS workspaces included, fragmentation-free), less what
  other tensors of the process held on the device before the step (a reference copy of the model,
  say), plus the parameters, buffers, inputs and optimizer state: the same quantity as on CPU;
- on CPU: the bytes of every tensor storage alive, tracked op by op with a ``TorchDispatchMode``
  and weak storage references (``memopt.cost_model.storage.LiveStorageTracker``), plus the parameters,
  buffers, inputs and optimizer state that exist before the step. This is what a
  ``max_memory_allocated`` would report for CPU tensors; it does not include allocator slack or
  memory that kernels allocate internally without creating tensors.

The model's parameters, buffers, gradients and RNG state are restored afterwards, so measuring
leaves the model as it was.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Optional

import torch
from torch import nn

from memopt.cost_model.optimizers import resolve_optimizer
from memopt.cost_model.step import LossFn, compute_loss
from memopt.cost_model.storage import LiveStorageTracker, SavedTensorRecorder, distinct_bytes, distinct_saved_bytes, storage_key
from memopt.core.inputs import normalize_inputs
from memopt.core.state import preserved_state, train_as_user
from torch.utils._pytree import tree_flatten


@dataclass
class Measurement:
    saved_bytes: int
    peak_bytes: int
    device: str
    method: str


def _plan_first(model: nn.Module, args: tuple, kwargs: dict) -> None:
    """An OptimizedModule captures and plans at its first training forward for new inputs: do that
    before the saved-tensor hooks below, or the cost model's own runs inside it would be recorded
    as what the training step saves. (Duck-typed: this layer sits below ``memopt.builder.optimized``.)"""
    build = getattr(model, "_build_for", None)
    if build is not None and torch.is_grad_enabled():
        build(args, kwargs)


def measure(model: nn.Module, example_inputs: Any, loss_fn: Optional[LossFn] = None, *,
            optimizer: Any = None) -> Measurement:
    """Run real training steps of ``model`` on ``example_inputs`` and return measured bytes.

    ``loss_fn`` maps the output to a scalar (default: the sum of every floating output);
    ``optimizer`` (None, "sgd", "adam", "adamw", a class or an instance) adds a real optimizer step.
    """
    if not isinstance(model, nn.Module):
        raise TypeError(f"model must be a torch.nn.Module, got {type(model).__name__}: {model!r:.80}")
    args, kwargs = normalize_inputs(example_inputs)
    resolved = resolve_optimizer(optimizer)
    params = list(model.parameters())
    state_keys = {storage_key(t) for t in params + list(model.buffers())}
    inputs = [t for t in tree_flatten((args, kwargs))[0] if isinstance(t, torch.Tensor)]
    device = params[0].device if params else (inputs[0].device if inputs else torch.device("cpu"))

    with preserved_state(model):
        train_as_user(model)
        for p in params:
            p.grad = None
        _plan_first(model, args, kwargs)
        # 1. saved activations
        with SavedTensorRecorder() as recorder:
            output = model(*args, **kwargs)
        saved = distinct_saved_bytes(recorder.saved, state_keys)
        compute_loss(output, loss_fn).backward()
        del output, recorder
        # 2. warm-up step (creates optimizer state), then the measured steady-state step
        opt = None
        if resolved is not None:
            cls, kw = resolved
            opt = cls([p for p in params if p.requires_grad], **kw)
            opt.step()
        for p in params:
            p.grad = None
        preexisting = _preexisting(model, opt, params, inputs)
        if device.type == "cuda":
            peak, method = _cuda_peak(model, args, kwargs, loss_fn, opt, preexisting, device)
        else:
            peak, method = _tracked_peak(model, args, kwargs, loss_fn, opt, preexisting)
        for p in params:
            p.grad = None
    return Measurement(int(saved), int(peak), str(device), method)


def _step(model, args, kwargs, loss_fn, opt) -> None:
    # Inside one autocast region the casts of the warm-up step (bf16 copies of the weights) stay in
    # autocast's cache and would not be allocated again; a training step casts anew (the cache is
    # emptied whenever the region is left), so the measured step starts with an empty cache.
    torch.clear_autocast_cache()
    loss = compute_loss(model(*args, **kwargs), loss_fn)
    loss.backward()
    del loss
    if opt is not None:
        opt.step()


def _preexisting(model, opt, params, inputs):
    """What exists before a step and counts toward its peak: parameters, buffers, inputs, optimizer state."""
    state = [t for st in (opt.state.values() if opt else []) for t in st.values() if isinstance(t, torch.Tensor)]
    return params + list(model.buffers()) + inputs + state


def _tracked_peak(model, args, kwargs, loss_fn, opt, preexisting):
    before = distinct_bytes(preexisting)
    tracker = LiveStorageTracker(preexisting)
    with tracker:
        _step(model, args, kwargs, loss_fn, opt)
    return before + tracker.peak, "cpu tensor-storage tracking (TorchDispatchMode + weak storage refs)"


def _cuda_peak(model, args, kwargs, loss_fn, opt, preexisting, device):
    torch.cuda.synchronize(device)
    # what the process holds on the device besides the step's own tensors is not the step's memory
    others = torch.cuda.memory_allocated(device) - distinct_bytes([t for t in preexisting if t.device == device])
    torch.cuda.reset_peak_memory_stats(device)
    _step(model, args, kwargs, loss_fn, opt)
    torch.cuda.synchronize(device)
    return torch.cuda.max_memory_allocated(device) - others, "torch.cuda.max_memory_allocated"
