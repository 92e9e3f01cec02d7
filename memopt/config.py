"""``memopt.Config``: one frozen dataclass, one field per technique (None turns it off).

The techniques and their order come from ``memopt.techniques.TECHNIQUES``; each technique config is a frozen
dataclass validated in ``__post_init__`` whose type selects its pass (``memopt.passes.base.register_pass``).
The fields are written out below for readers and type checkers; an import-time check keeps them equal to the
registry, in its order.
"""
from __future__ import annotations

import dataclasses
import json
import math
from dataclasses import dataclass
from typing import Any, Dict, Optional, Union

from memopt.fewbit.config import FewBitConfig
from memopt.recompute.config import RecomputeConfig
from memopt.reversible.config import ReversibleConfig
from memopt.stash.config import StashConfig
from memopt.techniques import TECHNIQUES

_DEVICES = ("cpu", "cuda", "meta")
# Config.prefer's named exchange rates (memopt.passes.planning.knapsack.POLICIES holds what each one means to the planner)
PREFER = ("balanced", "fidelity", "speed", "memory")
SHAPE_CHECKS = ("range", "every")
# the layout of Config.to_dict(); 1: dicts written before the key existed (same layout)
CONFIG_SCHEMA_VERSION = 1


@dataclass(frozen=True, kw_only=True)
class FidelityConfig:
    """The fidelity gate (``memopt/fidelity/gate.py``): after a plan without a budget is applied, one exact and one
    rewritten training step on a slice of the example batch compare every parameter's gradient; a parameter
    below ``min_cosine`` gets the rewritten units nearest to it in the graph raised to their next bit width, or
    exact, until it passes (at most ``max_rounds`` rounds). The report lists what the gate changed.

    Attributes:
        min_cosine: the least per-parameter gradient cosine against exact autograd, in (0, 1] (default 0.99).
        tiny: parameters whose exact gradient norm is below ``tiny`` times the median norm are listed apart and
            not gated (their direction is rounding noise, e.g. attention key biases), in [0, 1) (default 1e-3).
        max_rounds: repair rounds, 1..20 (default 12); rounds that stop helping end early (``fidelity.py``
            STALL_ROUNDS), so the bound costs time only where each round brings parameters closer to the bar.
        max_projections: how many losses a plan that passes narrowly is confirmed on, 2..32 (default 8); each
            costs an exact and a rewritten step on the slice. Fewer build faster and let more misses through
            under losses the gate did not see (docs/results/fidelity/gate_miss.md).
    """

    min_cosine: float = 0.99
    tiny: float = 1e-3
    max_rounds: int = 12
    max_projections: int = 8  # memopt.fidelity.gate.MAX_PROJECTIONS

    def __post_init__(self) -> None:
        if isinstance(self.min_cosine, bool) or not isinstance(self.min_cosine, (int, float)) or \
                not 0 < self.min_cosine <= 1:
            raise ValueError(f"FidelityConfig.min_cosine must be a number in (0, 1], got {self.min_cosine!r}")
        if isinstance(self.tiny, bool) or not isinstance(self.tiny, (int, float)) or not 0 <= self.tiny < 1:
            raise ValueError(f"FidelityConfig.tiny must be a number in [0, 1), got {self.tiny!r}")
        if isinstance(self.max_rounds, bool) or not isinstance(self.max_rounds, int) or not 1 <= self.max_rounds <= 20:
            raise ValueError(f"FidelityConfig.max_rounds must be an int in 1..20, got {self.max_rounds!r}")
        if isinstance(self.max_projections, bool) or not isinstance(self.max_projections, int) or \
                not 2 <= self.max_projections <= 32:
            raise ValueError(f"FidelityConfig.max_projections must be an int in 2..32, got {self.max_projections!r}")


