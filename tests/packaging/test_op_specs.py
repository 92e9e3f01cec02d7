"""memopt's graph ops take their non-tensor parameters as one typed spec and are read by parameter name, never by
position (issue 38): ``<Spec>.of(node)`` and ``memopt.core.leaf.argument(node, name)`` bind a node's args to the op's
own signature, where ``conv.args[13]`` silently reads another argument once the signature changes. The scan
(``op_reads.py``: which variables hold graph op nodes, and how it decides) walks passes/, memopt/ and cost_model/;
it is checked here on the very reads it replaced.
"""
from __future__ import annotations

import functools
import inspect
import sys

import pytest
import torch
from torch import fx

from memopt.core.errors import MemoptError
from memopt.core.leaf import LEAF_FUNCTIONS, argument, set_argument
from memopt.stash.ops import ChainSpec, FromStashSpec, conv_from_stash
from op_reads import Project
from test_layers import ROOT, modules

# graph ops whose non-tensor parameters are exactly those of the stock op they stand in for: no spec
STOCK_SIGNATURES = {"dropout_1bit": "F.dropout(x, p)", "where_1bit": "torch.where (tensors only)",
                    "max_pool2d_indices_only": "F.max_pool2d's", "bn_exact_link": "F.batch_norm's momentum and eps",
                    "reversible_segment": "a ReversibleSegment module and the inputs",
                    "cross_entropy_rows": "aten.cross_entropy_loss's reduction and ignore_index"}


@functools.lru_cache(maxsize=None)
def _project() -> Project:
    return Project({name: (str(path.relative_to(ROOT)), path.read_text()) for name, path in modules().items()})


def test_no_positional_reads_of_memopt_graph_ops():
    found = _project().findings()
    assert not found, "positional reads of memopt graph ops' arguments:\n" + "\n".join(found)


def test_the_scan_sees_every_graph_op_and_each_takes_a_spec():
    """The ops the scan finds are the registered ones; each takes its non-tensor parameters as a ``spec``
    NamedTuple with a reader ``of`` (but those whose parameters are the stock op's own: ``STOCK_SIGNATURES``)."""
    scanned, registered = set(_project().ops), {f.__name__ for f in LEAF_FUNCTIONS}
    assert scanned == registered, f"the scan finds {sorted(scanned - registered)} too, misses " \
                                  f"{sorted(registered - scanned)}"
    missing = []
    for fn in LEAF_FUNCTIONS:
        spec = inspect.signature(fn).parameters.get("spec")
        annotation = spec.annotation if spec is not None else None  # a string with `from __future__ import annotations`
        cls = getattr(sys.modules[fn.__module__], annotation, None) if isinstance(annotation, str) else annotation
        if fn.__name__ not in STOCK_SIGNATURES and not (hasattr(cls, "_fields") and hasattr(cls, "of")):
            missing.append(f"{fn.__module__}.{fn.__name__}{inspect.signature(fn)}")
    assert not missing, ("graph ops without a typed spec (a NamedTuple parameter `spec` with `of = "
                         "classmethod(spec_of)`):\n" + "\n".join(missing))


# the positional reads this test replaced (issue 38), as they stood, and ATen reads beside them that must pass
_OPS = '''
@graph_leaf
def bn_act_stash(x, weight, bias, running_mean, running_var, num_batches_tracked, residual, spec: ChainSpec, x2=None):
    pass

@graph_leaf
def conv_from_stash(y, weight, bias, packed, mask_packed, affine, zero_code, spec: FromStashSpec, chunks=1):
    pass

@graph_leaf
def fewbit_activation(x, spec: FewBitSpec):
    pass

CONSUMERS = (conv_from_stash,)
'''
_PASS = '''
from ops import CONSUMERS, bn_act_stash, conv_from_stash, fewbit_activation

def fidelity(new):
    if new.target is not fewbit_activation:
        return 0.0
    _, kind, params, bits, borders, levels = new.args[:6]                                        # line 7

def keeps_nothing(user, end):
    return user.target is bn_act_stash and user.args[6] is end                                   # line 10

def chain(node):
    if node.target is not bn_act_stash:
        return False
    return node.meta.get("chain") is not None

def links(gm):
    found = []
    for first in gm.graph.nodes:
        if not chain(first) or first.args[1] is None:                                            # line 20
            continue
        conv = next(iter(first.users))
        if conv.target is not conv_from_stash or conv.args[0] is not first:                      # line 23
            continue
        following = next(iter(conv.users))
        if following.args[:1] != (conv,) or chain(following):                                   # ATen or ours
            found.append((first, conv, following))
    return found

def link(first, conv):
    spec = first.meta["chain"]._replace(link_groups=conv.args[13])                              # line 31
    first.args = (*first.args[:7], spec, *first.args[8:])                                       # line 32

def stash_pass(gm):
    for first, conv, following in links(gm):
        link(first, conv)

def dispatch(new):
    if new.target in CONSUMERS:
        return rebuilt(new)
    if new.target is bn_act_stash:
        return 0.0
    return new.args[0]                                                                           # ATen: passes

def rebuilt(new):
    args = new.args
    return args[3]                                                                               # line 47

def matched(nxt):
    if nxt.op == "call_function" and nxt.target is not bn_act_stash:
        return nxt.args[0].users                                                                 # ATen: passes
    return [n.args[1] for n in nxt.users if n.target is conv_from_stash]                        # line 52
'''


def test_the_scan_catches_the_reads_it_replaced():
    found = Project({"ops": ("ops.py", _OPS), "passes": ("passes.py", _PASS)}).findings()
    lines = [int(f.split(":")[1]) for f in found]
    assert lines == [7, 10, 20, 23, 31, 32, 32, 47, 52], "\n".join(found)
    assert found[0].startswith("passes.py:7: `new.args[:6]` reads a memopt graph op's arguments by position")
    assert "FewBitSpec.of(new) for fewbit_activation's spec" in found[0]
    assert "conv_from_stash has no argument at position 13" in found[4] and "FromStashSpec.of(conv)" in found[4]
    assert "stash_pass() passes conv at line 36, where links() gives it" in found[4]
    assert 'memopt.core.leaf.argument(first, "weight") for bn_act_stash\'s weight' in found[2]
    assert 'memopt.core.leaf.argument(new, "packed")' in found[7]


def test_spec_helpers_read_and_write_by_name():
    graph = fx.Graph()
    tensors = [graph.placeholder(n) for n in ("y", "w", "b", "packed", "mask", "affine", "zero")]
    spec = FromStashSpec(4, "relu", (), ((1, 1), (0, 0), (1, 1), 8))
    node = graph.call_function(conv_from_stash, (*tensors, spec))
    assert FromStashSpec.of(node) == spec and FromStashSpec.of(node).groups == 8
    assert argument(node, "weight") is tensors[1] and argument(node, "chunks") == 1
    set_argument(node, "chunks", 4)
    set_argument(node, "spec", spec._replace(bits=8))
    assert node.kwargs == {"chunks": 4} and FromStashSpec.of(node).bits == 8 and len(node.args) == 8
    with pytest.raises(MemoptError, match="passes FromStashSpec .* not a memopt.stash.ops.ChainSpec"):
        ChainSpec.of(node)
    with pytest.raises(MemoptError, match="not a memopt graph op"):
        argument(graph.call_function(torch.relu, (tensors[0],)), "input")
