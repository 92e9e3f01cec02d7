"""python -m tools.bench.planner.bench_planner --threads 1   (about 15 minutes on 2 CPU cores)

Benchmark: the budget planner swept from the baseline peak down to the least it can reach.

For each model, 10 budgets evenly spaced from the baseline's estimated peak down to the peak of the
maximum-saving plan. Per budget: the plan's estimated peak, the measured peak of a real SGD step
(``memopt.measure``), planning time, step time (forward + backward) relative to stock measured
interleaved in this process, and the gradient agreement with exact autograd (cosine of the whole
gradient and the worst per-parameter cosine). ``torch.utils.checkpoint`` on every block (the
model's own stages of blocks) is measured the same way as the reference point.

Writes docs/results/planner/planner_sweep.md and docs/results/planner/planner_sweep.png.
"""
from __future__ import annotations

import argparse
import time
from pathlib import Path
from typing import Callable, Dict, List, Tuple

import torch
from tabulate import tabulate
from torch import nn

import memopt
from memopt.core.units import fmt_bytes
from memopt.record.timing import step_time_ratio
from memopt.testing.zoo import PreActResNet
from tools.bench.common import CheckpointBlocks

MiB = 2 ** 20


def _models() -> Dict[str, Tuple[Callable[[], nn.Module], torch.Tensor, Callable[[nn.Module], List[nn.Module]]]]:
    import torchvision

    return {
        "torchvision ResNet-50, 128x128, batch 8": (
            lambda: torchvision.models.resnet50(), torch.randn(8, 3, 128, 128),
            lambda m: [b for layer in (m.layer1, m.layer2, m.layer3, m.layer4) for b in layer]),
        "PreAct ResNet-56, 32x32, batch 32": (
            lambda: PreActResNet(56), torch.randn(32, 3, 32, 32), lambda m: list(m.blocks)),
        "torchvision MobileNetV2, 96x96, batch 16": (
            lambda: torchvision.models.mobilenet_v2(), torch.randn(16, 3, 96, 96),
            lambda m: list(m.features)),
    }


def _loss(out: torch.Tensor) -> torch.Tensor:
    return out.logsumexp(1).mean()


def _grads(model: nn.Module, x: torch.Tensor, forward=None) -> List[torch.Tensor]:
    model.zero_grad(set_to_none=True)
    torch.manual_seed(0)
    _loss((forward or model)(x)).backward()
    return [p.grad.detach().clone() for p in model.parameters()]


def _cosines(ref: List[torch.Tensor], got: List[torch.Tensor]) -> Tuple[float, float]:
    """Cosine of the whole gradient and the worst per-parameter cosine, in float64. Parameters whose exact
    gradient is below ZERO_GRAD x the median parameter-gradient norm are left out of the worst: their true
    gradient is (numerically) zero, so their cosine compares rounding noise with rounding noise (MobileNetV2's
    projection-BN biases gave 0.0001 with nothing rewritten; docs/results/stash/stash_gradients_models.md lists them)."""
    cos = torch.nn.functional.cosine_similarity
    ref, got = [g.double().flatten() for g in ref], [g.double().flatten() for g in got]
    flat = cos(torch.cat(ref), torch.cat(got), dim=0)
    floor = ZERO_GRAD * torch.stack([a.norm() for a in ref]).median()
    per = [cos(a, b, dim=0).item() for a, b in zip(ref, got) if a.norm() > floor]
    return float(flat), min(per)


ZERO_GRAD = 1e-3  # the exclusion rule of tools/bench/stash/bench_stash_gradients.py


def _ratio(forward, model, x, repeats: int) -> float:
    """Median step time of ``forward`` over stock, the two interleaved step by step."""
    return step_time_ratio(forward, model, x, repeats=repeats, loss_fn=_loss)[0]


def sweep(name: str, make, x, blocks, points: int, repeats: int, budgets_mb=None):
    torch.manual_seed(0)
    model = make().train()
    baseline = memopt.estimate(model, x, optimizer="sgd")
    # the least peak: every unit at its maximum saving (a budget of 1 byte fails and tells us)
    try:
        memopt.optimize(model, 1e-6, example_inputs=x, optimizer="sgd")
        raise AssertionError("a 1-byte budget was met")
    except memopt.BudgetError as e:
        minimum = e.minimum_bytes
    reference = _grads(model, x)
    rows = []
    budgets = [baseline.peak_bytes - (baseline.peak_bytes - minimum) * i / (points - 1) for i in range(points)]
    if budgets_mb:
        budgets = [b * MiB for b in budgets_mb]
    for budget in budgets:
        budget = max(budget, minimum + 1024)  # validate_budget rounds MiB to whole bytes
        start = time.perf_counter()
        try:
            om = memopt.optimize(model, budget / MiB, example_inputs=x, optimizer="sgd")
        except memopt.BudgetError:
            print(f"  {name}: budget {budget / MiB:.1f} MiB not met", flush=True)
            continue
        seconds = time.perf_counter() - start
        measured = memopt.measure(om, x, optimizer="sgd")
        flat, worst = _cosines(reference, _grads(model, x, om))
        ratio = _ratio(om, model, x, repeats)
        rows.append({"model": name, "budget": budget, "estimated": om.plan.estimated_peak_bytes,
                     "measured": measured.peak_bytes, "plan_s": seconds, "ratio": ratio, "cos": flat,
                     "worst": worst, "rewritten": sum(u["chosen"]["technique"] != "exact" for u in om.plan.units),
                     "units": len(om.plan.units)})
        print(rows[-1], flush=True)
    wrapped = CheckpointBlocks(model, blocks(model))
    measured = memopt.measure(wrapped, x, optimizer="sgd")
    flat, worst = _cosines(reference, _grads(model, x, wrapped))
    ckpt = {"model": name, "measured": measured.peak_bytes, "ratio": _ratio(wrapped, model, x, repeats),
            "cos": flat, "worst": worst}
    wrapped.restore()
    print(ckpt, flush=True)
    return baseline.peak_bytes, minimum, rows, ckpt


