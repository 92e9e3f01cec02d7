"""Reversible segments: found automatically, forward bit-identical, gradients within 1e-5 of
autograd, activation memory flat in depth, must-reject cases rejected with the reason."""
import copy
import io

import pytest
import torch
import torch.nn.functional as F
from torch import fx

import memopt
from memopt import Config, ReversibleConfig
from memopt.reversible.ops import ReversibleSegment, StepSpec, reversible_segment, run_forward, undo_steps
from memopt.testing.reversible_zoo import MUST_REJECT, must_reject, rev_transformer, revnet

ONLY_REVERSIBLE = dict(stash=None, fewbit=None)


def _train_step(model, x, seed=0):
    torch.manual_seed(seed)
    out = model(x)
    out.square().sum().backward()
    return out


def _grad_errors(model, ref):
    return {name: ((p.grad - q.grad).norm() / q.grad.norm()).item()
            for (name, p), q in zip(model.named_parameters(), ref.parameters()) if q.grad.norm() > 0}


def _reversible_calls(om):
    return [n for n in om._memopt_last.graph_module.graph.nodes if n.target is reversible_segment]


CASES = {"revnet": lambda: revnet((2, 2)), "transformer": lambda: rev_transformer(2),
         "transformer_dropout": lambda: rev_transformer(2, dropout=0.1)}


@pytest.mark.parametrize("case", sorted(CASES))
def test_rewritten_forward_exact_gradients_within_1e_5(case):
    model, x = CASES[case]()
    ref = copy.deepcopy(model)
    om = memopt.optimize(model, config=Config(**ONLY_REVERSIBLE))
    out, expected = _train_step(om, x), _train_step(ref, x)
    assert torch.equal(out, expected)
    assert _reversible_calls(om), om.report()
    errors = _grad_errors(model, ref)
    assert max(errors.values()) < 1e-5, sorted(errors.items(), key=lambda kv: -kv[1])[:3]
    # BatchNorm running statistics are updated once per step, exactly as in the original model
    for a, b in zip(model.buffers(), ref.buffers()):
        assert torch.equal(a, b)
    assert om.plan.estimated_saved_bytes < 0.5 * om.plan.baseline_saved_bytes


def test_activation_memory_flat_in_depth_and_estimate_equals_measurement():
    saved = {}
    for blocks in (2, 8):
        model, x = revnet((blocks,), width=16, batch=2, size=8)
        om = memopt.optimize(model, config=Config(**ONLY_REVERSIBLE), example_inputs=x)
        measured = memopt.measure(om, x)
        assert measured.saved_bytes == om.plan.estimated_saved_bytes
        saved[blocks] = (om.plan.baseline_saved_bytes, om.plan.estimated_saved_bytes)
    assert saved[8][0] > 3 * saved[2][0]  # stock autograd grows with depth
    assert saved[8][1] <= 1.10 * saved[2][1]  # the segment keeps its outputs only


@pytest.mark.parametrize("name", sorted(MUST_REJECT))
def test_must_reject_cases_stay_exact_with_the_reason(name):
    model, x = must_reject(name)
    ref = copy.deepcopy(model)
    om = memopt.optimize(model, config=Config(**ONLY_REVERSIBLE))
    torch.manual_seed(0)
    out = om(x)
    torch.manual_seed(0)
    assert torch.equal(out, ref(x))
    reasons = {n.name: n.reason for n in om.plan.nodes if n.reason.startswith("reversible")}
    expected = {"update_reads_its_stream": ("add", "getitem_1 is used by add_2 outside the segment"),
                "interior_used_outside": ("add", "f_0, an intermediate of its update, is also used by mean"),
                "spine_saved_outside": ("add", "getitem is used by relu outside the segment"),
                "inplace_in_update": ("f_2", "f_2 is in place"),
                "dropout_on_spine": ("dropout", "random on the stream add itself")}[name]
    assert expected[1] in reasons.get(expected[0], ""), reasons
    replaced = {r for n in _reversible_calls(om) for r in n.meta["memopt_decision"]["replaces"]}
    if name == "dropout_on_spine":  # the segment ends before the dropout: one coupling, dropout left out
        assert "dropout" not in replaced and "add_1" not in replaced
    else:
        assert not replaced


