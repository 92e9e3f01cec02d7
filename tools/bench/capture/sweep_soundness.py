"""python -m tools.bench.capture.sweep_soundness [--only torchvision|timm|hf] [--limit N] [--out PATH]

Soundness sweep over a model zoo (issue 21): does memopt train the user's real model, and never keep more?

Every torchvision classification model, one model per timm family (the smallest variant by parameter count),
and ~35 Hugging Face architectures from tiny configs; random weights, train mode, batch 2, the smallest
input each model accepts. Per model, memopt.optimize(model, example_inputs=x) with memopt.Config() defaults,
compared with a deepcopy of the model run eagerly (the stock model).

Columns: `capture` is om.plan.capture (or `refused` when optimize raised); `soundness check` is
om.plan.soundness (the capture-time check: eager vs captured saved bytes on its slice of the batch) or, for a
per-submodule plan, why the whole model was not captured (the first om.plan.submodules record);
`fwd equal` is torch.equal on every output tensor of a training-mode forward of om and of the stock copy
from the same RNG seed (torch, numpy and random seeded), over 3 training steps; `buffers equal` compares
every buffer (and parameter) of the model om wraps with the stock copy's after those 3 steps (each step:
forward with the same seed, loss = sum of the floating outputs (memopt.cost_model.step.default_loss),
backward; no optimizer). `stock saved` / `memopt saved` are memopt.measure(...).saved_bytes (saved-tensor
hooks) of the stock copy and of om; `ratio` = memopt / stock. Gradients are not compared here: the
default Config's lossy techniques (stash, few-bit) change them by design; the capture check compares them
bit for bit under the exact graph. Flags: `MORE THAN STOCK` (memopt saved > stock saved), `SILENT DIFF`
(forward, buffers or parameters differ while optimize succeeded), `REFUSED` (optimize raised a
MemoptError), `ERROR` (any other exception, a timeout or a crashed worker; type and first line recorded),
`SETUP` (the stock model itself could not be built or run at any tried size: a sweep limitation, not
memopt's). Each model runs in a worker process with a per-model timeout; models above 100M parameters
run one at a time.
"""
from __future__ import annotations

import collections
import copy
import statistics
import time
from typing import Any, Dict, List, Optional

from tools.bench.capture.runner import call as _call, first_line as _first_line, run_state, seed as _seed, sweep
from tools.bench.capture.zoo import FAMILIES, build
from tools.bench.common import RESULTS

TITLE = "Soundness sweep: memopt vs the stock model over a model zoo"


# ------------------------------------------------------------------------------------------- one model
def _compare_outputs(a, b) -> Optional[str]:
    """None when every output tensor is bit-identical; else what differs."""
    from memopt.cost_model.step import output_tensors
    ta, tb = output_tensors(a), output_tensors(b)
    if len(ta) != len(tb):
        return f"{len(ta)} vs {len(tb)} output tensors"
    for i, (x, y) in enumerate(zip(ta, tb)):
        if x.shape != y.shape or x.dtype != y.dtype:
            return f"output {i}: {tuple(x.shape)} {x.dtype} vs {tuple(y.shape)} {y.dtype}"
        if not __import__("torch").equal(x, y):
            diff = (x.detach().double() - y.detach().double()).abs().max().item() if x.is_floating_point() else "-"
            return f"output {i} differs (max abs {diff:.3g})" if isinstance(diff, float) else f"output {i} differs"
    return None


def _compare_state(model, ref) -> List[str]:
    import torch
    differ = []
    ours = dict(model.named_buffers())
    theirs = dict(ref.named_buffers())
    for name in sorted(set(ours) | set(theirs)):
        if name not in ours or name not in theirs or not torch.equal(ours[name], theirs[name]):
            differ.append(name)
    ours_p, theirs_p = dict(model.named_parameters()), dict(ref.named_parameters())
    for name in sorted(set(ours_p) | set(theirs_p)):
        if name not in ours_p or name not in theirs_p or not torch.equal(ours_p[name], theirs_p[name]):
            differ.append(f"param {name}")
    return differ


def _soundness(plan) -> str:
    s = getattr(plan, "soundness", None) or {}
    if plan.capture == "per-submodule" or getattr(plan, "submodules", None):
        subs = plan.submodules or []
        return f"whole model not captured: {subs[0]['why']}" if subs else "per-submodule (no records)"
    if not s:
        return "(no soundness record)"
    if not s.get("checked"):
        return f"skipped: {s.get('slice')}"
    return f"passed on {s.get('slice')} (eager {s.get('eager_saved_bytes')} B, captured {s.get('captured_saved_bytes')} B)"


