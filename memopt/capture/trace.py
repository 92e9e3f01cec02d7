"""Capture: turn an ``nn.Module`` into an ``fx.GraphModule`` that shares the model's state.

``torch.fx.symbolic_trace`` comes first: its graph is at module level, so ``call_module`` nodes
keep nn.Module identity (and hooks). When it fails (Python control flow on traced values, as in
Hugging Face models), ``torch.export.export(strict=False)`` gives an ATen-level training graph.
Either way the returned GraphModule is rebuilt on the *original* submodules, parameters and
buffers, so training it trains the user's model.
"""
from __future__ import annotations

import inspect
import logging
import os
import traceback
from dataclasses import dataclass
from typing import Any, Callable, Dict, List

import torch
from torch import fx, nn
from torch.utils._pytree import tree_flatten

from memopt.capture.fused_norms import canonical_batch_norms
from memopt.core.errors import TraceError
from memopt.core.leaf import LEAF_FUNCTIONS
from memopt.core.state import module_flags, preserved_state, restore_flags
from memopt.capture.cached_constants import share_repeated_constants
from memopt.capture.autograd_functions import as_operator, function_of
from memopt.capture.attention_masks import drop_constant_masks
from memopt.capture.failures import _quiet, trace_error, user_frame  # noqa: F401  (trace_error: re-exported)
from memopt.core import counters

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


def _rebuild_on_model(model: nn.Module, graph: fx.Graph, fallback: nn.Module | None,
                      extra: Dict[str, nn.Module] | None = None) -> fx.GraphModule:
    """A GraphModule whose attributes are the model's own objects (fallback: the export module's; ``extra``:
    modules capture made, the ``FunctionCall`` of each custom autograd Function)."""
    attrs: Dict[str, Any] = dict(extra or {})
    for node in graph.nodes:
        if node.op not in ("get_attr", "call_module") or node.target in attrs:
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


class FunctionCall(nn.Module):
    """A custom ``torch.autograd.Function`` kept whole in a captured graph: calling it runs the Function's own
    forward and backward. Tracing through it would make autograd differentiate its forward's ops instead (a
    straight-through estimator's gradient would be zero, a gradient-reversal layer's of the wrong sign), and
    would keep what its forward's ops keep rather than what it saves itself."""

    def __init__(self, function: type) -> None:
        super().__init__()
        self.function = function

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        return self.function.apply(*args, **kwargs)

    def extra_repr(self) -> str:
        return f"{self.function.__module__}.{self.function.__qualname__}"


class MemoptTracer(fx.Tracer):
    """The fx tracer with memopt's runtime functions (``memopt.core.leaf.LEAF_FUNCTIONS``) kept as leaves."""

    def __init__(self, *args, **kwargs) -> None:
        kwargs["autowrap_functions"] = tuple(kwargs.get("autowrap_functions", ())) + tuple(LEAF_FUNCTIONS)
        super().__init__(*args, **kwargs)

    def is_leaf_module(self, m: nn.Module, module_qualified_name: str) -> bool:
        return isinstance(m, FunctionCall) or super().is_leaf_module(m, module_qualified_name)


def _attribute_snapshot(root: nn.Module):
    """(modules, buffer objects, public attribute values) of ``root``: what ``_restore_attributes`` puts back."""
    modules = dict(root.named_modules())
    buffers = {(path, name): t for path, m in modules.items() for name, t in m._buffers.items()}
    attrs = {(path, key): v for path, m in modules.items() for key, v in vars(m).items() if not key.startswith("_")}
    return modules, buffers, attrs


def _restore_attributes(modules, buffers, attrs) -> list:
    """Put back every buffer and public attribute the traced forward rebound (to a traced value, or to anything:
    tracing runs the forward's Python, ``self.calls += 1`` included); returns the attributes (not buffers) that
    were rebound to traced values."""
    rebound = []
    for (path, name), original in buffers.items():
        if modules[path]._buffers.get(name) is not original:
            modules[path]._buffers[name] = original
    for path, module in modules.items():
        for key, value in list(vars(module).items()):
            if key.startswith("_") or attrs.get((path, key), _MISSING) is value:
                continue
            if isinstance(value, fx.Proxy):
                rebound.append(f"{path + '.' if path else ''}{key}")
            if (path, key) in attrs:
                object.__setattr__(module, key, attrs[(path, key)])
            else:
                delattr(module, key)
    return rebound


_MISSING = object()


