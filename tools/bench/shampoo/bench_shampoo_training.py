"""python -m tools.bench.shampoo.bench_shampoo_training --sensitivity   (4 minutes on 1 core; 7 with --sensitivity)

Training with 4-bit Shampoo on real data that ships offline, against 32-bit Shampoo, the naive
4-bit baseline (quantize="statistics") and AdamW.

- scikit-learn digits (8x8, 1437 train / 360 test, the fixed split of the stash benchmark) with a
  small CNN: conv 1->32, conv 32->64, pool, conv 64->128, pool, linear 512->10 (ReLU); batch 64;
- MNIST-1D (mnist1d, 4000 / 1000) with the GELU MLP 40-256-256-10 of the few-bit benchmark; batch 100.
All four optimizers train in lockstep inside one process (same initial weights and data order per
seed; each step runs the four in a rotating order), so step times are measured side by side under
the same machine load. AdamW: lr 1e-3, weight decay 0. Shampoo: AdamW graft with the same lr and
betas, weight decay 0, stat_every 5 and root_every 20 (the paper's 100 / 500 are for runs of 10^5
steps; these runs have 440 and 1200 steps, so the preconditioner is refreshed often enough to
matter), other settings default (eps 1e-6, stat_decay 0.95, blocks of 64, linear-2, rectify (1, 4)).
Preconditioned matrices of 4096+ elements are quantized: digits conv2/conv3/linear and the MLP's
256x256 statistics. One CPU thread (small ops are erratic with 2 threads on a loaded 2-core machine).
Reports test accuracy (mean ± std over 3 seeds), mean training loss per epoch (loss curves), and
the step time (forward + backward + optimizer step) and optimizer-step time of each: the mean over
all steps (wall clock, preconditioner updates included) and the median (a step without update).
"""
from __future__ import annotations

import argparse
import statistics

import torch
import torch.nn.functional as F
from tabulate import tabulate
from torch import nn

from memopt.optim import Shampoo
from tools.bench.common import RESULTS, GeluMLP, digits, mnist1d, write_results
from tools.bench.shampoo.lockstep import train_lockstep

STAT_EVERY, ROOT_EVERY = 5, 20
SENSITIVITY = ((10, 50), (20, 100))  # --sensitivity: MNIST-1D, 32-bit vs 4-bit at these (stat_every, root_every)


def methods(stat_every: int = STAT_EVERY, root_every: int = ROOT_EVERY, baselines: bool = True):
    every = {"stat_every": stat_every, "root_every": root_every}
    out = {
        "AdamW": lambda ps: torch.optim.AdamW(ps, lr=1e-3, weight_decay=0.0),
        "Shampoo 32-bit": lambda ps: Shampoo(ps, lr=1e-3, bits=32, **every),
        "Shampoo naive 4-bit": lambda ps: Shampoo(ps, lr=1e-3, bits=4, quantize="statistics", **every),
        "Shampoo 4-bit": lambda ps: Shampoo(ps, lr=1e-3, bits=4, **every),
    }
    return out if baselines else {k: out[k] for k in ("Shampoo 32-bit", "Shampoo 4-bit")}


class DigitsCNN(nn.Module):
    def __init__(self):
        super().__init__()
        self.c1, self.c2, self.c3 = nn.Conv2d(1, 32, 3, padding=1), nn.Conv2d(32, 64, 3, padding=1), \
            nn.Conv2d(64, 128, 3, padding=1)
        self.fc = nn.Linear(128 * 2 * 2, 10)

    def forward(self, x):
        h = F.relu(self.c2(F.relu(self.c1(x))))
        h = F.max_pool2d(F.relu(self.c3(F.max_pool2d(h, 2))), 2)
        return self.fc(h.flatten(1))


