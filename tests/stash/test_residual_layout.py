"""Issue 39: a chain's residual add must lay its sum out as the graph's add does.

In timm's iFormer (``iformer_t``, batch 4, 64x64) an attention block ends in ``x + bn(conv(h))`` where ``h``, and so
the conv and BatchNorm outputs, are channels-last at 4x4 and ``x`` is contiguous: eager's out-of-place add gives a
contiguous sum. The stash chain added the residual into the BatchNorm's output in place, so its sum stayed
channels-last (the same values), and the next block's BatchNorms (1x1 conv-BN-GELU-1x1 conv-BN) reduced their batch
statistics in the other layout's order: outputs ~1e-6 and running statistics off under the default Config.
"""
import copy

import pytest
import torch
from torch import nn

import memopt
from memopt.stash.ops import bn_act_stash, residual_sum


class ChannelsLastBranch(nn.Module):
    """``x + bn(conv(h))`` with ``h`` channels-last (iFormer's attention output projection): the BN output is
    channels-last, the residual ``x`` contiguous."""

    def __init__(self, c: int, residual_first: bool = True) -> None:
        super().__init__()
        self.conv, self.bn, self.residual_first = nn.Conv2d(c, c, 1, bias=False), nn.BatchNorm2d(c), residual_first

    def forward(self, x):
        y = self.bn(self.conv(torch.sigmoid(x).contiguous(memory_format=torch.channels_last)))
        return x + y if self.residual_first else y + x


class FFN(nn.Module):
    """iFormer's ``stages.2.blocks.8``: x + BN(1x1 conv(GELU(BN(1x1 conv(x)))))."""

    def __init__(self, c: int, hidden: int) -> None:
        super().__init__()
        self.conv1, self.bn1 = nn.Conv2d(c, hidden, 1, bias=False), nn.BatchNorm2d(hidden)
        self.act = nn.GELU()
        self.conv2, self.bn2 = nn.Conv2d(hidden, c, 1, bias=False), nn.BatchNorm2d(c)

    def forward(self, x):
        return x + self.bn2(self.conv2(self.act(self.bn1(self.conv1(x)))))


class Net(nn.Module):
    def __init__(self, c: int = 128, hidden: int = 256, residual_first: bool = True) -> None:
        super().__init__()
        self.attn, self.ffn = ChannelsLastBranch(c, residual_first), FFN(c, hidden)
        self.head = nn.Conv2d(c, 8, 1)

    def forward(self, x):
        return self.head(self.ffn(self.attn(x)))


def _one_step(model: nn.Module, x: torch.Tensor, config=None):
    reference = copy.deepcopy(model)
    om = memopt.optimize(model, example_inputs=x, config=config)
    torch.manual_seed(1)
    out = om(x)
    torch.manual_seed(1)
    expected = reference(x)
    return om, model, reference, out, expected


@pytest.mark.parametrize("residual_first", [True, False], ids=["x+bn", "bn+x"])
def test_chain_sum_has_the_eager_layout_and_the_next_block_is_bit_identical(one_thread, residual_first):
    torch.manual_seed(0)
    model = Net(residual_first=residual_first).train()
    x = torch.randn(4, 128, 4, 4)
    om, model, reference, out, expected = _one_step(model, x)
    chains = [n for n in om.graph_module.graph.nodes if n.target is bn_act_stash]
    spec = next(n.args[7] for n in chains if n.name.startswith("attn_bn"))
    assert spec.residual and spec.residual_first is residual_first and not spec.add_in_place
    assert torch.equal(out, expected)
    for (name, a), (_, b) in zip(model.named_buffers(), reference.named_buffers()):
        assert torch.equal(a, b), name
    out.square().sum().backward()
    expected.square().sum().backward()
    for (name, a), (_, b) in zip(model.named_parameters(), reference.named_parameters()):
        assert (a.grad is None) == (b.grad is None), name


@pytest.mark.parametrize("residual_first", [True, False])
@pytest.mark.parametrize("in_place", [False, True])
@pytest.mark.parametrize("layouts", ["cl+c", "c+cl", "c+c", "cl+cl"])
def test_residual_sum_matches_the_graphs_add(residual_first, in_place, layouts):
    """Values, shape, dtype and strides of the graph's add, whatever the operands' order and layouts; ``out`` is
    overwritten exactly where the graph's add lays the sum out as ``out``."""
    def tensor(layout: str, seed: int) -> torch.Tensor:
        t = torch.randn(4, 8, 4, 4, generator=torch.Generator().manual_seed(seed))
        return t.contiguous(memory_format=torch.channels_last) if layout == "cl" else t

    out_layout, residual_layout = layouts.split("+")
    out, residual = tensor(out_layout, 0), tensor(residual_layout, 1)
    first, second = (residual.clone(memory_format=torch.preserve_format), out.clone(
        memory_format=torch.preserve_format)) if residual_first else (out.clone(memory_format=torch.preserve_format),
                                                                      residual)
    expected = first.add_(second) if in_place else first + second
    z = residual_sum(out, residual, residual_first, in_place)
    assert torch.equal(z, expected) and z.stride() == expected.stride() and z.dtype == expected.dtype
    assert (z.data_ptr() == out.data_ptr()) == (expected.stride() == out.stride())


def test_residual_sum_broadcast_and_promotion():
    out = torch.randn(2, 4, 3, 3)
    for residual in (torch.randn(4, 1, 1), torch.randn(2, 4, 3, 3, dtype=torch.float64)):
        for residual_first in (True, False):
            expected = residual + out if residual_first else out + residual
            z = residual_sum(out.clone(), residual, residual_first, False)
            assert torch.equal(z, expected) and z.stride() == expected.stride() and z.dtype == expected.dtype
