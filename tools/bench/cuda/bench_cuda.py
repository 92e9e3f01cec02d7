"""python -m tools.bench.cuda.bench_cuda   (one prepared run on a lent GPU; it stops starting rows at --budget-s)

Benchmark on a CUDA GPU: saved bytes, peak and step time of memopt against stock, torch.utils.checkpoint and
torch.compile with an activation memory budget, one training step (forward, backward, SGD-momentum step).

Models (random weights): torchvision ResNet-50 at 224x224, batches 32 and 128; a BERT-base encoder
(Hugging Face ``BertModel``: 12 layers, hidden 768, 12 heads) at batch 32 x 512 tokens; a Llama-style decoder
(``LlamaForCausalLM``: 8 layers, hidden 1024, 16 heads, intermediate 2816, vocabulary 32000) at 1 x 2048 tokens.
Each in float32 and under bf16 autocast (``torch.autocast("cuda", torch.bfloat16)`` around optimize, measure
and the steps), the decoder under bf16 only. Rows per model and precision:
- stock: the model as it is;
- ``memopt.Config()``: every default, the fidelity gate on;
- ``torch.utils.checkpoint`` around every block (non-reentrant);
- memopt at checkpointing's peak: ``memopt.optimize(model, budget_mb=<checkpointing's measured peak>)``;
- ``torch.compile`` with ``torch._functorch.config.activation_memory_budget = 0.5`` (its partitioner's
  recomputation; compile time in the setup column);
- the first model (ResNet-50 batch 32), float32 only: ``MEMOPT_KERNELS=torch``, the plain PyTorch path, where
  the default runs the Triton kernels that passed their first-use check (``memopt.runtime.verify``), with a
  label that says whether one step's gradients are bit-identical to the default's, or equal to float32 rounding
  (the Triton BN backward sums in another order), in deterministic mode for that check.
Before the rows: every kernel family's first-use check on the device, float32 and bf16 (``kernels.prepare``),
its verdicts and the time it took. After them, within ``--largest-s`` seconds each: the largest batch of ResNet-50
224 (and with ``--largest-models resnet50,bert,llama`` of the CPU peak benchmark's BERT-shaped encoder and Llama)
whose step peak fits ``--cap-mb`` (doubling from batch 32, then bisection, at most ``--largest-probes`` steps
each), for stock, checkpointing, memopt default and memopt with ``budget_mb`` at the cap, with samples/s at that
batch (3 timed steps after a warm-up; absolute, batches differ).
Saved bytes from ``memopt.measure`` (saved-tensor hooks; asserted equal to the cost model's estimate for memopt's
rows in float32), measured peak from the caching allocator (``torch.cuda.max_memory_allocated`` during the
step, less other tensors' memory), step time as a ratio to stock (interleaved step by step in one process, each
step synchronised, median of 5 after 2 warm-ups; cuDNN autotuning on, as users run).

The file is rewritten after every row, so a run cut short keeps what it measured; past ``--budget-s`` seconds
no new row starts (those left are listed as not run). Without a GPU, ``--device cpu --smoke --out /tmp/cuda.md``
checks the script itself on small models (the kernel checks only under TRITON_INTERPRET=1).
"""
from __future__ import annotations

import argparse
import contextlib
import copy
import time
import warnings
from typing import Callable, Dict, List, NamedTuple, Tuple

import torch
from tabulate import tabulate

import memopt
from memopt.runtime import kernels, triton_fewbit, verify
from memopt.record.timing import step_time_ratio
from tools.bench.common import RESULTS, CheckpointBlocks, write_results_file

MiB = 2 ** 20
LARGEST_HEADERS = ["model", "precision", "method", "largest batch", "peak MiB at it", "samples/s at it",
                   "first batch over", "probes (batch: peak MiB)"]
HEADERS = ["model", "precision", "config", "saved MiB", "saved smaller", "peak MiB (measured)", "peak MiB (estimated)",
           "peak smaller", "step time / stock", "setup s"]


