"""capture -> annotate (cost model) -> rewrite (passes) -> annotate again -> plan, for one input signature."""
from __future__ import annotations

import dataclasses
import difflib
import logging
import math
from dataclasses import dataclass
from typing import Any, Callable, Dict, FrozenSet, List, Optional, Tuple

import torch
from torch import fx, nn
from torch.utils._pytree import tree_flatten

from memopt.cost_model.analysis import Estimate
from memopt.capture.trace import Captured, capture, check_inputs, export_capture, flat_inputs, opaque_functions
from memopt.config import Config
from memopt.core.errors import BudgetError, MemoptError
from memopt.core.heap import ResidentGrowth
from memopt.record.plan import Plan, node_plans, option_label
from memopt.fidelity.gate import has_lossy_units
from memopt.builder.budget_message import budget_message
from memopt.builder.request import Request, Session, input_signature
from memopt.capture.soundness import Soundness, check_capture
from memopt.passes.planning.candidates import copy_graph_module
from memopt.core.meta import DECISION_KEY, decided_nodes
from memopt.core.units import fmt_bytes
from memopt.reversible.check import real_examples
from memopt.passes.base import PassContext
from memopt.passes.planning.candidates import rewritten_units
from memopt.passes.manager import passes_for, run_passes
from memopt.passes.planning.planner import BudgetPlan, apply_decision, fit_decision, plan_for_budget, plan_units
from memopt.passes.planning.peak_first import every_block_from_codes, peak_first, peak_first_trial
from memopt.passes.stash.chunks import apply_chunks, chunk_to_fit, chunks_of
from memopt.passes.recompute_chunks import recompute_chunks_of, set_recompute_chunks
from memopt.cost_model.histograms import record_input_histograms
from memopt.fewbit.activations import TABLE_ACTIVATIONS


log = logging.getLogger("memopt")
# plannings of a CPU budget beside what the build left held in the process, the first included (_within_process)
PLANNINGS = 3


@dataclass
class Built:
    graph_module: fx.GraphModule
    plan: Plan
    baseline: Estimate
    estimate: Estimate
    planned: Optional[BudgetPlan] = None  # the budget planner's choice (None without a budget)
    # what another input shape needs to reuse this plan (memopt/builder/shape_reuse.py): the captured graph before any
    # rewrite (histograms kept), how it was captured, and the decisions before the fidelity gate
    captured: Optional[fx.GraphModule] = None
    method: str = ""
    initial: FrozenSet[Tuple[str, str, Optional[int]]] = frozenset()


def _without_opaque_functions(model: nn.Module, args: tuple, kwargs: dict,
                              captured: Captured) -> Tuple[Captured, Optional[Soundness]]:
    """A torch.export capture, checked, instead of a symbolic trace that kept some of the model's own Python
    functions whole (``torch.fx.wrap``: memopt cannot rewrite what they keep for backward; torchvision's Swin keeps
    its attention so); the symbolic trace when export fails or its check does. (capture, its check or None)."""
    opaque = opaque_functions(captured.graph_module) if captured.method == "symbolic_trace" else []
    if not opaque:
        return captured, None
    try:
        exported = export_capture(model, args, kwargs)
        soundness = check_capture(model, exported.graph_module, "export", args, kwargs,
                                  recapture=lambda a, k: export_capture(model, a, k).graph_module)
    except Exception as e:  # noqa: BLE001 - the symbolic trace serves
        log.info("memopt: %s: symbolic_trace kept %s whole; torch.export, which would see inside, fails (%s: %s): "
                 "keeping the symbolic trace", type(model).__name__, ", ".join(opaque[:3]), type(e).__name__,
                 str(e).splitlines()[0][:200] if str(e) else "")
        return captured, None
    log.info("memopt: %s: symbolic_trace kept %s whole, hiding what they keep for backward; captured by "
             "torch.export instead", type(model).__name__, ", ".join(opaque[:3]))
    return exported, soundness


