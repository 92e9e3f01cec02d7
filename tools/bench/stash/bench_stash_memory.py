"""python -m tools.bench.stash.bench_stash_memory   (about 10 minutes)

Benchmark: saved-activation bytes, peak and step time with the exact-forward stash.

- Pre-activation ResNet-164 (basic blocks), 32x32, batch 128: stock vs stash at 8/4/2 bits, each
  with few-bit codes for the activations left over; measured with ``memopt.measure`` (real CPU run,
  equal to the cost model's estimate, asserted).
- torchvision ResNet-50, 224x224: batch 32 estimated on fake tensors, batch 4 measured for real.
- Step time (forward + backward) of ResNet-50 at batch 4 and 8, memopt / stock, interleaved in one run:
  with the fused CPU kernels (memopt/runtime/native.py) and with the plain-PyTorch codecs (MEMOPT_NATIVE=0's
  path), and the fixed per-step overhead (memopt - stock seconds at a 64x64 batch of 2, every BN a chain).
Writes docs/results/stash/stash_memory.md.
"""
from __future__ import annotations

import argparse

import torch
from tabulate import tabulate

import memopt
from memopt.runtime import native
from memopt.core.units import fmt_bytes
from memopt.record.timing import step_time_ratio
from memopt.testing.zoo import PreActResNet
from tools.bench.common import RESULTS, CheckpointBlocks, write_results_file

CONFIGS = [("stock", None)] + [(f"stash {b}-bit + few-bit", b) for b in (8, 4, 2)]


def _config(bits):
    return memopt.Config(stash=memopt.StashConfig(bits=bits))


def measured_rows(name, model, x):
    rows, stock = [], None
    for label, bits in CONFIGS:
        if bits is None:
            m = memopt.measure(model, x, optimizer="sgd")
            stock = m
        else:
            om = memopt.optimize(model, example_inputs=x, config=_config(bits), optimizer="sgd")
            m = memopt.measure(om, x, optimizer="sgd")
            assert m.saved_bytes == om.plan.estimated_saved_bytes and m.peak_bytes == om.plan.estimated_peak_bytes
        rows.append([name, label, fmt_bytes(m.saved_bytes), f"{stock.saved_bytes / m.saved_bytes:.2f}x",
                     fmt_bytes(m.peak_bytes), f"{stock.peak_bytes / m.peak_bytes:.2f}x"])
        print(rows[-1], flush=True)
    return rows


PEAK_PARTS = [("parameters and buffers", "parameters_and_buffers"), ("gradients", "gradients"),
              ("momentum", "optimizer_state"), ("input", "inputs"), ("activations (forward-born)", "activations"),
              ("backward temporaries", "transient")]


def estimated_rows(name, model, x, parts=None):
    """Rows of the estimated table; ``parts`` (a list) receives each config's peak broken down by what is alive."""
    rows, stock = [], None
    for label, bits in CONFIGS:
        cfg = memopt.Config.exact() if bits is None else _config(bits)
        om = memopt.optimize(model, example_inputs=x, config=cfg, optimizer="sgd")
        plan = om.plan
        if parts is not None:
            b = plan.estimated_breakdown
            parts.append([label] + [fmt_bytes(b.get(key, 0)) for _, key in PEAK_PARTS] +
                         [fmt_bytes(plan.estimated_peak_bytes)])
        stock = stock or plan
        rows.append([name, label, fmt_bytes(plan.estimated_saved_bytes),
                     f"{stock.estimated_saved_bytes / plan.estimated_saved_bytes:.2f}x",
                     fmt_bytes(plan.estimated_peak_bytes), f"{stock.estimated_peak_bytes / plan.estimated_peak_bytes:.2f}x"])
        print(rows[-1], flush=True)
    return rows


def step_ratio(model, x, repeats=5, config=None):
    om = memopt.optimize(model, example_inputs=x, config=config or _config(4))
    return step_time_ratio(om, model, x, repeats=repeats, warmup=1)


