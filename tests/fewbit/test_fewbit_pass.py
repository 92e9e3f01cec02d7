"""The few-bit pass: every spelling, hyper-parameters, the freed-storage rule, reasons, the zoo."""
import copy

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import memopt
from conftest import call, leaves, zoo_params
from memopt.testing.zoo import build

FEWBIT_ONLY = memopt.Config(stash=None, recompute=None)  # the stash pass would take the BN chains first, peak-first blocks


class Spellings(nn.Module):
    """gelu as a module, elu with alpha as a functional (positional and keyword), softplus with beta
    as a module, sigmoid as a method, tanh as a torch function: each between two Linears."""

    def __init__(self):
        super().__init__()
        self.fcs = nn.ModuleList(nn.Linear(16, 16) for _ in range(6))
        self.gelu, self.softplus = nn.GELU(approximate="tanh"), nn.Softplus(beta=2.0)

    def forward(self, x):
        f = self.fcs
        x = f[1](self.gelu(f[0](x)))
        x = f[2](F.elu(x, 0.5))
        x = f[3](F.elu(x, alpha=0.25))
        x = f[4](self.softplus(x).sigmoid() * 2)
        return f[5](torch.tanh(x) * 3)


def _fewbit_nodes(om):
    return {n.name: n for n in om.plan.nodes if n.technique == "fewbit"}


def test_every_spelling_is_rewritten_with_its_hyper_parameters():
    torch.manual_seed(0)
    model, x = Spellings(), torch.randn(8, 16)
    # the pass itself, without the fidelity gate (on 4 samples it makes some of these exact; tests/fidelity)
    om = memopt.optimize(model, example_inputs=x, config=memopt.Config(fidelity=None))
    code = om.graph_module.code
    # all six: gelu, elu twice, softplus, sigmoid (a scalar mul keeps nothing) and tanh
    assert code.count("fewbit_activation(") == 6
    assert "('approximate', 'tanh')" in code and "('alpha', 0.5)" in code and "('alpha', 0.25)" in code
    assert "('beta', 2.0)" in code
    torch.manual_seed(1)
    assert torch.equal(om(x), model(x))


def test_the_export_path_rewrites_aten_spellings():
    model, x = build("shape_branch")  # captured by torch.export: aten.gelu.default
    om = memopt.optimize(model, example_inputs=x)
    assert om.plan.capture == "export"
    assert len(_fewbit_nodes(om)) == 2 and "torch.ops.aten.gelu.default(" not in om.graph_module.code
    assert torch.equal(om(x), model(x))


def test_relu_whose_output_the_next_conv_keeps_stays_exact_with_the_reason():
    model, x = build("cnn")
    om = memopt.optimize(model, example_inputs=x, config=FEWBIT_ONLY)
    relus = [n for n in om.plan.nodes if n.op == "relu"]
    assert relus and all(n.technique == "exact" for n in relus)
    assert all("also kept by" in n.reason and "frees nothing" in n.reason for n in relus)
    assert "also kept by features_1" in om.report()  # the report says why


def test_a_plan_reapplied_keeps_each_exact_units_own_reason():
    """A unit a decision leaves out says why the pass could not rewrite it, when it could not; "not chosen by the
    budget planner" only for units the pass could have rewritten (a plan made without a budget has no planner)."""
    model, x = build("cnn")
    om = memopt.optimize(model, example_inputs=x, config=FEWBIT_ONLY)
    again = memopt.optimize(model, example_inputs=x, plan=om.plan)
    for before, after in zip(om.plan.nodes, again.plan.nodes):
        assert (after.name, after.technique, after.reason) == (before.name, before.technique, before.reason)
    assert "budget planner" not in again.report()


def test_inplace_relu6_that_keeps_a_copy_is_rewritten_exactly():
    model, x = build("mobilenet_v2")
    om = memopt.optimize(model, example_inputs=x, config=FEWBIT_ONLY)
    rewritten = _fewbit_nodes(om)
    assert len(rewritten) == 35 and all(n.bits == 1 for n in rewritten.values())
    assert om.plan.estimated_saved_bytes < 0.75 * om.plan.baseline_saved_bytes