class Case(NamedTuple):
    name: str
    model: torch.nn.Module
    inputs: torch.Tensor
    blocks: List[torch.nn.Module]
    precisions: Tuple[str, ...]


def _resnet50(batch: int, size: int) -> Case:
    import torchvision

    m = torchvision.models.resnet50()
    return Case(f"ResNet-50, {size}x{size}, batch {batch}", m, torch.randn(batch, 3, size, size),
                [b for layer in (m.layer1, m.layer2, m.layer3, m.layer4) for b in layer], ("float32", "bf16"))


def _bert(batch: int, seq: int, layers: int, hidden: int, heads: int) -> Case:
    import transformers as T

    cfg = T.BertConfig(vocab_size=30522, hidden_size=hidden, num_hidden_layers=layers, num_attention_heads=heads,
                       intermediate_size=4 * hidden, max_position_embeddings=max(512, seq), attn_implementation="sdpa")
    m = T.BertModel(cfg)
    return Case(f"BERT encoder, {layers} layers, hidden {hidden}, batch {batch} x {seq}", m,
                torch.randint(0, cfg.vocab_size, (batch, seq)), list(m.encoder.layer), ("float32", "bf16"))


def _llama(seq: int, layers: int, hidden: int, heads: int, intermediate: int, vocab: int, batch: int = 1) -> Case:
    import transformers as T

    cfg = T.LlamaConfig(vocab_size=vocab, hidden_size=hidden, num_hidden_layers=layers, num_attention_heads=heads,
                        num_key_value_heads=heads, intermediate_size=intermediate, max_position_embeddings=seq,
                        use_cache=False, attn_implementation="sdpa")
    m = T.LlamaForCausalLM(cfg)
    return Case(f"Llama decoder, {layers} layers, hidden {hidden}, {batch} x {seq}", m,
                torch.randint(0, vocab, (batch, seq)), list(m.model.layers), ("bf16",))


def models(smoke: bool) -> Dict[str, Callable[[], Case]]:
    if smoke:  # the script's own check on any device: small and quick
        return {"resnet50": lambda: _resnet50(2, 64), "bert": lambda: _bert(2, 32, 2, 64, 2),
                "llama": lambda: _llama(64, 2, 64, 2, 176, 256)}
    return {"resnet50_b32": lambda: _resnet50(32, 224), "bert_base": lambda: _bert(32, 512, 12, 768, 12),
            "llama": lambda: _llama(2048, 8, 1024, 16, 2816, 32000), "resnet50_b128": lambda: _resnet50(128, 224)}


def _triton_runs(device: str) -> str:
    """Why the Triton row cannot run here ("" when it can): triton missing, or a CPU without the interpreter."""
    if not triton_fewbit.AVAILABLE:
        return f"skipped: triton does not import ({triton_fewbit.IMPORT_ERROR[:80]})"
    if device == "cpu" and not triton_fewbit.interpreting():
        return "skipped: CPU without TRITON_INTERPRET=1"
    return ""


