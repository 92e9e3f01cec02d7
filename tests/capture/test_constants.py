"""Constants a trace builds per call where the eager model caches one (memopt/capture/cached_constants.py): HF BEiT's relative
position index comes from an lru_cache, so eager gathers every layer's bias with one index tensor and autograd
keeps it once; under torch.export the cache is off and the graph built it per layer, keeping a copy per layer, so
the capture check refused the whole model. Now the later layers read the first copy, as in eager."""
import copy

import torch
from torch import nn

import memopt
from conftest import assert_step_as_eager
from memopt.capture.cached_constants import share_repeated_constants


def _index(n):
    """BEiT-style: a constant index written in place (slices filled from other constants)."""
    index = torch.zeros(n, n, dtype=torch.long)
    index[1:, 1:] = (torch.arange(n - 1)[:, None] - torch.arange(n - 1)[None, :]) + n - 2
    index[0, :] = 2 * n - 3
    index[:, 0] = 2 * n - 2
    return index


_CACHE = {}


def cached_index(n):
    if torch.compiler.is_exporting():  # HF's compile_compatible_method_lru_cache: off while tracing
        return _index(n)
    return _CACHE.setdefault(n, _index(n))


class Layer(nn.Module):
    def __init__(self, n, heads):
        super().__init__()
        self.table = nn.Parameter(torch.randn(2 * n - 1, heads))
        self.qkv = nn.Linear(8 * heads, 24 * heads)
        self.n, self.heads = n, heads

    def forward(self, x):
        b, n, c = x.shape
        bias = self.table[cached_index(n).view(-1)].view(n, n, -1).permute(2, 0, 1)
        q, k, v = self.qkv(x).view(b, n, 3, self.heads, 8).permute(2, 0, 3, 1, 4)
        y = nn.functional.scaled_dot_product_attention(q, k, v, attn_mask=bias[None].contiguous())
        return x + y.transpose(1, 2).reshape(b, n, c)


class RelativeBiasNet(nn.Module):
    def __init__(self, n=6, heads=2, depth=3):
        super().__init__()
        self.layers = nn.ModuleList(Layer(n, heads) for _ in range(depth))

    def forward(self, x):
        x = torch.stack(list(x.unbind(0)))  # symbolic tracing fails here: captured by torch.export
        for layer in self.layers:
            x = layer(x)
        return x


def test_a_constant_eager_caches_is_built_once_and_the_model_is_captured_whole():
    torch.manual_seed(0)
    model, x = RelativeBiasNet().train(), torch.randn(2, 6, 16)
    reference = copy.deepcopy(model)
    om = memopt.optimize(model, example_inputs=x, config=memopt.Config.exact())
    assert om.plan.capture == "export"
    graph = om.graph_module.graph
    assert sum(n.target is torch.ops.aten.zeros.default for n in graph.nodes) == 1  # the copies' chains removed
    gathers = [n for n in graph.nodes if n.target is torch.ops.aten.index.Tensor]
    assert len(gathers) == 3 and len({g.args[1][0] for g in gathers}) == 1
    assert_step_as_eager(om, model, reference, x)


class Traced(nn.Module):
    """Two equal constants read by the computation; ``mode`` makes one of them not a constant."""

    def __init__(self, mode):
        super().__init__()
        self.w = nn.Parameter(torch.randn(4, 3))
        self.register_buffer("offset", torch.zeros(4, dtype=torch.long))
        self.mode = mode

    def forward(self, x):
        first = torch.arange(4)
        second = torch.arange(4)
        if self.mode == "buffer":  # the model's state: may change between steps
            second = second + self.offset
        if self.mode == "written":  # written from the input after it is read
            y = self.w[first] * x + self.w[second] * x
            second.add_(x.sum().long())
            return y + second.float().sum()
        return self.w[first] * x + self.w[second] * x


def _exported(mode):
    model = Traced(mode)
    x = torch.randn(4, 3)
    gm = torch.export.export(model, (x,)).module()
    return gm, model, x


def test_equal_constants_share_their_first_copy_and_the_graph_computes_the_same():
    gm, model, x = _exported("plain")
    expected = gm(x)
    assert share_repeated_constants(gm, model) == ["arange_1"]
    assert torch.equal(gm(x), expected)
    assert sum(n.target is torch.ops.aten.arange.default for n in gm.graph.nodes) == 1


def test_a_constant_written_from_an_input_after_it_is_read_is_not_shared():
    gm, model, x = _exported("written")
    assert share_repeated_constants(gm, model) == []


def test_a_value_from_the_model_state_is_read_from_it_at_every_step():
    """The raw ``arange`` may be shared (equal constants); ``arange + offset`` reads a buffer that may change
    between steps, so it is not a constant: after the buffer changes, the graph follows it as eager does."""
    gm, model, x = _exported("buffer")
    share_repeated_constants(gm, model)
    with torch.no_grad():
        gm.offset.fill_(-1)
        model.offset.fill_(-1)
    assert torch.equal(gm(x), model(x))
