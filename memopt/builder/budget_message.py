"""The message of a budget the planner cannot meet: the least peak the config reaches, its largest consumers and
what would free each, and what of the budget is kept free (the workspace reserve, what the build left held)."""
from __future__ import annotations

from memopt.config import Config
from memopt.core.units import fmt_bytes
from memopt.fewbit.activations import ACTIVATIONS
from memopt.record.plan import NodePlan, Plan


def budget_message(plan: Plan, config: Config, held: int = 0) -> str:
    """The requested budget, the least peak the config can reach, and what would free the rest."""
    top = sorted(plan.nodes, key=lambda n: -n.saved_bytes_after)[:5]
    b = plan.estimated_breakdown
    lines = [f"budget_mb={plan.budget_bytes / 2**20:.1f} ({fmt_bytes(plan.budget_bytes)}) cannot be met for "
             f"{plan.model}: the smallest estimated peak with the current config is "
             f"{fmt_bytes(plan.estimated_peak_bytes)} (baseline "
             f"{fmt_bytes(plan.baseline_peak_bytes)}; of it parameters and buffers "
             f"{fmt_bytes(b.get('parameters_and_buffers'))}, gradients {fmt_bytes(b.get('gradients'))}, "
             f"optimizer state {fmt_bytes(b.get('optimizer_state'))}, activations {fmt_bytes(b.get('activations'))}, "
             f"transient {fmt_bytes(b.get('transient'))}).",
             "Largest remaining consumers of saved activation memory, and what would free them:"]
    for n in top:
        lines.append(f"  {n.name} ({n.op}, {n.shape}): {fmt_bytes(n.saved_bytes_after)} - {what_frees(n, config)}")
    reserve = config.workspace_bytes(plan.device)
    if reserve:
        lines.append(f"Of the budget, {fmt_bytes(reserve)} is kept free for cuDNN/cuBLAS workspaces, which the "
                     f"estimate does not count (Config.workspace_mb={config.workspace_mb!r}; None means "
                     f"{reserve // 2**20} MiB on {plan.device}).")
    if held:
        lines.append(f"Of the budget, {fmt_bytes(held)} is what this build has left held in the process's resident "
                     f"memory (buffer pools and caches of its checks; measured), which the training steps run beside "
                     f"(Config.workspace_mb set to a number replaces this measured reserve).")
    if plan.estimated_peak_bytes > plan.baseline_peak_bytes:
        lines.append(f"On this model the rewrites' backward temporaries outweigh what they free: the least peak is "
                     f"the baseline's own, {fmt_bytes(plan.baseline_peak_bytes)}.")
    lines.append("Raise budget_mb, lower the batch size, or widen the techniques' plan_bits in memopt.Config.")
    return "\n".join(lines)


def what_frees(node: NodePlan, config: Config) -> str:
    if node.technique == "stash" and node.bits:
        return (f"a {node.bits}-bit stash, the fewest bits StashConfig.plan_bits={config.stash.plan_bits} allows; "
                f"adding {node.bits // 2 or 1} to plan_bits would shrink it" if node.bits > 1 else
                "a 1-bit stash already")
    if node.technique == "recompute":
        return "a recomputed block: keeps only its inputs already"
    if node.technique == "fewbit" and node.bits:
        return (f"{node.bits}-bit few-bit codes; add {node.bits - 1} to FewBitConfig.plan_bits to shrink them"
                if node.bits > 1 else "a 1-bit code already")
    if node.op == "batch_norm" and config.stash is None:
        return "exact; enable the stash (Config.stash=memopt.StashConfig())"

    if node.op in ACTIVATIONS and config.fewbit is None:
        return "exact; enable few-bit (Config.fewbit=memopt.FewBitConfig())"
    why = node.reason or "no enabled technique rewrites this op"
    return f"exact: {why}; only recomputation (torch.utils.checkpoint) or a smaller batch frees it"
