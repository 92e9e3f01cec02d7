"""The default's first-use checks of the Triton kernels (memopt/runtime/verify.py, memopt/kernel_probes.py).

With MEMOPT_KERNELS unset a kernel family runs on a CUDA device only once its probe matched the plain path there.
Here CPU tensors under TRITON_INTERPRET=1 (Triton's interpreter, as the other Triton tests run) take that same path:
``verify.eligible`` is redirected to take CPU devices too.
"""
import collections
import copy
import dataclasses
import re
import warnings
from pathlib import Path

import pytest
import torch
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.utils._python_dispatch import TorchDispatchMode

import memopt
from memopt.fewbit.ops import FewBitSpec, fewbit_activation
from memopt.runtime import kernels, native, triton_bn, triton_fewbit, triton_stash_extras, verify
from memopt.stash import generic
from triton_stash_helpers import _Net, requires_triton

pytestmark = [requires_triton, pytest.mark.filterwarnings("ignore:invalid value encountered:RuntimeWarning")]
CPU = torch.device("cpu")


@pytest.fixture
def gpu_like(monkeypatch):
    """The default (MEMOPT_KERNELS unset) with CPU tensors eligible, as CUDA ones are, and the C kernels (which take
    precedence on CPU tensors) out, as on CUDA; no verdicts yet."""
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    monkeypatch.setattr(verify, "eligible", lambda device: device.type in ("cuda", "cpu"))
    monkeypatch.setattr(verify, "_verdicts", {})
    with kernels.forced(None), native.disabled():
        yield


@pytest.fixture
def probes(monkeypatch):
    """Counts of probe runs: (family, path) -> runs."""
    runs = collections.Counter()
    for family, probe in list(verify.PROBES.items()):
        def counted(device, dtype, _run=probe.run, _family=family):
            runs[_family, verify.probing()] += 1
            return _run(device, dtype)
        monkeypatch.setitem(verify.PROBES, family, dataclasses.replace(probe, run=counted))
    return runs


@pytest.fixture
def launches(monkeypatch):
    """Names of the kernels launched outside the probes."""
    names = []
    real = triton_fewbit._launch

    def launch(kernel, *args, **meta):
        if verify.probing() is None:
            names.append(kernel.__name__)
        return real(kernel, *args, **meta)

    monkeypatch.setattr(triton_fewbit, "_launch", launch)
    return names


def _gelu(bits=3):
    borders, levels = memopt.fewbit_table("gelu", bits)
    return "gelu", (("approximate", "none"),), bits, tuple(borders.tolist()), tuple(levels.tolist()), "act_1"


def _fewbit_step(x, args):
    leaf = x.detach().clone().requires_grad_()
    y = fewbit_activation(leaf, FewBitSpec(*args))
    y.backward(torch.linspace(-1, 1, y.numel()).view(y.shape).to(y.dtype))
    return y.detach(), leaf.grad


def _plain(fn):
    with kernels.forced("torch"):
        return fn()


def _warnings(fn):
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        result = fn()
    return result, [w for w in caught if issubclass(w.category, verify.KernelCheckWarning)]


def test_the_default_checks_a_family_once_per_dtype_then_runs_triton(gpu_like, probes, launches):
    x, args = torch.randn(4, 3, 5, 7) * 3, _gelu()
    (y, grad), found = _warnings(lambda: _fewbit_step(x, args))
    assert not found
    assert probes == {("fewbit", "triton"): 1, ("fewbit", "torch"): 1}  # one check: each path once
    assert launches == ["_encode_pack", "_unpack_scale"]  # then the step itself on Triton
    plain_y, plain_grad = _plain(lambda: _fewbit_step(x, args))
    assert torch.equal(y, plain_y) and torch.equal(grad, plain_grad)
    for _ in range(2):  # the verdict is kept: no further check
        _fewbit_step(x, args)
    assert sum(probes.values()) == 2 and verify.verdicts() == {("fewbit", "cpu", None, torch.float32): True}
    _fewbit_step(x.bfloat16(), args)  # another dtype: checked once more
    assert probes[("fewbit", "triton")] == 2 and verify.verdicts()[("fewbit", "cpu", None, torch.bfloat16)]


