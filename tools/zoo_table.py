"""python -m tools.zoo_table [--merge]   (seconds: it reads the committed sweep results, it runs no model)

The supported-models table of the README, from the fidelity sweeps over the real model zoos
(``tools/bench/fidelity/sweep_fidelity.py``: every torchvision classifier, one model per timm family, Hugging
Face architectures from tiny configs; the default ``memopt.Config()``): per family, the models the sweep ran,
how memopt captured them, the median and least saved-bytes ratio (saved-tensor hooks, stock / memopt), the
models whose worst per-parameter gradient cosine is below 0.98, the gate failures, and which techniques
rewrote which kinds of nodes. Only sweeps that recorded the capture path (the current sweep tool) are read.
Writes docs/results/zoo_table.md and prints the README rows.

It reads each zoo's current sweep file (tools/bench/fidelity/sweep_fidelity.py's ``current_file``: one row per
model, its latest run; re-runs of the sweep merge into it). ``--merge`` wrote those files, once, from the sweep
files in ARCHIVED (since moved to docs/results/archive/fidelity/), keeping each model's row from the last file that
ran it.
"""
from __future__ import annotations

import argparse
import json
import statistics
from collections import Counter
from pathlib import Path
from typing import Any, Dict, List, Tuple

from tabulate import tabulate

from tools.bench.common import RESULTS
from tools.bench.fidelity.sweep_fidelity import current_file, write_current

# (family as shown, the zoo, under bf16 autocast): the table reads the zoo's current file
SWEEPS = [("torchvision", "torchvision", False), ("timm", "timm", False), ("Hugging Face", "hf", False),
          ("timm, bf16 autocast", "timm", True), ("Hugging Face, bf16 autocast", "hf", True)]
# what --merge made each current file of, oldest first (a model re-run in a later file is kept once, with its latest
# row; the bf16 sweeps hold several families, filtered by the zoo's)
TV = "fidelity_sweep_torchvision"
ARCHIVED = {TV: [f"{TV}_f76933a", f"{TV}_rerun_a2eb48f", f"{TV}_rerun_f1c9010", f"{TV}_rerun_7d69347",
                 f"{TV}_rerun_1c38567", f"{TV}_rerun_d948d97", f"{TV}_rerun_1a96120"],
            "fidelity_sweep_timm": ["fidelity_sweep_timm_0f1cf69", "fidelity_sweep_timm_rerun_d948d97",
                                    "fidelity_sweep_timm_rerun_1a96120"],
            "fidelity_sweep_hf": ["fidelity_sweep_hf_ca9f7fa", "fidelity_sweep_hf_rerun_d948d97",
                                  "fidelity_sweep_hf_rerun_1a96120"],
            "fidelity_sweep_bf16_timm": ["fidelity_sweep_bf16_0a888e0", "fidelity_sweep_bf16_timm_rerun",
                                         "fidelity_sweep_bf16_timm_97a7817", "fidelity_sweep_bf16_timm_rerun_5ee3afc",
                                         "fidelity_sweep_bf16_timm_rerun_f830915"],
            "fidelity_sweep_bf16_hf": ["fidelity_sweep_bf16", "fidelity_sweep_bf16_hf_rerun_4c2073c"]}
ARCHIVE = RESULTS / "archive" / "fidelity"
KINDS = {"bn_act_stash": "BN-act chains", "conv_from_stash": "convs after chains", "linear_from_stash":
         "linears after chains", "generic_encode": "generic codes", "linear_from_codes": "linear inputs",
         "conv_from_codes": "conv inputs", "weight_op_from_rebuild": "rebuilt after norms",
         "weight_op_recomputed": "recomputed weights",
         "coded_call": "coded ops (norms, attention, products)", "fewbit_activation": "activations",
         "dropout_1bit": "dropout masks", "max_pool2d_indices_only": "max-pool offsets"}


def _rows(name: str, folder: Path = RESULTS / "fidelity") -> List[Dict[str, Any]]:
    path = folder / f"{name}.jsonl"
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()] if path.exists() else []


