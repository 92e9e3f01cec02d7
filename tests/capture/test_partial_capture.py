"""Per-submodule capture (memopt/builder/per_submodule.py): a model whose forward neither fx nor export can capture
still gets its captured blocks rewritten, with the forward unchanged and the rest left exact."""
import copy

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import memopt
from memopt.testing.zoo import build


def _step(model, x, seed=0):
    torch.manual_seed(seed)
    out = model(x)
    out.logsumexp(-1).mean().backward()
    return out


def test_blocks_are_rewritten_forward_identical_and_report_names_the_uncaptured_parent(one_thread):
    model, x = build("early_exit")
    reference = copy.deepcopy(model)
    om = memopt.optimize(model, example_inputs=x)
    plan = om.plan
    assert plan.capture == "per-submodule"
    captured = {r["path"]: r for r in plan.submodules}
    whole = captured[""]
    assert not whole["captured"] and whole["class"] == "EarlyExitResNet"
    # both capture failures quoted, and the construct they failed on
    assert "symbolic_trace: TraceError: symbolically traced variables cannot be used as inputs to control flow" \
        in whole["why"]
    assert "torch.export: GuardOnDataDependentSymNode" in whole["why"]
    assert "zoo.py" in whole["why"] and "if h.detach().abs().amax() > self.limit" in whole["why"]
    assert {p for p, r in captured.items() if r["captured"]} == {"stem", "blocks.0", "blocks.1", "blocks.2", "fc"}
    assert "blocks" not in captured  # the ModuleList is never called: its blocks are
    techniques = {u["chosen"]["technique"] for u in plan.units if u["name"].startswith("blocks.")}
    assert "stash" in techniques
    # the whole-model gate may run some blocks as written (it names them in its change)
    ran_as_written = {p for change in plan.fidelity.get("changes", [])
                      for p in change.partition("(")[2].partition(")")[0].split(", ")}
    assert set(om.graph_modules) == {"stem", "blocks.0", "blocks.1", "blocks.2", "fc"} - ran_as_written
    assert len(om.graph_modules) >= 3
    text = om.report()
    assert "captured per submodule" in text and "(whole model)" in text and "not captured" in text
    assert "blocks.0/bn1_stash" in text  # rows named by submodule (grouped where their bits agree)

    torch.manual_seed(0)
    out = om(x)
    torch.manual_seed(0)
    assert torch.equal(out, reference(x))
    # the rewritten forwards are routed only while om runs: the model is left as it was
    assert all("forward" not in m.__dict__ for m in model.modules())
    ours, stock = memopt.measure(om, x), memopt.measure(model, x)
    assert ours.saved_bytes == plan.estimated_saved_bytes and ours.peak_bytes == plan.estimated_peak_bytes
    assert stock.saved_bytes == plan.baseline_saved_bytes
    # measured: 561,792 vs 930,944 bytes (347,648 before the gate confirmed plans on the outputs' own direction)
    assert ours.saved_bytes < 0.7 * stock.saved_bytes


def test_exact_config_gradients_are_identical_and_default_config_close(one_thread):
    model, x = build("early_exit")
    twin = copy.deepcopy(model)
    om = memopt.optimize(model, example_inputs=x, config=memopt.Config.exact())
    assert om.plan.capture == "per-submodule" and len(om.graph_modules) == 5
    assert torch.equal(_step(om, x), _step(twin, x))
    for (name, p), q in zip(model.named_parameters(), twin.parameters(), strict=True):
        assert torch.equal(p.grad, q.grad), name
    for (name, b), c in zip(model.named_buffers(), twin.buffers(), strict=True):
        assert torch.equal(b, c), name  # BN statistics updated once

    model, x = build("early_exit")
    twin = copy.deepcopy(model)
    om = memopt.optimize(model, example_inputs=x)
    assert torch.equal(_step(om, x), _step(twin, x))
    for (name, p), q in zip(model.named_parameters(), twin.parameters(), strict=True):
        # measured worst per-parameter cosine: 0.994 (blocks.0.conv2.weight, 4-bit stash)
        assert F.cosine_similarity(p.grad.flatten(), q.grad.flatten(), 0) > 0.95, name


def test_eval_and_other_inputs_run_the_original_blocks(one_thread):
    model, x = build("early_exit")
    om = memopt.optimize(model, example_inputs=x)
    om.eval()
    with torch.no_grad():
        assert torch.equal(om(x), model(x))
    om.train()
    small = torch.randn(2, 3, 8, 8)  # a new input signature: captured and planned again
    torch.manual_seed(1)
    out = om(small)
    torch.manual_seed(1)
    assert torch.equal(out, model(small))
    assert "float32[2,3,8,8]" in om.plan.input_signature[0]


def test_estimate_covers_the_whole_model_and_says_how():
    model, x = build("early_exit")
    est = memopt.estimate(model, x)
    real = memopt.measure(model, x)
    assert (est.saved_bytes, est.peak_bytes) == (real.saved_bytes, real.peak_bytes)
    assert est.plan.capture == "per-submodule" and "measured" in est.plan.totals
    assert any(n.name.startswith("blocks.1/") for n in est.nodes)
    assert "(whole model)" in est.report()
    with pytest.raises(memopt.MemoptError, match="memopt.estimate cannot cover EarlyExitResNet on the meta device"):
        memopt.estimate(model, x.to("meta"))


