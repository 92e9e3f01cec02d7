"""Attention masks a trace builds from constants where the eager model passes none (memopt/capture/attention_masks.py): Hugging
Face models skip an all-true mask, or pass ``is_causal=True``, after looking at its values, which a trace
cannot do. Such a mask made the captured graph keep bytes eager does not, so whole models (HF ViT, Llama, ...)
fell back to per-submodule capture; now the capture runs what eager runs, bit for bit."""
import copy

import pytest
import torch
import torch.nn.functional as F
from torch import fx, nn

import memopt
from conftest import assert_step_as_eager
from memopt.capture.attention_masks import drop_constant_masks


class TracedMask(nn.Module):
    """Eager: SDPA with no mask (or ``is_causal``); under torch.export: the same attention with a mask built
    from constants, as HF's mask functions do. ``mask`` names the traced mask: "none" (all true), "causal",
    "float-causal" (0 / -inf), "window" (masks something besides the causal part: eager must keep it too),
    "input" (computed from the input: data). Iterating a tensor makes symbolic tracing fail, so it is exported."""

    def __init__(self, mask="none", heads=2, d=8):
        super().__init__()
        self.q, self.k, self.v, self.o = (nn.Linear(heads * d, heads * d) for _ in range(4))
        self.mask, self.heads, self.d = mask, heads, d

    def _built(self, x, n):
        ones = torch.ones(n, n, dtype=torch.bool)
        if self.mask == "none":
            return ones
        if self.mask == "causal":
            return ones.tril()
        if self.mask == "float-causal":
            return torch.zeros(n, n).masked_fill(~ones.tril(), float("-inf"))
        if self.mask == "window":
            return ones.tril() & ~ones.tril(-2)
        return (x[0, :, :1] > -10).expand(n, n)  # "input": all true, but read from the data

    def forward(self, x):
        x = torch.stack(list(x.unbind(0)))
        b, n, c = x.shape
        q, k, v = (f(x).view(b, n, self.heads, self.d).transpose(1, 2) for f in (self.q, self.k, self.v))
        if torch.compiler.is_exporting() or self.mask in ("window", "input"):
            y = F.scaled_dot_product_attention(q, k, v, attn_mask=self._built(x, n)[None, None].expand(b, 1, n, n))
        else:
            y = F.scaled_dot_product_attention(q, k, v, is_causal=self.mask != "none")
        return self.o(y.transpose(1, 2).reshape(b, n, c))


def _sdpa_masks(gm):
    return [(n.kwargs.get("attn_mask", n.args[3] if len(n.args) > 3 else None),
             n.kwargs.get("is_causal", n.args[5] if len(n.args) > 5 else False))
            for n in gm.graph.nodes if n.op == "call_function" and "scaled_dot_product" in str(n.target)]


@pytest.mark.parametrize("mask, causal", [("none", False), ("causal", True), ("float-causal", True)])
def test_a_constant_mask_is_what_eager_runs_and_the_model_is_captured_whole(mask, causal):
    torch.manual_seed(0)
    model, x = TracedMask(mask).train(), torch.randn(2, 6, 16)
    reference = copy.deepcopy(model)
    om = memopt.optimize(model, example_inputs=x, config=memopt.Config.exact())
    assert om.plan.capture == "export"
    assert _sdpa_masks(om.graph_module) == [(None, causal)]
    assert_step_as_eager(om, model, reference, x)


@pytest.mark.parametrize("mask", ["window", "input"])
def test_a_mask_that_masks_something_or_reads_the_input_stays(mask):
    torch.manual_seed(0)
    model, x = TracedMask(mask).train(), torch.randn(2, 6, 16)
    om = memopt.optimize(model, example_inputs=x, config=memopt.Config.exact())
    assert om.plan.capture == "export"
    (kept, causal), = _sdpa_masks(om.graph_module)
    assert isinstance(kept, fx.Node) and causal is False
    assert torch.equal(om(x), copy.deepcopy(model)(x))


def test_a_rectangular_lower_triangle_is_not_taken_for_causal():
    """SDPA's is_causal aligns the triangle to the top left; a (3, 5) tril mask is not what it would build for
    every shape, and only square ones are replaced."""

    class Rect(nn.Module):
        def forward(self, q, k, v):
            return F.scaled_dot_product_attention(q, k, v, attn_mask=torch.ones(3, 5, dtype=torch.bool).tril())

    gm = fx.symbolic_trace(Rect())
    assert drop_constant_masks(gm) == []
    assert isinstance(_sdpa_masks(gm)[0][0], fx.Node)


def test_a_mask_computed_from_a_parameter_stays_even_when_it_is_zero_now():
    """BEiT's relative position bias: a mask learned from a table initialised to zeros. All zero at init, so it
    masks nothing now, but it is a parameter's path: dropping it would drop the table's gradient."""

    class Learned(nn.Module):
        def __init__(self):
            super().__init__()
            self.table = nn.Parameter(torch.zeros(4, 4))

        def forward(self, q, k, v):
            return F.scaled_dot_product_attention(q, k, v, attn_mask=self.table * 2)

    gm = fx.symbolic_trace(Learned())
    assert drop_constant_masks(gm) == []
    q = torch.randn(1, 1, 4, 8)
    out = gm(q, q, q)
    out.sum().backward()
    assert gm.table.grad is not None


