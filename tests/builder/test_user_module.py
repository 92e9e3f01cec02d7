"""The user's module is theirs (issue 39): every submodule's training flag, buffer and parameter is what eager
PyTorch leaves, after optimize() and after every step: frozen BatchNorm, evaluation with autograd on, weight and
spectral norm (both APIs). Each construct runs 3 SGD steps beside an eager twin, under Config.exact() (bit for
bit: outputs, buffers, flags, gradients) and the default Config (outputs, buffers and flags bit for bit; the
rewrites only change gradients, checked by cosine)."""
import copy
import random
import warnings

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from torch import nn

import memopt


def cnn(seed=0):
    torch.manual_seed(seed)
    return nn.Sequential(nn.Conv2d(3, 8, 3, padding=1), nn.BatchNorm2d(8), nn.ReLU(), nn.Conv2d(8, 8, 3, padding=1),
                         nn.BatchNorm2d(8), nn.ReLU(), nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(8, 4))


def flags(model):
    return [m.training for m in model.modules()]


def cosine(a, b):
    return F.cosine_similarity(a.flatten().double(), b.flatten().double(), dim=0).item()


def steps_as_eager(om, model, reference, x, exact, n=3, cosines=True):
    """n SGD steps of ``om`` and of its eager twin: outputs, buffers and flags bit for bit after each; gradients
    bit for bit when ``exact``, else (with ``cosines``) every parameter's cosine >= 0.99."""
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    ref_opt = torch.optim.SGD(reference.parameters(), lr=0.05)
    for step in range(n):
        torch.manual_seed(step)
        out = om(x)
        torch.manual_seed(step)
        expected = reference(x)
        assert torch.equal(out, expected), f"step {step}: forward differs from eager"
        out.square().mean().backward()
        expected.square().mean().backward()
        for (name, p), q in zip(model.named_parameters(), reference.parameters()):
            if exact:
                assert torch.equal(p.grad, q.grad), f"step {step}: {name}.grad differs"
            elif cosines and q.grad.norm() > 1e-6:  # (a conv bias before a BatchNorm: zero but for rounding, both ways)
                assert cosine(p.grad, q.grad) >= 0.99, f"step {step}: {name}.grad cosine {cosine(p.grad, q.grad)}"
        opt.step(), ref_opt.step(), opt.zero_grad(), ref_opt.zero_grad()
        if not exact:  # the twin goes on from the same parameters, so each step's forward compares bit for bit
            with torch.no_grad():
                for p, q in zip(model.parameters(), reference.parameters()):
                    q.copy_(p)
        for (name, b), c in zip(model.named_buffers(), reference.buffers()):
            assert torch.equal(b, c), f"step {step}: buffer {name} differs"
        assert flags(model) == flags(reference)
        if exact:
            for (name, p), q in zip(model.named_parameters(), reference.parameters()):
                assert torch.equal(p, q), f"step {step}: {name} differs"


CONFIGS = [pytest.param(memopt.Config.exact(), True, id="exact"), pytest.param(memopt.Config(), False, id="default")]


@pytest.mark.parametrize("config,exact", CONFIGS)
@pytest.mark.parametrize("when", ["before", "after"])
def test_frozen_batchnorm_stays_frozen(config, exact, when):
    model, x = cnn().train(), torch.randn(8, 3, 16, 16)
    if when == "before":
        model[1].eval()
    reference = copy.deepcopy(model)
    before = flags(model)
    om = memopt.optimize(model, example_inputs=x, config=config)
    assert flags(model) == before, "optimize() changed a submodule's training flag"
    assert all(torch.equal(b, c) for b, c in zip(model.buffers(), reference.buffers()))
    if when == "after":  # frozen after optimize: the next training forward runs a graph captured that way
        model[1].eval(), reference[1].eval()
    steps_as_eager(om, model, reference, x, exact)
    assert not model[1].training


@pytest.mark.parametrize("config,exact", CONFIGS)
def test_evaluation_with_autograd_on_is_eager_evaluation(config, exact):
    model, x = cnn().train(), torch.randn(8, 3, 16, 16)
    reference = copy.deepcopy(model)
    om = memopt.optimize(model, example_inputs=x, config=config)
    steps_as_eager(om, model, reference, x, exact, n=1, cosines=False)
    planned = om.shape_stats["planned"]
    for _ in range(3):  # a validation loss computed without no_grad, between training steps
        model.eval(), reference.eval()
        assert not om.training
        loss, expected = om(x).logsumexp(1).mean(), reference(x).logsumexp(1).mean()
        assert torch.equal(loss, expected)
        assert all(torch.equal(b, c) for b, c in zip(model.buffers(), reference.buffers())), "eval moved statistics"
        om.train(), reference.train()
        assert model.training and all(flags(model))
        steps_as_eager(om, model, reference, x, exact, n=1, cosines=False)  # (cosines: the test below)
    assert om.shape_stats["planned"] == planned, "a mode flip planned again"


