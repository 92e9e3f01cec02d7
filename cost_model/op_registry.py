"""One registry from every spelling of an op to one op kind.

A graph captured by ``torch.fx.symbolic_trace`` spells an op as a module (``nn.GELU``), a
functional (``F.gelu``), a torch function (``torch.tanh``) or a tensor method (``x.gelu()``); a
graph captured by ``torch.export`` spells it as an ATen overload (``aten.gelu.default``). Passes
ask ``op_kind(node, modules)`` and never look at spellings themselves, so a rewrite written once
works on both capture paths.
"""
from __future__ import annotations

from typing import Dict, Mapping, Optional, Tuple

import torch
import torch.nn as nn
import torch.nn.functional as F
from torch import fx

aten = torch.ops.aten

# kind -> (module classes, python callables, tensor-method names, aten overload packets)
_SPELLINGS: Dict[str, Tuple[tuple, tuple, tuple, tuple]] = {
    "conv": ((nn.Conv1d, nn.Conv2d, nn.Conv3d), (F.conv1d, F.conv2d, F.conv3d),
             (), (aten.conv1d, aten.conv2d, aten.conv3d, aten.convolution)),
    "conv_transpose": ((nn.ConvTranspose1d, nn.ConvTranspose2d, nn.ConvTranspose3d),
                       (F.conv_transpose1d, F.conv_transpose2d, F.conv_transpose3d),
                       (), (aten.conv_transpose1d, aten.conv_transpose2d)),
    "linear": ((nn.Linear,), (F.linear,), (), (aten.linear, aten.addmm)),
    "matmul": ((), (torch.matmul, torch.bmm, torch.mm, torch.Tensor.matmul, __import__("operator").matmul),
               ("matmul", "bmm", "mm", "__matmul__"), (aten.matmul, aten.bmm, aten.mm)),
    "batch_norm": ((nn.BatchNorm1d, nn.BatchNorm2d, nn.BatchNorm3d), (F.batch_norm,), (),
                   (aten.batch_norm, aten._native_batch_norm_legit_functional,
                    aten._native_batch_norm_legit, aten.native_batch_norm,
                    aten._native_batch_norm_legit_no_training)),
    "layer_norm": ((nn.LayerNorm,), (F.layer_norm,), (), (aten.layer_norm, aten.native_layer_norm)),
    "group_norm": ((nn.GroupNorm,), (F.group_norm,), (), (aten.group_norm, aten.native_group_norm)),
    "rms_norm": ((nn.RMSNorm,), (F.rms_norm,), (), (aten.rms_norm,)),
    "relu": ((nn.ReLU,), (F.relu, torch.relu, torch.relu_, F.relu_), ("relu", "relu_"),
             (aten.relu, aten.relu_)),
    "relu6": ((nn.ReLU6,), (F.relu6,), (), (aten.relu6,)),
    "hardtanh": ((nn.Hardtanh,), (F.hardtanh,), (), (aten.hardtanh, aten.hardtanh_)),
    "leaky_relu": ((nn.LeakyReLU,), (F.leaky_relu,), (), (aten.leaky_relu, aten.leaky_relu_)),
    "gelu": ((nn.GELU,), (F.gelu,), ("gelu",), (aten.gelu, aten.gelu_)),
    "silu": ((nn.SiLU,), (F.silu,), ("silu",), (aten.silu, aten.silu_)),
    "elu": ((nn.ELU,), (F.elu,), (), (aten.elu, aten.elu_)),
    "celu": ((nn.CELU,), (F.celu,), (), (aten.celu, aten.celu_)),
    "selu": ((nn.SELU,), (F.selu, torch.selu), (), (aten.selu, aten.selu_)),
    "mish": ((nn.Mish,), (F.mish,), (), (aten.mish, aten.mish_)),
    "logsigmoid": ((nn.LogSigmoid,), (F.logsigmoid,), (), (aten.log_sigmoid,)),
    "softsign": ((nn.Softsign,), (F.softsign,), (), ()),
    "tanhshrink": ((nn.Tanhshrink,), (F.tanhshrink,), (), ()),
    "threshold": ((nn.Threshold,), (F.threshold, torch.threshold), (), (aten.threshold, aten.threshold_)),
    "softplus": ((nn.Softplus,), (F.softplus,), (), (aten.softplus,)),
    "hardswish": ((nn.Hardswish,), (F.hardswish,), (), (aten.hardswish, aten.hardswish_)),
    "hardsigmoid": ((nn.Hardsigmoid,), (F.hardsigmoid,), (), (aten.hardsigmoid, aten.hardsigmoid_)),
    "tanh": ((nn.Tanh,), (torch.tanh, F.tanh), ("tanh", "tanh_"), (aten.tanh, aten.tanh_)),
    "sigmoid": ((nn.Sigmoid,), (torch.sigmoid, F.sigmoid), ("sigmoid", "sigmoid_"),
                (aten.sigmoid, aten.sigmoid_)),
    "softmax": ((nn.Softmax,), (F.softmax, torch.softmax), ("softmax",), (aten.softmax, aten._softmax)),
    "log_softmax": ((nn.LogSoftmax,), (F.log_softmax, torch.log_softmax), ("log_softmax",),
                    (aten.log_softmax, aten._log_softmax)),
    "max_pool": ((nn.MaxPool1d, nn.MaxPool2d, nn.MaxPool3d), (F.max_pool1d, F.max_pool2d, F.max_pool3d),
                 (), (aten.max_pool2d, aten.max_pool2d_with_indices, aten.max_pool1d, aten.max_pool3d)),
    "avg_pool": ((nn.AvgPool1d, nn.AvgPool2d, nn.AvgPool3d, nn.AdaptiveAvgPool1d, nn.AdaptiveAvgPool2d,
                  nn.AdaptiveAvgPool3d),
                 (F.avg_pool1d, F.avg_pool2d, F.avg_pool3d, F.adaptive_avg_pool1d, F.adaptive_avg_pool2d,
                  F.adaptive_avg_pool3d), (),
                 (aten.avg_pool1d, aten.avg_pool2d, aten.avg_pool3d, aten.adaptive_avg_pool1d, aten.adaptive_avg_pool2d,
                  aten._adaptive_avg_pool2d, aten.adaptive_avg_pool3d, aten._adaptive_avg_pool3d)),
    "dropout": ((nn.Dropout, nn.Dropout1d, nn.Dropout2d), (F.dropout, F.dropout1d, F.dropout2d), (),
                (aten.dropout, aten.native_dropout, aten.dropout_)),
    "sdpa": ((), (F.scaled_dot_product_attention,), (), (aten.scaled_dot_product_attention,)),
    "add": ((), (torch.add, __import__("operator").add, __import__("operator").iadd),
            ("add", "add_", "__add__", "__iadd__"), (aten.add, aten.add_)),
    "mul": ((), (torch.mul, __import__("operator").mul, __import__("operator").imul),
            ("mul", "mul_", "__mul__"), (aten.mul, aten.mul_)),
    "div": ((), (torch.div, __import__("operator").truediv), ("div", "__truediv__"), (aten.div,)),
    "pow": ((), (torch.pow, __import__("operator").pow), ("pow", "__pow__"), (aten.pow,)),
    "cat": ((), (torch.cat, torch.concat), (), (aten.cat,)),
    "view": ((nn.Flatten,), (torch.flatten, torch.reshape, torch.permute, torch.transpose),
             ("view", "reshape", "flatten", "permute", "transpose", "contiguous", "unsqueeze", "squeeze",
              "chunk", "split", "expand", "size"),
             (aten.view, aten.reshape, aten.flatten, aten.permute, aten.transpose, aten.t, aten.unsqueeze,
              aten.squeeze, aten.split, aten.chunk, aten.expand, aten._unsafe_view, aten.select, aten.slice)),
    "embedding": ((nn.Embedding,), (F.embedding,), (), (aten.embedding,)),
    "cross_entropy": ((nn.CrossEntropyLoss,), (F.cross_entropy,), (), (aten.cross_entropy_loss,)),
}


