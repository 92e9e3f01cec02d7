"""python -m tools.bench.stash.bench_llama_text --threads 1   (memory part ~35 min, training ~8 min per seed, loaded 2-core CPU)
(or the parts as separate processes: --part memory, and --part training --seed K for K = 0, 1, 2; on a shared,
oversubscribed CPU use --threads 1: with 2 OpenMP threads the training steps ran about 10x slower here)

A Llama-style decoder under memopt's default config (issue 23): memory at bf16 autocast and float32, and
byte-level language-model training on real text.

Part 1, memory: Hugging Face ``LlamaForCausalLM`` built from a config with random weights (seed 0): 8 layers,
hidden 512, 8 heads (8 key/value heads), intermediate 1376, vocabulary 256 (bytes), sequence 512, batch 1; the
input is the first 512 bytes of the validation text below. For CPU bf16 autocast
(``torch.autocast("cpu", dtype=torch.bfloat16)``, around optimize, measure and the steps) and float32: the
saved-activation bytes and the peak of one training step (forward + backward, next-byte cross-entropy on the
float32 logits) measured by ``memopt.measure`` for the stock model and for ``memopt.optimize(model,
example_inputs=x, optimizer="adamw")`` (``memopt.Config()``, every default), the peak of a step with an AdamW
step (``measure(..., optimizer="adamw")``: parameters, gradients and AdamW state included), whether the training
forward's logits are bit-identical to stock's, and each parameter's gradient cosine against stock autograd on that
loss (``memopt.fidelity.gate.parameter_fidelity``, tiny=1e-3: parameters whose exact gradient norm is at most 1e-3 of
the median are listed apart).

Part 2, training: the text is the standard library's own top-level ``.py`` files (the directory of
``os.__file__``), sorted by name, split by file with a fixed seed (0) into 90% train / 10% validation, read as
bytes. A smaller Llama (``--layers`` 4, ``--hidden`` 128, 4 heads, ``--intermediate`` 344, sequence 128,
``--batch`` 8) is trained for
``--steps`` AdamW steps (default 300; lr 2e-3, weight decay 0.01, float32) from identical initial weights on identical batches (random
windows of the train bytes drawn per seed), stock and memopt (default config) side by side, one step of each in
turn; per seed (0, 1, 2): the final train loss (mean of the last 20 steps), the validation loss (mean over 64
fixed windows of 128 bytes, eval mode, no grad) and the difference memopt - stock. The step time (forward,
backward and AdamW step) is timed per step for both, interleaved in the same process; only ratios are reported
(the machine is shared and its absolute times drift).
Writes docs/results/stash/llama_text.md (after each part, so a partial run leaves the part it finished).
"""
from __future__ import annotations

import argparse
import copy
import fcntl
import json
import os
import statistics
import time
import traceback
from contextlib import nullcontext
from pathlib import Path

import torch
import torch.nn.functional as F
from tabulate import tabulate

import memopt
from memopt.core.units import fmt_bytes
from memopt.fidelity.gate import parameter_fidelity
from tools.bench.common import RESULTS, write_results

OUT = RESULTS / "stash" / "llama_text.md"
PENDING = "(not run yet: the run has not reached this part or stopped before it)"


