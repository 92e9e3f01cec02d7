"""Pre-activation histograms on the example inputs, for data-aware few-bit tables.

This is the one analysis that needs real values, so it runs the captured graph for real, once,
without grad, in train mode (as training will), and restores every parameter, buffer and the
RNG afterwards. Results go to ``node.meta[HISTOGRAM_KEY]`` as ``(counts, bin_edges)``.
"""
from __future__ import annotations

from typing import Any, Collection, Tuple

import torch
from torch import fx

from memopt.core.meta import HISTOGRAM_KEY
from memopt.cost_model.op_registry import op_kind
from memopt.core.state import preserved_state, train_as_user



def record_input_histograms(gm: fx.GraphModule, flat_inputs: list, kinds: Collection[str],
                            domain: Tuple[float, float], bins: int = 512) -> int:
    """Histogram the first input of every node whose op kind is in ``kinds``; returns how many."""

    modules = dict(gm.named_modules())
    targets = {n for n in gm.graph.nodes if op_kind(n, modules) in kinds}
    recorded = 0

    class _Recorder(fx.Interpreter):
        def run_node(self, n: fx.Node) -> Any:
            nonlocal recorded
            if n in targets and n.args and isinstance(n.args[0], fx.Node):
                x = self.env[n.args[0]]
                if isinstance(x, torch.Tensor) and x.is_floating_point() and x.numel():
                    values = x.detach().reshape(-1).to(torch.float32).clamp(domain[0], domain[1]).cpu()
                    lo, hi = float(values.min()), float(values.max())
                    if hi <= lo:
                        lo, hi = lo - 1e-3, hi + 1e-3
                    counts, edges = torch.histogram(values, bins=bins, range=(lo, hi))
                    n.meta[HISTOGRAM_KEY] = (counts.to(torch.float64), edges.to(torch.float64))
                    recorded += 1
            return super().run_node(n)

    with preserved_state(gm), torch.no_grad():
        train_as_user(gm)
        _Recorder(gm).run(*flat_inputs, enable_io_processing=False)
    return recorded
