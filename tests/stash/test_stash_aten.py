"""Stash chains in every spelling a capture produces (issue 23): torch.export's ATen graph (``aten.batch_norm`` with
its counter as a separate ``aten.add_``, in-place residual adds, ``aten.conv2d`` / ``aten.max_pool2d`` consumers),
functional BatchNorm and conv calls in fx graphs, and BatchNorm3d + conv3d. Forward outputs bit-identical, buffers
equal to eager's after each step, bytes as estimated, gradients as the fx chain's."""
import copy
import operator
import re

import pytest
import torch
import torch.nn.functional as F
from torch import fx, nn

import memopt
from memopt.passes.stash.chains import _match
from memopt.passes.stash.forms import BNForm, bn_form


def stash_config(bits=4, **kw):
    # the stash by itself: the fidelity gate would raise the bits these tests compare
    return memopt.Config(stash=memopt.StashConfig(bits=bits, **kw), fewbit=None, fidelity=None,
                         recompute=memopt.RecomputeConfig(peak_first_bits=None))


def _chains(om):
    """What each chain is (its report line, the joined BatchNorm's node name left out: spellings differ)."""
    return sorted(re.sub(r"BN \+ BN \S+", "BN + BN", n.reason) for n in om.plan.nodes if n.op == "bn_act_stash")


class ResNetLike(nn.Module):
    """A ResNet stem and two basic blocks written as Hugging Face's ResNet is (``hidden += residual`` on the
    BatchNorm's output: ``aten.add_`` in an export graph), the second with a downsample BatchNorm; ``untraceable``
    adds a Python condition on a shape, which symbolic tracing cannot follow and torch.export can."""

    def __init__(self, untraceable: bool, conv=nn.Conv2d) -> None:
        super().__init__()
        self.untraceable = untraceable
        self.stem = nn.Sequential(conv(3, 8, 3, padding=1, bias=False), nn.BatchNorm2d(8), nn.ReLU(), nn.MaxPool2d(2))
        self.c1, self.b1 = conv(8, 8, 3, padding=1, bias=False), nn.BatchNorm2d(8)
        self.c2, self.b2 = conv(8, 8, 3, padding=1, bias=False), nn.BatchNorm2d(8)
        self.c3, self.b3 = conv(8, 16, 3, stride=2, padding=1, bias=False), nn.BatchNorm2d(16)
        self.c4, self.b4 = conv(16, 16, 3, padding=1, bias=False), nn.BatchNorm2d(16)
        self.down, self.bd = conv(8, 16, 1, stride=2, bias=False), nn.BatchNorm2d(16)
        self.fc = nn.Linear(16, 10)

    def forward(self, x):
        if self.untraceable and x.shape[-1] < 0:
            x = -x
        x = self.stem(x)
        h = self.b2(self.c2(F.relu(self.b1(self.c1(x)))))
        h += x
        x = F.relu(h)
        h = self.b4(self.c4(F.relu(self.b3(self.c3(x)))))
        h += self.bd(self.down(x))
        return self.fc(F.adaptive_avg_pool2d(F.relu(h), 1).flatten(1))


def _step(om, model, x):
    model.zero_grad(set_to_none=True)
    out = om(x)
    out.square().sum().backward()
    return out, [p.grad.clone() for p in model.parameters()]


@pytest.mark.parametrize("generic", [True, False])
def test_export_graph_chains_match_the_fx_chains_bit_for_bit(generic):
    """The same model captured by torch.export (ATen) and by symbolic tracing gets the same chains (downsample BN
    joined, stem pooled when the generic stash is off), and computes the same forward, buffers and gradients:
    the ATen form is the fx form. Each also matches eager's forward and buffers over two steps."""
    torch.manual_seed(0)
    base = ResNetLike(untraceable=False).train()
    x = torch.randn(4, 3, 16, 16)
    runs = {}
    for untraceable in (True, False):
        model = copy.deepcopy(base)
        model.untraceable = untraceable
        reference = copy.deepcopy(model)
        om = memopt.optimize(model, example_inputs=x, config=stash_config(generic=generic))
        assert om.plan.capture == ("export" if untraceable else "symbolic_trace")
        steps = []
        for _ in range(2):
            out, grads = _step(om, model, x)
            ref, _ = _step(reference, reference, x)
            assert torch.equal(out, ref)
            steps.append((out, grads))
        for (name, b), r in zip(model.named_buffers(), reference.buffers()):
            assert torch.equal(b, r), name  # running statistics and num_batches_tracked: once per step
        assert memopt.measure(om, x).saved_bytes == om.plan.estimated_saved_bytes
        runs[untraceable] = (om, steps)
    (export, export_steps), (traced, traced_steps) = runs[True], runs[False]
    assert _chains(export) == _chains(traced)
    assert len(_chains(export)) == 5 and sum("BN + BN +" in r for r in _chains(export)) == 1
    assert any("max-pool" in r for r in _chains(export)) == (not generic)
    assert export.plan.estimated_saved_bytes == traced.plan.estimated_saved_bytes
    for (out_a, grads_a), (out_b, grads_b) in zip(export_steps, traced_steps):
        assert torch.equal(out_a, out_b)
        for a, b in zip(grads_a, grads_b):
            assert torch.allclose(a, b, rtol=1e-5, atol=1e-7)
    # the export graph's counters went with their BatchNorms: none is left, and none counts twice (buffers above)
    gm = export.graph_module
    assert not any(n.target is torch.ops.aten.add_.Tensor and "num_batches_tracked" in str(n.args[0])
                   for n in gm.graph.nodes)


