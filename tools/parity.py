"""The training loop shared by the parity benchmarks: same data order per seed, test accuracy."""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn


def fit_and_test(net: nn.Module, model: nn.Module, data, seed: int, epochs: int, batch: int,
                 drop_last: bool = False) -> float:
    """Train ``net`` (the module to call: stock, memopt or a naive variant) whose parameters are
    ``model``'s with Adam (lr 1e-3) on ``data`` = (x, y, x_test, y_test); return test accuracy in %."""
    x, y, xt, yt = data
    opt = torch.optim.Adam(model.parameters(), lr=1e-3)
    gen = torch.Generator().manual_seed(seed)
    stop = len(x) - batch + 1 if drop_last else len(x)
    for _ in range(epochs):
        order = torch.randperm(len(x), generator=gen)
        for i in range(0, stop, batch):
            idx = order[i:i + batch]
            loss = F.cross_entropy(net(x[idx]), y[idx])
            opt.zero_grad()
            loss.backward()
            opt.step()
    model.eval()
    with torch.no_grad():
        return (model(xt).argmax(1) == yt).float().mean().item() * 100
