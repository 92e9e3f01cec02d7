"""The budget planner: the knapsack solver, budgets honoured (estimated and measured), BudgetError,
determinism, and saved plans re-applied as they are (also after editing by hand)."""
import itertools
import json
import random

import pytest
import torch

import memopt
from memopt.testing.zoo import build
from memopt.passes.planning.candidates import Group, Option
from memopt.passes.planning.knapsack import max_saving, option_cost, solve

MiB = 2 ** 20


def _group(name, options):
    return Group(name, (name,), (name,), [Option("exact", None, "", 0, 0.0, 0.0)] +
                 [Option("stash", b, name, freed, fid, 0.0) for b, freed, fid in options])


def _brute_force(groups, required):
    best = None
    for choice in itertools.product(*(range(len(g.options)) for g in groups)):
        opts = [g.options[i] for g, i in zip(groups, choice)]
        if sum(o.freed_bytes for o in opts) >= required:
            cost = sum(option_cost(o) for o in opts)
            best = cost if best is None else min(best, cost)
    return best


@pytest.mark.parametrize("seed", range(12))
def test_knapsack_matches_brute_force(seed):
    """With bytes on whole cells the DP has no rounding: its optimum is the brute-force optimum."""
    rng = random.Random(seed)
    resolution, cell = 64, 1000
    groups = [_group(f"g{i}", [(b, cell * rng.randint(1, 40), rng.uniform(0, 10)) for b in (2, 4, 8)])
              for i in range(rng.randint(1, 5))]
    required = cell * resolution
    found = solve(groups, required, resolution)
    expected = _brute_force(groups, required)
    if expected is None:
        assert found is None
    else:
        assert found is not None and found.freed_bytes >= required
        assert found.cost == pytest.approx(expected)


def test_knapsack_rounds_conservatively():
    """Bytes not on cells round down: a DP-feasible choice always frees the real bytes asked for."""
    rng = random.Random(7)
    groups = [_group(f"g{i}", [(b, rng.randint(1, 10 ** 6), rng.uniform(0, 1)) for b in (2, 4)]) for i in range(30)]
    for required in (10 ** 5, 10 ** 6, 5 * 10 ** 6):
        found = solve(groups, required, 256)
        assert found is not None and found.freed_bytes >= required
    assert solve(groups, max_saving(groups).freed_bytes + 1) is None
    assert solve(groups, 0).choice == [0] * len(groups)


@pytest.fixture(scope="module")
def resnet():
    model, x = build("preact_resnet20")
    baseline = memopt.estimate(model, x, optimizer="sgd").peak_bytes
    full = memopt.optimize(model, example_inputs=x, optimizer="sgd").plan.estimated_peak_bytes
    return model, x, baseline, full


@pytest.mark.slow
def test_budget_at_or_above_baseline_changes_nothing(resnet):
    model, x, baseline, _ = resnet
    om = memopt.optimize(model, baseline / MiB, example_inputs=x, optimizer="sgd")
    assert all(n.technique == "exact" for n in om.plan.nodes)
    assert om.plan.estimated_peak_bytes == baseline and om.plan.planner == {}


@pytest.mark.slow
def test_budget_is_met_by_estimate_and_measurement(resnet):
    model, x, baseline, full = resnet
    budget = full + 0.5 * (baseline - full)
    om = memopt.optimize(model, budget / MiB, example_inputs=x, optimizer="sgd")
    plan = om.plan
    assert plan.estimated_peak_bytes <= budget
    techniques = {u["chosen"]["technique"] for u in plan.units}
    assert "exact" in techniques and techniques - {"exact"}, "a middle budget rewrites some units, not all"
    # the predicted bytes freed (sum over units) are what the cost model finds for the whole plan
    assert plan.planner["predicted_freed_bytes"] == plan.planner["estimated_freed_bytes"]
    measured = memopt.measure(om, x, optimizer="sgd")
    assert measured.saved_bytes == plan.estimated_saved_bytes
    assert abs(measured.peak_bytes - plan.estimated_peak_bytes) <= 0.1 * plan.estimated_peak_bytes
    assert measured.peak_bytes <= 1.1 * budget
    torch.manual_seed(0)
    out = om(x)
    torch.manual_seed(0)
    ref = model(x)
    assert torch.equal(out, ref)


