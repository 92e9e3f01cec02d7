"""A short soak (the 200-step version of tools/bench_soak.py): memory flat after warm-up, no packed
tensor outlives its step, one captured graph, no step-time drift; and a leaking model is caught."""
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
    time_start, time_end = result.time_ends
    assert time_end < 2.5 * time_start  # generous: other processes share the CPU


def test_soak_cnn_with_stash():
    torch.manual_seed(0)
    model = TinyResNet(width=4, blocks=1)
    om = memopt.optimize(model, example_inputs=_image(torch.Generator().manual_seed(1)))
    assert "stash" in {n.technique for n in om.plan.nodes}  # every ReLU is in a chain: few-bit finds none left
    _check(soak(om, _image, 10, steps=200, warmup=50))


def test_soak_transformer_with_fewbit():
    torch.manual_seed(0)
    model = TinyViT(d=16, depth=1, heads=2, patch=4, image=8)
    small = lambda gen: _image(gen, size=8)
    om = memopt.optimize(model, example_inputs=small(torch.Generator().manual_seed(1)))
    assert "fewbit" in {n.technique for n in om.plan.nodes}
    _check(soak(om, small, 10, steps=200, warmup=50))


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
