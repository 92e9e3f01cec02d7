"""The generic K-bit stash (inputs of conv / linear / matmul outside BN chains) and the exact 1-bit extras
(dropout masks, boolean conditions): forward bit-identical, input gradients exact, honest bytes."""
import copy
import math

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import memopt
from memopt.cost_model.storage import SavedTensorRecorder
from memopt.stash.generic import (EncodeSpec, FromCodesSpec, conv_from_codes, dropout_1bit, generic_encode,
                                  group_dequantize, group_quantize, linear_from_codes, matmul_from_codes, where_1bit)
from memopt.testing.zoo import TinyViT
from memopt.passes.planning.candidates import candidates
from memopt.passes.stash.generic import stash_nbytes

# the generic stash alone (coded ops, which make input gradients approximate too, are tests/stash/test_stash_coded.py)
# the generic stash by itself: no block recomputed from codes by the peak-first step (it would take the ops inside)
GENERIC = memopt.Config(stash=memopt.StashConfig(generic=True, generic_bits=4, coded_ops=()), fewbit=None,
                        recompute=memopt.RecomputeConfig(peak_first_bits=None))


@pytest.fixture(autouse=True)
def _one_thread(one_thread):
    yield


@pytest.mark.parametrize("bits", [2, 4, 8])
@pytest.mark.parametrize("n", [256 * 3, 1000, 17])
def test_codes_rebuild_within_half_a_step_and_count_their_metadata(bits, n):
    torch.manual_seed(0)
    x = torch.randn(n) * torch.linspace(0.1, 10, n)  # groups of very different ranges
    packed, params = group_quantize(x, bits, 256, False)
    groups = math.ceil(n / 256)
    assert params.shape == (2, groups) and packed.numel() + params.numel() * 4 == stash_nbytes(n, bits, 256)
    rebuilt = group_dequantize(packed, params, bits, 256, x)
    step = params[1].repeat_interleave(256)[:n]
    assert ((rebuilt - x).abs() <= step / 2 * (1 + 1e-4) + 1e-6).all()
    assert torch.equal(rebuilt.min(), x.min())  # each group's minimum is a level, rebuilt exactly


def test_stochastic_rounding_is_unbiased_and_leaves_the_global_rng_alone():
    torch.manual_seed(0)
    x = torch.rand(256) * 3
    state = torch.get_rng_state()
    mean = torch.stack([group_dequantize(*group_quantize(x, 2, 256, True), 2, 256, x) for _ in range(400)]).mean(0)
    assert torch.equal(torch.get_rng_state(), state)  # dropout after it draws what it would have drawn
    step = (x.max() - x.min()) / 3
    assert (mean - x).abs().mean() < 0.05 * step  # nearest rounding errs by ~step/4 on average
    nearest = group_dequantize(*group_quantize(x, 2, 256, False), 2, 256, x)
    assert (nearest - x).abs().mean() > 0.15 * step


@pytest.mark.parametrize("layout", ["contiguous", "channels_last", "transposed"])
def test_consumers_forward_and_input_gradient_are_exact(layout):
    torch.manual_seed(0)
    if layout == "transposed":
        x = torch.randn(4, 24, 10).transpose(1, 2)
        mod = nn.Linear(24, 12)
    else:
        x = torch.randn(4, 6, 9, 9)
        x = x.to(memory_format=torch.channels_last) if layout == "channels_last" else x
        mod = nn.Conv2d(6, 5, 3, stride=2, padding=1)
    x1, x2 = x.detach().requires_grad_(), x.detach().requires_grad_()
    packed, params = generic_encode(x1, EncodeSpec(8, 256))
    assert not packed.requires_grad and not params.requires_grad
    ref_mod = copy.deepcopy(mod)
    if isinstance(mod, nn.Linear):
        out = linear_from_codes(x1, mod.weight, mod.bias, packed, params, FromCodesSpec(8, 256, "fc"))
    else:
        conv = (mod.stride, mod.padding, mod.dilation, mod.groups)
        out = conv_from_codes(x1, mod.weight, mod.bias, packed, params, FromCodesSpec(8, 256, "conv", conv))
    ref = ref_mod(x2)
    assert torch.equal(out, ref)
    g = torch.randn_like(out)
    out.backward(g)
    ref.backward(g)
    assert torch.equal(x1.grad, x2.grad)  # needs the weight only
    assert torch.equal(mod.bias.grad, ref_mod.bias.grad)
    assert F.cosine_similarity(mod.weight.grad.flatten(), ref_mod.weight.grad.flatten(), 0) > 0.9999


