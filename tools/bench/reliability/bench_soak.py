"""python -m tools.bench.reliability.bench_soak   (about 5 minutes, one thread)

Soak benchmark: 2000 training steps of a small CNN and a small transformer with every technique on.

TinyResNet (width 8, one block per stage; stash chains and few-bit) and TinyViT (dim 32, depth 2; few-bit
GELU, dropout, attention), batch 16 at 16x16, SGD with momentum, fresh random inputs every step
(memopt.testing.soak). Reports resident memory after warm-up (first vs last 200 steps, slope),
packed tensors that outlived their step, graphs captured during the run, and step time drift.
Writes docs/results/reliability/soak.md, whose first line is the command.
"""
from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import torch
from tabulate import tabulate

import memopt
from memopt.testing.soak import soak
from memopt.testing.zoo import TinyResNet, TinyViT
from tools.bench.common import RESULTS, write_results_file


def models(batch: int):
    def image(gen):
        return torch.randn(batch, 3, 16, 16, generator=gen)

    yield "TinyResNet (w8, 1 block/stage)", TinyResNet(width=8, blocks=1), image
    yield "TinyViT (d32, depth 2, 4 heads)", TinyViT(d=32, depth=2, heads=4, patch=4, image=16), image


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=2000)
    parser.add_argument("--warmup", type=int, default=200)
    parser.add_argument("--batch", type=int, default=16)
    parser.add_argument("--threads", type=int, default=1, help="intra-op threads (tiny ops: 1 is fastest and steadiest)")
    parser.add_argument("--out", type=Path, default=RESULTS / "reliability" / "soak.md")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    command = "python -m tools.bench.reliability.bench_soak" + "".join(f" {a}" for a in sys.argv[1:])
    rows = []
    torch.manual_seed(0)
    for name, model, make_input in models(args.batch):
        om = memopt.optimize(model, example_inputs=make_input(torch.Generator().manual_seed(1)))
        rewritten = {}
        for n in om.plan.nodes:
            if n.technique != "exact":
                rewritten[n.technique] = rewritten.get(n.technique, 0) + 1
        start = time.time()
        r = soak(om, make_input, 10, args.steps, args.warmup)
        mib = 2 ** 20
        (rss0, rss1), (t0, t1) = r.rss_ends, r.time_ends
        rows.append([name, ", ".join(f"{k} {v}" for k, v in sorted(rewritten.items())), args.steps,
                     f"{rss0 / mib:.2f}", f"{rss1 / mib:.2f}", f"{(rss1 - rss0) / mib:+.3f}",
                     f"{r.rss_slope / mib:+.4f}", f"{max(r.rss[args.warmup:]) / mib:.2f}", r.packed[-1], r.leaked,
                     r.graphs, f"{t0 * 1e3:.1f}", f"{t1 * 1e3:.1f}", f"{t1 / t0:.2f}", f"{time.time() - start:.0f}"])
        print(rows[-1], flush=True)
    headers = ["model", "rewritten nodes", "steps", "RSS first 200 after warm-up (MiB)", "RSS last 200 (MiB)",
               "growth (MiB)", "slope (MiB / 1000 steps)", "max RSS after warm-up (MiB)", "storages packed per step",
               "packed storages alive after their step", "graphs captured", "median step first 200 (ms)",
               "median step last 200 (ms)", "time ratio last/first", "run (s)"]
    text = (f"{command}\n\n# Soak: {args.steps} training steps with every technique on\n\n"
            f"torch {torch.__version__}, CPU, {torch.get_num_threads()} threads; batch {args.batch}, "
            f"{args.warmup} warm-up steps; memopt.Config() defaults (stash 4 bits, few-bit 3 bits). Resident "
            f"memory is the process RSS (/proc/self/statm) after each step; a packed storage is one autograd "
            f"saved for backward (saved_tensors_hooks, weak references) and must be gone once its step ends.\n\n"
            + tabulate(rows, headers, tablefmt="github") + "\n")
    write_results_file(args.out, text)


if __name__ == "__main__":
    main()
