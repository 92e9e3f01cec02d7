# python -m tools.bench.planner.bench_budget_fidelity --threads 1   (about 25 minutes on a 2-core CPU)
"""python -m tools.bench.planner.bench_budget_fidelity --threads 1   (about 25 minutes on a 2-core CPU)

Benchmark: the budget planner's policy (``Config.prefer``) swept over budgets, with the fidelity gate on.

For each model (random weights), budgets from near the baseline's estimated peak down to the least the planner
reaches (``BudgetError.minimum_bytes`` with the default config), and for each of prefer="balanced" (the
default), "fidelity" and "speed": the plan's estimated peak and the measured peak of a real SGD step
(``memopt.measure``), the techniques chosen (units per technique and bits), the fidelity gate's verdict and the
worst per-parameter gradient cosine against exact autograd of the whole batch (the loss of the gate: fixed random
projections of the output; parameters whose exact gradient is below 1e-3 of the median norm are left out, their
true gradient is ~0), and the step time (forward + backward) over stock's, interleaved step by step in this
process. A budget a policy cannot meet with every gradient at cosine >= 0.99 shows the least peak it names.
The ViT is the memopt zoo's TinyViT at ViT-S width (pre-LN blocks, GELU MLP, dropout 0.1, no class token):
timm's vit_small_patch16_224 blocks take ``attn_mask=None`` as an input, which the recompute pass refuses ("it
reads attn_mask, which is not a single tensor"), so no policy could recompute them.

The calibration line fits ``memopt.passes.planning.knapsack.FLOPS_PER_PASS`` (FLOPs per element pass) on this machine:
with every lossy technique at its defaults (no budget), k = (ratio - 1) x 3 x forward FLOPs / element passes,
where the element passes are the plan's (``Option.time`` of its lossy units) and a stock step takes about three
forwards' FLOPs (backward ~ twice forward).
"""
from __future__ import annotations

import argparse
import collections
import copy
import subprocess
import time
from typing import Any, Callable, Dict, List, Tuple

import torch
from tabulate import tabulate
from torch import nn

import memopt
from memopt.core.inputs import normalize_inputs
from memopt.core.units import fmt_bytes
from memopt.fidelity.gate import RandomProjection, parameter_fidelity
from memopt.record.plan import option_decisions
from memopt.passes.planning.knapsack import FLOPS_PER_PASS
from memopt.testing.zoo import TinyViT
from memopt.record.timing import step_time_ratio
from tools.bench.common import write_results

MiB = 2 ** 20
PREFER = ("balanced", "fidelity", "speed")
FRACTIONS = (0.9, 0.7, 0.5, 0.3, 0.1, 0.0)  # of the way from the least reachable peak up to the baseline's


def _models() -> Dict[str, Tuple[Callable[[], nn.Module], Callable[[], Any]]]:
    import torchvision
    import transformers as T

    bert = T.BertConfig(vocab_size=1000, hidden_size=256, num_hidden_layers=6, num_attention_heads=4,
                        intermediate_size=1024)
    return {
        "torchvision ResNet-50, 96x96, batch 4": (torchvision.models.resnet50, lambda: torch.randn(4, 3, 96, 96)),
        "torchvision MobileNetV2, 96x96, batch 8": (torchvision.models.mobilenet_v2,
                                                   lambda: torch.randn(8, 3, 96, 96)),
        "HF BERT, 6 layers, hidden 256, batch 4 x 128 tokens": (
            lambda: T.BertModel(bert), lambda: {"input_ids": torch.randint(0, 1000, (4, 128))}),
        "ViT-S shape (zoo TinyViT: d 384, 6 heads, MLP 1536), depth 6, 128x128 / 16, batch 8": (
            lambda: TinyViT(d=384, depth=6, heads=6, patch=16, image=128), lambda: torch.randn(8, 3, 128, 128)),
    }


def _first(output: Any) -> torch.Tensor:
    return output if isinstance(output, torch.Tensor) else output[0]


def _loss(output: Any) -> torch.Tensor:
    return _first(output).float().logsumexp(-1).mean()


