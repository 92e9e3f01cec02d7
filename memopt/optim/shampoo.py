"""4-bit Shampoo (Wang et al., NeurIPS 2024) in plain PyTorch: a ``torch.optim.Optimizer``.

For a weight reshaped to a matrix G (m x n), Shampoo keeps the statistics L ≈ Σ GGᵀ (m x m) and
R ≈ Σ GᵀG (n x n) and steps along L^(-1/4) G R^(-1/4). The 4-bit method stores, per statistic,
its eigenvalues in fp32 and its eigenvector matrix in 4 bits (quantizing the eigenvectors is far
more accurate than quantizing the statistic), and per inverse root its diagonal in fp32 and its
off-diagonal in 4 bits. Per preconditioned block and side (order d):

At a statistic update (the current gradient only, as published):
    V = bjorck(deq(Vᵀ)ᵀ, rectify_iters[0]);  A = V diag(λ) Vᵀ
    A = stat_decay · A + (1 - stat_decay) · GGᵀ   (GᵀG for R)
    qr_iters times: P = qr(A V).Q (V by descending λ);  λ = diag(Pᵀ A P);  V = P
    (every ``eigh_every``-th update instead: λ, V = eigh(A));  store quant(Vᵀ), λ
At a root update:
    V = bjorck(deq(Vᵀ)ᵀ, rectify_iters[1])
    Â = V diag((λ + eps · max λ)^(-1/4)) Vᵀ;  store diag(Â) in fp32, quant(offdiag(Â))
Every step once a root exists: D = L̂ G R̂ per block, D *= ||G||_F / ||D||_F (grafting, whole
tensor); before that D = G. With ``tensor_layout="modes"`` a tensor of rank k >= 3 keeps one such
statistic per dimension (its mode unfolding in place of G) and D = G ×_1 Â_1 ... ×_k Â_k with
roots A^(-1/(2k)) (``memopt.optim.layout``). ``vector_bits`` stores the eigenvector matrices at
other than ``bits``. Then AdamW (decoupled weight decay) or SGD-momentum (L2 weight decay
added to D) steps with D as the gradient.

When updates happen is ``schedule`` (``memopt.optim.config``): "reference" (default) gathers
statistics from ``start_step`` on and takes the first roots once statistics exist, as the
published code does; "eager" builds both at ``start_step`` from that one gradient. Why: under
"eager" with the published root interval the first preconditioner, built from a single gradient,
is used unchanged for ``root_every`` steps.

Non-finite gradients: a parameter whose gradient holds a NaN or an infinity skips that step
entirely (parameter, statistics, roots, moments and its step count stay as they were) and a
``RuntimeWarning`` names it once. Why skip rather than fall back to the grafted direction: the
grafted optimizer's moments would take the non-finite values in just the same, and a step count
that does not advance keeps the statistic/root schedule on finite gradients only.

All state is allocated at full size at a parameter's first step, so state memory is constant from
step 1 (the budget accounting in ``cost_model`` relies on that). Statistics and first-order state
are fp32 whatever the parameter dtype. ``bits=32`` runs the same code with fp32 storage (the
32-bit baseline); ``quantize="statistics"`` is the naive baseline that stores L and R themselves
(fp32 diagonal, quantized off-diagonal) and takes roots with ``torch.linalg.eigh`` at root updates.
"""
from __future__ import annotations

import copy
import math
import warnings
from collections.abc import Callable, Iterable
from typing import Any

import torch
from torch._guards import detect_fake_mode

from memopt.core.storage import distinct_bytes
from memopt.optim.config import (FIRST_ORDER_KEYS, LEGACY_GROUP_DEFAULTS, ShampooConfig, check_layout,
                                 preconditioned, root_due, stat_due, stat_update_index, state_layout)
from memopt.optim.layout import TensorLayout, apply_roots, make_layout, mode_gram
from memopt.optim.linalg import bjorck, eigh_inverse_root, inverse_root, subspace_step
from memopt.optim.quant import QuantSpec, dequantize, quantize

