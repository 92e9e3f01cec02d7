"""python -m tools.bench.shampoo.bench_shampoo_tracking [--out PATH]   (about 3 minutes on 1 core)

Eigenvector tracking error of Shampoo's statistic over training, against the exact root, for the
ways ``Shampoo`` can update and store eigenvectors (qr_iters, eigh_every, vector_bits), next to the
4-bit quantization error, and where the error sits (eigenvalues or eigenvectors).

Gradients: the 256x256 hidden weight of an MLP 32-256-256-10 (Tanh) trained 300 steps with AdamW
(lr 1e-3, batch 64) on a synthetic task (labels of a fixed random teacher MLP on Gaussian inputs);
the gradient of every 5th step is recorded, 60 in all. Every variant sees this same sequence on a
standalone 256x256 parameter with stat_every = root_every = 1 (one statistic and root update per
recorded gradient), so only the eigenvector update differs. Exact: L = EMA_0.95(G Gᵀ) from 1e-6·I in
float64, R = L^(-1/4) by eigh with the relative ridge 1e-6·max λ. Errors are ||R~ - R||_F / ||R||_F:
"stored root" is the left root as the optimizer stores it (fp32 diagonal, off-diagonal in ``bits``)
after updates 10, 30 and 60; "tracked" is the root of the tracked statistic before the root is
stored (the stored eigenvectors dequantized and rectified with 4 Björck steps, the stored
eigenvalues), after update 60: the tracking error, to compare with "4-bit quantization alone"
(the exact eigenvectors of the final L stored in 4 bits and rectified, the same way). Where the
tracking error sits, after update 60: "eigenvalues only" takes the exact eigenvectors with the
tracked eigenvalues (sorted), "eigenvectors only" the tracked eigenvectors with the exact
statistic's Rayleigh quotients along them. Time: the fastest of 9 runs of the 60th statistic
update of one side (order 256; an eigh one for eigh_every=1), 1 thread; the fastest, not the
median, because the machine is shared and the median moves with the other jobs' load. Bytes: the preconditioner state of
the 256x256 parameter (L and R: eigenvectors, eigenvalues, roots).
"""
from __future__ import annotations

import argparse
import os
import time

import torch
import torch.nn.functional as F
from tabulate import tabulate
from torch import nn

from memopt.optim import Shampoo, state_bytes
from memopt.optim.config import ShampooConfig
from memopt.optim.linalg import bjorck, eigh_inverse_root, inverse_root
from memopt.optim.quant import QuantSpec, dequantize, quantize
from memopt.optim.shampoo import _MatrixStore
from tools.bench.common import RESULTS, write_results_file

COMMAND = "python -m tools.bench.shampoo.bench_shampoo_tracking"
EPS, ORDER, STEPS, EVERY = 1e-6, 256, 300, 5
MARKS = (10, 30, 60)
VARIANTS = [(32, "qr_iters=1 (published)", {}), (32, "qr_iters=4", {"qr_iters": 4}),
            (32, "qr_iters=8", {"qr_iters": 8}), (32, "eigh_every=10", {"eigh_every": 10}),
            (32, "eigh_every=1", {"eigh_every": 1}),
            (4, "qr_iters=1 (published)", {}), (4, "qr_iters=4", {"qr_iters": 4}),
            (4, "rectify_iters=(4, 4)", {"rectify_iters": (4, 4)}), (4, "eigh_every=1", {"eigh_every": 1}),
            (4, "vector_bits=8, qr_iters=1", {"vector_bits": 8}),
            (4, "vector_bits=8, qr_iters=4", {"vector_bits": 8, "qr_iters": 4}),
            (4, "vector_bits=8, eigh_every=1", {"vector_bits": 8, "eigh_every": 1}),
            (8, "eigh_every=1", {"eigh_every": 1})]


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


def relative(approx: torch.Tensor, ref: torch.Tensor) -> float:
    return ((approx.double() - ref).norm() / ref.norm()).item()


