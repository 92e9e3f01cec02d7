"""``python -m memopt demo``: optimize a built-in ResNet, print its report, measure before/after,
and draw saved bytes per block before/after (when matplotlib is installed)."""
from __future__ import annotations

import argparse
import re
import sys
from pathlib import Path
from typing import Dict, List, Tuple

import torch
import memopt
from memopt.core.units import fmt_bytes
from memopt.testing.zoo import TinyResNet

DEFAULT_PLOT = "memopt_demo.png"


def run_demo(args: argparse.Namespace) -> int:

    torch.manual_seed(0)
    model = TinyResNet(width=args.width).train()
    x = torch.randn(args.batch, 3, 32, 32)
    try:
        om = memopt.optimize(model, budget_mb=args.budget_mb, example_inputs=x, optimizer="sgd")
    except memopt.BudgetError as e:
        print(f"memopt: {e}", file=sys.stderr)
        return 1
    om.report(print=True, top=args.top)
    before = memopt.measure(model, x, optimizer="sgd")
    after = memopt.measure(om, x, optimizer="sgd")
    print()
    print(f"measured one training step of TinyResNet (batch {args.batch}, 32x32, SGD with momentum) on "
          f"{after.device} [{after.method}]:")
    print(f"  saved activations: stock {fmt_bytes(before.saved_bytes)} -> memopt {fmt_bytes(after.saved_bytes)}")
    print(f"  peak memory:       stock {fmt_bytes(before.peak_bytes)} -> memopt {fmt_bytes(after.peak_bytes)}")
    if not any(p["modified"] for p in om.plan.passes):
        print("  (no enabled technique rewrote this model, so stock and memopt are the same graph)")
    print(f"  estimated by the cost model: saved {fmt_bytes(om.plan.estimated_saved_bytes)}, "
          f"peak {fmt_bytes(om.plan.estimated_peak_bytes)}")
    plot = args.plot
    if plot != "":
        try:
            import matplotlib  # noqa: F401
        except ImportError:
            print("  (pip install matplotlib for a picture of saved bytes per block: --plot FILE)")
            return 0
        path = plot_saved_by_block(om.plan, Path(plot or DEFAULT_PLOT))
        print(f"  saved bytes per block, before and after: {path.resolve()}")
    return 0


def _block(name: str) -> str:
    """The block a node belongs to: its name up to the first index (layers_0_conv1 -> layers_0)."""
    match = re.match(r"^(.*?_\d+)(?:_|$)", name)
    return match.group(1) if match else name.rsplit("_", 1)[0] if "_" in name else name


def saved_by_block(plan) -> List[Tuple[str, int, int]]:
    """(block, saved bytes before, after) in graph order; a node's bytes go to its block."""
    blocks: Dict[str, List[int]] = {}
    for node in plan.nodes:
        if node.saved_bytes_before or node.saved_bytes_after:
            entry = blocks.setdefault(_block(node.name), [0, 0])
            entry[0] += node.saved_bytes_before
            entry[1] += node.saved_bytes_after
    return [(name, before, after) for name, (before, after) in blocks.items()]


def plot_saved_by_block(plan, path: Path) -> Path:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = saved_by_block(plan)
    fig, ax = plt.subplots(figsize=(max(6.0, 0.45 * len(rows)), 3.6))
    xs = range(len(rows))
    ax.bar([i - 0.2 for i in xs], [b / 2 ** 20 for _, b, _ in rows], 0.4, label="stock")
    ax.bar([i + 0.2 for i in xs], [a / 2 ** 20 for _, _, a in rows], 0.4, label="memopt")
    ax.set_xticks(list(xs), [name for name, _, _ in rows], rotation=60, ha="right", fontsize=7)
    ax.set_ylabel("saved for backward (MiB)")
    ax.set_title(f"{plan.model}: saved for backward, per block (sum over its nodes)", fontsize=9)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path
