"""python -m tools.bench.cost_model.bench_estimate

Benchmark: the cost model against real CPU runs on the test zoo, and planning time at scale.

Writes docs/results/cost_model/estimate_vs_measure.md.
"""
from __future__ import annotations

import argparse
import platform
import time

import torch
from tabulate import tabulate

import memopt
from memopt.core.units import fmt_bytes
from memopt.testing.zoo import ZOO, build
from tools.bench.common import RESULTS, write_results_file


def zoo_rows():
    rows = []
    for name in ZOO:
        model, inputs = build(name)
        start = time.perf_counter()
        est = memopt.estimate(model, inputs, optimizer="adam")
        est_s = time.perf_counter() - start
        start = time.perf_counter()
        real = memopt.measure(model, inputs, optimizer="adam")
        real_s = time.perf_counter() - start
        rows.append([name, est.plan.capture, fmt_bytes(est.saved_bytes), fmt_bytes(real.saved_bytes),
                     f"{est.saved_bytes / real.saved_bytes:.4f}", fmt_bytes(est.peak_bytes),
                     fmt_bytes(real.peak_bytes), f"{est.peak_bytes / real.peak_bytes:.4f}",
                     f"{est_s:.2f}", f"{real_s:.2f}"])
    return rows


def scale_rows(batches):
    import torchvision

    model = torchvision.models.resnet50().train()
    small = torch.randn(2, 3, 224, 224)
    real_small = memopt.measure(model, small).saved_bytes
    rows = []
    for b in batches:
        x = torch.empty(b, 3, 224, 224, device="meta")
        start = time.perf_counter()
        est = memopt.estimate(model, x, optimizer="sgd")
        seconds = time.perf_counter() - start
        rows.append([b, fmt_bytes(est.saved_bytes), fmt_bytes(real_small * b // 2),
                     f"{est.saved_bytes / (real_small * b / 2):.4f}", fmt_bytes(est.peak_bytes), f"{seconds:.2f}"])
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", default=str(RESULTS / "cost_model" / "estimate_vs_measure.md"))
    args = parser.parse_args()
    torch.manual_seed(0)
    zoo = tabulate(zoo_rows(), headers=["model", "capture", "saved est", "saved real", "ratio", "peak est",
                                        "peak real", "ratio", "estimate s", "measure s"], tablefmt="github")
    scale = tabulate(scale_rows([2, 32, 256]), headers=["batch", "saved est", "real batch-2 x b/2", "ratio",
                                                          "peak est (SGD)", "estimate s"], tablefmt="github")
    text = (f"# Cost model vs real CPU runs\n\nCommand: `python -m tools.bench.cost_model.bench_estimate` on {platform.machine()}, "
            f"{torch.get_num_threads()} threads, torch {torch.__version__}.\n\n"
            f"## Test zoo, one training step with Adam (estimate on fake tensors, measure on real ones)\n\n"
            f"{zoo}\n\n## torchvision ResNet-50, 224x224, estimated on fake tensors (meta inputs)\n\n"
            f"Real run at batch 2 scaled linearly; the small gap is the per-channel BN statistics, which do "
            f"not scale with the batch.\n\n{scale}\n")
    write_results_file(args.out, text)


if __name__ == "__main__":
    main()
