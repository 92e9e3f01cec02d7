"""python -m tools.bench.shampoo.bench_shampoo_schedule [--epochs N] [--out PATH]   (about a minute on 1 core)

4-bit Shampoo's two update schedules on the same short runs: "reference" (the default: statistics
from start_step, roots once statistics exist, AdamW alone until then) and "eager" (statistics and
roots built at step 1 from one gradient).

Task (no download; scikit-learn is not needed): 32 Gaussian features, labels from a fixed random
teacher MLP 32-64-10 (Tanh), 4096 train / 1024 test. Model: MLP 32-256-256-10 (Tanh); its 256x256
statistics are stored in 4 bits. Batch 64, 64 steps per epoch. Every optimizer trains from the same
initial weights on the same batch order per seed (3 seeds). AdamW: lr 1e-3, weight decay 0.
Shampoo: 4 bits, AdamW graft with the same lr, other settings default, at two update intervals:
(stat_every, root_every) = (5, 20), as the training benchmark uses for short runs, and the
published (100, 500). Reports test accuracy and the final training loss (mean over the last epoch).
"""
from __future__ import annotations

import argparse
import copy
import statistics

import torch
import torch.nn.functional as F
from tabulate import tabulate
from torch import nn

from memopt.optim import Shampoo
from tools.bench.common import RESULTS, write_results


def task(n_train: int = 4096, n_test: int = 1024):
    g = torch.Generator().manual_seed(1234)
    x = torch.randn(n_train + n_test, 32, generator=g)
    teacher = nn.Sequential(nn.Linear(32, 64), nn.Tanh(), nn.Linear(64, 10))
    with torch.no_grad():
        for p in teacher.parameters():
            p.copy_(torch.randn(p.shape, generator=g))
        y = teacher(x).argmax(1)
    return x[:n_train], y[:n_train], x[n_train:], y[n_train:]


def model() -> nn.Module:
    return nn.Sequential(nn.Linear(32, 256), nn.Tanh(), nn.Linear(256, 256), nn.Tanh(), nn.Linear(256, 10))


def methods() -> dict:
    out = {"AdamW": lambda ps: torch.optim.AdamW(ps, lr=1e-3, weight_decay=0.0)}
    for stat_every, root_every in ((5, 20), (100, 500)):
        for schedule in ("reference", "eager"):
            out[f"4-bit, {schedule}, ({stat_every}, {root_every})"] = (
                lambda ps, s=schedule, a=stat_every, b=root_every:
                Shampoo(ps, lr=1e-3, stat_every=a, root_every=b, schedule=s))
    return out


def run(seed: int, epochs: int, data) -> dict[str, tuple[float, float]]:
    x, y, xt, yt = data
    torch.manual_seed(seed)
    base = model()
    out = {}
    for name, make in methods().items():
        net = copy.deepcopy(base)
        opt = make(net.parameters())
        gen = torch.Generator().manual_seed(seed)
        for _ in range(epochs):
            order, losses = torch.randperm(len(x), generator=gen), []
            for i in range(0, len(x), 64):
                idx = order[i:i + 64]
                loss = F.cross_entropy(net(x[idx]), y[idx])
                opt.zero_grad()
                loss.backward()
                opt.step()
                losses.append(loss.item())
        with torch.no_grad():
            acc = (net(xt).argmax(1) == yt).float().mean().item() * 100
        out[name] = (acc, statistics.mean(losses))
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--epochs", type=int, default=10)
    parser.add_argument("--out", default=str(RESULTS / "shampoo" / "shampoo_schedule.md"))
    args = parser.parse_args()
    torch.set_num_threads(1)
    data = task()
    results = [run(seed, args.epochs, data) for seed in range(3)]
    rows = []
    for name in methods():
        accs = [r[name][0] for r in results]
        losses = [r[name][1] for r in results]
        rows.append([name, f"{statistics.mean(accs):.2f} ± {statistics.stdev(accs):.2f}",
                     " ".join(f"{a:.1f}" for a in accs), f"{statistics.mean(losses):.4f}"])
        print(rows[-1], flush=True)
    steps = args.epochs * 64
    write_results(args.out, "4-bit Shampoo: reference vs eager update schedule",
                  f"python -m tools.bench.shampoo.bench_shampoo_schedule --epochs {args.epochs}", __doc__,
                  f"{steps} steps per run.\n\n" + tabulate(
                      rows, headers=["optimizer, schedule, (stat_every, root_every)", "test acc % (mean ± std)",
                                     "seeds 0/1/2", "last-epoch train loss"], tablefmt="github"))


if __name__ == "__main__":
    main()
