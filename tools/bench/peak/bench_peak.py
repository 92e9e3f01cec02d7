"""python -m tools.bench.peak.bench_peak --table [--models llama,resnet50 --res 128]   (one fresh process per row)
python -m tools.bench.peak.bench_peak --largest --cap-mb 1024 [--models llama,bert --dtypes float32 --methods stock,checkpoint,memopt]
python -m tools.bench.peak.bench_peak --child --model llama --dtype float32 --batch 32 --method memopt   (one JSON line)

The peak a user runs out of: the resident memory of a whole CPU training step, stock against
torch.utils.checkpoint, torch.compile and memopt, and the largest batch that fits under a cap.

What is measured: one training step as a user writes it (``opt.zero_grad(set_to_none=True)``, forward and loss
under the precision's autocast or none, ``loss.backward()``, ``opt.step()``), parameters, gradients, optimizer
state and inputs included, each configuration in a FRESH PROCESS (``--child``, started by the parent through
``subprocess``) so that nothing one configuration allocated or cached is resident in the next. In the child, after
torch, memopt and the model's library are imported and before anything is built, the idle resident set is read
(``/proc/self/status``); then the model, inputs and optimizer are built, the method applied (``memopt.optimize``
runs here, compile happens at the first step), 2 warm-up steps run (the optimizer state exists from the first),
and the next steps are measured (3 in ``--table``, 1 in ``--largest``; ``--warmup`` / ``--steps`` change them).
The peak of a measured step is the kernel's high-water mark of the process's resident set (``VmHWM``), reset just
before the step by writing ``5`` to ``/proc/self/clear_refs`` (checked at start: it works on this Linux; where it
does not, a thread sampling ``VmRSS`` every 1 ms stands in). The kernel updates the mark before it unmaps any page,
so no spike is missed, where a sampler at 1 ms can miss a short one, and ``ru_maxrss`` (also in the JSON) cannot be
reset at all: it would report the warm-up steps and ``optimize()`` too. Reported: peak MiB = high-water mark less
the file-backed pages resident after the step (library code, loaded lazily during the warm-up steps) less the idle
process's anonymous memory, i.e. the anonymous memory the step peaked at above a process that only imported its
libraries (``peak_total_mib`` in the JSON keeps the file pages too). It includes what glibc's allocator keeps
resident after the warm-up steps freed it, as a user's process does. The largest of the measured steps' peaks is
reported.

The allocator is part of the peak: with glibc's malloc at its defaults (its mmap threshold grows up to 32 MiB after
a large block is freed, so later tensors of that size come from the heap, whose free holes stay resident), the
resident peak of a step can be hundreds of MiB above the bytes of its live tensors, and what runs before the step
(``memopt.optimize``'s planning, compile) shapes that heap. ``MALLOC_MMAP_THRESHOLD_=131072`` in the environment
(written in front of the command in the results file) fixes the threshold: every block of 128 KiB or more is its
own mapping, returned when freed, and the peak follows the live tensors; ``--malloc-trim`` hands the free heap back
before each measured step instead.

Floor = parameters + gradients + optimizer state (bytes of the tensors; what no activation technique
removes).

Step time: the median of the measured steps in each child (1 thread by default: ``--threads``), and its ratio to
the stock child's. Stock and method run in different processes, one after the other, on a shared machine, so the
ratio is noisier than the interleaved ratios of the other benchmarks. Setup: ``memopt.optimize`` seconds, or
torch.compile's first step (dynamo and inductor compiling forward and backward; inductor's cache in /tmp may
already hold the kernels of an earlier run).

Models (random weights; data random tensors / token ids): ResNet-50 (torchvision; ``--res``, SGD momentum 0.9,
cross-entropy on random labels), ViT-S/16 (timm ``vit_small_patch16_224`` at ``img_size=--res``, AdamW), a
BERT-base-shaped encoder (``BertForSequenceClassification``: hidden 768, 12 heads, intermediate 3072, ``--layers``
4, sequence ``--seq`` 128, 2 labels, AdamW, the model's loss), a Llama-style decoder (``LlamaForCausalLM``:
``--llama-layers`` 4, ``--hidden`` 256, ``--heads`` 4, ``--intermediate`` 688, vocabulary ``--vocab`` 4096 (not
32000: its logits alone would be 1000 MiB at 32 x 256 tokens), sequence ``--llama-seq`` 256, untied embeddings,
AdamW, ``model(input_ids, labels=input_ids).loss``). Hugging Face models use SDPA attention. Precisions: float32
and bf16 autocast (``torch.autocast("cpu", dtype=torch.bfloat16)`` around forward and loss, and around
``memopt.optimize``).

Methods: ``stock``; ``checkpoint``: torch.utils.checkpoint (non-reentrant) around every block (ResNet's
Bottlenecks, ViT's ``blocks[i]``; Hugging Face models through ``gradient_checkpointing_enable(
gradient_checkpointing_kwargs={"use_reentrant": False})``); ``compile``: ``torch.compile`` with
``torch._functorch.config.activation_memory_budget = 0.5`` (compile threads 1); ``memopt``:
``memopt.optimize(model, example_inputs=..., optimizer=opt)`` (``Config()``, every default; Hugging Face models
get the keyword inputs, labels included, as a dict); ``memopt_budget``: the same with ``budget_mb`` = the
checkpoint row's measured peak (``--table``) or the cap (``--largest``). A method that fails or is refused is a
row with its error.

``--largest``: per model, precision and method, the largest batch whose measured step peak is at most
``--cap-mb``: doubling from ``--start-batch``, then bisection, each probe a fresh child, at most ``--max-probes``
probes and ``--max-batch``; a probe that fails (error, refusal) counts as not fitting. Throughput = batch / step
seconds at that batch; optimize()'s own peak at that batch is shown beside it (a probe fits by its step's peak).
Files are rewritten after every row, so a run cut short keeps what it measured.
"""
from __future__ import annotations

