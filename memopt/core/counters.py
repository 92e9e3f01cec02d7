"""Counts and seconds of the expensive things one ``optimize()`` does: traces, cost-model runs, pass runs, real
training steps and graph copies.

Why: building a plan got slow because the same work was done several times (issue 38 counted 2 traces, 2 cost-model
runs, 6 pass runs and 10 real steps for one decision). A count per kind, kept in the plan (``om.plan.build``) and
printed by the build-cost benchmark (tools/bench/build_cost/), shows where an ``optimize()`` spends its time without a
profiler, and a test can assert that work is not repeated. The seconds per kind say which of them to cut: a
count alone does not (a cost-model run of a rewritten graph costs more than one of the captured graph, and a real
step of the gate's slice less than one of the whole batch). Each second is booked to the innermost kind running
(a cost-model run inside a pass run is the cost model's), so the kinds and ``other_s`` (capture checks' Python,
the planner's own arithmetic, the gate's bookkeeping) add up to ``seconds``. Counting is a dict increment and two
clock reads, so it is always on.
"""
from __future__ import annotations

import contextlib
import functools
import time
from typing import Any, Callable, Dict, Iterator, List, TypeVar

KINDS = ("traces", "cost_model_runs", "pass_runs", "real_steps", "graph_copies")

_open: List[Dict[str, float]] = []  # the tallies of the builds running now (nested: a re-plan inside a step)
_running: List[List[Any]] = []  # [kind, when it last resumed] of the timed calls running now, innermost last

F = TypeVar("F", bound=Callable[..., Any])


def _check(kind: str) -> None:
    if kind not in KINDS:
        raise ValueError(f"unknown build count kind {kind!r}; one of {', '.join(KINDS)}")


def count(kind: str, n: int = 1) -> None:
    """Add ``n`` to ``kind`` in every open tally (a no-op when none is open)."""
    _check(kind)
    for tally in _open:
        tally[kind] += n


def _book(kind: str, seconds: float) -> None:
    for tally in _open:
        tally[f"{kind}_s"] += seconds


@contextlib.contextmanager
def timed(kind: str, n: int = 1) -> Iterator[None]:
    """Count ``n`` of ``kind`` and book the seconds spent inside to it, less those of timed calls nested inside
    (they book their own)."""
    count(kind, n)
    now = time.perf_counter()
    if _running:
        outer = _running[-1]
        _book(outer[0], now - outer[1])
    _running.append([kind, now])
    try:
        yield
    finally:
        now = time.perf_counter()
        mine = _running.pop()
        _book(mine[0], now - mine[1])
        if _running:
            _running[-1][1] = now


def counted(kind: str) -> Callable[[F], F]:
    """Decorator: every call of the function is one ``kind``, timed (``timed``)."""
    _check(kind)

    def wrap(fn: F) -> F:
        @functools.wraps(fn)
        def inner(*args: Any, **kwargs: Any) -> Any:
            with timed(kind):
                return fn(*args, **kwargs)
        return inner  # type: ignore[return-value]
    return wrap


def _settle() -> None:
    """Book the innermost running timed call's seconds so far to the tallies open now."""
    if _running:
        now = time.perf_counter()
        _book(_running[-1][0], now - _running[-1][1])
        _running[-1][1] = now


@contextlib.contextmanager
def tally() -> Iterator[Dict[str, float]]:
    """Collect the counts of everything run inside into a dict {kind: count, ..., "seconds": wall time, kind + "_s":
    seconds of each kind, "other_s": the rest}."""
    counts: Dict[str, float] = {kind: 0 for kind in KINDS}
    counts.update({f"{kind}_s": 0.0 for kind in KINDS})
    _settle()  # a timed call around the tally: what it ran before is not this tally's
    _open.append(counts)
    start = time.perf_counter()
    try:
        yield counts
    finally:
        _settle()  # and what it ran inside the tally is
        counts["seconds"] = round(time.perf_counter() - start, 3)
        _open.remove(counts)
        for kind in KINDS:
            counts[f"{kind}_s"] = round(counts[f"{kind}_s"], 3)
        counts["other_s"] = round(max(counts["seconds"] - sum(counts[f"{k}_s"] for k in KINDS), 0.0), 3)
