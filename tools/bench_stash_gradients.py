"""Benchmark: per-parameter gradient cosine of torchvision ResNet-50 with the exact-forward stash.

For each input size / batch / seed: random init, random input, a random output gradient; the
parameter gradients of the stash (few-bit off) against exact autograd on a copy. Three grids:
"single" (2^K bins over ±WINDOWS[K], the grid before any mask split; residual z coded on both
sides), "split" (without a residual, 2^K bins on each side of the activation's kink, which the
stored 1-bit mask tells apart), "split+residual" (the current one: residual chains also split x̂ by
their mask, each side's window ending where its values end, and code z only where z > 0).
The older grids are reproduced by patching ``split_by_mask`` and ``positive_z_grid``.
Writes docs/results/stash_gradients.md. Run: python tools/bench_stash_gradients.py  (about 8 minutes)
"""
from __future__ import annotations

import argparse
import copy
from unittest import mock

import torch
import torch.nn.functional as F
from tabulate import tabulate

import memopt
import memopt.ops.stash as stash_ops
from results_file import write_results_file


def cosines(bits, size, batch, seed):
    import torchvision

    torch.manual_seed(seed)
    model = torchvision.models.resnet50().train()
    x = torch.randn(batch, 3, size, size)
    reference = copy.deepcopy(model)
    om = memopt.optimize(model, example_inputs=x, config=memopt.Config(stash=memopt.StashConfig(bits=bits), fewbit=None))
    out, ref = om(x), reference(x)
    g = torch.randn_like(out)
    out.backward(g)
    ref.backward(g)
    return {n: F.cosine_similarity(p.grad.flatten(), q.grad.flatten(), 0).item()
            for (n, p), q in zip(model.named_parameters(), reference.parameters())}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--bits", type=int, nargs="+", default=[4])
    parser.add_argument("--cases", default="64x2,128x4", help="SIZExBATCH,... (64x2 is tests/test_stash.py's)")
    parser.add_argument("--seeds", type=int, default=3)
    parser.add_argument("--grids", default="single,split,split+residual")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--out", default="docs/results/stash_gradients.md")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    rows = []
    for case in args.cases.split(","):
        size, batch = map(int, case.split("x"))
        for bits in args.bits:
            for grid in args.grids.split(","):
                split = {"single": lambda act, has_residual: False,
                         "split": lambda act, has_residual: act != "identity" and not has_residual,
                         "split+residual": stash_ops.split_by_mask}[grid]
                positive = stash_ops.positive_z_grid if grid == "split+residual" else (lambda act: False)
                for seed in range(args.seeds):
                    with mock.patch.object(stash_ops, "split_by_mask", split), \
                            mock.patch.object(stash_ops, "positive_z_grid", positive):
                        cos = cosines(bits, size, batch, seed)
                    worst = min(cos, key=cos.get)
                    bn_weights = [c for n, c in cos.items() if "bn" in n and n.endswith("weight")]
                    rows.append([f"{size}x{size}", batch, bits, grid, seed, f"{cos['bn1.weight']:.4f}",
                                 f"{cos[worst]:.4f}", worst, f"{sum(c >= 0.99 for c in cos.values())}/{len(cos)}",
                                 f"{sorted(bn_weights)[len(bn_weights) // 2]:.4f}"])
                    print(rows[-1], flush=True)
    headers = ["input", "batch", "bits", "x̂ grid", "seed", "stem bn1.weight cos", "worst cos", "worst parameter",
               "params >= 0.99", "median BN weight cos"]
    command = (f"python tools/bench_stash_gradients.py --bits {' '.join(map(str, args.bits))} --cases {args.cases} "
               f"--seeds {args.seeds} --grids {args.grids} --threads {args.threads}")
    write_results_file(args.out, "\n".join([
        "# Stash: per-parameter gradient cosine, torchvision ResNet-50", "",
        f"Command: `{command}` (torch {torch.__version__}, CPU). Random init, input N(0, 1), output gradient "
        f"N(0, 1); stash only (few-bit off); cosine of each parameter's gradient against exact autograd. "
        f"'single': the x̂ grid before any mask split (2^K bins over ±WINDOWS[K]); 'split': split at the kink "
        f"without a residual; 'split+residual': the current grid (residual chains split too, z coded where > 0).", "",
        tabulate(rows, headers, tablefmt="github"), ""]))


if __name__ == "__main__":
    main()
