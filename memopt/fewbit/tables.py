"""Optimal piecewise-constant approximations of activation derivatives (few-bit backward tables).

For f' on a domain [lo, hi] and a weight w >= 0, find borders lo < t_1 < ... < t_{K-1} < hi and
levels q_1..q_K minimising  E = ∫ (f'(x) - q(x))^2 w(x) dx,  q = q_k on (t_{k-1}, t_k].

For fixed borders each level is the w-weighted mean of f' on its piece; with prefix integrals
W = ∫w, F1 = ∫f'w, F2 = ∫f'^2 w over the grid cells, a piece [a, b] costs
    cost(a, b) = (F2(b) - F2(a)) - (F1(b) - F1(a))^2 / (W(b) - W(a)),
and dynamic programming over the grid cut points, D_k[j] = min_{i<j} D_{k-1}[i] + cost(i, j), finds
the global optimum on the grid (no seed, no local iteration). With uniform w, F1 over a cell is
f(t_{j+1}) - f(t_j) exactly, so the levels are the secant slopes (f(t_k) - f(t_{k-1}))/(t_k - t_{k-1}).
Cell integrals for F2 (and for F1 under other weights) use 5-point Gauss-Legendre per cell, with f'
from autograd in float64, so every activation uses one code path.
"""
from __future__ import annotations

import functools
import json
from pathlib import Path
from typing import Callable, Optional, Tuple, Union

import torch

from memopt.fewbit.activations import Params, get_activation
from memopt.core.validation import check_bits

Weight = Union[str, Callable[[torch.Tensor], torch.Tensor], Tuple[torch.Tensor, torch.Tensor]]

DEFAULT_DOMAIN = (-10.0, 10.0)
DEFAULT_GRID = 4096
SHIPPED = Path(__file__).with_name("default_tables.json")

_GL_NODES = torch.tensor([-0.9061798459386640, -0.5384693101056831, 0.0, 0.5384693101056831, 0.9061798459386640],
                         dtype=torch.float64)
_GL_WEIGHTS = torch.tensor([0.2369268850561891, 0.4786286704993665, 0.5688888888888889, 0.4786286704993665,
                            0.2369268850561891], dtype=torch.float64)


def derivative(name: str, params: Params, x: torch.Tensor) -> torch.Tensor:
    """f'(x) in float64 by autograd through the torch implementation of the activation."""
    act = get_activation(name)
    x = x.detach().to(torch.float64).requires_grad_(True)
    (grad,) = torch.autograd.grad(act(x, params).sum(), x)
    return grad


def _density(weight: Weight, x: torch.Tensor, scale: float) -> torch.Tensor:
    if isinstance(weight, str):
        if weight == "uniform":
            return torch.ones_like(x)
        if weight == "normal":
            return torch.exp(-0.5 * (x / scale) ** 2) / (scale * (2 * torch.pi) ** 0.5)
        raise ValueError(f"weight={weight!r} is not known; use 'uniform', 'normal', a callable density or a "
                         f"histogram (counts, bin_edges) such as torch.histogram returns")
    if callable(weight):
        w = torch.as_tensor(weight(x), dtype=torch.float64)
        if w.shape != x.shape or bool((w < 0).any()) or not bool(torch.isfinite(w).all()):
            raise ValueError("a callable weight must return a finite, non-negative density of its input's shape")
        return w
    if isinstance(weight, (tuple, list)) and len(weight) == 2:
        counts, edges = (torch.as_tensor(v, dtype=torch.float64) for v in weight)
        if edges.numel() != counts.numel() + 1 or bool((counts < 0).any()):
            raise ValueError(f"a histogram weight is (counts, bin_edges) with len(bin_edges) == len(counts) + 1 and "
                             f"counts >= 0; got {counts.numel()} counts and {edges.numel()} edges")
        widths = edges[1:] - edges[:-1]
        dens = torch.where(widths > 0, counts / widths.clamp_min(1e-300), torch.zeros_like(counts))
        idx = torch.bucketize(x, edges, right=True) - 1
        inside = (idx >= 0) & (idx < counts.numel())
        return torch.where(inside, dens[idx.clamp(0, counts.numel() - 1)], torch.zeros_like(x))
    raise TypeError(f"weight must be a name, a callable or a (counts, bin_edges) histogram, got {type(weight).__name__}")


