"""The fidelity gate (memopt/fidelity/gate.py): a plan's gradients checked per parameter against exact autograd on
the example inputs, and repaired where they miss."""
import copy

import pytest
import torch
from torch import nn

import memopt
from memopt.fidelity import gate as fidelity, losses
from memopt.fidelity.gate import RandomProjection, parameter_fidelity


class GeluMLP(nn.Module):
    def __init__(self, width=64, depth=4):
        super().__init__()
        self.layers = nn.ModuleList(nn.Linear(width, width) for _ in range(depth))
        self.head = nn.Linear(width, 8)

    def forward(self, x):
        for layer in self.layers:
            x = nn.functional.gelu(layer(x))
        return self.head(x)


def _cosines(model, om, x):
    """Per-parameter cosine of memopt's gradient against a deep copy's eager one, under the gate's own loss."""
    reference = copy.deepcopy(model)
    for m in (model, reference):
        m.zero_grad(set_to_none=True)
    loss = RandomProjection(seed=3)
    torch.manual_seed(0)
    loss(om(x)).backward()
    loss = RandomProjection(seed=3)
    torch.manual_seed(0)
    loss(reference(x)).backward()
    names = [n for n, _ in model.named_parameters()]
    return parameter_fidelity(names, [q.grad for q in reference.parameters()], [p.grad for p in model.parameters()],
                              1e-3)


@pytest.mark.slow
def test_a_plan_that_misses_the_gate_is_repaired_and_the_report_says_how():
    torch.manual_seed(0)
    model, x = GeluMLP(), torch.randn(64, 64)
    crushed = memopt.Config(fewbit=memopt.FewBitConfig(bits=1), stash=None, reversible=None)
    ungated = memopt.optimize(copy.deepcopy(model), example_inputs=x,
                              config=memopt.Config(fewbit=memopt.FewBitConfig(bits=1), stash=None, reversible=None,
                                                   fidelity=None))
    assert not ungated.plan.fidelity
    worst_ungated = min(f["cosine"] for f in _cosines(ungated.original_module, ungated, x).values() if not f["tiny"])
    assert worst_ungated < 0.99  # 1-bit GELU backward: the plan misses

    om = memopt.optimize(model, example_inputs=x, config=crushed)
    report = om.plan.fidelity
    assert report["passed"] and report["changes"] and report["slice"] == "the first 4 of 64 samples"
    assert all("fewbit" in change and ("bits" in change or "exact" in change) for change in report["changes"])
    assert report["worst"]["cosine"] >= 0.99
    assert set(report["parameters"]) == {n for n, _ in model.named_parameters()}
    # the repaired plan is what runs: its bits went up, it still saves, and the gradients hold at full batch
    bits = [u["chosen"]["bits"] for u in om.plan.units if u["chosen"]["technique"] == "fewbit"]
    assert bits and all(b is None or b > 1 for b in bits)
    assert memopt.measure(om, x).saved_bytes == om.plan.estimated_saved_bytes
    assert ungated.plan.estimated_saved_bytes <= om.plan.estimated_saved_bytes < om.plan.baseline_saved_bytes
    worst = min(f["cosine"] for f in _cosines(model, om, x).values() if not f["tiny"])
    assert worst > worst_ungated


def test_the_gate_can_be_switched_off_and_leaves_exact_plans_alone():
    model, x = GeluMLP(depth=2), torch.randn(8, 64)
    om = memopt.optimize(model, example_inputs=x, config=memopt.Config(fidelity=None))
    assert om.plan.fidelity == {}
    om = memopt.optimize(GeluMLP(depth=2), example_inputs=x, config=memopt.Config.exact())
    assert om.plan.fidelity == {}  # nothing lossy to check


@pytest.mark.parametrize("kwargs, message", [
    ({"min_cosine": 1.5}, r"FidelityConfig.min_cosine must be a number in \(0, 1\], got 1.5"),
    ({"tiny": -0.1}, r"FidelityConfig.tiny must be a number in \[0, 1\), got -0.1"),
    ({"max_rounds": 0}, r"FidelityConfig.max_rounds must be an int in 1..20, got 0"),
    ({"max_projections": 1}, r"FidelityConfig.max_projections must be an int in 2..32, got 1"),
    ({"max_projections": 4.0}, r"FidelityConfig.max_projections must be an int in 2..32, got 4.0"),
])
def test_bad_gate_settings_name_the_value_and_range(kwargs, message):
    with pytest.raises(ValueError, match=message):
        memopt.FidelityConfig(**kwargs)
    with pytest.raises(TypeError, match=r"Config.fidelity must be a memopt.FidelityConfig or None, got float"):
        memopt.Config(fidelity=0.99)


