"""Weight ops after a coded norm rebuild their input from the norm's input codes (memopt/stash/rebuild.py,
passes/stash/generic.py ``_rewrite_rebuilt``): no codes of their own, forward bit-identical, input gradient
exact, weight gradient from the norm of the rebuilt input, bytes as estimated."""
import copy
import pickle

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import memopt
from memopt.stash.generic import EncodeSpec, generic_encode, group_dequantize
from memopt.stash.rebuild import RebuildSpec, weight_op_from_rebuild

CODED = memopt.Config(stash=memopt.StashConfig(generic=True), fewbit=None, fidelity=None)


@pytest.fixture(autouse=True)
def _one_thread(one_thread):
    yield


class PreNorm(nn.Module):
    """Pre-norm blocks: a LayerNorm module feeding q / k / v, a functional layer_norm feeding an MLP, an
    RMSNorm module feeding a matmul with a parameter, and a GroupNorm feeding a 1x1 conv."""

    def __init__(self, d=32):
        super().__init__()
        self.inp = nn.Linear(16, d)
        self.ln, self.q, self.k, self.v = nn.LayerNorm(d), nn.Linear(d, d), nn.Linear(d, d), nn.Linear(d, d)
        self.w2, self.b2 = nn.Parameter(torch.ones(d) * 1.1), nn.Parameter(torch.zeros(d) + 0.1)
        self.fc1, self.fc2 = nn.Linear(d, 2 * d), nn.Linear(2 * d, d)
        self.rms, self.proj = nn.RMSNorm(d), nn.Parameter(torch.randn(d, d) / d ** 0.5)
        self.gn, self.conv = nn.GroupNorm(4, d), nn.Conv1d(d, d, 1)

    def forward(self, x):
        x = self.inp(x)
        h = self.ln(x)
        x = x + torch.tanh(self.q(h) * self.k(h)) * self.v(h)
        x = x + self.fc2(torch.tanh(self.fc1(F.layer_norm(x, (32,), self.w2, self.b2, 1e-5))))
        x = x + torch.tanh(self.rms(x) @ self.proj)
        return x + self.conv(self.gn(x.transpose(1, 2))).transpose(1, 2)


def test_weight_ops_after_a_coded_norm_keep_no_codes_of_their_own():
    torch.manual_seed(0)
    model, x = PreNorm(), torch.randn(4, 24, 16)
    om = memopt.optimize(copy.deepcopy(model), example_inputs=x, config=CODED)
    rebuilt = {n.name: n for n in om.plan.nodes if n.op == "weight_op_from_rebuild"}
    assert {"q_stash", "k_stash", "v_stash", "fc1_stash", "matmul_stash", "conv_stash"} <= set(rebuilt)
    assert all("as layer_norm of the 8-bit codes" in rebuilt[n].reason for n in ("q_stash", "fc1_stash"))
    assert "as rms_norm" in rebuilt["matmul_stash"].reason and "as group_norm" in rebuilt["conv_stash"].reason
    # the codes belong to the norm's unit: raising it (the gate, the planner) raises what the rebuild reads too
    units = {u["chosen"]["unit"]: u["chosen"] for u in om.plan.units}
    assert units["ln_coded"]["fidelity"] > 0 and units["rms_coded"]["fidelity"] > 0
    assert "matmul_coded" not in {n.name for n in om.plan.nodes}  # x @ parameter: rewritten once, as a weight op
    # the norms' outputs are not coded: only their inputs are, once, shared with the norm
    encoded = [n.name for n in om.graph_module.graph.nodes if n.target is generic_encode]
    assert not any(name.startswith(("ln_codes", "layer_norm_codes", "rms_codes", "gn_codes")) for name in encoded)
    saved = memopt.measure(om, x).saved_bytes
    assert saved == om.plan.estimated_saved_bytes and 2 * saved < om.plan.baseline_saved_bytes
    torch.manual_seed(1)
    out = om(x)
    torch.manual_seed(1)
    ref = model(x)
    assert torch.equal(out, ref)
    out.square().mean().backward()
    ref.square().mean().backward()
    for (name, p), q in zip(om.original_module.named_parameters(), model.parameters()):
        assert F.cosine_similarity(p.grad.flatten(), q.grad.flatten(), 0) > 0.99, name
    # the printed graph re-creates the spec: fx prints the NamedTuple by importing its class
    code = om.graph_module.code
    # (groups of 32: the norm's input is coded per token, memopt.stash.generic.row_group)
    assert "RebuildSpec('linear', (), 8, 32," in code and "'F.layer_norm', (('src', None), ('value', (32,))" in code
    again = pickle.loads(pickle.dumps(om.graph_module))
    assert torch.equal(again(x), out.detach())


