"""RMSNorm and residual-add + RMSNorm: Triton kernels, PyTorch reference, ``fuselm::`` registration.

y = (offset + w) * x / sqrt(mean(x^2) + eps), computed per row of the last dimension, with the
casting of the model family that is being matched:

- ``"llama"``: normalise in fp32, cast to the input dtype, then multiply by the weight (HF Llama,
  Mistral, Qwen, Phi-3). Output dtype: ``promote_types(x.dtype, weight.dtype)``.
- ``"gemma"``: everything in fp32, one cast to the input dtype at the end (HF Gemma 1/2/3, whose
  weight is stored as ``w`` and used as ``1 + w``: pass ``offset=1.0``).
- ``"none"``: the reference computes in the input dtype throughout; the kernel in fp32.
"""

from __future__ import annotations

import functools

import torch
from torch import Tensor

from fuselm.backend import runs_triton
from fuselm.ops._common import (
    FusedOp,
    as_rows,
    autotune,
    check_real,
    check_same_device,
    check_tensor,
    is_dtensor,
    new_output,
    on_local_shards,
    sm_count,
)
from fuselm.ops._triton import tl, triton

CASTINGS = ("llama", "gemma", "none")
MAX_SINGLE_PASS_COLS = 16384  # rows up to this many columns stay in registers; wider rows loop
CHUNK_COLS = 4096


# ----------------------------------------------------------------------------------- reference
def rms_norm_reference(x: Tensor, weight: Tensor, eps: float = 1e-6, offset: float = 0.0,
                       casting: str = "llama") -> Tensor:
    """Plain PyTorch RMSNorm (the fallback and the test oracle). Shapes as :func:`rms_norm`."""
    if casting == "none":
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * (offset + weight)
    x32 = x.float()
    normed = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + eps)
    if casting == "llama":
        return (offset + weight) * normed.to(x.dtype)
    return (normed * (offset + weight.float())).to(x.dtype)


def add_rms_norm_reference(x: Tensor, residual: Tensor, weight: Tensor, eps: float = 1e-6,
                           offset: float = 0.0, casting: str = "llama") -> tuple[Tensor, Tensor]:
    """Plain PyTorch residual add then RMSNorm; returns (normed, sum)."""
    total = x + residual
    return rms_norm_reference(total, weight, eps, offset, casting), total


# ----------------------------------------------------------------------------------- kernels
def _prune_by_registers(configs, named_args, **kwargs):
    """Drops tiles too large for registers (a prefetching program holds two) and, for rows wider
    than one block, the prefetching configs (only the single-pass backward prefetches)."""
    args = {**named_args, **kwargs}
    kept = [c for c in configs if c.kwargs["ROWS"] * args["BLOCK_N"] * (2 if c.kwargs.get("PREFETCH") else 1) <= 16384
            and (args.get("SINGLE_PASS", True) or not c.kwargs.get("PREFETCH"))]
    return kept or configs[:1]


_ROW_CONFIGS = [
    triton.Config({"ROWS": rows}, num_warps=warps)
    for rows, warps in [(1, 4), (1, 8), (2, 4), (2, 8), (4, 4), (4, 8), (1, 16), (2, 16), (4, 16), (8, 16)]
]


@triton.jit
def _load_input(x_ptr, residual_ptr, sum_ptr, rows, cols, mask, stride_x, stride_residual, stride_sum,
                HAS_RESIDUAL: tl.constexpr):
    """x (plus residual, whose rounded sum is stored) as fp32, for one [rows, cols] tile."""
    x = tl.load(x_ptr + rows * stride_x + cols, mask=mask, other=0.0).to(tl.float32)
    if HAS_RESIDUAL:
        x += tl.load(residual_ptr + rows * stride_residual + cols, mask=mask, other=0.0).to(tl.float32)
        x = x.to(sum_ptr.dtype.element_ty)  # the stored residual stream, rounded as PyTorch rounds x + r
        tl.store(sum_ptr + rows * stride_sum + cols, x, mask=mask)
    return x.to(tl.float32)