def test_config_round_trips_with_the_gate():
    config = memopt.Config(fidelity=memopt.FidelityConfig(min_cosine=0.95))
    assert memopt.Config.from_dict(config.to_dict()) == config


class _Chain(nn.Module):
    def __init__(self):
        super().__init__()
        self.conv1, self.conv2, self.conv3 = nn.Conv2d(3, 4, 1), nn.Conv2d(4, 4, 1), nn.Conv2d(4, 4, 1)
        self.bn1, self.bn2 = nn.BatchNorm2d(4), nn.BatchNorm2d(4)

    def forward(self, x):
        x = torch.relu(self.bn1(self.conv1(x)))
        x = torch.relu(self.bn2(self.conv2(x)))
        return self.conv3(x)


def test_the_gate_blames_only_units_after_the_parameter_and_the_largest_error_first():
    """A parameter's gradient comes from the backward of its consumers and what follows them: a unit before them
    (here ``relu``, conv2's input) cannot change it however lossy; among the units after, the largest fidelity
    proxy is raised first (rexnet_100: a 4-bit chain three nodes on, not the 8-bit code next to the BatchNorm)."""
    from memopt.fidelity.scope import responsible as _responsible
    graph = torch.fx.symbolic_trace(_Chain()).graph
    lossy = {("fewbit", "before"): {"relu"}, ("stash", "near"): {"bn2"}, ("fewbit", "far"): {"relu_1"}}
    weights = {("fewbit", "before"): 1e6, ("stash", "near"): 1.0, ("fewbit", "far"): 100.0}
    assert _responsible(graph, "conv2.weight", lossy, weights, radius=4) == [("fewbit", "far")]
    assert _responsible(graph, "conv2.weight", lossy, weights, radius=1) == [("stash", "near")]
    assert _responsible(graph, "conv3.weight", lossy, weights, radius=4) == []
    assert _responsible(graph, "conv1.weight", lossy, weights, radius=4) == [("fewbit", "before")]


def test_units_the_gate_turns_exact_say_so_in_the_report():
    """Without a budget, a unit the gate took out must not read "not chosen by the budget planner"."""
    torch.manual_seed(0)
    model, x = GeluMLP(), torch.randn(64, 64)
    config = memopt.Config(fewbit=memopt.FewBitConfig(bits=8), stash=None, reversible=None,
                           fidelity=memopt.FidelityConfig(min_cosine=1.0, max_rounds=3))
    om = memopt.optimize(model, example_inputs=x, config=config)
    assert any("-> exact" in change for change in om.plan.fidelity["changes"])
    exact = [n for n in om.plan.nodes if n.op == "gelu" and n.technique == "exact"]
    assert exact and all("made exact by the fidelity gate" in n.reason for n in exact)
    assert "budget planner" not in om.report()


def test_a_plan_still_missing_after_the_rounds_is_made_exact_and_the_user_is_warned(caplog):
    """Never ship a plan whose gradients miss the bar: when ``max_rounds`` is spent (one round here, a bar that
    3 -> 4-bit tables cannot reach) the gate turns the lossy units after the failing parameters exact, passes,
    and warns naming the worst parameter, its cosine and the settings that would keep the savings."""
    torch.manual_seed(0)
    model, x = GeluMLP(), torch.randn(64, 64)
    config = memopt.Config(fewbit=memopt.FewBitConfig(bits=3), stash=None, reversible=None,
                           fidelity=memopt.FidelityConfig(min_cosine=0.99999, max_rounds=1))
    with caplog.at_level("WARNING", logger="memopt"):
        om = memopt.optimize(model, example_inputs=x, config=config)
    report = om.plan.fidelity
    assert report["passed"] and report["last_resort"] and report["rounds"] == 1
    assert report["changes"][-1] == report["last_resort"] and "-> exact" in report["last_resort"]
    assert "last resort after 1 round:" in om.report()
    warning = next(r.getMessage() for r in caplog.records if "rather than ship" in r.getMessage())
    worst = report["last_resort"].rpartition("worst ")[2].split()[0]
    assert worst in warning and "FidelityConfig.max_rounds" in warning and "Config(fidelity=None)" in warning
    # what runs is exact where it matters: every gradient matches eager at the full batch
    assert all(f["cosine"] >= 0.99999 for f in _cosines(model, om, x).values() if not f["tiny"])
    assert not any(n.technique == "fewbit" for n in om.plan.nodes)  # every GELU follows layers.0


