"""python -m tools.bench.shampoo.bench_shampoo_compare [--seeds 3] [--tasks ..] [--out PATH] (25-50 min by load, 1 core)

4-bit Shampoo against first-order optimizers and other Shampoo implementations, on accuracy, optimizer
state bytes and step time, each optimizer at its best learning rate of a small sweep.

Tasks (all ship offline; batch 64 on digits, 100 on MNIST-1D; the last partial batch is dropped):
- digits MLP: scikit-learn digits (8x8 flattened to 64, the fixed 1437 / 360 split), GELU MLP 64-256-256-10;
- digits CNN: the small CNN of ``bench_shampoo_training`` (conv 1->32, 32->64, pool, 64->128, pool, fc 512->10);
- MNIST-1D MLP: mnist1d (4000 / 1000), the GELU MLP 40-256-256-10 of the few-bit benchmark;
- digits ResNet: digits upsampled bilinearly to 32x32, a small ResNet (3x3 stem, 3 stages of one
  torchvision basic block each, widths 16/32/64, strides 1/2/2, BatchNorm, global average pool, fc).
Optimizers: AdamW and SGD (momentum 0.9), weight decay 0; memopt ``Shampoo`` (AdamW graft, weight decay
0, stat_every 5, root_every 20 as in ``bench_shampoo_training``, other settings default) at 32, 8 and 4
bits with the default "reference" schedule and "matrix" layout, 4 bits with the "eager" schedule, the
naive 4-bit baseline (quantize="statistics"), and on the conv nets 4 bits with tensor_layout="modes"
(one preconditioner per dimension of a conv weight, as pytorch-optimizer's Shampoo and SOAP do).
pytorch-optimizer's ``Shampoo`` at its defaults: no momentum, statistics summed and roots recomputed by
SVD at every step (with roots every 20 steps, or with momentum, it reached non-finite statistics on the
digits MLP at every lr of a pilot sweep); ``ScalableShampoo`` with statistics every 5 and roots every 20
steps, preconditioning from step 20, the package's default SGD grafting and Nesterov momentum 0.9;
``SOAP`` with its eigenbasis every 20 steps, weight decay 0, otherwise its defaults (betas 0.95, 0.95).
Without pytorch-optimizer installed those rows are skipped.
Learning rates: every optimizer gets three, its family's usual value and 1/3 and 3 times it: AdamW,
memopt Shampoo and SOAP (Adam-normalised steps) 3e-4, 1e-3, 3e-3; SGD, ScalableShampoo (SGD-grafted)
and pytorch-optimizer's Shampoo (its step is of the order of lr, like Adagrad's) 0.03, 0.1, 0.3. The
best lr is the one with the highest mean test accuracy over the seeds (there is no separate validation
split, so every optimizer's best is picked the same, optimistic, way); a run that raised or whose
training loss is not finite is reported as such and cannot be the best.

Protocol: per task and seed every (optimizer, lr) pair trains in lockstep inside one process
(``lockstep.train_lockstep``: same initial weights, same batch order, each batch run by every pair in a
rotating order), so step times are measured side by side under the same machine load. Step times are of
``opt.step()`` alone ("optimizer step") and of forward + backward + ``opt.step()`` ("train step"), over
every lr and seed of an optimizer. Only steps after step 20 (the first root update) are classified:
"plain" is a step that updates neither statistics nor roots (``SOAP`` updates its statistics at
every step, so for it: no eigenbasis update; pytorch-optimizer's ``Shampoo`` has no plain step),
"update" a step that recomputes the roots or eigenbasis (statistics included); both are medians,
given as a ratio to AdamW's median optimizer step. "mean / AdamW" is the mean optimizer step over all
steps (updates and warm-up included) over AdamW's mean: the amortised cost at these update intervals.
State bytes: every tensor the optimizer holds in its state (walked recursively, so tensors inside
pytorch-optimizer's preconditioner objects count; distinct storages, parameters excluded), after
training, as a ratio to AdamW's.
One CPU thread. The results file is rewritten after every task, so a partial run leaves what it finished.
"""
from __future__ import annotations

import argparse
import math
import os
import platform
import shlex
import statistics
import sys
from collections.abc import Callable
from dataclasses import dataclass
from importlib.metadata import version
from typing import Any

import torch
import torch.nn.functional as F
from tabulate import tabulate
from torch import nn
from torchvision.models.resnet import BasicBlock

