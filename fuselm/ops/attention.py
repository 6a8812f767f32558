"""Decode attention over a preallocated KV cache: Triton kernel, PyTorch reference, ``fuselm::`` op.

Row b of the cache holds valid keys and values at positions [starts[b], ends[b]) of its L slots (left
padding: starts[b] > 0). Its T new queries sit at positions p_t = ends[b] - T + t, causal among
themselves. Query t of head h attends, with kv head h // (Hq / Hkv) (GQA), to the positions j with::

    starts[b] <= j <= p_t   and, with a sliding window w > 0,   j > p_t - w

(HF's ``sliding_window_overlay``: ``kv_idx > q_idx - sliding_window``), over the logits
``z = scale * q.k``, soft-capped to ``softcap * tanh(z / softcap)`` when softcap > 0 (Gemma 2, after
the scale, as HF does). A query that sees no position (a row with ends <= starts, or a query placed
before starts[b]) gets zeros.

The kernel is split-KV (flash-decoding). One program owns one (row, kv head, split): the GQA query
heads of that kv head times the T queries form the rows of its ``tl.dot`` tiles, so each K/V tile is
read once per kv head. The number of splits S depends on static shapes only (batch, kv heads, L, SM
count); each row's visible span [lo, hi) is cut into S chunks on the device, so every split has work
when the row is long, and a program whose chunk is empty reads nothing and exits. Splits combine in
the same launch: each writes its fp32 partial (running max, sum, unnormalised output) to a workspace,
takes a ticket from a per-(row, kv head) counter, and the last one to finish merges the partials, writes
the output and resets the counter to zero. Nothing depends on the lengths' values on the host: the
launch can be captured in a CUDA graph and replayed with new starts/ends in the same tensors. The counters
are one buffer per device, allocated on first use (before capture) and shared by every launch: launches
running concurrently on two streams would race on them.

At small batches the launch is a dependent one (it starts while the kernel before it finishes, and waits for it
before reading q), but it never releases the kernel after it early: the o projection's programs, launched while the
last splits merge, slowed that merge, the critical path (H100, B = 1 layer step back to back: 168.1 / 167.7 us
without the early release against 169.9 / 170.0 with it at 512 context, 176.1 / 175.8 against 177.0 at 4096;
``fuselm.generate`` at B = 1: 179.5 against 174.3 tok/s; benchmarks/NOTES.md, session 26). Before its wait, each
program of a dependent launch prefetches the first two K/V tiles of its chunk into L2 (FUSELM_KV_PREFETCH_TILES; the
positions were written in earlier steps, and the lengths read then are only a hint, read again after the wait).
H100, alternating runs (session 27): ``fuselm.generate`` at B = 32 3861-3865 -> 3885-3887 tok/s, at B = 1 174.8 ->
175.0; the B = 1 x 4096 layer step back to back 175.8 -> 176.9 us (there the two tiles are a split's whole chunk).
"""

from __future__ import annotations

import math

import torch
from torch import Tensor

from fuselm.backend import INTERPRETING, runs_triton
from fuselm.ops._common import (
    FusedOp,
    autotune,
    check_real,
    check_same,
    check_same_device,
    check_tensor,
    dependent_launch,
    kv_prefetch_tiles,
    new_output,
    prefetch_to_l2,
    sm_count,
    wait_for_previous_kernel,
    zeroed_counters,
)
from fuselm.ops._triton import tl, triton
from fuselm.ops.cross_entropy import _softcap