def test_check_gates_on_the_tolerance_and_anchors_cut_pieces():
    model, x = revnet((4,), batch=2, size=8)
    om = memopt.optimize(model, config=Config(reversible=ReversibleConfig(tolerance=1e-12), **ONLY_REVERSIBLE),
                         example_inputs=x)
    assert not _reversible_calls(om)
    assert any("relative error" in n.reason and "stays exact" in n.reason for n in om.plan.nodes)
    ref = copy.deepcopy(model)
    om = memopt.optimize(model, config=Config(reversible=ReversibleConfig(anchor_every=2), **ONLY_REVERSIBLE))
    _train_step(om, x), _train_step(ref, x)
    assert len(_reversible_calls(om)) == 4  # 8 couplings, 2 per piece
    assert max(_grad_errors(model, ref).values()) < 1e-5


def test_sentinel_rechecks_the_rebuilt_inputs():
    model, x = revnet((2,), batch=2, size=8)
    om = memopt.optimize(model, config=Config(reversible=ReversibleConfig(check_every=1), **ONLY_REVERSIBLE))
    _train_step(om, x)
    segment = getattr(om._memopt_last.graph_module, f"memopt_{_reversible_calls(om)[0].name}")
    assert segment.last_check is not None and 0 <= segment.last_check < 1e-5


def test_double_backward_raises_naming_the_segment():
    model, x = revnet((2,), batch=2, size=8)
    om = memopt.optimize(model, config=Config(**ONLY_REVERSIBLE))
    loss = om(x).square().sum()
    with pytest.raises(RuntimeError, match="double backward through the reversible segment reversible_add"):
        torch.autograd.grad(loss, list(model.parameters()), create_graph=True)


@pytest.mark.parametrize("explicit", [False, True], ids=["through-vjp", "explicit-inverse"])
def test_glue_round_trip_is_bitwise_exact(explicit):
    def glue(fn):
        return fx.symbolic_trace(fn)

    def spec(reads, writes, key, inverse, params):
        return StepSpec("glue", reads, writes, key, key, inverse=inverse if explicit else "", params=params)

    steps = [spec(("x",), ("a",), "s0", "pixel_shuffle", (2,)), spec(("a",), ("b",), "s1", "permute", ((0, 2, 3, 1),)),
             spec(("b",), ("c", "d"), "s2", "cat", (-1,)), spec(("d", "c"), ("e",), "s3", "split", (-1,)),
             spec(("e",), ("f",), "s4", "flip", ((1,),))]
    modules = {"s0": glue(lambda x: F.pixel_unshuffle(x, 2)), "s1": glue(lambda a: a.permute(0, 2, 3, 1)),
               "s2": glue(lambda b: torch.chunk(b, 2, dim=-1)), "s3": glue(lambda d, c: torch.cat([d, c], -1)),
               "s4": glue(lambda e: torch.flip(e, [1]))}
    segment = ReversibleSegment("glue", ["x"], ["f"], steps, modules)
    x = torch.randn(2, 4, 6, 6)
    (out,), rng, shapes = run_forward(segment, [x])
    g = torch.randn_like(out)
    rebuilt, grads, _ = undo_steps(segment, [out], rng, shapes, [g])
    assert torch.equal(rebuilt["x"], x)
    xr = x.clone().requires_grad_()
    (expected,), _, _ = run_forward(segment, [xr])
    (expected_grad,) = torch.autograd.grad(expected, xr, g)
    assert torch.equal(grads["x"], expected_grad)


