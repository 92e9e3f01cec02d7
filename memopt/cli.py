"""The command line: ``python -m memopt {demo,report,export,bench,estimate}``.

Models are named as a test-zoo name (``tiny_resnet``), a torchvision model (``resnet50`` or
``torchvision:resnet50``), a timm model (``resnet26d`` or ``timm:resnet26d``, random weights), or
``package.module:callable`` (called without arguments). Bad
arguments exit with code 2 and a one-line message.
"""
from __future__ import annotations

import argparse
import importlib
import sys
from typing import Any, Callable, List, Optional, Tuple

import torch
from torch import nn

from memopt.core.errors import MemoptError


class CliError(Exception):
    """A bad argument: printed as one line, exit code 2."""


def _is_timm_only(name: str) -> bool:
    """A bare name torchvision does not have but timm does (torchvision wins when both have it)."""
    try:
        import torchvision

        if callable(getattr(torchvision.models, name, None)):
            return False
    except ImportError:
        pass
    try:
        import timm
    except ImportError:
        return False
    return timm.is_model(name)


def resolve_model(spec: str, batch: Optional[int], input_shape: Optional[Tuple[int, ...]]) -> Tuple[nn.Module, Any]:
    """(model in train mode, example inputs) for a model spec; see the module docstring."""
    from memopt.testing.zoo import ZOO, build

    if spec in ZOO and ":" not in spec:
        model, inputs = build(spec)
        if batch is not None or input_shape is not None:
            if not isinstance(inputs, torch.Tensor):
                raise CliError(f"--batch/--input-shape cannot be used with zoo model {spec!r} (its inputs are a "
                               f"{type(inputs).__name__})")
            shape = input_shape or tuple(inputs.shape[1:])
            inputs = torch.randn(batch or inputs.shape[0], *shape)
        return model.train(), inputs
    if spec.startswith("timm:") or (":" not in spec and "." not in spec and _is_timm_only(spec)):
        name = spec.split(":", 1)[-1]
        try:
            import timm
        except ImportError:
            raise CliError(f"model {spec!r}: timm is not installed (pip install timm)") from None
        if not timm.is_model(name):
            raise CliError(f"unknown timm model {name!r}; timm.list_models('{name[:4]}*') lists similar names")
        factory: Callable[[], nn.Module] = lambda: timm.create_model(name, pretrained=False)  # noqa: E731
        default_shape: Tuple[int, ...] = tuple(timm.get_pretrained_cfg_value(name, "input_size") or (3, 224, 224))
    elif spec.startswith("torchvision:") or (":" not in spec and "." not in spec):
        name = spec.split(":", 1)[-1]
        try:
            import torchvision
        except ImportError:
            raise CliError(f"model {spec!r}: torchvision is not installed (pip install torchvision)") from None
        if not hasattr(torchvision.models, name) or not callable(getattr(torchvision.models, name)):
            raise CliError(f"unknown model {spec!r}: not a zoo model ({', '.join(sorted(ZOO))}), a torchvision "
                           f"model nor a timm model; use package.module:callable for your own")
        factory = lambda: getattr(torchvision.models, name)(weights=None)  # noqa: E731
        default_shape = (3, 224, 224)
    else:
        module_name, _, attr = spec.partition(":")
        if not attr:
            raise CliError(f"model {spec!r} must be package.module:callable")
        try:
            factory = getattr(importlib.import_module(module_name), attr)
        except (ImportError, AttributeError) as e:
            raise CliError(f"cannot load model {spec!r}: {e}") from None
        default_shape = ()
    shape = input_shape or default_shape
    if not shape:
        raise CliError(f"model {spec!r} needs --input-shape (one sample's shape, e.g. 3,224,224)")
    model = factory()
    if not isinstance(model, nn.Module):
        raise CliError(f"{spec!r} returned {type(model).__name__}, not a torch.nn.Module")
    return model.train(), torch.randn(batch or 8, *shape)


def _shape(text: str) -> Tuple[int, ...]:
    try:
        shape = tuple(int(v) for v in text.split(","))
    except ValueError:
        raise argparse.ArgumentTypeError(f"--input-shape must be comma-separated ints like 3,224,224, got {text!r}")
    if not shape or any(v <= 0 for v in shape):
        raise argparse.ArgumentTypeError(f"--input-shape entries must be positive, got {text!r}")
    return shape