def _cell_integrals(name: str, params: Params, edges: torch.Tensor, weight: Weight, scale: float):
    h = edges[1:] - edges[:-1]
    xs = (edges[:-1] + edges[1:]).unsqueeze(1) / 2 + h.unsqueeze(1) / 2 * _GL_NODES
    quad = h.unsqueeze(1) / 2 * _GL_WEIGHTS
    d = derivative(name, params, xs.reshape(-1)).view_as(xs)
    w = _density(weight, xs.reshape(-1), scale).view_as(xs)
    W = (w * quad).sum(1)
    F1 = (d * w * quad).sum(1)
    F2 = (d * d * w * quad).sum(1)
    if isinstance(weight, str) and weight == "uniform":
        act = get_activation(name)
        with torch.no_grad():
            f = act(edges.to(torch.float64), params)
        F1 = f[1:] - f[:-1]  # exact: f is the primitive of f'
        W = h
    return W, F1, F2


def _solve(W: torch.Tensor, F1: torch.Tensor, F2: torch.Tensor, pieces: int, block: int = 128):
    """Exact DP over cut points. Returns (cut indices 0 = c_0 < ... < c_K = N, optimal error, prefixes).

    The cost matrix is kept as column blocks of its upper triangle (i < j), so each DP sweep reads
    half the matrix, block by block while it sits in cache.
    """
    n = W.numel()
    zero = torch.zeros(1, dtype=torch.float64)
    PW, P1, P2 = (torch.cat([zero, v.cumsum(0)]) for v in (W, F1, F2))
    blocks = []
    for j0 in range(0, n + 1, block):
        j1 = min(j0 + block, n + 1)
        width = (PW[j0:j1] - PW[:j1, None]).clamp_(min=1e-300)
        first = P1[j0:j1] - P1[:j1, None]
        cost = P2[j0:j1] - P2[:j1, None]  # F2 - F1^2/W: the w-weighted squared error of the mean
        cost.sub_(first.square_().div_(width)).clamp_(min=0.0)
        cost.masked_fill_(torch.arange(j1).unsqueeze(1) >= torch.arange(j0, j1).unsqueeze(0), float("inf"))
        blocks.append((j0, j1, cost))
    best = torch.cat([cost[0] for _, _, cost in blocks])  # one piece covering cells 0..j-1
    choices = []
    for _ in range(1, pieces):
        new_best = torch.empty_like(best)
        arg = torch.empty(n + 1, dtype=torch.long)
        for j0, j1, cost in blocks:
            new_best[j0:j1], arg[j0:j1] = (best[:j1, None] + cost).min(dim=0)
        best = new_best
        choices.append(arg)
    cuts = [n]
    for arg in reversed(choices):
        cuts.append(int(arg[cuts[-1]]))
    cuts.append(0)
    return cuts[::-1], float(best[n]), (PW, P1)


def _validate(name: str, bits: int, domain, grid: int) -> None:
    act = get_activation(name)
    if act.exact:
        raise ValueError(f"{name} is piecewise linear: its derivative is coded exactly with a 1-bit mask, "
                         f"it needs no table")
    check_bits(bits, "bits")
    lo, hi = domain
    if not (float(lo) < float(hi)):
        raise ValueError(f"domain must be (low, high) with low < high, got {domain!r}")
    if not isinstance(grid, int) or grid < 2 ** bits:
        raise ValueError(f"grid must be an int >= 2**bits = {2 ** bits} cells, got {grid!r}")


def compute_table(name: str, bits: int, *, params: Params = (), domain=DEFAULT_DOMAIN, weight: Weight = "uniform",
                  grid: int = DEFAULT_GRID, scale: float = 1.0) -> Tuple[torch.Tensor, torch.Tensor, float]:
    """Solve the DP now (no cache): ``(borders, levels, error)``."""
    _validate(name, bits, domain, grid)
    params = get_activation(name).params(dict(params))
    edges = torch.linspace(float(domain[0]), float(domain[1]), grid + 1, dtype=torch.float64)
    W, F1, F2 = _cell_integrals(name, params, edges, weight, scale)
    cuts, error, (PW, P1) = _solve(W, F1, F2, 2 ** bits)
    a, b = torch.tensor(cuts[:-1]), torch.tensor(cuts[1:])
    width = PW[b] - PW[a]
    levels = torch.where(width > 1e-300, (P1[b] - P1[a]) / width.clamp_min(1e-300),
                         derivative(name, params, (edges[a] + edges[b]) / 2))
    return edges[torch.tensor(cuts[1:-1], dtype=torch.long)], levels, error


