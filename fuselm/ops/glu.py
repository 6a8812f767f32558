"""Gated MLP activations: SwiGLU (``silu(gate) * up``) and GeGLU (``gelu_tanh(gate) * up``).

Triton kernels, PyTorch reference and ``fuselm::`` registration. Two layouts:

- split: ``gate`` and ``up`` are two [..., I] tensors (Llama, Mistral, Qwen, Gemma);
- packed: one [..., 2*I] tensor, gate half first (Phi-3's ``gate_up_proj`` output). Its backward
  writes the gradient of the packed tensor as one [..., 2*I] buffer.

Both paths compute in fp32 (fp64 for fp64 input, reference only) and round once, to the input
dtype: the kernels are pure streaming, the reference upcasts. (HF's eager MLP computes in the input
dtype and rounds twice, after the activation and after the product.) ``gelu_tanh`` is
``F.gelu(x, approximate="tanh")`` (HF's ``gelu_pytorch_tanh``), computed through the identity
``0.5 * (1 + tanh(u)) = sigmoid(2 * u)``.
"""

from __future__ import annotations

import functools

import torch
import torch.nn.functional as F
from torch import Tensor

from fuselm.backend import runs_triton
from fuselm.ops._common import (
    FusedOp,
    as_rows,
    autotune,
    check_same,
    check_tensor,
    is_dtensor,
    new_output,
    on_local_shards,
)
from fuselm.ops._triton import tl, triton

ACTIVATIONS = ("silu", "gelu_tanh")
# In kernels a tensor comes first in products with these: triton 3.9's interpreter wraps `constexpr * tensor`
# into a constexpr, which later ops cannot take.
_SQRT_2_OVER_PI = tl.constexpr(0.7978845608028654)
_GELU_CUBIC = tl.constexpr(0.044715)


# ----------------------------------------------------------------------------------- reference
def _in_fp32(activation, gate: Tensor, up: Tensor) -> Tensor:
    work = torch.promote_types(gate.dtype, torch.float32)
    return (activation(gate.to(work)) * up.to(work)).to(gate.dtype)


def silu_mul_reference(gate: Tensor, up: Tensor) -> Tensor:
    """Plain PyTorch SwiGLU: ``silu(gate) * up`` in fp32 (fp64 for fp64), in gate's dtype. gate, up: [..., I]."""
    return _in_fp32(F.silu, gate, up)


def gelu_tanh_mul_reference(gate: Tensor, up: Tensor) -> Tensor:
    """Plain PyTorch GeGLU: ``gelu(gate, approximate="tanh") * up`` in fp32 (fp64 for fp64), in gate's dtype."""
    return _in_fp32(functools.partial(F.gelu, approximate="tanh"), gate, up)


_REFERENCES = {"silu": silu_mul_reference, "gelu_tanh": gelu_tanh_mul_reference}


# ----------------------------------------------------------------------------------- kernels
_CONFIGS = [
    triton.Config({"BLOCK": block}, num_warps=warps)
    for block, warps in [(2048, 4), (1024, 4), (2048, 8), (4096, 8), (4096, 16)]
]


@triton.jit
def _activation(g, ACTIVATION: tl.constexpr):
    """(act(g), sigmoid term s) in fp32, with act(g) = g * s for both activations."""
    if ACTIVATION == "silu":
        s = tl.sigmoid(g)
    else:
        s = tl.sigmoid(g * (2.0 * _SQRT_2_OVER_PI) * (1.0 + g * g * _GELU_CUBIC))
    return g * s, s


@triton.jit
def _activation_grad(g, s, ACTIVATION: tl.constexpr):
    """d act / d g in fp32, given s from :func:`_activation`."""
    if ACTIVATION == "silu":
        return s * (1.0 + g * (1.0 - s))
    return s + g * s * (1.0 - s) * (2.0 * _SQRT_2_OVER_PI) * (1.0 + g * g * (3.0 * _GELU_CUBIC))