def test_a_plan_passing_narrowly_is_confirmed_on_more_projections(monkeypatch):
    # a small parameter's cosine spreads with the projection: a plan within MARGIN of the bar draws further
    # projections (up to MAX_PROJECTIONS) before it is accepted; a wide pass stops at PROJECTIONS
    torch.manual_seed(0)
    model, x = nn.Sequential(nn.Linear(8, 32), nn.GELU(), nn.Linear(32, 4)), torch.randn(16, 8)
    config = memopt.Config(stash=None, reversible=None, fidelity=memopt.FidelityConfig(min_cosine=0.5))
    wide = memopt.optimize(copy.deepcopy(model), example_inputs=x, config=config).plan.fidelity
    assert wide["passed"] and wide["projections"] == fidelity.PROJECTIONS
    monkeypatch.setattr(fidelity, "MARGIN", 1.0)  # every pass is narrow now
    narrow = memopt.optimize(copy.deepcopy(model), example_inputs=x, config=config).plan.fidelity
    assert narrow["passed"] and narrow["projections"] == fidelity.MAX_PROJECTIONS
    # per further projection: the eager step and the rewritten step; its float64 twin (conditioning.float64_noise)
    # runs for the first loss only, and for a later one only when a parameter misses under it
    assert narrow["steps"] == wide["steps"] + 2 * (fidelity.MAX_PROJECTIONS - fidelity.PROJECTIONS)
    fewer = memopt.Config(stash=None, reversible=None, fidelity=memopt.FidelityConfig(min_cosine=0.5,
                                                                                       max_projections=3))
    assert memopt.optimize(copy.deepcopy(model), example_inputs=x, config=fewer).plan.fidelity["projections"] == 3
    assert wide["steps"] == 5  # loss 0: eager, float64, rewritten; loss 1: eager, rewritten


class TwoBranch(nn.Module):
    """A wide GELU branch and a narrow one scaled by 1e-3 (its own parameters frozen), both after ``stem``: the
    narrow branch's few-bit error cannot move any gated gradient, the wide one's can."""

    def __init__(self, a=256, b=32):
        super().__init__()
        self.stem = nn.Linear(16, 16)
        self.a1, self.a2 = nn.Linear(16, a), nn.Linear(a, 8)
        self.b1, self.b2 = nn.Linear(16, b), nn.Linear(b, 8)
        for p in (*self.b1.parameters(), *self.b2.parameters()):
            p.requires_grad_(False)

    def forward(self, x):
        h = self.stem(x)
        return self.a2(nn.functional.gelu(self.a1(h))) + 1e-3 * self.b2(nn.functional.gelu(self.b1(h)))


def test_the_last_resort_turns_exact_only_the_units_the_gradients_need():
    torch.manual_seed(0)
    model, x = TwoBranch(), torch.randn(64, 16)
    config = memopt.Config(fewbit=memopt.FewBitConfig(bits=3), stash=None, reversible=None,
                           fidelity=memopt.FidelityConfig(min_cosine=0.99999, max_rounds=1))
    om = memopt.optimize(model, example_inputs=x, config=config)
    report = om.plan.fidelity
    assert report["passed"] and "1 of the 2 lossy units after the failing parameters -> exact (fewbit gelu;" \
        in report["last_resort"]
    techniques = {n.name: n.technique for n in om.plan.nodes}
    assert techniques["gelu"] == "exact" and techniques["gelu_1_fewbit"] == "fewbit"
    assert all(f["cosine"] >= 0.99999 for f in _cosines(model, om, x).values() if not f["tiny"])


def _key(name):
    return ("stash", name)


