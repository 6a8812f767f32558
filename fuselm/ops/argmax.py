"""Row argmax over a vocabulary: the greedy token choice of a decode step. Triton kernel, PyTorch reference,
``fuselm::`` op.

``torch.argmax`` over a [B, V] row of logits runs one long reduction per row: 35 µs for B = 1 and V = 128256 on
the H200 (``benchmarks/results/step-profile-torch-argmax-h200.json``), about 14 % of the lm_head it follows, for
256 KB of reads. The kernel spreads each row over ``splits`` programs (every SM busy) that each reduce a chunk; the last
program of a row to take its ticket reduces the row's partials, so the choice stays one launch with shapes fixed
by (B, V) alone, graph-safe.

Semantics are ``torch.argmax(x, dim=-1)``'s: the index of the first maximum; a NaN counts as larger than every
number, so the first NaN of a row wins.
"""

from __future__ import annotations

import torch
from torch import Tensor

from fuselm.backend import runs_triton
from fuselm.ops import _common
from fuselm.ops._common import FusedOp, check_tensor, sm_count, zeroed_counters
from fuselm.ops._triton import tl, triton

BLOCK = 1024  # elements per load
# H200, B = 1 / 32 over 128256 columns: 126 / 9 programs a row with a serial combine took 10 / 20 us a step
# (results/step-profile-serial-argmax-h200.json); 126 / 33 with one vectorised read, 3.7 / 13 us
# (step-profile-tile-argmax-h200.json); the lanes' own bests across tiles, 3.8 / 10.7 (step-profile-h200.json)
PROGRAMS_PER_SM = 8
MAX_SPLITS = 256
_NO_INDEX = tl.constexpr(2**62)  # "none yet": larger than any index


def row_argmax_reference(x: Tensor) -> Tensor:
    """x [B, V] -> [B] int64, ``torch.argmax(x, dim=-1)``."""
    return x.argmax(dim=-1)


def _splits(n_rows: int, n_cols: int, device: torch.device) -> int:
    """Programs per row: about PROGRAMS_PER_SM per SM over the launch, each at least one BLOCK of the row."""
    wanted = triton.cdiv(PROGRAMS_PER_SM * sm_count(device), max(n_rows, 1))
    return max(1, min(wanted, MAX_SPLITS, triton.cdiv(n_cols, BLOCK)))


@triton.jit
def _row_argmax_kernel(x_ptr, out_ptr, values_ptr, indices_ptr, tickets_ptr, n_cols, stride_x, chunk,
                       SPLITS: tl.constexpr, BLOCK_SPLITS: tl.constexpr, BLOCK: tl.constexpr):
    # Program (r, s) owns columns [s * chunk, (s + 1) * chunk) of row r: reads them once (chunk x element size
    # bytes), writes its partial (largest value, its first index, first NaN index: 20 bytes) and takes a ticket of
    # row r; the row's last program reads the SPLITS partials back, writes out[r] (8 bytes) and resets the ticket.
    # Each of the BLOCK lanes keeps its own best over the chunk's tiles (a later column replaces it only when
    # strictly larger), so the loop has no cross-lane reduction; the lanes meet once after it.
    row = tl.program_id(0).to(tl.int64)
    split = tl.program_id(1)
    lo = split.to(tl.int64) * chunk
    lane_value = tl.full([BLOCK], -float("inf"), tl.float32)
    lane_index = tl.full([BLOCK], _NO_INDEX, tl.int64)
    lane_nan = tl.full([BLOCK], _NO_INDEX, tl.int64)
    for start in range(lo, tl.minimum(lo + chunk, n_cols), BLOCK):
        cols = start + tl.arange(0, BLOCK).to(tl.int64)
        ok = cols < n_cols
        x = tl.load(x_ptr + row * stride_x + cols, mask=ok, other=-float("inf")).to(tl.float32)
        is_nan = x != x
        take = ok & ~is_nan & ((x > lane_value) | (lane_index == _NO_INDEX))
        lane_value = tl.where(take, x, lane_value)
        lane_index = tl.where(take, cols, lane_index)
        lane_nan = tl.minimum(lane_nan, tl.where(is_nan, cols, _NO_INDEX))
    best_value = tl.max(lane_value, axis=0)
    best_index = tl.min(tl.where(lane_value == best_value, lane_index, _NO_INDEX), axis=0)
    best_nan = tl.min(lane_nan, axis=0)
    partial = row * SPLITS + split
    tl.store(values_ptr + partial, best_value)
    tl.store(indices_ptr + 2 * partial, best_index)
    tl.store(indices_ptr + 2 * partial + 1, best_nan)
    tl.debug_barrier()  # the partial is written before the ticket releases it
    ticket = tl.atomic_add(tickets_ptr + row, 1, sem="acq_rel", scope="gpu")
    if ticket == SPLITS - 1:  # the row's answer from its partials, all read at once
        others = tl.arange(0, BLOCK_SPLITS)
        there = others < SPLITS
        at = row * SPLITS + others
        values = tl.load(values_ptr + at, mask=there, other=-float("inf"), cache_modifier=".cg")
        indices = tl.load(indices_ptr + 2 * at, mask=there, other=_NO_INDEX, cache_modifier=".cg")
        nans = tl.load(indices_ptr + 2 * at + 1, mask=there, other=_NO_INDEX, cache_modifier=".cg")
        top = tl.max(values, axis=0)
        first = tl.min(tl.where(values == top, indices, _NO_INDEX), axis=0)  # chunks in column order
        nan = tl.min(nans, axis=0)
        tl.store(out_ptr + row, tl.where(nan != _NO_INDEX, nan, first))
        tl.store(tickets_ptr + row, 0)  # ready for the next launch


def _row_argmax_impl(x: Tensor) -> Tensor:
    n_rows, n_cols = x.shape
    out = torch.empty(n_rows, dtype=torch.long, device=x.device)
    if _common.poison_outputs:
        out.fill_(-1)
    if n_rows == 0:
        return out
    if x.stride(1) != 1:
        x = x.contiguous()
    splits = _splits(n_rows, n_cols, x.device)
    chunk = triton.cdiv(triton.cdiv(n_cols, splits), BLOCK) * BLOCK
    values = torch.empty(n_rows * splits, dtype=torch.float32, device=x.device)
    indices = torch.empty(2 * n_rows * splits, dtype=torch.long, device=x.device)
    tickets = zeroed_counters(x.device, n_rows)
    _row_argmax_kernel[(n_rows, splits)](x, out, values, indices, tickets, n_cols, x.stride(0), chunk,
                                         SPLITS=splits, BLOCK_SPLITS=triton.next_power_of_2(splits), BLOCK=BLOCK,
                                         num_warps=4)
    return out


def _row_argmax_fake(x):
    return x.new_empty(x.shape[0], dtype=torch.long)


ROW_ARGMAX = FusedOp("row_argmax", _row_argmax_impl, fake=_row_argmax_fake)


def row_argmax(x: Tensor) -> Tensor:
    """The index of each row's largest value, as ``torch.argmax(x, dim=-1)`` (first maximum; NaN wins).

    Args:
        x: [B, V] floating-point logits or scores (fp32/fp16/bf16 on the Triton path; any float dtype on the
            reference path), V >= 1; any row stride.

    Returns:
        [B] int64.
    """
    check_tensor("x", x, rank=2)
    if x.shape[1] == 0:
        raise ValueError(f"x must have at least one column to take an argmax over, got shape {tuple(x.shape)}")
    if runs_triton(x):
        return ROW_ARGMAX(x)
    return row_argmax_reference(x)
