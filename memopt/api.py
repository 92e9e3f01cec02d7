"""The public entry points: ``optimize``, ``estimate`` and ``load``."""
from __future__ import annotations

import dataclasses
import logging
from pathlib import Path
from typing import Any, Callable, Dict, List, Optional, Union

import torch
from torch import nn
from torch._dynamo.eval_frame import OptimizedModule as CompiledModule

from memopt.cost_model.analysis import Estimate, NodeCost, annotate
from memopt.cost_model.optimizers import resolve_optimizer
from memopt.capture.trace import capture, check_inputs
from memopt.core.inputs import normalize_inputs
from memopt.config import Config
from memopt.core.errors import MemoptError, TraceError
from memopt.core.state import module_flags, restore_flags, train_as_user
from memopt.record.export import GRAPH_HEADER, graph_code
from memopt.builder.optimized import OptimizedModule
from memopt.builder.request import validate_budget
from memopt.record.plan import Plan
from memopt.record.report import render
from memopt.builder.request import input_signature
from memopt.record.plan import node_plans
from memopt.builder.per_submodule import estimate_partial

log = logging.getLogger("memopt")


def _check_model(model: Any, caller: str = "optimize") -> nn.Module:
    if not isinstance(model, nn.Module):
        raise TypeError(f"model must be a torch.nn.Module, got {type(model).__name__}: {model!r:.80}")
    model = _uncompiled(model, caller)
    if isinstance(model, OptimizedModule):
        raise TypeError("model is already a memopt.OptimizedModule; pass its original_module to optimize again")
    return model


def _uncompiled(model: nn.Module, caller: str) -> nn.Module:
    """The module a ``torch.compile`` wrapper compiles (``_orig_mod``), with a warning.

    Optimizing the wrapper itself silently kept as much as stock (issue 24: it was captured through
    torch.export and nothing was rewritten), and memopt cannot rewrite inside a dynamo graph (AOT
    autograd re-partitions and re-saves). Unwrapping is sound: the wrapper holds no state of its own (its
    parameters, buffers and submodules are ``_orig_mod``'s, which the result shares) and compiling
    does not change what the module computes. Only the compile options are not carried over, so the
    warning says to compile the result."""
    unwrapped = model
    while isinstance(unwrapped, CompiledModule):
        unwrapped = unwrapped._orig_mod
    if unwrapped is model or isinstance(unwrapped, OptimizedModule):  # the latter: _check_model says what to do
        return unwrapped
    name = type(unwrapped).__name__
    if caller == "optimize":
        log.warning("memopt.optimize: the model is a torch.compile wrapper of %s; memopt rewrites its original "
                    "module (_orig_mod) and the result runs uncompiled, since compiling the model first would "
                    "throw the savings away. Compile the result instead: om = memopt.optimize(model, ...); "
                    "om = torch.compile(om)", name)
    else:
        log.warning("memopt.%s: the model is a torch.compile wrapper of %s; %s its original module (_orig_mod)",
                    caller, name, "estimating" if caller == "estimate" else "using")
    return unwrapped


def _check_plan(plan: Any) -> Plan:
    if isinstance(plan, (str, Path)):
        import json

        plan = json.loads(Path(plan).read_text())
    if isinstance(plan, dict) and "submodules" in plan or getattr(plan, "submodules", None):
        model = plan["model"] if isinstance(plan, dict) else plan.model
        raise MemoptError(f"this plan is of {model} captured per submodule; such a plan cannot be re-applied yet. "
                          f"Call memopt.optimize without plan= (it captures the submodules and plans them again).")
    if isinstance(plan, Plan):
        return plan
    if isinstance(plan, dict):
        return Plan.from_dict(plan)
    raise TypeError(f"plan must be a memopt.Plan, its dict or the path of its JSON, got {type(plan).__name__}: "
                    f"{plan!r:.80}")


def _check_config(config: Any) -> Config:
    if config is None:
        return Config()
    if not isinstance(config, Config):
        raise TypeError(f"config must be a memopt.Config or None, got {type(config).__name__}: {config!r:.80}")
    return config


