"""Every Triton kernel memopt launches compiles for a GPU, checked without one.

The codec tests run the kernels in Triton's CPU interpreter, which executes them as Python: a construct the GPU
compiler refuses (a plain Python helper called from a kernel, a loop bound of the wrong type, a scalar pointer
with a block mask) passes there and fails on the first CUDA run. Here every kernel launched by a small model's
training step (few-bit, the stash chain with its BN backward and max-pool, dropout, the generic stash) is
recorded with its arguments and compiled by Triton's own pipeline for an sm_90 target, down to PTX and the
cubin (Triton ships ptxas with its CUDA backend), with the constexprs and options it was launched with."""
import copy
import inspect
import os

import pytest
import torch
from torch import nn

import memopt
from memopt.runtime import kernels, native, triton_bn, triton_fewbit
from triton_stash_helpers import _Net, requires_triton

try:
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource
    from triton.runtime.jit import JITFunction
    PTXAS = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", "ptxas")
except Exception:  # no triton: requires_triton skips
    PTXAS = ""

requires_ptxas = pytest.mark.skipif(not os.path.exists(PTXAS), reason="triton's CUDA backend (ptxas) is not here")
_POINTERS = {torch.float32: "*fp32", torch.bfloat16: "*bf16", torch.float16: "*fp16", torch.uint8: "*u8",
             torch.bool: "*i1", torch.int32: "*i32", torch.int64: "*i64", torch.int16: "*i16"}


class _GeluHead(_Net):
    """The stash tests' small CNN with a GELU MLP head, so few-bit's kernels run too."""

    def __init__(self, c=8):
        super().__init__(c)
        self.fc = nn.Sequential(nn.Linear(c, 32), nn.GELU(), nn.Linear(32, 5))


def _launched(monkeypatch, config):
    """(kernel, positional args, keyword meta) of every launch in one optimized training step, interpreted."""
    seen = []
    real = triton_fewbit._launch

    def record(fn, grid, *args, **meta):
        seen.append((fn, args, meta))
        real(fn, grid, *args, **meta)

    monkeypatch.setenv("TRITON_INTERPRET", "1")
    monkeypatch.setattr(triton_fewbit, "_launch", record)
    monkeypatch.setattr(triton_fewbit, "_groups", lambda t: 128)  # a GPU's block sizes, not the interpreter's
    torch.manual_seed(0)
    model, x = _GeluHead().train(), torch.randn(4, 3, 16, 16)
    with kernels.forced("triton"), native.disabled():
        om = memopt.optimize(copy.deepcopy(model), example_inputs=x, config=config)
        om(x).square().sum().backward()
    return seen


def _signature(fn, args, meta):
    params = list(inspect.signature(fn).parameters.values())
    constexprs = {p.name for p in params if p.annotation in ("tl.constexpr", triton.language.constexpr)}
    signature, values = {}, {}
    for p, value in zip(params, args):
        values[p.name] = value
    values.update({k: v for k, v in meta.items() if k != "enable_fp_fusion"})
    for p in params:
        value = values[p.name]
        if p.name in constexprs:
            signature[p.name] = "constexpr"
        elif isinstance(value, torch.Tensor):
            signature[p.name] = _POINTERS[value.dtype]
        elif isinstance(value, bool):
            signature[p.name] = "i1"
        elif isinstance(value, int):
            signature[p.name] = "i32" if -2 ** 31 <= value < 2 ** 31 else "i64"
        elif isinstance(value, float):
            signature[p.name] = "fp32"
        else:
            raise TypeError(f"{fn.__name__}: argument {p.name} is a {type(value).__name__}")
    return signature, {name: values[name] for name in constexprs}


@requires_triton
@requires_ptxas
def test_every_kernel_a_training_step_launches_compiles_for_a_gpu(monkeypatch):
    seen = []
    # with few-bit and the generic stash; without them the residual block is a chain whose grid ends its sides
    for generic, fewbit in ((True, memopt.FewBitConfig(bits=3)), (False, None)):
        config = memopt.Config(stash=memopt.StashConfig(bits=4, generic=generic, min_per_channel=8), fewbit=fewbit,
                               fidelity=None)
        seen += _launched(monkeypatch, config)
    names = {fn.__name__ for fn, _, _ in seen}
    assert {"_encode_pack", "_unpack_scale", "_chain_encode", "_bn_sums", "_bn_grad", "_walk_pack",
            "_walk_unpack", "_chain_rebuild", "_channel_ends"} <= names, names
    monkeypatch.setenv("TRITON_INTERPRET", "0")  # compile, not interpret: helpers bound to their jitted form
    triton_bn._bind()
    variants = {}
    for fn, args, meta in seen:
        signature, constexprs = _signature(fn, args, meta)
        # one compile per kernel and choice of its branches (its boolean constexprs); widths and block sizes aside
        key = (fn.__name__, tuple(sorted((k, v) for k, v in constexprs.items() if isinstance(v, bool) or k == "ACT")))
        variants.setdefault(key, (fn, signature, constexprs, meta.get("enable_fp_fusion", True)))
    assert {key[0] for key in variants if ("ACT", 0) in key[1]} >= {"_bn_sums", "_bn_grad"}  # residual chains
    assert {key[0] for key in variants if ("ACT", 1) in key[1]} >= {"_bn_sums", "_bn_grad"}  # ReLU read from g
    for key in [k for k in variants if k[0] in ("_bn_sums", "_bn_grad") and ("ACT", 1) in k[1]]:
        # autocast's bf16 / fp16 gradient and LeakyReLU's slope rounded in it (the by-hand bf16 rounding)
        fn, signature, constexprs, fusion = variants[key]
        for dtype in ("*bf16", "*fp16"):
            variants[(key[0], key[1] + (("ACT", 2), ("g", dtype)))] = (
                fn, dict(signature, g_ptr=dtype), dict(constexprs, ACT=2), fusion)
    failures = []
    print(f"{len(variants)} kernel variants from {len(seen)} launches")
    for (name, _), (fn, signature, constexprs, fusion) in variants.items():
        source = ASTSource(fn=JITFunction(fn), signature=signature, constexprs=constexprs)
        try:
            compiled = triton.compile(source, target=GPUTarget("cuda", 90, 32),
                                      options={"enable_fp_fusion": fusion})
            assert compiled.asm["cubin"], name
        except Exception as error:  # every kernel's failure, not only the first
            failures.append(f"{name} {constexprs}: {type(error).__name__}: {str(error)[:400]}")
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    triton_bn._bind()
    assert not failures, "\n".join(failures)
