"""python -m tools.bench.build_cost.bench_build_cost [--models resnet50,bert,vit,mobilenetv3] [--out FILE] [--profile M]

What one ``memopt.optimize()`` costs, in stock training steps of the same example batch, and what it does: the
traces, cost-model runs, pass runs, real training steps and graph copies of the build (``om.plan.build``, counted
by memopt/core/counters.py), with the default Config and with a budget.

Each model runs in a fresh process (one torch thread): three stock steps (forward, loss, backward, optimizer step),
``optimize()`` with the default Config, three more stock steps, then ``optimize()`` with ``budget_mb`` halfway
between the default plan's estimated peak and the baseline's (a budget the planner has to work for, and can
meet). The ratio divides ``optimize()``'s wall time by the median of the six stock steps, measured in the same
process around it. The issue's targets: at most 10 stock steps with the default Config, at most 25 with a budget.
"""
from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import time
from tools.bench.common import RESULTS, write_results

MODELS = ("resnet50", "bert", "vit", "mobilenetv3")
KINDS = ("traces", "cost_model_runs", "pass_runs", "real_steps", "graph_copies")
SECONDS = tuple(f"{k}_s" for k in KINDS) + ("other_s",)  # om.plan.build's seconds per kind (memopt/core/counters.py)
OUT = RESULTS / "build_cost" / "build_cost.md"


def _case(name: str, batch: int):
    """(model, forward-and-loss, optimizer, describe) for one benchmark model at ``batch``."""
    import torch
    import torch.nn.functional as F

    from tools.bench.peak import child

    if name == "mobilenetv3":
        import timm

        torch.manual_seed(0)
        model = timm.create_model("mobilenetv3_large_100", pretrained=False).train()
        x, y = torch.randn(batch, 3, 224, 224), torch.randint(0, 1000, (batch,))
        case = child.Case(model, x, lambda net: F.cross_entropy(net(x), y), [], False,
                          "timm mobilenetv3_large_100 (squeeze-excite, hard-swish), 224x224, SGD momentum 0.9")
    else:
        case = child.build(name, batch, child.shape_args(layers=12))  # BERT-base's 12 layers
    opt = torch.optim.SGD(case.model.parameters(), lr=0.01, momentum=0.9) if name in ("resnet50", "mobilenetv3") \
        else torch.optim.AdamW(case.model.parameters(), lr=1e-4)
    return case, opt


def measure(name: str, batch: int) -> dict:
    """One model in this process: stock step seconds, then each optimize()'s seconds and build counts."""
    import torch

    import memopt

    torch.set_num_threads(1)
    case, opt = _case(name, batch)

    def stock_step() -> float:
        start = time.perf_counter()
        opt.zero_grad(set_to_none=True)
        case.forward_loss(case.model).backward()
        opt.step()
        return time.perf_counter() - start

    stock_step()  # warm-up: the first step allocates the optimizer state
    steps = [stock_step() for _ in range(3)]
    out = {"model": name, "batch": batch, "describe": case.describe}
    start = time.perf_counter()
    om = memopt.optimize(case.model, example_inputs=case.inputs, optimizer=opt)
    default_s = time.perf_counter() - start
    plan = om.plan
    steps += [stock_step() for _ in range(3)]
    out["stock_step_s"] = statistics.median(steps)
    out["default"] = {"seconds": default_s, **{k: plan.build.get(k) for k in KINDS + SECONDS}, "gate": _gate(plan)}
    budget = (plan.baseline_peak_bytes + plan.estimated_peak_bytes) / 2 / 2**20
    out["budget_mb"] = round(budget, 1)
    del om
    start = time.perf_counter()
    try:
        om = memopt.optimize(case.model, budget_mb=budget, example_inputs=case.inputs, optimizer=opt)
        out["budget"] = {"seconds": time.perf_counter() - start, **{k: om.plan.build.get(k) for k in KINDS + SECONDS},
                         "gate": _gate(om.plan)}
    except memopt.BudgetError as error:
        out["budget"] = {"seconds": time.perf_counter() - start, "error": str(error).splitlines()[0][:200]}
    return out


def _label(r: dict, which: str) -> str:
    """A row's first two cells: the model, and which optimize() (the budget's with its MiB)."""
    return f"{r['model']} | {which}" + (f" {r['budget_mb']} MiB" if which == "budget" else "")


def _gate(plan) -> dict:
    """What the fidelity gate did for ``plan`` (``Plan.fidelity``): rounds, gradients computed, losses, changes."""
    report = plan.fidelity or {}
    return {k: report.get(k) for k in ("rounds", "steps", "projections", "passed")} | {
        "changes": len(report.get("changes") or []), "last_resort": bool(report.get("last_resort"))}