def handed_on(recapture: Callable[[tuple, dict], fx.GraphModule]) -> Callable[[tuple, dict], fx.GraphModule]:
    """``recapture``, whose graph goes once to the next call with equal inputs (the same tree, tensors of the same
    shapes, dtypes, devices and values, the same other leaves): the soundness check and the fidelity gate each cut
    their own copy of the same slice of the example inputs (``batch_slice``), and an export costs more than the
    check's step. Handed on once, not kept: the gate writes its analysis into the graph it gets."""
    last: List[Any] = []

    def run(args: tuple, kwargs: dict) -> fx.GraphModule:
        leaves, spec = tree_flatten((args, kwargs))
        if last and last[0] == spec and len(last[1]) == len(leaves) and all(map(_equal_leaf, last[1], leaves)):
            gm = last[2]
            last.clear()
            return gm
        gm = recapture(args, kwargs)
        last[:] = [spec, leaves, gm]
        return gm

    return run


def _equal_leaf(a: Any, b: Any) -> bool:
    if isinstance(a, torch.Tensor) or isinstance(b, torch.Tensor):
        return (type(a) is type(b) and a.shape == b.shape and a.dtype == b.dtype and a.device == b.device
                and a.requires_grad == b.requires_grad and torch.equal(a, b))
    return a is b or (type(a) is type(b) and type(a) in (bool, int, float, str) and a == b)


def build(request: Request, whole: bool = True, capture_fn: Callable[[nn.Module, tuple, dict], Any] = capture,
          checked: Optional[Soundness] = None) -> Built:
    """Capture, annotate, choose the rewrites, apply them and re-annotate, for one input signature.

    ``request.plan`` (a saved ``Plan`` for these inputs) replaces planning: its chosen units are applied
    as they are. Otherwise no budget applies every enabled technique at its defaults, a budget the
    baseline meets changes nothing, and any other budget goes to the planner. ``capture_fn`` captures
    (``memopt/builder/shape_reuse.py`` passes a torch.export with some dimensions dynamic, or a graph captured and
    checked before that serves these sizes: ``checked`` is then its soundness check, not run again).
    ``request.loss_fn`` is the loss of every estimate's step and one of the fidelity gate's losses; ``whole``:
    False for a submodule's graph (per-submodule capture), whose inputs come from outside it.
    """
    model, args, kwargs, config = request.model, request.args, request.kwargs, request.config
    check_inputs(model, args, kwargs)
    growth = ResidentGrowth()  # what this build leaves held in a CPU process (its resident memory), from here
    captured = capture_fn(model, args, kwargs)
    if checked is None and captured.method == "symbolic_trace":
        exported, checked = _without_opaque_functions(model, args, kwargs, captured)
        if exported is not captured:  # its slices are exported as it was
            captured, capture_fn = exported, capture
    gm = captured.graph_module
    if whole:  # a submodule's graph (per-submodule capture) holds only some of the names
        warn_unknown_names(config, {n.name for n in gm.graph.nodes}, request.name)
    ctx = PassContext(args, kwargs, config.device,
                      None if _has_meta(args, kwargs) else real_examples(flat_inputs(gm, args, kwargs)),
                      foreign_inputs=not whole, optimizer=request.optimizer, loss_fn=request.loss_fn)
    # the gate's slice is captured as this graph was (an export graph is specialised to the batch size)
    recapture = handed_on((lambda a, k: capture_fn(model, a, k).graph_module) if capture_fn is not capture else
                          (lambda a, k: export_capture(model, a, k).graph_module) if captured.method == "export" else
                          (lambda a, k: capture(model, a, k).graph_module))
    session = Session(request, captured.method, ctx.annotate(gm), ctx, recapture=recapture)
    session.growth = growth if session.baseline.device == "cpu" else None
    # the soundness check runs an export graph captured on its slice as the gate will: the gate is handed that graph
    soundness = checked or check_capture(model, gm, captured.method, args, kwargs, recapture=recapture)
    if config.fewbit is not None and config.fewbit.weight == "data" and not _has_meta(args, kwargs):
        record_input_histograms(gm, flat_inputs(gm, args, kwargs), TABLE_ACTIVATIONS, config.fewbit.domain)
    gated = config.fidelity is not None and request.plan is None and soundness.checked
    session.pristine = copy_graph_module(gm)  # the no-budget rewrite works on gm itself
    # a budget in a CPU process's resident memory, with no reserve of the user's: keep that free too
    reserving = session.growth is not None and request.budget_bytes is not None and request.plan is None and \
        config.workspace_mb is None
    if reserving:
        session.reserve_bytes = session.growth.bytes()
    built, initial = _rewrite_and_gate(session, gm, gated)
    if session.growth is not None:
        built, initial = _within_process(session, built, initial, gated, reserving)
    built.plan.soundness = soundness.to_dict()
    built.captured, built.method, built.initial = session.pristine, captured.method, initial
    return built