import argparse
import contextlib
import json
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Dict, List, Optional

from tools.bench.peak.child import DEFAULT_BATCH, DTYPES, METHODS, MODELS, measure

ROOT = Path(__file__).resolve().parents[3]
RESULTS = ROOT / "docs" / "results" / "peak"
# the reference numbers (issue 40: measured by someone else the same way), MiB: stock / checkpoint / memopt
REFERENCE = {("llama", "float32", 32): (855, 316, 374), ("llama", "bf16", 32): (622, 225, 306),
             ("resnet50", "float32", 8, 128): (475, 384, 344), ("resnet50", "bf16", 8, 128): (393, 341, 331)}


# ---------------------------------------------------------------- children
def child_argv(args, model: str, dtype: str, batch: int, method: str, budget_mb: Optional[float]) -> List[str]:
    argv = [sys.executable, "-m", "tools.bench.peak.bench_peak", "--child", "--model", model, "--dtype", dtype,
            "--batch", str(batch), "--method", method, "--threads", str(args.threads),
            "--warmup", str(args.warmup), "--steps", str(args.steps)] + (["--malloc-trim"] if args.malloc_trim else [])
    for flag in ("res", "seq", "layers", "llama_layers", "llama_seq", "hidden", "heads", "intermediate", "vocab"):
        argv += [f"--{flag.replace('_', '-')}", str(getattr(args, flag))]
    if budget_mb is not None:
        argv += ["--budget-mb", f"{budget_mb:.1f}"]
    return argv