def _gradients_match(model, x, cfg) -> str:
    """One step's gradients with MEMOPT_KERNELS=torch against the default kernels, in deterministic mode (cuDNN
    and PyTorch's own kernels: otherwise atomics reorder sums and no two runs agree): "bit-identical", equal to
    rounding, or the largest difference."""
    flags = torch.backends.cudnn.deterministic, torch.backends.cudnn.benchmark, \
        torch.are_deterministic_algorithms_enabled()
    torch.backends.cudnn.deterministic, torch.backends.cudnn.benchmark = True, False
    torch.use_deterministic_algorithms(True, warn_only=True)
    grads = []
    try:
        for choice in (None, "torch"):
            with kernels.forced(choice):
                m = copy.deepcopy(model)
                om = memopt.optimize(m, example_inputs=x, config=cfg)
                torch.manual_seed(0)
                om(x).float().square().mean().backward()
                grads.append([p.grad.detach().clone() for p in m.parameters() if p.grad is not None])
                del om, m
    finally:
        torch.backends.cudnn.deterministic, torch.backends.cudnn.benchmark = flags[:2]
        torch.use_deterministic_algorithms(flags[2])
    if len(grads[0]) != len(grads[1]):
        return f"gradients of {len(grads[0])} vs {len(grads[1])} parameters"
    if all(torch.equal(a, b) for a, b in zip(*grads)):
        return "gradients bit-identical to the default's"
    # the Triton BN backward sums per channel in another order than the plain path (memopt/runtime/triton_bn.py):
    # float32 rounding apart, the gradients are the same
    worst = max(float((a.float() - b.float()).abs().max() / b.float().abs().max().clamp_min(1e-30))
                for a, b in zip(*grads))
    if worst <= 1e-4:
        return f"gradients match the default's to float32 rounding (largest difference {worst:.2g} of a max)"
    return f"gradients DIFFER from the default's: largest difference {worst:.3g} of the parameter's max"


class Bench:
    """The rows measured so far, the clock, and the file rewritten after every row."""

    def __init__(self, args) -> None:
        self.args, self.rows, self.start = args, [], time.perf_counter()
        self.checks: List[str] = []  # the first-use checks' verdicts (check_kernels)
        self.largest: List[List[str]] = []  # the largest-batch rows (largest_rows)

    def over(self) -> bool:
        return time.perf_counter() - self.start > self.args.budget_s

    def add(self, row: List[str]) -> None:
        self.rows.append(row)
        print(row, flush=True)
        self.write()

    def write(self) -> None:
        args = self.args
        table = tabulate(self.rows, headers=HEADERS, tablefmt="github")
        where = torch.cuda.get_device_name() if args.device == "cuda" else "CPU smoke run"
        command = "python -m tools.bench.cuda.bench_cuda" + (f" --models {args.models}" if args.models else "")
        text = (f"# memopt on a CUDA GPU\n\nCommand: `{command}` ({where}, torch {torch.__version__}, cuDNN "
                f"{torch.backends.cudnn.version()}; {time.perf_counter() - self.start:.0f} s so far). "
                f"{chr(10).join(__doc__.split(chr(10))[2:29])}\n\n## First-use kernel checks\n\n"
                + "\n".join(f"- {line}" for line in self.checks) + f"\n\n## Steps\n\n{table}\n")
        if self.largest:
            text += (f"\n## Largest batch under {args.cap_mb:.0f} MiB\n\n"
                     f"{tabulate(self.largest, headers=LARGEST_HEADERS, tablefmt='github')}\n")
        write_results_file(args.out, text)


def _precision(device: str, precision: str):
    if precision == "bf16":
        return torch.autocast(device, dtype=torch.bfloat16)
    return contextlib.nullcontext()


def _row(case, precision, label, m, stock, est_peak, ratio, setup_s=None) -> List[str]:
    return [case.name, precision, label, f"{m.saved_bytes / MiB:.1f}", f"{stock.saved_bytes / m.saved_bytes:.2f}x",
            f"{m.peak_bytes / MiB:.1f}", "" if est_peak is None else f"{est_peak / MiB:.1f}",
            f"{stock.peak_bytes / m.peak_bytes:.2f}x", f"{ratio:.2f}x", "" if setup_s is None else f"{setup_s:.1f}"]


