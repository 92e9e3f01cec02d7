"""python -m tools.bench.fidelity.sweep_fidelity [--only torchvision|timm|hf] [--limit N] [--models a,b] [--resume] [--bf16]

Gradient fidelity sweep (issue 22): at the default config, how close are memopt's gradients to exact autograd on
real models, what did the fidelity gate change, and what is left of the savings?

The zoo of the soundness sweep (tools/bench/capture/zoo.py: every torchvision classifier, one model per timm
family, Hugging Face architectures from tiny configs; random weights, train mode, batch 2; images of 128x128 or
the smallest larger size the model accepts (torchvision ViTs: their fixed patch grid), where BatchNorm sees
enough elements per channel to be a fair test). Per model: `memopt.optimize(model, example_inputs=x)` with `memopt.Config()` defaults (the
fidelity gate on), then one training step of om and of a deep copy run eagerly from the same RNG seed, loss =
the floating outputs times fixed random weights (memopt.fidelity.gate.RandomProjection, seed 11: not the gate's
seed 0), and the per-parameter gradient cosine (memopt.fidelity.gate.parameter_fidelity) over the parameters not
listed apart: `worst` and `p5` (5th percentile) cosine, `< 0.99` how many miss 0.99; parameters whose exact
gradient is below 1e-3 of the median norm, and those the gate lists as cancelled by a training-mode
BatchNorm (memopt.fidelity.gate.invariant_parameters), are counted in `apart`. `gate` is om.plan.fidelity:
passed or not, its training steps and changes (the first one shown), `-` where no lossy unit was planned
and `per-submodule` where the model was captured per submodule with no lossy rewrite (each submodule gated on its
own; with lossy rewrites the model is then gated as a whole: `per-submodule, whole model passed, ...`).
`capture`: how memopt captured it (om.plan.capture); `rewritten nodes`: the plan's rewritten nodes per
technique (the section "Techniques by node kind" counts them by op). `stock saved` / `memopt saved`:
memopt.measure(...).saved_bytes (saved-tensor hooks); `ratio` = stock /
memopt (higher is better). Flags: `BELOW 0.98` (the issue's goal: none), `ERROR`, `SETUP` (the stock model
cannot train on the inputs: a sweep limitation).

`--bf16`: the same per model with CPU bf16 autocast (``torch.autocast("cpu", dtype=torch.bfloat16)``) around
optimize, both training steps and both measurements, so memopt is compared with the eager model under the same
autocast (the bytes autograd keeps are then mostly bf16 copies), merged into fidelity_sweep_bf16_<family>.md. There
`autocast floor` is autocast's own error on the worst parameter (the cosine of eager under autocast against eager
float32, same seed and projection), `memopt vs float32` memopt's under autocast against eager float32 on that
parameter (near the floor: memopt adds little to autocast's own error there), and `autocast least` autocast's
least over the parameters compared: where memopt's worst is near them, it is at bf16's own noise. There "tiny" is
judged on the float32 gradient: bf16 rounding lifts a gradient that is ~0 (a BatchNorm scale a later training
BatchNorm cancels at init) above the rule.

Each zoo has one current results file, docs/results/fidelity/fidelity_sweep_<family>.md (.jsonl beside it; under
`--bf16` fidelity_sweep_bf16_<family>.md): one row per model, its latest run. Without `--out` a run goes to a
scratch file in the temporary folder (its .jsonl is what `--resume` continues) and, once complete, is merged model
by model into those files: a re-run of some models replaces their rows and keeps the others; the merged file names
the runs it holds. With `--out` the run is written to that file alone.
"""
from __future__ import annotations

import argparse
import collections
import contextlib
import copy
import io
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any, Dict, List, Optional

from tools.bench.capture.runner import call, code_state, first_line, run_state, seed, sweep
from tools.bench.capture.zoo import FAMILIES, build
from tools.bench.common import RESULTS, write_results

SCRIPT = "tools.bench.fidelity.sweep_fidelity"
TITLE = "Gradient fidelity sweep: memopt's default config vs exact autograd over a model zoo"
BF16_TITLE = TITLE + ", under bf16 autocast"
SCRATCH = Path(tempfile.gettempdir()) / "memopt_fidelity_sweep"  # a run before it is merged into the current files
MERGED = "Each model's latest row, merged model by model from these runs (oldest first; each names its code): "
GOAL = 0.98
MIN_SIZE = 128


def _gradients(module, model, x, loss) -> List[Any]:
    model.zero_grad(set_to_none=True)
    seed(7)
    loss(call(module, x)).backward()
    return [p.grad for p in model.parameters()]


