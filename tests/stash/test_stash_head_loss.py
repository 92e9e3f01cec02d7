"""A language model's head and loss as one op (memopt/stash/loss.py ``linear_cross_entropy_rows``,
passes/stash/head_loss.py): the loss and the logits are eager's bit for bit, the logits are not kept, the step's
peak falls, and the gradients are eager's up to the weight gradient's sum over row chunks."""
from __future__ import annotations

import copy

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import memopt
from memopt.core.errors import MemoptError
from memopt.stash import loss as stash_loss
from memopt.stash.loss import HeadLossSpec, cross_entropy_rows, linear_cross_entropy_rows

ONLY_EXTRAS = dict(fewbit=None, recompute=None, reversible=None, fidelity=None)


def _eager(x, weight, bias, target, up, reduction="mean"):
    logits = F.linear(x, weight, bias)
    flat = (logits.to(up) if up else logits).view(-1, logits.shape[-1])
    return F.cross_entropy(flat, target, reduction=reduction), logits


def _run(fn, tensors, extra):
    """(loss, logits, gradients) of ``loss + extra * sum(logits²)``: a second use of the logits output when
    ``extra`` is not 0."""
    for t in tensors:
        t.grad = None
    loss, logits = fn()
    total = loss + extra * logits.float().pow(2).sum() if extra else loss
    total.backward()
    return loss.detach(), logits.detach(), [t.grad.clone() for t in tensors]


@pytest.mark.parametrize("autocast", [False, True])
@pytest.mark.parametrize("extra", [0.0, 1e-3])
def test_the_loss_and_logits_are_eagers_and_the_gradients_within_rounding(monkeypatch, autocast, extra):
    monkeypatch.setattr(stash_loss, "CHUNK_BYTES", 64 << 10)  # many chunks
    torch.manual_seed(0)
    x = torch.randn(4, 50, 32, requires_grad=True)
    weight, bias = torch.randn(300, 32, requires_grad=True), torch.randn(300, requires_grad=True)
    target = torch.randint(0, 300, (200,))
    target[::9] = -100
    up = "float32" if autocast else ""
    with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
        eager = _run(lambda: _eager(x, weight, bias, target, torch.float32 if autocast else None),
                     (x, weight, bias), extra)
        ours = _run(lambda: linear_cross_entropy_rows(x, weight, bias, target, HeadLossSpec(1, -100, up)),
                    (x, weight, bias), extra)
    assert torch.equal(eager[0], ours[0]) and torch.equal(eager[1], ours[1])
    assert ours[1].dtype == (torch.bfloat16 if autocast else torch.float32)
    # the input gradient is eager's kernel on each chunk of rows; weight and bias sum over the chunks (float32
    # sums of bf16 products under autocast, rounded once)
    tolerance = 1e-2 if autocast else 1e-5
    for name, a, b in zip(("x", "weight", "bias"), eager[2], ours[2]):
        assert a.dtype == b.dtype and a.shape == b.shape, name
        assert float((a - b).abs().max()) <= tolerance * float(a.abs().max()), name


@pytest.mark.parametrize("autocast", [False, True])
def test_up_autocast_casts_as_autocast_does_when_the_op_runs(autocast):
    """``up="autocast"`` (a cross-entropy on bf16 logits that autocast up-cast while planning): float32 under
    autocast, the logits' own dtype without it: eager's loss either way."""
    torch.manual_seed(0)
    x = torch.randn(2, 24, 16, dtype=torch.bfloat16, requires_grad=True)
    weight = torch.randn(64, 16, dtype=torch.bfloat16, requires_grad=True)
    target = torch.randint(0, 64, (48,))
    with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
        expected = F.cross_entropy(F.linear(x, weight).view(-1, 64), target)
        got, _ = linear_cross_entropy_rows(x, weight, None, target, HeadLossSpec(1, -100, "autocast"))
    assert got.dtype == (torch.float32 if autocast else torch.bfloat16) and torch.equal(expected, got)
    got.backward()


def test_off_the_cpu_the_loss_is_eagers_whole_call_and_the_gradients_the_same(monkeypatch):
    """Off the CPU the loss value comes from eager's two whole-tensor calls (their reduction order unchecked
    there); the gradients come from the same chunks either way (checked here on the CPU)."""
    torch.manual_seed(0)
    x, weight = torch.randn(3, 40, 16, requires_grad=True), torch.randn(100, 16, requires_grad=True)
    target = torch.randint(0, 100, (120,))
    results = []
    for whole in (False, True):
        monkeypatch.setattr(stash_loss, "_whole_loss", lambda device, whole=whole: whole)
        results.append(_run(lambda: linear_cross_entropy_rows(x, weight, None, target, HeadLossSpec(1, -100, "")),
                            (x, weight), 0.0))
    assert torch.equal(results[1][0], F.cross_entropy(F.linear(x, weight).view(-1, 100), target).detach())
    assert torch.equal(results[0][0], results[1][0])
    assert all(torch.equal(a, b) for a, b in zip(results[0][2], results[1][2]))


