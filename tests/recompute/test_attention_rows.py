"""An attention with dropout on the CPU over batch ranges in the forward (memopt/recompute/attention_rows.py): the
output, its layout and the generator's state after it are eager's bit for bit, under masks, causal attention,
autocast and either thread count; the forward's tracked peak is a range's math path; a recomputed block's first
forward runs its attention so, inside chunked and unchunked blocks, with eager's gradients."""
import pytest
import torch
import torch.nn.functional as F
from torch import nn

from memopt.cost_model.storage import LiveStorageTracker
from memopt.recompute import attention_rows
from memopt.recompute.attention_rows import RowAttention, by_rows, draws_split, pieces_of
from memopt.recompute.ops import RecomputeSpec, recompute_from_codes

SDPA = F.scaled_dot_product_attention
ATEN = torch.ops.aten.scaled_dot_product_attention.default


def test_this_builds_generator_draws_by_rows():
    assert draws_split()


def test_pieces_follow_the_score_matrix_and_stay_off_elsewhere(monkeypatch):
    q = torch.empty(64, 12, 128, 64)
    assert pieces_of((q, q, q), {"dropout_p": 0.1}) == 3  # 48 MiB of float32 scores, 16 MiB a range
    assert pieces_of((q, q, q, None, 0.1), {}) == 3
    assert pieces_of((), {"query": q, "key": q, "value": q, "dropout_p": 0.1}) == 3
    assert pieces_of((q, q, q), {}) == 1  # no dropout: the fused kernel, no scores
    assert pieces_of((q, q, q), {"dropout_p": 1.0}) == 1
    assert pieces_of((q[:1], q[:1], q[:1]), {"dropout_p": 0.1}) == 1
    assert pieces_of((q, q[:32], q), {"dropout_p": 0.1}) == 1  # batches differ (broadcast keys): no rows to cut
    assert pieces_of((q.to("meta"), q, q), {"dropout_p": 0.1}) == 1
    monkeypatch.setattr(attention_rows, "draws_split", lambda: False)
    assert pieces_of((q, q, q), {"dropout_p": 0.1}) == 1


CASES = [  # (batch, heads, queries, keys, head dim, mask, causal)
    (8, 4, 48, 48, 16, None, False),
    (7, 3, 33, 33, 8, "per sample", False),
    (6, 2, 40, 40, 16, "broadcast", False),
    (5, 2, 24, 24, 8, "bool", False),
    (9, 2, 32, 32, 16, None, True),
    (6, 2, 20, 36, 8, "per sample", False),  # cross-attention: keys differ from queries
]


def _mask(kind, b, h, lq, lk, generator):
    if kind == "per sample":
        return torch.randn(b, 1, lq, lk, generator=generator)
    if kind == "broadcast":
        return torch.randn(1, h, lq, lk, generator=generator)
    if kind == "bool":
        return torch.rand(b, 1, 1, lk, generator=generator) > 0.2
    return None


