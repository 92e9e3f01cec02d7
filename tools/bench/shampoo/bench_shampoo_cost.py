"""python -m tools.bench.shampoo.bench_shampoo_cost [--reps 7] [--mlp-reps 41] [--out PATH]   (5 minutes, 1 core)

State bytes and step time of AdamW, SGD-momentum and memopt Shampoo at 32, 8 and 4 bits, and 4-bit
with 8-bit eigenvectors (``vector_bits=8``, the tracking remedy of ``shampoo_tracking.md``), in
both tensor layouts ("matrix": (out, in·k·k) as published; "modes": one preconditioner per
dimension of a conv weight), on torchvision ResNet-18 (random init, batch 8 at 64x64, 1000
classes) and on the MNIST-1D GELU MLP 40-256-256-10 (batch 100; it has no tensor of rank 3+, so
both layouts are the same there and only "matrix" is run).

Timing: one CPU thread, one process, every optimizer on the same model and the same gradients,
interleaved (each repetition runs every optimizer once, in a rotating order), median over the
repetitions (7 for ResNet-18, 41 for the MLP). All learning rates are 0, so the parameters, and so
the work per step, stay the same. Shampoo runs the steady-state step, the one the schedule runs
between preconditioner updates (``schedule="eager"`` builds statistics and roots at the first,
untimed, step; ``stat_every`` and ``root_every`` are set past the run). "optimizer step" is
``opt.step()`` alone; "training step" is zero_grad + forward + backward + ``opt.step()``. "update
step": one step that updates every statistic and every root (stat_every = root_every = 1 for that
step), timed once after the repetitions; "amortized" adds a hundredth of it to the steady-state
step, an upper bound of the mean step at the published intervals (statistics every 100 steps, roots
every 500). "matmul probe": a 1024x1024 fp32 matmul timed among the repetitions (median), the
machine's rate under the same load; "Shampoo GMAC/s": the multiply-adds of applying the roots
(Σ blocks, modes of d_i · block numel) over the median optimizer step, i.e. how close the step
is to its matmul floor. State bytes: ``memopt.optim.state_bytes`` (distinct storages).
"""
from __future__ import annotations

import argparse
import os
import math
import statistics
import time

import torch
import torch.nn.functional as F
import torchvision
from tabulate import tabulate

from memopt.optim import Shampoo, state_bytes
from memopt.optim.layout import make_layout
from tools.bench.common import RESULTS, GeluMLP, write_results_file

COMMAND = "python -m tools.bench.shampoo.bench_shampoo_cost"
STEADY = {"lr": 0.0, "schedule": "eager", "stat_every": 10 ** 9, "root_every": 10 ** 9}
HEADERS = ["model", "optimizer", "state MiB", "preconditioner MiB", "optimizer step ms", "step / AdamW's",
           "training step ms", "training step / AdamW's", "step / own 32-bit's", "update step ms",
           "amortized ms", "Shampoo GMAC/s"]


def optimizers(params: list[torch.Tensor], layouts: tuple[str, ...]) -> dict[str, torch.optim.Optimizer]:
    opts: dict[str, torch.optim.Optimizer] = {
        "AdamW": torch.optim.AdamW(params, lr=0.0, weight_decay=0.0),
        "SGD momentum 0.9": torch.optim.SGD(params, lr=0.0, momentum=0.9)}
    for layout in layouts:
        for bits in (32, 8, 4):
            opts[f"Shampoo {bits}-bit, {layout}"] = Shampoo(params, bits=bits, tensor_layout=layout, **STEADY)
        opts[f"Shampoo 4-bit, vector_bits=8, {layout}"] = Shampoo(params, bits=4, vector_bits=8,
                                                                 tensor_layout=layout, **STEADY)
    return opts


def apply_macs(params: list[torch.Tensor], layout: str) -> int:
    """Multiply-adds of applying the inverse roots once (every block, every mode: d_i x block numel)."""
    total = 0
    for p in params:
        lay = make_layout(p.shape, 1200, layout)
        for block in lay.blocks() if lay else ():
            total += math.prod(block.dims) * sum(block.dims)
    return total


def update_step(opt: torch.optim.Optimizer) -> float:
    """Seconds of one step that updates every statistic and root."""
    group = opt.param_groups[0]
    group["stat_every"] = group["root_every"] = 1
    start = time.perf_counter()
    opt.step()
    seconds = time.perf_counter() - start
    group["stat_every"] = group["root_every"] = STEADY["stat_every"]
    return seconds


