"""The worker pool the zoo sweeps share (tools/bench/capture/sweep_soundness.py, tools/bench/fidelity/
sweep_fidelity.py): one model per worker process, a timeout per model, models above HEAVY_PARAMS one at a time,
a worker killed for memory runs its model again alone at the end, one JSON line per model next to the results
file (``--resume`` keeps them), and the results file rewritten after every model.
"""
from __future__ import annotations

import argparse
import collections
import contextlib
import gc
import importlib
import io
import json
import os
import random
import sys
import time
import traceback
import warnings
from pathlib import Path
from typing import Any, Callable, Dict, Optional, Tuple

from tools.bench.capture.zoo import FAMILIES, HEAVY_PARAMS, count_params, names

LOCK_PATH = "/tmp/memopt_sweep_heavy.lock"


def first_line(e: BaseException) -> str:
    text = str(e).strip().splitlines()
    return f"{type(e).__name__}: {text[0][:200] if text else ''}"


def seed(s: int) -> None:
    import numpy as np
    import torch
    torch.manual_seed(s)
    np.random.seed(s)
    random.seed(s)


def call(model, x):
    if isinstance(x, dict):
        return model(**x)
    if isinstance(x, tuple):
        return model(*x)
    return model(x)


def code_state() -> str:
    """The commit and any uncommitted changes to the code under test, at the start of the run."""
    import subprocess
    root = Path(__file__).resolve().parents[3]
    try:
        head = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=root, capture_output=True, text=True,
                              check=True).stdout.strip()
        dirty = subprocess.run(["git", "status", "--porcelain", "--", "memopt", "passes", "cost_model"], cwd=root,
                               capture_output=True, text=True, check=True).stdout.split("\n")
    except (OSError, subprocess.CalledProcessError):
        return "code state unknown (no git)"
    changed = [line[3:] for line in dirty if line.strip()]
    return f"memopt at {head}" + (f" with uncommitted changes to {', '.join(changed)}" if changed else "")



def run_state(rows: list, total: int, done: bool, started: float, kept: int, code: str) -> str:
    """The results file's first line: complete or partial, the code under test, rows kept, the load."""
    state = (f"Complete: {len(rows)} models, {(time.time() - started) / 60:.0f} min." if done else
             f"**Partial results** ({len(rows)} of {total} models so far; the sweep is still running or was "
             f"stopped).")
    if code:
        state += f" Code at the start of the run: {code}."
    if kept:
        state += (f" {kept} rows were kept from the earlier run recorded in the .jsonl next to this file (--resume); "
                  f"the others ran now.")
    return (f"{state} Load average at write time: {os.getloadavg()[0]:.1f} (other jobs may share the cores; "
            f"seconds per model are not reliable).")


def _worker(conn, threads: int, job: str) -> None:
    """A worker process: receives (family, name), answers ("started", ...) then ("row", row) from ``job``
    ("module:function", the function taking (family, name) and returning the row)."""
    import fcntl

    import torch
    warnings.filterwarnings("ignore")
    import logging
    logging.getLogger("memopt").setLevel(logging.ERROR)
    torch.set_num_threads(threads)
    module, _, function = job.partition(":")
    run_one = getattr(importlib.import_module(module), function)
    while True:
        task = conn.recv()
        if task is None:
            return
        family, name = task
        heavy = count_params(family, name) > HEAVY_PARAMS
        lock = open(LOCK_PATH, "w") if heavy else None
        if lock is not None:
            fcntl.flock(lock, fcntl.LOCK_EX)  # released by the kernel if this process is killed
        conn.send(("started", None))
        try:
            row = run_one(family, name)
        except BaseException as e:  # noqa: BLE001
            traceback.print_exc()
            row = {"family": family, "model": name, "status": "error", "reason": f"sweep: {first_line(e)}"}
        finally:
            if lock is not None:
                lock.close()
        gc.collect()
        conn.send(("row", row))