@functools.lru_cache(maxsize=None)
def _shipped() -> dict:
    return json.loads(SHIPPED.read_text()) if SHIPPED.exists() else {}


SHIPPED_WEIGHTS = ("uniform", "normal")  # the named weights shipped (normal: at scale 1.0), on the default grid


def shipped_key(name: str, params: Params, bits: int, weight: str = "uniform") -> str:
    """The table's key in default_tables.json (uniform-weight keys keep their first format)."""
    key = f"{name}|{','.join(f'{k}={v}' for k, v in params)}|{bits}"
    return key if weight == "uniform" else f"{key}|{weight}"


@functools.lru_cache(maxsize=512)
def _cached(name: str, params: Params, bits: int, domain: Tuple[float, float], weight: str, grid: int,
            scale: float) -> Tuple[Tuple[float, ...], Tuple[float, ...], float]:
    # shipped: FewBitConfig's default weight ("normal", scale 1) took seconds per activation and bit width to solve
    # in every process that planned few-bit units
    if (domain, grid) == (DEFAULT_DOMAIN, DEFAULT_GRID) and (weight == "uniform" or (weight, scale) == ("normal", 1.0)):
        entry = _shipped().get(shipped_key(name, params, bits, weight))
        if entry is not None:
            return tuple(entry["borders"]), tuple(entry["levels"]), entry["error"]
    borders, levels, error = compute_table(name, bits, params=params, domain=domain, weight=weight, grid=grid,
                                           scale=scale)
    return tuple(borders.tolist()), tuple(levels.tolist()), error


def fewbit_table(name: str, bits: int, *, domain: Tuple[float, float] = DEFAULT_DOMAIN, weight: Weight = "uniform",
                 grid: int = DEFAULT_GRID, params: Optional[dict] = None,
                 scale: float = 1.0) -> Tuple[torch.Tensor, torch.Tensor]:
    """The optimal b-bit table for activation ``name``: ``(borders, levels)`` as float64 tensors.

    Args:
        name: a table activation ("gelu", "silu", "tanh", ...; see ``memopt.fewbit.TABLE_ACTIVATIONS``).
        bits: 1..8; the table has 2**bits levels and 2**bits - 1 internal borders.
        domain: the interval the weight lives on (default (-10, 10)); the end pieces extend to ±inf.
        weight: "uniform" (default), "normal" (Gaussian density with standard deviation ``scale``),
            a callable density, or a histogram ``(counts, bin_edges)`` of pre-activations.
        grid: number of grid cells on the domain (default 4096); borders lie on cell edges.
        params: the activation's hyper-parameters (e.g. {"approximate": "tanh"}, {"alpha": 0.5}).
    Tables for named weights are cached; defaults come from the data shipped in the package.
    """
    _validate(name, bits, domain, grid)
    act_params = get_activation(name).params(dict(params or {}))
    domain = (float(domain[0]), float(domain[1]))
    if isinstance(weight, str):
        borders, levels, _ = _cached(name, act_params, bits, domain, weight, grid, float(scale))
        return torch.tensor(borders, dtype=torch.float64), torch.tensor(levels, dtype=torch.float64)
    borders, levels, _ = compute_table(name, bits, params=act_params, domain=domain, weight=weight, grid=grid,
                                       scale=scale)
    return borders, levels


def table_error(name: str, borders: torch.Tensor, levels: torch.Tensor, *, params: Optional[dict] = None,
                domain: Tuple[float, float] = DEFAULT_DOMAIN, weight: Weight = "uniform", grid: int = DEFAULT_GRID,
                scale: float = 1.0) -> float:
    """∫ (f' - q)^2 w over the domain for any table (borders, levels), by the same quadrature."""
    act_params = get_activation(name).params(dict(params or {}))
    edges = torch.linspace(float(domain[0]), float(domain[1]), grid + 1, dtype=torch.float64)
    h = edges[1:] - edges[:-1]
    xs = ((edges[:-1] + edges[1:]).unsqueeze(1) / 2 + h.unsqueeze(1) / 2 * _GL_NODES).reshape(-1)
    quad = (h.unsqueeze(1) / 2 * _GL_WEIGHTS).reshape(-1)
    q = levels.to(torch.float64)[torch.bucketize(xs, borders.to(torch.float64))]
    d = derivative(name, act_params, xs)
    return float(((d - q) ** 2 * _density(weight, xs, scale) * quad).sum())
