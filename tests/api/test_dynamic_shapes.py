"""Inputs whose sizes change every batch reuse one captured graph and plan where the rewrite decisions are the
same (memopt/builder/shape_reuse.py), train bit for bit as eager PyTorch does, and plan again, saying why, where a size
changes a decision."""
import copy
import importlib.util
from pathlib import Path

import pytest
import torch
from torch import nn

import memopt
import memopt.builder.request
from memopt.builder.optimized import MAX_SIGNATURES


def cnn():
    torch.manual_seed(0)
    return nn.Sequential(nn.Conv2d(3, 8, 3, padding=1), nn.BatchNorm2d(8), nn.ReLU(),
                         nn.Conv2d(8, 8, 3, stride=2, padding=1), nn.BatchNorm2d(8), nn.GELU(),
                         nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(8, 4)).train()


# batch and image size change; every BatchNorm still normalises >= StashConfig.min_per_channel (32) elements
SIZES = [(4, 3, 16, 16), (2, 3, 16, 16), (4, 3, 24, 24), (3, 3, 12, 12), (6, 3, 20, 20)]


def _step(net, x, seed=0):
    torch.manual_seed(seed)
    out = net(x) if isinstance(x, torch.Tensor) else net(**x)
    out = out if isinstance(out, torch.Tensor) else out.last_hidden_state
    out.pow(2).mean().backward()
    return out.detach()


def _grads(model):
    grads = [None if p.grad is None else p.grad.clone() for p in model.parameters()]
    model.zero_grad(set_to_none=True)
    return grads


def _same(a, b):
    return (a is None and b is None) or (a is not None and b is not None and torch.equal(a, b))


@pytest.fixture
def gates(monkeypatch):
    """How often the fidelity gate ran."""
    calls = []
    real = memopt.builder.request.fidelity_gate

    def counted(*args, **kwargs):
        calls.append(1)
        return real(*args, **kwargs)

    monkeypatch.setattr(memopt.builder.request, "fidelity_gate", counted)
    return calls


def test_exact_config_one_plan_for_every_size_bit_identical(one_thread, caplog):
    model = cnn()
    reference = copy.deepcopy(model)
    om = memopt.optimize(model, example_inputs=torch.randn(SIZES[0]), config=memopt.Config.exact())
    with caplog.at_level("INFO", logger="memopt"):
        for shape in SIZES:
            x = torch.randn(shape)
            assert torch.equal(_step(om, x), _step(reference, x))
            assert all(map(_same, _grads(model), _grads(reference)))
            assert om.plan.input_signature[0].endswith(f"float32[{','.join(map(str, shape))}] cpu")
    assert om.shape_stats["planned"] == 1 and om.shape_stats["reused"] == len(SIZES) - 1
    assert "reusing the plan made for ['[0][0]: float32[4,3,16,16] cpu']" in caplog.text
    assert "input signatures: 1 planned" in om.report()


def test_default_config_reuses_the_plan_without_the_gate(one_thread, gates, caplog):
    model = cnn()
    reference = copy.deepcopy(model)
    om = memopt.optimize(model, example_inputs=torch.randn(SIZES[0]))
    chosen = om.plan.chosen_units()
    # 4-bit _1 and 3-bit _5 planned; the gate raises both to 8 under the outputs' own direction (this file's loss)
    assert chosen["stash"]["_1"] == 8 and chosen["fewbit"] == {"_5": 8} and len(gates) == 1
    with caplog.at_level("WARNING", logger="memopt"):
        for shape in SIZES:
            x = torch.randn(shape)
            assert torch.equal(_step(om, x), _step(reference, x))  # the forward is exact; gradients are not
            _grads(model), _grads(reference)
    assert om.shape_stats["planned"] == 1 and len(gates) == 1  # the gate ran once, for the first plan
    assert "capturing and planning again" not in caplog.text
    assert "new input signature ['[0][0]: float32[2,3,16,16] cpu'] for Sequential; reusing the plan" in caplog.text
    assert om.plan.chosen_units() == chosen
    assert om.plan.baseline_saved_bytes != 0 and om.plan.estimated_saved_bytes < om.plan.baseline_saved_bytes
    assert memopt.measure(om, torch.randn(SIZES[-1])).saved_bytes == om.plan.estimated_saved_bytes