def _build_tables():
    by_module, by_callable, by_method, by_packet = {}, {}, {}, {}
    for kind, (modules, callables, methods, packets) in _SPELLINGS.items():
        for m in modules:
            by_module[m] = kind
        for c in callables:
            by_callable[c] = kind
        for name in methods:
            by_method[name] = kind
        for p in packets:
            by_packet[p] = kind
    return by_module, by_callable, by_method, by_packet


_BY_MODULE, _BY_CALLABLE, _BY_METHOD, _BY_PACKET = _build_tables()

KINDS = tuple(_SPELLINGS)


def kind_of_target(target, module: Optional[nn.Module] = None) -> Optional[str]:
    """Op kind of a call target: a module instance, a callable, a method name or an ATen overload."""
    if module is not None:
        for cls in type(module).__mro__:
            if cls in _BY_MODULE:
                return _BY_MODULE[cls]
        return None
    if isinstance(target, str):
        return _BY_METHOD.get(target)
    if isinstance(target, torch._ops.OpOverload):
        return _BY_PACKET.get(target.overloadpacket)
    if isinstance(target, torch._ops.OpOverloadPacket):
        return _BY_PACKET.get(target)
    try:
        return _BY_CALLABLE.get(target)
    except TypeError:  # unhashable target
        return None


def op_kind(node: fx.Node, modules: Mapping[str, nn.Module]) -> Optional[str]:
    """The op kind of ``node`` (``None`` for placeholders, outputs, attributes and unknown ops)."""
    if node.op == "call_module":
        return kind_of_target(node.target, modules.get(node.target))
    if node.op in ("call_function", "call_method"):
        return kind_of_target(node.target)
    return None


def describe_target(node: fx.Node) -> str:
    """A short readable name of what a node calls, for reports."""
    if node.op == "call_module":
        return str(node.target)
    if node.op == "call_method":
        return f".{node.target}()"
    if node.op == "call_function":
        target = node.target
        if isinstance(target, torch._ops.OpOverload):
            return str(target)
        return getattr(target, "__name__", str(target))
    return node.op
