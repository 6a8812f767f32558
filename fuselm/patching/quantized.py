"""bitsandbytes 4-bit base projections of one input (q/k/v, gate/up, or one alone) in one autograd node, for the
fused LoRA path of a QLoRA model.

Per projection and step, bitsandbytes' own ``Linear4bit`` forward goes through its module checks, ``matmul_4bit`` and
an autograd Function, dequantises the weight and runs a GEMM, and its backward dequantises again for another. The
GPU work is small next to a step's GEMMs, but a QLoRA step at 4096 tokens is host-bound (benchmarks/NOTES.md), and
that Python runs 7 times per layer each way. Here one Function serves a group. Forward runs each projection as
bitsandbytes' forward does: from 0.50 on, its ``gemm_4bit`` op (on CUDA a fused 4-bit kernel at small M, dequantise
and GEMM above); before, its dequantisation kernel to the compute dtype and one GEMM. Backward dequantises the weights
again (as bitsandbytes does: the 4-bit weights stay the only copy kept) and accumulates dx in place, one GEMM per
projection. Arithmetic is bitsandbytes': the same kernels, the same dequantised bf16 weight and a cuBLAS GEMM with
fp32 accumulation. The double-quantised block scales are dequantised once per weight and kept (fp32, one per 64 weights:
0.44 GB for Llama-3-8B's layers), where bitsandbytes redoes them on every call. No Triton kernel and no ``fuselm::``
op: the arguments are bitsandbytes modules, and every piece of work is bitsandbytes' or cuBLAS's.

The weights are not dequantised into one stacked buffer for a single GEMM: bitsandbytes 0.49's ``out=`` variant on
CUDA rejects every ``out`` (its shape check compares a ``torch.Size`` with a list), and stacking by a copy costs more
HBM traffic than the two or three GEMMs it would merge.

Taken only where bitsandbytes' forward would do exactly this: a ``Linear4bit`` with its quantisation state, no bias,
no hook, compute dtype x's, and more than one row or a gradient wanted (bitsandbytes' single-row inference runs
its fused GEMV kernel instead), not packed for its CPU kernels, and (from 0.50) double-quantised scales only in the
blocks of 256 that its ``gemm_4bit`` takes.
"""

from __future__ import annotations

import torch
from torch import Tensor, nn
from torch.utils.weak import WeakIdKeyDictionary

from fuselm.ops._common import as_rows

_NESTED_ABSMAX = WeakIdKeyDictionary()  # weight -> (its absmax, version, fp32)


def _absmax(weight: Tensor) -> Tensor:
    """The fp32 block scales [N·K / blocksize] of a 4-bit weight. Under double quantisation they are themselves
    8-bit; bitsandbytes dequantises them on every call (two more launches and their Python), while the base is frozen,
    so here they are dequantised once, the same way, and kept until the weight or its quantised scales change."""
    from bitsandbytes.functional import dequantize_blockwise

    state = weight.quant_state
    if not state.nested:
        return state.absmax
    if state.absmax.is_inference():  # quantised under inference_mode: no version counter to tell a change by
        return (dequantize_blockwise(state.absmax, state.state2) + state.offset).float()
    source, version, absmax = _NESTED_ABSMAX.get(weight, (None, None, None))
    if source is not state.absmax or version != state.absmax._version:
        absmax = (dequantize_blockwise(state.absmax, state.state2) + state.offset).float()
        _NESTED_ABSMAX[weight] = (state.absmax, state.absmax._version, absmax)
    return absmax


def _dequantized(layer: nn.Module) -> Tensor:
    """``layer``'s 4-bit weight as [N, K] in its compute dtype: bitsandbytes' own dequantisation kernel (what its
    ``dequantize_4bit`` runs), given the scales of :func:`_absmax`."""
    weight = layer.weight
    state = weight.quant_state
    out = torch.ops.bitsandbytes.dequantize_4bit.default(weight, _absmax(weight), state.blocksize, state.quant_type,
                                                         state.shape, state.dtype)
    return out.t() if weight.shape[0] == 1 else out  # bitsandbytes' packed-transposed layout


def _has_gemm_4bit() -> bool:
    """Whether bitsandbytes' forward runs its ``gemm_4bit`` op (0.50 and later) rather than dequantise + GEMM."""
    return hasattr(torch.ops.bitsandbytes, "gemm_4bit")


def _gemm_4bit(x: Tensor, layer: nn.Module) -> Tensor:
    """x [..., K] -> x Wᵀ [..., N] through bitsandbytes' ``gemm_4bit`` op, called as its ``matmul_4bit`` calls it
    (the nested scales dequantised in the op; :func:`takes_nf4_group` checks that bitsandbytes supports them)."""
    weight = layer.weight
    state = weight.quant_state
    packed = weight.view(-1, 1)
    if not state.nested:
        return torch.ops.bitsandbytes.gemm_4bit.default(x, packed, state.shape, state.absmax, state.blocksize,
                                                        state.quant_type)
    return torch.ops.bitsandbytes.gemm_4bit.default(x, packed, state.shape, state.state2.absmax, state.blocksize,
                                                    state.quant_type, absmax_8bit=state.absmax,
                                                    absmax_code=state.state2.code, absmax_offset=state.offset)


class _Nf4Group(torch.autograd.Function):
    """x [..., K] -> per layer x W_iᵀ [..., N_i]: one GEMM per projection each way (dx only; the base is frozen)."""

    @staticmethod
    def forward(ctx, x: Tensor, *layers: nn.Module):
        ctx.layers, ctx.x_shape = layers, x.shape
        if _has_gemm_4bit() and x.numel():
            return tuple(_gemm_4bit(x, layer) for layer in layers)
        rows = as_rows(x)
        return tuple((rows @ _dequantized(layer).t()).view(*x.shape[:-1], layer.out_features) for layer in layers)

    @staticmethod
    def backward(ctx, *grads: Tensor | None):
        nothing = (None,) * len(ctx.layers)
        if not ctx.needs_input_grad[0] or all(dy is None for dy in grads):
            return None, *nothing
        dx = None
        for dy, layer in zip(grads, ctx.layers):
            if dy is not None:
                weight = _dequantized(layer)
                dx = as_rows(dy) @ weight if dx is None else dx.addmm_(as_rows(dy), weight)
        return dx.view(ctx.x_shape), *nothing


def takes_nf4_group(layer: nn.Module, x: Tensor) -> bool:
    """Whether ``layer``'s call on x may run in :func:`nf4_group_outputs` (module docstring; the caller checks for
    hooks)."""
    if type(layer).__name__ != "Linear4bit" or not type(layer).__module__.startswith("bitsandbytes"):
        return False
    state = getattr(layer.weight, "quant_state", None)
    return (state is not None and layer.bias is None
            and getattr(layer, "compute_dtype", None) in (None, x.dtype) and state.dtype == x.dtype
            and not getattr(state, "packing_format_for_cpu", False)
            and not (state.nested and _has_gemm_4bit() and state.state2.blocksize != 256)  # bitsandbytes refuses those
            and (x.numel() != x.shape[-1] or (torch.is_grad_enabled() and x.requires_grad)))


def nf4_group_outputs(layers: list[nn.Module], x: Tensor) -> list[Tensor]:
    """``[layer(x) for layer in layers]`` for bitsandbytes 4-bit layers that :func:`takes_nf4_group` accepts, in one
    autograd node."""
    return list(_Nf4Group.apply(x, *layers))