# ---------------------------------------------------------------- data
def stdlib_text(seed: int = 0):
    """(train bytes, validation bytes, number of train files, of validation files) as uint8 tensors."""
    root = Path(os.__file__).parent
    files = sorted(p for p in root.glob("*.py") if p.is_file())
    order = torch.randperm(len(files), generator=torch.Generator().manual_seed(seed)).tolist()
    n_val = max(1, len(files) // 10)
    val_files = sorted(files[i] for i in order[:n_val])
    train_files = sorted(files[i] for i in order[n_val:])

    def read(paths):
        data = b"".join(p.read_bytes() for p in paths)
        return torch.frombuffer(bytearray(data), dtype=torch.uint8).long()

    return read(train_files), read(val_files), len(train_files), len(val_files)


def llama(layers, hidden, heads, intermediate, seq, seed):
    import transformers as T

    cfg = T.LlamaConfig(vocab_size=256, hidden_size=hidden, num_hidden_layers=layers, num_attention_heads=heads,
                        num_key_value_heads=heads, intermediate_size=intermediate, max_position_embeddings=seq,
                        use_cache=False, tie_word_embeddings=False, attn_implementation="sdpa")
    torch.manual_seed(seed)
    return T.LlamaForCausalLM(cfg).train()


def next_byte_loss(ids):
    """Cross-entropy of the logits (in float32) at each position against the next byte of ``ids``."""
    target = ids[:, 1:].reshape(-1)

    def loss_fn(out):
        logits = out.logits if hasattr(out, "logits") else out["logits"]
        return F.cross_entropy(logits[:, :-1].float().reshape(-1, logits.shape[-1]), target)
    return loss_fn


# ---------------------------------------------------------------- part 1: memory and gradients
def memory_case(dtype_name, ids):
    ctx = (lambda: torch.autocast("cpu", dtype=torch.bfloat16)) if dtype_name == "bf16 autocast" else nullcontext
    x = {"input_ids": ids}
    loss_fn = next_byte_loss(ids)
    model = llama(8, 512, 8, 1376, ids.shape[1], seed=0)
    reference = copy.deepcopy(model)
    row = {"setting": dtype_name}
    t0 = time.perf_counter()
    with ctx():
        om = memopt.optimize(model, example_inputs=x, optimizer="adamw")
    row["optimize_s"] = time.perf_counter() - t0
    row["capture"] = om.plan.capture
    row["plan_saved"] = (om.plan.baseline_saved_bytes, om.plan.estimated_saved_bytes)
    print(f"[memory {dtype_name}] planned in {row['optimize_s']:.0f} s ({om.plan.capture}): estimated saved "
          f"{fmt_bytes(om.plan.baseline_saved_bytes)} -> {fmt_bytes(om.plan.estimated_saved_bytes)}", flush=True)
    with ctx():
        stock = memopt.measure(reference, x, loss_fn)
        ours = memopt.measure(om, x, loss_fn)
        stock_adamw = memopt.measure(reference, x, loss_fn, optimizer="adamw")
        ours_adamw = memopt.measure(om, x, loss_fn, optimizer="adamw")
    row.update(stock=stock, ours=ours, stock_adamw=stock_adamw, ours_adamw=ours_adamw)
    print(f"[memory {dtype_name}] measured saved {fmt_bytes(stock.saved_bytes)} -> {fmt_bytes(ours.saved_bytes)}, "
          f"peak {fmt_bytes(stock.peak_bytes)} -> {fmt_bytes(ours.peak_bytes)}, AdamW-step peak "
          f"{fmt_bytes(stock_adamw.peak_bytes)} -> {fmt_bytes(ours_adamw.peak_bytes)}", flush=True)
    # one training step of each from the same state: forward identical? per-parameter gradient cosine
    for p in list(model.parameters()) + list(reference.parameters()):
        p.grad = None
    with ctx():
        torch.manual_seed(7)
        out = om(**x).logits
        torch.manual_seed(7)
        ref = reference(**x).logits
        row["forward_equal"] = bool(torch.equal(out, ref))
        row["forward_maxdiff"] = float((out.float() - ref.float()).abs().max())
        target = ids[:, 1:].reshape(-1)
        F.cross_entropy(out[:, :-1].float().reshape(-1, 256), target).backward()
        F.cross_entropy(ref[:, :-1].float().reshape(-1, 256), target).backward()
    names = [n for n, _ in reference.named_parameters()]
    fid = parameter_fidelity(names, [p.grad for p in reference.parameters()], [p.grad for p in model.parameters()],
                             tiny=1e-3)
    kept = {n: f for n, f in fid.items() if not f["excluded"]}
    worst = min(kept, key=lambda n: kept[n]["cosine"])
    row["worst"] = (worst, kept[worst]["cosine"], kept[worst]["relative_error"])
    row["below_099"] = sorted((f["cosine"], n) for n, f in kept.items() if f["cosine"] < 0.99)
    row["n_params"] = (len(kept), len(fid))
    row["apart"] = sorted(n for n, f in fid.items() if f["excluded"])
    row["median_cos"] = statistics.median(f["cosine"] for f in kept.values())
    # what stays exact, largest first (the report's rows; per-submodule plans group repeated blocks)
    exact = {}
    for node in om.plan.nodes:
        if node.technique == "exact" and node.saved_bytes_after > 0:
            key = (node.op, node.reason[:90])
            n, b = exact.get(key, (0, 0))
            exact[key] = (n + 1, b + node.saved_bytes_after)
    row["exact_top"] = sorted(exact.items(), key=lambda kv: -kv[1][1])[:8]
    print(f"[memory {dtype_name}] forward equal {row['forward_equal']}, worst cosine {row['worst']}", flush=True)
    return row


def memory_section(rows, failures):
    lines = []
    table = []
    for r in rows:
        s, o, sa, oa = r["stock"], r["ours"], r["stock_adamw"], r["ours_adamw"]
        table.append([r["setting"], r["capture"], fmt_bytes(s.saved_bytes), fmt_bytes(o.saved_bytes),
                      f"{s.saved_bytes / o.saved_bytes:.2f}x", fmt_bytes(s.peak_bytes), fmt_bytes(o.peak_bytes),
                      f"{s.peak_bytes / o.peak_bytes:.2f}x", fmt_bytes(sa.peak_bytes), fmt_bytes(oa.peak_bytes),
                      f"{sa.peak_bytes / oa.peak_bytes:.2f}x"])
    if table:
        lines += [tabulate(table, ["setting", "capture", "saved, stock", "saved, memopt", "ratio", "peak, stock",
                                   "peak, memopt", "ratio", "AdamW-step peak, stock", "AdamW-step peak, memopt",
                                   "ratio"], tablefmt="github", disable_numparse=True), ""]
        est = [[r["setting"], fmt_bytes(r["plan_saved"][0]), fmt_bytes(r["plan_saved"][1]),
                "yes" if r["plan_saved"] == (r["stock"].saved_bytes, r["ours"].saved_bytes) else "no",
                f"{r['optimize_s']:.0f} s"] for r in rows]
        lines += ["Estimates (`om.plan`) beside the measurements, and the time `memopt.optimize` took on this "
                  "(loaded) machine:", "",
                  tabulate(est, ["setting", "estimated saved, stock", "estimated saved, memopt",
                                 "= measured", "optimize time"], tablefmt="github", disable_numparse=True), ""]
        grad = [[r["setting"], "yes" if r["forward_equal"] else f"NO (max abs diff {r['forward_maxdiff']:.3g})",
                 f"{r['worst'][1]:.4f}", r["worst"][0], f"{r['median_cos']:.5f}",
                 f"{r['n_params'][0] - len(r['below_099'])} of {r['n_params'][0]}", len(r["apart"])] for r in rows]
        lines += ["One training step from the same weights (next-byte cross-entropy), memopt against stock:", "",
                  tabulate(grad, ["setting", "training forward bit-identical", "worst param cos", "worst parameter",
                                  "median cos", "params >= 0.99", "listed apart (tiny)"], tablefmt="github", disable_numparse=True), ""]
        for r in rows:
            if r["below_099"]:
                lines.append(f"- {r['setting']}: below 0.99: " + ", ".join(f"{n} {c:.4f}" for c, n in r["below_099"]))
            if r["apart"]:
                lines.append(f"- {r['setting']}: listed apart (exact gradient norm <= 1e-3 of the median): "
                             + ", ".join(r["apart"]))
        lines.append("")
        for r in rows:
            lines += [f"What stays exact under {r['setting']} (memopt's plan, largest saved bytes first; the op, "
                      "the start of the report's reason, nodes, bytes):", "",
                      tabulate([[op, why, n, fmt_bytes(b)] for (op, why), (n, b) in r["exact_top"]],
                               ["op", "why (report)", "nodes", "saved"], tablefmt="github", disable_numparse=True), ""]
    for name, err in failures:
        lines += [f"**{name}: memopt failed** ({err})", ""]
    return "\n".join(lines)


# ---------------------------------------------------------------- part 2: training on the standard library's text
def train_seed(seed, train, val, steps, batch, seq, lr, size, control=False):
    model = llama(size[0], size[1], 4, size[2], seq, seed=seed)
    stock = copy.deepcopy(model)
    gen = torch.Generator().manual_seed(1000 + seed)

    def draw():
        starts = torch.randint(0, len(train) - seq, (batch,), generator=gen)
        return torch.stack([train[s:s + seq] for s in starts.tolist()])

    first = draw()
    t0 = time.perf_counter()
    if control:  # the noise floor: stock against stock with every weight scaled by (1 + 1e-6 N(0, 1))
        om = model
        with torch.no_grad():
            noise = torch.Generator().manual_seed(2000 + seed)
            for p in model.parameters():
                p.mul_(1 + 1e-6 * torch.randn(p.shape, generator=noise))
    else:
        om = memopt.optimize(model, example_inputs={"input_ids": first}, optimizer="adamw")
    optimize_s = time.perf_counter() - t0
    saved = memopt.measure(stock, {"input_ids": first}, next_byte_loss(first)).saved_bytes, \
        memopt.measure(om, {"input_ids": first}, next_byte_loss(first)).saved_bytes
    print(f"[train seed {seed}] planned in {optimize_s:.0f} s ({getattr(om, 'plan', om).__class__.__name__}); saved "
          f"{fmt_bytes(saved[0])} -> {fmt_bytes(saved[1])}", flush=True)
    opt_s = torch.optim.AdamW(stock.parameters(), lr=lr, weight_decay=0.01)
    opt_m = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=0.01)
    losses = {"stock": [], "memopt": []}
    times = {"stock": [], "memopt": []}
    first_equal = None
    ids = first
    for step in range(steps):
        if step:
            ids = draw()
        target = ids[:, 1:].reshape(-1)
        order = (("stock", stock, opt_s), ("memopt", om, opt_m))
        if step % 2:
            order = order[::-1]  # alternate which goes first
        for name, net, opt in order:
            t = time.perf_counter()
            logits = net(input_ids=ids).logits
            loss = F.cross_entropy(logits[:, :-1].reshape(-1, 256), target)
            opt.zero_grad(set_to_none=True)
            loss.backward()
            opt.step()
            times[name].append(time.perf_counter() - t)
            losses[name].append(loss.item())
        if step == 0:
            first_equal = losses["stock"][0] == losses["memopt"][0]
        if step % 25 == 0 or step == steps - 1:
            print(f"[train seed {seed}] step {step}: loss stock {losses['stock'][-1]:.4f} memopt "
                  f"{losses['memopt'][-1]:.4f}", flush=True)
    val_loss = {"stock": evaluate(stock, val, seq), "memopt": evaluate(model, val, seq)}
    warm = slice(5, None)
    ratios = [m / s for m, s in zip(times["memopt"][warm], times["stock"][warm])]
    return {"seed": seed, "train": {k: statistics.mean(v[-20:]) for k, v in losses.items()}, "val": val_loss,
            "first_equal": first_equal, "first_loss": losses["stock"][0],
            "ratio_sum": sum(times["memopt"][warm]) / sum(times["stock"][warm]),
            "ratio_median": statistics.median(ratios), "saved": saved, "optimize_s": optimize_s,
            "capture": om.plan.capture if hasattr(om, "plan") else "none (control)"}


