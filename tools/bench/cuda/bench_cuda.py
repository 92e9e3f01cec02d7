"""python -m tools.bench.cuda.bench_cuda   (on a machine with a GPU; about 3 minutes on an H200 before the Triton rows)

Benchmark on a CUDA GPU: saved bytes, peak and step time of memopt vs stock vs torch.utils.checkpoint.

For torchvision ResNet-50 (224x224, batches 32 and 128) and a pre-activation ResNet-164 (32x32, batch 128),
with SGD-momentum: saved activations (``memopt.measure``, asserted equal to the estimate), the step's peak
from the caching allocator (``torch.cuda.max_memory_allocated`` less other tensors' memory) beside the
cost model's estimate, and the step time relative to stock (forward + backward, interleaved step by step
in one process, each step synchronised, median of 10 after 3 warm-ups; cuDNN autotuning on, as users run).
Then ``memopt.optimize(model, budget_mb=...)`` at half and a quarter of stock's peak: measured peak vs budget.

The default config runs twice: with the default kernels (plain PyTorch on CUDA) and with ``MEMOPT_KERNELS=triton``
(``memopt.runtime.kernels``: few-bit's and the stash's Triton kernels, opt-in until they have run on a GPU). The
Triton row's label says whether one step's gradients are bit-identical to the default's (cuDNN and PyTorch in
deterministic mode for that check; the largest difference otherwise), which is the first check of those kernels
compiled on a GPU; the first steps include their compilation (warm-ups take it out of the timing).

Writes docs/results/cuda/cuda.md after every row (a run cut short keeps what it measured). Without a GPU,
``--device cpu --smoke --out /tmp/cuda.md`` checks the script itself (the Triton row under TRITON_INTERPRET=1 only).
"""
from __future__ import annotations

import argparse
import copy
import time

import torch
from tabulate import tabulate

import memopt
from memopt.runtime import kernels, triton_fewbit
from memopt.testing.zoo import PreActResNet
from memopt.timing import step_time_ratio
from tools.bench.common import RESULTS, CheckpointBlocks, write_results_file

MiB = 2 ** 20


def _models(smoke: bool):
    import torchvision

    def resnet50(batch, size=224):
        m = torchvision.models.resnet50()
        return (f"ResNet-50, {size}x{size}, batch {batch}", m, torch.randn(batch, 3, size, size),
                [b for layer in (m.layer1, m.layer2, m.layer3, m.layer4) for b in layer])

    def preact(depth, batch):
        m = PreActResNet(depth)
        return f"PreAct ResNet-{depth}, 32x32, batch {batch}", m, torch.randn(batch, 3, 32, 32), list(m.blocks)

    if smoke:  # the script's own check on any device: small and quick
        return {"resnet50": lambda: resnet50(2, 64), "preact": lambda: preact(20, 8)}
    return {"resnet50_b32": lambda: resnet50(32), "resnet50_b128": lambda: resnet50(128),
            "preact164": lambda: preact(164, 128)}


# (label, config, MEMOPT_KERNELS for the row: None is the default)
CONFIGS = [("memopt Config() (default)", memopt.Config(), None),
           ("memopt Config(), MEMOPT_KERNELS=triton", memopt.Config(), "triton"),
           ("stash 8-bit + few-bit", memopt.Config(stash=memopt.StashConfig(bits=8)), None),
           ("stash 2-bit + few-bit", memopt.Config(stash=memopt.StashConfig(bits=2)), None)]


def _triton_runs(device: str) -> str:
    """Why the Triton row cannot run here ("" when it can): triton missing, or a CPU without the interpreter."""
    if not triton_fewbit.AVAILABLE:
        return f"skipped: triton does not import ({triton_fewbit.IMPORT_ERROR[:80]})"
    if device == "cpu" and not triton_fewbit.interpreting():
        return "skipped: CPU without TRITON_INTERPRET=1"
    return ""