def sweep(doc: str, title: str, script: str, default_out: Path, job: str,
          render: Callable[..., str], progress: Callable[[Dict[str, Any]], str],
          variants: Optional[Dict[str, Tuple[str, str, Path, str]]] = None) -> None:
    """Parse the sweep's command line and run ``job`` over the zoo; ``render(rows, command, total, done, started,
    kept, code)`` makes the results body, ``progress(row)`` the line printed per model. ``variants``: {flag: (help,
    job, default out, title)}, flags that run another job (e.g. the same one under autocast) into another file."""
    import multiprocessing as mp
    from multiprocessing.connection import wait

    from tools.bench.common import write_results

    parser = argparse.ArgumentParser(description=doc, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--only", choices=FAMILIES, action="append", help="a family (repeatable); default all")
    parser.add_argument("--limit", type=int, default=None, help="the first N models of each family")
    parser.add_argument("--models", default=None, help="comma-separated model names (within the families)")
    parser.add_argument("--out", type=Path, default=None, help=f"default {default_out}")
    parser.add_argument("--workers", type=int, default=2, help="worker processes (threads split among them)")
    parser.add_argument("--timeout", type=float, default=300, help="seconds per model")
    parser.add_argument("--resume", action="store_true",
                        help="keep the rows of the .jsonl next to --out (timeouts and crashes run again)")
    for flag, (text, *_) in (variants or {}).items():
        parser.add_argument(flag, action="store_true", help=text)
    args = parser.parse_args()
    for flag, (_, variant_job, variant_out, variant_title) in (variants or {}).items():
        if getattr(args, flag.lstrip("-").replace("-", "_")):
            job, default_out, title = variant_job, variant_out, variant_title
    args.out = args.out or default_out
    command = f"python -m {script}" + "".join(f" {a}" for a in sys.argv[1:])
    families = args.only or list(FAMILIES)
    wanted = set(args.models.split(",")) if args.models else None
    tasks = []
    for family in families:
        ns = [n for n in names(family) if wanted is None or n in wanted]
        tasks += [(family, n) for n in ns[:args.limit]]
    jsonl = args.out.with_suffix(".jsonl")
    done_rows: Dict[Tuple[str, str], Dict[str, Any]] = {}
    if args.resume and jsonl.exists():
        for line in jsonl.read_text().splitlines():  # later lines win; timeouts and crashes run again
            r = json.loads(line)
            if r.get("status") in ("timeout", "crashed"):
                done_rows.pop((r["family"], r["model"]), None)
            else:
                done_rows[(r["family"], r["model"])] = r
    else:
        jsonl.parent.mkdir(parents=True, exist_ok=True)
        jsonl.write_text("")
    pending = collections.deque(t for t in tasks if t not in done_rows)
    kept = len(tasks) - len(pending)
    threads = max(1, (os.cpu_count() or 2) // args.workers)
    ctx = mp.get_context("spawn")
    started = time.time()
    code = code_state()
    print(f"{len(tasks)} models ({len(pending)} to run), {args.workers} workers x {threads} threads", flush=True)

    def spawn():
        parent, child = ctx.Pipe()
        proc = ctx.Process(target=_worker, args=(child, threads, job), daemon=True)
        proc.start()
        child.close()
        return {"proc": proc, "conn": parent, "task": None, "since": None}

    def write(done: bool) -> None:
        rows = [done_rows[t] for t in tasks if t in done_rows]
        body = render(rows, command, len(tasks), done, started, kept, code)
        if done:
            write_results(args.out, title, command, doc, body)
        else:  # the same file, quietly, after every model
            with contextlib.redirect_stdout(io.StringIO()):
                write_results(args.out, title, command, doc, body)

    def record(row: Dict[str, Any]) -> None:
        done_rows[(row["family"], row["model"])] = row
        with jsonl.open("a") as f:
            f.write(json.dumps(row) + "\n")
        print(f"[{len(done_rows)}/{len(tasks)} {time.time() - started:.0f}s] {row['family']} {row['model']}: "
              f"{progress(row)}", flush=True)
        write(False)

    # a model whose worker died (out of memory, most likely, next to another model) runs once more, alone, at the end
    solo: collections.deque = collections.deque()
    first_try: Dict[Tuple[str, str], str] = {}
    workers = [spawn() for _ in range(min(args.workers, max(1, len(pending))))]
    while pending or solo or any(w["task"] for w in workers):
        for w in workers:
            if w["task"] is None and (pending or (solo and not any(x["task"] for x in workers))):
                w["task"], w["since"] = (pending or solo).popleft(), None
                w["sent"] = time.time()
                w["conn"].send(w["task"])
        busy = [w for w in workers if w["task"]]
        ready = wait([w["conn"] for w in busy] + [w["proc"].sentinel for w in busy], timeout=2)
        for i, w in enumerate(workers):
            if not w["task"]:
                continue
            family, name = w["task"]
            if w["conn"] in ready:
                try:
                    kind, payload = w["conn"].recv()
                except (EOFError, OSError):
                    kind, payload = "dead", None
                if kind == "started":
                    w["since"] = time.time()
                    continue
                if kind == "row":
                    if w["task"] in first_try:
                        payload["reason"] = (f"{first_try[w['task']]}; ran again alone: "
                                             + payload.get("reason", "")).rstrip("; :")
                    record(payload)
                    w["task"] = None
                    continue
            alive = w["proc"].is_alive()
            overdue = w["since"] is not None and time.time() - w["since"] > args.timeout
            if not alive or overdue:
                if alive:
                    w["proc"].kill()
                w["proc"].join(5)
                status = "timeout" if alive else "crashed"
                others = sum(1 for x in workers if x["task"] and x is not w)
                reason = (f"timeout: no result within {args.timeout:.0f} s" if alive
                          else f"worker died (exit code {w['proc'].exitcode}; out of memory?)"
                          + (f" with {others} other model(s) running" if others else ""))
                if status == "crashed" and others and w["task"] not in first_try:
                    first_try[w["task"]] = f"first try: {reason}"
                    solo.append(w["task"])
                    print(f"{family} {name}: {reason}; will run again alone at the end", flush=True)
                else:
                    record({"family": family, "model": name, "status": status, "reason": reason,
                            "seconds": round(time.time() - (w["since"] or w["sent"]), 1)})
                workers[i] = spawn()
    for w in workers:
        try:
            w["conn"].send(None)
        except (BrokenPipeError, OSError):
            pass
        w["proc"].join(10)
    write(True)

