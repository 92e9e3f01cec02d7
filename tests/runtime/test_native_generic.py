"""The generic stash's group codecs and few-bit backward as fused C kernels (memopt/runtime/native_generic.py,
kernels_generic.c) against the plain-PyTorch path (``kernels.forced("torch")``), the reference: the same packed
bytes, group parameters, rebuilt values and gradients bit for bit (NaN payloads and signed zeros included), the
same outputs under fake tensors, and the same gradients through a whole transformer."""
import copy

import pytest
import torch
from torch._subclasses.fake_tensor import FakeTensorMode

import memopt
from memopt.fewbit.activations import ACTIVATIONS
from memopt.fewbit.ops import SCANNED_BORDERS, FewBitSpec, _encode, _packed_codes, _round_to, fewbit_activation
from memopt.runtime.bitpack import unpack_bits
from memopt.runtime import kernels, native, native_generic
from memopt.runtime.layout import rebuilt_stride
from memopt.stash import generic
from memopt.stash.generic import group_dequantize, group_quantize
from memopt.testing.zoo import build

pytestmark = pytest.mark.skipif(not native.available(), reason="the fused kernels could not be built here")


def _bits_of(t: torch.Tensor) -> torch.Tensor:
    """``t``'s raw bits (NaN payloads and zero signs compare), in logical order."""
    view = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}[t.element_size()]
    return t.contiguous().view(view)


def _same(a: torch.Tensor, b: torch.Tensor) -> bool:
    """The same dtype, shape, layout (strides of dimensions longer than 1) and bits."""
    layout = [[s for s, size in zip(t.stride(), t.shape) if size > 1] for t in (a, b)]
    return a.dtype == b.dtype and a.shape == b.shape and layout[0] == layout[1] and torch.equal(_bits_of(a),
                                                                                                 _bits_of(b))