def test_inplace_op_whose_input_is_read_again_stays_exact():
    class ReadAgain(nn.Module):
        def __init__(self):
            super().__init__()
            self.a, self.b = nn.Linear(8, 8), nn.Linear(8, 8)

        def forward(self, x):
            h = self.a(x)
            y = F.silu(h, inplace=True)
            return self.b(y) + h  # h was overwritten in place: rewriting would change this sum

    torch.manual_seed(0)
    model, x = ReadAgain(), torch.randn(4, 8)
    om = memopt.optimize(model, example_inputs=x)
    silu = next(n for n in om.plan.nodes if n.op == "silu")
    assert silu.technique == "exact" and "read by other nodes" in silu.reason
    assert torch.equal(om(x), model(x))


def test_allow_deny_bits_by_kind_and_exact_masks():
    model, x = build("vit")
    om = memopt.optimize(model, example_inputs=x, config=memopt.Config(
        fewbit=memopt.FewBitConfig(deny=("blocks_0_act",), bits_by_kind={"gelu": 2})))
    nodes = {n.name: n for n in om.plan.nodes}
    assert nodes["blocks_0_act"].technique == "exact" and "FewBitConfig.deny" in nodes["blocks_0_act"].reason
    assert [n.bits for n in _fewbit_nodes(om).values()] == [2]
    om = memopt.optimize(model, example_inputs=x, config=memopt.Config(fewbit=memopt.FewBitConfig(allow=("nope",))))
    assert not _fewbit_nodes(om)
    tiny, xt = build("tiny_resnet")
    om = memopt.optimize(tiny, example_inputs=xt,
                         config=memopt.Config(stash=None, fewbit=memopt.FewBitConfig(exact_masks=False)))
    assert not _fewbit_nodes(om)


def test_float64_models_stay_exact_and_say_why():
    model, x = build("mlp")
    model = model.double()
    om = memopt.optimize(model, example_inputs=x.double())
    gelu = next(n for n in om.plan.nodes if n.op == "gelu")
    assert gelu.technique == "exact" and "dtype float64 is not supported" in gelu.reason
    assert torch.equal(om(x.double()), model(x.double()))


def test_report_rows_show_technique_bits_and_bytes():
    model, x = build("vit")
    om = memopt.optimize(model, example_inputs=x)
    row = next(line for line in om.report(group=False).splitlines() if line.startswith("blocks_0_act_fewbit "))
    assert " fewbit " in row and " 3 " in row
    node = _fewbit_nodes(om)["blocks_0_act_fewbit"]
    assert node.saved_bytes_before == 4 * 16 * 256 * 4  # the fc1 output, float32
    assert node.saved_bytes_after == 4 * 16 * 256 * 3 // 8 + 4 * 8  # 3-bit codes + the 8-level table


def test_bad_fewbit_configs():
    with pytest.raises(ValueError, match="FewBitConfig.bits must be an int in 1..8, got 0"):
        memopt.FewBitConfig(bits=0)
    with pytest.raises(ValueError, match=r"FewBitConfig.bits_by_kind\['gelu'\] must be an int in 1..8, got 9"):
        memopt.FewBitConfig(bits_by_kind={"gelu": 9})
    with pytest.raises(ValueError, match="unknown op kind 'swish'"):
        memopt.FewBitConfig(bits_by_kind={"swish": 2})
    with pytest.raises(ValueError, match="FewBitConfig.weight='cauchy' is not known"):
        memopt.FewBitConfig(weight="cauchy")
    with pytest.raises(TypeError, match="Config.fewbit must be a memopt.FewBitConfig or None, got int"):
        memopt.Config(fewbit=3)


@pytest.mark.parametrize("name", zoo_params())
def test_zoo_estimate_equals_measure_and_gradients_stay_close(name):
    model, inputs = build(name)
    reference = copy.deepcopy(model)
    om = memopt.optimize(model, example_inputs=inputs, config=FEWBIT_ONLY)
    real = memopt.measure(om, inputs)
    assert real.saved_bytes == om.plan.estimated_saved_bytes
    assert real.peak_bytes == om.plan.estimated_peak_bytes
    torch.manual_seed(3)
    out = leaves(call(om, inputs))
    probes = [torch.randn(t.shape) for t in out]
    sum((t * p).sum() for t, p in zip(out, probes)).backward()
    torch.manual_seed(3)
    sum((t * p).sum() for t, p in zip(leaves(call(reference, inputs)), probes)).backward()
    for (n, p), q in zip(model.named_parameters(), reference.parameters()):
        if q.grad is None or q.grad.norm() == 0:
            continue
        assert F.cosine_similarity(p.grad.flatten(), q.grad.flatten(), 0) >= 0.99, n
