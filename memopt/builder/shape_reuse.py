"""Input shapes that change between training forwards: one captured graph and one plan for many shapes.

A build (capture, soundness check, plan, fidelity gate) is made for one concrete input signature. Inputs
that differ only in their sizes (the same ranks, dtypes, devices, ``requires_grad`` and non-tensor values:
``shape_free_signature``) reuse it when that is provably what a fresh build would run:

- The captured graph must serve the new sizes. A ``torch.fx.symbolic_trace`` graph does: a traced forward
  cannot branch on a size (sizes are traced values), so the graph repeats eager PyTorch's ops at any size.
  A ``torch.export`` graph is specialised to the sizes it was exported at: the first new size of a
  dimension exports again with the dimensions that changed dynamic (``Dim.AUTO``, as torch.compile's
  automatic dynamic shapes) and the batch dimension too (so the graph serves the soundness check's slice of the
  batch), and that graph serves later sizes only where export's own shape guards hold. Where that graph fails
  its capture check (the Llama family's keeps the causal mask it builds from the length), the new sizes are
  exported static and the plan applied to them, as are the family's later sizes. ``Config(dynamic=True)``
  exports dynamic from the first build (``FirstCapture``); ``Config(dynamic=False)`` never does.
- The plan's decisions must apply. The passes decide on sizes (the stash's ``min_per_channel``, few-bit's
  rule that a tensor too small to matter stays exact, ...), so the new sizes are annotated on fake tensors and
  the plan's decisions (the fidelity gate's repairs included) are applied to the captured graph, as
  ``optimize(plan=...)`` applies a plan: every (technique, unit, bits) must be rewritten there. A unit a fresh
  plan would add or leave out by a planning rule alone (few-bit's "too small to matter" flips for a tensor of
  fixed size as the largest one grows with the sequence) does not force a re-plan; a plan that rewrites nothing
  is re-planned where the passes would now rewrite something.
- Under a budget, the rewrites must still be needed (the baseline does not fit) and the estimated peak of
  the rewritten graph at the new sizes must fit.

A reused plan skips capture, the soundness check, the planner and the fidelity gate (which ran once, at
the reference sizes); the graph that runs is the one the passes produced for the new sizes, so a size the
passes wrote into the graph as a constant is the new one, with the plan's batch chunks (weight gradients,
recomputed blocks) set again where its layers and blocks take them at these sizes. Anything else plans anew,
with the reason logged.
"""
from __future__ import annotations

import dataclasses
import logging
import time
from dataclasses import dataclass, field
from typing import Any, Dict, List, Optional, Tuple, Union

import torch
from torch import fx, nn
from torch.utils._pytree import keystr, tree_flatten_with_path

from memopt.builder.dynamic_export import Dims, DynamicExport, describe
from memopt.capture.trace import Captured, capture, export_capture, flat_inputs
from memopt.core.errors import MemoptError, TraceError
from memopt.core.meta import DECISION_KEY
from memopt.cost_model.analysis import annotate
from memopt.passes.base import PassContext
from memopt.passes.planning.candidates import copy_graph_module
from memopt.passes.manager import passes_for, run_passes
from memopt.passes.stash.chunks import apply_chunks
from memopt.passes.planning.planner import apply_decision
from memopt.builder.pipeline import Built, build, decision_set, make_plan
from memopt.builder.request import Request, Session, autocast_state
from memopt.reversible.check import real_examples

log = logging.getLogger("memopt")

MAX_REFERENCES = 4  # plans kept per shape-free signature (a size that changes a decision adds one)
MAX_CHECKED = 1024  # input signatures remembered per plan as served by its very graph (no check when seen again)