def run_seed(model_cls, data, seed: int, epochs: int, batch: int, optimizers=None):
    """Train every method in lockstep; return {method: (accuracy, epoch losses, mean step s, mean
    optimizer-step s, median step s, median optimizer-step s)}."""
    torch.manual_seed(seed)
    runs = train_lockstep(model_cls().train(), data, seed, epochs, batch, optimizers or methods())
    out = {}
    for name, run in runs.items():
        if run["error"] is not None:
            raise RuntimeError(f"{name} failed on seed {seed}: {run['error']}")
        out[name] = (run["accuracy"], run["losses"], statistics.mean(run["step"]), statistics.mean(run["opt_step"]),
                     statistics.median(run["step"]), statistics.median(run["opt_step"]))
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--digits-epochs", type=int, default=20)
    parser.add_argument("--mnist1d-epochs", type=int, default=30)
    parser.add_argument("--sensitivity", action="store_true",
                        help=f"also MNIST-1D 32-bit vs 4-bit at (stat_every, root_every) in {SENSITIVITY}")
    parser.add_argument("--out", default=str(RESULTS / "shampoo" / "shampoo_training.md"))
    args = parser.parse_args()
    torch.set_num_threads(1)
    acc_rows, time_rows, curve_tables, summary = [], [], [], []
    tasks = (("digits, small CNN", DigitsCNN, digits(), args.digits_epochs, 64),
             ("MNIST-1D, GELU MLP", GeluMLP, mnist1d(), args.mnist1d_epochs, 100))
    for task, model_cls, data, epochs, batch in tasks:
        results = [run_seed(model_cls, data, seed, epochs, batch) for seed in range(3)]
        means, curve_rows = {}, []
        marks = sorted({0, 1, epochs // 4, epochs // 2, epochs - 1})
        for name in methods():
            accs = [r[name][0] for r in results]
            means[name] = statistics.mean(accs)
            acc_rows.append([task, name, f"{means[name]:.2f} ± {statistics.stdev(accs):.2f}",
                             " ".join(f"{a:.1f}" for a in accs)])
            curve = [statistics.mean(r[name][1][e] for r in results) for e in range(epochs)]
            curve_rows.append([name] + [f"{curve[e]:.4f}" for e in marks])
            ms = [statistics.mean(r[name][k] for r in results) * 1e3 for k in (2, 3, 4, 5)]
            time_rows.append([task, name] + [f"{v:.2f}" for v in ms])
            print(acc_rows[-1], time_rows[-1], flush=True)
        curve_tables.append(f"{task}:\n\n" + tabulate(curve_rows, headers=["optimizer"] + [
            f"epoch {e + 1}" for e in marks], tablefmt="github"))
        t32 = [statistics.mean(r["Shampoo 32-bit"][k] for r in results) for k in (2, 3, 4, 5)]
        t4 = [statistics.mean(r["Shampoo 4-bit"][k] for r in results) for k in (2, 3, 4, 5)]
        gap = means["Shampoo 4-bit"] - means["Shampoo 32-bit"]
        ratio = t4[0] / t32[0]
        summary.append(f"- {task}: 4-bit − 32-bit accuracy = **{gap:+.2f}** points "
                       f"({'meets' if gap >= -0.5 else 'misses'} the within-0.5 goal); naive 4-bit − 32-bit = "
                       f"{means['Shampoo naive 4-bit'] - means['Shampoo 32-bit']:+.2f}; AdamW − 32-bit = "
                       f"{means['AdamW'] - means['Shampoo 32-bit']:+.2f}. Wall-clock step time (mean over all "
                       f"steps, updates included) 4-bit / 32-bit = **{ratio:.2f}** "
                       f"({'meets' if ratio <= 1.10 else 'misses'} the <= 1.10 goal); optimizer step alone "
                       f"{t4[1] / t32[1]:.2f}; median step (a step without preconditioner update) "
                       f"{t4[2] / t32[2]:.2f}, its optimizer step {t4[3] / t32[3]:.2f}")
    sensitivity = ""
    if args.sensitivity:
        rows = []
        for stat_every, root_every in SENSITIVITY:
            chosen = methods(stat_every, root_every, baselines=False)
            results = [run_seed(GeluMLP, tasks[1][2], seed, args.mnist1d_epochs, 100, chosen) for seed in range(3)]
            accs = {name: [r[name][0] for r in results] for name in chosen}
            step = {name: statistics.mean(r[name][2] for r in results) for name in chosen}
            rows.append([stat_every, root_every] + [f"{statistics.mean(accs[n]):.2f} ± {statistics.stdev(accs[n]):.2f}"
                                                    for n in chosen]
                        + [f"{statistics.mean(accs['Shampoo 4-bit']) - statistics.mean(accs['Shampoo 32-bit']):+.2f}",
                           f"{step['Shampoo 4-bit'] / step['Shampoo 32-bit']:.2f}"])
            print(rows[-1], flush=True)
        sensitivity = ("\n\n## Sensitivity: MNIST-1D at other update intervals (3 seeds, same protocol)\n\n"
                       + tabulate(rows, headers=["stat_every", "root_every", "32-bit acc %", "4-bit acc %",
                                                 "4-bit − 32-bit", "mean step 4-bit / 32-bit"], tablefmt="github"))
    command = (f"python -m tools.bench.shampoo.bench_shampoo_training --digits-epochs {args.digits_epochs} "
               f"--mnist1d-epochs {args.mnist1d_epochs}{' --sensitivity' if args.sensitivity else ''}")
    write_results(args.out, "4-bit Shampoo: training on digits and MNIST-1D", command, __doc__,
                  "## Test accuracy (%)\n\n"
                  + tabulate(acc_rows, headers=["task", "optimizer", "mean ± std", "seeds 0/1/2"], tablefmt="github")
                  + "\n\n## Mean training loss per epoch (mean over seeds)\n\n" + "\n\n".join(curve_tables)
                  + "\n\n## Step time (per run, then the mean over seeds; measured side by side)\n\n"
                  + tabulate(time_rows, headers=["task", "optimizer", "mean train step ms", "mean optimizer step ms",
                                                 "median train step ms", "median optimizer step ms"],
                             tablefmt="github")
                  + sensitivity + "\n\n## Against the goals\n\n" + "\n".join(summary))


if __name__ == "__main__":
    main()
