"""The pointwise activations few-bit backward supports, as data.

Each ``Activation`` names the torch function computing it (called with the node's own
hyper-parameters, so the forward is the original op) and how its derivative is coded:
- ``mask``: piecewise-linear ops whose derivative takes two values; the code is an exact 1-bit
  mask, computed with the same comparisons as PyTorch's own backward (NaN included);
- otherwise a table: the optimal piecewise-constant approximation of f' (``memopt.fewbit_table``).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Dict, Optional, Tuple

import torch
import torch.nn.functional as F

Params = Tuple[Tuple[str, object], ...]  # sorted (name, value) pairs: hashable, JSON-friendly


@dataclass(frozen=True)
class Activation:
    name: str
    fn: Callable[..., torch.Tensor]
    defaults: Params = ()
    # exact ops: (x, params) -> bool code, and (params) -> (level for code 0, level for code 1)
    mask: Optional[Callable[[torch.Tensor, dict], torch.Tensor]] = None
    mask_levels: Optional[Callable[[dict], Tuple[float, float]]] = None
    # exact ops: PyTorch's backward lays its result out like the incoming gradient (hardtanh_backward,
    # hardsigmoid_backward) rather than like the input (threshold_backward, leaky_relu_backward); the
    # rewrite does the same, so later reductions sum in stock's order (bit-identical gradients)
    grad_layout: bool = False

    @property
    def exact(self) -> bool:
        return self.mask is not None

    def params(self, given: Dict[str, object]) -> Params:
        merged = dict(self.defaults)
        unknown = set(given) - set(merged)
        if unknown:
            raise ValueError(f"{self.name} has no hyper-parameters {sorted(unknown)}; it takes {sorted(merged)}")
        merged.update(given)
        return tuple(sorted(merged.items()))

    def __call__(self, x: torch.Tensor, params: Params) -> torch.Tensor:
        return self.fn(x, **dict(params))


def _hardtanh_fn(x, min_val, max_val):
    return F.hardtanh(x, min_val, max_val)


# Masks mirror ATen's backward formulas so that even NaN inputs get PyTorch's gradient:
# threshold_backward passes the gradient unless x <= threshold; hardtanh_backward blocks it when
# x <= min or x >= max; leaky_relu_backward uses x > 0; hardsigmoid_backward uses -3 < x < 3.
ACTIVATIONS: Dict[str, Activation] = {a.name: a for a in [
    Activation("relu", lambda x: torch.relu(x), mask=lambda x, p: ~(x <= 0), mask_levels=lambda p: (0.0, 1.0)),
    Activation("relu6", lambda x: F.relu6(x), mask=lambda x, p: ~((x <= 0) | (x >= 6)),
               mask_levels=lambda p: (0.0, 1.0), grad_layout=True),
    Activation("hardtanh", _hardtanh_fn, (("max_val", 1.0), ("min_val", -1.0)),
               mask=lambda x, p: ~((x <= p["min_val"]) | (x >= p["max_val"])), mask_levels=lambda p: (0.0, 1.0),
               grad_layout=True),
    Activation("leaky_relu", lambda x, negative_slope: F.leaky_relu(x, negative_slope), (("negative_slope", 0.01),),
               mask=lambda x, p: x > 0, mask_levels=lambda p: (float(p["negative_slope"]), 1.0)),
    # ATen's hardsigmoid backward multiplies by 1.0f/6.0f (single precision) for every dtype
    Activation("hardsigmoid", lambda x: F.hardsigmoid(x), mask=lambda x, p: (x > -3) & (x < 3),
               mask_levels=lambda p: (0.0, 0.1666666716337204), grad_layout=True),
    Activation("threshold", lambda x, threshold, value: F.threshold(x, threshold, value),
               (("threshold", 0.0), ("value", 0.0)), mask=lambda x, p: ~(x <= p["threshold"]),
               mask_levels=lambda p: (0.0, 1.0)),
    Activation("gelu", lambda x, approximate: F.gelu(x, approximate=approximate), (("approximate", "none"),)),
    Activation("silu", lambda x: F.silu(x)),
    Activation("sigmoid", lambda x: torch.sigmoid(x)),
    Activation("tanh", lambda x: torch.tanh(x)),
    Activation("elu", lambda x, alpha: F.elu(x, alpha), (("alpha", 1.0),)),
    Activation("celu", lambda x, alpha: F.celu(x, alpha), (("alpha", 1.0),)),
    Activation("selu", lambda x: F.selu(x)),
    Activation("softplus", lambda x, beta, threshold: F.softplus(x, beta, threshold),
               (("beta", 1.0), ("threshold", 20.0))),
    Activation("mish", lambda x: F.mish(x)),
    Activation("hardswish", lambda x: F.hardswish(x)),
    Activation("logsigmoid", lambda x: F.logsigmoid(x)),
    Activation("softsign", lambda x: F.softsign(x)),
    Activation("tanhshrink", lambda x: F.tanhshrink(x)),
]}

TABLE_ACTIVATIONS = tuple(name for name, a in ACTIVATIONS.items() if not a.exact)


def get_activation(name: str) -> Activation:
    if name not in ACTIVATIONS:
        raise ValueError(f"few-bit backward does not support {name!r}; supported: {sorted(ACTIVATIONS)}")
    return ACTIVATIONS[name]