def _rewrite_and_gate(session: Session, gm: fx.GraphModule, gated: bool) -> Tuple[Built, FrozenSet]:
    """The plan of ``gm`` (``_rewrite``), gated where it is lossy; with the decision before the gate. A budget
    that planning and the gate refuse is met by the default plan where that fits it (``_default_within``)."""
    ctx = session.ctx
    try:
        built = _rewrite(session, gm)
        initial = decision_set(built.graph_module)
        if gated and has_lossy_units(built.plan.units):
            built = _gate(session, built)
        return built, initial
    except BudgetError:
        session.ctx = ctx  # the refused plan's repairs are not the default plan's
        found = _default_within(session, gated)
        if found is None:
            raise
        return found


def _default_within(session: Session, gated: bool) -> Optional[Tuple[Built, FrozenSet]]:
    """The plan ``memopt.optimize`` makes without a budget (peak first, within the step-time allowance), gated, where
    it fits the budget the budget's planning refused, else None. The budget planner buys bytes with bits and the gate
    can refuse what it bought (a unit's gradient error grows with the batch it was planned at) and then finds the
    least peak by making units exact and recomputing blocks, where the default plan's 8-bit codes pass: a user
    asking for a budget must not be refused one that the plan they get without asking meets."""
    request, target = session.request, session.target
    if request.plan is not None or target is None:
        return None
    session.request = dataclasses.replace(request, budget_bytes=None)
    try:
        built, initial = _rewrite_and_gate(session, copy_graph_module(session.pristine), gated)
    finally:
        session.request = request
    fidelity = built.plan.fidelity or {}
    if built.plan.estimated_peak_bytes > target or not fidelity.get("passed", True):
        return None
    log.info("memopt: %s: budget_mb=%.1f is met by the default plan (estimated peak %s), where the budget's own "
             "planning was refused by the fidelity gate", request.name, request.budget_bytes / 2**20,
             fmt_bytes(built.plan.estimated_peak_bytes))
    built.plan.budget_bytes = request.budget_bytes
    return built, initial


def _within_process(session: Session, built: Built, initial: FrozenSet, gated: bool,
                    reserving: bool) -> Tuple[Built, FrozenSet]:
    """A CPU build's plan with what the build left held in the process recorded (the report adds it to the
    estimated peak: the process's resident peak); ``reserving`` (a budget without Config.workspace_mb): within the
    budget less all of it.

    The planner kept free what the build held when it planned; the gate's reference step in float64 and the
    plan's own steps leave more (their buffer pools). Where the plan's estimate no longer fits beside all of it,
    it is planned and gated again for the budget less the whole of it, up to ``PLANNINGS`` times in all: each
    planning in the same process grows it less than the one before (the pools are already there), so a plan a
    few MiB past its room is planned once more rather than handed over. Where it still grows past the last plan's
    room that is logged as a warning with the reserve that would have held it."""
    held = session.growth.bytes()
    budget = session.request.budget_bytes - session.config.workspace_bytes(session.baseline.device) if reserving \
        else None
    plannings = 1
    while reserving and plannings < PLANNINGS and held > session.reserve_bytes and \
            built.plan.estimated_peak_bytes + held > budget:
        log.info("memopt: %s: the build left %s held in this process (%s when it planned); its plan's estimated "
                 "peak %s does not fit beside it in budget_mb=%.1f: planning again for %s", session.request.name,
                 fmt_bytes(held), fmt_bytes(session.reserve_bytes), fmt_bytes(built.plan.estimated_peak_bytes),
                 session.request.budget_bytes / 2**20, fmt_bytes(budget - held))
        session.reserve_bytes = held
        built, initial = _rewrite_and_gate(session, copy_graph_module(session.pristine), gated)
        held, plannings = max(held, session.growth.bytes()), plannings + 1
    if reserving and built.plan.estimated_peak_bytes + held > budget:
        log.warning("memopt: %s: the build left %s held in this process after planning %d times for "
                    "budget_mb=%.1f; beside the plan's estimated peak %s that is %s over the budget. Set "
                    "Config(workspace_mb=%d) to keep that much free, or raise budget_mb", session.request.name,
                    fmt_bytes(held), plannings, session.request.budget_bytes / 2**20,
                    fmt_bytes(built.plan.estimated_peak_bytes),
                    fmt_bytes(built.plan.estimated_peak_bytes + held - budget), math.ceil(held / 2**20))
    built.plan.process_held_bytes = held
    return built, initial