def bench_case(case: Case, precision: str, bench: Bench, triton_row: bool) -> None:
    device = bench.args.device
    model, x = case.model.to(device).train(), case.inputs.to(device)
    steps = dict(repeats=bench.args.repeats, warmup=2)
    labels = ["stock", "memopt Config()", "torch.utils.checkpoint, every block", "memopt at checkpointing's peak",
              "torch.compile, activation_memory_budget=0.5"] + (["memopt Config(), MEMOPT_KERNELS=torch"]
                                                                 if triton_row else [])

    def skip_rest(done: int) -> bool:
        if not bench.over():
            return False
        for label in labels[done:]:
            bench.rows.append([case.name, precision, label, "not run: --budget-s reached"] + [""] * 6)
        bench.write()
        return True

    if skip_rest(0):
        return
    with _precision(device, precision):
        stock = memopt.measure(model, x, optimizer="sgd")
        _, stock_s = step_time_ratio(model, model, x, **steps)
        bench.add(_row(case, precision, f"stock ({stock_s * 1000:.0f} ms/step)", stock, stock, None, 1.0))
        if skip_rest(1):
            return
        start = time.perf_counter()
        om = memopt.optimize(model, example_inputs=x, optimizer="sgd")
        setup = time.perf_counter() - start
        m = memopt.measure(om, x, optimizer="sgd")
        if precision == "float32":
            assert m.saved_bytes == om.plan.estimated_saved_bytes, (m.saved_bytes, om.plan.estimated_saved_bytes)
        ratio, _ = step_time_ratio(om, model, x, **steps)
        bench.add(_row(case, precision, labels[1], m, stock, om.plan.estimated_peak_bytes, ratio, setup))
        del om
        if skip_rest(2):
            return
        ckpt = CheckpointBlocks(model, case.blocks)
        ckpt_m = memopt.measure(ckpt, x, optimizer="sgd")
        ratio, _ = step_time_ratio(ckpt, model, x, **steps)
        ckpt.restore()
        bench.add(_row(case, precision, labels[2], ckpt_m, stock, None, ratio))
        if skip_rest(3):
            return
        budget = ckpt_m.peak_bytes / MiB
        try:
            start = time.perf_counter()
            om = memopt.optimize(model, budget_mb=budget, example_inputs=x, optimizer="sgd")
            setup = time.perf_counter() - start
            m = memopt.measure(om, x, optimizer="sgd")
            ratio, _ = step_time_ratio(om, model, x, **steps)
            fits = "fits" if m.peak_bytes <= budget * MiB else "OVER"
            bench.add(_row(case, precision, f"{labels[3]} ({budget:.0f} MiB: {fits})", m, stock,
                           om.plan.estimated_peak_bytes, ratio, setup))
            del om
        except memopt.MemoptError as e:  # refused loudly: say so in the table
            bench.add([case.name, precision, f"{labels[3]} ({budget:.0f} MiB)", f"refused: {str(e)[:160]}"]
                      + [""] * 6)
        if skip_rest(4):
            return
        import torch._functorch.config as functorch_config
        with functorch_config.patch(activation_memory_budget=0.5):
            torch._dynamo.reset()
            compiled = torch.compile(model)
            start = time.perf_counter()
            memopt.measure(compiled, x)  # compiles (forward and backward)
            setup = time.perf_counter() - start
            m = memopt.measure(compiled, x, optimizer="sgd")
            ratio, _ = step_time_ratio(compiled, model, x, **steps)
        bench.add(_row(case, precision, labels[4], m, stock, None, ratio, setup))
        del compiled
        torch._dynamo.reset()
    if triton_row and not skip_rest(5):
        why_not = _triton_runs(device)
        if why_not:
            bench.add([case.name, precision, f"{labels[5]} ({why_not})"] + [""] * 7)
        else:
            label = f"{labels[5]} ({_gradients_match(model, x, memopt.Config())})"
            with kernels.forced("torch"):
                start = time.perf_counter()
                om = memopt.optimize(model, example_inputs=x, optimizer="sgd")
                setup = time.perf_counter() - start
                m = memopt.measure(om, x, optimizer="sgd")
                ratio, _ = step_time_ratio(om, model, x, **steps)
            bench.add(_row(case, precision, label, m, stock, om.plan.estimated_peak_bytes, ratio, setup))
    del model, x
    if device == "cuda":
        torch.cuda.empty_cache()


