"""Units coupled by the scale identity move together (issue 22): a depthwise block's stashed BatchNorm (B) needs the
chain before it (A) stashed too, in the planner's options, in the fidelity gate's repairs and in the plan record.

Root cause: A's BatchNorm weight is nearly scale-invariant through the depthwise conv and B (its true gradient is only
B's eps and ReLU6's clip terms), so B's codes' error in dL/dz, small for everything else, swamps it when A runs stock
BatchNorm backward; stashed, A solves that gradient from B's by the identity (memopt/stash/identity.py)."""
import torch
from torch import nn

import memopt
from memopt.capture.trace import capture
from memopt.cost_model.analysis import annotate
from memopt.fidelity.gate import RandomProjection, coupled, parameter_fidelity
from memopt.passes.base import PassContext
from memopt.passes.planning.candidates import Group, Option, candidates, couple
from memopt.passes.planning.knapsack import solve
from memopt.passes.planning.planner import apply_decision, chosen_decision
from memopt.record.plan import option_decisions, option_label
from memopt.capture.soundness import training_step


class Inverted(nn.Module):
    """MobileNetV2's inverted residual: expand 1x1 -> BN (A) -> ReLU6 -> depthwise 3x3 -> BN (B) -> ReLU6 ->
    project 1x1 -> BN."""

    def __init__(self, c: int = 8, e: int = 4):
        super().__init__()
        self.expand, self.bn1, self.act1 = nn.Conv2d(c, c * e, 1, bias=False), nn.BatchNorm2d(c * e), nn.ReLU6()
        self.dw = nn.Conv2d(c * e, c * e, 3, padding=1, groups=c * e, bias=False)
        self.bn2, self.act2 = nn.BatchNorm2d(c * e), nn.ReLU6()
        self.project, self.bn3 = nn.Conv2d(c * e, c, 1, bias=False), nn.BatchNorm2d(c)

    def forward(self, x):
        return x + self.bn3(self.project(self.act2(self.bn2(self.dw(self.act1(self.bn1(self.expand(x))))))))


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.stem = nn.Conv2d(3, 8, 3, padding=1)
        self.blocks = nn.Sequential(Inverted(), Inverted())
        self.head = nn.Linear(8, 10)

    def forward(self, x):
        return self.head(self.blocks(self.stem(x)).mean((2, 3)))


def _setup():
    torch.manual_seed(0)
    model, x = Net().train(), torch.randn(4, 3, 16, 16)
    gm = capture(model, (x,), {}).graph_module
    baseline = annotate(gm, (x,), {}, device="cpu")
    return model, x, gm, baseline, PassContext((x,), {}, "cpu")


def test_a_stashed_depthwise_batch_norm_breaks_the_weight_gradient_of_an_exact_chain_before_it():
    model, x, gm, _, ctx = _setup()
    names = [n for n, _ in model.named_parameters()]
    rng = torch.Generator().manual_seed(0).get_state()
    for seed in range(3):
        loss = RandomProjection(seed)
        exact = training_step(model, model, (x,), {}, rng, loss).grads

        def cosine(decision):
            rewritten, _ = apply_decision(gm, memopt.Config(), decision, ctx)
            grads = training_step(rewritten, model, (x,), {}, rng, loss).grads
            return parameter_fidelity(names, exact, grads, 1e-3)["blocks.0.bn1.weight"]["cosine"]

        assert cosine({"stash": {"blocks_0_bn2": 8}}) < 0.5  # B at 8 bits, A exact: A's weight gradient is noise
        assert cosine({"stash": {"blocks_0_bn2": 4, "blocks_0_bn1": 4}}) > 0.99  # both: solved by the identity


