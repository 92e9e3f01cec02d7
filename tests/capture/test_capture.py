"""Capture and the OptimizedModule contract: same outputs, same state, same parameters."""
import copy
import io

import pytest
import torch
from torch import nn

import memopt
from conftest import call, leaves, zoo_params
from memopt.testing.zoo import ZOO, build


@pytest.mark.parametrize("name", zoo_params())
def test_forward_is_bit_identical_and_capture_path(name):
    model, inputs = build(name)
    om = memopt.optimize(model, example_inputs=inputs)
    assert om.plan.capture == ZOO[name].capture
    torch.manual_seed(123)  # dropout draws the same mask when the same ops run in the same order
    ours = call(om, inputs)
    torch.manual_seed(123)
    theirs = call(model, inputs)
    assert type(ours) is type(theirs)
    for a, b in zip(leaves(ours), leaves(theirs), strict=True):
        assert torch.equal(a, b)


@pytest.mark.parametrize("name", zoo_params(["cnn", "vit", "shape_branch", "multi_io"]))
def test_exact_config_gradients_and_buffers_match_stock_training(name):
    model, inputs = build(name)
    twin = copy.deepcopy(model)
    # exact config: every rewrite off, so gradients must be bit-identical too
    om = memopt.optimize(model, example_inputs=inputs, config=memopt.Config.exact())
    torch.manual_seed(7)
    sum(t.sum() for t in leaves(call(om, inputs))).backward()
    torch.manual_seed(7)
    sum(t.sum() for t in leaves(call(twin, inputs))).backward()
    for (n, p), q in zip(model.named_parameters(), twin.parameters(), strict=True):
        assert (p.grad is None and q.grad is None) or torch.equal(p.grad, q.grad), n
    for (n, b), c in zip(model.named_buffers(), twin.buffers(), strict=True):
        assert torch.equal(b, c), n  # BN running stats updated exactly once


@pytest.mark.slow
def test_shares_parameters_buffers_and_state_dict_keys():
    model, inputs = build("tiny_resnet")
    om = memopt.optimize(model, example_inputs=inputs)
    assert list(om.state_dict()) == list(model.state_dict())
    assert all(p is q for p, q in zip(om.parameters(), model.parameters(), strict=True))
    assert all(b is c for b, c in zip(om.buffers(), model.buffers(), strict=True))
    # an optimizer built on the original parameters trains the optimized module
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    before = model.fc.weight.detach().clone()
    om(inputs).sum().backward()
    opt.step()
    assert not torch.equal(before, model.fc.weight)
    # checkpoints load both ways
    om.load_state_dict(model.state_dict())
    model.load_state_dict(om.state_dict())


def test_train_eval_deepcopy_and_torch_save():
    model, inputs = build("vit")
    om = memopt.optimize(model, example_inputs=inputs)
    om.eval()
    assert not model.training and not model.blocks[0].drop.training
    assert torch.equal(om(inputs), model(inputs))  # eval runs the original model untouched
    om.train()
    assert model.training
    clone = copy.deepcopy(om)
    assert all(p is not q and torch.equal(p, q) for p, q in zip(clone.parameters(), om.parameters()))
    torch.manual_seed(0)
    a = clone(inputs)
    torch.manual_seed(0)
    b = om(inputs)
    assert torch.equal(a, b)
    buffer = io.BytesIO()
    torch.save(om, buffer)
    buffer.seek(0)
    loaded = torch.load(buffer, weights_only=False)
    torch.manual_seed(0)
    assert torch.equal(loaded(inputs), b)
    strip = lambda p: {k: v for k, v in p.to_dict().items() if k != "build"}  # noqa: E731 - its own build's timings
    assert strip(loaded.plan) == strip(om.plan)


def test_lazy_capture_and_recapture_on_new_shapes(caplog):
    model, inputs = build("cnn")
    om = memopt.optimize(model)
    with pytest.raises(memopt.MemoptError, match="has not been captured yet"):
        om.plan
    om(inputs)
    first = om.plan
    assert "float32[4,3,32,32]" in first.input_signature[0]
    with caplog.at_level("WARNING", logger="memopt"):
        om(torch.randn(2, 3, 32, 32))
    assert "new input signature" in caplog.text
    assert om.plan.baseline_saved_bytes < first.baseline_saved_bytes
    assert om.original_module is model


def test_untraceable_model_raises_trace_error_naming_the_model_and_construct():
    class DataDependent(nn.Module):
        def __init__(self):
            super().__init__()
            self.w = nn.Parameter(torch.randn(4, 4))  # no submodule to capture instead

        def forward(self, x):
            if x.sum() > 0:  # a branch on a tensor value: neither fx nor export can capture it
                return x @ self.w
            return x

    model = DataDependent()
    state = copy.deepcopy(model.state_dict())
    with pytest.raises(memopt.TraceError) as info:
        memopt.optimize(model, example_inputs=torch.randn(2, 4))
    message = str(info.value)
    assert "DataDependent" in message
    assert "symbolic_trace failed" in message and "torch.export" in message
    assert "The construct: " in message and "test_capture.py" in message and "if x.sum() > 0:" in message
    assert "leaf" in message  # says what to try
    assert model.training and all(torch.equal(v, state[k]) for k, v in model.state_dict().items())


def test_untraceable_parent_with_traceable_children_is_captured_per_submodule():
    class DataDependent(nn.Module):
        def __init__(self):
            super().__init__()
            self.fc = nn.Linear(4, 4)

        def forward(self, x):
            if x.sum() > 0:
                return self.fc(x)
            return x

    model = DataDependent()
    x = torch.ones(2, 4)
    om = memopt.optimize(model, example_inputs=x)
    assert om.plan.capture == "per-submodule" and list(om.graph_modules) == ["fc"]
    assert torch.equal(om(x), model(x))


def test_torch_save_of_an_export_captured_module_keeps_state_shared():
    model, inputs = build("shape_branch")
    om = memopt.optimize(model, example_inputs=inputs)
    buffer = io.BytesIO()
    torch.save(om, buffer)
    buffer.seek(0)
    loaded = torch.load(buffer, weights_only=False)
    assert torch.equal(loaded(inputs), om(inputs))
    with torch.no_grad():
        loaded.out.bias.add_(1.0)  # the loaded graph must read the loaded module's parameters
    assert not torch.equal(loaded(inputs), om(inputs))
    assert torch.equal(loaded(inputs), loaded.original_module(inputs))
