"""The bad-input catalogue (issue 9): every refusal names the culprit, the bad value and the fix, and
leaves the user's model as it was; what memopt cannot rewrite stays exact and says why; nothing goes
silently wrong. Budgets (``budget_mb``, ``BudgetError``) are covered by the planner's own tests;
tests/api/test_api_errors.py has the basic argument checks this file extends."""
import copy
import io

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import memopt
from memopt.testing.zoo import build


def _state(model):
    return {k: v.clone() for k, v in model.state_dict().items()}


def _untouched(model, state, training=True):
    assert model.training == training
    assert all(torch.equal(v, state[k]) for k, v in model.state_dict().items())
    assert all(p.grad is None for p in model.parameters())


@pytest.mark.parametrize("inputs, fragment", [
    (torch.randint(0, 5, (4, 3, 32, 32)), r"features_0_0 .* \(inputs x: int64\[4,3,32,32\]\).*x.float\(\)"),
    (torch.randn(4, 3, 32, 32, dtype=torch.complex64), r"features_0_0 .* \(inputs x: complex64\[4,3,32,32\]\)"),
    (["not a tensor"], r"features_0_0 .* \(inputs x: str 'not a tensor'\): TypeError"),
])
def test_inputs_the_model_cannot_train_on_name_the_node_and_the_fix(inputs, fragment):
    model, _ = build("cnn")
    state = _state(model)
    with pytest.raises(memopt.MemoptError, match=fragment) as info:
        memopt.optimize(model, example_inputs=inputs)
    assert "Pass example inputs of the dtype, shape and device that training uses" in str(info.value)
    _untouched(model, state)


def test_not_a_module_and_other_example_input_types():
    with pytest.raises(TypeError, match=r"model must be a torch.nn.Module, got Linear.*|model must be a torch.nn.Module, "
                                        r"got type"):
        memopt.optimize(nn.Linear)  # the class, not an instance
    model, x = build("mlp")
    with pytest.raises(TypeError, match=r"example_inputs must be a tensor, a tuple/list .* got ndarray"):
        memopt.optimize(model, example_inputs=x.numpy())
    with pytest.raises(TypeError, match=r"do not match MultiIO.forward\(.*\): missing a required argument: 'y' "
                                        r"\(got 0 positional and \['x', 'z'\] keyword inputs\)"):
        memopt.optimize(build("multi_io")[0], example_inputs={"x": torch.randn(4, 16), "z": torch.randn(4, 8)})


def test_a_model_that_cannot_be_captured_names_the_construct_and_stays_untouched():
    class ItemBranch(nn.Module):
        def __init__(self):
            super().__init__()
            self.fc, self.bn = nn.Linear(4, 4), nn.BatchNorm1d(4)

        def forward(self, x):
            h = self.bn(self.fc(x))
            steps = int(h.abs().max().item() * 3)  # a Python int read from a tensor value
            for _ in range(steps):
                h = torch.relu(h)
            return h

    model = ItemBranch()
    state = _state(model)
    # fc and bn can be captured: memopt falls back to them (memopt/builder/per_submodule.py) and says why
    om = memopt.optimize(model, example_inputs=torch.randn(8, 4))
    whole = om.plan.submodules[0]
    assert om.plan.capture == "per-submodule" and whole["class"] == "ItemBranch" and not whole["captured"]
    assert "symbolic_trace: TypeError" in whole["why"] and "torch.export: GuardOnDataDependentSymNode" in whole["why"]
    assert "steps = int(h.abs().max().item() * 3)" in whole["why"]  # names the construct
    _untouched(model, state)  # the failed export ran on fake tensors; the real forwards restored the state


