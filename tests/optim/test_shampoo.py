"""memopt.optim.Shampoo: against a reference Shampoo, resume, grads untouched, groups, blocking,
errors, and the cost model's optimizer-state figure."""
import copy
import io

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import memopt
from memopt.optim import Shampoo, state_bytes
from memopt.optim.shampoo import ADAM_EPS

pytestmark = pytest.mark.usefixtures("one_thread")  # tiny LAPACK calls: see conftest


def _grads(shape, steps, seed=0):
    g = torch.Generator().manual_seed(seed)
    # a few dominant directions, as real gradients have: the preconditioner has something to do
    rows, cols = shape[0], torch.Size(shape[1:]).numel()
    basis = torch.randn(rows, 3, generator=g)
    return [(basis @ torch.randn(3, cols, generator=g)).view(shape) + 0.1 * torch.randn(*shape, generator=g)
            for _ in range(steps)]


def _run(opt_factory, shape, steps, seed=0, dtype=torch.float32):
    p = nn.Parameter(torch.ones(shape, dtype=dtype))
    opt = opt_factory([p])
    for g in _grads(shape, steps, seed):
        p.grad = g.to(dtype)
        opt.step()
    return p.detach().clone(), opt


def _root(a, eps):
    lam, vec = torch.linalg.eigh(a)
    lam = lam.clamp_min(0)
    return (vec * (lam + eps * lam.max()) ** -0.25) @ vec.T


def _reference_shampoo(shape, steps, lr, eps=1e-6, beta=0.95, betas=(0.9, 0.999), dtype=torch.float64,
                       published=False):
    """Shampoo grafted onto AdamW, statistics and roots every step, written out plainly.

    ``published=False``: textbook Shampoo (exact L, R; eigh roots). ``published=True``: the
    32-bit form of the 4-bit algorithm (eigenvalues + eigenvectors tracked by one warm-started
    QR step per update, V in descending eigenvalue order, rectification, no eigh).
    """
    p = torch.ones(shape, dtype=dtype)
    eye = [torch.eye(n, dtype=dtype) for n in shape]
    stats = [eps * e for e in eye]  # textbook: L, R
    eig = [(torch.full((n,), eps, dtype=dtype), e) for n, e in zip(shape, eye)]  # published: (λ, V)
    m, v = torch.zeros_like(p), torch.zeros_like(p)
    for k, g in enumerate(_grads(shape, steps), start=1):
        g = g.to(dtype)
        roots = []
        for side, gg in enumerate((g @ g.T, g.T @ g)):
            if published:
                lam, vec = eig[side]
                vec = 1.5 * vec - 0.5 * vec @ vec.T @ vec
                a = beta * (vec * lam) @ vec.T + (1 - beta) * gg
                vec = vec[:, lam.argsort(descending=True, stable=True)]
                vec = torch.linalg.qr(a @ vec).Q
                lam = ((a @ vec) * vec).sum(0)
                eig[side] = (lam, vec)
                for _ in range(4):
                    vec = 1.5 * vec - 0.5 * vec @ vec.T @ vec
                lam = lam.clamp_min(0)
                roots.append((vec * (lam + eps * lam.max()) ** -0.25) @ vec.T)
            else:
                stats[side] = beta * stats[side] + (1 - beta) * gg
                roots.append(_root(stats[side], eps))
        d = roots[0] @ g @ roots[1]
        d = d * g.norm() / d.norm()
        m = betas[0] * m + (1 - betas[0]) * d
        v = betas[1] * v + (1 - betas[1]) * d * d
        p = p - lr * (m / (1 - betas[0] ** k)) / ((v / (1 - betas[1] ** k)).sqrt() + ADAM_EPS)
    return p


def _distance(p, ref):
    """Distance of a trajectory's end point from the reference's, relative to how far it moved."""
    return ((p.double() - ref).norm() / (ref - 1).norm()).item()


# --- against a reference ------------------------------------------------------------------------

@pytest.mark.parametrize("quantize, published", [("statistics", False), ("eigenvectors", True)])
def test_bits32_matches_a_plain_reference(quantize, published):
    shape, steps, lr = (12, 20), 15, 0.05
    p, _ = _run(lambda ps: Shampoo(ps, lr=lr, bits=32, quantize=quantize, stat_every=1, root_every=1),
                shape, steps)
    # same algorithm, same precision: 2e-7 (statistics) and 3e-4 (eigenvectors: QR and Adam amplify
    # rounding) measured; the other algorithm is 0.21 away
    assert _distance(p, _reference_shampoo(shape, steps, lr, published=published, dtype=torch.float32)) < 2e-3
    assert _distance(p, _reference_shampoo(shape, steps, lr, published=not published, dtype=torch.float32)) > 0.1
    # and float64: within the float32/float64 gap of the reference itself (3e-4 and 0.08)
    assert _distance(p, _reference_shampoo(shape, steps, lr, published=published)) < (0.12 if published else 1e-3)