def _ratio(row) -> float:
    return row["stock_saved"] / row["memopt_saved"] if row.get("stock_saved") and row.get("memopt_saved") else 0.0


def latest(names: List[str], only, folder: Path = RESULTS / "fidelity") -> Tuple[List[Dict[str, Any]], str]:
    """Each model's row from the last of ``names`` (in ``folder``) that ran it, and the files as the table names
    them: the first, then each re-run with the number of models it ran."""
    by_model: Dict[Any, Dict[str, Any]] = {}
    used = []
    for name in names:
        rows = [r for r in _rows(name, folder) if only is None or r.get("family") == only]
        if rows and all("capture" in r or r.get("status") != "ok" for r in rows):  # sweeps of the current tool
            by_model.update({(r.get("family"), r["model"]): r for r in rows})
            tail = name.rsplit("_", 1)[-1]
            commit = tail if len(tail) == 7 and all(c in "0123456789abcdef" for c in tail) else name
            used.append(name if not used else f"re-run {commit}: {len(rows)}")
    return list(by_model.values()), "; ".join(used)


def summarise(family: str, name: str, rows: List[Dict[str, Any]]) -> List[Any]:
    ratios = sorted(r for r in map(_ratio, rows) if r)
    captures = Counter(r.get("capture", "?") for r in rows if r.get("status") == "ok")
    kinds: Counter = Counter()
    for r in rows:
        for technique, ops in r.get("techniques", {}).items():
            for op in ops:
                kinds[f"{technique}: {KINDS.get(op, op)}"] += 1
    below = [r["model"] for r in rows if r.get("worst") is not None and r["worst"] < 0.98]
    failed = [r["model"] for r in rows if "FAILED" in str(r.get("gate", ""))]  # a model's own or its whole-model gate
    failed += [f"{r['model']} (error)" for r in rows if r.get("status") == "error"]
    least = min(((_ratio(r), r["model"]) for r in rows if _ratio(r)), default=(0.0, "-"))
    return [family, f"{len(rows)} ({name})",
            ", ".join(f"{c} {n}" for c, n in captures.most_common()) or "-",
            f"{statistics.median(ratios):.2f}" if ratios else "-", f"{least[0]:.2f} ({least[1]})",
            ", ".join(below) or "none", ", ".join(failed) or "none",
            "; ".join(k for k, _ in kinds.most_common(6)) or "-"]


def merge() -> None:
    """Write each zoo's current sweep file from its ARCHIVED files: each model's latest row."""
    for _, family, bf16 in SWEEPS:
        out = current_file(family, bf16)
        names = ARCHIVED[out.stem]
        rows, _ = latest(names, family, ARCHIVE)
        write_current(out, rows, "python -m tools.zoo_table --merge",
                      [f"[{n}.md](../archive/fidelity/{n}.md)" for n in names], bf16)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default=str(RESULTS / "zoo_table.md"))
    parser.add_argument("--merge", action="store_true", help="write the current sweep files from ARCHIVED first")
    args = parser.parse_args()
    if args.merge:
        merge()
    table = []
    for family, zoo, bf16 in SWEEPS:
        rows, files = latest([current_file(zoo, bf16).stem], zoo)
        if rows:
            table.append(summarise(family, files, rows))
    headers = ["family", "models (sweep files)", "capture", "median saved ratio", "least ratio",
               "worst cosine < 0.98", "gate failed", "most common rewrites (models)"]
    text = tabulate(table, headers, tablefmt="github")
    Path(args.out).write_text(f"# Model zoos at the default config\n\nCommand: `python -m tools.zoo_table`. "
                              f"{' '.join(__doc__.split(chr(10))[2:8])}\n\n{text}\n")
    readme = tabulate([row[:7] for row in table], headers[:7], tablefmt="github")
    print(f"{text}\n\nREADME rows:\n{readme}")


if __name__ == "__main__":
    main()