def test_estimate_on_meta_inputs_rewrites_unchecked_and_torch_save_round_trips():
    model, x = revnet((2,), batch=2, size=8)
    planned = memopt.optimize(model, config=Config(**ONLY_REVERSIBLE),
                              example_inputs=torch.empty(64, 3, 8, 8, device="meta")).plan
    assert any(n.technique == "reversible" and "not checked" in n.reason for n in planned.nodes)
    assert planned.estimated_saved_bytes < 0.5 * planned.baseline_saved_bytes
    om = memopt.optimize(model, config=Config(**ONLY_REVERSIBLE), example_inputs=x)
    buffer = io.BytesIO()
    torch.save(om, buffer)
    buffer.seek(0)
    loaded = torch.load(buffer, weights_only=False)
    torch.manual_seed(0)
    a = loaded(x)
    torch.manual_seed(0)
    assert torch.equal(a, copy.deepcopy(model)(x))


@pytest.mark.parametrize("bad, message", [
    (dict(mode="fast"), "ReversibleConfig.mode='fast' is not supported"),
    (dict(tolerance=0), "ReversibleConfig.tolerance must be a positive finite number, got 0"),
    (dict(anchor_every=0), "ReversibleConfig.anchor_every must be None or a positive int, got 0"),
    (dict(segments="reversible_add"), "ReversibleConfig.segments must be a tuple of node names"),
])
def test_config_errors_quote_the_value(bad, message):
    with pytest.raises(ValueError, match=message.replace("(", r"\(").replace(")", r"\)")):
        ReversibleConfig(**bad)


@pytest.mark.slow
def test_planner_offers_reversible_pieces_and_the_estimate_holds():
    model, x = revnet((4,), batch=8, size=16)
    baseline = memopt.estimate(model, x).peak_bytes
    om = memopt.optimize(model, budget_mb=0.7 * baseline / 2**20, example_inputs=x)
    chosen = {u["chosen"]["technique"] for u in om.plan.units}
    assert "reversible" in chosen, om.plan.units
    assert om.plan.estimated_peak_bytes <= 0.7 * baseline
    assert memopt.measure(om, x).peak_bytes == om.plan.estimated_peak_bytes


@pytest.mark.slow
def test_aggressive_mode_inverts_batchnorm_and_leaky_relu_on_the_spine():
    saved = {}
    for mode in ("safe", "aggressive"):
        model, x = revnet((2, 2), batch=8, size=8, spine_norm=True)
        ref = copy.deepcopy(model)
        om = memopt.optimize(model, config=Config(reversible=ReversibleConfig(mode=mode), **ONLY_REVERSIBLE),
                             example_inputs=x)
        assert torch.equal(_train_step(om, x), _train_step(ref, x))
        assert max(_grad_errors(model, ref).values()) < 1e-4
        assert all(torch.equal(a, b) for a, b in zip(model.buffers(), ref.buffers()))
        assert memopt.measure(om, x).saved_bytes == om.plan.estimated_saved_bytes
        saved[mode] = om.plan.estimated_saved_bytes
    assert saved["aggressive"] < 0.6 * saved["safe"]
    model.body[2].negative_slope = 0.01  # too flat to invert accurately: the spine stops there
    om = memopt.optimize(model, config=Config(reversible=ReversibleConfig(mode="aggressive"), **ONLY_REVERSIBLE),
                         example_inputs=x)
    assert any("LeakyReLU slope 0.01 < 0.1" in n.reason for n in om.plan.nodes)


