"""bitsandbytes 4-bit base projections of one input (q/k/v, gate/up, or one alone) as one dequantised weight and one
GEMM, for the fused LoRA path of a QLoRA model.

Per projection and step, bitsandbytes' own ``Linear4bit`` forward goes through its module checks, ``matmul_4bit`` and
an autograd Function, dequantises the weight and runs a GEMM, and its backward dequantises again for another. The
GPU work is small next to a step's GEMMs, but a QLoRA step at 4096 tokens is host-bound (benchmarks/NOTES.md), and
that Python runs 7 times per layer each way. Here a group's weights are dequantised, by bitsandbytes' own
``dequantize_4bit``, into one [ΣN, K] buffer in the compute dtype and multiplied in one GEMM; backward dequantises
them again (as bitsandbytes does: the 4-bit weights stay the only copy kept) for one GEMM per projection. The
outputs are column slices of the one [M, ΣN] product. Arithmetic is bitsandbytes': the same dequantised bf16 weight
and a cuBLAS GEMM with fp32 accumulation. No Triton kernel and no ``fuselm::`` op: the arguments are bitsandbytes
modules, and every piece of work is bitsandbytes' or cuBLAS's.

Taken only where bitsandbytes' forward would do exactly this: a ``Linear4bit`` with its quantisation state, no bias,
no hook, compute dtype x's, and more than one row or a gradient wanted (bitsandbytes' single-row inference runs
its fused GEMV kernel instead), not packed for its CPU kernels.
"""

from __future__ import annotations

import torch
from torch import Tensor, nn

from fuselm.ops._common import as_rows


def _dequantize(layer: nn.Module, out: Tensor) -> None:
    """``layer``'s 4-bit weight [N, K] into ``out`` (bitsandbytes' own dequantisation; its CPU backend has no
    ``out=`` variant, so there the weight is dequantised, then copied)."""
    from bitsandbytes.functional import dequantize_4bit

    if out.is_cuda:
        dequantize_4bit(layer.weight, layer.weight.quant_state, out=out)
    else:
        out.copy_(dequantize_4bit(layer.weight, layer.weight.quant_state))


def _dequantized(layers: list[nn.Module], dtype: torch.dtype, device: torch.device) -> tuple[Tensor, list[int]]:
    """The layers' weights stacked [ΣN, K] in ``dtype``, and each layer's N."""
    widths = [layer.out_features for layer in layers]
    weight = torch.empty((sum(widths), layers[0].in_features), dtype=dtype, device=device)
    for layer, rows in zip(layers, weight.split(widths)):
        _dequantize(layer, rows)
    return weight, widths


class _Nf4Group(torch.autograd.Function):
    """x [..., K] -> per layer x W_iᵀ [..., N_i]: one GEMM forward, one per projection backward (dx only)."""

    @staticmethod
    def forward(ctx, x: Tensor, *layers: nn.Module):
        rows = as_rows(x)
        weight, widths = _dequantized(list(layers), x.dtype, x.device)
        out = rows @ weight.t()
        ctx.layers, ctx.x_shape, ctx.dtype, ctx.device = layers, x.shape, x.dtype, x.device
        return tuple(part.view(*x.shape[:-1], width) for part, width in zip(out.split(widths, dim=1), widths))

    @staticmethod
    def backward(ctx, *grads: Tensor | None):
        nothing = (None,) * len(ctx.layers)
        if not ctx.needs_input_grad[0] or all(dy is None for dy in grads):
            return None, *nothing
        weight, widths = _dequantized(list(ctx.layers), ctx.dtype, ctx.device)
        dx = None
        for dy, part in zip(grads, weight.split(widths)):
            if dy is not None:
                dx = as_rows(dy) @ part if dx is None else dx.addmm_(as_rows(dy), part)
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
            and (x.numel() != x.shape[-1] or (torch.is_grad_enabled() and x.requires_grad)))


def nf4_group_outputs(layers: list[nn.Module], x: Tensor) -> list[Tensor]:
    """``[layer(x) for layer in layers]`` for bitsandbytes 4-bit layers that :func:`takes_nf4_group` accepts:
    one dequantised [ΣN, K] weight and one GEMM."""
    return list(_Nf4Group.apply(x, *layers))
