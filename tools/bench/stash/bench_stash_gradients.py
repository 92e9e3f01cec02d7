"""python -m tools.bench.stash.bench_stash_gradients   (ResNet-50, three grids: about 8 minutes)

Benchmark: per-parameter gradient cosine of torchvision CNNs with the exact-forward stash.

For each model / input size / batch / seed: random init, random input, a random output gradient; the
parameter gradients of the stash (few-bit off) against exact autograd on a copy (both forwards from the
same RNG state, so dropout draws the same masks). Grids (older ones reproduced by patching; the rebuilt
x̂ is centred per channel in all of them): "single" (2^K bins over ±WINDOWS[K], the grid before any mask split; residual z coded on both sides),
"split" (without a residual, 2^K bins on each side of the activation's kink, which the stored 1-bit
mask tells apart), "split+residual" (commit 552fb46: residual chains also split x̂ by their mask, each
side's window ending where its values end, and code z only where z > 0; a downsample BN is a chain of
its own), "merged" (a downsample BN joins the residual chain it is added to, so its x̂ is split by that
chain's exact mask too), "ends" (merged, and every split window's outer end is where that side's
values end when that is inside ±WINDOWS[K+1], and the stem BN -> ReLU -> max-pool is one Function whose BN
weight gradient is exact from the pooled output), "identity" (ends, and the scale identity for BN weights
before a depthwise conv, K+1 bits for chains without an activation: ``memopt/stash/identity.py``),
"current" (identity, and each bin rebuilt at the mean of the values it coded: StashConfig.bin_means).

Parameters whose exact gradient is (numerically) zero have no meaningful cosine: a conv bias followed
by a training-mode BN (the BN removes any per-channel shift), a BN bias whose every path passes a
1x1 conv into a training-mode BN (MobileNetV2 projection BNs), a BN weight whose every consumer is a
per-channel training-mode BN after a positive-homogeneous ReLU / max-pool with β = 0 (DenseNet's
norm0 at init: zero up to eps). A parameter whose exact gradient norm is below ``--zero`` (1e-3) times
the model's median per-parameter exact-gradient norm is excluded from the cosine columns and listed
with both norms (exact and ours) relative to that median.
Writes docs/results/stash/stash_gradients.md (``--out`` for another file).
"""
from __future__ import annotations

import argparse
import contextlib
import copy
import statistics
from unittest import mock

import torch
import torch.nn.functional as F
from tabulate import tabulate

import memopt
import memopt.stash.ops as stash_ops
import memopt.stash.grid as stash_grid
import memopt.passes.stash.chains as stash_pass
from tools.bench.common import write_results_file

MODELS = ("resnet18", "resnet50", "vgg11_bn", "mobilenet_v2", "densenet121")
MOBILENET_NOTE = (
    "MobileNetV2's stem and expand BN weights (features.0.1.weight, features.N.conv.0.1.weight) are kept although "
    "their exact gradient is small: each channel feeds one depthwise channel and then a training-mode BN, so it "
    "is only the eps and ReLU6-clip terms of the scale identity (the 'least kept exact norm / median' column; "
    "docs/results/stash/stash_invariance.md). Summed over a rebuilt x̂ ('ends') they carry the code's rounding noise at "
    "the natural scale; 'identity' and 'current' solve them from the next BN's weight gradient by the identity "
    "(memopt/stash/identity.py), so they inherit that gradient's error, weighted toward its channels of "
    "small variance. Both also code chains without an activation (the projection BNs) with K+1 bits: "
    "their BN weights and the next expand convs' weights were the rows between 0.98 and 0.99 in 'ends'.")