class _recorded_grad_mode:
    """Within the block, ``torch.no_grad`` / ``torch.enable_grad`` regions entered by the traced forward also
    record ``torch._C._set_grad_enabled`` calls in the graph (fx records no context managers otherwise): an
    EMA updated under ``no_grad`` must not get autograd history when the graph runs. The mode restored on exit
    is the trace-time one, which is the training forward's (graphs run only with grad enabled)."""

    CLASSES = (torch.no_grad, torch.enable_grad)

    def __init__(self, tracer: fx.Tracer) -> None:
        self.tracer = tracer

    def __enter__(self) -> None:
        self.saved = [(cls, cls.__enter__, cls.__exit__) for cls in self.CLASSES]
        tracer = self.tracer
        for cls, enter, exit_ in self.saved:
            def patched_enter(ctx, _enter=enter, _mode=cls is torch.enable_grad):
                ctx._memopt_before = torch.is_grad_enabled()
                tracer.create_proxy("call_function", torch._C._set_grad_enabled, (_mode,), {})
                return _enter(ctx)

            def patched_exit(ctx, *exc, _exit=exit_):
                tracer.create_proxy("call_function", torch._C._set_grad_enabled, (ctx._memopt_before,), {})
                return _exit(ctx, *exc)

            cls.__enter__, cls.__exit__ = patched_enter, patched_exit

    def __exit__(self, *exc) -> None:
        for cls, enter, exit_ in self.saved:
            cls.__enter__, cls.__exit__ = enter, exit_


def _apply_owner() -> type:
    """The class whose ``apply`` every custom autograd Function inherits (torch.autograd.Function)."""
    return next(k for k in torch.autograd.Function.__mro__ if "apply" in vars(k))


class _patched_apply:
    """Within the block, ``Function.apply`` calls ``hook(cls, args, kwargs)`` first; a hook that returns
    something other than None replaces the call (the original applies otherwise)."""

    def __init__(self, hook) -> None:
        self.hook = hook

    def __enter__(self) -> None:
        function = torch.autograd.Function
        self.own = "apply" in vars(function)
        self.raw = vars(_apply_owner())["apply"]
        raw, hook = self.raw, self.hook

        def apply(cls, *args, **kwargs):
            replaced = hook(cls, args, kwargs)
            return raw.__get__(None, cls)(*args, **kwargs) if replaced is None else replaced

        function.apply = classmethod(apply)

    def __exit__(self, *exc) -> None:
        if self.own:
            torch.autograd.Function.apply = self.raw
        else:
            del torch.autograd.Function.apply


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
    """``symbolic_trace``'s tracer, with every module that has hooks kept as one call (tracing through a
    container would drop its hooks from the graph; stock PyTorch fires them), and every custom autograd
    Function applied to traced values kept as one ``FunctionCall``."""

    def __init__(self) -> None:
        super().__init__()
        self.functions: Dict[str, FunctionCall] = {}
        # buffers as get_attr nodes, so in-place updates of them in forward (counters, EMAs, BatchNorm
        # statistics computed functionally) are recorded instead of run once, for real, at trace time
        self.proxy_buffer_attributes = True

    def is_leaf_module(self, m: nn.Module, module_qualified_name: str) -> bool:
        return (bool(module_qualified_name) and has_hooks(m)) or super().is_leaf_module(m, module_qualified_name)

    def trace(self, root, concrete_args=None) -> fx.Graph:
        modules, buffers, attrs = _attribute_snapshot(root)
        try:
            with _patched_apply(self._function_call), _recorded_grad_mode(self):
                graph = super().trace(root, concrete_args)
            self._write_back_buffers(graph, modules, buffers)
        finally:
            rebound = _restore_attributes(modules, buffers, attrs)
        if rebound:
            raise TraceError(f"{type(root).__name__}'s forward assigns traced values to attributes "
                             f"({', '.join(rebound[:4])}) that are not buffers: a captured graph cannot do that",
                             f"forward assigns traced values to attributes {', '.join(rebound[:4])}")
        return graph

    def _write_back_buffers(self, graph: fx.Graph, modules, buffers) -> None:
        """A buffer rebound in forward (``self.count = self.count + 1``, which fx records out of place) gets the
        new value copied into it at the end of the graph: the same values as eager, the same buffer object."""
        output = next(n for n in graph.nodes if n.op == "output")
        for (path, name), original in buffers.items():
            now = modules[path]._buffers.get(name)
            if isinstance(now, fx.Proxy):
                with graph.inserting_before(output):
                    target = graph.get_attr(f"{path}.{name}" if path else name)
                    graph.call_method("copy_", (target, now.node))

    def _function_call(self, cls: type, args: tuple, kwargs: dict):
        if not any(isinstance(a, fx.Proxy) for a in tree_flatten((args, kwargs))[0]):
            return None
        base = "memopt_function_" + "".join(c if c.isalnum() else "_" for c in cls.__qualname__)
        name, i = base, 0
        while name in self.functions and self.functions[name].function is not cls:
            i += 1
            name = f"{base}_{i}"
        self.functions.setdefault(name, FunctionCall(cls))
        return self.create_proxy("call_module", name, args, kwargs)


