"""python -m tools.bench.reversible.bench_reversible   (about 10 minutes on 2 CPU cores)

Reversible segments: the evidence of issue 5 (activation memory flat in depth, bytes per pixel,
reconstruction and gradient error vs depth, step time, training parity).

Sections (``--only`` picks some; each writes its own results file under docs/results/reversible/):

- ``memory`` -> reversible_memory.md: saved activation bytes and peak of one training step (forward +
  backward, no optimizer) vs depth for the RevNet-style CNN (``RevNetCNN((d/2, d/2), width=16)``, two
  stages joined by pixel unshuffle) and the reversible transformer (``RevTransformer(d, dim=32)``, 4x4
  patches of 16x16 images), stock autograd vs memopt with only the reversible pass
  (``Config(stash=None, fewbit=None)``). Estimated on meta tensors at ``--meta-batch`` (segments
  are "not checked" there, so no anchors), measured with ``memopt.measure`` at ``--real-batch`` for
  ``--measured-depths`` (where the plan-time check runs and may cut segments into pieces: counted).
- ``pixel`` -> reversible_pixel.md: peak training memory (SGD with momentum) / (batch x 32 x 32) of
  CIFAR-size reversible CNNs (RevNetCNN, three stages), estimated at batch ``--px-batch`` on meta
  tensors and measured at a small real batch, with the plan's breakdown.
- ``error`` -> reversible_error.md: the segment as the pass builds it (planned on meta inputs, so
  not cut), run on real inputs: relative error of every rebuilt stream state (worst, and at the
  segment input) and per-parameter gradient error of the segment's Function vs plain autograd
  through the same steps, float32 and with bfloat16 autocast around forward and backward; plus
  bfloat16 autocast with ``backward()`` called *outside* the autocast context (the usual way to
  write a training loop).
- ``time`` -> reversible_time.md: step time (forward + backward) of memopt and of
  ``torch.utils.checkpoint`` around every RevBlock, relative to stock, RevNetCNN((4, 4), width=16) at
  ``--time-batches`` (``--threads``; runs last).
- ``parity`` -> reversible_training.md: scikit-learn digits (8x8, 1 channel), RevNetCNN((2, 2),
  width=16, in_channels=1), stock vs memopt, Adam lr 1e-3, batch 64, ``--epochs``, 3 seeds (same
  initial weights and data order within a seed).

The PNG docs/results/reversible/reversible_depth.png shows saved bytes vs depth (both models) and the error
vs depth. The full sweep: --measured-depths 8,16,32,64 (7 more minutes). ``--only plot`` redraws the PNG from the last
memory/error run (cached in the temp directory).
"""
from __future__ import annotations

import argparse
import copy
import json
import os
import statistics
import subprocess
import tempfile
import time
from pathlib import Path

import torch
from tabulate import tabulate
from torch import nn

import memopt
from memopt import Config
from memopt.reversible.ops import relative_error, reversible_segment, run_forward, undo_steps
from memopt.reversible.check import Examples, true_values
from memopt.core.state import preserved_state
from memopt.record.timing import step_time_ratio
from memopt.testing.reversible_zoo import RevBlock, RevNetCNN
from tools.bench.common import RESULTS, digits, fit_and_test, write_results_file
from tools.bench.reversible.common import (MiB, ONLY_REVERSIBLE, calls_of, couplings_rewritten, depth_sweep, header,
                                           installed_segment, not_rewritten_reasons, plot, random_steps)