@pytest.mark.parametrize("needed, expected", [({"a", "b"}, ["a", "b"]), ({"c"}, ["a", "b", "c"]), (set(), None)])
def test_fewest_exact_halves_between_the_plan_and_all_units_exact(needed, expected):
    """The shortest passing prefix of the units by fidelity proxy (largest first), in about log2(n) trials, the
    decision itself untouched; with nothing needed, one unit (none exact is the failing plan the gate had)."""
    names = "abcdefghij"
    keys = [_key(n) for n in reversed(names)]
    weights = {_key(n): float(len(names) - i) for i, n in enumerate(names)}  # a largest ... j smallest
    decision = {"stash": {n: 8 for n in names}}
    trials = []

    def passes(trial):
        trials.append(trial)
        return not (needed & set(trial["stash"]))

    chosen = fidelity._fewest_exact(keys, decision, weights, passes)
    if expected is None:  # nothing needed: the halving still ends at one unit, the least it tries
        assert [k[1] for k in chosen] == ["a"]
    else:
        assert [k[1] for k in chosen] == expected
    assert len(trials) <= 1 + 4 and decision == {"stash": {n: 8 for n in names}}  # 1 + ceil(log2 10)


def test_fewest_exact_takes_all_when_all_exact_still_fails():
    keys = [_key("a"), _key("b")]
    chosen = fidelity._fewest_exact(keys, {"stash": {"a": 4, "b": 4, "z": 4}}, {}, lambda trial: False)
    assert chosen == sorted(keys)


def test_a_widespread_raise_goes_by_bits_before_it_makes_units_exact():
    """timm XCiT: raising every stash unit one level turned 194 8-bit codes exact beside twelve 4-bit chains (saved
    ratio 1.19); by bits first, only the chains move, and exact comes when no technique has bits left."""
    config = memopt.Config()
    decision = {"stash": {"chain": 4, "code": 8, "mask": None}, "fewbit": {"gelu": 8}}
    lossy = {("stash", "chain"), ("stash", "code"), ("fewbit", "gelu")}
    weights = {key: 1.0 for key in lossy}
    raised, moves, followed = fidelity._raise_all(decision, config, "stash", lossy, weights, to_exact=False)
    assert raised == {"stash": {"chain": 8, "code": 8, "mask": None}, "fewbit": {"gelu": 8}}
    assert moves == "1 unit 4 -> 8 bits" and followed[("stash", "chain")] == 1.0 / 4 ** 4
    assert fidelity._raise_all(decision, config, "fewbit", lossy, weights, to_exact=False)[1] == ""  # at the top
    raised, moves, _ = fidelity._raise_all(decision, config, "stash", lossy, weights)
    assert raised["stash"] == {"chain": 8, "mask": None} and moves == "1 unit 4 -> 8 bits, 1 unit 8 bits -> exact"
    assert decision == {"stash": {"chain": 4, "code": 8, "mask": None}, "fewbit": {"gelu": 8}}  # a copy was raised


def test_the_gate_runs_the_planned_graph_when_the_slice_captures_another(caplog):
    """A slice's capture whose nodes are not the planned graph's would make the plan name nodes it lacks: the gate
    then runs the planned graph itself on the whole batch (and logs why) rather than measure an unrewritten one."""
    import logging

    from memopt.capture.trace import capture
    torch.manual_seed(0)
    model, x = GeluMLP(), torch.randn(16, 64)
    planned = capture(model, (x,), {}).graph_module

    def other(args, kwargs):
        gm = capture(model, args, kwargs).graph_module
        next(n for n in gm.graph.nodes if n.op == "call_function").name = "renamed"
        return gm

    with caplog.at_level(logging.INFO, logger="memopt"):
        base, args, _, which = fidelity.gate_graph(model, planned, (x,), {}, other)
    assert which == "the whole example batch" and args[0] is x
    assert [n.name for n in base.graph.nodes] == [n.name for n in planned.graph.nodes] and base is not planned
    assert "captured on the first samples is not the planned graph" in caplog.text
    base, args, _, which = fidelity.gate_graph(model, planned, (x,), {}, lambda a, k: capture(model, a, k).graph_module)
    assert which == "the first 4 of 16 samples" and args[0].shape[0] == 4