def test_max_pool_output_after_a_chain_is_coded_by_the_generic_stash():
    """A chain's max pool keeps only its window offsets; the pooled output, which the next conv keeps, is then
    coded by the generic stash (it was left exact: the new pool node had no dtype for it)."""
    torch.manual_seed(0)
    model, x = ResNetLike(untraceable=True).train(), torch.randn(4, 3, 16, 16)
    om = memopt.optimize(model, example_inputs=x, config=stash_config())
    nodes = {n.name: n for n in om.plan.nodes}
    assert any(n.op == "max_pool2d_indices_only" for n in nodes.values())
    first = [n for n in nodes.values() if n.op == "conv_from_codes"]
    assert first and "max_pool2d" in first[0].reason, [(n.name, n.reason) for n in nodes.values() if n.op == "conv"]


class Conv3dSubclass(nn.Conv3d):
    """A conv subclass outside torch.nn (torchvision's Conv3DSimple): symbolic tracing records its F.conv3d."""


class Video(nn.Module):
    """BatchNorm3d chains (r3d_18's layout): a functional conv3d consumer, a residual, global 3-d pooling."""

    def __init__(self) -> None:
        super().__init__()
        self.c0, self.b0 = Conv3dSubclass(3, 8, 3, padding=1, bias=False), nn.BatchNorm3d(8)
        self.c1, self.b1 = nn.Conv3d(8, 8, 3, padding=1, bias=False), nn.BatchNorm3d(8)
        self.c2, self.b2 = Conv3dSubclass(8, 8, 3, padding=1, bias=False), nn.BatchNorm3d(8)
        self.pool, self.fc = nn.AdaptiveAvgPool3d(1), nn.Linear(8, 5)

    def forward(self, x):
        x = F.relu(self.b0(self.c0(x)))
        h = self.b2(self.c2(F.relu(self.b1(self.c1(x)))))
        return self.fc(self.pool(F.relu(h + x)).flatten(1))


def test_batchnorm3d_chains_with_conv3d_consumers():
    torch.manual_seed(0)
    model, x = Video().train(), torch.randn(2, 3, 4, 8, 8)
    reference = copy.deepcopy(model)
    om = memopt.optimize(model, example_inputs=x, config=stash_config())
    chains = _chains(om)
    assert len(chains) == 3 and sum("residual" in r for r in chains) == 1, chains
    rebuilt = [n for n in om.plan.nodes if n.op == "conv_from_stash"]
    assert len(rebuilt) == 2  # c1 (module) and c2 (functional conv3d); c0 reads the model input
    out, grads = _step(om, model, x)
    ref, exact = _step(reference, reference, x)
    assert torch.equal(out, ref)
    for (name, b), r in zip(model.named_buffers(), reference.buffers()):
        assert torch.equal(b, r), name
    for (name, _), a, e in zip(model.named_parameters(), grads, exact):
        cosine = F.cosine_similarity(a.flatten().double(), e.flatten().double(), dim=0)
        assert cosine > 0.98, (name, float(cosine))  # 4 bits, 512 elements per channel: 0.989 at worst
    assert memopt.measure(om, x).saved_bytes == om.plan.estimated_saved_bytes
    assert om.plan.estimated_saved_bytes < 0.45 * om.plan.baseline_saved_bytes