@pytest.mark.parametrize("kind", ["linear", "matmul"])
def test_the_weight_gradient_is_that_of_the_norm_of_the_rebuilt_input_and_the_input_gradient_exact(kind):
    torch.manual_seed(0)
    src = torch.randn(3, 5, 16, requires_grad=True)
    ln_w, ln_b = torch.randn(16), torch.randn(16)
    weight = torch.randn(8, 16, requires_grad=True) if kind == "linear" else torch.randn(16, 8, requires_grad=True)
    bias = torch.randn(8, requires_grad=True) if kind == "linear" else None
    packed, params = generic_encode(src.detach(), EncodeSpec(8, 64))
    spec = RebuildSpec(kind, (), 8, 64, "node", "F.layer_norm",
                       (("src", None), ("value", (16,)), ("tensor", None), ("tensor", None), ("value", 1e-5)))
    x = F.layer_norm(src, (16,), ln_w, ln_b, 1e-5)
    out = weight_op_from_rebuild(x, src, weight, bias, packed, params, spec, (ln_w, ln_b))
    stock = F.linear(x, weight, bias) if kind == "linear" else x @ weight
    assert torch.equal(out, stock)
    g = torch.randn_like(out)
    gx, gw = torch.autograd.grad(out, (x, weight), g, retain_graph=True)
    sx, = torch.autograd.grad(stock, (x,), g, retain_graph=True)
    assert torch.equal(gx, sx)  # the input gradient needs only the weight
    rebuilt = F.layer_norm(group_dequantize(packed, params, 8, 64, torch.empty_like(src)), (16,), ln_w, ln_b, 1e-5)
    expected, = torch.autograd.grad(F.linear(rebuilt, weight, bias) if kind == "linear" else rebuilt @ weight,
                                    (weight,), g)
    torch.testing.assert_close(gw, expected, rtol=1e-5, atol=1e-5)
    with pytest.raises(memopt.MemoptError, match="double backward .* through the stash node node"):
        torch.autograd.grad(out, (weight,), g, create_graph=True)


def test_a_rebuilt_weight_op_is_priced_as_lossy_and_a_raise_of_its_unit_raises_the_shared_codes():
    # the rebuilt input is only as good as the norm input's codes: an option priced at fidelity 0 let the planner
    # pick a 2-bit rebuild as free and the gate skip the plan as having nothing lossy (a ViT at prefer="fidelity")
    torch.manual_seed(0)
    model, x = PreNorm(), torch.randn(4, 24, 16)
    om = memopt.optimize(copy.deepcopy(model), example_inputs=x, config=CODED)
    units = {u["chosen"]["unit"]: u["chosen"] for u in om.plan.units}
    rebuilt = [n.name for n in om.plan.nodes if n.op == "weight_op_from_rebuild"]
    weight_units = {u for u, c in units.items() if c["technique"] == "stash" and u in ("ln", "rms", "gn")}
    assert rebuilt and weight_units == {"ln", "rms", "gn"}
    assert all(units[u]["fidelity"] > 0 for u in weight_units)
    # the norm's codes at 2 bits, its consumers' unit at 8: the shared codes take the larger, so a raise of the
    # weight op's unit (by the gate or the planner) is not lost
    config = memopt.Config(stash=memopt.StashConfig(generic=True, generic_bits=2, node_bits={"ln": 8}), fewbit=None,
                           fidelity=None)
    code = memopt.optimize(copy.deepcopy(model), example_inputs=x, config=config).graph_module.code
    assert code.count("RebuildSpec('linear', (), 8, 32,") == 3  # q, k, v (in groups of one token's 32 features)
    assert "RebuildSpec('linear', (), 2, 32," in code  # fc1 after the functional layer_norm: both units at 2
