"""Pieces of tools/bench/reversible/bench_reversible.py no other benchmark uses: model builders, plan inspection,
the results header and the depth plot (kept apart so the benchmark stays one screenful per section)."""
from __future__ import annotations

import subprocess
import sys
from pathlib import Path
from typing import Iterator, Sequence, Tuple

import torch
from torch import nn

import memopt
from memopt import Config, ReversibleConfig
from memopt.reversible.ops import reversible_segment
from memopt.testing.reversible_zoo import RevNetCNN, RevTransformer
from tools.bench.common import ROOT

MiB = 2 ** 20
ONLY_REVERSIBLE = dict(stash=None, fewbit=None)


def command() -> str:
    return " ".join(["python", "-m", "tools.bench.reversible.bench_reversible", *sys.argv[1:]])


def library_state() -> str:
    head = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True, text=True).stdout.strip()
    dirty = subprocess.run(["git", "status", "--porcelain", "--", "memopt", "passes", "cost_model"], cwd=ROOT,
                           capture_output=True, text=True).stdout.strip()
    return f"memopt at {head}" + (" with uncommitted library changes" if dirty else "")


def header(title: str, extra: str = "") -> str:
    return (f"# {title}\n\nCommand: `{command()}` (torch {torch.__version__}, CPU, "
            f"{torch.get_num_threads()} threads, {library_state()}). {extra}\n\n")


def build(kind: str, blocks: int, seed: int = 0) -> nn.Module:
    torch.manual_seed(seed)
    if kind == "cnn":
        return RevNetCNN((blocks // 2, blocks - blocks // 2), width=16).train()
    return RevTransformer(blocks, dim=32).train()


def image(kind: str) -> int:
    return 32 if kind == "cnn" else 16


def calls_of(om) -> list:
    return [n for n in om._memopt_last.graph_module.graph.nodes if n.target is reversible_segment]


def couplings_rewritten(om) -> int:
    gm = om._memopt_last.graph_module
    return sum(sum(s.kind == "coupling" for s in getattr(gm, f"memopt_{n.name}").steps) for n in calls_of(om))


def random_steps(om) -> int:
    """Coupling steps flagged random (dropout in H, even p=0): each keeps a CPU RNG state (5056 bytes)."""
    gm = om._memopt_last.graph_module
    return sum(sum(s.random for s in getattr(gm, f"memopt_{n.name}").steps) for n in calls_of(om))


def not_rewritten_reasons(om) -> list:
    return sorted({n.reason for n in om.plan.nodes if n.reason.startswith("reversible") and n.technique != "reversible"})


def depth_sweep(depths: Sequence[int]) -> Iterator[Tuple[str, str, int, nn.Module, int]]:
    """(kind, label, blocks, fresh model, image size) for both models at every depth."""
    for kind, label in (("cnn", "RevNet CNN"), ("transformer", "reversible transformer")):
        for blocks in depths:
            yield kind, label, blocks, build(kind, blocks), image(kind)


def installed_segment(model: nn.Module, x_meta: torch.Tensor):
    om = memopt.optimize(model, config=Config(reversible=ReversibleConfig(tolerance=1.0, margin=1.0),
                                              **ONLY_REVERSIBLE), example_inputs=x_meta)
    calls = calls_of(om)
    assert len(calls) == 1, [n.name for n in calls]
    gm = om._memopt_last.graph_module
    return gm, calls[0], getattr(gm, f"memopt_{calls[0].name}")


# ---------------------------------------------------------------- plot
def plot(mem: dict, err: dict, path: Path, real_batch: int) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import matplotlib.ticker  # noqa: F401

    fig, axes = plt.subplots(1, 3, figsize=(18, 4.4))
    for ax, (kind, label) in zip(axes[:2], (("cnn", "RevNet CNN"), ("transformer", "reversible transformer"))):
        entries = mem.get(kind, [])
        if not entries:
            continue
        blocks = [e["blocks"] for e in entries]
        ax.plot(blocks, [e["stock_est"] / MiB for e in entries], "o-", color="C3", label="stock (estimated, meta batch)")
        ax.plot(blocks, [e["ours_est"] / MiB for e in entries], "o-", color="C0", label="memopt (estimated, meta batch: not checked)")
        measured = [e for e in entries if "ours_meas" in e]
        if measured:
            mb = [e["blocks"] for e in measured]
            ax.plot(mb, [e["stock_meas"] / MiB for e in measured], "x--", color="C3", ms=8,
                    label=f"stock measured (real batch {measured[0].get('real_batch', real_batch)})")
            ax.plot(mb, [e["ours_meas"] / MiB for e in measured], "x--", color="C0", ms=8, label="memopt measured (checked; exact where the check rejects)")
        ax.set(xscale="log", yscale="log", xlabel="RevBlocks (2 couplings each)", ylabel="saved activations (MiB)",
               title=f"{label}: activation memory of one step")
        ax.xaxis.set_minor_locator(matplotlib.ticker.NullLocator())
        ax.set_xticks(blocks, [str(b) for b in blocks])
        ax.legend(fontsize=6.5, loc="lower right" if kind == "cnn" else "upper left", framealpha=0.6)
    ax = axes[2]
    for kind, color in (("cnn", "C0"), ("transformer", "C1")):
        for mode, style in (("fp32", "-"), ("bf16", "--")):
            entries = err.get((kind, mode), [])
            if entries:
                ax.plot([b for b, _ in entries], [r["rebuild_worst"] for _, r in entries], "o" + style, color=color,
                        label=f"{kind} {mode}: worst rebuilt stream state")
        entries = err.get((kind, "fp32"), [])
        if entries:
            ax.plot([b for b, _ in entries], [r["ours_vs_f64_worst"] for _, r in entries], "x-", color=color, alpha=0.5,
                    ms=8, label=f"{kind} fp32: memopt worst gradient vs float64")
            ax.plot([b for b, _ in entries], [r["stock_vs_f64_worst"] for _, r in entries], "s:", color=color,
                    mfc="none", label=f"{kind} fp32: stock worst gradient vs float64")
    ax.axhline(1e-5, color="grey", lw=0.8, ls="-.", label="check threshold on rebuilt states (1e-5)")
    ax.set(xscale="log", yscale="log", xlabel="RevBlocks", ylabel="relative L2 error",
           title="reconstruction and gradient error vs depth")
    ax.xaxis.set_minor_locator(matplotlib.ticker.NullLocator())
    if err:
        ticks = sorted({b for entries in err.values() for b, _ in entries})
        ax.set_xticks(ticks, [str(b) for b in ticks])
    ax.legend(fontsize=6, loc="upper left", bbox_to_anchor=(1.01, 1.0))
    fig.tight_layout()
    fig.savefig(path, dpi=110)