@pytest.mark.parametrize("make, message", [
    (lambda: memopt.StashConfig(bits=0), "StashConfig.bits must be an int in 1..8, got 0"),
    (lambda: memopt.StashConfig(bits=9), "StashConfig.bits must be an int in 1..8, got 9"),
    (lambda: memopt.FewBitConfig(bits=0), "FewBitConfig.bits must be an int in 1..8, got 0"),
    (lambda: memopt.FewBitConfig(bits=9), "FewBitConfig.bits must be an int in 1..8, got 9"),
    (lambda: memopt.FewBitConfig(bits=True), "FewBitConfig.bits must be an int in 1..8, got True"),
    (lambda: memopt.FewBitConfig(bits=2.0), "FewBitConfig.bits must be an int in 1..8, got 2.0"),
    (lambda: memopt.FewBitConfig(weight="laplace"), "FewBitConfig.weight='laplace' is not known; use one of"),
    (lambda: memopt.FewBitConfig(domain=(1.0, -1.0)), "FewBitConfig.domain must be finite (low, high)"),
    (lambda: memopt.Config.from_dict({"revnet": {}}), "unknown Config fields ['revnet']; known fields are"),
    (lambda: memopt.Config(reversible=memopt.StashConfig()), "Config.reversible must be a memopt.ReversibleConfig or None"),
    (lambda: memopt.Config(stash=memopt.FewBitConfig()), "Config.stash must be a memopt.StashConfig or None"),
])
def test_invalid_config_values_are_refused_with_the_field_and_value(make, message):
    with pytest.raises((ValueError, TypeError)) as info:
        make()
    assert message in str(info.value)


def test_unknown_technique_keyword_is_refused():
    with pytest.raises(TypeError, match="unexpected keyword argument 'revnet'"):
        memopt.Config(revnet=memopt.ReversibleConfig())


class _Mixed(nn.Module):
    """float32 -> float64 -> float32, with an integer ReLU on the side: only float32 nodes are rewritten."""

    def __init__(self):
        super().__init__()
        self.a, self.b, self.c = nn.Linear(8, 8), nn.Linear(8, 8).double(), nn.Linear(8, 4)

    def forward(self, x, idx):
        h = F.gelu(self.a(x))
        h = F.silu(self.b(h.double()))
        counts = torch.relu(idx - 2)  # integer activation: no gradient, nothing to rewrite
        return self.c(torch.relu(h).float()) + counts.sum()


def test_unsupported_dtypes_in_the_graph_stay_exact_and_say_why():
    torch.manual_seed(0)
    model, inputs = _Mixed(), (torch.randn(4, 8), torch.arange(5))
    reference = copy.deepcopy(model)
    om = memopt.optimize(model, example_inputs=inputs)
    nodes = {n.name: n for n in om.plan.nodes}
    assert nodes["gelu_fewbit"].technique == "fewbit"
    for name, dtype in (("silu", "float64"), ("relu_1", "float64"), ("relu", "int64")):
        assert nodes[name].technique == "exact" and f"dtype {dtype} is not supported" in nodes[name].reason, name
    assert "silu" in om.report() and "dtype float64 is not supported" in om.report()  # the int ReLU keeps nothing
    real = memopt.measure(om, inputs)
    assert real.saved_bytes == om.plan.estimated_saved_bytes
    out, ref = om(*inputs), reference(*inputs)
    assert torch.equal(out, ref)
    out.sum().backward()
    ref.sum().backward()
    assert torch.equal(model.b.weight.grad, reference.b.weight.grad)  # float64 part: exact
    assert F.cosine_similarity(model.a.weight.grad.flatten(), reference.a.weight.grad.flatten(), 0) > 0.99


@pytest.mark.parametrize("name, config, node", [
    # backward reaches the head first: its input is coded by the generic stash
    ("cnn", memopt.Config(fewbit=None), r"stash node %head : .*call_module\[target=head\]"),
    ("vit", memopt.Config(stash=None), r"few-bit node %blocks_\d_act : .*call_module\[target=blocks.\d.act\]"),
])
def test_double_backward_through_a_rewritten_node_is_a_clear_error(name, config, node):
    model, x = build(name)
    om = memopt.optimize(model, example_inputs=x, config=config)
    loss = om(x).sum()
    with pytest.raises(memopt.MemoptError, match=f"double backward .* through the {node}") as info:
        grads = torch.autograd.grad(loss, [p for p in model.parameters()], create_graph=True, allow_unused=True)
        sum(g.square().sum() for g in grads if g is not None).backward()
    assert "deny=" in str(info.value)  # the node (node.format_node()) and the fix
    # the exact config supports it, as stock does
    om = memopt.optimize(model, example_inputs=x, config=memopt.Config.exact())
    grads = torch.autograd.grad(om(x).sum(), list(model.parameters()), create_graph=True, allow_unused=True)
    sum(g.square().sum() for g in grads if g is not None).backward()


