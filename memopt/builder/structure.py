"""What the optimized module checks about the model and its graphs around each call: which objects sit where
(a graph captured for one structure must not run on another), whose attributes a build reads, whether a forward
trains anything, and which convolutions a compiler may lay out anew. Split from ``optimized.py``."""
from __future__ import annotations

from typing import Optional

import torch
from torch import nn

from memopt.builder.pipeline import Built
from memopt.capture.trace import has_hooks
from memopt.core.modules import Walked, named_buffers, named_parameters, walk


def structure(model: nn.Module, walked: Optional[Walked] = None) -> tuple:
    """Which module and parameter objects sit where in ``model``, which require grad and which modules
    have hooks: a graph captured for one structure must not run on another (it would call the old
    objects, or skip hooks registered since). ``walked``: ``memopt.core.modules.walk(model)``, when the
    caller has it."""
    walked = walk(model) if walked is None else walked
    modules = tuple((name, id(m), has_hooks(m), m.training) for name, m in walked)
    params = tuple((name, id(p), p.requires_grad) for name, p in named_parameters(model, walked))
    buffers = tuple((name, id(b)) for name, b in named_buffers(model, walked))
    return modules + params + buffers


def guarded_paths(built) -> Optional[list]:
    """Whose attributes a build's graphs read: the whole model's, or only the captured submodules' when it was
    captured per submodule (the model's own forward runs eagerly there and may change its attributes)."""
    return None if isinstance(built, Built) else [unit.path for unit in built.units]


_CONV_FUNCTIONS = {torch.nn.functional.conv1d, torch.nn.functional.conv2d, torch.nn.functional.conv3d,
                   torch.conv1d, torch.conv2d, torch.conv3d, torch.ops.aten.convolution.default,
                   torch.ops.aten.conv2d.default}


def plain_convs(gm: torch.fx.GraphModule) -> list:
    """The convolutions of a rewritten graph that run as PyTorch's (memopt's own conv ops are leaves,
    opaque to dynamo): the ones inductor compiles, and may give channels-last copies of their inputs."""
    names = []
    for node in gm.graph.nodes:
        if node.op == "call_module" and isinstance(gm.get_submodule(node.target), nn.modules.conv._ConvNd) or \
                node.op == "call_function" and node.target in _CONV_FUNCTIONS:
            names.append(str(node.target) if node.op == "call_module" else node.name)
    return names


def trains_anything(model: nn.Module, args: tuple, kwargs: dict) -> bool:
    """Whether a forward has anything to train: a parameter or an input that requires grad (not so under
    ``torch.func.functional_call`` with detached tensors, or with every parameter frozen)."""
    from torch.utils._pytree import tree_leaves

    return any(p.requires_grad for p in model.parameters()) or any(
        isinstance(t, torch.Tensor) and t.requires_grad for t in tree_leaves((args, kwargs)))