def decision_set(gm: fx.GraphModule) -> FrozenSet[Tuple[str, str, Optional[int]]]:
    """{(technique, unit, bits)} of every rewrite in ``gm``: what two plans must share to be the same plan."""
    out = set()
    for node in decided_nodes(gm):
        decision = node.meta.get(DECISION_KEY)
        if decision and decision.get("technique") not in (None, "exact"):
            replaces = decision.get("replaces", node.name)
            unit = decision.get("unit", replaces if isinstance(replaces, str) else ",".join(replaces))
            out.add((decision["technique"], str(unit), decision.get("bits")))
    return frozenset(out)


def warn_unknown_names(config: Config, names: set, model: str) -> None:
    """A node name in a technique's allow / deny / node_bits that the captured graph does not have is most
    likely misspelled: it would be ignored without a word."""
    for field in ("stash", "fewbit"):
        cfg = getattr(config, field)
        if cfg is None:
            continue
        for option in ("allow", "deny", "node_bits"):
            given = getattr(cfg, option) or ()
            unknown = sorted({entry[0] if isinstance(entry, tuple) else entry for entry in given} - names)
            for name in unknown:
                close = difflib.get_close_matches(name, sorted(names), n=3)
                log.warning("memopt: %s: %sConfig.%s names %r, which is no node of the captured graph%s",
                            model, "Stash" if field == "stash" else "FewBit", option, name,
                            f"; did you mean {', '.join(map(repr, close))}?" if close else
                            " (om.report() lists the node names)")


def _gate(session: Session, built: Built) -> Built:
    """Run the fidelity gate on ``built``'s plan; re-apply the repaired decision when it changed anything. Under a
    budget, the bytes the repair gives back are found again by exact recomputation (the planner's last resort);
    a budget that cannot be met at the gate's cosine raises ``BudgetError`` with the least peak that can."""
    name, config = session.request.name, session.config
    decision, report = session.gate(built.plan.chosen_units(), built.plan.units)
    if report["changes"]:
        log.info("memopt: the fidelity gate changed %d units of %s: %s", len(report["changes"]), name,
                 "; ".join(report["changes"][:3]))
        before = built.plan.chosen_units()
        session.ctx = dataclasses.replace(session.ctx, gate_exact=frozenset(
            (t, u) for t, us in before.items() for u in us if u not in decision.get(t, {})))
        if built.planned is None:
            before = built.plan.estimated_peak_bytes
            gm, records = apply_decision(session.pristine, config, decision, session.ctx)
            set_recompute_chunks(gm, built.plan.recompute_chunks)  # the search goes on from where the plan's ended
            estimate, _ = chunk_to_fit(gm, session.ctx.annotate(gm), session.target, session.ctx.annotate)
            built = Built(gm, make_plan(session, estimate, records, gm, None), session.baseline, estimate)
            if session.target is not None and estimate.peak_bytes > session.target:  # every block from codes
                raise BudgetError(_repaired_over(session, before, estimate.peak_bytes, report),
                                  session.request.budget_bytes, estimate.peak_bytes)
        else:
            built = _refit(session, built, decision, report)
    if not report["passed"]:
        log.warning("memopt: %s: the fidelity gate could not bring every parameter to cosine %s in %d rounds: %s",
                    name, report["min_cosine"], report["rounds"], ", ".join(report["below"][:4]))
    built.plan.fidelity = report
    return built