def test_quantized_variants_rank_as_published():
    # distance from textbook Shampoo after 12 steps: 32-bit < 4-bit eigenvectors with rectification
    # < without rectification < 4-bit statistics (naive) < AdamW (no preconditioner at all)
    shape, steps, lr = (70, 80), 12, 0.05
    ref = _reference_shampoo(shape, steps, lr)
    variants = [{"bits": 32}, {"bits": 4}, {"bits": 4, "rectify_iters": (0, 0)},
                {"bits": 4, "quantize": "statistics"}]
    dist = [_distance(_run(lambda ps, kw=kw: Shampoo(ps, lr=lr, stat_every=1, root_every=1, **kw),
                           shape, steps)[0], ref) for kw in variants]
    dist.append(_distance(_run(lambda ps: torch.optim.AdamW(ps, lr=lr, weight_decay=0, eps=ADAM_EPS),
                               shape, steps)[0], ref))
    assert dist == sorted(dist) and dist[-1] > 2 * dist[1], dist


# --- standard optimizer behaviour ---------------------------------------------------------------

def _mlp():
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(20, 80), nn.Tanh(), nn.Linear(80, 70), nn.Tanh(), nn.Linear(70, 3))


def _batches(n, seed=1):
    g = torch.Generator().manual_seed(seed)
    teacher = torch.randn(20, 3, generator=g)
    xs = [torch.randn(16, 20, generator=g) for _ in range(n)]
    return [(x, (x @ teacher).argmax(1)) for x in xs]  # learnable labels


def _train(model, opt, batches):
    for x, y in batches:
        opt.zero_grad()
        F.cross_entropy(model(x), y).backward()
        opt.step()


RESUME_CASES = [{"bits": 4}, {"bits": 32}, {"bits": 4, "quant_map": "dynamic", "graft": "sgd", "lr": 0.05},
                {"bits": 8, "quantize": "statistics", "weight_decay": 0.01}]


@pytest.mark.parametrize("kw", RESUME_CASES, ids=lambda kw: "-".join(f"{k}={v}" for k, v in kw.items()))
def test_resume_is_bit_identical(kw):
    kw = dict({"lr": 0.01, "stat_every": 2, "root_every": 3}, **kw)
    batches = _batches(9)
    model = _mlp()
    opt = Shampoo(model.parameters(), **kw)
    _train(model, opt, batches[:5])
    buf = io.BytesIO()
    torch.save({"model": model.state_dict(), "opt": opt.state_dict()}, buf)
    _train(model, opt, batches[5:])  # N + M straight

    buf.seek(0)
    saved = torch.load(buf, weights_only=True)  # tensors and plain values only: no pickled objects
    resumed = _mlp()
    resumed.load_state_dict(saved["model"])
    opt2 = Shampoo(resumed.parameters(), **kw)
    opt2.load_state_dict(saved["opt"])
    _train(resumed, opt2, batches[5:])
    for a, b in zip(model.parameters(), resumed.parameters()):
        assert torch.equal(a, b)
    assert {k: v.dtype for st in opt.state.values() for k, v in st.items() if torch.is_tensor(v)} == \
        {k: v.dtype for st in opt2.state.values() for k, v in st.items() if torch.is_tensor(v)}


def test_resume_keeps_fp32_and_uint8_state_for_bf16_params():
    # torch's load_state_dict casts state to the parameter's dtype; Shampoo must undo that
    p = nn.Parameter(torch.ones(70, 66, dtype=torch.bfloat16))
    opt = Shampoo([p], stat_every=1, root_every=1)
    p.grad = torch.randn(70, 66).bfloat16()
    opt.step()
    opt2 = Shampoo([p], stat_every=1, root_every=1)
    opt2.load_state_dict(opt.state_dict())
    dtypes = {v.dtype for v in opt2.state[p].values() if torch.is_tensor(v)}
    assert dtypes == {torch.float32, torch.uint8}
    for key, value in opt.state[p].items():
        assert torch.equal(value, opt2.state[p][key]) if torch.is_tensor(value) else value == opt2.state[p][key]