def step_overhead(model, repeats=9):
    """Seconds memopt adds to a step whose kernels cost almost nothing (64x64, batch 2, every BN a chain):
    the Python side of its autograd Functions."""
    x = torch.randn(2, 3, 64, 64)
    ratio, stock = step_ratio(model, x, repeats, memopt.Config(stash=memopt.StashConfig(bits=4, min_per_channel=1)))
    return (ratio - 1) * stock


def checkpoint_ratio(model, x, repeats=5):
    """torch.utils.checkpoint around every bottleneck block, against stock, in the same way."""
    ckpt = CheckpointBlocks(model, [b for layer in (model.layer1, model.layer2, model.layer3, model.layer4)
                                    for b in layer])
    try:
        return step_time_ratio(ckpt, model, x, repeats=repeats, warmup=0)
    finally:
        ckpt.restore()


def main() -> None:
    import torchvision

    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", default=str(RESULTS / "stash" / "stash_memory.md"))
    args = parser.parse_args()
    torch.manual_seed(0)
    rows = measured_rows("PreAct ResNet-164, 32x32, batch 128 (measured)", PreActResNet(164).train(),
                         torch.randn(128, 3, 32, 32))
    resnet50 = torchvision.models.resnet50().train()
    parts = []
    rows += estimated_rows("ResNet-50, 224x224, batch 32 (estimated)", resnet50,
                           torch.empty(32, 3, 224, 224, device="meta"), parts)
    rows += measured_rows("ResNet-50, 224x224, batch 4 (measured)", resnet50, torch.randn(4, 3, 224, 224))
    x4, x8 = torch.randn(4, 3, 224, 224), torch.randn(8, 3, 224, 224)
    kernels = native.available()
    ratio, stock_s = step_ratio(resnet50, x4)
    ratio8, stock8_s = step_ratio(resnet50, x8)
    overhead = step_overhead(resnet50)
    with native.disabled():
        plain, _ = step_ratio(resnet50, x4)
    ckpt_ratio, _ = checkpoint_ratio(resnet50, x4)
    table = tabulate(rows, headers=["model", "config", "saved activations", "fewer than stock", "peak (SGD step)",
                                    "peak smaller"], tablefmt="github")
    text = (f"# Exact-forward stash: memory and time\n\nCommand: `python -m tools.bench.stash.bench_stash_memory` (torch "
            f"{torch.__version__}, CPU, {torch.get_num_threads()} threads). Saved bytes and peak of one training step "
            f"with SGD-momentum (parameters, gradients and optimizer state included in the peak). Measured rows come "
            f"from `memopt.measure` and equal the cost model's estimate (asserted).\n\n{table}\n\n"
            f"Step time (forward + backward) of ResNet-50, 224x224, stash 4-bit + few-bit vs stock, interleaved in one "
            f"process, median of 5 after one warm-up step, fused CPU kernels "
            f"{'on' if kernels else 'NOT AVAILABLE (plain path)'}: batch 4 **{ratio:.2f}x** (stock {stock_s:.2f} s per "
            f"step), batch 8 **{ratio8:.2f}x** (stock {stock8_s:.2f} s); batch 4 with the plain-PyTorch codecs "
            f"(`MEMOPT_NATIVE=0`): {plain:.2f}x; torch.utils.checkpoint around every bottleneck block, measured the "
            f"same way at batch 4: {ckpt_ratio:.2f}x. What memopt adds to a step whose kernels cost almost nothing "
            f"(64x64, batch 2, every BN a chain, 99 rewritten nodes): {overhead * 1e3:.0f} ms, the Python side of "
            f"its autograd Functions (wrappers, ctypes calls, small per-channel tensor ops).\n\n"
            f"## Where the peak goes (ResNet-50, batch 32, estimated)\n\nWhat is alive at the step's peak, from the "
            f"cost model's breakdown (`Plan.estimated_breakdown`): forward-born storages still alive are activations "
            f"(saved codes and statistics, plus any forward output not yet freed), storages born in backward are "
            f"temporaries (gradients of activations, rebuilt inputs, workspaces).\n\n"
            f"{tabulate(parts, headers=['config'] + [p for p, _ in PEAK_PARTS] + ['peak'], tablefmt='github')}\n")
    write_results_file(args.out, text)


if __name__ == "__main__":
    main()
