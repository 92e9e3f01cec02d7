"""The stash's Triton kernels in whole models (bit-identical gradients against the plain path), their launch counts
per rewritten node, fake tensors (same allocations, no launch) and the errors that name the fix. The codecs one by
one: test_triton_stash.py."""
import copy

import pytest
import torch
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

import memopt
from memopt.testing.allocations import Allocations
from memopt.cost_model.storage import LiveStorageTracker
from memopt.runtime import kernels, native, triton_fewbit, triton_stash, triton_stash_extras as extras
from memopt.stash import generic, grid as G
from memopt.stash.stats import batch_norm_train
from memopt.stash.ops import ChainSpec, bn_act_stash
from triton_stash_helpers import _Net, _both, _chain_input, _same, interpret, requires_triton  # noqa: F401 (interpret: a fixture)

pytestmark = pytest.mark.filterwarnings("ignore:invalid value encountered:RuntimeWarning")

@pytest.mark.slow
@requires_triton
@pytest.mark.parametrize("bits, generic_on", [(4, False), (2, True)])  # 8 bits: test_x_code_matches_...
def test_a_small_cnn_trains_one_step_with_the_plain_paths_outputs_buffers_and_gradients(interpret, monkeypatch, bits,
                                                                                        generic_on):
    """Outputs and buffers bit for bit; gradients to float32 rounding: the BN backward's per-channel sums run in
    another order on the Triton path (memopt/runtime/triton_bn.py), everything else gives the same bits."""
    launched = set()
    real = triton_fewbit._launch
    monkeypatch.setattr(triton_fewbit, "_launch", lambda kernel, *a, **k: launched.add(kernel.__name__) or real(
        kernel, *a, **k))
    torch.manual_seed(0)
    model, x = _Net().train(), torch.randn(4, 3, 24, 24).contiguous(memory_format=torch.channels_last)
    config = memopt.Config(stash=memopt.StashConfig(bits=bits, generic=generic_on, min_per_channel=8), fewbit=None,
                           fidelity=None)

    def step():
        m = copy.deepcopy(model)
        om = memopt.optimize(m, example_inputs=x, config=config)
        torch.manual_seed(3)
        out = om(x)
        out.square().sum().backward()
        # saved bytes measured = estimated (the cost model's fake tensors take this path, launching nothing)
        assert memopt.measure(om, x).saved_bytes == om.plan.estimated_saved_bytes
        return (out.detach(), list(m.buffers())), [p.grad for p in m.parameters()], om.plan

    (plain, plain_grads, plan), (fused, fused_grads, _) = _both(step)
    _same(plain, fused)
    for name, a, b in zip([n for n, _ in model.named_parameters()], plain_grads, fused_grads):
        assert torch.allclose(a, b, rtol=1e-4, atol=1e-5 * a.abs().max().item()), name
    # every stash codec with a Triton version ran: chain codes and rebuilds, the BN backward, pool offsets, the
    # dropout mask
    want = {"_chain_encode", "_chain_rebuild", "_bn_sums", "_bn_grad", "_walk_pack", "_walk_unpack", "_channel_ends"}
    assert launched >= want | ({"_group_params", "_group_encode", "_group_decode"} if generic_on else set())
    ops = [(n.op, n.reason.split(":")[0]) for n in plan.nodes if n.technique == "stash"]
    assert ("bn_act_stash", "BN + residual + relu") in ops and ("dropout_1bit", "dropout mask kept as 1 bit per "
                                                                "element (exact)") in ops, ops
    # the stem's max-pool fused into its chain, or (with the generic stash) on its own
    assert ("bn_act_stash", "BN + relu + max-pool") in ops or ("max_pool2d_indices_only", "keeps only its argmax "
                                                                "indices (exact)") in ops, ops


@requires_triton
def test_a_bf16_autocast_step_reads_the_bf16_gradient_as_the_plain_path(interpret):
    """Under autocast the chains' output gradients are bf16: the fused Triton backward reads them as they are (no
    float32 copy); the forward is bit-identical, the gradients as the plain path's to bf16 rounding."""
    torch.manual_seed(0)
    model, x = _Net().train(), torch.randn(4, 3, 24, 24)
    config = memopt.Config(stash=memopt.StashConfig(bits=4, generic=False, min_per_channel=8), fewbit=None,
                           fidelity=None)

    def step():
        m = copy.deepcopy(model)
        with torch.autocast("cpu", torch.bfloat16):
            om = memopt.optimize(m, example_inputs=x, config=config)
            torch.manual_seed(3)
            out = om(x)
        out.float().square().sum().backward()
        return (out.detach(), list(m.buffers())), [p.grad for p in m.parameters()]

    (plain, plain_grads), (fused, fused_grads) = _both(step)
    _same(plain, fused)
    for name, a, b in zip([n for n, _ in model.named_parameters()], plain_grads, fused_grads):
        cos = torch.nn.functional.cosine_similarity(a.flatten().double(), b.flatten().double(), 0)
        assert cos > 0.999, (name, cos)


