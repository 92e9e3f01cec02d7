"""python -m tools.bench.fidelity.bench_gate_miss --zoo timm|torchvision [--models a,b|all] [--settings 2x32,8x64] [--out FILE] [--resume]

The fidelity gate's miss rate (issue 39): after `memopt.optimize` has passed a plan, how far are its gradients from
eager autograd under losses the gate never saw?

Per model and setting (batch x resolution; random images, random init seeded, train mode, `memopt.Config()`
defaults): `om = memopt.optimize(model, example_inputs=x)` (the gate checks each parameter's gradient cosine >= 0.99
on a slice of the batch, under random projections of the outputs and the outputs' own direction), then one training
step of `om` and one of an eager deep copy taken before optimize (same weights, same input, the same RNG seed for
dropout) under each of 9 losses the gate did not see: 8 random projections of the outputs (memopt.fidelity.gate.
RandomProjection, seeds 100..107: weights drawn with a torch.Generator, the same for both models) and a user-style
cross-entropy on random labels (`ce`). Per parameter its worst cosine over the 9 (memopt.fidelity.gate.
parameter_fidelity), over the parameters the gate did not list apart (`om.plan.fidelity["invariant"]`); a parameter
whose exact gradient is tiny under one of these losses (below 1e-3 of the median norm, the gate's rule) is skipped
under that loss only (`tiny here`: those skipped under all 9); the gate's own `tiny` list (tiny under any one of its
losses) is compared here where it is not tiny (`gate's tiny compared`). `worst unseen`: the least of those cosines,
its parameter and loss; where it is below 0.99, `its eager/f64, memopt/f64`: that parameter's cosine under that loss
of eager float32's and of memopt's gradient against a float64 copy of the eager model (same step, whole batch): an
eager figure below the bar says float32 itself does not resolve it there; `worst proj` / `worst ce`: over the
projections / under ce only; `< 0.98`, `< 0.99`: how many of the compared parameters miss. `apart`: what the gate
listed apart: `f32-ill` (reason "float32 does not resolve it here": its float32 gradient below the bar against a
float64 step on the gate's slice), other `invariant` (structural: a parameter a training BatchNorm or a softmax
cancels), `tiny`. For the f32-ill ones: `gate f32/f64`, the least cosine the gate's reasons give, and on the whole
batch under ce, `eager f32/f64` and `memopt/f64`, the least cosine of eager float32's and of memopt's gradient
against a float64 copy of the eager model (same step); `f32-ill resolved here`: how many of them float32 does
resolve there (eager float32 at cosine >= 0.999 to float64, not tiny), `their worst memopt/eager (ce)` and `their <
0.98 / < 0.99`: memopt's cosine to eager float32 on those: parameters the gate did not check (its slice is smaller)
where a miss would be a real one. `gate`: passed or not, its worst cosine, steps, losses (projections it ran),
changes, and whether its last resort ran. `ratio` = om.plan.baseline_saved_bytes / om.plan.estimated_saved_bytes
(the planner's estimate). Seconds are wall time on a shared CPU at 1 thread.
"""
from __future__ import annotations

import argparse
import copy
import fcntl
import json
import os
import re
import sys
import time
import traceback
from pathlib import Path
from typing import Any, Dict, List, Tuple

from tools.bench.common import RESULTS

TITLE = "The fidelity gate's miss rate: gradient cosine under losses the gate did not see"
PROJECTION_SEEDS = tuple(range(100, 108))
INPUT_SEED, LABEL_SEED, INIT_SEED, STEP_SEED, OPTIMIZE_SEED = 1, 2, 0, 7, 3
ILL = "float32 does not resolve it here"
# one small model per timm family
TIMM_MODELS = ["resnet10t", "mobilenetv3_small_050", "efficientnet_lite0", "convnext_atto", "regnetx_002",
               "ghostnet_050", "repvit_m0_9", "vit_tiny_patch16_224", "deit_tiny_patch16_224", "levit_128s",
               "mobilevitv2_050", "densenet121", "iformer_t"]
ZOO_NAMES: Dict[str, Tuple[str, ...]] = {}  # --models all: the sweep zoo's models of the zoo, set by main
# above this many parameters a model is not run (fp32 model, its eager copy, a float64 twin and their gradients
# would not fit this bench's 24 GiB machine); its row says so
MAX_PARAMS = 400_000_000
EPS_ONLY = "sign of their difference"  # memopt.fidelity.degenerate_norms' reason


