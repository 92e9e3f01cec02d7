"""A recomputed block's backward over batch chunks (RecomputeSpec.chunks): only for blocks whose samples do not mix
(measured: memopt/recompute/chunks.py), chosen where the cost model puts the peak inside a recomputed block's
backward (memopt/passes/recompute_chunks.py). Forward bit-identical, estimate = measurement, gradients those of the
whole batch up to the order of the parameters' sums."""
import copy

import pytest
import torch
from torch import fx, nn

import memopt
from memopt.core.inputs import normalize_inputs
from memopt.cost_model.analysis import annotate
from memopt.passes.planning.candidates import copy_graph_module
from memopt.core.meta import META_KEY
from memopt.passes.recompute_chunks import (SEPARABLE_KEY, rebatch, recompute_chunks_of, recomputed,
                                           set_recompute_chunks, unannotated, why_not_chunked)
from memopt.recompute.chunks import recompute_inputs, separable
from memopt.recompute.ops import RecomputeSpec, ranges, recompute_from_codes
from memopt.testing.compare import forward_identical_gradients_close
from memopt.testing.zoo import build


class Block(nn.Module):
    """A transformer's MLP half: every op works on one sample (one token) at a time."""

    def __init__(self, d=64, hidden=512):
        super().__init__()
        self.norm, self.fc1, self.act, self.fc2 = nn.LayerNorm(d), nn.Linear(d, hidden), nn.GELU(), nn.Linear(hidden, d)

    def forward(self, x):
        return x + self.fc2(self.act(self.fc1(self.norm(x))))


class Mixer(nn.Module):
    def __init__(self, n=6):
        super().__init__()
        self.embed = nn.Linear(32, 64)
        self.blocks = nn.Sequential(*[Block() for _ in range(n)])
        self.head = nn.Linear(64, 10)

    def forward(self, x):
        return self.head(self.blocks(self.embed(x)).mean(1))


