"""The one list of techniques: ``Config``'s technique fields, the order their passes run in, and what the
planner may drive all come from ``TECHNIQUES``; each technique's pass module registers its pass and planner
hooks against its config type (``memopt.passes.base.register_pass``).

Adding a technique: a folder ``memopt/<name>/`` (config, autograd ops, kernels, README), a pass module
``passes/<name>.py`` that registers itself, a line here, its field on ``Config``, and its import in
``passes/__init__.py`` (docs/design.md has the checklist).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional, Tuple, Type

from memopt.fewbit.config import FewBitConfig
from memopt.recompute.config import RecomputeConfig
from memopt.reversible.config import ReversibleConfig
from memopt.stash.config import StashConfig


@dataclass(frozen=True)
class Technique:
    name: str  # its Config field, its pass's name, the "technique" of the nodes it rewrites
    config_type: Type


# in the order their passes run: reversible and recompute take whole blocks first, the stash takes BN chains,
# few-bit the activations left over
TECHNIQUES: Tuple[Technique, ...] = (
    Technique("reversible", ReversibleConfig),
    Technique("recompute", RecomputeConfig),
    Technique("stash", StashConfig),
    Technique("fewbit", FewBitConfig),
)


def technique_for(config_type: Type) -> Optional[Technique]:
    return next((t for t in TECHNIQUES if t.config_type is config_type), None)