# ------------------------------------------------------------------------------------------- models
def build(zoo: str, name: str, batch: int, res: int):
    """(model in train mode, images, their size), random init seeded. With ``--models all`` (the sweep zoo's models,
    ``tools/bench/capture/zoo.py``) the images are the smallest size from ``res`` on that the model accepts."""
    import torch
    torch.manual_seed(INIT_SEED)
    if name in ZOO_NAMES.get(zoo, ()):
        from tools.bench.capture.zoo import build_timm, build_torchvision
        model, res = (build_torchvision if zoo == "torchvision" else build_timm)(name, res)
    elif zoo == "torchvision":
        import torchvision
        builder = getattr(torchvision.models, name)
        kw = {"image_size": res} if name.startswith("vit_") else {}
        if name in ("googlenet", "inception_v3"):
            kw["init_weights"] = True
        model = builder(weights=None, **kw)
    else:
        import timm
        try:
            model = timm.create_model(name, pretrained=False, img_size=res)
        except TypeError:  # takes no img_size
            torch.manual_seed(INIT_SEED)
            model = timm.create_model(name, pretrained=False)
    x = torch.randn(batch, 3, res, res, generator=torch.Generator().manual_seed(INPUT_SEED))
    return model.train(), x, res


def _first_output(out):
    from memopt.cost_model.step import output_tensors
    return next(t for t in output_tensors(out) if t.is_floating_point())


class CrossEntropy:
    """A user's loss: cross-entropy of the first floating output (the logits) on random labels (fixed seed)."""

    def __init__(self, batch: int) -> None:
        self.batch = batch
        self.labels = None

    def __call__(self, out):
        import torch
        import torch.nn.functional as F
        logits = _first_output(out)
        logits = logits.reshape(logits.shape[0], -1) if logits.dim() != 2 else logits
        if self.labels is None:
            self.labels = torch.randint(0, logits.shape[1], (logits.shape[0],),
                                        generator=torch.Generator().manual_seed(LABEL_SEED))
        return F.cross_entropy(logits.float(), self.labels)


def _grads(module, params, x, loss) -> List[Any]:
    import torch
    for p in params:
        p.grad = None
    torch.manual_seed(STEP_SEED)
    loss(module(x)).backward()
    out = [None if p.grad is None else p.grad.detach().clone() for p in params]
    for p in params:
        p.grad = None
    return out