class LearnedBiasPlusTracedMask(nn.Module):
    """A learned relative-position bias as the mask, eager passing the bias alone. Under torch.export HF combines
    it with the all-true boolean padding mask it materialised: BEiT adds it (+1 everywhere, a shift the softmax
    nearly cancels, but not bit for bit); T5 superposes it with ``where(mask, bias, min).contiguous()``, whose
    ``where`` keeps the boolean mask for backward (the graph kept 12 bytes more than eager and was refused)."""

    def __init__(self, combine="add", n=6, heads=2, d=8):
        super().__init__()
        self.qkv = nn.Linear(heads * d, 3 * heads * d)
        self.table = nn.Parameter(torch.randn(n, n, heads))
        self.combine, self.heads, self.d = combine, heads, d

    def forward(self, x):
        x = torch.stack(list(x.unbind(0)))
        b, n, c = x.shape
        q, k, v = self.qkv(x).view(b, n, 3, self.heads, self.d).permute(2, 0, 3, 1, 4)
        bias = self.table.permute(2, 0, 1)[None]  # not contiguous, as T5's position bias
        if torch.compiler.is_exporting():
            mask = (torch.arange(n) >= 0)[None, None, None, :].expand(b, 1, n, n)
            bias = bias + mask if self.combine == "add" else torch.where(mask, bias, torch.finfo(bias.dtype).min)
        if self.combine == "where":
            bias = bias.contiguous()
        return F.scaled_dot_product_attention(q, k, v, attn_mask=bias).transpose(1, 2).reshape(b, n, c)


@pytest.mark.parametrize("combine", ["add", "where"])
def test_a_learned_bias_with_an_all_true_traced_mask_is_the_bias_alone(combine):
    torch.manual_seed(0)
    model, x = LearnedBiasPlusTracedMask(combine).train(), torch.randn(2, 6, 16)
    reference = copy.deepcopy(model)
    om = memopt.optimize(model, example_inputs=x, config=memopt.Config.exact())
    assert om.plan.capture == "export"
    (mask, _), = _sdpa_masks(om.graph_module)
    assert isinstance(mask, fx.Node) and not any(word in mask.name for word in ("add", "where"))
    assert not any("where" in node.name for node in om.graph_module.graph.nodes)
    out, expected = om(x), reference(x)
    assert torch.equal(out, expected)
    out.sum().backward()
    expected.sum().backward()
    assert torch.equal(model.table.grad, reference.table.grad)
    assert memopt.measure(om, x).saved_bytes == memopt.measure(reference, x).saved_bytes


class GroupedQueryAttention(nn.Module):
    """HF's SDPA attention with one key/value head for two query heads: eager (no mask) passes the key and value
    heads as they are with ``enable_gqa=True``; under torch.export HF materialised a mask, so it repeated them per
    query head (``repeat_kv``) and SDPA kept the repeated copies for backward."""

    def __init__(self, heads=2, d=8):
        super().__init__()
        self.q, self.o = nn.Linear(heads * d, heads * d), nn.Linear(heads * d, heads * d)
        self.k, self.v = nn.Linear(heads * d, d), nn.Linear(heads * d, d)
        self.heads, self.d = heads, d

    def forward(self, x):
        x = torch.stack(list(x.unbind(0)))
        b, n, c = x.shape
        q = self.q(x).view(b, n, self.heads, self.d).transpose(1, 2)
        k, v = (f(x).view(b, n, 1, self.d).transpose(1, 2) for f in (self.k, self.v))
        if torch.compiler.is_exporting():
            k, v = (t[:, :, None].expand(b, 1, self.heads, n, self.d).reshape(b, self.heads, n, self.d)
                    for t in (k, v))
            mask = torch.ones(n, n, dtype=torch.bool).tril()[None, None].expand(b, 1, n, n)
            y = F.scaled_dot_product_attention(q, k, v, attn_mask=mask)
        else:
            y = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
        return self.o(y.transpose(1, 2).reshape(b, n, c))


@pytest.mark.parametrize("autocast", [False, True], ids=["float32", "bf16-autocast"])
def test_grouped_key_value_heads_repeated_by_the_trace_are_passed_as_eager_passes_them(autocast):
    torch.manual_seed(0)
    model, x = GroupedQueryAttention().train(), torch.randn(2, 6, 16)
    reference = copy.deepcopy(model)
    context = torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast)
    with context:
        om = memopt.optimize(model, example_inputs=x, config=memopt.Config.exact())
    assert om.plan.capture == "export"
    sdpa, = [n for n in om.graph_module.graph.nodes if "scaled_dot_product" in str(n.target)]
    assert sdpa.kwargs["enable_gqa"] is True and sdpa.kwargs["is_causal"] is True
    assert not any(n.target is torch.ops.aten.expand.default for n in om.graph_module.graph.nodes)
    with context:
        out, expected = om(x), reference(x)
        assert torch.equal(out, expected)
        out.float().sum().backward()
        expected.float().sum().backward()
        assert memopt.measure(om, x).saved_bytes == memopt.measure(reference, x).saved_bytes
    assert all(torch.equal(a.grad, b.grad) for a, b in zip(model.parameters(), reference.parameters()))