@triton.jit
def _load_weight(weight_ptr, cols, n_cols, offset):
    """offset + weight as fp32 for the columns cols."""
    return tl.load(weight_ptr + cols, mask=cols < n_cols, other=0.0).to(tl.float32) + offset


@triton.jit
def _store_normed(x, rstd, weight, y_ptr, rows, cols, mask, stride_y, CAST_NORMED: tl.constexpr,
                  INPUT_DTYPE: tl.constexpr):
    """y = (offset + weight) * normalised x for one tile; weight is already offset, in fp32."""
    normed = x * rstd
    if CAST_NORMED:
        normed = normed.to(INPUT_DTYPE).to(tl.float32)
    tl.store(y_ptr + rows * stride_y + cols, (normed * weight).to(y_ptr.dtype.element_ty), mask=mask)


@autotune(_ROW_CONFIGS, key=["n_cols", "HAS_RESIDUAL"], prune_configs_by={"early_config_prune": _prune_by_registers})
@triton.jit
def _rms_norm_fwd_kernel(
    x_ptr, residual_ptr, weight_ptr, y_ptr, sum_ptr, rstd_ptr,
    n_rows, n_cols, stride_x, stride_residual, stride_y, stride_sum, eps, offset,
    HAS_RESIDUAL: tl.constexpr, CAST_NORMED: tl.constexpr,
    SINGLE_PASS: tl.constexpr, BLOCK_N: tl.constexpr, ROWS: tl.constexpr,
):
    # Program owns ROWS rows. Reads x (and residual) once, writes y (and their sum) once, plus one
    # fp32 rstd per row. Rows wider than BLOCK_N are read twice (sum of squares, then normalise).
    rows = (tl.program_id(0) * ROWS + tl.arange(0, ROWS)).to(tl.int64)[:, None]
    row_ok = rows < n_rows
    input_dtype = x_ptr.dtype.element_ty
    if SINGLE_PASS:
        cols = tl.arange(0, BLOCK_N)[None, :]
        mask = row_ok & (cols < n_cols)
        x = _load_input(x_ptr, residual_ptr, sum_ptr, rows, cols, mask, stride_x, stride_residual, stride_sum,
                        HAS_RESIDUAL)
        weight = _load_weight(weight_ptr, cols, n_cols, offset)  # issued before the reduction: latency hidden
        rstd = tl.rsqrt(tl.sum(x * x, axis=1, keep_dims=True) / n_cols + eps)
        _store_normed(x, rstd, weight, y_ptr, rows, cols, mask, stride_y, CAST_NORMED, input_dtype)
    else:
        sum_of_squares = tl.zeros([ROWS, 1], dtype=tl.float32)
        for start in range(0, n_cols, BLOCK_N):
            cols = start + tl.arange(0, BLOCK_N)[None, :]
            mask = row_ok & (cols < n_cols)
            x = _load_input(x_ptr, residual_ptr, sum_ptr, rows, cols, mask, stride_x, stride_residual,
                            stride_sum, HAS_RESIDUAL)
            sum_of_squares += tl.sum(x * x, axis=1, keep_dims=True)
        rstd = tl.rsqrt(sum_of_squares / n_cols + eps)
        for start in range(0, n_cols, BLOCK_N):
            cols = start + tl.arange(0, BLOCK_N)[None, :]
            mask = row_ok & (cols < n_cols)
            if HAS_RESIDUAL:
                x = tl.load(sum_ptr + rows * stride_sum + cols, mask=mask, other=0.0).to(tl.float32)
            else:
                x = tl.load(x_ptr + rows * stride_x + cols, mask=mask, other=0.0).to(tl.float32)
            _store_normed(x, rstd, _load_weight(weight_ptr, cols, n_cols, offset), y_ptr, rows, cols, mask, stride_y,
                          CAST_NORMED, input_dtype)
    tl.store(rstd_ptr + rows, rstd, mask=row_ok)