def test_report_shows_choices_alternatives_and_budget(resnet):
    model, x, baseline, full = resnet
    budget = full + 0.5 * (baseline - full)
    om = memopt.optimize(model, budget / MiB, example_inputs=x, optimizer="sgd")
    text = om.report()
    assert "planner" in text and "alternatives" in text and "budget" in text
    exact_unit = next(u for u in om.plan.units if u["chosen"]["technique"] == "exact")
    node = next(n for n in om.plan.nodes if n.name in exact_unit["nodes"] and n.reason)
    assert node.reason.startswith("planner: the budget is met without it")


@pytest.mark.slow
def test_budget_below_minimum_raises_with_minimum_and_consumers(resnet):
    model, x, baseline, full = resnet
    with pytest.raises(memopt.BudgetError) as info:
        memopt.optimize(model, 0.5 * full / MiB, example_inputs=x, optimizer="sgd")
    message = str(info.value)
    # the least peak uses the fewest plan_bits (2-bit stash), below the default plan (4-bit)
    assert info.value.budget_bytes == int(0.5 * full) and 0.5 * full < info.value.minimum_bytes < full
    assert f"budget_mb={0.5 * full / MiB:.1f}" in message
    assert "smallest estimated peak with the current config is" in message
    lines = [line for line in message.splitlines() if line.startswith("  ")]
    assert len(lines) == 5 and all(" - " in line for line in lines)
    assert "torch.utils.checkpoint" in message or "plan_bits" in message


@pytest.mark.slow
def test_plan_is_deterministic_and_reapplies_without_planning(resnet, tmp_path):
    model, x, baseline, full = resnet
    budget = (full + 0.3 * (baseline - full)) / MiB
    first = memopt.optimize(model, budget, example_inputs=x, optimizer="sgd")
    second = memopt.optimize(model, budget, example_inputs=x, optimizer="sgd")
    strip = lambda p: {k: v for k, v in p.to_dict().items() if k not in ("planner", "build")}  # noqa: E731 - timings differ
    assert strip(first.plan) == strip(second.plan)
    path = tmp_path / "plan.json"
    first.plan.save(path)
    again = memopt.optimize(model, example_inputs=x, optimizer="sgd", plan=path)
    assert again.graph_module.code == first.graph_module.code
    assert again.plan.planner == {}, "a re-applied plan is not planned again"
    assert again.plan.estimated_peak_bytes == first.plan.estimated_peak_bytes


