"""Per-submodule capture: optimize the parts of a model that can be captured when the whole cannot.

When neither ``torch.fx.symbolic_trace`` nor ``torch.export`` captures a model (Python control flow
on tensor values, ``.item()`` driving a loop, a call into another library), memopt runs one real
training forward of the model (state and RNG restored) with forward pre-hooks that record each
submodule's first inputs. Then, top-down, every submodule that was called is captured on its own
inputs; one that fails is reported with both capture errors and its children are tried instead. A
submodule that is never called itself (a ``ModuleList`` the parent loops over) is looked into.

Each captured submodule gets its own graph, cost-model annotation and rewrites (``pipeline.build``).
At a training forward of the ``OptimizedModule`` the model's own Python forward runs, and for its
duration (only) each captured submodule's ``forward`` is routed through its rewritten graph; calls
with other inputs than those captured, in eval mode or without grad, run the original forward.

The whole model's totals cannot come from fake tensors (its uncaptured code needs real values), so
they are measured: one real training step of the original model and one of the routed model on the
example inputs (``memopt.measure``; state, gradients and RNG restored). Per-node rows of the
captured submodules come from the fake-tensor cost model, as for a fully captured model.

Each submodule's plan passed the fidelity gate on its own inputs and outputs, but their errors meet in the
model's gradients; ``gate_whole`` checks the whole model's per-parameter gradients against eager autograd on the
example batch and, where some miss, runs the fewest lossy submodules as written.
"""
from __future__ import annotations

import dataclasses
import logging
import time
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any, Callable, Dict, Iterator, List, Optional, Tuple

import torch
from torch import nn
from torch.utils._pytree import tree_leaves, tree_map

from memopt.capture.trace import trace_error
from memopt.config import Config
from memopt.core.errors import BudgetError, MemoptError, TraceError
from memopt.core.state import preserved_state, train_as_user
from memopt.record.measure import measure
from memopt.builder.pipeline import build
from memopt.builder.request import input_signature
from memopt.builder.request import Request
from memopt.record.plan import PartialPlan
from memopt.core.units import fmt_bytes
from memopt.fidelity.gate import PROJECTIONS, gate_losses, gate_report, has_lossy_units, parameter_fidelity, \
    judged, per_min, shortest_passing, worst_over
from memopt.capture.soundness import training_grads

log = logging.getLogger("memopt")

CAPTURE = "per-submodule"


@dataclass
class Unit:
    path: str
    signature: Tuple[str, ...]
    built: Any  # pipeline.Built
    calls: int


@dataclass
class PartialBuilt:
    """What ``OptimizedModule`` keeps per input signature when the model was captured per submodule."""

    plan: PartialPlan
    units: List[Unit]

    @property
    def graph_module(self):
        raise MemoptError(f"{self.plan.model} was captured per submodule ({len(self.units)} graphs: "
                          f"{', '.join(u.path for u in self.units)}), not as one graph; use om.graph_modules")

    @property
    def graph_modules(self) -> Dict[str, torch.fx.GraphModule]:
        return {u.path: u.built.graph_module for u in self.units}

    @property
    def estimate(self):
        raise MemoptError(f"{self.plan.model} was captured per submodule: there is no single cost-model Estimate; "
                          f"om.plan has the measured totals and the per-submodule estimates")

    def run(self, model: nn.Module, args: tuple, kwargs: dict) -> Any:
        with routed(model, self.units):
            return model(*args, **kwargs)


# ------------------------------------------------------------------------- recording the calls
def _snapshot(value: Any) -> Any:
    def copy(t):
        if not isinstance(t, torch.Tensor):
            return t
        c = t.detach().clone()
        return c.requires_grad_(t.requires_grad) if (c.is_floating_point() or c.is_complex()) else c
    return tree_map(copy, value)