def shape_free_signature(args: tuple, kwargs: dict) -> Tuple[str, ...]:
    """``pipeline.input_signature`` with each tensor's sizes replaced by its rank: inputs with equal ones may
    share a captured graph and a plan."""
    out = []
    for path, leaf in tree_flatten_with_path((args, kwargs))[0]:
        if isinstance(leaf, torch.Tensor):
            out.append(f"{keystr(path)}: {str(leaf.dtype).replace('torch.', '')}[rank {leaf.dim()}] {leaf.device}"
                       f"{' requires_grad' if leaf.requires_grad else ''}")
        else:
            out.append(f"{keystr(path)}: {type(leaf).__name__} {leaf!r:.40}")
    return tuple(out + autocast_state())


def input_shapes(args: tuple, kwargs: dict) -> Dict[str, Tuple[int, ...]]:
    """{input path: shape} of every tensor input."""
    return {keystr(path): tuple(leaf.shape) for path, leaf in tree_flatten_with_path((args, kwargs))[0]
            if isinstance(leaf, torch.Tensor)}


def changed_dims(before: Dict[str, Tuple[int, ...]], after: Dict[str, Tuple[int, ...]]) -> Dims:
    return frozenset((path, i) for path, shape in after.items() for i, (a, b) in enumerate(zip(before[path], shape))
                     if a != b)


def distance(before: Dict[str, Tuple[int, ...]], after: Dict[str, Tuple[int, ...]]) -> int:
    """How far apart two inputs' sizes are (the sum of the differences of every dimension)."""
    return sum(abs(a - b) for path, shape in after.items() for a, b in zip(before.get(path, ()), shape))


class Recaptured:
    """A capture function for ``pipeline.build`` that returns a reference's captured graph again (a copy): it
    serves the new sizes, only the rewrite decisions differ there, so neither capture nor its check is redone."""

    def __init__(self, reference: "Reference") -> None:
        self.dims, self.guards, self.reference = reference.dynamic, reference.guards, reference

    def __call__(self, model: nn.Module, args: tuple, kwargs: dict) -> Captured:
        reference = self.reference
        if reference.serves(args, kwargs, input_shapes(args, kwargs)) is None:
            return Captured(copy_graph_module(reference.built.captured), reference.built.method)
        # other sizes than its graph serves (the fidelity gate's slice of the batch): captured afresh, as it was
        return export_capture(model, args, kwargs) if reference.built.method == "export" else \
            capture(model, args, kwargs)


@dataclass
class Reference:
    """A full build and what deciding on reuse needs of it."""

    built: Built
    shapes: Dict[str, Tuple[int, ...]]
    signature: List[str]
    dynamic: Dims = frozenset()  # dimensions its export graph was captured dynamic in
    guards: Any = None  # export's shape check (None: the graph serves its own sizes only, or fx)
    fingerprint: tuple = ()  # soundness.attribute_fingerprint of the model at capture
    given_plan: bool = False  # built from the Plan passed to optimize(plan=...)
    static: bool = False  # its family's graph with sizes dynamic failed its build: later sizes exported static
    # input signatures checked to run this very graph (no budget): {signature: pass records}
    checked: Dict[tuple, list] = field(default_factory=dict)
    # per dimension that changed: the least and greatest size checked to run this very graph (its own included)
    spans: Dict[Tuple[str, int], Tuple[int, int]] = field(default_factory=dict)

    def record(self, shapes: Dict[str, Tuple[int, ...]]) -> None:
        """Sizes ``shapes`` were checked to run this very graph: widen the spans of the dimensions they change."""
        for path, i in changed_dims(self.shapes, shapes):
            lo, hi = self.spans.get((path, i), (self.shapes[path][i],) * 2)
            self.spans[(path, i)] = (min(lo, shapes[path][i]), max(hi, shapes[path][i]))

    def within(self, shapes: Dict[str, Tuple[int, ...]]) -> bool:
        """Whether every dimension of ``shapes`` is its own size or lies inside the sizes checked for it."""
        return all((path, i) in self.spans and self.spans[(path, i)][0] <= shapes[path][i] <= self.spans[(path, i)][1]
                   for path, i in changed_dims(self.shapes, shapes))

    def __getstate__(self) -> dict:
        return dict(self.__dict__, guards=None)  # generated code: not picklable; a loaded one plans anew

    def serves(self, args: tuple, kwargs: dict, shapes: Dict[str, Tuple[int, ...]]) -> Optional[str]:
        """None when its captured graph computes what eager PyTorch does at ``shapes``; else why not."""
        if self.built.method == "symbolic_trace":
            return None
        if self.guards is None:
            changed = changed_dims(self.shapes, shapes)
            return (f"torch.export specialised the graph to the sizes of {describe(changed)}"
                    if changed else None)
        try:
            self.guards(*flat_inputs(self.built.captured, args, kwargs))
        except AssertionError as e:
            return f"torch.export's shape guard fails ({str(e)[:160]})"
        return None