@torch.no_grad()
def evaluate(model, val, seq, windows=64, batch=8):
    model.eval()
    starts = torch.linspace(0, len(val) - seq - 1, windows).long().tolist()
    total = 0.0
    for i in range(0, windows, batch):
        ids = torch.stack([val[s:s + seq] for s in starts[i:i + batch]])
        logits = model(input_ids=ids).logits
        total += F.cross_entropy(logits[:, :-1].reshape(-1, 256), ids[:, 1:].reshape(-1)).item() * len(ids)
    model.train()
    return total / windows


def training_section(results, failures, data_note):
    lines = [data_note, ""]
    if results:
        table = []
        for r in results:
            table.append([r["seed"], "yes" if r["first_equal"] else "NO", f"{r['train']['stock']:.4f}",
                          f"{r['train']['memopt']:.4f}", f"{r['train']['memopt'] - r['train']['stock']:+.4f}",
                          f"{r['val']['stock']:.4f}", f"{r['val']['memopt']:.4f}",
                          f"{r['val']['memopt'] - r['val']['stock']:+.4f}", f"{r['ratio_median']:.2f}x",
                          f"{r['ratio_sum']:.2f}x",
                          f"{fmt_bytes(r['saved'][0])} -> {fmt_bytes(r['saved'][1])}"])
        if len(results) > 1:
            mean = lambda f: statistics.mean(f(r) for r in results)  # noqa: E731
            table.append(["mean", "", f"{mean(lambda r: r['train']['stock']):.4f}",
                          f"{mean(lambda r: r['train']['memopt']):.4f}",
                          f"{mean(lambda r: r['train']['memopt'] - r['train']['stock']):+.4f}",
                          f"{mean(lambda r: r['val']['stock']):.4f}", f"{mean(lambda r: r['val']['memopt']):.4f}",
                          f"{mean(lambda r: r['val']['memopt'] - r['val']['stock']):+.4f}",
                          f"{mean(lambda r: r['ratio_median']):.2f}x", f"{mean(lambda r: r['ratio_sum']):.2f}x", ""])
        lines += [tabulate(table, ["seed", "step-0 loss identical", "train loss, stock", "train loss, memopt",
                                   "memopt - stock", "val loss, stock", "val loss, memopt", "memopt - stock",
                                   "step time memopt/stock (median of per-step ratios)",
                                   "(total time ratio)", "saved bytes per step (measured)"],
                           tablefmt="github", disable_numparse=True), "",
                  f"Losses in nats per byte; step-0 loss (before any update) {results[0]['first_loss']:.4f} "
                  f"(ln 256 = {torch.log(torch.tensor(256.0)).item():.4f}); capture "
                  f"{results[0]['capture']}; `memopt.optimize` took "
                  + ", ".join(f"{r['optimize_s']:.0f} s" for r in results) + " per seed.", ""]
    for name, err in failures:
        lines += [f"**{name}: memopt failed** ({err})", ""]
    return "\n".join(lines)


