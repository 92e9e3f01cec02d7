"""Recomputed blocks' backward over batch chunks: the setting on a rewritten graph, and the choice of it.

A block recomputed from codes runs again in backward, and what it keeps for its own backward then, with that
backward's gradients, is alive at once: in a model whose blocks are recomputed that is the step's peak (an MLP's
hidden activations and their gradients, an attention's scores). Run over k ranges of the batch
(``RecomputeSpec.chunks``, ``memopt.recompute.ops``) it is one range's. The cost model marks a peak that falls
inside a recomputed block's backward (``Estimate.breakdown["peak_in_recompute"]``), so chunks are chosen as the
weight gradients' are (``memopt.passes.stash.chunks``): by estimating the step with them, the fewest that reach
the target, kept only while they lower the estimated peak. Only blocks whose samples do not mix are chunked
(``memopt.recompute.chunks.separable``, measured once per block and kept in ``node.meta``; a block whose
exported graph writes the example's batch into its views reads it from its input first, ``rebatch``), and only blocks
recomputed from codes, whose gradients the fidelity gate checks anyway: an exact recomputation stays one piece,
so ``Config.exact()`` keeps eager's bits. The forward is untouched. The fidelity gate measures the plan's
decision on its slice without chunks: chunks change the order a parameter's gradient is summed over the samples
in, not any sample's gradient, as the weight gradients' chunks do. The setting lives in each node's spec, so a
printed, exported or re-traced graph keeps it; ``recompute_chunks_of`` reads it back for the plan.
"""
from __future__ import annotations

from typing import Callable, List, Optional, Tuple

import torch
from torch import fx

from memopt.core.leaf import argument, set_argument
from memopt.core.meta import META_KEY
from memopt.passes.chunking import fit_levels
from memopt.cost_model.analysis import Estimate
from memopt.recompute.chunks import Like, separable
from memopt.recompute.ops import RecomputeSpec, recompute_from_codes

LEVELS = (2, 4, 8, 16)  # chunk counts tried, fewest first: each is one more run of the block's ops per backward
SEPARABLE_KEY = "memopt_separable"  # node.meta: None where the block's samples do not mix, else why they do


def recomputed(gm: fx.GraphModule) -> List[fx.Node]:
    """The nodes of ``gm`` that recompute a block from codes."""
    return [n for n in gm.graph.nodes if n.op == "call_function" and n.target is recompute_from_codes]


def why_not_chunked(gm: fx.GraphModule, node: fx.Node) -> Optional[str]:
    """None where ``node``'s block may run its backward over batch chunks, else why not (measured once:
    ``separable`` on its inputs' shapes, from the cost model's annotation)."""
    if SEPARABLE_KEY in node.meta:
        return node.meta[SEPARABLE_KEY]
    missing = _unannotated_input(node)
    if missing is not None:  # not kept: once the graph is annotated the block can be measured
        return f"input {missing.name} has no single tensor shape from the cost model"
    node.meta[SEPARABLE_KEY] = _measure(gm, node)
    return node.meta[SEPARABLE_KEY]


def _unannotated_input(node: fx.Node) -> Optional[fx.Node]:
    return next((v for v in argument(node, "inputs") if isinstance(v, fx.Node) and META_KEY not in v.meta), None)


def unannotated(gm: fx.GraphModule) -> bool:
    """Whether a recomputed block of ``gm`` reads a node the cost model has not annotated (a node a pass made):
    annotate ``gm`` before setting chunks, or those blocks are not measured."""
    return any(_unannotated_input(n) is not None for n in recomputed(gm))


def _measure(gm: fx.GraphModule, node: fx.Node) -> Optional[str]:
    block = argument(node, "block")
    module = gm.get_submodule(block.target) if isinstance(block, fx.Node) and block.op == "get_attr" else None
    if module is None:
        return "its block is not a submodule of the graph"
    inputs, batch, stream = [], None, None
    for value in argument(node, "inputs"):
        if not isinstance(value, fx.Node):
            inputs.append(value)
            continue
        cost = value.meta[META_KEY]
        if len(cost.shapes) != 1:
            return f"input {value.name} has no single tensor shape from the cost model"
        like = Like(cost.shapes[0], getattr(torch, cost.dtypes[0]))
        if batch is None and like.dtype.is_floating_point and like.shape:
            batch, stream = like.shape[0], len(inputs)  # the block's stream: its first floating input
        inputs.append(like)
    if batch is None:
        return "it has no floating input to take the batch from"
    why = separable(module, inputs, batch)
    if why is None or not why.startswith(BAKED) or not isinstance(module, fx.GraphModule):
        return why
    undo = rebatch(module, batch, stream)  # sizes written into the graph (a torch.export capture's): read them instead
    if undo is None:
        return why
    again = separable(module, inputs, batch)
    if again is not None:
        undo()
    return again


