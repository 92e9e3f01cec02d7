"""python -m tools.bench.dynamic.sweep_hf_sizes

Hugging Face models at the input sizes a training run meets: what memopt captures, saves and costs at each.

Each model of tools/bench/capture/zoo.py's Hugging Face zoo (random weights, tiny configs) is optimized on a batch
of ``--batch`` (default Config, or ``Config(dynamic=True)`` with ``--dynamic``), then trained one step (forward,
backward; the same seeds as an eager copy: torch's, NumPy's, Python's) at that size and three more: ``--more``
tokens longer, a batch of ``--small`` (an epoch's last batch), ``--fewer`` tokens shorter. Token inputs
(integer, rank 2) change their length; other inputs change their batch only. Per size: how the graph that ran
was captured (``export``, ``symbolic_trace`` or ``per-submodule``), the saved bytes memopt's plan keeps against
eager's (the plan's estimates), and whether the forward is bit-identical to eager's. Per model: ``optimize()``'s
seconds, the input signatures planned (a build: capture, check, and plan or the first plan applied) and reused
(a cheap check), and all the planning's seconds (``om.shape_stats``). One process, one thread, models one after
the other.
"""
from __future__ import annotations

import argparse
import copy
import random
import statistics
import sys
import time

import numpy as np
import torch

import memopt
from tools.bench.capture import zoo
from tools.bench.common import RESULTS, write_results

OUT = RESULTS / "dynamic" / "hf_sizes.md"


def resized(x: dict, batch: int, tokens: int, seed: int) -> dict:
    """``x`` at batch ``batch``, token inputs ``tokens`` longer (fresh random values)."""
    gen, out = torch.Generator().manual_seed(seed), {}
    for key, value in x.items():
        shape = [batch] + list(value.shape[1:])
        if value.is_floating_point():
            out[key] = torch.randn(shape, generator=gen)
        else:
            if value.dim() == 2:
                shape[1] += tokens
            out[key] = torch.randint(4, 500, shape, generator=gen)
    return out


def seed(n: int) -> None:
    """Every generator a forward may draw from (Wav2Vec2's feature masking draws from NumPy's)."""
    torch.manual_seed(n)
    np.random.seed(n)
    random.seed(n)


def first_tensor(out):
    for key in ("last_hidden_state", "logits"):
        value = getattr(out, key, None)
        if isinstance(value, torch.Tensor):
            return value
    return out if isinstance(out, torch.Tensor) else out[0]


def run(name: str, config: memopt.Config, sizes) -> dict:
    model, x, _ = zoo.build("hf", name)
    eager = copy.deepcopy(model)
    inputs = [resized(x, batch, tokens, i) for i, (batch, tokens) in enumerate(sizes)]
    start = time.perf_counter()
    om = memopt.optimize(model, example_inputs=inputs[0], config=config, optimizer="adamw")
    row = {"optimize_s": time.perf_counter() - start, "sizes": []}
    for x in inputs:
        seed(3)
        mine = first_tensor(om(**x))
        seed(3)
        theirs = first_tensor(eager(**x))
        plan = om.plan
        row["sizes"].append((plan.capture, plan.estimated_saved_bytes, plan.baseline_saved_bytes,
                             bool(torch.equal(mine, theirs))))
        mine.float().pow(2).mean().backward()
        theirs.float().pow(2).mean().backward()
        model.zero_grad(set_to_none=True)
        eager.zero_grad(set_to_none=True)
    row["stats"] = om.shape_stats
    return row


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[1])
    parser.add_argument("--models", default="", help="comma-separated zoo names (default: all)")
    parser.add_argument("--dynamic", action="store_true", help="Config(dynamic=True)")
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--small", type=int, default=5)
    parser.add_argument("--more", type=int, default=16)
    parser.add_argument("--fewer", type=int, default=4)
    parser.add_argument("--out", default=str(OUT))
    args = parser.parse_args(argv)
    torch.set_num_threads(1)
    command = "python -m tools.bench.dynamic.sweep_hf_sizes" + (" " + " ".join(sys.argv[1:]) if argv is None
                                                                 and sys.argv[1:] else "")
    config = memopt.Config(dynamic=True if args.dynamic else None)
    sizes = [(args.batch, 0), (args.batch, args.more), (args.small, 0), (args.batch, -args.fewer)]
    names = [n.strip() for n in args.models.split(",") if n.strip()] or zoo.names("hf")
    lines = ["| model | optimize() s | planned | reused | planning s | " +
             " | ".join(f"batch {b}, tokens {t:+d}: capture, saved / eager KiB, forward =" for b, t in sizes) + " |",
             "|---|---|---|---|---|" + "---|" * len(sizes)]
    results = {}
    for name in names:
        try:
            row = results[name] = run(name, config, sizes)
        except Exception as e:  # noqa: BLE001 - a row with its error
            lines.append(f"| {name} | error: {type(e).__name__}: {str(e).splitlines()[0][:120] if str(e) else ''} |")
            continue
        stats = row["stats"]
        cells = [f"{c}, {s / 1024:.1f} / {b / 1024:.1f}, {'yes' if same else 'NO'}" for c, s, b, same in row["sizes"]]
        lines.append(f"| {name} | {row['optimize_s']:.2f} | {stats['planned']} | {stats['reused']} | "
                     f"{stats['plan_seconds'] + stats['reuse_seconds']:.2f} | " + " | ".join(cells) + " |")
        print(lines[-1], flush=True)
    done = list(results.values())
    whole = sum(all(c != "per-submodule" for c, *_ in r["sizes"]) for r in done)
    planning = [r["stats"]["plan_seconds"] + r["stats"]["reuse_seconds"] for r in done]
    summary = [
        f"Models: {len(names)}, {len(done)} ran; captured whole (not per submodule) at every size: {whole}; "
        f"forward bit-identical to eager at every size: {sum(all(s[3] for s in r['sizes']) for r in done)}.",
        f"Median optimize() {statistics.median(r['optimize_s'] for r in done):.2f} s; median planning over the "
        f"{len(sizes)} sizes {statistics.median(planning):.2f} s; input signatures planned: "
        f"{sum(r['stats']['planned'] for r in done)} of {len(sizes) * len(done)}.",
    ] if done else ["No model ran."]
    body = "\n".join([f"Config: {'Config(dynamic=True)' if args.dynamic else 'the default'}.", ""] + summary + [""]
                     + lines)
    write_results(args.out, "Hugging Face models across input sizes", command, __doc__, body)


if __name__ == "__main__":
    main()
