"""python -m tools.bench.stash.bench_stash_oracle --models resnet18 --steps 0 100 --bits 4 8 --size 224 --batch 16 --threads 2

Benchmark: how far is the stash's BN weight gradient from the best any K-bit code of x̂ could give?

The issue's criterion is a gradient cosine >= 0.99 for every parameter at 4 bits. The parameters that miss
it are BN weights, whose gradient dL/dγ_c = Σ g x̂ (g = dL/dy at the BN output, x̂ the normalised input, the
sum over channel c's elements) is the one place where the rounding error e of x̂ enters a gradient directly:
dL/dγ_c gains Σ g e. This measures the floor of that term for a model, on its real gradient g and x̂:

- exact autograd runs one step and hooks record every BatchNorm's input (hence x̂, from the batch statistics)
  and g (so Σ g x̂ = the BN weight's gradient; checked against autograd's to 1e-5 cosine);
- per channel the elements where g can be nonzero (the activation's pass mask, known exactly to the stash:
  the 1-bit mask or the z code's zero) are quantised with 2^K levels by a quantiser that sees x̂ but not g,
  as any stash must: 'uniform' = 2^K equal bins between that side's extreme values, each rebuilt at the mean
  of its values (no clipping, the best of the stash's own grid family), 'optimal' = the 2^K levels of least
  squared error for that channel's values (Lloyd-Max, by 1-D k-means: 40 iterations from the quantile bins);
- the BN weight's gradient from those values, Σ g q(x̂), is compared with the exact one by cosine.

g here is exact, so this isolates the BN weight's own rounding term: in the stash, g also carries the
variance-term errors of the BNs after it, which only add. So a BN weight below 0.99 with 'optimal' at K bits
cannot reach 0.99 with any per-element K-bit code of x̂ (a per-channel scalar quantiser; vector or
error-diffusion codes are not covered). 'stash window' is the stash's own grid on that side (its window, ends and
reach, ``memopt/stash/grid.py``) with every value in the bin means, so it tells the stash's rounding from
the errors its output gradients bring from later layers: 'memopt' is the stash's own gradient on the same
batch (few-bit off, ``memopt.optimize`` on a copy). Models are trained as in tools/bench/stash/bench_stash_trained.py (stock SGD on digits).
Writes docs/results/stash/stash_oracle.md.
"""
from __future__ import annotations

import argparse
import copy
from typing import Dict, List, Tuple

import torch
import torch.nn.functional as F
from tabulate import tabulate

import memopt
import memopt.stash.grid as stash_grid
from tools.bench.common import write_results_file
from tools.bench.stash.common import trained_case, upsampled_digits

LLOYD_ITERATIONS = 40


def record(model: torch.nn.Module, x: torch.Tensor, y: torch.Tensor) -> Dict[str, Tuple[torch.Tensor, torch.Tensor]]:
    """Exact forward and backward; per BatchNorm: (x̂ channels-first (C, N), g likewise) and autograd's grads."""
    seen, handles = {}, []

    def hook(name):
        def forward_hook(module, inputs, output):
            x_in = inputs[0].detach().transpose(0, 1).reshape(inputs[0].shape[1], -1).double()
            mean = x_in.mean(1, keepdim=True)
            var = x_in.var(1, unbiased=False, keepdim=True)
            seen[name] = [(x_in - mean) / torch.sqrt(var + module.eps), None]
            output.register_hook(lambda g: seen[name].__setitem__(
                1, g.detach().transpose(0, 1).reshape(g.shape[1], -1).double()))
        return forward_hook

    for name, module in model.named_modules():
        if isinstance(module, torch.nn.modules.batchnorm._BatchNorm):
            handles.append(module.register_forward_hook(hook(name)))
    try:
        torch.manual_seed(5)
        F.cross_entropy(model(x), y).backward()
    finally:
        for h in handles:
            h.remove()
    return {n: (v[0], v[1]) for n, v in seen.items()}


def uniform_levels(values: torch.Tensor, bins: int, lo=None, hi=None) -> torch.Tensor:
    """Each value rebuilt at the mean of its bin, 2^K equal bins between the values' extremes (or lo, hi: values
    outside clip into the outer bins)."""
    lo = values.min() if lo is None else lo
    hi = values.max() if hi is None else hi
    width = (hi - lo) / bins
    if width <= 0:
        return values.clone()
    k = ((values - lo) / width).floor().clamp_(0, bins - 1).long()
    total = torch.zeros(bins, dtype=values.dtype).index_add_(0, k, values)
    count = torch.zeros(bins, dtype=values.dtype).index_add_(0, k, torch.ones_like(values))
    return (total / count.clamp_min(1))[k]


def optimal_levels(values: torch.Tensor, bins: int) -> torch.Tensor:
    """Each value rebuilt at its Lloyd-Max level: 1-D k-means on the sorted values, from quantile bins."""
    n = values.numel()
    if n <= bins:
        return values.clone()
    ordered, order = values.sort()
    csum = torch.cat([ordered.new_zeros(1), ordered.cumsum(0)])
    cuts = torch.linspace(0, n, bins + 1).round().long()  # segment edges as indices into ordered
    for _ in range(LLOYD_ITERATIONS):
        starts, ends = cuts[:-1], cuts[1:]
        filled = ends > starts
        levels = (csum[ends] - csum[starts]) / (ends - starts).clamp_min(1)
        levels = levels[filled]
        edges = (levels[1:] + levels[:-1]) / 2
        new_cuts = torch.cat([cuts.new_zeros(1), torch.searchsorted(ordered, edges), cuts.new_full((1,), n)])
        if torch.equal(new_cuts, cuts):
            break
        cuts = new_cuts
    starts, ends = cuts[:-1], cuts[1:]
    levels = (csum[ends] - csum[starts]) / (ends - starts).clamp_min(1)
    which = torch.searchsorted(ends, torch.arange(n), right=True)
    out = torch.empty_like(values)
    out[order] = levels[which]
    return out


