"""4-bit Shampoo (Wang et al., NeurIPS 2024) in plain PyTorch: a ``torch.optim.Optimizer``.

For a weight reshaped to a matrix G (m x n), Shampoo keeps the statistics L ≈ Σ GGᵀ (m x m) and
R ≈ Σ GᵀG (n x n) and steps along L^(-1/4) G R^(-1/4). The 4-bit method stores, per statistic,
its eigenvalues in fp32 and its eigenvector matrix in 4 bits (quantizing the eigenvectors is far
more accurate than quantizing the statistic), and per inverse root its diagonal in fp32 and its
off-diagonal in 4 bits. Per preconditioned block and side (order d):

Every ``stat_every`` steps (the current gradient only, as published):
    V = bjorck(deq(Vᵀ)ᵀ, rectify_iters[0]);  A = V diag(λ) Vᵀ
    A = stat_decay · A + (1 - stat_decay) · GGᵀ   (GᵀG for R)
    P = qr(A V).Q (V by descending λ);  λ = diag(Pᵀ A P);  store quant(Pᵀ), λ          -- no eigh
Every ``root_every`` steps:
    V = bjorck(deq(Vᵀ)ᵀ, rectify_iters[1])
    Â = V diag((λ + eps · max λ)^(-1/4)) Vᵀ;  store diag(Â) in fp32, quant(offdiag(Â))
Every step: D = L̂ G R̂ per block, D *= ||G||_F / ||D||_F (grafting, whole tensor), then AdamW
(decoupled weight decay) or SGD-momentum (L2 weight decay added to D) steps with D as the gradient.

Updates happen at steps k >= ``start_step`` with (k - start_step) % every == 0, so by default the
statistics and roots are first built at step 1 (from L = R = eps·I, whose eigenvectors are I)
and the preconditioner is used from then on; before ``start_step`` D = G. All state is allocated
at full size at a parameter's first step, so state memory is constant from step 1 (the budget
accounting in ``cost_model`` relies on that). Statistics and first-order state are fp32 whatever
the parameter dtype. ``bits=32`` runs the same code with fp32 storage (the 32-bit baseline);
``quantize="statistics"`` is the naive baseline that stores L and R themselves (fp32 diagonal,
quantized off-diagonal) and takes roots with ``torch.linalg.eigh`` at root updates.
"""
from __future__ import annotations

import math
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any

import torch

from memopt.core.storage import distinct_bytes
from memopt.optim.linalg import bjorck, eigh_inverse_root, inverse_root, subspace_step
from memopt.optim.quant import QUANT_MAPS, QuantSpec, dequantize, quantize

ADAM_EPS = 1e-8  # AdamW's denominator epsilon (the API's ``eps`` is Shampoo's ridge and initial statistic)
PRECONDITIONER_PREFIX = "pre."  # state keys of the preconditioner; everything else is first-order state
_FIRST_ORDER_KEYS = {"adamw": ("exp_avg", "exp_avg_sq"), "sgd": ("momentum_buffer",)}


def _positive_int(name: str, value: Any, minimum: int = 1) -> None:
    if not isinstance(value, int) or isinstance(value, bool) or value < minimum:
        raise ValueError(f"{name}={value!r} must be an int >= {minimum}")


def _unit_interval(name: str, value: Any) -> None:
    if not isinstance(value, (int, float)) or isinstance(value, bool) or not 0.0 <= value < 1.0:
        raise ValueError(f"{name}={value!r} must be a float in [0, 1)")