def run_child(args, model: str, dtype: str, batch: int, method: str, budget_mb: Optional[float] = None) -> dict:
    """Measure one configuration in a fresh process; its JSON line, or a dict with the error."""
    argv = child_argv(args, model, dtype, batch, method, budget_mb)
    start = time.perf_counter()
    print(f"[child] {model} {dtype} batch {batch} {method}" + (f" budget {budget_mb:.0f} MiB" if budget_mb else ""),
          flush=True, file=sys.stderr)
    try:
        proc = subprocess.run(argv, cwd=ROOT, capture_output=True, text=True, timeout=args.child_timeout)
        lines = [line for line in proc.stdout.splitlines() if line.startswith("{")]
        result = json.loads(lines[-1]) if lines else {
            "error": f"child exited {proc.returncode} without a result: {' '.join(proc.stderr.split())[-300:]}"}
        if result.get("error"):
            print(proc.stderr[-3000:], file=sys.stderr)
    except subprocess.TimeoutExpired:
        result = {"error": f"timed out after {args.child_timeout:.0f} s (--child-timeout)"}
    result["wall_s"] = time.perf_counter() - start
    shown = {k: result.get(k) for k in ("peak_mib", "step_s", "optimize_s", "floor_mib", "error", "wall_s")}
    print(f"[child] -> {shown}", flush=True, file=sys.stderr)
    return result


# ---------------------------------------------------------------- formatting
def f1(value, suffix: str = "") -> str:
    return "" if value is None else f"{value:.1f}{suffix}"


def f2(value, suffix: str = "") -> str:
    return "" if value is None else f"{value:.2f}{suffix}"


def batch_of(args, model: str) -> int:
    return args.batches.get(model, DEFAULT_BATCH[model])


def reference(args, model: str, dtype: str, batch: int, method: str) -> str:
    key = (model, dtype, batch) + ((args.res,) if model == "resnet50" else ())
    default_llama = (args.llama_layers, args.hidden, args.heads, args.intermediate, args.vocab, args.llama_seq) \
        == (4, 256, 4, 688, 4096, 256)
    if key not in REFERENCE or method not in ("stock", "checkpoint", "memopt") or (model == "llama" and not default_llama):
        return ""
    return str(REFERENCE[key][("stock", "checkpoint", "memopt").index(method)])


def command_line(args) -> str:
    """The command, with the environment that changes a child's allocator (MALLOC_*, LD_PRELOAD) in front."""
    env = [f"{k}={v}" for k, v in sorted(os.environ.items()) if k.startswith("MALLOC_") or k == "LD_PRELOAD"]
    return " ".join(env + ["python -m tools.bench.peak.bench_peak"] + sys.argv[1:])


def write(args, out: Path, title: str, rows: List[List[str]], headers: List[str], extra: str) -> None:
    """Rewrite ``out`` (after every row); a ``## Reading`` section already in it (written by hand) is kept."""
    from tabulate import tabulate

    from tools.bench.common import write_results

    reading = ""
    if out.exists() and "\n## Reading\n" in out.read_text():
        reading = "## Reading" + out.read_text().split("\n## Reading\n", 1)[1]
    body = tabulate(rows, headers=headers, tablefmt="github", disable_numparse=True) + "\n\n" + extra
    write_results(out, title, command_line(args), __doc__, body + ("\n\n" + reading if reading else ""))
    import torch

    text = out.read_text()
    at = text.index(f"torch {torch.__version__}, CPU")
    end = text.index(")", at)
    threads = f"{args.threads} thread{'s' if args.threads > 1 else ''} per child"
    out.write_text(text[:at] + f"torch {torch.__version__}, CPU, {threads}" + text[end:])


def describe_models(results: Dict) -> str:
    seen = {}
    for r in results.values():
        if r.get("describe"):
            seen.setdefault(r["model"], r["describe"])
    return "\n".join(f"- {m}: {d}" for m, d in seen.items())


# ---------------------------------------------------------------- --table
TABLE_HEADERS = ["model", "precision", "batch", "method", "peak MiB", "peak / stock", "floor MiB",
                 "step s (median)", "step / stock", "setup s", "setup peak MiB", "optimize() peak MiB", "free heap MiB",
                 "issue 40 reference MiB", "note"]


