"""Decode projections that read the model's own weights: Triton kernels, PyTorch references, ``fuselm::`` ops.

Three ops, each a whole projection with what surrounds it in a decoder layer:

- :func:`linear_residual`: ``residual + x @ W.T (+ bias)`` (the o and down projections);
- :func:`norm_gated_linear`: ``act(norm(x) @ Wg.T) * (norm(x) @ Wu.T)`` (gate/up + SiLU or tanh-GELU);
- :func:`qkv_rope`: norm, q/k/v projections, biases, q/k head norms, RoPE and the KV-cache write; returns q.

Weights are used where the model keeps them (``nn.Linear`` layout [N, K]: separate q/k/v or Phi-3's packed
qkv, separate gate/up or Phi-3's packed gate_up); nothing is concatenated or copied.

Two paths on the GPU, picked by M = rows of x (B * T):

- M <= ``MAX_STREAMING_ROWS`` (decode; for linear_residual the narrower bounds where it beats cuBLAS, see
  ``LINEAR_RESIDUAL_MAX_ROWS``): one weight-streaming Triton kernel per op. A program owns a block of
  output columns for all M rows (padded to BLOCK_M >= 16 for ``tl.dot``) and streams its weight rows over K,
  so the weights cross HBM once; the norm runs in the prologue (each x tile times the norm weight is the
  operand, the rows' rstd from the same tiles scales the accumulator) and bias, residual, activation, head norm,
  RoPE and the cache write in the epilogue. linear_residual and qkv_rope also
  have split-K configs (the autotuner's choice): SPLIT_K programs share a column block, each over a chunk of K,
  and the last to finish sums their fp32 partials in split order and runs the epilogue, in the same launch.
- larger M (prefill): cuBLAS GEMMs (``torch.addmm`` / ``F.linear``) with fuselm's fused kernels around them.

Rounding points (those of the existing ops and of HF, but one): the GEMM operand of a normed projection is
rounded to x's dtype once, as x * norm weight on the streaming path (the rstd multiplies the fp32 accumulator)
and as :func:`fuselm.rms_norm` gives it on the others (HF rounds x * rstd, then that times the weight: the same
rounding error, in another place); a projection is accumulated in fp32 with its bias and rounded once,
``linear_residual`` adds the residual before that one rounding (``torch.addmm(residual, x, W.T)``), the gated
activation reads the rounded gate and up (as :func:`fuselm.silu_mul`), a head norm reads the rounded projection
and is rounded (as :func:`fuselm.rms_norm`), RoPE reads that and is rounded once (as :func:`fuselm.rope`).

The fused kernels have no backward: they run when no input requires grad (or grad mode is off); otherwise the
differentiable large-M path or the reference runs. Every launch is CUDA-graph-safe once warmed up (autotuning
keys are shapes only; no host syncs).
"""

from __future__ import annotations

import os

import torch
import torch.nn.functional as F
from torch import Tensor

from fuselm.backend import INTERPRETING, runs_triton
from fuselm.ops._common import (
    FusedOp,
    as_rows,
    autotune,
    check_same,
    check_same_device,
    check_tensor,
    dependent_launch,
    let_next_kernel_launch,
    new_output,
    prefetch_to_l2,
    wait_for_previous_kernel,
    zeroed_counters,
)
from fuselm.ops._triton import tl, triton
from fuselm.ops.glu import _REFERENCES as _GLU_REFERENCES
from fuselm.ops.glu import ACTIVATIONS, _activation, gelu_tanh_mul, silu_mul
from fuselm.ops.rms_norm import CASTINGS, check_norm_options, rms_norm, rms_norm_reference
from fuselm.ops.rope import rope_reference

MAX_STREAMING_ROWS = 64  # M = B * T up to this runs the weight-streaming kernels; above, cuBLAS
# linear_residual's kernel only where it beats cuBLAS torch.addmm(residual, x, W.T) (H200, bf16, Llama-3-8B shapes,
# CUDA-graph replays, benchmarks/decode_linear_bench.py, us fused vs addmm, with the split-K configs): o 4096 -> 4096
# 13.7 vs 16.9 at M = 1, 14.8 vs 17.8 at 32, 16.5 vs 15.9 at 64; down 14336 -> 4096 36.7 vs 39.8 at M = 1, 38.5 vs
# 41.1 at 32, 45.8 vs 43.4 at 64. So M <= 32, any K.
LINEAR_RESIDUAL_MAX_ROWS = 32
# Norm in the prologue: the operand is x * norm weight, and each row's rstd, summed from the same x tiles the dot
# reads, scales the fp32 accumulator after the loop, so the norm adds no pass over x and no launch. Up to this many
# rows it runs there; above, the norm runs first as fuselm.rms_norm (one more launch, M x K written and read back).
# benchmarks/decode_linear_bench.py times both at every M (rows "fused, norm in prologue" and "fused, rms_norm
# first"). On the H200 (us, prologue vs rms_norm first, both including the norm; CUDA-graph replays): qkv_rope 19.3
# vs 21.5 at M = 1, 19.7 vs 22.1 at 8, 23.4 vs 24.1 at 32, 47.8 vs 25.5 at 64; norm_gated_linear 64.6 vs 65.2 at 1,
# 65.2 vs 65.2 at 8, 68.8 vs 68.6 at 32, 75.2 vs 70.1 at 64 (BLOCK_M = 64 tiles: the fp32 x tile for the squares
# costs registers). So the prologue up to 32 rows, which also spares the layer step a launch per norm. fp16 always
# runs the norm first: x * weight before the rstd can leave fp16's range (bf16 has fp32's).
GATED_PROLOGUE_NORM_MAX_ROWS = 32
QKV_PROLOGUE_NORM_MAX_ROWS = 32
# The gate/up and q/k/v kernels' prologue norm adds the norm offset (0 or 1, a family's constant) as a constexpr
# instead of a run-time argument (FUSELM_CONSTANT_OFFSET=1; off until the GPU's A/B): see _operand_tile
CONSTANT_OFFSET = os.environ.get("FUSELM_CONSTANT_OFFSET", "0") == "1"
_GATED_GLU = {"silu": silu_mul, "gelu_tanh": gelu_tanh_mul}
# Triton's interpreter multiplies bf16 dot operands as their raw 16-bit integers and truncates fp32 -> bf16 casts:
# under it the kernels upcast bf16 dot operands (exact) and round bf16 to nearest even by hand, as a GPU does
_INTERPRETER = tl.constexpr(INTERPRETING)


# ----------------------------------------------------------------------------------- reference
def _flat(x: Tensor) -> Tensor:
    return x.reshape(x.shape[:-1].numel(), x.shape[-1])


def linear_residual_reference(x: Tensor, weight: Tensor, residual: Tensor, bias: Tensor | None = None) -> Tensor:
    """``residual + x @ weight.T (+ bias)`` as one ``torch.addmm`` (the large-M path and the fallback).
    Shapes as :func:`linear_residual`."""
    out = torch.addmm(_flat(residual), _flat(x), weight.t())
    if bias is not None:
        out = out + bias
    return out.view(residual.shape)


def _normed(x: Tensor, norm_weight: Tensor | None, eps: float, offset: float, casting: str) -> Tensor:
    """The GEMM operand: x, or its RMSNorm rounded to x's dtype."""
    if norm_weight is None:
        return x
    return rms_norm_reference(x, norm_weight, eps, offset, casting).to(x.dtype)


def _gate_up_halves(gate_weight: Tensor, up_weight: Tensor | None) -> tuple[Tensor, Tensor]:
    if up_weight is not None:
        return gate_weight, up_weight
    half = gate_weight.shape[0] // 2
    return gate_weight[:half], gate_weight[half:]


def norm_gated_linear_reference(x: Tensor, norm_weight: Tensor | None, eps: float, gate_weight: Tensor,
                                up_weight: Tensor | None, activation: str = "silu", casting: str = "llama",
                                offset: float = 0.0) -> Tensor:
    """``act(norm(x) @ Wg.T) * (norm(x) @ Wu.T)`` in plain PyTorch. Shapes as :func:`norm_gated_linear`."""
    h = _normed(x, norm_weight, eps, offset, casting)
    gate, up = _gate_up_halves(gate_weight, up_weight)
    return _GLU_REFERENCES[activation](F.linear(h, gate), F.linear(h, up))


def _qkv_weights(q_weight, k_weight, v_weight, q_bias, k_bias, v_bias, num_heads, num_kv_heads, head_dim):
    """(weight, bias) of q, k and v: the packed [(Hq + 2 Hkv) D, hidden] weight (and bias) split into views."""
    if k_weight is not None:
        return (q_weight, q_bias), (k_weight, k_bias), (v_weight, v_bias)
    sizes = [num_heads * head_dim, num_kv_heads * head_dim, num_kv_heads * head_dim]
    weights = q_weight.split(sizes)
    biases = q_bias.split(sizes) if q_bias is not None else (None, None, None)
    return tuple(zip(weights, biases))


def _write_cache(cache: Tensor, new: Tensor, cache_positions: Tensor) -> None:
    """cache [B, H, L, D][b, :, cache_positions[b, t]] = new[b, t] for new [B, T, H, D]; a position outside [0, L)
    writes nothing (as the kernels do). The mask's selection syncs with the host on CUDA: this fallback never runs in
    a captured graph (the engine captures the kernels; with the reference backend it captures nothing)."""
    batch, seq_len = new.shape[:2]
    positions = cache_positions.expand(batch, seq_len).long()
    rows = torch.arange(batch, device=cache.device)[:, None].expand(batch, seq_len)
    inside = (positions >= 0) & (positions < cache.shape[2])
    cache[rows[inside], :, positions[inside]] = new[inside].to(cache.dtype)