def _repaired_over(session: Session, before: int, after: int, report: Dict[str, Any]) -> str:
    budget = session.request.budget_bytes
    return (f"budget_mb={budget / 2**20:.1f} ({fmt_bytes(budget)}) cannot be met for {session.request.name} with "
            f"every parameter's gradient at cosine >= {report['min_cosine']} (Config.fidelity): with every block "
            f"recomputed from codes the estimated peak is {fmt_bytes(before)} but its gradients miss (worst "
            f"{report['before']['parameter']} at cosine {report['before']['cosine']:.4f}), and with the gate's "
            f"repairs it is {fmt_bytes(after)}. Raise the budget to at least "
            f"{math.ceil((after + session.kept_free) / 2**20 * 100) / 100} MiB{_held_note(session)}, lower "
            f"FidelityConfig.min_cosine, or accept the approximate gradients with Config(fidelity=None).")


def _held_note(session: Session) -> str:
    """Why a budget asked for in a refusal is above the least peak by more than the workspace reserve."""
    return (f" (with the {fmt_bytes(session.reserve_bytes)} this build left held in the process's resident memory, "
            f"measured, kept free beside it)" if session.reserve_bytes else "")


MAX_REPLANS = 3  # plans made again around the gate's repairs before a budget is refused


def _lowered(found: Dict[str, Dict[str, Any]], decision: Dict[str, Dict[str, Any]]) -> List[str]:
    """The lossy units ``found`` runs at other bits than the gate's ``decision`` (recomputed blocks aside)."""
    return sorted(f"{t} {u}: {decision.get(t, {}).get(u) or 'exact'} -> {b} bits" for t, us in found.items()
                  if t != "recompute" for u, b in us.items() if b and decision.get(t, {}).get(u) != b)


def _refit(session: Session, built: Built, decision: Dict[str, Dict[str, Any]], report: Dict[str, Any]) -> Built:
    """The gate's repaired decision under the budget: recomputed blocks on top where it no longer fits."""
    config, baseline, pristine, budget_bytes = session.config, session.baseline, session.pristine, \
        session.request.budget_bytes
    found, best = fit_decision(pristine, session.ctx, config, baseline, session.target, built.planned, decision)
    for _ in range(MAX_REPLANS):
        lowered = [] if found is None else _lowered(found.decision, decision)
        if not lowered:
            break
        # planned again around the repairs: units the gate left alone gave up bits, so the gate checks that plan
        plan = make_plan(session, found.estimate, found.records, found.graph_module, found)
        again, checked = session.gate(plan.chosen_units(), plan.units)
        report["steps"] += checked["steps"]
        report["changes"] += checked["changes"]  # the repairs of the plan made again are the plan's story too
        if checked["passed"] and not checked["changes"]:
            report["changes"].append(f"planned again around the repairs, within the budget: {', '.join(lowered)}")
            report.update({k: checked[k] for k in ("passed", "worst", "below", "parameters")})
            return Built(found.graph_module, plan, baseline, found.estimate, found)
        decision = again
        found, best = fit_decision(pristine, session.ctx, config, baseline, session.target, found, decision)
    else:
        found = None
    if found is None:
        least = best.estimate.peak_bytes
        raise BudgetError(
            f"budget_mb={budget_bytes / 2**20:.1f} ({fmt_bytes(budget_bytes)}) cannot be met for "
            f"{session.request.name} with every parameter's gradient at cosine >= {report['min_cosine']} "
            f"(Config.fidelity): the planner's plan reaches {fmt_bytes(built.plan.estimated_peak_bytes)} but its "
            f"gradients miss (worst {report['before']['parameter']} at cosine {report['before']['cosine']:.4f}), and "
            f"with the gate's repairs "
            f"{'plus every recomputable block' if config.recompute is not None else '(recomputation is off)'} "
            f"the least estimated peak is {fmt_bytes(least)}. Raise the budget to at least "
            f"{math.ceil((least + session.kept_free) / 2**20 * 100) / 100} MiB{_held_note(session)}, lower "
            f"FidelityConfig.min_cosine, or accept the approximate gradients with Config(fidelity=None).",
            budget_bytes, least)
    added = sorted(set(found.decision.get("recompute", {})) - set(built.planned.decision.get("recompute", {})))
    plan = make_plan(session, found.estimate, found.records, found.graph_module, found)
    if added:
        report["changes"].append(f"recompute {', '.join(added)}: exact recomputation frees the bytes the raised "
                                 f"bits gave back, within the budget")
        # the figures of the plan that runs: recomputed blocks replaced some lossy units by exact ones
        _, final = session.gate(plan.chosen_units(), plan.units, verify_only=True, config=dataclasses.replace(
            config, fidelity=dataclasses.replace(config.fidelity, max_rounds=1)))
        report.update({k: final[k] for k in ("passed", "worst", "below", "parameters")})
        report["steps"] += final["steps"]
    return Built(found.graph_module, plan, baseline, found.estimate, found)


