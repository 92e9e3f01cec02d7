"""A short soak (the 200-step version of tools/bench/reliability/bench_soak.py): memory flat after warm-up, no packed
tensor outlives its step, one captured graph, every step the same work (operators dispatched and
storages packed; step times are measured in tools/bench/reliability/bench_soak.py, not asserted here); and a leaking
model and a model whose steps grow are caught."""
import pytest
import torch
from torch import nn

import memopt
from memopt.testing.soak import soak
from memopt.testing.zoo import TinyResNet, TinyViT

MIB = 2 ** 20


pytestmark = pytest.mark.usefixtures("one_thread")  # tests/conftest.py: tiny ops, one thread


def _image(gen, batch=4, size=16):
    return torch.randn(batch, 3, size, size, generator=gen)


def _check(result):
    assert result.leaked == 0  # nothing autograd packed (codes, masks, statistics) outlives its step
    assert result.graphs == 1  # captured once: no re-capture per step
    rss_start, rss_end = result.rss_ends
    assert abs(rss_end - rss_start) < 4 * MIB, (rss_start, rss_end)
    # no drift: after warm-up every step dispatches the same operators and packs the same storages
    assert len(result.after_warmup(result.ops)) == 1, sorted(result.after_warmup(result.ops))
    assert len(result.after_warmup(result.packed)) == 1, sorted(result.after_warmup(result.packed))


def test_soak_cnn_with_stash():
    torch.manual_seed(0)
    model = TinyResNet(width=4, blocks=1)
    om = memopt.optimize(model, example_inputs=_image(torch.Generator().manual_seed(1)))
    assert "stash" in {n.technique for n in om.plan.nodes}  # every ReLU is in a chain: few-bit finds none left
    _check(soak(om, _image, 10, steps=200, warmup=50, count_ops=True))


def test_soak_transformer_with_fewbit():
    torch.manual_seed(0)
    model = TinyViT(d=16, depth=1, heads=2, patch=4, image=8)
    small = lambda gen: _image(gen, size=8)
    om = memopt.optimize(model, example_inputs=small(torch.Generator().manual_seed(1)))
    assert "fewbit" in {n.technique for n in om.plan.nodes}
    _check(soak(om, small, 10, steps=200, warmup=50, count_ops=True))


def test_soak_catches_a_leak():
    class Leaky(nn.Module):
        """Keeps every step's hidden activation (a storage autograd packed) on itself."""

        def __init__(self):
            super().__init__()
            self.fc1, self.fc2, self.kept = nn.Linear(768, 1024), nn.Linear(1024, 10), []

        def forward(self, x):
            h = torch.tanh(self.fc1(x.flatten(1)))
            self.kept.append(h)
            return self.fc2(h)

    # eager: fx capture would drop the list append
    result = soak(Leaky(), lambda gen: _image(gen, 64), 10, steps=40, warmup=8)
    assert result.leaked >= 40  # one per step at least: the tanh output
    # (its 10 MiB need not show in RSS: a process with freed heap, as after the rest of the suite, reuses it)


def test_soak_catches_a_growing_step():
    class Growing(nn.Module):
        """Each step adds one more operator (a history it replays): the drift the op counts catch."""

        def __init__(self):
            super().__init__()
            self.fc, self.history = nn.Linear(48, 10), []

        def forward(self, x):
            self.history.append(1.0)
            out = self.fc(x.flatten(1))
            for scale in self.history:
                out = out * scale
            return out

    result = soak(Growing(), lambda gen: _image(gen, 4, 4), 10, steps=12, warmup=2, count_ops=True)
    ops = result.ops[result.warmup:]
    assert len(result.after_warmup(result.ops)) == len(ops)  # a new count every step
    assert ops == sorted(ops) and ops[-1] - ops[0] >= 2 * (len(ops) - 1)  # forward mul + its backward