@pytest.mark.parametrize("reduction", [1, 2])
def test_gradcheck_in_float64(reduction):
    torch.manual_seed(0)
    x = torch.randn(2, 6, 5, dtype=torch.float64, requires_grad=True)
    weight = torch.randn(7, 5, dtype=torch.float64, requires_grad=True)
    bias = torch.randn(7, dtype=torch.float64, requires_grad=True)
    target = torch.tensor([0, 1, 2, 3, 4, 5, 6, -100, 1, 2, 3, 4])

    def f(x, weight, bias):
        loss, logits = linear_cross_entropy_rows(x, weight, bias, target, HeadLossSpec(reduction, -100, ""))
        return loss, logits.sin().sum()  # the logits output used too

    assert torch.autograd.gradcheck(f, (x, weight, bias))
    assert torch.autograd.gradcheck(lambda x, w: linear_cross_entropy_rows(x, w, None, target, HeadLossSpec(
        reduction, -100, ""))[0], (x, weight))


def test_without_grad_it_is_eagers_call_and_double_backward_is_refused():
    x, weight = torch.randn(3, 4), torch.randn(9, 4)
    target = torch.tensor([1, 2, 3])
    loss, logits = linear_cross_entropy_rows(x, weight, None, target, HeadLossSpec(1, -100, ""))
    assert loss.grad_fn is None and torch.equal(loss, F.cross_entropy(x @ weight.t(), target))
    loss, _ = linear_cross_entropy_rows(x, weight.requires_grad_(), None, target, HeadLossSpec(1, -100, ""))
    with pytest.raises(MemoptError, match="linear_cross_entropy_rows.*head_loss=False"):
        torch.autograd.grad(torch.autograd.grad(loss, weight, create_graph=True)[0].sum(), weight)


class TinyLM(nn.Module):
    """An embedding, a hidden layer and a 512-token head; the loss inside the forward as Hugging Face's causal LMs
    compute it (``logits.float()``, ``view(-1, vocab)``); ``extra``: the logits also feed something else."""

    def __init__(self, vocab: int = 512, extra: bool = False):
        super().__init__()
        self.embed, self.hidden, self.head = nn.Embedding(512, 32), nn.Linear(32, 32), nn.Linear(32, vocab)
        self.extra = extra

    def forward(self, tokens, labels):
        logits = self.head(torch.tanh(self.hidden(self.embed(tokens))))
        loss = F.cross_entropy(logits.float().view(-1, logits.shape[-1]), labels.view(-1))
        if self.extra:
            loss = loss + logits.float().logsumexp(-1).mean()
        return loss, logits


def _targets(gm):
    return {n.target for n in gm.graph.nodes if n.op == "call_function"}


@pytest.mark.parametrize("autocast", [False, True])
def test_a_models_head_and_loss_become_one_op_that_keeps_no_logits(autocast):
    torch.manual_seed(0)
    model = TinyLM()
    tokens, labels = torch.randint(0, 512, (8, 64)), torch.randint(0, 512, (8, 64))
    loss_fn = lambda out: out[0]  # noqa: E731
    cast = lambda: torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast)  # noqa: E731
    with cast():
        om = memopt.optimize(model, example_inputs=(tokens, labels), loss_fn=loss_fn, config=memopt.Config(
            **ONLY_EXTRAS, stash=memopt.StashConfig(generic=False)))
        rows = memopt.optimize(model, example_inputs=(tokens, labels), loss_fn=loss_fn, config=memopt.Config(
            **ONLY_EXTRAS, stash=memopt.StashConfig(generic=False, head_loss=False)))
    assert linear_cross_entropy_rows in _targets(om.graph_modules[""]), om.report()
    assert cross_entropy_rows in _targets(rows.graph_modules[""])
    assert "keeps the head's input, not the logits" in om.report()
    # the loss alone keeps the logits and makes their whole gradient; the op holds only the logits output, in
    # the forward, beside its chunks' temporaries
    logits_bytes = 8 * 64 * 512 * 4
    assert om.plan.estimated_peak_bytes <= rows.plan.estimated_peak_bytes - logits_bytes // 2
    with cast():
        measured = memopt.measure(om, (tokens, labels), loss_fn)
    assert abs(measured.peak_bytes - om.plan.estimated_peak_bytes) <= 4096  # the labels the loss closes over
    eager = copy.deepcopy(model)
    results = []
    for module, params in ((eager, list(eager.parameters())), (om, list(model.parameters()))):
        with cast():
            loss, logits = module(tokens, labels)
        loss.backward()
        results.append((loss.detach(), logits.detach(), [p.grad for p in params]))
    assert torch.equal(results[0][0], results[1][0]) and torch.equal(results[0][1], results[1][1])
    for a, b in zip(results[0][2], results[1][2]):
        assert F.cosine_similarity(a.flatten(), b.flatten(), 0) > 0.9999