@triton.jit
def _program_block(n_cols, BLOCK: tl.constexpr):
    """(row, first column, column offsets, mask) of the BLOCK columns this program owns."""
    program = tl.program_id(0)
    blocks_per_row = tl.cdiv(n_cols, BLOCK)
    start = (program % blocks_per_row).to(tl.int64) * BLOCK
    cols = tl.arange(0, BLOCK)
    return (program // blocks_per_row).to(tl.int64), start, cols, cols < n_cols - start


@autotune(_CONFIGS, key=["numel_bucket", "row_len"])
@triton.jit
def _glu_fwd_kernel(
    gate_ptr, up_ptr, out_ptr,
    n_cols, stride_gate, stride_up, stride_out,
    numel_bucket, row_len,  # autotune key only: next_pow2(numel), and the row length (0 when flat)
    ACTIVATION: tl.constexpr, BLOCK: tl.constexpr,
):
    # Program owns BLOCK consecutive columns of one row; when every tensor is contiguous the
    # launcher passes the whole tensor as one row. Reads BLOCK of gate and up, writes BLOCK of out:
    # 3 * BLOCK * element_size bytes, each byte of each tensor touched by exactly one program.
    row, start, cols, mask = _program_block(n_cols, BLOCK)
    g = tl.load(gate_ptr + (row * stride_gate + start) + cols, mask=mask, other=0.0).to(tl.float32)
    u = tl.load(up_ptr + (row * stride_up + start) + cols, mask=mask, other=0.0).to(tl.float32)
    act, _ = _activation(g, ACTIVATION)
    tl.store(out_ptr + (row * stride_out + start) + cols, (act * u).to(out_ptr.dtype.element_ty), mask=mask)


@autotune(_CONFIGS, key=["numel_bucket", "row_len"])
@triton.jit
def _glu_bwd_kernel(
    dout_ptr, gate_ptr, up_ptr, dgate_ptr, dup_ptr,
    n_cols, stride_dout, stride_gate, stride_up, stride_dgate, stride_dup,
    numel_bucket, row_len,  # autotune key only, as in the forward kernel
    ACTIVATION: tl.constexpr, BLOCK: tl.constexpr,
):
    # Program owns BLOCK consecutive columns of one row (or of the flat tensor). Reads BLOCK of
    # dout, gate and up; recomputes act(gate); writes BLOCK of dgate and dup (for the packed layout
    # these are the two halves of one gradient buffer): 5 * BLOCK * element_size bytes.
    row, start, cols, mask = _program_block(n_cols, BLOCK)
    dout = tl.load(dout_ptr + (row * stride_dout + start) + cols, mask=mask, other=0.0).to(tl.float32)
    g = tl.load(gate_ptr + (row * stride_gate + start) + cols, mask=mask, other=0.0).to(tl.float32)
    u = tl.load(up_ptr + (row * stride_up + start) + cols, mask=mask, other=0.0).to(tl.float32)
    act, s = _activation(g, ACTIVATION)
    dgate = dout * u * _activation_grad(g, s, ACTIVATION)
    tl.store(dgate_ptr + (row * stride_dgate + start) + cols, dgate.to(dgate_ptr.dtype.element_ty), mask=mask)
    tl.store(dup_ptr + (row * stride_dup + start) + cols, (dout * act).to(dup_ptr.dtype.element_ty), mask=mask)


# ----------------------------------------------------------------------------------- launchers
def _launch(kernel, inputs: list[Tensor], outputs: list[Tensor], activation: str) -> None:
    """Runs ``kernel`` over same-shape [..., I] tensors: ``inputs`` then ``outputs`` (output views
    must already be 2-D-viewable with unit column stride, which :func:`new_output` and halves of it are)."""
    if activation not in ACTIVATIONS:
        raise ValueError(f"activation must be one of {ACTIVATIONS}, got {activation!r}")
    tensors = inputs + outputs
    numel = tensors[0].numel()
    if numel == 0:
        return
    if all(t.is_contiguous() for t in tensors):  # one long row: no per-row offsets, no ragged row ends
        n_rows, n_cols, strides, row_len = 1, numel, [numel] * len(tensors), 0
    else:
        tensors = [as_rows(t) for t in tensors]
        n_rows, n_cols = tensors[0].shape
        strides, row_len = [t.stride(0) for t in tensors], n_cols
    grid = lambda meta: (n_rows * triton.cdiv(n_cols, meta["BLOCK"]),)  # noqa: E731
    kernel[grid](*tensors, n_cols, *strides, triton.next_power_of_2(numel), row_len, ACTIVATION=activation)


def _glu_forward(gate: Tensor, up: Tensor, activation: str) -> Tensor:
    out = new_output(gate.shape, gate.dtype, gate.device)
    _launch(_glu_fwd_kernel, [gate, up], [out], activation)
    return out


def _glu_backward(dout: Tensor, gate: Tensor, up: Tensor, activation: str) -> tuple[Tensor, Tensor]:
    dgate = new_output(gate.shape, gate.dtype, gate.device)
    dup = new_output(up.shape, up.dtype, up.device)
    _launch(_glu_bwd_kernel, [dout, gate, up], [dgate, dup], activation)
    return dgate, dup


def _halves(packed: Tensor) -> tuple[Tensor, Tensor]:
    """The gate and up halves of a packed [..., 2*I] tensor, as views."""
    half = packed.shape[-1] // 2
    return packed[..., :half], packed[..., half:]


def _glu_packed_backward(dout: Tensor, gate_up: Tensor, activation: str) -> Tensor:
    """d(gate_up) [..., 2*I]: the kernel writes dgate and dup into the two halves of one buffer."""
    dgate_up = new_output(gate_up.shape, gate_up.dtype, gate_up.device)
    _launch(_glu_bwd_kernel, [dout, *_halves(gate_up)], list(_halves(dgate_up)), activation)
    return dgate_up


# ----------------------------------------------------------------------------------- registration
def _glu_impl(gate: Tensor, up: Tensor, activation: str) -> Tensor:
    return _glu_forward(gate, up, activation)


def _glu_packed_impl(gate_up: Tensor, activation: str) -> Tensor:
    return _glu_forward(*_halves(gate_up), activation)


def _glu_backward_impl(dout: Tensor, gate: Tensor, up: Tensor, activation: str) -> tuple[Tensor, Tensor]:
    return _glu_backward(dout, gate, up, activation)


def _glu_packed_backward_impl(dout: Tensor, gate_up: Tensor, activation: str) -> Tensor:
    return _glu_packed_backward(dout, gate_up, activation)


def _glu_fake(gate, up, activation):
    return gate.new_empty(gate.shape)


def _glu_packed_fake(gate_up, activation):
    return gate_up.new_empty((*gate_up.shape[:-1], gate_up.shape[-1] // 2))


def _glu_backward_fake(dout, gate, up, activation):
    return gate.new_empty(gate.shape), up.new_empty(up.shape)


def _glu_packed_backward_fake(dout, gate_up, activation):
    return gate_up.new_empty(gate_up.shape)


def _setup_glu(ctx, inputs, output):
    gate, up, activation = inputs
    ctx.save_for_backward(gate, up)
    ctx.activation = activation


def _backward_glu(ctx, dout):
    gate, up = ctx.saved_tensors
    dgate, dup = GLU_BACKWARD(dout, gate, up, ctx.activation)
    return dgate, dup, None


def _setup_glu_packed(ctx, inputs, output):
    gate_up, activation = inputs
    ctx.save_for_backward(gate_up)
    ctx.activation = activation


def _backward_glu_packed(ctx, dout):
    (gate_up,) = ctx.saved_tensors
    return GLU_PACKED_BACKWARD(dout, gate_up, ctx.activation), None


GLU_BACKWARD = FusedOp("glu_backward", _glu_backward_impl, fake=_glu_backward_fake)
GLU_PACKED_BACKWARD = FusedOp("glu_packed_backward", _glu_packed_backward_impl, fake=_glu_packed_backward_fake)
GLU = FusedOp("glu", _glu_impl, fake=_glu_fake, setup_context=_setup_glu, backward=_backward_glu)
GLU_PACKED = FusedOp("glu_packed", _glu_packed_impl, fake=_glu_packed_fake, setup_context=_setup_glu_packed,
                     backward=_backward_glu_packed)


# ----------------------------------------------------------------------------------- public API
def _gated(activation: str, gate: Tensor, up: Tensor | None) -> Tensor:
    if is_dtensor(gate) or is_dtensor(up):
        return on_local_shards(functools.partial(_gated, activation), "gate", {"gate": gate, "up": up})
    check_tensor("gate", gate)
    if up is None:
        if gate.shape[-1] % 2:
            raise ValueError(
                f"gate (packed gate_up, up=None) must have an even last dimension, got shape {tuple(gate.shape)}"
            )
        if runs_triton(gate):
            return GLU_PACKED(gate, activation)
        return _REFERENCES[activation](*_halves(gate))
    check_tensor("up", up)
    if up.shape != gate.shape:
        raise ValueError(f"up has shape {tuple(up.shape)} but gate has shape {tuple(gate.shape)}")
    check_same("gate", gate, up=up)
    if runs_triton(gate):
        return GLU(gate, up, activation)
    return _REFERENCES[activation](gate, up)


def silu_mul(gate: Tensor, up: Tensor | None = None) -> Tensor:
    """SwiGLU: ``silu(gate) * up``, math in fp32 on both paths, rounded once to gate's dtype.

    Args:
        gate: [..., I] (any leading shape and strides), fp32/fp16/bf16 (any float dtype on the
            reference path). With ``up=None``: one packed [..., 2*I] tensor, gate half first.
        up: [..., I], same shape, dtype and device as gate; or None for the packed form.
        DTensors (gate and up placed alike, sharded on any dimension but the last, or replicated) run on the
        local shards and return a DTensor placed as gate.

    Returns:
        [..., I] in gate's dtype.
    """
    return _gated("silu", gate, up)


def gelu_tanh_mul(gate: Tensor, up: Tensor | None = None) -> Tensor:
    """GeGLU: ``gelu(gate, approximate="tanh") * up`` (HF's ``gelu_pytorch_tanh``), math in fp32 on both
    paths, rounded once to gate's dtype.

    Args and returns as :func:`silu_mul`.
    """
    return _gated("gelu_tanh", gate, up)
