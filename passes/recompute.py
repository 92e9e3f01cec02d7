"""The recompute pass: chosen blocks become one call that keeps only the block's inputs.

Blocks are found from ``node.meta["nn_module_stack"]`` (recorded by both capture paths): a node
belongs to the outermost module on its stack whose path ends in an index (a member of a Sequential
or ModuleList) and that is not the node's own leaf module. A block is eligible when its nodes are
contiguous in the graph, take from outside only tensors and values holding no tensor (``attn_mask=None``, a
size: passed through as they are; attributes are copied in), have exactly one value used outside (a tensor),
and contain no in-place op on an outside tensor.

A block recomputed from codes (``bits`` set) is approximate and gated anyway, so what it keeps while backward runs
it again is coded too (``RecomputeConfig.codes_inside``): the passes after this one (``PassContext.later``: the
stash, few-bit) run on the block's own graph at their configs' defaults, as they would have where the block was.
Its second forward then keeps codes where checkpointing keeps float tensors, which is what is alive at the peak
of a model whose every block is recomputed (the block being recomputed's own saved tensors and its backward).
The forward stays bit-identical (every such rewrite keeps it); the gate checks the gradients of the block as one
unit, and makes the whole block exact where they miss.
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Dict, List, Optional, Tuple, Union

import torch
from torch import fx

from memopt.core.leaf import argument
from memopt.core.meta import HISTOGRAM_KEY, META_KEY
from memopt.cost_model.op_registry import op_kind
from memopt.recompute.ops import RecomputeSpec, recompute_block, recompute_from_codes
from memopt.core.meta import DECISION_KEY, INNER_GRAPH_KEY
from memopt.recompute.config import RecomputeConfig
from memopt.passes.stash.chains import code_error
from memopt.passes.base import PassContext, PassResult, PlannerHooks, register_pass
from memopt.passes.manager import run_passes


@dataclass
class Block:
    name: str  # module path with dots as underscores
    path: str
    nodes: List[fx.Node]


def _block_path(node: fx.Node) -> Optional[str]:
    stack = node.meta.get("nn_module_stack")
    if not stack:
        return None
    paths = [value[0] if isinstance(value, tuple) else str(key) for key, value in stack.items()]
    own = paths[-1] if node.op == "call_module" else None
    for path in paths:
        if path.rsplit(".", 1)[-1].isdigit() and path != own:
            return path
    return None


def find_blocks(gm: fx.GraphModule) -> List[Block]:
    """Maximal contiguous runs of nodes sharing a block path, in graph order."""
    blocks: List[Block] = []
    for node in gm.graph.nodes:
        if node.op in ("placeholder", "output", "get_attr"):
            continue
        path = _block_path(node)
        if path is None:
            continue
        if blocks and blocks[-1].path == path and _adjacent(blocks[-1].nodes[-1], node):
            blocks[-1].nodes.append(node)
        else:
            blocks.append(Block(path.replace(".", "_"), path, [node]))
    names: Dict[str, int] = {}
    for block in blocks:  # a block split in two runs gets a suffix on its second run
        count = names.get(block.name, 0)
        names[block.name] = count + 1
        if count:
            block.name = f"{block.name}_{count}"
    return blocks


def _adjacent(previous: fx.Node, node: fx.Node) -> bool:
    walker = previous.next
    while walker is not node and walker.op == "get_attr":
        walker = walker.next
    return walker is node


def why_not(block: Block) -> Union[str, Tuple[List[fx.Node], fx.Node]]:
    """(outside inputs, the single output node), or the reason the block cannot be recomputed."""
    inside = set(block.nodes)
    inputs: List[fx.Node] = []
    for node in block.nodes:
        for arg in node.all_input_nodes:
            if arg in inside or arg.op == "get_attr" or arg in inputs:
                continue
            cost = arg.meta.get(META_KEY)
            if cost is None or len(cost.shapes) > 1:
                return f"it reads {arg.name}, which is not a single tensor"
            inputs.append(arg)  # a value holding no tensor (attn_mask=None, a size) passes through as it is
        if _inplace_on(node, inside):
            return f"{node.name} modifies an input of the block in place"
    # a size read off one of its tensor inputs (a dynamic export's ``sym_size``) is read inside the block instead,
    # so that the block run on part of the batch reads that part's size (memopt.recompute.chunks)
    inputs = [a for a in inputs if _size_source(a, inputs) is None]
    outputs = [n for n in block.nodes if any(u not in inside for u in n.users)]
    if len(outputs) != 1:
        return f"{len(outputs)} of its values are used outside it (one is needed)"
    cost = outputs[0].meta.get(META_KEY)
    if cost is None or len(cost.shapes) != 1:
        return f"its output {outputs[0].name} is not a single tensor"
    if not any(n.meta[META_KEY].shapes for n in inputs):
        return "it reads no tensor from outside"
    return inputs, outputs[0]


def _size_source(node: fx.Node, inputs: List[fx.Node]) -> Optional[Tuple[fx.Node, int]]:
    """(a tensor among ``inputs``, a dimension of it) whose size is ``node``'s value, where ``node`` is a symbolic
    size (a dynamic export's ``sym_size`` of the model's input: the same symbol as the block's input's batch);
    else None."""
    value = node.meta.get("val")
    if not isinstance(value, torch.SymInt):
        return None
    for source in inputs:
        tensor = source.meta.get("val")
        if source is node or not isinstance(tensor, torch.Tensor):
            continue
        for dim, size in enumerate(tensor.shape):
            if isinstance(size, torch.SymInt) and size.node.expr == value.node.expr:
                return source, dim
    return None


def _inplace_on(node: fx.Node, inside: set) -> bool:
    first = node.args[0] if node.args else None
    if not isinstance(first, fx.Node) or first in inside:
        return False
    if node.kwargs.get("inplace") is True:
        return True
    if isinstance(node.target, torch._ops.OpOverload):  # an export graph's ATen op: its schema says what it writes
        arguments = node.target._schema.arguments
        return bool(arguments) and arguments[0].alias_info is not None and arguments[0].alias_info.is_write
    target = node.target if isinstance(node.target, str) else getattr(node.target, "__name__", "")
    if node.op in ("call_method", "call_function") and target.endswith("_") and not target.endswith("__"):
        return True
    if node.op == "call_module":
        module = node.graph.owning_module.get_submodule(node.target)
        return bool(getattr(module, "inplace", False))
    return False


def _extract(gm: fx.GraphModule, block: Block, inputs: List[fx.Node], output: fx.Node) -> fx.GraphModule:
    graph = fx.Graph()
    env: Dict[fx.Node, fx.Node] = {}
    for i, node in enumerate(inputs):
        env[node] = graph.placeholder(f"input_{i}")
    for node in block.nodes:
        for arg in node.all_input_nodes:
            if arg.op == "get_attr" and arg not in env:
                env[arg] = graph.get_attr(arg.target)
            elif arg not in env and arg not in inputs:  # a size read off its input inside (see why_not)
                source, dim = _size_source(arg, inputs)
                env[arg] = graph.call_function(torch.ops.aten.sym_size.int, (env[source], dim))
                env[arg].meta = dict(arg.meta)
        env[node] = graph.node_copy(node, lambda n: env[n])
    graph.output(env[output])
    return fx.GraphModule(gm, graph, class_name=f"Recomputed_{block.name}")


def _code_inside(sub: fx.GraphModule, inputs: List[fx.Node], ctx: PassContext) -> List[str]:
    """Run the passes after recompute (``ctx.later``) on a block's own graph ``sub``; the names of the nodes they
    rewrote. Without a decision at their configs' defaults; under one (a plan applied, the fidelity gate's trials)
    at its bits for the units it names inside the block (their nodes keep the captured graph's names, and
    ``decided_nodes`` lists them among the plan's units), so the gate raises or drops a code inside a recomputed
    block as it does one outside, and the units it does not name stay exact.
    The block's inputs are foreign to its graph: backward keeps the rebuilt ones alive while it runs, so a code
    that only frees an input frees nothing."""
    placeholders = [n for n in sub.graph.nodes if n.op == "placeholder"]
    for placeholder, outer in zip(placeholders, inputs):
        placeholder.meta.update({k: outer.meta[k] for k in (META_KEY, HISTOGRAM_KEY) if k in outer.meta})
    inner = dataclasses.replace(ctx, explore=False, level=None, later=(), examples=None,
                                foreign_inputs=True, gate_exact=frozenset())
    run_passes(sub, ctx.later, inner)
    return sorted(n.name for n in sub.graph.nodes if n.op != "placeholder"
                  and n.meta.get(DECISION_KEY, {}).get("technique") not in (None, "exact"))


GROUP = 256  # the generic stash's group: a float32 minimum and step per 256 codes


def _fidelity(new: fx.Node, baseline, unit: str) -> float:
    """0 for an exact recomputation; from codes, the squared error of nearest rounding at the code's step over
    the coded inputs' elements (the stash's proxy, ``code_error``), so that the gate never takes it for exact."""
    if new.target is not recompute_from_codes:
        return 0.0
    spec = RecomputeSpec.of(new)
    total = 0.0
    for arg in argument(new, "inputs"):
        cost = arg.meta.get(META_KEY) if isinstance(arg, fx.Node) else None
        if cost is not None and cost.shapes and cost.dtypes and cost.dtypes[0].startswith(("float", "bfloat")):
            total += code_error(arg, spec.bits, spec.group, 12)
    return total


_PLANNER = PlannerHooks(
    fidelity=_fidelity,
    levels=lambda cfg: (None,), last_resort=True, reruns_forward=True)


@register_pass(RecomputeConfig, planner=_PLANNER)
def recompute_pass(gm: fx.GraphModule, cfg: RecomputeConfig, ctx: PassContext) -> PassResult:
    if cfg.segments == () and ctx.decision is None and not ctx.explore:
        return PassResult(gm, False)
    modules = dict(gm.named_modules())
    modified = False
    for block in find_blocks(gm):
        if not ctx.selects("recompute", block.name, cfg.segments):
            continue
        found = why_not(block)
        if isinstance(found, str):
            for node in block.nodes:
                node.meta.setdefault(DECISION_KEY, {"technique": "exact", "reason": f"recompute: {found}"})
            continue
        inputs, output = found
        sub = _extract(gm, block, inputs, output)
        attr = f"memopt_recompute_{block.name}"
        gm.add_submodule(attr, sub)
        random = any(op_kind(n, modules) == "dropout" for n in block.nodes)
        bits = ctx.bits("recompute", block.name, cfg.bits)
        inside = _code_inside(sub, inputs, ctx) if bits is not None and cfg.codes_inside and ctx.later else []
        with gm.graph.inserting_before(block.nodes[0]):
            module_node = gm.graph.get_attr(attr)
            spec = RecomputeSpec(random, block.path, bits, GROUP)  # bits None: inputs kept as they are
            new = gm.graph.create_node("call_function", recompute_block if bits is None else recompute_from_codes,
                                       (module_node, spec, *inputs), name=f"{block.name}_recompute")
        new.meta[DECISION_KEY] = {"technique": "recompute", "bits": bits, "unit": block.name,
                                  "replaces": [n.name for n in block.nodes],
                                  "reason": "recomputed in backward from its inputs (exact; one extra forward)"
                                  if bits is None else f"recomputed in backward from its inputs' {bits}-bit codes "
                                  f"(approximate gradients; one extra forward)" + (
                                      f"; inside it {len(inside)} ops keep codes as the other techniques' defaults "
                                      f"rewrite them ({', '.join(inside[:3])}{' ...' if len(inside) > 3 else ''})"
                                      if inside else ""), "inside": inside}
        if inside:
            new.meta[DECISION_KEY][INNER_GRAPH_KEY] = attr
        if META_KEY in output.meta:  # shapes for the next block's checks (the re-annotation replaces it)
            new.meta[META_KEY] = dataclasses.replace(output.meta[META_KEY], name=new.name, saved=[], flops=0)
        if "val" in output.meta:  # the capture's value (symbolic sizes: the next block reads them, _size_source)
            new.meta["val"] = output.meta["val"]
        output.replace_all_uses_with(new)
        attributes = {a for n in block.nodes for a in n.all_input_nodes if a.op == "get_attr"}
        for node in reversed(block.nodes):
            gm.graph.erase_node(node)
        for node in attributes:
            if not node.users:  # now read inside the block's own graph only
                gm.graph.erase_node(node)
        modified = True
    return PassResult(gm, modified)
