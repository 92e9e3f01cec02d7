"""The Triton kernels' first-use probes (``memopt.runtime.verify``), one per kernel family, registered on import.

Each probe runs the real memopt code path of its family on a tiny input and returns its outputs by name;
``verify.check`` runs it once with the Triton kernels and once with plain PyTorch and compares. The inputs come from a
private generator; the Functions' forward and backward are called directly with a stand-in ``ctx`` (``_Ctx``), so
nothing is recorded into an autograd graph. They live here, not in ``memopt.runtime``, because they call the techniques
(layer 2) that call the runtime (layer 1).
"""
from __future__ import annotations

from typing import Dict, Optional, Tuple

import torch
import torch.nn.functional as F

from memopt.fewbit.activations import get_activation
from memopt.fewbit.ops import _FewBit
from memopt.fewbit.tables import fewbit_table
from memopt.runtime import verify
from memopt.stash import generic
from memopt.stash.grid import _from_codes, exact_mask
from memopt.stash.ops import BNActStash, _Stash
from memopt.stash.pool import pool_backward, pool_indices, pool_offsets

Outputs = Dict[str, Optional[torch.Tensor]]


class _Ctx:
    """What a Function's forward and backward use of autograd's ``ctx``, for calling them outside autograd."""

    def __init__(self, needs_input_grad: Tuple[bool, ...] = ()):
        self.needs_input_grad = needs_input_grad
        self.saved_tensors: Tuple[torch.Tensor, ...] = ()

    def save_for_backward(self, *tensors: torch.Tensor) -> None:
        self.saved_tensors = tensors

    def mark_non_differentiable(self, *tensors: torch.Tensor) -> None:
        pass


def _randn(shape, device: torch.device, dtype: torch.dtype, seed: int, scale: float = 1.0, shift: float = 0.0
           ) -> torch.Tensor:
    """Normal values from a private generator (the user's RNG stream untouched), made on the CPU, then moved."""
    gen = torch.Generator().manual_seed(seed)
    return (torch.randn(shape, generator=gen) * scale + shift).to(device=device, dtype=dtype)


_TABLES: Dict[Tuple[str, int], Tuple[tuple, tuple, tuple]] = {}


def _fewbit_args(name: str, bits: int):
    """(params, borders, levels) as the pass writes them into the graph."""
    if (name, bits) not in _TABLES:
        act = get_activation(name)
        params = act.params({})
        if act.exact:
            _TABLES[name, bits] = params, (), tuple(act.mask_levels(dict(params)))
        else:
            borders, levels = fewbit_table(name, bits, params=dict(params))
            _TABLES[name, bits] = params, tuple(borders.tolist()), tuple(levels.tolist())
    return _TABLES[name, bits]


def probe_fewbit(device: torch.device, dtype: torch.dtype) -> Outputs:
    """Few-bit forward and backward of a table op (GELU, 3 bits) and of two masks (ReLU, LeakyReLU)."""
    out: Outputs = {}
    x = _randn((2, 3, 5, 7), device, dtype, 1, scale=3.0)
    x.view(-1)[:4] = 0.0  # on a mask's bound
    grad = _randn(x.shape, device, dtype, 2)
    for name, bits in (("gelu", 3), ("relu", 1), ("leaky_relu", 1)):
        params, borders, levels = _fewbit_args(name, bits)
        ctx = _Ctx()
        out[f"{name} output"] = _FewBit.forward(ctx, x, name, params, bits, borders, levels, "probe")
        out[f"{name} codes"] = ctx.saved_tensors[0]
        out[f"{name} input gradient"] = _FewBit.backward(ctx, grad)[0]
    return out


def _chain(device: torch.device, dtype: torch.dtype, residual: bool):
    """One BN chain's forward (``BNActStash``): (ctx, outputs, output gradient); bin means on, 4 bits."""
    x = _randn((2, 3, 16, 16), device, dtype, 3, scale=2.0, shift=0.3)
    x.view(-1)[3] = 40.0  # past the window: clipped, or followed where K reaches out
    gen = torch.Generator().manual_seed(4)
    weight = (torch.rand(3, generator=gen) + 0.5).to(device)
    bias = (torch.randn(3, generator=gen) * 0.5).to(device)
    r = _randn(x.shape, device, dtype, 5).relu() if residual else None
    ctx = _Ctx()
    outs = BNActStash.forward(ctx, x, weight, bias, None, None, None, r, 0.1, 1e-5, "relu", (), 4, residual, "probe",
                              means=True)
    return ctx, outs, _randn(x.shape, device, dtype, 6)


