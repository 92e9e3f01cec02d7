"""``OptimizedModule``: the user's model with a rewritten training graph and the same state.

It holds the original model's own parameter, buffer and child dicts (the same dict objects), so
``state_dict()`` keys, ``parameters()`` (the same ``nn.Parameter`` objects) and ``train()/eval()``
are those of the model, also after the model changes. The rewritten ``GraphModule`` for each input
signature lives outside the module tree (plain attributes), so nothing is registered twice.
Training forwards (train mode, grad enabled, no ``torch.func`` transform) run the rewritten graph;
every other forward runs the original model untouched. A graph is keyed by the input signature
and the model's structure (which module and parameter objects sit where, which require grad):
replacing a submodule or a parameter, adding one, freezing one or registering a hook re-captures
and re-plans at the next training forward, so a stale graph never trains the old objects. Inputs that
differ from a planned signature only in their sizes reuse its captured graph and plan where that is what a
new plan would run (``memopt/builder/shape_reuse.py``; ``shape_stats`` counts reuses and re-plans). Modules
with hooks are captured as one call and never rewritten, so their hooks fire as in stock PyTorch.
A model that cannot be captured whole is captured per submodule (``memopt/builder/per_submodule.py``): its own
forward runs, with the captured submodules' forwards routed through their graphs for that call only.
``torch.compile(om)`` keeps the savings: choosing the graph (``_route``) and memopt's runtime ops
(``memopt/core/leaf.py``) are opaque to dynamo and run eagerly; the code between them compiles.
"""
from __future__ import annotations

import builtins
import inspect
import logging
import sys
from collections import OrderedDict
from pathlib import Path
from typing import Any, Callable, Optional, Tuple, Union

import torch
from torch import nn

from memopt.capture.trace import capture
from memopt.core import counters
from memopt.core.heap import release_autocast_cache, release_free_heap
from memopt.core.inputs import normalize_inputs
from memopt.config import Config
from memopt.core.errors import MemoptError, TraceError
from memopt.builder.pipeline import Built, build
from memopt.builder.request import input_signature
from memopt.builder.request import Request
from memopt.record.plan import Plan
from memopt.core.state import module_flags, preserved_buffers, preserved_rng, restore_flags, share_module_state, \
    train_as_user
from memopt.builder.per_submodule import build_partial
from memopt.builder.structure import guarded_paths, plain_convs, trains_anything
from memopt.builder.structure import structure as model_structure
from memopt.core.modules import Walked, walk
from memopt.record.report import render
from memopt.builder.dynamic_export import DynamicExport, FirstCapture, batch_dims, describe
from memopt.builder.shape_reuse import (MAX_REFERENCES, Recaptured, Reference, ShapeStats, changed_dims, distance,
                                        input_shapes, reapplied, replan_key, reuse, shape_free_signature, timed)
from memopt.capture.soundness import Soundness, attribute_fingerprint, changed_attributes
from memopt.record.export import export_directory, export_partial

log = logging.getLogger("memopt")

MAX_SIGNATURES = 8  # captured graphs kept per module (least recently used dropped)


