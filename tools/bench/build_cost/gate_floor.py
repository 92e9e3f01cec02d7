"""python -m tools.bench.build_cost.gate_floor [--models resnet50,bert,vit,mobilenetv3] [--batches 8,32] [--out FILE]

The least a default ``optimize()`` can cost as the fidelity gate is specified, in stock training steps of the same
example batch: the work every build does even when the first plan passes, timed piece by piece with memopt's own
functions on the models of ``bench_build_cost`` (build_cost.md), so the issue's target of 10 stock steps can be
compared with what the method needs.

Each model and batch runs in a fresh process (one torch thread): three stock steps (forward, loss, backward,
optimizer step; after one warm-up step) give the median stock step. On the gate's slice (``soundness.batch_slice``:
the first 4 samples) ``soundness.training_grads`` runs the eager model under one random projection and under two
from one forward (the gate's way), which gives the slice's forward (2 t1 - t2) and one loss's backward (t2 - t1);
``conditioning.float64_noise`` runs the float64 reference step as the gate does (a float64 copy, its blocks
checkpointed); ``capture`` and the cost model's ``annotate`` run on the whole batch. The floor adds what a build
whose first plan passes must do (the gate's ``PROJECTIONS`` losses and, for a plan within its ``MARGIN`` of the
bar, as the zoo's plans are, ``MAX_PROJECTIONS``):

- the capture check: the eager model's and the captured graph's step on the slice (2 forwards, 2 backwards);
- the fidelity gate: every loss's gradients on both sides, eager and rewritten (8 x 2 backwards), from 4
  forwards (a first forward per side and a second per side for the confirmations, ``paired_grads``), and the
  float64 reference step of the first loss;
- the cost model: the captured graph and the rewritten one (2 runs), and a capture.

The rewritten graph's steps and cost-model run are timed on the eager model and the captured graph, which cost
less (the rewritten graph decodes what it saved), so the floor is a lower bound; repair rounds, the peak-first
trial, pass runs and graph copies come on top (build_cost.md counts them).
"""
from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import time

from tools.bench.common import RESULTS, write_results

OUT = RESULTS / "build_cost" / "gate_floor.md"
PARTS = ("capture check", "gate steps", "float64 step", "cost model", "capture")


def measure(name: str, batch: int) -> dict:
    """One model at ``batch`` in this process: the stock step and each part of the floor, in seconds."""
    import torch

    from memopt.capture.soundness import batch_slice, training_grads
    from memopt.capture.trace import capture
    from memopt.core.inputs import normalize_inputs
    from memopt.cost_model.analysis import annotate
    from memopt.fidelity.conditioning import FLOAT64_MAX_BYTES, float64_noise, parameter_fidelity
    from memopt.fidelity.gate import MAX_PROJECTIONS
    from memopt.fidelity.losses import projection
    from tools.bench.build_cost.bench_build_cost import _case

    torch.set_num_threads(1)
    case, opt = _case(name, batch)
    model = case.model

    def stock_step() -> float:
        start = time.perf_counter()
        opt.zero_grad(set_to_none=True)
        case.forward_loss(model).backward()
        opt.step()
        return time.perf_counter() - start

    stock_step()
    stock = statistics.median(stock_step() for _ in range(3))
    args, kwargs = normalize_inputs(case.inputs)
    sliced_args, sliced_kwargs, which = batch_slice(args, kwargs)
    rng = torch.Generator().manual_seed(0).get_state()
    names = [n for n, _ in model.named_parameters()]

    def grads(count: int) -> float:
        start = time.perf_counter()
        training_grads(model, model, sliced_args, sliced_kwargs, rng, [projection(i) for i in range(count)],
                       keep=False, stop=lambda _: False)
        return time.perf_counter() - start

    one = statistics.median(grads(1) for _ in range(3))
    two = statistics.median(grads(2) for _ in range(3))
    forward, backward = max(2 * one - two, 0.0), two - one
    exact = training_grads(model, model, sliced_args, sliced_kwargs, rng, [projection(0)])[0]
    start = time.perf_counter()
    noise = float64_noise(model, sliced_args, sliced_kwargs, rng, projection(0), names, exact, 1e-3, 0.99,
                          parameter_fidelity)
    float64 = time.perf_counter() - start
    ran = noise is not None and sum(t.numel() for t in [*model.parameters(), *model.buffers()]) * 8 <= \
        FLOAT64_MAX_BYTES  # else float64_noise made no copy and returned at once, as in the gate
    start = time.perf_counter()
    gm = capture(model, args, kwargs).graph_module
    traced = time.perf_counter() - start
    start = time.perf_counter()
    annotate(gm, args, kwargs, optimizer=opt)
    cost_model = time.perf_counter() - start
    parts = {"capture check": 2 * (forward + backward), "gate steps": 4 * forward + 2 * MAX_PROJECTIONS * backward,
             "float64 step": float64 if ran else 0.0, "cost model": 2 * cost_model, "capture": traced}
    return {"model": name, "batch": batch, "describe": case.describe, "slice": which, "stock_step_s": stock,
            "forward_s": forward, "backward_s": backward, "float64_s": float64 if ran else None, "parts": parts,
            "floor_steps": sum(parts.values()) / stock}


def _seconds(value) -> str:
    return "not run (over FLOAT64_MAX_BYTES)" if value is None else f"{value:.2f}"


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[1])
    p.add_argument("--models", default="resnet50,bert,vit,mobilenetv3")
    p.add_argument("--batches", default="8,32")
    p.add_argument("--out", default=str(OUT))
    p.add_argument("--child", help=argparse.SUPPRESS)
    p.add_argument("--batch", type=int, default=8, help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.child:
        print(json.dumps(measure(args.child, args.batch)))
        return
    rows = []
    for batch in map(int, args.batches.split(",")):
        for name in args.models.split(","):
            done = subprocess.run([sys.executable, "-m", "tools.bench.build_cost.gate_floor", "--child", name,
                                   "--batch", str(batch)], capture_output=True, text=True)
            if done.returncode != 0:
                raise SystemExit(f"{name} at batch {batch} failed:\n{done.stderr[-3000:]}")
            rows.append(json.loads(done.stdout.strip().splitlines()[-1]))
            print(rows[-1], flush=True)
    head = ("| model | batch | stock step s | slice forward s | slice backward s | float64 step s | "
            + " | ".join(PARTS) + " | floor in stock steps |")
    lines = [head, "|" + "---|" * (head.count("|") - 1)]
    for r in rows:
        lines.append(f"| {r['model']} | {r['batch']} | {r['stock_step_s']:.2f} | {r['forward_s']:.2f} | "
                     f"{r['backward_s']:.2f} | {_seconds(r['float64_s'])} | "
                     + " | ".join(f"{r['parts'][k] / r['stock_step_s']:.2f}" for k in PARTS)
                     + f" | {r['floor_steps']:.1f} |")
    models = {r["model"]: r["describe"] for r in rows}
    body = ("The parts in stock steps, then their sum:\n\n" + "\n".join(lines) + "\n\nModels:\n"
            + "\n".join(f"- {k}: {v}" for k, v in models.items()))
    command = "python -m tools.bench.build_cost.gate_floor" + "".join(
        f" --{k} {getattr(args, k)}" for k in ("models", "batches") if getattr(args, k) != p.get_default(k))
    write_results(args.out, "The least a default optimize() costs, in stock steps", command, __doc__, body)


if __name__ == "__main__":
    main()