from memopt.core.storage import distinct_bytes, storage_key
from memopt.optim import Shampoo
from memopt.optim.config import ShampooConfig, root_due, stat_due
from tools.bench.common import RESULTS, GeluMLP, digits, mnist1d, write_results_file
from tools.bench.shampoo.bench_shampoo_training import ROOT_EVERY, STAT_EVERY, DigitsCNN
from tools.bench.shampoo.lockstep import train_lockstep

try:
    import pytorch_optimizer
except ImportError:
    pytorch_optimizer = None
INSTALL_HINT = ("pytorch_optimizer is not installed: its Shampoo, ScalableShampoo and SOAP rows are skipped; "
                "`pip install pytorch_optimizer` to include them")

COMMAND = "python -m tools.bench.shampoo.bench_shampoo_compare"
ADAM_LRS, SGD_LRS = (3e-4, 1e-3, 3e-3), (0.03, 0.1, 0.3)
WARMUP = ROOT_EVERY  # steps up to the first root update are not classified plain / update


@dataclass(frozen=True)
class Method:
    """An optimizer of the comparison: its lr sweep, how to build it, and which steps update what.
    ``kind(opt, k)`` says what step k (1-based) does: "plain", "update" (roots or eigenbasis
    recomputed) or "stats" (statistics only); None for optimizers without a preconditioner."""

    name: str
    lrs: tuple[float, ...]
    make: Callable[[Any, float], torch.optim.Optimizer]
    kind: Callable[[torch.optim.Optimizer, int], str] | None = None
    conv_only: bool = False  # run only on models with a weight of rank >= 3 (elsewhere it is another row's twin)


def memopt_kind(opt: torch.optim.Optimizer, k: int) -> str:
    cfg = ShampooConfig.from_group(opt.param_groups[0])
    return "update" if root_due(cfg, k) else "stats" if stat_due(cfg, k) else "plain"


def methods() -> list[Method]:
    every = {"stat_every": STAT_EVERY, "root_every": ROOT_EVERY}

    def shampoo(**kw):
        return lambda ps, lr: Shampoo(ps, lr=lr, **every, **kw)

    out = [Method("AdamW", ADAM_LRS, lambda ps, lr: torch.optim.AdamW(ps, lr=lr, weight_decay=0.0)),
           Method("SGD momentum 0.9", SGD_LRS, lambda ps, lr: torch.optim.SGD(ps, lr=lr, momentum=0.9)),
           Method("memopt Shampoo 32-bit", ADAM_LRS, shampoo(bits=32), memopt_kind),
           Method("memopt Shampoo 8-bit", ADAM_LRS, shampoo(bits=8), memopt_kind),
           Method("memopt Shampoo 4-bit", ADAM_LRS, shampoo(bits=4), memopt_kind),
           Method("memopt Shampoo 4-bit eager", ADAM_LRS, shampoo(bits=4, schedule="eager"), memopt_kind),
           Method("memopt Shampoo naive 4-bit", ADAM_LRS, shampoo(bits=4, quantize="statistics"), memopt_kind),
           Method("memopt Shampoo 4-bit modes", ADAM_LRS, shampoo(bits=4, tensor_layout="modes"), memopt_kind,
                  conv_only=True)]
    if pytorch_optimizer is None:
        return out
    po = pytorch_optimizer
    out += [
        Method("pytorch-optimizer Shampoo", SGD_LRS, lambda ps, lr: po.Shampoo(ps, lr=lr),
               lambda opt, k: "update"),
        Method("pytorch-optimizer ScalableShampoo", SGD_LRS,
               lambda ps, lr: po.ScalableShampoo(ps, lr=lr, statistics_compute_steps=STAT_EVERY,
                                                 preconditioning_compute_steps=ROOT_EVERY,
                                                 start_preconditioning_step=ROOT_EVERY),
               lambda opt, k: "update" if k % ROOT_EVERY == 0 else "stats" if k % STAT_EVERY == 0 else "plain"),
        Method("pytorch-optimizer SOAP", ADAM_LRS,
               lambda ps, lr: po.SOAP(ps, lr=lr, weight_decay=0.0, precondition_frequency=ROOT_EVERY),
               # SOAP skips its first step and then counts from 1: the eigenbasis at (k - 1) % freq == 0
               lambda opt, k: "update" if k > 1 and (k - 1) % ROOT_EVERY == 0 else "plain")]
    return out