HEAD_DIMS = (64, 80, 96, 128, 256)
MAX_QUERIES = 16  # T per call: decode (1), speculative or chunked steps
LENGTH_DTYPES = (torch.int32, torch.int64)
# Split count: about PROGRAMS_PER_SM programs per SM for the launch, each split at least
# MIN_SPLIT_POSITIONS cache slots of L, at most MAX_SPLITS splits per (row, kv head); no split once the
# (row, kv head) units alone give every SM one (H200, B = 32 x 4k: 94.5 % of copy unsplit, 88 % at two).
# A short row's time is the latency of its split's loop, not bandwidth: at B = 1, L = 768 with 640 valid (generate's
# 512 + 256), 64 slots a split (12 splits) take 11.8 us against 15.9 at 256 (3 splits); at L = 8192 both are ~19.5 us
# (results/decode-attention-splits-h200.json).
PROGRAMS_PER_SM = 2
MIN_SPLIT_POSITIONS = 64
MAX_SPLITS = 64
TILE_ELEMENTS = 8192  # fp32 elements of a program's [rows, D] accumulator
# fp32 elements of one combine step's partial outputs: 32 splits of 4 rows x 128, so B = 1 x 32k's 32 partials (GQA 4)
# merge in one step. On an H100 that took B = 1 x 32k from 66.7 to 64.0 us (cuDNN 64.1) and the B = 1 x 4096 layer
# step from 191.3 to 183.8 us, against two steps at 8192; it costs 198 registers a thread against 151 (sm_90a).
COMBINE_ELEMENTS = 16384
SHARED_MEMORY_BUDGET = 160 * 1024  # bytes of pipelined K/V tiles a config may hold (H200: 227 KiB per block)
_LOG2E = tl.constexpr(1.4426950408889634)
_WIDEN_BF16_DOT = tl.constexpr(INTERPRETING)


# ----------------------------------------------------------------------------------- reference
def _new_output_for(q: Tensor, allocate) -> Tensor:
    """[B, Hq, T, D] output for q in [B, T, Hq, D] memory (o_proj reads it as [B, T, Hq * D] without a copy);
    ``allocate(shape, dtype, device)`` is torch.empty, torch.zeros or new_output."""
    batch, n_heads, n_queries, head_dim = q.shape
    return allocate((batch, n_queries, n_heads, head_dim), dtype=q.dtype, device=q.device).transpose(1, 2)


def decode_attention_reference(q: Tensor, k_cache: Tensor, v_cache: Tensor, starts: Tensor, ends: Tensor,
                               scale: float, softcap: float = 0.0, window: int = 0) -> Tensor:
    """Plain PyTorch decode attention (the fallback). Shapes and semantics as :func:`decode_attention`.

    Masked math over the whole [B, Hkv, L, D] buffer in ``promote_types(q.dtype, float32)``, the visibility
    mask built on the device from starts/ends (static shapes, no host sync: graph-safe). Values at positions
    no query sees are zeroed before use, so garbage there (an uninitialised cache) never reaches the output.
    """
    batch, n_heads, n_queries, head_dim = q.shape
    n_kv_heads, cache_len = k_cache.shape[1], k_cache.shape[2]
    group = n_heads // n_kv_heads
    if cache_len == 0:
        return _new_output_for(q, torch.zeros)
    work = torch.promote_types(q.dtype, torch.float32)
    positions = torch.arange(cache_len, device=q.device)
    query_positions = ends.long()[:, None] - n_queries + torch.arange(n_queries, device=q.device)  # [B, T]
    visible = ((positions >= starts.long()[:, None, None]) & (positions < ends.long()[:, None, None])
               & (positions <= query_positions[..., None]))  # [B, T, L]
    if window > 0:
        visible &= positions > query_positions[..., None] - window
    read = visible.any(dim=1)[:, None, :, None]  # [B, 1, L, 1]: positions some query sees
    keys = k_cache.to(work)
    values = v_cache.to(work).masked_fill(~read, 0.0)
    grouped_q = q.to(work).reshape(batch, n_kv_heads, group * n_queries, head_dim)
    logits = (grouped_q @ keys.transpose(-1, -2)) * scale  # [B, Hkv, G*T, L]
    if softcap > 0:
        logits = softcap * torch.tanh(logits / softcap)
    logits = logits.view(batch, n_kv_heads, group, n_queries, cache_len).masked_fill(~visible[:, None, None], -math.inf)
    row_max = logits.amax(dim=-1, keepdim=True)
    weights = torch.exp(logits - torch.where(torch.isfinite(row_max), row_max, 0.0))  # 0 where masked
    total = weights.sum(dim=-1, keepdim=True)
    weights = (weights / torch.where(total > 0, total, 1.0)).view(batch, n_kv_heads, group * n_queries, cache_len)
    out = (weights @ values).view(batch, n_heads, n_queries, head_dim)
    return _new_output_for(q, torch.empty).copy_(out)


