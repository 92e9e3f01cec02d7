"""Parameters float32 itself cannot resolve: listed apart from the fidelity gate's check, by measurement.

A cosine against the eager float32 gradient means something only where that gradient is itself the gradient to
float32's resolution. On some models at init and small batches it is not: the same step in float64 points elsewhere
(densenet121 or efficientnet_lite0 at batch 2 and 32x32: stock float32 below cosine 0.999 to float64 on most
parameters; issue 39), and any rewrite that rounds differently moves it as far as the rounding does, so the gate
would chase noise, turning units exact without getting closer. So, without autocast (``autocast_noise`` below
does the same for the low precision), the eager step runs once more on a float64 copy of the model, and
a parameter whose float32 gradient is below the gate's bar against float64's is listed apart with that figure as
the reason: the report names it, the gate does not repair for it.
"""
from __future__ import annotations

import contextlib
import copy
import functools
import logging
import math
from typing import Any, Dict, List, Optional, Tuple

import torch
from torch import nn
from torch.utils.checkpoint import checkpoint

from memopt.capture.soundness import training_step
from memopt.fidelity.tail import with_tails
from memopt.runtime import native_generic

log = logging.getLogger("memopt")

# A float64 copy of parameters and buffers larger than this is not made (the gate checks every parameter then):
# it would double the parameters' memory on the device for one reference step.
FLOAT64_MAX_BYTES = 256 << 20


def _double(value: Any) -> Any:
    if isinstance(value, torch.Tensor):
        return value.double() if value.is_floating_point() else value
    if isinstance(value, (list, tuple)):
        return type(value)(_double(v) for v in value)
    if isinstance(value, dict):
        return {k: _double(v) for k, v in value.items()}
    return value