def _plot(results, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2, figsize=(11, 4.2))
    for (name, (base, minimum, rows, ckpt)), color in zip(results.items(), ("C0", "C1", "C2")):
        budgets = [r["budget"] / MiB for r in rows]
        axes[0].plot(budgets, [r["measured"] / MiB for r in rows], "o-", color=color, label=f"{name}: measured")
        axes[0].plot(budgets, [r["estimated"] / MiB for r in rows], "x--", color=color, alpha=0.6)
        axes[0].axhline(ckpt["measured"] / MiB, color=color, ls=":", lw=1)
        axes[1].plot([r["measured"] / MiB for r in rows], [r["ratio"] for r in rows], "o-", color=color, label=name)
        axes[1].plot([ckpt["measured"] / MiB], [ckpt["ratio"]], "s", color=color, ms=9, mfc="none",
                     label=f"{name}: checkpoint every block")
    low = min(min(r["budget"] for r in rows) for _, _, rows, _ in results.values()) / MiB
    high = max(max(r["budget"] for r in rows) for _, _, rows, _ in results.values()) / MiB
    axes[0].plot([low, high], [low, high], color="grey", lw=0.8, label="peak = budget")
    axes[0].set(xlabel="budget (MiB)", ylabel="peak of one SGD step (MiB)",
                title="measured (o) and estimated (x) peak vs budget;\ndotted: checkpoint every block")
    axes[1].set(xlabel="measured peak (MiB)", ylabel="step time / stock (CPU)", title="time vs memory")
    axes[0].legend(fontsize=7)
    axes[1].legend(fontsize=6)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--points", type=int, default=10)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--out", default="docs/results/planner/planner_sweep.md")
    parser.add_argument("--only", default="", help="run only the models whose name contains this")
    parser.add_argument("--budgets", default="", help="comma-separated budgets in MiB instead of --points")
    parser.add_argument("--threads", type=int, default=0, help="torch intra-op threads (default: torch's)")
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    results = {}
    for name, (make, x, blocks) in _models().items():
        if args.only not in name:
            continue
        budgets_mb = [float(b) for b in args.budgets.split(",")] if args.budgets else None
        results[name] = sweep(name, make, x, blocks, args.points, args.repeats, budgets_mb)
    lines = ["# Budget planner sweep", "",
             f"Command: `python -m tools.bench.planner.bench_planner --points {args.points} --repeats {args.repeats}"
             f"{' --only ' + repr(args.only) if args.only else ''}{' --budgets ' + args.budgets if args.budgets else ''}"
             f"{' --threads ' + str(args.threads) if args.threads else ''}"
             f"{' --out ' + args.out if args.out != 'docs/results/planner/planner_sweep.md' else ''}` "
             f"(torch {torch.__version__}, CPU, {torch.get_num_threads()} threads). Peaks are of one SGD "
             f"(momentum) step: parameters, gradients, momentum, activations; measured with memopt.measure. "
             f"Step time is forward + backward, median of {args.repeats} interleaved with stock.", ""]
    for name, (base, minimum, rows, ckpt) in results.items():
        table = [[f"{r['budget'] / MiB:.1f}", f"{r['estimated'] / MiB:.1f}", f"{r['measured'] / MiB:.1f}",
                  f"{(r['measured'] - r['estimated']) / r['estimated']:+.1%}",
                  "yes" if r["measured"] <= 1.1 * r["budget"] else "NO",
                  f"{r['rewritten']}/{r['units']}", f"{r['ratio']:.2f}", f"{r['cos']:.4f}", f"{r['worst']:.4f}",
                  f"{r['plan_s']:.1f}"] for r in rows]
        table.append(["checkpoint every block", "", f"{ckpt['measured'] / MiB:.1f}", "", "", "",
                      f"{ckpt['ratio']:.2f}", f"{ckpt['cos']:.4f}", f"{ckpt['worst']:.4f}", ""])
        lines += [f"## {name}", "",
                  f"Baseline estimated peak {fmt_bytes(base)}; least reachable with the default config "
                  f"{fmt_bytes(int(minimum))}.", "",
                  tabulate(table, headers=["budget MiB", "estimated MiB", "measured MiB", "measured vs est.",
                                           "within 10% of budget", "units rewritten", "step time / stock",
                                           "grad cosine", "worst param cosine", "planning s"], tablefmt="github"),
                  "",
                  f"Worst param cosine: over parameters whose exact gradient is at least {ZERO_GRAD:g} x the median "
                  f"parameter-gradient norm (the others' true gradient is ~0).",
                  ""]
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text("\n".join(lines))
    _plot(results, out.with_suffix(".png"))
    print("\n".join(lines))
    print(f"wrote {out} and {out.with_suffix('.png')}")


if __name__ == "__main__":
    main()