# ----------------------------------------------------------------------------------- kernel
def _prune_by_shared_memory(configs, named_args, **kwargs):
    args = {**named_args, **kwargs}
    tile_bytes = 2 * args["BLOCK_D"] * args["k_ptr"].element_size()  # one position of K and of V
    kept = [c for c in configs if c.num_stages * c.kwargs["BLOCK_N"] * tile_bytes <= SHARED_MEMORY_BUDGET]
    return kept or configs[:1]


_CONFIGS = [  # positions per K/V tile, warps, pipeline stages; the first is the one the interpreter runs
    triton.Config({"BLOCK_N": n}, num_warps=w, num_stages=s)
    for n, w, s in [(32, 4, 3), (64, 4, 2), (64, 4, 3), (64, 4, 4), (64, 8, 3), (128, 4, 2), (128, 8, 2)]
]


@triton.jit
def _dot(a, b, DOT_PRECISION: tl.constexpr):
    """a @ b accumulated in fp32. Triton 3.6's interpreter multiplies bf16 operands as their uint16 bit
    patterns, so there they are widened to fp32 first (exactly: the same products a GPU sums)."""
    if _WIDEN_BF16_DOT and a.dtype == tl.bfloat16:
        a, b = a.to(tl.float32), b.to(tl.float32)
    return tl.dot(a, b, input_precision=DOT_PRECISION)


@triton.jit
def _query_rows(row_block, kv_head, ROWS: tl.constexpr, GROUP: tl.constexpr, N_QUERIES: tl.constexpr,
                BLOCK_M: tl.constexpr):
    """The first ROWS rows of a row block (row r = g * N_QUERIES + t is query t of q head kv_head * GROUP + g):
    their index in the block, whether they exist, their q head and their query."""
    local = tl.arange(0, ROWS)
    rows = row_block * BLOCK_M + local
    return local, rows < GROUP * N_QUERIES, kv_head * GROUP + rows // N_QUERIES, rows % N_QUERIES


@triton.jit
def _row_pointers(base, heads, queries, d, stride_h, stride_t, stride_d):
    return base + heads[:, None].to(tl.int64) * stride_h + queries[:, None] * stride_t + d[None, :] * stride_d


@triton.jit
def _visible_chunks(start_ptr, end_ptr, cache_len, window, n_splits, N_QUERIES: tl.constexpr,
                    HAS_WINDOW: tl.constexpr, BLOCK_N: tl.constexpr, LOAD_CACHE: tl.constexpr):
    """The row's start and end (at start_ptr, end_ptr; loaded with the cache modifier LOAD_CACHE), its visible span
    [lo, hi) of the cache, the span's chunk per split (whole K/V tiles) and how many splits have a non-empty chunk."""
    start = tl.maximum(tl.load(start_ptr, cache_modifier=LOAD_CACHE).to(tl.int32), 0)
    end = tl.load(end_ptr, cache_modifier=LOAD_CACHE).to(tl.int32)
    hi = tl.minimum(end, cache_len)
    lo = start
    if HAS_WINDOW:
        lo = tl.maximum(lo, end - N_QUERIES - window + 1)
    span = tl.maximum(hi - lo, 0)
    chunk = tl.maximum(tl.cdiv(tl.cdiv(span, n_splits), BLOCK_N) * BLOCK_N, BLOCK_N)
    return start, end, lo, hi, chunk, tl.cdiv(span, chunk)