def test_grad_is_never_modified_and_accumulation_works():
    model = _mlp()
    opt = Shampoo(model.parameters(), lr=0.01, weight_decay=0.1, stat_every=1, root_every=1)
    x, y = _batches(1)[0]
    F.cross_entropy(model(x), y).backward()
    F.cross_entropy(model(x), y).backward()  # accumulated
    before = [p.grad.clone() for p in model.parameters()]
    opt.step()
    assert all(torch.equal(b, p.grad) for b, p in zip(before, model.parameters()))
    opt.step()  # a second step on the same grads still sees them unchanged
    assert all(torch.equal(b, p.grad) for b, p in zip(before, model.parameters()))


def test_closure_and_hooks():
    model = _mlp()
    opt = Shampoo(model.parameters(), lr=0.01)
    x, y = _batches(1)[0]
    calls = []
    opt.register_step_post_hook(lambda o, a, k: calls.append("post"))

    def closure():
        opt.zero_grad()
        loss = F.cross_entropy(model(x), y)
        loss.backward()
        return loss

    first = opt.step(closure)
    assert torch.is_tensor(first) and calls == ["post"]
    for _ in range(20):
        last = opt.step(closure)
    assert last < first


def test_param_groups_have_their_own_settings():
    model = _mlp()
    opt = Shampoo([{"params": model[0].parameters(), "bits": 32},
                   {"params": list(model[2].parameters()) + list(model[4].parameters()), "lr": 0.0}],
                  lr=0.01, stat_every=1)
    before = [p.detach().clone() for p in model.parameters()]
    _train(model, opt, _batches(2))
    keys = {id(p): set(opt.state[p]) for p in model.parameters()}
    assert not any(k.endswith(".codes") for k in keys[id(model[0].weight)])  # bits=32 group
    assert any(k.endswith(".codes") for k in keys[id(model[2].weight)])  # 80x80 and 70x70 blocks
    moved = [not torch.equal(b, p) for b, p in zip(before, model.parameters())]
    assert moved == [True, True, False, False, False, False]  # lr=0 group stays put


def test_training_reduces_loss_for_every_variant():
    batches = _batches(40) * 2
    for kw in ({}, {"bits": 32}, {"quantize": "statistics"}, {"graft": "sgd", "lr": 0.1}):
        model = _mlp()
        opt = Shampoo(model.parameters(), **dict({"lr": 0.01, "stat_every": 5, "root_every": 10}, **kw))
        x, y = batches[0]
        first = F.cross_entropy(model(x), y).item()
        _train(model, opt, batches)
        assert F.cross_entropy(model(x), y).item() < 0.5 * first, kw


# --- memory -------------------------------------------------------------------------------------

def test_state_is_allocated_at_full_size_on_the_first_step():
    model = _mlp()
    opt = Shampoo(model.parameters(), stat_every=100, root_every=500, start_step=3)
    batches = _batches(4)
    _train(model, opt, batches[:1])
    first = state_bytes(opt)
    _train(model, opt, batches[1:])
    assert state_bytes(opt) == first and first["preconditioner"] > 0


