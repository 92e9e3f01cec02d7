"""Find reversible segments in a captured graph (analysis only; passes/reversible/segments.py rewrites them).

A scan starts at a split/chunk of a tensor into a partition (its parts are the *streams*) and walks
the graph in order. Each node that reads a stream or a pending value is one of:

- a **coupling** ``u' = u + h`` / ``h + u`` / ``u - h``: ``u`` a stream, ``h`` a stream other
  than ``u`` or a pending value whose cone (the pending nodes it comes from) reads no ``u``, has
  no in-place or outside input, and whose every node is used only inside the cone. ``u'`` replaces
  ``u``; the cone is consumed;
- **glue** that only moves elements, on a stream it is the only user of (reshape, permute,
  pixel (un)shuffle, chunk/split into a partition, ...) or a cat of all streams;
- otherwise a **pending** value (part of some ``H`` still to be consumed by a coupling).

After every step with nothing pending the scan records a checkpoint. A segment ends at the last
checkpoint where every value inside it, except the final streams, is used only inside it (an
interior value used outside, or a stream saved by an op outside, would keep what the segment
frees) and it holds at least one coupling. Nodes that stop a segment get a reason for the report.
"""
from __future__ import annotations

import operator
from dataclasses import dataclass, field
from typing import Dict, List, Optional, Set, Tuple

import torch
import torch.nn.functional as F
from torch import fx, nn

from memopt.core.meta import META_KEY
from memopt.cost_model.op_registry import op_kind

aten = torch.ops.aten

# Ops that only move elements (permutations), so their VJP is their inverse: pattern data.
GLUE_METHODS = {"view", "reshape", "flatten", "unflatten", "permute", "transpose", "contiguous", "flip", "unsqueeze",
                "squeeze", "chunk", "split", "t"}
GLUE_FUNCTIONS = {torch.flatten, torch.reshape, torch.permute, torch.transpose, torch.flip, torch.unsqueeze,
                  torch.squeeze, torch.chunk, torch.split, F.pixel_shuffle, F.pixel_unshuffle, torch.pixel_shuffle,
                  torch.pixel_unshuffle, torch.channel_shuffle}
GLUE_MODULES = (nn.Flatten, nn.Unflatten, nn.PixelShuffle, nn.PixelUnshuffle, nn.ChannelShuffle)
GLUE_ATEN = {aten.view, aten.reshape, aten._unsafe_view, aten.flatten, aten.unflatten, aten.permute, aten.transpose,
             aten.t, aten.flip, aten.unsqueeze, aten.squeeze, aten.split, aten.split_with_sizes, aten.chunk,
             aten.pixel_shuffle, aten.pixel_unshuffle, aten.channel_shuffle, aten.clone, aten.alias}
SPLITS = {"chunk", "split", torch.chunk, torch.split, aten.split, aten.split_with_sizes, aten.chunk}
CATS = {torch.cat, aten.cat}
# coupling ops: spelling -> (sign, the callable that runs it)
ADDS = {operator.add: operator.add, torch.add: torch.add, "add": operator.add, "__add__": operator.add,
        aten.add: aten.add.Tensor}
SUBS = {operator.sub: operator.sub, torch.sub: torch.sub, "sub": operator.sub, "__sub__": operator.sub,
        aten.sub: aten.sub.Tensor}
MULS = {operator.mul: "mul", torch.mul: "mul", "mul": "mul", "__mul__": "mul", "__rmul__": "mul", aten.mul: "mul",
        operator.truediv: "div", torch.div: "div", "div": "div", "__truediv__": "div", aten.div: "div"}
_FLOAT_STREAMS = ("float32", "float64")
MIN_SLOPE = 0.1  # LeakyReLU slopes below this amplify rounding error by > 10x per inverse
MIN_SCALE = 1e-3  # |scale| and |gamma| below this make an inverse divide by nearly zero


@dataclass
class FoundStep:
    kind: str  # "coupling" | "glue" | "bijection"
    node: fx.Node
    reads: List[fx.Node]  # coupling: [u, *V]
    writes: List[fx.Node]  # coupling: [u']; glue: its outputs (getitems for a split)
    cone: List[fx.Node] = field(default_factory=list)  # H's nodes, graph order (coupling)
    sign: int = 1
    u_first: bool = True
    target: object = None
    inverse: str = ""  # bijection (aggressive mode): "leaky_relu", "affine", "batch_norm"
    params: tuple = ()


@dataclass
class Segment:
    name: str
    inputs: List[fx.Node]
    outputs: List[fx.Node]
    steps: List[FoundStep]

    def nodes(self) -> List[fx.Node]:
        inside: List[fx.Node] = []
        for step in self.steps:
            inside.extend(step.cone)
            inside.append(step.node)
            inside.extend(w for w in step.writes if w is not step.node)
        return inside

    @property
    def couplings(self) -> int:
        return sum(step.kind == "coupling" for step in self.steps)


