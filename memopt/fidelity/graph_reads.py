"""What the fidelity gate's graph analyses read off a node: whether it normalises with batch statistics,
its output shape, and whether it reads only metadata (shared by ``invariant_params`` and
``degenerate_norms``)."""
from __future__ import annotations

from typing import Any, Dict, Optional, Tuple

from torch import fx, nn

from memopt.core.meta import META_KEY


def training_batch_norm(node: fx.Node, modules: Dict[str, nn.Module]) -> bool:
    """Whether ``node`` normalises with batch statistics (a BatchNorm module in training mode, ``F.batch_norm``
    or an ATen batch norm with ``training=True``)."""
    if node.op == "call_module":
        module = modules.get(node.target)
        return isinstance(module, nn.modules.batchnorm._BatchNorm) and (module.training or module.running_mean is None)
    if node.op != "call_function":
        return False
    name = getattr(node.target, "__name__", str(node.target))
    if "batch_norm" not in name or "no_training" in name or "backward" in name:
        return False
    training = node.kwargs.get("training", node.args[5] if len(node.args) > 5 else False)
    return training is True


def reads_metadata(node: fx.Node) -> bool:
    """A node that reads only a tensor's metadata (timm's ``_assert(x.ndim == 4)``), not its values."""
    if node.op == "call_function" and node.target is getattr:
        return node.args[1] in ("ndim", "shape", "dtype", "device", "is_cuda")
    return node.op == "call_method" and node.target in ("dim", "size")


def output_shape(node: Any) -> Optional[Tuple[int, ...]]:
    """The node's output shape from the cost model's record, ShapeProp's or export's metadata; None if unknown."""
    if not isinstance(node, fx.Node):
        return None
    cost = node.meta.get(META_KEY)
    if cost is not None and getattr(cost, "shapes", None):
        return tuple(cost.shapes[0])
    found = node.meta.get("tensor_meta", node.meta.get("val"))
    shape = getattr(found, "shape", None)
    return tuple(shape) if shape is not None else None
