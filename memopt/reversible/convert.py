"""Convert runs of plain residual blocks into a reversible form (opt-in: changes the function).

Plain residual blocks ``h_i = h_{i-1} + F_i(h_{i-1})`` have no inverse, so memopt's safe mode
leaves them alone. ``convert`` rewires a run of them (n >= ``min_blocks``) as

    h_1 = h_0 + F_1(h_0)                   (unchanged)
    (s_0, s_1) = chunk(cat([h_0, h_1]))    (two streams; a copy, so the segment starts at a split)
    h_2 = s_0 + F_2(s_1),  h_3 = s_1 + F_3(h_2),  h_i = h_{i-2} + F_i(h_{i-1})  (i >= 4)

which keeps every weight and every F_i as it is, and in which each update is an additive coupling:
``memopt.optimize`` on the converted model then finds one reversible segment per run. The
function changes: ``Conversion.max_abs_change`` is max |output difference| on the example batch at
the current weights; fine-tune before relying on the converted model.

The converted model is a module of its own, sharing the original's parameters, buffers and
submodules (the same objects; ``state_dict`` keys unchanged). It holds one rewritten graph per
mode, traced in train and in eval mode, so code that reads ``self.training`` behaves as in the
original in both.
"""
from __future__ import annotations

import operator
from dataclasses import dataclass, field
from typing import Any, Dict, List, Optional, Set, Tuple

import torch
from torch import fx, nn

from memopt.core.inputs import normalize_inputs
from memopt.core.errors import MemoptError
from memopt.core.state import preserved_state, share_module_state

_ADDS = (operator.add, torch.add)
_MAX_CONE = 5000


@dataclass
class Conversion:
    """What ``convert`` did: the residual adds of each converted run (train-mode graph node names),
    the function change on the example batch and the parameter counts (equal: weights are kept)."""

    runs: List[List[str]] = field(default_factory=list)
    skipped: List[str] = field(default_factory=list)
    max_abs_change: float = 0.0
    max_abs_output: float = 0.0
    params_before: int = 0
    params_after: int = 0

    def __str__(self) -> str:
        blocks = sum(len(r) for r in self.runs)
        lines = [f"memopt convert: {len(self.runs)} run(s) of plain residual blocks ({blocks} blocks) rewired to "
                 f"h_i = h_(i-2) + F_i(h_(i-1)); parameters {self.params_before} -> {self.params_after}",
                 f"the function CHANGED: max |output difference| on the example batch {self.max_abs_change:.4g} "
                 f"(max |output| {self.max_abs_output:.4g}); fine-tune the converted model"]
        lines += [f"  not converted: {why}" for why in self.skipped]
        return "\n".join(lines)


@dataclass
class _Residual:
    node: fx.Node  # the add
    x: fx.Node  # the input of the block (the residual operand)
    cone: Set[fx.Node]  # F's nodes


def _residual(node: fx.Node) -> Optional[_Residual]:
    """``node`` = x + F(x) with F reading only x, parameters and constants, used only by the add."""
    if node.op != "call_function" or node.target not in _ADDS or len(node.args) != 2 or node.kwargs:
        return None
    for x, r in (node.args, node.args[::-1]):
        if not isinstance(x, fx.Node) or not isinstance(r, fx.Node) or x is r:
            continue
        cone, stack, reads_x, ok = set(), [r], False, True
        while stack and ok:
            n = stack.pop()
            if n in cone:
                continue
            if n.op in ("placeholder", "output") or len(cone) > _MAX_CONE:
                ok = False
                break
            cone.add(n)
            for a in n.all_input_nodes:
                if a is x:
                    reads_x = True
                elif a.op != "get_attr":
                    stack.append(a)
        if not ok or not reads_x:
            continue
        if any(u not in cone and u is not node for n in cone for u in n.users):
            continue
        if any(u not in cone and u is not node for u in x.users):
            continue
        return _Residual(node, x, cone)
    return None


def _runs(graph: fx.Graph) -> List[List[_Residual]]:
    runs: List[List[_Residual]] = []
    for node in graph.nodes:
        res = _residual(node)
        if res is None:
            continue
        if runs and runs[-1][-1].node is res.x:
            runs[-1].append(res)
        else:
            runs.append([res])
    return runs


def _rewire(gm: fx.GraphModule, min_blocks: int) -> Tuple[List[List[str]], List[str]]:
    converted, skipped = [], []
    for run in _runs(gm.graph):
        if len(run) < min_blocks:
            skipped.append(f"a run of {len(run)} residual block(s) ending at {run[-1].node.name} "
                           f"(fewer than min_blocks={min_blocks})")
            continue
        h0, h1 = run[0].x, run[0].node
        with gm.graph.inserting_after(h1):
            cat = gm.graph.call_function(torch.cat, ([h0, h1],), {"dim": 0})
        with gm.graph.inserting_after(cat):
            chunk = gm.graph.call_function(torch.chunk, (cat, 2), {"dim": 0})
        with gm.graph.inserting_after(chunk):
            s0 = gm.graph.call_function(operator.getitem, (chunk, 0))
        with gm.graph.inserting_after(s0):
            s1 = gm.graph.call_function(operator.getitem, (chunk, 1))
        for n in run[1].cone:
            n.replace_input_with(h1, s1)
        run[1].node.replace_input_with(h1, s0)
        run[2].node.replace_input_with(run[1].node, s1)
        for j in range(3, len(run)):
            run[j].node.replace_input_with(run[j - 1].node, run[j - 2].node)
        converted.append([r.node.name for r in run])
    gm.graph.lint()
    gm.recompile()
    return converted, skipped