def _values(n: int, group: int, seed: int = 0) -> torch.Tensor:
    """Heavy-tailed values with the cases the codec must keep: constant groups (step 0), zeros of both signs first
    in a group whose minimum or maximum is zero, NaN (with a payload and a sign), ±inf, ranges whose width
    overflows to inf, and steps under FLT_MIN."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, generator=g) * torch.randn(n, generator=g).exp()
    groups = list(range(0, n, group))
    def zeros(s, first, other, sign=1.0, at=(2, 5)):
        """non-negative values (non-positive with sign -1), zeros every 7 from ``at``: ``first`` then ``other``"""
        s.abs_().mul_(sign)
        s[at[0]::7], s[at[1]::7] = first, other

    def put(s, where, value):
        s[where] = value

    nan_payload = torch.tensor(0xFFC00123 - (1 << 32), dtype=torch.int32).view(torch.float32)  # quiet, negative

    special = {
        1: lambda s: s.fill_(2.5),                              # constant: step 0
        2: lambda s: zeros(s, 0.0, -0.0),                       # minimum zero: the first zero's sign is kept
        3: lambda s: zeros(s, -0.0, 0.0),
        4: lambda s: zeros(s, 0.0, -0.0, -1.0),                 # maximum zero
        5: lambda s: zeros(s, -0.0, 0.0, -1.0),
        6: lambda s: put(s, len(s) // 2, float("nan")),
        7: lambda s: put(s, slice(len(s) // 3, None, 5), nan_payload),  # a negative NaN with a payload
        8: lambda s: put(s, 0, float("inf")),
        9: lambda s: put(s, -1, float("-inf")),
        10: lambda s: put(s, slice(None, None, 2), 3e38) or put(s, slice(1, None, 2), -3e38),  # width overflows
        11: lambda s: s.fill_(1e-38).__setitem__(slice(None, None, 4), 1.0000001e-38),  # step under FLT_MIN
        12: lambda s: s.zero_().__setitem__(slice(1, None, 2), -0.0),  # all zeros, +0 first
        13: lambda s: s.zero_().neg_(),                         # all -0
        14: lambda s: put(s, 3, nan_payload) or put(s, 9, float("nan")),  # two NaNs: the first is kept
        **{15 + 4 * j + k: (lambda s, at=at, k=k: zeros(s, *((0.0, -0.0), (-0.0, 0.0))[k % 2], (1.0, -1.0)[k // 2], at))
           for j, at in enumerate([(1, 12), (9, 3), (0, 6), (14, 17)]) for k in range(4)},  # other lanes first
    }
    for k, fix in special.items():
        if k < len(groups):
            fix(x[groups[k]:groups[k] + group])
    return x


def _both(fn):
    """fn() with the C kernels (the default), then on the plain path."""
    fused = fn()
    with kernels.forced("torch"):
        plain = fn()
    return fused, plain


def _check_codec(x: torch.Tensor, bits: int, group: int, rebuild_dtypes=(None,)):
    (packed, params), (packed_p, params_p) = _both(lambda: group_quantize(x, bits, group, False))
    assert _same(packed, packed_p) and _same(params, params_p)
    for dtype in rebuild_dtypes:
        like = torch.empty_strided(x.shape, rebuilt_stride(x), dtype=dtype or x.dtype)
        out, out_p = _both(lambda: group_dequantize(packed, params, bits, group, like))
        assert _same(out, out_p), dtype


@pytest.mark.parametrize("bits", range(1, 9))
@pytest.mark.parametrize("group", [256, 64, 17])
def test_codes_params_and_rebuilds_are_the_plain_paths_bits(bits, group):
    for n in (1, 7, group, 31 * group + 5, 70001):  # a lone element, a short tail, the threaded size
        _check_codec(_values(n, group, seed=n), bits, group)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float64])
def test_other_dtypes_code_through_float32_and_rebuild_through_it(dtype):
    x = _values(5000, 64).clamp(-6e4, 6e4).to(dtype)
    _check_codec(x, 4, 64, rebuild_dtypes=(None, torch.float32))


@pytest.mark.parametrize("layout", ["channels_last", "transposed", "sliced"])
def test_layouts_code_in_memory_order_as_the_plain_path(layout):
    x = _values(4 * 6 * 9 * 11, 256).view(4, 6, 9, 11)
    x = {"channels_last": lambda: x.contiguous(memory_format=torch.channels_last),
         "transposed": lambda: x.transpose(1, 3), "sliced": lambda: x[:, ::2]}[layout]()
    _check_codec(x, 8, 256, rebuild_dtypes=(None, torch.bfloat16))
    _check_codec(x, 3, 17)


def test_threads_give_the_same_bits():
    x = _values(300007, 256, seed=3)
    before = torch.get_num_threads()
    try:
        torch.set_num_threads(2)
        two = group_quantize(x, 5, 256, False)
        torch.set_num_threads(1)
        one = group_quantize(x, 5, 256, False)
    finally:
        torch.set_num_threads(before)
    assert _same(two[0], one[0]) and _same(two[1], one[1])


def test_empty_tensors_and_what_falls_back():
    packed, params = group_quantize(torch.zeros(0, 3), 8, 256, False)
    assert packed.shape == (0,) and params.shape == (2, 0)  # (the plain path fails on an empty tensor)
    assert group_dequantize(packed, params, 8, 256, torch.zeros(0, 3)).shape == (0, 3)
    # stochastic rounding and malformed codes take the plain path (its draws; its errors)
    x = _values(1000, 64)

    def stochastic():
        generic._GENERATORS.clear()  # the private generator from its seed on both paths
        return group_quantize(x, 4, 64, True)
    (packed, params), (packed_p, params_p) = _both(stochastic)
    assert _same(packed, packed_p) and _same(params, params_p)
    packed, params = group_quantize(x, 4, 64, False)
    with pytest.raises(ValueError, match="bytes"):
        group_dequantize(packed[:-1], params, 4, 64, x)
    assert not native_generic.decodable(packed, params[:, :-1], 4, 64, x.numel())
    assert not native_generic.encodable(x, 9, 64) and not native_generic.encodable(x, 4, 0)


def test_fake_tensors_get_the_same_outputs_and_nothing_runs():
    x = _values(4 * 300, 256).view(4, 300)
    real = group_quantize(x, 6, 256, False)
    with FakeTensorMode(allow_non_fake_inputs=True) as mode:
        fx = mode.from_tensor(x)
        packed, params = group_quantize(fx, 6, 256, False)
        out = group_dequantize(packed, params, 6, 256, fx)
        grad = native_generic.fewbit_scale(packed[:(fx.numel() * 3 + 7) // 8], 3, fx, torch.zeros(8))
    assert (packed.shape, params.shape, packed.dtype) == (real[0].shape, real[1].shape, real[0].dtype)
    assert out.shape == x.shape and out.dtype == x.dtype and grad.shape == x.shape


def _fewbit_grad(x, name, bits, grad):
    p = ACTIVATIONS[name].params({})
    borders, levels = memopt.fewbit_table(name, bits, params=dict(p))
    x = x.detach().requires_grad_()
    fewbit_activation(x, FewBitSpec(name, p, bits, tuple(borders.tolist()), tuple(levels.tolist()), "n")).backward(grad)
    return x.grad


@pytest.mark.parametrize("name", ["gelu", "silu"])
@pytest.mark.parametrize("bits", range(1, 9))
def test_fewbit_backward_is_the_plain_paths_gradient(name, bits):
    torch.manual_seed(bits)
    x, grad = torch.randn(5, 7, 33) * 3, torch.randn(5, 7, 33)
    grad.view(-1)[:4] = torch.tensor([float("nan"), float("inf"), -0.0, float("-inf")])
    fused, plain = _both(lambda: _fewbit_grad(x, name, bits, grad))
    assert _same(fused, plain)
    x.view(-1)[9] = float("nan")  # poisoned levels: every gradient NaN, the plain path's NaN
    assert _same(*_both(lambda: _fewbit_grad(x, name, bits, grad)))


@pytest.mark.parametrize("name", ["gelu", "silu"])
@pytest.mark.parametrize("bits", range(1, 9))
def test_fewbit_forward_codes_are_the_plain_paths_bytes(name, bits):
    """The fused encode's packed pieces against the plain path's (a comparison per border up to 15 borders,
    ``bucketize`` above): values equal to a border (they go to the lower piece), signed zeros, ±inf and NaN (piece 0
    where the plain path compares, the top piece where ``bucketize`` places it), over several chunks of the kernel
    and a length that is no multiple of 8."""
    p = ACTIVATIONS[name].params({})
    borders, _ = memopt.fewbit_table(name, bits, params=dict(p))
    rounded = tuple(_round_to(torch.float32, b) for b in borders.tolist())
    g = torch.Generator().manual_seed(bits)
    x = torch.randn(3 * 2048 + 13, generator=g) * 4
    x[:len(rounded)] = torch.tensor(rounded)
    x[-6:] = torch.tensor([float("nan"), -float("nan"), float("inf"), -float("inf"), -0.0, 0.0])
    fused = native_generic.fewbit_encode(x, rounded, bits, nan_top=len(rounded) > SCANNED_BORDERS)
    with kernels.forced("torch"):
        plain = _packed_codes(x, lambda part: _encode(part, tuple(borders.tolist())), bits)
    assert fused.dtype == plain.dtype == torch.uint8 and torch.equal(fused, plain)
    codes = unpack_bits(fused, bits, x.numel())
    assert codes[-6:-4].tolist() == [len(rounded) if len(rounded) > 15 else 0] * 2  # NaN where the plain path puts it


@pytest.mark.parametrize("case", ["channels_last", "bfloat16", "float16", "strided_grad"])
def test_fewbit_backward_falls_back_where_the_kernel_does_not_apply(case):
    torch.manual_seed(0)
    x, grad = torch.randn(2, 3, 5, 4) * 3, torch.randn(2, 3, 5, 4)
    if case == "channels_last":
        x = x.contiguous(memory_format=torch.channels_last)
    elif case == "strided_grad":
        grad = grad.transpose(1, 3).contiguous().transpose(1, 3)
    else:
        x, grad = x.to(getattr(torch, case)), grad.to(getattr(torch, case))
    assert _same(*_both(lambda: _fewbit_grad(x, "gelu", 4, grad)))


def test_a_transformer_trains_to_the_same_bits_with_and_without_the_kernels(monkeypatch):
    calls = {"group_encode": 0, "group_decode": 0, "fewbit_scale": 0, "fewbit_encode": 0}
    for name in calls:
        def counted(*args, _fn=getattr(native_generic, name), _name=name, **kwargs):
            calls[_name] += 1
            return _fn(*args, **kwargs)
        monkeypatch.setattr(native_generic, name, counted)
    model, x = build("vit")
    results = []
    for choice in (None, "torch"):
        m = copy.deepcopy(model)
        with kernels.forced(choice):
            om = memopt.optimize(m, example_inputs=x, config=memopt.Config(fidelity=None))
            if choice is None:
                real = memopt.measure(om, x)
                assert (real.peak_bytes, real.saved_bytes) == (om.plan.estimated_peak_bytes,
                                                               om.plan.estimated_saved_bytes)
            torch.manual_seed(0)
            out = om(x)
            out.backward(torch.randn_like(out))
        results.append((out.detach(), [p.grad for p in m.parameters()]))
    assert all(calls.values()), calls  # the plan coded tensors and ran few-bit backward through the kernels
    (out, grads), (out_p, grads_p) = results
    assert _same(out, out_p)
    assert len(grads) == len(grads_p) and all(_same(a, b) for a, b in zip(grads, grads_p))


def test_the_gates_comparison_sums_in_double_whatever_the_threads():
    """``compare``: the four sums parameter_fidelity reads, from one pass, as float64 copies give them (to double
    rounding), the same bits on 1 and 2 threads; what it does not take is left to PyTorch (None)."""
    torch.manual_seed(0)
    g = torch.randn(300_001)  # several blocks and a partial one
    a = g + 1e-3 * torch.randn_like(g)
    g64, a64 = g.double(), a.double()
    want = [float(g64 @ g64), float(a64 @ a64), float(g64 @ a64), float((a64 - g64) @ (a64 - g64))]
    before = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        one = native_generic.compare(g, a)
        torch.set_num_threads(2)
        two = native_generic.compare(g, a)
    finally:
        torch.set_num_threads(before)
    assert one == two
    assert all(abs(x - y) <= 1e-12 * abs(y) for x, y in zip(one, want)), (one, want)
    assert native_generic.compare(torch.zeros(0), torch.zeros(0)) == (0.0, 0.0, 0.0, 0.0)
    m = torch.randn(8, 6)
    assert native_generic.compare(m, torch.randn(6, 8)) is None  # another shape
    assert native_generic.compare(m.t(), m.t()) is None  # not contiguous
    assert native_generic.compare(m, m.double()) is None  # not float32
    with kernels.forced("torch"):
        assert native_generic.compare(m, m) is None
    with FakeTensorMode():
        f = torch.randn(4)
        assert native_generic.compare(f, f) is None


def _largest_allocation(fn) -> int:
    """The largest single allocation inside ``fn``, ATen's internal buffers included (the profiler's memory
    events)."""
    from torch.profiler import ProfilerActivity, profile
    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        fn()
    return max((e.self_cpu_memory_usage for e in prof.events()), default=0)


@pytest.mark.parametrize("bits,group", [(8, 256), (4, 64), (3, 17)])
def test_bf16_group_codes_are_the_float32_copys_with_no_float32_copy(bits, group):
    # autocast's bf16 activations: the kernel widens a span at a time (before: a whole float32 copy first)
    x = _values(70001, group).clamp(-3e38, 3e38).to(torch.bfloat16)
    packed, params = native_generic.group_encode(x, bits, group)
    packed32, params32 = native_generic.group_encode(x.float(), bits, group)
    assert _same(packed, packed32) and _same(params, params32)
    assert _largest_allocation(lambda: group_quantize(x, bits, group, False)) < x.numel() * 4 // 2
    _check_codec(x, bits, group)  # and the plain path's bits


@pytest.mark.parametrize("name,bits", [("gelu", 4), ("gelu", 8), ("silu", 2)])
def test_bf16_fewbit_forward_codes_its_input_as_its_float32_copy_with_no_float32_copy(name, bits):
    p = ACTIVATIONS[name].params({})
    borders, _ = memopt.fewbit_table(name, bits, params=dict(p))
    rounded = tuple(_round_to(torch.bfloat16, b) for b in borders.tolist())
    g = torch.Generator().manual_seed(bits)
    x = (torch.randn(3 * 2048 + 13, generator=g) * 4).to(torch.bfloat16)
    x[:len(rounded)] = torch.tensor(rounded)
    x[-6:] = torch.tensor([float("nan"), -float("nan"), float("inf"), -float("inf"), -0.0, 0.0])
    fused = native_generic.fewbit_encode(x, rounded, bits, nan_top=len(rounded) > SCANNED_BORDERS)
    assert torch.equal(fused, native_generic.fewbit_encode(x.float(), rounded, bits,
                                                           nan_top=len(rounded) > SCANNED_BORDERS))
    with kernels.forced("torch"):
        plain = _packed_codes(x, lambda part: _encode(part, tuple(borders.tolist())), bits)
    assert torch.equal(fused, plain)
    # the whole op under autocast's dtype: no float32 tensor of the input's size, ATen's internal ones included
    big = torch.randn(4, 1 << 20, generator=g).to(torch.bfloat16).requires_grad_()
    borders_, levels = memopt.fewbit_table(name, bits, params=dict(p))
    spec = FewBitSpec(name, p, bits, tuple(borders_.tolist()), tuple(levels.tolist()), "n")
    assert _largest_allocation(lambda: fewbit_activation(big, spec)) <= big.numel() * 2