def _positive_int(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a positive int, got {text!r}") from None
    if value <= 0:
        raise argparse.ArgumentTypeError(f"expected a positive int, got {text!r}")
    return value


def _optimize(args: argparse.Namespace):
    import memopt

    model, inputs = resolve_model(args.model, args.batch, args.input_shape)
    config = memopt.Config(device=args.device) if args.device else None
    try:
        om = memopt.optimize(model, args.budget_mb, example_inputs=inputs, config=config, optimizer=args.optimizer)
    except memopt.BudgetError as e:
        print(f"memopt: {e}", file=sys.stderr)
        raise SystemExit(1) from None
    return model, inputs, om


def _report(args: argparse.Namespace) -> int:
    _, _, om = _optimize(args)
    om.report(print=True, top=args.top)
    return 0


def _export(args: argparse.Namespace) -> int:
    _, _, om = _optimize(args)
    path = om.export(args.directory)
    print(f"wrote graph.py, graph.dot, graph.graphml, plan.json and report.md to {path}")
    return 0


def _bench(args: argparse.Namespace) -> int:
    import memopt
    from memopt.core.units import fmt_bytes

    model, inputs, om = _optimize(args)
    stock, ours = memopt.measure(model, inputs, optimizer=args.optimizer), memopt.measure(om, inputs,
                                                                                          optimizer=args.optimizer)

    from memopt.record.timing import step_time_ratio

    ratio, _ = step_time_ratio(om, model, inputs, repeats=args.steps)
    print(f"{args.model}: one training step ({args.optimizer or 'no optimizer'}), measured on {ours.device}")
    print(f"  saved activations: stock {fmt_bytes(stock.saved_bytes)} -> memopt {fmt_bytes(ours.saved_bytes)}")
    print(f"  peak memory:       stock {fmt_bytes(stock.peak_bytes)} -> memopt {fmt_bytes(ours.peak_bytes)}")
    print(f"  step time (forward + backward, median of {args.steps} interleaved): memopt / stock = {ratio:.2f}")
    return 0


def _estimate(args: argparse.Namespace) -> int:
    import memopt

    model, inputs = resolve_model(args.model, args.batch, args.input_shape)
    est = memopt.estimate(model, inputs, device=args.device, optimizer=args.optimizer)
    print(est.report(top=args.top))
    return 0


def _demo(args: argparse.Namespace) -> int:
    from memopt.demo import run_demo

    return run_demo(args)


def _model_options(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("model", help="a zoo model (tiny_resnet, resnet50, ...), a torchvision or timm model name, or "
                                      "package.module:callable returning an nn.Module")
    parser.add_argument("--input-shape", type=_shape, default=None,
                        help="one sample's shape, comma-separated (default: the zoo model's, 3,224,224 for "
                             "torchvision)")
    parser.add_argument("--batch", type=_positive_int, default=None, help="batch size (default: zoo's, else 8)")
    parser.add_argument("--device", default=None, help="device to plan for: cpu, cuda or meta (default: the model's)")
    parser.add_argument("--optimizer", default="sgd", help="optimizer whose state counts: sgd, adam, adamw "
                                                           "(default sgd)")


def _budget_options(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--budget-mb", type=float, default=None,
                        help="peak memory budget of one training step in MiB (default: every technique at its "
                             "default)")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="memopt", description="memopt: fit PyTorch training in less memory.")
    sub = parser.add_subparsers(dest="command", required=True)
    demo = sub.add_parser("demo", help="optimize a built-in ResNet, print its report and measured memory")
    demo.add_argument("--batch", type=_positive_int, default=32, help="batch size (default 32)")
    demo.add_argument("--width", type=_positive_int, default=16, help="channels of the first stage (default 16)")
    _budget_options(demo)
    demo.add_argument("--top", type=_positive_int, default=20, help="rows of the report (default 20)")
    demo.add_argument("--plot", default=None, help="PNG of saved bytes per block before/after, needs matplotlib "
                                                   "(default memopt_demo.png; '' for none)")
    demo.set_defaults(func=_demo)
    for name, func, text in (("report", _report, "plan a model and print its per-node report"),
                             ("export", _export, "plan a model and write graph.py/.dot/.graphml, plan.json, "
                                                 "report.md"),
                             ("bench", _bench, "measure memory and step time, stock vs memopt, side by side")):
        p = sub.add_parser(name, help=text)
        _model_options(p)
        _budget_options(p)
        if name == "export":
            p.add_argument("directory", help="output directory (created)")
        if name == "report":
            p.add_argument("--top", type=_positive_int, default=30, help="rows of the report (default 30)")
        if name == "bench":
            p.add_argument("--steps", type=_positive_int, default=5, help="timed steps of each (default 5)")
        p.set_defaults(func=func)
    est = sub.add_parser("estimate", help="run the cost model alone (no rewrite) and print the baseline")
    _model_options(est)
    est.add_argument("--top", type=_positive_int, default=30, help="rows of the report (default 30)")
    est.set_defaults(func=_estimate)
    return parser


def main(argv: Optional[List[str]] = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    if getattr(args, "budget_mb", None) is not None and not args.budget_mb > 0:
        parser.error(f"--budget-mb must be a positive number of MiB, got {args.budget_mb!r}")
    try:
        return args.func(args)
    except (CliError, ValueError, TypeError, MemoptError) as e:
        # a bad option value or input: one line on stderr naming it, exit code 2 (not a traceback)
        parser.error(str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__)
    return 2
