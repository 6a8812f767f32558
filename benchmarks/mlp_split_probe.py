"""Is the B = 1 MLP faster as one kernel split along the intermediate dimension? A probe (session 26).

Today the decode MLP is two launches: ``norm_gated_linear`` (norm, gate/up, SiLU: writes h [M, I]) and
``linear_residual`` (down + residual: reads all of h). The second waits for every program of the first (a
grid-wide dependency), so each pays a ramp and a tail (~5-9 us over its bytes at M = 1). Split along the
intermediate dimension instead, the MLP has no such dependency: a program that owns intermediate columns
[j, j + BLOCK_J) computes its slice of h from its gate/up rows (phase 1) and multiplies it straight into its
column slice of the down weight, W_down[:, j:j + BLOCK_J] (phase 2), giving an fp32 partial of all N outputs.
A small second kernel sums the partials in program order (deterministic) and adds the residual. Bytes: the same
weights, plus the partials (I / BLOCK_J x M x N x 4 B written and read back from L2: ~1.8 MB at BLOCK_J 128).

Prediction (H100, back to back, Llama-3-8B shapes, bf16, M = 1): the two kernels' ~2 x 5-9 us of fixed cost
become one kernel's plus the sum's (~3 us), if phase 2's column slices (BLOCK_J x 2 B of every 28 KB row) stream
near the copy rate: ~3-6 us off the MLP.

Rows: ``two_kernels`` (fuselm's ops as the layer step runs them) and ``split_j`` per config (BLOCK_J, BLOCK_K,
BLOCK_N, warps, stages), each a CUDA-graph replay timed back to back (no L2 flush: the weights are 7x L2), against
a back-to-back copy of the weight bytes; every config's output is checked against the two kernels'.

    python benchmarks/mlp_split_probe.py --out benchmarks/results/mlp-split-probe-h100.json
    python benchmarks/mlp_split_probe.py --smoke      (tiny shapes on the CPU, Triton's interpreter)
"""

from __future__ import annotations

import os
import sys

if "--smoke" in sys.argv:  # before triton is imported: the kernels run in the interpreter on CPU
    os.environ.setdefault("TRITON_INTERPRET", "1")

import argparse
import datetime
import json

import torch
import triton
import triton.language as tl
from timing import captured, copy_ms, median_ms

import fuselm
from fuselm.ops._common import dependent_launch, let_next_kernel_launch, new_output, wait_for_previous_kernel
from fuselm.ops.decode_linear import _block_rows, _cast, _dot, _operand_tile, _scale_by_rstd, _weight_tile
from fuselm.ops.glu import _activation

# (BLOCK_J, BLOCK_K, BLOCK_N, warps, stages)
CONFIGS = [(128, 128, 64, 4, 3), (128, 64, 64, 4, 4), (64, 256, 64, 4, 3), (64, 128, 128, 4, 3),
           (32, 256, 128, 4, 3), (128, 128, 128, 8, 3), (64, 128, 64, 4, 4), (32, 256, 64, 4, 4),
           (32, 512, 64, 4, 2), (16, 512, 64, 4, 3)]
SMOKE_CONFIGS = [(16, 32, 16, 4, 2)]