@dataclass(frozen=True)
class ShampooConfig:
    """One param group's hyperparameters, validated (see ``Shampoo`` for their meaning)."""

    lr: float
    bits: int
    betas: tuple[float, float]
    weight_decay: float
    graft: str
    momentum: float
    stat_decay: float
    eps: float
    stat_every: int
    root_every: int
    start_step: int
    block_size: int
    max_order: int
    min_quant_numel: int
    quant_map: str
    rectify_iters: tuple[int, int]
    quantize: str

    def __post_init__(self) -> None:
        if not isinstance(self.lr, (int, float)) or isinstance(self.lr, bool) or not self.lr >= 0:
            raise ValueError(f"lr={self.lr!r} must be a float >= 0")
        if self.bits not in (4, 8, 32) or isinstance(self.bits, bool):
            raise ValueError(f"bits={self.bits!r} is not supported; use 4, 8 or 32 (32 = unquantized)")
        if not isinstance(self.betas, (tuple, list)) or len(self.betas) != 2:
            raise ValueError(f"betas={self.betas!r} must be a pair (beta1, beta2)")
        for i, beta in enumerate(self.betas):
            _unit_interval(f"betas[{i}]", beta)
        if not isinstance(self.weight_decay, (int, float)) or not self.weight_decay >= 0:
            raise ValueError(f"weight_decay={self.weight_decay!r} must be a float >= 0")
        if self.graft not in _FIRST_ORDER_KEYS:
            raise ValueError(f"graft={self.graft!r} is not known; use 'adamw' or 'sgd'")
        _unit_interval("momentum", self.momentum)
        _unit_interval("stat_decay", self.stat_decay)
        if not isinstance(self.eps, (int, float)) or isinstance(self.eps, bool) or not self.eps > 0:
            raise ValueError(f"eps={self.eps!r} must be a float > 0 (1e-6 is published)")
        for name in ("stat_every", "root_every", "start_step", "block_size", "max_order"):
            _positive_int(name, getattr(self, name))
        _positive_int("min_quant_numel", self.min_quant_numel, 0)
        if self.quant_map not in QUANT_MAPS:
            raise ValueError(f"quant_map={self.quant_map!r} is not known; use one of {QUANT_MAPS}")
        iters = self.rectify_iters
        if (not isinstance(iters, (tuple, list)) or len(iters) != 2
                or any(not isinstance(i, int) or isinstance(i, bool) or i < 0 for i in iters)):
            raise ValueError(f"rectify_iters={iters!r} must be a pair of ints >= 0 "
                             f"(Björck steps at statistic and at root updates)")
        if self.quantize not in ("eigenvectors", "statistics"):
            raise ValueError(f"quantize={self.quantize!r} is not known; use 'eigenvectors' or 'statistics'")

    @classmethod
    def from_group(cls, group: dict[str, Any]) -> ShampooConfig:
        return cls(**{name: group[name] for name in cls.__dataclass_fields__})

    @property
    def spec(self) -> QuantSpec | None:
        return None if self.bits == 32 else QuantSpec(self.bits, self.block_size, self.quant_map)


@dataclass(frozen=True)
class _Layout:
    """A parameter seen as a (rows, cols) matrix, cut into blocks of at most ``max_order``."""

    rows: int
    cols: int
    max_order: int

    def blocks(self) -> list[tuple[int, slice, slice]]:
        def cuts(n: int) -> list[slice]:
            return [slice(i, min(i + self.max_order, n)) for i in range(0, n, self.max_order)]

        pairs = [(r, c) for r in cuts(self.rows) for c in cuts(self.cols)]
        return [(i, r, c) for i, (r, c) in enumerate(pairs)]


def _layout(shape: torch.Size, max_order: int) -> _Layout | None:
    """(shape[0], -1) after squeezing; None (no preconditioner) for rank <= 1 or empty tensors."""
    dims = [d for d in shape if d != 1]
    if len(dims) < 2 or 0 in dims:
        return None
    return _Layout(dims[0], math.prod(dims[1:]), max_order)


