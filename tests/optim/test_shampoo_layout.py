"""Shampoo's ``tensor_layout="modes"``: one preconditioner per dimension of a conv weight, against a
plain float64 per-mode Shampoo; identity with "matrix" where the layouts coincide; its validation."""
import copy
import io
import itertools
import math

import pytest
import torch
from torch import nn

import memopt
from memopt.optim import Shampoo, state_bytes
from memopt.optim.layout import apply_roots, make_layout
from memopt.optim.shampoo import ADAM_EPS

pytestmark = pytest.mark.usefixtures("one_thread")  # tiny LAPACK calls: see conftest


def _grads(shape, steps, seed=0):
    g = torch.Generator().manual_seed(seed)
    basis = torch.randn(shape[0], 2, generator=g)  # a few dominant directions: the preconditioner matters
    rest = math.prod(shape[1:])
    return [(basis @ torch.randn(2, rest, generator=g)).view(shape) + 0.1 * torch.randn(*shape, generator=g)
            for _ in range(steps)]


def _run(shape, steps, **kw):
    p = nn.Parameter(torch.ones(shape))
    opt = Shampoo([p], lr=0.05, bits=32, stat_every=1, root_every=1, **kw)
    for g in _grads(shape, steps):
        p.grad = g
        opt.step()
    return p.detach().clone(), opt, p


def _inv_root(a, eps, root):
    lam, vec = torch.linalg.eigh(a)
    lam = lam.clamp_min(0)
    return (vec * (lam + eps * lam.max()) ** (-1.0 / root)) @ vec.T


def _reference(shape, steps, lr=0.05, eps=1e-6, beta=0.95, betas=(0.9, 0.999), max_order=1200, modes=True):
    """Per-mode Shampoo written out plainly in float64: per block (each dimension cut at max_order) and
    mode i, L_i = β L_i + (1-β) G_(i) G_(i)ᵀ from eps·I; D = G ×_i L_i^(-1/(2k)) per block, grafted to
    ||G|| over the whole tensor; AdamW. ``modes=False``: the (shape[0], -1) matrix form."""
    view = tuple(shape) if modes else (shape[0], math.prod(shape[1:]))
    cuts = [[slice(i, min(i + max_order, n)) for i in range(0, n, max_order)] for n in view]
    blocks = list(itertools.product(*cuts))
    stats = {(b, i): eps * torch.eye(w[i].stop - w[i].start, dtype=torch.float64)
             for b, w in enumerate(blocks) for i in range(len(view))}
    p = torch.ones(shape, dtype=torch.float64)
    m, v = torch.zeros_like(p), torch.zeros_like(p)
    for k, g in enumerate(_grads(shape, steps), start=1):
        g = g.double().reshape(view)
        d = torch.empty_like(g)
        for b, where in enumerate(blocks):
            x = g[where]
            for i in range(len(view)):
                unfold = x.movedim(i, 0).reshape(x.shape[i], -1)
                stats[b, i] = beta * stats[b, i] + (1 - beta) * unfold @ unfold.T
            y = x
            for i in range(len(view)):
                y = torch.tensordot(_inv_root(stats[b, i], eps, 2 * len(view)), y, dims=([1], [i])).movedim(0, i)
            d[where] = y
        d = (d * g.norm() / d.norm()).reshape(shape)
        m = betas[0] * m + (1 - betas[0]) * d
        v = betas[1] * v + (1 - betas[1]) * d * d
        p = p - lr * (m / (1 - betas[0] ** k)) / ((v / (1 - betas[1] ** k)).sqrt() + ADAM_EPS)
    return p


def _distance(p, ref):
    return ((p.double() - ref).norm() / (ref - 1).norm()).item()