# ---------------------------------------------------------------- memory vs depth
def memory(args) -> dict:
    rows, series = [], {}
    for kind, label, blocks, model, size in depth_sweep(args.depths):
            t0 = time.time()
            meta = torch.empty(args.meta_batch, 3, size, size, device="meta")
            om = memopt.optimize(model, config=Config(**ONLY_REVERSIBLE), example_inputs=meta)
            p = om.plan
            entry = {"blocks": blocks, "stock_est": p.baseline_saved_bytes, "ours_est": p.estimated_saved_bytes,
                     "stock_peak_est": p.baseline_peak_bytes, "ours_peak_est": p.estimated_peak_bytes,
                     "pieces_est": len(calls_of(om)), "rewritten_est": couplings_rewritten(om),
                     "rng_bytes": random_steps(om) * torch.get_rng_state().numel()}
            rows.append([label, blocks, 2 * blocks, f"estimated, meta batch {args.meta_batch}",
                         f"{p.baseline_saved_bytes / MiB:.1f}", f"{p.estimated_saved_bytes / MiB:.2f}",
                         f"{p.baseline_saved_bytes / p.estimated_saved_bytes:.1f}x",
                         f"{p.baseline_peak_bytes / MiB:.1f}", f"{p.estimated_peak_bytes / MiB:.1f}",
                         f"{entry['pieces_est']} / {entry['rewritten_est']}"])
            print(rows[-1], f"{time.time() - t0:.1f}s", flush=True)
            if blocks in args.measured_depths:
                t0 = time.time()
                torch.manual_seed(1)
                x = torch.randn(args.real_batch, 3, size, size)
                stock = memopt.measure(model, x)
                om = memopt.optimize(model, config=Config(**ONLY_REVERSIBLE), example_inputs=x)
                ours = memopt.measure(om, x)
                entry.update(stock_meas=stock.saved_bytes, ours_meas=ours.saved_bytes, stock_peak_meas=stock.peak_bytes,
                             ours_peak_meas=ours.peak_bytes, ours_est_real=om.plan.estimated_saved_bytes,
                             ours_peak_est_real=om.plan.estimated_peak_bytes, pieces=len(calls_of(om)),
                             rewritten=couplings_rewritten(om), real_batch=args.real_batch, reasons=not_rewritten_reasons(om),
                             checks=sorted({n.reason for n in om.plan.nodes if n.technique == "reversible"}))
                est_ok = "=" if (om.plan.estimated_saved_bytes == ours.saved_bytes
                                 and om.plan.estimated_peak_bytes == ours.peak_bytes) else "!= estimate"
                rows.append([label, blocks, 2 * blocks, f"measured, real batch {args.real_batch} ({est_ok})",
                             f"{stock.saved_bytes / MiB:.2f}", f"{ours.saved_bytes / MiB:.3f}",
                             f"{stock.saved_bytes / ours.saved_bytes:.1f}x", f"{stock.peak_bytes / MiB:.2f}",
                             f"{ours.peak_bytes / MiB:.2f}", f"{entry['pieces']} / {entry['rewritten']}"])
                print(rows[-1], f"{time.time() - t0:.1f}s", entry["checks"], entry["reasons"], flush=True)
            series.setdefault(kind, []).append(entry)
    flat = []
    for kind, entries in series.items():
        lo, hi = entries[0], entries[-1]
        flat.append(f"- {kind}: memopt estimated saved bytes {hi['blocks']} / {lo['blocks']} blocks = "
                    f"{hi['ours_est'] / lo['ours_est']:.3f} (stock {hi['stock_est'] / lo['stock_est']:.2f}); "
                    f"peak {hi['ours_peak_est'] / lo['ours_peak_est']:.3f} (stock "
                    f"{hi['stock_peak_est'] / lo['stock_peak_est']:.2f}).")
        if hi["rng_bytes"]:
            flat.append(f"  of which RNG states of steps flagged random (nn.Dropout in H, here p=0): "
                        f"{lo['rng_bytes'] / 1024:.0f} KiB at {lo['blocks']} blocks, {hi['rng_bytes'] / 1024:.0f} KiB at "
                        f"{hi['blocks']} blocks (one 5056-byte CPU generator state per random step); without them "
                        f"{hi['blocks']} / {lo['blocks']} blocks = "
                        f"{(hi['ours_est'] - hi['rng_bytes']) / (lo['ours_est'] - lo['rng_bytes']):.3f}.")
        measured = [e for e in entries if "ours_meas" in e]
        if len(measured) > 1:
            a, b = measured[0], measured[-1]
            flat.append(f"  measured saved bytes {b['blocks']} / {a['blocks']} blocks = "
                        f"{b['ours_meas'] / a['ours_meas']:.3f} (stock {b['stock_meas'] / a['stock_meas']:.2f}); "
                        f"peak {b['ours_peak_meas'] / a['ours_peak_meas']:.3f}.")
        for e in measured:
            if e["pieces"] > 1 or e["reasons"]:
                flat.append(f"  at {e['blocks']} blocks the plan-time check made {e['pieces']} pieces "
                            f"({e['rewritten']} of {2 * e['blocks']} couplings rewritten): "
                            + "; ".join(c[:160] for c in e["checks"] + e["reasons"]))
    table = tabulate(rows, headers=["model", "blocks", "couplings", "setting", "stock saved MiB", "memopt saved MiB",
                                    "stock / memopt", "stock peak MiB", "memopt peak MiB",
                                    "pieces / couplings rewritten"], tablefmt="github")
    text = header("Reversible segments: activation memory vs depth",
                  "One training step (forward + backward of the sum of the outputs, no optimizer). memopt = "
                  "`Config(stash=None, fewbit=None)` (reversible pass only, safe mode, default tolerance). RevNet "
                  "CNN: `RevNetCNN((d/2, d/2), width=16)` on 32x32 images (stem conv-BN-ReLU, d/2 RevBlocks at "
                  "16 channels, pixel unshuffle, d/2 RevBlocks at 64 channels, pool, linear); reversible "
                  "transformer: `RevTransformer(d, dim=32)` (16x16 images, 4x4 patches, two 32-wide streams, "
                  "attention as F and MLP as G). 'pieces' = reversible_segment calls in the rewritten graph "
                  "(more than one: the plan-time check cut the segment, each cut keeps one more stream state). "
                  "Meta-tensor estimates are not checked, so never cut. '=' : measured saved and peak bytes equal "
                  "the plan's estimate at that batch.")
    write_results_file(Path(args.out_dir) / "reversible_memory.md", text + table + "\n\n" + "\n".join(flat) + "\n")
    return series


