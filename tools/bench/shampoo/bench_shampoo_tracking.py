"""python -m tools.bench.shampoo.bench_shampoo_tracking [--out PATH]   (about a minute on 1 core)

Eigenvector tracking error of Shampoo's statistic over training, against the exact root, for the
ways ``Shampoo`` can update eigenvectors (qr_iters, eigh_every), next to the 4-bit quantization error.

Gradients: the 256x256 hidden weight of an MLP 32-256-256-10 (Tanh) trained 300 steps with AdamW
(lr 1e-3, batch 64) on a synthetic task (labels of a fixed random teacher MLP on Gaussian inputs);
the gradient of every 5th step is recorded, 60 in all. Every variant sees this same sequence on a
standalone 256x256 parameter with stat_every = root_every = 1 (one statistic and root update per
recorded gradient), so only the eigenvector update differs. Exact: L = EMA_0.95(G Gᵀ) from 1e-6·I in
float64, R = L^(-1/4) by eigh with the relative ridge 1e-6·max λ. Error: ||R~ - R||_F / ||R||_F of
the stored left root after updates 10, 30 and 60 (32-bit storage: tracking error alone; 4-bit:
tracking and quantization). "4-bit quantization alone": the exact eigenvectors of the final L
stored in 4 bits (Uᵀ rows, blocks of 64, linear-2) and rectified with 4 Björck steps; and the exact
root stored as the optimizer stores roots. Time: the median wall time of the 60th statistic update
of one side (order 256; an eigh one for eigh_every=10), 1 thread.
"""
from __future__ import annotations

import argparse
import statistics
import time

import torch
import torch.nn.functional as F
from tabulate import tabulate
from torch import nn

from memopt.optim import Shampoo
from memopt.optim.config import ShampooConfig
from memopt.optim.linalg import bjorck, eigh_inverse_root, inverse_root
from memopt.optim.quant import QuantSpec, dequantize, quantize
from memopt.optim.shampoo import _MatrixStore
from tools.bench.common import RESULTS, write_results

EPS, ORDER, STEPS, EVERY = 1e-6, 256, 300, 5
MARKS = (10, 30, 60)
VARIANTS = [("qr_iters=1 (published)", {}), ("qr_iters=2", {"qr_iters": 2}), ("qr_iters=4", {"qr_iters": 4}),
            ("qr_iters=8", {"qr_iters": 8}), ("eigh_every=10", {"eigh_every": 10}),
            ("eigh_every=1", {"eigh_every": 1})]


def synthetic_task(seed: int = 0, n: int = 4096):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, 32, generator=g)
    teacher = nn.Sequential(nn.Linear(32, 64), nn.Tanh(), nn.Linear(64, 10))
    with torch.no_grad():
        for p in teacher.parameters():
            p.copy_(torch.randn(p.shape, generator=g))
        y = teacher(x).argmax(1)
    return x, y


def recorded_gradients(seed: int = 0) -> list[torch.Tensor]:
    x, y = synthetic_task(seed)
    torch.manual_seed(seed)
    model = nn.Sequential(nn.Linear(32, ORDER), nn.Tanh(), nn.Linear(ORDER, ORDER), nn.Tanh(), nn.Linear(ORDER, 10))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3, weight_decay=0.0)
    g = torch.Generator().manual_seed(seed + 1)
    grads = []
    for step in range(1, STEPS + 1):
        idx = torch.randint(0, len(x), (64,), generator=g)
        opt.zero_grad()
        F.cross_entropy(model(x[idx]), y[idx]).backward()
        if step % EVERY == 0:
            grads.append(model[2].weight.grad.clone())
        opt.step()
    return grads


def exact_roots(grads: list[torch.Tensor]) -> dict[int, torch.Tensor]:
    stat = EPS * torch.eye(ORDER, dtype=torch.float64)
    out = {}
    for i, g in enumerate(grads, start=1):
        g = g.double()
        stat = 0.95 * stat + 0.05 * g @ g.T
        if i in MARKS:
            out[i] = (eigh_inverse_root(stat, EPS), stat)
    return out


