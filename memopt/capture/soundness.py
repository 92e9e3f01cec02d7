"""The soundness check at capture: the captured graph, before any rewrite, must train as the eager model does.

On a slice of the example batch (``SLICE`` samples: enough for BatchNorm, small enough to fit wherever the
plan's target fits) it runs one training step of the eager model and one of the captured graph, from the
same parameters, buffers and RNG state, and compares bit for bit: outputs, buffers after the step (running
statistics, counters, EMAs), every parameter's and input's gradient; and the bytes autograd keeps (saved-tensor
hooks): the graph may not keep more than eager. Model state is restored after each run. A difference is a
construct capture changed (a custom autograd Function traced through, an in-place buffer update dropped,
``torch.utils.checkpoint`` removed, Python side effects in forward): ``check_capture`` raises ``TraceError``
naming it, and the caller falls back to per-submodule capture, where the failing parts run eagerly.

Fake or meta inputs cannot run: the check is skipped and says so.
"""
from __future__ import annotations

import hashlib
import logging
import random
import sys
from dataclasses import dataclass, field
from typing import Any, Callable, Dict, List, Optional, Tuple

import torch
from torch import fx, nn
from torch._subclasses.fake_tensor import FakeTensor
from torch.utils._pytree import keystr, tree_flatten, tree_flatten_with_path, tree_map

from memopt.core.errors import MemoptError, TraceError
from memopt.core.modules import Walked, walk
from memopt.core.state import preserved_state, train_as_user
from memopt.core.storage import storage_key
from memopt.cost_model.step import compute_loss, output_tensors
from memopt.cost_model.storage import SavedTensorRecorder, distinct_saved_bytes
from memopt.core import counters

log = logging.getLogger("memopt")

# samples of the example batch the check runs on
SLICE = 4


@dataclass
class Soundness:
    """What the check found (``Plan.soundness``)."""

    checked: bool
    slice: str  # which inputs it ran on, or why it did not run
    eager_saved_bytes: Optional[int] = None
    captured_saved_bytes: Optional[int] = None
    # parameters whose gradients are not bit-reproducible between identical steps (a kernel's run-to-run noise,
    # see _run_to_run): a graph step and an eager step that agree on them bit for bit were found on re-running
    not_reproducible: List[str] = field(default_factory=list)

    def to_dict(self) -> Dict[str, Any]:
        return dict(self.__dict__)


@dataclass
class StepResult:
    """One training step's outputs, buffers after it, parameter and input gradients, and saved bytes."""

    output: List[torch.Tensor]
    buffers: List[torch.Tensor]
    grads: List[Optional[torch.Tensor]]
    input_grads: List[Optional[torch.Tensor]]
    saved_bytes: int


def _is_abstract(t: Any) -> bool:
    return isinstance(t, torch.Tensor) and (t.is_meta or isinstance(t, FakeTensor))


def batch_slice(args: tuple, kwargs: dict, size: int = SLICE) -> Tuple[tuple, dict, str]:
    """The first ``size`` samples of every tensor input whose first dimension is the batch (the first tensor
    input's); the inputs as they are when the batch is not larger."""
    leaves = [t for t in tree_flatten((args, kwargs))[0] if isinstance(t, torch.Tensor) and t.dim() > 0]
    if not leaves or leaves[0].shape[0] <= size:
        return args, kwargs, "the whole example batch"
    batch = leaves[0].shape[0]

    def cut(t: Any) -> Any:
        if isinstance(t, torch.Tensor) and t.dim() > 0 and t.shape[0] == batch:
            part = t.detach()[:size].clone()
            return part.requires_grad_(t.requires_grad)
        return t

    sliced_args, sliced_kwargs = tree_map(cut, (args, kwargs))
    return sliced_args, sliced_kwargs, f"the first {size} of {batch} samples"


