"""The scale identity (memopt/stash/identity.py): BN weight gradients of chains that feed a depthwise conv
into a training-mode BN, solved from that BN's weight gradient; and K+1 bits for chains without an activation."""
import contextlib
import copy

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import memopt
from memopt.runtime import native
from memopt.stash.ops import ChainSpec, bn_act_stash
from memopt.stash.identity import link_term
from memopt.testing.zoo import build

ACTS = {"relu": nn.ReLU, "relu6": nn.ReLU6, "leaky_relu": lambda: nn.LeakyReLU(0.1)}


class DepthwiseBlock(nn.Module):
    """conv -> BN A -> act -> depthwise conv (channel multiplier ``mult``) -> BN B -> ReLU6 -> 1x1 conv."""

    def __init__(self, act="relu6", channels=6, mult=1, dw_groups=None):
        super().__init__()
        self.conv = nn.Conv2d(3, channels, 3, padding=1, bias=False)
        self.bn_a, self.act = nn.BatchNorm2d(channels), ACTS[act]() if act in ACTS else None  # None: BN -> conv
        self.dw = nn.Conv2d(channels, channels * mult, 3, padding=1, groups=dw_groups or channels, bias=False)
        self.bn_b, self.act_b = nn.BatchNorm2d(channels * mult), nn.ReLU6()
        self.proj = nn.Conv2d(channels * mult, 4, 1)

    def forward(self, x):
        y = self.bn_a(self.conv(x))
        return self.proj(self.act_b(self.bn_b(self.dw(y if self.act is None else self.act(y)))))


def _linked(om) -> int:
    """Chains of the rewritten graph whose weight gradient the scale identity solves (ChainSpec.link_groups)."""
    return sum(1 for n in om.graph_module.graph.nodes if n.target is bn_act_stash and ChainSpec.of(n).link_groups > 0)


def _block(act="relu6", beta=0.0, gamma=1.0, seed=0, tails=False, **kw):
    """The block and an input; ``tails``: heavy-tailed (a log-normal scale per element), so A's BN output
    reaches far past the code's window."""
    torch.manual_seed(seed)
    model = DepthwiseBlock(act, **kw).train()
    with torch.no_grad():
        model.bn_a.bias.fill_(beta)
        model.bn_a.weight.uniform_(0.5 * gamma, 1.5 * gamma)
    x = torch.randn(4, 3, 16, 16)
    return model, x * torch.randn(4, 3, 16, 16).mul(1.5).exp() if tails else x


def _grads(model, x, config, seed=1):
    """(forward output, {parameter: gradient}, exact output, {parameter: exact gradient})."""
    reference = copy.deepcopy(model)
    om = memopt.optimize(model, example_inputs=x, config=config)
    out, ref = om(x), reference(x)
    g = torch.randn(out.shape, generator=torch.Generator().manual_seed(seed))
    out.backward(g)
    ref.backward(g)
    return om, out, ref, {n: p.grad for n, p in model.named_parameters()}, \
        {n: p.grad for n, p in reference.named_parameters()}


def _config(**kw):
    # the chains by themselves: the fidelity gate (tests/fidelity) would raise the bits these tests measure, and the
    # generic stash / coded ops would code the convs' inputs and the BatchNorms left exact, and the peak-first step
    # would recompute blocks from codes (with the chains inside them)
    kw = {"generic": False, "coded_ops": (), **kw}
    return memopt.Config(stash=memopt.StashConfig(bits=4, min_per_channel=1, **kw), fewbit=None, fidelity=None,
                         recompute=memopt.RecomputeConfig(peak_first_bits=None))


def _cos(a, b):
    return F.cosine_similarity(a.flatten(), b.flatten(), 0).item()


@pytest.mark.parametrize("act, beta, mult", [("relu6", 0.0, 1), ("relu6", 4.0, 1), ("relu", 0.5, 2),
                                             ("leaky_relu", -0.3, 1), ("identity", 0.2, 1)])
