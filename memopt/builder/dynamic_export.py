"""Captures whose torch.export graph leaves some sizes dynamic, so that one graph serves many input sizes.

A ``torch.export`` graph is specialised to the sizes it was exported at, unless the export is told which dimensions
may vary (``Dim.AUTO``: export specialises a dimension the model's code pins, and records shape guards for the rest).
``DynamicExport`` exports again, at the first new size, with the dimensions that changed dynamic (as
torch.compile's automatic dynamic shapes); ``FirstCapture`` exports dynamic from the first build
(``Config(dynamic=True)``). Both make the batch dimension dynamic too, so that the graph serves the soundness
check's and the fidelity gate's slice of the batch. Which sizes a graph serves is its guards' answer
(``memopt/builder/shape_reuse.py`` decides the rest of a reuse).
"""
from __future__ import annotations

import logging
from typing import FrozenSet, Optional, Tuple

import torch
from torch import fx, nn
from torch.export import Dim, ShapesCollection
from torch.utils._pytree import keystr, tree_flatten_with_path

from memopt.capture.soundness import SLICE
from memopt.capture.trace import Captured, capture, export_capture, export_fixups, export_module, flat_inputs, \
    on_model
from memopt.core.errors import TraceError
from memopt.passes.planning.candidates import copy_graph_module

log = logging.getLogger("memopt")

Dims = FrozenSet[Tuple[str, int]]  # (input path, dimension)


def describe(dims: Dims) -> str:
    return ", ".join(f"{path} dim {i}" for path, i in sorted(dims))


class DynamicExport:
    """A capture function for ``pipeline.build``: ``torch.export`` (non-strict, as ``capture``) with ``dims``
    dynamic. ``guards`` is the exported program's shape check of the first (full-size) capture: it raises
    ``AssertionError`` naming the guard that fails for inputs the graph does not serve. Should the dynamic
    export fail, the ordinary capture runs (whose graph serves its own sizes only: ``guards`` stays None).

    The first capture also makes the batch dimension dynamic (``batch_dims``; without it where that export
    fails), so that the graph serves the soundness check's slice of the batch: a later call whose inputs the
    first graph's guards accept gets a copy of that graph, not another export (an export costs more than the
    check's steps), and other batch sizes can reuse the plan."""

    def __init__(self, dims: Dims, batch: Dims = frozenset(), static: bool = False) -> None:
        self.dims = dims
        self.batch = batch
        self.guards = None
        self.calls = 0
        self._pristine: Optional[fx.GraphModule] = None
        self.speculate = not static  # False: every call exports its own sizes (``static``)

    def dynamic(self) -> bool:
        """Whether the graph it captured has some sizes dynamic."""
        return self.speculate and self.guards is not None and bool(self.dims)

    def static(self) -> None:
        """Capture again from the start, each call's own sizes (a build of the dynamic graph failed: a graph with
        sizes dynamic can keep what the sizes' own graph does not, as a causal mask built from the sequence
        length, which the static graph's fix-ups replace by ``is_causal=True``)."""
        self.speculate, self.calls, self.guards, self._pristine, self.dims, self.batch = \
            False, 0, None, None, frozenset(), frozenset()

    def __call__(self, model: nn.Module, args: tuple, kwargs: dict) -> Captured:
        first, self.calls = self.calls == 0, self.calls + 1
        if not self.speculate:
            return export_capture(model, args, kwargs)
        if not first and self._serves(args, kwargs):
            return Captured(copy_graph_module(self._pristine), "export")
        try:
            gm, guards = self._first_export(model, args, kwargs) if first else \
                self._export(model, args, kwargs, self.dims)
        except Exception as e:  # noqa: BLE001 - the ordinary capture reports its own failures
            log.info("memopt: torch.export of %s with %s dynamic failed (%s: %s); capturing these sizes only",
                     type(model).__name__, describe(self.dims), type(e).__name__, str(e)[:200])
            return capture(model, args, kwargs)
        if first:
            self.guards, self._pristine = guards, copy_graph_module(gm)  # kept before a build rewrites gm
        return Captured(gm, "export")

    def _first_export(self, model: nn.Module, args: tuple, kwargs: dict):
        """The export with the batch dynamic too, else with ``dims`` only; ``dims`` says which it was."""
        if self.batch - self.dims:
            try:
                exported = self._export(model, args, kwargs, self.dims | self.batch)
                self.dims = self.dims | self.batch
                return exported
            except Exception as e:  # noqa: BLE001 - tried again with the batch static
                log.info("memopt: torch.export of %s with the batch dimension dynamic too failed (%s: %s); exporting "
                         "with %s dynamic", type(model).__name__, type(e).__name__, str(e)[:160], describe(self.dims))
        return self._export(model, args, kwargs, self.dims)

    def _serves(self, args: tuple, kwargs: dict) -> bool:
        """Whether the first graph computes what eager does on these inputs (its shape guards pass)."""
        if self._pristine is None or self.guards is None:
            return False
        try:
            self.guards(*flat_inputs(self._pristine, args, kwargs))
        except Exception:  # noqa: BLE001 - AssertionError names the failing guard; any failure: not served
            return False
        return True

    def _export(self, model: nn.Module, args: tuple, kwargs: dict, dynamic: Dims):
        shapes = ShapesCollection()
        for path, leaf in tree_flatten_with_path((args, kwargs))[0]:
            dims = {i: Dim.AUTO for p, i in dynamic if p == keystr(path)}
            if isinstance(leaf, torch.Tensor) and dims:
                shapes[leaf] = dims
        ep_module = export_module(model, args, kwargs, shapes.dynamic_shapes(model, args, kwargs))
        guards = getattr(ep_module, "_guards_fn", None)
        if guards is None:
            raise TraceError("torch.export made no shape guards for its graph, so no other size can be checked",
                             "no shape guards")
        return on_model(model, ep_module), guards


