"""What the fidelity gate keeps alive while it measures: optimize()'s own peak must not be a multiple of the
parameters' gradients above the training step's (issue 40: ResNet-50's optimize() peaked at 4.7x its step)."""
import gc

import torch
from torch import nn
from torch.multiprocessing.reductions import StorageWeakRef
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

import memopt
from memopt.fidelity import gate as fidelity


WIDTH, DEPTH = 96, 4  # no other tensor of the test has the (96, 96) shape of the layers' weights


def _mlp() -> nn.Module:
    """Linear layers with a GELU after each (few-bit GELU backward: a lossy plan the gate confirms on every loss)."""
    return nn.Sequential(*[m for _ in range(DEPTH) for m in (nn.Linear(WIDTH, WIDTH), nn.GELU())], nn.Linear(WIDTH, 8))


def _weight_grads_alive() -> int:
    """Real tensors of the layers' weight shape alive now, parameters aside (gradients and their copies; the cost
    model's fake tensors hold no memory)."""
    return sum(1 for o in gc.get_objects() if type(o) is torch.Tensor and tuple(o.shape) == (WIDTH, WIDTH))


def test_the_gate_keeps_one_set_of_a_plans_gradients_beside_its_references(monkeypatch):
    """Every parameter_fidelity call of the gate sees the eager references of the first losses, the state
    ``preserved_state`` restores, and one set of the plan's gradients with, in a confirmation, the eager ones made
    beside them (``paired_grads``): not one set per loss on either side (each loss's are reduced to figures at once),
    and no float64 copy of the model kept between losses."""
    counts = []
    compare = fidelity.parameter_fidelity

    def counting(*args, **kwargs):
        counts.append(_weight_grads_alive())
        return compare(*args, **kwargs)

    monkeypatch.setattr(fidelity, "parameter_fidelity", counting)
    torch.manual_seed(0)
    model, x = _mlp(), torch.randn(16, WIDTH)
    om = memopt.optimize(model, example_inputs=x, config=memopt.Config(stash=None, reversible=None))
    report = om.plan.fidelity
    assert report["passed"] and report["projections"] == memopt.FidelityConfig().max_projections == 8
    # the first losses' references + the snapshot of the parameters + a pair (eager, plan) under one loss
    assert counts and max(counts) <= (fidelity.PROJECTIONS + 3) * DEPTH, counts
    assert min(counts) >= fidelity.PROJECTIONS * DEPTH  # the count sees the references


def test_references_stay_where_they_are_on_the_host():
    grads = [torch.ones(3), None]
    assert fidelity.on_host(grads)[0] is grads[0] and fidelity.on_host(grads)[1] is None


class _Storages(TorchDispatchMode):
    """Weak references to the storage of every real tensor an op makes while the mode is on."""

    def __init__(self) -> None:
        super().__init__()
        self.made: dict = {}

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in tree_flatten(out)[0]:
            if type(t) in (torch.Tensor, nn.Parameter) and t.device.type == "cpu" and t.untyped_storage().nbytes():
                ref = StorageWeakRef(t.untyped_storage())
                self.made[ref.cdata] = (ref, t.untyped_storage().nbytes(), str(func))
        return out


class _Unpacking(nn.Module):
    """Blocks in a Sequential (the float64 reference checkpoints them) after a shape unpacked from the input, which a
    symbolic trace does through torch.fx's Proxy.__iter__ (timm's patch embedding does it)."""

    def __init__(self) -> None:
        super().__init__()
        self.body = nn.Sequential(*[nn.Sequential(nn.Linear(WIDTH, WIDTH), nn.GELU(), nn.Linear(WIDTH, WIDTH))
                                    for _ in range(3)])
        self.head = nn.Linear(WIDTH, 8)

    def forward(self, x):
        n, d = x.shape
        return self.head(self.body(x.reshape(n, d)))


def test_optimize_leaves_no_tensor_memory_to_the_cyclic_collector():
    """What optimize() made and dropped is freed when it returns, not when Python's cyclic collector next runs.
    Two reference cycles did that, each keeping memory resident into the user's first steps, on top of their peak:
    the float64 reference copy's checkpointed blocks (each wrapped forward held its block: the copy and its
    gradients; ResNet-50 128x128 batch 48 with budget_mb=1024 measured 1251 MiB against 1001 estimated), and
    torch.fx's Proxy.__iter__, whose frame holds itself and through f_back the fidelity gate's frame, and with it
    the gate's reference gradients."""
    torch.manual_seed(0)
    model, x = _Unpacking(), torch.randn(16, WIDTH)
    mode = _Storages()
    gc.collect()
    gc.disable()
    try:
        with mode:
            om = memopt.optimize(model, example_inputs=x, config=memopt.Config(stash=None, reversible=None))
        assert om.plan.fidelity["passed"] and om.plan.capture == "symbolic_trace"
        alive = {k: v for k, v in mode.made.items() if not v[0].expired()}
        gc.collect()
    finally:
        gc.enable()
    freed = sorted((nbytes, name) for ref, nbytes, name in alive.values() if ref.expired())
    assert not freed, f"{len(freed)} storages ({sum(b for b, _ in freed)} bytes) were held by reference cycles: {freed[-5:]}"