def _as_operators(applied: Dict[type, str]):
    """A ``_patched_apply`` hook for export: each custom autograd Function becomes one opaque operator call
    (``memopt.capture.autograd_functions``), replaced by its ``FunctionCall`` after export; one the operator cannot describe is
    recorded in ``applied`` (with where and why) and left to export, which inlines it."""
    def hook(cls: type, args: tuple, kwargs: dict) -> Any:
        # memopt's own ops; torch.library's Function for a custom operator's autograd (the operator stays one node)
        if cls.__module__.startswith("memopt.") or cls.__module__ == "torch._library.autograd":
            return None
        out, why = as_operator(cls, args, kwargs)
        if why is not None:
            applied.setdefault(cls, f"{_caller()}; {why}")
        return out

    return hook


def _function_calls(graph: fx.Graph) -> Dict[str, FunctionCall]:
    """Replace each opaque operator call standing for a custom autograd Function with a call of its
    ``FunctionCall`` (the modules to attach, by name)."""
    functions: Dict[str, FunctionCall] = {}
    for node in list(graph.nodes):
        cls = function_of(node.target) if node.op == "call_function" else None
        if cls is None:
            continue
        base = "memopt_function_" + "".join(c if c.isalnum() else "_" for c in cls.__qualname__)
        name, i = base, 0
        while name in functions and functions[name].function is not cls:
            i += 1
            name = f"{base}_{i}"
        if name not in functions:
            functions[name] = FunctionCall(cls)
            if graph.owning_module is not None:  # the export module until the graph moves onto the model
                graph.owning_module.add_submodule(name, functions[name])
        with graph.inserting_before(node):
            call = graph.call_module(name, node.args, dict(node.kwargs))
        call.meta = dict(node.meta)
        node.replace_all_uses_with(call)
        graph.erase_node(node)
    return functions


def _caller() -> str:
    """``file:line`` of the innermost frame of the model's own code (the one applying a Function): neither torch's
    nor memopt's package (not its parent: installed, that is site-packages, where the model's library lives too),
    nor generated (``<...>``)."""
    skip = (os.path.dirname(torch.__file__) + os.sep, os.path.dirname(os.path.abspath(__file__)) + os.sep)
    frames = [f for f in traceback.extract_stack() if not f.filename.startswith(skip + ("<",))]
    return f"{frames[-1].filename}:{frames[-1].lineno}" if frames else "?"


def _defaults_left_out(model: nn.Module, args: tuple, kwargs: dict) -> Dict[str, Any]:
    """The forward's parameters the example inputs leave at a plain default (None, a bool, a number, a string),
    to trace as those constants: fx would trace them as inputs, and ``if attn_mask is not None:`` on an input
    is always taken. fx asserts the value in the graph, and a call passing them has another input signature,
    so it is captured again."""
    try:
        parameters = list(inspect.signature(model.forward).parameters.values())
    except (TypeError, ValueError):  # a forward without a signature Python can read
        return {}
    positional = (inspect.Parameter.POSITIONAL_ONLY, inspect.Parameter.POSITIONAL_OR_KEYWORD)
    if len(args) > sum(p.kind in positional for p in parameters):
        return {}  # *args take the rest: the signature does not say which are left out
    left = {}
    for i, p in enumerate(parameters):
        given = (p.kind in positional and i < len(args)) or p.name in kwargs
        if (not given and p.kind in positional + (inspect.Parameter.KEYWORD_ONLY,) and p.default is not p.empty
                and (p.default is None or type(p.default) in (bool, int, float, str))):
            left[p.name] = p.default
    return left


