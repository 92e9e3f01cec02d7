"""One configuration (model, dtype, batch, method) measured in this process, which the parent started fresh for
it: the peak resident memory of a whole training step (forward, loss, backward, optimizer step) above the idle
process, the step time, the setup time (``memopt.optimize``, or torch.compile's first step) and the floor
(parameters + gradients + optimizer state). ``measure(args)`` returns the dict the child prints as one JSON line.

How the peak is read (Linux): the kernel's own high-water mark of the resident set, ``VmHWM`` in
``/proc/self/status``, reset before each measured step by writing ``5`` to ``/proc/self/clear_refs`` (it then
equals the current ``VmRSS``). The kernel updates it before it unmaps any page, so it misses no spike, however
short; a sampling thread would. Where the reset is refused, a thread reading ``VmRSS`` every 1 ms stands in
(``hwm_method`` says which ran).
"""
from __future__ import annotations

import contextlib
import gc
import re
import statistics
import threading
import time
import traceback
from typing import Callable, Dict, List, Optional

KiB_PER_MiB = 1024
MODELS = ("llama", "bert", "resnet50", "vit")
METHODS = ("stock", "checkpoint", "compile", "memopt", "memopt_budget")
DTYPES = ("float32", "bf16")
DEFAULT_BATCH = {"llama": 32, "bert": 8, "resnet50": 8, "vit": 8}


# ---------------------------------------------------------------- resident memory
def status() -> Dict[str, int]:
    """VmRSS, VmHWM, RssAnon, RssFile, RssShmem of this process, KiB."""
    with open("/proc/self/status") as f:
        text = f.read()
    return {k: int(m.group(1)) for k in ("VmRSS", "VmHWM", "RssAnon", "RssFile", "RssShmem")
            if (m := re.search(rf"^{k}:\s+(\d+)", text, re.M))}


class HighWater:
    """The peak resident set since the last ``reset()``: the kernel's VmHWM after clear_refs, or a 1 ms sampler."""

    def __init__(self) -> None:
        self.method = "clear_refs"
        try:
            self._clear()
        except OSError:
            self.method = "sampler (clear_refs refused)"
            self._peak, self._stop = 0, threading.Event()
            threading.Thread(target=self._sample, daemon=True).start()

    @staticmethod
    def _clear() -> None:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")

    def _sample(self) -> None:
        while not self._stop.is_set():
            self._peak = max(self._peak, status()["VmRSS"])
            time.sleep(0.001)

    def reset(self) -> None:
        if self.method == "clear_refs":
            self._clear()
        else:
            self._peak = status()["VmRSS"]

    def peak_kib(self) -> int:
        if self.method == "clear_refs":
            return status()["VmHWM"]
        return max(self._peak, status()["VmRSS"])


def trim() -> None:
    """glibc's malloc_trim(0): return the free heap to the kernel (``--malloc-trim``, and the end's diagnostic)."""
    import ctypes

    try:
        ctypes.CDLL("libc.so.6").malloc_trim(0)
    except (OSError, AttributeError):
        pass


# ---------------------------------------------------------------- models
class Case:
    """A model, its inputs, the blocks to checkpoint, how a step's loss is computed, and its optimizer."""

    def __init__(self, model, inputs, forward_loss: Callable, blocks: List, hf: bool, describe: str,
                 loss_of_output: Optional[Callable] = None) -> None:
        self.model, self.inputs, self.forward_loss, self.blocks, self.hf = model, inputs, forward_loss, blocks, hf
        self.describe = describe
        # the step's loss of the model's output: memopt.optimize's loss_fn, so its estimate counts the same step
        self.loss_of_output = loss_of_output


def import_model_code(name: str) -> None:
    """Import what building ``name`` loads, so that the idle baseline has it."""
    if name == "resnet50":
        import torchvision.models  # noqa: F401
    elif name == "vit":
        import timm.models.vision_transformer  # noqa: F401
    else:
        import transformers as T
        getattr(T, "LlamaForCausalLM" if name == "llama" else "BertForSequenceClassification")  # the lazy import


def shape_args(**overrides):
    """bench_peak's model-shape arguments at their defaults (``--res``, ``--seq``, ...), for scripts that build its
    models without its command line; ``overrides`` replace some."""
    from types import SimpleNamespace

    shape = dict(res=224, seq=128, layers=4, vocab=4096, hidden=256, llama_layers=4, heads=4, intermediate=688,
                 llama_seq=256)
    return SimpleNamespace(**dict(shape, **overrides))