def check_kernels(bench: Bench) -> None:
    """Every kernel family's first-use check on the device now, float32 and bf16 (``kernels.prepare``, what the
    default runs at first use): the verdicts, the warnings of those that failed, and the time it took."""
    device = torch.device(bench.args.device)
    if device.type == "cuda" and device.index is None:
        device = torch.device("cuda", torch.cuda.current_device())
    why_not = _triton_runs(bench.args.device)
    if why_not:
        bench.checks = [f"none ran ({why_not}): every row takes the plain path"]
        return
    start = time.perf_counter()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always", verify.KernelCheckWarning)
        passed = kernels.prepare(device, (torch.float32, torch.bfloat16))
    seconds = time.perf_counter() - start
    if not passed:
        bench.checks = [f"none ran on {device}: the default does not take Triton there (" + (
            f"MEMOPT_KERNELS={kernels.choice()}" if kernels.choice() else "first-use checks run on CUDA devices")
            + ")"]
        return
    found = verify.verdicts()
    bench.checks = [f"{family}: " + ", ".join(f"{str(dtype).replace('torch.', '')} "
                                              f"{'passed' if found.get((family, device.type, device.index, dtype)) else 'FAILED: plain path'}"
                                              for dtype in (torch.float32, torch.bfloat16)) for family in passed]
    bench.checks += [f"warning: {w.message}" for w in caught if issubclass(w.category, verify.KernelCheckWarning)]
    bench.checks.append(f"{len(passed)} families checked in {seconds:.1f} s")
    bench.write()


def _probe(case: Case, method: str, precision: str, device: str, cap_mb: float) -> dict:
    """One step of ``case`` under ``method``: {"peak_mib", "samples_s"} or {"error"}."""
    model, x = case.model.to(device).train(), case.inputs.to(device)
    try:
        with _precision(device, precision):
            if method == "checkpoint":
                target = CheckpointBlocks(model, case.blocks)
            elif method.startswith("memopt"):
                target = memopt.optimize(model, example_inputs=x, optimizer="sgd",
                                         budget_mb=cap_mb if method == "memopt at the cap" else None)
            else:
                target = model
            peak = memopt.measure(target, x, optimizer="sgd").peak_bytes / MiB
            _, seconds = step_time_ratio(target, target, x, repeats=3, warmup=1)
        return {"peak_mib": peak, "samples_s": x.shape[0] / seconds}
    except (torch.cuda.OutOfMemoryError, memopt.MemoptError) as error:
        return {"error": f"{type(error).__name__}: {str(error).splitlines()[0][:120]}"}
    finally:
        del model, x
        if device == "cuda":
            torch.cuda.empty_cache()