def _fallback(plan) -> str:
    subs = getattr(plan, "submodules", None) or []
    if not subs:
        return ""
    captured = [s for s in subs if s.get("captured")]
    eager = [s for s in subs[1:] if not s.get("captured")]
    text = f"per-submodule: {len(captured)} captured, {len(eager)} left eager"
    if eager:
        why = eager[0]["why"]
        same = sum(1 for s in eager if s["why"] == why)
        text += (f"; first: {eager[0]['path']} ({eager[0]['class']}): {why[:160]}"
                 + (f" (same reason for {same} of them)" if same > 1 else ""))
    return text


def _stock_error(ref, x) -> Optional[str]:
    """None if one training step of the stock model runs (on a copy); else its error."""
    from memopt.cost_model.step import default_loss
    try:
        _seed(7)
        default_loss(_call(copy.deepcopy(ref), x)).backward()
        return None
    except Exception as e:  # noqa: BLE001
        return _first_line(e)


def run_one(family: str, name: str) -> Dict[str, Any]:
    import memopt
    from memopt.cost_model.step import default_loss

    row: Dict[str, Any] = {"family": family, "model": name}
    start = time.time()
    try:
        model, x, desc = build(family, name)
        row["input"] = desc
        row["params"] = sum(p.numel() for p in model.parameters())
        ref = copy.deepcopy(model)
    except Exception as e:  # noqa: BLE001
        row.update(status="setup", reason=f"building the stock model: {_first_line(e)}")
        return row
    try:
        _seed(3)
        om = memopt.optimize(model, example_inputs=x)
    except Exception as e:  # noqa: BLE001
        stock = _stock_error(ref, x)
        if stock is not None:
            row.update(status="setup", reason=f"the stock model cannot train on these inputs: {stock}")
            return row
        row.update(status="refused" if isinstance(e, memopt.MemoptError) else "error", capture="refused",
                   reason=f"optimize: {_first_line(e)}")
        om = None
    if om is not None:
        plan = om.plan
        row["capture"] = plan.capture
        row["soundness"] = _soundness(plan)
        row["reason"] = _fallback(plan)
        try:
            fwd = None
            for step in range(3):
                _seed(100 + step)
                out_ref = _call(ref, x)
                default_loss(out_ref).backward()
                _seed(100 + step)
                out_om = _call(om, x)
                default_loss(out_om).backward()
                diff = _compare_outputs(out_om, out_ref)
                if diff and fwd is None:
                    fwd = f"step {step + 1}: {diff}"
                del out_ref, out_om
                for p in list(model.parameters()) + list(ref.parameters()):
                    p.grad = None
            row["fwd_equal"] = "yes" if fwd is None else f"NO ({fwd})"
            differ = _compare_state(model, ref)
            row["buffers_equal"] = "yes" if not differ else (
                f"NO ({len(differ)}: {', '.join(differ[:3])}{', ...' if len(differ) > 3 else ''})")
        except Exception as e:  # noqa: BLE001
            stock = _stock_error(ref, x)
            row.update(status="setup" if stock else "error",
                       reason=f"the stock model cannot train on these inputs: {stock}" if stock
                       else f"training steps: {_first_line(e)}")
    try:
        row["stock_saved"] = memopt.measure(ref, x).saved_bytes
        if om is not None and row.get("status") != "error":
            row["memopt_saved"] = memopt.measure(om, x).saved_bytes
    except Exception as e:  # noqa: BLE001
        if row.get("status") is None:
            row.update(status="error", reason=f"memopt.measure: {_first_line(e)}")
    row["seconds"] = round(time.time() - start, 1)
    row.setdefault("status", "ok")
    return row


# ------------------------------------------------------------------------------------------- the sweep
def _flags(row: Dict[str, Any]) -> List[str]:
    flags = []
    status = row.get("status")
    if status == "setup":
        flags.append("SETUP")
    elif status == "refused":
        flags.append("REFUSED")
    elif status in ("error", "timeout", "crashed"):
        flags.append("ERROR")
    if str(row.get("fwd_equal", "")).startswith("NO") or str(row.get("buffers_equal", "")).startswith("NO"):
        flags.append("SILENT DIFF")
    if row.get("memopt_saved") is not None and row.get("stock_saved") is not None \
            and row["memopt_saved"] > row["stock_saved"]:
        flags.append("MORE THAN STOCK")
    return flags


