"""Random small models from memopt's op vocabulary, described by a plain spec (for the fuzz tests).

A spec is ``(family, input_shape, ops)``: family "image" (N, C, H, W) or "tokens" (N, L, D); ``ops``
is a tuple of op tuples applied in order to one running tensor, with a stack of saved tensors
for residual adds and concatenations. ``FuzzNet`` interprets the spec in ``forward``: the loop is
over a Python constant, so ``torch.fx.symbolic_trace`` unrolls it into a flat graph.
"""
from __future__ import annotations

import math
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

# few-bit activation kind -> (module class, functional); every activation memopt supports
ACT_SPELLINGS = {
    "relu": (nn.ReLU, F.relu), "relu6": (nn.ReLU6, F.relu6), "hardtanh": (nn.Hardtanh, F.hardtanh),
    "leaky_relu": (lambda: nn.LeakyReLU(0.2), lambda x: F.leaky_relu(x, 0.2)),
    "hardsigmoid": (nn.Hardsigmoid, F.hardsigmoid), "threshold": (lambda: nn.Threshold(0.1, -1.0),
                                                                  lambda x: F.threshold(x, 0.1, -1.0)),
    "gelu": (nn.GELU, F.gelu), "silu": (nn.SiLU, F.silu), "sigmoid": (nn.Sigmoid, torch.sigmoid),
    "tanh": (nn.Tanh, torch.tanh), "elu": (nn.ELU, F.elu),
    "celu": (nn.CELU, F.celu), "selu": (nn.SELU, F.selu), "softplus": (nn.Softplus, F.softplus),
    "mish": (nn.Mish, F.mish), "hardswish": (nn.Hardswish, F.hardswish), "logsigmoid": (nn.LogSigmoid, F.logsigmoid),
    "softsign": (nn.Softsign, F.softsign), "tanhshrink": (nn.Tanhshrink, F.tanhshrink),
}
ACTS = tuple(ACT_SPELLINGS)  # table ops keep default hyper-parameters: their tables ship (no DP solve)
STASH_ACTS = ("relu", "relu6", "leaky_relu")  # what the stash chains end with


