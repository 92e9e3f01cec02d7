"""python -m tools.bench.compile.bench_compile   (about 2.5 minutes on 1 CPU thread)

Benchmark: does ``torch.compile`` keep memopt's savings (issue 24)?

Why: AOT autograd re-partitions what dynamo traces and decides itself what to save, so a compiled
memopt module could keep as much as stock; memopt's graph choice and runtime ops are opaque to dynamo
for that reason (``memopt/core/leaf.py``, ``memopt/builder/optimized.py``). Per model, one training step's
saved activations (every tensor autograd packs, distinct storages, parameters and buffers left out,
and copies of parameters, which inductor makes for its channels-last convolutions, counted apart) of
stock eager, memopt eager, ``torch.compile(om)`` with the aot_eager and inductor backends,
the inductor backend with its layout optimization off,
``torch.compile(model)`` (stock compiled, inductor) and ``memopt.optimize(torch.compile(model))`` (unwrapped,
with a warning). Every variant starts from the same weights and makes one warm-up step (which
compiles) before the measured one, so BatchNorm statistics match. 'same as eager' compares the
measured step's output and parameter gradients with the eager module of the same kind (memopt eager
for memopt rows, stock eager for stock rows): 'bit-identical' or the largest absolute difference.
'first call' is the warm-up forward and backward, compile included.
Writes docs/results/compile/compile_savings.md.
"""
from __future__ import annotations

import argparse
import copy
import logging
import time

import torch
import torch._dynamo
from tabulate import tabulate
from torch import nn
from torch._functorch import config as functorch_config
from torch._inductor import config as inductor_config

import memopt
from memopt.core.units import fmt_bytes
from memopt.cost_model.storage import storage_key
from tools.bench.common import RESULTS

COMMAND = "python -m tools.bench.compile.bench_compile"
OUT = RESULTS / "compile" / "compile_savings.md"
NO_LAYOUT = "torch.compile(om), inductor, layout_optimization=False"


def cnn() -> nn.Module:
    """Three conv-BN-ReLU layers (widths 32, 64, 64), global pool, linear: the CNN of issue 24."""
    layers, c = [], 3
    for width in (32, 64, 64):
        layers += [nn.Conv2d(c, width, 3, padding=1, bias=False), nn.BatchNorm2d(width), nn.ReLU()]
        c = width
    return nn.Sequential(*layers, nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(c, 10))


def resnet18() -> nn.Module:
    import torchvision  # an optional dependency of the benchmarks, not of memopt

    return torchvision.models.resnet18(weights=None)


MODELS = {"cnn": ("3-layer conv-BN-ReLU CNN", cnn, (16, 3, 32, 32)),
          "resnet18": ("torchvision resnet18", resnet18, (8, 3, 64, 64))}


def variants(model: nn.Module, x: torch.Tensor):
    """(row name, kind, module to train, the module whose parameters it trains) for each variant."""
    yield "stock eager", "stock", model, model
    yield "torch.compile(model), inductor", "stock", torch.compile(model), model
    om = memopt.optimize(model, example_inputs=x)
    yield "memopt eager", "memopt", om, model
    yield "torch.compile(om), aot_eager", "memopt", torch.compile(om, backend="aot_eager"), model
    yield "torch.compile(om), inductor", "memopt", torch.compile(om), model
    yield NO_LAYOUT, "memopt", torch.compile(om), model
    unwrapped = memopt.optimize(torch.compile(model), example_inputs=x)
    yield "memopt.optimize(torch.compile(model))", "memopt", unwrapped, model


def step(module: nn.Module, params: nn.Module, x: torch.Tensor):
    """One training step: (saved activation bytes, bytes of saved parameter copies, output, gradients).

    Inductor converts conv weights to channels-last copies and saves those for backward: tensors of 2 or
    more dimensions with a parameter's shape and values are counted apart, as parameter copies, not
    activations (1-d ones are left as activations: a BatchNorm statistic can equal a freshly set weight)."""
    for p in params.parameters():
        p.grad = None
    state = {storage_key(t) for t in list(params.parameters()) + list(params.buffers())}
    packed = {}

    def pack(t: torch.Tensor) -> torch.Tensor:
        if storage_key(t) not in state:
            packed[storage_key(t)] = t
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        out = module(x)
    weights = [p.detach() for p in params.parameters()]
    copies = [t for t in packed.values()
              if t.dim() >= 2 and any(t.shape == w.shape and torch.equal(t, w) for w in weights)]
    copied = sum(t.untyped_storage().nbytes() for t in copies)
    saved = sum(t.untyped_storage().nbytes() for t in packed.values()) - copied
    packed.clear()  # autograd keeps what it saved; these references go before backward
    del copies
    out.logsumexp(1).mean().backward()
    return saved, copied, out.detach(), [p.grad.clone() for p in params.parameters()]


def difference(a, b) -> str:
    (out_a, grads_a), (out_b, grads_b) = a, b
    if torch.equal(out_a, out_b) and all(torch.equal(g, h) for g, h in zip(grads_a, grads_b)):
        return "bit-identical"
    worst = max([(out_a - out_b).abs().max().item()] + [(g - h).abs().max().item() for g, h in zip(grads_a, grads_b)])
    return f"max abs diff {worst:.1e}"


def run(name: str):
    title, make, shape = MODELS[name]
    torch.manual_seed(0)
    base, x = make().train(), torch.randn(*shape)
    rows, eager = [], {}
    for row, kind, module, params in variants(copy.deepcopy(base), x):
        torch._dynamo.reset()  # each variant compiles afresh, within dynamo's recompile limit
        params.load_state_dict(base.state_dict())
        with inductor_config.patch(layout_optimization=row != NO_LAYOUT):
            start = time.perf_counter()
            step(module, params, x)  # warm-up (compiles)
            first = time.perf_counter() - start
            params.load_state_dict(base.state_dict())
            saved, copied, out, grads = step(module, params, x)
        eager.setdefault(kind, (row, (out, grads), saved))
        same = "(reference)" if eager[kind][0] == row else difference(eager[kind][1], (out, grads))
        rows.append([row, fmt_bytes(saved), f"{saved:,}", f"{saved / eager['stock'][2]:.3f}", fmt_bytes(copied), same, f"{first:.1f} s"])
        print(title, rows[-1], flush=True)
    return f"## {title}, batch {shape[0]}, {shape[2]}x{shape[3]}\n\n" + tabulate(
        rows, headers=["variant", "saved activations", "bytes", "/ stock eager", "parameter copies saved", "same as eager", "first call"], tablefmt="github")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[1])
    parser.add_argument("--models", nargs="+", default=list(MODELS), choices=list(MODELS))
    args = parser.parse_args()
    torch.set_num_threads(1)
    inductor_config.fx_graph_cache = False  # 'first call' times a cold compile, not a cache hit
    functorch_config.enable_autograd_cache = False
    logging.getLogger("memopt").setLevel(logging.ERROR)  # the unwrap warning is expected here
    tables = [run(name) for name in args.models]
    doc = __doc__.split("\n\n", 2)[2].strip()
    text = (f"Command: `{COMMAND}{'' if args.models == list(MODELS) else ' --models ' + ' '.join(args.models)}` "
            f"(torch {torch.__version__}, CPU, 1 thread)\n\n# torch.compile keeps memopt's savings\n\n{doc}\n\n"
            + "\n\n".join(tables) + "\n")
    OUT.parent.mkdir(parents=True, exist_ok=True)
    OUT.write_text(text)
    print(text)


if __name__ == "__main__":
    main()