def test_a_reapplied_plan_keeps_the_reason_a_batchnorm_chain_stays_exact():
    """A BatchNorm chain the stash pass cannot take (4 elements per channel) says so when a plan is re-applied,
    not "not chosen by the budget planner" (that plan had no budget)."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.BatchNorm1d(16), torch.nn.ReLU(),
                                torch.nn.Linear(16, 4)).train()
    x = torch.randn(4, 8)
    om = memopt.optimize(model, example_inputs=x)
    again = memopt.optimize(model, example_inputs=x, plan=om.plan)
    reasons = {n.name: n.reason for n in again.plan.nodes}
    assert reasons == {n.name: n.reason for n in om.plan.nodes}
    assert any("4 elements per channel" in (r or "") for r in reasons.values()), reasons


@pytest.mark.slow
def test_a_hand_edited_plan_is_applied_as_edited(resnet, tmp_path):
    model, x, baseline, full = resnet
    om = memopt.optimize(model, (full + 0.3 * (baseline - full)) / MiB, example_inputs=x, optimizer="sgd")
    data = json.loads(om.plan.to_json())
    entry = next(u for u in data["units"] if u["chosen"]["technique"] == "stash")
    entry["chosen"]["bits"] = 8
    exact = next(u for u in data["units"] if u["chosen"]["technique"] == "exact")
    exact["chosen"] = next(o for o in exact["alternatives"] if o["technique"] == "stash" and o["bits"] == 3)
    edited = memopt.optimize(model, example_inputs=x, optimizer="sgd", plan=data)
    bits = {n.name: n.bits for n in edited.plan.nodes if n.technique == "stash"}
    assert bits[f"{entry['chosen']['unit']}_stash"] == 8
    assert bits[f"{exact['chosen']['unit']}_stash"] == 3


@pytest.mark.slow
def test_a_plan_naming_a_missing_node_is_refused(resnet):
    model, x, _, _ = resnet
    data = memopt.optimize(model, example_inputs=x, optimizer="sgd").plan.to_dict()
    data["units"].append({"name": "stash:nope", "nodes": ["nope"], "alternatives": [],
                          "chosen": {"technique": "stash", "bits": 4, "unit": "nope", "freed_bytes": 0,
                                     "fidelity": 0.0, "time": 0.0}})
    with pytest.raises(memopt.MemoptError, match="'nope' with stash but it cannot be applied: there is no such node"):
        memopt.optimize(model, example_inputs=x, plan=data)


@pytest.mark.slow
def test_plan_and_budget_together_are_refused(resnet):
    model, x, _, _ = resnet
    plan = memopt.optimize(model, example_inputs=x).plan
    with pytest.raises(ValueError, match="either plan= .* or budget_mb/config, not both"):
        memopt.optimize(model, 100.0, plan=plan)


@pytest.mark.parametrize("field, value, match", [
    ("plan_bits", (), "StashConfig.plan_bits must be a non-empty tuple"),
    ("plan_bits", (2, 9), r"StashConfig.plan_bits entry must be an int in 1..8, got 9"),
    ("node_bits", {"bn": 0}, r"StashConfig.node_bits\['bn'\] must be an int in 1..8, got 0"),
    ("node_bits", 3, "StashConfig.node_bits must map node names to bits"),
])
def test_planner_config_errors_quote_the_value(field, value, match):
    with pytest.raises(ValueError, match=match):
        memopt.StashConfig(**{field: value})


@pytest.mark.slow
def test_cuda_budget_keeps_workspace_headroom(resnet):
    # planning for CUDA (fake tensors, no GPU needed): the planner keeps Config.workspace_mb free for the cuDNN
    # workspaces the estimate does not count (measured up to 37 MiB above the estimate on an H200, docs/results/cuda/cuda.md)
    model, x, _, _ = resnet
    cuda = memopt.estimate(model, x, optimizer="sgd", device="cuda").peak_bytes
    budget_mb = cuda / MiB + 1  # meets the estimate, not the default 64 MiB headroom
    with pytest.raises(memopt.BudgetError, match=r"Of the budget, 64\.00 MiB is kept free for cuDNN/cuBLAS "
                                                 r"workspaces.*Config\.workspace_mb=None; None means 64 MiB on cuda"):
        memopt.optimize(model, budget_mb, example_inputs=x, optimizer="sgd", config=memopt.Config(device="cuda"))
    om = memopt.optimize(model, budget_mb, example_inputs=x, optimizer="sgd",
                         config=memopt.Config(device="cuda", workspace_mb=0.5))
    assert all(n.technique == "exact" for n in om.plan.nodes)  # within budget less 0.5 MiB already
    om = memopt.optimize(model, budget_mb, example_inputs=x, optimizer="sgd",
                         config=memopt.Config(device="cuda", workspace_mb=2))
    assert om.plan.estimated_peak_bytes <= (budget_mb - 2) * MiB < cuda
    # on CPU the estimate is the measurement: no headroom by default
    assert memopt.Config().workspace_bytes("cpu") == 0 and memopt.Config().workspace_bytes("cuda:0") == 64 * MiB
    with pytest.raises(ValueError, match=r"Config.workspace_mb must be None or a finite number of MiB >= 0, got -1"):
        memopt.Config(workspace_mb=-1)