# ---------------------------------------------------------------- the file
SECTIONS = ("## 1. Memory", "## 2. Training", "## Reading")


def _kept_sections(path):
    """{heading prefix: text} of the sections already in the results file (another part's run)."""
    try:
        text = Path(path).read_text()
    except OSError:
        return {}
    out, starts = {}, [(text.find(h), h) for h in SECTIONS if text.find(h) >= 0]
    starts.sort()
    for i, (at, heading) in enumerate(starts):
        end = starts[i + 1][0] if i + 1 < len(starts) else len(text)
        out[heading] = text[at:end].split("\n", 1)[1].strip()
    return out


def write(args, memory, training, reading):
    kept = _kept_sections(args.out) if args.part != "all" else {}
    if args.part == "training":
        memory = kept.get(SECTIONS[0], memory)
    if args.part == "memory":
        training = kept.get(SECTIONS[1], training)
    reading = kept.get(SECTIONS[2], reading)
    body = "\n".join(["## 1. Memory: Llama, 8 layers, hidden 512, sequence 512, batch 1", "", memory, "",
                      "## 2. Training: byte-level language model on the standard library's source", "", training,
                      "", "## Reading", "", reading])
    memory_base = f"python -m tools.bench.stash.bench_llama_text --threads {args.memory_threads or args.threads}"
    base = f"python -m tools.bench.stash.bench_llama_text --threads {args.threads}" \
        + "".join(f" --{k} {getattr(args, k)}" for k, d in (("layers", 4), ("hidden", 128), ("intermediate", 344),
                                                          ("batch", 8)) if getattr(args, k) != d) \
        + (f" --steps {args.steps}" if args.steps != 300 else "") + (f" --seeds {args.seeds}" if args.seeds != 3 else "")
    training_runs = ([f"{base} --part training"] if args.seed is None else
                     [f"{base} --part training --seed {k}" for k in range(args.seeds)])
    if args.memory_threads:
        training_runs = [f"{run} --memory-threads {args.memory_threads}" for run in training_runs]
    command = base if args.part == "all" else "` and `".join([f"{memory_base} --part memory"] + training_runs)
    title = "Llama decoder under memopt's default config: memory and byte-level training"
    write_results(args.out, title, command, __doc__, body)
    if args.part != "all":  # the two parts ran at the same time, as two processes
        text = Path(args.out).read_text().replace(f"`{command}` (", f"`{command}` (separate processes, ", 1)
        Path(args.out).write_text(text)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--steps", type=int, default=300)
    parser.add_argument("--seeds", type=int, default=3)
    parser.add_argument("--part", choices=("all", "memory", "training"), default="all",
                        help="one part only, keeping the other part's section of the results file")
    parser.add_argument("--seed", type=int, default=None,
                        help="train this seed only, merging with the seeds already in the results file (one "
                             "process per seed)")
    parser.add_argument("--memory-threads", type=int, default=None,
                        help="(the results file's command line only) --threads of the --part memory run, when the "
                             "training runs used another")
    parser.add_argument("--control", action="store_true",
                        help="print the noise floor instead: stock against stock with weights scaled by "
                             "1 + 1e-6 N(0, 1), same batches (no file written)")
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--hidden", type=int, default=128)
    parser.add_argument("--intermediate", type=int, default=344)
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--out", default=str(OUT))
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    start = time.perf_counter()
    train, val, n_train, n_val = stdlib_text()
    data_note = (f"Text: {n_train + n_val} top-level `.py` files of the standard library at "
                 f"`{Path(os.__file__).parent}` ({n_train} train files, {len(train) / 2**20:.2f} MiB; {n_val} "
                 f"validation files, {len(val) / 2**20:.2f} MiB). Llama {args.layers} layers, hidden {args.hidden}, 4 heads, "
                 f"intermediate {args.intermediate}; {args.steps} steps, batch {args.batch} x 128 bytes, "
                 f"seeds 0..{args.seeds - 1}.")
    memory, training, reading = PENDING, PENDING, "(written by hand after the run)"

    rows, failures = [], []
    if args.part in ("all", "memory") and not args.control:
        ids = val[:512].unsqueeze(0).clone()
        for setting in ("bf16 autocast", "float32"):
            try:
                rows.append(memory_case(setting, ids))
            except Exception as exc:  # record and go on: the benchmark reports a failed configuration
                traceback.print_exc()
                failures.append((setting, f"{type(exc).__name__}: {str(exc)[:300]}"))
            memory = memory_section(rows, failures)
            write(args, memory, training, reading)
            print(f"[{time.perf_counter() - start:.0f} s elapsed]", flush=True)

    results, tfail = [], []
    seeds = range(args.seeds) if args.seed is None else [args.seed]
    if args.control:  # prints only; the results file is left as it is
        for seed in seeds:
            r = train_seed(seed, train, val, args.steps, batch=args.batch, seq=128, lr=2e-3,
                           size=(args.layers, args.hidden, args.intermediate), control=True)
            print(f"[control seed {seed}] perturbed - stock: train {r['train']['memopt'] - r['train']['stock']:+.4f}, "
                  f"validation {r['val']['memopt'] - r['val']['stock']:+.4f}", flush=True)
        return
    for seed in (seeds if args.part in ("all", "training") else []):
        try:
            results.append(train_seed(seed, train, val, args.steps, batch=args.batch, seq=128, lr=2e-3,
                                      size=(args.layers, args.hidden, args.intermediate)))
        except Exception as exc:
            traceback.print_exc()
            tfail.append((f"seed {seed}", f"{type(exc).__name__}: {str(exc)[:300]}"))
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        with open(args.out, "a") as lock:  # one process per seed: read, merge and write under a lock
            fcntl.flock(lock, fcntl.LOCK_EX)
            if args.seed is not None:  # merge with the seeds the other processes wrote
                results, tfail = _merged_seeds(args.out, results, tfail)
            training = training_section(sorted(results, key=lambda r: r["seed"]), tfail, data_note)
            training += "\n\n" + "\n".join(f"<!-- seed-result {json.dumps(r)} -->" for r in results)
            training += "".join(f"\n<!-- seed-failure {json.dumps(f)} -->" for f in tfail)
            write(args, memory, training, reading)
        print(f"[{time.perf_counter() - start:.0f} s elapsed]", flush=True)


def _merged_seeds(path, results, failures):
    """This process's seeds and those already in the results file (written by the other seeds' processes)."""
    try:
        text = Path(path).read_text()
    except OSError:
        return results, failures
    mine = {r["seed"] for r in results} | {f[0] for f in failures}
    for line in text.splitlines():
        if line.startswith("<!-- seed-result "):
            r = json.loads(line[len("<!-- seed-result "):-len(" -->")])
            if r["seed"] not in mine:
                results.append(r)
        elif line.startswith("<!-- seed-failure "):
            f = json.loads(line[len("<!-- seed-failure "):-len(" -->")])
            if f[0] not in mine:
                failures.append(tuple(f))
    return results, failures

if __name__ == "__main__":
    main()