@pytest.mark.parametrize("shape, max_order", [((6, 4, 3, 3), 1200), ((5, 7, 3), 4)])
def test_modes_layout_matches_a_plain_per_mode_reference(shape, max_order):
    # eigh at every statistic update: the 32-bit roots are the exact ones, so only fp32 rounding differs
    p, opt, _ = _run(shape, 8, tensor_layout="modes", eigh_every=1, max_order=max_order)
    assert _distance(p, _reference(shape, 8, max_order=max_order)) < 1e-3
    # and it is not the matrix layout: that reference is far away
    assert _distance(p, _reference(shape, 8, max_order=max_order, modes=False)) > 0.02
    blocks = math.prod(-(-d // max_order) for d in shape)
    assert sum(key.endswith(".root") for key in opt.state[opt.param_groups[0]["params"][0]]) == blocks * len(shape)


def test_matrix_layout_matches_the_matrix_reference_on_a_conv_weight():
    p, _, _ = _run((6, 4, 3, 3), 8, eigh_every=1)
    assert _distance(p, _reference((6, 4, 3, 3), 8, modes=False)) < 1e-3


@pytest.mark.parametrize("shape", [(9, 13), (9, 1, 13), (1, 9, 13, 1)])
def test_modes_equals_matrix_bit_for_bit_for_tensors_of_rank_two(shape):
    a, opt_a, pa = _run(shape, 6, tensor_layout="modes")
    b, opt_b, pb = _run(shape, 6, tensor_layout="matrix")
    assert torch.equal(a, b)
    assert sorted(opt_a.state[pa]) == sorted(opt_b.state[pb])


def test_modes_state_of_a_conv_weight_is_quantized_per_mode_and_smaller():
    shape = (64, 64, 3, 3)
    sizes = {}
    for layout in ("matrix", "modes"):
        p = nn.Parameter(torch.randn(shape))
        opt = Shampoo([p], bits=4, tensor_layout=layout, stat_every=1, root_every=1)
        p.grad = _grads(shape, 1)[0]
        opt.step()
        sizes[layout] = state_bytes(opt)["preconditioner"]
        keys = set(opt.state[p])
    # modes: 64x64 statistics in 4 bits (64² = min_quant_numel), the 3x3 ones in fp32
    assert {"pre.0.m0.vecs.codes", "pre.0.m1.root.codes", "pre.0.m2.root", "pre.0.m3.vecs"} <= keys
    assert opt.state[p]["pre.0.m2.root"].shape == (3, 3)
    # matrix: L 64², R 576² (4.5 bits per element) against modes: 2 x 64² + 2 x 3² fp32
    assert sizes["modes"] * 20 < sizes["matrix"]
    assert torch.isfinite(p).all()


def test_apply_roots_multiplies_every_mode():
    x = torch.randn(3, 4, 5, dtype=torch.float64)
    roots = [torch.randn(n, n, dtype=torch.float64) for n in (3, 4, 5)]
    roots = [r + r.T for r in roots]
    assert torch.allclose(apply_roots(x, roots), torch.einsum("ai,bj,ck,ijk->abc", *roots, x))
    m = torch.randn(3, 4, dtype=torch.float64)
    assert torch.allclose(apply_roots(m, roots[:2]), roots[0] @ m @ roots[1])


def test_make_layout_squeezes_and_keeps_rank_two_as_a_matrix():
    assert make_layout(torch.Size([8, 1, 3, 3]), 1200, "modes").shape == (8, 3, 3)
    assert make_layout(torch.Size([8, 1, 3, 3]), 1200, "matrix").shape == (8, 9)
    assert make_layout(torch.Size([8, 1, 5]), 1200, "modes").shape == (8, 5)
    assert make_layout(torch.Size([1, 7]), 1200, "modes") is None


# --- validation -----------------------------------------------------------------------------------

def test_bad_tensor_layout_names_the_value_and_the_allowed_ones():
    p = nn.Parameter(torch.ones(4, 4))
    message = r"tensor_layout='flat' is not known; use one of \('matrix', 'modes'\)"
    with pytest.raises(ValueError, match=message):
        Shampoo([p], tensor_layout="flat")
    opt = Shampoo([p])
    with pytest.raises(ValueError, match=message):
        opt.add_param_group({"params": [nn.Parameter(torch.ones(3, 3))], "tensor_layout": "flat"})
    assert len(opt.param_groups) == 1


def test_tensor_layout_cannot_change_once_state_exists():
    p = nn.Parameter(torch.ones(4, 3, 3, 3))
    opt = Shampoo([p], tensor_layout="modes")
    p.grad = torch.ones_like(p)
    opt.step()
    opt.param_groups[0]["tensor_layout"] = "matrix"
    before = p.detach().clone()
    with pytest.raises(ValueError, match=r"\['tensor_layout'\] changed from 'modes' to 'matrix'"):
        opt.step()
    assert torch.equal(p, before)


@pytest.mark.slow
@pytest.mark.parametrize("kw", [{"tensor_layout": "modes"}, {"vector_bits": 8}])
def test_cost_model_estimates_the_new_options_exactly(kw):
    # the cost model runs the step on fake tensors: state and transients must match a real run
    model = nn.Sequential(nn.Conv2d(3, 70, 3), nn.ReLU(), nn.Conv2d(70, 70, 3), nn.Flatten(), nn.Linear(70 * 16, 5))
    x = torch.randn(2, 3, 8, 8)
    opt = Shampoo(model.parameters(), stat_every=1, root_every=1, **kw)
    report = memopt.estimate(model, x, optimizer=opt)
    assert report.peak_bytes == memopt.measure(model, x, optimizer=opt).peak_bytes
    real = copy.deepcopy(model)
    real_opt = Shampoo(real.parameters(), stat_every=1, root_every=1, **kw)
    for _ in range(2):  # the cost model simulates two steps
        real_opt.zero_grad()
        real(x).sum().backward()
        real_opt.step()
    assert report.breakdown["optimizer_state"] == state_bytes(real_opt)["total"]


def test_modes_and_vector_bits_resume_bit_identically():
    shape, kw = (70, 66, 3), {"tensor_layout": "modes", "vector_bits": 8, "stat_every": 2, "root_every": 2}
    grads = _grads(shape, 6)
    p = nn.Parameter(torch.ones(shape))
    opt = Shampoo([p], lr=0.01, **kw)
    for g in grads[:3]:
        p.grad = g
        opt.step()
    buf = io.BytesIO()
    torch.save({"p": p.detach().clone(), "opt": opt.state_dict()}, buf)
    for g in grads[3:]:
        p.grad = g
        opt.step()
    buf.seek(0)
    saved = torch.load(buf, weights_only=True)
    q = nn.Parameter(saved["p"])
    opt2 = Shampoo([q], lr=0.01, **kw)
    opt2.load_state_dict(saved["opt"])
    assert opt2.state[q]["pre.0.m0.vecs.codes"].numel() == 70 * 70  # 8-bit eigenvectors, reloaded as uint8
    for g in grads[3:]:
        q.grad = g
        opt2.step()
    assert torch.equal(p, q)
