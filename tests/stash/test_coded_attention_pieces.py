"""A coded attention's forward and backward over batch ranges on the CPU (``memopt.stash.coded.attention_pieces``):
the math path makes several score-sized tensors in the forward and again in the backward's second run, the peaks
of a BERT-shaped encoder; range by range they are a range's. Dropout's draws are kept as bits and served by rows,
so the forward and the user's random stream are eager's and each range's gradients are its rows of the whole
batch's."""
import pytest
import torch
import torch.nn.functional as F

from memopt.cost_model.storage import LiveStorageTracker
from memopt.recompute import attention_rows
from memopt.stash import coded, generic
from memopt.stash.grads import Rows
from memopt.stash.coded import CodedSpec, attention_pieces, coded_call
from memopt.stash.generic import EncodeSpec, generic_encode

SDPA = "F.scaled_dot_product_attention"


def _run(monkeypatch, piece_bytes, dropout, coded_slots=(), mask=None, seed=3):
    """(output, gradients of q, k, v (and the mask), the generator's state after forward, backward's tracked peak)
    of one coded attention with ``PIECE_BYTES`` set to ``piece_bytes``."""
    monkeypatch.setattr(attention_rows, "PIECE_BYTES", piece_bytes)
    torch.manual_seed(0)
    q, k, v = (torch.randn(8, 3, 48, 16, requires_grad=True) for _ in range(3))
    leaves = [q, k, v] + ([mask] if mask is not None else [])
    spec = CodedSpec(SDPA, tuple(coded_slots), 8, 256, dropout > 0, "sdpa")
    codes = tuple(generic_encode(t, EncodeSpec(8, 256)) for i, t in enumerate((q, k, v)) if i in coded_slots)
    kwargs = {"dropout_p": dropout} if mask is None else {"dropout_p": dropout, "attn_mask": mask}
    torch.manual_seed(seed)
    out = coded_call(spec, (q, k, v), kwargs, codes)
    after = torch.get_rng_state()
    g = torch.randn_like(out)
    tracker = LiveStorageTracker(preexisting=[out, g, *leaves, *[t for pair in codes for t in pair]])
    with tracker:
        grads = torch.autograd.grad(out, [t for t in leaves if t.requires_grad], g)
    return out, grads, after, tracker.peak


def test_pieces_follow_the_score_matrix_and_stay_off_elsewhere(monkeypatch):
    spec = CodedSpec(SDPA, (0, 1, 2), 8, 256, True, "s")
    q = torch.empty(64, 12, 128, 64)
    p = {"dropout_p": 0.1}
    assert attention_pieces(spec, (q, q, q), p) == 3  # 48 MiB of float32 scores in 16 MiB ranges
    assert attention_pieces(spec, (q, q, q, None, 0.1), {}) == 3  # dropout_p positional
    assert attention_pieces(spec, (q, q, q), {"dropout_p": 0.0}) == 1  # no dropout: the fused kernel, no scores
    assert attention_pieces(spec._replace(random=False), (q, q, q), p) == 1
    assert attention_pieces(spec, (q[:1], q[:1], q[:1]), p) == 1  # one sample
    assert attention_pieces(spec._replace(target="F.layer_norm"), (q,), p) == 1
    assert attention_pieces(spec, (q.to("meta"), q, q), p) == 1  # not the CPU
    exported = spec._replace(target="aten.scaled_dot_product_attention.default")  # an exported graph's
    assert attention_pieces(exported, (q, q, q), p) == 3
    monkeypatch.setattr(attention_rows, "draws_split", lambda: False)  # a generator that cannot draw by rows
    assert attention_pieces(spec, (q, q, q), p) == 1


@pytest.mark.parametrize("dropout", [0.0, 0.3])
def test_the_forward_and_the_generator_are_eagers_and_gradients_the_whole_batchs(monkeypatch, dropout):
    whole = _run(monkeypatch, 1 << 40, dropout)  # one range: the generator's state replayed
    ranged = _run(monkeypatch, 8 * 3 * 48 * 48 * 4 // 4, dropout)  # four ranges of two samples
    assert torch.equal(ranged[0], whole[0]) and torch.equal(ranged[2], whole[2])
    for a, b in zip(ranged[1], whole[1]):
        # nothing coded here: the same masks, the same values up to the matmuls' rounding over fewer rows
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)
    if dropout:  # the math path's score-sized tensors are a range's (without dropout: one fused call either way)
        assert ranged[3] < whole[3] * 0.7, (ranged[3], whole[3])
    else:
        assert ranged[3] == whole[3]


def test_coded_inputs_and_a_broadcast_mask_by_rows(monkeypatch):
    mask = torch.randn(1, 1, 48, 48, requires_grad=True)  # no batch rows: every range reads it, grads summed
    whole = _run(monkeypatch, 1 << 40, 0.2, coded_slots=(0, 1, 2), mask=mask)
    ranged = _run(monkeypatch, 8 * 3 * 48 * 48, 0.2, coded_slots=(0, 1, 2), mask=mask)
    assert torch.equal(ranged[0], whole[0])
    for a, b in zip(ranged[1], whole[1]):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)
    # against stock autograd on the exact inputs: the 8-bit codes' precision
    torch.manual_seed(0)
    q, k, v = (torch.randn(8, 3, 48, 16, requires_grad=True) for _ in range(3))
    torch.manual_seed(3)
    out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, dropout_p=0.2)
    assert torch.equal(out, ranged[0])
    g = torch.randn_like(out)
    ref = torch.autograd.grad(out, (q, k, v, mask), g)
    for a, b in zip(ranged[1], ref):
        assert F.cosine_similarity(a.flatten(), b.flatten(), 0) > 0.999


def test_coded_inputs_are_rebuilt_a_range_at_a_time(monkeypatch):
    """Over ranges, a coded q, k, v whose codes cut by rows is rebuilt range by range: the same gradients as
    from the whole rebuild, without the three whole rebuilt tensors alive at the backward's peak."""
    pieces = 8 * 3 * 48 * 48 * 4 // 4  # four ranges
    by_range = _run(monkeypatch, pieces, 0.2, coded_slots=(0, 1, 2))
    monkeypatch.setattr(coded, "rows_rebuild", lambda *a: Rows(generic.rows_rebuild(*a).whole, None))
    whole = _run(monkeypatch, pieces, 0.2, coded_slots=(0, 1, 2))
    assert torch.equal(by_range[0], whole[0])
    for a, b in zip(by_range[1], whole[1]):
        assert torch.equal(a, b)
    rebuilt = 8 * 3 * 48 * 16 * 4  # one of q, k, v in float32
    assert by_range[3] <= whole[3] - 2 * rebuilt, (by_range[3], whole[3])