COLUMNS = """Columns: peak MiB, the largest measured step's peak (above); floor MiB, parameters + gradients +
optimizer state; step s, the median measured step in that child, and its ratio to the stock child's; setup s,
``memopt.optimize`` or torch.compile's first step; setup peak MiB, the peak (measured the same way) from building
the model through optimize / compile and the warm-up steps; optimize() peak MiB, the peak while
``memopt.optimize`` ran (the model, inputs and optimizer included: above the step's peak, optimize() is what runs
out of memory first; empty for other methods); free heap MiB, what glibc's ``malloc_trim(0)`` handed
back to the kernel after the measured steps: memory the step freed that the allocator still kept resident
(diagnostic, read after the measurement; large values go with a heap whose free holes the next step cannot all
reuse, see the allocator note above)."""


def table(args) -> None:
    out = Path(args.out or RESULTS / "peak.md")
    rows, results, start = [], {}, time.perf_counter()
    for model in args.models:
        batch = batch_of(args, model)
        for dtype in args.dtypes:
            for method in args.methods:
                budget = None
                if method == "memopt_budget":
                    ckpt = results.get((model, dtype, "checkpoint")) or {}
                    if ckpt.get("peak_mib") is None:
                        ckpt = run_child(args, model, dtype, batch, "checkpoint")
                        results[(model, dtype, "checkpoint")] = ckpt
                    budget = ckpt.get("peak_mib")
                    if budget is None:
                        rows.append([model, dtype, str(batch), method] + [""] * (len(TABLE_HEADERS) - 5) +
                                    ["not run: the checkpoint row has no peak to use as the budget"])
                        write(args, out, "Peak memory of a CPU training step", rows, TABLE_HEADERS, "")
                        continue
                r = run_child(args, model, dtype, batch, method, budget)
                results[(model, dtype, method)] = r
                stock = results.get((model, dtype, "stock")) or {}
                peak, step = r.get("peak_mib"), r.get("step_s")
                note = r.get("note") or ""
                if budget is not None:
                    label = "fits" if peak is not None and peak <= budget else "OVER" if peak is not None else ""
                    note = f"budget_mb={budget:.0f} ({label}); {note}".rstrip("; ")
                if r.get("error"):
                    note = f"ERROR: {r['error']}"
                rows.append([model, dtype, str(batch), method, f1(peak),
                             f2(peak / stock["peak_mib"] if peak and stock.get("peak_mib") else None, "x"),
                             f1(r.get("floor_mib")), f2(step),
                             f2(step / stock["step_s"] if step and stock.get("step_s") else None, "x"),
                             f1(r.get("optimize_s")), f1(r.get("setup_peak_mib")),
                             f1(r.get("optimize_peak_mib")) if method.startswith("memopt") else "",
                             f1(r.get("heap_free_mib")),
                             reference(args, model, dtype, batch, method), note])
                extra = (f"Models:\n\n{describe_models(results)}\n\nIdle baseline subtracted (per child, resident "
                         f"set after the imports): " + ", ".join(sorted({f"{r['baseline_mib']:.0f}"
                                                                          for r in results.values()
                                                                          if r.get("baseline_mib")}))
                         + f" MiB; high-water mark read by {next((r['hwm_method'] for r in results.values() if r.get('hwm_method')), '?')}. "
                         f"Wall time so far {time.perf_counter() - start:.0f} s.\n\n{COLUMNS}" + (" With ``--malloc-trim`` the free heap was also handed back "
                                                                   "before each measured step." if args.malloc_trim else ""))
                write(args, out, "Peak memory of a CPU training step", rows, TABLE_HEADERS, extra)


# ---------------------------------------------------------------- --largest
LARGEST_HEADERS = ["model", "precision", "method", "largest batch", "peak MiB at it", "optimize() peak MiB at it",
                   "samples/s at it",
                   "first batch over", "probes", "search s", "note"]


