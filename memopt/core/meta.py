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