def qkv_rope_reference(x: Tensor, norm_weight: Tensor | None, eps: float, q_weight: Tensor, k_weight: Tensor | None,
                       v_weight: Tensor | None, cos: Tensor, sin: Tensor, k_cache: Tensor, v_cache: Tensor,
                       cache_positions: Tensor, num_heads: int, num_kv_heads: int, q_bias: Tensor | None = None,
                       k_bias: Tensor | None = None, v_bias: Tensor | None = None, q_norm_weight: Tensor | None = None,
                       k_norm_weight: Tensor | None = None, qk_norm_eps: float | None = None, casting: str = "llama",
                       offset: float = 0.0, last_only: bool = False) -> Tensor:
    """Plain PyTorch :func:`qkv_rope` (the fallback and the test oracle): writes the caches, returns q."""
    batch, seq_len, _ = x.shape
    head_dim = k_cache.shape[-1]
    h = _normed(x, norm_weight, eps, offset, casting)
    (wq, bq), (wk, bk), (wv, bv) = _qkv_weights(q_weight, k_weight, v_weight, q_bias, k_bias, v_bias, num_heads,
                                                num_kv_heads, head_dim)
    q = F.linear(h, wq, bq).view(batch, seq_len, num_heads, head_dim)
    k = F.linear(h, wk, bk).view(batch, seq_len, num_kv_heads, head_dim)
    v = F.linear(h, wv, bv).view(batch, seq_len, num_kv_heads, head_dim)
    if q_norm_weight is not None:
        head_eps = eps if qk_norm_eps is None else qk_norm_eps
        q = rms_norm_reference(q, q_norm_weight, head_eps, offset, casting).to(x.dtype)
        k = rms_norm_reference(k, k_norm_weight, head_eps, offset, casting).to(x.dtype)
    q, k = rope_reference(q, k, cos, sin, layout="bshd")
    _write_cache(k_cache, k, cache_positions)
    _write_cache(v_cache, v, cache_positions)
    return (q[:, -1:] if last_only else q).contiguous().transpose(1, 2)


# ----------------------------------------------------------------------------------- kernel helpers
@triton.jit
def _operand_tile(x_ptr, norm_weight_ptr, rows, row_ok, cols, stride_xm, n_inner, sum_of_squares, offset,
                  HAS_NORM: tl.constexpr, OPERAND_DTYPE: tl.constexpr, EVEN_K: tl.constexpr,
                  CONSTANT_OFFSET: tl.constexpr):
    """The [BLOCK_M, BLOCK_K] GEMM operand tile at columns cols, and the rows' running fp32 sum of squares.

    Without a norm: x, and the sum unchanged. With one: x * (norm weight + offset) rounded once to the operand
    dtype, and the sum plus this tile's squares; RMSNorm's per-row factor rstd commutes with the dot, so
    :func:`_scale_by_rstd` applies it to the fp32 accumulator once the sum covers all of K. CONSTANT_OFFSET (None,
    or the offset's value): the offset as a constant. With a run-time offset Triton 3.6 rounds the product in a
    blocked layout and stores it to shared memory a second time to reach the mma's operand layout, a store and a
    barrier a K tile; with a constant it multiplies in the operand's layout (static, sm_90a; benchmarks/NOTES.md,
    the norm offset as a constant)."""
    if EVEN_K:  # every K tile whole: no column mask
        x = tl.load(x_ptr + rows[:, None] * stride_xm + cols[None, :], mask=row_ok[:, None], other=0.0)
    else:
        x = tl.load(x_ptr + rows[:, None] * stride_xm + cols[None, :],
                    mask=row_ok[:, None] & (cols[None, :] < n_inner), other=0.0)
    if HAS_NORM:
        x = x.to(tl.float32)
        sum_of_squares += tl.sum(x * x, axis=1)
        if EVEN_K:
            weight = tl.load(norm_weight_ptr + cols).to(tl.float32)
        else:
            weight = tl.load(norm_weight_ptr + cols, mask=cols < n_inner, other=0.0).to(tl.float32)
        if CONSTANT_OFFSET is None:
            weight += offset
        else:
            weight += CONSTANT_OFFSET
        return _cast(x * weight[None, :], OPERAND_DTYPE), sum_of_squares
    return x.to(OPERAND_DTYPE), sum_of_squares


@triton.jit
def _scale_by_rstd(acc, sum_of_squares, n_inner, eps, HAS_NORM: tl.constexpr):
    """acc [BLOCK_M, *] times each row's rstd = rsqrt(mean of squares + eps) (acc unchanged without a norm)."""
    if HAS_NORM:
        return acc * tl.rsqrt(sum_of_squares / n_inner + eps)[:, None]
    return acc


@triton.jit
def _weight_tile(w_ptr, weight_rows, rows_ok, cols, stride_wn, n_inner, WHOLE: tl.constexpr):
    """The [BLOCK_K, BLOCK_N] transposed tile W[weight_rows, cols].T, ready for tl.dot(x_tile, w_tile); WHOLE: every
    row exists and every column is below n_inner (no mask)."""
    if WHOLE:
        return tl.load(w_ptr + weight_rows[None, :] * stride_wn + cols[:, None])
    return tl.load(w_ptr + weight_rows[None, :] * stride_wn + cols[:, None],
                   mask=rows_ok[None, :] & (cols[:, None] < n_inner), other=0.0)


@triton.jit
def _prefetch_weight_rows(w_ptr, weight_rows, rows_ok, k_lo, stride_wn, n_inner, PREFETCH_LINES: tl.constexpr):
    """Into L2: the first PREFETCH_LINES 128-byte lines of W[weight_rows, k_lo:] (before the dependent wait)."""
    if PREFETCH_LINES > 0:
        per_line: tl.constexpr = 1024 // w_ptr.dtype.element_ty.primitive_bitwidth
        cols = k_lo + tl.arange(0, PREFETCH_LINES) * per_line
        prefetch_to_l2(w_ptr + weight_rows[:, None] * stride_wn + cols[None, :],
                       rows_ok[:, None] & (cols[None, :] < n_inner))


@triton.jit
def _cast(x, DTYPE: tl.constexpr):
    """x.to(DTYPE), rounding to nearest even (by hand in the interpreter, whose fp32 -> bf16 cast truncates)."""
    if _INTERPRETER and DTYPE == tl.bfloat16:
        bits = x.to(tl.float32).to(tl.uint32, bitcast=True)
        bits = (bits + 0x7FFF + ((bits >> 16) & 1)) & 0xFFFF0000
        x = bits.to(tl.float32, bitcast=True)
    return x.to(DTYPE)


@triton.jit
def _dot(x, w, acc):
    """acc + x @ w with fp32 accumulation (fp32 operands in IEEE fp32, not TF32, as torch's matmul)."""
    if _INTERPRETER and x.dtype == tl.bfloat16:
        x, w = x.to(tl.float32), w.to(tl.float32)
    return tl.dot(x, w, acc, input_precision="ieee")


