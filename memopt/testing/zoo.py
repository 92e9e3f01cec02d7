"""Small, fast models covering the op surface memopt must handle, with example inputs.

Every builder returns ``(model, example_inputs)`` in train mode with weights drawn from a fixed
seed. torchvision models are built from configs with random weights (nothing is downloaded).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, Dict, Tuple

import torch
import torch.nn.functional as F
from torch import nn

Built = Tuple[nn.Module, Any]


class MLP(nn.Module):
    def __init__(self, d: int = 32) -> None:
        super().__init__()
        self.fc1, self.fc2, self.fc3, self.fc4 = (nn.Linear(d, 64), nn.Linear(64, 64), nn.Linear(64, 64),
                                                  nn.Linear(64, 10))
        self.act1, self.act2 = nn.GELU(), nn.SiLU()

    def forward(self, x):
        return self.fc4(torch.tanh(self.fc3(self.act2(self.fc2(self.act1(self.fc1(x)))))))


class ConvBNReLU(nn.Sequential):
    def __init__(self, cin: int, cout: int, inplace: bool = False) -> None:
        super().__init__(nn.Conv2d(cin, cout, 3, padding=1, bias=False), nn.BatchNorm2d(cout), nn.ReLU(inplace))


class SmallCNN(nn.Module):
    def __init__(self, inplace: bool = False) -> None:
        super().__init__()
        self.features = nn.Sequential(ConvBNReLU(3, 16, inplace), nn.MaxPool2d(2), ConvBNReLU(16, 32, inplace),
                                      nn.MaxPool2d(2))
        self.head = nn.Linear(32 * 8 * 8, 10)

    def forward(self, x):
        return self.head(torch.flatten(self.features(x), 1))


class BasicBlock(nn.Module):
    def __init__(self, cin: int, cout: int, stride: int = 1) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(cin, cout, 3, stride, 1, bias=False)
        self.bn1 = nn.BatchNorm2d(cout)
        self.relu = nn.ReLU(inplace=True)
        self.conv2 = nn.Conv2d(cout, cout, 3, 1, 1, bias=False)
        self.bn2 = nn.BatchNorm2d(cout)
        self.down = None
        if stride != 1 or cin != cout:
            self.down = nn.Sequential(nn.Conv2d(cin, cout, 1, stride, bias=False), nn.BatchNorm2d(cout))

    def forward(self, x):
        identity = x if self.down is None else self.down(x)
        out = self.relu(self.bn1(self.conv1(x)))
        return self.relu(self.bn2(self.conv2(out)) + identity)


def _three_stages(block, width: int, per_stage: int) -> Tuple[nn.Sequential, int]:
    """CIFAR-style stages of widths w, 2w, 4w; the first block of stages 2 and 3 strides by 2."""
    layers, cin = [], width
    for stage, cout in enumerate((width, 2 * width, 4 * width)):
        for i in range(per_stage):
            layers.append(block(cin, cout, 2 if (stage and i == 0) else 1))
            cin = cout
    return nn.Sequential(*layers), cin


class TinyResNet(nn.Module):
    """A CIFAR-style ResNet (3 stages of basic blocks) that needs no torchvision: the demo model."""

    def __init__(self, width: int = 16, blocks: int = 2, classes: int = 10) -> None:
        super().__init__()
        self.stem = ConvBNReLU(3, width, inplace=True)
        self.layers, cin = _three_stages(BasicBlock, width, blocks)
        self.pool = nn.AdaptiveAvgPool2d(1)
        self.fc = nn.Linear(cin, classes)

    def forward(self, x):
        return self.fc(torch.flatten(self.pool(self.layers(self.stem(x))), 1))


class PreActBlock(nn.Module):
    """Pre-activation basic block (He et al. 2016): BN -> ReLU -> conv, twice, plus the shortcut."""

    def __init__(self, cin: int, cout: int, stride: int = 1) -> None:
        super().__init__()
        self.bn1, self.relu1 = nn.BatchNorm2d(cin), nn.ReLU(inplace=True)
        self.conv1 = nn.Conv2d(cin, cout, 3, stride, 1, bias=False)
        self.bn2, self.relu2 = nn.BatchNorm2d(cout), nn.ReLU(inplace=True)
        self.conv2 = nn.Conv2d(cout, cout, 3, 1, 1, bias=False)
        self.shortcut = nn.Conv2d(cin, cout, 1, stride, bias=False) if stride != 1 or cin != cout else None

    def forward(self, x):
        h = self.relu1(self.bn1(x))
        identity = x if self.shortcut is None else self.shortcut(h)
        return self.conv2(self.relu2(self.bn2(self.conv1(h)))) + identity


class PreActResNet(nn.Module):
    """CIFAR pre-activation ResNet of depth 6n+2 (20, 56, 164 with n = 3, 9, 27), basic blocks."""

    def __init__(self, depth: int = 20, width: int = 16, classes: int = 10) -> None:
        super().__init__()
        if (depth - 2) % 6:
            raise ValueError(f"depth must be 6n+2, got {depth}")
        n = (depth - 2) // 6
        self.stem = nn.Conv2d(3, width, 3, 1, 1, bias=False)
        self.blocks, cin = _three_stages(PreActBlock, width, n)
        self.bn, self.relu = nn.BatchNorm2d(cin), nn.ReLU(inplace=True)
        self.pool, self.fc = nn.AdaptiveAvgPool2d(1), nn.Linear(cin, classes)

    def forward(self, x):
        return self.fc(torch.flatten(self.pool(self.relu(self.bn(self.blocks(self.stem(x))))), 1))


class Attention(nn.Module):
    def __init__(self, d: int, heads: int, p: float) -> None:
        super().__init__()
        self.heads, self.p = heads, p
        self.qkv, self.proj = nn.Linear(d, 3 * d), nn.Linear(d, d)

    def forward(self, x):
        b, n, d = x.shape
        q, k, v = self.qkv(x).view(b, n, 3, self.heads, d // self.heads).permute(2, 0, 3, 1, 4).unbind(0)
        y = F.scaled_dot_product_attention(q, k, v, dropout_p=self.p if self.training else 0.0)
        return self.proj(y.transpose(1, 2).reshape(b, n, d))


class EncoderBlock(nn.Module):
    def __init__(self, d: int, heads: int, p: float = 0.1) -> None:
        super().__init__()
        self.ln1, self.attn = nn.LayerNorm(d), Attention(d, heads, p)
        self.ln2, self.fc1, self.act, self.fc2 = nn.LayerNorm(d), nn.Linear(d, 4 * d), nn.GELU(), nn.Linear(4 * d, d)
        self.drop = nn.Dropout(p)

    def forward(self, x):
        x = x + self.drop(self.attn(self.ln1(x)))
        return x + self.drop(self.fc2(self.act(self.fc1(self.ln2(x)))))


class TinyViT(nn.Module):
    def __init__(self, d: int = 64, depth: int = 2, heads: int = 4, patch: int = 4, image: int = 16) -> None:
        super().__init__()
        self.embed = nn.Conv2d(3, d, patch, patch)
        self.pos = nn.Parameter(torch.randn(1, (image // patch) ** 2, d) * 0.02)
        self.blocks = nn.Sequential(*[EncoderBlock(d, heads) for _ in range(depth)])
        self.norm, self.head = nn.LayerNorm(d), nn.Linear(d, 10)

    def forward(self, x):
        x = self.embed(x).flatten(2).transpose(1, 2) + self.pos
        return self.head(self.norm(self.blocks(x)).mean(1))


class SharedModule(nn.Module):
    """One Linear called twice: its weight is one parameter, its two inputs two saved storages."""

    def __init__(self) -> None:
        super().__init__()
        self.fc, self.act, self.out = nn.Linear(32, 32), nn.SiLU(), nn.Linear(32, 4)

    def forward(self, x):
        return self.out(self.act(self.fc(self.act(self.fc(x)))))


class MultiIO(nn.Module):
    """Two inputs (one by keyword, with a default), a dict output."""

    def __init__(self) -> None:
        super().__init__()
        self.a, self.b, self.c = nn.Linear(16, 32), nn.Linear(8, 32), nn.Linear(32, 4)

    def forward(self, x, y, scale: float = 1.0):
        h = F.gelu(self.a(x)) * torch.sigmoid(self.b(y)) * scale
        return {"logits": self.c(h), "features": h}


class ShapeBranch(nn.Module):
    """Python control flow on the input's shape: symbolic_trace fails, torch.export handles it."""

    def __init__(self) -> None:
        super().__init__()
        self.small, self.large = nn.Linear(16, 16), nn.Linear(16, 16)
        self.out = nn.Linear(16, 4)

    def forward(self, x):
        h = self.small(x) if x.shape[0] < 8 else self.large(x)
        for _ in range(x.shape[1] // 8):  # loop count read from the shape
            h = F.gelu(h)
        return self.out(h)


def _seeded(fn: Callable[[], Built]) -> Callable[[], Built]:
    def build() -> Built:
        torch.manual_seed(0)
        model, inputs = fn()
        return model.train(), inputs
    build.__name__ = fn.__name__
    return build


@dataclass(frozen=True)
class ZooEntry:
    name: str
    build: Callable[[], Built]
    needs_torchvision: bool = False
    capture: str = "symbolic_trace"


def _tv(name: str, batch: int = 2, size: int = 64) -> Callable[[], Built]:
    def fn() -> Built:
        import torchvision

        return getattr(torchvision.models, name)(weights=None), torch.randn(batch, 3, size, size)
    return fn


ZOO: Dict[str, ZooEntry] = {e.name: e for e in [
    ZooEntry("mlp", _seeded(lambda: (MLP(), torch.randn(8, 32)))),
    ZooEntry("cnn", _seeded(lambda: (SmallCNN(), torch.randn(4, 3, 32, 32)))),
    ZooEntry("cnn_inplace", _seeded(lambda: (SmallCNN(inplace=True), torch.randn(4, 3, 32, 32)))),
    ZooEntry("tiny_resnet", _seeded(lambda: (TinyResNet(), torch.randn(4, 3, 32, 32)))),
    ZooEntry("preact_resnet20", _seeded(lambda: (PreActResNet(20), torch.randn(4, 3, 32, 32)))),
    ZooEntry("vit", _seeded(lambda: (TinyViT(), torch.randn(4, 3, 16, 16)))),
    ZooEntry("shared", _seeded(lambda: (SharedModule(), torch.randn(8, 32)))),
    ZooEntry("multi_io", _seeded(lambda: (MultiIO(), {"x": torch.randn(4, 16), "y": torch.randn(4, 8)}))),
    ZooEntry("shape_branch", _seeded(lambda: (ShapeBranch(), torch.randn(4, 16))), capture="export"),
    ZooEntry("resnet18", _seeded(_tv("resnet18")), needs_torchvision=True),
    ZooEntry("resnet50", _seeded(_tv("resnet50")), needs_torchvision=True),
    ZooEntry("mobilenet_v2", _seeded(_tv("mobilenet_v2")), needs_torchvision=True),
    ZooEntry("vgg11_bn", _seeded(_tv("vgg11_bn", size=32)), needs_torchvision=True),
    ZooEntry("densenet121", _seeded(_tv("densenet121", size=32)), needs_torchvision=True),
]}


def build(name: str) -> Built:
    """Build the zoo model ``name``: ``(model, example_inputs)``."""
    if name not in ZOO:
        raise KeyError(f"unknown zoo model {name!r}; known: {sorted(ZOO)}")
    return ZOO[name].build()


class EarlyExitResNet(nn.Module):
    """A residual net that stops early when its activations blow up: the branch reads a tensor value,
    so neither symbolic_trace nor torch.export can capture the forward; each block can be captured."""

    def __init__(self, width: int = 16, depth: int = 3, classes: int = 10, limit: float = 1e4) -> None:
        super().__init__()
        self.stem = ConvBNReLU(3, width)
        self.blocks = nn.ModuleList([BasicBlock(width, width) for _ in range(depth)])
        self.fc = nn.Linear(width, classes)
        self.limit = limit

    def forward(self, x):
        h = self.stem(x)
        for block in self.blocks:
            h = block(h)
            if h.detach().abs().amax() > self.limit:  # data-dependent control flow: not capturable
                break
        return self.fc(F.gelu(h).mean((2, 3)))


ZOO["early_exit"] = ZooEntry("early_exit", _seeded(lambda: (EarlyExitResNet(), torch.randn(4, 3, 16, 16))),
                             capture="per-submodule")