class Normed(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc, self.bn = nn.Linear(16, 16), nn.BatchNorm1d(16)

    def forward(self, x):
        return x + self.bn(self.fc(x))


class Dropped(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc, self.drop = nn.Linear(16, 16), nn.Dropout(0.5)

    def forward(self, x):
        return x + self.drop(self.fc(x))


class Baked(nn.Module):
    """Reshapes with the batch size it was written for, as an exported graph does."""

    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(16, 16)

    def forward(self, x):
        return x + self.fc(x).view(8, 16)


class ShapedBlock(Block):
    """Splits its hidden units into groups by the input's sizes: an exported graph writes the example's batch into
    the view (``[32, 16, 8, 64]``), so the block runs on a range only once it reads the batch again (``rebatch``)."""

    def forward(self, x):
        b, t, _ = x.shape
        h = self.act(self.fc1(self.norm(x)).view(b, t, 8, 64))
        return x + self.fc2(h.reshape(b, t, 512))


class ExportedMixer(Mixer):
    """torch.fx cannot trace the check on the input's rank, so memopt captures it with torch.export."""

    def __init__(self, n=6):
        super().__init__(n)
        self.blocks = nn.Sequential(*[ShapedBlock() for _ in range(n)])

    def forward(self, x):
        if x.dim() != 3:
            raise ValueError("x must be (batch, tokens, features)")
        return super().forward(x)


def _cosine(a, b):
    return torch.nn.functional.cosine_similarity(a.flatten().double(), b.flatten().double(), 0).item()


@pytest.mark.parametrize("batch,chunks", [(8, 2), (7, 3), (3, 8), (5, 1)])
def test_ranges_are_tensor_splits(batch, chunks):
    expected = [(int(r[0]), int(r[-1]) + 1) for r in torch.arange(batch).tensor_split(min(chunks, batch))]
    assert ranges(batch, chunks) == expected


def test_blocks_whose_samples_mix_are_not_separable_and_the_check_leaves_no_trace():
    torch.manual_seed(0)
    x = torch.randn(8, 16)
    block, normed, dropped, baked = Block(16, 32), Normed().train(), Dropped().train(), Baked()
    stats = [b.clone() for b in normed.buffers()]
    rng = torch.get_rng_state()
    assert separable(block, recompute_inputs([x]), 8) is None
    assert "its samples mix" in separable(normed, recompute_inputs([x]), 8)
    assert separable(dropped, recompute_inputs([x]), 8) is None  # its draws kept: tests/recompute/test_draws.py
    assert "does not run on part of the batch" in separable(baked, recompute_inputs([x]), 8)
    assert all(torch.equal(a, b) for a, b in zip(stats, normed.buffers())) and normed.training
    assert torch.equal(rng, torch.get_rng_state())


def test_a_chunked_backward_gives_the_whole_batchs_gradients():
    torch.manual_seed(0)
    block, x = Block(), torch.randn(12, 16, 64)
    table = torch.randn(16, 64, requires_grad=True)  # read whole by every range: its gradient sums over them
    runs = []
    for chunks in (1, 3):
        block.zero_grad()
        xs, ts = x.clone().requires_grad_(), table.detach().clone().requires_grad_()
        out = recompute_from_codes(block, RecomputeSpec(False, "blocks.0", 8, 256, chunks), xs + ts)
        out.square().mean().backward()
        runs.append((out.detach(), xs.grad, ts.grad, [p.grad.clone() for p in block.parameters()]))
    (out1, x1, t1, p1), (out3, x3, t3, p3) = runs
    assert torch.equal(out1, out3)  # the forward is the block's own, whatever the chunks
    assert torch.allclose(x1, x3, rtol=1e-5, atol=1e-7) and torch.allclose(t1, t3, rtol=1e-5, atol=1e-6)
    for a, b in zip(p1, p3):
        assert torch.allclose(a, b, rtol=1e-4, atol=1e-6) and _cosine(a, b) > 0.999999


def test_a_chunked_backward_refuses_a_block_that_updates_buffers():
    block, x = Normed().train(), torch.randn(8, 16, requires_grad=True)
    out = recompute_from_codes(block, RecomputeSpec(False, "layer.3", 8, 256, 4), x)
    with pytest.raises(RuntimeError, match=r"block layer\.3 updates buffers.*chunks=1"):
        out.sum().backward()


def _mixer():
    torch.manual_seed(0)
    return Mixer(), torch.randn(32, 16, 32)


def test_the_default_plan_chunks_recomputed_blocks_where_the_peak_falls_inside_one():
    model, x = _mixer()
    reference = copy.deepcopy(model)
    om = memopt.optimize(model, example_inputs=x, optimizer="sgd")
    plan = om.plan
    assert plan.recompute_chunks > 1 and plan.fidelity["passed"]
    assert "recomputed blocks' backward in batch chunks" in om.report()
    measured = memopt.measure(om, x, optimizer="sgd")
    assert measured.peak_bytes == plan.estimated_peak_bytes
    # the same plan without chunks peaks higher
    built = next(iter(om._memopt_built.values()))
    whole = copy_graph_module(built.graph_module)
    assert set_recompute_chunks(whole, 1) == 0
    args, kwargs = normalize_inputs(x)
    assert annotate(whole, args, kwargs, optimizer="sgd").peak_bytes > plan.estimated_peak_bytes
    forward_identical_gradients_close(om, model, reference, x)


@pytest.mark.parametrize("inside", [True, False])
def test_an_exported_graphs_blocks_read_the_batch_again_and_take_chunks(inside):
    # without codes inside, the block's graph is the captured nodes' copy, whose inputs carry no shapes: the batch
    # is read from the input the block's stream comes in by (it was not, and such blocks took no chunks)
    torch.manual_seed(0)
    model, x = ExportedMixer(), torch.randn(32, 16, 32)
    reference = copy.deepcopy(model)
    config = memopt.Config(recompute=memopt.RecomputeConfig(codes_inside=inside))
    om = memopt.optimize(model, example_inputs=x, optimizer="sgd", config=config)
    assert om.plan.capture == "export" and om.plan.recompute_chunks > 1
    assert memopt.measure(om, x, optimizer="sgd").peak_bytes == om.plan.estimated_peak_bytes
    forward_identical_gradients_close(om, model, reference, x)


def test_rebatch_reads_the_batch_from_the_input_and_its_undo_puts_the_graph_back():
    block = fx.symbolic_trace(nn.Sequential(nn.Linear(16, 16), nn.Tanh()))
    for node in block.graph.nodes:
        if node.op == "placeholder":
            node.meta["val"] = torch.empty(8, 16)
    with block.graph.inserting_before(next(n for n in block.graph.nodes if n.op == "output")):
        last = next(n for n in reversed(block.graph.nodes) if n.op == "call_module")
        view = block.graph.call_function(torch.ops.aten.view.default, (last, [8, 16]))
    last.replace_all_uses_with(view, delete_user_cb=lambda user: user is not view)
    block.recompile()
    code, x = block.code, torch.randn(8, 16)
    whole = block(x)
    with pytest.raises(RuntimeError, match="invalid for input of size"):
        block(x[:4])  # the batch of 8 written into the view
    undo = rebatch(block, 8)
    assert undo is not None and "sym_size" in block.code
    assert torch.equal(block(x), whole) and torch.equal(block(x[:4]), whole[:4])
    undo()
    assert block.code == code


def test_a_plan_applied_again_keeps_its_recompute_chunks():
    model, x = _mixer()
    om = memopt.optimize(model, example_inputs=x, optimizer="sgd")
    again = memopt.optimize(copy.deepcopy(model), example_inputs=x, optimizer="sgd", plan=om.plan)
    assert again.plan.recompute_chunks == om.plan.recompute_chunks > 1
    assert again.plan.estimated_peak_bytes == om.plan.estimated_peak_bytes


def test_a_new_batch_size_served_by_the_plan_keeps_its_recompute_chunks():
    model, x = _mixer()
    om = memopt.optimize(model, example_inputs=x, optimizer="sgd")
    assert om.plan.recompute_chunks > 1
    bigger = torch.randn(48, 16, 32)
    om(bigger).sum().backward()
    reused = om._memopt_last
    assert type(reused).__name__ == "Reused"  # the plan served the new size: no capture, no planner
    assert recompute_chunks_of(reused.graph_module) == om.plan.recompute_chunks
    measured = memopt.measure(om, bigger, optimizer="sgd").peak_bytes
    assert measured == reused.estimate.peak_bytes
    whole = copy_graph_module(reused.graph_module)
    set_recompute_chunks(whole, 1)
    args, kwargs = normalize_inputs(bigger)
    assert annotate(whole, args, kwargs, optimizer="sgd").peak_bytes > measured


def test_a_dynamically_exported_graphs_blocks_read_their_batch_off_their_input_and_take_chunks():
    torch.manual_seed(0)
    model, x = ExportedMixer(), torch.randn(32, 16, 32)
    om = memopt.optimize(model, example_inputs=x, optimizer="sgd")
    bigger = torch.randn(48, 16, 32)
    om(bigger).sum().backward()  # exported again with the batch dynamic: sizes are sym_size of the model's input
    built = om._memopt_last
    nodes = recomputed(built.graph_module)
    assert nodes and all(why_not_chunked(built.graph_module, n) is None for n in nodes)
    assert all(not isinstance(a, fx.Node) or a.target is not torch.ops.aten.sym_size.int for n in nodes for a in n.args)
    assert recompute_chunks_of(built.graph_module) > 1
    assert memopt.measure(om, bigger, optimizer="sgd").peak_bytes == built.estimate.peak_bytes


def test_a_block_reading_an_unannotated_node_is_measured_once_the_graph_is_annotated():
    model, x = _mixer()
    om = memopt.optimize(model, example_inputs=x, optimizer="sgd")
    gm = copy_graph_module(next(iter(om._memopt_built.values())).graph_module)
    node = recomputed(gm)[1]
    node.meta.pop(SEPARABLE_KEY, None)
    source = next(a for a in node.args if isinstance(a, fx.Node) and a.op != "get_attr")
    source.meta.pop(META_KEY)  # as a node a pass just made
    assert unannotated(gm) and why_not_chunked(gm, node).endswith("has no single tensor shape from the cost model")
    assert SEPARABLE_KEY not in node.meta  # that verdict is not kept
    args, kwargs = normalize_inputs(x)
    annotate(gm, args, kwargs, simulate=False)
    assert not unannotated(gm) and why_not_chunked(gm, node) is None


def test_blocks_with_batch_norm_are_never_chunked():
    model, x = build("tiny_resnet")
    config = memopt.Config(recompute=memopt.RecomputeConfig(segments=None, bits=8), stash=None, fewbit=None,
                           fidelity=None)
    om = memopt.optimize(model, example_inputs=x, config=config, optimizer="sgd")
    gm = next(iter(om._memopt_built.values())).graph_module
    nodes = recomputed(gm)
    assert nodes and set_recompute_chunks(gm, 4) == 0
    assert all("its samples mix" in why_not_chunked(gm, n) for n in nodes)
    assert all(RecomputeSpec.of(n).chunks == 1 for n in nodes)


def test_recompute_chunks_must_be_a_positive_int():
    model, x = _mixer()
    om = memopt.optimize(model, example_inputs=x, optimizer="sgd")
    gm = next(iter(om._memopt_built.values())).graph_module
    with pytest.raises(ValueError, match=r"recompute chunks must be an int >= 1, got 0"):
        set_recompute_chunks(gm, 0)