def _fresh_inputs(args: tuple, kwargs: dict) -> Tuple[tuple, dict, List[torch.Tensor]]:
    """Copies of the inputs, so each run gets its own input gradients, and the leaves those land on. An input
    that requires grad is passed as a non-leaf (a copy of its leaf), as a submodule's input is in a real
    forward: in-place ops on it (ReLU(inplace=True)) are legal there."""
    leaves: List[torch.Tensor] = []

    def copy(t: Any) -> Any:
        if not isinstance(t, torch.Tensor):
            return t
        leaf = t.detach().clone().requires_grad_(t.requires_grad)
        leaves.append(leaf)
        return leaf.clone() if t.requires_grad else leaf

    copied_args, copied_kwargs = tree_map(copy, (args, kwargs))
    return copied_args, copied_kwargs, leaves


def seed_host_rngs(rng: torch.Tensor) -> None:
    """Seed Python's ``random`` and numpy's global RNG from torch's state ``rng``: the steps memopt compares draw
    the same there too (HF Wav2Vec2 picks its SpecAugment spans with numpy), and from a state no trace ran with,
    so a draw a trace baked into its graph as a constant shows as a difference instead of matching by chance.
    (``preserved_state`` puts the user's streams back afterwards.)"""
    seed = int.from_bytes(hashlib.blake2b(bytes(rng.flatten().tolist()), digest_size=4).digest(), "little")
    random.seed(seed)
    numpy = sys.modules.get("numpy")
    if numpy is not None:
        numpy.random.seed(seed)


def unseen_rng_state() -> torch.Tensor:
    """A CPU RNG state derived from the current one but not equal to it. Capture traces at the current state and
    puts it back, so a draw the trace baked into its graph as a constant (``torch.randn(8, 8)`` with no tensor
    argument) would equal the eager step's draw from that same state: compared from another state, it differs."""
    seed = int.from_bytes(hashlib.blake2b(bytes(torch.get_rng_state().tolist()), digest_size=8).digest(), "little")
    return torch.Generator().manual_seed(seed ^ 0x5EED).get_state()


def _start_step(model: nn.Module, params: List[torch.Tensor], rng: torch.Tensor) -> None:
    """A compared step's start (inside ``preserved_state``): the user's training mode, the draws from ``rng``,
    no gradients."""
    train_as_user(model)
    torch.set_rng_state(rng)
    seed_host_rngs(rng)
    for p in params:
        p.grad = None


@counters.counted("real_steps")
def training_step(fn, model: nn.Module, args: tuple, kwargs: dict, rng: torch.Tensor, loss_fn=None,
                  throwaway: bool = False) -> StepResult:
    """One training step of ``fn`` (``model`` or a graph over its parameters) from the state ``rng`` and the model's
    own, left as they were (``throwaway``: the model's parameters and buffers are not put back, only the RNGs and
    flags: a copy made for this step, whose snapshot would be one more copy of it at the step's peak)."""
    params = list(model.parameters())
    state = {storage_key(t) for t in params + list(model.buffers())}
    args, kwargs, inputs = _fresh_inputs(args, kwargs)
    with preserved_state(model, tensors=not throwaway):
        _start_step(model, params, rng)
        with SavedTensorRecorder() as recorder:
            out = fn(*args, **kwargs)
        saved = distinct_saved_bytes(recorder.saved, state)
        del recorder
        compute_loss(out, loss_fn).backward()
        outputs = [t.detach().clone() for t in output_tensors(out)]
        buffers = [b.detach().clone() for b in model.buffers()]
        # the gradients themselves, not copies (``preserved_state`` puts the user's back): no second set alive
        grads = [None if p.grad is None else p.grad.detach() for p in params]
        input_grads = [None if t.grad is None else t.grad.detach() for t in inputs]
    return StepResult(outputs, buffers, grads, input_grads, saved)


