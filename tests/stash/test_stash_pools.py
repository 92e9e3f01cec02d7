"""Average pools after a chain (passes/stash/chains.py ``pool_keeps_input``): which keep their input for backward is
checked against PyTorch's autograd itself (saved_tensors_hooks) for every spelling, and a chain read by a pool
that keeps its output is still rewritten (it frees its BatchNorm input) with the bytes as estimated."""
import copy

import pytest
import torch
import torch.nn.functional as F
from torch import fx, nn

import memopt
from memopt.cost_model.op_registry import op_kind
from memopt.passes.stash.chains import pool_keeps_input

aten = torch.ops.aten
POOLS = [  # (the op as a callable module or function, input shape)
    (nn.AvgPool2d(2), (2, 3, 8, 8)), (lambda t: F.avg_pool2d(t, 3, 1, 1), (2, 3, 8, 8)),
    (lambda t: aten.avg_pool2d.default(t, [2, 2]), (2, 3, 8, 8)),
    (nn.AvgPool1d(2), (2, 3, 8)), (nn.AvgPool3d(2), (2, 3, 4, 4, 4)),
    (nn.AdaptiveAvgPool2d(1), (2, 3, 8, 8)), (nn.AdaptiveAvgPool2d((1, 1)), (2, 3, 8, 8)),
    (nn.AdaptiveAvgPool2d(3), (2, 3, 8, 8)), (nn.AdaptiveAvgPool2d(4), (2, 3, 8, 8)),
    (lambda t: F.adaptive_avg_pool2d(t, 1), (2, 3, 8, 8)), (lambda t: F.adaptive_avg_pool2d(t, (2, 1)), (2, 3, 8, 8)),
    (lambda t: aten.adaptive_avg_pool2d.default(t, [1, 1]), (2, 3, 8, 8)),
    (lambda t: aten.adaptive_avg_pool2d.default(t, [3, 3]), (2, 3, 8, 8)),
    (lambda t: aten._adaptive_avg_pool2d.default(t, [1, 1]), (2, 3, 8, 8)),
    (nn.AdaptiveAvgPool1d(1), (2, 3, 8)), (nn.AdaptiveAvgPool1d(3), (2, 3, 8)),
    (nn.AdaptiveAvgPool3d(1), (2, 3, 4, 4, 4)), (nn.AdaptiveAvgPool3d(3), (2, 3, 4, 4, 4)),
    (lambda t: F.adaptive_avg_pool3d(t, 1), (2, 3, 4, 4, 4)),
    (lambda t: aten.adaptive_avg_pool3d.default(t, [1, 1, 1]), (2, 3, 4, 4, 4)),
    (lambda t: aten._adaptive_avg_pool3d.default(t, [1, 1, 1]), (2, 3, 4, 4, 4)),
    (lambda t: F.avg_pool1d(t, 2), (2, 3, 8)), (lambda t: F.avg_pool3d(t, 2), (2, 3, 4, 4, 4)),
    (lambda t: aten.avg_pool1d.default(t, [2]), (2, 3, 8)),
    (lambda t: aten.avg_pool3d.default(t, [2, 2, 2]), (2, 3, 4, 4, 4)),
    (lambda t: aten.adaptive_avg_pool1d.default(t, [1]), (2, 3, 8)),
    (lambda t: aten.adaptive_avg_pool1d.default(t, [3]), (2, 3, 8)),
]


def _autograd_keeps_input(op, shape) -> bool:
    x = torch.randn(shape, requires_grad=True) * 1.0
    storages = []
    with torch.autograd.graph.saved_tensors_hooks(lambda t: storages.append(t.untyped_storage().data_ptr()) or t,
                                                  lambda t: t):
        op(x)
    return x.untyped_storage().data_ptr() in storages


class _Wrap(nn.Module):
    def __init__(self, op):
        super().__init__()
        self.op = op

    def forward(self, x):
        return self.op(x)


def _pool_node(op):
    gm = fx.symbolic_trace(_Wrap(op))  # a module call, or the function (F / ATen) the lambda calls
    node = next(n for n in gm.graph.nodes if n.op in ("call_module", "call_function"))
    return node, dict(gm.named_modules())


@pytest.mark.parametrize("index", range(len(POOLS)))
def test_the_rule_is_what_autograd_keeps(index):
    op, shape = POOLS[index]
    node, modules = _pool_node(op)
    assert op_kind(node, modules) == "avg_pool", node.format_node()  # every spelling is known as a pool
    assert pool_keeps_input(node, modules) == _autograd_keeps_input(op, shape), (node.format_node(), shape)


class ChainThenPool(nn.Module):
    def __init__(self, pool):
        super().__init__()
        self.conv, self.bn, self.pool, self.fc = nn.Conv2d(3, 8, 3, padding=1), nn.BatchNorm2d(8), pool, nn.LazyLinear(4)

    def forward(self, x):
        return self.fc(self.pool(F.relu(self.bn(self.conv(x)))).flatten(1))


@pytest.mark.parametrize("pool, keeps", [(nn.AvgPool2d(2), True), (nn.AdaptiveAvgPool2d(3), True),
                                         (nn.AdaptiveAvgPool2d(1), False)])
def test_a_chain_read_by_an_average_pool_frees_what_is_estimated(pool, keeps):
    torch.manual_seed(0)
    model, x = ChainThenPool(pool).train(), torch.randn(4, 3, 16, 16)
    model(x)  # the lazy linear's shape
    reference = copy.deepcopy(model)
    om = memopt.optimize(model, example_inputs=x, config=memopt.Config(
        stash=memopt.StashConfig(bits=4, generic=False), fewbit=None, fidelity=None, recompute=None, reversible=None))
    assert [n.op for n in om.plan.nodes if n.op == "bn_act_stash"] == ["bn_act_stash"]
    assert torch.equal(om(x), reference(x))
    measured = memopt.measure(om, x).saved_bytes
    assert measured == om.plan.estimated_saved_bytes
    relu_output = 4 * 8 * 16 * 16 * 4
    # the pool's copy of the chain's output stays when it keeps its input, and only then
    assert (measured >= relu_output) == keeps, (measured, relu_output)
    assert measured < om.plan.baseline_saved_bytes