def run_one(family: str, name: str) -> Dict[str, Any]:
    import torch
    from torch.fx.passes.shape_prop import ShapeProp

    import memopt
    from memopt.capture.trace import capture
    from memopt.fidelity.gate import RandomProjection, invariant_parameters, parameter_fidelity

    row: Dict[str, Any] = {"family": family, "model": name}
    start = time.time()
    try:
        model, x, desc = build(family, name, MIN_SIZE)
        row["input"] = desc
        ref = copy.deepcopy(model)
        autocast = torch.is_autocast_enabled("cpu")
        full = copy.deepcopy(model) if autocast else None
        exact = _gradients(ref, ref, x, RandomProjection(seed=11))  # before optimize: a stock failure is SETUP
    except Exception as e:  # noqa: BLE001
        row.update(status="setup", reason=f"the stock model: {first_line(e)}")
        return row
    if autocast:  # eager float32 against eager under autocast: how far autocast alone moves each gradient
        with torch.autocast("cpu", enabled=False):
            floor = _gradients(full, full, x, RandomProjection(seed=11))
        del full
    try:
        seed(3)
        t = time.time()
        om = memopt.optimize(model, example_inputs=x)
        row["optimize_s"] = round(time.time() - t, 1)
    except Exception as e:  # noqa: BLE001
        row.update(status="error", reason=f"optimize: {first_line(e)}")
        return row
    plan = om.plan
    row["capture"] = plan.capture
    row["techniques"] = _techniques(plan)
    gate = getattr(plan, "fidelity", None)
    whole = "per-submodule, whole model " if getattr(plan, "submodules", None) else ""
    if gate:
        row["gate"] = (f"{whole}{'passed' if gate['passed'] else 'FAILED'}, {gate.get('steps')} steps, "
                       f"{len(gate['changes'])} changes" + (f": {gate['changes'][0]}" if gate["changes"] else ""))
    elif whole:
        row["gate"] = "per-submodule"
    else:
        row["gate"] = "-"
    try:
        approx = _gradients(om, model, x, RandomProjection(seed=11))
        names = [n for n, _ in model.named_parameters()]
        try:
            invariant = {}
            if not isinstance(x, dict):
                gm = capture(ref, x if isinstance(x, tuple) else (x,), {}).graph_module
                with torch.no_grad():  # shapes for the rules that follow reshapes (a key bias before a softmax)
                    ShapeProp(gm).propagate(*(x if isinstance(x, tuple) else (x,)))
                invariant = invariant_parameters(gm)
        except Exception:  # noqa: BLE001  (models only captured per submodule: nothing listed apart)
            invariant = {}
        figures = parameter_fidelity(names, exact, approx, 1e-3, invariant)
        own = parameter_fidelity(names, floor, exact, 1e-3, invariant) if autocast else {}
        for p, f in own.items():  # ~0 in float32 (the "tiny" rule on the true gradient), lifted by bf16 rounding
            if f["tiny"]:
                figures[p]["excluded"] = True
        kept = sorted(f["cosine"] for f in figures.values() if not f["excluded"])
        if kept:
            worst = min(figures.items(), key=lambda kv: kv[1]["cosine"] if not kv[1]["excluded"] else 2.0)
            row.update(worst=round(kept[0], 4), worst_parameter=worst[0], p5=round(kept[len(kept) // 20], 4),
                       below=sum(c < 0.99 for c in kept), gated=len(kept),
                       apart=sum(f["excluded"] for f in figures.values()))
            if autocast:  # autocast's own error on that parameter: eager float32 vs eager under autocast
                row["autocast_floor"] = round(own[worst[0]]["cosine"], 4)
                # and memopt's under autocast against eager float32: at the floor, memopt adds nothing visible
                row["memopt_float32"] = round(parameter_fidelity(names, floor, approx, 1e-3, invariant)
                                              [worst[0]]["cosine"], 4)
                row["autocast_least"] = round(min(f["cosine"] for f in own.values() if not f["excluded"]), 4)
        row["stock_saved"] = memopt.measure(ref, x).saved_bytes
        row["memopt_saved"] = memopt.measure(om, x).saved_bytes
    except Exception as e:  # noqa: BLE001
        row.update(status="error", reason=f"gradients / measure: {first_line(e)}")
    row["seconds"] = round(time.time() - start, 1)
    row.setdefault("status", "ok")
    return row


def run_one_bf16(family: str, name: str) -> Dict[str, Any]:
    """``run_one`` under CPU bf16 autocast (the model's parameters stay float32, as in mixed-precision training)."""
    import torch
    with torch.autocast("cpu", dtype=torch.bfloat16):
        return dict(run_one(family, name), autocast="bf16")


def _techniques(plan) -> Dict[str, Dict[str, int]]:
    """{technique: {the rewritten node's op: nodes}} of a plan (per-submodule plans list every submodule's)."""
    found: Dict[str, Dict[str, int]] = {}
    for node in plan.nodes:
        if node.technique != "exact":
            ops = found.setdefault(node.technique, {})
            ops[node.op] = ops.get(node.op, 0) + 1
    return found


def _technique_summary(row) -> str:
    return ", ".join(f"{t} {sum(ops.values())}" for t, ops in sorted(row.get("techniques", {}).items())) or "-"


def _ratio(row) -> Optional[float]:
    s, m = row.get("stock_saved"), row.get("memopt_saved")
    return s / m if s and m else None


def _flags(row: Dict[str, Any]) -> List[str]:
    flags = []
    if row.get("status") == "setup":
        flags.append("SETUP")
    elif row.get("status") not in ("ok", None):
        flags.append("ERROR")
    if row.get("worst") is not None and row["worst"] < GOAL:
        flags.append(f"BELOW {GOAL}")
    return flags


def render(rows: List[Dict[str, Any]], command: str, total: int, done: bool, started: float, kept: int = 0,
           code: str = "") -> str:
    from tabulate import tabulate
    from memopt.core.units import fmt_bytes

    summary = []
    for family in FAMILIES + ("all",):
        fr = [r for r in rows if family == "all" or r["family"] == family]
        if not fr:
            continue
        ratios = [x for x in (_ratio(r) for r in fr) if x is not None]
        worst = [r["worst"] for r in fr if r.get("worst") is not None]
        summary.append([family, len(fr), len(worst), sum(w < GOAL for w in worst), sum(w < 0.99 for w in worst),
                        f"{min(worst):.4f}" if worst else "-", f"{statistics.median(worst):.4f}" if worst else "-",
                        sum(1 for r in fr if str(r.get("gate", "")).startswith("FAILED")),
                        sum(1 for r in fr if "ERROR" in _flags(r)),
                        f"{statistics.median(ratios):.2f}" if ratios else "-"])
    summary_table = tabulate(summary, ["family", "models", "compared", f"worst < {GOAL} (goal 0)", "worst < 0.99",
                                       "least worst", "median worst", "gate failed", "errors",
                                       "median saved ratio stock/memopt"], tablefmt="github")
    floors = any("autocast_floor" in r for r in rows)
    table = []
    for r in sorted(rows, key=lambda r: (r["family"], r.get("worst", 2.0))):
        ratio = _ratio(r)
        table.append([r["family"], r["model"], r.get("input", ""), r.get("worst", "-"),
                      r.get("worst_parameter", "-"), r.get("p5", "-"),
                      f"{r['below']}/{r['gated']}" if "below" in r else "-", r.get("apart", "-")]
                     + ([r.get("autocast_floor", "-"), r.get("memopt_float32", "-"), r.get("autocast_least", "-")]
                        if floors else [])
                     + [" ".join(str(r.get("gate", "-")).split())[:160].replace("|", "\\|"),
                      fmt_bytes(r["stock_saved"]) if r.get("stock_saved") else "-",
                      fmt_bytes(r["memopt_saved"]) if r.get("memopt_saved") else "-",
                      f"{ratio:.2f}" if ratio else "-", r.get("capture", "-"), _technique_summary(r),
                      r.get("optimize_s", "-"), ", ".join(_flags(r)),
                      " ".join(str(r.get("reason", "")).split())[:200].replace("|", "\\|")])
    full = tabulate(table, ["family", "model", "input", "worst", "worst parameter", "p5", "< 0.99", "apart"]
                    + (["autocast floor", "memopt vs float32", "autocast least"] if floors else [])
                    + ["gate", "stock saved", "memopt saved", "ratio", "capture", "rewritten nodes", "optimize s",
                       "flag", "reason"], tablefmt="github")
    kinds: Dict[tuple, List[int]] = {}
    for r in rows:  # (family, technique, op) -> [models, nodes]
        for technique, ops in r.get("techniques", {}).items():
            for op, n in ops.items():
                entry = kinds.setdefault((r["family"], technique, op), [0, 0])
                entry[0] += 1
                entry[1] += n
    captures = collections.Counter((r["family"], r["capture"]) for r in rows if r.get("capture"))
    by_kind = tabulate([[f, t, op, m, n] for (f, t, op), (m, n) in sorted(kinds.items())],
                       ["family", "technique", "rewritten node op", "models", "nodes"], tablefmt="github")
    by_capture = tabulate([[f, c, n] for (f, c), n in sorted(captures.items())], ["family", "capture", "models"],
                          tablefmt="github")
    return (f"{run_state(rows, total, done, started, kept, code)}\n\n## Summary\n\n{summary_table}\n\n"
            f"## All models (worst first per family)\n\n{full}\n\n## Capture paths\n\n{by_capture}\n\n"
            f"## Techniques by node kind (the rewritten nodes' ops, over the models)\n\n{by_kind}\n")


def current_file(family: str, bf16: bool = False) -> Path:
    """A zoo's current results file (one row per model, its latest run), which a run without --out updates."""
    return RESULTS / "fidelity" / f"fidelity_sweep_{'bf16_' if bf16 else ''}{family}.md"


def read_rows(jsonl: Path) -> List[Dict[str, Any]]:
    """A sweep's rows, one per model: where a model has several lines, its last."""
    rows: Dict[tuple, Dict[str, Any]] = {}
    for line in jsonl.read_text().splitlines() if jsonl.exists() else []:
        if line.strip():
            r = json.loads(line)
            rows[(r.get("family"), r["model"])] = r
    return list(rows.values())


def merged_from(out: Path) -> List[str]:
    """The runs a current file was merged from, as its MERGED line names them."""
    lines = out.read_text().splitlines() if out.exists() else []
    return next((line[len(MERGED):].rstrip(".").split("; ") for line in lines if line.startswith(MERGED)), [])


def write_current(out: Path, rows: List[Dict[str, Any]], command: str, sources: List[str], bf16: bool) -> None:
    """Write a zoo's current file: ``rows`` (one per model, as they were recorded) to its .jsonl, and rendered as a
    sweep's results under ``command`` and the line naming ``sources``, the runs they were merged from."""
    out.with_suffix(".jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    body = render(rows, command, len(rows), True, time.time()).split("\n\n", 1)[1]  # less the run's own state
    with contextlib.redirect_stdout(io.StringIO()):
        write_results(out, BF16_TITLE if bf16 else TITLE, command, __doc__,
                      f"{MERGED}{'; '.join(sources)}.\n\n{body}")
    print(f"{out}: {len(rows)} models")


def merge_run(run: Path, command: str, code: str, bf16: bool) -> None:
    """Merge a complete run's rows into each family's current file, model by model: the run's rows replace those
    of the same models, the other models keep theirs."""
    ran = read_rows(run)
    for family in FAMILIES:
        fresh = [r for r in ran if r.get("family") == family]
        if not fresh:
            continue
        out = current_file(family, bf16)
        rows = {(r.get("family"), r["model"]): r for r in read_rows(out.with_suffix(".jsonl"))}
        rows.update({(r.get("family"), r["model"]): r for r in fresh})
        write_current(out, list(rows.values()), command,
                      merged_from(out) + [f"`{command}` ({code}, {len(fresh)} models)"], bf16)


def main() -> None:
    parser = argparse.ArgumentParser(add_help=False)  # the two options of the runner's that decide where rows go
    parser.add_argument("--out")
    parser.add_argument("--bf16", action="store_true")
    known, _ = parser.parse_known_args()
    code = code_state()
    scratch = SCRATCH / ("fidelity_sweep_bf16.md" if known.bf16 else "fidelity_sweep.md")
    sweep(__doc__, TITLE, SCRIPT, SCRATCH / "fidelity_sweep.md", f"{SCRIPT}:run_one", render,
          lambda row: (f"{row.get('status')} worst={row.get('worst')} ({row.get('worst_parameter')}) "
                       f"ratio={_ratio(row)} gate={str(row.get('gate'))[:120]} {', '.join(_flags(row))} "
                       f"{row.get('reason', '')[:200]}"),
          {"--bf16": ("run every model under CPU bf16 autocast", f"{SCRIPT}:run_one_bf16",
                      SCRATCH / "fidelity_sweep_bf16.md", BF16_TITLE)})
    if known.out is None:  # the run is complete: merge it into the current files
        merge_run(scratch.with_suffix(".jsonl"), f"python -m {SCRIPT}" + "".join(f" {a}" for a in sys.argv[1:]),
                  code, known.bf16)


if __name__ == "__main__":
    main()