# ---------------------------------------------------------------- bytes per pixel
PIXEL_MODELS = {"RevNetCNN((2, 2, 2), width=16)": ((2, 2, 2), 16), "RevNetCNN((2, 2, 2), width=8)": ((2, 2, 2), 8),
                "RevNetCNN((4, 4, 4), width=8)": ((4, 4, 4), 8)}


def pixel(args) -> None:
    rows, notes = [], []
    configs = {"stock": Config.exact(), "memopt reversible only": Config(**ONLY_REVERSIBLE), "memopt Config()": Config()}
    for name, (stages, width) in PIXEL_MODELS.items():
        torch.manual_seed(0)
        model = RevNetCNN(stages, width).train()
        params = sum(p.numel() for p in model.parameters())
        for cfg_name, cfg in configs.items():
            for batch, real in ((args.px_batch, False), (args.px_real_batch, True)):
                if real and not args.px_measure:
                    continue
                pixels = batch * 32 * 32
                if real:
                    torch.manual_seed(1)
                    x = torch.randn(batch, 3, 32, 32)
                else:
                    x = torch.empty(batch, 3, 32, 32, device="meta")
                om = memopt.optimize(model, config=cfg, example_inputs=x, optimizer="sgd")
                p = om.plan
                b = {k: v / pixels for k, v in p.estimated_breakdown.items()}
                measured = memopt.measure(om, x, optimizer="sgd").peak_bytes if real else None
                techniques = sorted({n.technique for n in p.nodes if n.technique not in ("exact", None)})
                rows.append([name, f"{params / 1e6:.2f}M", cfg_name, f"{batch} ({'real' if real else 'meta'})",
                             f"{p.estimated_peak_bytes / pixels:.0f}",
                             "-" if measured is None else f"{measured / pixels:.0f}",
                             f"{(b['parameters_and_buffers'] + b['gradients'] + b['optimizer_state']):.0f}",
                             f"{b['inputs']:.0f}", f"{b['activations']:.0f}", f"{b['transient']:.0f}",
                             ", ".join(techniques) or "-"])
                print(rows[-1], flush=True)
                if cfg_name != "stock" and not real:
                    verdict = "met" if p.estimated_peak_bytes / pixels <= 352 else "not met"
                    notes.append(f"- {name}, {cfg_name}: {p.estimated_peak_bytes / pixels:.0f} B/px at batch {batch} "
                                 f"(goal <= 352: {verdict}); kept activations {b['activations']:.0f} B/px (plus the "
                                 f"{b['inputs']:.0f} B/px input image), transient at the peak {b['transient']:.0f} "
                                 f"B/px, parameters + gradients + momentum {b['parameters_and_buffers'] + b['gradients'] + b['optimizer_state']:.0f} B/px.")
    table = tabulate(rows, headers=["model", "params", "config", "batch", "estimated peak B/px",
                                    "measured peak B/px", "params+grads+momentum B/px", "inputs B/px",
                                    "activations at peak B/px", "transient at peak B/px", "techniques applied"],
                     tablefmt="github")
    text = header("Reversible segments: training memory per input pixel",
                  "Peak memory of one SGD (momentum 0.9) training step -- parameters, gradients, momentum, "
                  "inputs, kept activations and the transient tensors alive at the peak -- divided by batch x "
                  "32 x 32. Goal (issue 5): at or below the 352 B/px the published reversible CIFAR CNN reports. "
                  "Models: `RevNetCNN(stages, width)` from memopt/testing/reversible_zoo.py: stem conv3x3(3->w)-"
                  "BN-ReLU at 32x32 (not reversible), RevBlocks (y1 = x1 + F(x2), y2 = x2 + G(y1), F and G = "
                  "conv3x3-BN-ReLU-conv3x3 on w/2 channels) at w channels 32x32, pixel unshuffle, RevBlocks at 4w "
                  "channels 16x16, pixel unshuffle, RevBlocks at 16w channels 8x8, global average pool, linear "
                  "16w->10. The breakdown columns are the plan's `estimated_breakdown` at the peak moment.")
    explain = ("\n\nWhere the bytes go (batch {0}, estimated):\n\n".format(args.px_batch) + "\n".join(notes) + "\n\n"
               "Kept activations under memopt are the input image (12 B/px, kept by the stem conv), the "
               "non-reversible stem (its conv output kept by BatchNorm: 4w B/px; its ReLU output: 4w B/px in "
               "float32, or w/8 B/px as the 1-bit few-bit mask with `Config()`) and the segment's output (pixel "
               "unshuffle keeps the element count, so the stream is 4w B/px at every stage), plus about 1 B/px for "
               "the head -- the reversible body itself keeps nothing else. The "
               "transient is the backward working set at the moment of the peak: 6 float32 maps the size of the "
               "full-resolution stream (6 x 4w B/px: 384 B/px at width 16), consistent with the peak falling while the segment's backward walks the "
               "32x32 stage (rebuilt streams, their gradients, F/G recomputed with grad and their gradients). "
               "Neither stash nor few-bit shrinks that working set; at a small real batch the parameters, "
               "gradients and momentum dominate instead.\n")
    write_results_file(Path(args.out_dir) / "reversible_pixel.md", text + table + explain)


