"""Few-bit backward's Triton kernels (memopt/runtime/triton_fewbit.py) against the plain path, bit for bit.

They run here in triton's CPU interpreter: TRITON_INTERPRET is read when a kernel is wrapped with ``triton.jit``,
which ``triton_fewbit`` does on first use once per value of the flag, so setting it per test (``monkeypatch``)
is enough and leaves other tests alone. On a GPU machine the same comparisons run compiled (test_cuda_*).
"""
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.utils._python_dispatch import TorchDispatchMode

import memopt
from conftest import requires_cuda
from memopt.cost_model.storage import LiveStorageTracker
from memopt.fewbit.activations import ACTIVATIONS
from memopt.fewbit.ops import FewBitSpec, _encode, _triton_encode, fewbit_activation
from memopt.runtime import kernels, native, triton_fewbit
from memopt.runtime.bitpack import pack_bits

requires_triton = pytest.mark.skipif(not triton_fewbit.AVAILABLE, reason=f"triton does not import here "
                                                                         f"({triton_fewbit.IMPORT_ERROR})")
EXACT = [name for name, a in ACTIVATIONS.items() if a.exact]
DTYPES = [torch.float32, torch.bfloat16, torch.float16]
# the interpreter computes with numpy, which warns where inf * 0 makes the NaN the plain path makes too
pytestmark = pytest.mark.filterwarnings("ignore:invalid value encountered:RuntimeWarning")
SPECIAL = [float("nan"), float("inf"), -float("inf"), 0.0, -0.0, 6.0, -3.0, 3.0, 1.0, -1.0, 0.1, -0.3, 0.7]


@pytest.fixture
def triton_on(monkeypatch):
    """The Triton path, interpreted on the CPU."""
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    with kernels.forced("triton"):
        yield


def _args(name, bits=3, params=None):
    act = ACTIVATIONS[name]
    p = act.params(params or {})
    if act.exact:
        return name, p, bits, (), tuple(act.mask_levels(dict(p)))
    borders, levels = memopt.fewbit_table(name, bits, params=dict(p))
    return name, p, bits, tuple(borders.tolist()), tuple(levels.tolist())


def _x(n, dtype, seed=0):
    torch.manual_seed(seed)
    x = torch.randn(n) * 4
    x[:min(n, len(SPECIAL))] = torch.tensor(SPECIAL[:n])
    return x.to(dtype)


def _same(a, b):
    """Equal bit for bit, NaN payloads aside (PyTorch's own kernels differ on those), and laid out alike."""
    assert a.shape == b.shape and a.dtype == b.dtype and a.stride() == b.stride()
    assert torch.equal(a.isnan(), b.isnan())
    keep = ~a.isnan()
    ints = {4: torch.int32, 2: torch.int16}[a.element_size()]
    assert torch.equal(a[keep].view(ints), b[keep].view(ints))  # +0 and -0 told apart


@requires_triton
@pytest.mark.parametrize("bits", range(1, 9))
@pytest.mark.parametrize("dtype", DTYPES)
def test_table_codes_and_poisoned_levels_match_the_plain_path(triton_on, bits, dtype):
    name, p, bits, borders, levels = _args("gelu", bits)
    for n in (1, 7, 8, 9, 1000, 40_003):
        x = _x(n, dtype, seed=n)
        packed, level_t = _triton_encode(x, name, p, bits, borders, levels)
        assert torch.equal(packed, pack_bits(_encode(x, borders), bits)), (bits, dtype, n)
        assert level_t.isnan().all()  # x[0] is NaN: every level poisoned, as the plain path's float32 sum gives
        finite = torch.randn(n).to(dtype)
        assert torch.equal(_triton_encode(finite, name, p, bits, borders, levels)[1], torch.tensor(levels))


@requires_triton
@pytest.mark.parametrize("name, params", [(n, {}) for n in EXACT] + [
    ("hardtanh", {"min_val": -0.3, "max_val": 0.7}), ("threshold", {"threshold": 0.1, "value": 2.0}),
    ("leaky_relu", {"negative_slope": 0.2})])
