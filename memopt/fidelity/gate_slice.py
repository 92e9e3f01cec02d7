"""The graph and inputs the fidelity gate runs: the model captured again on the first samples of the example batch
the way the plan's graph was, with the plan's analysis carried over, or the planned graph on the whole batch."""
from __future__ import annotations

import logging
from typing import Callable, Optional, Tuple

import torch
from torch import fx, nn
from torch.utils._pytree import tree_flatten

from memopt.capture.soundness import batch_slice
from memopt.capture.trace import capture
from memopt.core.meta import HISTOGRAM_KEY, META_KEY
from memopt.passes.planning.candidates import copy_graph_module

log = logging.getLogger("memopt")


def gate_graph(model: nn.Module, planned: fx.GraphModule, args: tuple, kwargs: dict,
               recapture: Optional[Callable[[tuple, dict], fx.GraphModule]]) -> Tuple[fx.GraphModule, tuple, dict, str]:
    """(the graph the gate rewrites and runs, its inputs, which inputs): the planned graph itself on the whole batch
    when the slice is the whole batch; else the model captured again on the slice *the way the plan's graph was*
    (``recapture``: torch.export again for an export graph, which is specialised to the batch size), with the
    planned graph's analysis carried over by node name, so the slice's graph is rewritten exactly as the plan says
    and only runs on fewer samples. A recapture whose nodes are not the planned graph's would make the decision
    name nodes it lacks, rewrite nothing and pass unchecked (an export-planned EfficientNet gated on a symbolic
    trace did): then the gate runs the planned graph on the whole batch, and says so in the log."""
    sliced_args, sliced_kwargs, which = batch_slice(args, kwargs)
    if which != "the whole example batch":
        recapture = recapture or (lambda a, k: capture(model, a, k).graph_module)
        base = recapture(sliced_args, sliced_kwargs)
        if [n.name for n in base.graph.nodes] == [n.name for n in planned.graph.nodes]:
            analysis = {n.name: {k: n.meta[k] for k in (META_KEY, HISTOGRAM_KEY) if k in n.meta}
                        for n in planned.graph.nodes}
            for node in base.graph.nodes:
                node.meta.update(analysis.get(node.name, {}))
            return base, sliced_args, sliced_kwargs, which
        log.info("memopt: %s captured on the first samples is not the planned graph; the fidelity gate runs on the "
                 "whole example batch", type(model).__name__)
    return copy_graph_module(planned), args, kwargs, "the whole example batch"


def batch_size(args: tuple, kwargs: dict) -> int:
    """The first tensor input's leading dimension (``batch_slice``'s batch), 0 without one."""
    return next((t.shape[0] for t in tree_flatten((args, kwargs))[0] if isinstance(t, torch.Tensor) and t.dim() > 0),
                0)
