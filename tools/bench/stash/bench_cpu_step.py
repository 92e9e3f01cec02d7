"""python -m tools.bench.stash.bench_cpu_step --threads 1   (about 3 minutes on a 2-core CPU)

CPU step time of memopt's default plan against stock, side by side in one process (issue 23's target: <= 1.25x
for transformers). Hugging Face encoder and decoder from configs with random weights (seed 0): BERT and Llama,
4 layers, hidden 256, 4 heads, batch 8, sequence 128, training mode. One step = forward, the mean of the squared
last hidden state, backward. Steps of stock and memopt alternate (``--steps`` each, the first 2 dropped), so
load from other processes falls on both; the ratio of medians is reported, with the saved bytes
(``memopt.measure``) and whether the forward is bit-identical. Run with the fused C kernels (the default) and with
``MEMOPT_KERNELS=torch``-equivalent plain PyTorch (``memopt.runtime.kernels.forced("torch")``) to show what they buy.
"""
from __future__ import annotations

import argparse
import copy
import os
import platform
import statistics
import subprocess
import time
from pathlib import Path

import torch
from tabulate import tabulate

import memopt
from memopt.runtime import kernels

OUT = Path("docs/results/stash/cpu_step.md")


def _model(kind: str):
    import transformers as T
    torch.manual_seed(0)
    if kind == "BERT":
        cfg = T.BertConfig(vocab_size=1000, hidden_size=256, num_hidden_layers=4, num_attention_heads=4,
                           intermediate_size=1024)
        model = T.BertModel(cfg)
    else:
        cfg = T.LlamaConfig(vocab_size=1000, hidden_size=256, num_hidden_layers=4, num_attention_heads=4,
                            num_key_value_heads=4, intermediate_size=688)
        model = T.LlamaModel(cfg)
    return model.train(), torch.randint(0, 1000, (8, 128), generator=torch.Generator().manual_seed(1))


def _step(module, x):
    out = module(x)
    hidden = out[0] if isinstance(out, (tuple, list)) else out.last_hidden_state
    hidden.float().square().mean().backward()
    return hidden.detach()


def _row(kind: str, path: str, steps: int) -> list:
    model, x = _model(kind)
    stock = copy.deepcopy(model)
    om = memopt.optimize(model, example_inputs=x)
    torch.manual_seed(3)
    a = _step(stock, x)
    torch.manual_seed(3)
    b = _step(om, x)
    times = {"stock": [], "memopt": []}
    with kernels.forced("torch" if path == "plain PyTorch" else None):
        for _ in range(steps):
            for name, module in (("stock", stock), ("memopt", om)):
                start = time.perf_counter()
                _step(module, x)
                times[name].append(time.perf_counter() - start)
    s, m = (statistics.median(times[k][2:]) for k in ("stock", "memopt"))
    saved = (memopt.measure(stock, x).saved_bytes, memopt.measure(om, x).saved_bytes)
    return [kind, path, f"{s * 1e3:.1f}", f"{m * 1e3:.1f}", f"{m / s:.2f}", f"{saved[0] / saved[1]:.2f}",
            "yes" if torch.equal(a, b) else "NO"]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--out", type=Path, default=OUT)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    rows = [_row(kind, path, args.steps) for kind in ("BERT", "Llama") for path in ("C kernels", "plain PyTorch")]
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True).stdout.strip()
    text = [f"# CPU step time, memopt default vs stock", "",
            f"Command: `python -m tools.bench.stash.bench_cpu_step --threads {args.threads} --steps {args.steps}` "
            f"(torch {torch.__version__}, {platform.machine()}, memopt at {commit}; load average "
            f"{os.getloadavg()[0]:.1f} at the end: other jobs may share the cores, the alternation puts them on both "
            f"columns).", "", __doc__.split("\n\n", 1)[1].strip(), "",
            tabulate(rows, ["model", "memopt codecs", "stock ms", "memopt ms", "step ratio", "saved ratio",
                            "forward identical"], tablefmt="github"), ""]
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text("\n".join(text))
    print("\n".join(text))


if __name__ == "__main__":
    main()