# ---------------------------------------------------------------- error vs depth
def segment_errors(model, gm, call, segment, x, mode: str) -> dict:
    """mode: fp32, bf16 (autocast around forward and backward), bf16-out (backward outside autocast)."""
    with preserved_state(model):
        values = true_values(gm, Examples([x]), list(call.args[1:]))
    inputs = [values[n.name] for n in call.args[1:]]

    def autocast(on: bool):
        return torch.autocast("cpu", dtype=torch.bfloat16, enabled=on)

    bf16 = mode != "fp32"
    states, rebuilt = [], {}
    with preserved_state(model), torch.no_grad(), autocast(bf16):
        outputs, rng, shapes = run_forward(segment, inputs, lambda k, s: states.append(dict(s)))
        undo_steps(segment, outputs, rng, shapes, on_step=lambda k, s: rebuilt.__setitem__(k, dict(s)))
    errors = [relative_error([rebuilt[k][s] for s in states[k]], [states[k][s] for s in states[k]])
              for k in sorted(rebuilt)]
    params = segment.params()
    grads = []
    for reversible in (False, True):
        with preserved_state(model):
            leaves = [t.detach().clone().requires_grad_(True) for t in inputs]
            torch.manual_seed(0)
            with autocast(bf16):
                if reversible:
                    out = reversible_segment(segment, *leaves)
                    outs = list(out) if isinstance(out, tuple) else [out]
                else:
                    outs, _, _ = run_forward(segment, leaves)
                g = torch.Generator().manual_seed(0)
                loss = sum((o.float() * torch.randn(o.shape, generator=g)).sum() for o in outs)
                if mode != "bf16-out":
                    grads.append(torch.autograd.grad(loss, leaves + params, allow_unused=True))
            if mode == "bf16-out":
                grads.append(torch.autograd.grad(loss, leaves + params, allow_unused=True))
    # float64 reference (plain autograd on a float64 copy): how far stock autograd itself is from exact
    with preserved_state(model):
        ref_segment = copy.deepcopy(segment).double()
        leaves = [t.detach().clone().double().requires_grad_(True) for t in inputs]
        outs, _, _ = run_forward(ref_segment, leaves)
        g = torch.Generator().manual_seed(0)
        loss = sum((o * torch.randn(o.shape, generator=g).double()).sum() for o in outs)
        exact = torch.autograd.grad(loss, leaves + ref_segment.params(), allow_unused=True)

    def rel(pairs):
        return [((b.double() - a.double()).norm() / a.double().norm()).item()
                for a, b in pairs if a is not None and b is not None and a.norm() > 0]

    per_param = rel(zip(*grads))
    stock_err = rel(zip(exact, grads[0]))
    ours_err = rel(zip(exact, grads[1]))
    return {"rebuild_worst": max(errors), "rebuild_input": errors[0], "grad_worst": max(per_param),
            "grad_median": statistics.median(per_param), "n_grads": len(per_param),
            "stock_vs_f64_worst": max(stock_err), "stock_vs_f64_median": statistics.median(stock_err),
            "ours_vs_f64_worst": max(ours_err), "ours_vs_f64_median": statistics.median(ours_err)}