def _rewrite(session: Session, gm: fx.GraphModule) -> Built:
    """Apply the request's plan, every technique, or the planner's choice to the captured ``gm`` (real example
    inputs visible to checks)."""
    request, config, baseline, ctx = session.request, session.config, session.baseline, session.ctx
    planned: Optional[BudgetPlan] = None
    trial = fallback = None
    target = session.target
    if request.plan is not None:
        gm, records = apply_decision(gm, config, request.plan.chosen_units(), ctx)
        _check_applied(gm, request.plan)
        apply_chunks(gm, request.plan.weight_grad_chunks, request.plan.recompute_chunks,
                     lambda g: ctx.annotate(g, simulate=False))
    elif target is None:
        trial = peak_first_trial(gm, config, ctx, baseline)
        pristine = copy_graph_module(gm) if trial is not None else None  # the default run rewrites gm in place
        gm, records = run_passes(gm, passes_for(config), ctx)
    elif baseline.peak_bytes <= target:
        records = []
    else:
        planned, best = plan_for_budget(gm, config, baseline, target, ctx)
        if planned is None:  # every block recomputed from codes, where the planner's exact recomputation missed
            found = every_block_from_codes(session.pristine, config, ctx, baseline, target, ctx.annotate)
            if found is None or found.estimate.peak_bytes > target:
                least = make_plan(session, best.estimate, best.records, best.graph_module, best) if found is None \
                    or best.estimate.peak_bytes <= found.estimate.peak_bytes else \
                    make_plan(session, found.estimate, found.records, found.graph_module, None)
                raise BudgetError(budget_message(least, config, session.reserve_bytes), request.budget_bytes,
                                  min(least.estimated_peak_bytes, least.baseline_peak_bytes))
            log.info("memopt: %s: the budget is met by recomputing all %d blocks from %d-bit codes (estimated peak "
                     "%s; the planner's least was %s)", request.name, len(found.blocks),
                     config.recompute.peak_first_bits, fmt_bytes(found.estimate.peak_bytes),
                     fmt_bytes(best.estimate.peak_bytes))
            fallback = found  # its estimate and chunks stand
        gm, records = (planned.graph_module, planned.records) if planned is not None else \
            (found.graph_module, found.records)
    modified = any(r.modified for r in records)
    estimate = planned.estimate if planned is not None else fallback.estimate if fallback is not None else (
        ctx.annotate(gm) if modified else baseline)
    if modified and request.plan is None and target is None:  # no budget: chunks wherever they lower the peak
        estimate, _ = chunk_to_fit(gm, estimate, None, ctx.annotate)
    found = peak_first(pristine, trial, ctx, estimate, ctx.annotate) if trial is not None else None
    if found is not None:  # peak first (no plan, no budget): blocks recomputed from codes, with their chunks
        log.info("memopt: %s: recomputing %d blocks from %d-bit codes%s lowers the estimated peak %s -> %s at "
                 "about %.2fx a stock step's FLOPs", request.name, len(found.blocks), config.recompute.peak_first_bits,
                 " (their own tensors coded too)" if found.inside else "", fmt_bytes(estimate.peak_bytes),
                 fmt_bytes(found.estimate.peak_bytes), found.time_ratio)
        gm, records, estimate, modified = found.graph_module, found.records, found.estimate, True
    result = make_plan(session, estimate, records, gm, planned)
    if target is not None and request.plan is None and result.estimated_peak_bytes > target:
        raise BudgetError(budget_message(result, config, session.reserve_bytes), request.budget_bytes,
                          result.estimated_peak_bytes)
    return Built(gm, result, baseline, estimate, planned)