# --------------------------------------------------------------------------- tasks
class DigitsMLP(nn.Module):
    """GELU MLP 64-256-256-10 on flattened 8x8 digits."""

    def __init__(self):
        super().__init__()
        self.net = nn.Sequential(nn.Flatten(), nn.Linear(64, 256), nn.GELU(), nn.Linear(256, 256), nn.GELU(),
                                 nn.Linear(256, 10))

    def forward(self, x):
        return self.net(x)


class DigitsResNet(nn.Module):
    """A small ResNet for 1x32x32 inputs: 3x3 stem, one basic block per stage, strides 1/2/2, fc."""

    def __init__(self, widths: tuple[int, ...] = (16, 32, 64), classes: int = 10):
        super().__init__()
        layers: list[nn.Module] = [nn.Conv2d(1, widths[0], 3, padding=1, bias=False), nn.BatchNorm2d(widths[0]),
                                   nn.ReLU(inplace=True)]
        inp = widths[0]
        for i, width in enumerate(widths):
            stride = 1 if i == 0 else 2
            down = None if stride == 1 and inp == width else nn.Sequential(
                nn.Conv2d(inp, width, 1, stride=stride, bias=False), nn.BatchNorm2d(width))
            layers.append(BasicBlock(inp, width, stride, down))
            inp = width
        self.features = nn.Sequential(*layers)
        self.fc = nn.Linear(inp, classes)

    def forward(self, x):
        return self.fc(self.features(x).mean((2, 3)))


def digits32():
    """digits upsampled bilinearly from 8x8 to 32x32 (same split as ``digits``)."""
    x, y, xt, yt = digits()
    up = lambda t: F.interpolate(t, size=(32, 32), mode="bilinear", align_corners=False)  # noqa: E731
    return up(x), y, up(xt), yt


@dataclass(frozen=True)
class Task:
    key: str
    title: str
    model: type[nn.Module]
    data: Callable[[], tuple]
    epochs: int
    batch: int


TASKS = (Task("digits-mlp", "digits MLP", DigitsMLP, digits, 8, 64),
         Task("digits-cnn", "digits CNN", DigitsCNN, digits, 6, 64),
         Task("mnist1d-mlp", "MNIST-1D MLP", GeluMLP, mnist1d, 10, 100),
         Task("digits-resnet", "digits ResNet 32x32", DigitsResNet, digits32, 3, 64))


# --------------------------------------------------------------------------- measurements
def optimizer_state_bytes(opt: torch.optim.Optimizer, model: nn.Module) -> int:
    """Bytes of the distinct storages of every tensor reachable from ``opt.state`` (through dicts, lists,
    tuples and objects' attributes), the model's parameters excluded."""
    params = {storage_key(p) for p in model.parameters()}
    found: list[torch.Tensor] = []
    seen: set[int] = set()
    stack: list[Any] = list(opt.state.values())
    while stack:
        obj = stack.pop()
        if id(obj) in seen or isinstance(obj, (str, bytes, int, float, bool, type(None), nn.Module, type)):
            continue
        seen.add(id(obj))
        if isinstance(obj, torch.Tensor):
            if storage_key(obj) not in params:
                found.append(obj)
        elif isinstance(obj, dict):
            stack.extend(obj.values())
        elif isinstance(obj, (list, tuple, set)):
            stack.extend(obj)
        elif hasattr(obj, "__dict__"):
            stack.extend(vars(obj).values())
    return distinct_bytes(found)