def largest_batch(args, model: str, dtype: str, method: str):
    """(largest fitting batch or 0, its result, smallest failing batch or None, probes {batch: result})."""
    probes: Dict[int, dict] = {}
    budget = args.cap_mb if method == "memopt_budget" else None

    def fits(b: int) -> bool:
        r = probes[b] = run_child(args, model, dtype, b, method, budget)
        return r.get("peak_mib") is not None and r["peak_mib"] <= args.cap_mb and not r.get("error")

    lo, hi, b = 0, None, min(args.start_batch, args.max_batch)
    while len(probes) < args.max_probes:  # doubling (or halving when the start is already over)
        if fits(b):
            lo = b
            if b >= args.max_batch or hi is not None:
                break
            b = min(2 * b, args.max_batch)
        else:
            hi = b
            if lo or b == 1:
                break
            b = b // 2
    while hi is not None and hi - lo > 1 and len(probes) < args.max_probes:  # bisection
        mid = (lo + hi) // 2
        if fits(mid):
            lo = mid
        else:
            hi = mid
    return lo, probes.get(lo), hi, probes


def largest(args) -> None:
    out = Path(args.out or RESULTS / "largest_batch.md")
    rows, start, results = [], time.perf_counter(), {}
    for model in args.models:
        for dtype in args.dtypes:
            for method in args.methods:
                t0 = time.perf_counter()
                lo, r, hi, probes = largest_batch(args, model, dtype, method)
                for b, p in probes.items():
                    results[(model, dtype, method, b)] = p
                r = r or {}
                note = []
                if hi is not None and hi - lo > 1:
                    note.append(f"search stopped at --max-probes {args.max_probes}")
                if hi is None:
                    note.append(f"fits at --max-batch {args.max_batch}" if lo == args.max_batch else "")
                failed = {b: p for b, p in probes.items() if p.get("error")}
                for b, p in sorted(failed.items())[:2]:
                    note.append(f"batch {b}: {p['error'][:200]}")
                trail = ", ".join(f"{b}: {f1(p.get('peak_mib')) or 'error'}" for b, p in probes.items())
                note.append(f"probes (batch: MiB) {trail}")
                rows.append([model, dtype, method, str(lo), f1(r.get("peak_mib")),
                             f1(r.get("optimize_peak_mib")) if method.startswith("memopt") else "",
                             f1(lo / r["step_s"]) if r.get("step_s") else "", "" if hi is None else str(hi),
                             str(len(probes)), f"{time.perf_counter() - t0:.0f}", "; ".join(n for n in note if n)])
                extra = (f"Cap {args.cap_mb:.0f} MiB (the peak as defined above: anonymous resident memory above the "
                         f"idle process). Search: doubling from batch {args.start_batch}, bisection, at most "
                         f"{args.max_probes} probes, batch at most {args.max_batch}; {args.warmup} warm-up steps and "
                         f"{args.steps} measured step(s) per probe.\n\nModels:\n\n{describe_models(results)}\n\n"
                         f"Wall time so far {time.perf_counter() - start:.0f} s.")
                write(args, out, f"Largest batch under {args.cap_mb:.0f} MiB, CPU training step", rows,
                      LARGEST_HEADERS, extra)