def test_four_bit_preconditioner_is_seven_times_smaller():
    sizes = {}
    for bits in (32, 4):
        _, opt = _run(lambda ps, bits=bits: Shampoo(ps, bits=bits), (512, 512), 1)
        sizes[bits] = state_bytes(opt)
    # per side of order 512: fp32 eigenvalues + V + root vs fp32 eigenvalues + root diagonal + 2 x 4.5 bits
    side32 = 4 * 512 + 2 * 4 * 512 * 512
    side4 = 2 * 4 * 512 + 2 * (512 * 512 // 2 + 512 * 8 * 4)
    assert sizes[32]["preconditioner"] == 2 * side32 and sizes[4]["preconditioner"] == 2 * side4
    assert sizes[32]["preconditioner"] / sizes[4]["preconditioner"] > 7.0
    assert sizes[4]["first_order"] == sizes[32]["first_order"] == 2 * 4 * 512 * 512
    assert sizes[4]["total"] == sizes[4]["preconditioner"] + sizes[4]["first_order"]


@pytest.mark.parametrize("kw", [{}, {"bits": 32}, {"quantize": "statistics"}, {"graft": "sgd"}])
def test_estimate_counts_the_same_optimizer_state_as_a_real_run(kw):
    model = _mlp()
    x = torch.randn(16, 20)
    opt = Shampoo(model.parameters(), lr=0.01, **kw)
    report = memopt.estimate(model, x, optimizer=opt)
    real = copy.deepcopy(model)
    real_opt = Shampoo(real.parameters(), lr=0.01, **kw)
    for _ in range(2):  # the cost model simulates two steps
        real_opt.zero_grad()
        real(x).sum().backward()
        real_opt.step()
    assert report.breakdown["optimizer_state"] == state_bytes(real_opt)["total"]
    assert not opt.state  # the user's optimizer is only read


def test_estimated_peak_equals_measured_peak_and_optimize_counts_the_state():
    model = _mlp()
    x = torch.randn(16, 20)
    opt = Shampoo(model.parameters(), stat_every=1, root_every=1)  # the step's QR/Björck transients too
    assert memopt.estimate(model, x, optimizer=opt).peak_bytes == memopt.measure(model, x, optimizer=opt).peak_bytes
    planned = memopt.optimize(model, example_inputs=x, optimizer=opt)
    real = copy.deepcopy(model)
    real_opt = Shampoo(real.parameters())
    real(x).sum().backward()
    real_opt.step()
    assert planned.plan.estimated_breakdown["optimizer_state"] == state_bytes(real_opt)["total"]


def test_state_bytes_and_estimate_agree_for_stock_adamw():
    model = _mlp()
    x = torch.randn(16, 20)
    estimated = memopt.estimate(model, x, optimizer=torch.optim.AdamW(model.parameters())).breakdown
    opt = torch.optim.AdamW(model.parameters())
    for _ in range(2):
        model(x).sum().backward()
        opt.step()
    params = sum(p.numel() for p in model.parameters())
    sizes = state_bytes(opt)
    assert sizes["preconditioner"] == 0 and sizes["first_order"] == 2 * 4 * params + 4 * 6  # m, v, 6 steps
    assert estimated["optimizer_state"] == sizes["total"]


# --- errors -------------------------------------------------------------------------------------

@pytest.mark.parametrize("kw, message", [
    ({"bits": 3}, r"bits=3 is not supported; use 4, 8 or 32"),
    ({"bits": True}, r"bits=True is not supported"),
    ({"lr": -1.0}, r"lr=-1.0 must be a float >= 0"),
    ({"betas": (0.9,)}, r"betas=\(0.9,\) must be a pair"),
    ({"betas": (0.9, 1.0)}, r"betas\[1\]=1.0 must be a float in \[0, 1\)"),
    ({"weight_decay": -0.1}, r"weight_decay=-0.1 must be a float >= 0"),
    ({"graft": "adam"}, r"graft='adam' is not known; use 'adamw' or 'sgd'"),
    ({"momentum": 1.5}, r"momentum=1.5 must be a float in \[0, 1\)"),
    ({"stat_decay": 1.0}, r"stat_decay=1.0 must be a float in \[0, 1\)"),
    ({"eps": 0.0}, r"eps=0.0 must be a float > 0"),
    ({"stat_every": 0}, r"stat_every=0 must be an int >= 1"),
    ({"root_every": 2.5}, r"root_every=2.5 must be an int >= 1"),
    ({"start_step": 0}, r"start_step=0 must be an int >= 1"),
    ({"block_size": 0}, r"block_size=0 must be an int >= 1"),
    ({"max_order": -3}, r"max_order=-3 must be an int >= 1"),
    ({"min_quant_numel": -1}, r"min_quant_numel=-1 must be an int >= 0"),
    ({"quant_map": "nf4"}, r"quant_map='nf4' is not known; use one of \('linear2', 'dynamic'\)"),
    ({"rectify_iters": (1,)}, r"rectify_iters=\(1,\) must be a pair of ints >= 0"),
    ({"rectify_iters": (1, -2)}, r"rectify_iters=\(1, -2\) must be a pair"),
    ({"quantize": "both"}, r"quantize='both' is not known; use 'eigenvectors' or 'statistics'"),
])
def test_bad_arguments_name_the_value(kw, message):
    with pytest.raises(ValueError, match=message):
        Shampoo([nn.Parameter(torch.ones(2, 2))], **kw)


def test_bad_param_group_and_sparse_grad():
    p = nn.Parameter(torch.ones(3, 3))
    opt = Shampoo([p])
    with pytest.raises(ValueError, match=r"bits=2 is not supported"):
        opt.add_param_group({"params": [nn.Parameter(torch.ones(2))], "bits": 2})
    p.grad = torch.eye(3).to_sparse()
    with pytest.raises(RuntimeError, match="does not support sparse gradients"):
        opt.step()
