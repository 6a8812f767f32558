"""Cross-entropy over a vocabulary, alone and fused with the LM head: Triton kernels, PyTorch
reference, ``fuselm::`` registration.

Per non-ignored token with (optionally soft-capped) logits z and lse = logsumexp(z):

    loss = (1 - eps) * (lse - z[label]) + eps * (lse - mean(z)) + z_loss * lse^2

which is ``F.cross_entropy(..., label_smoothing=eps)`` (what HF computes on fp32 logits) plus the
z-loss. Soft-capping (Gemma 2's ``final_logit_softcapping``) replaces z by ``cap * tanh(z / cap)``
first. Ignored tokens (label == ignore_index) contribute 0. ``reduction="mean"`` divides the sum by
the count of non-ignored tokens, or by ``num_items`` when given (HF's ``num_items_in_batch``).

:func:`linear_cross_entropy` never materialises the [N, V] logits: it walks the tokens in chunks of
``chunk_tokens`` rows. Per chunk, cuBLAS computes the logits into one reused buffer, two Triton kernels
turn each row into its loss and overwrite the buffer in place with d(loss)/d(logits) (rows split into
vocabulary segments when a chunk has too few rows to fill the GPU), and cuBLAS folds that into d
hidden (this chunk's rows) and d weight (accumulated over chunks). For "mean" and "sum" this happens
in the forward pass with a unit upstream gradient, and the backward only scales
the stored gradients by it (a 0-dim tensor). For "none" the upstream gradient differs per token and
d weight cannot be rescaled after the fact, so the forward computes only the losses and the backward
runs the chunk loop again with the per-token upstream gradients as the kernel's row scale.

Nothing here synchronises with the host (the mean's divisor stays a device tensor), so both ops
work under CUDA graphs and ``torch.compile``.
"""

from __future__ import annotations

import numbers

import torch
import torch.nn.functional as F
from torch import Tensor

from fuselm.backend import runs_triton
from fuselm.ops._common import (
    FusedOp,
    as_rows,
    check_not_dtensor,
    check_real,
    check_same,
    check_tensor,
    new_output,
    sm_count,
)
from fuselm.ops._triton import tl, triton

REDUCTIONS = ("mean", "sum", "none")
# Launch shape of the row kernels, from a sweep on the H200 (benchmarks/NOTES.md): 2048-column
# blocks on 4 warps, and rows split along the vocabulary until 16 programs per SM run.
MAX_BLOCK_V = 2048  # vocabulary columns a program holds at a time; wider rows loop
PROGRAMS_PER_SM = 16
# Default size of linear_cross_entropy's per-chunk logits buffer. Each chunk re-reads and re-writes
# the whole [V, H] weight gradient, so smaller chunks cost time: on an H200 with Llama-3's vocabulary,
# 64 MiB (256 tokens) took 1.39x the three GEMMs' time, 256 MiB (1024 tokens) 1.06x.
CHUNK_BYTES = 256 * 2**20


# ----------------------------------------------------------------------------------- reference
def _reference_rows(logits: Tensor, labels: Tensor, ignore_index: int, label_smoothing: float,
                    softcap: float | None, z_loss: float) -> tuple[Tensor, Tensor]:
    """Per-token losses [N] and logsumexp [N] of [N, V] logits, in fp32 (fp64 for fp64 input)."""
    z = logits.to(torch.promote_types(logits.dtype, torch.float32))
    if softcap is not None:
        z = softcap * torch.tanh(z / softcap)
    rows = F.cross_entropy(z, labels.long(), ignore_index=ignore_index, reduction="none",
                           label_smoothing=label_smoothing)
    lse = torch.logsumexp(z, dim=-1)
    if z_loss:
        rows = rows + torch.where(labels != ignore_index, z_loss * lse.square(), 0.0)
    return rows, lse


def cross_entropy_reference(logits: Tensor, labels: Tensor, *, ignore_index: int = -100, reduction: str = "mean",
                            label_smoothing: float = 0.0, softcap: float | None = None, z_loss: float = 0.0,
                            num_items: int | Tensor | None = None,
                            return_z_loss: bool = False) -> Tensor | tuple[Tensor, Tensor]:
    """Plain PyTorch cross-entropy (the fallback and the test oracle). Arguments as :func:`cross_entropy`."""
    _check_cross_entropy_args(logits, labels)
    ignore_index, label_smoothing, softcap, z_loss = _check_options(ignore_index, reduction, label_smoothing, softcap,
                                                                    z_loss, num_items)
    rows, lse = _reference_rows(logits.reshape(-1, logits.shape[-1]), labels.reshape(-1), ignore_index,
                                label_smoothing, softcap, z_loss)
    return _finish(rows, lse, labels, ignore_index, reduction, z_loss, num_items, return_z_loss)


def linear_cross_entropy_reference(hidden: Tensor, weight: Tensor, labels: Tensor, bias: Tensor | None = None, *,
                                   ignore_index: int = -100, reduction: str = "mean", label_smoothing: float = 0.0,
                                   softcap: float | None = None, z_loss: float = 0.0,
                                   num_items: int | Tensor | None = None, chunk_tokens: int | None = None,
                                   return_z_loss: bool = False) -> Tensor | tuple[Tensor, Tensor]:
    """Plain PyTorch ``cross_entropy(F.linear(hidden, weight, bias))``: materialises the logits in
    hidden's dtype, as HF does, then computes the loss in fp32. ``chunk_tokens`` is accepted and unused."""
    _check_linear_args(hidden, weight, labels, bias, chunk_tokens)
    return cross_entropy_reference(F.linear(hidden, weight, bias), labels, ignore_index=ignore_index,
                                   reduction=reduction, label_smoothing=label_smoothing, softcap=softcap,
                                   z_loss=z_loss, num_items=num_items, return_z_loss=return_z_loss)