@dataclass
class ShapeStats:
    """How the input signatures a module met were served: planned (a full build) or reused (a cheap check)."""

    planned: int = 0
    reused: int = 0
    plan_seconds: float = 0.0
    reuse_seconds: float = 0.0  # the checks, those that failed included
    remembered: int = 0  # of the reused: seen before (then dropped from the cache), served with no check
    inside: int = 0  # of the reused: new, inside the sizes checked (Config.shape_checks="range"), no check
    replans: Dict[str, int] = field(default_factory=dict)  # cause -> count

    def to_dict(self) -> Dict[str, Any]:
        return {"planned": self.planned, "reused": self.reused, "remembered": self.remembered,
                "inside": self.inside, "plan_seconds": round(self.plan_seconds, 4),
                "reuse_seconds": round(self.reuse_seconds, 4), "replans": dict(self.replans)}

    def line(self) -> str:
        return (f"input signatures: {self.planned} planned ({self.plan_seconds:.2f} s), {self.reused} reused a plan "
                f"({self.reuse_seconds:.2f} s of checks)")


class Reused(Built):
    """A reference's plan applied at new sizes. Its ``plan``, ``baseline`` and ``estimate`` (a full training-step
    estimate at these sizes, for reports) are computed on first use, on meta copies of the inputs."""

    def __init__(self, graph_module: fx.GraphModule, reference: Built, records: list, signature: List[str],
                 request: Request, estimates: Optional[tuple] = None) -> None:
        self.graph_module, self.planned, self.reference = graph_module, None, reference
        self.captured, self.method, self.initial = reference.captured, reference.method, reference.initial
        args, kwargs = torch.utils._pytree.tree_map(_meta, (request.args, request.kwargs))
        self._request = dataclasses.replace(request, args=args, kwargs=kwargs)
        self._records, self._signature = records, signature
        self._estimates = estimates
        self._plan = None
        self.remembered = False  # served with no check: these very inputs were checked before
        self.inside = False  # served with no check: inside the sizes checked (Config.shape_checks="range")

    def _complete(self) -> None:
        request, records = self._request, self._records
        args, kwargs, config, optimizer = request.args, request.kwargs, request.config, request.optimizer
        if self._estimates is None:
            baseline = annotate(copy_graph_module(self.captured), args, kwargs, device=config.device,
                                optimizer=optimizer)
            modified = any(r.modified for r in records)
            estimate = annotate(self.graph_module, args, kwargs, device=config.device, optimizer=optimizer) \
                if modified else baseline
            self._estimates = (baseline, estimate)
        baseline, estimate = self._estimates
        plan = make_plan(Session(request, self.method, baseline), estimate, records, self.graph_module, None)
        plan.input_signature = list(self._signature)
        plan.soundness, plan.fidelity = self.reference.plan.soundness, self.reference.plan.fidelity
        self._plan = plan

    @property
    def plan(self):
        if self._plan is None:
            self._complete()
        return self._plan

    @property
    def baseline(self):
        if self._estimates is None:
            self._complete()
        return self._estimates[0]

    @property
    def estimate(self):
        if self._estimates is None:
            self._complete()
        return self._estimates[1]


def _meta(value: Any) -> Any:
    if not isinstance(value, torch.Tensor):
        return value
    return torch.empty_strided(value.shape, value.stride(), dtype=value.dtype,
                               device="meta").requires_grad_(value.requires_grad)


