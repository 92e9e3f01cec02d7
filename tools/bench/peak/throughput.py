"""python -m tools.bench.peak.throughput --model vit --batches checkpoint=224,memopt_budget=480 [--cap-mb 1024]

Samples per second of the peak benchmark's methods, each at its own batch (the largest that fit the cap in
``bench_peak --largest``), side by side in one process, interleaved.

``bench_peak --largest`` times each probe in its own process, one after another, on a machine other work shares, so
its samples/s column compares runs under different loads; the issue's throughput target (at least 0.8x
checkpointing's, each method at its largest batch) needs them under the same load. Here every method is built on
its own copy of the model at its batch (``child.build``, seeded), ``memopt_budget`` with ``budget_mb`` =
``--cap-mb`` as in ``--largest`` (its optimize() seconds reported), one warm-up step each, then ``--rounds``
rounds of one training step of every method in turn; samples/s = batch / the median step. CPU, ``--threads``
torch threads (default 1, as the peak benchmark). Memory is not measured here (the methods share the process):
the peaks are ``bench_peak``'s.
"""
from __future__ import annotations

import argparse
import statistics
import time

from tabulate import tabulate

from tools.bench.common import RESULTS, write_results
from tools.bench.peak.step_ratio import _cast, interleaved


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[1])
    p.add_argument("--model", default="vit")
    p.add_argument("--batches", default="checkpoint=224,memopt_budget=480",
                   help="method=batch,...: stock, checkpoint, memopt, memopt_budget")
    p.add_argument("--dtype", default="float32", choices=("float32", "bf16"))
    p.add_argument("--cap-mb", type=float, default=1024, help="memopt_budget's budget_mb")
    p.add_argument("--res", type=int, default=128)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--out", default="")
    a = p.parse_args()
    import torch

    from tools.bench.peak import child

    torch.set_num_threads(a.threads)
    batches = {k: int(v) for k, v in (kv.split("=") for kv in a.batches.split(",") if kv)}
    cast = _cast(a.dtype)
    nets, setups = {}, {}
    for method, batch in batches.items():
        case = child.build(a.model, batch, child.shape_args(res=a.res))
        opt = child.make_optimizer(a.model, case.model)
        start = time.perf_counter()
        net, _, note = child.apply(method, case, opt, cast, a.cap_mb if method == "memopt_budget" else None)
        setups[method] = (time.perf_counter() - start if method.startswith("memopt") else None, note)
        nets[method] = (net, opt, case.forward_loss)
    times = interleaved(nets, cast, a.rounds, show=True)
    rate = {m: batches[m] / statistics.median(times[m]) for m in batches}
    base = rate.get("checkpoint")
    rows = [[a.model, a.dtype, m, batches[m], f"{statistics.median(times[m]):.2f}",
             f"{min(times[m]):.2f}-{max(times[m]):.2f}", f"{rate[m]:.2f}",
             f"{rate[m] / base:.2f}x" if base else "", "" if setups[m][0] is None else f"{setups[m][0]:.1f}",
             setups[m][1]] for m in batches]
    table = tabulate(rows, headers=["model", "precision", "method", "batch", "median step s", "range s", "samples/s",
                                    "/ checkpoint's", "optimize() s", "note"], tablefmt="github")
    command = (f"python -m tools.bench.peak.throughput --model {a.model} --batches {a.batches} --dtype {a.dtype} "
               f"--cap-mb {a.cap_mb:g} --res {a.res} --rounds {a.rounds} --threads {a.threads}")
    body = f"Median over {a.rounds} interleaved rounds, {a.threads} torch thread(s), CPU.\n\n{table}"
    write_results(a.out or str(RESULTS / "peak" / f"throughput_{a.model}.md"),
                  "Samples per second at each method's largest batch, interleaved", command, __doc__, body)


if __name__ == "__main__":
    main()