def record_calls(model: nn.Module, args: tuple, kwargs: dict) -> Dict[str, list]:
    """{submodule path: [args, kwargs, calls, checkpointed]}: the first inputs of every submodule the model's
    training forward calls, from one real forward (grad on, train mode; state and RNG restored).
    ``checkpointed``: a call ran under ``torch.utils.checkpoint`` (saved-tensor hooks active, or autograd off as
    in its reentrant form): such a submodule is left as the model runs it, since checkpoint's recomputation
    calls it again outside memopt's routing and must find the tensors the first call saved."""

    calls: Dict[str, list] = {}
    handles = []

    def hook(path):
        def pre_hook(module, a, kw):
            checkpointed = not torch.is_grad_enabled() or \
                torch._C._autograd._top_saved_tensors_default_hooks(False) is not None
            if path in calls:
                calls[path][2] += 1
                calls[path][3] |= checkpointed
            else:
                calls[path] = [_snapshot(a), _snapshot(kw), 1, checkpointed]
        return pre_hook

    for path, module in model.named_modules():
        if path:
            handles.append(module.register_forward_pre_hook(hook(path), with_kwargs=True))
    try:
        with preserved_state(model), torch.enable_grad():
            train_as_user(model)
            model(*args, **kwargs)
    finally:
        for h in handles:
            h.remove()
    return calls


# ------------------------------------------------------------------------- choosing and building
def _signature(args: tuple, kwargs: dict) -> Tuple[str, ...]:
    return tuple(input_signature(args, kwargs))


def capture_units(model: nn.Module, args: tuple, kwargs: dict, config: Config, whole_error: TraceError):
    """Build every largest capturable submodule; returns (units, submodule records)."""

    calls = record_calls(model, args, kwargs)
    records: List[Dict[str, Any]] = [{"path": "", "class": type(model).__name__, "captured": False, "method": "",
                                      "calls": 1, "saved_bytes_before": None, "saved_bytes_after": None,
                                      "why": whole_error.summary}]
    units: List[Unit] = []

    def visit(prefix: str, module: nn.Module) -> None:
        for name, child in module.named_children():
            path = f"{prefix}.{name}" if prefix else name
            if path not in calls:
                if any(p.startswith(path + ".") for p in calls):
                    visit(path, child)  # a container the parent loops over, never called itself
                continue
            a, kw, count, checkpointed = calls[path]
            if checkpointed:
                records.append({"path": path, "class": type(child).__name__, "captured": False, "method": "",
                                "calls": count, "saved_bytes_before": None, "saved_bytes_after": None,
                                "why": "runs under torch.utils.checkpoint (or with autograd off): left as the "
                                       "model runs it"})
                continue
            try:
                built = build(Request(child, a, kw, config), whole=False)
            except (MemoptError, ValueError) as e:
                # not capturable, or its analysis failed (a data-dependent op the cost model cannot run on fake
                # tensors, nothing to train in its outputs, ...): this submodule runs eagerly, its children are
                # tried; the report says why
                why = e.summary if isinstance(e, TraceError) else f"{type(e).__name__}: {str(e).splitlines()[0][:200]}"
                log.info("memopt: submodule %s (%s) not captured: %s", path, type(child).__name__, why)
                records.append({"path": path, "class": type(child).__name__, "captured": False, "method": "",
                                "calls": count, "saved_bytes_before": None, "saved_bytes_after": None,
                                "why": why})
                visit(path, child)
                continue
            units.append(Unit(path, _signature(a, kw), built, count))
            records.append({"path": path, "class": type(child).__name__, "captured": True,
                            "method": built.plan.capture, "calls": count,
                            "saved_bytes_before": built.plan.baseline_saved_bytes,
                            "saved_bytes_after": built.plan.estimated_saved_bytes,
                            "why": "" if count == 1 else f"called {count} times; calls with other inputs than the "
                                                        f"first run the original forward"})

    visit("", model)
    return units, records


