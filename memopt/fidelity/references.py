"""Where the fidelity gate keeps the eager step's gradients it compares plans with, and whether it keeps them at all.

The gate measures every plan against the eager step's gradients under the same losses. Kept for every loss, those
references are up to ``max_projections`` copies of the parameters' gradients, independent of the batch, which put
optimize()'s own peak far above the training step it plans for (docs/results/peak/optimize_peak.md). So they live
in host memory (``on_host``), and where the copies for the confirmation losses would weigh more than the eager
forward's saved tensors on the gate's slice, the gate keeps only its first losses' and makes a later loss's beside
the plan's (``worth_pairing``; ``memopt.capture.soundness.paired_grads``).
"""
from __future__ import annotations

from typing import Dict, List, Optional

import torch
from torch import fx, nn

from memopt.core.meta import META_KEY, STATE_CATEGORIES


def worth_pairing(model: nn.Module, graph: fx.GraphModule, confirmations: int, fraction: float) -> bool:
    """Whether making the eager gradients of ``confirmations`` losses beside the plan's keeps less than keeping them:
    all but one copy of the gradients saved, against the eager forward alive beside the plan's (``graph``'s kept
    bytes, annotated at the whole batch, times the slice's ``fraction`` of it)."""
    return (confirmations - 1) * gradient_bytes(model) > fraction * kept_bytes(graph)


def gradient_bytes(model: nn.Module) -> int:
    """Bytes of one set of the parameters' gradients."""
    return sum(p.numel() * p.element_size() for p in model.parameters() if p.requires_grad)


def kept_bytes(graph: fx.GraphModule) -> int:
    """Bytes of the distinct storages the graph's annotated nodes keep for backward (the cost model's, for the
    shapes it was annotated at), parameters and buffers aside."""
    kept: Dict[int, int] = {}
    for node in graph.graph.nodes:
        cost = node.meta.get(META_KEY)
        for ref in getattr(cost, "saved", ()):
            if ref.category not in STATE_CATEGORIES:
                kept[ref.key] = ref.nbytes
    return sum(kept.values())


def on_host(grads: List[Optional[torch.Tensor]]) -> List[Optional[torch.Tensor]]:
    """``grads`` in host memory: the gate keeps the eager step's gradients under each of its losses (up to
    ``max_projections`` + 1 copies of the parameters' gradients) for every plan it measures, which on an accelerator
    would put optimize()'s own peak far above the training step's; ``parameter_fidelity`` brings one parameter's
    at a time to the device it compares on. On CPU: the tensors themselves."""
    return [g if g is None or g.device.type == "cpu" else g.to("cpu") for g in grads]