@triton.jit
def _load_grad_inputs(dy_ptr, x_ptr, dsum_ptr, rows, cols, mask, stride_dy, stride_x, stride_dsum,
                      HAS_DSUM: tl.constexpr):
    """(x, dy, dsum) as fp32 for one [rows, cols] tile (dsum 0 without HAS_DSUM). All three loads are
    issued together, before the row reduction that needs x and dy, so dsum's latency hides behind it."""
    x = tl.load(x_ptr + rows * stride_x + cols, mask=mask, other=0.0).to(tl.float32)
    dy = tl.load(dy_ptr + rows * stride_dy + cols, mask=mask, other=0.0).to(tl.float32)
    dsum = 0.0
    if HAS_DSUM:
        dsum = tl.load(dsum_ptr + rows * stride_dsum + cols, mask=mask, other=0.0).to(tl.float32)
    return x, dy, dsum


@triton.jit
def _load_row_block(dy_ptr, x_ptr, dsum_ptr, rstd_ptr, rows, cols, n_rows, n_cols, stride_dy, stride_x, stride_dsum,
                    HAS_DSUM: tl.constexpr):
    """(x, dy, dsum, rstd) of one block of whole rows ([ROWS, 1] rows; rows >= n_rows read nothing)."""
    row_ok = rows < n_rows
    x, dy, dsum = _load_grad_inputs(dy_ptr, x_ptr, dsum_ptr, rows, cols, row_ok & (cols < n_cols), stride_dy, stride_x,
                                    stride_dsum, HAS_DSUM)
    return x, dy, dsum, tl.load(rstd_ptr + rows, mask=row_ok, other=0.0)


@triton.jit
def _store_dx(x, dy, dsum, weight, rstd, mean_dot, dx_ptr, dresidual_ptr, rows, cols, mask, stride_dx,
              stride_dresidual, HAS_DRESIDUAL: tl.constexpr, CAST_NORMED: tl.constexpr, INPUT_DTYPE: tl.constexpr):
    """Stores dx (and the same values to dresidual) for one tile; returns the tile's dweight column
    sums (fp32).

    mean_dot is the row's mean of (dy * w) * normed: what dx loses to the norm's projection; dsum
    is the gradient reaching the residual sum directly (0 for a plain norm).
    """
    normed = x * rstd
    dx = rstd * (dy * weight - normed * mean_dot) + dsum
    tl.store(dx_ptr + rows * stride_dx + cols, dx.to(dx_ptr.dtype.element_ty), mask=mask)
    if HAS_DRESIDUAL:
        tl.store(dresidual_ptr + rows * stride_dresidual + cols, dx.to(dresidual_ptr.dtype.element_ty), mask=mask)
    if CAST_NORMED:
        normed = normed.to(INPUT_DTYPE).to(tl.float32)
    return tl.sum(dy * normed, axis=0)


MAX_PROGRAMS_PER_SM = 8
_BWD_CONFIGS = [
    triton.Config({"ROWS": rows, "PROGRAMS_PER_SM": per_sm, "PREFETCH": prefetch}, num_warps=warps)
    for rows, per_sm, warps, prefetch in [
        (1, 2, 8, False), (1, 4, 4, False), (1, 4, 8, False), (1, 8, 4, False), (2, 2, 8, False), (2, 4, 4, False),
        (2, 4, 8, False), (2, 8, 4, False), (4, 2, 8, False), (4, 2, 16, False), (4, 4, 4, False), (4, 4, 8, False),
        # two row blocks in flight per program: the next block's loads go out before this one's reduction
        (1, 2, 8, True), (1, 4, 8, True), (2, 2, 8, True), (2, 4, 8, True), (2, 2, 16, True)]
]


@autotune(_BWD_CONFIGS, key=["n_cols", "HAS_DSUM", "HAS_DRESIDUAL", "HAS_DWEIGHT"],
          prune_configs_by={"early_config_prune": _prune_by_registers})
