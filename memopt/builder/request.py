"""What one build was asked for (``Request``), and what its steps share once the model is captured (``Session``);
the budget and the input signature a request is keyed by.

A build's steps (rewrite, fidelity gate, the gate's re-fit under a budget, the plan record) all need the model, its
example inputs, the config, the budget, the optimizer and the loss, and, once captured, the capture method, the
graph before any rewrite, the baseline estimate, the pass context and how to capture the model again on the gate's
slice. Threaded by hand they made parameter lists of 9-13 that had to agree; here they are named once: the request
is frozen (a step cannot change what the user asked), the session is made once per capture and handed on.
"""
from __future__ import annotations

import gc
import math
from dataclasses import dataclass
from typing import Any, Callable, Dict, List, Optional, Tuple

import torch
from torch import fx, nn
from torch.utils._pytree import keystr, tree_flatten_with_path

from memopt.config import Config
from memopt.cost_model.analysis import Estimate
from memopt.core.heap import ResidentGrowth
from memopt.fidelity.gate import fidelity_gate
from memopt.passes.base import Decision, PassContext
from memopt.record.plan import Plan


@dataclass(frozen=True)
class Request:
    """One build's inputs, as ``memopt.optimize`` (or a per-submodule or shape-reuse build) asks for them:
    ``args`` / ``kwargs`` the example inputs in their one normalized form, ``budget_bytes`` None for no budget,
    ``plan`` a saved plan to apply instead of planning, ``loss_fn`` the step's loss (None: the outputs' sum)."""
    model: nn.Module
    args: tuple
    kwargs: Dict[str, Any]
    config: Config
    budget_bytes: Optional[int] = None
    optimizer: Any = None
    plan: Optional[Plan] = None
    loss_fn: Optional[Callable[[Any], Any]] = None

    @property
    def name(self) -> str:
        """The model's class name, as messages and plans name it."""
        return type(self.model).__name__


@dataclass
class Session:
    """What a build's steps share once the model is captured: the ``request``, the capture ``method``, the
    ``baseline`` estimate, the pass context, the graph before any rewrite (``pristine``: the gate and the re-fit
    rewrite copies of it), and ``recapture(args, kwargs)``: the model captured again as this graph was (the gate's
    slice; an export graph is specialised to the batch size)."""
    request: Request
    method: str
    baseline: Estimate
    ctx: Optional[PassContext] = None
    pristine: Optional[fx.GraphModule] = None
    recapture: Optional[Callable[[tuple, dict], fx.GraphModule]] = None

    @property
    def config(self) -> Config:
        return self.request.config

    # A CPU build's: the resident memory the build has left held so far (``memopt.core.heap.ResidentGrowth``), read
    # after the gate for the plan's record, and before planning too where a budget has no Config.workspace_mb;
    # None for a CUDA build
    growth: Optional[ResidentGrowth] = None
    reserve_bytes: int = 0  # the growth the planner keeps free below the budget, beside the workspace

    @property
    def target(self) -> Optional[int]:
        """The bytes the planner plans for: the budget less the device's workspace reserve and what the build has
        left held in a CPU process (None: no budget)."""
        budget = self.request.budget_bytes
        return None if budget is None else self.config.planning_target(budget, self.baseline.device) - \
            self.reserve_bytes

    @property
    def kept_free(self) -> int:
        """The bytes of the budget no plan may use: the workspace reserve and the measured process growth."""
        return self.config.workspace_bytes(self.baseline.device) + self.reserve_bytes

    def gate(self, decision: Decision, units: List[Dict[str, Any]], config: Optional[Config] = None,
             verify_only: bool = False) -> Tuple[Decision, Dict[str, Any]]:
        """The fidelity gate (``memopt.fidelity.gate.fidelity_gate``) on this capture's pristine graph for the
        plan ``decision`` / ``units``, under ``config`` (default the request's)."""
        request = self.request
        try:
            return fidelity_gate(request.model, request.args, request.kwargs, config or self.config, decision, units,
                                 self.pristine, verify_only=verify_only, recapture=self.recapture,
                                 loss_fn=request.loss_fn)
        finally:
            # The gate's frame can outlive it in a reference cycle: torch.fx's Proxy.__iter__ (a tuple unpacked from
            # a traced value, as timm's patch embedding does) keeps its own frame in a local, and through f_back
            # every frame on the stack when the gate recaptured its slice, the gate's own included, which keeps at
            # its return the gate's reference gradients (several copies of the parameters' gradients). Collected
            # here, once a gate, they do not sit on top of the user's first training steps.
            gc.collect()


def input_signature(args: tuple, kwargs: dict) -> List[str]:
    """One readable line per input leaf, and one per device type autocast is on for; two calls with
    equal signatures share a plan (autocast changes the dtypes and so the bytes of every node)."""
    out = []
    for path, leaf in tree_flatten_with_path((args, kwargs))[0]:
        if isinstance(leaf, torch.Tensor):
            shape = ",".join(map(str, leaf.shape))
            out.append(f"{keystr(path)}: {str(leaf.dtype).replace('torch.', '')}[{shape}] {leaf.device}"
                       f"{' requires_grad' if leaf.requires_grad else ''}")
        else:
            out.append(f"{keystr(path)}: {type(leaf).__name__} {leaf!r:.40}")
    return out + autocast_state()


def autocast_state() -> List[str]:
    """``["autocast cpu: bfloat16", ...]`` for each device type autocast is enabled for now ([] when off)."""
    return [f"autocast {device}: {str(torch.get_autocast_dtype(device)).replace('torch.', '')}"
            for device in ("cpu", "cuda") if torch.is_autocast_enabled(device)]


def validate_budget(budget_mb: Any) -> Optional[int]:
    """``budget_mb`` (MiB, None for no budget) -> bytes; anything else than a positive finite number is refused."""
    if budget_mb is None:
        return None
    if isinstance(budget_mb, bool) or not isinstance(budget_mb, (int, float)):
        raise TypeError(f"budget_mb must be a positive number of MiB or None, got "
                        f"{type(budget_mb).__name__}: {budget_mb!r:.40}")
    if not math.isfinite(budget_mb) or budget_mb <= 0:
        raise ValueError(f"budget_mb must be a positive finite number of MiB or None, got {budget_mb!r}")
    return int(budget_mb * 1024 * 1024)