class FuzzNet(nn.Module):
    def __init__(self, spec) -> None:
        super().__init__()
        self.family, shape, self.ops = spec
        self.layers = nn.ModuleList()
        self.index: list[int] = []  # op -> its module's index in self.layers (-1: none)
        c = shape[1] if self.family == "image" else shape[2]
        stack: list[int] = []
        for op in self.ops:
            module = None
            kind = op[0]
            if kind == "conv":
                _, cout, k, stride, bias = op
                module, c = nn.Conv2d(c, cout, k, stride, k // 2, bias=bias), cout
            elif kind == "linear":
                _, dout, bias = op
                module, c = nn.Linear(c, dout, bias=bias), dout
            elif kind == "bn":
                module = nn.BatchNorm2d(c) if self.family == "image" else nn.BatchNorm1d(c)
            elif kind == "ln":
                module = nn.LayerNorm(c)
            elif kind == "act" and op[2] == "module":
                module = ACT_SPELLINGS[op[1]][0]()
            elif kind == "dropout":
                module = nn.Dropout(op[1])
            elif kind == "maxpool":
                module = nn.MaxPool2d(op[1], op[2], op[1] // 2 if op[1] == 3 else 0)
            elif kind == "save":
                stack.append(c)
            elif kind == "cat":
                c += stack.pop()
            elif kind == "add":
                stack.pop()
            if module is not None:
                self.layers.append(module)
            self.index.append(len(self.layers) - 1 if module is not None else -1)
        self.head = nn.Linear(c, 5)

    def forward(self, x):
        stack = []
        for op, i in zip(self.ops, self.index):
            kind = op[0]
            if kind in ("conv", "linear", "bn", "ln", "dropout", "maxpool") or (kind == "act" and op[2] == "module"):
                if kind == "bn" and self.family == "tokens":  # BatchNorm1d over (N*L, D)
                    x = self.layers[i](x.reshape(-1, x.shape[-1])).view(x.shape)
                else:
                    x = self.layers[i](x)
            elif kind == "act":
                x = ACT_SPELLINGS[op[1]][1](x)
            elif kind == "avgpool":
                x = F.avg_pool2d(x, 2)
            elif kind == "save":
                stack.append(x)
            elif kind == "add":
                x = x + stack.pop()
            elif kind == "cat":
                x = torch.cat([x, stack.pop()], dim=1 if self.family == "image" else -1)
            elif kind == "permute_ln":  # ConvNeXt style: LayerNorm over channels in NHWC
                x = F.layer_norm(x.permute(0, 2, 3, 1), (x.shape[1],)).permute(0, 3, 1, 2)
            elif kind == "heads":  # split heads, mix tokens per head (a matmul), merge heads
                n, length, d = x.shape
                h = x.reshape(n, length, op[1], d // op[1]).transpose(1, 2)
                att = torch.softmax(h @ h.transpose(-1, -2) / math.sqrt(d // op[1]), dim=-1)
                x = (att @ h).transpose(1, 2).reshape(n, length, d)
            elif kind == "matmul":  # a plain matmul with its own transpose
                x = torch.matmul(x, x.transpose(-1, -2)) @ x / x.shape[-1]
        if self.family == "image":
            x = torch.flatten(F.adaptive_avg_pool2d(x, 1), 1)
        else:
            x = x.mean(1)
        return self.head(x)


def describe(spec) -> str:
    family, shape, ops = spec
    return f"{family} {shape}: " + " ".join("/".join(map(str, op)) for op in ops)


def image_ops(draw_int, draw_choice, draw_bool, c: int, hw: int, length: int) -> tuple[Any, ...]:
    """Draw ``length`` image ops (valid for any channel count and spatial size >= 1)."""
    ops, stack = [], []  # stack: (c, hw) of saved tensors
    for _ in range(length):
        options = ["conv", "conv", "bn", "bn", "act", "act", "dropout", "save", "permute_ln", "block", "block"]
        if hw >= 2:
            options += ["maxpool", "avgpool"]
        if stack and stack[-1] == (c, hw):
            options += ["add", "add"]
        if stack and stack[-1][1] == hw:
            options += ["cat"]
        kind = draw_choice(options)
        if kind == "conv":
            k = draw_choice([1, 3])
            stride = 2 if hw >= 4 and draw_bool() and draw_bool() else 1
            cout = draw_choice([2, 3, 4, 6, 8])
            ops.append(("conv", cout, k, stride, draw_bool()))
            c, hw = cout, (hw + 2 * (k // 2) - k) // stride + 1
        elif kind == "bn":
            ops.append(("bn",))
        elif kind == "block":  # conv -> BN -> ReLU-like: the stash's chain
            cout = draw_choice([4, 8])
            ops += [("conv", cout, 3, 1, False), ("bn",), ("act", draw_choice(STASH_ACTS), draw_choice(["module", "functional"]))]
            c = cout
        elif kind == "act":
            ops.append(("act", draw_choice(ACTS + STASH_ACTS * 3), draw_choice(["module", "functional"])))
        elif kind == "dropout":
            ops.append(("dropout", draw_choice([0.0, 0.25])))
        elif kind == "maxpool":
            k = draw_choice([2, 3])
            ops.append(("maxpool", k, 2))
            hw = (hw + 2 * (k // 2 if k == 3 else 0) - k) // 2 + 1
        elif kind == "avgpool":
            ops.append(("avgpool",))
            hw //= 2
        elif kind == "save":
            ops.append(("save",))
            stack.append((c, hw))
        elif kind == "add":
            ops.append(("add",))
            stack.pop()
        elif kind == "cat":
            ops.append(("cat",))
            c += stack.pop()[0]
        elif kind == "permute_ln":
            ops.append(("permute_ln",))
    while stack and stack[-1] != (c, hw):  # saved tensors that never got used are dropped unused
        stack.pop()
    return tuple(ops)


def token_ops(draw_int, draw_choice, draw_bool, d: int, length: int) -> tuple[Any, ...]:
    ops, stack = [], []
    for _ in range(length):
        options = ["linear", "linear", "ln", "bn", "act", "act", "dropout", "save", "matmul"]
        if d % 2 == 0:
            options.append("heads")
        if stack and stack[-1] == d:
            options += ["add", "add"]
        if stack:
            options.append("cat")
        kind = draw_choice(options)
        if kind == "linear":
            dout = draw_choice([4, 6, 8, 12])
            ops.append(("linear", dout, draw_bool()))
            d = dout
        elif kind in ("ln", "bn", "matmul"):
            ops.append((kind,))
        elif kind == "act":
            ops.append(("act", draw_choice(ACTS), draw_choice(["module", "functional"])))
        elif kind == "dropout":
            ops.append(("dropout", draw_choice([0.0, 0.25])))
        elif kind == "heads":
            ops.append(("heads", 2))
        elif kind == "save":
            ops.append(("save",))
            stack.append(d)
        elif kind == "add":
            ops.append(("add",))
            stack.pop()
        elif kind == "cat":
            ops.append(("cat",))
            d += stack.pop()
    return tuple(ops)
