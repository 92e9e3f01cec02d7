"""Counts of the expensive things one ``optimize()`` does: traces, cost-model runs, pass runs, real training steps and
graph copies.

Why: building a plan got slow because the same work was done several times (issue 38 counted 2 traces, 2 cost-model
runs, 6 pass runs and 10 real steps for one decision). A count per kind, kept in the plan (``om.plan.build``) and
printed by the build-cost benchmark (tools/bench/build_cost/), shows where an ``optimize()`` spends its time without a
profiler, and a test can assert that work is not repeated. Counting is a dict increment, so it is always on.
"""
from __future__ import annotations

import contextlib
import time
from typing import Dict, Iterator, List

KINDS = ("traces", "cost_model_runs", "pass_runs", "real_steps", "graph_copies")

_open: List[Dict[str, float]] = []  # the tallies of the builds running now (nested: a re-plan inside a step)


def count(kind: str, n: int = 1) -> None:
    """Add ``n`` to ``kind`` in every open tally (a no-op when none is open)."""
    if kind not in KINDS:
        raise ValueError(f"unknown build count kind {kind!r}; one of {', '.join(KINDS)}")
    for tally in _open:
        tally[kind] += n


@contextlib.contextmanager
def tally() -> Iterator[Dict[str, float]]:
    """Collect the counts of everything run inside into a dict {kind: count, ..., "seconds": wall time}."""
    counts: Dict[str, float] = {kind: 0 for kind in KINDS}
    _open.append(counts)
    start = time.perf_counter()
    try:
        yield counts
    finally:
        counts["seconds"] = round(time.perf_counter() - start, 3)
        _open.remove(counts)
