"""python -m tools.bench.fewbit.bench_fewbit_ops

Benchmark: few-bit activations one by one, side by side with the native op in one process.

Per activation and bit width: the table's error ∫(f'-q)^2 on (-10, 10) (uniform weight, the shipped
tables), the saved bytes per element measured with saved-tensor hooks, and forward / backward time
as a ratio to the native op (median of interleaved repeats on 2^20 float32 elements, CPU).
Writes docs/results/fewbit/fewbit_ops.md.
"""
from __future__ import annotations

import argparse
import statistics
import time

import torch
from tabulate import tabulate

import memopt
from memopt.cost_model.storage import SavedTensorRecorder
from memopt.fewbit.activations import ACTIVATIONS
from memopt.fewbit.tables import table_error
from memopt.fewbit.ops import FewBitSpec, fewbit_activation
from tools.bench.common import RESULTS, write_results_file

N = 1 << 20


def _args(name, bits):
    act = ACTIVATIONS[name]
    p = act.params({})
    if act.exact:
        return name, p, 1, (), tuple(act.mask_levels(dict(p)))
    borders, levels = memopt.fewbit_table(name, bits)
    return name, p, bits, tuple(borders.tolist()), tuple(levels.tolist())


def _saved_bytes(fn, x):
    with SavedTensorRecorder() as rec:
        fn(x)
    return sum({s.key: s.nbytes for s in rec.saved}.values())


def _times(fn, x, grad, repeats):
    fwd, bwd = [], []
    for _ in range(repeats):
        xi = x.detach().requires_grad_()
        t0 = time.perf_counter()
        y = fn(xi)
        t1 = time.perf_counter()
        y.backward(grad)
        t2 = time.perf_counter()
        fwd.append(t1 - t0)
        bwd.append(t2 - t1)
    return statistics.median(fwd), statistics.median(bwd)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", default=str(RESULTS / "fewbit" / "fewbit_ops.md"))
    parser.add_argument("--repeats", type=int, default=15)
    args = parser.parse_args()
    torch.manual_seed(0)
    x = torch.randn(N) * 2
    grad = torch.randn(N)
    rows = []
    for name, act in ACTIVATIONS.items():
        native = lambda t, act=act: act(t, act.params({}))  # noqa: E731
        native_bytes = _saved_bytes(native, x.requires_grad_())
        for bits in ([1] if act.exact else [1, 2, 3, 4, 8]):
            a = _args(name, bits)
            ours = lambda t, a=a: fewbit_activation(t, FewBitSpec(*a))  # noqa: E731
            error = "exact" if act.exact else f"{table_error(name, torch.tensor(a[3]), torch.tensor(a[4])):.3g}"
            # interleave the two so that machine noise hits both alike
            nf, nb = _times(native, x, grad, 3)
            of, ob = _times(ours, x, grad, 3)
            for _ in range(args.repeats // 3):
                f1, b1 = _times(native, x, grad, 3)
                f2, b2 = _times(ours, x, grad, 3)
                nf, nb, of, ob = min(nf, f1), min(nb, b1), min(of, f2), min(ob, b2)
            ours_bytes = _saved_bytes(ours, x.detach().requires_grad_())
            rows.append([name, bits, error, f"{native_bytes / N:.3f}", f"{ours_bytes / N:.4f}",
                         f"{native_bytes / ours_bytes:.1f}x", f"{of / nf:.2f}", f"{ob / nb:.2f}"])
    table = tabulate(rows, headers=["activation", "bits", "table error", "stock bytes/elem", "few-bit bytes/elem",
                                    "smaller", "forward time ratio", "backward time ratio"], tablefmt="github")
    text = (f"# Few-bit activations vs native ops\n\nCommand: `python -m tools.bench.fewbit.bench_fewbit_ops` "
            f"(torch {torch.__version__}, CPU, {torch.get_num_threads()} threads, 2^20 float32 elements; "
            f"times are the best of {args.repeats} interleaved runs; ratio > 1 means slower than native).\n\n{table}\n")
    write_results_file(args.out, text)


if __name__ == "__main__":
    main()
