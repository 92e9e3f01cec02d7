"""The keys memopt writes into ``fx.Node.meta``, in one place.

Analyses write, passes and reports read; a pass never reads another pass's private keys.
"""
# the cost model's per-node record (memopt.cost_model.analysis.NodeCost)
META_KEY = "memopt_cost"
# a rewritten node's decision: technique, unit, bits, reason (read by the report and the planner)
DECISION_KEY = "memopt_decision"
# pre-activation histograms recorded on real inputs (memopt.cost_model.histograms)
HISTOGRAM_KEY = "memopt_histogram"
# a stash chain's typed parameters (memopt.stash.ops.ChainSpec), read by the planner
CHAIN_KEY = "memopt_chain"
# storage categories that are model state, not activations
STATE_CATEGORIES = ("parameter", "buffer")
# on a rewritten node that runs a graph of its own which the other techniques rewrote too (a block recomputed from
# codes, whose second forward keeps codes): the attribute holding that graph (``decided_nodes`` walks it)
INNER_GRAPH_KEY = "inner_graph"


def decided_nodes(gm):
    """Every node of ``gm``'s graph, then those of the graphs its rewritten nodes run inside them (``INNER_GRAPH_KEY``
    in their decision): the units rewritten there are the plan's as much as those outside, so the gate can raise
    them and a plan names them (their nodes keep the captured graph's names)."""
    inner = []
    for node in gm.graph.nodes:
        yield node
        attr = (node.meta.get(DECISION_KEY) or {}).get(INNER_GRAPH_KEY)
        if attr is not None:
            inner.append(gm.get_submodule(attr))
    for sub in inner:
        yield from sub.graph.nodes