@triton.jit
def _rms_norm_bwd_kernel(
    dy_ptr, dsum_ptr, x_ptr, weight_ptr, rstd_ptr, dx_ptr, dresidual_ptr, dweight_partial_ptr,
    n_rows, n_cols, stride_dy, stride_dsum, stride_x, stride_dx, stride_dresidual, offset,
    HAS_DSUM: tl.constexpr, HAS_DRESIDUAL: tl.constexpr, HAS_DWEIGHT: tl.constexpr, CAST_NORMED: tl.constexpr,
    SINGLE_PASS: tl.constexpr, BLOCK_N: tl.constexpr, ROWS: tl.constexpr, PROGRAMS_PER_SM: tl.constexpr,
    PREFETCH: tl.constexpr,
):
    # Persistent program p of P: owns the blocks of ROWS rows that start at p*ROWS, (p+P)*ROWS, ...
    # (so the programs running at once work on neighbouring rows, as a plain grid would) and one
    # fp32 row of dweight partial sums. Reads x, dy (and dsum) once and writes dx once (and the same
    # values to dresidual) when a row fits in BLOCK_N; the weight row is then read once per program.
    # With PREFETCH the next row block's loads are issued before this block's reduction (two blocks
    # in flight). Wider rows are read twice (the row's mean_dot first, then dx) with their weight
    # chunks, and their dweight partials accumulate in place in the program's own row of the
    # partial buffer (its first row block stores them). Without HAS_DWEIGHT (a frozen weight, as under
    # LoRA) no partial is written.
    program = tl.program_id(0)
    partial_row = dweight_partial_ptr + program.to(tl.int64) * n_cols
    input_dtype = x_ptr.dtype.element_ty
    block = tl.arange(0, BLOCK_N)
    step = tl.num_programs(0) * ROWS
    if SINGLE_PASS:
        cols = block[None, :]
        weight = _load_weight(weight_ptr, cols, n_cols, offset)
        dweight = tl.zeros([BLOCK_N], dtype=tl.float32)
        rows = (program * ROWS + tl.arange(0, ROWS)).to(tl.int64)[:, None]
        x, dy, dsum, rstd = _load_row_block(dy_ptr, x_ptr, dsum_ptr, rstd_ptr, rows, cols, n_rows, n_cols, stride_dy,
                                            stride_x, stride_dsum, HAS_DSUM)
        for _ in range(program * ROWS, n_rows, step):
            next_rows = rows + step
            if PREFETCH:
                next_block = _load_row_block(dy_ptr, x_ptr, dsum_ptr, rstd_ptr, next_rows, cols, n_rows, n_cols,
                                             stride_dy, stride_x, stride_dsum, HAS_DSUM)
            mean_dot = tl.sum(dy * weight * x * rstd, axis=1, keep_dims=True) / n_cols
            dweight += _store_dx(x, dy, dsum, weight, rstd, mean_dot, dx_ptr, dresidual_ptr, rows, cols,
                                 (rows < n_rows) & (cols < n_cols), stride_dx, stride_dresidual, HAS_DRESIDUAL,
                                 CAST_NORMED, input_dtype)
            if not PREFETCH:
                next_block = _load_row_block(dy_ptr, x_ptr, dsum_ptr, rstd_ptr, next_rows, cols, n_rows, n_cols,
                                             stride_dy, stride_x, stride_dsum, HAS_DSUM)
            x, dy, dsum, rstd = next_block
            rows = next_rows
        if HAS_DWEIGHT:
            tl.store(partial_row + block, dweight, mask=block < n_cols)
    else:
        for first_row in range(program * ROWS, n_rows, step):
            rows = (first_row + tl.arange(0, ROWS)).to(tl.int64)[:, None]
            row_ok = rows < n_rows
            rstd = tl.load(rstd_ptr + rows, mask=row_ok, other=0.0)
            mean_dot = tl.zeros([ROWS, 1], dtype=tl.float32)
            for start in range(0, n_cols, BLOCK_N):
                cols = start + block[None, :]
                mask = row_ok & (cols < n_cols)
                x, dy, _ = _load_grad_inputs(dy_ptr, x_ptr, dsum_ptr, rows, cols, mask, stride_dy, stride_x,
                                             stride_dsum, False)
                weight = _load_weight(weight_ptr, cols, n_cols, offset)
                mean_dot += tl.sum(dy * weight * x * rstd, axis=1, keep_dims=True)
            mean_dot = mean_dot / n_cols
            for start in range(0, n_cols, BLOCK_N):
                cols = start + block[None, :]
                mask = row_ok & (cols < n_cols)
                x, dy, dsum = _load_grad_inputs(dy_ptr, x_ptr, dsum_ptr, rows, cols, mask, stride_dy, stride_x,
                                                stride_dsum, HAS_DSUM)
                weight = _load_weight(weight_ptr, cols, n_cols, offset)
                contribution = _store_dx(x, dy, dsum, weight, rstd, mean_dot, dx_ptr, dresidual_ptr, rows, cols,
                                         mask, stride_dx, stride_dresidual, HAS_DRESIDUAL, CAST_NORMED, input_dtype)
                if HAS_DWEIGHT:
                    col_ok = start + block < n_cols
                    chunk = partial_row + start + block
                    # 0 on the first block; tl.where, as `&` with this scalar test makes an int32 mask in triton's
                    # interpreter, which triton 3.9's refuses
                    earlier = tl.load(chunk, mask=tl.where(first_row > program * ROWS, col_ok, False), other=0.0)
                    tl.store(chunk, earlier + contribution, mask=col_ok)