# ----------------------------------------------------------------------------------- kernels
@triton.jit
def _softcap(z, cap):
    """(cap * tanh(z / cap), its derivative 1 - tanh^2) in fp32, to a few ulp for every z.

    |t| >= 1/4: tanh from e = exp(-2|t|) without cancellation; |t| < 1/4: its Taylor series, whose
    next term is below 1e-8 relative there. The derivative 4e / (1 + e)^2 has no cancellation at all.
    """
    t = z / cap
    e = tl.exp(-2.0 * tl.abs(t))
    t2 = t * t
    series = t * (1.0 + t2 * (-1.0 / 3 + t2 * (2.0 / 15 + t2 * (-17.0 / 315 + t2 * (62.0 / 2835)))))
    large = (1.0 - e) / (1.0 + e)
    tanh = tl.where(tl.abs(t) < 0.25, series, tl.where(t < 0, -large, large))
    return cap * tanh, 4.0 * e / ((1.0 + e) * (1.0 + e))


@triton.jit
def _segment_stats(row_ptr, start, end, softcap, HAS_SOFTCAP: tl.constexpr, HAS_SMOOTHING: tl.constexpr,
                   BLOCK_V: tl.constexpr):
    """One pass over logits[start:end] of a row: (max z, sum of exp(z - max), sum of z), fp32.

    Only the running max is reduced across the block at each step; the exp and z sums accumulate
    per lane and are reduced once at the end.
    """
    block = tl.arange(0, BLOCK_V)
    seg_max = tl.full((), float("-inf"), tl.float32)
    exp_sums = tl.zeros((BLOCK_V,), tl.float32)
    z_sums = tl.zeros((BLOCK_V,), tl.float32)
    for first in range(start, end, BLOCK_V):
        cols = first + block
        mask = cols < end
        z = tl.load(row_ptr + cols, mask=mask, other=0.0).to(tl.float32)
        if HAS_SOFTCAP:
            z, _ = _softcap(z, softcap)
        if HAS_SMOOTHING:
            z_sums += tl.where(mask, z, 0.0)
        z = tl.where(mask, z, float("-inf"))
        new_max = tl.maximum(seg_max, tl.max(z, axis=0))
        shift = tl.where(new_max == float("-inf"), 0.0, new_max)  # a block of only -inf logits: no NaN
        exp_sums = exp_sums * tl.exp(seg_max - shift) + tl.exp(z - shift)
        seg_max = new_max
    return seg_max, tl.sum(exp_sums, axis=0), tl.sum(z_sums, axis=0)