@triton.jit
def _mlp_split_kernel(x_ptr, norm_weight_ptr, gate_ptr, up_ptr, down_ptr, partial_ptr,
                      n_rows, n_hidden, n_inter, stride_xm, stride_gn, stride_un, stride_dn, eps, offset,
                      DEPENDENT: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_J: tl.constexpr, BLOCK_K: tl.constexpr,
                      BLOCK_N: tl.constexpr):
    # Program j owns intermediate columns [j * BLOCK_J, +BLOCK_J). Phase 1 streams its BLOCK_J rows of gate and up
    # over the hidden size (the norm in the prologue, as _norm_gated_kernel) into h = silu(gate) * up [M, BLOCK_J],
    # rounded as HF rounds it. Phase 2 streams W_down[:, its columns] in BLOCK_N-row tiles and writes the fp32
    # partial h @ W_down[:, cols].T [M, N] of its columns to partial[j]. Reads its weights once; writes M x N x 4 B.
    cols_j = (tl.program_id(0) * BLOCK_J + tl.arange(0, BLOCK_J)).to(tl.int64)
    j_ok = cols_j < n_inter
    rows = tl.arange(0, BLOCK_M).to(tl.int64)
    row_ok = rows < n_rows
    wait_for_previous_kernel(DEPENDENT)
    sum_of_squares = tl.zeros([BLOCK_M], dtype=tl.float32)
    acc_gate = tl.zeros([BLOCK_M, BLOCK_J], dtype=tl.float32)
    acc_up = tl.zeros([BLOCK_M, BLOCK_J], dtype=tl.float32)
    for start in range(0, n_hidden, BLOCK_K):
        cols_k = start + tl.arange(0, BLOCK_K)
        x, sum_of_squares = _operand_tile(x_ptr, norm_weight_ptr, rows, row_ok, cols_k, stride_xm, n_hidden,
                                          sum_of_squares, offset, True, gate_ptr.dtype.element_ty, False)
        acc_gate = _dot(x, _weight_tile(gate_ptr, cols_j, j_ok, cols_k, stride_gn, n_hidden, False), acc_gate)
        acc_up = _dot(x, _weight_tile(up_ptr, cols_j, j_ok, cols_k, stride_un, n_hidden, False), acc_up)
    dtype = gate_ptr.dtype.element_ty
    gate = _cast(_scale_by_rstd(acc_gate, sum_of_squares, n_hidden, eps, True), dtype).to(tl.float32)
    up = _cast(_scale_by_rstd(acc_up, sum_of_squares, n_hidden, eps, True), dtype).to(tl.float32)
    activated, _ = _activation(gate, "silu")
    h = _cast(tl.where(j_ok[None, :], activated * up, 0.0), dtype)  # [BLOCK_M, BLOCK_J], as silu_mul writes it
    partial_base = partial_ptr + tl.program_id(0).to(tl.int64) * n_rows * n_hidden
    for start in range(0, n_hidden, BLOCK_N):
        cols_n = start + tl.arange(0, BLOCK_N)
        n_ok = cols_n < n_hidden
        part = _dot(h, _weight_tile(down_ptr, cols_n, n_ok, cols_j, stride_dn, n_inter, False),
                    tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32))
        tl.store(partial_base + rows[:, None] * n_hidden + cols_n[None, :], part,
                 mask=row_ok[:, None] & n_ok[None, :])
    let_next_kernel_launch(DEPENDENT)


@triton.jit
def _sum_partials_kernel(partial_ptr, residual_ptr, out_ptr, n_parts, n_rows, n_hidden,
                         DEPENDENT: tl.constexpr, BLOCK_P: tl.constexpr, BLOCK_N: tl.constexpr):
    # Program (n, m) owns outputs [n * BLOCK_N, +BLOCK_N) of row m: the residual plus the n_parts fp32 partials,
    # summed BLOCK_P at a time in program order (deterministic), rounded once. Reads n_parts x BLOCK_N x 4 B (L2).
    cols = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    ok = cols < n_hidden
    row = tl.program_id(1).to(tl.int64)
    wait_for_previous_kernel(DEPENDENT)
    total = tl.load(residual_ptr + row * n_hidden + cols, mask=ok, other=0.0).to(tl.float32)
    for first in range(0, n_parts, BLOCK_P):
        parts = first + tl.arange(0, BLOCK_P)
        tile = tl.load(partial_ptr + (parts[:, None].to(tl.int64) * n_rows + row) * n_hidden + cols[None, :],
                       mask=(parts < n_parts)[:, None] & ok[None, :], other=0.0, cache_modifier=".cg")
        total += tl.sum(tile, axis=0)
    tl.store(out_ptr + row * n_hidden + cols, _cast(total, out_ptr.dtype.element_ty), mask=ok)


def split_mlp(x, norm_weight, eps, gate, up, down, residual, config):
    """residual + down(silu(gate(norm(x))) * up(norm(x))) for x [M, H] in two launches (phase kernel, sum)."""
    block_j, block_k, block_n, warps, stages = config
    (n_rows, n_hidden), n_inter = x.shape, gate.shape[0]
    n_parts = triton.cdiv(n_inter, block_j)
    partials = new_output((n_parts, n_rows, n_hidden), torch.float32, x.device)
    out = new_output(residual.shape, x.dtype, x.device)
    launch = dependent_launch(x.device, n_rows, prefetch=False)
    _mlp_split_kernel[(n_parts,)](
        x, norm_weight, gate, up, down, partials, n_rows, n_hidden, n_inter, x.stride(0), gate.stride(0),
        up.stride(0), down.stride(0), eps, 0.0, BLOCK_M=_block_rows(n_rows), BLOCK_J=block_j, BLOCK_K=block_k,
        BLOCK_N=block_n, num_warps=warps, num_stages=stages, **launch)
    sum_block = 128 if x.is_cuda else 16
    _sum_partials_kernel[(triton.cdiv(n_hidden, sum_block), n_rows)](
        partials, residual, out, n_parts, n_rows, n_hidden, BLOCK_P=16, BLOCK_N=sum_block, num_warps=4, **launch)
    return out