class _MatrixStore:
    """Reads and writes square state matrices under a key, quantized when they are large enough.

    Quantized (bits < 32 and numel >= min_quant_numel): ``key.codes`` (packed uint8) and
    ``key.scales`` (fp32); a symmetric matrix (``sym``) keeps its diagonal in ``key.diag`` (fp32)
    and quantizes only the off-diagonal, whose scale the large diagonal would otherwise swamp.
    Otherwise the fp32 matrix itself under ``key``. Existing tensors are overwritten in place, so
    storages keep their identity and size across steps.
    """

    def __init__(self, state: dict[str, Any], cfg: ShampooConfig) -> None:
        self.state, self.spec, self.min_numel = state, cfg.spec, cfg.min_quant_numel

    def _quantized(self, n: int) -> bool:
        return self.spec is not None and n * n >= self.min_numel

    def _set(self, key: str, value: torch.Tensor) -> None:
        if key in self.state:
            self.state[key].copy_(value)
        else:
            self.state[key] = value.detach().clone()

    def put(self, key: str, m: torch.Tensor, sym: bool = False) -> None:
        if not self._quantized(m.shape[0]):
            self._set(key, m)
            return
        if sym:
            self._set(key + ".diag", m.diagonal())
            m = m.clone()
            m.diagonal().zero_()
        codes, scales = quantize(m, self.spec)
        self._set(key + ".codes", codes)
        self._set(key + ".scales", scales)

    def get(self, key: str, n: int, sym: bool = False) -> torch.Tensor:
        """The fp32 (n, n) matrix; for an unquantized one, the state tensor itself (do not modify)."""
        if not self._quantized(n):
            return self.state[key]
        m = dequantize(self.state[key + ".codes"], self.state[key + ".scales"], (n, n), self.spec)
        if sym:
            m.diagonal().add_(self.state[key + ".diag"])  # m is fresh: in place saves an n x n transient
        return m