class OptimizedModule(nn.Module):
    """Returned by ``memopt.optimize``; train it as you trained the original model."""

    def __init__(self, model: nn.Module, config: Config, budget_bytes: Optional[int], optimizer: Any,
                 plan: Optional[Plan] = None) -> None:
        super().__init__()
        # the model's own dicts, not copies: a module or parameter the user adds or replaces later is ours too
        share_module_state(self, model)
        # Plain attributes (object.__setattr__), not registered: they hold the same objects again.
        object.__setattr__(self, "_memopt_model", model)
        object.__setattr__(self, "_memopt_config", config)
        object.__setattr__(self, "_memopt_budget", budget_bytes)
        object.__setattr__(self, "_memopt_optimizer", optimizer)
        object.__setattr__(self, "_memopt_plan", plan)
        # optimize()'s loss_fn and the input signature of the example inputs it was given with: it may close over
        # that batch's targets, so builds for other signatures estimate with the default loss
        object.__setattr__(self, "_memopt_loss", (None, None))
        object.__setattr__(self, "_memopt_built", OrderedDict())
        object.__setattr__(self, "_memopt_guards", {})
        object.__setattr__(self, "_memopt_last", None)
        object.__setattr__(self, "_memopt_layout_warned", False)
        self._init_shapes()

    # ---------------------------------------------------------------- standing in for the model
    @property
    def training(self) -> bool:  # type: ignore[override]
        """The model's own flag: ``model.eval()`` on the original module is ``om.eval()`` too (an evaluation
        with autograd on runs the model, not the training graph)."""
        model = self.__dict__.get("_memopt_model")
        return model.training if model is not None else self.__dict__.get("_memopt_training", True)

    @training.setter
    def training(self, mode: bool) -> None:
        model = self.__dict__.get("_memopt_model")
        if model is None:  # nn.Module.__init__, before the model is attached
            self.__dict__["_memopt_training"] = mode
        else:
            model.training = mode

    def __getattr__(self, name: str) -> Any:
        """Parameters, buffers and submodules as ``nn.Module`` finds them (the model's own dicts); any other
        attribute is the model's (``config``, ``save_pretrained``, ``generate``, ``device``...)."""
        try:
            return super().__getattr__(name)
        except AttributeError:
            model = self.__dict__.get("_memopt_model")
            if model is None or name.startswith("_memopt"):
                raise
            return getattr(model, name)

    def __new__(cls, model: nn.Module, *args: Any, **kwargs: Any) -> "OptimizedModule":
        # an instance of the model class's stand-in subclass, whose forward has the model's signature
        return super().__new__(stand_in_class(type(model)) if cls is OptimizedModule else cls)

    def __reduce_ex__(self, protocol: int) -> tuple:
        """Pickled (and deep-copied) as its stand-in class rebuilt from the model's class: the subclass is made at
        run time, so pickle cannot find it by name."""
        return _rebuild, (type(self._memopt_model),), self.__getstate__()

    def _init_shapes(self) -> None:
        # shape-free signature + structure -> [Reference] (memopt/builder/shape_reuse.py), most recently used first
        object.__setattr__(self, "_memopt_families", OrderedDict())
        object.__setattr__(self, "_memopt_shape_stats", ShapeStats())
        object.__setattr__(self, "_memopt_logged", set())

    def __setstate__(self, state: dict) -> None:
        super().__setstate__(state)
        if "_memopt_families" not in self.__dict__:  # pickled before shapes were reused
            self._init_shapes()

    # ---------------------------------------------------------------- capture and planning
    def _build_for(self, args: tuple, kwargs: dict) -> Built:
        walked = walk(self._memopt_model)  # one walk of the module tree for the structure and the guards
        signature, structure = tuple(input_signature(args, kwargs)), model_structure(self._memopt_model, walked)
        key = (signature, structure)
        built, guards_failed = self._cached(key, walked)
        if built is None:
            family = (shape_free_signature(args, kwargs), structure)
            # planning reads module attributes: a parametrised weight (spectral norm) read in training mode runs
            # its power iteration, which moves its buffers; the user's buffers stay as eager leaves them
            with preserved_buffers(self._memopt_model), preserved_rng():  # the forward draws what eager's would
                built = self._plan_or_reuse(family, signature, args, kwargs, guards_failed)
            self._memopt_built[key] = built
            self._memopt_guards[key] = attribute_fingerprint(self._memopt_model, guarded_paths(built))
            while len(self._memopt_built) > MAX_SIGNATURES:
                dropped, _ = self._memopt_built.popitem(last=False)
                self._memopt_guards.pop(dropped, None)
        else:
            self._memopt_built.move_to_end(key)
        object.__setattr__(self, "_memopt_last", built)
        return built

    def _plan_or_reuse(self, family: tuple, signature: tuple, args: tuple, kwargs: dict, guards_failed: bool) -> Any:
        built, cause, served = self._reuse(family, signature, args, kwargs)
        if built is None:
            if guards_failed:
                pass  # _cached said what changed
            elif any(k[0] == signature for k in self._memopt_built):
                log.warning("memopt: %s changed since it was captured (a module or parameter was added, replaced "
                            "or frozen, a submodule's training flag changed, or a hook registered); capturing and planning again",
                            type(self._memopt_model).__name__)
            elif self._memopt_built or cause is not None:
                self._log_replan(signature, cause or (
                    "captured per submodule (memopt/builder/per_submodule.py), whose plans are made for one signature each"
                    if not isinstance(self._memopt_last, Built) else
                    "no plan yet for these ranks, dtypes, devices, non-tensor inputs and modules"))
            built = self._plan_new(family, signature, args, kwargs, cause, served)
        return built

    def _cached(self, key: tuple, walked: Walked) -> Tuple[Any, bool]:
        """(the build for ``key``, False) if its guards hold: the plain Python attributes its graphs may have
        read as constants are as they were at capture; else (None, True) after dropping it, with a log line.
        ``walked``: ``memopt.core.modules.walk`` of the model, made for this forward."""
        built = self._memopt_built.get(key)
        if built is None:
            return None, False
        now = attribute_fingerprint(self._memopt_model, guarded_paths(built), walked)
        recorded = self._memopt_guards.get(key)
        if recorded is None or now == recorded:
            return built, False
        log.warning("memopt: %s changed since it was captured (%s); capturing and planning again",
                    type(self._memopt_model).__name__, ", ".join(changed_attributes(recorded, now)[:4]))
        del self._memopt_built[key]
        del self._memopt_guards[key]
        return None, True

    def _build_new(self, signature: tuple, args: tuple, kwargs: dict, capture_fn=capture, checked=None):
        try:
            with counters.tally() as counts:
                built = self._capture_and_plan(signature, args, kwargs, capture_fn, checked)
            built.plan.build = dict(counts)
            return built
        finally:  # planning's freed memory back to the system, not left in the heap the training step then grows
            release_autocast_cache()
            release_free_heap()

    def _capture_and_plan(self, signature: tuple, args: tuple, kwargs: dict, capture_fn, checked):
        plan = self._memopt_plan
        if plan is not None and list(signature) != plan.input_signature:
            log.warning("memopt: the given plan is for inputs %s, not %s; planning these inputs anew",
                        plan.input_signature, list(signature))
            plan = None
        while True:
            try:
                return build(self._request(args, kwargs, plan, signature), capture_fn=capture_fn, checked=checked)
            except TraceError as error:  # else the submodules that can be captured (builder/per_submodule.py)
                whole = error
            if not (isinstance(capture_fn, DynamicExport) and capture_fn.dynamic()):
                break
            log.info("memopt: %s exported with %s dynamic fails (%s); exporting these sizes only",
                     type(self._memopt_model).__name__, describe(capture_fn.dims), whole.summary)
            capture_fn.static()
        # outside the except block: a refusal of the fallback is one message (it quotes the whole capture's), not a
        # traceback chained to the first
        log.warning("memopt: %s cannot be captured whole; capturing its submodules instead (%s)",
                    type(self._memopt_model).__name__, whole.summary)
        return build_partial(self._request(args, kwargs, plan, signature), whole)

    def _request(self, args: tuple, kwargs: dict, plan: Optional[Plan] = None,
                 signature: Optional[tuple] = None) -> Request:
        """What a build for these inputs is asked: optimize()'s model, config, budget and optimizer, ``plan``, and
        its loss_fn where ``signature`` is its example inputs' (``_loss_for``)."""
        return Request(self._memopt_model, args, kwargs, self._memopt_config, self._memopt_budget,
                       self._memopt_optimizer, plan, None if signature is None else self._loss_for(signature))

    def _loss_for(self, signature: tuple) -> Optional[Callable[[Any], Any]]:
        """optimize()'s loss_fn for the signature of its example inputs; None (the default loss) for any other."""
        loss_signature, loss_fn = self._memopt_loss
        return loss_fn if tuple(signature) == loss_signature else None

    def _reuse(self, family: tuple, signature: tuple, args: tuple, kwargs: dict) -> tuple:
        """(a reference plan of ``family`` applied at these sizes, None, None) when one serves them
        (memopt/builder/shape_reuse.py); else (None, why not: the re-plan's cause or None when the family has no plan yet, a
        reference whose captured graph serves these sizes, whose decisions differ, or None)."""
        references = self._memopt_families.get(family)
        served = None
        if not references:
            return None, None, None
        self._memopt_families.move_to_end(family)
        shapes, fingerprint, causes = input_shapes(args, kwargs), attribute_fingerprint(self._memopt_model), []
        # one seen at these very inputs first, then the nearest sizes (a size rule flips between references)
        for reference in sorted(references, key=lambda r: (signature not in r.checked, distance(r.shapes, shapes))):
            if reference.fingerprint != fingerprint:
                references.remove(reference)
                causes.append(f"{type(self._memopt_model).__name__} changed since it was captured (" +
                              ", ".join(changed_attributes(reference.fingerprint, fingerprint)[:4]) + ")")
                continue
            why = "the plan given to optimize(plan=...) is for its own inputs only" if reference.given_plan else \
                reference.serves(args, kwargs, shapes)
            if why is None:
                result, seconds = timed(reuse, reference, self._request(args, kwargs), list(signature))
                self._memopt_shape_stats.reuse_seconds += seconds
                if isinstance(result, Built):
                    references.remove(reference)
                    references.insert(0, reference)
                    self._memopt_shape_stats.reused += 1
                    self._memopt_shape_stats.remembered += getattr(result, "remembered", True)  # True: the reference
                    self._memopt_shape_stats.inside += getattr(result, "inside", False)
                    self._log_reuse(signature, reference, getattr(result, "inside", False))
                    return result, None, None
                if served is None:  # its graph serves these sizes: its decisions are the cause that matters
                    served, causes = reference, [result] + causes
                    continue
                why = result
            causes.append(why)
        return None, causes[0] if causes else None, served

    def _plan_new(self, family: tuple, signature: tuple, args: tuple, kwargs: dict, cause: Optional[str],
                  served=None):
        """A full build (capture, check, plan, gate), kept as a reference for the family's later sizes. A graph
        torch.export specialised to other sizes is exported again with the dimensions that changed dynamic; a
        captured graph that serves these sizes (``served``: only its decisions differ) is planned again as it is."""
        references = self._memopt_families.get(family, [])
        shapes, capture_fn, checked = input_shapes(args, kwargs), capture, None
        exported = next((r for r in references if r.built.method == "export"), None)
        if served is not None:
            capture_fn, checked = Recaptured(served), Soundness(**served.built.plan.soundness)
        elif cause is not None and exported is not None and self._memopt_config.dynamic is not False:
            dims = exported.dynamic | changed_dims(exported.shapes, shapes)
            if getattr(exported, "static", False):  # its family's dynamic graph failed: these sizes, the plan applied
                capture_fn = DynamicExport(frozenset(), static=True)
            elif dims:
                capture_fn = DynamicExport(dims, batch_dims(args, kwargs))
                log.info("memopt: exporting %s again with %s dynamic", type(self._memopt_model).__name__,
                         describe(dims))
        if capture_fn is capture and self._memopt_config.dynamic:  # an export graph dynamic from the start
            capture_fn = FirstCapture(args, kwargs)
        plan = self._memopt_plan
        given = plan is not None and list(signature) == plan.input_signature
        built, seconds = None, 0.0
        if type(capture_fn) is DynamicExport and self._memopt_budget is None and not exported.given_plan:
            built, seconds = timed(reapplied, exported, self._request(args, kwargs), capture_fn)
        if built is None:
            built, more = timed(self._build_new, signature, args, kwargs, capture_fn, checked)
            seconds += more
        stats = self._memopt_shape_stats
        stats.planned, stats.plan_seconds = stats.planned + 1, stats.plan_seconds + seconds
        if cause is not None:
            stats.replans[replan_key(cause)] = stats.replans.get(replan_key(cause), 0) + 1
        if isinstance(built, Built) and built.captured is not None:
            guards = capture_fn.guards if isinstance(capture_fn, (DynamicExport, Recaptured)) and \
                built.method == "export" else None
            references.insert(0, Reference(built, shapes, list(signature), capture_fn.dims if guards else frozenset(),
                                           guards, attribute_fingerprint(self._memopt_model), given,
                                           static=isinstance(capture_fn, DynamicExport) and not capture_fn.speculate))
            del references[MAX_REFERENCES:]
            self._memopt_families[family] = references
            self._memopt_families.move_to_end(family)
            while len(self._memopt_families) > MAX_SIGNATURES:
                self._memopt_families.popitem(last=False)
        return built

    def _log_replan(self, signature: tuple, cause: str) -> None:
        """Each re-plan is logged with its cause: the first of each kind of cause as a warning, repeats at INFO."""
        kind = replan_key(cause)
        level = logging.INFO if kind in self._memopt_logged else logging.WARNING
        self._memopt_logged.add(kind)
        log.log(level, "memopt: new input signature %s for %s; capturing and planning again: %s", list(signature),
                type(self._memopt_model).__name__, cause)

    def _log_reuse(self, signature: tuple, reference, inside: bool) -> None:
        """The first reuse of each kind is a warning (the sizes change: the user may want to know what it costs),
        later ones INFO."""
        kind = "reuse inside" if inside else "reuse"
        first = kind not in self._memopt_logged
        self._memopt_logged.add(kind)
        how = ("these sizes lie inside the sizes it was checked to run, " + ", ".join(
            f"{path} dim {i}: {lo}..{hi}" for (path, i), (lo, hi) in sorted(reference.spans.items())) +
            " (Config.shape_checks='range'; 'every' checks each new size)") if inside else \
            "its captured graph serves these sizes and the plan's decisions apply to them"
        log.log(logging.WARNING if first else logging.INFO, "memopt: new input signature %s for %s; reusing the plan "
                "made for %s: %s%s", list(signature), type(self._memopt_model).__name__, reference.signature, how,
                " (later reuses are logged at INFO; om.shape_stats counts them)" if first else "")

    @property
    def shape_stats(self) -> dict:
        """How many input signatures were planned (full build) and how many reused a plan, and the seconds each
        took; ``replans``: each re-plan's cause (numbers blanked) and how often."""
        return self._memopt_shape_stats.to_dict()

    def prepare(self, example_inputs: Any, loss_fn: Optional[Callable[[Any], Any]] = None) -> "OptimizedModule":
        """Capture and plan for ``example_inputs`` now (``optimize`` calls this when given inputs); ``loss_fn``
        maps their output to the step's loss (see ``memopt.optimize``)."""
        args, kwargs = normalize_inputs(example_inputs)
        if loss_fn is not None:
            object.__setattr__(self, "_memopt_loss", (tuple(input_signature(args, kwargs)), loss_fn))
        flags = module_flags(self._memopt_model)
        train_as_user(self._memopt_model)  # we plan the training graph, under the user's submodule flags
        try:
            self._build_for(args, kwargs)
        finally:
            restore_flags(flags)
        return self

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        built = self._route(args, kwargs, torch.compiler.is_compiling())  # True while dynamo traces this
        if built is None:
            return self._memopt_model(*args, **kwargs)
        if isinstance(built, Built):
            return built.graph_module(*args, **kwargs)
        return built.run(self._memopt_model, args, kwargs)  # captured per submodule

    @torch.compiler.disable(reason="memopt: choosing, capturing and planning the graph runs eagerly (a graph break "
                                   "before the rewritten graph); torch.compile(fullgraph=True) cannot compile a "
                                   "memopt OptimizedModule: compile it without fullgraph=True")
    def _route(self, args: tuple, kwargs: dict, compiling: bool = False) -> Any:
        """The build whose graph runs this forward, or None to run the original model.

        Opaque to ``torch.compile``: under dynamo ``peek_interpreter_stack()`` is never None (it is
        wrapped as an object), so a traced check sent every compiled forward to the original model
        and kept as much as stock (issue 24); and capture and planning are no graph to compile.
        Dynamo breaks the graph here and traces the rewritten graph this returns."""
        # torch.func transforms (grad, vmap, jacrev, ...) run the original model: memopt's autograd
        # Functions have no functorch rules, and a transform's forward is not the training step planned
        if not (self._memopt_model.training and torch.is_grad_enabled()) or torch._C._functorch.peek_interpreter_stack() is not None \
                or not trains_anything(self._memopt_model, args, kwargs):
            return None
        built = self._build_for(args, kwargs)
        if compiling:
            self._warn_inductor_layout(built)
        return built

    def _warn_inductor_layout(self, built) -> None:
        """Warn once per module when inductor may keep more than eager memopt: its layout optimization makes
        channels-last copies of the inputs of the convolutions it compiles, and saves those for backward
        beside the tensors memopt's ops (or the caller) keep. Measured on torchvision resnet18 (batch 8,
        64x64): 2.90 MiB saved instead of 2.40; with ``layout_optimization = False``, the same as eager
        (docs/results/compile/compile_savings.md). Only checked when inductor is loaded and that option on."""
        config = sys.modules.get("torch._inductor.config")
        if self._memopt_layout_warned or config is None or not getattr(config, "layout_optimization", False):
            return
        graphs = {"": built.graph_module} if isinstance(built, Built) else built.graph_modules
        convs = [f"{path}.{name}" if path else name for path, gm in graphs.items() for name in plain_convs(gm)]
        if convs:
            object.__setattr__(self, "_memopt_layout_warned", True)
            log.warning("memopt: torch.compile of %s: with the inductor backend, %d convolution(s) outside "
                        "memopt's ops (%s) may save channels-last copies of their inputs beside what memopt keeps "
                        "(+21%% saved bytes on resnet18); set torch._inductor.config.layout_optimization = False "
                        "before the first compiled call to keep eager memopt's saved bytes",
                        type(self._memopt_model).__name__, len(convs), ", ".join(convs[:4]) +
                        (", ..." if len(convs) > 4 else ""))

    def train(self, mode: bool = True) -> "OptimizedModule":
        super().train(mode)
        self._memopt_model.train(mode)
        return self

    # ---------------------------------------------------------------- inspection
    @property
    def original_module(self) -> nn.Module:
        return self._memopt_model

    @property
    def graph_module(self) -> torch.fx.GraphModule:
        return self._last().graph_module

    @property
    def graph_modules(self) -> "dict[str, torch.fx.GraphModule]":
        """{submodule path: rewritten graph}: {"": graph} for a model captured whole, one entry per
        captured submodule for a model captured per submodule (``memopt/builder/per_submodule.py``)."""
        built = self._last()
        return {"": built.graph_module} if isinstance(built, Built) else built.graph_modules

    @property
    def plan(self) -> Plan:
        """Every decision for the most recent input signature (a JSON-serialisable ``Plan``)."""
        return self._last().plan

    @property
    def estimate(self):
        return self._last().estimate

    def _last(self) -> Built:
        if self._memopt_last is None:
            raise MemoptError(f"{type(self._memopt_model).__name__} has not been captured yet: pass "
                              f"example_inputs to memopt.optimize or run one training forward first")
        return self._memopt_last

    def report(self, print: bool = False, *, top: Optional[int] = None, group: bool = True) -> str:  # noqa: A002
        """The per-node memory table and totals; ``print=True`` also prints it."""

        text = render(self.plan, top=top, group=group)
        stats = self._memopt_shape_stats
        if stats.planned + stats.reused > 1:
            text += "\n" + stats.line()
        if print:
            builtins.print(text)
        return text

    def export(self, directory: Union[str, Path]) -> Path:
        """Write graph.py, graph.dot, graph.graphml, plan.json and report.md into ``directory``."""
        if not isinstance(self._last(), Built):
            return export_partial(self, Path(directory))
        return export_directory(self, Path(directory))

    def __repr__(self) -> str:
        if self._memopt_last is None:
            return f"OptimizedModule({type(self._memopt_model).__name__}, not captured yet)"
        return self.report()


_STAND_INS: dict = {}


def stand_in_class(model_class: type) -> type:
    """``OptimizedModule``'s subclass for ``model_class``: its ``forward`` has the model class's signature, as
    ``inspect.signature`` reads it on the class or on an instance (the Hugging Face Trainer reads the class: it keeps
    the dataset columns and finds the label arguments that signature names; without them it drops every column and
    reports no ``eval_loss``)."""
    cls = _STAND_INS.get(model_class)
    if cls is None:
        def forward(self, *args: Any, **kwargs: Any) -> Any:
            return OptimizedModule.forward(self, *args, **kwargs)

        try:
            forward.__signature__ = inspect.signature(model_class.forward)
        except (TypeError, ValueError):  # a forward inspect cannot read keeps (*args, **kwargs)
            pass
        forward.__doc__ = model_class.forward.__doc__
        cls = type(f"Optimized{model_class.__name__}", (OptimizedModule,),
                   {"forward": forward, "__module__": __name__, "__doc__": OptimizedModule.__doc__})
        _STAND_INS[model_class] = cls
    return cls


def _rebuild(model_class: type) -> "OptimizedModule":
    cls = stand_in_class(model_class)
    return nn.Module.__new__(cls)