def build(name: str, batch: int, args) -> Case:
    import torch
    import torch.nn.functional as F

    torch.manual_seed(0)
    if name in ("resnet50", "vit"):
        if name == "resnet50":
            import torchvision

            model = torchvision.models.resnet50()
            blocks = [b for layer in (model.layer1, model.layer2, model.layer3, model.layer4) for b in layer]
            describe = f"ResNet-50 (torchvision), {args.res}x{args.res}, SGD momentum 0.9"
        else:
            import timm

            model = timm.create_model("vit_small_patch16_224", img_size=args.res, pretrained=False)
            blocks = list(model.blocks)
            describe = f"ViT-S/16 (timm vit_small_patch16_224), {args.res}x{args.res}, AdamW"
        x, y = torch.randn(batch, 3, args.res, args.res), torch.randint(0, 1000, (batch,))
        return Case(model.train(), x, lambda net: F.cross_entropy(net(x), y), blocks, False, describe,
                    lambda out: F.cross_entropy(out, y[:len(out)]))
    import transformers as T

    if name == "llama":
        cfg = T.LlamaConfig(vocab_size=args.vocab, hidden_size=args.hidden, num_hidden_layers=args.llama_layers,
                            num_attention_heads=args.heads, num_key_value_heads=args.heads,
                            intermediate_size=args.intermediate, max_position_embeddings=args.llama_seq,
                            use_cache=False, tie_word_embeddings=False, attn_implementation="sdpa")
        model = T.LlamaForCausalLM(cfg)
        ids = torch.randint(0, args.vocab, (batch, args.llama_seq))
        inputs = {"input_ids": ids, "labels": ids}
        describe = (f"Llama (LlamaForCausalLM), {args.llama_layers} layers, hidden {args.hidden}, {args.heads} "
                    f"heads, intermediate {args.intermediate}, vocabulary {args.vocab}, sequence {args.llama_seq}, "
                    "AdamW")
    else:
        cfg = T.BertConfig(hidden_size=768, num_hidden_layers=args.layers, num_attention_heads=12,
                           intermediate_size=3072, num_labels=2, attn_implementation="sdpa")
        model = T.BertForSequenceClassification(cfg)
        inputs = {"input_ids": torch.randint(0, cfg.vocab_size, (batch, args.seq)),
                  "labels": torch.randint(0, 2, (batch,))}
        describe = (f"BERT-base-shaped encoder (BertForSequenceClassification), {args.layers} layers, hidden 768, "
                    f"12 heads, intermediate 3072, vocabulary {cfg.vocab_size}, sequence {args.seq}, AdamW")
    return Case(model.train(), inputs, lambda net: net(**inputs).loss, [], True, describe, lambda out: out.loss)


def make_optimizer(name: str, model):
    import torch

    if name == "resnet50":
        return torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9)
    return torch.optim.AdamW(model.parameters(), lr=1e-4)


# ---------------------------------------------------------------- methods
def apply(method: str, case: Case, opt, cast, budget_mb: Optional[float]):
    """(the module a step calls, setup seconds or None, a note)."""
    import torch

    model = case.model
    if method == "stock":
        return model, None, ""
    if method == "checkpoint":
        if case.hf:
            model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
            return model, None, "gradient_checkpointing_enable (non-reentrant)"
        from tools.bench.common import CheckpointBlocks

        return CheckpointBlocks(model, case.blocks), None, f"torch.utils.checkpoint around {len(case.blocks)} blocks"
    if method == "compile":
        import torch._functorch.config as functorch_config
        import torch._inductor.config as inductor_config

        functorch_config.activation_memory_budget = 0.5
        inductor_config.compile_threads = 1  # compiles in this process: no worker pool on a shared 2-core machine
        return torch.compile(model), None, "activation_memory_budget=0.5; setup = first step's seconds"
    import memopt

    example = case.inputs
    start = time.perf_counter()
    with cast():
        if method == "memopt":
            om = memopt.optimize(model, example_inputs=example, optimizer=opt, loss_fn=case.loss_of_output)
        else:
            om = memopt.optimize(model, budget_mb=budget_mb, example_inputs=example, optimizer=opt,
                                 loss_fn=case.loss_of_output)
    setup = time.perf_counter() - start
    plan = getattr(om, "plan", None)
    note = f"capture {plan.capture}" if plan is not None and hasattr(plan, "capture") else ""
    if plan is not None and hasattr(plan, "chosen_units"):
        blocks = plan.chosen_units().get("recompute", {})
        bits = sorted({b for b in blocks.values() if b}, reverse=True)
        note += (f"; recomputes {len(blocks)} blocks" + (f" from {'/'.join(map(str, bits))}-bit codes" if bits else "")
                 if blocks else "; recomputes no block")
        note += f"; estimated peak {plan.estimated_peak_bytes / 2**20:.1f} MiB (the cost model)"
        if getattr(plan, "process_held_bytes", 0):
            note += f", beside {plan.process_held_bytes / 2**20:.1f} MiB optimize() left held (measured)"
    return om, setup, note


