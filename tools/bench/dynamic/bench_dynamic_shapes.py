"""python -m tools.bench.dynamic.bench_dynamic_shapes

Training steps of a tiny Hugging Face BERT on dynamic-padded batches: memopt against stock PyTorch.

Sequence lengths come from a fixed-seed log-normal distribution of sentence lengths clipped to 16-512 tokens;
each batch is padded to its longest sequence, rounded up to a multiple of 8 (``pad_to_multiple_of=8``, as
``DataCollatorWithPadding`` is commonly used), with the attention mask marking the padding. The same batches
train a stock model and a memopt model (``memopt.optimize`` on the first batch) built from the same seed, one
step of each in turn, so load on the machine falls on both alike. Planning time is what memopt spent on
input signatures it had not seen: full builds (capture, soundness check, plan, fidelity gate) and the cheap
checks that let a new length reuse a plan (``om.shape_stats``). Its share is of memopt's whole training time,
planning included. Step-time ratio: the median memopt step over steps that planned nothing, against stock's
median step (both timed forward, backward and AdamW step).
"""
from __future__ import annotations

import argparse
import statistics
import sys
import time

import torch

import memopt
from memopt.builder.optimized import MAX_SIGNATURES
from tools.bench.common import RESULTS, write_results_file

OUT = RESULTS / "dynamic" / "dynamic_shapes.md"
SMALL = dict(hidden_size=128, num_hidden_layers=2, num_attention_heads=4, intermediate_size=256)