def two_kernels(x, norm_weight, eps, gate, up, down, residual):
    """The decode MLP as the layer step runs it today."""
    h = fuselm.norm_gated_linear(x, norm_weight, eps, gate, up, activation="silu")
    return fuselm.linear_residual(h, down, residual)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", help="JSON path")
    parser.add_argument("--smoke", action="store_true", help="tiny shapes on the CPU")
    parser.add_argument("--rows", type=int, nargs="+", default=[1])
    args = parser.parse_args()
    cuda = torch.cuda.is_available() and not args.smoke
    device, dtype = ("cuda", torch.bfloat16) if cuda else ("cpu", torch.float32)
    hidden, inter = (4096, 14336) if cuda else (64, 96)
    torch.manual_seed(0)
    gate, up = (torch.randn(inter, hidden, device=device, dtype=dtype) / hidden ** 0.5 for _ in range(2))
    down = torch.randn(hidden, inter, device=device, dtype=dtype) / inter ** 0.5
    norm_weight = 1 + 0.1 * torch.randn(hidden, device=device, dtype=dtype)
    weight_bytes = sum(t.numel() * t.element_size() for t in (gate, up, down))
    copy = copy_ms(weight_bytes, flush_l2=False) if cuda else float("nan")
    print(f"weights {weight_bytes / 1e6:.1f} MB; back-to-back copy of them {copy * 1e3:.1f} us", flush=True)
    rows_out = []
    with fuselm.use_backend("triton"), torch.no_grad():
        for n_rows in args.rows:
            x = torch.randn(n_rows, hidden, device=device, dtype=dtype)
            residual = torch.randn(n_rows, hidden, device=device, dtype=dtype)
            call = (x, norm_weight, 1e-5, gate, up, down, residual)
            expected = two_kernels(*call)
            exact = (residual.double() + torch.nn.functional.linear(
                torch.nn.functional.silu(torch.nn.functional.linear(fuselm.rms_norm(x, norm_weight, 1e-5).double(),
                                                                   gate.double()))
                * torch.nn.functional.linear(fuselm.rms_norm(x, norm_weight, 1e-5).double(), up.double()),
                down.double()))
            scale = exact.abs().max().item()
            variants = [("two_kernels", None, lambda call=call: two_kernels(*call))]
            variants += [("split_j", c, lambda call=call, c=c: split_mlp(*call, c))
                         for c in (CONFIGS if cuda else SMOKE_CONFIGS)]
            for name, config, fn in variants:
                try:
                    out = fn()
                except Exception as error:  # a config out of shared memory or registers: recorded, not timed
                    rows_out.append({"impl": name, "rows": n_rows, "config": config, "error": repr(error)[:300]})
                    print(f"M={n_rows:<3} {name:<12} {str(config):<28} failed: {repr(error)[:120]}", flush=True)
                    continue
                error = ((out.double() - exact).abs().max() / scale).item()
                ms = median_ms(captured(fn), flush_l2=False) if cuda else float("nan")
                row = {"impl": name, "rows": n_rows, "config": config, "us": round(ms * 1e3, 2),
                       "pct_of_copy": round(100 * copy / ms, 1), "max_rel_error_vs_fp64": error,
                       "max_rel_diff_vs_two_kernels": ((out.double() - expected.double()).abs().max() / scale).item()}
                rows_out.append(row)
                print(f"M={n_rows:<3} {name:<12} {str(config):<28} {row['us']:8.2f} us  {row['pct_of_copy']:5.1f} % "
                      f"of copy  err {error:.1e}", flush=True)
    if args.out:
        result = {"gpu": torch.cuda.get_device_name() if cuda else "none (smoke)", "torch": torch.__version__,
                  "triton": triton.__version__,
                  "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
                  "weight_bytes": weight_bytes, "copy_us_back_to_back": copy * 1e3, "rows": rows_out,
                  "formula": "pct_of_copy = back-to-back copy of the weight bytes / the replay's time"}
        with open(args.out, "w") as f:
            json.dump(result, f, indent=1)


if __name__ == "__main__":
    main()