def test_coupled_units_are_one_group_whose_options_never_rewrite_the_needing_unit_alone():
    model, x, gm, baseline, ctx = _setup()
    groups = candidates(gm, (x,), {}, memopt.Config(), baseline, ctx=ctx)
    for block in ("blocks_0", "blocks_1"):
        group = next(g for g in groups if f"stash:{block}_bn2" in g.name.split("+"))
        assert f"stash:{block}_bn1" in group.name.split("+")
        assert group.couplings == ((f"stash:{block}_bn2", f"stash:{block}_bn1"),)
        taken = [{(t, u) for t, u, _ in o.decisions()} for o in group.options]
        assert any(("stash", f"{block}_bn2") in t and ("stash", f"{block}_bn1") in t for t in taken)
        assert any(t == {("stash", f"{block}_bn1")} for t in taken)  # A alone is fine
        assert not any(("stash", f"{block}_bn2") in t and ("stash", f"{block}_bn1") not in t for t in taken)


def _option(unit, freed, fidelity):
    return Option("stash", 8, unit, freed, fidelity, 0.0, freed)


def test_the_knapsack_on_coupled_groups_takes_the_needed_unit_with_the_cheaper_needing_one():
    a = Group("stash:a", ("a",), ("a",), [Option("exact", None, "", 0, 0.0, 0.0), _option("a", 100, 1.0)])
    b = Group("stash:b", ("b",), ("b",), [Option("exact", None, "", 0, 0.0, 0.0), _option("b", 100, 0.1)])
    assert chosen_decision([a, b], solve([a, b], 100).choice) == {"stash": {"b": 8}}  # uncoupled: b alone
    joint = couple([a, b], {("stash:b", "stash:a")})
    assert len(joint) == 1 and [o.label() for o in joint[0].options] == ["exact", "stash@8", "stash@8 a + stash@8 b"]
    assert chosen_decision(joint, solve(joint, 100).choice) == {"stash": {"a": 8}}
    assert chosen_decision(joint, solve(joint, 200).choice) == {"stash": {"a": 8, "b": 8}}
    both = joint[0].options[2]
    assert (both.freed_bytes, both.fidelity, both.technique) == (200, 1.1, "joint")
    record = both.to_dict()
    assert Option.from_dict(record) == both
    assert option_decisions(record) == [("stash", "a", 8), ("stash", "b", 8)]
    assert option_label(record) == "stash@8 a + stash@8 b"


def test_a_repair_that_turns_the_needed_unit_exact_turns_the_needing_one_exact_too_and_says_so():
    decision = {"stash": {"b": 4, "c": 8}, "fewbit": {"g": 2}}
    notes = coupled(decision, [("stash:b", "stash:a"), ("stash:c", "stash:b")])
    assert decision == {"stash": {}, "fewbit": {"g": 2}}  # c needed b, which needed a
    assert notes == ["stash b -> exact (coupled: it needs stash a, now exact)",
                     "stash c -> exact (coupled: it needs stash b, now exact)"]
    kept = {"stash": {"a": 4, "b": 8}}
    assert coupled(kept, [("stash:b", "stash:a")]) == [] and kept == {"stash": {"a": 4, "b": 8}}


def test_a_budget_plan_records_its_couplings_and_keeps_them():
    torch.manual_seed(0)
    model, x = Net().train(), torch.randn(4, 3, 16, 16)
    stock = memopt.optimize(Net().train(), example_inputs=x, config=memopt.Config(fidelity=None)).plan
    budget = stock.estimated_peak_bytes + 0.3 * (stock.baseline_peak_bytes - stock.estimated_peak_bytes)
    om = memopt.optimize(model, budget_mb=budget / 2 ** 20, example_inputs=x)
    couplings = sorted(tuple(c) for u in om.plan.units for c in u["couplings"])
    assert couplings == [("stash:blocks_0_bn2", "stash:blocks_0_bn1"), ("stash:blocks_1_bn2", "stash:blocks_1_bn1")]
    chosen = om.plan.chosen_units().get("stash", {})
    assert chosen  # the budget needs stashed units
    for needing, needed in couplings:
        assert needing.split(":")[1] not in chosen or needed.split(":")[1] in chosen
    assert om.plan.fidelity["passed"]
    assert "stash@" in om.report()