class _PreNormMLP(nn.Module):
    def __init__(self):
        super().__init__()
        self.norm, self.fc1, self.fc2 = nn.LayerNorm(32), nn.Linear(32, 64), nn.Linear(64, 32)

    def forward(self, x):
        return x + self.fc2(torch.nn.functional.gelu(self.fc1(self.norm(x))))


def test_units_that_reach_weight_gradients_alone_are_blamed_for_those_weights_only():
    """The generic stash's linear inputs change only their linear's weight gradient (the input gradient needs the
    weight alone): a failing bias or norm parameter never spends a gate round on them (HF MambaOut's fc1.bias did),
    while the coded norm and the few-bit GELU, whose input gradients are approximate, stay in every scope after
    them."""
    from memopt.fidelity.scope import weight_only_units, within_reach
    torch.manual_seed(0)
    om = memopt.optimize(_PreNormMLP(), example_inputs=torch.randn(4, 16, 32))
    only = weight_only_units(om._memopt_last.graph_module)
    assert only == {("stash", "norm"): {"fc1.weight"}, ("stash", "gelu"): {"fc2.weight"}}
    lossy = {(u["chosen"]["technique"], u["chosen"]["unit"]): set(u["nodes"]) for u in om.plan.units}
    assert set(lossy) == {("stash", "norm"), ("stash", "gelu"), ("stash", "norm_coded"), ("fewbit", "gelu")}
    assert set(within_reach(lossy, only, "fc1.bias")) == {("stash", "norm_coded"), ("fewbit", "gelu")}
    assert set(within_reach(lossy, only, "fc1.weight")) == set(lossy) - {("stash", "gelu")}
    assert set(within_reach(lossy, only, "norm.weight")) == {("stash", "norm_coded"), ("fewbit", "gelu")}


def test_rounds_that_stop_helping_end_early_and_the_warning_does_not_ask_for_more(monkeypatch, caplog):
    """A generous ``max_rounds`` must cost time only while rounds help: past EARLY_RESORT rounds, when
    STALL_ROUNDS rounds in a row lift no failing parameter (here the repair is given no unit to raise), the gate
    goes to its last resort, says so in the changes, and its warning does not suggest raising ``max_rounds``."""
    monkeypatch.setattr(fidelity, "responsible", lambda *args, **kwargs: [])
    monkeypatch.setattr(fidelity, "WIDESPREAD_LEAST", 10 ** 6)  # no technique-wide raise either
    torch.manual_seed(0)
    model, x = GeluMLP(), torch.randn(64, 64)
    config = memopt.Config(fewbit=memopt.FewBitConfig(bits=3), stash=None, reversible=None,
                           fidelity=memopt.FidelityConfig(min_cosine=0.99999, max_rounds=20))
    with caplog.at_level("WARNING", logger="memopt"):
        om = memopt.optimize(model, example_inputs=x, config=config)
    report = om.plan.fidelity
    assert report["passed"] and report["rounds"] == fidelity.EARLY_RESORT
    stop = f"rounds stopped after {fidelity.EARLY_RESORT}: the last "
    assert any(change.startswith(stop) for change in report["changes"])
    assert report["last_resort"].startswith(f"last resort after {fidelity.EARLY_RESORT} rounds:")
    warning = next(r.getMessage() for r in caplog.records if "rather than ship" in r.getMessage())
    assert "max_rounds" not in warning and "FidelityConfig.min_cosine" in warning
    assert all(f["cosine"] >= 0.99999 for f in _cosines(model, om, x).values() if not f["tiny"])


def wide_noise():
    """TwoBranch with a narrow branch (24) that carries the gradients and a wide one (512) that does not: the wide
    branch's few-bit unit has the larger error proxy but moves no gated gradient."""
    return TwoBranch(a=24, b=512)


@pytest.mark.parametrize("measured", [True, False])
def test_the_last_resort_orders_units_by_their_measured_effect(monkeypatch, measured):
    """The last resort turns exact the fewest units that pass, found by halving over an order: each candidate's
    measured effect on the failing parameters (one trial each), not its error proxy, which ranks the wide branch
    that moves nothing first and costs both units."""
    if not measured:
        monkeypatch.setattr(fidelity, "MEASURED_ORDER", 0)  # the proxy order, for contrast
    torch.manual_seed(0)
    model, x = wide_noise(), torch.randn(64, 16)
    config = memopt.Config(fewbit=memopt.FewBitConfig(bits=3), stash=None, reversible=None,
                           fidelity=memopt.FidelityConfig(min_cosine=0.99999, max_rounds=1))
    report = memopt.optimize(model, example_inputs=x, config=config).plan.fidelity
    assert report["passed"]
    want = "1 of the 2 lossy units after the failing parameters -> exact (fewbit gelu;" if measured else \
        "2 of the 2 lossy units after the failing parameters -> exact"
    assert want in report["last_resort"], report["last_resort"]