def test_a_model_step_checks_each_family_once_and_matches_the_plain_path(gpu_like, probes, launches):
    torch.manual_seed(0)
    model, x = _Net().train(), torch.randn(2, 3, 16, 16)
    config = memopt.Config(stash=memopt.StashConfig(bits=2, generic=True, min_per_channel=8), fewbit=None,
                           fidelity=None)

    def step():
        m = copy.deepcopy(model)
        om = memopt.optimize(m, example_inputs=x, config=config)
        torch.manual_seed(3)
        out = om(x)
        out.square().sum().backward()
        return out.detach(), [p.grad for p in m.parameters()]

    (out, grads), found = _warnings(step)
    assert not found
    checked = {family for family, _ in probes}
    assert {"chain", "bn", "mask"} <= checked and set(probes.values()) == {1}, probes
    assert {"_chain_encode", "_bn_sums", "_walk_pack"} <= set(launches)
    plain_out, plain_grads = _plain(step)
    assert torch.equal(out, plain_out)
    for a, b in zip(plain_grads, grads):  # the BN backward's sums: float32 rounding
        assert torch.allclose(a, b, rtol=1e-4, atol=1e-5 * a.abs().max().item())
    runs = dict(probes)
    step()
    assert probes == runs  # every verdict kept


def test_a_kernel_that_raises_leaves_its_family_on_the_plain_path_with_one_warning(gpu_like, probes, launches,
                                                                                   monkeypatch):
    real = triton_fewbit._launch

    def broken(kernel, *args, **meta):
        if kernel.__name__ == "_encode_pack":
            raise RuntimeError("PassManager::run failed\nlong compiler log")
        return real(kernel, *args, **meta)

    monkeypatch.setattr(triton_fewbit, "_launch", broken)
    x, args = torch.randn(4, 3, 5, 7) * 3, _gelu()
    (y, grad), found = _warnings(lambda: _fewbit_step(x, args))
    assert len(found) == 1
    message = str(found[0].message)
    assert message == (
        "memopt: the Triton kernels for few-bit backward (encode + pack, unpack + scale) (kernel family 'fewbit') "
        "failed their first-use check on cpu, torch.float32: RuntimeError: PassManager::run failed. memopt runs plain "
        "PyTorch for them there in this process (the same results, slower). Set MEMOPT_KERNELS=native (or torch) to "
        "skip the check and this warning, or report it to memopt's maintainers with this message")
    plain_y, plain_grad = _plain(lambda: _fewbit_step(x, args))
    assert torch.equal(y, plain_y) and torch.equal(grad, plain_grad)
    (_, found) = _warnings(lambda: _fewbit_step(x, args))
    assert not found and probes[("fewbit", "triton")] == 1  # one warning, one check
    assert not kernels.fewbit_triton(x, "act_1")
    # other families are checked on their own
    assert kernels.stash_triton(x, "generic stash code") and probes[("generic", "triton")] == 1


def test_a_kernel_that_differs_leaves_its_family_on_the_plain_path_naming_the_difference(gpu_like, probes,
                                                                                         monkeypatch):
    real = triton_stash_extras.group_decode

    def off(*args, **kwargs):
        out = real(*args, **kwargs)
        out[(0,) * out.dim()] += 0.5
        return out

    monkeypatch.setattr(triton_stash_extras, "group_decode", off)
    x = torch.randn(7, 50)

    def run():
        packed, params = generic.group_quantize(x, 4, 64, False)
        return packed, params, generic.group_dequantize(packed, params, 4, 64, x)

    got, found = _warnings(run)
    assert len(found) == 1, [str(w.message) for w in found]
    assert re.search(r"the Triton kernels for the generic stash's group codes \(kernel family 'generic'\) failed "
                     r"their first-use check on cpu, torch.float32: rows rebuilt: max abs diff 0\.5 from the plain "
                     r"path \(expected bit-identical\)\. .* Set MEMOPT_KERNELS=native \(or torch\)",
                     str(found[0].message))
    want = _plain(run)
    assert all(torch.equal(a, b) for a, b in zip(got, want))
    assert not _warnings(run)[1] and probes[("generic", "triton")] == 1


def test_the_bn_backward_passes_within_float32_rounding_and_fails_past_it(gpu_like, monkeypatch):
    real = triton_bn.bn_backward
    error = {"size": 1e-7}

    def nudged(*args, **kwargs):
        grad_x, *rest = real(*args, **kwargs)
        return (grad_x * (1 + error["size"]), *rest)

    monkeypatch.setattr(triton_bn, "bn_backward", nudged)
    assert verify.check("bn", CPU, torch.float32)  # a relative 1e-7: float32 rounding
    error["size"] = 1e-2
    passed, found = _warnings(lambda: verify.check("bn", CPU, torch.float32))
    assert not passed and len(found) == 1
    assert re.search(r"kernel family 'bn'\) failed their first-use check on cpu, torch.float32: chain input gradient: "
                     r"max abs diff \S+ from the plain path, past float32 rounding \(\S+\)", str(found[0].message))