def test_convert_rewires_residual_runs_reports_the_change_and_then_is_reversible():
    from memopt.core.errors import MemoptError
    from memopt.testing.zoo import SmallCNN, TinyViT

    torch.manual_seed(0)
    model, x = TinyViT(depth=4).train(), torch.randn(4, 3, 16, 16)
    converted = memopt.reversible.convert(model, x)
    report = converted.conversion
    assert [len(run) for run in report.runs] == [8]  # attention + MLP residual of 4 blocks
    assert report.params_before == report.params_after == sum(p.numel() for p in model.parameters())
    assert report.max_abs_change > 0 and "the function CHANGED" in str(report)
    assert list(converted.state_dict()) == list(model.state_dict())
    assert "pos" in torch.export.export(converted, (x,), strict=False).graph_signature.parameters

    ref_model = copy.deepcopy(model)
    ref = memopt.reversible.convert(ref_model, x)
    om = memopt.optimize(converted, config=Config(**ONLY_REVERSIBLE))
    assert torch.equal(_train_step(om, x), _train_step(ref, x))
    assert _reversible_calls(om)
    errors = {n: ((p.grad - q.grad).norm() / q.grad.norm()).item()
              for (n, p), q in zip(model.named_parameters(), ref_model.parameters())}
    assert max(errors.values()) < 1e-5, errors
    assert om.plan.estimated_saved_bytes < 0.3 * om.plan.baseline_saved_bytes
    converted.eval()
    with torch.no_grad():
        assert converted(x).shape == (4, 10)

    with pytest.raises(MemoptError, match="SmallCNN has no run of >= 3 plain residual blocks"):
        memopt.reversible.convert(SmallCNN(), torch.randn(2, 3, 32, 32))


@pytest.mark.parametrize("technique", ["reversible", "recompute"])
def test_backward_recomputes_under_the_forward_autocast_state(technique):
    """Backward runs outside the autocast block: H (or the recomputed block) must still run in
    bfloat16, else the rebuilt input / the gradient belong to another function (errors ~1e-1)."""
    from memopt import RecomputeConfig

    model, x = revnet((2, 2), batch=8, size=8)
    ref = copy.deepcopy(model)
    config = Config(**ONLY_REVERSIBLE) if technique == "reversible" else \
        Config(reversible=None, recompute=RecomputeConfig(segments=None), **ONLY_REVERSIBLE)
    om = memopt.optimize(model, config=config)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        out, expected = om(x), ref(x)
    assert torch.equal(out, expected)
    assert any(n.technique == technique for n in om.plan.nodes)
    out.float().square().sum().backward()
    expected.float().square().sum().backward()
    assert max(_grad_errors(model, ref).values()) < 1e-3


class _SpineLayerNorm(torch.nn.Module):
    """Reversible transformer blocks joined by LayerNorm and a constant scale on the spine."""

    def __init__(self) -> None:
        super().__init__()
        from memopt.testing.reversible_zoo import RevTransformerBlock

        self.embed = torch.nn.Linear(8, 64)
        self.blocks = torch.nn.ModuleList(RevTransformerBlock(32, 4, 0.0) for _ in range(3))
        self.norms = torch.nn.ModuleList(torch.nn.LayerNorm(64) for _ in range(3))
        self.head = torch.nn.Linear(64, 10)

    def forward(self, x):
        x = self.embed(x)
        for block, norm in zip(self.blocks, self.norms):
            a, b = x.chunk(2, dim=-1)
            a, b = block(a, b)
            x = norm(torch.cat([a, b], dim=-1)) * 0.5
        return self.head(x.mean(1))


@pytest.mark.slow
def test_aggressive_mode_inverts_layer_norm_and_constant_scale():
    torch.manual_seed(0)
    model, x = _SpineLayerNorm().train(), torch.randn(4, 10, 8)
    counts = {}
    for mode in ("safe", "aggressive"):
        ref = copy.deepcopy(model)
        om = memopt.optimize(model, config=Config(reversible=ReversibleConfig(mode=mode), **ONLY_REVERSIBLE))
        model.zero_grad()
        assert torch.equal(_train_step(om, x), _train_step(ref, x))
        assert max(_grad_errors(model, ref).values()) < 1e-5
        counts[mode] = (len(_reversible_calls(om)), om.plan.estimated_saved_bytes)
    assert counts["safe"][0] == 3 and counts["aggressive"][0] == 1  # one segment across the norms
    assert counts["aggressive"][1] < counts["safe"][1]