# ---------------------------------------------------------------- the measurement
def measure(args) -> dict:
    """One configuration in this (fresh) process; errors are reported in the dict, not raised."""
    out = {"model": args.model, "dtype": args.dtype, "batch": args.batch, "method": args.method,
           "budget_mb": args.budget_mb, "threads": args.threads, "peak_mib": None, "step_s": None,
           "optimize_s": None, "floor_mib": None, "error": None}
    try:
        _measure(args, out)
    except Exception as exc:  # the parent's table records it: e.g. memopt refusing, compile failing on CPU
        traceback.print_exc()
        out["error"] = f"{type(exc).__name__}: {' '.join(str(exc).split())[:400]}"
    return out


def _measure(args, out: dict) -> None:
    import torch

    torch.set_num_threads(args.threads)
    import memopt  # noqa: F401  (in the baseline: the import is no part of a step)
    import tools.bench.common  # noqa: F401

    import_model_code(args.model)
    gc.collect()
    base = status()
    high = HighWater()
    out["hwm_method"] = high.method
    out["baseline_mib"] = base["VmRSS"] / KiB_PER_MiB
    cast = (lambda: torch.autocast("cpu", dtype=torch.bfloat16)) if args.dtype == "bf16" else contextlib.nullcontext

    high.reset()
    case = build(args.model, args.batch, args)
    out["describe"] = case.describe
    opt = make_optimizer(args.model, case.model)
    setup_kib = high.peak_kib()  # building the model, its inputs and optimizer
    high.reset()
    net, setup, note = apply(args.method, case, opt, cast, args.budget_mb)
    out["optimize_s"], out["note"] = setup, note
    # what memopt.optimize() (its capture check, cost model and fidelity gate) peaked at, measured as a step's peak
    # is, the model and inputs included: where it is above the step's, optimize() is what runs out of memory first
    # (torch.compile compiles at the first step: its figure is in the setup peak)
    applied_kib = high.peak_kib()
    setup_kib = max(setup_kib, applied_kib)
    out["optimize_peak_mib"] = (applied_kib - status()["RssFile"] - base["RssAnon"] - base["RssShmem"]) / KiB_PER_MiB
    high.reset()

    def step() -> float:
        opt.zero_grad(set_to_none=True)
        with cast():
            loss = case.forward_loss(net)
        loss.backward()
        opt.step()
        return float(loss.detach())

    warm = []
    for _ in range(args.warmup):
        t = time.perf_counter()
        step()
        warm.append(time.perf_counter() - t)
    if args.method == "compile" and warm:
        out["optimize_s"] = warm[0]  # dynamo + inductor compile forward and backward on the first step
    out["warmup_s"] = warm
    # what building, optimize() (or compile's first step) and the warm-up steps peaked at, measured the same way
    out["setup_peak_mib"] = (max(setup_kib, high.peak_kib()) - status()["RssFile"] - base["RssAnon"]
                             - base["RssShmem"]) / KiB_PER_MiB
    times, peaks, loss = [], [], None
    for _ in range(args.steps):
        if args.malloc_trim:
            trim()
        high.reset()
        t = time.perf_counter()
        loss = step()
        times.append(time.perf_counter() - t)
        now = status()
        # anonymous memory at the step's peak above the idle process: the high-water mark less the file-backed
        # pages resident now (code and data of loaded libraries; constant once the warm-up steps loaded them)
        peaks.append((high.peak_kib() - now["RssFile"] - base["RssAnon"] - base["RssShmem"]) / KiB_PER_MiB)
        out["peak_total_mib"] = max(out.get("peak_total_mib") or 0, (high.peak_kib() - base["VmRSS"]) / KiB_PER_MiB)
        out["file_growth_mib"] = (now["RssFile"] - base["RssFile"]) / KiB_PER_MiB
    out["peak_mib"], out["peaks_mib"] = max(peaks), peaks
    out["step_s"], out["steps_s"] = statistics.median(times), times
    out["loss"] = loss
    params = list(case.model.parameters())
    state = sum(v.numel() * v.element_size() for s in opt.state.values() for v in s.values()
                if isinstance(v, torch.Tensor))
    floor = sum(p.numel() * p.element_size() for p in params) \
        + sum(p.grad.numel() * p.grad.element_size() for p in params if p.grad is not None) + state
    out["floor_mib"] = floor / 2 ** 20
    before = status()["RssAnon"]
    trim()  # diagnostic, after the measurement: how much of the resident set was free heap glibc kept
    out["heap_free_mib"] = (before - status()["RssAnon"]) / KiB_PER_MiB
    import resource

    out["ru_maxrss_mib"] = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / KiB_PER_MiB