def build_partial(request: Request, whole_error: TraceError) -> PartialBuilt:
    """The fallback of ``pipeline.build`` when ``request.model`` cannot be captured whole (``request.loss_fn``: the
    step's loss of the model's output, in both measured steps and the whole-model gate; the submodules' own gates
    cannot use it)."""
    model, args, kwargs, config, budget_bytes, optimizer, plan, loss_fn = (
        request.model, request.args, request.kwargs, request.config, request.budget_bytes, request.optimizer,
        request.plan, request.loss_fn)

    if plan is not None:
        raise MemoptError(f"{type(model).__name__} cannot be captured whole ({whole_error.summary}); a saved plan "
                          f"cannot be re-applied to a model captured per submodule yet. Call memopt.optimize "
                          f"without plan= (it captures the submodules and plans them again).")
    _require_real_inputs(model, args, kwargs, whole_error, "memopt.optimize")
    units, records = capture_units(model, args, kwargs, config, whole_error)
    if not units:
        raise trace_error(f"{whole_error}\nNo submodule of it could be captured either (tried: "
                          f"{', '.join(r['path'] for r in records[1:]) or 'none: the forward calls no submodule'}).",
                          whole_error.summary)
    inputs = args if not kwargs else (args if args else kwargs)
    if args and kwargs:
        raise MemoptError(f"{type(model).__name__} is captured per submodule, whose totals are measured with "
                          f"memopt.measure; give its example inputs either positionally or by keyword, not both")
    base = measure(model, inputs, loss_fn, optimizer=optimizer)
    gate: Dict[str, Any] = {}
    if budget_bytes is not None and base.peak_bytes <= budget_bytes:
        units_run: List[Unit] = []
        after = base
    else:
        # each submodule was gated on its own inputs; their errors meet in the model's gradients, so the model is
        # checked as a whole too (on the full example batch: the routing is per input shape, and the measurement
        # below runs the same step anyway)
        units_run, gate = gate_whole(model, args, kwargs, config, units, loss_fn)
        with routed(model, units_run):
            after = measure(model, inputs, loss_fn, optimizer=optimizer)
    if budget_bytes is not None and after.peak_bytes > budget_bytes:
        raise BudgetError(f"budget_mb={budget_bytes / 2**20:.1f} ({fmt_bytes(budget_bytes)}) cannot be met for "
                          f"{type(model).__name__}: it is captured per submodule ({whole_error.summary}), where "
                          f"memopt applies every technique at its defaults and does not plan for a budget; the "
                          f"measured peak with them is {fmt_bytes(after.peak_bytes)} (baseline "
                          f"{fmt_bytes(base.peak_bytes)}). Raise budget_mb, lower the batch size, or make the "
                          f"model capturable whole so the planner can use recomputation.",
                          budget_bytes, after.peak_bytes)
    nodes, unit_entries, passes = [], [], []
    for unit in units_run:
        nodes += [dataclasses.replace(n, name=f"{unit.path}/{n.name}") for n in unit.built.plan.nodes]
        unit_entries += [_prefixed_unit(unit.path, u) for u in unit.built.plan.units]
        passes += [dict(p, submodule=unit.path) for p in unit.built.plan.passes]
    result = PartialPlan(
        model=type(model).__name__, capture=CAPTURE, device=after.device,
        input_signature=input_signature(args, kwargs), torch_version=torch.__version__, config=config.to_dict(),
        budget_bytes=budget_bytes, baseline_saved_bytes=base.saved_bytes, estimated_saved_bytes=after.saved_bytes,
        baseline_peak_bytes=base.peak_bytes, estimated_peak_bytes=after.peak_bytes, baseline_breakdown={},
        estimated_breakdown={}, passes=passes, nodes=nodes, units=unit_entries, submodules=records, fidelity=gate,
        totals=f"measured: one real training step of the original and of the optimized model on the example "
               f"inputs ({after.method}); the code outside the captured submodules cannot run on fake tensors")
    return PartialBuilt(result, units_run)