def test_torch_func_transforms_run_the_original_model():
    # memopt's autograd Functions have no functorch rules: under a transform the OptimizedModule runs the
    # original model (exact, no memory saved), like eval and no_grad forwards.
    from torch.func import functional_call, grad, vmap

    model, x = build("mlp")
    om = memopt.optimize(model, example_inputs=x)
    params = {k: v.detach() for k, v in om.named_parameters()}

    def loss(p, net):
        return functional_call(net, p, (x,)).square().sum()

    ours, stock = grad(loss)(params, om), grad(loss)(params, model)
    assert ours.keys() == stock.keys() and all(torch.equal(ours[k], stock[k]) for k in ours)
    assert torch.equal(vmap(om)(x.unsqueeze(1)), vmap(model)(x.unsqueeze(1)))
    # functional_call without a transform, with detached parameters: nothing to train, the model itself runs
    assert torch.equal(functional_call(om, params, (x,)), model(x))


def test_hooks_fire_as_in_stock_and_hooked_modules_stay_exact(caplog):
    # A module with hooks (its own or global module hooks) is captured as one call and never rewritten:
    # a rewrite would skip its hooks, and a forward hook may change the output. Hooks registered after
    # optimize are picked up at the next training forward (re-capture). Capture and planning run the
    # model on fake tensors: hooks fire there too (on FakeTensors).
    model, x = build("cnn")
    om = memopt.optimize(model, example_inputs=x)
    assert om.graph_module.code.count("bn_act_stash(") == 2
    fired = []
    for name, module in model.named_modules():
        if name.count(".") == 2 or name in ("features.1", "features.3", "head"):  # the leaves
            module.register_forward_hook(lambda m, i, o, name=name: fired.append(("forward", name)))
            module.register_full_backward_hook(lambda m, gi, go, name=name: fired.append(("backward", name)))
    model.features[0][2].register_forward_hook(lambda m, i, o: o * 2)  # changes the output
    with caplog.at_level("WARNING", logger="memopt"):
        om(x)
    assert "or a hook registered" in caplog.text
    # planning runs the graph on fake tensors, so hooks fire there too; compare the training steps only
    fired.clear()
    torch.manual_seed(0)
    out = om(x)
    out.sum().backward()
    ours, fired[:] = sorted(fired), []
    torch.manual_seed(0)
    ref = model(x)
    ref.sum().backward()
    assert torch.equal(out, ref)
    assert ours == sorted(fired)  # every hook fired, forward and backward, as in stock
    reasons = {n.name: n.reason for n in om.plan.nodes}
    assert reasons["features_0_1"] == "stash: the BatchNorm has hooks, which a rewrite would skip"
    assert reasons["features_0_2"] == "few-bit: its module has hooks, which a rewrite would skip"


def test_hooks_on_a_container_fire_and_keep_it_whole():
    model, x = build("cnn")
    seen = []
    model.features[2].register_forward_hook(lambda m, i, o: seen.append(o.shape))  # an nn.Sequential
    om = memopt.optimize(model, example_inputs=x)
    assert "features_2" in {n.name for n in om.plan.nodes}  # one call: fx would trace through it
    seen.clear()
    om(x)
    assert seen == [torch.Size([4, 32, 16, 16])]
    assert om.graph_module.code.count("bn_act_stash(") == 1  # the chain inside the hooked container stays exact


@pytest.mark.parametrize("name, bad", [("cnn", float("nan")), ("cnn", float("inf")), ("vit", float("nan")),
                                       ("tiny_resnet", float("-inf"))])
def test_non_finite_inputs_give_non_finite_gradients_where_stock_does(name, bad):
    model, x = build(name)
    reference = copy.deepcopy(model)
    om = memopt.optimize(model, example_inputs=x)
    x = x.clone()
    x[0, 0, 0, 0] = bad
    torch.manual_seed(0)
    out = om(x)
    torch.manual_seed(0)
    ref = reference(x)
    assert torch.equal(out.isfinite(), ref.isfinite())
    out.sum().backward()
    ref.sum().backward()
    for (n, p), q in zip(model.named_parameters(), reference.parameters()):
        assert torch.isfinite(p.grad).all() == torch.isfinite(q.grad).all(), n  # GradScaler skips the same steps