def training_grads(fn, model: nn.Module, args: tuple, kwargs: dict, rng: torch.Tensor, losses: List[Any],
                   stop: Optional[Callable[[List[Optional[torch.Tensor]]], bool]] = None, keep: bool = True
                   ) -> List[List[Optional[torch.Tensor]]]:
    """The parameters' gradients of ``training_step(fn, ...)`` under each of ``losses`` in turn, from ONE forward:
    each backward but the last keeps the graph (``retain_graph``) and starts from the RNG state the forward left,
    so K losses cost one forward and K backwards where K steps cost K of each, with the same bits (the forward is
    the same computation from the same state and draws; each backward reads the same saved tensors: memopt's
    ops neither free nor overwrite what they saved, tests/capture/test_shared_forward.py). ``stop(grads)``: no
    further backward once it is true (the gate stops at a loss a parameter misses under). ``keep=False``: each loss's
    gradients go to ``stop`` only and are dropped before the next backward (the list holds None for them), so one
    set of gradients is alive at a time, not one per loss: the gate reduces them to figures at once, and eight
    copies of the parameters' gradients would raise optimize()'s own peak above the training step's."""
    if not losses:
        return []
    return _training_grads(fn, model, args, kwargs, rng, losses, stop, keep)


@counters.counted("real_steps")
def _training_grads(fn, model: nn.Module, args: tuple, kwargs: dict, rng: torch.Tensor, losses: List[Any],
                    stop: Optional[Callable[[List[Optional[torch.Tensor]]], bool]], keep: bool = True
                    ) -> List[List[Optional[torch.Tensor]]]:
    found: List[List[Optional[torch.Tensor]]] = []
    params = list(model.parameters())
    args, kwargs, inputs = _fresh_inputs(args, kwargs)
    with preserved_state(model):
        _start_step(model, params, rng)
        out = fn(*args, **kwargs)
        after = _rng_states()
        for index, loss_fn in enumerate(losses):
            last = index == len(losses) - 1
            grads = _backward_grads(out, loss_fn, params, inputs, after, last)
            found.append(grads if keep else None)
            done = stop is not None and stop(grads)
            del grads
            if done and not last:
                break
        del out
    return found


def _rng_states() -> tuple:
    """The CPU and (where initialised) CUDA RNG states: where a forward left them, for each backward after it."""
    return torch.get_rng_state(), torch.cuda.get_rng_state_all() if torch.cuda.is_initialized() else None


def _backward_grads(out: Any, loss_fn: Any, params: List[torch.Tensor], inputs: List[torch.Tensor], after: tuple,
                    last: bool) -> List[Optional[torch.Tensor]]:
    """One loss's backward from the RNG states its forward left (``after``), the graph kept unless ``last``: the
    parameters' gradients themselves, not copies, with ``p.grad`` left None so the next backward makes fresh ones."""
    for t in params + inputs:
        t.grad = None
    torch.set_rng_state(after[0])
    if after[1] is not None:
        torch.cuda.set_rng_state_all(after[1])
    compute_loss(out, loss_fn).backward(retain_graph=not last)
    grads = [None if p.grad is None else p.grad.detach() for p in params]
    for p in params:
        p.grad = None
    return grads


