"""Coded ops (memopt/stash/coded.py, passes/stash/coded.py): norms, attention, products, softmax and gated units
keep their activations as codes: forward bit-identical, gradients close, bytes lower and estimated exactly,
storages kept by exact nodes left alone with the reason."""
import copy
import pickle

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import memopt
from memopt.core.meta import DECISION_KEY
from memopt.fidelity.gate import parameter_fidelity
from memopt.stash.coded import CodedSpec, coded_call, name_of, resolve
from memopt.stash.config import CODED_OPS
from memopt.stash.generic import EncodeSpec, FromCodesSpec, generic_encode, linear_from_codes

# coded ops alone: no block recomputed from codes by the default plan's peak-first step
CODED = memopt.Config(stash=memopt.StashConfig(generic=True, coded_ops=CODED_OPS), fewbit=None, fidelity=None,
                      recompute=memopt.RecomputeConfig(peak_first_bits=None))
EXACT = memopt.Config(stash=None, fewbit=None, fidelity=None)


@pytest.fixture(autouse=True)
def _one_thread(one_thread):
    yield


class Block(nn.Module):
    """A pre-norm transformer block with a gated MLP, RMSNorm written out (as Hugging Face Llama does) and
    attention dropout: every coded kind but GroupNorm and an explicit softmax."""

    def __init__(self, d=32, heads=2, dropout=0.0):
        super().__init__()
        self.ln = nn.LayerNorm(d)
        self.qkv = nn.Linear(d, 3 * d)
        self.proj = nn.Linear(d, d)
        self.gate, self.up, self.down = nn.Linear(d, 2 * d), nn.Linear(d, 2 * d), nn.Linear(2 * d, d)
        self.weight = nn.Parameter(torch.ones(d))
        self.heads, self.dropout = heads, dropout

    def rms(self, x):
        return self.weight * (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6))

    def forward(self, x):
        b, t, d = x.shape
        q, k, v = self.qkv(self.ln(x)).view(b, t, 3, self.heads, d // self.heads).permute(2, 0, 3, 1, 4)
        a = F.scaled_dot_product_attention(q, k, v, dropout_p=self.dropout if self.training else 0.0, is_causal=True)
        x = x + self.proj(a.transpose(1, 2).reshape(b, t, d))
        h = self.rms(x)
        return x + self.down(F.silu(self.gate(h)) * self.up(h))


class Model(nn.Module):
    def __init__(self, dropout=0.0):
        super().__init__()
        self.inp = nn.Linear(16, 32)
        self.blocks = nn.Sequential(Block(dropout=dropout), Block(dropout=dropout))
        self.head = nn.Linear(32, 5)

    def forward(self, x):
        return self.head(self.blocks(self.inp(x)).softmax(-1))


class NormNet(nn.Module):
    """GroupNorm, an explicit attention softmax and a GELU-gated product."""

    def __init__(self):
        super().__init__()
        self.conv = nn.Conv1d(8, 16, 3, padding=1)
        self.gn = nn.GroupNorm(4, 16)
        self.q, self.k = nn.Linear(16, 16), nn.Linear(16, 16)
        self.a, self.b = nn.Linear(16, 16), nn.Linear(16, 16)

    def forward(self, x):
        h = self.gn(self.conv(x)).transpose(1, 2)
        att = torch.softmax(self.q(h) @ self.k(h).transpose(1, 2) / 4.0, dim=-1)
        h = att @ h
        return (F.gelu(self.a(h), approximate="tanh") * self.b(h)).sum(1)


def _step(module, x, seed=0):
    torch.manual_seed(seed)
    out = module(x)
    out.backward(torch.ones_like(out) + torch.arange(out.numel()).view_as(out) / out.numel())
    return out


@pytest.mark.parametrize("make,shape,dropout", [(Model, (4, 24, 16), 0.0), (Model, (4, 24, 16), 0.2),
                                                (NormNet, (4, 8, 20), None)])
def test_forward_identical_gradients_close_bytes_lower_and_estimated(make, shape, dropout):
    torch.manual_seed(0)
    model = make() if dropout is None else make(dropout)
    reference = copy.deepcopy(model)
    x = torch.randn(*shape)
    om = memopt.optimize(model, example_inputs=x, config=CODED)
    kinds = {d["reason"].split(":")[0] for n in om.graph_module.graph.nodes
             if (d := n.meta.get(DECISION_KEY)) and d.get("technique") == "stash" and d["reason"].startswith("coded")}
    expected = {"coded layer_norm", "coded sdpa", "coded pow", "coded mul", "coded gated", "coded softmax"} \
        if make is Model else {"coded group_norm", "coded softmax", "coded matmul", "coded gated"}
    assert expected <= kinds, kinds
    out, ref = _step(om, x), _step(reference, x)
    assert torch.equal(out, ref)  # same ops, same order, same dropout draws
    names = [n for n, _ in model.named_parameters()]
    figures = parameter_fidelity(names, [q.grad for q in reference.parameters()], [p.grad for p in model.parameters()],
                                 1e-3)
    worst = min((f["cosine"], n) for n, f in figures.items() if not f["excluded"])
    assert worst[0] > 0.999, worst  # an attention key bias (exact gradient ~0) is listed apart
    real = memopt.measure(om, x)
    assert real.saved_bytes == om.plan.estimated_saved_bytes
    stock = memopt.measure(reference, x).saved_bytes
    assert real.saved_bytes < 0.5 * stock, (real.saved_bytes, stock)


def test_dropout_is_replayed_in_backward():
    """With attention dropout the recomputed attention must draw the forward's mask: one coded sdpa's gradient
    against stock autograd's, from the same seed, agrees to the codes' precision (another mask would not)."""
    torch.manual_seed(0)
    q, k, v = (torch.randn(2, 2, 40, 16, requires_grad=True) for _ in range(3))
    spec = CodedSpec("F.scaled_dot_product_attention", (), 8, 256, True, "sdpa")
    torch.manual_seed(3)
    out = coded_call(spec, (q, k, v), {"dropout_p": 0.5}, ())
    g = torch.randn_like(out)
    mine = torch.autograd.grad(out, (q, k, v), g)
    torch.manual_seed(3)
    ref_out = F.scaled_dot_product_attention(q, k, v, dropout_p=0.5)
    assert torch.equal(out, ref_out)
    ref = torch.autograd.grad(ref_out, (q, k, v), g)
    for a, b in zip(mine, ref):
        assert torch.equal(a, b)  # nothing coded: the replay is exact


def test_a_storage_an_exact_node_keeps_is_not_coded_and_the_report_says_why():
    class Shared(nn.Module):
        def __init__(self):
            super().__init__()
            self.inp, self.ln = nn.Linear(8, 32), nn.LayerNorm(32)

        def forward(self, x):
            h = self.inp(x)
            return self.ln(h) + torch.sin(h)  # sin keeps h too: coding it for the LayerNorm would free nothing

    model, x = Shared(), torch.randn(4, 10, 8)
    reference = copy.deepcopy(model)
    om = memopt.optimize(model, example_inputs=x, config=CODED)
    ln = next(n for n in om.graph_module.graph.nodes if n.name == "ln_coded")
    assert ln.args[0].coded == ()  # h stays as it is; the LayerNorm's mean and rstd are what it frees
    assert "keeps its inputs as they are (nodes that stay exact keep them too)" in ln.meta[DECISION_KEY]["reason"]
    _step(om, x), _step(reference, x)
    for p, q in zip(model.parameters(), reference.parameters()):
        assert torch.allclose(p.grad, q.grad, rtol=1e-5, atol=1e-6)  # nothing coded: recomputed exactly
    assert memopt.measure(om, x).saved_bytes < memopt.measure(reference, x).saved_bytes


def test_deny_names_the_coded_unit_and_keeps_it_exact():
    torch.manual_seed(0)
    model, x = Model(), torch.randn(2, 8, 16)
    om = memopt.optimize(copy.deepcopy(model), example_inputs=x, config=CODED)
    units = {d["unit"] for n in om.graph_module.graph.nodes if (d := n.meta.get(DECISION_KEY)) and "unit" in d}
    sdpa = next(u for u in units if u.startswith("scaled_dot_product_attention") and u.endswith("_coded"))
    denied = memopt.Config(stash=memopt.StashConfig(generic=True, coded_ops=CODED_OPS, deny=(sdpa,)), fewbit=None,
                           fidelity=None)
    om2 = memopt.optimize(copy.deepcopy(model), example_inputs=x, config=denied)
    node = next(n for n in om2.graph_module.graph.nodes if n.name == sdpa[:-len("_coded")])
    assert "excluded by StashConfig allow/deny" in node.meta[DECISION_KEY]["reason"]


def test_names_resolve_to_the_same_callables_and_specs_pickle():
    for target in (F.layer_norm, torch.ops.aten.scaled_dot_product_attention.default, "softmax", torch.mul):
        assert resolve(name_of(target)) is (getattr(torch.Tensor, target) if isinstance(target, str) else target)
    spec = CodedSpec("F.layer_norm", (0,), 8, 256, False, "ln")
    assert pickle.loads(pickle.dumps(spec)) == spec
    with pytest.raises(memopt.MemoptError, match="unknown op 'F.nope'.*re-run memopt.optimize"):
        resolve("F.nope")


def test_coded_ops_are_validated():
    with pytest.raises(ValueError, match=r"StashConfig.coded_ops must be a tuple drawn from .*got \('attention',\)"):
        memopt.StashConfig(coded_ops=("attention",))
    with pytest.raises(ValueError, match="generic_bits"):
        memopt.StashConfig(generic_bits=9)


def test_double_backward_through_a_coded_op_names_it():
    x = torch.randn(4, 300, requires_grad=True)
    spec = CodedSpec("F.layer_norm", (0,), 8, 256, False, "ln_node")
    packed, params = generic_encode(x, EncodeSpec(8, 256))
    out = coded_call(spec, (x, (300,)), {}, ((packed, params),))
    with pytest.raises(memopt.MemoptError, match="double backward .* coded op ln_node"):
        torch.autograd.grad(out.pow(2).sum(), x, create_graph=True)


def test_a_slice_of_a_fused_projection_is_rebuilt_in_its_logical_order():
    """q, k, v as slices of one (b, t, 3, h, d) projection are not dense: their codes are taken in logical order
    and must be rebuilt in it (a permuted dense layout, as empty_like gives, scrambled them: cosine 0.23)."""
    torch.manual_seed(0)
    base = torch.randn(4, 24, 3, 2, 16, requires_grad=True)
    q, k, v = base.permute(2, 0, 3, 1, 4)
    spec = CodedSpec("F.scaled_dot_product_attention", (0, 1, 2), 8, 256, False, "s")
    out = coded_call(spec, (q, k, v), {}, tuple(generic_encode(t, EncodeSpec(8, 256)) for t in (q, k, v)))
    g = torch.randn_like(out)
    (mine,) = torch.autograd.grad(out, base, g)
    (ref,) = torch.autograd.grad(F.scaled_dot_product_attention(q, k, v), base, g)
    assert F.cosine_similarity(mine.flatten(), ref.flatten(), 0) > 0.9999
    w = torch.randn(16, 16, requires_grad=True)
    packed, params = generic_encode(q, EncodeSpec(8, 256))
    (gw,) = torch.autograd.grad(linear_from_codes(q, w, None, packed, params, FromCodesSpec(8, 256)).sum(), w)
    (rw,) = torch.autograd.grad(F.linear(q, w).sum(), w)
    assert F.cosine_similarity(gw.flatten(), rw.flatten(), 0) > 0.9999


class NormActNet(nn.Module):
    """BatchNorms no stash chain takes: BN -> SiLU, BN -> hard-swish, and a 3-D BN -> ReLU."""

    def __init__(self):
        super().__init__()
        self.c1, self.b1 = nn.Conv2d(3, 16, 3, padding=1), nn.BatchNorm2d(16)
        self.c2, self.b2 = nn.Conv2d(16, 16, 3, padding=1), nn.BatchNorm2d(16)
        self.c3, self.b3 = nn.Conv3d(1, 4, 3, padding=1), nn.BatchNorm3d(4, momentum=None)
        self.head = nn.Linear(16 + 4, 3)

    def forward(self, x):
        h = F.hardswish(self.b2(self.c2(F.silu(self.b1(self.c1(x))))))
        v = torch.relu(self.b3(self.c3(x[:, :1].unsqueeze(1))))
        return self.head(torch.cat([h.mean((2, 3)), v.mean((2, 3, 4))], 1))


def test_batch_norms_no_chain_takes_are_coded_and_update_their_statistics_once():
    torch.manual_seed(0)
    model, x = NormActNet(), torch.randn(4, 3, 12, 12)
    reference = copy.deepcopy(model)
    om = memopt.optimize(model, example_inputs=x, config=memopt.Config(fidelity=None, fewbit=None))
    coded = [n.meta[DECISION_KEY]["replaces"][0] for n in om.graph_module.graph.nodes
             if (d := n.meta.get(DECISION_KEY)) and d.get("reason", "").startswith("coded batch_norm")]
    assert sorted(coded) == ["b1", "b2", "b3"]
    for _ in range(2):
        out, ref = _step(om, x), _step(reference, x)
        assert torch.equal(out, ref)
    for (name, b), c in zip(model.named_buffers(), reference.buffers()):
        assert torch.equal(b, c), name  # running statistics and batch counters: once per step, as stock
    names = [n for n, _ in model.named_parameters()]
    figures = parameter_fidelity(names, [q.grad for q in reference.parameters()], [p.grad for p in model.parameters()],
                                 1e-3)
    assert min(f["cosine"] for f in figures.values() if not f["excluded"]) > 0.999
    assert memopt.measure(om, x).saved_bytes == om.plan.estimated_saved_bytes


def test_an_output_the_graph_updates_in_place_is_the_ops_own():
    """F.linear of a contiguous 3-D input with a bias returns a view; made inside a custom Function, autograd
    refused the in-place update that follows it in Hugging Face Wav2Vec2 ("Output 0 of LinearFromCodes is a view")."""
    class InPlace(nn.Module):
        def __init__(self):
            super().__init__()
            self.a, self.b = nn.Linear(8, 8), nn.Linear(8, 8)

        def forward(self, x):
            h = self.a(torch.tanh(x))
            h.mul_(2.0)
            return self.b(h.relu())

    torch.manual_seed(0)
    model, x = InPlace(), torch.randn(2, 300, 8)
    reference = copy.deepcopy(model)
    om = memopt.optimize(model, example_inputs=x, config=memopt.Config(fidelity=None, fewbit=None))
    assert any(n.op == "linear_from_codes" for n in om.plan.nodes)
    out, ref = _step(om, x), _step(reference, x)
    assert torch.equal(out, ref)


@pytest.mark.parametrize("row, group, expected", [(32, 256, 32), (256, 256, 256), (768, 256, 256), (300, 256, 150),
                                                  (1000, 256, 250), (257, 256, 256), (8, 256, 256), (49, 256, 49)])
def test_row_group_keeps_groups_within_a_row(row, group, expected):
    from memopt.stash.generic import row_group
    assert row_group(row, group) == expected


class SmallTokens(nn.Module):
    """A LayerNorm over tokens of which the first two are a thousand times smaller than the rest (HF DeiT's class
    and distillation tokens at init, in a later layer), then a linear: coded on the step of the patch tokens
    beside them, the small tokens rebuild as noise, which the norm scales up to unit size."""

    def __init__(self):
        super().__init__()
        self.proj, self.norm, self.fc = nn.Linear(32, 32), nn.LayerNorm(32), nn.Linear(32, 32)
        self.tokens = nn.Parameter(torch.randn(1, 2, 32) * 1e-3)

    def forward(self, x):
        h = torch.cat([self.tokens.expand(x.shape[0], 2, 32), self.proj(x)], 1)
        return self.fc(self.norm(h))


def test_a_norm_input_is_grouped_per_token_so_small_tokens_keep_their_shape():
    torch.manual_seed(0)
    model, x = SmallTokens().train(), torch.randn(2, 16, 32)
    reference = copy.deepcopy(model)
    om = memopt.optimize(model, example_inputs=x, config=CODED)
    coded = [n for n in om.graph_module.graph.nodes if n.target is coded_call]
    assert coded and coded[0].args[0].group == 32, "the LayerNorm's input is coded per token"
    assert torch.equal(om(x), reference(x))
    names = [n for n, _ in model.named_parameters()]
    grads = []
    for module, params in ((reference, reference), (om, model)):
        params.zero_grad()
        (module(x) * torch.randn(2, 18, 32, generator=torch.Generator().manual_seed(1))).sum().backward()
        grads.append([p.grad for p in params.parameters()])
    figures = parameter_fidelity(names, grads[0], grads[1], 0.0)
    assert min(f["cosine"] for f in figures.values()) > 0.999, figures
