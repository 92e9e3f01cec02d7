"""Command line: ``python -m memopt demo`` and ``python -m memopt estimate``."""
from __future__ import annotations

import argparse
import sys
from typing import List, Optional

import torch


def _demo(args: argparse.Namespace) -> int:
    import memopt
    from memopt.report import fmt_bytes
    from memopt.testing.zoo import TinyResNet

    torch.manual_seed(0)
    model = TinyResNet(width=args.width).train()
    x = torch.randn(args.batch, 3, 32, 32)
    try:
        om = memopt.optimize(model, budget_mb=args.budget_mb, example_inputs=x, optimizer="sgd")
    except memopt.BudgetError as e:
        print(f"memopt: {e}", file=sys.stderr)
        return 1
    om.report(print=True, top=args.top)
    before = memopt.measure(model, x, optimizer="sgd")
    after = memopt.measure(om, x, optimizer="sgd")
    print()
    print(f"measured one training step of TinyResNet (batch {args.batch}, 32x32, SGD with momentum) on "
          f"{after.device} [{after.method}]:")
    print(f"  saved activations: stock {fmt_bytes(before.saved_bytes)} -> memopt {fmt_bytes(after.saved_bytes)}")
    print(f"  peak memory:       stock {fmt_bytes(before.peak_bytes)} -> memopt {fmt_bytes(after.peak_bytes)}")
    if not any(p["modified"] for p in om.plan.passes):
        print("  (no enabled technique rewrote this model, so stock and memopt are the same graph)")
    print(f"  estimated by the cost model: saved {fmt_bytes(om.plan.estimated_saved_bytes)}, "
          f"peak {fmt_bytes(om.plan.estimated_peak_bytes)}")
    return 0


def _estimate(args: argparse.Namespace) -> int:
    import memopt
    from memopt.testing.zoo import ZOO, build

    if args.model not in ZOO:
        print(f"unknown model {args.model!r}; choose one of {sorted(ZOO)}", file=sys.stderr)
        return 2
    model, inputs = build(args.model)
    est = memopt.estimate(model, inputs, device=args.device, optimizer=args.optimizer)
    print(est.report(top=args.top))
    return 0


def main(argv: Optional[List[str]] = None) -> int:
    parser = argparse.ArgumentParser(prog="memopt", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)
    demo = sub.add_parser("demo", help="optimize a built-in ResNet, print its report and measured memory")
    demo.add_argument("--batch", type=int, default=32)
    demo.add_argument("--width", type=int, default=16)
    demo.add_argument("--budget-mb", type=float, default=None,
                      help="peak memory budget of one training step in MiB (default: every technique at its default)")
    demo.add_argument("--top", type=int, default=20)
    demo.set_defaults(func=_demo)
    est = sub.add_parser("estimate", help="run the cost model on a model of the test zoo")
    est.add_argument("model")
    est.add_argument("--device", default=None)
    est.add_argument("--optimizer", default=None)
    est.add_argument("--top", type=int, default=30)
    est.set_defaults(func=_estimate)
    args = parser.parse_args(argv)
    return args.func(args)


if __name__ == "__main__":
    sys.exit(main())