def parameter_fidelity(names: List[str], exact: List[Optional[torch.Tensor]], approx: List[Optional[torch.Tensor]],
                       tiny: float, invariant: Optional[Dict[str, str]] = None) -> Dict[str, Dict[str, Any]]:
    """{parameter: {"cosine", "relative_error", "tiny", "negligible", "excluded", "numel", "exact_sq",
    "perpendicular_sq"}} of the approximate gradients against the exact ones (the last three for ``tail``);
    ``tiny``: an exact gradient below ``tiny`` times the median norm; ``negligible``: an
    error below that too (a bound at 0.1 of the median let the BatchNorm weight of timm MobileNetV2-035 below
    through again); ``excluded`` (``judged`` passes it whatever its cosine): tiny with a negligible error, or in
    ``invariant`` (parameters whose exact gradient is ~0 by construction). A tiny exact gradient whose
    rewritten one is not (timm MobileNetV2-035 at 8x128: a BatchNorm weight's, 7170 times as large) is an error
    like any other."""
    invariant = invariant or {}
    sums = [None if g is None else _sums(g, g if a is None else a) for g, a in zip(exact, approx)]
    norms = [0.0 if s is None else math.sqrt(s[0]) for s in sums]
    positive = sorted(n for n in norms if n > 0)
    median = positive[len(positive) // 2] if positive else 0.0
    out = {}
    for name, g, a, norm, each in zip(names, exact, approx, norms, sums):
        if g is None or a is None:
            continue
        _, aa, ga, dd = each
        other, error = math.sqrt(aa), math.sqrt(dd)
        cosine = ga / (norm * other) if norm * other > 0 else (1.0 if other == norm else 0.0)
        relative = error / norm if norm > 0 else float(other > 0)
        small = norm <= tiny * median
        negligible = error <= tiny * median
        out[name] = {"cosine": cosine, "relative_error": relative, "tiny": small, "negligible": negligible,
                     "excluded": (small and negligible) or name in invariant, "numel": g.numel(),
                     "exact_sq": norm * norm, "perpendicular_sq": max(aa - ga * ga / (norm * norm), 0.0) if norm > 0
                     else aa}
    return out


def _sums(g: torch.Tensor, a: torch.Tensor) -> Tuple[float, float, float, float]:
    """(sum g², sum a², sum g·a, sum (a - g)²) in double: one pass of the C kernel over two float32 gradients
    (``native_generic.compare``), else float64 copies. ``g`` kept in host memory (the gate's references,
    ``references.on_host``) is brought to ``a``'s device, one parameter at a time."""
    if g.device != a.device:
        g = g.to(a.device)
    found = native_generic.compare(g, a) if g.dtype == a.dtype == torch.float32 else None
    if found is not None:
        return found
    g64, a64 = g.double().flatten(), a.double().flatten()
    d64 = a64 - g64
    return float(g64 @ g64), float(a64 @ a64), float(g64 @ a64), float(d64 @ d64)


def judged(f: Dict[str, Any]) -> float:
    """The cosine a parameter's figures are judged by: 1 where it is listed apart (invariant, or tiny with a
    negligible error) or its error is negligible (``parameter_fidelity``), else its cosine."""
    return 1.0 if f["excluded"] or f["negligible"] else f["cosine"]


def float64_noise(model: nn.Module, args: tuple, kwargs: dict, rng: Any, loss: Any, names: List[str],
                  exact: List[Optional[torch.Tensor]], tiny: float, bar: float,
                  fidelity: Any) -> Optional[Dict[str, str]]:
    """{parameter: why} of the parameters whose eager float32 gradient (``exact``, under ``loss``) is below ``bar``
    against the same step in float64; None where this does not apply (autocast on, not every parameter float32, or
    a bar of 1: that asks for float32 eager's own bits, which float64 does not give), {} where the float64 step could
    not run or would be too large (logged). ``fidelity``: ``parameter_fidelity``. The float64 copy is made for the
    call and dropped after it, not kept for the gate's next loss: alive through the gate it would sit beside the
    gate's reference gradients at optimize()'s peak, where copying again costs a few percent of the float64 step.
    Its blocks are checkpointed (``checkpoint_blocks``), and where that step fails it runs as written."""
    if bar >= 1 or any(torch.is_autocast_enabled(d) for d in ("cpu", "cuda")):
        return None
    tensors = list(model.parameters()) + list(model.buffers())
    if not tensors or any(p.dtype != torch.float32 for p in model.parameters()):
        return None
    size = sum(t.numel() for t in tensors) * 8
    if size > FLOAT64_MAX_BYTES:
        log.info("memopt: no float64 reference step for %s (its float64 copy would take %d MiB); no parameter is "
                 "listed apart as beyond float32's resolution", type(model).__name__, size >> 20)
        return {}
    full, error = None, None
    for blocks in (True, False):  # its blocks checkpointed (a smaller peak), else as written
        twin = copy.deepcopy(model).double()
        if blocks and not checkpoint_blocks(twin):
            continue
        try:
            full = training_step(twin, twin, _double(args), _double(kwargs), rng, loss, throwaway=True).grads
            break
        except (RuntimeError, TypeError, NotImplementedError) as e:  # an op without a float64 kernel, a module that
            error = e  # recomputation does not take
        finally:
            release(twin)
            del twin
    if full is None:
        log.info("memopt: no float64 reference step for %s (%s); no parameter is listed apart as beyond float32's "
                 "resolution", type(model).__name__, str(error).splitlines()[0][:160] if str(error) else error)
        return {}
    figures = fidelity(names, full, exact, tiny)
    return {p: (f"float32 does not resolve it here: the eager float32 gradient is at cosine {f['cosine']:.3f} to "
                f"float64's on the same step, below the bar") for p, f in figures.items()
            if judged(f) < bar}


def checkpoint_blocks(module: nn.Module) -> int:
    """Wrap the forward of every block of ``module`` (a child with children of its own of a Sequential or ModuleList,
    not looked inside) in non-reentrant ``torch.utils.checkpoint``; returns how many. Only for the float64
    reference's throwaway copy: its step in float64 keeps twice float32's activations on the slice, at optimize()'s
    peak beside the gate's references; recomputing each block in backward gives the same gradients bit for bit (the
    same kernels on the same values, the RNG replayed) for one more forward."""
    wrapped = 0
    for child in module.children():
        if not isinstance(child, (nn.Sequential, nn.ModuleList)):
            wrapped += checkpoint_blocks(child)
            continue
        for block in child.children():
            if next(block.children(), None) is not None:
                block.forward = functools.partial(checkpoint, block.forward, use_reentrant=False)
                wrapped += 1
    return wrapped


def release(module: nn.Module) -> None:
    """Drop what ``checkpoint_blocks`` put on ``module``'s blocks: each wrapped ``forward`` holds its block (a
    bound method in the block's own ``__dict__``), a reference cycle that keeps the whole float64 copy, its
    parameters and gradients, resident until Python's cyclic collector happens to run, which can be during the
    user's first training steps, on top of their peak. Without the cycle the copy goes when its last name does."""
    for block in module.modules():
        block.__dict__.pop("forward", None)


def autocast_noise(model: nn.Module, args: tuple, kwargs: dict, rng: Any, loss: Any, names: List[str],
                   exact: List[Optional[torch.Tensor]], tiny: float, bar: float) -> Optional[Dict[str, str]]:
    """Under autocast (None when it is off): {parameter: why} for the parameters whose eager gradient under
    autocast is itself below the bar against eager float32 (one more step, autocast off). There the reference
    the gate compares with is the low precision's rounding, not a gradient: any change of rounding moves it as
    far, and chasing it turned every unit exact without bringing it closer (the bf16 sweep's "autocast floor"
    column: on several CNNs at init the two gradients of a parameter are unrelated)."""
    devices = [d for d in ("cpu", "cuda") if torch.is_autocast_enabled(d)]
    if not devices:
        return None
    try:
        with contextlib.ExitStack() as stack:
            for device in devices:
                stack.enter_context(torch.autocast(device, enabled=False))
            full = training_step(model, model, args, kwargs, rng, loss).grads
    except RuntimeError as error:  # a submodule captured on its own gets low-precision inputs: no float32 step
        log.info("memopt: no float32 reference step under autocast for %s (%s); no parameter is listed apart as "
                 "autocast's noise", type(model).__name__, str(error).splitlines()[0][:160])
        return {}
    figures = parameter_fidelity(names, full, exact, tiny)
    out = {p: (f"under autocast its eager gradient is itself at cosine {f['cosine']:.3f} to float32's: below the "
               f"bar, it is the low precision's rounding, not a reference") for p, f in figures.items()
           if judged(f) < bar}
    # ~0 in float32 (below ``tiny`` of the median) but lifted above that by autocast's rounding: the float32 step
    # is what says the gradient is ~0 (MobileNetV3's BN -> ReLU -> depthwise conv -> BN at init, bias 0: the
    # ReLU passes the first BN's scale through and the second cancels it)
    out.update({p: (f"its float32 gradient is below {tiny:g} of the median (~0): under autocast the eager one is "
                    f"rounding") for p, f in figures.items() if f["tiny"]})
    return out


def worst_over(figures: List[Dict[str, Dict[str, Any]]]) -> Dict[str, Dict[str, Any]]:
    """Per parameter, its worst figures over the projections under which it is gated; apart only where it is apart
    under every one. A gradient tiny under one loss is judged under the others: excluded under any, it passed
    unchecked under all (timm MobileNetV2-035 at 8x128: a BatchNorm weight tiny under one gate loss had cosines
    0.03-0.55 under every fresh projection). What is excluded under one loss only is a small gradient whose error is
    negligible there (``parameter_fidelity``): rounding near the tiny bar, not a miss. A parameter of few elements
    whose losses predict a lower cosine under fresh projections than any of them gave is judged by that prediction
    (``tail.with_tails``)."""
    per: Dict[str, Dict[str, Any]] = {}
    for each in figures:
        for p, f in each.items():
            if p not in per or (not f["excluded"], -judged(f), -f["cosine"]) > \
                    (not per[p]["excluded"], -judged(per[p]), -per[p]["cosine"]):
                per[p] = f
    return with_tails(per, figures)


def gate_report(per_parameter: Dict[str, Dict[str, Any]], failing: List[str], invariant: Dict[str, str],
                **head: Any) -> Dict[str, Any]:
    """The gate's report (``Plan.fidelity``): ``head`` (its verdict, changes, steps ...), then the worst parameter,
    those below the bar, those listed apart and every parameter's figures."""
    kept = {p: f for p, f in per_parameter.items() if not f["excluded"]}
    worst = min(kept.items(), key=lambda kv: (judged(kv[1]), kv[1]["cosine"])) if kept else None
    return {
        **head,
        "worst": None if worst is None else {"parameter": worst[0], "cosine": round(worst[1]["cosine"], 6),
                                             "relative_error": round(worst[1]["relative_error"], 6)},
        "below": [f"{p} ({per_parameter[p]['cosine']:.4f}" + (f", the 1% tail its {per_parameter[p]['tail']} losses "
                  f"predict)" if per_parameter[p].get("tail") else ")") for p in failing],
        "tiny": sorted(p for p, f in per_parameter.items() if f["tiny"]),
        "invariant": {p: invariant[p] for p in sorted(invariant) if p in per_parameter},
        "parameters": {p: {"cosine": round(f["cosine"], 6), "relative_error": round(f["relative_error"], 6),
                           **({"tail": f["tail"]} if f.get("tail") else {})} for p, f in per_parameter.items()},
    }


def _misses(figures: Dict[str, Dict[str, Any]], bar: float) -> bool:
    """Whether a parameter misses the bar under one loss's figures."""
    return any(judged(f) < bar for f in figures.values())


def per_min(per_parameter: Dict[str, Dict[str, Any]]) -> float:
    """The least cosine over the parameters not listed apart."""
    return min((judged(f) for f in per_parameter.values()), default=1.0)
