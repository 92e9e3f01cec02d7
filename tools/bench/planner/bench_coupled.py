# python -m tools.bench.planner.bench_coupled --threads 2
"""python -m tools.bench.planner.bench_coupled [--models mobilenet_v2,mnasnet0_5] [--fractions 0.9,0.7,0.5,0.3]

Benchmark: budget plans on depthwise CNNs, where the scale identity couples units (issue 22).

In an inverted-residual block (BN A -> ReLU6 -> depthwise conv -> BN B), A's BatchNorm weight is nearly
scale-invariant through the depthwise conv and B: its true gradient is only B's eps and ReLU6's clip terms. With B
stashed and A left exact, B's codes' error in dL/dz swamps that small gradient; with both stashed, A's weight
gradient is solved from B's by the scale identity (memopt/stash/identity.py). The planner takes such units as one
group of joint options (passes/planning/candidates.py ``couple``), and the fidelity gate keeps the coupling through its
repairs.

Per model (torchvision, random weights, batch 4, 128x128, SGD) and budget (a fraction of the way from the default
plan's estimated peak to the baseline's), two plans: the planner alone (``Config(fidelity=None)``) and with the
fidelity gate (the default). Columns: the plan's estimated peak; `B without A`: coupled pairs with B stashed and A
not (the pairs are read from the depthwise convs of the model: A is the BatchNorm feeding a depthwise conv through
an activation, B the BatchNorm after it); `worst A weight`: the least gradient cosine of those A weights against
exact autograd (one training step, fixed random projection of the output); `worst`: the least over all parameters
whose exact gradient is above 1e-3 of the median norm; the gate's verdict, steps and changes.
"""
from __future__ import annotations

import argparse
import copy
import sys
import time
from typing import Any, Dict, List, Tuple

import torch
from tabulate import tabulate
from torch import nn

import memopt
from memopt.fidelity.gate import RandomProjection, parameter_fidelity
from tools.bench.common import RESULTS, write_results

MiB = 2 ** 20
OUT = RESULTS / "planner" / "coupled_units.md"


def coupled_pairs(model: nn.Module) -> List[Tuple[str, str]]:
    """(A, B) BatchNorm module names: A -> activation -> depthwise conv -> B, in module order (torchvision's
    Conv2dNormActivation / InvertedResidual layout: each conv followed by its BatchNorm)."""
    mods = list(model.named_modules())
    pairs = []
    for i, (name, m) in enumerate(mods):
        if isinstance(m, nn.Conv2d) and m.groups == m.in_channels and m.groups > 1:
            before = [n for n, x in mods[:i] if isinstance(x, nn.BatchNorm2d)]
            after = next((n for n, x in mods[i + 1:] if isinstance(x, nn.BatchNorm2d)), None)
            if before and after:
                pairs.append((before[-1], after))
    return pairs


def _grads(module, model, x, loss) -> List[torch.Tensor]:
    model.zero_grad(set_to_none=True)
    torch.manual_seed(7)
    loss(module(x)).backward()
    return [p.grad.clone() if p.grad is not None else None for p in model.parameters()]


def run(name: str, fractions: List[float]) -> List[Dict[str, Any]]:
    import torchvision
    torch.manual_seed(0)
    model, x = getattr(torchvision.models, name)().train(), torch.randn(4, 3, 128, 128)
    pairs = coupled_pairs(model)
    names = [n for n, _ in model.named_parameters()]
    loss = RandomProjection(11)
    exact = _grads(model, model, x, loss)
    default = memopt.optimize(copy.deepcopy(model), example_inputs=x, optimizer="sgd",
                              config=memopt.Config(fidelity=None)).plan
    rows = []
    for fraction in fractions:
        budget = default.estimated_peak_bytes + fraction * (default.baseline_peak_bytes - default.estimated_peak_bytes)
        for gate in (False, True):
            start = time.perf_counter()
            config = memopt.Config() if gate else memopt.Config(fidelity=None)
            target = copy.deepcopy(model)
            om = memopt.optimize(target, budget / MiB, example_inputs=x, optimizer="sgd", config=config)
            seconds = time.perf_counter() - start
            figures = parameter_fidelity(names, exact, _grads(om, target, x, loss), 1e-3)
            stashed = set(om.plan.chosen_units().get("stash", {}))
            bn = {a: a.replace(".", "_") for pair in pairs for a in pair}
            broken = [(a, b) for a, b in pairs if bn[b] in stashed and bn[a] not in stashed]
            worst_a = min(figures[f"{a}.weight"]["cosine"] for a, _ in pairs)
            kept = {k: v for k, v in figures.items() if not v["tiny"]}
            worst = min(kept, key=lambda k: kept[k]["cosine"])
            report = om.plan.fidelity or {}
            rows.append({"model": name, "fraction": fraction, "budget": budget, "gate": gate,
                         "estimated": om.plan.estimated_peak_bytes, "broken": len(broken), "pairs": len(pairs),
                         "worst_a": worst_a, "worst": f"{worst} {kept[worst]['cosine']:.4f}",
                         "verdict": "-" if not report else ("passed" if report.get("passed") else "FAILED"),
                         "steps": report.get("steps", 0), "changes": len(report.get("changes", [])),
                         "seconds": seconds})
            print(rows[-1], flush=True)
    return rows


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--models", default="mobilenet_v2,mnasnet0_5")
    parser.add_argument("--fractions", default="0.9,0.7,0.5,0.3")
    parser.add_argument("--threads", type=int, default=None)
    parser.add_argument("--out", default=str(OUT))
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    rows = [r for m in args.models.split(",") for r in run(m, [float(f) for f in args.fractions.split(",")])]
    table = tabulate([[r["model"], r["fraction"], f"{r['budget'] / MiB:.2f}", "gate" if r["gate"] else "planner alone",
                       f"{r['estimated'] / MiB:.2f}", f"{r['broken']}/{r['pairs']}", f"{r['worst_a']:.4f}", r["worst"],
                       r["verdict"], r["steps"], r["changes"], f"{r['seconds']:.0f}"] for r in rows],
                     headers=["model", "fraction", "budget MiB", "plan", "estimated MiB", "B without A",
                              "worst A weight", "worst", "gate", "gate steps", "gate changes", "optimize s"],
                     tablefmt="github")
    command = "python -m tools.bench.planner.bench_coupled " + " ".join(sys.argv[1:])
    write_results(args.out, "Coupled units under a budget: depthwise blocks' BatchNorms planned together",
                  command.strip(), __doc__, table)


if __name__ == "__main__":
    main()
