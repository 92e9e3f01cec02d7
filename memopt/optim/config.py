"""Shampoo's hyper-parameters: validation, the update schedule, and what may not change mid-run.

- ``ShampooConfig`` checks one param group's values and names the bad one, its allowed range and
  the fix; ``Shampoo.add_param_group`` runs it before the group is added, so a bad group never
  lands in ``param_groups``.
- The schedule (``stat_due``, ``root_due``, ``preconditioned``) is a pure function of the
  parameter's step count, so a resumed run follows the same schedule without extra state.
- ``state_layout``: the hyper-parameters that decide the layout of a parameter's stored state
  (storage format, blocking, first-order buffers). It is stored with the state, and a group whose
  values no longer match raises ``ValueError`` instead of reading state it cannot interpret.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from memopt.optim.layout import TENSOR_LAYOUTS
from memopt.optim.quant import QUANT_MAPS, QuantSpec

FIRST_ORDER_KEYS = {"adamw": ("exp_avg", "exp_avg_sq"), "sgd": ("momentum_buffer",)}
SCHEDULES = ("reference", "eager")
# group keys added after the first release, with the value that reproduces a checkpoint saved before them
LEGACY_GROUP_DEFAULTS = {"schedule": "eager", "qr_iters": 1, "eigh_every": 0, "tensor_layout": "matrix",
                         "vector_bits": None}
# hyper-parameters that shape the stored state; the quantization ones only matter when something is quantized
_LAYOUT_KEYS = ("bits", "vector_bits", "quantize", "graft", "max_order", "tensor_layout")
_QUANT_LAYOUT_KEYS = ("block_size", "quant_map", "min_quant_numel")


def _positive_int(name: str, value: Any, minimum: int = 1) -> None:
    if not isinstance(value, int) or isinstance(value, bool) or value < minimum:
        raise ValueError(f"{name}={value!r} must be an int >= {minimum}")


def _unit_interval(name: str, value: Any) -> None:
    if not isinstance(value, (int, float)) or isinstance(value, bool) or not 0.0 <= value < 1.0:
        raise ValueError(f"{name}={value!r} must be a float in [0, 1)")


@dataclass(frozen=True, kw_only=True)
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
    schedule: str
    block_size: int
    max_order: int
    min_quant_numel: int
    quant_map: str
    rectify_iters: tuple[int, int]
    qr_iters: int
    eigh_every: int
    quantize: str
    tensor_layout: str
    vector_bits: int | None

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
        if self.graft not in FIRST_ORDER_KEYS:
            raise ValueError(f"graft={self.graft!r} is not known; use 'adamw' or 'sgd'")
        _unit_interval("momentum", self.momentum)
        _unit_interval("stat_decay", self.stat_decay)
        if not isinstance(self.eps, (int, float)) or isinstance(self.eps, bool) or not self.eps > 0:
            raise ValueError(f"eps={self.eps!r} must be a float > 0 (1e-6 is published)")
        for name in ("stat_every", "root_every", "start_step", "block_size", "max_order", "qr_iters"):
            _positive_int(name, getattr(self, name))
        _positive_int("min_quant_numel", self.min_quant_numel, 0)
        _positive_int("eigh_every", self.eigh_every, 0)
        if self.schedule not in SCHEDULES:
            raise ValueError(f"schedule={self.schedule!r} is not known; use 'reference' (statistics first, "
                             f"roots once statistics exist) or 'eager' (roots from the first step)")
        if self.quant_map not in QUANT_MAPS:
            raise ValueError(f"quant_map={self.quant_map!r} is not known; use one of {QUANT_MAPS}")
        iters = self.rectify_iters
        if (not isinstance(iters, (tuple, list)) or len(iters) != 2
                or any(not isinstance(i, int) or isinstance(i, bool) or i < 0 for i in iters)):
            raise ValueError(f"rectify_iters={iters!r} must be a pair of ints >= 0 "
                             f"(Björck steps at statistic and at root updates)")
        if self.quantize not in ("eigenvectors", "statistics"):
            raise ValueError(f"quantize={self.quantize!r} is not known; use 'eigenvectors' or 'statistics'")
        if self.vector_bits not in (None, 4, 8, 32) or isinstance(self.vector_bits, bool):
            raise ValueError(f"vector_bits={self.vector_bits!r} is not supported; use None (the same as bits), "
                             f"4, 8 or 32 (the storage of the eigenvector matrices)")
        if self.tensor_layout not in TENSOR_LAYOUTS:
            raise ValueError(f"tensor_layout={self.tensor_layout!r} is not known; use one of {TENSOR_LAYOUTS}: "
                             f"'matrix' preconditions a tensor as (shape[0], -1), 'modes' each dimension of "
                             f"a conv weight or other tensor of rank >= 3")

    @classmethod
    def from_group(cls, group: dict[str, Any]) -> ShampooConfig:
        missing = [name for name in cls.__dataclass_fields__ if name not in group]
        if missing:
            raise ValueError(f"param group lacks {missing}; add the keys, or pass the group to "
                             f"add_param_group, which fills them from the optimizer's defaults")
        return cls(**{name: group[name] for name in cls.__dataclass_fields__})

    @property
    def spec(self) -> QuantSpec | None:
        return None if self.bits == 32 else QuantSpec(self.bits, self.block_size, self.quant_map)

    @property
    def vector_spec(self) -> QuantSpec | None:
        """How eigenvector matrices are stored: ``vector_bits``, or ``bits`` when it is None."""
        bits = self.bits if self.vector_bits is None else self.vector_bits
        return None if bits == 32 else QuantSpec(bits, self.block_size, self.quant_map)


# --- schedule -----------------------------------------------------------------------------------
# k is the parameter's step count (1-based, advanced only by steps with a finite gradient).
# "eager": statistics and roots at k >= start_step with (k - start_step) % every == 0, so both are
#   built at start_step from one gradient, and the preconditioner is used from start_step on.
# "reference" (the published code's order): with j = k - start_step + 1 steps counted from
#   start_step, statistics at j % stat_every == 0, roots at j % root_every == 0 once at least one
#   statistic update happened (j >= stat_every); before the first root the step is the grafted
#   optimizer's alone (D = G), so no preconditioner built from a single gradient is ever used.

def stat_due(cfg: ShampooConfig, k: int) -> bool:
    if k < cfg.start_step:
        return False
    if cfg.schedule == "eager":
        return (k - cfg.start_step) % cfg.stat_every == 0
    return (k - cfg.start_step + 1) % cfg.stat_every == 0


def root_due(cfg: ShampooConfig, k: int) -> bool:
    if k < cfg.start_step:
        return False
    if cfg.schedule == "eager":
        return (k - cfg.start_step) % cfg.root_every == 0
    j = k - cfg.start_step + 1
    return j >= cfg.stat_every and j % cfg.root_every == 0


def first_root_step(cfg: ShampooConfig) -> int:
    """The step at which the first root is computed, from which the preconditioner is used."""
    if cfg.schedule == "eager":
        return cfg.start_step
    j = -(-cfg.stat_every // cfg.root_every) * cfg.root_every  # smallest multiple of root_every >= stat_every
    return cfg.start_step + j - 1


def preconditioned(cfg: ShampooConfig, k: int) -> bool:
    return k >= first_root_step(cfg)


def stat_update_index(cfg: ShampooConfig, k: int) -> int:
    """1-based count of the statistic update at step k (for ``eigh_every``)."""
    if cfg.schedule == "eager":
        return (k - cfg.start_step) // cfg.stat_every + 1
    return (k - cfg.start_step + 1) // cfg.stat_every


# --- hyper-parameters fixed once state exists ---------------------------------------------------

def state_layout(cfg: ShampooConfig) -> dict[str, Any]:
    """The hyper-parameters a parameter's stored state was laid out with (plain values, so the
    dict survives ``torch.save`` / ``torch.load(weights_only=True)``)."""
    quantized = cfg.spec is not None or cfg.vector_spec is not None
    keys = _LAYOUT_KEYS + (_QUANT_LAYOUT_KEYS if quantized else ())
    return {key: getattr(cfg, key) for key in keys}


def check_layout(saved: dict[str, Any], cfg: ShampooConfig, group_index: int) -> None:
    """Raise ``ValueError`` naming the first layout hyper-parameter whose value differs from ``saved``."""
    now = state_layout(cfg)
    for key in _LAYOUT_KEYS + _QUANT_LAYOUT_KEYS:
        if key in saved and key in now and saved[key] != now[key]:
            raise ValueError(
                f"param_groups[{group_index}]['{key}'] changed from {saved[key]!r} to {now[key]!r} after its "
                f"parameters' state was built with {key}={saved[key]!r}; {key} decides how that state is "
                f"stored, so it cannot change mid-run. Set it back to {saved[key]!r}, or drop the state of "
                f"those parameters (del optimizer.state[p]) or create a new Shampoo to start over with "
                f"{key}={now[key]!r}")