def op_key(node: fx.Node):
    """What a call node calls, one spelling per op: the method name, the callable, or the ATen packet."""
    if node.op == "call_method":
        return node.target
    target = node.target
    return target.overloadpacket if isinstance(target, torch._ops.OpOverload) else target


def _lookup(table, node: fx.Node):
    """``table[op_key(node)]`` for call nodes (tables and sets of spellings), else None."""
    try:
        if node.op not in ("call_function", "call_method"):
            return None
        key = op_key(node)
        return table.get(key) if isinstance(table, dict) else (True if key in table else None)
    except TypeError:  # an unhashable target
        return None


def is_glue(node: fx.Node, modules: Dict[str, nn.Module]) -> bool:
    if node.op == "call_module":
        return isinstance(modules.get(node.target), GLUE_MODULES)
    if node.op == "call_method":
        return node.target in GLUE_METHODS
    if node.op != "call_function":
        return False
    key = op_key(node)
    try:
        return key in GLUE_FUNCTIONS or key in GLUE_ATEN
    except TypeError:
        return False


def is_inplace(node: fx.Node, modules: Dict[str, nn.Module]) -> bool:
    if node.kwargs.get("inplace") is True:
        return True
    if node.op == "call_module":
        return bool(getattr(modules.get(node.target), "inplace", False))
    target = node.target
    if isinstance(target, torch._ops.OpOverload):
        return target._schema.is_mutable
    name = target if isinstance(target, str) else getattr(target, "__name__", "")
    return (name.endswith("_") and not name.endswith("__")) or name in ("iadd", "isub", "imul", "itruediv") or \
        name.startswith("__i")


def is_random(node: fx.Node, modules: Dict[str, nn.Module]) -> bool:
    """Whether the node draws random numbers (a dropout with p = 0 draws none: no RNG state kept)."""
    if op_kind(node, modules) == "dropout":
        if node.op == "call_module":
            return getattr(modules.get(node.target), "p", 1.0) != 0
        p = node.kwargs.get("p", node.args[1] if len(node.args) > 1 else 0.5)
        return not (isinstance(p, (int, float)) and p == 0)
    name = node.target if isinstance(node.target, str) else getattr(node.target, "__name__", str(node.target))
    return any(word in name for word in ("rand", "bernoulli", "dropout", "multinomial", "normal"))


def _dtype(node: fx.Node) -> Optional[str]:
    cost = node.meta.get(META_KEY)
    if cost is not None and cost.dtypes:
        return str(cost.dtypes[0]).replace("torch.", "")
    val = node.meta.get("val", node.meta.get("tensor_meta"))
    dtype = getattr(val, "dtype", None)
    return None if dtype is None else str(dtype).replace("torch.", "")


def _shapes(node: fx.Node) -> Optional[list]:
    cost = node.meta.get(META_KEY)
    return list(cost.shapes) if cost is not None and cost.shapes is not None else None


def _split_outputs(node: fx.Node) -> Optional[List[fx.Node]]:
    """The getitem users of a split/chunk, in order, when they cover every part; else None."""
    if _lookup(SPLITS, node) is None or not node.users:
        return None
    parts = _shapes(node)
    items: Dict[int, fx.Node] = {}
    for user in node.users:
        if user.op != "call_function" or user.target is not operator.getitem or not isinstance(user.args[1], int):
            return None
        items[user.args[1]] = user
    if parts is None or sorted(items) != list(range(len(parts))) or len(parts) < 2:
        return None
    return [items[i] for i in range(len(parts))]


