"""Parameters float32 itself does not resolve are listed apart by measurement (memopt/fidelity/conditioning.py): the
eager step in float64 against float32's; never under a bar of 1 or autocast, never a change to the user's model."""
import copy
import gc

import pytest
import torch
from torch import nn

import memopt
from memopt.fidelity.conditioning import float64_noise
from memopt.fidelity.gate import RandomProjection, parameter_fidelity
from memopt.capture.soundness import training_step

WHY = "float32 does not resolve it here"


class IllConditioned(nn.Module):
    """Centres its input after adding 1e7: float32 keeps none of the input's digits there, float64 all of them."""

    def __init__(self):
        super().__init__()
        self.s = nn.Parameter(torch.ones(16))
        self.fc1, self.act, self.fc2 = nn.Linear(16, 32), nn.GELU(), nn.Linear(32, 4)

    def forward(self, x):
        big = x + 1e7
        return self.fc2(self.act(self.fc1(self.s * (big - big.mean(0)))))


class WellConditioned(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc1, self.act, self.fc2 = nn.Linear(16, 32), nn.GELU(), nn.Linear(32, 4)

    def forward(self, x):
        return self.fc2(self.act(self.fc1(x)))


def _eager(cls):
    """(model, input, float64_noise's arguments up to the bar) of one eager float32 step under a projection."""
    torch.manual_seed(0)
    model, x = cls(), torch.randn(16, 16)
    rng = torch.Generator().manual_seed(0).get_state()
    loss = RandomProjection(0)
    names = [n for n, _ in model.named_parameters()]
    grads = training_step(model, model, (x,), {}, rng, loss).grads
    return model, x, (model, (x,), {}, rng, loss, names, grads, 1e-3)


def test_parameters_float32_cannot_resolve_are_listed_apart_with_the_figure():
    torch.manual_seed(0)
    model, x = IllConditioned(), torch.randn(16, 16)
    before = copy.deepcopy(model.state_dict())
    om = memopt.optimize(model, example_inputs=x)
    apart = om.plan.fidelity["invariant"]
    assert "s" in apart and apart["s"].startswith(WHY) and "to float64's on the same step" in apart["s"], apart
    assert om.plan.fidelity["passed"] and not om.plan.fidelity["changes"]  # nothing repaired for rounding
    assert f"listed apart: s: {WHY}" in om.report()
    assert all(torch.equal(v, before[k]) for k, v in model.state_dict().items())  # the float64 twin is a copy


def test_well_conditioned_parameters_stay_gated():
    model, x, args = _eager(WellConditioned)
    assert float64_noise(*args, 0.99, parameter_fidelity) == {}
    om = memopt.optimize(model, example_inputs=x)
    assert not any(why.startswith(WHY) for why in om.plan.fidelity["invariant"].values())


def test_not_under_an_exact_bar_autocast_or_another_dtype():
    model, x, args = _eager(IllConditioned)
    rng, loss, names, grads = args[3:7]
    assert float64_noise(*args, 0.99, parameter_fidelity).keys() >= {"s"}
    assert float64_noise(*args, 1.0, parameter_fidelity) is None  # a bar of 1 asks for float32 eager's own bits
    with torch.autocast("cpu", dtype=torch.bfloat16):
        assert float64_noise(*args, 0.99, parameter_fidelity) is None  # autocast_noise's case
    half = copy.deepcopy(model).bfloat16()
    assert float64_noise(half, (x.bfloat16(),), {}, rng, loss, names, grads, 1e-3, 0.99, parameter_fidelity) is None


class Blocks(nn.Module):
    """Blocks in a Sequential (BatchNorm and dropout inside) and one in a ModuleList, beside a leaf."""

    def __init__(self):
        super().__init__()
        self.stem = nn.Linear(16, 32)
        self.body = nn.Sequential(*[nn.Sequential(nn.Linear(32, 32), nn.BatchNorm1d(32), nn.Dropout(0.3), nn.GELU())
                                    for _ in range(3)])
        self.more = nn.ModuleList([nn.Sequential(nn.Linear(32, 32), nn.Tanh()), nn.ReLU()])
        self.head = nn.Linear(32, 4)

    def forward(self, x):
        x = self.body(self.stem(x))
        for m in self.more:
            x = m(x)
        return self.head(x)


def test_the_float64_copys_blocks_are_checkpointed_with_the_same_gradients(monkeypatch):
    """The float64 reference step recomputes its copy's blocks in backward (a smaller peak inside optimize()): its
    gradients are the plain float64 step's bit for bit, dropout and BatchNorm included, and where the checkpointed
    step fails it runs as written."""
    from memopt.fidelity import conditioning

    torch.manual_seed(0)
    model, x = Blocks().double(), torch.randn(8, 16, dtype=torch.float64)
    rng, loss = torch.Generator().manual_seed(0).get_state(), RandomProjection(0)
    plain = training_step(model, model, (x,), {}, rng, loss).grads
    twin = copy.deepcopy(model)
    assert conditioning.checkpoint_blocks(twin) == 4  # 3 in body, the Sequential in more; not the ReLU or the stem
    assert "forward" not in vars(model.body[0])  # the copy's, not the model's
    again = training_step(twin, twin, (x,), {}, rng, loss, throwaway=True).grads
    assert all(torch.equal(a, b) for a, b in zip(plain, again))

    def broken(twin):  # a block that recomputation does not take
        twin.fc1.forward = lambda *a: (_ for _ in ()).throw(RuntimeError("recomputed differently"))
        return 1

    _, _, args = _eager(IllConditioned)  # "s" is listed apart only if a float64 step ran
    monkeypatch.setattr(conditioning, "checkpoint_blocks", broken)
    assert WHY in float64_noise(*args, 0.99, parameter_fidelity).get("s", "")
    monkeypatch.setattr(conditioning, "checkpoint_blocks", lambda twin: 0)  # no blocks: as written at once
    assert WHY in float64_noise(*args, 0.99, parameter_fidelity).get("s", "")


def test_parameter_fidelity_lists_tiny_gradients_apart():
    exact = [torch.ones(4), torch.full((4,), 1e-6), torch.ones(4)]
    approx = [torch.ones(4), -torch.full((4,), 1e-6), torch.tensor([1.0, 1.0, 1.0, -1.0])]
    figures = parameter_fidelity(["a", "b", "c"], exact, approx, tiny=1e-3)
    assert figures["a"]["cosine"] == pytest.approx(1.0) and not figures["a"]["tiny"]
    assert figures["b"]["tiny"] and figures["b"]["cosine"] == pytest.approx(-1.0)
    assert figures["c"]["cosine"] == pytest.approx(0.5) and figures["c"]["relative_error"] == pytest.approx(1.0)


def test_the_float64_copy_is_freed_when_its_step_ends():
    """The checkpointed float64 copy goes when float64_noise returns, not at the next cyclic collection: each wrapped
    forward held its block (a bound method in the block's own __dict__), a cycle that kept the copy, its parameters
    and gradients, resident until Python's collector happened to run."""
    torch.manual_seed(0)
    model, x = Blocks(), torch.randn(8, 16)
    rng, loss = torch.Generator().manual_seed(0).get_state(), RandomProjection(0)
    names = [n for n, _ in model.named_parameters()]
    grads = training_step(model, model, (x,), {}, rng, loss).grads
    gc.collect()
    gc.disable()

    def float64_parameters() -> set:
        return {id(o) for o in gc.get_objects() if type(o) is nn.Parameter and o.dtype == torch.float64}

    try:
        before = float64_parameters()  # other tests' in this process, if any
        assert float64_noise(model, (x,), {}, rng, loss, names, grads, 1e-3, 0.99, parameter_fidelity) is not None
        left = float64_parameters() - before
    finally:
        gc.enable()
    assert not left, f"{len(left)} float64 parameters of the reference copy outlived its step"