def test_a_nan_activation_inside_a_stash_chain_is_never_coded_into_a_finite_gradient():
    model, x = build("tiny_resnet")
    reference = copy.deepcopy(model)
    om = memopt.optimize(model, example_inputs=x, config=memopt.Config(fewbit=None))
    with torch.no_grad():
        for m in (model, reference):
            m.layers[3].conv1.weight[0, 0, 0, 0] = float("nan")  # NaN born mid-network, in one channel
    out, ref = om(x), reference(x)
    assert torch.equal(out.isnan(), ref.isnan())
    out.sum().backward()
    ref.sum().backward()
    for (n, p), q in zip(model.named_parameters(), reference.parameters()):
        assert torch.equal(p.grad.isfinite(), q.grad.isfinite()), n


def test_replacing_or_adding_a_module_after_optimizing_is_picked_up(caplog):
    model, x = build("mlp")
    om = memopt.optimize(model, example_inputs=x)
    model.fc4 = nn.Linear(64, 3)  # replaced after optimizing: the old graph would still call the old one
    with caplog.at_level("WARNING", logger="memopt"):
        out = om(x)
    assert "MLP changed since it was captured" in caplog.text
    assert out.shape == (8, 3) and torch.equal(out, model(x))
    assert om.fc4 is model.fc4 and any(p is model.fc4.weight for p in om.parameters())
    out.sum().backward()
    assert model.fc4.weight.grad is not None
    model.extra = nn.Linear(2, 2)  # added: part of the optimized module's state too
    assert "extra.weight" in om.state_dict() and any(p is model.extra.weight for p in om.parameters())
    model.fc3.weight = nn.Parameter(torch.zeros(64, 64))  # a replaced parameter is the one trained
    om(x).sum().backward()
    assert model.fc3.weight.grad is not None


def test_freezing_a_parameter_after_optimizing_is_picked_up():
    model, x = build("cnn")
    om = memopt.optimize(model, example_inputs=x)
    before = om.plan.estimated_saved_bytes
    for p in model.features.parameters():
        p.requires_grad_(False)
    om(x).sum().backward()
    assert all(p.grad is None for p in model.features.parameters())
    assert model.head.weight.grad is not None
    assert om.plan.estimated_saved_bytes < before  # re-planned: the frozen features keep nothing now
    real = memopt.measure(om, x)
    assert real.saved_bytes == om.plan.estimated_saved_bytes


def test_state_dict_from_the_original_loads_into_the_optimized_module_and_back():
    model, x = build("tiny_resnet")
    om = memopt.optimize(model, example_inputs=x)
    donor, _ = build("tiny_resnet")
    with torch.no_grad():
        for p in donor.parameters():
            p.add_(1.0)
    buffer = io.BytesIO()
    torch.save(donor.state_dict(), buffer)
    buffer.seek(0)
    om.load_state_dict(torch.load(buffer))
    assert all(torch.equal(a, b) for a, b in zip(model.state_dict().values(), donor.state_dict().values()))
    assert torch.equal(om(x), donor(x))  # the optimized graph runs the loaded weights
    fresh, _ = build("tiny_resnet")
    fresh.load_state_dict(om.state_dict())
    assert list(om.state_dict()) == list(fresh.state_dict())
    assert all(torch.equal(a, b) for a, b in zip(fresh.state_dict().values(), donor.state_dict().values()))
    with pytest.raises(RuntimeError, match="Missing key"):
        om.load_state_dict({"fc.weight": donor.fc.weight})


def test_a_misspelled_node_name_in_allow_deny_or_node_bits_is_named(caplog):
    import logging

    model, x = build("tiny_resnet")
    config = memopt.Config(stash=memopt.StashConfig(deny=("layers_0_bn_1",), node_bits={"layers_9_bn1": 8}),
                           fewbit=memopt.FewBitConfig(allow=("stem_2",)), fidelity=None)
    with caplog.at_level(logging.WARNING, logger="memopt"):
        memopt.optimize(model, example_inputs=x, config=config)
    assert "StashConfig.deny names 'layers_0_bn_1', which is no node of the captured graph; did you mean " \
           "'layers_0_bn1'" in caplog.text
    assert "StashConfig.node_bits names 'layers_9_bn1'" in caplog.text
    assert "FewBitConfig.allow names 'stem_2'" not in caplog.text  # a real node


def test_float64_inputs_for_a_float32_model_are_named():
    model, x = build("mlp")
    with pytest.raises(memopt.MemoptError, match=r"Example input \[0\]\[0\] is float64 but the parameters are "
                                                 r"float32: pass it as x.to\(torch.float32\)"):
        memopt.optimize(model, example_inputs=x.double())