@counters.counted("real_steps")
def paired_grads(first, second, model: nn.Module, args: tuple, kwargs: dict, rng: torch.Tensor, losses: List[Any],
                 take: Callable[[List[Optional[torch.Tensor]], List[Optional[torch.Tensor]]], bool]
                 ) -> Tuple[int, bool]:
    """``training_grads`` of ``first`` and of ``second`` side by side: both forwards run (the second from the state
    the first started from: buffers put back, the same draws), then under each of ``losses`` in turn a backward of
    each, whose gradients go to ``take(first's, second's)`` and are dropped; no further loss once ``take`` returns
    True. Returns (the number of losses handed to ``take``, whether it stopped short because one side changed in
    place a tensor the other's graph saved: a buffer the second forward or a backward updates, as a reversible
    segment's recomputation does; autograd refuses that backward, and the caller measures the remaining losses
    apart). Each set of gradients is ``training_grads``' bit for bit (the same
    forward from the same state, the same backward), but only one set of each is alive at a time: the fidelity gate
    confirms a plan on losses whose eager gradients it would otherwise keep, a copy of the parameters' gradients per
    loss, at the cost of two forwards alive at once."""
    params, buffers = list(model.parameters()), list(model.buffers())
    runs = []
    with preserved_state(model):
        start = [b.detach().clone() for b in buffers]
        for fn in (first, second):
            fn_args, fn_kwargs, inputs = _fresh_inputs(args, kwargs)
            _start_step(model, params, rng)
            out = fn(*fn_args, **fn_kwargs)
            runs.append((out, inputs, _rng_states()))
            if fn is first:
                with torch.no_grad():  # through .data: the first graph saved some of them (BatchNorm's running
                    for b, value in zip(buffers, start):  # statistics) and must not see a new version
                        b.data.copy_(value)
        del start
        count = 0
        for index, loss_fn in enumerate(losses):
            last = index == len(losses) - 1
            sets = []
            for out, inputs, after in runs:
                try:
                    sets.append(_backward_grads(out, loss_fn, params, inputs, after, last))
                except RuntimeError as error:
                    if "modified by an inplace operation" not in str(error):
                        raise
                    for p in params:
                        p.grad = None
                    return count, True
            count += 1
            done = take(*sets)
            del sets
            if done:
                break
        del runs
    return count, False


def _same(a: Optional[torch.Tensor], b: Optional[torch.Tensor]) -> bool:
    if a is None or b is None:
        return a is None and b is None
    if a.shape != b.shape or a.dtype != b.dtype:
        return False
    if a.is_floating_point() or a.is_complex():
        nan = a.isnan()
        return bool(torch.equal(nan, b.isnan()) and torch.equal(a[~nan], b[~nan]))
    return bool(torch.equal(a, b))


def _differences(model: nn.Module, eager: StepResult, captured: StepResult, method: str,
                 grads: bool = True) -> List[str]:
    names = [n for n, _ in model.named_parameters()]
    buffer_names = [n for n, _ in model.named_buffers()]
    found = []
    if len(eager.output) != len(captured.output) or not all(map(_same, eager.output, captured.output)):
        found.append("the training forward's outputs differ (a value the trace fixed as a constant: a draw from "
                     "torch with no tensor argument (torch.randn(8, 8)), from Python's or numpy's RNG, or a tensor's "
                     "value read in Python?)")
    bad = [n for n, a, b in zip(buffer_names, eager.buffers, captured.buffers) if not _same(a, b)]
    if bad:
        found.append(f"buffers after the step differ: {', '.join(bad[:4])}{' ...' if len(bad) > 4 else ''} (an "
                     f"in-place buffer update in forward that the graph does not repeat)")
    bad = [n for n, a, b in zip(names, eager.grads, captured.grads) if grads and not _same(a, b)]
    if bad:
        found.append(f"gradients differ: {', '.join(bad[:4])}{' ...' if len(bad) > 4 else ''} (a custom "
                     f"autograd Function traced through, whose backward the graph does not call?)")
    if not all(map(_same, eager.input_grads, captured.input_grads)):
        found.append("input gradients differ")
    if captured.saved_bytes > eager.saved_bytes:
        why = ("torch.export's ATen graph saves intermediates the eager kernels do not" if method == "export" else
               "torch.utils.checkpoint or a memory-saving autograd Function traced away?")
        found.append(f"the graph keeps {captured.saved_bytes} bytes for backward where the eager model keeps "
                     f"{eager.saved_bytes} ({why})")
    return found


# Rounds of one more graph step and one more eager step, at most, to see whether gradients that differ only in their
# last bits are a kernel's run-to-run noise: on CPU the gradient of SDPA's learned, batch-broadcast attn_mask
# (TinyViT's attention biases) differs in its last bits between identical steps, eager or captured, in about one
# step of four.
RERUNS = 4
# Only differences this small against the gradient's largest entry are retried (a reordered float sum moves a few
# units in the last place; a real difference, a custom Function traced through, is far larger).
LAST_BITS = 1e-5


