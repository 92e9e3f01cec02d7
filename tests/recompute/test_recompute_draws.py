"""A random block recomputed in batch chunks keeps its draws as bits (memopt/recompute/draws.py): the forward draws
as eager's does (same outputs, same generator state after it), each range's second forward gets its rows of the
masks, so the gradients are those of one backward of the whole batch with the forward's masks; a draw that cannot be
kept as bits or cut by rows refuses with the block's name and the fix."""
import copy

import pytest
import torch
from torch import nn

import memopt
from memopt.recompute.chunks import recompute_inputs, separable
from memopt.recompute.draws import DrawError
from memopt.recompute.ops import RecomputeSpec, recompute_from_codes
from memopt.testing.compare import forward_identical_gradients_close


class DroppedBlock(nn.Module):
    """A transformer layer's shape of dropout: on the hidden units, on attention-like scores ``[b, heads, t, t]``
    and on the output."""

    def __init__(self, d=32, hidden=128, heads=2):
        super().__init__()
        self.heads = heads
        self.norm, self.fc1, self.fc2 = nn.LayerNorm(d), nn.Linear(d, hidden), nn.Linear(hidden, d)
        self.drop_hidden, self.drop_scores, self.drop_out = nn.Dropout(0.1), nn.Dropout(0.3), nn.Dropout(0.1)

    def forward(self, x):
        b, t, d = x.shape
        h = self.norm(x)
        q = h.view(b, t, self.heads, d // self.heads).transpose(1, 2)
        scores = self.drop_scores((q @ q.transpose(-1, -2)).softmax(-1))
        h = h + (scores @ q).transpose(1, 2).reshape(b, t, d)
        return x + self.drop_out(self.fc2(self.drop_hidden(torch.nn.functional.gelu(self.fc1(h)))))


class Noisy(nn.Module):
    """Draws Gaussian noise: values that are not 0 or 1."""

    def forward(self, x):
        return x + torch.randn_like(x)


class Across(nn.Module):
    """Draws its mask on the transposed input: the mask's first dimension is not the batch."""

    def __init__(self):
        super().__init__()
        self.drop = nn.Dropout(0.5)

    def forward(self, x):
        return x + self.drop(x.t()).t()


def _run(block, x, chunks, seed=5):
    """(output, generator state after the forward, input gradient, parameter gradients) of one step of ``block``
    recomputed (inputs kept as they are) with ``chunks``; chunks None: the block itself, eagerly."""
    block.zero_grad()
    xs = x.clone().requires_grad_()
    torch.manual_seed(seed)
    if chunks is None:
        out = block(xs)
    else:
        out = recompute_from_codes(block, RecomputeSpec(True, "layers.2", None, 256, chunks), xs)
    state = torch.get_rng_state()
    out.square().mean().backward()
    return out.detach(), state, xs.grad, [p.grad.clone() for p in block.parameters()]


@pytest.mark.parametrize("chunks", [2, 3, 16])
def test_a_chunked_random_block_draws_as_eager_and_gives_eagers_gradients(chunks):
    torch.manual_seed(0)
    block, x = DroppedBlock().train(), torch.randn(7, 6, 32)
    eager = _run(block, x, None)
    whole = _run(block, x, 1)  # the generator replayed, as before
    chunked = _run(block, x, chunks)
    for run in (whole, chunked):
        assert torch.equal(run[0], eager[0]) and torch.equal(run[1], eager[1])
        assert torch.allclose(run[2], eager[2], rtol=1e-5, atol=1e-7)
        for a, b in zip(run[3], eager[3]):
            assert torch.allclose(a, b, rtol=1e-4, atol=1e-6)


def test_the_draws_are_kept_as_one_bit_per_element_through_save_for_backward():
    torch.manual_seed(0)
    block, x = DroppedBlock().train(), torch.randn(8, 6, 32, requires_grad=True)
    saved = []

    def pack(t):
        saved.append(t)
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        recompute_from_codes(block, RecomputeSpec(True, "layers.2", None, 256, 4), x)
    masks = [t for t in saved if t.dtype == torch.uint8]
    # per sample: the hidden units 6x128, the scores 2x6x6 (72 bits: 9 bytes), the output 6x32
    assert sorted(tuple(t.shape) for t in masks) == sorted([(8, 6 * 128 // 8), (8, 9), (8, 6 * 32 // 8)])
    assert not any(t.dtype == torch.uint8 and t.dim() == 1 for t in saved)  # no generator state kept


class SelfAttention(nn.Module):
    def __init__(self, p):
        super().__init__()
        self.p = p

    def forward(self, x):
        q = x.view(x.shape[0], x.shape[1], 4, -1).transpose(1, 2)
        y = torch.nn.functional.scaled_dot_product_attention(q, q, q, dropout_p=self.p)
        return y.transpose(1, 2).reshape(x.shape)


def test_an_attention_without_dropout_draws_nothing_and_with_dropout_keeps_its_draws():
    """A CPU fused attention is a seeded op even at dropout_p 0 (every attention without dropout calls it): no draw.
    With dropout, CPU attention runs its math path, whose dropout draws with bernoulli, kept as bits."""
    x = torch.randn(8, 6, 32)
    assert separable(SelfAttention(0.0), recompute_inputs([x]), 8) is None
    assert separable(SelfAttention(0.2), recompute_inputs([x]), 8) is None


def test_blocks_whose_draws_cannot_be_kept_or_cut_are_not_separable():
    x, tokens, block = torch.randn(8, 16), torch.randn(8, 6, 16), DroppedBlock(16, 32).train()
    rng = torch.get_rng_state()
    assert separable(block, recompute_inputs([tokens]), 8) is None
    assert "draws with aten.randn" in separable(Noisy(), recompute_inputs([x]), 8)
    assert "whose first dimension is not the batch" in separable(Across().train(), recompute_inputs([x]), 8)
    assert torch.equal(rng, torch.get_rng_state())


def test_a_hand_built_chunked_spec_on_noise_refuses_naming_the_block_and_the_fix():
    x = torch.randn(8, 16, requires_grad=True)
    with pytest.raises(DrawError, match=r"recomputed block layers\.2 draws with aten\.randn.*chunks=1"):
        recompute_from_codes(Noisy(), RecomputeSpec(True, "layers.2", 8, 256, 4), x)


class DroppedMixer(nn.Module):
    def __init__(self, n=6):
        super().__init__()
        self.embed = nn.Linear(32, 64)
        self.blocks = nn.Sequential(*[DroppedBlock(64, 512, 4) for _ in range(n)])
        self.head = nn.Linear(64, 10)

    def forward(self, x):
        return self.head(self.blocks(self.embed(x)).mean(1))


def test_the_default_plan_chunks_blocks_with_dropout_estimate_equal_to_measurement():
    torch.manual_seed(0)
    model, x = DroppedMixer().train(), torch.randn(32, 16, 32)
    reference = copy.deepcopy(model)
    om = memopt.optimize(model, example_inputs=x, optimizer="sgd")
    assert om.plan.recompute_chunks > 1 and om.plan.fidelity["passed"]
    assert memopt.measure(om, x, optimizer="sgd").peak_bytes == om.plan.estimated_peak_bytes
    forward_identical_gradients_close(om, model, reference, x)


class _NoisyBackward(torch.autograd.Function):
    """Doubles its input; its backward drops half the gradient by a fresh mask, a draw the forward never made."""

    @staticmethod
    def forward(ctx, x):
        return 2 * x

    @staticmethod
    def backward(ctx, grad):
        noise = torch.empty_like(grad).bernoulli_(0.5)
        return 2 * grad * noise


class NoisyBackward(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc, self.drop = nn.Linear(16, 16), nn.Dropout(0.5)

    def forward(self, x):
        return x + _NoisyBackward.apply(self.drop(self.fc(x)))


def test_a_draw_only_in_backward_is_refused():
    why = separable(NoisyBackward().train(), recompute_inputs([torch.randn(8, 16)]), 8)
    assert "draws more often in a range's second forward and its backward (aten.bernoulli_.float)" in why


def test_ops_that_replay_their_draws_in_backward_are_given_the_same_rows_there():
    """A coded attention with dropout inside a recomputed block runs again in its own backward from the generator
    state it saved; in a chunked backward it saves the replayer's position instead and is given the same masks."""
    from memopt.passes.recompute_chunks import recomputed, set_recompute_chunks, why_not_chunked
    from memopt.testing.zoo import EncoderBlock

    class LM(nn.Module):  # a large head after the blocks: the peak falls in their backward, which chunks lower
        def __init__(self, vocab=1024, d=64):
            super().__init__()
            self.embed = nn.Embedding(vocab, d)
            self.blocks = nn.Sequential(*[EncoderBlock(d, 4) for _ in range(6)])
            self.norm, self.head = nn.LayerNorm(d), nn.Linear(d, vocab)

        def forward(self, ids):
            return self.head(self.norm(self.blocks(self.embed(ids))))

    torch.manual_seed(0)
    model, x = LM().train(), torch.randint(0, 1024, (8, 64))
    reference = copy.deepcopy(model)
    # every block recomputed from codes, coded inside (the default plan's peak-first step codes inside only where
    # chunks leave the peak in the blocks' backward)
    config = memopt.Config(recompute=memopt.RecomputeConfig(segments=None, bits=8, codes_inside=True))
    om = memopt.optimize(model, example_inputs=x, config=config)
    gm = om._memopt_last.graph_module
    nodes = [n for n in recomputed(gm) if "coded_call" in getattr(gm, n.args[0].target).code]
    assert nodes and all(why_not_chunked(gm, n) is None for n in nodes), "no chunkable block with a coded op inside"
    assert om.plan.recompute_chunks > 1
    forward_identical_gradients_close(om, model, reference, x)
    chunked = [p.grad.clone() for p in model.parameters()]
    set_recompute_chunks(gm, 1)
    model.zero_grad()
    torch.manual_seed(1)
    om(x).logsumexp(-1).mean().backward()
    for name, p, g in zip([n for n, _ in model.named_parameters()], model.parameters(), chunked):
        assert torch.allclose(g, p.grad, rtol=1e-4, atol=1e-7), name