@pytest.mark.parametrize("dtype", DTYPES)
def test_masks_match_the_activations_comparisons_nan_and_inf_included(triton_on, name, params, dtype):
    act = ACTIVATIONS[name]
    for bits in (1, 2, 3):
        x = _x(1001, dtype)
        name_, p, _, borders, levels = _args(name, bits, params)
        packed, level_t = _triton_encode(x, name, p, bits, borders, levels)
        assert level_t is None
        assert torch.equal(packed, pack_bits(act.mask(x, dict(p)), bits)), (name, params, dtype, bits)


def _grads(x, args, grad, choice):
    with kernels.forced(choice):
        leaf = x.detach().clone().requires_grad_()
        y = fewbit_activation(leaf, FewBitSpec(*args))
        y.backward(grad)
    return leaf.grad


LAYOUTS = ["contiguous", "channels_last", "transposed", "expanded_grad", "sliced"]


def _layout(x, grad, layout):
    if layout == "channels_last":
        return x.contiguous(memory_format=torch.channels_last), grad.contiguous(memory_format=torch.channels_last)
    if layout == "transposed":
        return x.transpose(1, 3), grad.transpose(1, 3)
    if layout == "expanded_grad":  # what y.sum().backward() sends: every stride 0
        return x, grad.view(-1)[:1].view(1, 1, 1, 1).expand(x.shape)
    return x[:, ::2], grad[:, ::2]  # a gapped input: packed from one copy


@requires_triton
@pytest.mark.parametrize("name, bits", [("relu", 1), ("relu6", 1), ("hardtanh", 1), ("leaky_relu", 1),
                                        ("hardsigmoid", 1), ("threshold", 1), ("gelu", 1), ("gelu", 2),
                                        ("silu", 3), ("tanh", 4), ("elu", 5), ("mish", 6), ("sigmoid", 7),
                                        ("softplus", 8)])
@pytest.mark.parametrize("dtype", DTYPES)
def test_gradients_are_bit_identical_in_every_layout(triton_on, name, bits, dtype):
    args = _args(name, bits)
    for layout in LAYOUTS:
        x = _x(3 * 6 * 5 * 7, dtype).view(3, 6, 5, 7)
        if not ACTIVATIONS[name].exact:
            x = x.nan_to_num(0.5, 2.0, -2.0)  # a non-finite input poisons every level: tested above
        grad = _x(x.numel(), dtype, seed=1).view(x.shape)
        xl, gl = _layout(x, grad, layout)
        _same(_grads(xl, args, gl, "triton"), _grads(xl, args, gl, "torch"))


@requires_triton
@pytest.mark.parametrize("shape", [(0,), (0, 3), (), (1,), (7,), (5, 1, 3, 1, 2, 2, 3)])
def test_odd_shapes(triton_on, shape):
    x = torch.randn(shape) * 3
    grad = torch.randn(shape)
    for args in (_args("gelu", 3), _args("relu", 1)):
        _same(_grads(x, args, grad, "triton"), _grads(x, args, grad, "torch"))
    if len(shape) == 7:  # six dimensions that never merge: more than the kernel walks, the plain path takes it
        xt = x.permute(6, 0, 2, 4, 1, 3, 5)
        order = (3, 0, 5, 1, 6, 2, 4)  # the gradient in yet another memory order
        gt = torch.randn([xt.shape[d] for d in order]).permute(sorted(range(7), key=order.__getitem__))
        assert gt.shape == xt.shape and not triton_fewbit.scale_fits(gt, torch.empty(gt.shape), xt.stride())
        _same(_grads(xt, _args("gelu", 3), gt, "triton"), _grads(xt, _args("gelu", 3), gt, "torch"))


@requires_triton
@pytest.mark.parametrize("name, bits", [("gelu", 3), ("silu", 8), ("relu", 1)])
def test_a_large_odd_size(triton_on, name, bits):
    x = _x(100_003, torch.float32).nan_to_num(0.5, 2.0, -2.0).view(1, -1)
    grad = _x(100_003, torch.float32, seed=2).view(1, -1)
    _same(_grads(x, _args(name, bits), grad, "triton"), _grads(x, _args(name, bits), grad, "torch"))