def lengths(steps: int, batch: int, seed: int, median: float, sigma: float, multiple: int) -> list:
    """The padded length of each batch: the longest of ``batch`` log-normal sentence lengths, clipped to
    16-512, rounded up to ``multiple``."""
    gen = torch.Generator().manual_seed(seed)
    raw = torch.exp(torch.randn(steps, batch, generator=gen) * sigma + torch.log(torch.tensor(median)))
    longest = raw.clamp(16, 512).amax(1).ceil().long()
    return [min(512, -(-int(n) // multiple) * multiple) for n in longest]


def batch_for(step: int, length: int, batch: int, seed: int, vocab: int) -> dict:
    gen = torch.Generator().manual_seed(seed * 100003 + step)
    ids = torch.randint(1, vocab, (batch, length), generator=gen)
    own = torch.randint(16, length + 1, (batch,), generator=gen)
    own[0] = length  # the longest sequence sets the padded length
    mask = (torch.arange(length)[None, :] < own[:, None]).long()
    return {"input_ids": ids * mask, "attention_mask": mask}


def make_model(seed: int):
    import transformers as T

    torch.manual_seed(seed)
    return T.BertModel(T.BertConfig(vocab_size=1000, **SMALL)).train()


def step(net, opt, x) -> float:
    start = time.perf_counter()
    out = net(**x).last_hidden_state
    out.pow(2).mean().backward()
    opt.step()
    opt.zero_grad(set_to_none=True)
    return time.perf_counter() - start


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[1])
    parser.add_argument("--steps", type=int, default=1000)
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--median", type=float, default=48.0, help="median sentence length (tokens)")
    parser.add_argument("--sigma", type=float, default=0.8, help="log-normal sigma of sentence lengths")
    parser.add_argument("--multiple", type=int, default=8, help="pad each batch to a multiple of this")
    parser.add_argument("--config", choices=("default", "exact"), default="default")
    parser.add_argument("--shape-checks", choices=("range", "every"), default="range",
                        help="Config.shape_checks: check only sizes outside those checked, or every new size")
    parser.add_argument("--dynamic", choices=("none", "true", "false"), default="none",
                        help="Config.dynamic: export at the example's sizes first (none), dynamic from the start "
                             "(true), or never dynamic (false)")
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", default=str(OUT))
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)
    command = "python -m tools.bench.dynamic.bench_dynamic_shapes" + (" " + " ".join(sys.argv[1:]) if argv is None
                                                                       and sys.argv[1:] else "")
    sizes = lengths(args.steps, args.batch, args.seed, args.median, args.sigma, args.multiple)
    stock, mine = make_model(args.seed), make_model(args.seed)
    dynamic = {"none": None, "true": True, "false": False}[args.dynamic]
    config = memopt.Config(shape_checks=args.shape_checks, dynamic=dynamic) if args.config == "default" else \
        memopt.Config.exact(shape_checks=args.shape_checks, dynamic=dynamic)
    first = batch_for(0, sizes[0], args.batch, args.seed, 1000)
    start = time.perf_counter()
    om = memopt.optimize(mine, example_inputs=first, config=config, optimizer="adamw")
    first_wall, first_plan = time.perf_counter() - start, om.shape_stats["plan_seconds"]
    opts = [torch.optim.AdamW(m.parameters(), lr=1e-4) for m in (stock, mine)]
    torch.manual_seed(1)  # the same weights and dropout: the training forward must be identical
    a = stock(**first).last_hidden_state
    torch.manual_seed(1)
    same_forward = bool(torch.equal(a, om(**first).last_hidden_state))
    del a
    stock_times, mine_times, planned_steps, halfway = [], [], [], None
    for i, length in enumerate(sizes):
        x = batch_for(i, length, args.batch, args.seed, 1000)
        if i == len(sizes) // 2:
            halfway = om.shape_stats
        stock_times.append(step(stock, opts[0], x))
        before = om.shape_stats
        mine_times.append(step(om, opts[1], x))
        after = om.shape_stats
        if (after["planned"], after["reused"]) != (before["planned"], before["reused"]):
            planned_steps.append(i)
    stats = om.shape_stats
    planning = stats["plan_seconds"] + stats["reuse_seconds"]  # the first build (optimize) included
    total = sum(mine_times) + first_wall
    plain = [t for i, t in enumerate(mine_times) if i not in planned_steps]
    ratio = statistics.median(plain) / statistics.median(stock_times)
    distinct = len(set(sizes))
    late = stats["plan_seconds"] + stats["reuse_seconds"] - halfway["plan_seconds"] - halfway["reuse_seconds"]
    late_share = late / sum(mine_times[len(sizes) // 2:]) * 100
    fresh = len(set(sizes[len(sizes) // 2:]) - set(sizes[:len(sizes) // 2]))
    checked = stats["reused"] - stats["remembered"] - stats["inside"]
    lines = [
        command, "",
        f"# Dynamic shapes: {args.steps} training steps of a tiny BERT on dynamic-padded batches", "",
        f"torch {torch.__version__}, CPU, {torch.get_num_threads()} thread(s); memopt.Config"
        f"{'' if args.config == 'default' else '.exact'}(shape_checks={args.shape_checks!r}, dynamic={dynamic!r}), "
        f"AdamW, batch {args.batch}.", "",
        __doc__.split("\n\n", 2)[2].strip(), "",
        f"Padded lengths: {distinct} distinct values in {min(sizes)}-{max(sizes)} (median "
        f"{int(statistics.median(sizes))}).", "",
        "| | value |", "|---|---|",
        f"| training steps | {args.steps} |",
        f"| input signatures planned (full build: capture, check, plan, gate) | {stats['planned']}: the first "
        f"({first_plan:.2f} s) and {stats['planned'] - 1} re-plans ({stats['plan_seconds'] - first_plan:.2f} s) |",
        f"| input signatures that reused a plan | {stats['reused']}: {checked} after a check, {stats['inside']} "
        f"inside the lengths checked, no check, {stats['remembered']} checked before, no check (a length comes "
        f"back after the cache of {MAX_SIGNATURES} dropped it) |",
        f"| time in reuse checks (failed ones included) | {stats['reuse_seconds']:.2f} s, "
        f"{stats['reuse_seconds'] / max(checked, 1) * 1000:.0f} ms per checked reuse |",
        f"| re-plan causes | {'; '.join(f'{k} (x{v})' for k, v in stats['replans'].items()) or 'none'} |",
        f"| planning time | {planning:.2f} s |",
        f"| memopt training time, planning included | {total:.2f} s |",
        f"| **planning share of training time** | **{planning / total * 100:.2f} %** (target: under 5 %) |",
        f"| planning share over the second half of the steps | {late_share:.2f} % ({fresh} lengths first seen "
        f"there) |",
        f"| stock training time | {sum(stock_times):.2f} s |",
        f"| median step, stock / memopt (steps without planning) | {statistics.median(stock_times) * 1000:.1f} / "
        f"{statistics.median(plain) * 1000:.1f} ms |",
        f"| **step-time ratio** memopt / stock (medians) | **x{ratio:.2f}** |",
        f"| whole run, memopt / stock | x{total / sum(stock_times):.2f} |",
        f"| first training forward bit-identical to stock | {same_forward} |",
        "",
        f"Saved bytes per step at the last batch's length ({sizes[-1]} tokens): stock "
        f"{om.plan.baseline_saved_bytes / 2**20:.2f} MiB, memopt {om.plan.estimated_saved_bytes / 2**20:.2f} MiB "
        f"(estimates of the reused plan).",
    ]
    write_results_file(args.out, "\n".join(lines) + "\n")


if __name__ == "__main__":
    main()