def _prune_dot_sizes(configs, named_args, **kwargs):
    """On a GPU tl.dot needs every tile side >= 16: drops the head splits too fine for a head's columns."""
    block_half = {**named_args, **kwargs}.get("BLOCK_HALF_HEAD")
    kept = [c for c in configs if block_half is None or block_half // c.kwargs.get("SPLIT", 1) >= 16]
    return kept or configs[:1]


_PRUNE = {"early_config_prune": _prune_dot_sizes}
# Shared memory per pipeline stage is about (weight tiles x BLOCK_N + BLOCK_M) x BLOCK_K elements: the configs keep
# stages x that under ~192 KB for bf16 at BLOCK_M = 64 (two weight tiles); the last fits fp32 as well.
_STREAMING_CONFIGS = [  # (BLOCK_N, BLOCK_K, warps, stages); the first is the one the interpreter runs
    triton.Config({"BLOCK_N": n, "BLOCK_K": k}, num_warps=w, num_stages=s)
    for n, k, w, s in [(32, 128, 4, 4), (64, 128, 4, 4), (32, 256, 4, 3), (64, 256, 8, 2), (128, 64, 8, 3),
                       (16, 256, 4, 4), (128, 64, 4, 4), (32, 64, 4, 2)]
]
_STREAMING_KEY = ["BLOCK_M", "n_out", "n_inner"]


# ----------------------------------------------------------------------------------- linear + residual kernel
# Split-K configs: a program owns a BLOCK_N column block over 1 / SPLIT_K of K, so a projection with few column blocks
# (o: 4096 / 16 = 256 programs on 132 SMs) keeps more weight loads in flight. The partials meet in one launch: each
# writes its fp32 [M, BLOCK_N] partial, takes a ticket, and the last of the column block sums the SPLIT_K partials in
# split order (deterministic) and runs the epilogue. The autotuner keeps them only where they win. Wider column blocks
# at M = 32 (BLOCK_N 64 and 128 with split-K, re-reading less of x per weight byte) lost to these on an H100
# (benchmarks/NOTES.md, session 18).
MAX_SPLIT_K = 4
_LINEAR_RESIDUAL_CONFIGS = [
    triton.Config({**config.kwargs, "SPLIT_K": 1}, num_warps=config.num_warps, num_stages=config.num_stages)
    for config in _STREAMING_CONFIGS
] + [
    triton.Config({"BLOCK_N": n, "BLOCK_K": k, "SPLIT_K": split}, num_warps=w, num_stages=s)
    for n, k, split, w, s in [(16, 256, 2, 4, 4), (16, 256, 4, 4, 4), (32, 256, 2, 4, 3), (32, 256, 4, 4, 3),
                              (16, 128, 4, 4, 4)]
]


@triton.jit
def _sum_split_partials(partial_ptr, rows, row_ok, cols_n, col_ok, n_rows, n_out, SPLIT_K: tl.constexpr,
                        BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
    """The [BLOCK_M, BLOCK_N] sum of the SPLIT_K fp32 partials [SPLIT_K, M, N] at (rows, cols_n), added in split
    order. Other programs (other SMs) wrote them: read at L2 (.cg), past L1."""
    total = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    mask = row_ok[:, None] & col_ok[None, :]
    for split in tl.static_range(SPLIT_K):
        total += tl.load(partial_ptr + (split * n_rows + rows[:, None]) * n_out + cols_n[None, :], mask=mask,
                         other=0.0, cache_modifier=".cg")
    return total


@autotune(_LINEAR_RESIDUAL_CONFIGS, key=_STREAMING_KEY)
@triton.jit
def _linear_residual_kernel(
    x_ptr, w_ptr, bias_ptr, residual_ptr, out_ptr, partial_ptr, tickets_ptr,
    n_rows, n_out, n_inner, stride_xm, stride_wn, stride_rm, stride_om,
    HAS_BIAS: tl.constexpr, DEPENDENT: tl.constexpr, PREFETCH_LINES: tl.constexpr, BLOCK_M: tl.constexpr,
    EVEN_K: tl.constexpr, EVEN_N: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, SPLIT_K: tl.constexpr,
):
    # Program (n, s) owns output columns [n * BLOCK_N, +BLOCK_N) of all M rows over K chunk s of SPLIT_K. Streams
    # its BLOCK_N weight rows over the chunk once (every weight byte read by one program) and re-reads x's chunk
    # (M x K / SPLIT_K, from L2). With SPLIT_K = 1 it writes M x BLOCK_N outputs = residual + acc (+ bias), rounded
    # once; otherwise an fp32 M x BLOCK_N partial, and the last program of column block n to take its ticket reads
    # the SPLIT_K partials back, writes the outputs and resets the ticket.
    cols_n = (tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)).to(tl.int64)
    col_ok = cols_n < n_out
    rows = tl.arange(0, BLOCK_M).to(tl.int64)
    row_ok = rows < n_rows
    chunk = tl.cdiv(tl.cdiv(n_inner, SPLIT_K), BLOCK_K) * BLOCK_K
    k_lo = tl.program_id(1) * chunk
    acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    _prefetch_weight_rows(w_ptr, cols_n, col_ok, k_lo, stride_wn, n_inner, PREFETCH_LINES)
    wait_for_previous_kernel(DEPENDENT)
    for start in range(k_lo, tl.minimum(k_lo + chunk, n_inner), BLOCK_K):
        cols_k = start + tl.arange(0, BLOCK_K)
        x, _ = _operand_tile(x_ptr, x_ptr, rows, row_ok, cols_k, stride_xm, n_inner, 0.0, 0.0, False,
                             w_ptr.dtype.element_ty, EVEN_K, None)
        acc = _dot(x, _weight_tile(w_ptr, cols_n, col_ok, cols_k, stride_wn, n_inner, EVEN_K and EVEN_N), acc)
    let_next_kernel_launch(DEPENDENT)
    mask = row_ok[:, None] & col_ok[None, :]
    last = True
    if SPLIT_K > 1:
        _store_partial(partial_ptr, acc, rows, row_ok, cols_n, col_ok, n_rows, n_out)
        tl.debug_barrier()  # every thread's partial is written before the ticket releases it
        ticket = tl.atomic_add(tickets_ptr + tl.program_id(0), 1, sem="acq_rel", scope="gpu")
        last = ticket == SPLIT_K - 1
        if last:
            acc = _sum_split_partials(partial_ptr, rows, row_ok, cols_n, col_ok, n_rows, n_out, SPLIT_K, BLOCK_M,
                                      BLOCK_N)
            tl.store(tickets_ptr + tl.program_id(0), 0)  # ready for the next launch
    if last:
        acc += tl.load(residual_ptr + rows[:, None] * stride_rm + cols_n[None, :], mask=mask,
                       other=0.0).to(tl.float32)
        if HAS_BIAS:
            acc += tl.load(bias_ptr + cols_n, mask=col_ok, other=0.0).to(tl.float32)[None, :]
        tl.store(out_ptr + rows[:, None] * stride_om + cols_n[None, :], _cast(acc, out_ptr.dtype.element_ty),
                 mask=mask)


# ----------------------------------------------------------------------------------- norm + gate/up kernel
@autotune(_STREAMING_CONFIGS, key=_STREAMING_KEY + ["HAS_NORM"])
@triton.jit
def _norm_gated_kernel(
    x_ptr, norm_weight_ptr, gate_ptr, up_ptr, out_ptr,
    n_rows, n_out, n_inner, stride_xm, stride_gn, stride_un, stride_om, eps, offset,
    HAS_NORM: tl.constexpr, CONSTANT_OFFSET: tl.constexpr, ACTIVATION: tl.constexpr, DEPENDENT: tl.constexpr,
    PREFETCH_LINES: tl.constexpr, BLOCK_M: tl.constexpr, EVEN_K: tl.constexpr, EVEN_N: tl.constexpr,
    BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
):
    # Program owns columns [pid * BLOCK_N, +BLOCK_N) of the I outputs, for all M rows: the same BLOCK_N rows of
    # gate and of up, streamed over K once (2 * BLOCK_N * K weight elements), so act(gate) * up runs in the
    # epilogue. Re-reads x (M x K, from L2) once; with HAS_NORM each x tile times the norm weight is the operand
    # and the rows' rstd, summed from the same tiles, scales both accumulators after the loop. Writes M x BLOCK_N.
    cols_n = (tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)).to(tl.int64)
    col_ok = cols_n < n_out
    rows = tl.arange(0, BLOCK_M).to(tl.int64)
    row_ok = rows < n_rows
    _prefetch_weight_rows(gate_ptr, cols_n, col_ok, 0, stride_gn, n_inner, PREFETCH_LINES)
    _prefetch_weight_rows(up_ptr, cols_n, col_ok, 0, stride_un, n_inner, PREFETCH_LINES)
    wait_for_previous_kernel(DEPENDENT)
    sum_of_squares = tl.zeros([BLOCK_M], dtype=tl.float32)
    acc_gate = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    acc_up = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    for start in range(0, n_inner, BLOCK_K):
        cols_k = start + tl.arange(0, BLOCK_K)
        x, sum_of_squares = _operand_tile(x_ptr, norm_weight_ptr, rows, row_ok, cols_k, stride_xm, n_inner,
                                          sum_of_squares, offset, HAS_NORM, gate_ptr.dtype.element_ty, EVEN_K,
                                          CONSTANT_OFFSET)
        acc_gate = _dot(x, _weight_tile(gate_ptr, cols_n, col_ok, cols_k, stride_gn, n_inner, EVEN_K and EVEN_N),
                        acc_gate)
        acc_up = _dot(x, _weight_tile(up_ptr, cols_n, col_ok, cols_k, stride_un, n_inner, EVEN_K and EVEN_N), acc_up)
    let_next_kernel_launch(DEPENDENT)
    acc_gate = _scale_by_rstd(acc_gate, sum_of_squares, n_inner, eps, HAS_NORM)
    acc_up = _scale_by_rstd(acc_up, sum_of_squares, n_inner, eps, HAS_NORM)
    out_dtype = out_ptr.dtype.element_ty
    gate = _cast(acc_gate, out_dtype).to(tl.float32)  # the rounded projections, as silu_mul reads them
    activated, _ = _activation(gate, ACTIVATION)
    result = activated * _cast(acc_up, out_dtype).to(tl.float32)
    tl.store(out_ptr + rows[:, None] * stride_om + cols_n[None, :], _cast(result, out_dtype),
             mask=row_ok[:, None] & col_ok[None, :])


# ----------------------------------------------------------------------------------- q/k/v + RoPE + cache kernels
@triton.jit
def _head_columns(part, half, head_dim, SPLIT: tl.constexpr, BLOCK_HALF_HEAD: tl.constexpr,
                  BLOCK_TAIL: tl.constexpr):
    """Columns of a head that part ``part`` of SPLIT owns: d1 in the first rotary half (d1 + half is its pair)
    and the pass-through tail dt >= 2 * half (part 0 owns all of it), with their masks."""
    per_part: tl.constexpr = BLOCK_HALF_HEAD // SPLIT
    d1 = part * per_part + tl.arange(0, per_part)
    tail = 2 * half + tl.arange(0, BLOCK_TAIL)
    # tl.where, not `& (part == 0)`: triton 3.9's interpreter makes an int32 mask of a tensor & a scalar comparison
    return d1, d1 < half, tail, tl.where(part == 0, tail < head_dim, False)


@triton.jit
def _select_head(slot, n_heads_q, n_heads_kv, q_ptr, k_ptr, v_ptr, stride_q, stride_k, stride_v):
    """(kind 0/1/2 for q/k/v, head within that kind, its pointer and row stride) of head slot ``slot``."""
    kind = (slot >= n_heads_q).to(tl.int32) + (slot >= n_heads_q + n_heads_kv).to(tl.int32)
    head = slot - tl.where(kind == 0, 0, n_heads_q) - tl.where(kind == 2, n_heads_kv, 0)
    if kind == 0:
        ptr, stride = q_ptr, stride_q
    elif kind == 1:
        ptr, stride = k_ptr, stride_k
    else:
        ptr, stride = v_ptr, stride_v
    return kind, head, ptr, stride


@triton.jit
def _head_norm(a, weight_ptr, cols, ok, rstd, offset, CAST_NORMED: tl.constexpr, DTYPE: tl.constexpr):
    normed = a * rstd[:, None]
    if CAST_NORMED:
        normed = _cast(normed, DTYPE).to(tl.float32)
    weight = tl.load(weight_ptr + cols, mask=ok, other=0.0).to(tl.float32) + offset
    return _cast(normed * weight[None, :], DTYPE).to(tl.float32)


@triton.jit
def _rotary_tables(cos_ptr, sin_ptr, rows, row_ok, seq_len, d1, ok1, half, rotates,
                   stride_cb, stride_ct, stride_cd, stride_sb, stride_st, stride_sd):
    """cos and sin at columns d1 and d1 + half of each row's (b, t): four fp32 [BLOCK_M, len(d1)] tiles, read once
    for every head the caller rotates with them; nothing is read where ``rotates`` is False (a v head)."""
    b, t = rows // seq_len, rows % seq_len
    mask = tl.where(rotates, row_ok, False)[:, None] & ok1[None, :]
    cos_row = (cos_ptr + b * stride_cb + t * stride_ct)[:, None]
    sin_row = (sin_ptr + b * stride_sb + t * stride_st)[:, None]
    c1 = tl.load(cos_row + d1[None, :] * stride_cd, mask=mask, other=0.0).to(tl.float32)
    c2 = tl.load(cos_row + (d1 + half)[None, :] * stride_cd, mask=mask, other=0.0).to(tl.float32)
    n1 = tl.load(sin_row + d1[None, :] * stride_sd, mask=mask, other=0.0).to(tl.float32)
    n2 = tl.load(sin_row + (d1 + half)[None, :] * stride_sd, mask=mask, other=0.0).to(tl.float32)
    return c1, c2, n1, n2


@triton.jit
def _cache_rows(positions_ptr, rows, row_ok, seq_len, stride_pb, stride_pt, writes_cache):
    """Each row's cache position (int64; -1 where the row does not exist or ``writes_cache`` is False: a q head)."""
    b, t = rows // seq_len, rows % seq_len
    return tl.load(positions_ptr + b * stride_pb + t * stride_pt, mask=tl.where(writes_cache, row_ok, False),
                   other=-1).to(tl.int64)