@requires_triton
def test_a_table_too_big_for_its_width_is_refused(triton_on):
    with pytest.raises(ValueError, match=r"a 2-bit table has at most 3 borders and 4 levels, got 7 and 8; pass the "
                                         r"table made for 2 bits"):
        triton_fewbit.encode_table(torch.randn(5), torch.arange(7.0), torch.arange(8.0), 2, nan_top=False)


class _Ops(TorchDispatchMode):
    """Counts the ATen ops that run a kernel or allocate (views and metadata left out)."""

    def __init__(self):
        super().__init__()
        self.ops = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if not func.is_view and func.__name__.split(".")[0] not in ("detach", "alias", "permute", "view"):
            self.ops.append(func.__name__)
        return func(*args, **(kwargs or {}))


@requires_triton
@pytest.mark.parametrize("name, bits", [("gelu", 3), ("relu", 1)])
def test_one_launch_each_way_and_one_allocation(triton_on, monkeypatch, name, bits):
    launches, ops = [], _Ops()
    real = triton_fewbit._launch

    def counted(kernel, grid, *args, **meta):
        launches.append(kernel.__name__)
        before = len(ops.ops)
        real(kernel, grid, *args, **meta)
        del ops.ops[before:]  # the interpreter's own tensor copies are not launches on a GPU

    monkeypatch.setattr(triton_fewbit, "_launch", counted)
    x = torch.randn(4, 8, 5, 5, requires_grad=True)
    args = _args(name, bits)
    # warm: the constant tables are copied once per device
    fewbit_activation(x.detach().requires_grad_(), FewBitSpec(*args))
    launches.clear()
    with ops:
        y = fewbit_activation(x, FewBitSpec(*args))
    forward = list(ops.ops)
    assert launches == ["_encode_pack"]
    activation = {"gelu": ["gelu.default"], "relu": ["relu.default"]}[name]
    # the activation itself, the packed codes' allocation and, for a table, the levels' copy (poisoned in place)
    assert forward == activation + ["empty.memory_format"] + (["clone.default"] if name == "gelu" else [])
    ops.ops.clear()
    grad = torch.randn(x.shape)
    with ops:
        y.backward(grad)
    assert launches == ["_encode_pack", "_unpack_scale"]
    assert [op for op in ops.ops if op not in ("ones_like.default",)] in (["empty.memory_format"],
                                                                          ["empty_like.default"])


@requires_triton
def test_the_default_keeps_cpu_tensors_on_the_plain_path_and_fake_tensors_never_launch(monkeypatch):
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    monkeypatch.setattr(triton_fewbit, "_kernel", lambda fn: pytest.fail(f"launched {fn.__name__}"))
    x = torch.randn(10, requires_grad=True)
    with kernels.forced(None):
        assert not kernels.fewbit_triton(x, "n")
        fewbit_activation(x, FewBitSpec(*_args("gelu"))).sum().backward()
    with kernels.forced("native"):
        assert not kernels.fewbit_triton(x, "n")
    with kernels.forced("triton"):
        assert not kernels.fewbit_triton(x.double(), "n")  # float64: the plain path (exact masks, gradcheck)
        args = _args("gelu")
        with FakeTensorMode():
            fake = torch.randn(10, requires_grad=True)
            assert kernels.fewbit_triton(fake, "n")  # the path real tensors take: allocations, no launch
            fewbit_activation(fake, FewBitSpec(*args)).sum().backward()


@requires_triton
@pytest.mark.parametrize("name, bits", [("gelu", 3), ("relu", 1)])
def test_fake_tensors_allocate_what_the_kernels_allocate(triton_on, name, bits):
    # the cost model's estimate runs this path on fake tensors: same allocations, no launch. (On the interpreter
    # the measured peak of a whole model is not comparable: it keeps kernel arguments alive in reference cycles
    # until the garbage collector runs, and re-announces the cached tables through aten.set_.)
    args = _args(name, bits)

    def peak(x, grad, preexisting):
        tracker = LiveStorageTracker([x, grad, *preexisting])
        with tracker:
            torch.autograd.grad(fewbit_activation(x, FewBitSpec(*args)), x, grad)
        return tracker.peak, sorted(e[1] for e in tracker.at_peak)

    x, grad = torch.randn(8, 3, 5, 7, requires_grad=True), torch.randn(8, 3, 5, 7)
    # the constant tables are made once per device
    torch.autograd.grad(fewbit_activation(x, FewBitSpec(*args)), x, grad)
    real = peak(x, grad, triton_fewbit._constants.values())
    with FakeTensorMode():
        fx, fg = torch.randn(8, 3, 5, 7, requires_grad=True), torch.randn(8, 3, 5, 7)
        assert real == peak(fx, fg, ())
    with kernels.forced("torch"):
        plain = peak(x, grad, ())
    assert real[0] <= plain[0]