def test_matmul_with_a_parameter_and_what_it_keeps():
    torch.manual_seed(0)
    w = nn.Parameter(torch.randn(32, 16))
    x1 = torch.randn(3, 50, 32, requires_grad=True)
    x2 = x1.detach().requires_grad_()
    packed, params = generic_encode(x1, EncodeSpec(4, 256))
    with SavedTensorRecorder() as rec:
        out = matmul_from_codes(x1, w, packed, params, FromCodesSpec(4, 256, "mm"))
    assert sum(s.nbytes for s in rec.saved) == stash_nbytes(x1.numel(), 4, 256) + w.numel() * 4
    w2 = w.detach().clone().requires_grad_()
    ref = x2 @ w2
    assert torch.equal(out, ref)
    g = torch.randn_like(out)
    out.backward(g)
    ref.backward(g)
    torch.testing.assert_close(x1.grad, x2.grad, rtol=0, atol=0)
    assert F.cosine_similarity(w.grad.flatten(), w2.grad.flatten(), 0) > 0.99


def test_vit_forward_identical_bytes_equal_measure_and_report():
    torch.manual_seed(0)
    model, x = TinyViT().train(), torch.randn(8, 3, 16, 16)
    reference = copy.deepcopy(model)
    om = memopt.optimize(model, example_inputs=x, config=GENERIC)
    exact = memopt.optimize(copy.deepcopy(model), example_inputs=x,  # no recomputation from codes either
                            config=memopt.Config(stash=memopt.StashConfig(generic=False, coded_ops=()), fewbit=None,
                                                 recompute=None))
    torch.manual_seed(1)
    out = om(x)
    torch.manual_seed(1)
    ref = reference(x)
    assert torch.equal(out, ref)
    g = torch.randn_like(out)
    out.backward(g)
    ref.backward(g)
    for (n, p), q in zip(model.named_parameters(), reference.parameters()):
        cos = F.cosine_similarity(p.grad.flatten(), q.grad.flatten(), 0)
        assert cos > (0.99 if n.endswith("weight") else 0.9999), (n, cos)  # measured >= 0.9947 at 4 bits
    real = memopt.measure(om, x)
    assert real.saved_bytes == om.plan.estimated_saved_bytes and real.peak_bytes == om.plan.estimated_peak_bytes
    assert om.plan.estimated_saved_bytes < 0.7 * exact.plan.estimated_saved_bytes  # measured 0.51
    nodes = {n.name: n for n in om.plan.nodes}
    assert nodes["blocks_0_fc2_stash"].technique == "stash" and nodes["blocks_0_fc2_stash"].bits == 4
    assert "model input" in nodes["embed"].reason  # its input stays alive outside the step anyway
    assert "blocks_0_ln1_codes" in om.report(group=False)


def test_a_storage_frees_only_when_every_saver_is_rewritten():
    class Net(nn.Module):
        def __init__(self):
            super().__init__()
            self.ln, self.q, self.k, self.v = nn.LayerNorm(16), nn.Linear(16, 16), nn.Linear(16, 16), nn.Linear(16, 16)
            self.fc1, self.fc2 = nn.Linear(16, 32), nn.Linear(32, 16)

        def forward(self, x):
            h = self.ln(x)
            a = self.q(h) * self.k(h) + self.v(h)
            return self.fc2(torch.tanh(self.fc1(a)))  # tanh keeps its output too: fc2 cannot free it

    torch.manual_seed(0)
    model, x = Net(), torch.randn(4, 10, 16)
    om = memopt.optimize(model, example_inputs=x, config=GENERIC)
    nodes = {n.name: n for n in om.plan.nodes}
    assert {"q_stash", "k_stash", "v_stash", "ln_codes"} <= set(nodes)  # one code for the three projections
    assert [n for n in nodes if n.endswith("_codes")].count("ln_codes") == 1
    assert nodes["fc2"].technique == "exact" and "also kept by tanh" in nodes["fc2"].reason
    assert memopt.measure(om, x).saved_bytes == om.plan.estimated_saved_bytes
    om = memopt.optimize(copy.deepcopy(model), example_inputs=x,
                         config=memopt.Config(stash=memopt.StashConfig(generic=True, deny=("ln",)), fewbit=None))
    assert "excluded by StashConfig" in next(n for n in om.plan.nodes if n.name == "q").reason


