"""python -m tools.bench.peak.step_ratio [--models llama,resnet50] [--dtypes float32,bf16] [--rounds 6] [--out PATH]

Step time of the peak benchmark's methods side by side in one process, interleaved.

The peak table (``bench_peak --table``) times each method in its own process one after another, so machine load falls on them
unevenly; here each round runs one training step of every method in turn (stock, torch.utils.checkpoint on every
block, memopt's default plan), each on its own copy of the model and its own optimizer, and the medians over the
rounds give the ratios. The models, inputs, losses, optimizers and checkpointing are the peak benchmark's
(``tools/bench/peak/child.py``); ``memopt.optimize`` runs first (its seconds reported), then one warm-up step of
every method, then ``--rounds`` rounds. CPU, ``--threads`` torch threads (default 1, as the peak benchmark).
"""
from __future__ import annotations

import argparse
import contextlib
import statistics
import time

from tabulate import tabulate

from tools.bench.common import RESULTS, write_results

METHODS = ("stock", "checkpoint", "memopt")


def _cast(dtype: str):
    import torch

    return (lambda: torch.autocast("cpu", dtype=torch.bfloat16)) if dtype == "bf16" else contextlib.nullcontext


def _nets(name: str, batch: int, dtype: str, shape):
    """{method: (module a step calls, its optimizer, the step's forward-and-loss)}, and optimize()'s seconds."""
    from tools.bench.peak import child

    nets, setup = {}, None
    for method in METHODS:
        case = child.build(name, batch, shape)  # seeded: the same weights and inputs for every method
        opt = child.make_optimizer(name, case.model)
        start = time.perf_counter()
        net, _, _ = child.apply(method, case, opt, _cast(dtype), None)
        if method == "memopt":
            setup = time.perf_counter() - start
        nets[method] = (net, opt, case.forward_loss)
    return nets, setup


def _step(net, opt, forward_loss, cast) -> float:
    start = time.perf_counter()
    opt.zero_grad(set_to_none=True)
    with cast():
        loss = forward_loss(net)
    loss.backward()
    opt.step()
    return time.perf_counter() - start


def interleaved(nets: dict, cast, rounds: int, show: bool = False) -> dict:
    """{method: step seconds of each round}: one warm-up step of every method (optimizer state, caches), then
    ``rounds`` rounds of one step of every method in turn, so machine load falls on all of them alike."""
    times = {m: [] for m in nets}
    for m in nets:
        _step(*nets[m], cast)
    for _ in range(rounds):
        for m in nets:
            times[m].append(_step(*nets[m], cast))
            if show:
                print(m, f"{times[m][-1]:.2f} s", flush=True)
    return times


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[1])
    p.add_argument("--models", default="llama,resnet50")
    p.add_argument("--dtypes", default="float32,bf16")
    p.add_argument("--batch", default="", help="model=N,... (defaults: the peak benchmark's)")
    p.add_argument("--res", type=int, default=128)
    p.add_argument("--rounds", type=int, default=6)
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--out", default="")
    a = p.parse_args()
    import torch

    from tools.bench.peak import child

    torch.set_num_threads(a.threads)
    batches = dict(child.DEFAULT_BATCH, **{k: int(v) for k, v in (kv.split("=") for kv in a.batch.split(",") if kv)})
    rows = []
    for name in a.models.split(","):
        for dtype in a.dtypes.split(","):
            nets, setup = _nets(name, batches[name], dtype, child.shape_args(res=a.res))
            cast = _cast(dtype)
            times = interleaved(nets, cast, a.rounds)
            med = {m: statistics.median(times[m]) for m in METHODS}
            rows.append([name, dtype, batches[name], *(f"{med[m]:.3f}" for m in METHODS),
                         f"{med['checkpoint'] / med['stock']:.2f}x", f"{med['memopt'] / med['stock']:.2f}x",
                         f"{med['memopt'] / med['checkpoint']:.2f}x", f"{setup:.1f}",
                         f"{setup / med['stock']:.1f}"])
            print(rows[-1], flush=True)
            del nets
    table = tabulate(rows, headers=["model", "precision", "batch", "stock s", "checkpoint s", "memopt s",
                                    "checkpoint / stock", "memopt / stock", "memopt / checkpoint",
                                    "optimize() s", "optimize() in stock steps"], tablefmt="github")
    command = "python -m tools.bench.peak.step_ratio " + " ".join(
        f"--{k} {v}" for k, v in (("models", a.models), ("dtypes", a.dtypes), ("batch", a.batch),
                                  ("res", a.res), ("rounds", a.rounds), ("threads", a.threads)) if v != "")
    body = (f"Median step seconds over {a.rounds} interleaved rounds, {a.threads} torch thread(s), torch "
            f"{torch.__version__}, CPU.\n\n{table}")
    write_results(a.out or str(RESULTS / "peak" / "step_ratio.md"), "Step time side by side: stock, checkpointing, "
                  "memopt", command, __doc__, body)


if __name__ == "__main__":
    main()