def batch_dims(args: tuple, kwargs: dict) -> Dims:
    """The batch dimension of every tensor input (dimension 0 of those whose first size is the first tensor
    input's, as ``soundness.batch_slice`` cuts them), when the batch is larger than the soundness check's slice."""
    leaves = [(keystr(path), leaf) for path, leaf in tree_flatten_with_path((args, kwargs))[0]
              if isinstance(leaf, torch.Tensor) and leaf.dim() > 0]
    if not leaves or leaves[0][1].shape[0] <= SLICE:
        return frozenset()
    return frozenset((path, 0) for path, leaf in leaves if leaf.shape[0] == leaves[0][1].shape[0])


def token_dims(args: tuple, kwargs: dict) -> Dims:
    """The sequence dimension (1) of every rank-2 integer or boolean tensor input: token ids, attention masks,
    token type and position ids, which a collator pads per batch (Hugging Face's default does) to the batch's
    longest sequence."""
    return frozenset((keystr(path), 1) for path, leaf in tree_flatten_with_path((args, kwargs))[0]
                     if isinstance(leaf, torch.Tensor) and leaf.dim() == 2 and leaf.shape[1] > 1
                     and not leaf.is_floating_point() and not leaf.is_complex())


class FirstCapture(DynamicExport):
    """The capture of a family's first build under ``Config(dynamic=True)``: ``capture``'s symbolic trace first;
    where that fails, torch.export with the batch dimension (``batch_dims``) and the sequence dimension of token
    inputs (``token_dims``) dynamic, so that the one graph serves the soundness check's and the fidelity gate's
    slice of the batch, an epoch's smaller last batch and the next padded length, which a static export would
    each capture, check and apply the plan to again. Where that export fails, it is made with the token dimensions only, then static
    (``export_capture``: ``guards`` stays None). Later calls get a copy of the first graph where its shape guards
    accept their inputs, else a capture of their own sizes by the same path."""

    def __init__(self, args: tuple, kwargs: dict) -> None:
        super().__init__(token_dims(args, kwargs), batch_dims(args, kwargs))
        self.method: Optional[str] = None

    def __call__(self, model: nn.Module, args: tuple, kwargs: dict) -> Captured:
        first, self.calls = self.calls == 0, self.calls + 1
        if first:
            captured = capture(model, args, kwargs, export=self._speculative)
            self.method = captured.method
            return captured
        if self.method == "export" and self._serves(args, kwargs):
            return Captured(copy_graph_module(self._pristine), "export")
        return export_capture(model, args, kwargs) if self.method == "export" else capture(model, args, kwargs)

    def _speculative(self, model: nn.Module, args: tuple, kwargs: dict) -> Captured:
        if self.speculate and self.dims | self.batch:
            try:
                gm, guards = self._first_export(model, args, kwargs)
            except Exception as e:  # noqa: BLE001 - exported static, as before
                log.info("memopt: torch.export of %s with %s dynamic failed (%s: %s); exporting these sizes only",
                         type(model).__name__, describe(self.dims | self.batch), type(e).__name__, str(e)[:200])
            else:
                gm = export_fixups(gm, model)
                self.guards, self._pristine = guards, copy_graph_module(gm)
                return Captured(gm, "export")
        self.dims = frozenset()
        return export_capture(model, args, kwargs)
