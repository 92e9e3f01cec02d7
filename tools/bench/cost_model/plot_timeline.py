"""python -m tools.bench.cost_model.plot_timeline   (seconds)

The memory timeline of one training step (forward + backward), stock vs memopt, as a picture.

Live bytes of the storages a real CPU step creates (the rule of ``memopt.measure``: parameters and
inputs excluded), recorded after every ATen op, for the built-in TinyResNet at batch 32, stock vs
memopt at its defaults vs memopt at a budget. Writes docs/results/cost_model/memory_timeline.png.
"""
from __future__ import annotations

import argparse
from pathlib import Path
from typing import List, Tuple

import torch

import memopt
from memopt.cost_model.storage import LiveStorageTracker
from memopt.testing.zoo import TinyResNet
from tools.bench.common import RESULTS


class RecordingTracker(LiveStorageTracker):
    """``LiveStorageTracker`` that also records (phase, live bytes) after every op."""

    def __init__(self, preexisting) -> None:
        super().__init__(preexisting)
        self.timeline: List[Tuple[str, int]] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = super().__torch_dispatch__(func, types, args, kwargs)
        self.timeline.append((self.phase, self.current))
        return out


def timeline(module: torch.nn.Module, params, x: torch.Tensor) -> List[Tuple[str, int]]:
    for p in params:
        p.grad = None
    tracker = RecordingTracker(list(params) + [x])
    with tracker:
        tracker.phase = "forward"
        loss = module(x).logsumexp(1).mean()
        tracker.phase = "backward"
        loss.backward()
        del loss
    return tracker.timeline


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--batch", type=int, default=32)
    parser.add_argument("--out", default=str(RESULTS / "cost_model" / "memory_timeline.png"))
    args = parser.parse_args()
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    torch.manual_seed(0)
    model = TinyResNet().train()
    x = torch.randn(args.batch, 3, 32, 32)
    params = list(model.parameters()) + list(model.buffers())
    stock = timeline(model, params, x)
    default = memopt.optimize(model, example_inputs=x, optimizer="sgd")
    budget_mb = (default.plan.estimated_peak_bytes + default.plan.baseline_peak_bytes) / 2 / 2 ** 20
    planned = memopt.optimize(model, budget_mb, example_inputs=x, optimizer="sgd")
    runs = [("stock", stock), ("memopt, defaults", timeline(default, params, x)),
            (f"memopt, budget {budget_mb:.0f} MiB", timeline(planned, params, x))]
    fig, ax = plt.subplots(figsize=(8, 3.8))
    for label, points in runs:
        xs = [i / (len(points) - 1) for i in range(len(points))]
        ax.plot(xs, [b / 2 ** 20 for _, b in points],
                label=f"{label} (peak {max(b for _, b in points) / 2 ** 20:.1f} MiB, {len(points)} ops)")
        boundary = next(i for i, (phase, _) in enumerate(points) if phase == "backward")
        ax.axvline(xs[boundary], color=ax.lines[-1].get_color(), ls=":", lw=0.8)
    ax.set(xlabel="progress through the step's ATen ops (dotted: backward starts)",
           ylabel="live activation memory (MiB)",
           title=f"TinyResNet, batch {args.batch}, CPU: memory over one forward + backward")
    ax.legend(fontsize=8)
    fig.tight_layout()
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(args.out, dpi=110)
    for label, points in runs:
        print(f"{label}: peak {max(b for _, b in points) / 2 ** 20:.2f} MiB over {len(points)} ops")
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