def run_variant(grads, exact, bits: int, kw: dict) -> dict:
    p = nn.Parameter(torch.zeros(ORDER, ORDER))
    opt = Shampoo([p], lr=0.0, bits=bits, stat_every=1, root_every=1, **kw)
    cfg = ShampooConfig.from_group(opt.param_groups[0])
    state = opt.state[p]
    out = {}
    for i, g in enumerate(grads, start=1):
        p.grad = g
        opt.step()
        if i in MARKS:
            out[i] = relative(_MatrixStore(state, cfg).get("pre.0.L.root", ORDER, sym=True), exact[i][0])
    ref, stat = exact[MARKS[-1]]
    store = _MatrixStore(state, cfg)
    vecs = bjorck(store.get("pre.0.L.vecs", ORDER).mT, 4).double()
    vals = state["pre.0.L.vals"].double()
    out["tracked"] = relative(inverse_root(vecs, vals, EPS), ref)
    _, exact_vecs = torch.linalg.eigh(stat)
    out["eigenvalues only"] = relative(inverse_root(exact_vecs, vals.sort().values, EPS), ref)
    out["eigenvectors only"] = relative(inverse_root(vecs, ((stat @ vecs) * vecs).sum(0), EPS), ref)
    out["bytes"] = state_bytes(opt)["preconditioner"]
    # the timed step also did the right side, the root and the preconditioned direction: time one
    # statistic update of one side directly
    gg = grads[-1] @ grads[-1].T
    update_times = []
    for _ in range(9):
        saved = {k: v.clone() for k, v in state.items() if torch.is_tensor(v)}
        start = time.perf_counter()
        opt._update_stat(store, "pre.0.L", gg, cfg, len(grads))
        update_times.append(time.perf_counter() - start)
        for k, v in saved.items():
            state[k].copy_(v)
    out["ms"] = min(update_times) * 1e3  # the least disturbed of 9 on a shared machine
    return out


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


def reading(results: dict, quant: float) -> str:
    """What the table says about the cause, from this run's numbers."""
    eigh4, eigh32 = results[4, "eigh_every=1"], results[32, "eigh_every=1"]
    mixed = results[4, "vector_bits=8, eigh_every=1"]
    qr1, qr4 = results[4, "qr_iters=1 (published)"], results[4, "qr_iters=4"]
    return (f"Cause: at 4 bits an exact eigh at every update leaves the tracked root {eigh4['tracked']:.4f} from "
            f"the exact one (32 bits: {eigh32['tracked']:.4f}), {eigh4['tracked'] / quant:.1f}x the error of one "
            f"4-bit quantization of the exact eigenvectors ({quant:.4f}); more QR iterations do not help either "
            f"({qr1['tracked']:.4f} with 1, {qr4['tracked']:.4f} with 4). The eigenvalues are close "
            f"(eigenvalues only: {eigh4['eigenvalues only']:.4f}); the eigenvectors are not "
            f"({eigh4['eigenvectors only']:.4f}): every update rebuilds the statistic from the re-quantized "
            f"eigenvectors, so each update's quantization error enters the statistic and they accumulate. "
            f"8-bit eigenvectors (4-bit roots) with eigh at every update: tracked {mixed['tracked']:.4f}, under "
            f"the 4-bit quantization error, for {mixed['bytes'] / qr1['bytes']:.2f}x the preconditioner bytes of "
            f"published 4-bit and {mixed['ms'] / qr1['ms']:.2f}x its statistic-update time; the stored root adds "
            f"the 4-bit root's own quantization error.")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", default=str(RESULTS / "shampoo" / "shampoo_tracking.md"))
    args = parser.parse_args()
    torch.set_num_threads(1)
    load_start = os.getloadavg()[0]
    grads = recorded_gradients()
    exact = exact_roots(grads)
    quant, root_quant = quantization_only(exact[MARKS[-1]][1])
    rows, results = [], {}
    for bits, label, kw in VARIANTS:
        r = results[bits, label] = run_variant(grads, exact, bits, kw)
        rows.append([bits, label] + [f"{r[m]:.4f}" for m in MARKS]
                    + [f"{r[k]:.4f}" for k in ("tracked", "eigenvalues only", "eigenvectors only")]
                    + [f"{r['ms']:.2f}", f"{r['bytes'] / 1024:.0f}"])
        print(rows[-1], flush=True)
    table = tabulate(rows, headers=["bits", "eigenvector update / storage"]
                     + [f"stored root, after {m} updates" for m in MARKS]
                     + ["tracked, after 60", "eigenvalues only", "eigenvectors only",
                        "ms per statistic update (one side)", "preconditioner KiB"], tablefmt="github")
    doc = __doc__.split("\n\n", 1)[1].strip()
    text = (f"{COMMAND}\n\n# 4-bit Shampoo: eigenvector tracking error over training, order {ORDER}\n\n"
            f"torch {torch.__version__}, CPU, 1 thread; load average (1 min) {load_start:.1f} at the start, "
            f"{os.getloadavg()[0]:.1f} at the end (2 cores, shared with other jobs: times carry that noise)."
            f"\n\n{doc}\n\n{table}\n\n"
            f"4-bit quantization alone (exact eigenvectors of the final L, 4-bit, rectified): **{quant:.4f}**; "
            f"the exact root stored as Shampoo stores it at 4 bits (fp32 diagonal, 4-bit off-diagonal): "
            f"**{root_quant:.4f}**.\n\n{reading(results, quant)}\n")
    write_results_file(args.out, text)


if __name__ == "__main__":
    main()