def test_planner_offers_generic_units_with_bytes_and_fidelity():
    torch.manual_seed(0)
    model, x = TinyViT().train(), torch.randn(4, 3, 16, 16)
    from memopt.cost_model.analysis import annotate
    from memopt.capture.trace import capture

    gm = capture(model, (x,), {}).graph_module
    baseline = annotate(gm, (x,), {})
    config = memopt.Config(stash=memopt.StashConfig(generic=True, plan_bits=(2, 8)), fewbit=None, recompute=None)
    groups = {g.name: g for g in candidates(gm, (x,), {}, config, baseline)}
    options = groups["stash:blocks_0_act"].options
    assert [(o.technique, o.bits) for o in options] == [("exact", None), ("stash", 2), ("stash", 8)]
    two, eight = options[1:]
    numel = 4 * 16 * 256
    assert two.freed_bytes == numel * 4 - stash_nbytes(numel, 2, 256)  # the GELU output, only fc2 kept it
    assert two.fidelity > eight.fidelity > 0


@pytest.mark.parametrize("dtype, shape", [(torch.float32, (5, 37)), (torch.bfloat16, (5, 37)),
                                          (torch.float64, (5, 37)), (torch.float32, "channels_last")])
def test_dropout_keeps_one_bit_and_is_exact(dtype, shape):
    if shape == "channels_last":  # ATen's noise follows the input's layout, and so do the gradients
        x = torch.randn(4, 3, 5, 5).contiguous(memory_format=torch.channels_last).requires_grad_()
    else:
        x = torch.randn(shape, dtype=dtype, requires_grad=True)
    x2 = x.detach().clone().requires_grad_()
    torch.manual_seed(3)
    with SavedTensorRecorder() as rec:
        out = dropout_1bit(x, 0.3)
    torch.manual_seed(3)
    ref = F.dropout(x2, 0.3, True)
    assert torch.equal(out, ref)
    assert sum(s.nbytes for s in rec.saved) == math.ceil(x.numel() / 8) + x.element_size()  # mask + scale
    g = torch.randn_like(out)
    out.backward(g)
    ref.backward(g)
    assert torch.equal(x.grad, x2.grad) and x.grad.stride() == x2.grad.stride()


def test_dropout_rng_stream_and_where_condition():
    x = torch.randn(6, 9, requires_grad=True)
    torch.manual_seed(7)
    dropout_1bit(x, 0.5)
    a = torch.rand(3)
    torch.manual_seed(7)
    F.dropout(x, 0.5, True)
    assert torch.equal(a, torch.rand(3))  # the same draws: later random ops see the same stream
    cond = torch.randn(6, 9) > 0
    b = torch.randn(9, dtype=torch.float64, requires_grad=True)
    y = torch.randn(6, 9, dtype=torch.float64, requires_grad=True)
    torch.autograd.gradcheck(lambda p, q: where_1bit(cond, p, q), (y, b))
    with SavedTensorRecorder() as rec:
        where_1bit(cond, y, b)
    assert [s.nbytes for s in rec.saved] == [math.ceil(cond.numel() / 8)]


def test_models_with_dropout_get_one_bit_masks_and_stay_exact():
    torch.manual_seed(0)
    model, x = TinyViT().train(), torch.randn(4, 3, 16, 16)
    reference = copy.deepcopy(model)
    # the exact extras alone (the default also codes what the dropouts feed, and recomputes blocks from codes)
    om = memopt.optimize(model, example_inputs=x, config=memopt.Config(
        fewbit=None, stash=memopt.StashConfig(generic=False, coded_ops=()), recompute=None))
    on = [n for n in om.plan.nodes if n.name.endswith("_1bit")]
    assert len(on) == 4 and all(n.technique == "stash" and n.bits == 1 for n in on)
    torch.manual_seed(1)
    out = om(x)
    torch.manual_seed(1)
    ref = reference(x)
    assert torch.equal(out, ref)
    out.sum().backward()
    ref.sum().backward()
    for p, q in zip(model.parameters(), reference.parameters()):
        assert torch.equal(p.grad, q.grad)
    assert memopt.measure(om, x).saved_bytes == om.plan.estimated_saved_bytes


