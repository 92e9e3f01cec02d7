"""Weight gradients over batch chunks: the setting on a rewritten graph's consumers, and the choice of it.

A consumer (a conv / linear / matmul whose input the stash keeps as codes: ``conv_from_stash``,
``linear_from_stash``, ``conv_from_codes``, ``linear_from_codes``, ``matmul_from_codes``) rebuilds its input in
backward for its weight gradient. With ``chunks=k`` it rebuilds and reads it k ranges of the batch at a time
(``memopt.stash.grads``). The whole rebuilt input is as large as the input gradient allocated next, so chunks
lower a step's peak only where the rebuild needs more than its output (autocast's float32 rebuild of a bf16
input, the plain-PyTorch decode's unpacked codes and mask) and only when the peak falls there. The cost model
says when it does (``Estimate.breakdown["peak_in_weight_grad"]``, marked by ``memopt.core.phase``), so chunks
are chosen by estimating the step with them (``chunk_to_fit``), never by a rule of thumb: kept where the
estimated peak falls, the fewest that fit the target.

The setting lives on the graph (each consumer's ``chunks`` keyword), so a printed, exported or re-traced graph
keeps it; ``chunks_of`` reads it back for the plan (``Plan.weight_grad_chunks``).
"""
from __future__ import annotations

from typing import Callable, List, Optional, Tuple

from torch import fx

from memopt.core.meta import decided_nodes
from memopt.cost_model.analysis import Estimate
from memopt.passes.chunking import fit_levels
from memopt.passes.recompute_chunks import recompute_chunks_to_fit, set_recompute_chunks, unannotated
from memopt.stash.generic import conv_from_codes, linear_from_codes, matmul_from_codes
from memopt.stash.ops import conv_from_stash, linear_from_stash

CONSUMERS = (conv_from_stash, linear_from_stash, conv_from_codes, linear_from_codes, matmul_from_codes)
LEVELS = (2, 4, 8, 16)  # chunk counts tried, fewest first: each chunk is one more weight-gradient call


def consumers(gm: fx.GraphModule) -> List[fx.Node]:
    """The nodes whose weight gradient reads a rebuilt input, those inside blocks recomputed from codes included
    (``decided_nodes``: a recomputed block's backward is where a fully recomputed model's step peaks)."""
    return [n for n in decided_nodes(gm) if n.op == "call_function" and n.target in CONSUMERS]


def chunks_of(gm: fx.GraphModule) -> int:
    """The largest chunk count set on ``gm``'s consumers (1: none chunked)."""
    return max((int(n.kwargs.get("chunks", 1)) for n in consumers(gm)), default=1)


def set_chunks(gm: fx.GraphModule, chunks: int) -> int:
    """Set every consumer's ``chunks`` (1 removes the keyword); returns how many consumers there are."""
    if not isinstance(chunks, int) or isinstance(chunks, bool) or chunks < 1:
        raise ValueError(f"weight-gradient chunks must be an int >= 1, got {chunks!r}; 1 computes each weight "
                         f"gradient in one piece")
    found = consumers(gm)
    for n in found:
        kwargs = dict(n.kwargs)
        if chunks == 1:
            kwargs.pop("chunks", None)
        else:
            kwargs["chunks"] = chunks
        n.kwargs = kwargs
    for owner in {id(n.graph): n.graph.owning_module for n in found}.values():  # gm, and each block's own graph
        owner.recompile()
    return len(found)


def apply_chunks(gm: fx.GraphModule, weight_grad: int, recompute: int,
                 shapes: Callable[[fx.GraphModule], Estimate]) -> None:
    """Set a plan's chunk levels on ``gm`` (the plan applied again, or at other sizes): its weight gradients', and
    its recomputed blocks' where they take them. ``shapes(gm)`` annotates ``gm`` first where a block reads a node
    a pass made, which the cost model has not seen (measuring a block needs its inputs' shapes)."""
    set_chunks(gm, weight_grad)
    if recompute > 1 and unannotated(gm):
        shapes(gm)
    set_recompute_chunks(gm, recompute)


def chunk_to_fit(gm: fx.GraphModule, estimate: Estimate, target: Optional[int],
                 annotate: Callable[[fx.GraphModule], Estimate]) -> Tuple[Estimate, int]:
    """Chunk ``gm``'s weight gradients where the cost model says that lowers the peak; (the estimate kept, the
    chunk count set: 1 when none). Recomputed blocks' backward is chunked first where the peak falls there
    (``memopt.passes.recompute_chunks``).

    Tried only while the peak falls inside a weight gradient from a rebuilt input and is above ``target``
    (None: no budget, lower is better); each level is one full estimate. Stops at the fewest chunks that reach
    ``target``, or when more chunks no longer lower the peak; the graph keeps the best level found.
    """
    estimate, _ = recompute_chunks_to_fit(gm, estimate, target, annotate)  # the larger transient first
    if not consumers(gm):
        return estimate, chunks_of(gm)
    return fit_levels(gm, estimate, target, LEVELS, chunks_of(gm), "peak_in_weight_grad", set_chunks, annotate)