BAKED = "it does not run on part of the batch"
# ops whose size-list argument a torch.export graph writes the example's batch into
_SIZED = {"view", "reshape", "_unsafe_view", "expand"}


def rebatch(module: fx.GraphModule, batch: int, stream_at: Optional[int] = None):
    """Make ``module``'s graph read its batch size from its first floating input (``aten.sym_size``) wherever a
    view, reshape or expand writes ``batch`` first in its sizes, as a graph exported at the example's sizes does;
    returns a function that undoes it, or None where there is nothing to change. At the example's batch every op
    gets the sizes it got before, so the forward is the same computation; ``separable`` then says whether the
    block runs on part of the batch. ``stream_at``: that input's position, where the caller knows it (a block's
    placeholders carry no shapes when the recompute pass made its graph from nodes without them); else the first
    placeholder whose recorded shape starts with ``batch``."""
    placeholders = [n for n in module.graph.nodes if n.op == "placeholder"]
    stream = placeholders[stream_at] if stream_at is not None and stream_at < len(placeholders) else \
        next((n for n in placeholders if _floating(n, batch)), None)
    sized = {n: _size_list(n) for n in module.graph.nodes if n.op == "call_function"}
    changed = [n for n, sizes in sized.items() if sizes is not None and sizes[0] == batch]
    if stream is None or not changed:
        return None
    with module.graph.inserting_after(stream):
        size = module.graph.call_function(torch.ops.aten.sym_size.int, (stream, 0))
    before = {n: n.args for n in changed}
    for n in changed:
        n.args = (n.args[0], [size, *sized[n][1:]], *n.args[2:])
    module.recompile()

    def undo() -> None:
        for n, args in before.items():
            n.args = args
        module.graph.erase_node(size)
        module.recompile()

    return undo


def _floating(node: fx.Node, batch: int) -> bool:
    value = node.meta.get("val")
    cost = node.meta.get(META_KEY)
    shape = tuple(value.shape) if hasattr(value, "shape") else (cost.shapes[0] if cost is not None and cost.shapes
                                                                   else ())
    dtype = str(getattr(value, "dtype", "")) if value is not None else (cost.dtypes[0] if cost is not None and
                                                                        cost.dtypes else "")
    return bool(shape) and shape[0] == batch and "float" in dtype


def _size_list(node: fx.Node):
    """The sizes a view / reshape / expand call passes (a list of ints, its second argument), else None."""
    name = getattr(getattr(node.target, "overloadpacket", None), "__name__", getattr(node.target, "__name__", ""))
    if name not in _SIZED or len(node.args) < 2 or not isinstance(node.args[1], (list, tuple)) or not node.args[1]:
        return None
    return node.args[1] if all(isinstance(v, int) for v in node.args[1]) else None


def recompute_chunks_of(gm: fx.GraphModule) -> int:
    """The largest chunk count set on ``gm``'s recomputed blocks (1: none chunked)."""
    return max((RecomputeSpec.of(n).chunks for n in recomputed(gm)), default=1)


def set_recompute_chunks(gm: fx.GraphModule, chunks: int) -> int:
    """Set ``chunks`` on every recomputed block of ``gm`` that may take it (1 on the others); returns how many
    take it."""
    if not isinstance(chunks, int) or isinstance(chunks, bool) or chunks < 1:
        raise ValueError(f"recompute chunks must be an int >= 1, got {chunks!r}; 1 runs each recomputed block's "
                         f"backward on the whole batch at once")
    taken = 0
    for node in recomputed(gm):
        level = chunks if chunks == 1 or why_not_chunked(gm, node) is None else 1
        taken += level > 1
        spec = RecomputeSpec.of(node)
        if spec.chunks != level:
            set_argument(node, "spec", spec._replace(chunks=level))
    gm.recompile()
    return taken


def recompute_chunks_to_fit(gm: fx.GraphModule, estimate: Estimate, target: Optional[int],
                            annotate: Callable[[fx.GraphModule], Estimate]) -> Tuple[Estimate, int]:
    """Chunk the backward of ``gm``'s separable recomputed blocks where the cost model says that lowers the peak;
    (the estimate kept, the chunk count set: 1 when none). Tried only while the peak falls inside a recomputed
    block's backward and is above ``target`` (None: lower is better); each level is one full estimate; the graph
    keeps the best level found."""
    if not recomputed(gm):
        return estimate, 1
    return fit_levels(gm, estimate, target, LEVELS, recompute_chunks_of(gm), "peak_in_recompute",
                      set_recompute_chunks, annotate)
