"""memopt.optim.Shampoo's update schedule ("reference" default, "eager") and eigenvector tracking
(qr_iters, eigh_every) against the exact root of the exact statistic."""
import pytest
import torch
from torch import nn

from memopt.optim import Shampoo
from memopt.optim.config import ShampooConfig, first_root_step, preconditioned, root_due, stat_due
from memopt.optim.shampoo import ADAM_EPS

pytestmark = pytest.mark.usefixtures("one_thread")


def _cfg(**kw):
    opt = Shampoo([nn.Parameter(torch.ones(2, 2))], **kw)
    return ShampooConfig.from_group(opt.param_groups[0])


def _steps(pred, cfg, n=30):
    return [k for k in range(1, n + 1) if pred(cfg, k)]


def test_default_schedule_is_the_reference_one():
    cfg = _cfg()
    assert cfg.schedule == "reference"
    assert _steps(stat_due, cfg, 1000) == [100 * i for i in range(1, 11)]
    assert _steps(root_due, cfg, 1000) == [500, 1000]
    assert first_root_step(cfg) == 500 and not preconditioned(cfg, 499) and preconditioned(cfg, 500)


@pytest.mark.parametrize("kw, stats, roots, first", [
    ({"stat_every": 3, "root_every": 6}, [3, 6, 9, 12, 15], [6, 12], 6),
    ({"stat_every": 3, "root_every": 6, "start_step": 4}, [6, 9, 12, 15], [9, 15], 9),
    ({"stat_every": 5, "root_every": 2}, [5, 10, 15], [6, 8, 10, 12, 14, 16], 6),  # roots once statistics exist
    ({"stat_every": 1, "root_every": 1}, list(range(1, 17)), list(range(1, 17)), 1),
    ({"stat_every": 3, "root_every": 6, "schedule": "eager"}, [1, 4, 7, 10, 13, 16], [1, 7, 13], 1),
    ({"stat_every": 3, "root_every": 6, "start_step": 4, "schedule": "eager"}, [4, 7, 10, 13, 16], [4, 10, 16], 4),
])
def test_schedule_steps(kw, stats, roots, first):
    cfg = _cfg(**kw)
    assert _steps(stat_due, cfg, 16) == stats
    assert _steps(root_due, cfg, 16) == roots
    assert first_root_step(cfg) == first and _steps(preconditioned, cfg, 16) == list(range(first, 17))


def _grads(n, shape=(70, 66), seed=0):
    g = torch.Generator().manual_seed(seed)
    basis = torch.randn(shape[0], 3, generator=g)
    return [basis @ torch.randn(3, shape[1], generator=g) + 0.1 * torch.randn(*shape, generator=g) for _ in range(n)]


def test_reference_schedule_is_adamw_until_the_first_root_and_gathers_statistics_meanwhile():
    w, ref = nn.Parameter(torch.ones(70, 66)), nn.Parameter(torch.ones(70, 66))
    opt = Shampoo([w], lr=0.01, stat_every=3, root_every=6)
    adamw = torch.optim.AdamW([ref], lr=0.01, weight_decay=0.0, eps=ADAM_EPS)
    vals, roots = [], []
    for k, g in enumerate(_grads(7), start=1):
        w.grad, ref.grad = g, g.clone()
        opt.step()
        adamw.step()
        vals.append(opt.state[w]["pre.0.L.vals"].clone())
        roots.append(opt.state[w]["pre.0.L.root.codes"].clone())
        if k < 6:
            torch.testing.assert_close(w, ref, rtol=0, atol=1e-6)  # the grafted optimizer alone
    changed = [not torch.equal(a, b) for a, b in zip(vals, vals[1:])]
    assert changed == [False, True, False, False, True, False]  # statistics at steps 3 and 6
    assert [not torch.equal(a, b) for a, b in zip(roots, roots[1:])] == [False] * 4 + [True, False]  # root at 6
    assert (w - ref).abs().max() > 1e-3  # preconditioned from step 6


def test_eager_schedule_builds_everything_at_the_first_step():
    w, ref = nn.Parameter(torch.ones(70, 66)), nn.Parameter(torch.ones(70, 66))
    opt = Shampoo([w], lr=0.01, stat_every=3, root_every=6, schedule="eager")
    adamw = torch.optim.AdamW([ref], lr=0.01, weight_decay=0.0, eps=ADAM_EPS)
    w.grad, ref.grad = _grads(1)[0], _grads(1)[0]
    opt.step()
    adamw.step()
    assert not torch.equal(opt.state[w]["pre.0.L.vals"], torch.full((70,), 1e-6))
    # AdamW's first step is ±lr per element whatever the direction: compare the second
    w.grad, ref.grad = _grads(2)[1], _grads(2)[1]
    opt.step()
    adamw.step()
    assert (w - ref).abs().max() > 1e-3


# --- eigenvector tracking -----------------------------------------------------------------------

def _tracking_error(steps=40, **kw):
    """Relative Frobenius error of the stored 32-bit left root against A^(-1/4) of the exact EMA statistic."""
    w = nn.Parameter(torch.ones(40, 30))
    opt = Shampoo([w], bits=32, stat_every=1, root_every=1, **kw)
    stat = 1e-6 * torch.eye(40, dtype=torch.float64)
    for g in _grads(steps, (40, 30), seed=3):
        w.grad = g
        opt.step()
        g = g.double()
        stat = 0.95 * stat + 0.05 * g @ g.T
    lam, vec = torch.linalg.eigh(stat)
    lam = lam.clamp_min(0)
    exact = (vec * (lam + 1e-6 * lam.max()) ** -0.25) @ vec.T
    return ((opt.state[w]["pre.0.L.root"].double() - exact).norm() / exact.norm()).item()


def test_more_qr_iterations_and_eigh_refreshes_track_the_exact_root_better():
    one, four, eigh_each = _tracking_error(), _tracking_error(qr_iters=4), _tracking_error(eigh_every=1)
    assert eigh_each < 1e-3 < four < one, (one, four, eigh_each)  # eigh: fp32 rounding only
    assert _tracking_error(eigh_every=10) < one  # a refresh every 10th update already helps
