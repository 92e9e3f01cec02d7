"""``soundness.training_grads``: K losses' gradients from one forward and K backwards (retain_graph) are the bits of K
separate training steps, for every kind of memopt op (the fidelity gate relies on it to check a plan on eight
losses at about the cost of three steps)."""
import copy

import pytest
import torch
from torch import nn

import memopt
from memopt.capture.soundness import paired_grads, training_grads, training_step
from memopt.fidelity.gate import OwnDirection, RandomProjection
from memopt.testing.reversible_zoo import rev_transformer, revnet
from memopt.testing.zoo import build

RNG = torch.Generator().manual_seed(5).get_state()


def _losses():  # a projection draws its weights at its first output: fresh ones for each model
    return [RandomProjection(0), OwnDirection(), RandomProjection(2), RandomProjection(3)]


def _optimized(name: str):
    """(the user's model, its rewritten stand-in, the inputs) for one kind of memopt op."""
    if name == "revnet":
        model, x = revnet((2, 2))
        config = memopt.Config(stash=None, fewbit=None, fidelity=None)
    elif name == "rev_transformer_dropout":
        model, x = rev_transformer(2, dropout=0.1)
        config = memopt.Config(stash=None, fewbit=None, fidelity=None)
    elif name.startswith("recompute"):
        model, x = build("vit")
        for m in model.modules():
            if isinstance(m, nn.Dropout):
                m.p = 0.3  # replayed in backward: every backward must replay the same draws
        config = memopt.Config(recompute=memopt.RecomputeConfig(segments=None, bits=8 if "codes" in name else None),
                               stash=None, fewbit=None, fidelity=None)
    else:  # the default techniques: stash chains and codes, few-bit, 8-bit codes of the rest
        model, x = build({"default_cnn": "tiny_resnet", "default_vit": "vit", "default_mobilenet": "mobilenet_v2"}[
            name])
        config = memopt.Config(fidelity=None)
    model.train()
    om = memopt.optimize(model, example_inputs=x, config=config)
    return model, om, x


@pytest.mark.parametrize("name", ["default_cnn", "default_vit", "recompute", "recompute_codes", "revnet",
                                  "rev_transformer_dropout", "default_mobilenet", "default_cnn_bf16"])
def test_one_forward_and_k_backwards_give_the_bits_of_k_steps(name):
    if name == "default_mobilenet":
        pytest.importorskip("torchvision")
    with torch.autocast("cpu", torch.bfloat16, enabled=name.endswith("_bf16")):
        _check(*_optimized(name.removesuffix("_bf16")), name)


def _check(model, om, x, name):
    args, kwargs = (x,) if isinstance(x, torch.Tensor) else tuple(x), {}
    before, losses = copy.deepcopy(model.state_dict()), _losses()
    shared = training_grads(om, model, args, kwargs, RNG, losses)
    steps = [training_step(om, model, args, kwargs, RNG, loss).grads for loss in losses]
    assert len(shared) == len(steps) == len(losses)
    names = [n for n, _ in model.named_parameters()]
    for index, (a, b) in enumerate(zip(shared, steps)):
        for pname, g, h in zip(names, a, b):
            assert (g is None) == (h is None), (index, pname)
            assert g is None or torch.equal(g, h), f"{name}, loss {index}: {pname} differs"
    after = model.state_dict()
    assert all(torch.equal(before[k], after[k]) for k in before), "the model's state moved"
    assert all(p.grad is None for p in model.parameters())


def test_stop_ends_the_backwards_at_the_first_true():
    model, om, x = _optimized("default_cnn")
    seen, losses = [], _losses()
    found = training_grads(om, model, (x,), {}, RNG, losses, stop=lambda grads: seen.append(1) or len(seen) == 2)
    assert len(found) == 2 == len(seen)
    assert all(torch.equal(g, h) for g, h in zip(found[1], training_step(om, model, (x,), {}, RNG, losses[1]).grads)
               if g is not None)


@pytest.mark.parametrize("name", ["default_cnn", "recompute_codes", "rev_transformer_dropout"])
def test_paired_grads_are_each_sides_training_grads(name):
    """The eager model and its rewritten stand-in side by side (the gate's confirmations): each loss's two sets of
    gradients are the bits ``training_grads`` gives each alone, BatchNorm statistics and dropout draws included, and
    the model's state is left as it was."""
    model, om, x = _optimized(name)
    args = (x,) if isinstance(x, torch.Tensor) else tuple(x)
    before, losses = copy.deepcopy(model.state_dict()), _losses()
    eager, rewritten = training_grads(model, model, args, {}, RNG, losses), training_grads(om, model, args, {}, RNG,
                                                                                            losses)
    pairs = []
    assert paired_grads(model, om, model, args, {}, RNG, losses,
                        lambda a, b: pairs.append((a, b)) or False) == (4, False)
    assert len(pairs) == len(losses)
    for index, (a, b) in enumerate(pairs):
        for g, h in ((a, eager[index]), (b, rewritten[index])):
            assert all((u is None) == (v is None) and (u is None or torch.equal(u, v)) for u, v in zip(g, h)), index
    stopped = []
    assert paired_grads(model, om, model, args, {}, RNG, losses,
                        lambda a, b: stopped.append(1) or len(stopped) == 2) == (2, False)
    after = model.state_dict()
    assert all(torch.equal(before[k], after[k]) for k in before), "the model's state moved"
    assert all(p.grad is None for p in model.parameters())


def test_paired_grads_stop_where_one_side_changes_what_the_other_saved():
    """A RevNet whose plan keeps its couplings exact (a tolerance no rebuild meets) updates BatchNorm buffers the
    eager graph saved: autograd refuses the eager side's second backward, and ``paired_grads`` says so after the
    losses it did measure (the gate measures the rest apart) instead of raising."""
    from memopt.testing.reversible_zoo import revnet

    model, x = revnet((4,), batch=2, size=8)
    config = memopt.Config(reversible=memopt.ReversibleConfig(tolerance=1e-12), stash=None, fewbit=None,
                           fidelity=None)
    om = memopt.optimize(model, config=config, example_inputs=x)
    pairs, losses = [], _losses()
    assert paired_grads(model, om, model, (x,), {}, RNG, losses, lambda a, b: pairs.append((a, b)) or False) == \
        (1, True)
    eager, rewritten = (training_grads(fn, model, (x,), {}, RNG, losses[:1])[0] for fn in (model, om))
    assert all(torch.equal(g, h) for g, h in zip(pairs[0][0], eager) if g is not None)
    assert all(torch.equal(g, h) for g, h in zip(pairs[0][1], rewritten) if g is not None)
    assert all(p.grad is None for p in model.parameters())