def left_root(opt: Shampoo, p: torch.Tensor) -> torch.Tensor:
    state = opt.state[p]
    if "pre.0.L.root" in state:
        return state["pre.0.L.root"]
    spec = QuantSpec(4, 64, "linear2")
    m = dequantize(state["pre.0.L.root.codes"], state["pre.0.L.root.scales"], (ORDER, ORDER), spec)
    return m + torch.diag(state["pre.0.L.root.diag"])


def run_variant(grads, exact, bits: int, kw: dict) -> tuple[dict[int, float], float]:
    p = nn.Parameter(torch.zeros(ORDER, ORDER))
    opt = Shampoo([p], lr=0.0, bits=bits, stat_every=1, root_every=1, **kw)
    errors, times = {}, []
    for i, g in enumerate(grads, start=1):
        p.grad = g
        start = time.perf_counter()
        opt.step()
        times.append(time.perf_counter() - start)
        if i in MARKS:
            ref = exact[i][0]
            errors[i] = ((left_root(opt, p).double() - ref).norm() / ref.norm()).item()
    # the timed step also did the right side, the root and the preconditioned direction: time one
    # statistic update of one side directly
    state = opt.state[p]
    cfg = ShampooConfig.from_group(opt.param_groups[0])
    store = _MatrixStore(state, cfg)
    gg = grads[-1] @ grads[-1].T
    update_times = []
    for _ in range(7):
        saved = {k: v.clone() for k, v in state.items() if torch.is_tensor(v)}
        start = time.perf_counter()
        opt._update_stat(store, "pre.0.L", gg, cfg, len(grads))
        update_times.append(time.perf_counter() - start)
        for k, v in saved.items():
            state[k].copy_(v)
    return errors, statistics.median(update_times)


def quantization_only(stat: torch.Tensor) -> tuple[float, float]:
    lam, u = torch.linalg.eigh(stat)
    spec = QuantSpec(4, 64, "linear2")
    ut = u.T.float().contiguous()
    u_q = dequantize(*quantize(ut, spec), tuple(ut.shape), spec).T
    approx = inverse_root(bjorck(u_q, 4), lam.float(), EPS).double()
    ref = eigh_inverse_root(stat, EPS)
    off = (ref - torch.diag(ref.diagonal())).float()  # the stored root: fp32 diagonal, 4-bit off-diagonal
    root_q = dequantize(*quantize(off, spec), tuple(off.shape), spec).double() + torch.diag(ref.diagonal())
    return (((approx - ref).norm() / ref.norm()).item(), ((root_q - ref).norm() / ref.norm()).item())


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", default=str(RESULTS / "shampoo" / "shampoo_tracking.md"))
    args = parser.parse_args()
    torch.set_num_threads(1)
    grads = recorded_gradients()
    exact = exact_roots(grads)
    quant, root_quant = quantization_only(exact[MARKS[-1]][1])
    rows = []
    for bits in (32, 4):
        for label, kw in VARIANTS:
            errors, t = run_variant(grads, exact, bits, kw)
            rows.append([bits, label] + [f"{errors[m]:.4f}" for m in MARKS] + [f"{t * 1e3:.2f}"])
            print(rows[-1], flush=True)
    table = tabulate(rows, headers=["bits", "eigenvector update"] + [f"error after {m} updates" for m in MARKS]
                     + ["ms per statistic update (one side)"], tablefmt="github")
    write_results(args.out, f"4-bit Shampoo: eigenvector tracking error over training, order {ORDER}",
                  "python -m tools.bench.shampoo.bench_shampoo_tracking", __doc__,
                  f"{table}\n\n4-bit quantization alone (exact eigenvectors of the final L, 4-bit, rectified): "
                  f"**{quant:.4f}**; the exact root stored as Shampoo stores it (fp32 diagonal, 4-bit off-diagonal): "
                  f"**{root_quant:.4f}**.")


if __name__ == "__main__":
    main()