def error(args) -> dict:
    rows, series = [], {}
    for kind, label, blocks, model, size in depth_sweep(args.error_depths):
            gm, call, segment = installed_segment(model, torch.empty(args.error_batch, 3, size, size, device="meta"))
            torch.manual_seed(1)
            x = torch.randn(args.error_batch, 3, size, size)
            for mode in ("fp32", "bf16", "bf16-out"):
                r = segment_errors(model, gm, call, segment, x, mode)
                series.setdefault((kind, mode), []).append((blocks, r))
                rows.append([label, blocks, 2 * blocks, mode, f"{r['rebuild_input']:.2e}", f"{r['rebuild_worst']:.2e}",
                             f"{r['grad_median']:.2e}", f"{r['grad_worst']:.2e}",
                             f"{r['stock_vs_f64_median']:.1e} / {r['stock_vs_f64_worst']:.1e}",
                             f"{r['ours_vs_f64_median']:.1e} / {r['ours_vs_f64_worst']:.1e}", r["n_grads"]])
                print(rows[-1], flush=True)
    table = tabulate(rows, headers=["model", "blocks", "couplings", "precision", "rebuilt segment input (rel.)",
                                    "worst rebuilt state (rel.)", "gradient error median", "gradient error worst",
                                    "stock vs float64 (median / worst)", "memopt vs float64 (median / worst)",
                                    "tensors compared"], tablefmt="github")
    text = header("Reversible segments: reconstruction and gradient error vs depth",
                  f"Models as in reversible_memory.md at random initialisation, real batch {args.error_batch}. The "
                  "segment is the one the pass installs when planned on meta inputs (whole, not cut by the check). "
                  "'rebuilt' = relative L2 error of the stream states undo_steps rebuilds from the segment outputs "
                  "against the true forward states (at the segment input, and the worst over all steps). Gradient "
                  "error: per tensor (segment inputs and every parameter of F and G) relative L2 error of the "
                  "reversible Function's gradient vs plain autograd through the same steps, loss = <outputs, fixed "
                  "random tensor>. 'vs float64': the same gradients against plain autograd on a float64 copy of the segment (how "
                  "far stock autograd at this precision is from exact, for scale). fp32: no autocast. bf16: `torch.autocast('cpu', dtype=torch.bfloat16)` around "
                  "forward and backward (F and G run in bfloat16, the streams stay float32). bf16-out: autocast "
                  "around the forward only, `autograd.grad` called after leaving it (how training loops are "
                  "usually written). The plan-time check accepts rebuilt-state errors below tolerance / margin = "
                  "1e-5 and gradient errors below 1e-3 (defaults).")
    write_results_file(Path(args.out_dir) / "reversible_error.md", text + table + "\n")
    return series