def reuse(reference: Reference, request: Request, signature: List[str]) -> Union[Built, str]:
    """``reference``'s plan at the sizes of the request's inputs when every rewrite decision is the same there
    (and, with a budget, the rewrites are needed and fit); else why not (a re-plan's cause)."""
    args, kwargs, config, budget_bytes, optimizer = request.args, request.kwargs, request.config, \
        request.budget_bytes, request.optimizer
    built = reference.built
    budget = budget_bytes is not None
    if list(signature) == reference.signature:  # its own inputs, seen again after the cache dropped them
        return built
    if not budget and not passes_for(config):  # nothing to decide: the captured graph runs as it is
        return Reused(built.graph_module, built, [], signature, request)
    if tuple(signature) in reference.checked:  # checked before, and it ran this graph
        result = Reused(built.graph_module, built, reference.checked[tuple(signature)], signature, request)
        result.remembered = True
        return result
    shapes = input_shapes(args, kwargs)
    if not budget and config.shape_checks == "range" and reference.checked and reference.within(shapes):
        result = Reused(built.graph_module, built, next(iter(reference.checked.values())), signature, request)
        result.inside = True
        return result
    base = copy_graph_module(built.captured)
    baseline = annotate(base, args, kwargs, device=config.device, optimizer=optimizer, simulate=budget)
    meta = any(isinstance(t, torch.Tensor) and t.is_meta for t in torch.utils._pytree.tree_leaves((args, kwargs)))
    ctx = PassContext(args, kwargs, config.device, None if meta else real_examples(flat_inputs(base, args, kwargs)))
    final = decision_set(built.graph_module)
    # and beside what the reference's build left held in a CPU process (a later build's planning grows it little)
    target = config.planning_target(budget_bytes, baseline.device) - built.plan.process_held_bytes if budget else None
    if budget and (baseline.peak_bytes <= target) != (not final):
        return ("the baseline fits the budget at these sizes: the plan's rewrites are not needed" if final else
                "the baseline no longer fits the budget at these sizes")
    if final:  # the plan's decisions (after its fidelity gate's repairs), applied at these sizes: each must apply
        gm, records = apply_decision(base, config, built.plan.chosen_units(), ctx)
        # and its batch chunks, on the blocks and layers that take them at these sizes (the estimate counts them)
        apply_chunks(gm, built.plan.weight_grad_chunks, built.plan.recompute_chunks,
                     lambda g: annotate(g, args, kwargs, device=config.device, optimizer=optimizer, simulate=False))
    elif budget:
        gm, records = base, []
    else:  # a plan that rewrites nothing: would the passes rewrite something at these sizes?
        gm, records = run_passes(copy_graph_module(base), passes_for(config), ctx)
    if decision_set(gm) != final:
        return _difference(final, decision_set(gm), gm)
    estimates = None
    if budget:
        modified = any(r.modified for r in records)
        estimate = annotate(gm, args, kwargs, device=config.device, optimizer=optimizer) if modified else baseline
        if estimate.peak_bytes > target:
            return (f"the plan's estimated peak at these sizes, {estimate.peak_bytes / 2**20:.1f} MiB, exceeds the "
                    f"budget less the workspace reserve and what optimize() left held, {target / 2**20:.1f} MiB")
        estimates = (baseline, estimate)
    if same_program(gm, built.graph_module):  # one graph for every size it was checked at
        gm = built.graph_module
        if not budget:
            reference.checked[tuple(signature)] = records
            reference.record(shapes)
            while len(reference.checked) > MAX_CHECKED:
                reference.checked.pop(next(iter(reference.checked)))
    return Reused(gm, built, records, signature, request, estimates)