def largest_rows(bench: Bench, title: str, build: Callable[[int], Case], start_batch: int) -> None:
    """The largest batch whose step peak fits ``--cap-mb``, per precision and method: doubling from
    ``start_batch``, then bisection, at most ``--largest-probes`` steps, none started past ``--largest-s``."""
    args, begun = bench.args, time.perf_counter()
    methods = ("stock", "checkpoint", "memopt Config()", "memopt at the cap")
    for precision in ("float32", "bf16"):
        for method in methods:
            probes: Dict[int, dict] = {}

            def fits(b: int) -> bool:
                torch.manual_seed(0)
                r = probes[b] = _probe(build(b), method, precision, args.device, args.cap_mb)
                return "error" not in r and r["peak_mib"] <= args.cap_mb

            lo, hi, b = 0, None, start_batch
            timed_out = lambda: time.perf_counter() - begun > args.largest_s  # noqa: E731
            while len(probes) < args.largest_probes and not timed_out():
                if fits(b):
                    lo, b = b, 2 * b
                    if hi is not None:
                        break
                else:
                    hi = b
                    if lo or b == 1:
                        break
                    b //= 2
            while hi is not None and hi - lo > 1 and len(probes) < args.largest_probes and not timed_out():
                mid = (lo + hi) // 2
                lo, hi = (mid, hi) if fits(mid) else (lo, mid)
            at = probes.get(lo, {})
            trail = ", ".join(f"{k}: {v['peak_mib']:.0f}" if "error" not in v else f"{k}: {v['error']}"
                              for k, v in probes.items()) + (" (stopped by --largest-s)" if timed_out() else "")
            bench.largest.append([title, precision, method, str(lo),
                                  f"{at['peak_mib']:.0f}" if "peak_mib" in at else "",
                                  f"{at['samples_s']:.1f}" if "samples_s" in at else "",
                                  "" if hi is None else str(hi), trail])
            print(bench.largest[-1], flush=True)
            bench.write()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", default=str(RESULTS / "cuda" / "cuda.md"))
    parser.add_argument("--device", default="cuda", help="cuda (default); cpu only with --smoke")
    parser.add_argument("--smoke", action="store_true", help="small models: checks the script itself")
    parser.add_argument("--models", default="", help="comma-separated keys: resnet50_b32,bert_base,llama,resnet50_b128")
    parser.add_argument("--budget-s", type=float, default=330.0, help="no row starts after this many seconds")
    parser.add_argument("--repeats", type=int, default=5, help="timed steps per side")
    parser.add_argument("--cap-mb", type=float, default=8192.0, help="the largest-batch rows' peak cap, MiB")
    parser.add_argument("--largest-s", type=float, default=90.0, help="no largest-batch probe starts after this")
    parser.add_argument("--largest-probes", type=int, default=5, help="steps per largest-batch search")
    parser.add_argument("--largest-models", default="resnet50",
                        help="comma-separated largest-batch searches, each within --largest-s: resnet50,bert,llama")
    args = parser.parse_args()
    if args.device == "cuda" and not torch.cuda.is_available():
        raise SystemExit("tools.bench.cuda.bench_cuda needs a CUDA GPU (torch.cuda.is_available() is False)")
    torch.backends.cudnn.benchmark = True
    bench = Bench(args)
    check_kernels(bench)
    builders = models(args.smoke)
    for i, key in enumerate(args.models.split(",") if args.models else builders):
        if key not in builders:
            raise SystemExit(f"--models: unknown key {key!r}; choose from {', '.join(builders)}")
        torch.manual_seed(0)
        case = builders[key]()
        for precision in case.precisions:
            bench_case(case, precision, bench, triton_row=i == 0 and precision == "float32")
    if args.largest_s > 0:
        searches = largest_searches(args.smoke)
        for key in args.largest_models.split(","):
            if key not in searches:
                raise SystemExit(f"--largest-models: unknown key {key!r}; choose from {', '.join(searches)}")
            largest_rows(bench, *searches[key])


def largest_searches(smoke: bool) -> Dict[str, Tuple[str, Callable[[int], Case], int]]:
    """(title, batch -> case, first batch) of each model's largest-batch search: the CPU peak benchmark's shapes
    (tools/bench/peak: ResNet-50, the BERT-base-shaped encoder of 4 layers at seq 128, the 4-layer Llama at seq
    256), at 224x224 for ResNet-50; tiny ones with ``smoke``."""
    if smoke:
        return {"resnet50": ("ResNet-50, 64x64", lambda b: _resnet50(b, 64), 2),
                "bert": ("BERT encoder, 2 layers, hidden 64, seq 32", lambda b: _bert(b, 32, 2, 64, 2), 2),
                "llama": ("Llama decoder, 2 layers, hidden 64, seq 64", lambda b: _llama(64, 2, 64, 2, 176, 256, b), 2)}
    return {"resnet50": ("ResNet-50, 224x224", lambda b: _resnet50(b, 224), 32),
            "bert": ("BERT encoder, 4 layers, hidden 768, seq 128", lambda b: _bert(b, 128, 4, 768, 12), 32),
            "llama": ("Llama decoder, 4 layers, hidden 256, seq 256", lambda b: _llama(256, 4, 256, 4, 688, 4096, b),
                      32)}


if __name__ == "__main__":
    main()