def test_the_identity_holds_for_exact_float64_gradients(act, beta, mult):
    # γ dL/dγ + β dL/dβ = Σ_o γ_o dL/dγ_o eps / (var_o + eps) - 6 Σ_clip dL/dz, per channel of A: the maths the
    # solve relies on, checked on stock autograd in float64 (β = 4 puts many ReLU6 inputs above 6)
    model, x = _block(act, beta, mult=mult)
    model, x = model.double(), x.double()
    seen = {}
    model.bn_a.register_forward_hook(lambda m, i, o: seen.__setitem__("y", o))
    model.bn_a.register_forward_hook(lambda m, i, o: [o.register_hook(lambda g: seen.__setitem__("gy", g))] and None)
    if model.act is not None:
        model.act.register_forward_hook(lambda m, i, o: [o.register_hook(lambda g: seen.__setitem__("gz", g))] and None)
    model.bn_b.register_forward_hook(lambda m, i, o: seen.__setitem__("u", i[0]))
    model(x).backward(torch.randn(4, 4, 16, 16, dtype=torch.float64))
    a, b = model.bn_a, model.bn_b
    invstd = (seen["u"].var((0, 2, 3), unbiased=False) + b.eps).rsqrt()
    rhs = link_term(b.weight, invstd, b.weight.grad, b.eps, a.num_features).double()
    lhs = a.weight * a.weight.grad + a.bias * a.bias.grad
    if act == "relu6" and beta > 0:  # the clip term matters: without it the two sides disagree
        assert ((lhs - rhs).abs() > 0.1 * lhs.abs()).any()
    if act == "relu6":
        rhs = rhs - 6 * (seen["gz"] * (seen["y"] >= 6)).sum((0, 2, 3))
    # float64 throughout; the kernels' eps is float32's 1e-5 (2.5e-8 off), hence not 1e-12
    torch.testing.assert_close(lhs, rhs, rtol=1e-6, atol=1e-9 * lhs.abs().max().item())


@pytest.mark.parametrize("act, beta, mult, tails", [("relu6", 0.0, 1, False), ("relu6", 4.0, 1, False),
                                                    ("relu6", 0.0, 1, True), ("relu", 0.5, 2, False),
                                                    ("leaky_relu", -0.3, 1, False), ("identity", 0.2, 1, False)])
def test_solved_bn_weight_gradient_is_accurate_and_nothing_downstream_changes(act, beta, mult, tails):
    # tails: clipped values lie past the code's window, whose end then is not the data's (no channel skipped)
    model, x = _block(act, beta, mult=mult, tails=tails)
    om, out, ref, ours, exact = _grads(copy.deepcopy(model), x, _config())
    assert torch.equal(out, ref)
    assert _linked(om) == 1
    node = next(n for n in om.plan.nodes if n.name == "bn_a_stash")
    assert "solved by the scale identity from bn_b" in node.reason
    _, _, _, plain, _ = _grads(copy.deepcopy(model), x, _config(scale_identity=False))
    # the rebuilt-x̂ sum is noise against this nearly scale-invariant gradient; the solve inherits B's weight
    # gradient's error (and β times dL/dβ's): measured 0.968-1.0 here (0.716-0.97 without), 0.9979-0.9997 at β = 0
    # with Gaussian inputs, 0.990 with heavy tails (0.49 without)
    solved, summed = _cos(ours["bn_a.weight"], exact["bn_a.weight"]), _cos(plain["bn_a.weight"], exact["bn_a.weight"])
    assert solved > summed and solved > (0.995 if beta == 0 and not tails else 0.96)
    for name in ("dw.weight", "bn_b.weight", "bn_b.bias", "proj.weight", "proj.bias"):
        assert torch.equal(ours[name], plain[name]), name  # computed before A's backward
    # dL/dβ is not solved (the unfused path sums it in another order)
    torch.testing.assert_close(ours["bn_a.bias"], plain["bn_a.bias"], rtol=1e-5, atol=1e-6)
    for name in ours:  # the stash's usual error elsewhere (least measured here: 0.9716, bn_a.bias, LeakyReLU)
        assert name == "bn_a.weight" or _cos(ours[name], exact[name]) > 0.96, name


def test_relu6_channels_whose_clip_the_code_cannot_tell_keep_the_rebuilt_sum():
    # γ so large that y >= 6 and y <= 0 lie within three bins of the code's mask-false side: no solve there
    model, x = _block("relu6", beta=0.0, gamma=40.0)
    _, _, _, ours, _ = _grads(copy.deepcopy(model), x, _config())
    _, _, _, plain, _ = _grads(copy.deepcopy(model), x, _config(scale_identity=False))
    torch.testing.assert_close(ours["bn_a.weight"], plain["bn_a.weight"], rtol=1e-4, atol=1e-6)


def test_no_link_without_a_depthwise_conv_into_a_batchnorm():
    model, x = _block("relu6", dw_groups=3)  # two input channels per group: channels mix
    om, *_ = _grads(model, x, _config())
    assert _linked(om) == 0
    model, x = build("resnet18")
    om = memopt.optimize(model, example_inputs=x, config=memopt.Config(fewbit=None, fidelity=None))
    assert _linked(om) == 0