def export_module(model: nn.Module, args: tuple, kwargs: dict, dynamic_shapes: Any = None) -> fx.GraphModule:
    """``torch.export`` (non-strict) of ``model``: its module, each custom autograd Function kept as one operator
    (``memopt.capture.autograd_functions``); raises what export raises, and ``TraceError`` for a Function export would inline (its
    own backward would not run). The model's attributes and mode are restored."""
    flags = module_flags(model)
    applied: Dict[type, str] = {}
    snapshot = _attribute_snapshot(model)  # export runs the forward's Python too
    try:
        with _quiet("torch.fx.experimental.symbolic_shapes"), _patched_apply(_as_operators(applied)):
            # (a failure is reported by us, with its construct)
            exported = torch.export.export(model, args, kwargs=kwargs, strict=False, dynamic_shapes=dynamic_shapes)
    finally:
        _restore_attributes(*snapshot)
        restore_flags(flags)
    if applied:
        names = ", ".join(f"{cls.__qualname__} ({where})" for cls, where in list(applied.items())[:3])
        raise TraceError(f"torch.export inlines the custom autograd Function {names}: its own backward would "
                         f"not run.", f"custom autograd Function {names}")
    return exported.module()


def on_model(model: nn.Module, ep_module: fx.GraphModule) -> fx.GraphModule:
    """The graph of an exported module on ``model``'s own objects, its Functions as ``FunctionCall``s."""
    graph = ep_module.graph
    _drop_export_guards(graph)
    functions = _function_calls(graph)
    graph.lint()
    return _rebuild_on_model(model, graph, ep_module, functions)


@counters.counted("traces")
def export_capture(model: nn.Module, args: tuple, kwargs: dict) -> Captured:
    """Capture ``model`` with ``torch.export`` (``export_module``), with what a trace builds that eager does not
    replaced by what eager runs."""
    return Captured(export_fixups(on_model(model, export_module(model, args, kwargs)), model), "export")


def export_fixups(gm: fx.GraphModule, model: nn.Module) -> fx.GraphModule:
    """``gm`` (an export graph of ``model``) with what a trace builds that eager does not replaced by what eager
    runs: attention masks that mask nothing, constants the trace builds again per call."""
    drop_constant_masks(gm)
    share_repeated_constants(gm, model)  # what eager caches, the trace built per call
    return gm


_OWN_MODULES = ("torch", "memopt", "_operator", "operator", "math", "builtins")


def opaque_functions(gm: fx.GraphModule) -> List[str]:
    """The model's own Python functions a symbolic trace kept whole as leaves (``torch.fx.wrap``: torchvision's
    Swin attention and patch merging): memopt sees neither the ops inside nor what they keep for backward."""
    return sorted({f"{node.target.__module__}.{node.target.__qualname__}" for node in gm.graph.nodes
                   if node.op == "call_function" and inspect.isfunction(node.target)
                   and node.target not in LEAF_FUNCTIONS
                   and not (node.target.__module__ or "").split(".")[0] in _OWN_MODULES})


@counters.counted("traces")
def capture(model: nn.Module, args: tuple, kwargs: dict,
            export: Callable[[nn.Module, tuple, dict], Captured] = None) -> Captured:
    """Capture ``model`` on the example inputs; raise ``TraceError`` when neither path works. ``export``: the
    torch.export path (``export_capture`` unless given: a family's first build exports with some dimensions
    dynamic, ``memopt.builder.dynamic_export.FirstCapture``)."""
    try:
        # symbolic tracing runs the forward's Python: what it does to real tensors (a buffer counter, an EMA
        # that no traced value flows into) happens for real, and is undone here
        tracer = _HookAwareTracer()
        with preserved_state(model):
            traced = tracer.trace(model, _defaults_left_out(model, args, kwargs) or None)
        gm = _rebuild_on_model(model, traced, None, tracer.functions)
        canonical_batch_norms(gm, model)
        drop_constant_masks(gm)  # what the eager model passes to attention where a trace builds a mask
        return Captured(gm, "symbolic_trace")
    except Exception as fx_error:  # noqa: BLE001 - any tracing failure sends us to the export path
        fx_msg = f"{type(fx_error).__name__}: {fx_error}"
        fx_where = user_frame(fx_error)
    log.info("memopt: symbolic_trace failed for %s (%s); trying torch.export", type(model).__name__, fx_msg)
    try:
        return (export or export_capture)(model, args, kwargs)
    except Exception as export_error:  # noqa: BLE001
        export_msg = f"{type(export_error).__name__}: {export_error}"
        export_where = user_frame(export_error)
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