def test_a_size_that_changes_a_decision_plans_again_and_says_why(one_thread, gates, caplog):
    model = cnn()
    reference = copy.deepcopy(model)
    om = memopt.optimize(model, example_inputs=torch.randn(SIZES[0]))
    chosen = om.plan.chosen_units()
    tiny = torch.randn(1, 3, 4, 4)  # the first BatchNorm sees 1 x 4 x 4 = 16 < 32 elements per channel
    with caplog.at_level("WARNING", logger="memopt"):
        assert torch.equal(_step(om, tiny), _step(reference, tiny))
    assert ("new input signature ['[0][0]: float32[1,3,4,4] cpu'] for Sequential; capturing and planning again: the "
            "rewrite decisions differ: stash _1 (8 bits) is not rewritten at these sizes: stash: it normalises 16 "
            "elements per channel, fewer than StashConfig.min_per_channel=32") in caplog.text
    assert "_1" not in om.plan.chosen_units().get("stash", {}) and om.shape_stats["planned"] == 2 and len(gates) == 2
    assert sum(om.shape_stats["replans"].values()) == 1
    _grads(model), _grads(reference)
    for shape in SIZES[1:]:  # back to sizes the first plan serves: reused, never planned again
        x = torch.randn(shape)
        assert torch.equal(_step(om, x), _step(reference, x))
        assert om.plan.chosen_units() == chosen
    assert om.shape_stats["planned"] == 2 and len(gates) == 2


def test_the_cache_bound_holds_and_evicted_sizes_are_remembered(one_thread):
    model = cnn()
    om = memopt.optimize(model, example_inputs=torch.randn(2, 3, 8, 8))
    sizes = [(2, 3, 8 + 2 * i, 8 + 2 * i) for i in range(MAX_SIGNATURES + 4)]
    for shape in sizes + sizes[:2]:
        _step(om, torch.randn(shape))
        assert len(om._memopt_built) <= MAX_SIGNATURES
    stats = om.shape_stats
    assert stats["planned"] == 1 and stats["reused"] == len(sizes) + 1 and stats["remembered"] == 2
    assert len({id(built.graph_module) for built in om._memopt_built.values()}) == 1  # one graph for all sizes