def _gradients_match(model, x, cfg) -> str:
    """One step's gradients with MEMOPT_KERNELS=triton against the default kernels, in deterministic mode (cuDNN
    and PyTorch's own kernels: otherwise atomics reorder sums and no two runs agree): "bit-identical", or the
    largest difference."""
    flags = torch.backends.cudnn.deterministic, torch.backends.cudnn.benchmark, \
        torch.are_deterministic_algorithms_enabled()
    torch.backends.cudnn.deterministic, torch.backends.cudnn.benchmark = True, False
    torch.use_deterministic_algorithms(True, warn_only=True)
    grads = []
    try:
        for choice in (None, "triton"):
            with kernels.forced(choice):
                m = copy.deepcopy(model)
                om = memopt.optimize(m, example_inputs=x, config=cfg)
                torch.manual_seed(0)
                om(x).float().square().mean().backward()
                grads.append([p.grad.detach().clone() for p in m.parameters() if p.grad is not None])
                del om, m
    finally:
        torch.backends.cudnn.deterministic, torch.backends.cudnn.benchmark = flags[:2]
        torch.use_deterministic_algorithms(flags[2])
    if len(grads[0]) != len(grads[1]):
        return f"gradients of {len(grads[0])} vs {len(grads[1])} parameters"
    if all(torch.equal(a, b) for a, b in zip(*grads)):
        return "gradients bit-identical to the default"
    worst = max(float((a.float() - b.float()).abs().max()) for a, b in zip(*grads))
    return f"gradients DIFFER from the default: max abs difference {worst:.3g}"


def _row(name, label, m, stock, est_peak, ratio, plan_s=None):
    return [name, label, f"{m.saved_bytes / MiB:.1f}", f"{stock.saved_bytes / m.saved_bytes:.2f}x",
            f"{m.peak_bytes / MiB:.1f}", "" if est_peak is None else f"{est_peak / MiB:.1f}",
            f"{stock.peak_bytes / m.peak_bytes:.2f}x", f"{ratio:.2f}x", "" if plan_s is None else f"{plan_s:.1f}"]