@pytest.mark.parametrize("threads", [1, 2])
@pytest.mark.parametrize("bf16", [False, True])
@pytest.mark.parametrize("case", CASES)
@pytest.mark.parametrize("fn", [SDPA, ATEN])
def test_ranges_give_eagers_output_layout_and_generator_state(case, bf16, threads, fn):
    b, h, lq, lk, e, mask_kind, causal = case
    generator = torch.Generator().manual_seed(b * lq + e)
    q = torch.randn(b, lq, h, e, generator=generator).transpose(1, 2)  # a transformer's strided view
    k, v = (torch.randn(b, h, lk, e, generator=generator) for _ in range(2))
    kwargs = {"attn_mask": _mask(mask_kind, b, h, lq, lk, generator), "dropout_p": 0.25, "is_causal": causal}
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=bf16):
            torch.manual_seed(11)
            eager = fn(q, k, v, **kwargs)
            after_eager = torch.get_rng_state()
            torch.manual_seed(11)
            ranged, kept, shapes = by_rows(fn, (q, k, v), kwargs, 3)
            after = torch.get_rng_state()
    finally:
        torch.set_num_threads(before)
    assert torch.equal(ranged, eager) and ranged.dtype == eager.dtype and ranged.stride() == eager.stride()
    assert torch.equal(after, after_eager)
    assert shapes == [(b, h, lq, lk)] and kept[0].shape == (b, -(-(h * lq * lk) // 8))


def test_the_forward_peak_is_a_ranges(monkeypatch):
    monkeypatch.setattr(attention_rows, "PIECE_BYTES", 8 * 4 * 96 * 96 * 4 // 8)  # eight ranges of one sample
    q, k, v = (torch.randn(8, 4, 96, 32) for _ in range(3))
    peaks = []
    for mode in (None, RowAttention()):
        tracker = LiveStorageTracker(preexisting=[q, k, v])
        with torch.no_grad(), tracker:
            if mode is None:
                SDPA(q, k, v, dropout_p=0.1)
            else:
                with mode:
                    SDPA(q, k, v, dropout_p=0.1)
        peaks.append(tracker.peak)
    scores, output = 8 * 4 * 96 * 96 * 4, 8 * 4 * 96 * 32 * 4
    assert peaks[0] >= 2.5 * scores  # softmax, noise and product of the whole batch at once
    # the output, the bits of the batch's draw and one range's math path (an eighth of the scores, a few times)
    assert peaks[1] < output + 0.6 * scores and peaks[1] < 0.3 * peaks[0], peaks


def test_the_mode_leaves_recorded_and_dropout_free_calls_alone(monkeypatch):
    monkeypatch.setattr(attention_rows, "PIECE_BYTES", 1)  # every call with dropout would be cut to single rows
    calls = []
    real = attention_rows.by_rows
    monkeypatch.setattr(attention_rows, "by_rows", lambda *a, **k: calls.append(a[3]) or real(*a, **k))
    q = torch.randn(4, 2, 16, 8, requires_grad=True)
    with RowAttention():
        out = SDPA(q, q, q, dropout_p=0.2)  # recording autograd: one call, eager's graph
        with torch.no_grad():
            SDPA(q, q, q)  # no dropout
            SDPA(q.to(torch.float64), q.double(), q.double(), dropout_p=0.0)
        assert calls == [] and out.requires_grad
        with torch.no_grad():
            SDPA(q, q, q, dropout_p=0.2)
    assert calls == [4]


class Layer(nn.Module):
    """A BERT-shaped layer: attention with dropout, then an MLP with dropout."""

    def __init__(self, d=32, heads=4):
        super().__init__()
        self.heads = heads
        self.qkv, self.proj = nn.Linear(d, 3 * d), nn.Linear(d, d)
        self.norm, self.fc, self.drop = nn.LayerNorm(d), nn.Linear(d, d), nn.Dropout(0.1)

    def forward(self, x, mask):
        b, t, d = x.shape
        q, k, v = self.qkv(x).view(b, t, 3, self.heads, d // self.heads).permute(2, 0, 3, 1, 4)
        a = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, dropout_p=0.2)
        h = self.norm(x + self.proj(a.transpose(1, 2).reshape(b, t, d)))
        return h + self.drop(self.fc(h))


@pytest.mark.parametrize("chunks", [1, 3])
def test_a_recomputed_blocks_forward_is_eagers_and_its_gradients_too(monkeypatch, chunks):
    monkeypatch.setattr(attention_rows, "PIECE_BYTES", 6 * 4 * 40 * 40 * 4 // 3)  # three ranges
    calls = []
    real = attention_rows.by_rows
    monkeypatch.setattr(attention_rows, "by_rows", lambda *a, **k: calls.append(a[3]) or real(*a, **k))
    torch.manual_seed(0)
    layer, x = Layer().train(), torch.randn(6, 40, 32)
    mask = torch.randn(6, 1, 1, 40)
    runs = []
    for recomputed in (False, True):
        layer.zero_grad()
        xs = x.clone().requires_grad_()
        torch.manual_seed(4)
        if recomputed:
            out = recompute_from_codes(layer, RecomputeSpec(True, "layer", None, 256, chunks), xs, mask)
        else:
            out = layer(xs, mask)
        state = torch.get_rng_state()
        out.square().mean().backward()
        runs.append((out.detach(), state, xs.grad, [p.grad.clone() for p in layer.parameters()]))
    (out, state, gx, gp), (rout, rstate, rgx, rgp) = runs
    assert calls == [3]  # the first forward's attention, by rows; the backward's second forward not again
    assert torch.equal(rout, out) and torch.equal(rstate, state)
    torch.testing.assert_close(rgx, gx, rtol=1e-5, atol=1e-7)
    for a, b in zip(rgp, gp):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)