def run_task(task: Task, seeds: int, chosen: list[Method]) -> dict[str, Any]:
    """Every method at every lr, every seed, in lockstep per seed; raw results per (method, lr)."""
    data = task.data()
    makers = {(m.name, lr): (lambda ps, m=m, lr=lr: m.make(ps, lr)) for m in chosen for lr in m.lrs}
    acc: dict[tuple, list] = {key: [] for key in makers}
    times: dict[str, dict[str, list[float]]] = {m.name: {c: [] for c in ("plain", "update", "stats", "all", "train")}
                                                for m in chosen}
    state: dict[str, int] = {}
    for seed in range(seeds):
        torch.manual_seed(seed)
        runs = train_lockstep(task.model(), data, seed, task.epochs, task.batch,
                              {f"{name} lr={lr:g}": make for (name, lr), make in makers.items()})
        for m in chosen:
            for lr in m.lrs:
                run = runs[f"{m.name} lr={lr:g}"]
                if run["error"] is not None:
                    acc[(m.name, lr)].append(run["error"])
                    print(f"{task.title} seed {seed} {m.name} lr={lr:g}: {run['error']}", flush=True)
                    continue
                finite = all(math.isfinite(loss) for loss in run["losses"][-1:])
                acc[(m.name, lr)].append(run["accuracy"] if finite else "loss not finite")
                state.setdefault(m.name, optimizer_state_bytes(run["opt"], run["model"]))
                t = times[m.name]
                t["all"] += run["opt_step"]
                t["train"] += run["step"]
                for k, seconds in enumerate(run["opt_step"], start=1):
                    if k > WARMUP:
                        t[m.kind(run["opt"], k) if m.kind else "plain"].append(seconds)
        print(f"{task.title}: seed {seed} done", flush=True)
    return {"acc": acc, "times": times, "state": state}


def fmt_acc(values: list) -> tuple[str, float | None]:
    """'mean ± std' of the accuracies, or the failure; and the mean (None if any run failed)."""
    bad = [v for v in values if isinstance(v, str)]
    if bad:
        return f"failed in {len(bad)}/{len(values)} seeds ({bad[0]})", None
    mean = statistics.mean(values)
    std = statistics.stdev(values) if len(values) > 1 else 0.0
    return f"{mean:.2f} ± {std:.2f}", mean


def tables(task: Task, res: dict[str, Any], chosen: list[Method]) -> tuple[list, list, str]:
    """Rows of the best-lr table and of the sweep table for ``task``, and its summary line."""
    times, acc = res["times"], res["acc"]
    adam_med = statistics.median(times["AdamW"]["plain"])
    adam_mean, adam_train = statistics.mean(times["AdamW"]["all"]), statistics.mean(times["AdamW"]["train"])
    best_rows, sweep_rows, means = [], [], {}
    for m in chosen:
        best = None
        for lr in m.lrs:
            text, mean = fmt_acc(acc[(m.name, lr)])
            sweep_rows.append([task.title, m.name, f"{lr:g}", text,
                               " ".join(f"{v:.1f}" if not isinstance(v, str) else "x" for v in acc[(m.name, lr)])])
            if mean is not None and (best is None or mean > best[1]):
                best = (lr, mean)
        t = times[m.name]
        med = lambda c: statistics.median(t[c]) if t[c] else None  # noqa: E731
        plain, update = med("plain"), med("update")
        timing = [f"{plain * 1e3:.2f}" if plain else "", f"{plain / adam_med:.1f}" if plain else "",
                  f"{update * 1e3:.1f}" if update else "—", f"{update / adam_med:.1f}" if update else "—",
                  f"{statistics.mean(t['all']) / adam_mean:.1f}" if t["all"] else "",
                  f"{statistics.mean(t['train']) / adam_train:.2f}" if t["train"] else ""]
        sb = res["state"].get(m.name)
        state = [f"{sb / 1024:.1f}" if sb is not None else "",
                 f"{sb / res['state']['AdamW']:.2f}" if sb is not None and "AdamW" in res["state"] else ""]
        if best is None:
            best_rows.append([task.title, m.name, "—", "every lr failed", ""] + state + timing)
            continue
        lr, mean = best
        means[m.name] = (mean, statistics.stdev(acc[(m.name, lr)]) if len(acc[(m.name, lr)]) > 1 else 0.0)
        best_rows.append([task.title, m.name, f"{lr:g}", fmt_acc(acc[(m.name, lr)])[0],
                          " ".join(f"{v:.1f}" for v in acc[(m.name, lr)])] + state + timing)
    if not means:
        return best_rows, sweep_rows, f"- {task.title}: every run failed"
    top = max(means, key=lambda n: means[n][0])
    close = [n for n in means if n != top and means[n][0] + means[n][1] >= means[top][0] - means[top][1]]
    summary = f"- {task.title}: highest mean accuracy {top} ({means[top][0]:.2f} ± {means[top][1]:.2f})"
    summary += f"; ±1 std ranges overlapping it: {', '.join(close) if close else 'none'}"
    four, full = "memopt Shampoo 4-bit", "memopt Shampoo 32-bit"
    if four in means and full in means:
        summary += (f"; memopt 4-bit − 32-bit = {means[four][0] - means[full][0]:+.2f} points (stds "
                    f"{means[four][1]:.2f}, {means[full][1]:.2f}), state {res['state'][four] / res['state'][full]:.2f}"
                    f"x of 32-bit's")
    return best_rows, sweep_rows, summary