def test_config_errors_quote_the_value_and_double_backward_names_the_node():
    with pytest.raises(ValueError, match="StashConfig.group_size must be a positive int, got 0"):
        memopt.StashConfig(group_size=0)
    with pytest.raises(ValueError, match="StashConfig.generic must be True or False, got 'yes'"):
        memopt.StashConfig(generic="yes")
    with pytest.raises(ValueError, match=r"StashConfig.consumers must be a tuple drawn from .*got \('attention',\)"):
        memopt.StashConfig(consumers=("attention",))
    torch.manual_seed(0)
    model, x = TinyViT().train(), torch.randn(2, 3, 16, 16)
    om = memopt.optimize(model, example_inputs=x, config=GENERIC)
    with pytest.raises(memopt.MemoptError, match=r"double backward .* stash node %head : "):
        torch.autograd.grad(om(x).sum(), list(model.parameters()), create_graph=True)


def test_under_autocast_linears_drop_their_low_precision_copies():
    """Under bf16 autocast a linear keeps bf16 copies of its input and weight that it made itself; the generic stash
    keeps the codes and the float32 weight instead (it skipped such linears as "keeping more than its input")."""
    torch.manual_seed(0)
    model, x = nn.Sequential(nn.Linear(256, 256), nn.GELU(), nn.Linear(256, 256)).train(), torch.randn(64, 256)
    reference = copy.deepcopy(model)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        om = memopt.optimize(model, example_inputs=x, config=memopt.Config(fidelity=None, fewbit=None))
        stock, real = memopt.measure(reference, x).saved_bytes, memopt.measure(om, x).saved_bytes
        assert real == om.plan.estimated_saved_bytes and real < 0.5 * stock
        assert sum(n.op == "linear_from_codes" for n in om.plan.nodes) == 2
        torch.manual_seed(1)
        out = om(x)
        torch.manual_seed(1)
        ref = reference(x)
    assert torch.equal(out, ref) and out.dtype == torch.bfloat16
    out.float().sum().backward()
    ref.float().sum().backward()
    for p, q in zip(model.parameters(), reference.parameters()):
        assert p.grad.dtype == torch.float32 and F.cosine_similarity(p.grad.flatten(), q.grad.flatten(), 0) > 0.999


@pytest.mark.parametrize("op", ["linear", "matmul", "conv"])
def test_under_autocast_a_float32_input_is_rebuilt_in_the_ops_dtype(op, monkeypatch):
    """Autocast casts a float32 input to bf16 for the op, so its weight gradient reads the bf16 copy: backward
    rebuilds the codes straight into bf16 (through float32 a slice at a time), the same values as the float32
    rebuild cast down, and makes no float32 tensor as large as the input."""
    from memopt.cost_model.storage import LiveStorageTracker
    from memopt.stash import generic
    monkeypatch.setattr(generic, "DECODE_SLICE", 4096)  # float32 slices well below the input's size
    torch.manual_seed(0)
    x = torch.randn(64, 8, 16, 16) if op == "conv" else torch.randn(16, 24, 256)
    weight = torch.randn(12, 8, 3, 3) if op == "conv" else torch.randn(256, 128) if op == "matmul" \
        else torch.randn(128, 256)
    weight.requires_grad_()
    packed, params = generic_encode(x, EncodeSpec(8, 256))
    spec = FromCodesSpec(8, 256, "test", (1, 1, 1, 1) if op == "conv" else ())
    with torch.autocast("cpu", dtype=torch.bfloat16):
        out = conv_from_codes(x, weight, None, packed, params, spec) if op == "conv" else \
            matmul_from_codes(x, weight, packed, params, spec) if op == "matmul" else \
            linear_from_codes(x, weight, None, packed, params, spec)
    assert out.dtype == torch.bfloat16
    grad = torch.randn_like(out)
    largest = []

    class Float32Sizes(LiveStorageTracker):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            result = super().__torch_dispatch__(func, types, args, kwargs)
            largest.extend(t.numel() for t in torch.utils._pytree.tree_leaves(result)
                           if isinstance(t, torch.Tensor) and t.dtype == torch.float32)
            return result
    tracker = Float32Sizes(preexisting=[x, weight, packed, params, grad, out])
    with tracker:
        (grad_w,) = torch.autograd.grad(out, weight, grad)
    assert max(largest, default=0) < x.numel()  # no full-size float32 rebuild
    x_hat = group_dequantize(packed, params, 8, 256, torch.empty_like(x)).to(torch.bfloat16)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        ref = F.conv2d(x_hat, weight, None, 1, 1, 1, 1) if op == "conv" else x_hat @ weight if op == "matmul" \
            else F.linear(x_hat, weight)
    (want,) = torch.autograd.grad(ref, weight, grad)
    assert torch.equal(grad_w, want)


