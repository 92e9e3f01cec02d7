"""python -m tools.bench.stash.bench_stash_invariance --size 224 --batch 8   (about 3 minutes)

Benchmark: why MobileNetV2's stem and expand BN weights miss cosine 0.99 under a rebuilt-x̂ stash, and the identity that fixes it.

Each of those BNs feeds ReLU6 and then a depthwise conv and a training-mode BN, channel by channel. Scaling
a channel's (γ, β) by α scales its ReLU6 output by α while nothing reaches 6 (ReLU is positively
homogeneous), and the next BN divides it out: γ dL/dγ + β dL/dβ = 0 up to eps and the clip at 6, so at
initialisation (β = 0) the exact weight gradient sum(g x̂) is nearly zero, far below its natural scale
||g|| ||x̂|| (the size the sum would have if g and x̂ were unrelated). The stash's weight gradient is
sum(g x̂_q): its error sum(g (x̂_q - x̂)) is rounding noise of that natural scale times the code's step.

For every such BN of torchvision MobileNetV2 (random init, seed 0), this captures the BN input and the
gradient at its ReLU6 output from one stock step, runs the chain's stash Function alone on them at 2, 4 and
8 bits, and reports the exact gradient against its natural scale, and our error against the exact gradient.
Then the same weights' cosine from ``memopt.optimize`` on the whole model, where the scale identity
(``memopt/stash/identity.py``, on by default) solves them from the next BN's weight gradient, and the
stem weight's error with the rebuilt-x̂ stash on one stage at a time.
Writes docs/results/stash/stash_invariance.md.
"""
from __future__ import annotations

import argparse
import math

import torch
import torch.nn.functional as F
from tabulate import tabulate

from memopt.stash.ops import BNActStash
from tools.bench.common import RESULTS, write_results_file

BITS = (2, 4, 8)


def _targets(model):
    """(name, Conv2dNormActivation) for the stem and every expand block: BN -> ReLU6 -> depthwise conv."""
    out = [("features.0", model.features[0])]
    for i in range(2, len(model.features) - 1):
        out.append((f"features.{i}.conv.0", model.features[i].conv[0]))
    return out


def _capture(model, x):
    """The BN inputs and ReLU6 output gradients of one stock step, and its output gradient."""
    store = {}
    for name, block in _targets(model):
        bn, act = block[1], block[2]
        bn.register_forward_hook(lambda m, i, o, name=name: store.__setitem__((name, "x"), i[0].detach().clone()))
        act.register_forward_hook(lambda m, i, o, name=name: (o.register_hook(
            lambda g, name=name: store.__setitem__((name, "g"), g.detach().clone())), None)[1])
    torch.manual_seed(1)
    out = model(x)
    grad = torch.randn_like(out)
    out.backward(grad)
    return store, grad


def whole_model_cosines(model, x, grad, exact, bits: int):
    """{parameter: cosine against ``exact``} from ``memopt.optimize`` on the whole model (stash defaults, so
    the scale identity is on; few-bit and reversible off), the same input and output gradient as the capture."""
    import copy

    import memopt

    m = copy.deepcopy(model)
    om = memopt.optimize(m, example_inputs=x, config=memopt.Config(stash=memopt.StashConfig(bits=bits), fewbit=None, fidelity=None,
                                                                   reversible=None))
    torch.manual_seed(1)
    om(x).backward(grad)
    return {n: F.cosine_similarity(p.grad.flatten(), exact[n].flatten(), 0).item() for n, p in m.named_parameters()
            if n in exact}


def _stash_weight_grad(x, g, bn, bits):
    x = x.clone().requires_grad_()
    w, b = (p.detach().clone().requires_grad_() for p in (bn.weight, bn.bias))
    y = BNActStash.apply(x, w, b, torch.zeros_like(bn.running_mean), torch.ones_like(bn.running_var), None, None,
                         0.1, bn.eps, "relu6", (), bits, True, "probe")[0]
    y.backward(g)
    return w.grad


def _exact(x, g, bn):
    w = bn.weight.detach().clone().requires_grad_()
    z = F.batch_norm(x, None, None, w, bn.bias.detach(), True, 0.1, bn.eps)
    F.relu6(z).backward(g)
    xhat = F.batch_norm(x, None, None, None, None, True, 0.1, bn.eps)
    gz = g * ((z > 0) & (z < 6))
    natural = (gz.square().sum((0, 2, 3)).sqrt() * xhat.square().sum((0, 2, 3)).sqrt()).norm()
    return w.grad, natural, bool((z >= 6).any())


def stage_rows(bits: int, size: int, batch: int):
    """The stem BN weight's gradient error when the stash rewrites only one stage's chains (features.N),
    ``memopt.optimize`` on the whole model (few-bit and reversible off): where the error comes from."""
    import copy

    import torchvision

    import memopt

    torch.manual_seed(0)
    model = torchvision.models.mobilenet_v2().train()
    x = torch.randn(batch, 3, size, size)
    plain = memopt.StashConfig(bits=bits, scale_identity=False)  # the rebuilt-x̂ sum whose error this traces
    every = memopt.optimize(copy.deepcopy(model), example_inputs=x,
                            config=memopt.Config(stash=plain, fewbit=None, reversible=None, fidelity=None))
    chains = [n.name[:-len("_stash")] for n in every.plan.nodes if n.op == "bn_act_stash"]
    stages = {}
    for name in chains:
        stages.setdefault(name.split("_")[1], []).append(name)
    reference = copy.deepcopy(model)
    torch.manual_seed(1)
    out = reference(x)
    g = torch.randn_like(out)
    out.backward(g)
    exact = reference.features[0][1].weight.grad
    rows = []
    for stage, names in stages.items():
        m = copy.deepcopy(model)
        om = memopt.optimize(m, example_inputs=x, config=memopt.Config(
            stash=memopt.StashConfig(bits=bits, allow=tuple(names), scale_identity=False), fewbit=None, fidelity=None,
            reversible=None))
        torch.manual_seed(1)
        om(x).backward(g)
        err = (m.features[0][1].weight.grad - exact).norm() / exact.norm()
        rows.append([f"features.{stage}", len(names), f"{err:.2g}"])
        print(rows[-1], flush=True)
    return rows