def test_memopt_kernels_overrides_the_check_both_ways(gpu_like, probes, launches):
    x, args = torch.randn(4, 3, 5, 7), _gelu()
    with kernels.forced("triton"):  # no check: the kernels run
        _fewbit_step(x, args)
    assert launches == ["_encode_pack", "_unpack_scale"] and not probes and not verify.verdicts()
    launches.clear()
    for choice in ("native", "torch"):  # never Triton, never a check
        with kernels.forced(choice):
            _fewbit_step(x, args)
            assert not kernels.stash_triton(x, "x̂ code")
    assert not launches and not probes and not verify.verdicts()


def test_fake_tensors_never_run_a_check_and_follow_the_kept_verdict(gpu_like, probes):
    args = _gelu()
    with FakeTensorMode():
        fake = torch.randn(4, 3, 5, 7, requires_grad=True)
        assert not kernels.fewbit_triton(fake, "act_1")  # no verdict yet: the plain path's decision
        fewbit_activation(fake, FewBitSpec(*args)).sum().backward()
    assert not probes and not verify.verdicts()
    assert kernels.fewbit_triton(torch.randn(3), "act_1")  # a real tensor: checked, passed
    with FakeTensorMode():
        fake = torch.randn(4, 3, 5, 7, requires_grad=True)
        assert kernels.fewbit_triton(fake, "act_1")
        assert not kernels.fewbit_triton(fake.half(), "act_1")  # float16 not checked yet
    assert sum(probes.values()) == 2


def test_a_check_leaves_the_users_rng_and_autograd_alone(gpu_like):
    torch.manual_seed(7)
    x = torch.randn(300, requires_grad=True)
    before = torch.get_rng_state()
    gen = generic._generator(CPU)
    private = gen.get_state()
    with torch.enable_grad():
        for family in verify.PROBES:
            assert verify.check(family, CPU, torch.float32), family
    assert torch.equal(torch.get_rng_state(), before) and torch.equal(gen.get_state(), private)
    assert x.grad is None and x.grad_fn is None


def test_no_check_under_a_dispatch_mode_and_no_verdict_kept(gpu_like, probes):
    class Passing(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            return func(*args, **(kwargs or {}))

    x = torch.randn(10)
    with Passing():
        assert not kernels.stash_triton(x, "1-bit mask")
    assert not probes and not verify.verdicts()
    assert kernels.stash_triton(x, "1-bit mask") and probes[("mask", "triton")] == 1


def test_every_phrase_the_stash_passes_has_a_family_with_a_probe():
    root = Path(memopt.__file__).resolve().parent
    phrases = {m for path in root.rglob("*.py")
               for m in re.findall(r'stash_triton\(\s*[\w.]+,\s*"([^"]+)"', path.read_text())}
    assert len(phrases) >= 10, phrases
    assert {verify.family_of(p) for p in phrases} | {verify.FEWBIT} == set(verify.PROBES), phrases
    assert phrases == set(verify.FAMILY_OF)


def test_a_cpu_device_is_not_eligible_by_default():
    assert verify.eligible(torch.device("cuda", 0)) and not verify.eligible(CPU)
    with kernels.forced(None):
        assert not kernels.fewbit_triton(torch.randn(3), "act_1")


def test_prepare_checks_every_family_ahead_so_fake_tensors_follow_the_real_path(gpu_like, probes):
    with kernels.forced("native"):
        assert kernels.prepare(CPU) == {} and not probes  # no Triton by default there: nothing to check
    assert kernels.prepare(CPU) == {family: True for family in verify.PROBES}
    assert set(probes.values()) == {1} and len(probes) == 2 * len(verify.PROBES)
    with FakeTensorMode():
        assert kernels.stash_triton(torch.randn(3), "x̂ code") and kernels.fewbit_triton(torch.randn(3), "act_1")
    assert kernels.prepare(CPU) and len(probes) == 2 * len(verify.PROBES) and set(probes.values()) == {1}


def test_no_check_while_a_cuda_graph_is_captured(monkeypatch):
    """A check launches its probe and reads the result on the host: inside a CUDA graph capture that would be
    captured too (or raise), so it is put off; the step takes the plain path there until a check ran outside
    (the README: take one ordinary step before capturing)."""
    cuda = torch.device("cuda", 0)
    monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", lambda: False)
    assert verify._may_probe(cuda)
    monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", lambda: True)
    assert not verify._may_probe(cuda)
    assert verify._may_probe(CPU)  # capture is a CUDA stream's state: other devices are unaffected