def gradients(name, bits, size, batch, seed, identity=True, means=True):
    """{parameter: (cosine, exact-gradient norm, our gradient norm, whether it is a BatchNorm weight)}."""
    import torchvision

    torch.manual_seed(seed)
    model = getattr(torchvision.models, name)(weights=None).train()
    x = torch.randn(batch, 3, size, size)
    reference = copy.deepcopy(model)
    om = memopt.optimize(model, example_inputs=x, config=memopt.Config(
        stash=memopt.StashConfig(bits=bits, scale_identity=identity, identity_extra_bit=identity, bin_means=means),
        fewbit=None, fidelity=None))
    torch.manual_seed(seed + 1000)
    out = om(x)
    torch.manual_seed(seed + 1000)
    ref = reference(x)
    assert torch.equal(out, ref), name
    g = torch.randn_like(out)
    out.backward(g)
    ref.backward(g)
    bn_weights = {f"{m}.weight" for m, mod in model.named_modules() if isinstance(mod, torch.nn.modules.batchnorm._BatchNorm)}
    return {n: (F.cosine_similarity(p.grad.flatten(), q.grad.flatten(), 0).item(), q.grad.norm().item(),
                p.grad.norm().item(), n in bn_weights)
            for (n, p), q in zip(model.named_parameters(), reference.parameters())}