SUM_BLOCK_COLS, SUM_BLOCK_ROWS = 32, 128


@triton.jit
def _dweight_sum_kernel(partial_ptr, dweight_ptr, n_partials, n_cols, BLOCK_ROWS: tl.constexpr,
                        BLOCK_COLS: tl.constexpr):
    # Program owns BLOCK_COLS columns: reads their n_partials fp32 partial sums once (one 128-byte
    # run per partial row) and writes their dweight once, in the weight's dtype.
    cols = tl.program_id(0) * BLOCK_COLS + tl.arange(0, BLOCK_COLS)[None, :]
    col_ok = cols < n_cols
    total = tl.zeros([BLOCK_ROWS, BLOCK_COLS], dtype=tl.float32)
    for first in range(0, n_partials, BLOCK_ROWS):
        rows = (first + tl.arange(0, BLOCK_ROWS)).to(tl.int64)[:, None]
        total += tl.load(partial_ptr + rows * n_cols + cols, mask=(rows < n_partials) & col_ok, other=0.0)
    tl.store(dweight_ptr + cols, tl.sum(total, axis=0)[None, :].to(dweight_ptr.dtype.element_ty), mask=col_ok)


# ----------------------------------------------------------------------------------- launchers
@functools.cache  # called on every launch; triton.next_power_of_2 alone costs microseconds
def _block_cols(n_cols: int) -> tuple[int, bool]:
    if n_cols <= MAX_SINGLE_PASS_COLS:
        return triton.next_power_of_2(n_cols), True
    return CHUNK_COLS, False


def _out_dtype(x: Tensor, weight: Tensor, casting: str) -> torch.dtype:
    return x.dtype if casting == "gemma" else torch.promote_types(x.dtype, weight.dtype)


def _launch_fwd(x: Tensor, residual: Tensor | None, weight: Tensor, eps: float, offset: float,
                casting: str) -> tuple[Tensor, Tensor | None, Tensor]:
    x2 = as_rows(x)
    residual2 = as_rows(residual) if residual is not None else None
    n_rows, n_cols = x2.shape
    y = new_output(x.shape, _out_dtype(x, weight, casting), x.device)
    total = new_output(x.shape, x.dtype, x.device) if residual is not None else None
    rstd = new_output(x.shape[:-1], torch.float32, x.device)
    if n_rows == 0:
        return y, total, rstd
    y2 = y.view(-1, n_cols)
    total2 = total.view(-1, n_cols) if total is not None else y2
    block_n, single_pass = _block_cols(n_cols)
    grid = lambda meta: (triton.cdiv(n_rows, meta["ROWS"]),)  # noqa: E731
    _rms_norm_fwd_kernel[grid](
        x2, residual2 if residual2 is not None else x2, weight.contiguous(), y2, total2, rstd,
        n_rows, n_cols, x2.stride(0), (residual2 if residual2 is not None else x2).stride(0),
        y2.stride(0), total2.stride(0), eps, offset,
        HAS_RESIDUAL=residual is not None, CAST_NORMED=casting == "llama",
        SINGLE_PASS=single_pass, BLOCK_N=block_n,
    )
    return y, total, rstd