@pytest.mark.parametrize("into, absorbed", [("bn", True), ("residual", False), ("out_of_place", True)])
def test_an_in_place_add_joins_a_chain_only_when_nobody_else_reads_what_it_writes(into, absorbed):
    """``aten.add_(r, bn)`` writes the sum into r: when r is read elsewhere (an alias, here ``mean(r)``), the
    chain's out-of-place sum would leave that reader the old value, so the add stays in the graph (the chain ends
    at the BatchNorm); written into the BatchNorm's own output, or out of place, it joins."""
    root = nn.Module()
    root.bn = nn.BatchNorm2d(3)
    graph, aten = fx.Graph(), torch.ops.aten
    x = graph.placeholder("x")
    r = graph.call_function(aten.mul.Tensor, (x, 2.0))
    bn = graph.call_module("bn", (x,))
    if into == "out_of_place":
        add = graph.call_function(aten.add.Tensor, (r, bn))
    else:
        add = graph.call_function(aten.add_.Tensor, (bn, r) if into == "bn" else (r, bn))
    relu = graph.call_function(aten.relu.default, (add,))
    graph.output((relu, graph.call_function(aten.mean.default, (r,))))
    gm = fx.GraphModule(root, graph)
    found = _match(bn, dict(gm.named_modules()))
    assert found == ((add, relu, "relu") if absorbed else (None, bn, "identity"))


class FunctionalBN(nn.Module):
    """``F.batch_norm`` on a plain module's own tensors (no BatchNorm module for canonical to find)."""

    def __init__(self) -> None:
        super().__init__()
        self.c, self.c2 = nn.Conv2d(3, 6, 3, padding=1), nn.Conv2d(6, 6, 3, padding=1)
        self.weight, self.bias = nn.Parameter(torch.rand(6) + 0.5), nn.Parameter(torch.randn(6))
        self.register_buffer("running_mean", torch.zeros(6))
        self.register_buffer("running_var", torch.ones(6))

    def forward(self, x):
        h = F.batch_norm(self.c(x), self.running_mean, self.running_var, self.weight, self.bias, True, 0.2, 1e-3)
        return self.c2(F.relu(h))


def test_functional_batch_norm_in_an_fx_graph_heads_a_chain():
    torch.manual_seed(0)
    model, x = FunctionalBN().train(), torch.randn(4, 3, 8, 8)
    reference = copy.deepcopy(model)
    om = memopt.optimize(model, example_inputs=x, config=stash_config(generic=False))
    assert om.plan.capture == "symbolic_trace" and len(_chains(om)) == 1
    assert [n.op for n in om.plan.nodes if n.op == "conv_from_stash"] == ["conv_from_stash"]
    for _ in range(2):
        out, _ = _step(om, model, x)
        ref, _ = _step(reference, reference, x)
        assert torch.equal(out, ref)
    assert torch.equal(model.running_mean, reference.running_mean)
    assert torch.equal(model.running_var, reference.running_var)
    assert memopt.measure(om, x).saved_bytes == om.plan.estimated_saved_bytes


def _aten_graph(counter: str = "before", training: bool = True):
    """An export-style graph: aten.batch_norm on get_attr tensors with its counter as a separate aten.add_."""
    root = nn.Module()
    root.bn = nn.BatchNorm2d(3)
    graph = fx.Graph()
    x = graph.placeholder("x")
    attrs = {n: graph.get_attr(f"bn.{n}") for n in ("weight", "bias", "running_mean", "running_var")}
    if counter != "none":
        attrs["num_batches_tracked"] = graph.get_attr("bn.num_batches_tracked")
    aten = torch.ops.aten
    if counter == "before":
        graph.call_function(aten.add_.Tensor, (attrs["num_batches_tracked"], 1))
    bn = graph.call_function(aten.batch_norm.default, (x, attrs["weight"], attrs["bias"], attrs["running_mean"],
                                                       attrs["running_var"], training, 0.1, 1e-5, False))
    out = bn
    if counter == "after":
        graph.call_function(aten.add_.Tensor, (attrs["num_batches_tracked"], 1))
    if counter == "read":
        graph.call_function(aten.add_.Tensor, (attrs["num_batches_tracked"], 1))
        out = graph.call_function(operator.add, (bn, attrs["num_batches_tracked"]))
    graph.output(out)
    return fx.GraphModule(root, graph), bn


@pytest.mark.parametrize("counter, expect", [("before", None), ("none", None), ("after", "updated after it"),
                                             ("read", "not by one lone add_(1)")])
def test_aten_batch_norm_form_and_its_counter(counter, expect):
    gm, bn = _aten_graph(counter)
    form = bn_form(bn, dict(gm.named_modules()))
    if expect is None:
        assert isinstance(form, BNForm) and form.momentum == 0.1 and form.eps == 1e-5
        assert (form.counter is not None) == (counter == "before") and (form.params[4] is None) == (counter == "none")
        assert [n.name for n in form.replaced()][0] == bn.name
    else:
        assert isinstance(form, str) and expect in form and "bn.num_batches_tracked" in form, form


def test_aten_batch_norm_with_running_statistics_is_no_chain_head():
    gm, bn = _aten_graph(training=False)
    form = bn_form(bn, dict(gm.named_modules()))
    assert isinstance(form, str) and "training=False" in form and bn.name in form