def _ratio(row) -> Optional[float]:
    s, m = row.get("stock_saved"), row.get("memopt_saved")
    if s is None or m is None or not s:
        return None
    return m / s


def _cell(text: Any, width: int = 220) -> str:
    text = "" if text is None else str(text)
    text = " ".join(text.split()).replace("|", "\\|")
    return text if len(text) <= width else text[:width - 3] + "..."


def render(rows: List[Dict[str, Any]], command: str, total: int, done: bool, started: float, kept: int = 0,
           code: str = "") -> str:
    from tabulate import tabulate
    from memopt.core.units import fmt_bytes

    summary = []
    for family in FAMILIES + ("all",):
        fr = [r for r in rows if family == "all" or r["family"] == family]
        if not fr:
            continue
        paths = collections.Counter(r.get("capture", "-") for r in fr if r.get("status") not in ("setup",))
        ratios = [x for x in (_ratio(r) for r in fr) if x is not None]
        summary.append([
            family, len(fr),
            ", ".join(f"{k} {v}" for k, v in sorted(paths.items())),
            sum(1 for r in fr if r.get("capture") == "per-submodule"),
            sum(1 for r in fr if r.get("status") == "refused"),
            sum(1 for r in fr if r.get("status") in ("error", "timeout", "crashed")),
            sum(1 for r in fr if r.get("status") == "setup"),
            sum(1 for r in fr if "SILENT DIFF" in _flags(r)),
            sum(1 for r in fr if "MORE THAN STOCK" in _flags(r)),
            f"{statistics.median(ratios):.3f}" if ratios else "-",
        ])
    summary_table = tabulate(summary, ["family", "models", "capture paths", "fallbacks (per-submodule)", "refusals",
                                       "errors", "setup failures", "silent differences (goal 0)",
                                       "more than stock (goal 0)", "median saved ratio memopt/stock"],
                             tablefmt="github")
    table = []
    for r in rows:
        ratio = _ratio(r)
        table.append([r["family"], r["model"], r.get("input", ""), r.get("capture", "-"),
                      _cell(r.get("soundness", ""), 160), _cell(r.get("fwd_equal", "-"), 80),
                      _cell(r.get("buffers_equal", "-"), 100),
                      fmt_bytes(r["stock_saved"]) if r.get("stock_saved") is not None else "-",
                      fmt_bytes(r["memopt_saved"]) if r.get("memopt_saved") is not None else "-",
                      f"{ratio:.3f}" if ratio is not None else "-", r.get("seconds", "-"),
                      ", ".join(_flags(r)), _cell(r.get("reason", ""))])
    full = tabulate(table, ["family", "model", "input", "capture", "soundness check", "fwd equal (3 steps)",
                            "buffers equal (3 steps)", "stock saved", "memopt saved", "ratio", "s", "flag",
                            "fallback / refusal / error reason"], tablefmt="github")
    flagged = [r for r in rows if _flags(r)]
    flag_lines = "\n".join(f"- {r['family']} / {r['model']}: {', '.join(_flags(r))}: "
                           f"{_cell(r.get('reason') or r.get('fwd_equal') or '', 300)}"
                           + (f"; buffers {_cell(r.get('buffers_equal'), 200)}"
                              if str(r.get('buffers_equal', '')).startswith('NO') else "")
                           for r in flagged) or "- none"
    return (f"{run_state(rows, total, done, started, kept, code)}\n\n## Summary\n\n{summary_table}\n\n## Flagged rows\n\n"
            f"{flag_lines}\n\n## All models\n\n{full}\n")


def main() -> None:
    sweep(__doc__, TITLE, "tools.bench.capture.sweep_soundness", RESULTS / "capture" / "soundness_sweep.md",
          "tools.bench.capture.sweep_soundness:run_one", render,
          lambda row: (f"{row.get('capture', '-')} {row.get('status')} fwd={row.get('fwd_equal', '-')} "
                       f"buf={row.get('buffers_equal', '-')} ratio={_ratio(row)} {', '.join(_flags(row))} "
                       f"{row.get('reason', '')[:200]}"))


if __name__ == "__main__":
    main()