class _Scan:
    """One scan from a split node; see the module docstring."""

    def __init__(self, gm: fx.GraphModule, split: fx.Node, parts: List[fx.Node], modules: Dict[str, nn.Module],
                 aggressive: bool = False):
        self.gm, self.modules, self.aggressive = gm, modules, aggressive
        self.source = split.args[0]
        self.streams: List[fx.Node] = list(parts)
        self.pending: Dict[fx.Node, Set[fx.Node]] = {}  # pending node -> streams its cone reads
        self.poisoned: Dict[fx.Node, str] = {}
        self.steps: List[FoundStep] = [FoundStep("glue", split, [self.source], list(parts))]
        self.checkpoints: List[Tuple[int, List[fx.Node]]] = [(1, list(parts))]
        self.reasons: Dict[fx.Node, str] = {}
        self.done: Set[fx.Node] = set(parts)

    def run(self) -> None:
        node = self.steps[0].node.next
        while node.op != "output":
            if node not in self.done and not self._visit(node):
                return
            node = node.next

    def _visit(self, node: fx.Node) -> bool:
        ours = [a for a in node.all_input_nodes if a in self.pending or a in self.streams]
        if not ours:
            return True
        if node.op == "placeholder":
            return False
        if is_inplace(node, self.modules):
            self.reasons[node] = f"{node.name} is in place on a value of the segment"
            return False
        if is_random(node, self.modules) and any(a in self.streams for a in ours):
            self.reasons[node] = (f"{node.name} is random on the stream {ours[0].name} itself (not inside an update): "
                                  f"not invertible, so a segment must end before it")
        step = self._coupling(node) or self._glue(node) or (self._bijection(node) if self.aggressive else None)
        if step is not None:
            self.steps.append(step)
            if not self.pending:
                self.checkpoints.append((len(self.steps), list(self.streams)))
            return True
        reads = set()
        for a in ours:
            reads |= self.pending.get(a, {a})
        self.pending[node] = reads
        outside = [a for a in node.all_input_nodes if a not in ours and a.op != "get_attr"]
        if outside:
            self.poisoned[node] = f"{node.name} reads {outside[0].name} from outside the segment"
        return True

    def _coupling(self, node: fx.Node) -> Optional[FoundStep]:
        sign, target = 1, _lookup(ADDS, node)
        if target is None:
            sign, target = -1, _lookup(SUBS, node)
        if target is None or len(node.args) != 2 or set(node.kwargs) - {"alpha"} or node.kwargs.get("alpha", 1) != 1:
            return None
        a, b = node.args
        choices = [(a, b, True)] + ([(b, a, False)] if sign > 0 else [])
        why = None
        for u, h, u_first in choices:
            if u not in self.streams or not isinstance(h, fx.Node) or h is u:
                continue
            found = self._check_coupling(node, u, h)
            if isinstance(found, str):
                why = why or found
                continue
            cone, sources = found
            for x in cone:
                del self.pending[x]
            self.streams[self.streams.index(u)] = node
            return FoundStep("coupling", node, [u, *sources], [node], cone, sign, u_first, target)
        if why is not None:
            self.reasons[node] = why
        return None

    def _check_coupling(self, node: fx.Node, u: fx.Node, h: fx.Node):
        if _dtype(u) not in _FLOAT_STREAMS or _dtype(node) != _dtype(u):
            return f"{node.name}: stream {u.name} is {_dtype(u)}; streams must stay float32 or wider"
        if _shapes(u) != _shapes(node):
            return f"{node.name}: {u.name} is broadcast by the update"
        if h in self.streams:
            return [], [h]
        if h not in self.pending:
            return f"{node.name}: its update {h.name} is computed outside the segment"
        cone, stack = set(), [h]
        while stack:
            x = stack.pop()
            if x in cone:
                continue
            cone.add(x)
            stack.extend(a for a in x.all_input_nodes if a in self.pending)
        if u in self.pending[h]:
            return f"{node.name}: its update {h.name} reads {u.name}, the stream it updates (H must not read u)"
        stale = [s for s in self.pending[h] if s not in self.streams]
        if stale:
            return f"{node.name}: its update {h.name} reads {stale[0].name}, which an earlier step replaced"
        for x in cone:
            if x in self.poisoned:
                return f"{node.name}: {self.poisoned[x]}"
            outside = [user for user in x.users if user not in cone and user is not node]
            if outside:
                return (f"{node.name}: {x.name}, an intermediate of its update, is also used by "
                        f"{outside[0].name} outside it")
        order = [x for x in self.gm.graph.nodes if x in cone]
        sources = [s for s in self.streams if s in self.pending[h]]
        return order, sources

    def _glue(self, node: fx.Node) -> Optional[FoundStep]:
        if node.op == "call_function" and _lookup(CATS, node) is not None:
            parts = node.args[0] if node.args else node.kwargs.get("tensors")
            if isinstance(parts, (list, tuple)) and len(parts) == len(self.streams) and \
                    set(parts) == set(self.streams) and len(set(parts)) == len(parts) and not self.pending:
                self.streams = [node]
                return FoundStep("glue", node, list(parts), [node])
            return None
        if not is_glue(node, self.modules):
            return None
        tensors = [a for a in node.all_input_nodes if a.op != "get_attr"]
        if len(tensors) != 1 or tensors[0] not in self.streams or len(tensors[0].users) != 1:
            return None
        stream = tensors[0]
        parts = _split_outputs(node)
        if parts is None and any(u.op == "call_function" and u.target is operator.getitem for u in node.users):
            return None  # a split whose parts are not all used: not a partition
        writes = parts if parts is not None else [node]
        at = self.streams.index(stream)
        self.streams[at:at + 1] = writes
        self.done.update(writes)
        return FoundStep("glue", node, [stream], writes)


    def _bijection(self, node: fx.Node) -> Optional[FoundStep]:
        """An elementwise map with a closed-form inverse on a stream it is the only user of."""
        tensors = [a for a in node.all_input_nodes if a.op != "get_attr"]
        if len(tensors) != 1 or tensors[0] not in self.streams or len(tensors[0].users) != 1 or self.pending:
            return None
        stream = tensors[0]
        found = _bijection_kind(node, stream, self.modules)
        if isinstance(found, str):
            self.reasons[node] = found
            return None
        if found is None:
            return None
        self.streams[self.streams.index(stream)] = node
        return FoundStep("bijection", node, [stream], [node], inverse=found[0], params=found[1])