def gate_whole(model: nn.Module, args: tuple, kwargs: dict, config: Config, units: List[Unit],
               loss_fn: Optional[Callable[[Any], Any]] = None) -> Tuple[List[Unit], Dict[str, Any]]:
    """(the units to run, the report) of the fidelity gate on the whole model captured per submodule: its
    per-parameter gradients with every unit routed against eager autograd, under the gate's first ``PROJECTIONS``
    losses (a random projection of the outputs, their own direction; ``loss_fn`` too when given) (a fixed RNG draw,
    state restored), with the parameters each unit's own gate listed apart. Where some miss ``FidelityConfig.min_cosine``, the fewest units with lossy rewrites that pass, the
    least faithful first by their own gates, run their original forward instead (found by halving); the report
    says which. No report when the gate is off or no unit is lossy."""
    gate = config.fidelity
    lossy = [u for u in units if has_lossy_units(u.built.plan.units)]
    if gate is None or not lossy:
        return units, {}
    start = time.perf_counter()
    names = [n for n, _ in model.named_parameters()]
    invariant = {f"{u.path}.{p}": why for u in units for p, why in u.built.plan.fidelity.get("invariant", {}).items()}
    rng = torch.Generator().manual_seed(0).get_state()
    next_loss = gate_losses(loss_fn, "the whole example batch")
    losses = [next_loss(i) for i in range(PROJECTIONS + (loss_fn is not None))]
    exacts = training_grads(model, model, args, kwargs, rng, losses)  # one forward, a backward per loss
    steps, cache = [len(losses)], {}

    def evaluate(run: List[Unit]) -> Tuple[Dict[str, Dict[str, Any]], List[str]]:
        key = tuple(u.path for u in run)
        if key not in cache:
            figures: List[Dict[str, Dict[str, Any]]] = []  # each loss's gradients reduced at once, not kept
            with routed(model, run):
                training_grads(model, model, args, kwargs, rng, losses, keep=False, stop=lambda grads: figures.append(
                    parameter_fidelity(names, exacts[len(figures)], grads, gate.tiny, invariant)) or False)
            steps[0] += len(losses)
            cache[key] = worst_over(figures)
        per = cache[key]
        return per, sorted((p for p, f in per.items() if judged(f) < gate.min_cosine),
                           key=lambda p: per[p]["cosine"])

    per, failing = evaluate(units)
    before = {"parameter": failing[0] if failing else None,
              "cosine": per[failing[0]]["cosine"] if failing else per_min(per)}
    changes: List[str] = []
    if failing:
        order = sorted(lossy, key=lambda u: (u.built.plan.fidelity.get("worst") or {}).get("cosine", 1.0))
        k = shortest_passing(len(order), lambda k: not evaluate([u for u in units if u not in order[:k]])[1])
        dropped = order[:k]
        units = [u for u in units if u not in dropped]
        changes.append(f"{k} of the {len(lossy)} submodules with lossy rewrites run their original forward "
                       f"({', '.join(u.path for u in dropped[:4])}{' ...' * (k > 4)}): with every submodule "
                       f"rewritten, {len(failing)} parameters of the whole model were below {gate.min_cosine}, "
                       f"worst {failing[0]} {per[failing[0]]['cosine']:.4f}")
        log.warning("memopt: %s (captured per submodule): %s", type(model).__name__, changes[-1])
        per, failing = evaluate(units)
    log.info("memopt: fidelity gate on %s as a whole: %d steps, %.2f s", type(model).__name__, steps[0],
             time.perf_counter() - start)
    return units, gate_report(per, failing, invariant, min_cosine=gate.min_cosine,
                              slice="the whole example batch, the model as a whole", rounds=len(changes),
                              changes=changes, passed=not failing, last_resort=changes[0] if changes else None,
                              steps=steps[0], projections=len(losses), user_loss=loss_fn is not None,
                              before=before)


def _prefixed_unit(path: str, entry: Dict[str, Any]) -> Dict[str, Any]:
    def option(o):
        o = dict(o, parts=[option(p) for p in o.get("parts", ())])
        return dict(o, unit=f"{path}/{o['unit']}") if o.get("unit") else o

    def key(k):
        technique, _, unit = k.partition(":")
        return f"{technique}:{path}/{unit}"
    return dict(entry, name=f"{path}/{entry['name']}", nodes=[f"{path}/{n}" for n in entry["nodes"]],
                chosen=option(entry["chosen"]), alternatives=[option(o) for o in entry["alternatives"]],
                couplings=[[key(a), key(b)] for a, b in entry.get("couplings", ())])


