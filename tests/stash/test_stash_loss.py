"""Cross-entropy in chunks of rows (memopt/stash/loss.py, passes/stash/extras.py): the loss and the logits'
gradient are eager's bit for bit, the log-softmax is not kept, and the step's estimated peak is lower."""
from __future__ import annotations

import copy

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import memopt
from memopt.core.errors import MemoptError
from memopt.stash import loss as stash_loss
from memopt.stash.loss import REDUCTIONS, cross_entropy_rows


@pytest.mark.parametrize("reduction", ["mean", "sum"])
@pytest.mark.parametrize("rows, classes", [(3, 5), (1000, 37), (4096, 512)])
def test_loss_and_gradient_are_eagers_bit_for_bit_in_chunks(monkeypatch, reduction, rows, classes):
    monkeypatch.setattr(stash_loss, "CHUNK_BYTES", 64 << 10)  # many chunks
    torch.manual_seed(0)
    x = (torch.randn(rows, classes) * 3).requires_grad_()
    target = torch.randint(0, classes, (rows,))
    target[::7] = -100
    grad = torch.tensor(0.37)
    eager = F.cross_entropy(x, target, reduction=reduction)
    (expected,) = torch.autograd.grad(eager, x, grad)
    ours = cross_entropy_rows(x, target, REDUCTIONS[reduction], -100)
    (got,) = torch.autograd.grad(ours, x, grad)
    assert torch.equal(ours, eager) and torch.equal(got, expected)


def test_under_autocast_it_is_eagers_bit_for_bit():
    torch.manual_seed(0)
    x, target = torch.randn(64, 33).requires_grad_(), torch.randint(0, 33, (64,))
    with torch.autocast("cpu", dtype=torch.bfloat16):
        eager, ours = F.cross_entropy(x, target), cross_entropy_rows(x, target, 1, -100)
    assert torch.equal(eager, ours)
    assert torch.equal(torch.autograd.grad(eager, x)[0], torch.autograd.grad(ours, x)[0])


@pytest.mark.parametrize("ignore_index", [0, 3, -1, -100])
def test_any_ignored_class_is_eagers_bit_for_bit(ignore_index):
    torch.manual_seed(0)
    x, target = torch.randn(300, 7).requires_grad_(), torch.randint(0, 7, (300,))
    target[::5] = ignore_index
    for reduction in ("mean", "sum"):
        eager = F.cross_entropy(x, target, reduction=reduction, ignore_index=ignore_index)
        ours = cross_entropy_rows(x, target, REDUCTIONS[reduction], ignore_index)
        assert torch.equal(eager, ours)
        assert torch.equal(torch.autograd.grad(eager, x)[0], torch.autograd.grad(ours, x)[0])


def test_gradcheck_in_float64():
    x = torch.randn(6, 5, dtype=torch.float64, requires_grad=True)
    target = torch.tensor([0, 4, -100, 2, 1, 3])
    for reduction in (1, 2):
        assert torch.autograd.gradcheck(lambda z: cross_entropy_rows(z, target, reduction, -100), (x,))


def test_other_dtypes_and_no_grad_run_the_stock_op():
    x, target = torch.randn(8, 5).bfloat16().requires_grad_(), torch.randint(0, 5, (8,))
    assert cross_entropy_rows(x, target, 1, -100).grad_fn.name() != "_CrossEntropyRowsBackward"
    with torch.no_grad():
        assert torch.equal(cross_entropy_rows(x.float(), target, 1, -100), F.cross_entropy(x.float(), target))


def test_double_backward_names_the_op_and_the_fix():
    x = torch.randn(4, 3, requires_grad=True)
    loss = cross_entropy_rows(x, torch.tensor([0, 1, 2, 0]), 1, -100)
    with pytest.raises(MemoptError, match="cross_entropy_rows.*compact_extras=False"):
        torch.autograd.grad(loss, x, create_graph=True)