def measure(name: str, model: torch.nn.Module, batch: tuple[torch.Tensor, torch.Tensor], layouts: tuple[str, ...],
            reps: int) -> tuple[list[list[str]], str]:
    x, y = batch
    params = [p for p in model.parameters() if p.requires_grad]

    def backward() -> None:
        model.zero_grad(set_to_none=False)
        F.cross_entropy(model(x), y).backward()

    backward()
    opts = optimizers(params, layouts)
    for opt in opts.values():
        opt.step()  # Shampoo: state, statistics and the first roots
    labels = list(opts)
    step_t: dict[str, list[float]] = {label: [] for label in labels}
    train_t: dict[str, list[float]] = {label: [] for label in labels}
    probe, probe_t = torch.randn(1024, 1024), []
    for rep in range(reps):
        order = labels[rep % len(labels):] + labels[:rep % len(labels)]
        for label in order:
            start = time.perf_counter()
            opts[label].step()
            step_t[label].append(time.perf_counter() - start)
        start = time.perf_counter()
        probe @ probe
        probe_t.append(time.perf_counter() - start)
        for label in order:
            start = time.perf_counter()
            backward()
            opts[label].step()
            train_t[label].append(time.perf_counter() - start)
    backward()
    update = {label: update_step(opts[label]) for label in labels if label.startswith("Shampoo")}
    med = {label: (statistics.median(step_t[label]), statistics.median(train_t[label])) for label in labels}
    base_step, base_train = med["AdamW"]
    rows = []
    for label in labels:
        sb = state_bytes(opts[label])
        step, train = med[label]
        row = [name, label, f"{sb['total'] / 2 ** 20:.2f}", f"{sb['preconditioner'] / 2 ** 20:.2f}",
               f"{step * 1e3:.2f}", f"{step / base_step:.2f}", f"{train * 1e3:.1f}", f"{train / base_train:.2f}"]
        if label in update:
            layout = label.rsplit(", ", 1)[1]
            same32 = f"Shampoo 32-bit, {layout}"
            row += [f"{step / med[same32][0]:.2f}", f"{update[label] * 1e3:.0f}",
                    f"{(step + update[label] / 100) * 1e3:.1f}", f"{apply_macs(params, layout) / step / 1e9:.1f}"]
        else:
            row += ["", "", "", ""]
        rows.append(row)
        print(row, flush=True)
    macs = ", ".join(f"{layout} {apply_macs(params, layout) / 1e9:.3f} GMAC" for layout in layouts)
    rate = 1024 ** 3 / statistics.median(probe_t)
    return rows, (f"{name}: applying the roots takes {macs} per step; the matmul probe ran at "
                  f"{rate / 1e9:.1f} GMAC/s (median).")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--reps", type=int, default=7)
    parser.add_argument("--mlp-reps", type=int, default=41)
    parser.add_argument("--out", default=str(RESULTS / "shampoo" / "shampoo_cost.md"))
    args = parser.parse_args()
    torch.set_num_threads(1)
    load_start = os.getloadavg()[0]
    torch.manual_seed(0)
    rows, notes = [], []
    for name, model, batch, layouts, reps in (
            ("ResNet-18", torchvision.models.resnet18(), (torch.randn(8, 3, 64, 64), torch.randint(0, 1000, (8,))),
             ("matrix", "modes"), args.reps),
            ("MLP 40-256-256-10", GeluMLP(), (torch.randn(100, 40), torch.randint(0, 10, (100,))),
             ("matrix",), args.mlp_reps)):
        r, note = measure(name, model, batch, layouts, reps)
        rows += r
        notes.append(note)
    table = tabulate(rows, headers=HEADERS, tablefmt="github")
    doc = __doc__.split("\n\n", 1)[1].strip()
    text = (f"{COMMAND} --reps {args.reps} --mlp-reps {args.mlp_reps}\n\n"
            f"# Shampoo: state bytes and step time against AdamW and SGD\n\n"
            f"torch {torch.__version__}, CPU, 1 thread; load average (1 min) {load_start:.1f} at the start, "
            f"{os.getloadavg()[0]:.1f} at the end (2 cores, shared with other jobs: times carry that noise)."
            f"\n\n{doc}\n\n{table}\n\n" + "\n\n".join(notes) + "\n")
    write_results_file(args.out, text)


if __name__ == "__main__":
    main()