# ------------------------------------------------------------------------------------------- one row
def run_one(zoo: str, name: str, batch: int, res: int) -> Dict[str, Any]:
    import torch

    import memopt
    from memopt.fidelity.gate import RandomProjection, parameter_fidelity

    row: Dict[str, Any] = {"zoo": zoo, "model": name, "setting": f"{batch}x{res}"}
    start = time.time()
    try:
        from tools.bench.capture.zoo import count_params  # named or --models all: never build what cannot fit
        row["params_total"] = count_params(zoo, name)
        if row["params_total"] > MAX_PARAMS:
            row.update(status="skipped", error=f"{row['params_total'] / 1e6:.0f}M parameters > MAX_PARAMS "
                                               f"{MAX_PARAMS / 1e6:.0f}M: would not fit this machine's memory")
            return row
        model, x, size = build(zoo, name, batch, res)
        if size != res:
            row["size"] = size
        ref = copy.deepcopy(model)
        names = [n for n, _ in model.named_parameters()]
        row["params"] = len(names)
        torch.manual_seed(OPTIMIZE_SEED)
        t = time.time()
        om = memopt.optimize(model, example_inputs=x)
        row["optimize_s"] = round(time.time() - t, 1)
        plan = om.plan
        if plan.estimated_saved_bytes:
            row["ratio"] = plan.baseline_saved_bytes / plan.estimated_saved_bytes
        gate = getattr(plan, "fidelity", None) or {}
        if not gate:
            row["gate"] = "none"
        else:
            worst = gate.get("worst") or {}
            row["gate"] = (f"{'passed' if gate.get('passed') else 'FAILED'} {worst.get('cosine', '-')}, "
                           f"{gate.get('steps')} steps, {gate.get('projections')} losses, "
                           f"{len(gate.get('changes', []))} changes"
                           + (", last resort" if gate.get("last_resort") else ""))
        invariant = dict(gate.get("invariant", {}))
        ill = {p: why for p, why in invariant.items() if why.startswith(ILL)}
        eps_only = [p for p, why in invariant.items() if EPS_ONLY in why]
        gate_tiny = set(gate.get("tiny", []))
        row.update(ill=len(ill), eps_only=len(eps_only), invariant=len(invariant) - len(ill) - len(eps_only),
                   tiny=len(gate_tiny - set(invariant)))
        if ill:
            cosines = [float(m.group(1)) for why in ill.values() for m in [re.search(r"cosine (-?[0-9.]+)", why)]
                       if m]
            row["gate_f64"] = min(cosines) if cosines else None
        apart = set(invariant)  # the gate's tiny ones are judged per loss here (tiny under one of its losses:
        # a zero-initialised head makes every gradient 0 under the outputs' own direction)
        # same weights: optimize must not have moved them
        for (n, p), q in zip(model.named_parameters(), ref.parameters()):
            if not torch.equal(p, q):
                raise RuntimeError(f"optimize changed {n}")
        params, ref_params = list(model.parameters()), list(ref.parameters())
        losses: List[Tuple[str, Any]] = [(f"proj{s}", RandomProjection(seed=s)) for s in PROJECTION_SEEDS]
        ce = CrossEntropy(batch)
        losses.append(("ce", ce))
        per: Dict[str, Tuple[float, str]] = {}  # parameter -> (worst cosine, loss)
        tiny_here = set()
        ce_grads = None
        for label, loss in losses:
            exact = _grads(ref, ref_params, x, loss)
            approx = _grads(om, params, x, loss)
            if label == "ce":
                ce_grads = (exact, approx)
            for p, f in parameter_fidelity(names, exact, approx, memopt.Config().fidelity.tiny).items():
                if p in apart:
                    continue
                if f["tiny"]:
                    tiny_here.add(p)
                    continue
                if p not in per or f["cosine"] < per[p][0]:
                    per[p] = (f["cosine"], label)
        row["tiny_here"] = len(tiny_here - set(per))
        row["gate_tiny_compared"] = len(gate_tiny & set(per))
        if per:
            worst_p = min(per, key=lambda p: per[p][0])
            row.update(worst=per[worst_p][0], worst_parameter=worst_p, worst_loss=per[worst_p][1],
                       compared=len(per), below98=sum(c < 0.98 for c, _ in per.values()),
                       below99=sum(c < 0.99 for c, _ in per.values()))
            proj = [c for c, lab in per.values() if lab != "ce"]
            row["worst_proj"] = min(proj) if proj else None
        # worst under ce alone
        exact, approx = ce_grads
        ce_fig = parameter_fidelity(names, exact, approx, memopt.Config().fidelity.tiny)
        ce_kept = [f["cosine"] for p, f in ce_fig.items() if p not in apart and not f["tiny"]]
        row["worst_ce"] = min(ce_kept) if ce_kept else None
        try:  # a float64 copy of the eager model, same step: the f32-ill parameters under ce, the worst one
            twin = copy.deepcopy(ref).double()
            twin_params = list(twin.parameters())
            if ill:
                full = _grads(twin, twin_params, x.double(), ce)
                e64 = parameter_fidelity(names, full, exact, 0.0)
                m64 = parameter_fidelity(names, full, approx, 0.0)
                row["eager_f64"] = min(e64[p]["cosine"] for p in ill if p in e64)
                row["memopt_f64"] = min(m64[p]["cosine"] for p in ill if p in m64)
                # those float32 does resolve on the whole batch under ce: memopt against eager there
                resolved = [p for p in ill if p in e64 and e64[p]["cosine"] >= 0.999 and not ce_fig[p]["tiny"]]
                row["ill_resolved"] = len(resolved)
                if resolved:
                    w = min(resolved, key=lambda p: ce_fig[p]["cosine"])
                    row.update(ill_worst=ce_fig[w]["cosine"], ill_worst_parameter=w,
                               ill_below99=sum(ce_fig[p]["cosine"] < 0.99 for p in resolved),
                               ill_below98=sum(ce_fig[p]["cosine"] < 0.98 for p in resolved))
            if per and per[worst_p][0] < 0.99:  # the worst parameter under its worst loss: float32's own noise?
                loss = dict(losses)[row["worst_loss"]]
                i = names.index(worst_p)
                full = _grads(twin, twin_params, x.double(), loss)
                exact = _grads(ref, ref_params, x, loss)
                approx = _grads(om, params, x, loss)
                e64 = parameter_fidelity([worst_p], [full[i]], [exact[i]], 0.0)[worst_p]["cosine"]
                m64 = parameter_fidelity([worst_p], [full[i]], [approx[i]], 0.0)[worst_p]["cosine"]
                row["worst_f64"] = f"{e64:.4f} / {m64:.4f}"
            del twin
        except Exception as e:  # noqa: BLE001
            row["note"] = f"float64 step: {type(e).__name__}: {str(e).splitlines()[0][:120] if str(e) else ''}"
        row["status"] = "ok"
    except Exception as e:  # noqa: BLE001
        text = str(e).strip().splitlines()
        row.update(status="error", error=f"{type(e).__name__}: {text[0][:200] if text else ''}")
        traceback.print_exc()
    row["seconds"] = round(time.time() - start, 1)
    return row


