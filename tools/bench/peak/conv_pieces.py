"""MALLOC_MMAP_THRESHOLD_=131072 python -m tools.bench.peak.conv_pieces [--batch 96] [--rounds 5] [--out PATH]

What one CPU ``convolution_backward`` holds beyond the tensors it returns, whole batch against batch pieces.

Each row is a convolution of torchvision's ResNet-50 at 128x128 (its shapes at ``--batch``), float32, random
data, 1 thread. For the input gradient (``output_mask`` [True, False, False], from a one-element stand-in of the
input as ``memopt.stash.grads`` computes it) and the weight gradient ([False, True, False], from the input), the
process's resident high-water mark (``VmHWM``, reset just before the call through ``/proc/self/clear_refs``) less
its resident set before the call: "extra" = what the call peaked at above what was there, its result included.
"whole": one call; "pieces": ``memopt.stash.grads``'s batch pieces (``input_pieces``: neither gradient over
``PIECE_BYTES`` a piece), the input gradient written into one tensor of the whole batch, the weight gradient
summed. With the malloc threshold in the environment every block of 128 KiB or more is its own mapping, so the
mark follows the live memory. Time: the median over ``--rounds`` interleaved rounds (whole, pieces, whole,
...), ms. "equal": whether the pieced input gradient is ``torch.equal`` to the whole call's (a piece may run
another of oneDNN's implementations, chosen by the batch too), else its largest difference relative to the
largest magnitude.
"""
from __future__ import annotations

import argparse
import statistics
import sys
import time

import torch
from tabulate import tabulate

from memopt.stash.grads import PIECE_BYTES, input_pieces, row_ranges
from tools.bench.common import RESULTS, write_results

BACKWARD = torch.ops.aten.convolution_backward
MiB = 2 ** 20
# (name, in channels, out channels, kernel, stride, input side) at 128x128: ResNet-50's distinct convolutions
CONVS = [("layer1 conv1 (first block)", 64, 64, 1, 1, 32), ("layer1 conv2", 64, 64, 3, 1, 32),
         ("layer1 conv3", 64, 256, 1, 1, 32), ("layer1 conv1", 256, 64, 1, 1, 32),
         ("layer2 conv1 (first block)", 256, 128, 1, 1, 32), ("layer2 conv2 (first block)", 128, 128, 3, 2, 32),
         ("layer2 downsample", 256, 512, 1, 2, 32), ("layer3 conv2", 256, 256, 3, 1, 8)]


def _kib(key: str) -> int:
    for line in open("/proc/self/status"):
        if line.startswith(key + ":"):
            return int(line.split()[1]) * 1024
    raise RuntimeError(f"/proc/self/status has no {key}")


def _extra(fn):
    """(result, MiB the call peaked at above the resident set before it, seconds)."""
    before = _kib("VmRSS")
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")
    start = time.perf_counter()
    out = fn()
    return out, (_kib("VmHWM") - before) / MiB, time.perf_counter() - start


def _input_grad(g, x, w, args, pieces):
    stand_in = x.new_empty(1).expand(x.shape)
    if pieces == 1:
        return BACKWARD(g, stand_in, w, None, *args, [True, False, False])[0]
    out = torch.empty(x.shape)
    for a, b in row_ranges(x.shape[0], pieces):
        out[a:b] = BACKWARD(g[a:b], stand_in[a:b], w, None, *args, [True, False, False])[0]
    return out


def _weight_grad(g, x, w, args, pieces):
    total = None
    for a, b in row_ranges(x.shape[0], pieces):
        part = BACKWARD(g[a:b], x[a:b], w, None, *args, [False, True, False])[1]
        total = part if total is None else total.add_(part)
    return total


def _row(name: str, cin: int, cout: int, k: int, s: int, side: int, batch: int, rounds: int) -> list:
    """One convolution's row: sizes, pieces, extra MiB / ms of each call whole and in pieces, equality."""
    x, w = torch.randn(batch, cin, side, side), torch.randn(cout, cin, k, k) * 0.05
    g = torch.randn_like(torch.nn.functional.conv2d(x, w, None, s, k // 2))
    args = ([s, s], [k // 2, k // 2], [1, 1], False, [0, 0], 1)
    pieces = input_pieces(g, x.shape)
    measured = {}
    for _ in range(rounds):
        for what, fn in (("input", _input_grad), ("weight", _weight_grad)):
            for label, n in (("whole", 1), ("pieces", pieces)):
                out, extra, seconds = _extra(lambda: fn(g, x, w, args, n))
                entry = measured.setdefault((what, label), {"extra": [], "s": [], "out": out})
                entry["extra"].append(extra)
                entry["s"].append(seconds)
                del out
    whole, pieced = measured[("input", "whole")]["out"], measured[("input", "pieces")]["out"]
    diff = "yes" if torch.equal(whole, pieced) else \
        f"no, {((whole - pieced).abs().max() / whole.abs().max()).item():.1e}"
    row = [name, f"{cin}->{cout} {k}x{k} /{s}", f"{x.numel() * 4 / MiB:.0f} / {g.numel() * 4 / MiB:.0f}", pieces]
    for what in ("input", "weight"):
        for label in ("whole", "pieces"):
            entry = measured[(what, label)]
            row.append(f"{max(entry['extra']):.0f} / {statistics.median(entry['s']) * 1e3:.0f}")
    return row + [diff]


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--batch", type=int, default=96)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--out", default=str(RESULTS / "peak" / "conv_pieces.md"))
    opts = parser.parse_args(argv)
    torch.set_num_threads(1)
    torch.manual_seed(0)
    rows = []
    for conv in CONVS:
        rows.append(_row(*conv, opts.batch, opts.rounds))
        print(rows[-1], flush=True)
    headers = ["convolution", "shape", "input / incoming gradient MiB", "pieces", "input grad whole: extra MiB / ms",
               "input grad pieces", "weight grad whole", "weight grad pieces", "pieced input grad equal"]
    body = (f"Batch {opts.batch}, `PIECE_BYTES` {PIECE_BYTES / MiB:.0f} MiB, {opts.rounds} rounds.\n\n"
            + tabulate(rows, headers=headers, tablefmt="github"))
    command = "MALLOC_MMAP_THRESHOLD_=131072 python -m tools.bench.peak.conv_pieces " + " ".join(sys.argv[1:])
    write_results(opts.out, "CPU convolution backward: what one call holds, whole batch against pieces", command,
                  __doc__, body)


if __name__ == "__main__":
    main()