def _run_to_run(model: nn.Module, graph: fx.GraphModule, args: tuple, kwargs: dict, rng: torch.Tensor,
                eager: StepResult, captured: StepResult) -> Optional[List[str]]:
    """The parameters whose gradients differ between ``eager`` and ``captured`` when another graph step matches
    ``eager`` on them bit for bit, or another eager step matches ``captured`` (the steps are not reproducible, and
    the graph does what eager does); None when no such pair turns up in ``RERUNS`` rounds or the differences are
    not last-bit ones."""
    names = [n for n, _ in model.named_parameters()]
    differing = [i for i, (a, b) in enumerate(zip(eager.grads, captured.grads)) if not _same(a, b)]
    if not differing or any(eager.grads[i] is None or captured.grads[i] is None
                            or eager.grads[i].shape != captured.grads[i].shape for i in differing):
        return None
    if not all((captured.grads[i] - eager.grads[i]).abs().max().item()
               <= LAST_BITS * eager.grads[i].abs().max().item() for i in differing):
        return None
    for _ in range(RERUNS):
        for step, other in ((graph, eager), (model, captured)):
            again = training_step(step, model, args, kwargs, rng).grads
            if all(_same(again[i], other.grads[i]) for i in differing):
                return [names[i] for i in differing]
    log.info("memopt: %s: gradients differ from eager's in their last bits and no re-run of either step agreed "
             "(%d rounds): %s", type(model).__name__, RERUNS, ", ".join(names[i] for i in differing[:4]))
    return None


def _dtype_hint(model: nn.Module, args: tuple, kwargs: dict) -> str:
    """Names floating inputs whose dtype no floating parameter has (float64 data for a float32 model)."""
    dtypes = {p.dtype for p in model.parameters() if p.is_floating_point()}
    odd = [(keystr(path), t.dtype) for path, t in tree_flatten_with_path((args, kwargs))[0]
           if isinstance(t, torch.Tensor) and t.is_floating_point() and dtypes and t.dtype not in dtypes]
    if not odd:
        return ""
    path, dtype = odd[0]
    want = sorted(str(d).replace("torch.", "") for d in dtypes)[0]
    return (f"Example input {path} is {str(dtype).replace('torch.', '')} but the parameters are "
            f"{', '.join(sorted(str(d).replace('torch.', '') for d in dtypes))}: pass it as x.to(torch.{want}). ")


