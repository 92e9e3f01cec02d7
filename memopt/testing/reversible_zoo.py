"""Models for the reversible pass: a RevNet-style CNN, a reversible transformer, and the cases the
pass must reject. Written the way users write them (plain modules, ``chunk``/``cat``, no memopt
wrappers); every builder returns ``(model, example_input)`` in train mode from a fixed seed."""
from __future__ import annotations

from typing import Tuple

import torch
import torch.nn.functional as F
from torch import nn


def _conv_bn_relu_conv(channels: int) -> nn.Sequential:
    return nn.Sequential(nn.Conv2d(channels, channels, 3, padding=1, bias=False), nn.BatchNorm2d(channels),
                         nn.ReLU(), nn.Conv2d(channels, channels, 3, padding=1, bias=False))


class RevBlock(nn.Module):
    """Additive coupling: y1 = x1 + F(x2), y2 = x2 + G(y1) on the two channel halves."""

    def __init__(self, channels: int) -> None:
        super().__init__()
        self.f, self.g = _conv_bn_relu_conv(channels // 2), _conv_bn_relu_conv(channels // 2)

    def forward(self, x):
        x1, x2 = torch.chunk(x, 2, dim=1)
        y1 = x1 + self.f(x2)
        y2 = x2 + self.g(y1)
        return torch.cat([y1, y2], dim=1)


class RevNetCNN(nn.Module):
    """Stem (conv-BN-ReLU, not reversible), stages of coupling blocks joined by pixel unshuffle
    (invertible downsampling: channels x4, spatial /2), average pooling and a linear head.
    ``spine_norm``: BatchNorm + LeakyReLU(0.2) on the spine after every block (Hascoet et al.)."""

    def __init__(self, blocks_per_stage: Tuple[int, ...] = (2, 2), width: int = 16, in_channels: int = 3,
                 classes: int = 10, spine_norm: bool = False) -> None:
        super().__init__()
        self.stem = nn.Sequential(nn.Conv2d(in_channels, width, 3, padding=1, bias=False), nn.BatchNorm2d(width),
                                  nn.ReLU())
        stages, channels = [], width
        for i, count in enumerate(blocks_per_stage):
            if i:
                stages.append(nn.PixelUnshuffle(2))
                channels *= 4
            for _ in range(count):
                stages.append(RevBlock(channels))
                if spine_norm:  # layer-wise invertible ops on the spine (aggressive mode inverts them)
                    stages.extend([nn.BatchNorm2d(channels), nn.LeakyReLU(0.2)])
        self.body = nn.Sequential(*stages)
        self.head = nn.Linear(channels, classes)

    def forward(self, x):
        # the spine stays float32 under autocast (F and G may run in bfloat16; u + h promotes)
        x = self.body(self.stem(x).float())
        return self.head(torch.flatten(F.adaptive_avg_pool2d(x, 1), 1))


class _Attention(nn.Module):
    def __init__(self, dim: int, heads: int) -> None:
        super().__init__()
        self.heads = heads
        self.norm, self.qkv, self.proj = nn.LayerNorm(dim), nn.Linear(dim, 3 * dim), nn.Linear(dim, dim)

    def forward(self, x):
        b, n, d = x.shape
        q, k, v = self.qkv(self.norm(x)).reshape(b, n, 3, self.heads, d // self.heads).permute(2, 0, 3, 1, 4)
        out = F.scaled_dot_product_attention(q, k, v)
        return self.proj(out.transpose(1, 2).reshape(b, n, d))


class _MLP(nn.Module):
    def __init__(self, dim: int, dropout: float) -> None:
        super().__init__()
        self.norm, self.fc1, self.fc2 = nn.LayerNorm(dim), nn.Linear(dim, 2 * dim), nn.Linear(2 * dim, dim)
        self.drop = nn.Dropout(dropout)

    def forward(self, x):
        return self.drop(self.fc2(F.gelu(self.fc1(self.norm(x)))))


class RevTransformerBlock(nn.Module):
    """Two streams: y1 = x1 + Attention(x2), y2 = x2 + MLP(y1) (RevViT / Reformer style)."""

    def __init__(self, dim: int, heads: int, dropout: float) -> None:
        super().__init__()
        self.attn, self.mlp = _Attention(dim, heads), _MLP(dim, dropout)

    def forward(self, x1, x2):
        y1 = x1 + self.attn(x2)
        y2 = x2 + self.mlp(y1)
        return y1, y2


class RevTransformer(nn.Module):
    """Patch embedding to 2*dim, split into two streams, reversible blocks, cat, norm, mean, head."""

    def __init__(self, depth: int = 2, dim: int = 32, heads: int = 4, patch: int = 4, image: int = 16,
                 dropout: float = 0.0, classes: int = 10) -> None:
        super().__init__()
        self.embed = nn.Conv2d(3, 2 * dim, patch, stride=patch)
        self.pos = nn.Parameter(torch.zeros(1, (image // patch) ** 2, 2 * dim).normal_(std=0.02))
        self.blocks = nn.ModuleList(RevTransformerBlock(dim, heads, dropout) for _ in range(depth))
        self.norm, self.head = nn.LayerNorm(2 * dim), nn.Linear(2 * dim, classes)

    def forward(self, x):
        x = self.embed(x).flatten(2).transpose(1, 2) + self.pos
        x1, x2 = x.chunk(2, dim=-1)
        for block in self.blocks:
            x1, x2 = block(x1, x2)
        return self.head(self.norm(torch.cat([x1, x2], dim=-1)).mean(1))


# ---------------------------------------------------------------- cases the pass must reject
class _RejectBase(nn.Module):
    def __init__(self, channels: int = 8) -> None:
        super().__init__()
        self.stem = nn.Conv2d(3, channels, 3, padding=1)
        self.f, self.g = _conv_bn_relu_conv(channels // 2), _conv_bn_relu_conv(channels // 2)
        self.head = nn.Linear(channels, 10)

    def finish(self, y):
        return self.head(torch.flatten(F.adaptive_avg_pool2d(y, 1), 1))


class UpdateReadsItsStream(_RejectBase):
    """y1 = x1 + F(x2 + x1): H reads u."""

    def forward(self, x):
        x1, x2 = torch.chunk(self.stem(x), 2, dim=1)
        y1 = x1 + self.f(x2 + x1)
        y2 = x2 + self.g(y1)
        return self.finish(torch.cat([y1, y2], dim=1))


class InteriorUsedOutside(_RejectBase):
    """An intermediate of F is also used by the head."""

    def forward(self, x):
        x1, x2 = torch.chunk(self.stem(x), 2, dim=1)
        t = self.f[0](x2)
        y1 = x1 + self.f[3](self.f[2](self.f[1](t)))
        y2 = x2 + self.g(y1)
        return self.finish(torch.cat([y1, y2], dim=1)) + t.mean()


class SpineSavedOutside(_RejectBase):
    """A spine value the couplings replace (x1) is also read by a ReLU outside, which keeps its output."""

    def forward(self, x):
        x1, x2 = torch.chunk(self.stem(x), 2, dim=1)
        y1 = x1 + self.f(x2)
        y2 = x2 + self.g(y1)
        return self.finish(torch.cat([y1, y2], dim=1)) + torch.relu(x1).sum()


class InplaceInUpdate(_RejectBase):
    """F contains an in-place ReLU."""

    def __init__(self) -> None:
        super().__init__()
        self.f[2] = nn.ReLU(inplace=True)

    def forward(self, x):
        x1, x2 = torch.chunk(self.stem(x), 2, dim=1)
        y1 = x1 + self.f(x2)
        y2 = x2 + self.g(y1)
        return self.finish(torch.cat([y1, y2], dim=1))


class DropoutOnSpine(_RejectBase):
    """Dropout applied to the stream itself, not inside H."""

    def forward(self, x):
        x1, x2 = torch.chunk(self.stem(x), 2, dim=1)
        y1 = F.dropout(x1 + self.f(x2), 0.2, self.training)
        y2 = x2 + self.g(y1)
        return self.finish(torch.cat([y1, y2], dim=1))


MUST_REJECT = {"update_reads_its_stream": UpdateReadsItsStream, "interior_used_outside": InteriorUsedOutside,
               "spine_saved_outside": SpineSavedOutside, "inplace_in_update": InplaceInUpdate,
               "dropout_on_spine": DropoutOnSpine}


def revnet(blocks_per_stage: Tuple[int, ...] = (2, 2), width: int = 16, batch: int = 4, size: int = 16,
           seed: int = 0, spine_norm: bool = False):
    torch.manual_seed(seed)
    return RevNetCNN(blocks_per_stage, width, spine_norm=spine_norm).train(), torch.randn(batch, 3, size, size)


def rev_transformer(depth: int = 2, dim: int = 32, batch: int = 4, dropout: float = 0.0, seed: int = 0):
    torch.manual_seed(seed)
    return RevTransformer(depth, dim, dropout=dropout).train(), torch.randn(batch, 3, 16, 16)


def must_reject(name: str, seed: int = 0):
    torch.manual_seed(seed)
    return MUST_REJECT[name]().train(), torch.randn(2, 3, 8, 8)