@dataclass(frozen=True)
class Config:
    """Options of ``memopt.optimize``.

    Attributes:
        reversible: reversible segments (``ReversibleConfig``; None turns it off): coupling blocks
            (RevNet, reversible transformers) rebuild their inputs from their outputs in backward,
            checked on the example inputs first. Runs first; models without such blocks are
            unchanged.
        recompute: recomputation of whole blocks in backward (``RecomputeConfig``; None turns it
            off). The budget planner uses it as a last resort, after few-bit and stash at their fewest
            bits; without a budget the default plan recomputes blocks from 8-bit codes of their inputs
            only where that lowers the estimated step peak (``RecomputeConfig.peak_first_bits``). Runs
            first; the other techniques rewrite what is left outside the recomputed blocks.
        stash: exact forward with a K-bit stash for BatchNorm-activation chains (``StashConfig``;
            None turns it off). Runs before few-bit, which takes the activations left over.
        fewbit: few-bit backward for pointwise activations (``FewBitConfig``; None turns it off).
        device: the device the cost model plans for (default None: the model's own device).
            "cuda" works on a machine without a GPU: planning runs on fake tensors.
        workspace_mb: MiB the budget planner keeps free below ``budget_mb`` for what the cost model does
            not see: cuDNN / cuBLAS workspaces and the caching allocator's 512-byte rounding. Default
            None: ``CUDA_WORKSPACE_MB`` (64) when planning for CUDA; on CPU, where the budget is the process's
            resident memory, what the build itself leaves held in the process (measured: the math library's
            buffer pools and the caches of its checks, ``memopt.core.heap.ResidentGrowth``; reported as
            ``Plan.process_held_bytes``), so a first build in a process keeps more free than a later one. A
            number replaces either. Not counted on CPU either way: what kernels allocate inside an op (oneDNN's
            reorders of convolution inputs and outputs, docs/results/peak/largest_batch_resnet50_budget.md):
            set a number to keep that free for a CNN. The CUDA default sits above the largest gap measured
            between a step's peak and its estimate (see docs/results/cuda/cuda.md); with cuDNN autotuning on a
            large free GPU, more may be taken.
        fidelity: the fidelity gate (``FidelityConfig``; None turns it off): plans without a budget are checked
            per parameter against exact gradients on the example inputs and repaired where they miss.
        prefer: how the budget planner trades gradient fidelity against step time when a ``budget_mb`` needs
            rewrites (without a budget every technique runs at its defaults and ``prefer`` changes nothing):
            "balanced" (default): the least fidelity cost, time a tie-breaker, whole blocks recomputed only when
            the lossy techniques at their fewest bits do not fit. "fidelity": exact recomputation of blocks
            before any lossy option wherever it frees the bytes; lossy options only for what recomputation
            cannot reach. "speed": the least extra work: lossy codecs (down to 3 bits) before recomputation,
            whose time is its recomputed FLOPs. "memory": every lossy unit at its fewest bits (the least peak
            they reach), blocks recomputed on top only where the budget needs them. A number w >= 0 is an
            explicit exchange rate: an option costs ``fidelity + w * time`` (fidelity: the squared-error proxy;
            time: extra elementwise passes, one per element, a recomputed FLOP counted at the planner's
            ``FLOPS_PER_PASS``), recomputation competing with the lossy options ("fidelity" is 1e-9, "speed"
            1e-2). ``prefer`` never relaxes the fidelity gate: every plan,
            "memory" included, is repaired until each parameter's gradient reaches
            ``FidelityConfig.min_cosine`` (within the budget, by recomputation); to keep approximate gradients,
            lower ``min_cosine`` or set ``fidelity=None``.
        shape_checks: how a new input size that only changes sizes reuses a plan without a budget
            (``memopt/builder/shape_reuse.py``): "range" (default) checks a size on fake tensors (the plan's decisions applied
            there, the rewritten graph compared) only when some dimension lies outside the sizes already checked
            to run the plan's very graph; inside that range the graph runs unchecked (the passes' size rules are
            thresholds, and the graph was the same program at both ends). "every" checks each new size (costs
            about one fake-tensor pass over the graph per size). Under a budget every new size is checked.
        dynamic: which sizes a ``torch.export`` capture (the path of models ``torch.fx`` cannot trace, as Hugging
            Face's) leaves dynamic, as ``torch.compile(dynamic=...)``: None (default) exports at the example's
            sizes and, at the first new size, exports again with the dimensions that changed dynamic and the
            batch dimension too (an export with symbolic sizes costs several static ones). True exports from the
            first build with the batch dimension and the sequence dimension of rank-2 integer inputs (token ids,
            attention masks) dynamic, so the first new batch size or padded length reuses the plan (a cheap check)
            instead of exporting again; where that graph fails the capture check (it can keep what the sizes'
            own graph does not: a causal mask built from the sequence length, which a static graph replaces by
            ``is_causal=True``), the example's sizes are exported as with None. For training on dynamic-padded
            batches. False: every new size is captured at its own sizes and planned anew.
    """

    reversible: Optional[ReversibleConfig] = ReversibleConfig()
    recompute: Optional[RecomputeConfig] = RecomputeConfig()
    stash: Optional[StashConfig] = StashConfig()
    fewbit: Optional[FewBitConfig] = FewBitConfig()
    device: Optional[str] = None
    workspace_mb: Optional[float] = None
    fidelity: Optional[FidelityConfig] = FidelityConfig()
    prefer: Union[str, float] = "balanced"
    shape_checks: str = "range"
    dynamic: Optional[bool] = None

    def __post_init__(self) -> None:
        for name, cls in _TECHNIQUES.items():
            value = getattr(self, name)
            if value is not None and not isinstance(value, cls):
                raise TypeError(f"Config.{name} must be a memopt.{cls.__name__} or None, got "
                                f"{type(value).__name__}: {value!r:.80}")
        if self.device is not None:
            if not isinstance(self.device, str) or self.device.split(":")[0] not in _DEVICES:
                raise ValueError(f"Config.device={self.device!r} is not supported; use None or one of "
                                 f"{list(_DEVICES)} (optionally with an index, e.g. 'cuda:1')")
        if self.fidelity is not None and not isinstance(self.fidelity, FidelityConfig):
            raise TypeError(f"Config.fidelity must be a memopt.FidelityConfig or None, got "
                            f"{type(self.fidelity).__name__}: {self.fidelity!r:.80}")
        w = self.workspace_mb
        if w is not None and (isinstance(w, bool) or not isinstance(w, (int, float)) or not math.isfinite(w) or w < 0):
            raise ValueError(f"Config.workspace_mb must be None or a finite number of MiB >= 0, got {w!r}")
        if self.shape_checks not in SHAPE_CHECKS:
            raise ValueError(f"Config.shape_checks={self.shape_checks!r} is not supported; use one of "
                             f"{list(SHAPE_CHECKS)}")
        if self.dynamic not in (None, True, False) or not isinstance(self.dynamic, (bool, type(None))):
            raise ValueError(f"Config.dynamic={self.dynamic!r} is not supported; use None (export at the example's "
                             f"sizes, dynamic from the first new size), True (dynamic from the start) or False")
        p = self.prefer
        if isinstance(p, bool) or not (p in PREFER if isinstance(p, str) else
                                       isinstance(p, (int, float)) and math.isfinite(p) and p >= 0):
            raise ValueError(f"Config.prefer={p!r} is not supported; use one of {list(PREFER)} or a finite number "
                             f">= 0 (the fidelity cost one extra elementwise pass per element is worth)")

    def workspace_bytes(self, device: str) -> int:
        """Bytes the budget planner keeps free on ``device`` (see ``workspace_mb``)."""
        if self.workspace_mb is not None:
            return int(self.workspace_mb * 2 ** 20)
        return CUDA_WORKSPACE_MB * 2 ** 20 if device.startswith("cuda") else 0

    def planning_target(self, budget_bytes: Optional[int], device: str) -> Optional[int]:
        """The estimated peak a plan must reach for ``budget_bytes`` on ``device``: the budget less the workspace
        reserve (None without a budget). The planner, the gate's re-fit and shape reuse all plan to it."""
        return None if budget_bytes is None else budget_bytes - self.workspace_bytes(device)

    @classmethod
    def exact(cls, **kwargs: Any) -> "Config":
        """Every technique off: the captured graph runs unchanged (for baselines and comparisons)."""
        return cls(**{name: None for name in _TECHNIQUES}, **kwargs)

    def to_dict(self) -> Dict[str, Any]:
        """A JSON-ready dict (tuples become lists) with its ``schema_version``; ``Config.from_dict`` reads it
        back."""
        return {**json.loads(json.dumps(dataclasses.asdict(self))), "schema_version": CONFIG_SCHEMA_VERSION}

    @classmethod
    def from_dict(cls, data: Dict[str, Any]) -> "Config":
        """Read ``to_dict``'s output; dicts without ``schema_version`` (written before it existed) are version 1."""
        data = dict(data)
        version = data.pop("schema_version", 1)
        if not isinstance(version, int) or not 1 <= version <= CONFIG_SCHEMA_VERSION:
            raise ValueError(f"Config schema_version {version!r} is not one this memopt reads (1 to "
                             f"{CONFIG_SCHEMA_VERSION}): upgrade memopt or rebuild the Config")
        names = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(data) - names)
        if unknown:
            raise ValueError(f"unknown Config fields {unknown}; known fields are {sorted(names)}")
        data = dict(data)
        if isinstance(data.get("fidelity"), dict):
            data["fidelity"] = FidelityConfig(**data["fidelity"])
        for name, technique in _TECHNIQUES.items():
            if isinstance(data.get(name), dict):
                data[name] = technique(**{k: tuple(v) if isinstance(v, list) else v for k, v in data[name].items()})
        return cls(**data)


# Default headroom for CUDA workspaces (Config.workspace_mb): above the largest gap measured on ResNet-50 (37 MiB)
CUDA_WORKSPACE_MB = 64

# Config field -> its technique's config class, from the one registry
_TECHNIQUES = {t.name: t.config_type for t in TECHNIQUES}


def _check_fields() -> None:
    """Config's technique fields are the registry's, in its order (which is the order passes run in)."""
    fields = [(f.name, f.type) for f in dataclasses.fields(Config) if f.name in _TECHNIQUES]
    expected = [t.name for t in TECHNIQUES]
    if [name for name, _ in fields] != expected:
        raise TypeError(f"memopt.Config's technique fields {[name for name, _ in fields]} differ from "
                        f"memopt.techniques.TECHNIQUES {expected}: add or reorder the fields in memopt/config.py")


_check_fields()