def _grid_patches(grid):
    """Patches that reproduce ``grid`` (the rebuilt x̂ is centred per channel in every one of them)."""
    split = {"single": lambda act, has_residual: False,
             "split": lambda act, has_residual: act != "identity" and not has_residual}.get(grid, stash_ops.split_by_mask)
    positive = (lambda act: False) if grid in ("single", "split") else stash_ops.positive_z_grid
    current = grid in ("ends", "identity", "current")
    return (mock.patch.object(stash_ops, "split_by_mask", split), mock.patch.object(stash_ops, "positive_z_grid", positive),
            mock.patch.object(stash_pass, "_second_bn", stash_pass._second_bn if grid in ("merged", "ends", "identity",
                                                                                          "current")
                              else (lambda *args: None)),
            mock.patch.object(stash_grid, "DATA_ENDS", current),
            mock.patch.object(stash_pass, "_fusable_pool", stash_pass._fusable_pool if current else (lambda *a: None)))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--models", default="resnet50", help=f"comma-separated, from {','.join(MODELS)}")
    parser.add_argument("--bits", type=int, nargs="+", default=[4])
    parser.add_argument("--cases", default="64x2,128x4", help="SIZExBATCH,... (64x2 is tests/stash/test_stash.py's)")
    parser.add_argument("--seeds", type=int, default=3)
    parser.add_argument("--grids", default="split+residual,merged,current",
                        help="single,split,split+residual,merged,ends,identity,current")
    parser.add_argument("--zero", type=float, default=1e-3,
                        help="exact gradient norm below this times the median parameter-gradient norm: excluded")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--out", default="docs/results/stash/stash_gradients.md")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    rows, excluded = [], {}
    for name in args.models.split(","):
        for case in args.cases.split(","):
            size, batch = map(int, case.split("x"))
            for bits in args.bits:
                for grid in args.grids.split(","):
                    for seed in range(args.seeds):
                        with contextlib.ExitStack() as stack:
                            for patch in _grid_patches(grid):
                                stack.enter_context(patch)
                            grads = gradients(name, bits, size, batch, seed, identity=grid in ("identity", "current"),
                                              means=grid == "current")
                        median = statistics.median(v[1] for v in grads.values())
                        zero = {n for n, v in grads.items() if v[1] < args.zero * median}
                        for n in sorted(zero):
                            excluded.setdefault((name, n), []).append((grads[n][1] / median, grads[n][2] / median))
                        cos = {n: v[0] for n, v in grads.items() if n not in zero}
                        worst = min(cos, key=cos.get)
                        least_kept = min(grads[n][1] for n in cos) / median
                        bn_weights = sorted(c for n, c in cos.items() if grads[n][3])
                        rows.append([name, f"{size}x{size}", batch, bits, grid, seed, f"{cos[worst]:.4f}", worst,
                                     f"{sum(c >= 0.99 for c in cos.values())}/{len(cos)}",
                                     f"{bn_weights[len(bn_weights) // 2]:.4f}" if bn_weights else "",
                                     len(zero), f"{least_kept:.1e}"])
                        print(rows[-1], flush=True)
    headers = ["model", "input", "batch", "bits", "grid", "seed", "worst cos", "worst parameter", "params >= 0.99",
               "median BN weight cos", "excluded (exact grad ~ 0)", "least kept exact norm / median"]
    excl_rows = [[m, n, len(v), f"{max(e for e, _ in v):.1e}", f"{min(o for _, o in v):.1e} .. {max(o for _, o in v):.1e}"]
                 for (m, n), v in sorted(excluded.items())]
    command = (f"python -m tools.bench.stash.bench_stash_gradients --models {args.models} --bits {' '.join(map(str, args.bits))} "
               f"--cases {args.cases} --seeds {args.seeds} --grids {args.grids} --zero {args.zero:g} "
               f"--threads {args.threads}"
               f"{' --out ' + args.out if args.out != 'docs/results/stash/stash_gradients.md' else ''}")
    if args.out.endswith("stash_gradients.md"):
        title = "# Stash: per-parameter gradient cosine, torchvision ResNet-50"
    else:
        title = f"# Stash: per-parameter gradient cosine, torchvision {', '.join(args.models.split(','))}"
    write_results_file(args.out, "\n".join([
        title, "",
        f"Command: `{command}` (torch {torch.__version__}, CPU). Random init, input N(0, 1), output gradient "
        f"N(0, 1), both forwards from the same RNG state (dropout: same masks); stash only (few-bit off); cosine "
        f"of each parameter's gradient against exact autograd. Grids (the rebuilt x̂ centred per channel in all): "
        f"'split+residual' = commit 552fb46 (residual chains split x̂ by their exact mask and code z only where "
        f"z > 0; a downsample BN is an identity chain of its own); 'merged' = + the downsample BN joins the "
        f"residual chain it is added to, its x̂ split by that chain's mask; 'ends' = merged + each split "
        f"window's outer end where that side's values end if inside ±WINDOWS[K+1] + the stem BN -> ReLU -> max-pool in one "
        f"Function with its BN weight gradient exact from the pooled output; 'identity' = ends + the scale identity "
        f"for BN weights before a depthwise conv and K+1 bits for chains without an activation (StashConfig."
        f"scale_identity, identity_extra_bit; the same as 'ends' in models without either); 'current' = identity + "
        f"each bin rebuilt at the mean of the values it coded where a code's means cost at most half of its "
        f"bytes (StashConfig.bin_means; K <= 4). Older grids: "
        f"`--grids single,split`.", "",
        f"**Exclusion rule.** A parameter whose exact gradient norm is below {args.zero:g} x the model's median "
        f"per-parameter exact-gradient norm has a (numerically) zero true gradient, so its cosine compares two "
        f"noises: it is left out of 'worst cos' and 'params >= 0.99' and listed below with the exact and our "
        f"gradient norms relative to that median. The last column of the main table is the smallest ratio among "
        f"the parameters kept, so the gap to the threshold is visible.", "",
        tabulate(rows, headers, tablefmt="github"), "",
        "## Excluded parameters (exact gradient ~ 0)", "",
        "Why zero: a conv bias followed by a training-mode BN (the BN removes a per-channel shift); a BN bias "
        "whose every path reaches a 1x1 conv into a training-mode BN (MobileNetV2 projection BNs); DenseNet "
        "norm0.weight: every consumer is a per-channel training-mode BN after ReLU and max-pool, which commute "
        "with a positive per-channel scale when β = 0 (at init), so the true gradient is zero up to eps. Our "
        "gradient there is the sum of the consumers' quantisation errors (for norm0.weight, the errors of the "
        "seven BN weight gradients of dense block 1 and its transition).", "",
        *([MOBILENET_NOTE, ""] if "mobilenet_v2" in args.models.split(",") else []),
        tabulate(excl_rows, ["model", "parameter", "runs", "exact norm / median (max)", "our norm / median (range)"],
                 tablefmt="github") if excl_rows else "(none)", ""]))


if __name__ == "__main__":
    main()