@triton.jit
def _finish_head(
    a1, a2, tail_values, kind, head, rows, row_ok, d1, ok1, tail, tail_ok, c1, c2, n1, n2, position,
    q_norm_ptr, k_norm_ptr, q_out_ptr, k_cache_ptr, v_cache_ptr,
    seq_len, head_dim, half, cache_len, head_eps, offset,
    stride_qb, stride_qh, stride_qt, stride_qd, stride_kb, stride_kh, stride_kl, stride_kd,
    stride_vb, stride_vh, stride_vl, stride_vd,
    HAS_HEAD_NORM: tl.constexpr, CAST_NORMED: tl.constexpr, HAS_TAIL: tl.constexpr,
):
    """Epilogue of one head's projection (a1, a2: the rounded [BLOCK_M, *] columns d1 and d1 + half, tail_values
    those of tail): head norm and RoPE (with :func:`_rotary_tables`' c1, c2, n1, n2) for q and k, then the store,
    q into q_out at its step t, k and v into their cache at the row's position (:func:`_cache_rows`; rows whose
    position is outside [0, cache_len) write nothing)."""
    dtype = q_out_ptr.dtype.element_ty
    b, t = rows // seq_len, rows % seq_len
    if kind < 2:
        if HAS_HEAD_NORM:  # the whole head is in this program (SPLIT = 1)
            sum_of_squares = tl.sum(a1 * a1, axis=1) + tl.sum(a2 * a2, axis=1)
            if HAS_TAIL:
                sum_of_squares += tl.sum(tail_values * tail_values, axis=1)
            rstd = tl.rsqrt(sum_of_squares / head_dim + head_eps)
            norm_ptr = q_norm_ptr if kind == 0 else k_norm_ptr
            a1 = _head_norm(a1, norm_ptr, d1, ok1, rstd, offset, CAST_NORMED, dtype)
            a2 = _head_norm(a2, norm_ptr, d1 + half, ok1, rstd, offset, CAST_NORMED, dtype)
            if HAS_TAIL:
                tail_values = _head_norm(tail_values, norm_ptr, tail, tail_ok, rstd, offset, CAST_NORMED, dtype)
        a1, a2 = a1 * c1 - a2 * n1, a2 * c2 + a1 * n2
    if kind == 0:
        out, stride_d, write = q_out_ptr + b * stride_qb + head * stride_qh + t * stride_qt, stride_qd, row_ok
    else:
        write = row_ok & (position >= 0) & (position < cache_len)
        if kind == 1:
            out, stride_d = k_cache_ptr + b * stride_kb + head * stride_kh + position * stride_kl, stride_kd
        else:
            out, stride_d = v_cache_ptr + b * stride_vb + head * stride_vh + position * stride_vl, stride_vd
    mask = write[:, None] & ok1[None, :]
    tl.store(out[:, None] + d1[None, :] * stride_d, _cast(a1, dtype), mask=mask)
    tl.store(out[:, None] + (d1 + half)[None, :] * stride_d, _cast(a2, dtype), mask=mask)
    if HAS_TAIL:
        tl.store(out[:, None] + tail[None, :] * stride_d, _cast(tail_values, dtype),
                 mask=write[:, None] & tail_ok[None, :])