class SideBySide(nn.Module):
    """Two GELU branches with their own outputs, side by side. The second one's GELU inputs are about its input's
    mean: far past the bend for the even rows of ``side_by_side_input`` (its few-bit derivative is 1 there, as the
    exact one), near 0 for the odd rows (where the few-bit table's steps show)."""

    def __init__(self):
        super().__init__()
        self.a1, self.a2 = nn.Linear(16, 128), nn.Linear(128, 4)
        self.b1, self.b2 = nn.Linear(16, 128), nn.Linear(128, 4)
        with torch.no_grad():
            self.b1.weight.copy_(1 / 16 + 0.01 * torch.randn(128, 16))
            self.b1.bias.zero_()

    def forward(self, x):
        return torch.cat([self.a2(nn.functional.gelu(self.a1(x))), self.b2(nn.functional.gelu(self.b1(x)))], 1)


def side_by_side_input(n=64):
    x = torch.randn(n, 16)
    x[0::2] += 8.0
    return x


class FirstOutputs:
    """The gate's first two losses weigh the second output on the even rows only, a full random projection after
    them: the second branch's parameters are gated under every loss, its few-bit error shows only after two."""

    def __init__(self, index):
        self.index, self.full = index, RandomProjection(seed=index)

    def __call__(self, out):
        if self.index < 2:
            rows = (torch.arange(out.shape[0]) % 2 == 0).to(out.dtype)[:, None]
            out = torch.cat([out[:, :4], out[:, 4:] * rows], 1)
        return self.full(out)


def test_the_last_resorts_plan_is_confirmed_on_further_projections_and_resorted_where_one_misses(monkeypatch):
    """The last resort picks the fewest exact units that pass the losses in use; what it ships is confirmed on
    further projections as any passing plan is, and a unit a new projection exposes goes exact too."""
    torch.manual_seed(0)
    model, x = SideBySide(), side_by_side_input()
    config = memopt.Config(fewbit=memopt.FewBitConfig(bits=3), stash=None, reversible=None,
                           fidelity=memopt.FidelityConfig(min_cosine=0.99999, max_rounds=1))
    monkeypatch.setattr(losses, "projection", FirstOutputs)
    monkeypatch.setattr(fidelity, "MARGIN", 1.0)  # every pass is confirmed up to MAX_PROJECTIONS
    om = memopt.optimize(model, example_inputs=x, config=config)
    report = om.plan.fidelity
    resorts = [c for c in report["changes"] if c.startswith("last resort")]
    assert report["passed"] and len(resorts) == 2, report["changes"]
    assert "(fewbit gelu;" in resorts[0] and "(fewbit gelu_1;" in resorts[1], resorts
    assert report["projections"] == fidelity.MAX_PROJECTIONS
    assert {n.name: n.technique for n in om.plan.nodes if n.op == "gelu"} == {"gelu": "exact", "gelu_1": "exact"}
    assert all(f["cosine"] >= 0.99999 for f in _cosines(model, om, x).values() if not f["tiny"])


class ZeroHead(nn.Module):
    """Two heads; the second's last layer starts at zero, so under the outputs' own direction (the gate's second
    loss) its weight's gradient is exactly zero, and under a random projection it is not."""

    def __init__(self):
        super().__init__()
        self.a = nn.Sequential(nn.Linear(8, 32), nn.GELU(), nn.Linear(32, 4))
        self.b = nn.Sequential(nn.Linear(8, 32), nn.GELU(), nn.Linear(32, 4))
        nn.init.zeros_(self.b[2].weight)
        nn.init.zeros_(self.b[2].bias)

    def forward(self, x):
        return self.a(x), self.b(x)