@pytest.mark.parametrize("why", ["classifier", "extra"])
def test_no_fusion_where_it_would_free_nothing(why):
    """A head with fewer classes than input features, or logits that feed more than the loss, keep the
    cross-entropy in chunks of rows alone."""
    model = TinyLM(vocab=16) if why == "classifier" else TinyLM(extra=True)
    tokens, labels = torch.randint(0, 512, (4, 16)), torch.randint(0, 16, (4, 16))
    om = memopt.optimize(model, example_inputs=(tokens, labels), loss_fn=lambda out: out[0], config=memopt.Config(
        **ONLY_EXTRAS, stash=memopt.StashConfig(generic=False)))
    found = _targets(om.graph_modules[""])
    assert linear_cross_entropy_rows not in found and cross_entropy_rows in found


def test_a_fused_graph_pickles_and_runs_the_same(tmp_path):
    """The op and its spec resolve by name in a pickled graph (``torch.save`` / ``memopt.load`` read them)."""
    import pickle

    torch.manual_seed(0)
    model = TinyLM()
    tokens, labels = torch.randint(0, 512, (2, 16)), torch.randint(0, 512, (2, 16))
    om = memopt.optimize(model, example_inputs=(tokens, labels), loss_fn=lambda out: out[0], config=memopt.Config(
        **ONLY_EXTRAS, stash=memopt.StashConfig(generic=False)))
    gm = pickle.loads(pickle.dumps(om.graph_modules[""]))
    assert linear_cross_entropy_rows in _targets(gm)
    assert "HeadLossSpec(1, -100, " in gm.code
    expected, got = om.graph_modules[""](tokens, labels), gm(tokens, labels)
    assert all(torch.equal(a, b) for a, b in zip(expected, got))


def _hf(name: str):
    transformers = pytest.importorskip("transformers")
    tiny = dict(vocab_size=1024, num_hidden_layers=2, num_attention_heads=4, intermediate_size=128)
    if name == "llama":
        return transformers.LlamaForCausalLM(transformers.LlamaConfig(
            hidden_size=64, num_key_value_heads=4, max_position_embeddings=64, use_cache=False,
            tie_word_embeddings=False, attn_implementation="sdpa", **tiny))
    if name == "gpt2":  # tied: the head's weight is the embedding's
        return transformers.GPT2LMHeadModel(transformers.GPT2Config(vocab_size=1024, n_embd=64, n_layer=2, n_head=4,
                                                                    n_positions=64, use_cache=False))
    if name == "gpt_neox":
        return transformers.GPTNeoXForCausalLM(transformers.GPTNeoXConfig(hidden_size=64, max_position_embeddings=64,
                                                                          use_cache=False, **tiny))
    return transformers.BertForMaskedLM(transformers.BertConfig(hidden_size=64, **tiny))


@pytest.mark.slow
@pytest.mark.parametrize("name, autocast", [("llama", False), ("llama", True), ("gpt2", False), ("gpt2", True),
                                            ("gpt_neox", True), ("bert_mlm", False), ("bert_mlm", True)])
def test_hugging_face_language_models_with_the_default_config(name, autocast):
    torch.manual_seed(0)
    model = _hf(name).train()
    ids = torch.randint(0, 1024, (4, 48))
    inputs = {"input_ids": ids, "labels": ids}
    eager = copy.deepcopy(model)
    cast = lambda: torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast)  # noqa: E731
    with cast():
        om = memopt.optimize(model, example_inputs=inputs, loss_fn=lambda out: out.loss)
    assert any(linear_cross_entropy_rows in _targets(gm) for gm in om.graph_modules.values()), om.report()
    with cast():
        measured = memopt.measure(om, inputs, lambda out: out.loss)
    assert abs(measured.peak_bytes - om.plan.estimated_peak_bytes) <= 0.01 * measured.peak_bytes
    torch.manual_seed(1)
    with cast():
        expected = eager(**inputs)
    torch.manual_seed(1)
    with cast():
        got = om(**inputs)
    assert torch.equal(expected.loss, got.loss) and torch.equal(expected.logits, got.logits)
    expected.loss.backward()
    got.loss.backward()
    head = [(p.grad, q.grad) for (n, p), q in zip(eager.named_parameters(), model.parameters())
            if n.endswith(("lm_head.weight", "embed_out.weight", "wte.weight", "word_embeddings.weight"))]
    assert head and all(F.cosine_similarity(a.flatten(), b.flatten(), 0) > 0.999 for a, b in head)
