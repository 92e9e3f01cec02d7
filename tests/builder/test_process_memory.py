"""A CPU budget is the process's resident memory: what a build leaves held in it (memopt/core/heap.py ResidentGrowth:
buffer pools and caches of its checks) is kept free below the budget, measured before planning and again after the
gate, planned again (up to three plannings in all) where the plan no longer fits beside it; reported;
Config.workspace_mb replaces it."""
import logging
import math

import pytest
import torch

import memopt
import memopt.core.heap as heap
from memopt.testing.zoo import build

MiB = 2 ** 20


@pytest.mark.process_memory
def test_growth_counts_memory_held_and_not_memory_freed():
    growth = heap.ResidentGrowth()
    if heap.anonymous_resident_bytes() is None:
        pytest.skip("no /proc/self/status RssAnon here")
    held = torch.ones(16 * MiB)  # 64 MiB, every page written
    assert growth.bytes() >= 60 * MiB
    del held
    assert growth.bytes() < 16 * MiB  # freed and handed back: not held (the allocator's slack aside)


class _Process:
    """settled_resident_bytes as a process whose build leaves ``held`` bytes (set by the test, read at each call),
    on top of 1 GiB; records how often it was read."""

    def __init__(self, monkeypatch, *held):
        self.held, self.reads = list(held), 0
        monkeypatch.setattr(heap, "settled_resident_bytes", self)

    def __call__(self):
        value = 2 ** 30 + (self.held[min(self.reads - 1, len(self.held) - 1)] if self.reads else 0)
        self.reads += 1
        return value


@pytest.fixture(scope="module")
def preact():
    model, x = build("preact_resnet20")
    baseline = memopt.estimate(model, x, optimizer="sgd").peak_bytes
    return model, x, baseline


def test_a_cpu_budget_plans_beside_what_the_build_left_held(monkeypatch, preact):
    model, x, baseline = preact
    budget = baseline - MiB // 2  # the baseline does not fit; a few rewrites do
    process = _Process(monkeypatch, 1 * MiB)
    om = memopt.optimize(model, budget / MiB, example_inputs=x, optimizer="sgd")
    plan = om.plan
    assert process.reads == 3  # at the start, before planning, after the gate
    assert plan.process_held_bytes == 1 * MiB
    assert plan.estimated_peak_bytes <= budget - 1 * MiB
    assert "with what optimize() left held in this process (1.00 MiB: buffer pools and caches of its checks, " \
           "measured), the process's resident peak is about" in om.report()
    saved = memopt.Plan.from_dict(plan.to_dict())
    assert saved.process_held_bytes == 1 * MiB


def test_a_plan_that_no_longer_fits_beside_it_is_planned_again(monkeypatch, caplog, preact):
    model, x, baseline = preact
    budget = baseline - MiB // 2
    process = _Process(monkeypatch, 0, 2 * MiB)  # nothing held when it plans, 2 MiB after the gate
    with caplog.at_level(logging.INFO, logger="memopt"):
        om = memopt.optimize(model, budget / MiB, example_inputs=x, optimizer="sgd")
    assert process.reads == 4  # the start, before planning, after the gate, after the second plan's gate
    again = [r.getMessage() for r in caplog.records if "planning again for" in r.getMessage()]
    assert len(again) == 1 and "the build left 2.00 MiB held in this process (0 B when it planned)" in again[0]
    assert om.plan.estimated_peak_bytes <= budget - 2 * MiB and om.plan.process_held_bytes == 2 * MiB


def test_growth_past_the_second_plan_s_room_is_planned_a_third_time(monkeypatch, caplog, preact):
    model, x, baseline = preact
    budget = baseline - MiB // 2
    process = _Process(monkeypatch, 0, 2 * MiB, 3 * MiB)  # the second planning grows it by 1 MiB more
    with caplog.at_level(logging.INFO, logger="memopt"):
        om = memopt.optimize(model, budget / MiB, example_inputs=x, optimizer="sgd")
    assert process.reads == 5  # the start, before planning, after each of the three plans' gates
    again = [r.getMessage() for r in caplog.records if "planning again for" in r.getMessage()]
    assert len(again) == 2 and "the build left 3.00 MiB held in this process (2.00 MiB when it planned)" in again[1]
    assert not [r for r in caplog.records if r.levelno == logging.WARNING]
    assert om.plan.estimated_peak_bytes <= budget - 3 * MiB and om.plan.process_held_bytes == 3 * MiB


def test_growth_past_the_last_plan_s_room_is_a_warning_with_the_reserve(monkeypatch, caplog, preact):
    model, x, baseline = preact
    budget = baseline - MiB // 2
    process = _Process(monkeypatch, 0, 2 * MiB, 3 * MiB, baseline)  # after the third, as much as the whole step
    with caplog.at_level(logging.INFO, logger="memopt"):
        om = memopt.optimize(model, budget / MiB, example_inputs=x, optimizer="sgd")
    assert process.reads == 5  # no fourth planning (PLANNINGS)
    warned = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING and "over the budget" in
              r.getMessage()]
    assert len(warned) == 1 and "after planning 3 times" in warned[0] and \
        f"Set Config(workspace_mb={math.ceil(baseline / MiB)}) to keep that much free" in warned[0]
    assert om.plan.process_held_bytes == baseline


def test_a_budget_it_leaves_no_room_for_names_it(monkeypatch, preact):
    model, x, baseline = preact
    _Process(monkeypatch, baseline)  # the build holds as much as the whole step: nothing fits beside it
    with pytest.raises(memopt.BudgetError, match=r"(?s)Of the budget, \d+\.\d+ MiB is what this build has left held "
                                                 r"in the process's resident memory .*Config\.workspace_mb set to a "
                                                 r"number replaces this measured reserve"):
        memopt.optimize(model, baseline / MiB, example_inputs=x, optimizer="sgd")


@pytest.mark.parametrize("why", ["workspace_mb", "no budget", "cuda"])
def test_measured_and_reported_but_not_reserved_with_a_workspace_or_without_a_budget(monkeypatch, preact, why):
    model, x, baseline = preact
    process = _Process(monkeypatch, baseline)  # as much as the whole step: no budget could be met beside it
    config = {"workspace_mb": memopt.Config(workspace_mb=0), "cuda": memopt.Config(device="cuda"),
              "no budget": memopt.Config()}[why]
    budget = None if why == "no budget" else baseline / MiB + 64  # above CUDA's workspace reserve too
    om = memopt.optimize(model, budget, example_inputs=x, optimizer="sgd", config=config)
    if why == "cuda":  # not the process's memory: read once at the start, dropped once the graph says CUDA
        assert process.reads == 1 and om.plan.process_held_bytes == 0 and "left held" not in om.report()
    else:  # the start and after the gate, none before planning: recorded and reported, nothing kept free for it
        assert process.reads == 2 and om.plan.process_held_bytes == baseline
        assert "left held in this process" in om.report()


def test_a_refused_repair_names_the_memory_held(monkeypatch):
    model, x = build("preact_resnet20")
    budget = 0.75 * memopt.estimate(model, x, optimizer="sgd").peak_bytes  # tight: the gate's repairs need room
    _Process(monkeypatch, 2 * MiB)  # 2 MiB held when it plans: the repaired plan does not fit beside it
    with pytest.raises(memopt.BudgetError, match=r"Raise the budget to at least \d+\.\d+ MiB \(with the 2\.00 MiB "
                                                 r"this build left held in the process's resident memory, measured, "
                                                 r"kept free beside it\)"):
        memopt.optimize(model, budget / MiB, example_inputs=x, optimizer="sgd")