def bench_model(build, rows, budget_rows, device, save):
    name, model, x, blocks = build()
    model, x = model.to(device).train(), x.to(device)
    stock = memopt.measure(model, x, optimizer="sgd")
    est = memopt.estimate(model, x, optimizer="sgd")
    assert stock.saved_bytes == est.saved_bytes, (stock.saved_bytes, est.saved_bytes)
    _, stock_s = step_time_ratio(model, model, x, repeats=3, warmup=2)
    rows.append(_row(name, f"stock ({stock_s * 1000:.0f} ms/step)", stock, stock, est.peak_bytes, 1.0))
    print(rows[-1], flush=True)
    save()
    for label, cfg, choice in CONFIGS:
        if choice == "triton":
            why_not = _triton_runs(device)
            if why_not:
                rows.append([name, f"{label} ({why_not})"] + [""] * 7)
                save()
                continue
            label = f"{label} ({_gradients_match(model, x, cfg)})"
        with kernels.forced(choice):
            start = time.perf_counter()
            om = memopt.optimize(model, example_inputs=x, config=cfg, optimizer="sgd")
            plan_s = time.perf_counter() - start
            m = memopt.measure(om, x, optimizer="sgd")
            assert m.saved_bytes == om.plan.estimated_saved_bytes, (label, m.saved_bytes,
                                                                    om.plan.estimated_saved_bytes)
            ratio, _ = step_time_ratio(om, model, x, repeats=10, warmup=3)
        rows.append(_row(name, label, m, stock, om.plan.estimated_peak_bytes, ratio, plan_s))
        print(rows[-1], flush=True)
        save()
        del om
    ckpt = CheckpointBlocks(model, blocks)
    m = memopt.measure(ckpt, x, optimizer="sgd")
    ratio, _ = step_time_ratio(ckpt, model, x, repeats=10, warmup=3)
    rows.append(_row(name, "torch.utils.checkpoint, every block", m, stock, None, ratio))
    print(rows[-1], flush=True)
    save()
    ckpt.restore()
    for frac in (0.5, 0.25):
        budget = frac * stock.peak_bytes / MiB
        try:
            om = memopt.optimize(model, budget_mb=budget, example_inputs=x, optimizer="sgd")
            m = memopt.measure(om, x, optimizer="sgd")
        except memopt.MemoptError as e:  # refused loudly: say so in the table
            budget_rows.append([name, f"{budget:.0f} ({frac:.2f} x stock)", "", "", f"refused: {str(e)[:120]}", ""])
            save()
            continue
        ratio, _ = step_time_ratio(om, model, x, repeats=10, warmup=3)
        budget_rows.append([name, f"{budget:.0f} ({frac:.2f} x stock)", f"{om.plan.estimated_peak_bytes / MiB:.1f}",
                            f"{m.peak_bytes / MiB:.1f}", "yes" if m.peak_bytes <= budget * MiB else "NO",
                            f"{ratio:.2f}x"])
        print(budget_rows[-1], flush=True)
        save()
        del om
    del model, x
    if device == "cuda":
        torch.cuda.empty_cache()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", default=str(RESULTS / "cuda" / "cuda.md"))
    parser.add_argument("--device", default="cuda", help="cuda (default); cpu only with --smoke")
    parser.add_argument("--smoke", action="store_true", help="small models: checks the script itself")
    parser.add_argument("--models", default="", help="comma-separated keys: resnet50_b32,resnet50_b128,preact164")
    args = parser.parse_args()
    if args.device == "cuda" and not torch.cuda.is_available():
        raise SystemExit("tools.bench.cuda.bench_cuda needs a CUDA GPU (torch.cuda.is_available() is False)")
    torch.backends.cudnn.benchmark = True
    torch.manual_seed(0)
    rows, budget_rows = [], []
    models = _models(args.smoke)
    for key in (args.models.split(",") if args.models else models):
        # the file is rewritten after every row: a run cut short keeps what it measured
        bench_model(models[key], rows, budget_rows, args.device, lambda: _write(args, rows, budget_rows))


def _write(args, rows, budget_rows) -> None:
    table = tabulate(rows, headers=["model", "config", "saved MiB (measured = estimated)", "fewer than stock",
                                    "peak MiB (measured)", "peak MiB (estimated)", "peak smaller", "step time / stock",
                                    "optimize() s"], tablefmt="github")
    budgets = tabulate(budget_rows, headers=["model", "budget MiB", "planned peak MiB", "measured peak MiB",
                                             "fits", "step time / stock"], tablefmt="github")
    where = torch.cuda.get_device_name() if args.device == "cuda" else "CPU smoke run"
    command = "python -m tools.bench.cuda.bench_cuda" + (f" --models {args.models}" if args.models else "")
    text = (f"# memopt on a CUDA GPU\n\nCommand: `{command}` ({where}, torch {torch.__version__}, cuDNN "
            f"{torch.backends.cudnn.version()}). One SGD-momentum training step; saved bytes from `memopt.measure` "
            f"(asserted equal to the cost model's estimate); measured peak from the caching allocator "
            f"(`torch.cuda.max_memory_allocated` during the step, less other tensors' memory, cuDNN workspaces "
            f"included); step time forward + backward, interleaved with stock step by step, median of 10, cuDNN "
            f"autotuning on. The `MEMOPT_KERNELS=triton` row runs few-bit's and the stash's Triton kernels "
            f"(`memopt.runtime.kernels`); its label says whether one step's gradients match the default's bit for "
            f"bit (deterministic mode for that check).\n\n{table}\n\n## Budgets\n\n"
            f"`memopt.optimize(model, budget_mb=B)` with B half and a "
            f"quarter of stock's measured peak.\n\n{budgets}\n")
    write_results_file(args.out, text)


if __name__ == "__main__":
    main()