# ---------------------------------------------------------------- step time
class Checkpointed(nn.Module):
    def __init__(self, block: nn.Module) -> None:
        super().__init__()
        self.block = block

    def forward(self, x):
        return torch.utils.checkpoint.checkpoint(self.block, x, use_reentrant=False)


def step_time(args) -> None:
    load = subprocess.run(["uptime"], capture_output=True, text=True).stdout.strip()
    rows = []
    for batch in args.time_batches:
        torch.manual_seed(0)
        model = RevNetCNN((4, 4), width=16).train()
        x = torch.randn(batch, 3, 32, 32)
        om = memopt.optimize(model, config=Config(**ONLY_REVERSIBLE), example_inputs=x)
        ckpt = copy.deepcopy(model)
        ckpt.body = nn.Sequential(*[Checkpointed(m) if isinstance(m, RevBlock) else m for m in ckpt.body])
        ours, stock_s = step_time_ratio(om, model, x, repeats=args.repeats)
        theirs, _ = step_time_ratio(ckpt, model, x, repeats=args.repeats)
        rows.append([batch, f"{stock_s * 1e3:.1f}", f"{ours:.2f}x", f"{theirs:.2f}x", len(calls_of(om))])
        print(rows[-1], flush=True)
    load_after = subprocess.run(["uptime"], capture_output=True, text=True).stdout.strip()
    table = tabulate(rows, headers=["batch", "stock step ms", "memopt (reversible only) / stock",
                                    "torch.utils.checkpoint around every RevBlock / stock", "memopt pieces"],
                     tablefmt="github")
    text = header("Reversible segments: step time",
                  f"RevNetCNN((4, 4), width=16) (8 RevBlocks, 16 couplings), 32x32, forward + backward of the "
                  f"output sum, median of {args.repeats} interleaved steps after a warm-up "
                  f"(memopt.record.timing.step_time_ratio). Expected near 1.3 (one extra forward of each F and G); "
                  f"checkpointing every block also recomputes each block once. Load before: `{load}`; after: "
                  f"`{load_after}` (other jobs shared the 2 cores: the ratios are interleaved step by step, the "
                  f"absolute times are not reliable).")
    write_results_file(Path(args.out_dir) / "reversible_time.md", text + table + "\n")


