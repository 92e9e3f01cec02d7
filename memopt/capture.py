"""Capture: turn an ``nn.Module`` into an ``fx.GraphModule`` that shares the model's state.

``torch.fx.symbolic_trace`` comes first: its graph is at module level, so ``call_module`` nodes
keep nn.Module identity (and hooks). When it fails (Python control flow on traced values, as in
Hugging Face models), ``torch.export.export(strict=False)`` gives an ATen-level training graph.
Either way the returned GraphModule is rebuilt on the *original* submodules, parameters and
buffers, so training it trains the user's model.
"""
from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Any, Dict, Tuple

import torch
from torch import fx, nn

from memopt.core.errors import TraceError
from memopt.core.leaf import LEAF_FUNCTIONS

log = logging.getLogger("memopt")

@dataclass
class Captured:
    graph_module: fx.GraphModule
    method: str  # "symbolic_trace" or "export"


def _resolve(root: nn.Module, target: str):
    obj = root
    for part in target.split("."):
        obj = getattr(obj, part)
    return obj


def _rebuild_on_model(model: nn.Module, graph: fx.Graph, fallback: nn.Module | None) -> fx.GraphModule:
    """A GraphModule whose attributes are the model's own objects (fallback: the export module's)."""
    attrs: Dict[str, Any] = {}
    for node in graph.nodes:
        if node.op not in ("get_attr", "call_module"):
            continue
        try:
            attrs[node.target] = _resolve(model, node.target)
        except AttributeError:
            if fallback is None:
                raise
            attrs[node.target] = _resolve(fallback, node.target)  # lifted constants of export
    # A pickled GraphModule is re-traced from its code when loaded, with the tracer class recorded
    # here. export's own tracer cannot run there, and the plain one would trace into memopt's
    # runtime functions; MemoptTracer keeps those as leaves.
    graph._tracer_cls = MemoptTracer
    graph._tracer_extras = {}
    return fx.GraphModule(attrs, graph, class_name=type(model).__name__ + "Graph")


class MemoptTracer(fx.Tracer):
    """The fx tracer with memopt's runtime functions (``memopt.core.leaf.LEAF_FUNCTIONS``) kept as leaves."""

    def __init__(self, *args, **kwargs) -> None:
        kwargs["autowrap_functions"] = tuple(kwargs.get("autowrap_functions", ())) + tuple(LEAF_FUNCTIONS)
        super().__init__(*args, **kwargs)


def _drop_export_guards(graph: fx.Graph) -> None:
    # export inserts a call to a guard module checking input shapes; it is not picklable and we
    # re-capture on any new input signature ourselves (OptimizedModule), so it is safe to drop.
    for node in list(graph.nodes):
        if node.op == "call_module" and str(node.target).startswith("_guards") and not node.users:
            graph.erase_node(node)


def has_hooks(module: nn.Module) -> bool:
    """Whether calling ``module`` runs hooks (its own, or global module hooks): a rewrite that replaces
    the call would skip them, and a forward hook may change the output. Such modules stay exact."""
    from torch.nn.modules import module as m

    own = (module._forward_hooks, module._forward_pre_hooks, module._backward_hooks, module._backward_pre_hooks)
    return any(own) or any((m._global_forward_hooks, m._global_forward_pre_hooks, m._global_backward_hooks,
                            m._global_backward_pre_hooks))


class _HookAwareTracer(fx.Tracer):
    """``symbolic_trace``'s tracer, with every module that has hooks kept as one call: tracing through a
    container would drop its hooks from the graph (stock PyTorch fires them)."""

    def is_leaf_module(self, m: nn.Module, module_qualified_name: str) -> bool:
        return (bool(module_qualified_name) and has_hooks(m)) or super().is_leaf_module(m, module_qualified_name)