class TinyLM(nn.Module):
    """Embedding, a hidden layer and a head over a 512-token vocabulary; the loss inside the forward (as Hugging
    Face's causal LMs compute it when given labels), written in one of three spellings."""

    def __init__(self, spelling: str):
        super().__init__()
        self.embed, self.hidden, self.head = nn.Embedding(512, 32), nn.Linear(32, 32), nn.Linear(32, 512)
        self.spelling, self.loss = spelling, nn.CrossEntropyLoss(ignore_index=-100)

    def forward(self, tokens, labels):
        logits = self.head(torch.tanh(self.hidden(self.embed(tokens)))).float()
        flat, target = logits.view(-1, logits.shape[-1]), labels.view(-1)
        if self.spelling == "module":
            loss = self.loss(flat, target)
        elif self.spelling == "sum":
            loss = F.cross_entropy(flat, target, reduction="sum") / target.numel()
        else:
            loss = F.cross_entropy(flat, target, ignore_index=-100)
        return loss, logits


@pytest.mark.parametrize("spelling", ["functional", "module", "sum"])
def test_a_models_loss_is_rewritten_exactly_and_lowers_the_estimated_peak(spelling):
    torch.manual_seed(0)
    model = TinyLM(spelling)
    tokens, labels = torch.randint(0, 512, (8, 64)), torch.randint(0, 512, (8, 64))
    labels[:, :3] = -100
    only_extras = memopt.Config(fewbit=None, recompute=None, reversible=None,
                                stash=memopt.StashConfig(generic=False, head_loss=False), fidelity=None)
    loss_fn = lambda out: out[0]  # noqa: E731
    om = memopt.optimize(model, example_inputs=(tokens, labels), config=only_extras, loss_fn=loss_fn)
    rows = [n for n in om.graph_modules[""].graph.nodes if n.target is cross_entropy_rows]
    assert len(rows) == 1, om.report()
    stock = memopt.optimize(model, example_inputs=(tokens, labels), config=memopt.Config.exact(),
                            loss_fn=loss_fn)
    assert om.plan.estimated_peak_bytes < stock.plan.estimated_peak_bytes
    measured = memopt.measure(om, (tokens, labels), loss_fn)
    assert abs(measured.peak_bytes - om.plan.estimated_peak_bytes) <= 4096  # the labels the loss closes over
    grads = []
    for module in (model, om):
        module.zero_grad()
        loss, logits = module(tokens, labels)
        loss.backward()
        grads.append((loss.detach(), logits.detach(), [p.grad.clone() for p in model.parameters()]))
    assert torch.equal(grads[0][0], grads[1][0]) and torch.equal(grads[0][1], grads[1][1])
    assert all(torch.equal(a, b) for a, b in zip(grads[0][2], grads[1][2]))


@pytest.mark.slow
def test_a_hugging_face_masked_lm_loss_is_rewritten_and_training_stays_bit_identical():
    transformers = pytest.importorskip("transformers")
    config = transformers.BertConfig(vocab_size=300, hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
                                     intermediate_size=64)
    torch.manual_seed(0)
    model = transformers.BertForMaskedLM(config).train()
    ids = torch.randint(0, 300, (4, 24))
    labels = ids.clone()
    labels[:, :5] = -100
    inputs = {"input_ids": ids, "labels": labels}
    eager = copy.deepcopy(model)
    extras_only = memopt.Config(fewbit=None, recompute=None, reversible=None, fidelity=None, stash=memopt.StashConfig(
        generic=False, coded_ops=(), recompute_weights=False, head_loss=False))
    om = memopt.optimize(model, example_inputs=inputs, config=extras_only, loss_fn=lambda out: out.loss)
    assert any(n.target is cross_entropy_rows for gm in om.graph_modules.values() for n in gm.graph.nodes)
    torch.manual_seed(1)
    expected = eager(**inputs)
    expected.loss.backward()
    torch.manual_seed(1)
    got = om(**inputs)
    got.loss.backward()
    assert torch.equal(expected.loss, got.loss) and torch.equal(expected.logits, got.logits)
    assert all(torch.equal(p.grad, q.grad) for p, q in zip(eager.parameters(), model.parameters()))