def stash_levels(values: torch.Tensor, bins: int) -> torch.Tensor:
    """The stash's own window on one side of a split code (``stash_grid``: half-width WINDOWS[K+1], an outer end
    inside it where the data end, following the data out to REACH where they end past REACH_PAST), each bin
    at the mean of all its values: the stash's rounding with exact output gradients and without its sampling
    of the means (every MEAN_STRIDE-th value)."""
    bits = bins.bit_length() - 1
    ends = torch.stack([values.min(), values.max()]).float()
    half, past, reach = (f(bits, True) for f in (stash_grid.x_grid_half, stash_grid.x_grid_past,
                                                  stash_grid.x_grid_reach))
    lo, hi = stash_grid.follow_ends(ends, half, past, reach).double() if bits in stash_grid.REACH \
        else ends.clamp(-half, half).double()
    return uniform_levels(values, bins, lo, hi)


QUANTISERS = {"stash window": stash_levels, "uniform": uniform_levels, "optimal": optimal_levels}


def oracle_grads(xhat: torch.Tensor, g: torch.Tensor, bits: int) -> Dict[str, torch.Tensor]:
    """Per quantiser: Σ g q(x̂) per channel, q fitted to the channel's elements where g is nonzero."""
    out = {name: torch.zeros(xhat.shape[0], dtype=torch.float64) for name in QUANTISERS}
    for c in range(xhat.shape[0]):
        live = g[c] != 0
        v, gc = xhat[c][live], g[c][live]
        if v.numel() == 0:
            continue
        for name, quantise in QUANTISERS.items():
            out[name][c] = (gc * quantise(v, 1 << bits)).sum()
    return out


def memopt_grads(model, x, y, bits: int) -> Dict[str, torch.Tensor]:
    ours = copy.deepcopy(model)
    om = memopt.optimize(ours, example_inputs=x,
                         config=memopt.Config(stash=memopt.StashConfig(bits=bits), fewbit=None, fidelity=None))
    torch.manual_seed(5)
    F.cross_entropy(om(x), y).backward()
    return {n: p.grad.detach().double() for n, p in ours.named_parameters()}


def cos(a: torch.Tensor, b: torch.Tensor) -> float:
    return F.cosine_similarity(a.flatten(), b.flatten(), 0).item()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--models", default="resnet18")
    parser.add_argument("--steps", type=int, nargs="+", default=[0, 100])
    parser.add_argument("--bits", type=int, nargs="+", default=[4, 8])
    parser.add_argument("--size", type=int, default=224)
    parser.add_argument("--batch", type=int, default=16)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--out", default="docs/results/stash/stash_oracle.md")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    data_x, data_y = upsampled_digits(args.size)
    summary: List[list] = []
    detail: List[list] = []
    for name in args.models.split(","):
        for steps in args.steps:
            model, _, x, y = trained_case(name, steps, data_x, data_y, args.batch)
            reference = copy.deepcopy(model)
            recorded = record(reference, x, y)
            exact = {n: p.grad.detach().double() for n, p in reference.named_parameters()}
            for bits in args.bits:
                ours = memopt_grads(model, x, y, bits)
                per_bn = []
                for bn, (xhat, g) in recorded.items():
                    key = f"{bn}.weight"
                    if key not in exact:
                        continue
                    direct = (g * xhat).sum(1)
                    check = cos(direct, exact[key])
                    if check < 1 - 1e-5:
                        raise RuntimeError(f"{key}: Σ g x̂ from the hooks disagrees with autograd (cosine {check})")
                    oracle = oracle_grads(xhat, g, bits)
                    per_bn.append((key, cos(ours[key], exact[key]),
                                   *(cos(oracle[name], direct) for name in QUANTISERS)))
                columns = range(1, 2 + len(QUANTISERS))
                counts = [sum(row[i] >= 0.99 for row in per_bn) for i in columns]
                worst = [min(row[i] for row in per_bn) for i in columns]
                summary.append([name, steps, bits, len(per_bn)] + [f"{c}/{len(per_bn)}" for c in counts]
                               + [f"{w:.4f}" for w in worst])
                print(summary[-1], flush=True)
                for key, *values in sorted(per_bn, key=lambda r: r[1])[:5]:
                    detail.append([name, steps, bits, key] + [f"{v:.4f}" for v in values])
    command = (f"python -m tools.bench.stash.bench_stash_oracle --models {args.models} --steps {' '.join(map(str, args.steps))} "
               f"--bits {' '.join(map(str, args.bits))} --size {args.size} --batch {args.batch} "
               f"--threads {args.threads}{' --out ' + args.out if args.out != 'docs/results/stash/stash_oracle.md' else ''}")
    body = " ".join(__doc__.split("\n\n", 2)[2].split("Writes docs/")[0].split())
    write_results_file(args.out, "\n".join([
        "# Stash: BN weight gradients against the best K-bit code of x̂", "",
        f"Command: `{command}` (torch {torch.__version__}, CPU). {body}", "",
        tabulate(summary, ["model", "stock SGD steps", "bits", "BN weights", ">= 0.99 memopt"]
                 + [f">= 0.99 {name}" for name in QUANTISERS] + ["worst memopt"]
                 + [f"worst {name}" for name in QUANTISERS], tablefmt="github"), "",
        "## The five BN weights of each run where memopt is worst", "",
        tabulate(detail, ["model", "steps", "bits", "parameter", "memopt"] + list(QUANTISERS), tablefmt="github"),
        ""]))


if __name__ == "__main__":
    main()