def optimize(model: nn.Module, budget_mb: Optional[float] = None, *, example_inputs: Any = None,
             config: Optional[Config] = None, optimizer: Any = None,
             plan: Union[Plan, Dict[str, Any], str, Path, None] = None,
             loss_fn: Optional[Callable[[Any], Any]] = None) -> OptimizedModule:
    """Rewrite ``model``'s training graph so that one training step fits ``budget_mb`` MiB.

    Args:
        model: any ``nn.Module``; it is never modified, and the result shares its parameters.
        budget_mb: the peak memory of one training step to fit, in MiB (None: every safe default
            rewrite). A budget the config cannot meet raises ``memopt.BudgetError``.
        example_inputs: a tensor, a tuple of positional inputs or a dict of keyword inputs. With
            them the model is captured and planned now; without them, at the first training forward
            (and again, with a logged warning, whenever the input signature changes).
        config: a ``memopt.Config`` (default ``Config()``: every technique at its safe default).
        optimizer: the optimizer whose state counts in the budget: None, "sgd", "adam", "adamw",
            an Optimizer class or instance.
        plan: a saved plan (``om.plan``, its dict, or a path to its JSON) to re-apply without
            planning: its config, budget and chosen units (which may be edited by hand) are used
            for inputs of the plan's signature; other signatures are planned anew (logged). Give
            either ``plan`` or ``budget_mb``/``config``, not both.
        loss_fn: the training step's loss of the model's output for ``example_inputs`` (e.g.
            ``lambda out: F.cross_entropy(out, y[:len(out)])``), so that the peak estimate and the budget count
            the loss's own memory (a language model's cross-entropy over the vocabulary can be the step's
            largest temporaries) and the fidelity gate checks the gradients under the loss that trains. The
            gate runs it on the output of the first samples only: index the targets by the output's length, as
            above. Other input signatures are estimated with the default loss (the sum of the outputs).

    With a budget below the baseline peak the planner (``passes/planning/planner.py``) picks, per stash
    chain and activation, exact or a technique at one of its ``plan_bits``: the choice that frees
    enough saved bytes for the least gradient-fidelity cost (time breaks ties), checked against
    the full cost model.
    """
    model = _check_model(model)
    if plan is not None:
        plan = _check_plan(plan)
        if budget_mb is not None or config is not None:
            raise ValueError("give either plan= (which carries its own budget and config) or budget_mb/config, "
                             f"not both (got budget_mb={budget_mb!r}, config={config!r:.60})")
        budget_mb = None if plan.budget_bytes is None else plan.budget_bytes / 2**20
        config = Config.from_dict(plan.config)
    budget_bytes = validate_budget(budget_mb)
    config = _check_config(config)
    resolve_optimizer(optimizer)  # validate early
    if loss_fn is not None and not callable(loss_fn):
        raise TypeError(f"loss_fn must map the model's output to a scalar loss (a callable), got "
                        f"{type(loss_fn).__name__}: {loss_fn!r:.60}")
    if loss_fn is not None and example_inputs is None:
        raise ValueError("loss_fn is the loss of the example batch's output: give example_inputs= with it (it may "
                         "close over that batch's targets), or leave loss_fn out")
    om = OptimizedModule(model, config, budget_bytes, optimizer, plan)
    if example_inputs is not None:
        om.prepare(example_inputs, loss_fn)
    return om


@dataclasses.dataclass
class EstimateReport:
    """``memopt.estimate``'s answer: the cost model alone, no rewrite."""

    saved_bytes: int
    peak_bytes: int
    nodes: List[NodeCost]
    breakdown: Dict[str, int]
    plan: Plan

    def report(self, *, top: Optional[int] = None, group: bool = True) -> str:
        return render(self.plan, top=top, group=group)


def estimate(model: nn.Module, example_inputs: Any, *, device: Optional[str] = None, optimizer: Any = None,
             loss_fn=None) -> EstimateReport:
    """Run the cost model on fake tensors (no activation memory is allocated) and report the baseline."""

    model = _check_model(model, "estimate")
    config = Config(device=device)
    resolve_optimizer(optimizer)
    args, kwargs = normalize_inputs(example_inputs)
    check_inputs(model, args, kwargs)
    flags = module_flags(model)
    train_as_user(model)
    try:
        captured = capture(model, args, kwargs)
        est: Estimate = annotate(captured.graph_module, args, kwargs, device=config.device,
                                 optimizer=optimizer, loss_fn=loss_fn)
    except TraceError as whole:  # per-submodule capture (memopt/builder/per_submodule.py)
        saved, peak, nodes, plan = estimate_partial(model, args, kwargs, device, optimizer, loss_fn, whole)
        return EstimateReport(saved, peak, nodes, {}, plan)
    finally:
        restore_flags(flags)
    plan = Plan(model=type(model).__name__, capture=captured.method, device=est.device,
                input_signature=input_signature(args, kwargs), torch_version=torch.__version__,
                config=config.to_dict(), budget_bytes=None, baseline_saved_bytes=est.saved_bytes,
                estimated_saved_bytes=est.saved_bytes, baseline_peak_bytes=est.peak_bytes,
                estimated_peak_bytes=est.peak_bytes, baseline_breakdown=dict(est.breakdown),
                estimated_breakdown=dict(est.breakdown), nodes=node_plans(est, est, {}))
    return EstimateReport(est.saved_bytes, est.peak_bytes, list(est.nodes.values()), dict(est.breakdown), plan)


def load(model: nn.Module, directory: Union[str, Path], example_inputs: Any, *, optimizer: Any = None) -> OptimizedModule:
    """Re-apply an exported plan (``om.export(directory)``) to ``model`` and check the graph matches.
    Pass the same example inputs (and optimizer, which the budget accounts for) as at export time.

    Raises ``MemoptError`` when the re-built graph differs from the exported ``graph.py`` (a changed
    model, torch version or memopt version): memopt never silently runs a different graph.
    """
    directory = Path(directory)
    om = optimize(model, example_inputs=example_inputs, optimizer=optimizer, plan=directory / "plan.json")
    expected = (directory / "graph.py").read_text()
    actual = GRAPH_HEADER.format(model=om.plan.model, capture=om.plan.capture) + graph_code(om.graph_module)
    if actual != expected:
        raise MemoptError(f"the graph re-built from {directory / 'plan.json'} differs from {directory / 'graph.py'}; "
                          f"the model, its inputs or the torch/memopt version changed since the export. "
                          f"Run memopt.optimize again and re-export.")
    return om