def capture(model: nn.Module, args: tuple, kwargs: dict) -> Captured:
    """Capture ``model`` on the example inputs; raise ``TraceError`` when neither path works."""
    try:
        gm = _rebuild_on_model(model, _HookAwareTracer().trace(model), None)
        return Captured(gm, "symbolic_trace")
    except Exception as fx_error:  # noqa: BLE001 - any tracing failure sends us to the export path
        fx_msg = f"{type(fx_error).__name__}: {fx_error}"
        fx_where = user_frame(fx_error)
    log.info("memopt: symbolic_trace failed for %s (%s); trying torch.export", type(model).__name__, fx_msg)
    was_training = model.training
    try:
        with _quiet("torch.fx.experimental.symbolic_shapes"):  # a failure is reported by us, with its construct
            exported = torch.export.export(model, args, kwargs=kwargs, strict=False)
        ep_module = exported.module()
        graph = ep_module.graph
        _drop_export_guards(graph)
        graph.lint()
        gm = _rebuild_on_model(model, graph, ep_module)
        return Captured(gm, "export")
    except Exception as export_error:  # noqa: BLE001
        export_msg = f"{type(export_error).__name__}: {export_error}"
        export_where = user_frame(export_error)
    finally:
        model.train(was_training)
    first = lambda msg: msg.strip().splitlines()[0][:300] if msg.strip() else msg  # noqa: E731
    where = fx_where or export_where
    construct = f"  The construct: {where}\n" if where else ""
    summary = (f"symbolic_trace: {first(fx_msg)[:160]}; torch.export: {first(export_msg)[:160]}"
               + (f"; at {where}" if where else ""))
    raise trace_error(
        f"memopt could not capture {type(model).__name__}.\n"
        f"  torch.fx.symbolic_trace failed with: {first(fx_msg)}\n"
        f"  torch.export.export(strict=False) failed with: {first(export_msg)}\n"
        f"{construct}"
        f"What to try: make the failing construct traceable (replace Python control flow on tensor "
        f"values with torch.where / torch.cond), mark the submodule that contains it as a leaf "
        f"(wrap it in a module and call torch.fx.wrap / a custom Tracer.is_leaf_module), or optimize "
        f"the traceable submodules separately with memopt.optimize(submodule, ...).", summary)


class _quiet:
    """A failing torch.export prints its whole partial graph to stderr and logs a warning; we report
    the failure ourselves, with its construct. The logger is raised to ERROR and stderr is held back
    for the duration; on success what was written to stderr is passed on."""

    def __init__(self, name: str) -> None:
        self.logger = logging.getLogger(name)

    def __enter__(self) -> None:
        import contextlib
        import io

        self.level = self.logger.level
        self.logger.setLevel(logging.ERROR)
        self.buffer = io.StringIO()
        self.redirect = contextlib.redirect_stderr(self.buffer)
        self.redirect.__enter__()

    def __exit__(self, exc_type, *exc) -> None:
        import sys

        self.redirect.__exit__(exc_type, *exc)
        self.logger.setLevel(self.level)
        if exc_type is None and self.buffer.getvalue():
            sys.stderr.write(self.buffer.getvalue())


def trace_error(message: str, summary: str) -> TraceError:
    """A ``TraceError`` with ``summary``: one line naming both failures and the construct (for reports)."""
    error = TraceError(message)
    error.summary = summary
    return error


def user_frame(error: BaseException) -> str:
    """``file:line (function): code`` of the innermost frame of the traceback outside torch: the
    construct of the model's own code that tracing failed on ("" when there is none)."""
    import os
    import traceback

    torch_dir = os.path.dirname(torch.__file__) + os.sep
    frames = [f for f in traceback.extract_tb(error.__traceback__)
              if not f.filename.startswith(torch_dir) and not f.filename.startswith("<")
              and os.path.abspath(f.filename) != os.path.abspath(__file__)]
    if not frames:
        return ""
    f = frames[-1]
    return f"{f.filename}:{f.lineno} in {f.name}: {(f.line or '').strip()}"


def flat_inputs(gm: fx.GraphModule, args: tuple, kwargs: dict) -> list:
    """The values of ``gm``'s placeholders, in order, for the model-level ``args`` and ``kwargs``."""
    codegen = gm.graph._codegen
    pytree_info = getattr(codegen, "pytree_info", None)
    if pytree_info is not None and pytree_info.in_spec is not None:
        from torch.fx._pytree import tree_flatten_spec
        return list(tree_flatten_spec((args, kwargs), pytree_info.in_spec))
    import inspect
    bound = inspect.signature(gm.forward).bind(*args, **kwargs)
    bound.apply_defaults()
    return list(bound.arguments.values())


def structured_output(gm: fx.GraphModule, out: Any) -> Any:
    """Undo the output flattening of export graphs (identity for symbolic_trace graphs)."""
    return gm.graph._codegen.process_outputs(out)


def check_inputs(model: nn.Module, args: tuple, kwargs: dict) -> None:
    """Refuse inputs that do not fit ``model.forward`` before anything is traced."""
    import inspect

    signature = inspect.signature(model.forward)
    try:
        signature.bind(*args, **kwargs)
    except TypeError as e:
        raise TypeError(f"example inputs do not match {type(model).__name__}.forward{signature}: {e} "
                        f"(got {len(args)} positional and {sorted(kwargs)} keyword inputs)") from None
    devices = {t.device for t in list(model.parameters()) + list(model.buffers())}
    from torch.utils._pytree import tree_flatten_with_path, keystr

    for path, leaf in tree_flatten_with_path((args, kwargs))[0]:
        if isinstance(leaf, torch.Tensor) and devices and leaf.device not in devices and leaf.device.type != "meta":
            raise ValueError(f"example input {keystr(path)} is on {leaf.device} but {type(model).__name__}'s "
                             f"parameters are on {sorted(map(str, devices))}; move the inputs or the model "
                             f"(model.to(device)) first")
