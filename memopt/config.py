"""``memopt.Config``: one frozen dataclass, one field per technique (None turns it off).

Technique configs (``FewBitConfig``, ``StashConfig``, ``ReversibleConfig``) join as their
techniques land; each is a frozen dataclass validated in ``__post_init__`` whose type selects its
pass through ``passes.base.register_pass``.
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any, Dict, Optional

_DEVICES = ("cpu", "cuda", "meta")


@dataclass(frozen=True)
class Config:
    """Options of ``memopt.optimize``.

    Attributes:
        device: the device the cost model plans for (default None: the model's own device).
            "cuda" works on a machine without a GPU: planning runs on fake tensors.
    """

    device: Optional[str] = None

    def __post_init__(self) -> None:
        if self.device is not None:
            if not isinstance(self.device, str) or self.device.split(":")[0] not in _DEVICES:
                raise ValueError(f"Config.device={self.device!r} is not supported; use None or one of "
                                 f"{list(_DEVICES)} (optionally with an index, e.g. 'cuda:1')")

    def to_dict(self) -> Dict[str, Any]:
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, data: Dict[str, Any]) -> "Config":
        names = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(data) - names)
        if unknown:
            raise ValueError(f"unknown Config fields {unknown}; known fields are {sorted(names)}")
        return cls(**data)