class PlainCNN(nn.Module):
    """Convs and ReLUs without BatchNorm (VGG, AlexNet): each ReLU keeps its output, the next conv its input,
    a max pool its input and int64 indices; ``branch`` adds a shape test that sends capture to torch.export."""

    def __init__(self, branch=False):
        super().__init__()
        self.c1, self.c2, self.c3 = nn.Conv2d(3, 8, 3, padding=1), nn.Conv2d(8, 8, 3, padding=1), nn.Conv2d(8, 8, 3)
        self.fc, self.branch = nn.Linear(8 * 6 * 6, 10), branch

    def forward(self, x):
        if self.branch and x.shape[0] > 1:  # data-independent, but symbolic tracing cannot decide it
            x = x * 1.0
        x = F.max_pool2d(torch.relu(self.c1(x)), 2)
        x = F.relu(self.c2(x), inplace=True)
        x = torch.relu(self.c3(x))
        return self.fc(x.flatten(1))


@pytest.mark.parametrize("branch", [False, True])
def test_relus_join_the_units_of_what_keeps_their_output_and_max_pools_keep_offsets(branch):
    """Neither a ReLU's 1-bit mask nor the next conv's codes free the ReLU output alone (both keep it): the
    stash unit takes the ReLU in and it keeps its mask; a max pool keeps its window offsets, and the ReLU
    before it its mask. Forward and input gradient bit-identical, bytes as estimated, on fx and export graphs."""
    torch.manual_seed(0)
    model, x = PlainCNN(branch), torch.randn(4, 3, 16, 16)
    om = memopt.optimize(copy.deepcopy(model), example_inputs=x, config=GENERIC)
    assert om.plan.capture == ("export" if branch else "symbolic_trace")
    masks = [n for n in om.plan.nodes if n.op == "fewbit_activation"]
    assert len(masks) == 3 and all(n.technique == "stash" and "exact 1-bit mask" in n.reason for n in masks)
    assert sum(n.op == "max_pool2d_indices_only" for n in om.plan.nodes) == 1
    saved = memopt.measure(om, x).saved_bytes
    assert saved == om.plan.estimated_saved_bytes and om.plan.baseline_saved_bytes > 3 * saved
    xs = [x.clone().requires_grad_() for _ in range(2)]
    outs = [om(xs[0]), model(xs[1])]
    assert torch.equal(*outs)
    for out in outs:
        out.square().sum().backward()
    assert torch.equal(xs[0].grad, xs[1].grad)  # masks, offsets and the codes' input gradients are exact
    cos = F.cosine_similarity(om.original_module.c2.weight.grad.flatten(), model.c2.weight.grad.flatten(), 0)
    assert cos > 0.99


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("bits,group,n", [(8, 256, 5000), (4, 256, 4096), (3, 100, 3333), (8, 7, 129)])
def test_low_precision_rebuild_through_float32_slices(monkeypatch, dtype, bits, group, n):
    """A bf16 / fp16 rebuild decodes through float32 a slice at a time: the same values as one full-size
    float32 temporary rounded to the dtype, and no temporary as large as the whole tensor."""
    from memopt.cost_model.storage import LiveStorageTracker
    from memopt.runtime import native_generic
    from memopt.stash import generic
    if not native_generic.applies(torch.zeros(1), float_dtype=True):
        pytest.skip("the C kernels are not built here")
    torch.manual_seed(0)
    x = torch.randn(n).to(dtype)
    packed, params = generic.group_quantize(x, bits, group, False)
    want = generic.group_dequantize(packed, params, bits, group, torch.empty(n)).to(dtype)
    monkeypatch.setattr(generic, "DECODE_SLICE", 64)
    like = torch.empty(n, dtype=dtype)
    tracker = LiveStorageTracker(preexisting=[packed, params, like])
    with tracker:
        got = generic.group_dequantize(packed, params, bits, group, like)
    assert torch.equal(got, want)
    assert tracker.peak < n * got.element_size() + n * 4  # one slice of float32 at a time, not all n values
