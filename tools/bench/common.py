"""What the benchmarks under tools/bench/ share: where results go, how a results file is written, and the
pieces more than one technique's benchmarks use (the parity training loop, the offline data sets, the
GELU MLP, torch.utils.checkpoint around a model's blocks).

Every benchmark runs from the repository root as ``python -m tools.bench.<technique>.<script>`` and writes
its results under ``docs/results/<technique>/``; each results file starts with the command that made it.
"""
from __future__ import annotations

from pathlib import Path
from typing import List, Union

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.checkpoint import checkpoint

ROOT = Path(__file__).resolve().parents[2]
RESULTS = ROOT / "docs" / "results"


# ---------------------------------------------------------------- results files
def write_results_file(out: Union[str, Path], text: str) -> None:
    """What every benchmark does last: write its markdown results file and print it."""
    Path(out).parent.mkdir(parents=True, exist_ok=True)
    Path(out).write_text(text)
    print(text)


def write_results(out: Union[str, Path], title: str, command: str, doc: str, body: str) -> None:
    """Write ``# title``, the command (and torch version), the script's docstring without its first two
    paragraphs (its command and its summary), then ``body``, to ``out``; print it."""
    description = doc.split("\n\n", 2)[2].strip()
    threads = ", 1 thread" if torch.get_num_threads() == 1 else ""
    text = (f"# {title}\n\nCommand: `{command}` (torch {torch.__version__}, CPU{threads}).\n\n"
            f"{description}\n\n{body.strip()}\n")
    write_results_file(out, text)


# ---------------------------------------------------------------- training parity
def fit_and_test(net: nn.Module, model: nn.Module, data, seed: int, epochs: int, batch: int,
                 drop_last: bool = False) -> float:
    """The training loop shared by the parity benchmarks (same data order per seed). Train ``net`` (the
    module to call: stock, memopt or a naive variant) whose parameters are ``model``'s with Adam (lr 1e-3)
    on ``data`` = (x, y, x_test, y_test); return test accuracy in %."""
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


def digits():
    """scikit-learn's digits (8x8, 1 channel, values in [0, 1]) with a fixed 1437 / 360 split:
    (x, y, x_test, y_test)."""
    from sklearn.datasets import load_digits

    d = load_digits()
    x = torch.tensor(d.images, dtype=torch.float32).unsqueeze(1) / 16.0
    y = torch.tensor(d.target)
    g = torch.Generator().manual_seed(0)
    order = torch.randperm(len(x), generator=g)
    train, test = order[:1437], order[1437:]
    return x[train], y[train], x[test], y[test]


def mnist1d():
    """MNIST-1D, generated procedurally by the mnist1d package (no download), 4000 / 1000:
    (x, y, x_test, y_test)."""
    from mnist1d.data import get_dataset_args, make_dataset

    d = make_dataset(get_dataset_args())
    return (torch.tensor(d["x"], dtype=torch.float32), torch.tensor(d["y"]),
            torch.tensor(d["x_test"], dtype=torch.float32), torch.tensor(d["y_test"]))


class GeluMLP(nn.Module):
    """The MNIST-1D MLP 40-256-256-10 with GELU (few-bit and Shampoo training benchmarks)."""

    def __init__(self):
        super().__init__()
        self.net = nn.Sequential(nn.Linear(40, 256), nn.GELU(), nn.Linear(256, 256), nn.GELU(), nn.Linear(256, 10))

    def forward(self, x):
        return self.net(x)


# ---------------------------------------------------------------- the checkpointing reference point
class CheckpointBlocks(nn.Module):
    """``model`` whose listed blocks run under ``torch.utils.checkpoint`` (non-reentrant) when called
    through this wrapper; calling ``model`` directly still runs it plain (the stock side of a ratio)."""

    def __init__(self, model: nn.Module, blocks: List[nn.Module]) -> None:
        super().__init__()
        self.model = model
        self._originals = []
        self.active = False
        for block in blocks:
            forward = block.forward
            self._originals.append((block, forward))
            block.forward = self._checkpointed(forward)

    def _checkpointed(self, forward):
        def run(*args, **kwargs):  # Hugging Face layers take keyword arguments (attention masks, positions)
            if self.active:
                return checkpoint(forward, *args, use_reentrant=False, **kwargs)
            return forward(*args, **kwargs)
        return run

    def forward(self, *args, **kwargs):
        self.active = True
        try:
            return self.model(*args, **kwargs)
        finally:
            self.active = False

    def restore(self) -> None:
        for block, forward in self._originals:
            block.forward = forward