def _launch_bwd(dy: Tensor, dsum: Tensor | None, x: Tensor, weight: Tensor, rstd: Tensor, offset: float,
                casting: str, separate_residual_grad: bool, weight_grad: bool) -> tuple[Tensor, Tensor, Tensor]:
    x2, dy2 = as_rows(x), as_rows(dy)
    dsum2 = as_rows(dsum) if dsum is not None else None
    n_rows, n_cols = x2.shape
    dx = new_output(x.shape, x.dtype, x.device)
    dresidual = new_output(x.shape if separate_residual_grad else (0,), x.dtype, x.device)
    if n_rows == 0:
        return dx, torch.zeros_like(weight) if weight_grad else weight.new_empty(0), dresidual
    block_n, single_pass = _block_cols(n_cols)
    n_sms = sm_count(x.device)
    # one fp32 row of dweight partial sums per program; the autotuner picks how many programs run (none written
    # without weight_grad: rstd stands in for the pointer)
    max_programs = min(n_sms * MAX_PROGRAMS_PER_SM, n_rows)
    partial = new_output((max_programs, n_cols), torch.float32, x.device) if weight_grad else rstd
    dx2 = dx.view(-1, n_cols)
    dresidual2 = dresidual.view(-1, n_cols) if separate_residual_grad else dx2
    grid = lambda meta: (min(n_sms * meta["PROGRAMS_PER_SM"], triton.cdiv(n_rows, meta["ROWS"])),)  # noqa: E731
    _rms_norm_bwd_kernel[grid](
        dy2, dsum2 if dsum2 is not None else dy2, x2, weight.contiguous(), rstd.reshape(-1), dx2, dresidual2, partial,
        n_rows, n_cols, dy2.stride(0), (dsum2 if dsum2 is not None else dy2).stride(0), x2.stride(0),
        dx2.stride(0), dresidual2.stride(0), offset,
        HAS_DSUM=dsum is not None, HAS_DRESIDUAL=separate_residual_grad, HAS_DWEIGHT=weight_grad,
        CAST_NORMED=casting == "llama", SINGLE_PASS=single_pass, BLOCK_N=block_n,
    )
    if not weight_grad:
        return dx, weight.new_empty(0), dresidual
    dweight = new_output(weight.shape, weight.dtype, weight.device)
    _dweight_sum_kernel[(triton.cdiv(n_cols, SUM_BLOCK_COLS),)](
        partial, dweight, grid(_rms_norm_bwd_kernel.best_config.kwargs)[0], n_cols,
        BLOCK_ROWS=SUM_BLOCK_ROWS, BLOCK_COLS=SUM_BLOCK_COLS, num_warps=4)
    return dx, dweight, dresidual


# ----------------------------------------------------------------------------------- registration
def _rms_norm_impl(x: Tensor, weight: Tensor, eps: float, offset: float, casting: str) -> tuple[Tensor, Tensor]:
    y, _, rstd = _launch_fwd(x, None, weight, eps, offset, casting)
    return y, rstd


def _add_rms_norm_impl(x: Tensor, residual: Tensor, weight: Tensor, eps: float, offset: float,
                       casting: str) -> tuple[Tensor, Tensor, Tensor]:
    return _launch_fwd(x, residual, weight, eps, offset, casting)