class _NoBlocks(nn.Module):
    def __init__(self):
        super().__init__()
        self.w = nn.Parameter(torch.randn(4, 4))

    def forward(self, x):
        if x.sum() > 0:  # a branch on a tensor value, and no submodule to fall back on
            return x @ self.w
        return x


def test_nothing_capturable_raises_naming_the_construct():
    with pytest.raises(memopt.TraceError) as info:
        memopt.optimize(_NoBlocks(), example_inputs=torch.randn(2, 4))
    message = str(info.value)
    assert "memopt could not capture _NoBlocks" in message
    assert "The construct: " in message and "test_partial_capture.py" in message and "if x.sum() > 0:" in message
    assert "No submodule of it could be captured either (tried: none: the forward calls no submodule)" in message


@pytest.mark.slow
def test_budget_plan_and_export(tmp_path, one_thread):
    model, x = build("early_exit")
    with pytest.raises(memopt.BudgetError, match="captured per submodule .* does not plan for a budget"):
        memopt.optimize(model, budget_mb=0.1, example_inputs=x)
    roomy = memopt.optimize(model, budget_mb=100, example_inputs=x)
    assert roomy.plan.units == [] and roomy.plan.estimated_saved_bytes == roomy.plan.baseline_saved_bytes
    om = memopt.optimize(model, example_inputs=x)
    om.export(tmp_path)
    assert (tmp_path / "graph_blocks_0.py").read_text().startswith("# memopt: rewritten training graph of "
                                                                    "EarlyExitResNet.blocks.0")
    assert "(whole model)" in (tmp_path / "report.md").read_text()
    with pytest.raises(memopt.MemoptError, match="captured per submodule; such a plan cannot be re-applied yet"):
        memopt.optimize(model, plan=tmp_path / "plan.json")
    with pytest.raises(memopt.MemoptError, match="use om.graph_modules"):
        om.graph_module
    clone = copy.deepcopy(om)
    torch.manual_seed(0)
    a = clone(x)
    torch.manual_seed(0)
    assert torch.equal(a, om(x))


class _Block(nn.Module):
    def __init__(self, width):
        super().__init__()
        self.a, self.b = nn.Linear(width, 4 * width), nn.Linear(4 * width, width)

    def forward(self, x):
        return x + self.b(F.gelu(self.a(x)))


class GeluChain(nn.Module):
    """Eight GELU blocks with Python control flow on a value between them: captured per submodule."""

    def __init__(self, width=16, depth=8):
        super().__init__()
        self.blocks = nn.ModuleList(_Block(width) for _ in range(depth))
        self.head = nn.Linear(width, 4)

    def forward(self, x):
        for block in self.blocks:
            x = block(x)
            if x.detach().abs().amax() > 1e6:
                x = x / 2
        return self.head(x)


def test_the_model_captured_per_submodule_is_gated_as_a_whole(one_thread, caplog):
    """Each block passes its own gate at 3 bits (cosine >= 0.995 on its own inputs and outputs), but their
    errors meet in the model's gradients: with every block rewritten, parameters of the whole model miss the bar.
    The whole-model gate finds the fewest blocks to run as written and says which."""
    torch.manual_seed(0)
    model, x = GeluChain(), torch.randn(64, 16)
    reference = copy.deepcopy(model)
    config = memopt.Config(fewbit=memopt.FewBitConfig(bits=3), stash=None, reversible=None,
                           fidelity=memopt.FidelityConfig(min_cosine=0.995))
    with caplog.at_level("WARNING", logger="memopt"):
        om = memopt.optimize(model, example_inputs=x, config=config)
    gate = om.plan.fidelity
    assert om.plan.capture == "per-submodule" and gate["slice"] == "the whole example batch, the model as a whole"
    assert gate["before"]["cosine"] < 0.995 and gate["passed"] and gate["worst"]["cosine"] >= 0.995
    change, = gate["changes"]
    kept = int(change.split(" of the 8 ")[0])  # 4 under two random projections; 6 with the outputs' own direction
    assert 1 <= kept < 8 and change.startswith(f"{kept} of the 8 submodules with lossy rewrites run their original "
                                               f"forward (")
    named = change.partition("(")[2].partition(")")[0].removesuffix(" ...").split(", ")  # the first four
    rewritten = set(om.graph_modules) - {"head"}
    assert len(rewritten) == 8 - kept and rewritten.isdisjoint(named) and "head" in om.graph_modules
    assert any(change in r.getMessage() for r in caplog.records)
    assert "the model as a whole" in om.report() and change in om.report()
    torch.manual_seed(0)
    assert torch.equal(om(x), reference(x))


def test_a_model_captured_per_submodule_without_lossy_rewrites_has_no_gate_report(one_thread):
    torch.manual_seed(0)
    model, x = GeluChain(), torch.randn(64, 16)
    om = memopt.optimize(model, example_inputs=x, config=memopt.Config.exact())
    assert om.plan.capture == "per-submodule" and om.plan.fidelity == {}