def _gate_row(r: dict, which: str) -> str:
    gate = r[which].get("gate")
    if not gate or gate.get("steps") is None:
        return ""
    return (f"| {_label(r, which)} | "
            f"{gate['rounds']} | {gate['steps']} | {gate['projections']} | {gate['changes']} | "
            f"{'yes' if gate['last_resort'] else 'no'} |")


def profile(name: str, batch: int, top: int = 25) -> None:
    """Where one default ``optimize()`` of ``name`` spends its time: cProfile, memopt's functions by cumulative
    time (printed, no file written)."""
    import cProfile
    import pstats

    import torch

    import memopt

    torch.set_num_threads(1)
    case, opt = _case(name, batch)
    profiler = cProfile.Profile()
    profiler.enable()
    om = memopt.optimize(case.model, example_inputs=case.inputs, optimizer=opt)
    profiler.disable()
    print(om.plan.build)
    pstats.Stats(profiler).sort_stats("cumulative").print_stats("memopt|passes|cost_model", top)


def _row(r: dict, which: str) -> str:
    b = r[which]
    ratio = b["seconds"] / r["stock_step_s"]
    counts = " | ".join(str(b.get(k, "")) for k in KINDS)
    note = b.get("error", "")
    return (f"| {_label(r, which)} | "
            f"{r['stock_step_s']:.2f} | {b['seconds']:.1f} | {ratio:.1f} | {counts} | {note} |")


def _seconds_row(r: dict, which: str) -> str:
    """Where one optimize()'s seconds went, each kind in stock steps (each second booked to the innermost kind)."""
    b = r[which]
    if "error" in b or b.get("real_steps_s") is None:
        return ""
    step = r["stock_step_s"]
    parts = " | ".join(f"{b[k] / step:.1f}" for k in SECONDS)
    return (f"| {_label(r, which)} | "
            f"{b['seconds'] / step:.1f} | {parts} |")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[1])
    p.add_argument("--models", default=",".join(MODELS))
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--out", default=str(OUT))
    p.add_argument("--child", help=argparse.SUPPRESS)
    p.add_argument("--profile", choices=MODELS, help="profile one default optimize() of this model instead")
    args = p.parse_args()
    if args.profile:
        profile(args.profile, args.batch)
        return
    if args.child:
        print(json.dumps(measure(args.child, args.batch)))
        return
    rows = []
    for name in args.models.split(","):
        done = subprocess.run([sys.executable, "-m", "tools.bench.build_cost.bench_build_cost", "--child", name,
                               "--batch", str(args.batch)], capture_output=True, text=True)
        if done.returncode != 0:
            raise SystemExit(f"{name} failed:\n{done.stderr[-3000:]}")
        rows.append(json.loads(done.stdout.strip().splitlines()[-1]))
        print(rows[-1], flush=True)
    head = ("| model | optimize() | stock step s | optimize() s | in stock steps | " + " | ".join(KINDS) +
            " | note |\n|" + "---|" * (6 + len(KINDS)))
    body = head + "\n" + "\n".join(_row(r, w) for r in rows for w in ("default", "budget"))
    seconds = [row for r in rows for w in ("default", "budget") if (row := _seconds_row(r, w))]
    if seconds:
        body += ("\n\nWhere the seconds went, in stock steps (``om.plan.build``: each second booked to the innermost "
                 "kind running, so a cost-model run inside a pass run is the cost model's; ``real_steps`` holds the "
                 "capture check's and the fidelity gate's steps, float64 ones included; ``other``: the rest, the "
                 "gate's and the planner's own Python):\n\n| model | optimize() | all | " +
                 " | ".join(k[:-2] for k in SECONDS) + " |\n|" + "---|" * (3 + len(SECONDS)) + "\n" +
                 "\n".join(seconds))
    gates = [row for r in rows for w in ("default", "budget") if (row := _gate_row(r, w))]
    if gates:
        body += ("\n\nThe fidelity gate (``om.plan.fidelity``): its repair rounds, the gradients it computed (a backward "
                 "each, eager and rewritten, float64 ones included: ``steps``), the losses a passing plan was confirmed "
                 "on, its changes to the plan and whether its last resort ran:\n\n| model | optimize() | rounds | steps "
                 "| losses | changes | last resort |\n|---|---|---|---|---|---|---|\n" + "\n".join(gates))
    body += "\n\nModels:\n" + "\n".join(f"- {r['model']}: {r['describe']}, batch {r['batch']}" for r in rows)
    command = "python -m tools.bench.build_cost.bench_build_cost " + " ".join(sys.argv[1:])
    write_results(args.out, "What optimize() costs, in stock steps", command.strip(), __doc__, body)


if __name__ == "__main__":
    main()
