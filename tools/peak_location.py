"""python -m tools.peak_location --model resnet50 --batch 32 --bits 4

Where one training step of a memopt-optimized torchvision model peaks: the line of memopt's code (or of the
rewritten graph) that was running when the live bytes were highest, the phase, and the largest storages alive.

A real run on CPU under the same storage tracker ``memopt.measure`` uses (``memopt.cost_model.storage.LiveStorageTracker``),
counting from the model's parameters, buffers and input. Prints; writes no file.
"""
from __future__ import annotations

import argparse
import traceback
from collections import Counter

import torch

import memopt
from memopt.cost_model.storage import LiveStorageTracker


class _Locating(LiveStorageTracker):
    """Also remembers the memopt / graph frames on the stack each time the peak rises."""

    where: list = []
    phase_at: str = ""

    def _note_peak(self) -> None:
        before = self.peak
        super()._note_peak()
        if self.peak > before:
            frames = [f for f in traceback.extract_stack()
                      if "/memopt/" in f.filename or "<eval_with_key>" in f.filename]
            self.where = [(f.filename.rsplit("/", 1)[-1], f.name, f.lineno, f.line) for f in frames[-3:]]
            self.phase_at = self.phase


def main() -> None:
    import torchvision

    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="resnet50")
    parser.add_argument("--size", type=int, default=224)
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--bits", type=int, default=4)
    args = parser.parse_args()
    torch.manual_seed(0)
    model = getattr(torchvision.models, args.model)().train()
    x = torch.randn(args.batch, 3, args.size, args.size)
    om = memopt.optimize(model, example_inputs=x, config=memopt.Config(stash=memopt.StashConfig(bits=args.bits)))
    om(x).sum().backward()  # warm-up: the measured step is a steady-state one
    model.zero_grad(set_to_none=True)
    tracker = _Locating(list(model.parameters()) + list(model.buffers()) + [x])
    with tracker:
        tracker.phase = "forward"
        loss = om(x).sum()
        tracker.phase = "backward"
        loss.backward()
    print(f"peak {tracker.peak / 2 ** 20:.1f} MiB above parameters, buffers and input, in {tracker.phase_at}, at:")
    for file, name, line, text in tracker.where:
        print(f"  {file}:{line} {name}: {text}")
    phases = Counter()
    for _, nbytes, phase in tracker.at_peak:
        phases[phase] += nbytes
    print("alive at the peak, by the phase that made it (MiB):", {k: round(v / 2 ** 20, 1) for k, v in phases.items()})
    print("largest storages alive (MiB):", [round(n / 2 ** 20, 1) for _, n, _ in sorted(tracker.at_peak,
                                                                                       key=lambda t: -t[1])[:8]])


if __name__ == "__main__":
    main()