def _require_real_inputs(model: nn.Module, args: tuple, kwargs: dict, whole_error: TraceError, caller: str) -> None:
    fake = [t for t in tree_leaves((args, kwargs)) + list(model.parameters())
            if isinstance(t, torch.Tensor) and t.is_meta]
    if fake:
        raise MemoptError(f"{caller} cannot cover {type(model).__name__} on the meta device: the model cannot be "
                          f"captured whole ({whole_error.summary}), so the code outside its captured submodules must "
                          f"run on real values. Give real example inputs (and parameters) on the model's device, or "
                          f"make the forward capturable.")


# ------------------------------------------------------------------------- routing at run time
@contextmanager
def routed(model: nn.Module, units: List[Unit]) -> Iterator[None]:
    """For the duration of the block, each unit's submodule runs its rewritten graph (instance attribute
    ``forward``); afterwards the model is as it was."""
    patched = []
    try:
        for unit in units:
            module = model.get_submodule(unit.path)
            own = module.__dict__.get("forward", _MISSING)
            module.__dict__["forward"] = _router(module, unit, module.forward)
            patched.append((module, own))
        yield
    finally:
        for module, own in reversed(patched):
            if own is _MISSING:
                module.__dict__.pop("forward", None)
            else:
                module.__dict__["forward"] = own


_MISSING = object()


def _router(module: nn.Module, unit: Unit, original):
    def forward(*args: Any, **kwargs: Any) -> Any:
        if not (module.training and torch.is_grad_enabled()):
            return original(*args, **kwargs)
        if _signature(args, kwargs) != unit.signature:
            log.info("memopt: %s called with inputs %s, captured for %s; running its original forward",
                     unit.path, list(_signature(args, kwargs)), list(unit.signature))
            return original(*args, **kwargs)
        return unit.built.graph_module(*args, **kwargs)
    return forward


# ------------------------------------------------------------------------- estimate and report
def estimate_partial(model: nn.Module, args: tuple, kwargs: dict, device: Optional[str], optimizer: Any,
                     loss_fn, whole_error: TraceError):
    """``memopt.estimate`` of a model that cannot be captured whole: per-node costs of the captured
    submodules (fake tensors) and the whole model's totals from one real step (nothing rewritten)."""

    _require_real_inputs(model, args, kwargs, whole_error, "memopt.estimate")
    config = Config.exact(device=device)
    units, records = capture_units(model, args, kwargs, config, whole_error)
    if args and kwargs:
        raise MemoptError(f"give {type(model).__name__}'s example inputs either positionally or by keyword, not both")
    real = measure(model, args if args else kwargs, loss_fn, optimizer=optimizer)
    nodes = [dataclasses.replace(n, name=f"{u.path}/{n.name}") for u in units for n in u.built.baseline.nodes.values()]
    plan_nodes = [dataclasses.replace(n, name=f"{u.path}/{n.name}") for u in units for n in u.built.plan.nodes]

    plan = PartialPlan(
        model=type(model).__name__, capture=CAPTURE, device=real.device, input_signature=input_signature(args, kwargs),
        torch_version=torch.__version__, config=config.to_dict(), budget_bytes=None,
        baseline_saved_bytes=real.saved_bytes, estimated_saved_bytes=real.saved_bytes,
        baseline_peak_bytes=real.peak_bytes, estimated_peak_bytes=real.peak_bytes, baseline_breakdown={},
        estimated_breakdown={}, nodes=plan_nodes, submodules=records,
        totals=f"measured: one real training step on the example inputs ({real.method}); the code outside the "
               f"captured submodules cannot run on fake tensors")
    return real.saved_bytes, real.peak_bytes, nodes, plan
