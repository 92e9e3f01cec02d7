"""python -m tools.bench.stash.bench_cpu_selects --threads 2   (seconds)

Benchmark: the CPU ops behind the stash's selects and statistics (memopt/stash/grid.py).

On one ResNet-50 layer1 tensor at batch 4 (4x256x56x56 float32, 3.2M elements): torch.where / masked_fill with
a bool mask against the exact replacements the stash uses on CPU (uint8 arithmetic, threshold_backward on the
mask, lerp by the 0/1 mask), and per-channel std/mean by std_mean, the batch-norm kernel and batch slices.
Each figure is the mean of 20 calls after one warm-up, in one process, so the ratios are what matters.
Writes docs/results/stash/stash_cpu_ops.md.
"""
from __future__ import annotations

import argparse
import time

import torch
from tabulate import tabulate

from memopt.stash.stats import batch_slices, channel_std_mean, keep_where, select_u8
from tools.bench.common import RESULTS, write_results_file


def _ms(fn, n: int = 20) -> float:
    fn()
    start = time.perf_counter()
    for _ in range(n):
        fn()
    return (time.perf_counter() - start) / n * 1e3


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--out", default=str(RESULTS / "stash" / "stash_cpu_ops.md"))
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    shape = (4, 256, 56, 56)
    g, mask = torch.randn(shape), torch.randn(shape) > 0
    a, b = torch.randn(1, 256, 1, 1), torch.randn(1, 256, 1, 1)
    c0, c1 = (torch.randint(0, 16, shape, dtype=torch.uint8) for _ in range(2))
    z = torch.randn(shape) * 3 + 1
    dims = [0, 2, 3]
    rows = [
        ["select uint8 codes", "torch.where(mask, c1, c0)", f"{_ms(lambda: torch.where(mask, c1, c0)):.2f}",
         "select_u8 (uint8 arithmetic)", f"{_ms(lambda: select_u8(mask, c1.clone(), c0)):.2f}"],
        ["zero where the mask is false", "torch.where(mask, g, 0)", f"{_ms(lambda: torch.where(mask, g, 0.0)):.2f}",
         "keep_where (threshold_backward)", f"{_ms(lambda: keep_where(g, mask)):.2f}"],
        ["the same, in place", "g.masked_fill(~mask, 0)", f"{_ms(lambda: g.clone().masked_fill_(~mask, 0.0)):.2f}",
         "keep_where(out=g)", f"{_ms(lambda: keep_where(g, mask, out=g.clone())):.2f}"],
        ["per-channel rows by the mask", "torch.where(mask, a, b)", f"{_ms(lambda: torch.where(mask, a, b)):.2f}",
         "lerp(b, a, mask[s].float()) per batch slice",
         f"{_ms(lambda: [torch.lerp(b, a, mask[s].float()) for s in batch_slices(mask)]):.2f}"],
        ["", "", "", "the same over the whole tensor at once", f"{_ms(lambda: torch.lerp(b, a, mask.float())):.2f}"],
        ["per-channel std and mean", "torch.std_mean", f"{_ms(lambda: torch.std_mean(z, dim=dims, correction=0)):.2f}",
         "channel_std_mean (slices)", f"{_ms(lambda: channel_std_mean(z)):.2f}"],
        ["", "native_batch_norm statistics",
         f"{_ms(lambda: torch.ops.aten.native_batch_norm(z, None, None, None, None, True, 0.0, 0.0)):.2f}", "", ""],
    ]
    table = tabulate(rows, headers=["operation", "stock op", "ms", "stash on CPU", "ms"], tablefmt="github")
    text = (f"# Stash: CPU selects and statistics\n\nCommand: `python -m tools.bench.stash.bench_cpu_selects --threads "
            f"{args.threads}` (torch {torch.__version__}, CPU, {args.threads} threads). One {'x'.join(map(str, shape))} "
            f"float32 tensor (ResNet-50 layer1 at batch 4); mean of 20 calls after a warm-up; the clones in some rows "
            f"are timed with them. Full-size rows vary with the allocator's history (fresh pages cost page faults): "
            f"compare within a run.\n\n{table}\n")
    write_results_file(args.out, text)


if __name__ == "__main__":
    main()