# ---------------------------------------------------------------- training parity
def parity(args) -> None:
    data = digits()
    rows, means = [], {}
    for method in ("stock", "memopt"):
        accs = []
        for seed in range(args.seeds):
            torch.manual_seed(seed)
            model = RevNetCNN((2, 2), width=16, in_channels=1).train()
            net = model
            if method == "memopt":
                net = memopt.optimize(model, config=Config(**ONLY_REVERSIBLE), example_inputs=data[0][:64])
                assert calls_of(net), net.report()
            accs.append(fit_and_test(net, model, data, seed, args.epochs, batch=64, drop_last=True))
            print(method, seed, accs[-1], flush=True)
        means[method] = statistics.mean(accs)
        rows.append([method, f"{means[method]:.2f} ± {statistics.stdev(accs) if len(accs) > 1 else 0:.2f}",
                     "-" if method == "stock" else f"{means[method] - means['stock']:+.2f}",
                     " ".join(f"{a:.2f}" for a in accs)])
    table = tabulate(rows, headers=["method", "test accuracy %", "vs stock (points)", "per seed"], tablefmt="github")
    text = header("Reversible segments: training parity on digits",
                  f"scikit-learn digits (1437 train / 360 test, 8x8, 1 channel, fixed split; one test image = 0.28 "
                  f"points). RevNetCNN((2, 2), width=16, in_channels=1): stem conv-BN-ReLU, 2 RevBlocks at 16 "
                  f"channels 8x8, pixel unshuffle, 2 RevBlocks at 64 channels 4x4, pool, linear. Adam lr 1e-3, "
                  f"batch 64, {args.epochs} epochs, {args.seeds} seeds; stock and memopt (reversible only) share "
                  f"initial weights and data order within a seed. Goal: within 0.3 points.")
    write_results_file(Path(args.out_dir) / "reversible_training.md", text + table + "\n")


def ints(text: str) -> list:
    return [int(v) for v in text.split(",") if v]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--only", default="memory,pixel,error,time,parity",
                        help="comma-separated sections; 'plot' redraws the PNG from the last memory/error run")
    parser.add_argument("--depths", type=ints, default=ints("8,16,32,64"))
    parser.add_argument("--measured-depths", type=ints, default=ints("8,16"))
    parser.add_argument("--meta-batch", type=int, default=64)
    parser.add_argument("--real-batch", type=int, default=2)
    parser.add_argument("--px-batch", type=int, default=512)
    parser.add_argument("--px-real-batch", type=int, default=4)
    parser.add_argument("--px-measure", type=int, default=1)
    parser.add_argument("--error-depths", type=ints, default=ints("8,16,32,64"))
    parser.add_argument("--error-batch", type=int, default=4)
    parser.add_argument("--time-batches", type=ints, default=ints("8,32"))
    parser.add_argument("--repeats", type=int, default=30)
    parser.add_argument("--threads", type=int, default=None)
    parser.add_argument("--epochs", type=int, default=10)
    parser.add_argument("--seeds", type=int, default=3)
    parser.add_argument("--out-dir", default=str(RESULTS / "reversible"))
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    only = set(args.only.split(","))
    start = time.time()
    mem = err = None
    cache = Path(tempfile.gettempdir()) / "memopt_bench_reversible_plot.json"  # a partial rerun redraws the PNG
    if "memory" in only:
        mem = memory(args)
    if "error" in only:
        err = error(args)
    if mem is not None or err is not None or "plot" in only:
        old = json.loads(cache.read_text()) if cache.exists() else {}
        mem = mem if mem is not None else old.get("mem", {})
        err = err if err is not None else {tuple(k.split("|")): v for k, v in old.get("err", {}).items()}
        cache.write_text(json.dumps({"mem": mem, "err": {"|".join(k): v for k, v in err.items()}}))
        plot(mem, err, Path(args.out_dir) / "reversible_depth.png", args.real_batch)
    if "pixel" in only:
        pixel(args)
    if "parity" in only:
        parity(args)
    if "time" in only:
        step_time(args)
    print(f"total {time.time() - start:.0f}s, load: {os.getloadavg()}")


if __name__ == "__main__":
    main()