# ---------------------------------------------------------------- the command
def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    mode = p.add_mutually_exclusive_group(required=True)
    mode.add_argument("--table", action="store_true", help="peak, step time, setup per model x precision x method")
    mode.add_argument("--largest", action="store_true", help="largest batch under --cap-mb per model x precision x method")
    mode.add_argument("--child", action="store_true", help="measure one configuration in this process; one JSON line")
    p.add_argument("--json", action="store_true", help="(with --child: the default) print only the JSON line on stdout")
    p.add_argument("--models", default="llama,bert,resnet50,vit", help=f"comma-separated: {','.join(MODELS)}")
    p.add_argument("--methods", default=",".join(METHODS), help=f"comma-separated: {','.join(METHODS)}")
    p.add_argument("--dtypes", default=",".join(DTYPES), help="comma-separated: float32,bf16 (bf16 = autocast)")
    p.add_argument("--batch", default="", help="N for every model, or model=N,... (defaults: "
                   + ", ".join(f"{k} {v}" for k, v in DEFAULT_BATCH.items()) + ")")
    p.add_argument("--model", choices=MODELS, help="(--child)")
    p.add_argument("--method", choices=METHODS, help="(--child)")
    p.add_argument("--dtype", choices=DTYPES + ("bfloat16",), help="(--child)")
    p.add_argument("--budget-mb", type=float, default=None, help="(--child, memopt_budget) memopt's budget_mb")
    p.add_argument("--res", type=int, default=224, help="image side of ResNet-50 and ViT")
    p.add_argument("--seq", type=int, default=128, help="BERT sequence")
    p.add_argument("--layers", type=int, default=4, help="BERT layers")
    p.add_argument("--llama-layers", type=int, default=4)
    p.add_argument("--llama-seq", type=int, default=256)
    p.add_argument("--hidden", type=int, default=256, help="Llama hidden size")
    p.add_argument("--heads", type=int, default=4, help="Llama heads (= key/value heads)")
    p.add_argument("--intermediate", type=int, default=688, help="Llama MLP size")
    p.add_argument("--vocab", type=int, default=4096, help="Llama vocabulary")
    p.add_argument("--threads", type=int, default=1, help="torch threads in each child")
    p.add_argument("--warmup", type=int, default=2, help="warm-up steps per child")
    p.add_argument("--steps", type=int, default=None, help="measured steps per child (--table 3, --largest 1)")
    p.add_argument("--malloc-trim", action="store_true",
                   help="call glibc's malloc_trim(0) before each measured step (the free heap the allocator kept "
                        "after setup and warm-up is then not in the peak)")
    p.add_argument("--cap-mb", type=float, default=1024.0, help="(--largest) the peak to fit, MiB")
    p.add_argument("--start-batch", type=int, default=8, help="(--largest) the first batch probed")
    p.add_argument("--max-batch", type=int, default=512, help="(--largest)")
    p.add_argument("--max-probes", type=int, default=10, help="(--largest) children per model x precision x method")
    p.add_argument("--child-timeout", type=float, default=1800.0, help="seconds before a child is stopped")
    p.add_argument("--out", default="", help="results file (default docs/results/peak/peak.md or largest_batch.md)")
    args = p.parse_args(argv)
    if args.dtype == "bfloat16":
        args.dtype = "bf16"
    if args.steps is None:
        args.steps = 1 if args.largest else 3
    args.models, args.methods, args.dtypes = (getattr(args, k).split(",") for k in ("models", "methods", "dtypes"))
    for values, allowed, flag in ((args.models, MODELS, "--models"), (args.methods, METHODS, "--methods"),
                                  (args.dtypes, DTYPES, "--dtypes")):
        if set(values) - set(allowed):
            p.error(f"{flag}: unknown {sorted(set(values) - set(allowed))}; choose from {','.join(allowed)}")
    args.batches = {}
    if args.batch:
        if "=" in args.batch:
            args.batches = {k: int(v) for k, v in (item.split("=") for item in args.batch.split(","))}
        else:
            args.batches = {m: int(args.batch) for m in MODELS}
    if args.child and not (args.model and args.method and args.dtype):
        p.error("--child needs --model, --method and --dtype (and --batch, else the model's default)")
    return args


def main(argv=None) -> None:
    args = parse_args(argv)
    if args.child:
        args.batch = batch_of(args, args.model)
        with contextlib.redirect_stdout(sys.stderr):  # stdout carries the JSON line only
            result = measure(args)
        print(json.dumps(result), flush=True)
        return
    if args.table:
        table(args)
    else:
        largest(args)


if __name__ == "__main__":
    main()