class _FullSizeOps(TorchDispatchMode):
    """The ATen ops that read or write a tensor of ``n`` elements (the chain's size)."""
    REDUCTIONS = {"amin", "amax", "aminmax", "max", "min", "sum", "mean", "std_mean", "var_mean", "std", "var"}

    def __init__(self, n: int) -> None:
        super().__init__()
        self.n, self.ops = n, []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if any(isinstance(t, torch.Tensor) and t.numel() == self.n for t in tree_flatten((args, kwargs))[0]):
            self.ops.append(func.overloadpacket.__name__)
        return func(*args, **(kwargs or {}))

    def reductions(self) -> list:
        return [op for op in self.ops if op in self.REDUCTIONS]


@requires_triton
def test_launches_per_stash_node_are_few_and_fixed(interpret, monkeypatch):
    launches = []
    real = triton_fewbit._launch

    def counted(kernel, grid, *args, **meta):
        launches.append(kernel.__name__)
        real(kernel, grid, *args, **meta)

    monkeypatch.setattr(triton_fewbit, "_launch", counted)
    x = _chain_input((4, 8, 10, 10), torch.float32, "contiguous", special=False)
    c = x.shape[1]
    args = [torch.ones(c, requires_grad=True), torch.zeros(c, requires_grad=True), torch.zeros(c), torch.ones(c), None]
    with kernels.forced("triton"), native.disabled():
        for spec, forward, backward in [
                (ChainSpec("relu", 4, means=True), ["_channel_ends", "_chain_encode"], ["_bn_sums", "_bn_grad"]),
                (ChainSpec("relu", 8, pool=(3, 2, 1, 1, False)), ["_walk_pack", "_channel_ends", "_chain_encode"],
                 ["_walk_unpack", "_bn_sums", "_bn_grad"])]:
            launches.clear()
            leaf = x.clone().requires_grad_()
            with _FullSizeOps(x.numel()) as full_ops:
                y = bn_act_stash(leaf, *args, None, spec)[0]
            assert launches == forward, spec
            # the grid's data ends (4 and 8 bits reach out) come from the encode's own pass: no reduction over x
            # in PyTorch (they were x.amin and x.amax), the batch norm's statistics the only one
            assert not full_ops.reductions(), (spec, full_ops.ops)
            launches.clear()
            with Allocations(x.numel()) as full:
                y.sum().backward()
            assert launches == backward, spec
            if spec.pool is None:  # the ReLU's and the BN's backward read grad_y as it is: no full-size temporary
                assert [name for name, _ in full.made] == ["empty.memory_format"], full.made  # grad_x, which the second launch writes
        # a residual chain keeps g (the residual's gradient): the first launch writes it, no launch or copy of its own
        launches.clear()
        leaf, r = x.clone().requires_grad_(), x.clone().requires_grad_()
        with _FullSizeOps(x.numel()) as full_ops:
            y = bn_act_stash(leaf, *args, r, ChainSpec("relu", 4, residual=True))[0]
        # both sides' ends and the extremes in one pass, then the x̂ code and the z code
        assert launches == ["_channel_ends", "_chain_encode", "_chain_encode"], launches
        # what is left in PyTorch reduces z (the sum's code: its mean, std and top), not x
        assert "amin" not in full_ops.reductions() and full_ops.reductions().count("amax") == 1, full_ops.ops
        launches.clear()
        with Allocations(x.numel()) as full:
            y.sum().backward()
        assert launches == ["_chain_rebuild", "_bn_sums", "_bn_grad"]  # the mask from the z code, then as above
        assert full.made == [("empty.memory_format", torch.uint8)] + [("empty.memory_format", torch.float32)] * 2, \
            full.made  # the mask's bytes, g and grad_x
        launches.clear()
        packed, params = generic.generic_encode(x, generic.EncodeSpec(4, 256))
        generic.group_dequantize(packed, params, 4, 256, x)
        assert launches == ["_group_params", "_group_encode", "_group_decode"]
        launches.clear()
        generic.dropout_1bit(x.clone().requires_grad_(), 0.5).sum().backward()
        assert launches == ["_walk_pack", "_walk_unpack"]


@requires_triton
def test_fake_tensors_allocate_what_the_kernels_allocate_and_launch_nothing(interpret, monkeypatch):
    # the cost model runs this path on fake tensors: the same outputs, no launch
    def shapes(make, fake):
        if fake:
            monkeypatch.setattr(triton_fewbit, "_kernel", lambda fn: pytest.fail(f"launched {fn.__name__}"))
        with kernels.forced("triton"), native.disabled():
            x = make()
            c = x.shape[1]
            w, b = torch.ones(c), torch.zeros(c)
            _, mean, invstd, _, _ = batch_norm_train(x, w, b, None, None, None, 0.1, 1e-5)
            outs = G.x_code(x, w, b, mean, invstd, 1e-5, x > 0, 4, "relu", True, False, affine=True, means=True)
            packed, params = generic.group_quantize(x, 3, 256, False)
            more = [packed, params, generic.group_dequantize(packed, params, 3, 256, x),
                    extras.pack_mask(x > 0), G._from_codes(torch.zeros(x.shape, dtype=torch.uint8), x > 0, outs[1])]
        return [(tuple(t.shape), t.dtype, t.stride()) for t in [*outs[:2], outs[3], outs[4], *more]]

    real = shapes(lambda: torch.randn(2, 8, 16, 16).contiguous(memory_format=torch.channels_last), False)
    with FakeTensorMode():
        fake = shapes(lambda: torch.randn(2, 8, 16, 16).contiguous(memory_format=torch.channels_last), True)
    assert real == fake


