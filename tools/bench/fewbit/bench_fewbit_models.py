"""python -m tools.bench.fewbit.bench_fewbit_models   (about 10 minutes on 2 CPU cores)

Benchmark: few-bit backward on a BERT-base-shaped encoder and a GELU MLP, stock vs 1-4 bits.

BERT-base shape: 12 pre-LN encoder blocks, hidden 768, 12 heads, FFN 3072 with GELU, dropout 0.1,
sequence 128, batch 8 (token embeddings as input). GELU MLP: 4 x Linear(2048) + GELU, batch 512.
For each: saved-activation bytes and peak (``memopt.measure``), step time (forward + backward,
median of 3, same process), and per-parameter gradient cosine / relative error vs stock autograd
(same inputs, same dropout masks). Writes docs/results/fewbit/fewbit_models.md.
"""
from __future__ import annotations

import argparse
import copy
import statistics
import time

import torch
import torch.nn.functional as F
from tabulate import tabulate
from torch import nn

import memopt
from memopt.core.units import fmt_bytes
from memopt.testing.zoo import EncoderBlock
from tools.bench.common import RESULTS, write_results_file


def bert_base():
    torch.manual_seed(0)
    return nn.Sequential(*[EncoderBlock(768, 12, 0.1) for _ in range(12)]).train(), torch.randn(8, 128, 768)


def gelu_mlp():
    torch.manual_seed(0)
    layers = []
    for _ in range(4):
        layers += [nn.Linear(2048, 2048), nn.GELU()]
    return nn.Sequential(*layers, nn.Linear(2048, 10)).train(), torch.randn(512, 2048)


def step_time(model, x, repeats=3):
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        model(x).square().mean().backward()
        times.append(time.perf_counter() - start)
        for p in model.parameters():
            p.grad = None
    return statistics.median(times)


def grad_agreement(model, om, x):
    reference = copy.deepcopy(model)
    torch.manual_seed(1)
    om(x).square().mean().backward()
    torch.manual_seed(1)
    reference(x).square().mean().backward()
    cos, rel = [], []
    for p, q in zip(model.parameters(), reference.parameters()):
        if q.grad is not None and q.grad.norm() > 0:
            cos.append(F.cosine_similarity(p.grad.flatten(), q.grad.flatten(), 0).item())
            rel.append(((p.grad - q.grad).norm() / q.grad.norm()).item())
    for p in model.parameters():
        p.grad = None
    return min(cos), statistics.median(rel), max(rel)


def run(name, build):
    rows = []
    model, x = build()
    loss = lambda out: out.square().mean()  # noqa: E731
    stock = memopt.measure(model, x, loss_fn=loss)
    stock_time = step_time(model, x)
    rows.append([name, "stock", fmt_bytes(stock.saved_bytes), "1.00", fmt_bytes(stock.peak_bytes), "1.00", "-", "-", "-"])
    for bits in (1, 2, 3, 4):
        om = memopt.optimize(model, example_inputs=x, config=memopt.Config(stash=None, fewbit=memopt.FewBitConfig(bits=bits)))
        m = memopt.measure(om, x, loss_fn=loss)
        assert m.saved_bytes == om.plan.estimated_saved_bytes, "the cost model must match the measurement"
        t = step_time(om, x)
        cos, med, worst = grad_agreement(model, om, x)
        rows.append([name, f"few-bit {bits}", fmt_bytes(m.saved_bytes), f"{m.saved_bytes / stock.saved_bytes:.3f}",
                     fmt_bytes(m.peak_bytes), f"{t / stock_time:.2f}", f"{cos:.4f}", f"{med:.4f}", f"{worst:.4f}"])
        print(rows[-1], flush=True)
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", default=str(RESULTS / "fewbit" / "fewbit_models.md"))
    args = parser.parse_args()
    rows = run("GELU MLP 4x2048, batch 512", gelu_mlp) + run("BERT-base shape, batch 8 x 128", bert_base)
    table = tabulate(rows, headers=["model", "config", "saved activations", "vs stock", "peak (CPU tracked)",
                                    "step time vs stock", "min grad cosine", "median rel err", "max rel err"],
                     tablefmt="github")
    text = (f"# Few-bit backward on whole models\n\nCommand: `python -m tools.bench.fewbit.bench_fewbit_models` (torch "
            f"{torch.__version__}, CPU, {torch.get_num_threads()} threads). Bytes from `memopt.measure` (equal to "
            f"the cost model's estimate, asserted); few-bit tables with the default weight "
            f"({memopt.FewBitConfig().weight!r}); step time is forward + backward, median of 3, as a ratio to "
            f"stock measured in the same process; gradient agreement per parameter tensor vs stock autograd.\n\n"
            f"{table}\n")
    write_results_file(args.out, text)


if __name__ == "__main__":
    main()