@triton.jit
def _prefetch_chunk(k_base, v_base, start_ptr, end_ptr, split, cache_len, window, n_splits, stride_kl,
                    stride_kd, stride_vl, stride_vd, HEAD_DIM: tl.constexpr, N_QUERIES: tl.constexpr,
                    HAS_WINDOW: tl.constexpr, PREFETCH_TILES: tl.constexpr, BLOCK_D: tl.constexpr,
                    BLOCK_N: tl.constexpr):
    """Every 128-byte line of the K and V positions of split ``split``'s first PREFETCH_TILES tiles into L2, from
    the lengths as they read now (the first tiles: the loop's ramp; a whole long row would not stay in L2).

    A hint only, so it may run before the wait for the kernel before: L2 is where every SM's reads and writes meet,
    so a line prefetched stale or while written is never wrong, and the lengths are read here at L2 (.cg), leaving
    no line in L1 for the reads after the wait to find.
    """
    _, _, lo, hi, chunk, n_active = _visible_chunks(start_ptr, end_ptr, cache_len, window, n_splits, N_QUERIES,
                                                    HAS_WINDOW, BLOCK_N, ".cg")
    if split < n_active:
        per_line: tl.constexpr = 1024 // k_base.dtype.element_ty.primitive_bitwidth  # elements of a 128-byte line
        lines = tl.arange(0, (BLOCK_D + per_line - 1) // per_line) * per_line
        split_lo = lo + split * chunk
        split_hi = tl.minimum(split_lo + tl.minimum(chunk, PREFETCH_TILES * BLOCK_N), hi)
        for tile in range(split_lo, split_hi, BLOCK_N):
            positions = (tile + tl.arange(0, BLOCK_N)).to(tl.int64)
            mask = (positions < split_hi)[:, None] & (lines < HEAD_DIM)[None, :]
            prefetch_to_l2(k_base + positions[:, None] * stride_kl + lines[None, :] * stride_kd, mask)
            prefetch_to_l2(v_base + positions[:, None] * stride_vl + lines[None, :] * stride_vd, mask)


@triton.jit
def _decode_attention_kernel(
    q_ptr, k_ptr, v_ptr, starts_ptr, ends_ptr, out_ptr, partial_out_ptr, partial_stats_ptr, tickets_ptr,
    scale, softcap, window, cache_len, n_splits, stride_starts, stride_ends,
    stride_qb, stride_qh, stride_qt, stride_qd, stride_kb, stride_kh, stride_kl, stride_kd,
    stride_vb, stride_vh, stride_vl, stride_vd, stride_ob, stride_oh, stride_ot, stride_od,
    HEAD_DIM: tl.constexpr, GROUP: tl.constexpr, N_QUERIES: tl.constexpr, HAS_SOFTCAP: tl.constexpr,
    HAS_WINDOW: tl.constexpr, DOT_PRECISION: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_D: tl.constexpr,
    COMBINE_ROWS: tl.constexpr, COMBINE_SPLITS: tl.constexpr, DEPENDENT: tl.constexpr, PREFETCH_TILES: tl.constexpr,
    BLOCK_N: tl.constexpr,
):
    # Program (split, kv_head * row_blocks + row_block, b) owns BLOCK_M of the GROUP * N_QUERIES query rows
    # of kv head kv_head in batch row b, and chunk `split` of the row's visible span [lo, hi). It reads its
    # q rows once and each K and V position of its chunk once (nothing outside [lo, hi)). With one non-empty
    # chunk it writes the output rows; with several, an fp32 partial (per row: max, sum, unnormalised
    # [D] output), and the last program of the (b, kv head, row block) to finish reads every partial back
    # and writes the output rows. A program with an empty chunk reads nothing (split 0 of a row with
    # nothing visible writes zeros).
    split = tl.program_id(0)
    b = tl.program_id(2).to(tl.int64)
    unit = b * tl.num_programs(1) + tl.program_id(1)  # (b, kv head, row block): its partials and ticket
    row_blocks = (GROUP * N_QUERIES + BLOCK_M - 1) // BLOCK_M
    kv_head, row_block = tl.program_id(1) // row_blocks, tl.program_id(1) % row_blocks
    local, row_ok, heads, queries = _query_rows(row_block, kv_head, BLOCK_M, GROUP, N_QUERIES, BLOCK_M)
    d = tl.arange(0, BLOCK_D)
    d_ok = d < HEAD_DIM
    out_mask = row_ok[:, None] & d_ok[None, :]
    k_base = k_ptr + b * stride_kb + kv_head.to(tl.int64) * stride_kh
    v_base = v_ptr + b * stride_vb + kv_head.to(tl.int64) * stride_vh
    start_ptr, end_ptr = starts_ptr + b * stride_starts, ends_ptr + b * stride_ends
    if PREFETCH_TILES > 0:  # (dependent launches) while the kernel before finishes: its first K/V tiles into L2
        _prefetch_chunk(k_base, v_base, start_ptr, end_ptr, split, cache_len, window, n_splits, stride_kl,
                        stride_kd, stride_vl, stride_vd, HEAD_DIM, N_QUERIES, HAS_WINDOW, PREFETCH_TILES, BLOCK_D,
                        BLOCK_N)
    wait_for_previous_kernel(DEPENDENT)
    # q is read before the lengths, by every program, so that its latency overlaps theirs
    q = tl.load(_row_pointers(q_ptr + b * stride_qb, heads, queries, d, stride_qh, stride_qt, stride_qd),
                mask=out_mask, other=0.0)
    start, end, lo, hi, chunk, n_active = _visible_chunks(start_ptr, end_ptr, cache_len, window, n_splits, N_QUERIES,
                                                          HAS_WINDOW, BLOCK_N, "")

    out_base = out_ptr + b * stride_ob
    out_ptrs = _row_pointers(out_base, heads, queries, d, stride_oh, stride_ot, stride_od)
    if split < n_active:
        query_pos = end - N_QUERIES + queries
        row_lo = tl.full([BLOCK_M], 0, tl.int32) + start
        if HAS_WINDOW:
            row_lo = tl.maximum(row_lo, query_pos - window + 1)
        split_lo = lo + split * chunk
        split_hi = tl.minimum(split_lo + chunk, hi)
        k_tile = k_base + d[None, :] * stride_kd
        v_tile = v_base + d[None, :] * stride_vd
        row_max = tl.full([BLOCK_M], float("-inf"), tl.float32)  # log2 units
        row_sum = tl.zeros([BLOCK_M], tl.float32)
        acc = tl.zeros([BLOCK_M, BLOCK_D], tl.float32)
        for tile in range(split_lo, split_hi, BLOCK_N):
            positions = tile + tl.arange(0, BLOCK_N)
            in_chunk = positions < split_hi
            kv_mask = in_chunk[:, None] & d_ok[None, :]
            k = tl.load(k_tile + positions[:, None].to(tl.int64) * stride_kl, mask=kv_mask, other=0.0,
                        eviction_policy="evict_first")
            v = tl.load(v_tile + positions[:, None].to(tl.int64) * stride_vl, mask=kv_mask, other=0.0,
                        eviction_policy="evict_first")
            logits = _dot(q, tl.trans(k), DOT_PRECISION) * scale
            if HAS_SOFTCAP:
                logits, _ = _softcap(logits, softcap)
            visible = (in_chunk[None, :] & (positions[None, :] >= row_lo[:, None])
                       & (positions[None, :] <= query_pos[:, None]))
            logits = tl.where(visible, logits * _LOG2E, float("-inf"))
            new_max = tl.maximum(row_max, tl.max(logits, axis=1))
            shift = tl.where(new_max == float("-inf"), 0.0, new_max)  # rows with nothing visible yet stay at 0
            weights = tl.exp2(logits - shift[:, None])
            rescale = tl.exp2(row_max - shift)
            row_sum = row_sum * rescale + tl.sum(weights, axis=1)
            acc = acc * rescale[:, None] + _dot(weights.to(v.dtype), v, DOT_PRECISION)
            row_max = new_max
        if n_active == 1:
            out = acc / tl.where(row_sum > 0, row_sum, 1.0)[:, None]
            tl.store(out_ptrs, out.to(out_ptr.dtype.element_ty), mask=out_mask)
        else:
            stats_ptrs = partial_stats_ptr + (unit * n_splits + split) * 2 * BLOCK_M + local
            tl.store(stats_ptrs, row_max, mask=row_ok)
            tl.store(stats_ptrs + BLOCK_M, row_sum, mask=row_ok)
            tl.store(partial_out_ptr + ((unit * n_splits + split) * BLOCK_M + local[:, None]) * BLOCK_D + d[None, :],
                     acc, mask=out_mask)
            tl.debug_barrier()  # every thread's partial is written before the ticket releases it
            ticket = tl.atomic_add(tickets_ptr + unit, 1, sem="acq_rel", scope="gpu")
            if ticket == n_active - 1:
                _combine_partials(partial_out_ptr, partial_stats_ptr, out_base, unit, n_splits, n_active, row_block,
                                  kv_head, stride_oh, stride_ot, stride_od, GROUP, N_QUERIES, HEAD_DIM, BLOCK_M,
                                  BLOCK_D, COMBINE_ROWS, COMBINE_SPLITS)
                tl.store(tickets_ptr + unit, 0)  # ready for the next launch
    elif split == 0:  # nothing visible in the whole row
        tl.store(out_ptrs, tl.zeros([BLOCK_M, BLOCK_D], tl.float32).to(out_ptr.dtype.element_ty), mask=out_mask)


@triton.jit
def _combine_partials(partial_out_ptr, partial_stats_ptr, out_base, unit, n_splits, n_active, row_block, kv_head,
                      stride_oh, stride_ot, stride_od, GROUP: tl.constexpr, N_QUERIES: tl.constexpr,
                      HEAD_DIM: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_D: tl.constexpr,
                      COMBINE_ROWS: tl.constexpr, COMBINE_SPLITS: tl.constexpr):
    """Merges the n_active partials of ``unit`` into its output rows, COMBINE_SPLITS partials of the
    first COMBINE_ROWS rows (all the block's rows that exist) at a time.

    The partials were written by other programs, possibly on other SMs: they are read at L2 (.cg), past L1.
    """
    local, row_ok, heads, queries = _query_rows(row_block, kv_head, COMBINE_ROWS, GROUP, N_QUERIES, BLOCK_M)
    d = tl.arange(0, BLOCK_D)
    out_mask = row_ok[:, None] & (d < HEAD_DIM)[None, :]
    row_max = tl.full([COMBINE_ROWS], float("-inf"), tl.float32)
    row_sum = tl.zeros([COMBINE_ROWS], tl.float32)
    acc = tl.zeros([COMBINE_ROWS, BLOCK_D], tl.float32)
    for first in range(0, n_active, COMBINE_SPLITS):
        splits = unit * n_splits + first + tl.arange(0, COMBINE_SPLITS)
        stats_mask = (splits < unit * n_splits + n_active)[:, None] & row_ok[None, :]
        stats = partial_stats_ptr + splits[:, None] * 2 * BLOCK_M + local[None, :]
        maxes = tl.load(stats, mask=stats_mask, other=float("-inf"), cache_modifier=".cg")  # [splits, rows]
        sums = tl.load(stats + BLOCK_M, mask=stats_mask, other=0.0, cache_modifier=".cg")
        outs = tl.load(partial_out_ptr + (splits[:, None, None] * BLOCK_M + local[None, :, None]) * BLOCK_D
                       + d[None, None, :], mask=stats_mask[:, :, None] & out_mask[None, :, :], other=0.0,
                       cache_modifier=".cg")
        new_max = tl.maximum(row_max, tl.max(maxes, axis=0))
        shift = tl.where(new_max == float("-inf"), 0.0, new_max)
        rescale = tl.exp2(row_max - shift)
        weights = tl.exp2(maxes - shift[None, :])
        row_sum = row_sum * rescale + tl.sum(sums * weights, axis=0)
        acc = acc * rescale[:, None] + tl.sum(outs * weights[:, :, None], axis=0)
        row_max = new_max
    out = acc / tl.where(row_sum > 0, row_sum, 1.0)[:, None]
    out_ptrs = _row_pointers(out_base, heads, queries, d, stride_oh, stride_ot, stride_od)
    tl.store(out_ptrs, out.to(out_ptrs.dtype.element_ty), mask=out_mask)


_decode_attention = autotune(
    _CONFIGS, key=["cache_len", "n_splits", "HEAD_DIM", "GROUP", "N_QUERIES", "HAS_SOFTCAP", "HAS_WINDOW"],
    prune_configs_by={"early_config_prune": _prune_by_shared_memory})(_decode_attention_kernel)


# ----------------------------------------------------------------------------------- launcher
def _row_block(n_rows: int, head_dim: int) -> int:
    """Query rows per program: the GQA group times T, at least 16 (tl.dot's M), at most the accumulator budget."""
    return max(16, min(triton.next_power_of_2(n_rows), TILE_ELEMENTS // triton.next_power_of_2(head_dim)))


def _num_splits(batch: int, n_kv_heads: int, row_blocks: int, cache_len: int, sms: int, merge_width: int) -> int:
    """Splits per (row, kv head, row block): a function of static shapes only, never of the lengths.

    The last program merges ``merge_width`` partials a step, and each further step is a dependent round trip
    (~2.6 us, session 22). A count just past a multiple of the width (33 for 132 SMs, 8 kv heads, width 32)
    is rounded down to it when that gives up at most an eighth of the splits: 33 splits merge in two steps
    whenever the span holds 33 whole tiles' chunks, 32 always in one.
    """
    units = max(batch * n_kv_heads * row_blocks, 1)
    wanted = 1 if units >= sms else triton.cdiv(PROGRAMS_PER_SM * sms, units)
    count = max(1, min(wanted, MAX_SPLITS, triton.cdiv(cache_len, MIN_SPLIT_POSITIONS)))
    if count > merge_width and count % merge_width <= count // 8:
        count -= count % merge_width
    return count


def _decode_attention_impl(q: Tensor, k_cache: Tensor, v_cache: Tensor, starts: Tensor, ends: Tensor, scale: float,
                           softcap: float, window: int) -> Tensor:
    batch, n_heads, n_queries, head_dim = q.shape
    n_kv_heads, cache_len = k_cache.shape[1], k_cache.shape[2]
    out = _new_output_for(q, new_output)
    if out.numel() == 0:
        return out
    group = n_heads // n_kv_heads
    block_m, block_d = _row_block(group * n_queries, head_dim), triton.next_power_of_2(head_dim)
    row_blocks = triton.cdiv(group * n_queries, block_m)
    combine_rows = min(block_m, triton.next_power_of_2(group * n_queries))  # the rows of a block that exist
    combine_splits = max(1, COMBINE_ELEMENTS // (combine_rows * block_d))  # partials merged a step
    n_splits = _num_splits(batch, n_kv_heads, row_blocks, cache_len, sm_count(q.device), combine_splits)
    units = batch * n_kv_heads * row_blocks
    # workspace (static shape): per (unit, split) BLOCK_M maxima and sums, and a [BLOCK_M, BLOCK_D] output
    partial_stats = new_output((units, n_splits, 2, block_m), torch.float32, q.device)
    partial_out = new_output((units, n_splits, block_m, block_d), torch.float32, q.device)
    grid = (n_splits, n_kv_heads * row_blocks, batch)
    launch = dependent_launch(q.device, batch * n_queries, op="decode_attention", prefetch=False)
    launch["PREFETCH_TILES"] = kv_prefetch_tiles if launch["DEPENDENT"] else 0
    _decode_attention[grid](
        q, k_cache, v_cache, starts, ends, out, partial_out, partial_stats, zeroed_counters(q.device, units),
        scale, softcap, window, cache_len, n_splits, starts.stride(0), ends.stride(0), *q.stride(), *k_cache.stride(),
        *v_cache.stride(), *out.stride(),
        HEAD_DIM=head_dim, GROUP=group, N_QUERIES=n_queries, HAS_SOFTCAP=softcap > 0, HAS_WINDOW=window > 0,
        DOT_PRECISION="ieee" if q.dtype == torch.float32 else "tf32", BLOCK_M=block_m, BLOCK_D=block_d,
        COMBINE_ROWS=combine_rows, COMBINE_SPLITS=combine_splits, **launch,
    )
    return out


def _decode_attention_fake(q, k_cache, v_cache, starts, ends, scale, softcap, window):
    return _new_output_for(q, torch.empty)


DECODE_ATTENTION = FusedOp("decode_attention", _decode_attention_impl, fake=_decode_attention_fake)


# ----------------------------------------------------------------------------------- public API
def _check_lengths(name: str, lengths: object, q: Tensor) -> None:
    if not isinstance(lengths, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(lengths).__name__}")
    if lengths.dtype not in LENGTH_DTYPES:
        raise TypeError(f"{name} must be an int32 or int64 tensor, got dtype {lengths.dtype}")
    if lengths.shape != (q.shape[0],):
        raise ValueError(f"{name} must have shape [B] = ({q.shape[0]},) (q's batch), got {tuple(lengths.shape)}")
    check_same_device("q", q, **{name: lengths})


def _check_args(q: Tensor, k_cache: Tensor, v_cache: Tensor, starts: Tensor, ends: Tensor, softcap: float,
                window: int) -> None:
    check_tensor("q", q, rank=4)
    check_tensor("k_cache", k_cache, rank=4)
    check_tensor("v_cache", v_cache, rank=4)
    check_same("q", q, k_cache=k_cache, v_cache=v_cache)
    batch, n_heads, n_queries, head_dim = q.shape
    if head_dim not in HEAD_DIMS:
        raise ValueError(f"q's head_dim (last dim) must be one of {HEAD_DIMS}, got {head_dim}")
    if n_queries > MAX_QUERIES:
        raise ValueError(f"q has {n_queries} queries per row (dim 2): at most {MAX_QUERIES} are supported")
    if k_cache.shape[0] != batch or k_cache.shape[3] != head_dim:
        raise ValueError(f"k_cache has shape {tuple(k_cache.shape)} but q has shape {tuple(q.shape)}: k_cache must be "
                         f"[B={batch}, Hkv, L, D={head_dim}]")
    if v_cache.shape != k_cache.shape:
        raise ValueError(f"v_cache has shape {tuple(v_cache.shape)} but k_cache has shape {tuple(k_cache.shape)}")
    n_kv_heads = k_cache.shape[1]
    if n_kv_heads == 0 or n_heads % n_kv_heads:
        raise ValueError(f"q's {n_heads} heads must be a multiple of k_cache's {n_kv_heads} kv heads (GQA)")
    _check_lengths("starts", starts, q)
    _check_lengths("ends", ends, q)
    if not check_real("softcap", softcap) >= 0:
        raise ValueError(f"softcap must be >= 0 (0 = off), got {softcap}")
    if isinstance(window, bool) or not isinstance(window, int) or window < 0:
        raise ValueError(f"window must be an int >= 0 (0 = off), got {window!r}")


def decode_attention(q: Tensor, k_cache: Tensor, v_cache: Tensor, starts: Tensor, ends: Tensor, *,
                     scale: float | None = None, softcap: float = 0.0, window: int = 0) -> Tensor:
    """Attention of T new queries per row over a KV cache, reading only each row's visible positions.

    Args:
        q: [B, Hq, T, D] queries, T <= 16 (1 for decode), D in (64, 80, 96, 128, 256); fp32/fp16/bf16 (any
            float dtype on the reference path); any strides.
        k_cache, v_cache: [B, Hkv, L, D] with Hq % Hkv == 0 (GQA: q head h reads kv head h // (Hq / Hkv));
            q's dtype and device; any strides (a unit last stride reads fastest).
        starts, ends: [B] int32 or int64 on q's device: row b's valid cache positions are
            [starts[b], ends[b]), its T queries sit at positions ends[b] - T .. ends[b] - 1, causal among
            themselves. Values are read on the device (no host sync); positions outside [0, L) are never read.
            Any strides (e.g. the columns of one [B, 2] tensor, or one value expanded to [B]).
        scale: softmax scale, default D ** -0.5.
        softcap: 0 = off; else logits become softcap * tanh(logits / softcap) after the scale (Gemma 2).
        window: 0 = off; else a query at position p sees only positions > p - window (HF's sliding window).

    Returns:
        [B, Hq, T, D] in q's dtype, accumulated in fp32: a transposed view of [B, T, Hq, D] memory, so that
        ``out.transpose(1, 2).reshape(B, T, Hq * D)`` (o_proj's input) is free (for T = 1 it is contiguous).
        A query with no visible position (e.g. a row with ends <= starts) gets zeros. No gradient flows
        through the Triton path: with grad mode on and an input requiring grad, the PyTorch reference runs.
    """
    _check_args(q, k_cache, v_cache, starts, ends, softcap, window)
    scale = q.shape[-1] ** -0.5 if scale is None else float(scale)
    softcap = float(softcap)
    needs_grad = torch.is_grad_enabled() and (q.requires_grad or k_cache.requires_grad or v_cache.requires_grad)
    if runs_triton(q) and not needs_grad:
        return DECODE_ATTENTION(q, k_cache, v_cache, starts, ends, scale, softcap, window)
    return decode_attention_reference(q, k_cache, v_cache, starts, ends, scale, softcap, window)