def _rms_norm_backward_impl(dy: Tensor, dsum: Tensor | None, x: Tensor, weight: Tensor, rstd: Tensor,
                            offset: float, casting: str, separate_residual_grad: bool,
                            weight_grad: bool) -> tuple[Tensor, Tensor, Tensor]:
    """(dx, dweight, dresidual): dresidual is a second copy of dx when ``separate_residual_grad``, else empty;
    dweight is empty without ``weight_grad`` (a frozen weight: nothing computed for it)."""
    return _launch_bwd(dy, dsum, x, weight, rstd, offset, casting, separate_residual_grad, weight_grad)


# the fakes give the launchers' contiguous outputs
def _rms_norm_fake(x, weight, eps, offset, casting):
    return x.new_empty(x.shape, dtype=_out_dtype(x, weight, casting)), x.new_empty(x.shape[:-1], dtype=torch.float32)


def _add_rms_norm_fake(x, residual, weight, eps, offset, casting):
    y, rstd = _rms_norm_fake(x, weight, eps, offset, casting)
    return y, x.new_empty(x.shape), rstd


def _rms_norm_backward_fake(dy, dsum, x, weight, rstd, offset, casting, separate_residual_grad, weight_grad):
    dresidual_shape = x.shape if separate_residual_grad else (0,)
    return x.new_empty(x.shape), weight.new_empty(weight.shape if weight_grad else (0,)), x.new_empty(dresidual_shape)


def _setup_rms_norm(ctx, inputs, output):
    x, weight, _, offset, casting = inputs
    ctx.save_for_backward(x, weight, output[1])
    ctx.offset, ctx.casting = offset, casting


def _backward_rms_norm(ctx, dy, _drstd):
    x, weight, rstd = ctx.saved_tensors
    weight_grad = ctx.needs_input_grad[1]
    dx, dweight, _ = RMS_NORM_BACKWARD(dy, None, x, weight, rstd, ctx.offset, ctx.casting, False, weight_grad)
    return dx, dweight if weight_grad else None, None, None, None


def _setup_add_rms_norm(ctx, inputs, output):
    x, residual, weight, _, offset, casting = inputs
    ctx.save_for_backward(output[1], weight, output[2])
    ctx.offset, ctx.casting = offset, casting
    # x and residual get the same gradient. Handing one tensor to both is free unless one is a leaf
    # (a direct call, or a layer input under reentrant gradient checkpointing): autograd then clones
    # it for the leaf's .grad (a read and a write), where writing a second copy in the kernel costs
    # only the write.
    ctx.separate_residual_grad = x.requires_grad and residual.requires_grad and (x.is_leaf or residual.is_leaf)


def _backward_add_rms_norm(ctx, dy, dsum, _drstd):
    total, weight, rstd = ctx.saved_tensors
    if dy is None:
        dy = torch.zeros_like(total)
    weight_grad = ctx.needs_input_grad[2]
    dx, dweight, dresidual = RMS_NORM_BACKWARD(dy, dsum, total, weight, rstd, ctx.offset, ctx.casting,
                                               ctx.separate_residual_grad, weight_grad)
    return dx, dresidual if ctx.separate_residual_grad else dx, dweight if weight_grad else None, None, None, None


RMS_NORM_BACKWARD = FusedOp("rms_norm_backward", _rms_norm_backward_impl, fake=_rms_norm_backward_fake)
RMS_NORM = FusedOp("rms_norm", _rms_norm_impl, fake=_rms_norm_fake, setup_context=_setup_rms_norm,
                   backward=_backward_rms_norm)
ADD_RMS_NORM = FusedOp("add_rms_norm", _add_rms_norm_impl, fake=_add_rms_norm_fake,
                       setup_context=_setup_add_rms_norm, backward=_backward_add_rms_norm)


# ----------------------------------------------------------------------------------- public API
def check_norm_options(eps: float, offset: float, eps_name: str = "eps") -> tuple[float, float]:
    """(eps, offset) as floats: eps a non-negative finite number, offset a finite one; else an error naming it."""
    eps, offset = check_real(eps_name, eps), check_real("offset", offset)
    if not 0.0 <= eps < float("inf"):
        raise ValueError(f"{eps_name} must be a non-negative finite number, got {eps}")
    if not -float("inf") < offset < float("inf"):
        raise ValueError(f"offset must be a finite number, got {offset}")
    return eps, offset