def _bijection_kind(node: fx.Node, stream: fx.Node, modules: Dict[str, nn.Module]):
    """(inverse kind, params), a reason it is not invertible enough, or None (not a bijection)."""
    kind = op_kind(node, modules)
    if kind == "leaky_relu":
        if node.op == "call_module":
            slope = modules[node.target].negative_slope
        else:
            slope = node.kwargs.get("negative_slope", node.args[1] if len(node.args) > 1 else 0.01)
        if not isinstance(slope, (int, float)) or not slope >= MIN_SLOPE:
            return f"{node.name}: LeakyReLU slope {slope!r} < {MIN_SLOPE}: its inverse amplifies error too much"
        return "leaky_relu", (float(slope),)
    if kind == "batch_norm" and node.op == "call_module":
        bn = modules[node.target]
        if not (bn.training and bn.affine):
            return f"{node.name}: only train-mode BatchNorm with affine parameters is inverted"
        smallest = bn.weight.detach().abs().min().item()
        if not smallest >= MIN_SCALE:
            return f"{node.name}: BatchNorm gamma has |value| {smallest:.2e} < {MIN_SCALE}: not invertible"
        return "batch_norm", (node.target,)
    if kind == "layer_norm" and node.op == "call_module":
        ln = modules[node.target]
        if not ln.elementwise_affine or ln.weight is None:
            return f"{node.name}: only LayerNorm with an affine weight is inverted"
        smallest = ln.weight.detach().abs().min().item()
        if not smallest >= MIN_SCALE:
            return f"{node.name}: LayerNorm gamma has |value| {smallest:.2e} < {MIN_SCALE}: not invertible"
        return "layer_norm", (node.target,)
    op = _lookup(MULS, node) or ("add" if _lookup(ADDS, node) else "sub" if _lookup(SUBS, node) else None)
    if op is None or len(node.args) != 2 or node.kwargs:
        return None
    first, second = node.args
    constant = second if first is stream else first
    if not isinstance(constant, (int, float)) or isinstance(constant, bool):
        return None
    if first is not stream and op in ("sub", "div"):
        return None
    if op in ("mul", "div") and not abs(constant) >= MIN_SCALE:
        return f"{node.name}: scaling by {constant!r} is not invertible enough (|scale| < {MIN_SCALE})"
    return "affine", (op, float(constant))


def _first_violation(segment_nodes: List[fx.Node], outputs: List[fx.Node]) -> Optional[str]:
    inside = set(segment_nodes)
    for node in segment_nodes:
        if node in outputs:
            continue
        for user in node.users:
            if user not in inside:
                return (f"{node.name} is used by {user.name} outside the segment: it would be kept anyway, so the "
                        f"segment cannot end after it")
    return None


def find_segments(gm: fx.GraphModule, aggressive: bool = False) -> Tuple[List[Segment], Dict[fx.Node, str]]:
    """Segments in graph order, and reasons for nodes where a candidate segment stopped or failed.
    ``aggressive``: also take elementwise bijections on streams (``_bijection_kind``)."""
    modules = dict(gm.named_modules())
    segments: List[Segment] = []
    reasons: Dict[fx.Node, str] = {}
    taken: Set[fx.Node] = set()
    for node in list(gm.graph.nodes):
        if node in taken:
            continue
        parts = _split_outputs(node)
        if parts is None or not isinstance(node.args[0], fx.Node):
            continue
        scan = _Scan(gm, node, parts, modules, aggressive)
        scan.run()
        best, why = None, None
        for count, streams in reversed(scan.checkpoints):
            candidate = Segment("", [scan.source], streams, scan.steps[:count])
            if candidate.couplings == 0:
                continue
            why = _first_violation(candidate.nodes(), streams)
            if why is None:
                best = candidate
                break
        if best is None:
            if scan.steps[1:] and any(s.kind == "coupling" for s in scan.steps):
                first = next(s.node for s in scan.steps if s.kind == "coupling")
                reasons[first] = why or "the segment never returns to a state with nothing pending"
            reasons.update({n: r for n, r in scan.reasons.items() if n not in reasons})
            continue
        first = next(s.node for s in best.steps if s.kind == "coupling")
        best.name = f"reversible_{first.name}"
        segments.append(best)
        taken.update(best.nodes())
        for n, r in scan.reasons.items():
            if n not in taken:
                reasons.setdefault(n, r)
    return segments, reasons