def reapplied(reference: Reference, request: Request, capture_fn: "DynamicExport") -> Optional[Built]:
    """``reference``'s plan applied to the graph ``capture_fn`` exports again with the changed dimensions dynamic
    (``request``: the model, the new inputs, the config and the optimizer; no budget):
    the capture and its soundness check run, the planner and the fidelity gate do not (the graph computes what the
    reference's did, whose decisions the gate checked). Where the graph with sizes dynamic fails its build, and
    where its family's did before (``Reference.static``), these sizes are exported static and the plan is applied
    to that graph the same way (``DynamicExport.static``). None, after a log line, when the export falls back to
    ``capture`` or a decision does not apply to the new graph: the caller then plans anew."""
    request = dataclasses.replace(request, budget_bytes=None, plan=reference.built.plan, loss_fn=None)
    while True:
        try:
            built = build(request, capture_fn=capture_fn)
            break
        except MemoptError as e:
            if isinstance(e, TraceError) and capture_fn.dynamic():
                log.info("memopt: %s exported with %s dynamic fails (%s); exporting these sizes only", request.name,
                         describe(capture_fn.dims), e.summary)
                capture_fn.static()
                continue
            log.info("memopt: the plan made for %s does not apply to %s exported %s (%s); planning anew",
                     reference.signature, request.name, _how(capture_fn), str(e)[:200])
            return None
    if (capture_fn.speculate and capture_fn.guards is None) or \
            decision_set(built.graph_module) != decision_set(reference.built.graph_module):
        return None
    built.plan.fidelity = reference.built.plan.fidelity
    log.info("memopt: %s exported again %s; the plan made for %s applied to it (no planner, no gate)",
             request.name, _how(capture_fn), reference.signature)
    return built


def _how(capture_fn: "DynamicExport") -> str:
    return f"with {describe(capture_fn.dims)} dynamic" if capture_fn.speculate else "at these sizes"


def same_program(a: fx.GraphModule, b: fx.GraphModule) -> bool:
    """Whether running ``a`` is running ``b``: the same generated code, and every attribute it reads the same
    object, an equal tensor, or (a pass's sub-graph) the same program again. Sizes a pass wrote into the graph
    as constants are in the code, so a graph that depends on them is never shared across sizes."""
    if a is b:
        return True
    if a.code != b.code:
        return False
    for node in a.graph.nodes:
        if node.op not in ("get_attr", "call_module"):
            continue
        x, y = _attribute(a, node.target), _attribute(b, node.target)
        if x is y:
            continue
        if isinstance(x, torch.Tensor) and isinstance(y, torch.Tensor):
            if x.dtype != y.dtype or x.shape != y.shape or x.device != y.device or not torch.equal(x, y):
                return False
        elif not (isinstance(x, fx.GraphModule) and isinstance(y, fx.GraphModule) and same_program(x, y)):
            return False
    return True


def _attribute(gm: fx.GraphModule, target: str) -> Any:
    obj = gm
    for part in target.split("."):
        obj = getattr(obj, part, None)
    return obj


def _difference(expected: frozenset, found: frozenset, gm: fx.GraphModule) -> str:
    """The first few units whose decision differs, with the pass's reason where it left one exact."""
    reasons = {n.name: n.meta[DECISION_KEY].get("reason", "") for n in gm.graph.nodes
               if n.meta.get(DECISION_KEY, {}).get("technique") == "exact"}
    parts = []
    for technique, unit, bits in sorted(expected - found, key=str)[:3]:
        why = reasons.get(unit)
        parts.append(f"{technique} {unit} ({bits} bits) is not rewritten at these sizes" + (f": {why}" if why else ""))
    for technique, unit, bits in sorted(found - expected, key=str)[:3]:
        parts.append(f"{technique} {unit} ({bits} bits) is rewritten at these sizes but not at the planned ones")
    return "the rewrite decisions differ: " + "; ".join(parts)


def replan_key(cause: str) -> str:
    """A re-plan cause without its numbers: log lines are written once per kind of cause."""
    return "".join("#" if c.isdigit() else c for c in cause)


def timed(fn, *args, **kwargs):
    start = time.perf_counter()
    result = fn(*args, **kwargs)
    return result, time.perf_counter() - start