def _check_norm_args(x: Tensor, weight: Tensor, eps: float, offset: float, casting: str,
                     **others: Tensor) -> tuple[float, float]:
    """Checks every argument; returns (eps, offset) as floats."""
    eps, offset = check_norm_options(eps, offset)
    check_tensor("x", x)
    check_tensor("weight", weight, rank=1)
    if casting not in CASTINGS:
        raise ValueError(f"casting must be one of {CASTINGS}, got {casting!r}")
    if x.shape[-1] == 0:
        raise ValueError("x must have a non-empty last (hidden) dimension")
    if weight.shape[0] != x.shape[-1]:
        raise ValueError(f"weight has size {weight.shape[0]} but x's hidden size (last dim) is {x.shape[-1]}")
    check_same_device("x", x, weight=weight)
    for name, t in others.items():
        check_tensor(name, t)
        if t.shape != x.shape:
            raise ValueError(f"{name} has shape {tuple(t.shape)} but x has shape {tuple(x.shape)}")
        check_same_device("x", x, **{name: t})
        if t.dtype != x.dtype:
            raise TypeError(f"{name} has dtype {t.dtype} but x has dtype {x.dtype}")
    return eps, offset


def rms_norm(x: Tensor, weight: Tensor, eps: float = 1e-6, offset: float = 0.0, casting: str = "llama") -> Tensor:
    """RMSNorm over the last dimension.

    Args:
        x: [..., hidden], fp32/fp16/bf16 (any dtype on the reference path); any leading shape.
        weight: [hidden], same device as x.
        DTensors (x sharded on any dimension but the last, or replicated; weight replicated) run on the local
        shards and return a DTensor placed as x (``fuselm.ops._common.on_local_shards``).
        eps: added to mean(x^2) before the square root; a Python float (or int) >= 0, not a tensor.
        offset: the norm multiplies by ``offset + weight`` (Gemma: 1.0); a Python float (or int).
        casting: ``"llama"``, ``"gemma"`` or ``"none"`` (module docstring).

    Returns:
        [..., hidden]; dtype x.dtype for ``"gemma"``, else ``promote_types(x.dtype, weight.dtype)``.
    """
    if is_dtensor(x) or is_dtensor(weight):
        return on_local_shards(lambda x, weight: rms_norm(x, weight, eps, offset, casting), "x",
                               {"x": x, "weight": weight}, replicated=("weight",))
    eps, offset = _check_norm_args(x, weight, eps, offset, casting)
    if runs_triton(x):
        return RMS_NORM(x, weight, eps, offset, casting)[0]
    return rms_norm_reference(x, weight, eps, offset, casting)


def add_rms_norm(x: Tensor, residual: Tensor, weight: Tensor, eps: float = 1e-6, offset: float = 0.0,
                 casting: str = "llama") -> tuple[Tensor, Tensor]:
    """Residual add fused into RMSNorm: ``total = x + residual``; returns ``(rms_norm(total), total)``.

    Args:
        x, residual: [..., hidden], same shape, dtype and device.
        weight, eps, offset, casting: as :func:`rms_norm`.

    Returns:
        (normed [..., hidden], total [..., hidden] in x.dtype). ``total`` is the new residual stream.
    """
    if is_dtensor(x) or is_dtensor(residual) or is_dtensor(weight):
        return on_local_shards(lambda x, residual, weight: add_rms_norm(x, residual, weight, eps, offset, casting), "x",
                               {"x": x, "residual": residual, "weight": weight}, replicated=("weight",))
    eps, offset = _check_norm_args(x, weight, eps, offset, casting, residual=residual)
    if runs_triton(x):
        y, total, _ = ADD_RMS_NORM(x, residual, weight, eps, offset, casting)
        return y, total
    return add_rms_norm_reference(x, residual, weight, eps, offset, casting)


