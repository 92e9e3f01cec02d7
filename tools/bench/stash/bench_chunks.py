"""python -m tools.bench.stash.bench_chunks [--only torchvision|timm|hf] [--models a,b] [--out PATH]

Weight gradients over batch chunks on real model zoos: where does the peak fall inside a weight gradient from a
rebuilt input, and what do chunks take off it?

Per model (random weights; torchvision and timm at batch 8 and their smallest accepted image size from 64 up, the
Hugging Face tiny configs of ``tools/bench/capture/zoo.py`` at their batch of 2), in float32 and under CPU bf16
autocast, with the fused C kernels (``native``: the CPU default) and with plain PyTorch everywhere
(``MEMOPT_KERNELS=torch``: the codecs CUDA runs by default; on this GPU-less machine the cost model simulates a
CUDA step with CPU kernels anyway, so this is how the CUDA default's temporaries are seen here), the default plan
(``memopt.optimize``, every technique at its defaults, the fidelity gate off: it does not change where chunks
apply) is estimated twice with the cost model's step: with every consumer in one piece (``set_chunks(gm, 1)``),
and as ``optimize`` left it (chunks where ``chunk_to_fit`` found the peak inside a weight gradient and chunks
lowered it). Columns: the one-piece peak, whether it falls inside a weight gradient, the chunks chosen, and the
peak with them. Estimates only (the tests hold estimate = measurement for chunked plans).
"""
from __future__ import annotations

import argparse
import contextlib
import sys
import time

import torch
from tabulate import tabulate

import memopt
from memopt.core.units import fmt_bytes
from memopt.cost_model.analysis import annotate
from memopt.passes.stash.chunks import set_chunks
from memopt.record.plan import PartialPlan
from memopt.runtime import kernels
from tools.bench.capture.zoo import TIMM_MODELS, build_timm, build_torchvision, hf_models, torchvision_names
from tools.bench.common import RESULTS, write_results

BATCH = 8
SETTINGS = [("float32", "native"), ("bf16", "native"), ("float32", "torch"), ("bf16", "torch")]


def _models(only, names):
    if only in (None, "torchvision"):
        for n in torchvision_names():
            if not names or n in names:
                yield "torchvision", n, lambda n=n: _image(*build_torchvision(n, 64))
    if only in (None, "timm"):
        for n in TIMM_MODELS:
            if not names or n in names:
                yield "timm", n, lambda n=n: _image(*build_timm(n, 64))
    if only in (None, "hf"):
        for n, (make, inputs, _) in hf_models().items():
            if not names or n in names:
                yield "hf", n, lambda make=make, inputs=inputs: (make(), inputs())


def _image(model, size):
    return model, torch.randn(BATCH, 3, size, size)


def _row(model, inputs, precision, codecs):
    args, kwargs = ((), inputs) if isinstance(inputs, dict) else ((inputs,), {})
    cast = torch.autocast("cpu", torch.bfloat16) if precision == "bf16" else contextlib.nullcontext()
    with cast, kernels.forced(None if codecs == "native" else codecs):
        om = memopt.optimize(model, example_inputs=inputs, optimizer="sgd", config=memopt.Config(fidelity=None))
        if isinstance(om.plan, PartialPlan):  # one graph per submodule: not estimated here
            return None
        gm = om.graph_module
        chosen, peak = om.plan.weight_grad_chunks, om.plan.estimated_peak_bytes
        set_chunks(gm, 1)
        whole = annotate(gm, args, kwargs, optimizer="sgd")
        set_chunks(gm, chosen)
    return whole.peak_bytes, bool(whole.breakdown.get("peak_in_weight_grad")), chosen, peak


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[1])
    parser.add_argument("--only", choices=("torchvision", "timm", "hf"))
    parser.add_argument("--models", default="")
    parser.add_argument("--out", default=str(RESULTS / "stash" / "weight_grad_chunks.md"))
    a = parser.parse_args()
    names = {n for n in a.models.split(",") if n}
    rows, counts = [], {s: [0, 0, 0] for s in SETTINGS}  # models, peak in a weight gradient, chunked
    for family, name, make in _models(a.only, names):
        torch.manual_seed(0)
        start = time.perf_counter()
        try:
            model, inputs = make()
        except Exception as e:  # a model that does not build here is listed, not fatal
            rows.append([family, name, "-", f"not built: {type(e).__name__}", "", "", "", ""])
            continue
        for precision, codecs in SETTINGS:
            try:
                found = _row(model, inputs, precision, codecs)
            except Exception as e:
                rows.append([family, name, f"{precision} {codecs}", f"failed: {type(e).__name__}: {str(e)[:60]}",
                             "", "", "", ""])
                continue
            if found is None:
                rows.append([family, name, f"{precision} {codecs}", "captured per submodule (not estimated here)",
                             "", "", "", ""])
                continue
            whole, inside, chosen, peak = found
            c = counts[(precision, codecs)]
            c[0], c[1], c[2] = c[0] + 1, c[1] + inside, c[2] + (chosen > 1)
            rows.append([family, name, f"{precision} {codecs}", fmt_bytes(whole), "yes" if inside else "no", chosen,
                         fmt_bytes(peak), f"{100 * (whole - peak) / whole:.1f}%"])
        print(f"{name}: {time.perf_counter() - start:.0f} s", file=sys.stderr, flush=True)
        _write(a, rows, counts)  # after every model: a sweep stopped early keeps what it measured


def _write(a, rows, counts) -> None:
    summary = [[f"{p} {d}", *counts[(p, d)]] for p, d in SETTINGS]
    body = ("## Summary\n\n" + tabulate(summary, headers=["setting", "models estimated", "peak inside a weight "
                                                              "gradient", "chunked"], tablefmt="github")
            + "\n\n## Per model\n\n" + tabulate(rows, headers=["zoo", "model", "setting", "peak, one piece",
                                                               "inside a weight gradient", "chunks",
                                                               "peak, chunked", "lower by"], tablefmt="github"))
    command = "python -m tools.bench.stash.bench_chunks" + "".join(
        f" --{k} {v}" for k, v in (("only", a.only), ("models", a.models)) if v)
    write_results(a.out, "Weight gradients over batch chunks on the zoos", command, __doc__, body)


if __name__ == "__main__":
    main()