def _grads(net: nn.Module, params: nn.Module, x: Any) -> List[torch.Tensor]:
    args, kwargs = normalize_inputs(x)
    params.zero_grad(set_to_none=True)
    torch.manual_seed(0)
    RandomProjection(seed=3)(_first(net(*args, **kwargs))).backward()
    return [p.grad.detach().clone() if p.grad is not None else None for p in params.parameters()]


def _worst(model: nn.Module, reference: List[torch.Tensor], got: List[torch.Tensor]) -> float:
    names = [n for n, _ in model.named_parameters()]
    return min(f["cosine"] for f in parameter_fidelity(names, reference, got, 1e-3).values() if not f["tiny"])


def _chosen(om) -> str:
    counts = collections.Counter((t, b) for u in om.plan.units for t, _, b in option_decisions(u["chosen"]))
    return ", ".join(f"{t}{'' if b is None else '@' + str(b)} {n}" for (t, b), n in sorted(counts.items(), key=str)) \
        or "nothing"


def calibrate(name: str, make, inputs, repeats: int) -> Dict[str, Any]:
    """FLOPs per element pass on this machine, from the default config's step time (see the docstring)."""
    torch.manual_seed(0)
    model, x = make().train(), inputs()
    om = memopt.optimize(model, example_inputs=x, optimizer="sgd")
    passes = sum(u["chosen"]["time"] for u in om.plan.units if u["chosen"]["technique"] in ("stash", "fewbit"))
    from memopt.capture.trace import capture
    from memopt.cost_model.analysis import annotate

    args, kwargs = normalize_inputs(x)
    flops = sum(c.flops for c in annotate(capture(model, args, kwargs).graph_module, args, kwargs,
                                          simulate=False).nodes.values())
    ratio, stock = step_time_ratio(om, model, x, repeats=repeats, loss_fn=_loss)
    return {"model": name, "ratio": ratio, "stock_s": stock, "passes": passes, "flops": flops,
            "k": (ratio - 1) * 3 * flops / passes if passes else float("nan")}


def sweep(name: str, make, inputs, repeats: int, fractions) -> Tuple[int, int, List[Dict[str, Any]]]:
    torch.manual_seed(0)
    model, x = make().train(), inputs()
    baseline = memopt.estimate(model, x, optimizer="sgd").peak_bytes
    try:
        memopt.optimize(copy.deepcopy(model), 1e-6, example_inputs=x, optimizer="sgd")
        raise AssertionError("a 1-byte budget was met")
    except memopt.BudgetError as e:
        least = e.minimum_bytes
    reference = _grads(model, model, x)
    rows = []
    for fraction in fractions:
        budget = max(least + fraction * (baseline - least), least + 1024)
        for prefer in PREFER:
            row = {"model": name, "fraction": fraction, "budget": budget, "prefer": prefer}
            start = time.perf_counter()
            try:
                om = memopt.optimize(model, budget / MiB, example_inputs=x, optimizer="sgd",
                                     config=memopt.Config(prefer=prefer))
            except memopt.BudgetError as e:
                row.update(error=e.minimum_bytes, plan_s=time.perf_counter() - start)
                rows.append(row)
                print(row, flush=True)
                continue
            gate = om.plan.fidelity or {}
            row.update(plan_s=time.perf_counter() - start, estimated=om.plan.estimated_peak_bytes,
                       measured=memopt.measure(om, x, loss_fn=_loss, optimizer="sgd").peak_bytes,
                       chosen=_chosen(om), gate="not run (nothing lossy)" if not gate else
                       ("passed" if gate["passed"] else "FAILED"),
                       worst=_worst(model, reference, _grads(om, model, x)),
                       ratio=step_time_ratio(om, model, x, repeats=repeats, loss_fn=_loss)[0])
            rows.append(row)
            print({k: v for k, v in row.items()}, flush=True)
    return baseline, least, rows


