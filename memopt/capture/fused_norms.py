"""Canonical forms of captured graphs, so that module-level patterns match what fused modules lower to.

Norm-act modules such as timm's ``BatchNormAct2d`` subclass ``nn.BatchNorm2d`` but fuse the activation into
their own forward, so ``torch.fx`` traces through them: a ``num_batches_tracked.add_(1)``, then
``F.batch_norm`` on the module's own buffers and parameters, then ``drop`` (often ``nn.Identity``) and ``act``
modules. The stash's chain pattern looks for a BatchNorm *module* followed by an activation, so these stayed
exact. ``canonical_batch_norms`` turns each such sequence back into a call of a plain ``nn.BatchNorm1d/2d/3d``
that shares the module's parameters and buffers (the same tensor objects) and runs stock's ``forward``: the same
``F.batch_norm`` call with the same arguments and the same counter update, so outputs, buffers and gradients
are bit-identical (the capture check verifies it on every model). ``nn.Identity`` calls are dropped.
"""
from __future__ import annotations

from typing import Dict, Optional

import torch.nn.functional as F
from torch import fx, nn

_PLAIN = {1: nn.BatchNorm1d, 2: nn.BatchNorm2d, 3: nn.BatchNorm3d}
PROXY_PREFIX = "memopt_bn_"
OWNER_ATTRIBUTE = "memopt_owner"  # on a twin: the path of the model's module whose tensors it holds


def proxy_name(owner: str) -> str:
    """The attribute of the graph module holding the stock twin of the fused BatchNorm at ``owner``."""
    return PROXY_PREFIX + owner.replace(".", "_")


def _attr(node, gm: fx.GraphModule) -> Optional[str]:
    return node.target if isinstance(node, fx.Node) and node.op == "get_attr" else None


def _owner(node: fx.Node, gm: fx.GraphModule, root: nn.Module) -> Optional[str]:
    """The BatchNorm module path whose buffers and parameters ``node`` (an ``F.batch_norm`` call) uses, when they
    are exactly that module's own and its settings match the call's; else None."""
    names = dict(zip(("input", "running_mean", "running_var", "weight", "bias", "training", "momentum", "eps"),
                     node.args))
    names.update(node.kwargs)
    paths = {key: _attr(names.get(key), gm) for key in ("running_mean", "running_var", "weight", "bias")}
    if any(p is None for p in paths.values()):
        return None
    owner = paths["weight"].rpartition(".")[0]
    if any(p != f"{owner}.{key}" for key, p in paths.items()):
        return None
    try:
        module = root.get_submodule(owner)  # the model's own module (gm holds only the attributes it reads)
    except AttributeError:
        return None
    if not isinstance(module, nn.modules.batchnorm._BatchNorm) or type(module) in _PLAIN.values():
        return None
    if not (module.affine and module.track_running_stats and module.momentum is not None):
        return None
    if names.get("training") is not module.training or names.get("momentum") != module.momentum or \
            names.get("eps") != module.eps:
        return None
    return owner


def _counter_update(node: fx.Node, owner: str) -> Optional[fx.Node]:
    """The ``num_batches_tracked.add_(1)`` of ``owner`` before ``node`` (training mode), or None."""
    previous = node.prev
    while previous.op != "root":
        if previous.op == "call_method" and previous.target == "add_" and previous.args[1:] == (1,) and \
                _attr(previous.args[0], None) == f"{owner}.num_batches_tracked" and not previous.users:
            return previous
        previous = previous.prev
    return None


def _hooked(module: nn.Module) -> bool:
    """A module with its own forward hooks: calling it differently would skip or change them."""
    return bool(module._forward_hooks or module._forward_pre_hooks)


def _plain_twin(module: nn.modules.batchnorm._BatchNorm, dims: int, owner: str) -> nn.Module:
    """A stock BatchNorm holding ``module``'s very parameters and buffers (no copies)."""
    twin = _PLAIN[dims](module.num_features, eps=module.eps, momentum=module.momentum, device="meta")
    twin.weight, twin.bias = module.weight, module.bias
    for name in ("running_mean", "running_var", "num_batches_tracked"):
        twin._buffers[name] = module._buffers[name]
    twin.train(module.training)
    setattr(twin, OWNER_ATTRIBUTE, owner)
    return twin


def canonical_batch_norms(gm: fx.GraphModule, root: nn.Module) -> int:
    """Rewrite fused norm-act modules' ``F.batch_norm`` back into stock BatchNorm calls; drop ``nn.Identity``
    calls (``root``: the model ``gm`` was traced from). Returns how many calls were rewritten or dropped (``gm`` is
    recompiled when anything changed)."""
    changed = 0
    modules: Dict[str, nn.Module] = dict(root.named_modules())
    for node in list(gm.graph.nodes):
        if node.op == "call_module" and isinstance(modules.get(node.target), nn.Identity) and len(node.args) == 1 \
                and not node.kwargs and isinstance(node.args[0], fx.Node) and not _hooked(modules[node.target]):
            node.replace_all_uses_with(node.args[0])
            gm.graph.erase_node(node)
            changed += 1
            continue
        if node.op != "call_function" or node.target is not F.batch_norm:
            continue
        owner = _owner(node, gm, root)
        value = node.args[0] if node.args else node.kwargs.get("input")
        if owner is None or not isinstance(value, fx.Node) or _hooked(modules[owner]):
            continue
        dims = next((d for d, plain in _PLAIN.items() if isinstance(modules[owner], plain)), None)
        counter = _counter_update(node, owner) if modules[owner].training else None
        if dims is None or (modules[owner].training and counter is None):
            continue
        target = proxy_name(owner)
        gm.add_submodule(target, _plain_twin(modules[owner], dims, owner))
        with gm.graph.inserting_before(node):
            call = gm.graph.call_module(target, (value,))
        call.meta.update(node.meta)
        node.replace_all_uses_with(call)
        gm.graph.erase_node(node)
        if counter is not None:
            counter_attr = counter.args[0]
            gm.graph.erase_node(counter)
            if not counter_attr.users:
                gm.graph.erase_node(counter_attr)
        changed += 1
    for node in list(gm.graph.nodes):  # the get_attr nodes the rewritten calls no longer read
        if node.op == "get_attr" and not node.users:
            gm.graph.erase_node(node)
    if changed:
        gm.graph.lint()
        gm.recompile()
    return changed