def test_the_default_and_native_keep_the_plain_path(interpret):
    x = torch.randn(4)
    for choice in (None, "native", "torch"):
        with kernels.forced(choice):
            assert not kernels.stash_triton(x, "x̂ code")
    with kernels.forced("triton"):
        assert not kernels.stash_triton(x.double(), "x̂ code")  # float64: the plain path
        assert kernels.stash_triton(x, "x̂ code") == triton_fewbit.AVAILABLE


@requires_triton
def test_forcing_triton_on_a_cpu_tensor_outside_the_interpreter_names_the_fix(monkeypatch):
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    message = (r"MEMOPT_KERNELS=triton but the stash's generic stash code has a CPU input, which Triton runs only "
               r"in its interpreter; set TRITON_INTERPRET=1 \(tests\), or MEMOPT_KERNELS=native")
    with kernels.forced("triton"), pytest.raises(memopt.MemoptError, match=message):
        generic.group_quantize(torch.randn(10), 4, 256, False)


@requires_triton
def test_bad_arguments_are_refused_with_the_fix(interpret):
    x = torch.randn(2, 3, 4)
    rows4 = torch.zeros(4, 3)
    with pytest.raises(ValueError, match=r"a split grid \(4 rows\) needs the mask that picks each element's side; "
                                         r"got mask=None for x of shape \(2, 3, 4\)"):
        triton_stash.encode(x, rows4, 4)
    with pytest.raises(ValueError, match=r"sums must be new_bin_sums\(3, 1, 4\) of shape \(2, 3, 16\), got "
                                         r"\(2, 3, 8\)"):
        triton_stash.encode(x, rows4[:2], 4, sums=torch.zeros(2, 3, 8, dtype=torch.int64))
    with pytest.raises(ValueError, match=r"a code book for 2-bit codes has 4 entries per side, got 8"):
        triton_stash.rebuild(torch.zeros(6, dtype=torch.uint8), 2, x.shape, torch.zeros(3, 1, 8))
    with pytest.raises(ValueError, match=r"packed has 5 bytes but 24 codes of 2 bits need 6; pass the codes"):
        extras.group_decode(torch.zeros(5, dtype=torch.uint8), torch.zeros(2, 1), 2, 256, x)
    with pytest.raises(ValueError, match=r"group must be at least 1 element, got 0"):
        extras.group_encode(x, 4, 0)


def test_without_triton_forcing_it_is_an_error_naming_the_fix(monkeypatch):
    # (tests/runtime/test_triton_fewbit.py imports and trains memopt with `import triton` failing)
    monkeypatch.setattr(triton_stash, "AVAILABLE", False)
    monkeypatch.setattr(triton_fewbit, "IMPORT_ERROR", "ImportError: no triton")
    with kernels.forced(None):
        assert not kernels.stash_triton(torch.randn(3), "generic stash code")
    message = (r"MEMOPT_KERNELS=triton but `import triton` failed \(ImportError: no triton\) for the stash's generic "
               r"stash code; install triton, or set MEMOPT_KERNELS=native \(or unset it\)")
    with kernels.forced("triton"), pytest.raises(memopt.MemoptError, match=message):
        generic.group_quantize(torch.randn(300), 4, 256, False)


@requires_triton
@pytest.mark.parametrize("means", [False, True])
def test_fake_tensors_estimate_the_measured_peak(interpret, monkeypatch, means):
    # one chain node forward and backward on the Triton path, measured, then estimated on fake tensors. The real
    # run launches nothing either: the interpreter re-announces every argument's storage through aten.set_ and
    # keeps arguments alive in reference cycles, which a GPU launch does not; a launch allocates nothing, so the
    # peak is the wrappers' and the ops' around them (the values, never read for a size, do not matter)
    monkeypatch.setattr(triton_fewbit, "_launch", lambda *args, **meta: None)

    def peak(make):
        x = make()
        c = x.shape[1]
        params = [torch.ones(c, requires_grad=True), torch.zeros(c, requires_grad=True)]
        grad = torch.ones(x.shape)
        tracker = LiveStorageTracker([x, grad, *params])
        with tracker, kernels.forced("triton"), native.disabled():
            y = bn_act_stash(x, *params, None, None, None, None, ChainSpec("relu", 4, means=means))[0]
            torch.autograd.grad(y, [x, *params], grad)
        return tracker.peak, sorted(e[1] for e in tracker.at_peak)

    def make():
        return torch.randn(4, 8, 16, 16).requires_grad_()

    real = peak(make)
    with FakeTensorMode():
        assert peak(make) == real