def _table(rows: List[Dict[str, Any]]) -> str:
    out = []
    for r in rows:
        head = [f"{r['budget'] / MiB:.1f}", r["prefer"]]
        if "error" in r:
            out.append(head + ["BudgetError", "", f"least {r['error'] / MiB:.1f}", "", "", "", f"{r['plan_s']:.0f}"])
            continue
        out.append(head + [f"{r['estimated'] / MiB:.1f}", f"{r['measured'] / MiB:.1f}", r["chosen"], r["gate"],
                           f"{r['worst']:.4f}", f"{r['ratio']:.2f}", f"{r['plan_s']:.0f}"])
    return tabulate(out, headers=["budget MiB", "prefer", "estimated MiB", "measured MiB", "chosen (units)",
                                  "gate", "worst param cosine", "step time / stock", "planning s"],
                    tablefmt="github")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--only", default="", help="run only the models whose name contains this")
    parser.add_argument("--fractions", default=",".join(map(str, FRACTIONS)))
    parser.add_argument("--out", default="docs/results/planner/budget_fidelity.md")
    parser.add_argument("--threads", type=int, default=0, help="torch intra-op threads (default: torch's)")
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    fractions = [float(f) for f in args.fractions.split(",")]
    started = time.perf_counter()
    sections, summary = [], []
    models = {k: v for k, v in _models().items() if args.only in k}
    first = next(iter(models.items()))
    fit = calibrate(first[0], *first[1], args.repeats)
    print(fit, flush=True)
    for name, (make, inputs) in models.items():
        baseline, least, rows = sweep(name, make, inputs, args.repeats, fractions)
        sections += [f"## {name}", "", f"Baseline estimated peak {fmt_bytes(baseline)}; least reachable "
                     f"{fmt_bytes(int(least))}.", "", _table(rows), ""]
        for prefer in PREFER:
            done = [r for r in rows if r["prefer"] == prefer and "error" not in r]
            summary.append([name, prefer, f"{len(done)}/{len(fractions)}",
                            f"{min((r['worst'] for r in done), default=float('nan')):.4f}",
                            sum("recompute" in r["chosen"] for r in done),
                            f"{min((r['measured'] for r in done), default=float('nan')) / MiB:.1f}",
                            f"{max((r['ratio'] for r in done), default=float('nan')):.2f}"])
    try:  # read-only git: the commit, and the files the working tree changes against it
        git = lambda *a: subprocess.run(["git", *a], capture_output=True, text=True).stdout.split()  # noqa: E731
        commit = " ".join(git("rev-parse", "--short", "HEAD"))
        changed = git("diff", "--name-only", "HEAD")
        commit += f" with uncommitted changes to {', '.join(changed)}" if changed else ""
    except OSError:
        commit = "unknown"
    command = (f"python -m tools.bench.planner.bench_budget_fidelity --repeats {args.repeats}"
               f"{' --only ' + repr(args.only) if args.only else ''}"
               f"{' --fractions ' + args.fractions if args.fractions != ','.join(map(str, FRACTIONS)) else ''}"
               f"{' --threads ' + str(args.threads) if args.threads else ''}"
               f"{' --out ' + args.out if args.out != 'docs/results/planner/budget_fidelity.md' else ''}")
    body = [f"Commit {commit}; {time.perf_counter() - started:.0f} s in all. Budgets: the least reachable peak plus "
            f"{', '.join(map(str, fractions))} of the way up to the baseline's. Peaks are of one SGD (momentum) step.",
            "", "## Summary", "",
            tabulate(summary, headers=["model", "prefer", "budgets met", "worst param cosine (all budgets)",
                                       "plans with recomputation", "least measured peak MiB", "slowest step / stock"],
                     tablefmt="github"), "",
            "## Calibration of FLOPS_PER_PASS", "",
            f"{fit['model']}, every technique at its defaults: step {fit['ratio']:.2f}x stock ({fit['stock_s']:.2f} s), "
            f"{fit['passes']:.3g} element passes of codecs, {fit['flops']:.3g} forward FLOPs: "
            f"k = ({fit['ratio']:.2f} - 1) x 3 x {fit['flops']:.3g} / {fit['passes']:.3g} = **{fit['k']:.0f}** FLOPs per "
            f"element pass (the planner uses {FLOPS_PER_PASS['cpu']:.0f} on CPU, {FLOPS_PER_PASS['cuda']:.0f} on CUDA).",
            ""] + sections
    write_results(args.out, "Budget sweeps by planner policy (Config.prefer)", command, __doc__, "\n".join(body))


if __name__ == "__main__":
    main()