class Shampoo(torch.optim.Optimizer):
    """4-bit Shampoo with AdamW or SGD-momentum grafting (the maths is in the module docstring).

    Args (defaults follow the paper's CIFAR/ImageNet settings unless noted):
        lr: learning rate of the grafted optimizer (1e-3, AdamW's usual value; use ~0.1 with "sgd").
        bits: 4 (default), 8, or 32 for the unquantized baseline through the same code.
        betas: AdamW's (beta1, beta2) = (0.9, 0.999); AdamW's own epsilon is ``ADAM_EPS`` = 1e-8.
        weight_decay: 0.0; decoupled for "adamw", added to the direction (L2) for "sgd".
        graft: "adamw" (default) or "sgd" (momentum, no dampening, no Nesterov).
        momentum: SGD momentum, 0.9.
        stat_decay: β of L = βL + (1-β)GGᵀ, 0.95.
        eps: 1e-6, the initial L = R = eps·I and the relative ridge eps·max λ of the inverse root.
        stat_every, root_every: T1 = 100 and T2 = 500 steps between statistic / root updates.
        start_step: 1, the first step that updates and uses the preconditioner.
        block_size: 64 elements per fp32 quantization scale.
        max_order: 1200; larger dimensions are split into blocks with their own L and R.
        min_quant_numel: 4096; smaller matrices (order < 64) stay fp32.
        quant_map: "linear2" (default, signed squares) or "dynamic" (dynamic tree).
        rectify_iters: (1, 4) Björck steps at statistic and at root updates.
        quantize: "eigenvectors" (the method) or "statistics" (the naive baseline).
    Parameters of rank <= 1 after squeezing are not preconditioned (D = G). Each param group may
    override any of these. ``p.grad`` is never modified.
    """

    def __init__(self, params: Iterable[Any], lr: float = 1e-3, *, bits: int = 4,
                 betas: tuple[float, float] = (0.9, 0.999), weight_decay: float = 0.0, graft: str = "adamw",
                 momentum: float = 0.9, stat_decay: float = 0.95, eps: float = 1e-6, stat_every: int = 100,
                 root_every: int = 500, start_step: int = 1, block_size: int = 64, max_order: int = 1200,
                 min_quant_numel: int = 4096, quant_map: str = "linear2", rectify_iters: tuple[int, int] = (1, 4),
                 quantize: str = "eigenvectors") -> None:
        defaults = {"lr": lr, "bits": bits, "betas": tuple(betas) if isinstance(betas, list) else betas,
                    "weight_decay": weight_decay, "graft": graft, "momentum": momentum,
                    "stat_decay": stat_decay, "eps": eps, "stat_every": stat_every, "root_every": root_every,
                    "start_step": start_step, "block_size": block_size, "max_order": max_order,
                    "min_quant_numel": min_quant_numel, "quant_map": quant_map,
                    "rectify_iters": rectify_iters, "quantize": quantize}
        ShampooConfig(**defaults)  # fail at construction, naming the bad value
        super().__init__(params, defaults)

    def add_param_group(self, param_group: dict[str, Any]) -> None:
        super().add_param_group(param_group)
        ShampooConfig.from_group(self.param_groups[-1])

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """As ``torch.optim.Optimizer``'s, but state tensors keep their saved dtype: the stock
        method casts every state tensor to the parameter's dtype (uint8 codes, fp32 statistics)."""
        super().load_state_dict(state_dict)
        saved_ids = [i for g in state_dict["param_groups"] for i in g["params"]]
        params = [p for g in self.param_groups for p in g["params"]]
        for pid, p in zip(saved_ids, params):
            for key, value in state_dict["state"].get(pid, {}).items():
                if isinstance(value, torch.Tensor):
                    self.state[p][key] = value.to(device=p.device, copy=True)

    @torch.no_grad()
    def step(self, closure: Callable[[], float] | None = None) -> float | None:
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        for group in self.param_groups:
            cfg = ShampooConfig.from_group(group)
            for p in group["params"]:
                if p.grad is None:
                    continue
                if p.grad.is_sparse:
                    raise RuntimeError("Shampoo does not support sparse gradients")
                self._step_param(p, cfg)
        return loss

    def _init_state(self, p: torch.Tensor, state: dict[str, Any], cfg: ShampooConfig,
                    layout: _Layout | None) -> None:
        state["step"] = 0
        for key in _FIRST_ORDER_KEYS[cfg.graft]:
            state[key] = torch.zeros(p.shape, dtype=torch.float32, device=p.device)
        store = _MatrixStore(state, cfg)
        for b, rows, cols in layout.blocks() if layout else ():
            for side, sl in (("L", rows), ("R", cols)):
                n, key = sl.stop - sl.start, f"{PRECONDITIONER_PREFIX}{b}.{side}"
                eye = torch.eye(n, dtype=torch.float32, device=p.device)
                vals = torch.full((n,), cfg.eps, dtype=torch.float32, device=p.device)
                if cfg.quantize == "eigenvectors":  # eps·I: eigenvalues eps, eigenvectors I
                    state[key + ".vals"] = vals
                    store.put(key + ".vecs", eye)
                else:
                    store.put(key + ".stat", eye * cfg.eps, sym=True)
                store.put(key + ".root", inverse_root(eye, vals, cfg.eps), sym=True)

    def _update_stat(self, store: _MatrixStore, key: str, gg: torch.Tensor, cfg: ShampooConfig) -> None:
        n, beta = gg.shape[0], cfg.stat_decay
        if cfg.quantize == "statistics":
            store.put(key + ".stat", beta * store.get(key + ".stat", n, sym=True) + (1 - beta) * gg, sym=True)
            return
        v = bjorck(store.get(key + ".vecs", n).mT, cfg.rectify_iters[0])
        a = beta * ((v * store.state[key + ".vals"]) @ v.mT) + (1 - beta) * gg
        p, vals = subspace_step(a, v, store.state[key + ".vals"])
        store.put(key + ".vecs", p.mT)  # stored as Vᵀ: a quantization block lies in one eigenvector
        store.state[key + ".vals"].copy_(vals)

    def _update_root(self, store: _MatrixStore, key: str, n: int, cfg: ShampooConfig) -> None:
        if cfg.quantize == "statistics":
            root = eigh_inverse_root(store.get(key + ".stat", n, sym=True), cfg.eps)
        else:
            v = bjorck(store.get(key + ".vecs", n).mT, cfg.rectify_iters[1])
            root = inverse_root(v, store.state[key + ".vals"], cfg.eps)
        store.put(key + ".root", root, sym=True)

    def _direction(self, g: torch.Tensor, state: dict[str, Any], cfg: ShampooConfig, layout: _Layout) -> torch.Tensor:
        """The grafted preconditioned direction for the fp32 gradient ``g``."""
        k = state["step"] - cfg.start_step
        gm = g.reshape(layout.rows, layout.cols)
        store = _MatrixStore(state, cfg)
        out = torch.empty_like(gm)
        for b, rows, cols in layout.blocks():
            gb = gm[rows, cols]
            roots = []
            for side, n in (("L", gb.shape[0]), ("R", gb.shape[1])):
                key = f"{PRECONDITIONER_PREFIX}{b}.{side}"
                if k % cfg.stat_every == 0:  # GGᵀ / GᵀG only when the statistic is updated
                    self._update_stat(store, key, gb @ gb.mT if side == "L" else gb.mT @ gb, cfg)
                if k % cfg.root_every == 0:
                    self._update_root(store, key, n, cfg)
                roots.append(store.get(key + ".root", n, sym=True))
            out[rows, cols] = roots[0] @ gb @ roots[1]
        # grafting: the preconditioner picks the direction, the gradient's norm the step length
        scale = torch.linalg.vector_norm(gm) / torch.linalg.vector_norm(out).clamp_min(torch.finfo(out.dtype).tiny)
        return (out * scale).view(g.shape)

    def _step_param(self, p: torch.Tensor, cfg: ShampooConfig) -> None:
        state = self.state[p]
        layout = _layout(p.shape, cfg.max_order)
        if not state:
            self._init_state(p, state, cfg, layout)
        state["step"] += 1
        step = state["step"]
        g = p.grad.detach().to(torch.float32)  # may alias p.grad: only out-of-place ops on g below
        d = self._direction(g, state, cfg, layout) if layout and step >= cfg.start_step else g
        if cfg.graft == "adamw":
            beta1, beta2 = cfg.betas
            exp_avg, exp_avg_sq = state["exp_avg"], state["exp_avg_sq"]
            exp_avg.lerp_(d, 1 - beta1)
            exp_avg_sq.mul_(beta2).addcmul_(d, d, value=1 - beta2)
            denom = (exp_avg_sq / (1 - beta2 ** step)).sqrt_().add_(ADAM_EPS)
            update = (exp_avg / (1 - beta1 ** step)) / denom
            if cfg.weight_decay:
                p.mul_(1 - cfg.lr * cfg.weight_decay)
        else:
            if cfg.weight_decay:
                d = d + cfg.weight_decay * p.detach().float()
            update = state["momentum_buffer"].mul_(cfg.momentum).add_(d)
        p.add_(update.to(p.dtype), alpha=-cfg.lr)


def state_bytes(optimizer: torch.optim.Optimizer) -> dict[str, int]:
    """Bytes of an optimizer's state: {"preconditioner", "first_order", "total"}.

    Counts distinct storages (``untyped_storage().nbytes()``; views of one storage count once), so
    packed 4-bit codes count at their packed size. Keys starting with ``PRECONDITIONER_PREFIX`` are
    Shampoo's preconditioner; every other tensor (any optimizer's m, v, momentum, step) is first-order.
    """
    pre: list[torch.Tensor] = []
    first: list[torch.Tensor] = []
    for st in optimizer.state.values():
        for key, value in st.items():
            if isinstance(value, torch.Tensor):
                (pre if str(key).startswith(PRECONDITIONER_PREFIX) else first).append(value)
    return {"preconditioner": distinct_bytes(pre), "first_order": distinct_bytes(first),
            "total": distinct_bytes(pre + first)}
