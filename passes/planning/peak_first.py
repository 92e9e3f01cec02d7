"""The default plan's peak-first step: recompute blocks from coded inputs where that lowers the step's peak.

Without a budget every technique runs at its defaults, which shrinks what autograd keeps; but what decides
whether a batch fits is the peak of the whole step, and on transformers the codes of every saved tensor keep
more than checkpointing, which keeps only each block's input. Recomputing a block from its input's codes
(``memopt.recompute``, ``RecomputeConfig.bits``) keeps less than both: a quarter of float32's bytes per
boundary element at 8 bits. It costs one more forward of the block, so blocks are taken by the bytes they keep
per FLOP until the cost model's FLOPs of a step reach ``RecomputeConfig.time_allowance`` stock steps, and the
result is kept only when the estimated peak, with the recomputed blocks' backward in batch chunks where they
lower it, falls by at least ``peak_first_gain``; otherwise the default plan stands. The blocks' own tensors are
kept as eager keeps them first: codes inside them (``RecomputeConfig.codes_inside``) lower only a peak that
falls inside a recomputed block's backward and cost an encode and a decode of each in every step, so that
variant is estimated only where the first one's peak still falls there, and kept only where it is lower. None
of it runs where what no rewrite removes (``Estimate.floor_bytes``: parameters, inputs, optimizer state, every
gradient) is already within ``peak_first_gain`` of the default plan's peak.
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any, Callable, Dict, List, Optional, Tuple

from torch import fx

from memopt.cost_model.analysis import Estimate
from memopt.passes.base import PassContext
from memopt.passes.planning.candidates import copy_graph_module
from memopt.passes.manager import PassRecord, passes_for, run_passes
from memopt.passes.recompute import find_blocks, why_not
from memopt.passes.stash.chunks import chunk_to_fit

STEP_FORWARDS = 3.0  # a training step's FLOPs in forwards: the forward and a backward of about twice its FLOPs


@dataclass
class PeakFirst:
    graph_module: fx.GraphModule
    records: List[PassRecord]
    estimate: Estimate
    blocks: Tuple[str, ...]
    time_ratio: float  # the step's FLOPs with the blocks recomputed, in stock steps
    inside: bool = False  # the blocks' own tensors coded too (RecomputeConfig.codes_inside)


def eligible_blocks(gm: fx.GraphModule, baseline: Estimate) -> Dict[str, Tuple[int, int]]:
    """{block: (bytes its nodes keep in the baseline, FLOPs of its forward)} of every block the recompute pass
    can take (annotated ``gm``: the baseline's node costs)."""
    out = {}
    for block in find_blocks(gm):
        if isinstance(why_not(block), str):
            continue
        costs = [baseline.nodes[n.name] for n in block.nodes if n.name in baseline.nodes]
        out[block.name] = (sum(c.saved_bytes for c in costs), sum(c.flops for c in costs))
    return out


def within_allowance(blocks: Dict[str, Tuple[int, int]], forward_flops: int, allowance: float
                     ) -> Tuple[Tuple[str, ...], float]:
    """The blocks taken by kept bytes per FLOP (most first) while the step's FLOPs stay within ``allowance`` stock
    steps, and the ratio they reach (a pure function on numbers)."""
    step = STEP_FORWARDS * max(forward_flops, 1)
    taken, extra = [], 0
    for name, (kept, flops) in sorted(blocks.items(), key=lambda kv: (-kv[1][0] / max(kv[1][1], 1), kv[0])):
        if kept <= 0 or (step + extra + flops) / step > allowance:
            continue
        taken.append(name)
        extra += flops
    return tuple(sorted(taken)), (step + extra) / step


def peak_first_trial(gm: fx.GraphModule, config: Any, ctx: PassContext, baseline: Estimate
                     ) -> Optional[Tuple[Any, Tuple[str, ...], float]]:
    """(the config that recomputes the blocks within the time allowance from codes, those blocks, the step's FLOPs
    in stock steps), or None when the config asks for no peak-first step (recomputation off, blocks named,
    ``peak_first_bits=None``, an exact config, a decision to apply) or no block can be taken. ``gm``: the captured
    graph, annotated (the baseline)."""
    if from_codes(config, ctx, ()) is None:
        return None
    forward = sum(c.flops for c in baseline.nodes.values())
    taken, ratio = within_allowance(eligible_blocks(gm, baseline), forward, config.recompute.time_allowance)
    return (from_codes(config, ctx, taken), taken, ratio) if taken else None


def from_codes(config: Any, ctx: PassContext, blocks: Tuple[str, ...]) -> Optional[Any]:
    """``config`` recomputing ``blocks`` from ``peak_first_bits``-bit codes, or None when it asks for no
    recomputation from codes unasked (recomputation off, blocks named, ``peak_first_bits=None``, an exact config)
    or there is a decision to apply: the one rule of the peak-first step and of a budget's fallback."""
    cfg = getattr(config, "recompute", None)
    if cfg is None or cfg.segments != () or cfg.peak_first_bits is None or ctx.decision is not None:
        return None
    return dataclasses.replace(config, recompute=dataclasses.replace(cfg, segments=blocks, bits=cfg.peak_first_bits))


def peak_first(pristine: fx.GraphModule, trial: Tuple[Any, Tuple[str, ...], float], ctx: PassContext,
               default: Estimate, annotate: Callable[[fx.GraphModule], Estimate]) -> Optional[PeakFirst]:
    """``peak_first_trial``'s config run on ``pristine`` (a copy of the captured graph: the last trial rewrites it
    in place) and estimated with chunks, without codes inside the blocks and then, where its peak still falls inside a
    recomputed block's backward and the config allows, with them; the lower kept (the first on a tie) when its
    peak is at least ``peak_first_gain`` below ``default``'s, else None."""
    config, taken, ratio = trial
    bar = (1 - config.recompute.peak_first_gain) * default.peak_bytes
    if default.floor_bytes() > bar:
        return None  # what no rewrite removes is already within the gain of the default's peak: no trial can pass
    found = _codes_inside_last(pristine, config, ctx, taken, ratio, None, annotate,
                               lambda estimate: not estimate.breakdown.get("peak_in_recompute"), in_place=True)
    return found if found.estimate.peak_bytes <= bar else None


def every_block_from_codes(pristine: fx.GraphModule, config: Any, ctx: PassContext, baseline: Estimate,
                           target: int, annotate: Callable[[fx.GraphModule], Estimate]) -> Optional[PeakFirst]:
    """Under a budget the planner could not meet: every eligible block recomputed from ``peak_first_bits``-bit
    codes on top of the other techniques' defaults, the blocks' backward and the weight gradients chunked where
    that lowers the peak toward ``target``: first with the blocks' own tensors kept as they are, then, where that
    misses ``target`` and ``RecomputeConfig.codes_inside`` allows, coded inside too; None when the config asks for
    no recomputation from codes (off, blocks named, ``peak_first_bits=None``) or no block is eligible. The caller
    keeps it only where it fits (the lower of the two where neither does).

    Why beside the planner: its last resort recomputes blocks exactly, so a recomputed block's backward holds the
    block's saved tensors as eager keeps them, and at large batches that transient, not what the step keeps, is
    the peak. Batch chunks of that backward lower it without coding anything; codes inside the second forward
    lower it where chunks cannot (a block whose samples mix), and cost an encode and a decode per coded tensor in
    every block's backward where the peak lies elsewhere, so they are tried second. Time is not weighed otherwise
    (every block costs one more forward, as checkpointing every block does): the budget asked for the memory.
    ``pristine`` is not changed."""
    asked = from_codes(config, ctx, ())
    eligible = eligible_blocks(pristine, baseline) if asked is not None else {}
    blocks = tuple(sorted(eligible))
    if not blocks:
        return None
    forward = sum(c.flops for c in baseline.nodes.values())
    ratio = (STEP_FORWARDS * forward + sum(flops for _, flops in eligible.values())) / (STEP_FORWARDS * max(forward, 1))
    return _codes_inside_last(pristine, from_codes(config, ctx, blocks), ctx, blocks, ratio, target, annotate,
                              lambda estimate: estimate.peak_bytes <= target, in_place=False)


def _codes_inside_last(pristine: fx.GraphModule, config: Any, ctx: PassContext, blocks: Tuple[str, ...],
                       ratio: float, target: Optional[int], annotate: Callable[[fx.GraphModule], Estimate],
                       done: Callable[[Estimate], bool], in_place: bool) -> PeakFirst:
    """``config``'s blocks recomputed from codes, estimated with chunks toward ``target`` (None: lower is better):
    first with the blocks' own tensors kept as eager keeps them, then, where ``done`` says that estimate is not
    enough and ``RecomputeConfig.codes_inside`` allows, coded inside too; the lower kept (the first on a tie).
    ``pristine`` is rewritten in place by the last trial where ``in_place``, else left as it is."""
    variants = (False, True) if config.recompute.codes_inside else (False,)
    found = None
    for inside in variants:
        cfg = dataclasses.replace(config, recompute=dataclasses.replace(config.recompute, codes_inside=inside))
        source = pristine if in_place and inside == variants[-1] else copy_graph_module(pristine)
        gm, records = run_passes(source, passes_for(cfg), ctx)
        estimate, _ = chunk_to_fit(gm, annotate(gm), target, annotate)
        if found is None or estimate.peak_bytes < found.estimate.peak_bytes:
            found = PeakFirst(gm, records, estimate, blocks, ratio, inside)
        if done(estimate):
            break
    return found