def make_plan(session: Session, estimate: Estimate, records: list, gm: fx.GraphModule,
              planned: Optional[BudgetPlan]) -> Plan:
    """The plan record of ``gm`` (rewritten from the session's capture; ``estimate`` its estimate, ``records``
    its passes' records, ``planned`` the budget planner's choice or None)."""
    request, baseline = session.request, session.baseline
    decisions = {n.name: n.meta[DECISION_KEY] for n in gm.graph.nodes if DECISION_KEY in n.meta}
    units = plan_units(gm, baseline, estimate, planned)
    if planned is not None:
        _explain_exact(decisions, units)
    return Plan(
        model=request.name, capture=session.method, device=estimate.device,
        input_signature=input_signature(request.args, request.kwargs), torch_version=torch.__version__,
        config=request.config.to_dict(), budget_bytes=request.budget_bytes,
        baseline_saved_bytes=baseline.saved_bytes, estimated_saved_bytes=estimate.saved_bytes,
        baseline_peak_bytes=baseline.peak_bytes, estimated_peak_bytes=estimate.peak_bytes,
        baseline_breakdown=dict(baseline.breakdown), estimated_breakdown=dict(estimate.breakdown),
        passes=[{"name": r.name, "modified": r.modified} for r in records],
        nodes=node_plans(baseline, estimate, decisions), units=units, weight_grad_chunks=chunks_of(gm),
        recompute_chunks=recompute_chunks_of(gm),
        planner={} if planned is None else {
            "required_bytes": planned.required_bytes, "rounds": planned.rounds,
            "seconds": round(planned.seconds, 3), "predicted_freed_bytes": planned.solution.freed_bytes,
            "estimated_freed_bytes": baseline.saved_bytes - estimate.saved_bytes,
            "cost": planned.solution.cost, "groups": len(planned.groups)},
    )


def _check_applied(gm: fx.GraphModule, plan: Plan) -> None:
    """Every unit the plan rewrites must have been rewritten; otherwise say which and why not."""
    done = {(t, u) for t in plan.chosen_units() for u in rewritten_units(gm, t)}
    for technique, units in plan.chosen_units().items():
        for unit in units:
            if (technique, unit) not in done:
                node = next((n for n in gm.graph.nodes if n.name == unit), None)
                why = "there is no such node in the captured graph" if node is None else \
                    node.meta.get(DECISION_KEY, {}).get("reason", "the pass did not rewrite it")
                raise MemoptError(f"the plan rewrites {unit!r} with {technique} but it cannot be applied: {why}. "
                                  f"The model or its inputs changed since the plan was made; plan again "
                                  f"(memopt.optimize without plan=) or drop that unit from the plan.")


def _explain_exact(decisions: Dict[str, Dict[str, Any]], units: List[Dict[str, Any]]) -> None:
    """Nodes of units the planner left exact say so (instead of 'not in allow'), and why."""
    recomputed = {node: entry["chosen"]["unit"] for entry in units if entry["chosen"]["technique"] == "recompute"
                  for node in entry["nodes"]}
    for entry in units:
        if entry["chosen"]["technique"] != "exact":
            continue
        blocks = sorted({recomputed[n] for n in entry["nodes"] if n in recomputed})
        if blocks:
            reason = (f"planner: part of this unit lies in the recomputed block {', '.join(blocks)}, so the "
                      f"rest stays exact")
        else:
            alternatives = ", ".join(f"{option_label(o)} frees {fmt_bytes(o['freed_bytes'])}"
                                     for o in entry["alternatives"][1:4])
            reason = f"planner: the budget is met without it ({alternatives})"
        for name in entry["nodes"]:
            if name not in recomputed:
                decisions[name] = dict(decisions.get(name, {}), technique="exact", reason=reason)


def _has_meta(args: tuple, kwargs: dict) -> bool:
    from torch.utils._pytree import tree_leaves

    return any(isinstance(t, torch.Tensor) and t.is_meta for t in tree_leaves((args, kwargs)))