NORMS = {
    "weight_norm": lambda m: nn.utils.weight_norm(m),
    "spectral_norm": lambda m: nn.utils.spectral_norm(m),
    "parametrizations.weight_norm": lambda m: nn.utils.parametrizations.weight_norm(m),
    "parametrizations.spectral_norm": lambda m: nn.utils.parametrizations.spectral_norm(m),
}


def normed(kind, seed=0):
    torch.manual_seed(seed)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", FutureWarning)  # the old weight_norm API is deprecated, still used
        wrap = NORMS[kind]
        return nn.Sequential(wrap(nn.Conv2d(3, 8, 3, padding=1)), nn.LeakyReLU(0.2), wrap(nn.Conv2d(8, 8, 3)),
                             nn.LeakyReLU(0.2), nn.Flatten(), wrap(nn.Linear(8 * 14 * 14, 1)))


@pytest.mark.slow
@pytest.mark.parametrize("config,exact", CONFIGS)
@pytest.mark.parametrize("kind", list(NORMS))
def test_weight_and_spectral_norm_move_only_as_eager(kind, config, exact):
    # the old API's weight is a non-leaf attribute: the model cannot be deep-copied, so the twin is built again
    model, reference, x = normed(kind), normed(kind), torch.randn(4, 3, 16, 16)
    om = memopt.optimize(model, example_inputs=x, config=config)
    for (name, b), c in zip(model.named_buffers(), reference.buffers()):
        assert torch.equal(b, c), f"optimize() moved {name}"
    steps_as_eager(om, model, reference, x, exact)


LOSSES = {"square": lambda out, t: out.square().mean(), "cross_entropy": lambda out, t: F.cross_entropy(out, t),
          "projection": lambda out, t: (out * torch.linspace(-1, 1, out.numel()).view_as(out)).sum()}


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_the_gate_holds_under_losses_it_did_not_see(seed):
    # before the gate confirmed plans on the output's own direction, the square loss found a BN weight at 0.97-0.98
    model, x = cnn(seed).train(), torch.randn(8, 3, 16, 16)
    target = torch.arange(8) % 4
    reference = copy.deepcopy(model)
    om = memopt.optimize(model, example_inputs=x)
    for name, loss in LOSSES.items():
        for m in (model, reference):
            m.zero_grad()
        loss(om(x), target).backward()
        loss(reference(x), target).backward()
        apart = om.plan.fidelity["invariant"]  # listed apart, with the reason (the conv biases before a BN: ~0)
        worst = min((cosine(p.grad, q.grad), n) for (n, p), q in zip(model.named_parameters(), reference.parameters())
                    if n not in apart)
        assert worst[0] >= 0.99, (name, worst)


class Checkpointed(nn.Module):
    """Every block under torch.utils.checkpoint, as Hugging Face's gradient_checkpointing_enable() runs them."""

    def __init__(self):
        super().__init__()
        self.blocks = nn.ModuleList(nn.Sequential(nn.Linear(8, 8), nn.GELU()) for _ in range(2))

    def forward(self, x):
        for block in self.blocks:
            x = torch.utils.checkpoint.checkpoint(block, x, use_reentrant=False)
        return x


def test_a_model_checkpointed_everywhere_is_refused_in_one_message():
    with pytest.raises(memopt.TraceError) as info:
        memopt.optimize(Checkpointed(), example_inputs=torch.randn(4, 8))
    assert info.value.__context__ is None and info.value.__cause__ is None, "a chained traceback"
    assert "checkpoint" in str(info.value) and "blocks.0" in str(info.value)


class _DrawsFromNumpy(nn.Module):
    """Draws from NumPy's and Python's global generators in training mode (as Hugging Face Wav2Vec2's SpecAugment
    picks its masked spans with NumPy), a draw its output does not depend on."""

    def __init__(self):
        super().__init__()
        self.inner = nn.Sequential(nn.Linear(8, 16), nn.GELU(), nn.Linear(16, 8))

    def forward(self, x):
        if self.training:
            np.random.rand()
            random.random()
        if bool(x.abs().sum() >= 0):  # a branch on a value: captured per submodule, this forward runs eagerly
            x = x + 1
        return self.inner(x)


def test_planning_leaves_numpy_and_python_generators_where_they_were():
    """optimize() runs the model's forward for real (the capture check, the gate, a step measured per submodule): the
    user's NumPy and Python streams stay where they were, so a forward that plans draws what eager's would."""
    torch.manual_seed(0)
    model = _DrawsFromNumpy().train()
    np.random.seed(5)
    random.seed(5)
    om = memopt.optimize(model, example_inputs=torch.randn(8, 8))
    assert om.plan.capture == "per-submodule" and om.plan.chosen_units()  # it planned, gate included
    numpy_state, python_state = np.random.get_state(), random.getstate()
    np.random.seed(5)
    random.seed(5)
    assert all(np.array_equal(a, b) for a, b in zip(numpy_state, np.random.get_state()))
    assert python_state == random.getstate()
