"""The plan-time check of a reversible segment on the example inputs.

``pieces`` runs the segment's steps forward from its true input (twice: ``H`` must be
deterministic), then rebuilds the stream states backwards step by step and compares each with the
true one. Walking from the end, a step whose rebuilt input is further than ``threshold`` (relative
L2) from the truth ends the current piece there (the next piece keeps that state: an anchor); a
step that fails even from its true output stays exact. Each piece's gradients are then compared
with plain autograd. Everything runs on the real example inputs with the model's state (buffers,
RNG, grads) restored afterwards.

The example inputs reach the pass explicitly (``PassContext.examples``: ``real_examples`` of the graph's
placeholder values, None on fake or meta inputs, when the check is skipped).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Dict, List, Optional, Sequence, Tuple

import torch
from torch import fx
from torch._subclasses.fake_tensor import FakeTensor

from memopt.core.inputs import Examples

from memopt.reversible.ops import ReversibleSegment, _Reversible, relative_error, run_forward, undo_steps
from memopt.runtime.rng import rng_state, set_rng_state
from memopt.core.state import preserved_state


def real_examples(flat: Optional[List[Any]]) -> Optional[Examples]:
    """``Examples`` of the real placeholder values ``flat``; None when there are none or they are fake or meta
    (then nothing can be checked)."""
    if flat is None or any(isinstance(t, torch.Tensor) and (t.is_meta or isinstance(t, FakeTensor)) for t in flat):
        return None
    return Examples(list(flat))


def true_values(gm: fx.GraphModule, examples: Examples, wanted: Sequence[fx.Node]) -> Dict[str, torch.Tensor]:
    """The values of ``wanted`` nodes in one real forward of ``gm`` (state restored, no autograd)."""
    names = {n.name for n in wanted}
    key = ("values", id(gm), frozenset(names))
    if key in examples.cache:
        return examples.cache[key]
    values: Dict[str, torch.Tensor] = {}

    class Recorder(fx.Interpreter):
        def run_node(self, n: fx.Node) -> Any:
            out = super().run_node(n)
            if n.name in names:
                values[n.name] = out
            return out

    with preserved_state(gm), torch.no_grad():
        Recorder(gm).run(*examples.inputs)
    examples.cache[key] = values
    return values


@dataclass
class Piece:
    start: int  # first step
    end: int  # one past the last step
    rebuild_error: float  # worst relative error of a rebuilt stream state inside the piece
    grad_error: Optional[float] = None  # relative error of the gradients vs plain autograd
    rejected: str = ""


@dataclass
class CheckResult:
    pieces: List[Piece]
    dropped: Dict[int, str]  # step index -> why it stays exact
    forward_ok: bool = True
    why: str = ""


def check_segment(segment: ReversibleSegment, true_input: Sequence[torch.Tensor], true_output: Optional[Sequence[torch.Tensor]],
                  boundaries: Sequence[Sequence[str]], threshold: float, tolerance: float,
                  anchor_every: Optional[int], state_of: Any) -> CheckResult:
    """Split ``segment`` into checked pieces (see the module docstring). ``boundaries[k]``: the stream
    names before step k (and after the last). ``state_of``: the module whose state to restore."""
    n = len(segment.steps)
    with preserved_state(state_of), torch.no_grad():  # restores the generators too
        rng_start = rng_state(true_input)
        states: List[Dict[str, torch.Tensor]] = []
        outputs, extras, shapes = run_forward(segment, true_input, lambda k, s: states.append(dict(s)))
        set_rng_state(rng_start, true_input)
        again, _, _ = run_forward(segment, true_input)
    if not all(torch.equal(a, b) for a, b in zip(outputs, again)):
        return CheckResult([], {}, False, "its forward is not deterministic (two runs differ), so inputs "
                                          "cannot be rebuilt from outputs")
    if true_output is not None and not all(torch.equal(a, b) for a, b in zip(outputs, true_output)):
        return CheckResult([], {}, False, "running its steps does not reproduce the graph's values bit for bit")
    def undo_one(k: int, after: Dict[str, torch.Tensor]) -> Dict[str, torch.Tensor]:
        sub = sub_segment(segment, k, k + 1, boundaries)
        with preserved_state(state_of), torch.no_grad():
            rebuilt, _, _ = undo_steps(sub, [after[name] for name in sub.outputs],
                                       {0: extras[k]} if k in extras else {}, {0: shapes[k]} if k in shapes else {})
        out = {name: t for name, t in after.items() if name not in sub.outputs}
        out.update(rebuilt)
        return out

    pieces: List[Piece] = []
    dropped: Dict[int, str] = {}
    end = n
    while end > 0:
        current, worst, couplings, k = dict(states[end]), 0.0, 0, end - 1
        while k >= 0:
            step = segment.steps[k]
            couplings += step.kind == "coupling"
            rebuilt = undo_one(k, current)
            names = list(boundaries[k])
            error = relative_error([rebuilt[s] for s in names], [states[k][s] for s in names])
            too_long = anchor_every is not None and couplings > anchor_every
            if error > threshold or too_long:
                if k == end - 1:
                    dropped[k] = (f"{step.where}: rebuilding its input from its output has relative error "
                                  f"{error:.2e} > {threshold:.1e} (tolerance / margin); it stays exact")
                    end = k
                else:
                    pieces.append(Piece(k + 1, end, worst))
                    end = k + 1
                break
            worst, current, k = max(worst, error), rebuilt, k - 1
        else:
            pieces.append(Piece(0, end, worst))
            end = 0
    pieces.reverse()
    checked: List[Piece] = []
    while pieces:  # gradients: a piece that fails is halved at a coupling until its parts pass
        piece = pieces.pop(0)
        couplings = [i for i in range(piece.start, piece.end) if segment.steps[i].kind == "coupling"]
        if not couplings:
            checked.append(piece)
            continue
        piece.grad_error = _grad_error(segment, piece, states, boundaries, state_of)
        if piece.grad_error <= tolerance:
            checked.append(piece)
        elif len(couplings) > 1:
            cut = couplings[len(couplings) // 2]
            pieces[:0] = [Piece(piece.start, cut, piece.rebuild_error), Piece(cut, piece.end, piece.rebuild_error)]
        else:
            piece.rejected = (f"its gradients differ from plain autograd by {piece.grad_error:.2e} relative "
                              f"(> tolerance {tolerance:g}) even for one coupling; it stays exact")
            checked.append(piece)
    return CheckResult(checked, dropped)


def sub_segment(segment: ReversibleSegment, start: int, end: int, boundaries: Sequence[Sequence[str]],
                name: Optional[str] = None, **kwargs: Any) -> ReversibleSegment:
    """Steps ``start:end`` of ``segment`` as a segment of their own (sharing its sub-modules)."""
    steps = segment.steps[start:end]
    read = {r for s in steps for r in s.reads}
    written = {w for s in steps for w in s.writes}
    inputs = [s for s in boundaries[start] if s in read]
    outputs = [s for s in boundaries[end] if s in written or s in inputs]
    modules = {s.module: getattr(segment, s.module) for s in steps}
    return ReversibleSegment(name or segment.name, inputs, outputs, steps, modules, **kwargs)


def _grad_error(segment: ReversibleSegment, piece: Piece, states: List[Dict[str, torch.Tensor]],
                boundaries: Sequence[Sequence[str]], state_of: Any) -> float:
    """Relative error of all input and parameter gradients together (one L2 norm over every element):
    the piece's Function vs plain autograd. Per tensor it would be dominated by parameters whose true
    gradient is (numerically) zero -- conv biases ahead of a train-mode BatchNorm -- where both sides
    are rounding noise."""
    sub = sub_segment(segment, piece.start, piece.end, boundaries)
    params = sub.params()
    grads: List[Tuple[torch.Tensor, ...]] = []
    with preserved_state(state_of):  # restores the generators too
        rng = rng_state([states[piece.start][name] for name in sub.inputs])
        generator = torch.Generator().manual_seed(0)
        for reversible in (False, True):
            inputs = [states[piece.start][name].detach().clone().requires_grad_(True) for name in sub.inputs]
            set_rng_state(rng, inputs)
            with torch.enable_grad():
                if reversible:
                    out = _Reversible.apply(sub, len(inputs), *inputs, *params)
                    outs = list(out) if isinstance(out, tuple) else [out]
                else:
                    outs, _, _ = run_forward(sub, inputs)
                generator.manual_seed(0)
                loss = sum((o * torch.randn(o.shape, generator=generator, dtype=o.dtype).to(o.device)).sum()
                           for o in outs)
                grads.append(torch.autograd.grad(loss, inputs + params, allow_unused=True))
    plain, rebuilt = grads
    pairs = [(b, a) for a, b in zip(plain, rebuilt) if a is not None and b is not None]
    if not pairs:
        return 0.0
    return relative_error([torch.cat([b.double().flatten() for b, _ in pairs])],
                          [torch.cat([a.double().flatten() for _, a in pairs])])