def main() -> None:
    import torchvision

    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--size", type=int, default=224)
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--stage-size", type=int, default=64, help="input size of the per-stage runs")
    parser.add_argument("--stage-batch", type=int, default=2)
    parser.add_argument("--out", default=str(RESULTS / "stash" / "stash_invariance.md"))
    args = parser.parse_args()
    import copy

    torch.manual_seed(0)
    model = torchvision.models.mobilenet_v2().train()
    pristine = copy.deepcopy(model)  # the capture's hooks would keep memopt from rewriting the chains
    x = torch.randn(args.batch, 3, args.size, args.size)
    store, grad = _capture(model, x)
    exact_all = {n: p.grad for n, p in model.named_parameters()}
    solved = {bits: whole_model_cosines(pristine, x, grad, exact_all, bits) for bits in BITS}
    rows, worst8, least8 = [], 0.0, math.inf
    for name, block in _targets(model):
        x, g, bn = store[(name, "x")], store[(name, "g")], block[1]
        exact, natural, clipped = _exact(x, g, bn)
        row = [f"{name}.1.weight", f"{exact.norm() / natural:.1e}", "yes" if clipped else "no"]
        for bits in BITS:
            ours = _stash_weight_grad(x, g, bn, bits)
            err = ((ours - exact).norm() / exact.norm()).item()
            if bits == 8:
                worst8, least8 = max(worst8, err), min(least8, err)
            row += [f"{err:.2g}", f"{F.cosine_similarity(ours, exact, 0):.3f}"]
        row += [f"{solved[bits][f'{name}.1.weight']:.4f}" for bits in BITS]
        rows.append(row)
        print(rows[-1], flush=True)
    headers = ["parameter", "|exact| / natural scale", "any z >= 6"]
    for bits in BITS:
        headers += [f"{bits}-bit |error| / |exact|", f"{bits}-bit cosine"]
    headers += [f"{bits}-bit cosine, scale identity" for bits in BITS]
    table = tabulate(rows, headers=headers, tablefmt="github")
    stages = tabulate(stage_rows(8, args.stage_size, args.stage_batch),
                      headers=["only this stage's chains stashed", "chains", "8-bit |error| / |exact|"],
                      tablefmt="github")
    text = (f"# Stash: MobileNetV2's scale-invariant BN weights\n\nCommand: `python -m tools.bench.stash.bench_stash_invariance "
            f"--size {args.size} --batch {args.batch}` (torch {torch.__version__}, CPU). Random init (seed 0), input "
            f"N(0, 1), output gradient N(0, 1); each BN's chain Function run alone on the BN input and the ReLU6 "
            f"output gradient captured from one stock step (columns up to '8-bit cosine': the weight gradient "
            f"summed over the rebuilt x̂); the last three columns: `memopt.optimize` on the whole model with the "
            f"same input and output gradient, stash defaults (scale identity on). Natural scale: the norm over "
            f"channels of ||g_c|| ||x̂_c||, g the gradient at the BN output where ReLU6 passes it.\n\n{table}\n\n"
            f"Read-out: every one of these weights has an exact gradient a small fraction of its natural scale "
            f"(column 2): γ dL/dγ + β dL/dβ = 0 for a BN -> ReLU6 -> depthwise conv -> training-mode BN "
            f"channel while no value reaches 6 (where some do, column 3, the gradient is larger but still tiny), "
            f"and β = 0 at initialisation. The stash's error is rounding noise of the natural scale times the "
            f"code's step: at 8 bits, the most the stash offers, it is {least8:.2g}x to {worst8:.3g}x the exact "
            f"gradient. A cosine of 0.99 needs the error below about 0.14 x the exact gradient; halving the step "
            f"per extra bit, the worst row would need about "
            f"{8 + math.log2(max(worst8, 0.14) / 0.14):.1f} bits: not a matter of tuning the code. The identity "
            f"itself is the way out: with g = dL/dz, per channel, γ dL/dγ + β dL/dβ = Σ g z - 6 Σ_clip g and "
            f"Σ g z = Σ (dL/du) u = γ' dL/dγ' eps / (var' + eps) (u the depthwise output, primes the next BN's), "
            f"which needs no activation at all; memopt solves dL/dγ from it (`StashConfig.scale_identity`, on by "
            f"default), so these weights inherit the next BN's weight-gradient error instead (last columns).\n\n"
            f"## Where the stem weight's error comes from\n\n"
            f"`memopt.optimize` on the whole model at 8 bits ({args.stage_size}x{args.stage_size}, batch "
            f"{args.stage_batch}), the rebuilt-x̂ stash (`scale_identity=False`) allowed on one stage's chains at a "
            f"time (`StashConfig(allow=...)`); the error of features.0.1.weight's gradient relative to the exact one:\n\n{stages}\n\nThe error comes "
            f"from the stem's own chain and the depthwise block right after it; the chains further down, whose "
            f"errors reach the stem through exact conv transposes and the exact mean terms of the BNs, add little.\n")
    write_results_file(args.out, text)


if __name__ == "__main__":
    main()
