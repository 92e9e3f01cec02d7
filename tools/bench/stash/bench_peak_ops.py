"""python -m tools.bench.stash.bench_peak_ops [--model resnet50|llama|bert|vit] [--batch 8] [--size 224] [--bf16] [--out PATH]

What is alive at the peak of one training step, measured: stock against memopt's default plan (the fidelity gate
off), with the storages alive at each one's peak, largest first, and the op and memopt source line that made each.

One forward and backward of a torchvision model (loss: logsumexp of the outputs), or of a transformer of the peak
benchmark (``--model llama|bert|vit``: ``tools/bench/peak/child.py``'s models at their default shapes, ``--size``
the ViT's image side; the model's own loss, which memopt gets as ``loss_fn``), random weights, the optimizer's
step left out (it adds nothing to the peak of forward and backward), under
the storage tracker ``memopt.measure`` uses (``LiveStorageTracker``: every storage an op creates, weakly
referenced until it dies); parameters, buffers and the input are preexisting and not counted, their gradients
are (the floor line). With ``--bf16`` the planning, the forward and the loss run under CPU bf16 autocast and the
backward after it, as torch's autocast documentation has users write it (autocast's cached bf16 weight copies die
at its exit; what the backward needs of them, each op saved). Sources are the last two frames inside memopt
(file:line), empty for autograd's own allocations (gradient accumulation). Peaks in MiB.
"""
from __future__ import annotations

import argparse
import contextlib
import traceback

import torch
import torchvision
from tabulate import tabulate

import memopt
from memopt.cost_model.storage import LiveStorageTracker
from tools.bench.common import RESULTS, write_results
from tools.bench.peak import child


class _Who(LiveStorageTracker):
    """The tracker, remembering which op (and memopt line) made each storage, and the set alive at the peak."""

    def __init__(self, *a, **k):
        super().__init__(*a, **k)
        self.made, self.snapshot = {}, []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        before = set(self._live)
        out = super().__torch_dispatch__(func, types, args, kwargs)
        for key in set(self._live) - before:
            where = [f"{f.filename.split('/')[-1]}:{f.lineno}" for f in traceback.extract_stack()
                     if "/memopt/" in f.filename or "/passes/" in f.filename][-2:]
            self.made[key] = (str(func).replace("aten.", ""), self.phase, " < ".join(reversed(where)))
        return out

    def _take_peak(self) -> None:  # just after a sweep: _live holds exactly the storages alive at the new peak
        super()._take_peak()
        self.snapshot = [(record[2], self.made.get(key)) for key, (_, record) in self._live.items()]


def _peak(module, forward_loss, inputs, cast, params):
    tracker = _Who(preexisting=params + inputs)
    with tracker:
        tracker.phase = "forward"
        with cast():
            loss = forward_loss(module)
        tracker.phase = "backward"
        loss.backward()
    for p in params:
        p.grad = None
    return tracker.peak, sorted(tracker.snapshot, key=lambda e: -e[0])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[1])
    parser.add_argument("--model", default="resnet50")
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--size", type=int, default=224)
    parser.add_argument("--bf16", action="store_true")
    parser.add_argument("--top", type=int, default=10)
    parser.add_argument("--out", default="")
    a = parser.parse_args()
    torch.manual_seed(0)
    cast = (lambda: torch.autocast("cpu", torch.bfloat16)) if a.bf16 else contextlib.nullcontext
    if a.model in ("llama", "bert", "vit"):
        case = child.build(a.model, a.batch, child.shape_args(res=a.size))
        model, example, loss_fn, forward_loss = case.model, case.inputs, case.loss_of_output, case.forward_loss
        inputs = list(example.values()) if isinstance(example, dict) else [example]
        optimizer = "adamw"
    else:
        model = getattr(torchvision.models, a.model)()
        example = torch.randn(a.batch, 3, a.size, a.size)
        inputs, optimizer, loss_fn = [example], "sgd", None
        forward_loss = lambda net: net(example).float().logsumexp(1).mean()  # noqa: E731
    with cast():
        om = memopt.optimize(model, example_inputs=example, optimizer=optimizer, loss_fn=loss_fn,
                             config=memopt.Config(fidelity=None))
    params = list(model.parameters()) + list(model.buffers())
    grads = sum(p.numel() * p.element_size() for p in model.parameters() if p.requires_grad)
    body = [f"Floor: the parameters' gradients, {grads / 2 ** 20:.1f} MiB, alive at the end of every backward."]
    for name, module in (("stock", model), ("memopt", om)):
        peak, alive = _peak(module, forward_loss, inputs, cast, params)
        rows = [[f"{nbytes / 2 ** 20:.2f}", *(who or ("?", "", ""))] for nbytes, who in alive[:a.top]]
        body.append(f"## {name}: peak {peak / 2 ** 20:.1f} MiB\n\n" + tabulate(
            rows, headers=["MiB", "made by", "phase", "memopt source"], tablefmt="github"))
    command = (f"python -m tools.bench.stash.bench_peak_ops --model {a.model} --batch {a.batch} --size {a.size}"
               + (" --bf16" if a.bf16 else ""))
    out = a.out or str(RESULTS / "stash" / f"peak_ops_{a.model}_{'bf16' if a.bf16 else 'fp32'}.md")
    shape = f"{a.size}x{a.size}" if a.model not in ("llama", "bert") else "default sequence"
    write_results(out, f"What is alive at the peak: {a.model}, batch {a.batch}, {shape}"
                  + (", bf16 autocast" if a.bf16 else ""), command, __doc__, "\n\n".join(body))


if __name__ == "__main__":
    main()
