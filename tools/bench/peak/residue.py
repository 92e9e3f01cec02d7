"""python -m tools.bench.peak.residue [--model llama|resnet50|vit|bert] [--batch N] [--res R] [--budget-mb B]

Where the resident peak of ``bench_peak``'s memopt rows differs from memopt's estimate: in one fresh process,
the cost model's estimate of the plan, the same step measured by ``memopt.measure`` (the live-storage tracker the
cost model mirrors, on real tensors), and the anonymous resident memory ``memopt.optimize`` leaves behind (read
before and after it, after a garbage collection): what a process holds from then on besides the step's tensors
(modules it imported, caches); then the parts of the estimated peak (parameters, optimizer state, activations
kept for backward, transients alive at the peak) and the nodes that keep the most. Run it with ``MALLOC_MMAP_THRESHOLD_=131072`` as the peak table is, so freed large
blocks go back to the kernel. Prints three lines; no results file (the peak table's Reading quotes it). ``--twice``
then runs ``optimize()`` a second time with the first plan dropped and prints what that leaves held.
"""
from __future__ import annotations

import argparse
import gc
import re


def anon_mib() -> float:
    with open("/proc/self/status") as f:
        return int(re.search(r"RssAnon:\s+(\d+)", f.read()).group(1)) / 1024


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[1])
    p.add_argument("--model", default="llama", choices=("llama", "resnet50", "vit", "bert"))
    p.add_argument("--batch", type=int, default=None)
    p.add_argument("--res", type=int, default=128)
    p.add_argument("--budget-mb", type=float, default=None, help="optimize() with this budget_mb: the plan then "
                   "records what the build measured it left held (Plan.process_held_bytes), printed beside")
    p.add_argument("--twice", action="store_true", help="then optimize() again in the same process (the first plan "
                   "dropped) and print what that second call leaves held: one-time process costs vs per-plan ones")
    args = p.parse_args()
    import torch

    import memopt
    from tools.bench.peak import child

    torch.set_num_threads(1)
    batch = args.batch or child.DEFAULT_BATCH[args.model]
    case = child.build(args.model, batch, child.shape_args(res=args.res))
    opt = child.make_optimizer(args.model, case.model)
    gc.collect()
    before = anon_mib()
    om = memopt.optimize(case.model, example_inputs=case.inputs, optimizer=opt, loss_fn=case.loss_of_output,
                         budget_mb=args.budget_mb)
    gc.collect()
    held = anon_mib() - before
    measured = memopt.measure(om, case.inputs, case.loss_of_output, optimizer=opt)
    print(f"{case.describe}, batch {batch}: estimated peak {om.plan.estimated_peak_bytes / 2**20:.1f} MiB, "
          f"memopt.measure {measured.peak_bytes / 2**20:.1f} MiB, anonymous memory held after optimize() "
          f"{held:.1f} MiB" + (f" (the build's own measure, Plan.process_held_bytes: "
                               f"{om.plan.process_held_bytes / 2**20:.1f} MiB)" if args.budget_mb else ""))
    parts = ("parameters_and_buffers", "optimizer_state", "gradients", "inputs", "activations", "transient")
    print("the estimated peak's parts: " + ", ".join(f"{p.replace('_', ' ')} "
                                                      f"{om.plan.estimated_breakdown.get(p, 0) / 2**20:.1f}"
                                                      for p in parts) + " MiB (cost_model.analysis.Estimate.breakdown)")
    kept = sorted(((c.saved_bytes, name, c.target, c.shapes[:1]) for name, c in
                   om.estimate.nodes.items()), reverse=True)[:4]
    if args.twice:
        del om, measured
        gc.collect()
        before = anon_mib()
        om = memopt.optimize(case.model, example_inputs=case.inputs, optimizer=opt, loss_fn=case.loss_of_output)
        del om
        gc.collect()
        print(f"a second optimize() in the same process, its plan dropped: {anon_mib() - before:.1f} MiB more "
              f"anonymous memory held")
        return
    print("the nodes that keep the most for backward: " + "; ".join(
        f"{name} ({target}, out {shapes[0] if shapes else '?'}) {b / 2**20:.1f} MiB" for b, name, target, shapes in kept))


if __name__ == "__main__":
    main()