def probe_chain(device: torch.device, dtype: torch.dtype) -> Outputs:
    """A BN -> ReLU chain and a BN -> add -> ReLU chain (the x̂ code with its bin sums and side ends, the z code: every
    output and saved tensor), the consumers' rebuild of act(z) and of the mask from a z code, and x̂ rebuilt from
    codes on split rows and on a code book."""
    out: Outputs = {}
    for residual in (False, True):
        ctx, (y, y_codes, mask_packed, affine, zero_code), _ = _chain(device, dtype, residual)
        tag = "residual chain" if residual else "chain"
        out.update({f"{tag} output": y, f"{tag} z code": y_codes, f"{tag} mask": mask_packed, f"{tag} z rows": affine,
                    f"{tag} zero code": zero_code})
        out.update({f"{tag} saved tensor {i}": t for i, t in enumerate(ctx.saved_tensors)})
        out[f"{tag} act(z)"] = _Stash.rebuild(y_codes, mask_packed, affine, zero_code, ctx.bits, ctx.shape, "relu", ())
        out[f"{tag} exact mask"] = exact_mask(mask_packed, y_codes, zero_code, ctx.bits, ctx.shape)
    gen = torch.Generator().manual_seed(14)
    codes = torch.randint(0, 16, (2, 3, 5, 7), dtype=torch.uint8, generator=gen).to(device)
    mask = (torch.rand(codes.shape, generator=gen) > 0.5).to(device)
    rows = torch.stack([torch.randn(3, generator=gen), torch.rand(3, generator=gen) * 0.4,
                        torch.randn(3, generator=gen), torch.rand(3, generator=gen) * 0.2]).to(device)
    book = torch.randn(3, 2, 16, generator=gen).to(device)
    out["x̂ from rows"], out["x̂ from a book"] = _from_codes(codes, mask, rows), _from_codes(codes, mask, book)
    return out


def probe_bn(device: torch.device, dtype: torch.dtype) -> Outputs:
    """The BN backward from the x̂ code: with the ReLU's backward fused in (a chain without residual), and after it
    (a residual chain); the forward on the plain path, so only the backward is compared."""
    out: Outputs = {}
    for residual in (False, True):
        with verify.probe_as("torch"):
            ctx, outs, grad_y = _chain(device, dtype, residual)
        grads = BNActStash.backward(ctx, grad_y, *(None,) * (len(outs) - 1))
        tag = "residual chain" if residual else "chain"
        out.update({f"{tag} input gradient": grads[0], f"{tag} weight gradient": grads[1],
                    f"{tag} bias gradient": grads[2], f"{tag} residual gradient": grads[6]})
    return out


BN_CLOSE = tuple(f"{tag} {name} gradient" for tag in ("chain", "residual chain")
                 for name in ("input", "weight", "bias"))


def probe_pool(device: torch.device, dtype: torch.dtype) -> Outputs:
    """Max-pool window offsets (3x3, stride 2, padding 1), the indices rebuilt from them and the scattered gradient."""
    x = _randn((2, 3, 9, 11), device, dtype, 7)
    pooled, indices = F.max_pool2d(x, 3, 2, 1, return_indices=True)
    packed, meta = pool_offsets(x.shape, pooled, indices, 3, 2, 1, 1)
    grad = _randn(pooled.shape, device, dtype, 8)
    return {"offsets": packed, "indices": pool_indices(packed, meta, device),
            "input gradient": pool_backward(grad, packed, meta)}


def probe_mask(device: torch.device, dtype: torch.dtype) -> Outputs:
    """1-bit masks: packed and unpacked (an odd size, a transposed mask), and ``where``'s forward and backward."""
    out: Outputs = {}
    v = _randn((37, 6), device, dtype, 9)
    for name, mask in (("mask", v > 0), ("transposed mask", (v > 0.5).t())):
        packed = generic._pack_mask(mask)
        out[f"{name} packed"] = packed
        out[f"{name} unpacked"] = generic._unpack_mask(packed, mask.shape)
    cond = (_randn((1, 6), device, torch.float32, 10) > 0).expand(37, 6)
    ctx = _Ctx((False, True, True))
    out["where"] = generic.Where1Bit.forward(ctx, cond, v, -v)
    out["where a gradient"], out["where b gradient"] = generic.Where1Bit.backward(ctx, v * 0.5)[1:]
    return out


def probe_generic(device: torch.device, dtype: torch.dtype) -> Outputs:
    """The generic stash's group codes (a tail group, a transposed input; rounded and stochastic) and rebuild."""
    out: Outputs = {}
    gen = generic._generator(device)  # stochastic rounding's private generator: restored, both paths draw alike
    for name, x, stochastic in (("rows", _randn((5, 61), device, dtype, 11), False),
                                ("transposed", _randn((9, 40), device, dtype, 12).t(), False),
                                ("stochastic", _randn((5, 61), device, dtype, 13), True)):
        state = gen.get_state() if gen is not None else None
        try:
            packed, params = generic.group_quantize(x, 4, 64, stochastic)
        finally:
            if gen is not None:
                gen.set_state(state)
        out.update({f"{name} codes": packed, f"{name} groups": params,
                    f"{name} rebuilt": generic.group_dequantize(packed, params, 4, 64, x)})
    return out


verify.register(verify.FEWBIT, "few-bit backward (encode + pack, unpack + scale)", probe_fewbit)
verify.register("chain", "the BN chains' codes (x̂ and z codes, their rebuilds and masks)", probe_chain)
verify.register("bn", "the BatchNorm backward from the x̂ code", probe_bn, close=BN_CLOSE)
verify.register("pool", "max-pool window offsets", probe_pool)
verify.register("mask", "1-bit masks (dropout, where)", probe_mask)
verify.register("generic", "the generic stash's group codes", probe_generic)