def test_a_following_batchnorm_left_exact_still_links_and_keeps_stock_gradients():
    model, x = _block("relu6", beta=4.0)
    om, out, ref, ours, exact = _grads(copy.deepcopy(model), x, _config(deny=("bn_b",)))
    assert torch.equal(out, ref)
    assert "bn_exact_link(" in om.graph_module.code
    link = next(n for n in om.plan.nodes if "bn_exact_link" in n.op)
    assert link.technique == "exact" and "scale identity" in link.reason
    for name in ("proj.weight", "proj.bias", "bn_b.weight", "bn_b.bias"):
        assert torch.equal(ours[name], exact[name]), name  # stock's kernels on stock's saved tensors
    assert _cos(ours["bn_a.weight"], exact["bn_a.weight"]) > 0.999  # R from B's exact weight gradient
    real = memopt.measure(om, x)
    assert real.saved_bytes == om.plan.estimated_saved_bytes and real.peak_bytes == om.plan.estimated_peak_bytes


def test_running_statistics_update_once_with_links():
    model, x = _block("relu6")
    reference = copy.deepcopy(model)
    om = memopt.optimize(model, example_inputs=x, config=_config(deny=("bn_b",)))
    for _ in range(2):
        om(x).sum().backward()
        reference(x).sum().backward()
    for (n, b), c in zip(model.named_buffers(), reference.buffers()):
        assert torch.equal(b, c), n


@pytest.mark.slow
def test_mobilenet_v2_links_every_expand_chain_and_codes_projections_with_one_more_bit():
    pytest.importorskip("torchvision")
    model, x = build("mobilenet_v2")
    om = memopt.optimize(model, example_inputs=x, config=memopt.Config(fewbit=None, fidelity=None))
    chains = [n for n in om.plan.nodes if n.op == "bn_act_stash"]
    linked = [n for n in chains if "scale identity" in n.reason]
    assert len(linked) == _linked(om) > 0
    identity = [n for n in chains if "+ identity:" in n.reason]
    assert identity and all(n.bits == 5 for n in identity)
    assert all(n.bits == 4 for n in chains if n not in identity)
    om = memopt.optimize(build("mobilenet_v2")[0], example_inputs=x,
                         config=memopt.Config(stash=memopt.StashConfig(identity_extra_bit=False), fewbit=None,
                                              fidelity=None))
    assert all(n.bits == 4 for n in om.plan.nodes if n.op == "bn_act_stash")


@pytest.mark.parametrize("field", ["scale_identity", "identity_extra_bit"])
def test_config_flags_must_be_bools(field):
    with pytest.raises(ValueError, match=f"StashConfig.{field} must be True or False, got 1"):
        memopt.StashConfig(**{field: 1})


@pytest.mark.parametrize("act, beta", [("relu6", 0.0), ("relu6", 4.0), ("relu6", -1.0), ("leaky_relu", -0.3)])
def test_fused_and_plain_paths_solve_the_same(act, beta):
    # the fused backward sums the clipped elements and solves between its two passes; the plain path in PyTorch
    model, x = _block(act, beta)
    results = []
    for use in (True, False):
        with contextlib.nullcontext() if use else native.disabled():
            _, out, _, ours, _ = _grads(copy.deepcopy(model), x, _config())
        results.append((out, ours))
    (out, grads), (out_p, grads_p) = results
    assert torch.equal(out, out_p)
    for name in grads:
        torch.testing.assert_close(grads[name], grads_p[name], rtol=1e-4, atol=1e-5 * grads_p[name].abs().max().item())


@pytest.mark.slow
def test_planner_levels_of_chains_without_an_activation_round_trip(tmp_path):
    # the planner's options carry the asked bits (the level); the codes of an identity chain use one more, and a
    # saved plan re-applies to the same graph
    pytest.importorskip("torchvision")
    model, x = build("mobilenet_v2")
    # the planner's own choice at the least peak (the fidelity gate would need recomputation it cannot fit here)
    config = memopt.Config(fewbit=None, fidelity=None)
    full = memopt.optimize(copy.deepcopy(model), example_inputs=x, config=config).plan
    budget = full.estimated_peak_bytes / 2 ** 20  # tight enough that the small projection chains are rewritten
    om = memopt.optimize(model, budget, example_inputs=x, config=config)
    levels = {u["chosen"]["unit"]: u["chosen"]["bits"] for u in om.plan.units if u["chosen"]["technique"] == "stash"}
    identity = [n for n in om.plan.nodes if n.op == "bn_act_stash" and "+ identity:" in n.reason]
    assert identity
    for node in identity:
        level = levels[node.name[:-len("_stash")]]
        assert level in memopt.StashConfig().plan_bits and node.bits == min(level + 1, 8)
    path = tmp_path / "plan.json"
    om.plan.save(path)
    again = memopt.optimize(model, example_inputs=x, plan=path)
    assert again.graph_module.code == om.graph_module.code
    assert again.plan.estimated_peak_bytes == om.plan.estimated_peak_bytes
