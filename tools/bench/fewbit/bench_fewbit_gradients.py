"""python -m tools.bench.fewbit.bench_fewbit_gradients

Benchmark: gradient fidelity of few-bit backward, per table weight and bit width, on the zoo.

For each model with table activations and each FewBitConfig, one backward of a random linear
functional of the outputs (the same for stock and memopt) is compared per parameter tensor with
stock autograd: cosine similarity and relative error ||g - g_ref|| / ||g_ref||. Three input seeds.
Writes docs/results/fewbit/fewbit_gradients.md.
"""
from __future__ import annotations

import argparse
import copy
import statistics

import torch
import torch.nn.functional as F
from tabulate import tabulate

import memopt
from memopt.testing.zoo import build
from tools.bench.common import RESULTS, write_results_file

MODELS = ["mlp", "vit", "shared", "multi_io", "shape_branch"]
CONFIGS = [("uniform", b) for b in (1, 2, 3, 4)] + [("normal", 3)] + [("data", b) for b in (1, 2, 3, 4)]


def _leaves(out):
    return [t for t in torch.utils._pytree.tree_leaves(out) if isinstance(t, torch.Tensor) and t.is_floating_point()]


def _call(model, inputs):
    return model(**inputs) if isinstance(inputs, dict) else model(inputs)


def _perturb(inputs, seed):
    g = torch.Generator().manual_seed(seed)
    return torch.utils._pytree.tree_map(
        lambda t: torch.randn(t.shape, generator=g) * t.std() + t.mean() if isinstance(t, torch.Tensor) else t, inputs)


def gradient_errors(name: str, weight: str, bits: int, seed: int):
    model, inputs = build(name)
    inputs = _perturb(inputs, seed)
    reference = copy.deepcopy(model)
    om = memopt.optimize(model, example_inputs=inputs, config=memopt.Config(stash=None, fewbit=memopt.FewBitConfig(bits=bits, weight=weight)))
    torch.manual_seed(seed)
    out = _leaves(_call(om, inputs))
    gen = torch.Generator().manual_seed(seed + 1)
    probes = [torch.randn(t.shape, generator=gen) for t in out]
    sum((t * p).sum() for t, p in zip(out, probes)).backward()
    torch.manual_seed(seed)
    sum((t * p).sum() for t, p in zip(_leaves(_call(reference, inputs)), probes)).backward()
    cos, rel = [], []
    for p, q in zip(model.parameters(), reference.parameters()):
        if q.grad is None or q.grad.norm() == 0:
            continue
        cos.append(F.cosine_similarity(p.grad.flatten(), q.grad.flatten(), 0).item())
        rel.append(((p.grad - q.grad).norm() / q.grad.norm()).item())
    return min(cos), statistics.median(rel), max(rel), sum(n.technique == "fewbit" for n in om.plan.nodes)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", default=str(RESULTS / "fewbit" / "fewbit_gradients.md"))
    args = parser.parse_args()
    rows, summary = [], {}
    for weight, bits in CONFIGS:
        for name in MODELS:
            runs = [gradient_errors(name, weight, bits, seed) for seed in range(3)]
            min_cos = min(r[0] for r in runs)
            med_rel = statistics.median(r[1] for r in runs)
            max_rel = max(r[2] for r in runs)
            rows.append([weight, bits, name, runs[0][3], f"{min_cos:.4f}", f"{med_rel:.4f}", f"{max_rel:.4f}"])
            summary.setdefault((weight, bits), []).append((min_cos, max_rel))
    table = tabulate(rows, headers=["weight", "bits", "model", "rewritten", "min cosine", "median rel err",
                                    "max rel err"], tablefmt="github")
    overall = tabulate([[w, b, f"{min(c for c, _ in v):.4f}", f"{max(r for _, r in v):.4f}"]
                        for (w, b), v in summary.items()],
                       headers=["weight", "bits", "worst cosine (all models, seeds, params)", "worst rel err"],
                       tablefmt="github")
    text = (f"# Few-bit backward: gradient fidelity per table weight\n\nCommand: `python -m tools.bench.fewbit.bench_fewbit_gradients` "
            f"(torch {torch.__version__}, CPU). Per parameter tensor, vs stock autograd, over 3 input seeds; "
            f"the loss is a fixed random linear functional of the outputs.\n\n## Summary\n\n{overall}\n\n"
            f"## Per model\n\n{table}\n")
    write_results_file(args.out, text)


if __name__ == "__main__":
    main()