def _hf():
    path = Path(__file__).resolve().parent.parent / "models" / "test_hf_models.py"
    spec = importlib.util.spec_from_file_location("memopt_test_hf_models", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.mark.parametrize("config", ["exact", "default"])
def test_bert_sequence_lengths_share_one_dynamic_export(one_thread, gates, caplog, config):
    pytest.importorskip("transformers")
    model, _, _ = _hf()._build("bert")
    reference = copy.deepcopy(model)
    tokens = lambda n: {"input_ids": torch.randint(0, 1000, (2, n))}  # noqa: E731
    om = memopt.optimize(model, example_inputs=tokens(16),
                         config=memopt.Config.exact() if config == "exact" else memopt.Config())
    with caplog.at_level("INFO", logger="memopt"):
        for n in (16, 24, 40, 17, 64, 32):
            x = tokens(n)
            assert torch.equal(_step(om, x), _step(reference, x))
            mine, theirs = _grads(model), _grads(reference)
            if config == "exact":
                assert all(map(_same, mine, theirs))
    # torch.export specialises the first graph to 16 tokens; the second length exports it again with the
    # sequence dimension dynamic and applies the first plan to it (no planner, no gate: the graph computes what the
    # first one did), and every later length reuses that graph and its plan: checked where a length lies outside
    # the lengths checked before (40, 17, 64), not where it lies inside them (32)
    assert "capturing and planning again: torch.export specialised the graph to the sizes of [1]['input_ids'] " \
           "dim 1" in caplog.text
    assert "exporting BertModel again with [1]['input_ids'] dim 1 dynamic" in caplog.text
    stats = om.shape_stats
    assert stats["planned"] == 2 and stats["reused"] == 4
    assert om.plan.capture == "export" and "int64[2,32]" in om.plan.input_signature[0]
    if config == "default":
        assert "the plan made for [\"[1]['input_ids']: int64[2,16] cpu\"] applied to it (no planner, no gate)" \
            in caplog.text
        assert stats["inside"] == 1 and "these sizes lie inside the sizes it was checked to run, [1]['input_ids'] " \
            "dim 1: 17..64 (Config.shape_checks='range'" in caplog.text
    assert len(gates) == (0 if config == "exact" else 1)


def test_a_budget_plan_is_reused_only_where_it_is_needed_and_fits(one_thread, caplog):
    model = cnn()
    x = torch.randn(16, 3, 32, 32)
    budget = 0.8 * memopt.estimate(model, x).peak_bytes / 2 ** 20
    om = memopt.optimize(model, budget, example_inputs=x)
    chosen = om.plan.chosen_units()
    assert chosen
    with caplog.at_level("WARNING", logger="memopt"):
        _step(om, torch.randn(14, 3, 32, 32))  # a little smaller: the same rewrites, within the budget
        assert om.shape_stats["planned"] == 1 and om.plan.chosen_units() == chosen
        assert om.plan.estimated_peak_bytes <= budget * 2 ** 20
        _step(om, torch.randn(2, 3, 16, 16))  # the baseline fits: a fresh plan rewrites nothing
    assert ("capturing and planning again: the baseline fits the budget at these sizes: the plan's rewrites are not "
            "needed") in caplog.text
    assert om.shape_stats["planned"] == 2 and om.plan.chosen_units() == {}


class _HalfGradient(torch.autograd.Function):
    """Identity forward, half the gradient backward: inlined by export, its gradient would be autograd's (1x)."""

    @staticmethod
    def forward(ctx, x):
        return x.clone()

    @staticmethod
    def backward(ctx, grad):
        return grad * 0.5


class _Tokens(nn.Module):
    def __init__(self):
        super().__init__()
        self.a, self.b = nn.Linear(8, 16), nn.Linear(16, 4)

    def forward(self, x):
        h = _HalfGradient.apply(torch.relu(self.a(x)))
        if x.shape[0] > 1:  # Python control flow on a size: symbolic_trace fails, torch.export captures it
            h = h * 2
        return self.b(h)


def test_a_custom_function_stays_whole_in_the_dynamic_export(one_thread):
    torch.manual_seed(0)
    model = _Tokens().train()
    reference = copy.deepcopy(model)
    om = memopt.optimize(model, example_inputs=torch.randn(2, 16, 8), config=memopt.Config.exact())
    for n in (16, 24, 40, 17):
        x = torch.randn(2, n, 8)
        assert torch.equal(_step(om, x), _step(reference, x))
        assert all(map(_same, _grads(model), _grads(reference)))
    assert om.plan.capture == "export" and om.shape_stats["planned"] == 2 and om.shape_stats["reused"] == 2
    functions = [m.function for m in om.graph_module.modules() if type(m).__name__ == "FunctionCall"]
    assert functions == [_HalfGradient]


class Pooled(nn.Module):
    """A tanh of fixed size (batch x width) beside tensors that grow with the sequence: few-bit's "too small to
    matter" rule flips for it as the largest kept tensor grows."""

    def __init__(self):
        super().__init__()
        self.a, self.b, self.head = nn.Linear(16, 64), nn.Linear(64, 16), nn.Linear(16, 16)

    def forward(self, x):
        h = self.b(nn.functional.gelu(self.a(x)))
        return h + torch.tanh(self.head(h.mean(1)))[:, None]


def test_a_plan_whose_decisions_still_apply_is_reused_where_a_planning_rule_flips(one_thread, caplog):
    torch.manual_seed(0)
    model = Pooled().train()
    om = memopt.optimize(model, example_inputs=torch.randn(4, 8, 16))
    assert "tanh" in om.plan.chosen_units().get("fewbit", {})
    with caplog.at_level("INFO", logger="memopt"):
        _step(om, torch.randn(4, 256, 16))  # tanh keeps under 1/256 of the largest tensor: a fresh plan skips it
    assert om.shape_stats["planned"] == 1 and om.shape_stats["reused"] == 1
    assert "tanh" in om.plan.chosen_units()["fewbit"]
    fresh = memopt.optimize(copy.deepcopy(model), example_inputs=torch.randn(4, 256, 16))
    assert "tanh" not in fresh.plan.chosen_units().get("fewbit", {})


@pytest.mark.parametrize("checks", ["range", "every"])
def test_sizes_inside_the_checked_range_run_unchecked_unless_every_size_is_asked(one_thread, checks):
    om = memopt.optimize(cnn(), example_inputs=torch.randn(4, 3, 16, 16), config=memopt.Config(shape_checks=checks))
    for side in (24, 12, 20, 14):  # 24 and 12 widen the range; 20 and 14 lie inside it
        _step(om, torch.randn(4, 3, side, side))
    stats = om.shape_stats
    assert stats["planned"] == 1 and stats["reused"] == 4
    assert stats["inside"] == (2 if checks == "range" else 0)
    with pytest.raises(ValueError, match=r"Config.shape_checks='some' is not supported; use one of \['range', "
                                         r"'every'\]"):
        memopt.Config(shape_checks="some")


class Exported(nn.Module):
    """A BatchNorm1d chain over a sequence, captured by torch.export (its in-place write stops the symbolic trace)."""

    def __init__(self):
        super().__init__()
        self.conv, self.bn, self.out = nn.Conv1d(4, 8, 3, padding=1), nn.BatchNorm1d(8), nn.Conv1d(8, 4, 1)

    def forward(self, x):
        h = torch.relu(self.bn(self.conv(x))).clone()
        h[:, 0] = 0.0
        h = h.reshape(x.shape[0], 8, -1)  # export writes the batch size into the graph
        return self.out(nn.functional.gelu(h))


def test_an_export_graph_replanned_at_sizes_it_serves_gates_a_slice_it_does_not_serve(one_thread, caplog):
    """At 3 steps the chain normalises 24 elements per channel (under StashConfig.min_per_channel): the plan's
    decision does not apply, so the dynamic export graph, which serves these sizes, is planned again. Its fidelity
    gate slices the batch (it crashed on a size mismatch once); the re-export made the batch dimension dynamic too
    (DynamicExport), so that graph serves the slice, where one dynamic in the sequence only had the slice captured
    afresh."""
    torch.manual_seed(0)
    model = Exported().train()
    reference = copy.deepcopy(model)
    om = memopt.optimize(model, example_inputs=torch.randn(8, 4, 16))
    assert om.plan.capture == "export" and "batch_norm_coded" in om.plan.chosen_units()["stash"]
    with caplog.at_level("INFO", logger="memopt"):
        for n in (24, 3):
            x = torch.randn(8, 4, n)
            assert torch.equal(_step(om, x), _step(reference, x))
    assert "the rewrite decisions differ: stash batch_norm_coded (8 bits) is not rewritten at these sizes" \
        in caplog.text
    assert om.shape_stats["planned"] == 3 and om.plan.capture == "export"


class _Ids(nn.Module):
    """A token model torch.export captures (an in-place write stops the symbolic trace), GELU for the gate."""

    def __init__(self):
        super().__init__()
        self.embed, self.up, self.down = nn.Embedding(100, 16), nn.Linear(16, 32), nn.Linear(32, 16)

    def forward(self, ids):
        h = self.up(self.embed(ids)).clone()
        h[:, 0] = 0.0
        return self.down(nn.functional.gelu(h))


def _counted_exports(monkeypatch) -> list:
    """The input shape of every torch.export memopt makes (its first input's)."""
    from memopt.builder import dynamic_export
    from memopt.capture import trace

    exports = []
    export = trace.export_module
    counted = lambda *a, **k: exports.append(tuple(a[1][0].shape)) or export(*a, **k)  # noqa: E731
    monkeypatch.setattr(trace, "export_module", counted)
    monkeypatch.setattr(dynamic_export, "export_module", counted)
    return exports


def test_a_dynamic_export_serves_the_soundness_slice_and_other_batch_sizes(one_thread, monkeypatch, caplog):
    """The re-export with the changed dimension dynamic makes the batch dynamic too: the soundness check runs that
    graph on its slice of the batch (no second export of the slice), and a later batch size reuses the plan."""
    exports = _counted_exports(monkeypatch)
    torch.manual_seed(0)
    model = _Ids().train()
    reference = copy.deepcopy(model)
    ids = lambda b, n: torch.randint(0, 100, (b, n))  # noqa: E731
    om = memopt.optimize(model, example_inputs=ids(8, 16))
    assert om.plan.capture == "export"
    first = len(exports)
    with caplog.at_level("INFO", logger="memopt"):
        for b, n in ((8, 24), (6, 24), (8, 40)):
            x = ids(b, n)
            assert torch.equal(_step(om, x), _step(reference, x))
            _grads(model), _grads(reference)
    assert exports[first:] == [(8, 24)], exports  # one export, batch and sequence dynamic; the slice is served
    assert "exporting _Ids again with [0][0] dim 1 dynamic" in caplog.text
    assert om.shape_stats["planned"] == 2 and om.shape_stats["reused"] == 2, om.shape_stats


@pytest.mark.parametrize("dynamic", [True, False])
def test_config_dynamic_exports_dynamic_from_the_start_or_never(one_thread, monkeypatch, caplog, dynamic):
    """Config(dynamic=True): one export at optimize(), batch and sequence dynamic; it serves the soundness check's
    and the gate's slice and every later batch size and length (reused, no export, no re-plan). False: every new
    size is exported at its own sizes (the slice's too) and planned anew. Forwards bit-identical to eager."""
    exports = _counted_exports(monkeypatch)
    torch.manual_seed(0)
    model = _Ids().train()
    reference = copy.deepcopy(model)
    ids = lambda b, n: torch.randint(0, 100, (b, n))  # noqa: E731
    om = memopt.optimize(model, example_inputs=ids(8, 16), config=memopt.Config(dynamic=dynamic))
    assert om.plan.capture == "export" and om.plan.chosen_units()["fewbit"]
    assert exports == ([(8, 16)] if dynamic else [(8, 16), (4, 16)]), exports
    with caplog.at_level("INFO", logger="memopt"):
        for b, n in ((8, 24), (6, 24), (8, 40)):
            x = ids(b, n)
            assert torch.equal(_step(om, x), _step(reference, x))
            _grads(model), _grads(reference)
    stats = om.shape_stats
    if dynamic:
        assert exports == [(8, 16)] and (stats["planned"], stats["reused"]) == (1, 3), (exports, stats)
        assert "dynamic" not in "".join(stats["replans"])
    else:
        assert "dynamic" not in caplog.text and (stats["planned"], stats["reused"]) == (4, 0), stats
        assert exports[2:] == [(8, 24), (4, 24), (6, 24), (4, 24), (8, 40), (4, 40)], exports


class _CausalWhenExported(nn.Module):
    """Attention whose eager forward passes ``is_causal=True`` and whose exported graph builds the causal mask from
    the sequence length (as Hugging Face's decoders do under torch.export): at the example's sizes the capture's
    fix-ups replace the constant mask, with the length dynamic the graph keeps it, where eager keeps none."""

    def __init__(self):
        super().__init__()
        self.embed, self.qkv = nn.Embedding(100, 16), nn.Linear(16, 48)
        self.up, self.down = nn.Linear(16, 32), nn.Linear(32, 16)

    def forward(self, ids):
        h = self.embed(ids).clone()
        h[:, 0] = 0.0  # stops the symbolic trace
        q, k, v = self.qkv(h).chunk(3, dim=-1)
        if torch.compiler.is_exporting():
            n = ids.shape[1]
            mask = torch.arange(n)[:, None] >= torch.arange(n)[None, :]
            a = nn.functional.scaled_dot_product_attention(q, k, v, attn_mask=mask)
        else:
            a = nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.down(nn.functional.gelu(self.up(a)))


def test_config_dynamic_falls_back_to_the_examples_sizes_where_the_dynamic_graph_fails_its_check(one_thread, caplog):
    torch.manual_seed(0)
    model = _CausalWhenExported().train()
    reference = copy.deepcopy(model)
    x = torch.randint(0, 100, (8, 16))
    with caplog.at_level("INFO", logger="memopt"):
        om = memopt.optimize(model, example_inputs=x, config=memopt.Config(dynamic=True))
    assert "_CausalWhenExported exported with [0][0] dim 0, [0][0] dim 1 dynamic fails (capture check" \
        in caplog.text, caplog.text
    assert om.plan.capture == "export"  # whole, at the example's sizes: not per submodule
    default = memopt.optimize(copy.deepcopy(reference), example_inputs=x)
    assert om.plan.chosen_units() == default.plan.chosen_units()
    assert om.plan.estimated_saved_bytes == default.plan.estimated_saved_bytes
    assert torch.equal(_step(om, x), _step(reference, x))


@pytest.mark.parametrize("bad", ["yes", 1, 0])
def test_config_dynamic_takes_none_true_or_false(bad):
    with pytest.raises(ValueError) as info:
        memopt.Config(dynamic=bad)
    assert str(info.value) == (f"Config.dynamic={bad!r} is not supported; use None (export at the example's sizes, "
                               f"dynamic from the first new size), True (dynamic from the start) or False")
    assert memopt.Config.from_dict(memopt.Config(dynamic=True).to_dict()).dynamic is True


def test_where_the_dynamic_export_fails_its_check_each_new_size_is_exported_static_with_the_plan(
        one_thread, gates, monkeypatch, caplog):
    """A decoder whose graph with the length dynamic keeps a causal mask eager does not (the Llama family's under
    torch.export): at a new length the dynamic re-export fails its capture check, so these sizes are exported
    static and the first plan applied to them (no planner, no gate), and later lengths go there directly, not
    through another failing dynamic export; the model stays captured whole (it fell to per-submodule capture,
    and to a full plan, at every new length)."""
    exports = _counted_exports(monkeypatch)
    torch.manual_seed(0)
    model = _CausalWhenExported().train()
    reference = copy.deepcopy(model)
    om = memopt.optimize(model, example_inputs=torch.randint(0, 100, (8, 16)))
    first = om.plan.chosen_units()
    assert om.plan.capture == "export" and first.get("fewbit") and exports == [(8, 16), (4, 16)], first
    with caplog.at_level("INFO", logger="memopt"):
        for n in (24, 40, 24):
            x = torch.randint(0, 100, (8, n))
            assert torch.equal(_step(om, x), _step(reference, x))
            _grads(model), _grads(reference)
            assert om.plan.capture == "export" and om.plan.chosen_units() == first
    assert caplog.text.count("_CausalWhenExported exported with [0][0] dim 0, [0][0] dim 1 dynamic fails (capture "
                             "check") == 1, caplog.text
    assert caplog.text.count("_CausalWhenExported exported again at these sizes; the plan made for") == 2
    assert "capturing its submodules" not in caplog.text
    assert exports[2:] == [(8, 24), (8, 24), (4, 24), (8, 40), (4, 40)], exports
    assert om.shape_stats["planned"] == 3 and len(gates) == 1