class ConvertedModule(nn.Module):
    """The converted model: the original's parameters, buffers and submodules (the same dicts),
    running the rewired graph of the current mode."""

    def __init__(self, model: nn.Module, graphs: Dict[bool, fx.GraphModule], conversion: Conversion) -> None:
        super().__init__()
        share_module_state(self, model)
        self.training = model.training
        object.__setattr__(self, "_memopt_graphs", graphs)
        object.__setattr__(self, "conversion", conversion)

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        # .forward, not __call__: tracing this module then traces through the graph's code, whose
        # submodule calls resolve to this module's own (shared) submodules
        return self._memopt_graphs[self.training].forward(*args, **kwargs)

    def train(self, mode: bool = True) -> "ConvertedModule":
        super().train(mode)
        return self


def _with_signature(gm: fx.GraphModule) -> type:
    """A ConvertedModule subclass whose ``forward`` takes the graph's inputs by name: fx traces a
    module only through a forward with named parameters, not ``*args``."""
    names = [n.target for n in gm.graph.nodes if n.op == "placeholder"]
    if not all(isinstance(n, str) and n.isidentifier() and not n.startswith("*") for n in names):
        return ConvertedModule
    params = ", ".join(names)
    namespace: Dict[str, Any] = {}
    exec(f"def forward(self, {params}):\n    return self._memopt_graphs[self.training].forward({params})\n",
         namespace)  # noqa: S102 - the source is built from identifiers checked above
    return type(f"Converted{type(gm).__name__}", (ConvertedModule,), {"forward": namespace["forward"]})


def convert(model: nn.Module, example_inputs: Any, *, min_blocks: int = 3) -> ConvertedModule:
    """Rewire runs of plain residual blocks in ``model`` so that they are reversible (see the module
    docstring); returns the converted module, whose ``conversion`` attribute reports the change.

    Args:
        model: an ``nn.Module`` that ``torch.fx.symbolic_trace`` can trace.
        example_inputs: a tensor or a tuple of positional inputs, to measure the function change.
        min_blocks: shortest run to convert (default 3: two blocks give one coupling, too little gain).
    """
    if not isinstance(min_blocks, int) or isinstance(min_blocks, bool) or min_blocks < 3:
        raise ValueError(f"min_blocks must be an int >= 3, got {min_blocks!r}")
    args, kwargs = normalize_inputs(example_inputs)
    mode = model.training
    graphs: Dict[bool, fx.GraphModule] = {}
    conversion = Conversion()
    try:
        for training in (True, False):
            model.train(training)
            gm = fx.symbolic_trace(model)
            runs, skipped = _rewire(gm, min_blocks)
            if training:
                conversion.runs, conversion.skipped = runs, skipped
            elif [len(r) for r in runs] != [len(r) for r in conversion.runs]:
                raise MemoptError(f"convert: {type(model).__name__} has residual runs {conversion.runs} in train "
                                  f"mode but {runs} in eval mode; convert needs the same block structure in both")
            # the graph reads parameters, buffers and submodules through the model's own dicts, so
            # whoever swaps them on the model (torch.export, torch.func) swaps them for the graph too
            share_module_state(gm, model)
            graphs[training] = gm
    except fx.proxy.TraceError as e:
        raise MemoptError(f"convert: torch.fx.symbolic_trace cannot trace {type(model).__name__} ({e}); convert "
                          f"rewires an fx graph, so the model's forward must be traceable") from e
    finally:
        model.train(mode)
    if not conversion.runs:
        raise MemoptError(f"convert: {type(model).__name__} has no run of >= {min_blocks} plain residual blocks "
                          f"h + F(h) (F reading only h and parameters); nothing to convert"
                          + (f" ({'; '.join(conversion.skipped)})" if conversion.skipped else ""))
    converted = _with_signature(graphs[True])(model, graphs, conversion)
    with preserved_state(model), torch.no_grad():
        seed = torch.initial_seed()
        torch.manual_seed(seed)
        before = model(*args, **kwargs)
        torch.manual_seed(seed)
        after = converted(*args, **kwargs)
    conversion.max_abs_change = max(((a.float() - b.float()).abs().max().item() for a, b in
                                     zip(_tensors(before), _tensors(after))), default=0.0)
    conversion.max_abs_output = max((a.float().abs().max().item() for a in _tensors(before)), default=0.0)
    conversion.params_before = sum(p.numel() for p in model.parameters())
    conversion.params_after = sum(p.numel() for p in converted.parameters())
    return converted


def _tensors(value: Any) -> List[torch.Tensor]:
    from torch.utils._pytree import tree_leaves

    return [t for t in tree_leaves(value) if isinstance(t, torch.Tensor) and t.is_floating_point()]
