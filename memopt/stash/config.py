"""``memopt.StashConfig``: exact forward, K-bit stash for backward: BN-activation chains, optionally the
inputs of every other conv / linear / matmul, and exact 1-bit extras."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Mapping, Optional, Tuple, Union

from memopt.core.validation import check_bits, check_bits_choices, normalise_node_bits, normalise_node_names

CONSUMERS = ("conv", "linear", "matmul")
# ops without a weight that keep activations and can run again from codes (memopt/stash/coded.py)
CODED_OPS = ("batch_norm", "layer_norm", "group_norm", "rms_norm", "sdpa", "softmax", "matmul", "mul", "div", "pow",
             "gated")


@dataclass(frozen=True)
class StashConfig:
    """Exact-forward K-bit stash (Chakrabarti & Moseley, NeurIPS 2019) for BatchNorm -> [+ residual]
    -> ReLU/ReLU6/LeakyReLU chains whose outputs feed conv, linear, pooling or add consumers.

    Attributes:
        bits: K, bits per element of each code, 1..8 (default 4; the paper uses 4 and 8; chains without an
            activation use K + 1, see ``identity_extra_bit``; at 8 bits the grids reach out to the data's
            extremes, at 4 bits where those lie far past the window, ``memopt/stash/grid.py`` REACH).
        allow: if given, only chains whose BatchNorm node is named here are rewritten.
        deny: BatchNorm node names whose chains stay exact.
        node_bits: per-unit overrides {unit: bits}; the budget planner's choices do not go
            here but to the pass (``PassContext.decision``).
        plan_bits: the bits the budget planner may choose from (default (2, 3, 4, 8)).
        min_per_channel: BatchNorms that normalise fewer elements per channel than this (batch x
            spatial size) stay exact (default 32). With few elements the BN input gradient is a
            near-total cancellation (with 2 it is exactly zero up to eps) that a quantized x̂
            cannot reproduce: DenseNet-121 at 32x32, batch 2 (2 elements per channel in its last
            block) got sign-flipped upstream gradients from them.
        generic: also stash the inputs of conv / linear / matmul-with-a-parameter nodes that no chain
            covers (transformer projections, LayerNorm and GELU outputs): per group of ``group_size``
            elements a float32 minimum and step, ``generic_bits``-bit codes. Forward outputs and input
            gradients stay exact; the weight gradients of those layers become approximate. On by default
            (issue 23: transformers keep most of their bytes there), at 8 bits and under the fidelity
            gate: unlike a BN chain's x̂, these inputs have no known scale, so the error depends on the data
            (outlier features in a group widen its step); the gate checks every plan against exact
            gradients and raises what misses. The budget planner also offers these units (unit = the
            node whose output is coded; ``allow``, ``deny`` and ``node_bits`` take that name).
        generic_bits: bits of the generic stash and of coded ops, 1..8 (default 8; the budget planner
            may choose fewer from ``plan_bits``).
        coded_ops: op kinds without a weight that keep their activations as generic-stash codes and run
            again on them in backward (``memopt/stash/coded.py``), drawn from ``CODED_OPS`` (default all):
            training BatchNorms no chain took (BN -> SiLU / hard-swish, BatchNorm3d; as small ones as
            ``min_per_channel`` allows), LayerNorm / GroupNorm / RMSNorm, scaled-dot-product attention (its dropout replayed), products,
            quotients and matmuls of activations, ``pow``, softmax (which codes its output) and gated units
            ``act(g) * u`` (SiLU / GELU; g and u kept, act(g) rebuilt). Forward outputs are unchanged;
            their input gradients become approximate too. A coded op's unit is ``<node>_coded``.
        group_size: elements per group of the generic stash (default 256, as ActNN): 8 bytes of
            metadata per group, 6% on top of 4-bit codes. The input of a coded norm is grouped within
            the blocks it normalises (``memopt.stash.generic.row_group``: a token's features, a channel's
            plane), so that a row of small values is not coded on the step of a wide one.
        stochastic: stochastic rounding for the generic stash (unbiased in expectation, but about twice
            the squared error of rounding to nearest: see docs/results/stash/stash_generic.md); default
            False: deterministic.
        consumers: which op kinds the generic stash rewrites, a subset of ("conv", "linear",
            "matmul"); a matmul qualifies only with a 2-D parameter as its second operand.
        scale_identity: solve the BN weight gradient of a chain whose every channel feeds one depthwise conv
            channel into another rewritten chain's training-mode BN (MobileNetV2's stem and expand BNs) from
            that BN's weight gradient, by the exact scale identity γ dL/dγ + β dL/dβ = Σ_o γ_o dL/dγ_o eps /
            (var_o + eps) − 6 Σ_clip dL/dz, instead of summing over its rebuilt x̂ (default True; such weights
            are nearly scale-invariant, their true gradient tiny beside the code's rounding noise:
            ``memopt/stash/identity.py``, docs/results/stash/stash_invariance.md). Forward outputs and every
            other gradient's formula unchanged.
        identity_extra_bit: chains without an activation (MobileNetV2's projection BNs) code with K + 1 bits
            (at most 8; default True). An activation chain's codes get one bit of resolution from its exact
            1-bit mask (each side of the kink has its own 2^K bins; after a residual z is coded only where
            z > 0); a chain without an activation has no mask to give it, and at K bits its BN weight and the
            next conv's weight gradients missed a cosine of 0.99 in MobileNetV2 at 4 bits (see
            memopt/stash/README.md, "Why the defaults"). The report shows the bits used; the planner's levels
            stay K.
        bin_means: rebuild each bin of a chain's codes at the mean of the values it coded instead of its midpoint,
            at K <= 4 (default True; ``memopt/stash/grid.py`` MEAN_BITS). The forward sums the offsets inside
            their bins of every 4th value per channel (exact integer sums, so both code paths agree bit for bit);
            the means cost 2^K floats per side and channel (128 bytes per channel for a split 4-bit code, counted
            by the cost model). They matter on real data: a bin holding one repeated value (flat image
            backgrounds) rebuilds it exactly, and a clipped outer bin rebuilds at its tail's mean (see
            docs/results/stash/stash_trained_224.md, with and without the means). Only codes whose means
            cost at most half their packed bytes get them (at 4 bits, channels of at least 512 elements);
            the report says which.
        compact_extras: keep training-dropout masks and ``torch.where`` boolean conditions as 1 bit
            per element, and a cross-entropy over 2-d logits its logits instead of their log-softmax, with its
            backward in chunks of rows (``memopt/stash/loss.py``) (default True: exact, same ops and random
            draws, bit-identical outputs and gradients; CPU dropout otherwise keeps a float32 noise tensor).
        head_loss: with ``compact_extras``, a linear head whose logits feed a cross-entropy (through views and
            one cast) and nothing but the model's output joins that loss as one op that keeps the head's input, not
            the logits, and makes the head's gradients in the forward a chunk of rows at a time (default True;
            ``passes/stash/head_loss.py``). Applied where the logits have more columns than the head's input
            has features (an LM's vocabulary). Forward outputs and the loss bit-identical; the head's weight and
            bias gradients are summed over row chunks (rounding-level: the gate checks them), the input gradient
            is eager's kernel on each chunk of rows (scaled by the loss's gradient after it, exact for 1).
        recompute_weights: a conv or linear whose weight the graph computes from parameters alone (timm's
            weight-standardised convs, weight norm) keeps the parameters it reads and recomputes the weight in
            backward, instead of keeping a weight-sized copy per op (default True: exact, the same ops on the
            same parameters; one more pass over the weight per step; ``memopt/stash/weights.py``).
    """

    bits: int = 4
    allow: Optional[Tuple[str, ...]] = None
    deny: Tuple[str, ...] = ()
    min_per_channel: int = 32
    node_bits: Union[Tuple[Tuple[str, int], ...], Mapping[str, int]] = ()
    plan_bits: Tuple[int, ...] = (2, 3, 4, 8)
    generic: bool = True
    generic_bits: int = 8
    coded_ops: Tuple[str, ...] = CODED_OPS
    group_size: int = 256
    stochastic: bool = False
    consumers: Tuple[str, ...] = CONSUMERS
    compact_extras: bool = True
    recompute_weights: bool = True
    head_loss: bool = True
    scale_identity: bool = True
    identity_extra_bit: bool = True
    bin_means: bool = True

    def __post_init__(self) -> None:
        check_bits(self.bits, "StashConfig.bits")
        check_bits(self.generic_bits, "StashConfig.generic_bits")
        if not isinstance(self.coded_ops, (tuple, list)) or not set(self.coded_ops) <= set(CODED_OPS):
            raise ValueError(f"StashConfig.coded_ops must be a tuple drawn from {CODED_OPS}, got {self.coded_ops!r}")
        object.__setattr__(self, "coded_ops", tuple(self.coded_ops))
        for name in ("generic", "stochastic", "compact_extras", "recompute_weights", "head_loss", "scale_identity",
                     "identity_extra_bit", "bin_means"):
            if not isinstance(getattr(self, name), bool):
                raise ValueError(f"StashConfig.{name} must be True or False, got {getattr(self, name)!r}")
        if not isinstance(self.group_size, int) or isinstance(self.group_size, bool) or self.group_size < 1:
            raise ValueError(f"StashConfig.group_size must be a positive int, got {self.group_size!r}")
        if not isinstance(self.consumers, (tuple, list)) or not set(self.consumers) <= set(CONSUMERS):
            raise ValueError(f"StashConfig.consumers must be a tuple drawn from {CONSUMERS}, got {self.consumers!r}")
        object.__setattr__(self, "consumers", tuple(self.consumers))
        if not isinstance(self.min_per_channel, int) or self.min_per_channel < 1:
            raise ValueError(f"StashConfig.min_per_channel must be a positive int, got {self.min_per_channel!r}")
        normalise_node_names(self, "allow", "deny")
        normalise_node_bits(self, "node_bits")
        object.__setattr__(self, "plan_bits", check_bits_choices(self.plan_bits, "StashConfig.plan_bits"))

    def generic_bits_for(self, unit: str) -> int:
        """Bits of a generic-stash unit (the node whose output is coded) or a coded op (its node)."""
        return dict(self.node_bits).get(unit, self.generic_bits)

    def bits_for(self, unit: str) -> int:
        """Bits of a unit: a chain's BatchNorm node, or the node whose output the generic stash codes."""
        return dict(self.node_bits).get(unit, self.bits)
