"""memopt.core.modules lists what nn.Module's own generators list, in their order, duplicates and all."""
from __future__ import annotations

import torch
from torch import nn

from memopt.core.modules import named_buffers, named_parameters, walk


class _Shared(nn.Module):
    """One Linear reached under two names, a None child, a parameter set to None, a deep chain."""

    def __init__(self) -> None:
        super().__init__()
        shared = nn.Linear(3, 3)
        self.a = shared
        self.block = nn.Sequential(nn.Conv2d(3, 4, 3), nn.BatchNorm2d(4), nn.Sequential(shared, nn.ReLU()))
        self.missing = None
        self.empty = nn.Linear(2, 2, bias=False)
        self.register_parameter("gone", None)
        self.register_buffer("scale", torch.ones(2))
        self.deep = nn.Sequential(nn.Sequential(nn.Sequential(nn.Linear(2, 2))))


def _names(pairs):
    return [(name, id(value)) for name, value in pairs]


def test_walk_matches_torchs_generators_with_shared_and_missing_members() -> None:
    for model in (_Shared(), nn.Sequential(_Shared(), nn.ModuleList([nn.Linear(1, 1), None])), nn.Linear(2, 2)):
        walked = walk(model)
        assert _names(walked) == _names(model.named_modules(remove_duplicate=False))
        assert _names(named_parameters(model, walked)) == _names(model.named_parameters(remove_duplicate=False))
        assert _names(named_buffers(model, walked)) == _names(model.named_buffers(remove_duplicate=False))
    shared = _Shared()
    assert [name for name, _ in walk(shared)].count("a") == 1 and any(n == "block.2.0" for n, _ in walk(shared))
    assert len(walk(shared)) > len(list(shared.named_modules()))  # the shared Linear twice, as remove_duplicate=False



class _OwnParameters(nn.Linear):
    """Lists only its weight: its own ``named_parameters`` decides."""

    def named_parameters(self, prefix="", recurse=True, remove_duplicate=True):
        yield "weight", self.weight


def test_a_model_with_its_own_named_parameters_is_listed_by_it() -> None:
    model = _OwnParameters(2, 2)
    assert _names(named_parameters(model, walk(model))) == [("weight", id(model.weight))]