@triton.jit
def _qkv_rope_kernel(
    x_ptr, norm_weight_ptr, wq_ptr, wk_ptr, wv_ptr, bq_ptr, bk_ptr, bv_ptr, q_norm_ptr, k_norm_ptr,
    cos_ptr, sin_ptr, positions_ptr, q_out_ptr, k_cache_ptr, v_cache_ptr, partial_ptr, squares_partial_ptr,
    tickets_ptr, n_rows, seq_len, n_inner, n_heads_q, n_heads_kv, head_dim, half, cache_len,
    stride_xm, stride_wq, stride_wk, stride_wv,
    stride_cb, stride_ct, stride_cd, stride_sb, stride_st, stride_sd, stride_pb, stride_pt,
    stride_qb, stride_qh, stride_qt, stride_qd, stride_kb, stride_kh, stride_kl, stride_kd,
    stride_vb, stride_vh, stride_vl, stride_vd,
    eps, head_eps, offset,
    HAS_NORM: tl.constexpr, CONSTANT_OFFSET: tl.constexpr, HAS_BIAS: tl.constexpr, HAS_HEAD_NORM: tl.constexpr,
    CAST_NORMED: tl.constexpr, HAS_TAIL: tl.constexpr, DEPENDENT: tl.constexpr, PREFETCH_LINES: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_HALF_HEAD: tl.constexpr, BLOCK_TAIL: tl.constexpr, EVEN_K: tl.constexpr,
    FULL_HALF: tl.constexpr, SPLIT: tl.constexpr, BLOCK_K: tl.constexpr, SPLIT_K: tl.constexpr,
):
    # Program (p, s) owns part p % SPLIT of head slot p // SPLIT (slots: the Hq q heads, then the Hkv k heads, then
    # the Hkv v heads) for all M rows, over K chunk s of SPLIT_K: the rotary pairs (d1, d1 + half) of its part and,
    # in part 0, the tail columns. Streams those weight rows over the chunk once (D / SPLIT rows: every weight byte
    # read by one program) and re-reads x (M x K) from L2; with HAS_NORM its tiles' squares sum to each row's rstd,
    # applied after the dot (_operand_tile). With SPLIT_K > 1 it writes its fp32 M x D / SPLIT partial (and its M
    # partial sums of squares) and takes a ticket, and the last program of the part sums the SPLIT_K partials in split
    # order (as _linear_residual_kernel does). That one runs rstd, bias, head norm, RoPE and the store in the
    # epilogue: M x D / SPLIT elements to q_out or to the caches.
    slot, part = tl.program_id(0) // SPLIT, tl.program_id(0) % SPLIT
    kind, head, w_ptr, stride_w = _select_head(slot, n_heads_q, n_heads_kv, wq_ptr, wk_ptr, wv_ptr, stride_wq,
                                               stride_wk, stride_wv)
    d1, ok1, tail, tail_ok = _head_columns(part, half, head_dim, SPLIT, BLOCK_HALF_HEAD, BLOCK_TAIL)
    rows_first, rows_second, rows_tail = head * head_dim + d1, head * head_dim + half + d1, head * head_dim + tail
    rows = tl.arange(0, BLOCK_M).to(tl.int64)
    row_ok = rows < n_rows
    chunk = tl.cdiv(tl.cdiv(n_inner, SPLIT_K), BLOCK_K) * BLOCK_K
    k_lo = tl.program_id(1) * chunk
    _prefetch_weight_rows(w_ptr, rows_first, ok1, k_lo, stride_w, n_inner, PREFETCH_LINES)
    _prefetch_weight_rows(w_ptr, rows_second, ok1, k_lo, stride_w, n_inner, PREFETCH_LINES)
    wait_for_previous_kernel(DEPENDENT)
    sum_of_squares = tl.zeros([BLOCK_M], dtype=tl.float32)
    acc1 = tl.zeros([BLOCK_M, BLOCK_HALF_HEAD // SPLIT], dtype=tl.float32)
    acc2 = tl.zeros([BLOCK_M, BLOCK_HALF_HEAD // SPLIT], dtype=tl.float32)
    acc_tail = tl.zeros([BLOCK_M, BLOCK_TAIL], dtype=tl.float32)
    for start in range(k_lo, tl.minimum(k_lo + chunk, n_inner), BLOCK_K):
        cols_k = start + tl.arange(0, BLOCK_K)
        x, sum_of_squares = _operand_tile(x_ptr, norm_weight_ptr, rows, row_ok, cols_k, stride_xm, n_inner,
                                          sum_of_squares, offset, HAS_NORM, wq_ptr.dtype.element_ty, EVEN_K,
                                          CONSTANT_OFFSET)
        acc1 = _dot(x, _weight_tile(w_ptr, rows_first, ok1, cols_k, stride_w, n_inner, EVEN_K and FULL_HALF), acc1)
        acc2 = _dot(x, _weight_tile(w_ptr, rows_second, ok1, cols_k, stride_w, n_inner, EVEN_K and FULL_HALF), acc2)
        if HAS_TAIL:
            acc_tail = _dot(x, _weight_tile(w_ptr, rows_tail, tail_ok, cols_k, stride_w, n_inner, False), acc_tail)
    let_next_kernel_launch(DEPENDENT)
    last = True
    if SPLIT_K > 1:
        # the partial's columns: slot s's head_dim columns of the [SPLIT_K, M, slots * D] fp32 workspace
        n_cols = (n_heads_q + 2 * n_heads_kv) * head_dim
        columns = slot * head_dim
        _store_partial(partial_ptr, acc1, rows, row_ok, columns + d1, ok1, n_rows, n_cols)
        _store_partial(partial_ptr, acc2, rows, row_ok, columns + half + d1, ok1, n_rows, n_cols)
        if HAS_TAIL:
            _store_partial(partial_ptr, acc_tail, rows, row_ok, columns + tail, tail_ok, n_rows, n_cols)
        if HAS_NORM:  # [SPLIT_K, programs, M]: this program's row sums of squares over its chunk
            tl.store(squares_partial_ptr + (tl.program_id(1) * tl.num_programs(0) + tl.program_id(0)) * n_rows + rows,
                     sum_of_squares, mask=row_ok)
        tl.debug_barrier()  # every thread's partial is written before the ticket releases it
        ticket = tl.atomic_add(tickets_ptr + tl.program_id(0), 1, sem="acq_rel", scope="gpu")
        last = ticket == SPLIT_K - 1
        if last:
            acc1 = _sum_split_partials(partial_ptr, rows, row_ok, columns + d1, ok1, n_rows, n_cols, SPLIT_K,
                                       BLOCK_M, BLOCK_HALF_HEAD // SPLIT)
            acc2 = _sum_split_partials(partial_ptr, rows, row_ok, columns + half + d1, ok1, n_rows, n_cols, SPLIT_K,
                                       BLOCK_M, BLOCK_HALF_HEAD // SPLIT)
            if HAS_TAIL:
                acc_tail = _sum_split_partials(partial_ptr, rows, row_ok, columns + tail, tail_ok, n_rows, n_cols,
                                               SPLIT_K, BLOCK_M, BLOCK_TAIL)
            if HAS_NORM:
                sum_of_squares = tl.zeros([BLOCK_M], dtype=tl.float32)
                for split in tl.static_range(SPLIT_K):
                    sum_of_squares += tl.load(squares_partial_ptr + (split * tl.num_programs(0) + tl.program_id(0))
                                              * n_rows + rows, mask=row_ok, other=0.0, cache_modifier=".cg")
            tl.store(tickets_ptr + tl.program_id(0), 0)  # ready for the next launch
    if last:
        _qkv_rope_epilogue(
            _scale_by_rstd(acc1, sum_of_squares, n_inner, eps, HAS_NORM),
            _scale_by_rstd(acc2, sum_of_squares, n_inner, eps, HAS_NORM),
            _scale_by_rstd(acc_tail, sum_of_squares, n_inner, eps, HAS_NORM),
            slot, kind, head, rows, row_ok, d1, ok1, tail, tail_ok, rows_first, rows_second, rows_tail,
            bq_ptr, bk_ptr, bv_ptr, q_norm_ptr, k_norm_ptr, cos_ptr, sin_ptr, positions_ptr, q_out_ptr,
            k_cache_ptr, v_cache_ptr, n_heads_q, n_heads_kv, seq_len, head_dim, half, cache_len, head_eps, offset,
            stride_cb, stride_ct, stride_cd, stride_sb, stride_st, stride_sd, stride_pb, stride_pt,
            stride_qb, stride_qh, stride_qt, stride_qd, stride_kb, stride_kh, stride_kl, stride_kd,
            stride_vb, stride_vh, stride_vl, stride_vd, HAS_BIAS, HAS_HEAD_NORM, CAST_NORMED, HAS_TAIL)


@triton.jit
def _store_partial(partial_ptr, acc, rows, row_ok, cols, col_ok, n_rows, n_out):
    """Split program_id(1)'s fp32 partial acc [BLOCK_M, len(cols)] into the [SPLIT_K, M, n_out] workspace."""
    tl.store(partial_ptr + (tl.program_id(1) * n_rows + rows[:, None]) * n_out + cols[None, :], acc,
             mask=row_ok[:, None] & col_ok[None, :])


@triton.jit
def _qkv_rope_epilogue(
    acc1, acc2, acc_tail, slot, kind, head, rows, row_ok, d1, ok1, tail, tail_ok, rows_first, rows_second, rows_tail,
    bq_ptr, bk_ptr, bv_ptr, q_norm_ptr, k_norm_ptr, cos_ptr, sin_ptr, positions_ptr, q_out_ptr, k_cache_ptr,
    v_cache_ptr, n_heads_q, n_heads_kv, seq_len, head_dim, half, cache_len, head_eps, offset,
    stride_cb, stride_ct, stride_cd, stride_sb, stride_st, stride_sd, stride_pb, stride_pt,
    stride_qb, stride_qh, stride_qt, stride_qd, stride_kb, stride_kh, stride_kl, stride_kd,
    stride_vb, stride_vh, stride_vl, stride_vd,
    HAS_BIAS: tl.constexpr, HAS_HEAD_NORM: tl.constexpr, CAST_NORMED: tl.constexpr, HAS_TAIL: tl.constexpr,
):
    """A part's whole fp32 projection (acc1, acc2: columns d1 and d1 + half; acc_tail: the tail) plus its bias,
    rounded once, then :func:`_finish_head`."""
    if HAS_BIAS:
        _, _, b_ptr, _ = _select_head(slot, n_heads_q, n_heads_kv, bq_ptr, bk_ptr, bv_ptr, 0, 0, 0)
        acc1 += tl.load(b_ptr + rows_first, mask=ok1, other=0.0).to(tl.float32)[None, :]
        acc2 += tl.load(b_ptr + rows_second, mask=ok1, other=0.0).to(tl.float32)[None, :]
        if HAS_TAIL:
            acc_tail += tl.load(b_ptr + rows_tail, mask=tail_ok, other=0.0).to(tl.float32)[None, :]
    dtype = q_out_ptr.dtype.element_ty
    c1, c2, n1, n2 = _rotary_tables(cos_ptr, sin_ptr, rows, row_ok, seq_len, d1, ok1, half, kind < 2,
                                    stride_cb, stride_ct, stride_cd, stride_sb, stride_st, stride_sd)
    _finish_head(
        _cast(acc1, dtype).to(tl.float32), _cast(acc2, dtype).to(tl.float32), _cast(acc_tail, dtype).to(tl.float32),
        kind, head, rows, row_ok, d1, ok1, tail, tail_ok, c1, c2, n1, n2,
        _cache_rows(positions_ptr, rows, row_ok, seq_len, stride_pb, stride_pt, kind > 0),
        q_norm_ptr, k_norm_ptr, q_out_ptr, k_cache_ptr, v_cache_ptr, seq_len, head_dim, half, cache_len, head_eps,
        offset, stride_qb, stride_qh, stride_qt, stride_qd, stride_kb, stride_kh, stride_kl, stride_kd,
        stride_vb, stride_vh, stride_vl, stride_vd, HAS_HEAD_NORM, CAST_NORMED, HAS_TAIL)


_QKV_KEY = ["BLOCK_M", "n_inner", "n_heads_q", "n_heads_kv", "head_dim", "half", "HAS_NORM",
            "HAS_HEAD_NORM"]
_QKV_CONFIGS = [  # (SPLIT, BLOCK_K, SPLIT_K, warps, stages): SPLIT parts per head and SPLIT_K chunks of K spread a
    # projection over more SMs (SPLIT_K also for a head norm, which needs SPLIT = 1); (1, 64, 1, 4, 3) keeps whole
    # heads of 256 (Gemma) within shared memory. (2, 128, 2, 4, 3) and (1, 64, 4, 4, 4) give 32 rows 192 programs
    # that fit two or more per SM (49 and 66 KB of shared memory, sm_90): M = 32's pick, (1, 256, 2, 4, 3), runs 96
    # of 181 KB, one per SM. Neither they nor SPLIT_K = 11 (48 head slots x 11 = 4 x 132 programs: every SM busy) beat
    # it on an H100 (benchmarks/NOTES.md, session 18), nor did the pick with 8 warps or with the dot swapped to run
    # as wgmma (W-tile @ x.T: 128-140 registers against 255), which tied or lost (session 22).
    triton.Config({"SPLIT": split, "BLOCK_K": k, "SPLIT_K": split_k}, num_warps=w, num_stages=s)
    for split, k, split_k, w, s in [
        (1, 128, 1, 4, 4), (2, 128, 1, 4, 4), (4, 128, 1, 4, 4), (2, 256, 1, 4, 3), (4, 256, 1, 4, 3),
        (1, 256, 1, 8, 2), (2, 64, 1, 4, 4), (1, 64, 1, 4, 3),
        (2, 256, 2, 4, 3), (4, 256, 2, 4, 3), (4, 128, 4, 4, 4), (1, 256, 2, 4, 3), (1, 128, 4, 4, 4),
        (2, 128, 2, 4, 3), (1, 64, 4, 4, 4)]
]
_QKV_MAX_SPLIT = max(config.kwargs["SPLIT"] for config in _QKV_CONFIGS)  # head parts: one ticket each
_qkv_rope_split = autotune(_QKV_CONFIGS, key=_QKV_KEY, prune_configs_by=_PRUNE)(_qkv_rope_kernel)
# a head norm needs the whole head in one program
_qkv_rope_whole = autotune([c for c in _QKV_CONFIGS if c.kwargs["SPLIT"] == 1], key=_QKV_KEY)(_qkv_rope_kernel)


# (BLOCK_M, warps): few rows and warps a program. A program walks its group's head slots one after another, so the
# kernel's loads in flight grow with the programs resident: at Llama-3-8B's shapes on an H100 (B1 x 2048 / B32 x 512
# tokens; benchmarks/qkv_epilogue_probe.py) (2, 1) moves its bytes at 80 / 84 % of copy, (8, 4) at 68 / 71, (16, 4) at
# 63 / 65, (64, 8) at 57 / 56, (1, 1) at 71 / 70
_QKV_EPILOGUE_CONFIGS = [
    triton.Config({"BLOCK_M": m}, num_warps=w) for m, w in [(16, 4), (8, 4), (8, 2), (4, 1), (2, 1)]
]


@autotune(_QKV_EPILOGUE_CONFIGS, key=["n_rows_bucket", "n_heads_q", "n_heads_kv", "head_dim", "half", "HAS_HEAD_NORM"])
@triton.jit
def _qkv_epilogue_kernel(
    q_ptr, k_ptr, v_ptr, q_norm_ptr, k_norm_ptr, cos_ptr, sin_ptr, positions_ptr, q_out_ptr, k_cache_ptr,
    v_cache_ptr,
    n_rows, n_rows_bucket, seq_len, n_heads_q, n_heads_kv, head_dim, half, cache_len,
    stride_q, stride_k, stride_v,
    stride_cb, stride_ct, stride_cd, stride_sb, stride_st, stride_sd, stride_pb, stride_pt,
    stride_qb, stride_qh, stride_qt, stride_qd, stride_kb, stride_kh, stride_kl, stride_kd,
    stride_vb, stride_vh, stride_vl, stride_vd,
    head_eps, offset,
    HAS_HEAD_NORM: tl.constexpr, CAST_NORMED: tl.constexpr, HAS_TAIL: tl.constexpr, Q_LAST_ONLY: tl.constexpr,
    BLOCK_HALF_HEAD: tl.constexpr, BLOCK_TAIL: tl.constexpr, BLOCK_M: tl.constexpr,
):
    # Large-M epilogue after the cuBLAS projections. Program (i, kv_head) owns rows [i * BLOCK_M, +BLOCK_M) of one
    # GQA group: the Hq / Hkv q heads that read kv head kv_head, then that k head and that v head. It reads the
    # rows' cos/sin and cache positions once for the group, then each head's BLOCK_M x D projection values (bias
    # already added) once, runs head norm and RoPE, and writes them once, to q_out or to the caches.
    # Q_LAST_ONLY: q holds one row per sequence (its last position, row b for rows b * seq_len + seq_len - 1), and
    # a program whose rows hold no last position skips the q heads.
    rows = (tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)).to(tl.int64)
    row_ok = rows < n_rows
    kv_head = tl.program_id(1)
    group = n_heads_q // n_heads_kv
    d1, ok1, tail, tail_ok = _head_columns(0, half, head_dim, 1, BLOCK_HALF_HEAD, BLOCK_TAIL)
    c1, c2, n1, n2 = _rotary_tables(cos_ptr, sin_ptr, rows, row_ok, seq_len, d1, ok1, half, True,
                                    stride_cb, stride_ct, stride_cd, stride_sb, stride_st, stride_sd)
    position = _cache_rows(positions_ptr, rows, row_ok, seq_len, stride_pb, stride_pt, True)
    if Q_LAST_ONLY:
        q_rows, q_row_ok = rows // seq_len, row_ok & (rows % seq_len == seq_len - 1)
        first_slot = tl.where(tl.max(q_row_ok.to(tl.int32), axis=0) > 0, 0, group)
    else:
        q_rows, q_row_ok, first_slot = rows, row_ok, 0
    for i in range(first_slot, group + 2):  # head slots: q heads kv_head * group + i, then k and v head kv_head
        slot = tl.where(i < group, kv_head * group + i, n_heads_q + (i - group) * n_heads_kv + kv_head)
        kind, head, proj_ptr, stride_row = _select_head(slot, n_heads_q, n_heads_kv, q_ptr, k_ptr, v_ptr,
                                                        stride_q, stride_k, stride_v)
        slot_rows, slot_row_ok = tl.where(kind == 0, q_rows, rows), tl.where(kind == 0, q_row_ok, row_ok)
        row_base = (proj_ptr + slot_rows * stride_row + head * head_dim)[:, None]
        a1 = tl.load(row_base + d1[None, :], mask=slot_row_ok[:, None] & ok1[None, :], other=0.0).to(tl.float32)
        a2 = tl.load(row_base + half + d1[None, :], mask=slot_row_ok[:, None] & ok1[None, :],
                     other=0.0).to(tl.float32)
        tail_values = tl.load(row_base + tail[None, :], mask=slot_row_ok[:, None] & tail_ok[None, :],
                              other=0.0).to(tl.float32)
        _finish_head(
            a1, a2, tail_values, kind, head, rows, slot_row_ok, d1, ok1, tail, tail_ok, c1, c2, n1, n2, position,
            q_norm_ptr, k_norm_ptr, q_out_ptr, k_cache_ptr, v_cache_ptr, seq_len, head_dim, half, cache_len,
            head_eps, offset, stride_qb, stride_qh, stride_qt, stride_qd, stride_kb, stride_kh, stride_kl, stride_kd,
            stride_vb, stride_vh, stride_vl, stride_vd, HAS_HEAD_NORM, CAST_NORMED, HAS_TAIL)


# ----------------------------------------------------------------------------------- launchers
def _block_rows(n_rows: int) -> int:
    """All M rows padded to a tl.dot tile side (>= 16)."""
    return max(16, triton.next_power_of_2(n_rows))


def _even_k(configs: list[triton.Config], n_inner: int) -> bool:
    """Whether every config's K chunks (BLOCK_K x SPLIT_K, powers of 2) tile n_inner exactly: the streaming loops
    then load x and W without a column mask."""
    return n_inner % max(c.kwargs["BLOCK_K"] * c.kwargs.get("SPLIT_K", 1) for c in configs) == 0


def _whole_tiles(configs: list[triton.Config], n_inner: int, n_out: int) -> dict[str, bool]:
    """EVEN_K (:func:`_even_k`) and EVEN_N: every config's column blocks tile n_out exactly (no row mask on W)."""
    return {"EVEN_K": _even_k(configs, n_inner), "EVEN_N": n_out % max(c.kwargs["BLOCK_N"] for c in configs) == 0}


def _unit_stride(weight: Tensor) -> Tensor:
    return weight if weight.stride(-1) == 1 else weight.contiguous()


def _linear_residual_impl(x: Tensor, weight: Tensor, residual: Tensor, bias: Tensor | None) -> Tensor:
    x2, residual2, weight = as_rows(x), as_rows(residual), _unit_stride(weight)
    (n_rows, n_inner), n_out = x2.shape, weight.shape[0]
    out = new_output(residual.shape, x.dtype, x.device)
    out2 = out.view(n_rows, n_out)
    # the split-K configs' workspace (static shape: every config fits it) and one ticket per column block
    partials = new_output((MAX_SPLIT_K, n_rows, n_out), torch.float32, x.device)
    tickets = zeroed_counters(x.device, n_out)
    grid = lambda meta: (triton.cdiv(n_out, meta["BLOCK_N"]), meta["SPLIT_K"])  # noqa: E731
    _linear_residual_kernel[grid](
        x2, weight, bias.contiguous() if bias is not None else weight, residual2, out2, partials, tickets,
        n_rows, n_out, n_inner, x2.stride(0), weight.stride(0), residual2.stride(0), out2.stride(0),
        HAS_BIAS=bias is not None, BLOCK_M=_block_rows(n_rows),
        **_whole_tiles(_LINEAR_RESIDUAL_CONFIGS, n_inner, n_out),
        **dependent_launch(x.device, n_rows, op="linear_residual"))
    return out


def _constant_offset(offset: float) -> float | None:
    """The prologue norm's offset as the kernels' CONSTANT_OFFSET constexpr: its value with CONSTANT_OFFSET on
    (one compiled kernel per value), else None (a run-time argument)."""
    return offset if CONSTANT_OFFSET else None


def _norm_gated_linear_impl(x: Tensor, norm_weight: Tensor | None, eps: float, gate_weight: Tensor,
                            up_weight: Tensor | None, activation: str, offset: float) -> Tensor:
    """The small-M kernel. No casting argument: with the rstd after the dot, Llama's and Gemma's norms round the
    operand x * (weight + offset) the same way."""
    x2 = as_rows(x)
    gate, up = (_unit_stride(w) for w in _gate_up_halves(gate_weight, up_weight))
    (n_rows, n_inner), n_out = x2.shape, gate.shape[0]
    out = new_output((*x.shape[:-1], n_out), x.dtype, x.device)
    out2 = out.view(n_rows, n_out)
    grid = lambda meta: (triton.cdiv(n_out, meta["BLOCK_N"]),)  # noqa: E731
    _norm_gated_kernel[grid](
        x2, norm_weight.contiguous() if norm_weight is not None else x2, gate, up, out2,
        n_rows, n_out, n_inner, x2.stride(0), gate.stride(0), up.stride(0), out2.stride(0), eps, offset,
        HAS_NORM=norm_weight is not None, CONSTANT_OFFSET=_constant_offset(offset), ACTIVATION=activation,
        BLOCK_M=_block_rows(n_rows),
        **_whole_tiles(_STREAMING_CONFIGS, n_inner, n_out),
        **dependent_launch(x.device, n_rows, op="norm_gated_linear"))
    return out


def _head_blocks(head_dim: int, rotary_dim: int) -> dict:
    """The head-shape constexprs of the q/k/v kernels (tile sides >= 16, as tl.dot needs)."""
    tail = head_dim - rotary_dim
    return {"HAS_TAIL": tail > 0, "BLOCK_HALF_HEAD": max(16, triton.next_power_of_2(rotary_dim // 2)),
            "BLOCK_TAIL": max(16, triton.next_power_of_2(max(tail, 1)))}


def _epilogue_strides(cos: Tensor, sin: Tensor, positions: Tensor, q_out: Tensor, k_cache: Tensor,
                      v_cache: Tensor) -> tuple[int, ...]:
    """cos, sin ([1 or B, T, R]: batch stride 0 when 1), positions ([B, T] or [T]: batch stride 0), q_out,
    k_cache and v_cache strides, in the kernels' argument order."""
    tables = [s for t in (cos, sin) for s in (0 if t.shape[0] == 1 else t.stride(0), t.stride(1), t.stride(2))]
    position_strides = (0, positions.stride(0)) if positions.dim() == 1 else positions.stride()
    return (*tables, *position_strides, *q_out.stride(), *k_cache.stride(), *v_cache.stride())


def _qkv_rope_impl(x: Tensor, norm_weight: Tensor | None, eps: float, q_weight: Tensor, k_weight: Tensor,
                   v_weight: Tensor, q_bias: Tensor | None, k_bias: Tensor | None, v_bias: Tensor | None,
                   q_norm_weight: Tensor | None, k_norm_weight: Tensor | None, head_eps: float, cos: Tensor,
                   sin: Tensor, k_cache: Tensor, v_cache: Tensor, cache_positions: Tensor, num_heads: int,
                   casting: str, offset: float) -> Tensor:
    """The small-M kernel; q/k/v weights (and biases) are separate tensors or views of the packed one."""
    batch, seq_len, _ = x.shape
    num_kv_heads, cache_len, head_dim = k_cache.shape[1:]
    x2 = as_rows(x)
    weights = [_unit_stride(w) for w in (q_weight, k_weight, v_weight)]
    q_out = new_output((batch, seq_len, num_heads, head_dim), x.dtype, x.device).transpose(1, 2)
    has_head_norm = q_norm_weight is not None
    kernel = _qkv_rope_whole if has_head_norm else _qkv_rope_split
    slots = num_heads + 2 * num_kv_heads
    # the split-K configs' workspaces (static shapes: every config fits them) and one ticket per (slot, part)
    partials = new_output((MAX_SPLIT_K, x2.shape[0], slots * head_dim), torch.float32, x.device)
    squares_partials = (partials if norm_weight is None else  # [SPLIT_K, programs, M] row sums of squares
                        new_output((MAX_SPLIT_K, slots * _QKV_MAX_SPLIT, x2.shape[0]), torch.float32, x.device))
    tickets = zeroed_counters(x.device, slots * _QKV_MAX_SPLIT)
    grid = lambda meta: (slots * meta["SPLIT"], meta["SPLIT_K"])  # noqa: E731
    head_blocks = _head_blocks(head_dim, cos.shape[-1])
    biases = [b.contiguous() if b is not None else weights[0] for b in (q_bias, k_bias, v_bias)]
    head_norms = [w.contiguous() if w is not None else x2 for w in (q_norm_weight, k_norm_weight)]
    kernel[grid](
        x2, norm_weight.contiguous() if norm_weight is not None else x2, *weights, *biases, *head_norms,
        cos, sin, cache_positions, q_out, k_cache, v_cache, partials, squares_partials, tickets,
        x2.shape[0], seq_len, x2.shape[1], num_heads, num_kv_heads, head_dim, cos.shape[-1] // 2, cache_len,
        x2.stride(0), *(w.stride(0) for w in weights),
        *_epilogue_strides(cos, sin, cache_positions, q_out, k_cache, v_cache), eps, head_eps, offset,
        HAS_NORM=norm_weight is not None, CONSTANT_OFFSET=_constant_offset(offset), HAS_BIAS=q_bias is not None,
        HAS_HEAD_NORM=has_head_norm,
        CAST_NORMED=casting == "llama", BLOCK_M=_block_rows(x2.shape[0]), **head_blocks,
        EVEN_K=_even_k(_QKV_CONFIGS, x2.shape[1]), FULL_HALF=cos.shape[-1] // 2 == head_blocks["BLOCK_HALF_HEAD"],
        **dependent_launch(x.device, x2.shape[0], op="qkv_rope"))
    return q_out


def _qkv_epilogue_impl(q: Tensor, k: Tensor, v: Tensor, q_norm_weight: Tensor | None, k_norm_weight: Tensor | None,
                       head_eps: float, cos: Tensor, sin: Tensor, k_cache: Tensor, v_cache: Tensor,
                       cache_positions: Tensor, num_heads: int, seq_len: int, casting: str, offset: float) -> Tensor:
    """The large-M epilogue over the cuBLAS projections k and v [M, Hkv*D] and q [M, Hq*D], or q [B, Hq*D] of each
    sequence's last position alone (then q_out is [B, Hq, 1, D]); all with unit column stride."""
    n_rows = k.shape[0]
    batch = n_rows // seq_len
    num_kv_heads, cache_len, head_dim = k_cache.shape[1:]
    q_last_only = q.shape[0] != n_rows
    if q_last_only and q.shape[0] != batch:
        raise ValueError(f"q has {q.shape[0]} rows: expected k's {n_rows} or one a sequence ({batch})")
    q_out = new_output((batch, 1 if q_last_only else seq_len, num_heads, head_dim), q.dtype, q.device).transpose(1, 2)
    # the kernel steps q_out's T dim by each row's t, seq_len - 1 for the last position: it sees T's stride as 0
    q_steps = q_out.as_strided(q_out.shape, (*q_out.stride()[:2], 0, q_out.stride(3))) if q_last_only else q_out
    grid = lambda meta: (triton.cdiv(n_rows, meta["BLOCK_M"]), num_kv_heads)  # noqa: E731
    head_norms = [w.contiguous() if w is not None else q for w in (q_norm_weight, k_norm_weight)]
    _qkv_epilogue_kernel[grid](
        q, k, v, *head_norms, cos, sin, cache_positions, q_out, k_cache, v_cache,
        n_rows, triton.next_power_of_2(n_rows), seq_len, num_heads, num_kv_heads, head_dim, cos.shape[-1] // 2,
        cache_len, q.stride(0), k.stride(0), v.stride(0),
        *_epilogue_strides(cos, sin, cache_positions, q_steps, k_cache, v_cache), head_eps, offset,
        HAS_HEAD_NORM=q_norm_weight is not None, CAST_NORMED=casting == "llama", Q_LAST_ONLY=q_last_only,
        **_head_blocks(head_dim, cos.shape[-1]))
    return q_out


# ----------------------------------------------------------------------------------- registration
def _linear_residual_fake(x, weight, residual, bias):
    return residual.new_empty(residual.shape)


def _norm_gated_linear_fake(x, norm_weight, eps, gate_weight, up_weight, activation, offset):
    n_out = gate_weight.shape[0] if up_weight is not None else gate_weight.shape[0] // 2
    return x.new_empty((*x.shape[:-1], n_out))


def _qkv_rope_fake(x, norm_weight, eps, q_weight, k_weight, v_weight, q_bias, k_bias, v_bias, q_norm_weight,
                   k_norm_weight, head_eps, cos, sin, k_cache, v_cache, cache_positions, num_heads, casting, offset):
    return x.new_empty((x.shape[0], x.shape[1], num_heads, k_cache.shape[-1])).transpose(1, 2)


def _qkv_epilogue_fake(q, k, v, q_norm_weight, k_norm_weight, head_eps, cos, sin, k_cache, v_cache, cache_positions,
                       num_heads, seq_len, casting, offset):
    batch = k.shape[0] // seq_len
    q_len = 1 if q.shape[0] != k.shape[0] else seq_len
    return q.new_empty((batch, q_len, num_heads, k_cache.shape[-1])).transpose(1, 2)


LINEAR_RESIDUAL = FusedOp("linear_residual", _linear_residual_impl, fake=_linear_residual_fake)
NORM_GATED_LINEAR = FusedOp("norm_gated_linear", _norm_gated_linear_impl, fake=_norm_gated_linear_fake)
QKV_ROPE = FusedOp("qkv_rope", _qkv_rope_impl, fake=_qkv_rope_fake, mutates_args=("k_cache", "v_cache"))
QKV_EPILOGUE = FusedOp("qkv_rope_epilogue", _qkv_epilogue_impl, fake=_qkv_epilogue_fake,
                       mutates_args=("k_cache", "v_cache"))


# ----------------------------------------------------------------------------------- checks
def _norm_in_prologue(x: Tensor, n_rows: int, max_rows: int) -> bool:
    """Whether a streaming kernel runs the norm itself (``*_PROLOGUE_NORM_MAX_ROWS``; never for fp16, whose range
    x * weight before the rstd can leave)."""
    return n_rows <= max_rows and x.dtype != torch.float16


def _needs_grad(*tensors: Tensor | None) -> bool:
    return torch.is_grad_enabled() and any(t is not None and t.requires_grad for t in tensors)


def _check_weight(name: str, weight: Tensor, x: Tensor, n_out: int | None = None) -> None:
    check_tensor(name, weight, rank=2)
    check_same("x", x, **{name: weight})
    if weight.shape[1] != x.shape[-1]:
        raise ValueError(f"{name} has shape {tuple(weight.shape)} but x's last dim is {x.shape[-1]}: "
                         f"expected [N, {x.shape[-1]}] (nn.Linear layout)")
    if n_out is not None and weight.shape[0] != n_out:
        raise ValueError(f"{name} has shape {tuple(weight.shape)}, expected [{n_out}, {x.shape[-1]}]")


def _check_vector(name: str, t: Tensor | None, size: int, x: Tensor, same_dtype: bool = True) -> None:
    if t is None:
        return
    check_tensor(name, t, rank=1)
    if t.shape[0] != size:
        raise ValueError(f"{name} has shape {tuple(t.shape)}, expected [{size}]")
    (check_same if same_dtype else check_same_device)("x", x, **{name: t})


def _check_norm(casting: str, norm_weight: Tensor | None, eps: float, offset: float, x: Tensor) -> tuple[float, float]:
    """Checks the norm's arguments; returns (eps, offset) as floats."""
    if casting not in CASTINGS:
        raise ValueError(f"casting must be one of {CASTINGS}, got {casting!r}")
    _check_vector("norm_weight", norm_weight, x.shape[-1], x, same_dtype=False)
    return check_norm_options(eps, offset)


# ----------------------------------------------------------------------------------- public API
def linear_residual(x: Tensor, weight: Tensor, residual: Tensor, bias: Tensor | None = None) -> Tensor:
    """``residual + x @ weight.T (+ bias)``: the o or down projection with the residual add in its epilogue.

    Args:
        x: [..., K], fp32/fp16/bf16 (any float dtype on the reference path); any strides.
        weight: [N, K] (nn.Linear layout, read in place), x's dtype and device.
        residual: [..., N] (x's leading shape), x's dtype and device; not modified.
        bias: optional [N], x's dtype.

    Returns:
        [..., N] in x's dtype: the new residual stream. Accumulated in fp32 with the residual (and bias) added
        before the one rounding, as ``torch.addmm(residual, x, weight.T)`` does. The streaming kernel runs for up
        to ``LINEAR_RESIDUAL_MAX_ROWS`` rows (where it beats cuBLAS); otherwise, or when an input requires grad,
        that ``torch.addmm`` (then ``+ bias``) runs.
    """
    check_tensor("x", x)
    _check_weight("weight", weight, x)
    check_tensor("residual", residual)
    check_same("x", x, residual=residual)
    if residual.shape != (*x.shape[:-1], weight.shape[0]):
        raise ValueError(f"residual has shape {tuple(residual.shape)}, expected {(*x.shape[:-1], weight.shape[0])} "
                         "(x's leading shape, weight's N)")
    _check_vector("bias", bias, weight.shape[0], x)
    n_rows = x.numel() // x.shape[-1] if x.shape[-1] else 0
    if (runs_triton(x) and 0 < n_rows <= LINEAR_RESIDUAL_MAX_ROWS and weight.shape[0]
            and not _needs_grad(x, weight, residual, bias)):
        return LINEAR_RESIDUAL(x, weight, residual, bias)
    return linear_residual_reference(x, weight, residual, bias)


def norm_gated_linear(x: Tensor, norm_weight: Tensor | None, eps: float, gate_weight: Tensor,
                      up_weight: Tensor | None = None, *, activation: str = "silu", casting: str = "llama",
                      offset: float = 0.0) -> Tensor:
    """The gated MLP's first half: ``act(norm(x) @ gate_weight.T) * (norm(x) @ up_weight.T)``.

    Args:
        x: [..., K], fp32/fp16/bf16 (any float dtype on the reference path); any strides.
        norm_weight: [K] RMSNorm weight (any float dtype), or None to skip the norm (x is already normed).
        eps, casting, offset: the norm's, as :func:`fuselm.rms_norm` (Gemma: ``casting="gemma"``, offset 1.0).
        gate_weight: [I, K] (nn.Linear layout, read in place), x's dtype; with ``up_weight=None`` Phi-3's packed
            [2I, K] gate_up weight, gate rows first.
        up_weight: [I, K] or None.
        activation: ``"silu"`` (SwiGLU) or ``"gelu_tanh"`` (GeGLU).

    Returns:
        [..., I] in x's dtype. Up to ``MAX_STREAMING_ROWS`` rows (and no input requiring grad): one
        weight-streaming kernel; otherwise fuselm.rms_norm, cuBLAS GEMM(s) and fuselm's silu_mul/gelu_tanh_mul.
    """
    check_tensor("x", x)
    if activation not in ACTIVATIONS:
        raise ValueError(f"activation must be one of {ACTIVATIONS}, got {activation!r}")
    eps, offset = _check_norm(casting, norm_weight, eps, offset, x)
    _check_weight("gate_weight", gate_weight, x)
    if up_weight is None:
        if gate_weight.shape[0] % 2:
            raise ValueError(f"gate_weight (packed gate_up, up_weight=None) must have an even first dimension, "
                             f"got shape {tuple(gate_weight.shape)}")
    else:
        _check_weight("up_weight", up_weight, x, gate_weight.shape[0])
    n_rows = x.numel() // x.shape[-1] if x.shape[-1] else 0
    if not runs_triton(x) or x.shape[-1] == 0 or gate_weight.shape[0] == 0:
        return norm_gated_linear_reference(x, norm_weight, eps, gate_weight, up_weight, activation, casting, offset)
    if 0 < n_rows <= MAX_STREAMING_ROWS and not _needs_grad(x, norm_weight, gate_weight, up_weight):
        if norm_weight is not None and not _norm_in_prologue(x, n_rows, GATED_PROLOGUE_NORM_MAX_ROWS):
            x, norm_weight = rms_norm(x, norm_weight, eps, offset, casting).to(x.dtype), None
        return NORM_GATED_LINEAR(x, norm_weight, eps, gate_weight, up_weight, activation, offset)
    h = x if norm_weight is None else rms_norm(x, norm_weight, eps, offset, casting).to(x.dtype)
    if up_weight is None:
        return _GATED_GLU[activation](F.linear(h, gate_weight))
    return _GATED_GLU[activation](F.linear(h, gate_weight), F.linear(h, up_weight))


def _check_qkv_args(x, norm_weight, eps, q_weight, k_weight, v_weight, cos, sin, k_cache, v_cache, cache_positions,
                    num_heads, num_kv_heads, q_bias, k_bias, v_bias, q_norm_weight, k_norm_weight, qk_norm_eps, casting,
                    offset) -> tuple[float, float, float]:
    """Checks every argument; returns (eps, offset, the head norms' eps) as floats."""
    check_tensor("x", x, rank=3)
    batch, seq_len, _ = x.shape
    eps, offset = _check_norm(casting, norm_weight, eps, offset, x)
    head_eps = eps if qk_norm_eps is None else check_norm_options(qk_norm_eps, offset, "qk_norm_eps")[0]
    for name, heads in (("num_heads", num_heads), ("num_kv_heads", num_kv_heads)):
        if not isinstance(heads, int) or isinstance(heads, bool) or heads <= 0:
            raise ValueError(f"{name} must be a positive int, got {heads!r}")
    if num_heads % num_kv_heads:
        raise ValueError(f"num_heads ({num_heads}) must be a multiple of num_kv_heads ({num_kv_heads})")
    for name, cache in (("k_cache", k_cache), ("v_cache", v_cache)):
        check_tensor(name, cache, rank=4)
        check_same("x", x, **{name: cache})
        if cache.shape[0] != batch or cache.shape[1] != num_kv_heads:
            raise ValueError(f"{name} has shape {tuple(cache.shape)}, expected [B={batch}, Hkv={num_kv_heads}, L, D]")
    if v_cache.shape != k_cache.shape:
        raise ValueError(f"v_cache has shape {tuple(v_cache.shape)} but k_cache has shape {tuple(k_cache.shape)}")
    head_dim = k_cache.shape[-1]
    q_size, kv_size = num_heads * head_dim, num_kv_heads * head_dim
    if (k_weight is None) != (v_weight is None):
        raise ValueError("k_weight and v_weight must both be given (separate q/k/v) or both be None (packed qkv)")
    if k_weight is None:
        _check_weight("q_weight", q_weight, x, q_size + 2 * kv_size)
        if k_bias is not None or v_bias is not None:
            raise ValueError("with a packed q_weight, pass the packed bias as q_bias (k_bias and v_bias must be None)")
        _check_vector("q_bias", q_bias, q_size + 2 * kv_size, x)
    else:
        _check_weight("q_weight", q_weight, x, q_size)
        _check_weight("k_weight", k_weight, x, kv_size)
        _check_weight("v_weight", v_weight, x, kv_size)
        if len({b is None for b in (q_bias, k_bias, v_bias)}) > 1:
            raise ValueError("q_bias, k_bias and v_bias must all be given or all be None")
        for name, bias, size in (("q_bias", q_bias, q_size), ("k_bias", k_bias, kv_size), ("v_bias", v_bias, kv_size)):
            _check_vector(name, bias, size, x)
    if (q_norm_weight is None) != (k_norm_weight is None):
        raise ValueError("q_norm_weight and k_norm_weight must both be given or both be None")
    _check_vector("q_norm_weight", q_norm_weight, head_dim, x, same_dtype=False)
    _check_vector("k_norm_weight", k_norm_weight, head_dim, x, same_dtype=False)
    if q_norm_weight is not None and q_norm_weight.dtype != k_norm_weight.dtype:
        raise TypeError(f"k_norm_weight has dtype {k_norm_weight.dtype} but q_norm_weight has {q_norm_weight.dtype}")
    for name, table in (("cos", cos), ("sin", sin)):
        check_tensor(name, table, rank=3)
        check_same_device("x", x, **{name: table})
        if table.shape[0] not in (1, batch) or table.shape[1] != seq_len:
            raise ValueError(f"{name} has shape {tuple(table.shape)}, expected [1 or B={batch}, T={seq_len}, R]")
    rotary_dim = cos.shape[-1]
    if sin.shape != cos.shape or sin.dtype != cos.dtype:
        raise ValueError(f"sin ({tuple(sin.shape)}, {sin.dtype}) must match cos ({tuple(cos.shape)}, {cos.dtype})")
    if rotary_dim <= 0 or rotary_dim % 2 or rotary_dim > head_dim:
        raise ValueError(f"cos's last dim (rotary_dim) must be even and in [2, head_dim={head_dim}], got {rotary_dim}")
    if not isinstance(cache_positions, torch.Tensor) or cache_positions.dtype not in (torch.int32, torch.int64):
        raise TypeError(f"cache_positions must be an int32 or int64 tensor, got "
                        f"{getattr(cache_positions, 'dtype', type(cache_positions).__name__)}")
    check_same_device("x", x, cache_positions=cache_positions)
    if tuple(cache_positions.shape) not in ((batch, seq_len), (seq_len,)):
        raise ValueError(f"cache_positions has shape {tuple(cache_positions.shape)}, expected [B={batch}, "
                         f"T={seq_len}] or [T={seq_len}]")
    return eps, offset, head_eps


def qkv_rope(x: Tensor, norm_weight: Tensor | None, eps: float, q_weight: Tensor, k_weight: Tensor | None,
             v_weight: Tensor | None, cos: Tensor, sin: Tensor, k_cache: Tensor, v_cache: Tensor,
             cache_positions: Tensor, *, num_heads: int, num_kv_heads: int, q_bias: Tensor | None = None,
             k_bias: Tensor | None = None, v_bias: Tensor | None = None, q_norm_weight: Tensor | None = None,
             k_norm_weight: Tensor | None = None, qk_norm_eps: float | None = None, casting: str = "llama",
             offset: float = 0.0, last_only: bool = False) -> Tensor:
    """Attention's input side: RMSNorm, q/k/v projections (+ biases), q/k head norms, RoPE, KV-cache write.

    Args:
        x: [B, T, hidden], fp32/fp16/bf16 (any float dtype on the reference path); any strides.
        norm_weight: [hidden] input RMSNorm weight (any float dtype), or None (x already normed).
        eps, casting, offset: the norms' (layer norm and head norms), as :func:`fuselm.rms_norm`.
        q_weight, k_weight, v_weight: [Hq*D, hidden], [Hkv*D, hidden], [Hkv*D, hidden] (nn.Linear layout, read in
            place), x's dtype; or Phi-3's packed q_weight [(Hq + 2 Hkv) * D, hidden] with k_weight = v_weight = None.
        cos, sin: [1 or B, T, R] as HF's rotary embedding returns them (R even, <= D: partial rotary leaves
            d >= R unrotated; any scaling is inside them), any float dtype.
        k_cache, v_cache: [B, Hkv, L, D], x's dtype and device, any strides: written in place with the new
            rotated k and the new v at ``cache_positions``; nothing else in them is touched.
        cache_positions: [B, T] or [T] (shared by every row), int32/int64, each in [0, L) (a position outside it
            writes nothing).
        num_heads, num_kv_heads: Hq and Hkv (Hq a multiple of Hkv).
        q_bias, k_bias, v_bias: optional [Hq*D], [Hkv*D], [Hkv*D] (Qwen2); the packed [(Hq + 2 Hkv) * D] as q_bias.
        q_norm_weight, k_norm_weight: optional [D] per-head RMSNorm weights (Qwen3, Gemma3), applied before RoPE
            with eps ``qk_norm_eps`` (default ``eps``).
        last_only: return q of each row's last position alone ([B, Hq, 1, D]); k and v of every position are
            written as without it. Above ``MAX_STREAMING_ROWS`` rows, q's GEMM then runs for those B rows alone
            (a prefill whose caller reads only the last position's output).

    Returns:
        q [B, Hq, T, D] in x's dtype, normed and rotated: a transposed view of [B, T, Hq, D] memory, the layout
        HF's attention gets from its projections (SDPA's cuDNN kernel then writes its output in that layout too,
        and the o projection's [B, T, Hq * D] input is a view of it). Up to ``MAX_STREAMING_ROWS`` rows (B * T):
        one weight-streaming kernel; more: fuselm.rms_norm, one cuBLAS GEMM per weight and one epilogue kernel.
        No autograd: with grad mode on and an input requiring grad, the PyTorch reference runs.
    """
    eps, offset, head_eps = _check_qkv_args(x, norm_weight, eps, q_weight, k_weight, v_weight, cos, sin, k_cache,
                                            v_cache, cache_positions, num_heads, num_kv_heads, q_bias, k_bias, v_bias,
                                            q_norm_weight, k_norm_weight, qk_norm_eps, casting, offset)
    biases = (q_bias, k_bias, v_bias)
    if (not runs_triton(x) or x.shape[-1] == 0
            or _needs_grad(x, norm_weight, q_weight, k_weight, v_weight, *biases, q_norm_weight, k_norm_weight)):
        return qkv_rope_reference(x, norm_weight, eps, q_weight, k_weight, v_weight, cos, sin, k_cache, v_cache,
                                  cache_positions, num_heads, num_kv_heads, *biases, q_norm_weight, k_norm_weight,
                                  head_eps, casting, offset, last_only)
    batch, seq_len, _ = x.shape
    n_rows = batch * seq_len
    head_dim = k_cache.shape[-1]
    if n_rows == 0:
        return x.new_empty((batch, min(seq_len, 1) if last_only else seq_len, num_heads, head_dim)).transpose(1, 2)
    (wq, bq), (wk, bk), (wv, bv) = _qkv_weights(q_weight, k_weight, v_weight, *biases, num_heads, num_kv_heads,
                                                head_dim)
    if n_rows <= MAX_STREAMING_ROWS:
        if norm_weight is not None and not _norm_in_prologue(x, n_rows, QKV_PROLOGUE_NORM_MAX_ROWS):
            x, norm_weight = rms_norm(x, norm_weight, eps, offset, casting).to(x.dtype), None
        q = QKV_ROPE(x, norm_weight, eps, wq, wk, wv, bq, bk, bv, q_norm_weight, k_norm_weight, head_eps, cos, sin,
                     k_cache, v_cache, cache_positions, num_heads, casting, offset)
        return q[:, :, -1:].transpose(1, 2).contiguous().transpose(1, 2) if last_only else q  # B x Hq x D copied
    h = as_rows(x if norm_weight is None else rms_norm(x, norm_weight, eps, offset, casting).to(x.dtype))
    if last_only:  # q's GEMM for each sequence's last row alone: the epilogue reads q [B, Hq * D]
        q = F.linear(h.view(batch, seq_len, -1)[:, -1], wq, bq)
        k, v = F.linear(h, wk, bk), F.linear(h, wv, bv)
    elif k_weight is None:  # one GEMM against the packed weight; q, k and v are column slices of its output
        q, k, v = F.linear(h, q_weight, q_bias).split([num_heads * head_dim, *2 * [num_kv_heads * head_dim]], dim=1)
    else:
        q, k, v = F.linear(h, wq, bq), F.linear(h, wk, bk), F.linear(h, wv, bv)
    return QKV_EPILOGUE(q, k, v, q_norm_weight, k_norm_weight, head_eps, cos, sin, k_cache, v_cache, cache_positions,
                        num_heads, seq_len, casting, offset)
