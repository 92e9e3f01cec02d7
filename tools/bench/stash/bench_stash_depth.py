"""python -m tools.bench.stash.bench_stash_depth   (about 5 minutes on 2 CPU cores)

The exact-forward stash's central claim: gradient error does not grow with depth.

CIFAR-size pre-activation ResNets of depth 20, 56 and 164 (batch 32, random init, one batch of
random 32x32 images, a fixed random linear loss). For each depth and K in {2, 4, 8}: per conv layer,
the relative L2 error and cosine of the weight gradient against exact autograd, for
(a) memopt's stash: exact forward, K-bit codes used only by backward;
(b) naive approximate activations: the K-bit quantized activation (same per-channel ±3σ grid)
    is what the forward consumes (and what backward sees), so errors compound through the layers.
Writes docs/results/stash/stash_depth.md and docs/results/stash/stash_depth.png.
"""
from __future__ import annotations

import argparse
import copy
import statistics
from pathlib import Path

import torch
import torch.nn.functional as F
from tabulate import tabulate
from torch import nn

import memopt
from memopt.testing.zoo import PreActResNet
from tools.bench.common import RESULTS
from tools.bench.stash.common import naive_copy


def conv_grads(model, x, probe):
    model.zero_grad(set_to_none=True)
    (model(x) * probe).sum().backward()
    return [m.weight.grad.clone() for m in model.modules() if isinstance(m, nn.Conv2d)]


def errors(grads, exact):
    rel = [((g - e).norm() / e.norm()).item() for g, e in zip(grads, exact)]
    cos = [F.cosine_similarity(g.flatten(), e.flatten(), 0).item() for g, e in zip(grads, exact)]
    return rel, cos


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--depths", default="20,56,164")
    parser.add_argument("--batch", type=int, default=32)
    parser.add_argument("--out", default=str(RESULTS / "stash" / "stash_depth.md"))
    args = parser.parse_args()
    rows, curves = [], {}
    for depth in map(int, args.depths.split(",")):
        torch.manual_seed(depth)
        model = PreActResNet(depth).train()
        x = torch.randn(args.batch, 3, 32, 32)
        probe = torch.randn(args.batch, 10)
        state = copy.deepcopy(model.state_dict())
        exact = conv_grads(model, x, probe)
        for bits in (2, 4, 8):
            model.load_state_dict(state)  # BN running stats back to where they were
            om = memopt.optimize(model, example_inputs=x, config=memopt.Config(
                stash=memopt.StashConfig(bits=bits), fewbit=None, fidelity=None))
            stash_rel, stash_cos = errors(conv_grads(om, x, probe), exact)
            model.load_state_dict(state)
            naive_rel, naive_cos = errors(conv_grads(naive_copy(model, bits), x, probe), exact)
            curves[(depth, bits)] = (stash_rel, naive_rel)
            for label, rel, cos in (("stash (exact forward)", stash_rel, stash_cos),
                                    ("naive (quantized forward)", naive_rel, naive_cos)):
                rows.append([depth, bits, label, f"{statistics.median(rel):.4f}", f"{max(rel):.4f}",
                             f"{rel[0]:.4f}", f"{min(cos):.4f}"])
            print(rows[-2], rows[-1], flush=True)
    table = tabulate(rows, headers=["depth", "bits", "method", "median rel err", "max rel err",
                                    "rel err, first conv", "min cosine"], tablefmt="github")
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    text = (f"# Exact-forward stash vs naive quantized activations, by depth\n\nCommand: `python "
            f"-m tools.bench.stash.bench_stash_depth` (torch {torch.__version__}, CPU). Pre-activation ResNets (basic blocks, "
            f"width 16/32/64), batch {args.batch}, random init and data; per conv layer, the weight gradient against "
            f"exact autograd. 'first conv' is the stem, the layer farthest from the loss.\n\n{table}\n\n"
            f"![relative error per layer](stash_depth.png)\n")
    out.write_text(text)
    _plot(curves, out.with_suffix(".png"))
    print(text)


def _plot(curves, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    bits_list = sorted({b for _, b in curves})
    fig, axes = plt.subplots(1, len(bits_list), figsize=(5 * len(bits_list), 4), sharey=True)
    for ax, bits in zip(axes, bits_list):
        for (depth, b), (stash, naive) in sorted(curves.items()):
            if b != bits:
                continue
            pos = [i / max(len(stash) - 1, 1) for i in range(len(stash))]
            ax.plot(pos, stash, label=f"stash, depth {depth}")
            ax.plot(pos, naive, "--", label=f"naive, depth {depth}")
        ax.set_yscale("log")
        ax.set_title(f"{bits}-bit activations")
        ax.set_xlabel("conv layer (0 = stem, 1 = last)")
    axes[0].set_ylabel("relative L2 error of the weight gradient")
    axes[-1].legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


if __name__ == "__main__":
    main()