def test_a_gradient_tiny_under_one_loss_is_gated_under_the_others():
    torch.manual_seed(0)
    report = memopt.optimize(ZeroHead(), example_inputs=torch.randn(16, 8)).plan.fidelity
    assert report["projections"] >= 2 and report["passed"]
    assert "b.2.weight" not in report["tiny"], report["tiny"]  # tiny under the own direction only
    assert report["parameters"]["b.2.weight"]["cosine"] < 1.0  # measured, not skipped


def test_a_tiny_gradient_is_listed_apart_only_while_its_error_is_negligible_too():
    exact = [torch.full((4,), 1.0), torch.full((4,), 2.0), torch.full((4,), 1e-5)]
    near = parameter_fidelity(["a", "b", "c"], exact, [exact[0], exact[1], -exact[2]], 1e-3)
    assert near["c"]["tiny"] and near["c"]["negligible"] and near["c"]["excluded"]  # rounding near zero
    far = parameter_fidelity(["a", "b", "c"], exact, [exact[0], exact[1], torch.full((4,), 0.5)], 1e-3)
    assert far["c"]["tiny"] and not far["c"]["negligible"] and not far["c"]["excluded"]  # an invented gradient
    assert fidelity.judged(far["c"]) == far["c"]["cosine"] and fidelity.judged(near["c"]) == 1.0


def test_a_miss_the_all_exact_plan_shares_is_listed_apart_not_chased(monkeypatch):
    """Where a parameter misses with every lossy unit exact too, the rewritten graph's own rounding moves it (a
    near-invariant gradient): no unit is to blame, so it is listed apart with that reason, measured, and the plan
    keeps its codes. Here every rewritten step turns layers.0.bias's gradient around, whatever the plan."""
    real = fidelity.training_grads

    def grads(fn, model, *args, stop=None, **kwargs):
        index = [n for n, _ in model.named_parameters()].index("layers.0.bias")

        def flipped(each):  # before the gate reads them
            if fn is not model:
                each[index] = -each[index]
            return stop is not None and stop(each)
        return real(fn, model, *args, stop=flipped, **kwargs)

    monkeypatch.setattr(fidelity, "training_grads", grads)
    torch.manual_seed(0)
    om = memopt.optimize(GeluMLP(), example_inputs=torch.randn(64, 64),
                         config=memopt.Config(fewbit=memopt.FewBitConfig(bits=4), stash=None, reversible=None))
    report = om.plan.fidelity
    assert report["passed"] and not report["last_resort"], report["changes"]
    assert report["invariant"]["layers.0.bias"].startswith("with every lossy unit exact its gradient is at cosine "
                                                          "-1.000 to eager's"), report["invariant"]
    assert any(n.technique == "fewbit" for n in om.plan.nodes)  # the codes stay


def test_a_plan_confirmed_on_eight_losses_shares_its_forwards(monkeypatch):
    """Eight losses cost four forwards, not sixteen steps: the eager side's gradients and the plan's under the first
    two losses, each from one forward (a plan new to the gate), then the other six side by side, from one forward
    of each, measured ahead of confirmation (``paired_grads``: on this model the six copies of the eager gradients
    would weigh more than the eager forward on the slice); every (plan, loss) gradient once."""
    calls = []
    real, pairs = fidelity.training_grads, fidelity.paired_grads

    def counted(fn, model, *args, **kwargs):
        found = real(fn, model, *args, **kwargs)
        calls.append(("eager" if fn is model else "plan", len(found)))
        return found

    def paired(*args, **kwargs):
        found = pairs(*args, **kwargs)
        calls.append(("eager and plan", found[0]))
        return found

    monkeypatch.setattr(fidelity, "training_grads", counted)
    monkeypatch.setattr(fidelity, "paired_grads", paired)
    torch.manual_seed(0)
    om = memopt.optimize(GeluMLP(), example_inputs=torch.randn(64, 64),
                         config=memopt.Config(fewbit=memopt.FewBitConfig(bits=8), stash=None, reversible=None))
    report = om.plan.fidelity
    assert report["passed"] and not report["changes"] and report["projections"] == fidelity.MAX_PROJECTIONS == 8
    assert calls == [("eager", 2), ("plan", 2), ("eager and plan", 6)], calls
    assert report["steps"] == 16 + 1  # a gradient per loss on each side, and the float64 check of the first