BEST_HEADERS = ["task", "optimizer", "best lr", "test acc % (mean ± std)", "seeds", "state KiB", "state / AdamW",
                "plain opt step ms", "plain / AdamW", "update opt step ms", "update / AdamW", "mean / AdamW",
                "train step / AdamW"]


def cpu_name() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            return next(line.split(":", 1)[1].strip() for line in f if line.startswith("model name"))
    except (OSError, StopIteration):
        return platform.processor() or "unknown CPU"


def write(out: str, header: str, done: list[Task], pending: list[Task], best: list, sweep: list,
          summary: list[str]) -> None:
    doc = __doc__.split("\n\n", 1)[1].strip()
    status = (f"**Partial: {', '.join(t.title for t in pending)} not run yet.**\n\n" if pending else "")
    epochs = ", ".join(f"{t.title} {t.epochs} epochs" for t in done + pending)
    text = (f"{header}\n\n{status}{doc}\n\nEpochs: {epochs}.\n\n## Best learning rate per optimizer\n\n"
            + tabulate(best, headers=BEST_HEADERS, tablefmt="github")
            + "\n\n## Summary (computed by the script)\n\n" + "\n".join(summary)
            + "\n\n## Full learning-rate sweep (test accuracy %)\n\n"
            + tabulate(sweep, headers=["task", "optimizer", "lr", "mean ± std", "seeds"], tablefmt="github") + "\n")
    write_results_file(out, text)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--seeds", type=int, default=3)
    parser.add_argument("--tasks", nargs="+", choices=[t.key for t in TASKS], default=[t.key for t in TASKS])
    parser.add_argument("--epochs", nargs="+", default=[], metavar="TASK=N",
                        help="override a task's epochs, e.g. digits-resnet=2")
    parser.add_argument("--out", default=str(RESULTS / "shampoo" / "shampoo_compare.md"))
    args = parser.parse_args()
    if args.seeds < 1:
        parser.error(f"--seeds {args.seeds} must be >= 1 (3 gives mean ± std)")
    overrides = {}
    for item in args.epochs:
        key, _, value = item.partition("=")
        if key not in {t.key for t in TASKS} or not value.isdigit() or int(value) < 1:
            parser.error(f"--epochs {item!r}: expected TASK=N with TASK one of {[t.key for t in TASKS]} and N >= 1")
        overrides[key] = int(value)
    torch.set_num_threads(1)
    if pytorch_optimizer is None:
        print(INSTALL_HINT, flush=True)
    chosen = methods()
    tasks = [Task(t.key, t.title, t.model, t.data, overrides.get(t.key, t.epochs), t.batch)
             for t in TASKS if t.key in args.tasks]
    po = (f"pytorch_optimizer {version('pytorch_optimizer')}" if pytorch_optimizer is not None
          else f"pytorch_optimizer not installed ({INSTALL_HINT.split(': ', 1)[1]})")
    load = os.getloadavg()[0]
    header = ("# Shampoo against AdamW, SGD and pytorch-optimizer's Shampoos\n\n"
              f"Command: `{shlex.join([*COMMAND.split(), *sys.argv[1:]])}`\n\n"
              f"torch {torch.__version__}, {po}; CPU: {cpu_name()} ({os.cpu_count()} cores, shared with other "
              f"jobs), torch threads {torch.get_num_threads()}; load average (1 min) {load:.1f} at the start")
    best, sweep, summary = [], [], []
    for i, task in enumerate(tasks):
        conv = any(p.dim() >= 3 for p in task.model().parameters())
        here = [m for m in chosen if conv or not m.conv_only]
        res = run_task(task, args.seeds, here)
        b, s, line = tables(task, res, here)
        best, sweep, summary = best + b, sweep + s, summary + [line]
        end = f", {os.getloadavg()[0]:.1f} after {task.title}"
        header += end
        write(args.out, header + ".", tasks[:i + 1], tasks[i + 1:], best, sweep, summary)


if __name__ == "__main__":
    main()