@triton.jit
def _store_segment_grad(src_ptr, dst_ptr, start, end, label, lse, scale, n_cols, label_smoothing, softcap, z_loss,
                        HAS_SOFTCAP: tl.constexpr, BLOCK_V: tl.constexpr):
    """dst[start:end] = scale * d(loss)/d(logits) for one row, recomputing softmax from src and lse.

    d/dz_j = p_j * (1 + 2 z_loss lse) - eps / V - (1 - eps) [j == label], times tanh's derivative
    when soft-capped. dst may be src (in place): each block is read before it is written.
    """
    block = tl.arange(0, BLOCK_V)
    for first in range(start, end, BLOCK_V):
        cols = first + block
        mask = cols < end
        z = tl.load(src_ptr + cols, mask=mask, other=0.0).to(tl.float32)
        if HAS_SOFTCAP:
            z, dcap = _softcap(z, softcap)
        dz = tl.exp(z - lse) * (1.0 + 2.0 * z_loss * lse) - label_smoothing / n_cols
        dz -= tl.where(cols == label, 1.0 - label_smoothing, 0.0)
        if HAS_SOFTCAP:
            dz *= dcap
        tl.store(dst_ptr + cols, (dz * scale).to(dst_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _row_scale(upstream, valid, in_range):
    """What a row's d(loss)/d(logits) is multiplied by: the upstream gradient; 0 for an ignored row; NaN
    for a bad label (outside [0, V), not ignore_index), so every gradient that row reaches shows it."""
    return tl.where(valid, tl.where(in_range, upstream, float("nan")), 0.0)


@triton.jit
def _cross_entropy_partials_kernel(
    logits_ptr, labels_ptr, partials_ptr, z_label_ptr,
    n_cols, segment_cols, stride_logits, softcap,
    HAS_SOFTCAP: tl.constexpr, HAS_SMOOTHING: tl.constexpr, BLOCK_V: tl.constexpr,
):
    # Program (row, segment) reads the row's logits [segment * segment_cols, + segment_cols) once
    # and writes three fp32 partials (max, exp sum, z sum) to partials[row, :, segment]; the
    # program whose segment holds the row's label also writes that (soft-capped) logit to z_label[row].
    row = tl.program_id(0).to(tl.int64)
    segment = tl.program_id(1)
    n_segments = tl.num_programs(1)
    start = segment.to(tl.int64) * segment_cols
    end = tl.minimum(start + segment_cols, n_cols)
    row_ptr = logits_ptr + row * stride_logits
    seg_max, exp_sum, z_sum = _segment_stats(row_ptr, start, end, softcap, HAS_SOFTCAP, HAS_SMOOTHING, BLOCK_V)
    partial = partials_ptr + row * 3 * n_segments + segment
    tl.store(partial, seg_max)
    tl.store(partial + n_segments, exp_sum)
    tl.store(partial + 2 * n_segments, z_sum)
    label = tl.load(labels_ptr + row).to(tl.int64)
    if (label >= start) & (label < end):
        z_label = tl.load(row_ptr + label).to(tl.float32)
        if HAS_SOFTCAP:
            z_label, _ = _softcap(z_label, softcap)
        tl.store(z_label_ptr + row, z_label)


@triton.jit
def _cross_entropy_finish_kernel(
    logits_ptr, labels_ptr, partials_ptr, z_label_ptr, loss_ptr, lse_ptr, scale_ptr,
    n_cols, n_segments, segment_cols, stride_logits, stride_scale, ignore_index, label_smoothing, softcap, z_loss,
    HAS_SOFTCAP: tl.constexpr, HAS_SCALE: tl.constexpr, WRITE_GRAD: tl.constexpr, BLOCK_V: tl.constexpr,
    BLOCK_SEGMENTS: tl.constexpr,
):
    # Program (row, segment) combines the row's n_segments partials (3 fp32 each) into lse; segment 0
    # writes the row's fp32 loss and lse. With WRITE_GRAD (one program per segment; else one per
    # row) it reads its segment of the logits again and overwrites it in place with
    # scale[row] * d(loss)/d(logits) (linear_cross_entropy's private chunk buffer, never user data).
    row = tl.program_id(0).to(tl.int64)
    segment = tl.program_id(1)
    segments = tl.arange(0, BLOCK_SEGMENTS)
    segment_ok = segments < n_segments
    partials = partials_ptr + row * 3 * n_segments + segments
    maxes = tl.load(partials, mask=segment_ok, other=float("-inf"))
    row_max = tl.max(maxes, axis=0)
    shift = tl.where(row_max == float("-inf"), 0.0, row_max)
    exp_sum = tl.sum(tl.load(partials + n_segments, mask=segment_ok, other=0.0) * tl.exp(maxes - shift), axis=0)
    lse = shift + tl.log(exp_sum)
    label = tl.load(labels_ptr + row).to(tl.int64)
    valid = label != ignore_index
    in_range = (label >= 0) & (label < n_cols)
    if segment == 0:
        tl.device_assert(in_range | ~valid, "cross_entropy: a label is outside [0, vocabulary size) and is not "
                                            "ignore_index")
        z_label = tl.load(z_label_ptr + row, mask=valid & in_range, other=0.0)
        z_sum = tl.sum(tl.load(partials + 2 * n_segments, mask=segment_ok, other=0.0), axis=0)
        # eps = 0 must not turn -inf logits (z_sum = -inf) into 0 * inf = NaN
        smoothing = tl.where(label_smoothing > 0, label_smoothing * (lse - z_sum / n_cols), 0.0)
        loss = (1.0 - label_smoothing) * (lse - z_label) + smoothing + z_loss * lse * lse
        loss = tl.where(valid, tl.where(in_range, loss, float("nan")), 0.0)  # a bad label shows as NaN
        tl.store(loss_ptr + row, loss)
        tl.store(lse_ptr + row, lse)
    if WRITE_GRAD:
        scale = 1.0
        if HAS_SCALE:
            scale = tl.load(scale_ptr + row * stride_scale)
        scale = _row_scale(scale, valid, in_range)
        start = segment.to(tl.int64) * segment_cols
        row_ptr = logits_ptr + row * stride_logits
        _store_segment_grad(row_ptr, row_ptr, start, tl.minimum(start + segment_cols, n_cols), label, lse, scale,
                            n_cols, label_smoothing, softcap, z_loss, HAS_SOFTCAP, BLOCK_V)


@triton.jit
def _cross_entropy_bwd_kernel(
    grad_ptr, logits_ptr, labels_ptr, lse_ptr, dlogits_ptr,
    n_cols, segment_cols, stride_grad, stride_logits, stride_dlogits, ignore_index, label_smoothing, softcap, z_loss,
    HAS_SOFTCAP: tl.constexpr, BLOCK_V: tl.constexpr,
):
    # Program (row, segment) reads the segment's logits once (plus the row's label, lse and upstream
    # gradient) and writes its dlogits once. Ignored rows get exact zeros whatever the upstream holds.
    row = tl.program_id(0).to(tl.int64)
    start = tl.program_id(1).to(tl.int64) * segment_cols
    label = tl.load(labels_ptr + row).to(tl.int64)
    lse = tl.load(lse_ptr + row)
    scale = _row_scale(tl.load(grad_ptr + row * stride_grad).to(tl.float32), label != ignore_index,
                       (label >= 0) & (label < n_cols))
    _store_segment_grad(logits_ptr + row * stride_logits, dlogits_ptr + row * stride_dlogits, start,
                        tl.minimum(start + segment_cols, n_cols), label, lse, scale, n_cols, label_smoothing, softcap,
                        z_loss, HAS_SOFTCAP, BLOCK_V)


SCALE_BLOCK = 2048


@triton.jit
def _scale_kernel(x_ptr, scale_ptr, n_elements, BLOCK: tl.constexpr):
    # Program owns BLOCK consecutive elements of x: reads and writes each once, x *= scale in fp32.
    offsets = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    mask = offsets < n_elements
    scale = tl.load(scale_ptr).to(tl.float32)
    x = tl.load(x_ptr + offsets, mask=mask).to(tl.float32)
    tl.store(x_ptr + offsets, (x * scale).to(x_ptr.dtype.element_ty), mask=mask)


# ----------------------------------------------------------------------------------- launchers
def _launch_config(n_cols: int) -> dict:
    return {"BLOCK_V": min(MAX_BLOCK_V, triton.next_power_of_2(n_cols)), "num_warps": 4}


def _segment_cols(n_rows: int, n_cols: int, block_v: int, device: torch.device) -> int:
    """Columns per program: whole rows when there are rows enough to fill the GPU, else rows split
    into segments of whole blocks until about PROGRAMS_PER_SM programs per SM run."""
    n_blocks = triton.cdiv(n_cols, block_v)
    segments = min(n_blocks, max(1, triton.cdiv(PROGRAMS_PER_SM * sm_count(device), n_rows)))
    return triton.cdiv(n_blocks, segments) * block_v


def _row_stride(t: Tensor) -> int:
    return 0 if t.dim() == 0 else t.stride(0)


def _cross_entropy_rows(logits: Tensor, labels: Tensor, ignore_index: int, label_smoothing: float,
                        softcap: float | None, z_loss: float, scale: Tensor | None = None, write_grad: bool = False,
                        out: tuple[Tensor, Tensor] | None = None) -> tuple[Tensor, Tensor]:
    """Per-row loss and lse (fp32 [N], into ``out`` when given) of [N, V] logits; with ``write_grad``,
    also overwrites the logits in place with ``scale * d(loss)/d(logits)`` (scale: 0-dim or [N]
    fp32; None for 1). Two launches: per-segment partial statistics, then their combination."""
    n_rows, n_cols = logits.shape
    if out is None:
        out = new_output((n_rows,), torch.float32, logits.device), new_output((n_rows,), torch.float32, logits.device)
    loss, lse = out
    if n_rows == 0:
        return loss, lse
    config = _launch_config(n_cols)
    segment_cols = _segment_cols(n_rows, n_cols, config["BLOCK_V"], logits.device)
    n_segments = triton.cdiv(n_cols, segment_cols)
    partials = new_output((n_rows, 3, n_segments), torch.float32, logits.device)
    z_label = new_output((n_rows,), torch.float32, logits.device)
    _cross_entropy_partials_kernel[(n_rows, n_segments)](
        logits, labels, partials, z_label, n_cols, segment_cols, logits.stride(0), softcap or 1.0,
        HAS_SOFTCAP=softcap is not None, HAS_SMOOTHING=label_smoothing > 0, **config,
    )
    _cross_entropy_finish_kernel[(n_rows, n_segments if write_grad else 1)](
        logits, labels, partials, z_label, loss, lse, scale if scale is not None else loss,
        n_cols, n_segments, segment_cols, logits.stride(0), _row_stride(scale) if scale is not None else 0,
        ignore_index, label_smoothing, softcap or 1.0, z_loss,
        HAS_SOFTCAP=softcap is not None, HAS_SCALE=scale is not None, WRITE_GRAD=write_grad,
        BLOCK_SEGMENTS=triton.next_power_of_2(n_segments), **config,
    )
    return loss, lse


def _cross_entropy_dlogits(grad: Tensor, logits: Tensor, labels: Tensor, lse: Tensor, ignore_index: int,
                           label_smoothing: float, softcap: float | None, z_loss: float) -> Tensor:
    n_rows, n_cols = logits.shape
    dlogits = new_output((n_rows, n_cols), logits.dtype, logits.device)
    if n_rows == 0:
        return dlogits
    config = _launch_config(n_cols)
    segment_cols = _segment_cols(n_rows, n_cols, config["BLOCK_V"], logits.device)
    _cross_entropy_bwd_kernel[(n_rows, triton.cdiv(n_cols, segment_cols))](
        grad, logits, labels, lse, dlogits,
        n_cols, segment_cols, _row_stride(grad), logits.stride(0), dlogits.stride(0),
        ignore_index, label_smoothing, softcap or 1.0, z_loss,
        HAS_SOFTCAP=softcap is not None, **config,
    )
    return dlogits


def default_chunk_tokens(vocab_size: int, dtype: torch.dtype) -> int:
    """Tokens per chunk so that one chunk's [chunk, V] logits take about 256 MiB (a power of two)."""
    fit = CHUNK_BYTES // (vocab_size * dtype.itemsize)
    return 1 << (fit.bit_length() - 1) if fit else 1


def _linear_cross_entropy_chunks(hidden: Tensor, weight: Tensor, bias: Tensor | None, labels: Tensor,
                                 scale: Tensor | None, ignore_index: int, label_smoothing: float,
                                 softcap: float | None, z_loss: float, chunk_tokens: int, grad_hidden: bool,
                                 grad_weight: bool, grad_bias: bool) -> tuple[Tensor, Tensor, Tensor, Tensor, Tensor]:
    """Per-row loss and lse (fp32 [N]) and, as asked, ``scale``-weighted gradients of their sum:
    d hidden [N, H] (hidden's dtype), d weight [V, H] (weight's dtype), d bias [V] (bias's dtype);
    an unrequested gradient is an empty [0] tensor.

    Per chunk of C tokens: one [C, V] logits GEMM into a reused buffer (C*V elements written), the
    kernel (reads them twice, writes them once in place), then the two gradient GEMMs read it.
    """
    n_rows, hidden_size = hidden.shape
    vocab_size = weight.shape[0]
    weight = as_rows(weight)  # odd strides: one copy here rather than one inside every chunk's GEMMs
    write_grad = grad_hidden or grad_weight or grad_bias
    loss = new_output((n_rows,), torch.float32, hidden.device)
    lse = new_output((n_rows,), torch.float32, hidden.device)
    dhidden = new_output((n_rows, hidden_size) if grad_hidden else (0,), hidden.dtype, hidden.device)
    # the first chunk's GEMM writes d weight (later ones accumulate): no zero-fill pass over [V, H]
    dweight = (new_output if n_rows else torch.zeros)((vocab_size, hidden_size) if grad_weight else (0,),
                                                      dtype=weight.dtype, device=weight.device)
    dbias = torch.zeros(vocab_size if grad_bias else 0, dtype=torch.float32, device=hidden.device)
    buffer = torch.empty(min(chunk_tokens, n_rows), vocab_size, dtype=hidden.dtype, device=hidden.device)
    for start in range(0, n_rows, chunk_tokens):
        end = min(start + chunk_tokens, n_rows)
        hidden_chunk, logits = hidden[start:end], buffer[: end - start]
        if bias is None:
            torch.mm(hidden_chunk, weight.t(), out=logits)
        else:
            torch.addmm(bias, hidden_chunk, weight.t(), out=logits)
        chunk_scale = scale[start:end] if scale is not None and scale.dim() == 1 else scale
        _cross_entropy_rows(logits, labels[start:end], ignore_index, label_smoothing, softcap, z_loss, chunk_scale,
                            write_grad, out=(loss[start:end], lse[start:end]))
        if grad_hidden:
            torch.mm(logits, weight, out=dhidden[start:end])
        if grad_weight and start == 0:
            torch.mm(logits.t(), hidden_chunk, out=dweight)
        elif grad_weight:
            dweight.addmm_(logits.t(), hidden_chunk)
        if grad_bias:
            dbias += logits.sum(0, dtype=torch.float32)
    return loss, lse, dhidden, dweight, dbias.to(bias.dtype) if grad_bias else dbias


# ----------------------------------------------------------------------------------- registration
def _cross_entropy_impl(logits: Tensor, labels: Tensor, ignore_index: int, label_smoothing: float,
                      softcap: float | None, z_loss: float) -> tuple[Tensor, Tensor]:
    return _cross_entropy_rows(logits, labels.contiguous(), ignore_index, label_smoothing, softcap, z_loss)


def _cross_entropy_backward_impl(grad: Tensor, logits: Tensor, labels: Tensor, lse: Tensor, ignore_index: int,
                               label_smoothing: float, softcap: float | None, z_loss: float) -> Tensor:
    return _cross_entropy_dlogits(grad, logits, labels.contiguous(), lse, ignore_index, label_smoothing, softcap,
                                  z_loss)


def _cross_entropy_fake(logits, labels, ignore_index, label_smoothing, softcap, z_loss):
    rows = logits.new_empty(logits.shape[:1], dtype=torch.float32)
    return rows, torch.empty_like(rows)


def _cross_entropy_backward_fake(grad, logits, labels, lse, ignore_index, label_smoothing, softcap, z_loss):
    return torch.empty_like(logits, memory_format=torch.contiguous_format)


def _setup_cross_entropy(ctx, inputs, output):
    logits, labels, *ctx.options = inputs
    ctx.save_for_backward(logits, labels, output[1])


def _backward_cross_entropy(ctx, grad, _grad_lse):
    logits, labels, lse = ctx.saved_tensors
    dlogits = CROSS_ENTROPY_BACKWARD(grad, logits, labels, lse, *ctx.options)
    return dlogits, None, None, None, None, None


CROSS_ENTROPY_BACKWARD = FusedOp("cross_entropy_backward", _cross_entropy_backward_impl,
                                 fake=_cross_entropy_backward_fake)
CROSS_ENTROPY = FusedOp("cross_entropy", _cross_entropy_impl, fake=_cross_entropy_fake,
                        setup_context=_setup_cross_entropy, backward=_backward_cross_entropy)


def _linear_cross_entropy_impl(hidden: Tensor, weight: Tensor, bias: Tensor | None, labels: Tensor,
                             divisor: Tensor | None, reduction: str, ignore_index: int, label_smoothing: float,
                             softcap: float | None, z_loss: float, chunk_tokens: int, grad_hidden: bool,
                             grad_weight: bool, grad_bias: bool) -> tuple[Tensor, Tensor, Tensor, Tensor, Tensor]:
    """Returns (loss, lse [N], d hidden, d weight, d bias) for a unit upstream gradient; the
    gradients are computed here only for "mean" / "sum" (empty [0] tensors otherwise)."""
    reduce = reduction != "none"
    scale = divisor.reciprocal() if divisor is not None else None
    rows, lse, dhidden, dweight, dbias = _linear_cross_entropy_chunks(
        hidden, weight, bias, labels.contiguous(), scale, ignore_index, label_smoothing, softcap, z_loss,
        chunk_tokens, reduce and grad_hidden, reduce and grad_weight, reduce and grad_bias)
    loss = rows if not reduce else rows.sum() if divisor is None else rows.sum() / divisor
    return loss, lse, dhidden, dweight, dbias


def _linear_cross_entropy_backward_impl(grad: Tensor, hidden: Tensor, weight: Tensor, bias: Tensor | None,
                                      labels: Tensor, ignore_index: int, label_smoothing: float,
                                      softcap: float | None, z_loss: float, chunk_tokens: int, grad_hidden: bool,
                                      grad_weight: bool, grad_bias: bool) -> tuple[Tensor, Tensor, Tensor]:
    """reduction="none": the chunk loop again, each row's gradient scaled by its upstream ``grad``."""
    _, _, dhidden, dweight, dbias = _linear_cross_entropy_chunks(
        hidden, weight, bias, labels.contiguous(), grad.float(), ignore_index, label_smoothing, softcap, z_loss,
        chunk_tokens, grad_hidden, grad_weight, grad_bias)
    return dhidden, dweight, dbias


def _scale_impl(x: Tensor, scale: Tensor) -> None:
    """x *= scale in place, in fp32 arithmetic. x: contiguous, any float dtype; scale: 0-dim.

    torch's ``x.mul_(scale)`` takes a generic, unvectorised path for a bf16 x and an fp32 scale: it
    moved a Llama-3 d weight (2.1 GB) at ~1 TB/s on the H200, this kernel at copy speed."""
    if x.numel():
        _scale_kernel[(triton.cdiv(x.numel(), SCALE_BLOCK),)](x, scale, x.numel(), BLOCK=SCALE_BLOCK, num_warps=4)


def _scale_fake(x, scale):
    return None


def _fake_grads(hidden, weight, bias, grad_hidden, grad_weight, grad_bias):
    return (hidden.new_empty(hidden.shape if grad_hidden else (0,)),
            weight.new_empty(weight.shape if grad_weight else (0,)),
            bias.new_empty(bias.shape) if grad_bias else hidden.new_empty((0,), dtype=torch.float32))


def _linear_cross_entropy_fake(hidden, weight, bias, labels, divisor, reduction, ignore_index, label_smoothing,
                               softcap, z_loss, chunk_tokens, grad_hidden, grad_weight, grad_bias):
    reduce = reduction != "none"
    rows = hidden.new_empty(hidden.shape[:1], dtype=torch.float32)
    loss = hidden.new_empty((), dtype=torch.float32) if reduce else torch.empty_like(rows)
    return loss, rows, *_fake_grads(hidden, weight, bias, reduce and grad_hidden, reduce and grad_weight,
                                    reduce and grad_bias)


def _linear_cross_entropy_backward_fake(grad, hidden, weight, bias, labels, ignore_index, label_smoothing, softcap,
                                        z_loss, chunk_tokens, grad_hidden, grad_weight, grad_bias):
    return _fake_grads(hidden, weight, bias, grad_hidden, grad_weight, grad_bias)


def _setup_linear_cross_entropy(ctx, inputs, output):
    hidden, weight, bias, labels, _, ctx.reduction, *options, grad_hidden, grad_weight, grad_bias = inputs
    ctx.options, ctx.wanted = options, (grad_hidden, grad_weight, grad_bias)
    if ctx.reduction == "none":
        ctx.save_for_backward(hidden, weight, bias, labels)
    else:
        # Held as plain references, not saved tensors: backward hands them to autograd as the only
        # reference, so AccumulateGrad adopts each buffer instead of cloning it (1 GB for a Llama-3 dW).
        ctx.mark_non_differentiable(*output[2:])
        ctx.grads = output[2:]
    ctx.set_materialize_grads(False)  # else autograd allocates zero "gradients" for those [N, H], [V, H] outputs


def _backward_linear_cross_entropy(ctx, grad, *_unused_output_grads):
    if grad is None:  # only lse was used (it gets no gradient)
        return (None,) * 14
    if ctx.reduction == "none":
        grads = LINEAR_CROSS_ENTROPY_BACKWARD(grad, *ctx.saved_tensors, *ctx.options, *ctx.wanted)
    else:
        # The gradients were computed in the forward pass; scale them in place rather than holding a
        # second [V, H] copy. They are this op's own buffers, never the caller's; a second backward
        # through the same graph would see them already scaled, so it is refused.
        if getattr(ctx, "consumed", False):
            raise RuntimeError("linear_cross_entropy: backward ran twice through the same graph (retain_graph); "
                               "its gradients are computed in the forward pass and consumed by the first backward")
        ctx.consumed = True
        for g in ctx.grads:
            SCALE_(g, grad)
        grads, ctx.grads = ctx.grads, None
    dhidden, dweight, dbias = (g if wanted else None for g, wanted in zip(grads, ctx.wanted))
    return (dhidden, dweight, dbias) + (None,) * 11


SCALE_ = FusedOp("scale_", _scale_impl, fake=_scale_fake, mutates_args=("x",))
LINEAR_CROSS_ENTROPY_BACKWARD = FusedOp("linear_cross_entropy_backward", _linear_cross_entropy_backward_impl,
                                        fake=_linear_cross_entropy_backward_fake)
LINEAR_CROSS_ENTROPY = FusedOp("linear_cross_entropy", _linear_cross_entropy_impl, fake=_linear_cross_entropy_fake,
                               setup_context=_setup_linear_cross_entropy, backward=_backward_linear_cross_entropy)


# ----------------------------------------------------------------------------------- public API
def _check_options(ignore_index: int, reduction: str, label_smoothing: float, softcap: float | None, z_loss: float,
                   num_items: int | Tensor | None) -> tuple[int, float, float | None, float]:
    """Checks the options; returns ignore_index as an int and (label_smoothing, softcap, z_loss) as floats (softcap
    may be None)."""
    if isinstance(ignore_index, bool) or not isinstance(ignore_index, numbers.Integral):
        raise TypeError(f"ignore_index must be an int, got {type(ignore_index).__name__}")
    label_smoothing, z_loss = check_real("label_smoothing", label_smoothing), check_real("z_loss", z_loss)
    softcap = None if softcap is None else check_real("softcap", softcap)
    if reduction not in REDUCTIONS:
        raise ValueError(f"reduction must be one of {REDUCTIONS}, got {reduction!r}")
    if not 0.0 <= label_smoothing <= 1.0:
        raise ValueError(f"label_smoothing must be in [0, 1], got {label_smoothing}")
    if softcap is not None and not 0.0 < softcap < float("inf"):
        raise ValueError(f"softcap must be a positive finite number or None, got {softcap}")
    if not 0.0 <= z_loss < float("inf"):
        raise ValueError(f"z_loss must be a non-negative finite number, got {z_loss}")
    if num_items is not None:
        _check_num_items(num_items, reduction)
    return int(ignore_index), label_smoothing, softcap, z_loss


def _check_num_items(num_items: int | Tensor, reduction: str) -> None:
    if reduction != "mean":
        raise ValueError(f"num_items divides the 'mean' reduction only, but reduction is {reduction!r}")
    if isinstance(num_items, Tensor):
        if num_items.dim() != 0:
            raise ValueError(f"num_items must be a 0-dim tensor or an int, got shape {tuple(num_items.shape)}")
    elif isinstance(num_items, bool) or not isinstance(num_items, numbers.Integral):
        raise TypeError(f"num_items must be an int or a 0-dim tensor, got {type(num_items).__name__}")
    elif num_items <= 0:
        raise ValueError(f"num_items must be positive, got {num_items}")


def _check_labels(labels: object, expected_shape: torch.Size, owner: str, owner_tensor: Tensor) -> None:
    if not isinstance(labels, Tensor):
        raise TypeError(f"labels must be a torch.Tensor, got {type(labels).__name__}")
    check_not_dtensor("labels", labels)
    if labels.is_floating_point() or labels.is_complex() or labels.dtype == torch.bool:
        raise TypeError(f"labels must be an integer tensor, got dtype {labels.dtype}")
    if labels.shape != expected_shape:
        raise ValueError(f"labels has shape {tuple(labels.shape)} but {owner} has leading shape "
                         f"{tuple(expected_shape)}")
    if labels.device != owner_tensor.device:
        raise ValueError(f"labels is on {labels.device} but {owner} is on {owner_tensor.device}")


def _check_cross_entropy_args(logits: Tensor, labels: Tensor) -> None:
    check_tensor("logits", logits)
    if logits.shape[-1] == 0:
        raise ValueError("logits must have a non-empty last (vocabulary) dimension")
    _check_labels(labels, logits.shape[:-1], "logits", logits)


def _check_linear_args(hidden: Tensor, weight: Tensor, labels: Tensor, bias: Tensor | None,
                       chunk_tokens: int | None) -> None:
    check_tensor("hidden", hidden)
    check_tensor("weight", weight, rank=2)
    if weight.shape[0] == 0:
        raise ValueError("weight must have a non-empty first (vocabulary) dimension")
    if weight.shape[1] != hidden.shape[-1]:
        raise ValueError(f"weight's hidden size (dim 1) is {weight.shape[1]} but hidden's (last dim) is "
                         f"{hidden.shape[-1]}")
    if bias is not None:
        check_tensor("bias", bias, rank=1)
        if bias.shape[0] != weight.shape[0]:
            raise ValueError(f"bias has size {bias.shape[0]} but weight's vocabulary size (dim 0) is {weight.shape[0]}")
    check_same("hidden", hidden, weight=weight, bias=bias)
    _check_labels(labels, hidden.shape[:-1], "hidden", hidden)
    if chunk_tokens is not None and (isinstance(chunk_tokens, bool) or not isinstance(chunk_tokens, int)
                                     or chunk_tokens < 1):
        raise ValueError(f"chunk_tokens must be a positive int or None, got {chunk_tokens!r}")


def _mean_divisor(valid: Tensor, num_items: int | Tensor | None) -> Tensor:
    """0-dim fp32 device tensor: the count of non-ignored tokens, or num_items."""
    if num_items is None:
        return valid.sum().to(torch.float32)
    if isinstance(num_items, Tensor):
        return num_items.to(device=valid.device, dtype=torch.float32)
    return torch.full((), float(num_items), dtype=torch.float32, device=valid.device)


def _reduce(rows: Tensor, reduction: str, divisor: Tensor | None, shape: torch.Size) -> Tensor:
    if reduction == "none":
        return rows.view(shape)
    return rows.sum() if divisor is None else rows.sum() / divisor.to(rows.dtype)


def _z_loss_term(lse: Tensor, valid: Tensor, z_loss: float, reduction: str, divisor: Tensor | None,
                 shape: torch.Size) -> Tensor:
    """The z-loss part of the loss, reduced the same way, without gradient (for logging)."""
    return _reduce(torch.where(valid, z_loss * lse.detach().square(), 0.0), reduction, divisor, shape)


def _finish(rows: Tensor, lse: Tensor, labels: Tensor, ignore_index: int, reduction: str, z_loss: float,
            num_items: int | Tensor | None, return_z_loss: bool) -> Tensor | tuple[Tensor, Tensor]:
    valid = labels.reshape(-1) != ignore_index
    divisor = _mean_divisor(valid, num_items) if reduction == "mean" else None
    loss = _reduce(rows, reduction, divisor, labels.shape)
    if not return_z_loss:
        return loss
    return loss, _z_loss_term(lse, valid, z_loss, reduction, divisor, labels.shape)


def cross_entropy(logits: Tensor, labels: Tensor, *, ignore_index: int = -100, reduction: str = "mean",
                  label_smoothing: float = 0.0, softcap: float | None = None, z_loss: float = 0.0,
                  num_items: int | Tensor | None = None,
                  return_z_loss: bool = False) -> Tensor | tuple[Tensor, Tensor]:
    """Cross-entropy of logits against integer labels (module docstring gives the formula).

    Args:
        logits: [..., V], fp32/fp16/bf16 (any dtype on the reference path), any strides. Not modified.
        labels: [...] integer (int64 as HF passes them), same device; ``ignore_index`` marks ignored tokens.
            A label outside [0, V) that is not ignore_index: IndexError on the reference path; on the
            Triton path (which never syncs with the host) a NaN loss and NaN in every gradient that
            token reaches, and a failed ``tl.device_assert`` when run with ``TRITON_DEBUG=1``.
        ignore_index: label value whose tokens contribute nothing.
        reduction: ``"mean"`` (sum / count of non-ignored tokens, or / num_items; NaN when every token
            is ignored and num_items is None, as F.cross_entropy), ``"sum"``, or ``"none"``.
        label_smoothing: eps in [0, 1], as in F.cross_entropy.
        softcap: logits become ``softcap * tanh(logits / softcap)`` first (Gemma 2); None: off.
        z_loss: adds ``z_loss * logsumexp(logits)^2`` per non-ignored token.
        num_items: "mean" only: divide by this (int, or 0-dim tensor: HF's num_items_in_batch) instead.
        return_z_loss: also return the z-loss part, reduced the same way, without gradient (logging).
        label_smoothing, softcap and z_loss are Python floats (or ints), never tensors.

    Returns:
        fp32 loss: 0-dim for "mean"/"sum", [...] for "none" (0 at ignored tokens); with
        ``return_z_loss``, ``(loss, z_loss_part)``. fp64 logits give fp64 (reference path).
    """
    _check_cross_entropy_args(logits, labels)
    ignore_index, label_smoothing, softcap, z_loss = _check_options(ignore_index, reduction, label_smoothing, softcap,
                                                                    z_loss, num_items)
    flat_labels = labels.reshape(-1)
    if runs_triton(logits):
        rows, lse = CROSS_ENTROPY(as_rows(logits), flat_labels, ignore_index, label_smoothing,
                                                   softcap, z_loss)
    else:
        rows, lse = _reference_rows(logits.reshape(-1, logits.shape[-1]), flat_labels, ignore_index,
                                    label_smoothing, softcap, z_loss)
    return _finish(rows, lse, labels, ignore_index, reduction, z_loss, num_items, return_z_loss)


def linear_cross_entropy(hidden: Tensor, weight: Tensor, labels: Tensor, bias: Tensor | None = None, *,
                         ignore_index: int = -100, reduction: str = "mean", label_smoothing: float = 0.0,
                         softcap: float | None = None, z_loss: float = 0.0, num_items: int | Tensor | None = None,
                         chunk_tokens: int | None = None,
                         return_z_loss: bool = False) -> Tensor | tuple[Tensor, Tensor]:
    """``cross_entropy(hidden @ weight.T + bias, labels)`` without materialising the [N, V] logits.

    Args:
        hidden: [..., H] final hidden states, fp32/fp16/bf16, any strides. Not modified.
        weight: [V, H] LM-head weight (may be tied to the embedding), hidden's dtype and device.
            When it does not require grad (frozen head, LoRA) its gradient is not computed.
        labels: [...] integer, hidden's leading shape.
        bias: [V] or None, hidden's dtype.
        chunk_tokens: tokens per chunk; default :func:`default_chunk_tokens` (a ~256 MiB logits buffer).
            Smaller chunks hold less memory and cost time: every chunk re-reads and re-writes d weight.
        the rest: as :func:`cross_entropy`.

    Returns:
        As :func:`cross_entropy`. The logits are computed in hidden's dtype (cuBLAS), the loss in fp32.
        Memory beyond inputs and outputs: one [chunk_tokens, V] buffer, plus for "mean"/"sum" the
        gradients (d hidden [N, H], d weight [V, H]), computed during the forward pass.
    """
    _check_linear_args(hidden, weight, labels, bias, chunk_tokens)
    ignore_index, label_smoothing, softcap, z_loss = _check_options(ignore_index, reduction, label_smoothing, softcap,
                                                                    z_loss, num_items)
    if not runs_triton(hidden):
        return linear_cross_entropy_reference(
            hidden, weight, labels, bias, ignore_index=ignore_index, reduction=reduction,
            label_smoothing=label_smoothing, softcap=softcap, z_loss=z_loss, num_items=num_items,
            return_z_loss=return_z_loss)
    flat_labels = labels.reshape(-1)
    valid = flat_labels != ignore_index
    divisor = _mean_divisor(valid, num_items) if reduction == "mean" else None
    grad_on = torch.is_grad_enabled()
    loss, lse, *_ = LINEAR_CROSS_ENTROPY(
        hidden.reshape(flat_labels.numel(), hidden.shape[-1]),  # not (-1, H): H may be 0 (all-zero logits)
        weight, bias, flat_labels, divisor, reduction, ignore_index, label_smoothing, softcap, z_loss,
        chunk_tokens or default_chunk_tokens(weight.shape[0], hidden.dtype),
        grad_on and hidden.requires_grad, grad_on and weight.requires_grad,
        grad_on and bias is not None and bias.requires_grad)
    if reduction == "none":
        loss = loss.view(labels.shape)
    if not return_z_loss:
        return loss
    return loss, _z_loss_term(lse, valid, z_loss, reduction, divisor, labels.shape)