def check_capture(model: nn.Module, gm: fx.GraphModule, method: str, args: tuple, kwargs: dict,
                  recapture=None) -> Soundness:
    """Compare one training step of ``gm`` (captured by ``method``, not rewritten) with the eager ``model`` on a
    slice of the inputs; raise ``TraceError`` naming what differs. ``recapture(args, kwargs)`` captures again on
    the slice when ``gm`` is specialised to the full batch's shapes (torch.export)."""
    if any(_is_abstract(t) for t in tree_flatten((args, kwargs))[0]):
        log.info("memopt: soundness check of %s skipped: the example inputs are fake or meta tensors",
                 type(model).__name__)
        return Soundness(False, "skipped: fake or meta example inputs")
    sliced_args, sliced_kwargs, which = batch_slice(args, kwargs)
    graph = gm
    if method == "export" and which != "the whole example batch" and recapture is not None:
        graph = recapture(sliced_args, sliced_kwargs)  # export graphs are specialised to their input shapes
    rng = unseen_rng_state()
    fingerprint = attribute_fingerprint(model)
    try:
        eager = training_step(model, model, sliced_args, sliced_kwargs, rng)
    except Exception as e:  # noqa: BLE001 - reported with the model named
        raise MemoptError(f"memopt cannot check its capture of {type(model).__name__}: one training step of the "
                          f"eager model on {which} of the example inputs fails ({type(e).__name__}: {e}). "
                          f"{_dtype_hint(model, args, kwargs)}Pass example inputs the model trains on.") from e
    changed = changed_attributes(fingerprint, attribute_fingerprint(model))
    if changed:
        raise TraceError(f"memopt cannot capture {type(model).__name__}: its forward changes Python attributes "
                         f"({', '.join(changed[:4])}), which a captured graph would not do. Keep such state in "
                         f"buffers, or optimize the submodules without it.",
                         f"forward changes Python attributes {', '.join(changed[:4])}")
    try:
        captured = training_step(graph, model, sliced_args, sliced_kwargs, rng)
    except Exception as e:  # noqa: BLE001 - the captured graph does not run where the model does
        raise TraceError(f"memopt's capture of {type(model).__name__} ({method}) fails on {which} of the example inputs "
                         f"where the eager model runs ({type(e).__name__}: {e}).",
                         f"capture check ({method}): the graph fails: {type(e).__name__}: {str(e)[:120]}") from e
    found = _differences(model, eager, captured, method)
    noise: List[str] = []
    if found and not _differences(model, eager, captured, method, grads=False):  # only gradients differ
        noise = _run_to_run(model, graph, sliced_args, sliced_kwargs, rng, eager, captured) or []
        if noise:
            found = []
            log.info("memopt: %s: the gradients of %s are not reproducible between identical steps (a kernel's "
                     "run-to-run noise); a re-run of the graph or of eager matched the other bit for bit: accepted",
                     type(model).__name__, ", ".join(noise[:4]))
    if found:
        detail = "; ".join(found)
        raise TraceError(f"memopt's capture of {type(model).__name__} ({method}) does not train as the eager model "
                         f"does on {which} of the example inputs: {detail}. memopt refuses to run it; it falls back "
                         f"to the submodules whose capture is sound and runs the rest eagerly.",
                         f"capture check ({method}): {detail}")
    return Soundness(True, which, eager.saved_bytes, captured.saved_bytes, noise)


# -------------------------------------------------------------------------- attribute guards
_PRIMITIVES = (bool, int, float, str, type(None))
_PLAIN = frozenset(_PRIMITIVES)  # the exact types, tested first: most attributes are one of them


def _primitive(value: Any) -> bool:
    if isinstance(value, _PRIMITIVES):
        return True
    return isinstance(value, tuple) and all(isinstance(v, _PRIMITIVES) for v in value)


def attribute_fingerprint(model: nn.Module, paths: Optional[List[str]] = None,
                          walked: Optional[Walked] = None) -> Tuple:
    """The plain Python attributes (bool, int, float, str, None, tuples of them; ``training`` included) of every
    submodule (only those under ``paths`` when given): what a captured forward may have read as constants. A
    training forward compares it with the capture's and captures again when it changed. ``walked``:
    ``memopt.core.modules.walk(model)``, when the caller has it."""
    out: List[tuple] = []
    for name, module in walk(model) if walked is None else walked:
        if paths is not None and not any(name == p or name.startswith(p + ".") or not p for p in paths):
            continue
        # public attributes only (``training`` among them): the rest is nn.Module's own bookkeeping
        out.extend((name, key, value) for key, value in vars(module).items()
                   if key[:1] != "_" and (type(value) in _PLAIN or _primitive(value)))
    return tuple(out)


def changed_attributes(before: Tuple, after: Tuple) -> List[str]:
    """``name.attr: old -> new`` for every guarded attribute that differs between two fingerprints."""
    old = {(n, k): v for n, k, v in before}
    new = {(n, k): v for n, k, v in after}
    return [f"{n + '.' if n else ''}{k}: {old.get((n, k))!r} -> {new.get((n, k))!r}"
            for (n, k) in sorted(set(old) | set(new)) if old.get((n, k)) != new.get((n, k))]

