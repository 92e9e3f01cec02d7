"""The codes inside a block recomputed from codes are units of the plan (``memopt.core.meta.decided_nodes``): the
plan names them, a plan applied again rewrites them at its bits, a decision that does not name them leaves the
block's inside exact, and the fidelity gate raises them as it raises the units outside, where it used to drop the
whole block's recomputation because the codes it could not see were what missed."""
import copy

import torch

import memopt
from memopt.core.meta import DECISION_KEY
from memopt.testing.zoo import build


def _config(fewbit_bits: int = 3, fidelity: bool = False) -> memopt.Config:
    return memopt.Config(recompute=memopt.RecomputeConfig(segments=None, bits=8),
                         fewbit=memopt.FewBitConfig(bits=fewbit_bits),
                         **({} if fidelity else {"fidelity": None}))


def _blocks(om):
    gm = om.graph_module
    return {n.meta[DECISION_KEY]["unit"]: (n, getattr(gm, n.args[0].target)) for n in gm.graph.nodes
            if (n.meta.get(DECISION_KEY) or {}).get("technique") == "recompute"}


def _inside(om):
    """{(technique, unit): bits} of the rewrites inside the recomputed blocks' own graphs."""
    out = {}
    for _, sub in _blocks(om).values():
        for node in sub.graph.nodes:
            decision = node.meta.get(DECISION_KEY) or {}
            if decision.get("technique") not in (None, "exact") and "unit" in decision:
                out[(decision["technique"], decision["unit"])] = decision.get("level", decision.get("bits"))
    return out


def test_the_plan_names_the_codes_inside_recomputed_blocks():
    model, x = build("vit")
    om = memopt.optimize(model, example_inputs=x, config=_config(), optimizer="sgd")
    inside = _inside(om)
    assert ("fewbit", "blocks_0_act") in inside, sorted(inside)
    chosen = om.plan.chosen_units()
    assert {(t, u) for t, u in inside} <= {(t, u) for t, us in chosen.items() for u in us}
    assert all(chosen[t][u] == bits for (t, u), bits in inside.items())
    assert all(bits == 8 for bits in chosen["recompute"].values())


def test_a_plan_applied_again_rewrites_the_inside_at_its_bits_and_only_the_units_it_names():
    model, x = build("vit")
    om = memopt.optimize(copy.deepcopy(model), example_inputs=x, config=_config(), optimizer="sgd")
    again = memopt.optimize(copy.deepcopy(model), example_inputs=x, optimizer="sgd", plan=om.plan)
    assert _inside(again) == _inside(om)
    assert again.plan.estimated_peak_bytes == om.plan.estimated_peak_bytes
    plan = copy.deepcopy(om.plan)  # a plan from before inner units were named: the blocks' insides stay exact
    plan.units = [u for u in plan.units if (u["chosen"]["technique"], u["chosen"]["unit"]) not in _inside(om)]
    older = memopt.optimize(copy.deepcopy(model), example_inputs=x, optimizer="sgd", plan=plan)
    assert set(_blocks(older)) == set(_blocks(om)) and not _inside(older)
    assert older.plan.estimated_peak_bytes > om.plan.estimated_peak_bytes


def test_the_gate_raises_a_code_inside_a_recomputed_block_and_keeps_the_block():
    # 1-bit GELU tables miss the gate's cosine on the ViT: with the GELUs inside recomputed blocks, the gate used
    # to see only the blocks and made them exact, dropping the recomputation that lowers the peak
    model, x = build("vit")
    torch.manual_seed(0)
    om = memopt.optimize(model, example_inputs=x, config=_config(fewbit_bits=1, fidelity=True), optimizer="sgd")
    report = om.plan.fidelity
    assert report["passed"], report
    assert any(c.startswith("fewbit") for c in report["changes"]), report["changes"]
    assert not any(c.startswith("recompute") for c in report["changes"]), report["changes"]
    chosen = om.plan.chosen_units()
    assert set(chosen["recompute"]) == set(_blocks(om)) and set(chosen["recompute"].values()) == {8}
    inside = _inside(om)
    gelus = {u: b for (t, u), b in inside.items() if t == "fewbit"}
    assert gelus and all(b > 1 for b in gelus.values()), gelus


def test_weight_gradient_chunks_reach_the_consumers_inside_recomputed_blocks():
    # a model whose blocks are all recomputed peaks in a block's backward: the weight gradients from codes there
    # are chunked as those outside are (chunk_to_fit / a plan's weight_grad_chunks)
    from memopt.passes.stash.chunks import chunks_of, consumers, set_chunks

    model, x = build("vit")
    om = memopt.optimize(model, example_inputs=x, config=_config(), optimizer="sgd")
    gm = om.graph_module
    inner = [n for n in consumers(gm) if n.graph is not gm.graph]
    assert inner, "no weight gradient from codes inside the recomputed blocks"
    set_chunks(gm, 4)
    assert chunks_of(gm) == 4 and all(n.kwargs["chunks"] == 4 for n in inner)
    for _, sub in _blocks(om).values():  # the code each block runs says so, not only its graph
        if any(n.graph is sub.graph for n in inner):
            assert "chunks = 4" in sub.code
    set_chunks(gm, 1)
    assert all("chunks" not in n.kwargs for n in consumers(gm))