# ------------------------------------------------------------------------------------------- the file
def _f(v, digits: int = 4) -> str:
    return "-" if v is None else f"{v:.{digits}f}" if isinstance(v, float) else str(v)


def section(zoo: str, rows: List[Dict[str, Any]], command: str, total: int, done: bool) -> str:
    from tabulate import tabulate
    state = (f"Complete: {len(rows)} rows." if done else f"**Partial** ({len(rows)} of {total} rows so far; "
             f"the run is going on or was stopped).")
    summary = []
    for setting in sorted({r["setting"] for r in rows}, key=lambda s: tuple(map(int, s.split("x")))) + ["all"]:
        sr = [r for r in rows if setting == "all" or r["setting"] == setting]
        ok = [r for r in sr if r.get("worst") is not None]
        ratios = sorted(r["ratio"] for r in sr if r.get("ratio"))
        summary.append([setting, len(sr), len(ok), sum(r["worst"] >= 0.99 for r in ok),
                        sum(r["worst"] >= 0.98 for r in ok), _f(min((r["worst"] for r in ok), default=None)),
                        sum(r.get("below99", 0) for r in ok), sum(r.get("below98", 0) for r in ok),
                        sum(r.get("compared", 0) for r in ok), sum(1 for r in sr if r.get("ill")),
                        sum(r.get("ill", 0) for r in sr),
                        f"{sum(r.get('ill_resolved', 0) for r in sr)}: {sum(r.get('ill_below98', 0) for r in sr)} / "
                        f"{sum(r.get('ill_below99', 0) for r in sr)}",
                        sum(1 for r in sr if "FAILED" in str(r.get("gate", ""))),
                        sum(r.get("status") == "error" for r in sr), sum(r.get("status") == "skipped" for r in sr),
                        _f(ratios[len(ratios) // 2], 2) if ratios else "-"])
    summary_table = tabulate(summary, ["setting", "rows", "compared", "worst >= 0.99", "worst >= 0.98",
                                       "least worst", "params < 0.99", "params < 0.98", "params compared",
                                       "models with f32-ill", "f32-ill params",
                                       "f32-ill resolved here: < 0.98 / < 0.99", "gate failed", "errors", "skipped",
                                       "median ratio"], tablefmt="github")
    table = []
    for r in rows:
        table.append([r["model"] + (f" @{r['size']}" if r.get("size") else ""), r["setting"], _f(r.get("worst")),
                      f"{r['worst_parameter']} ({r['worst_loss']})" if r.get("worst_parameter") else "-",
                      r.get("worst_f64", "-"), _f(r.get("worst_proj")), _f(r.get("worst_ce")),
                      f"{r['below98']}/{r['compared']}" if "below98" in r else "-",
                      f"{r['below99']}/{r['compared']}" if "below99" in r else "-",
                      f"{r.get('ill', '-')} / {r.get('eps_only', '-')} / {r.get('invariant', '-')} / {r.get('tiny', '-')}",
                      f"{r.get('tiny_here', '-')} / {r.get('gate_tiny_compared', '-')}", _f(r.get("gate_f64"), 3),
                      _f(r.get("eager_f64")), _f(r.get("memopt_f64")), r.get("ill_resolved", "-"),
                      f"{_f(r['ill_worst'])} ({r['ill_worst_parameter']})" if r.get("ill_worst_parameter") else "-",
                      f"{r['ill_below98']} / {r['ill_below99']}" if "ill_below99" in r else "-", str(r.get("gate", "-")), _f(r.get("optimize_s"), 1),
                      _f(r.get("ratio"), 2), _f(r.get("seconds"), 0),
                      " ".join(str(r.get("error", r.get("note", ""))).split())[:200].replace("|", "\\|")])
    full = tabulate(table, ["model", "setting", "worst unseen", "worst parameter (loss)", "its eager/f64, memopt/f64",
                            "worst proj", "worst ce",
                            "< 0.98", "< 0.99", "apart: f32-ill / BN eps-only / invariant / tiny", "tiny here / gate's tiny compared",
                            "gate f32/f64", "eager f32/f64", "memopt/f64", "f32-ill resolved here",
                            "their worst memopt/eager (ce)", "their < 0.98 / < 0.99", "gate", "optimize s", "ratio", "s",
                            "error"], tablefmt="github")
    return (f"<!-- section {zoo} -->\n## {zoo}\n\nCommand: `{command}`. {state} Load average at write time: "
            f"{os.getloadavg()[0]:.1f}.\n\n{summary_table}\n\n{full}\n<!-- end {zoo} -->\n")


def write(out: Path, zoo: str, text: str, doc: str) -> None:
    """Replace this zoo's section of ``out`` (other zoos' sections are kept), under a lock."""
    import torch
    out.parent.mkdir(parents=True, exist_ok=True)
    with open("/tmp/memopt_gate_miss.lock", "w") as lock:  # two zoos' runs may share the file
        fcntl.flock(lock, fcntl.LOCK_EX)
        old = out.read_text() if out.exists() else ""
        sections = dict(re.findall(r"<!-- section (\w+) -->\n(.*?<!-- end \1 -->\n)", old, re.S))
        sections[zoo] = text.split("\n", 1)[1]
        ordered = [z for z in ("timm", "torchvision") if z in sections] + \
            sorted(z for z in sections if z not in ("timm", "torchvision"))
        commands = [re.search(r"Command: `([^`]*)`", sections[z]).group(1) for z in ordered]
        description = doc.split("\n\n", 2)[2].strip()
        body = "\n".join(f"<!-- section {z} -->\n{sections[z]}" for z in ordered)
        out.write_text(f"# {TITLE}\n\nCommand: {', then '.join(f'`{c}`' for c in commands)} (torch "
                       f"{torch.__version__}, CPU, 1 thread; each section below is one run).\n\n"
                       f"{description}\n\n{body}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[1])
    parser.add_argument("--zoo", choices=("timm", "torchvision"), required=True)
    parser.add_argument("--models", default="", help="comma-separated names (default: the zoo's list)")
    parser.add_argument("--settings", default="2x32,8x64", help="batch x resolution, comma-separated")
    parser.add_argument("--out", default=str(RESULTS / "fidelity" / "gate_miss.md"))
    parser.add_argument("--resume", action="store_true",
                        help="keep the rows of the zoo's jsonl beside --out and run only the missing ones")
    args = parser.parse_args()
    import logging
    import warnings

    import torch
    torch.set_num_threads(1)
    warnings.filterwarnings("ignore")
    logging.getLogger("memopt").setLevel(logging.ERROR)
    if args.models == "all":  # the sweep zoo's models, fewest parameters first (the heavy ones last)
        from tools.bench.capture.zoo import count_params, names
        ZOO_NAMES[args.zoo] = tuple(names(args.zoo))
        models = sorted(ZOO_NAMES[args.zoo], key=lambda m: count_params(args.zoo, m))
    elif args.models:
        models = [m.strip() for m in args.models.split(",") if m.strip()]
    elif args.zoo == "timm":
        models = list(TIMM_MODELS)
    else:
        import torchvision
        models = list(torchvision.models.list_models(module=torchvision.models))
    settings = [tuple(int(v) for v in s.split("x")) for s in args.settings.split(",")]
    command = "python -m tools.bench.fidelity.bench_gate_miss " + " ".join(sys.argv[1:])
    out = Path(args.out)
    store = out.with_name(f"{out.stem}_{args.zoo}.jsonl")  # every row as it is measured: --resume reads it
    rows: List[Dict[str, Any]] = []
    if args.resume and store.exists():
        rows = [json.loads(line) for line in store.read_text().splitlines() if line.strip()]
    elif store.exists():
        store.unlink()
    done = {(r["model"], r["setting"]) for r in rows}
    total = len(models) * len(settings)
    for batch, res in settings:
        for name in models:
            if (name, f"{batch}x{res}") in done:
                continue
            row = run_one(args.zoo, name, batch, res)
            rows.append(row)
            with open(store, "a") as f:
                f.write(json.dumps(row) + "\n")
            print(f"{name} {batch}x{res}: {row.get('status')} worst={_f(row.get('worst'))} "
                  f"({row.get('worst_parameter')}, {row.get('worst_loss')}) <0.99={row.get('below99')} "
                  f"ill={row.get('ill')} gate={row.get('gate')} {row.get('seconds')} s {row.get('error', '')}",
                  flush=True)
            write(out, args.zoo, section(args.zoo, rows, command, total, len(rows) == total), __doc__)
    write(out, args.zoo, section(args.zoo, rows, command, total, len(rows) >= total), __doc__)


if __name__ == "__main__":
    main()