ADAM_EPS = 1e-8  # AdamW's denominator epsilon (the API's ``eps`` is Shampoo's ridge and initial statistic)
PRECONDITIONER_PREFIX = "pre."  # state keys of the preconditioner; everything else is first-order state


class _MatrixStore:
    """Reads and writes square state matrices under a key, quantized when they are large enough.

    Quantized (bits < 32 and numel >= min_quant_numel): ``key.codes`` (packed uint8) and
    ``key.scales`` (fp32); a symmetric matrix (``sym``) keeps its diagonal in ``key.diag`` (fp32)
    and quantizes only the off-diagonal, whose scale the large diagonal would otherwise swamp.
    Otherwise the fp32 matrix itself under ``key``. Eigenvector matrices (keys ending ".vecs") use
    ``vector_bits``, everything else ``bits``. Existing tensors are overwritten in place, so
    storages keep their identity and size across steps.
    """

    def __init__(self, state: dict[str, Any], cfg: ShampooConfig) -> None:
        self.state, self.min_numel = state, cfg.min_quant_numel
        self.specs = {False: cfg.spec, True: cfg.vector_spec}

    def _spec(self, key: str, n: int) -> QuantSpec | None:
        """How the (n, n) matrix under ``key`` is quantized; None: stored in fp32."""
        spec = self.specs[key.endswith(".vecs")]
        return spec if spec is not None and n * n >= self.min_numel else None

    def _set(self, key: str, value: torch.Tensor) -> None:
        if key in self.state:
            self.state[key].copy_(value)
        else:
            self.state[key] = value.detach().clone()

    def put(self, key: str, m: torch.Tensor, sym: bool = False) -> None:
        spec = self._spec(key, m.shape[0])
        if spec is None:
            self._set(key, m)
            return
        if sym:
            self._set(key + ".diag", m.diagonal())
            m = m.clone()
            m.diagonal().zero_()
        codes, scales = quantize(m, spec)
        self._set(key + ".codes", codes)
        self._set(key + ".scales", scales)

    def get(self, key: str, n: int, sym: bool = False) -> torch.Tensor:
        """The fp32 (n, n) matrix; for an unquantized one, the state tensor itself (do not modify)."""
        spec = self._spec(key, n)
        if spec is None:
            return self.state[key]
        m = dequantize(self.state[key + ".codes"], self.state[key + ".scales"], (n, n), spec)
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
        start_step: 1, the first step counted by the schedule.
        schedule: "reference" (default: statistics from ``start_step``, roots once statistics exist,
            the grafted optimizer alone until then) or "eager" (statistics and roots at
            ``start_step``, preconditioned from then on; this class's behaviour before the option).
        block_size: 64 elements per fp32 quantization scale.
        max_order: 1200; larger dimensions are split into blocks with their own L and R.
        min_quant_numel: 4096; smaller matrices (order < 64) stay fp32.
        quant_map: "linear2" (default, signed squares) or "dynamic" (dynamic tree).
        rectify_iters: (1, 4) Björck steps at statistic and at root updates.
        qr_iters: 1 (published) warm-started QR iterations per statistic update; more iterations
            bring the tracked eigenvectors closer to the statistic's at the cost of one QR each.
        eigh_every: 0 (never); N > 0 replaces every N-th statistic update's QR iterations by an
            exact ``torch.linalg.eigh``, which resets the QR iterations' tracking error (not the
            error of quantized eigenvectors, which re-enters at every update: see vector_bits).
        quantize: "eigenvectors" (the method) or "statistics" (the naive baseline).
        tensor_layout: "matrix" (published: a tensor is preconditioned as (shape[0], -1)) or "modes"
            (tensors of rank >= 3 after squeezing, e.g. conv weights, get one preconditioner per
            dimension with inverse roots A^(-1/(2·rank)); see ``memopt.optim.layout``).
        vector_bits: None (= bits, published), 4, 8 or 32: the storage of the eigenvector matrices
            alone (roots keep ``bits``). Why: every statistic update rebuilds the statistic from the
            stored eigenvectors, so their quantization error enters the statistic again at each
            update and accumulates, whatever qr_iters or eigh_every; 8-bit eigenvectors with
            eigh_every=1 track the statistic closer than one 4-bit quantization of its exact ones.
    Parameters of rank <= 1 after squeezing are not preconditioned (D = G). Each param group may
    override any of these; bits, vector_bits, quantize, graft, max_order, tensor_layout and (when
    anything is quantized) block_size, quant_map and min_quant_numel are fixed once a parameter has
    state. ``p.grad`` is never modified.
    """

    def __init__(self, params: Iterable[Any], lr: float = 1e-3, *, bits: int = 4,
                 betas: tuple[float, float] = (0.9, 0.999), weight_decay: float = 0.0, graft: str = "adamw",
                 momentum: float = 0.9, stat_decay: float = 0.95, eps: float = 1e-6, stat_every: int = 100,
                 root_every: int = 500, start_step: int = 1, schedule: str = "reference", block_size: int = 64,
                 max_order: int = 1200, min_quant_numel: int = 4096, quant_map: str = "linear2",
                 rectify_iters: tuple[int, int] = (1, 4), qr_iters: int = 1, eigh_every: int = 0,
                 quantize: str = "eigenvectors", tensor_layout: str = "matrix",
                 vector_bits: int | None = None) -> None:
        defaults = {"lr": lr, "bits": bits, "betas": tuple(betas) if isinstance(betas, list) else betas,
                    "weight_decay": weight_decay, "graft": graft, "momentum": momentum,
                    "stat_decay": stat_decay, "eps": eps, "stat_every": stat_every, "root_every": root_every,
                    "start_step": start_step, "schedule": schedule, "block_size": block_size,
                    "max_order": max_order, "min_quant_numel": min_quant_numel, "quant_map": quant_map,
                    "rectify_iters": rectify_iters, "qr_iters": qr_iters, "eigh_every": eigh_every,
                    "quantize": quantize, "tensor_layout": tensor_layout,
                    "vector_bits": vector_bits}
        ShampooConfig(**defaults)  # fail at construction, naming the bad value
        self._warned_nonfinite: set[int] = set()  # ids of parameters already warned about
        super().__init__(params, defaults)

    def add_param_group(self, param_group: dict[str, Any]) -> None:
        """As ``torch.optim.Optimizer``'s, but the group is validated first, so a bad one is never added."""
        if isinstance(param_group, dict):
            filled = {key: value for key, value in param_group.items() if key not in ("params", "param_names")}
            for key, value in self.defaults.items():
                filled.setdefault(key, value)
            ShampooConfig.from_group(filled)
        super().add_param_group(param_group)

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """As ``torch.optim.Optimizer``'s, but state tensors keep their saved dtype: the stock
        method casts every state tensor to the parameter's dtype (uint8 codes, fp32 statistics)
        and mangles strings inside dicts (the ``layout`` record).
        Groups saved before an option existed get the value that reproduces their run."""
        super().load_state_dict(state_dict)
        for group in self.param_groups:
            for key, value in LEGACY_GROUP_DEFAULTS.items():
                group.setdefault(key, value)
        saved_ids = [i for g in state_dict["param_groups"] for i in g["params"]]
        params = [p for g in self.param_groups for p in g["params"]]
        for pid, p in zip(saved_ids, params):
            for key, value in state_dict["state"].get(pid, {}).items():
                if isinstance(value, torch.Tensor):
                    self.state[p][key] = value.to(device=p.device, copy=True)
                elif isinstance(value, dict):  # the stock method turns strings inside into generators
                    self.state[p][key] = copy.deepcopy(value)

    @torch.no_grad()
    def step(self, closure: Callable[[], float] | None = None) -> float | None:
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        work = []  # validate every group before any parameter moves: an error leaves all untouched
        for index, group in enumerate(self.param_groups):
            cfg = ShampooConfig.from_group(group)
            params = [p for p in group["params"] if p.grad is not None]
            for p in params:
                if p.grad.is_sparse:
                    raise RuntimeError("Shampoo does not support sparse gradients")
                if "layout" in self.state[p]:
                    check_layout(self.state[p]["layout"], cfg, index)
            work.append((index, group, cfg, params))
        for index, group, cfg, params in work:
            for p, finite in zip(params, self._finite(params)):
                if finite:
                    self._step_param(p, cfg)
                else:
                    self._warn_nonfinite(p, group, index)
        return loss

    @staticmethod
    def _finite(params: list[torch.Tensor]) -> list[bool]:
        """Whether each gradient is all finite, with one host sync for the group. A finite norm means
        every element is finite, and one norm pass per gradient costs less than ``isfinite`` (which
        writes a bool tensor and reads it again); only a gradient whose norm is not finite (a NaN or
        inf, or finite elements whose squares overflow) is checked element by element. Under a
        fake-tensor mode (the cost model) the same ops run and every gradient counts as finite."""
        if not params:
            return []
        flags = torch.isfinite(torch.stack([n.float() for n in torch._foreach_norm([p.grad for p in params])]))
        if detect_fake_mode(flags) is not None:
            return [True] * len(params)
        return [finite or bool(torch.isfinite(p.grad).all()) for finite, p in zip(flags.tolist(), params)]

    def _warn_nonfinite(self, p: torch.Tensor, group: dict[str, Any], index: int) -> None:
        if id(p) in self._warned_nonfinite:
            return
        self._warned_nonfinite.add(id(p))
        position = next(i for i, q in enumerate(group["params"]) if q is p)
        names = group.get("param_names")
        name = repr(names[position]) if names else f"param_groups[{index}]['params'][{position}]"
        bad = (~torch.isfinite(p.grad)).sum().item()
        warnings.warn(
            f"Shampoo: parameter {name} (shape {tuple(p.shape)}) has a non-finite gradient ({bad} of "
            f"{p.grad.numel()} elements NaN or inf); its step was skipped and its state left unchanged. "
            f"Later skips of this parameter are not warned about; lower the learning rate or clip or "
            f"scale the loss if this repeats", RuntimeWarning, stacklevel=3)

    def _init_state(self, p: torch.Tensor, state: dict[str, Any], cfg: ShampooConfig,
                    layout: TensorLayout | None) -> None:
        state["step"] = 0
        state["layout"] = state_layout(cfg)
        for key in FIRST_ORDER_KEYS[cfg.graft]:
            state[key] = torch.zeros(p.shape, dtype=torch.float32, device=p.device)
        store = _MatrixStore(state, cfg)
        for block in layout.blocks() if layout else ():
            for side, n in zip(layout.sides, block.dims):
                key = f"{PRECONDITIONER_PREFIX}{block.index}.{side}"
                eye = torch.eye(n, dtype=torch.float32, device=p.device)
                vals = torch.full((n,), cfg.eps, dtype=torch.float32, device=p.device)
                if cfg.quantize == "eigenvectors":  # eps·I: eigenvalues eps, eigenvectors I
                    state[key + ".vals"] = vals
                    store.put(key + ".vecs", eye)
                else:
                    store.put(key + ".stat", eye * cfg.eps, sym=True)
                store.put(key + ".root", inverse_root(eye, vals, cfg.eps, layout.root), sym=True)

    def _update_stat(self, store: _MatrixStore, key: str, gg: torch.Tensor, cfg: ShampooConfig, k: int) -> None:
        n, beta = gg.shape[0], cfg.stat_decay
        if cfg.quantize == "statistics":
            store.put(key + ".stat", beta * store.get(key + ".stat", n, sym=True) + (1 - beta) * gg, sym=True)
            return
        vals = store.state[key + ".vals"]
        v = bjorck(store.get(key + ".vecs", n).mT, cfg.rectify_iters[0])
        a = beta * ((v * vals) @ v.mT) + (1 - beta) * gg
        if cfg.eigh_every and stat_update_index(cfg, k) % cfg.eigh_every == 0:
            vals_new, v = torch.linalg.eigh(a)
        else:
            vals_new = vals
            for _ in range(cfg.qr_iters):
                v, vals_new = subspace_step(a, v, vals_new)
        store.put(key + ".vecs", v.mT)  # stored as Vᵀ: a quantization block lies in one eigenvector
        vals.copy_(vals_new)

    def _update_root(self, store: _MatrixStore, key: str, n: int, cfg: ShampooConfig, root: int = 4) -> None:
        if cfg.quantize == "statistics":
            inv = eigh_inverse_root(store.get(key + ".stat", n, sym=True), cfg.eps, root)
        else:
            v = bjorck(store.get(key + ".vecs", n).mT, cfg.rectify_iters[1])
            inv = inverse_root(v, store.state[key + ".vals"], cfg.eps, root)
        store.put(key + ".root", inv, sym=True)

    def _direction(self, g: torch.Tensor, state: dict[str, Any], cfg: ShampooConfig,
                   layout: TensorLayout) -> torch.Tensor:
        """The grafted preconditioned direction for the fp32 gradient ``g`` (updating statistics
        and roots when the schedule says so); ``g`` itself before the first root."""
        k = state["step"]
        update_stat, update_root, used = stat_due(cfg, k), root_due(cfg, k), preconditioned(cfg, k)
        if not (update_stat or update_root or used):
            return g
        gm = g.reshape(layout.shape)
        store = _MatrixStore(state, cfg)
        blocks = layout.blocks()
        out = torch.empty_like(gm) if len(blocks) > 1 else None
        for block in blocks:
            gb = gm[block.where]
            roots = []
            for mode, (side, n) in enumerate(zip(layout.sides, block.dims)):
                key = f"{PRECONDITIONER_PREFIX}{block.index}.{side}"
                if update_stat:  # the Gram matrix only when the statistic is updated
                    self._update_stat(store, key, mode_gram(gb, mode), cfg, k)
                if update_root:
                    self._update_root(store, key, n, cfg, layout.root)
                if used:
                    roots.append(store.get(key + ".root", n, sym=True))
            if not used:
                continue
            if out is None:  # one block: no copy into a separate output
                out = apply_roots(gb, roots)
            else:
                out[block.where] = apply_roots(gb, roots)
        if not used:  # statistics gathered, no root yet: the grafted optimizer alone
            return g
        # grafting: the preconditioner picks the direction, the gradient's norm the step length
        scale = torch.linalg.vector_norm(gm) / torch.linalg.vector_norm(out).clamp_min(torch.finfo(out.dtype).tiny)
        return out.mul_(scale).reshape(g.shape)

    def _step_param(self, p: torch.Tensor, cfg: ShampooConfig) -> None:
        state = self.state[p]
        layout = make_layout(p.shape, cfg.max_order, cfg.tensor_layout)
        if not state:
            self._init_state(p, state, cfg, layout)
        state.setdefault("layout", state_layout(cfg))  # state saved before the key existed
        state["step"] += 1
        step = state["step"]
        g = p.grad.detach().to(torch.float32)  # may alias p.grad: only out-of-place ops on g below
        d = self._direction(g, state, cfg, layout) if layout else g
        if cfg.graft == "adamw":
            beta1, beta2 = cfg.betas
            exp_avg, exp_avg_sq = state["exp_avg"], state["exp_avg_sq"]
            exp_avg.lerp_(d, 1 - beta1)
            exp_avg_sq.mul_(beta2).addcmul_(d, d, value=1 - beta2)
            if cfg.weight_decay:
                p.mul_(1 - cfg.lr * cfg.weight_decay)
            # torch's AdamW arithmetic, in place: sqrt(v / bc2) + eps as sqrt(v) / sqrt(bc2) + eps
            denom = exp_avg_sq.sqrt().div_(math.sqrt(1 - beta2 ** step)).add_(ADAM_EPS)
            if p.dtype == torch.float32:
                p.addcdiv_(exp_avg, denom, value=-cfg.lr / (1 - beta1 ** step))
                return
            update = exp_avg.div(denom).div_(1 - beta1 ** step)
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
