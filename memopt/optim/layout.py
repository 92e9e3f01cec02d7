"""How Shampoo sees a parameter: which tensor it preconditions, cut into which blocks, along which modes.

Two layouts (``tensor_layout``):
- "matrix" (default, as published): the squeezed tensor viewed as (shape[0], prod(rest)), two
  modes L (rows) and R (columns), inverse roots A^(-1/4). A conv weight (out, in, k, k) becomes
  (out, in·k·k): its R is (in·k·k)², and above ``max_order`` it is cut into several blocks.
- "modes" (per-dimension, as Shampoo's tensor form, ScalableShampoo and SOAP do): the squeezed
  tensor keeps its k >= 3 dimensions and each mode i has its own statistic L_i = Σ G_(i) G_(i)ᵀ
  over the mode-i unfolding G_(i) (d_i x N/d_i), with inverse roots L_i^(-1/(2k)) (Shampoo's
  exponent for order-k tensors: for k = 2 it is the matrix case's -1/4). Why: a conv's (in·k·k)
  side becomes an in x in and two k x k preconditioners, which hold fewer elements and cost fewer
  FLOPs to apply. Tensors of rank <= 2 after squeezing are laid out as matrices in both layouts,
  so their state and steps are identical.
Each dimension above ``max_order`` is cut into chunks of at most ``max_order``; every block (one
chunk per dimension) has its own preconditioner per mode. Blocks are enumerated with the last
dimension fastest, which for matrices is the order state keys have always had.
"""
from __future__ import annotations

import itertools
import math
from dataclasses import dataclass

import torch

TENSOR_LAYOUTS = ("matrix", "modes")


@dataclass(frozen=True, kw_only=True)
class Block:
    """One preconditioned block: its index (in state keys), where it lies, its size per mode."""

    index: int
    where: tuple[slice, ...]
    dims: tuple[int, ...]


@dataclass(frozen=True, kw_only=True)
class TensorLayout:
    """The gradient viewed as ``shape`` (2-D for matrices), cut into blocks of at most ``max_order``."""

    shape: tuple[int, ...]
    max_order: int

    @property
    def sides(self) -> tuple[str, ...]:
        """State-key names of the modes: "L", "R" for matrices (the published names), "m0".. otherwise."""
        return ("L", "R") if len(self.shape) == 2 else tuple(f"m{i}" for i in range(len(self.shape)))

    @property
    def root(self) -> int:
        """p of the inverse roots A^(-1/p): 2 x the number of modes."""
        return 2 * len(self.shape)

    def blocks(self) -> list[Block]:
        def cuts(n: int) -> list[slice]:
            return [slice(i, min(i + self.max_order, n)) for i in range(0, n, self.max_order)]

        return [Block(index=i, where=where, dims=tuple(s.stop - s.start for s in where))
                for i, where in enumerate(itertools.product(*(cuts(n) for n in self.shape)))]


def make_layout(shape: torch.Size, max_order: int, tensor_layout: str) -> TensorLayout | None:
    """The layout of a parameter of ``shape``; None (no preconditioner) for rank <= 1 after squeezing
    or an empty tensor."""
    dims = [d for d in shape if d != 1]
    if len(dims) < 2 or 0 in dims:
        return None
    if tensor_layout == "modes" and len(dims) > 2:
        return TensorLayout(shape=tuple(dims), max_order=max_order)
    return TensorLayout(shape=(dims[0], math.prod(dims[1:])), max_order=max_order)


def mode_gram(x: torch.Tensor, mode: int) -> torch.Tensor:
    """G_(i) G_(i)ᵀ of the mode-``mode`` unfolding of block ``x`` (G Gᵀ and Gᵀ G for a matrix)."""
    if x.dim() == 2:
        return x @ x.mT if mode == 0 else x.mT @ x
    unfolded = x.movedim(mode, 0).reshape(x.shape[mode], -1)
    return unfolded @ unfolded.mT


def apply_roots(x: torch.Tensor, roots: list[torch.Tensor]) -> torch.Tensor:
    """x multiplied along every mode i by the symmetric ``roots[i]`` (L̂ x R̂ for a matrix)."""
    if x.dim() == 2:
        return roots[0] @ x @ roots[1]
    for mode, root in enumerate(roots):
        x = torch.tensordot(root, x, dims=([1], [mode])).movedim(0, mode)
    return x