def test_the_switch_refuses_bad_values_and_torch_turns_the_c_kernels_off(monkeypatch):
    with pytest.raises(memopt.MemoptError, match=r"MEMOPT_KERNELS='cuda' is not one of triton, native, torch; set "
                                                 r"one of those, or unset it"):
        kernels.parse("cuda")
    assert kernels.parse(" Triton ") == "triton" and kernels.parse("") is None
    x = torch.zeros(8, dtype=torch.uint8)
    with kernels.forced("torch"):
        assert not native.applies(x) and not kernels.native_allowed()
    with kernels.forced("native"):
        assert native.applies(x) == native.available()


@requires_triton
def test_forcing_triton_on_a_cpu_tensor_outside_the_interpreter_names_the_fix(monkeypatch):
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    message = r"MEMOPT_KERNELS=triton but few-bit node act_3 has a CPU input.*set TRITON_INTERPRET=1"
    with kernels.forced("triton"), pytest.raises(memopt.MemoptError, match=message):
        fewbit_activation(torch.randn(4, requires_grad=True), FewBitSpec(*_args("gelu"), "act_3"))


def test_memopt_imports_and_trains_without_triton(tmp_path):
    code = (
        "import sys; sys.modules['triton'] = None\n"  # `import triton` now raises ImportError
        "import torch, memopt\n"
        "from memopt.runtime import kernels, triton_fewbit\n"
        "from memopt.fewbit.ops import FewBitSpec, fewbit_activation\n"
        "assert not triton_fewbit.AVAILABLE and 'import of triton halted' in triton_fewbit.IMPORT_ERROR\n"
        "x = torch.randn(6, requires_grad=True)\n"
        "b, l = memopt.fewbit_table('gelu', 2)\n"
        "args = ('gelu', (('approximate', 'none'),), 2, tuple(b.tolist()), tuple(l.tolist()), 'act_1')\n"
        "fewbit_activation(x, FewBitSpec(*args)).sum().backward()\n"
        "assert x.grad is not None\n"
        "with kernels.forced('triton'):\n"
        "    try:\n"
        "        fewbit_activation(x, FewBitSpec(*args))\n"
        "    except memopt.MemoptError as e:\n"
        "        assert 'MEMOPT_KERNELS=triton but `import triton` failed' in str(e) and 'act_1' in str(e), e\n"
        "    else:\n"
        "        raise AssertionError('no error')\n"
        "print('ok')\n")
    root = Path(memopt.__file__).resolve().parent.parent
    env = {**os.environ, "PYTHONPATH": str(root), "MEMOPT_KERNELS": ""}
    done = subprocess.run([sys.executable, "-c", code], cwd=tmp_path, env=env, capture_output=True, text=True,
                          timeout=120)
    assert done.returncode == 0 and done.stdout.strip() == "ok", done.stderr[-2000:]


@requires_cuda
@requires_triton
@pytest.mark.parametrize("name, bits", [("relu", 1), ("hardsigmoid", 1), ("gelu", 3), ("silu", 5), ("tanh", 8)])
@pytest.mark.parametrize("dtype", DTYPES)
def test_cuda_triton_matches_the_plain_path(name, bits, dtype):
    args = _args(name, bits)
    for layout in LAYOUTS:
        x = _x(4 * 6 * 5 * 7, dtype).view(4, 6, 5, 7).nan_to_num(0.5, 2.0, -2.0).cuda()
        grad = _x(x.numel(), dtype, seed=1).view(x.shape).cuda()
        xl, gl = _layout(x, grad, layout)
        _same(_grads(xl, args, gl, None).cpu(), _grads(xl, args, gl, "torch").cpu())
