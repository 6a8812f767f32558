"""How fast a decode projection's weight stream can go: tile shapes, split-K and pointer loads against TMA.

The decode projections run at t = ~5 us + bytes / 3.90 TB/s against a copy rate of ~4.22 TB/s (benchmarks/NOTES.md,
"Split-K"): both the fixed cost and the stream rate stand between the layer step and 85 % of its bound. This times
the stream alone, with nothing else in the kernel: y = x @ W.T for M = 1 (x padded to a 16-row tile, as the decode
kernels pad it) or M = 32 rows of x (``--rows``: where every projection streams slower than at M = 1), each program
owning BLOCK_N weight rows over 1 / SPLIT_K of K and writing its fp32 partial (no combine, no epilogue). Per config,
weight shape and M, the weight tiles come in either as pointer loads (what the decode kernels do: cp.async on sm_90)
or through a host-made TMA descriptor (``TensorDescriptor``), and a plain read-only stream of the same bytes (one
contiguous block per program, summed) gives the read ceiling.

Each row is a CUDA-graph replay over enough weight copies to cover 3 x L2, divided by the copies: a launch's whole
time, ramp and tail included. Replays run back to back, without timing.median_ms's L2 flush: the copies already leave
nothing in L2 for the next replay, and the flush's dirty lines would be written back during the timed one. Two weight
sizes per shape of K (o 4096 x 4096 and gate/up 28672 x 4096; down 4096 x 14336) let a line through t = fixed +
bytes / rate split the two.

    python benchmarks/stream_bench.py --out benchmarks/results/stream-h200.json [--rows 1 32]
    python benchmarks/stream_bench.py --smoke          # tiny shapes, any device (the interpreter on a CPU)
"""

from __future__ import annotations

import argparse
import contextlib
import datetime
import itertools
import json
import math
import os
from concurrent.futures import ThreadPoolExecutor

import torch
import triton
import triton.language as tl
from timing import captured, copy_gbps, median_ms

from fuselm.backend import INTERPRETING
from fuselm.ops.decode_linear import _dot

GB = 1e9
SHAPES = {"o": (4096, 4096), "gate_up": (28672, 4096), "down": (4096, 14336)}  # (N, K) of Llama-3-8B's projections
SMOKE_SHAPES = {"small": (100, 200), "long": (70, 648)}  # odd sizes: masked rows and columns
LOADS = ("pointer", "tma")
SHARED_MEMORY = 200 * 1024  # bytes of pipelined tiles a config may hold (H200: 227 KiB per block)


@triton.jit
def _x_tile(x_ptr, rows, cols_k, n_rows, n_inner):
    """The [BLOCK_M, BLOCK_K] operand x[rows, cols_k] of x [M, K] (contiguous), zeros past M (as the decode kernels
    pad M to the dot's 16 rows or more)."""
    return tl.load(x_ptr + rows[:, None] * n_inner + cols_k[None, :],
                   mask=(rows[:, None] < n_rows) & (cols_k[None, :] < n_inner), other=0.0)


@triton.jit
def _weight_tile(w, n_lo, k_lo, n_out, n_inner, stride_wn, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                 TMA: tl.constexpr):
    """The [BLOCK_K, BLOCK_N] tile W[n_lo:+BLOCK_N, k_lo:+BLOCK_K].T (zeros past W's edges): w is a pointer (pointer
    loads of the transposed tile) or, with TMA, a descriptor whose [BLOCK_N, BLOCK_K] box is loaded and transposed."""
    if TMA:
        tile = tl.trans(w.load([n_lo, k_lo]))
    else:
        cols_n = n_lo + tl.arange(0, BLOCK_N).to(tl.int64)
        cols_k = k_lo + tl.arange(0, BLOCK_K)
        tile = tl.load(w + cols_n[None, :] * stride_wn + cols_k[:, None],
                       mask=(cols_n[None, :] < n_out) & (cols_k[:, None] < n_inner), other=0.0)
    return tile


@triton.jit
def _stream_kernel(w, x_ptr, partial_ptr, n_rows, n_out, n_inner, stride_wn, BLOCK_M: tl.constexpr,
                   BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, SPLIT_K: tl.constexpr, TMA: tl.constexpr):
    # Program (n, s) owns weight rows [n * BLOCK_N, +BLOCK_N) over K chunk s of SPLIT_K: reads that block of W once
    # ([BLOCK_K, BLOCK_N] tiles, by pointer loads or TMA) and x's M rows over the chunk (L2), writes M x BLOCK_N fp32
    # partial sums into partial [SPLIT_K, M, N].
    n_lo = tl.program_id(0) * BLOCK_N
    cols_n = n_lo + tl.arange(0, BLOCK_N)
    rows = tl.arange(0, BLOCK_M)
    chunk = tl.cdiv(tl.cdiv(n_inner, SPLIT_K), BLOCK_K) * BLOCK_K
    k_lo = tl.program_id(1) * chunk
    acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    for start in range(k_lo, tl.minimum(k_lo + chunk, n_inner), BLOCK_K):
        x = _x_tile(x_ptr, rows, start + tl.arange(0, BLOCK_K), n_rows, n_inner)
        acc = _dot(x, _weight_tile(w, n_lo, start, n_out, n_inner, stride_wn, BLOCK_N, BLOCK_K, TMA), acc)
    tl.store(partial_ptr + (tl.program_id(1) * n_rows + rows[:, None]) * n_out + cols_n[None, :], acc,
             mask=(rows[:, None] < n_rows) & (cols_n[None, :] < n_out))


@triton.jit
def _read_kernel(w_ptr, sums_ptr, n_elements, BLOCK: tl.constexpr, TILES: tl.constexpr):
    # Program p owns elements [p * TILES * BLOCK, +TILES * BLOCK) of the flat weight: reads them once, writes one
    # fp32 sum (the read ceiling: the same bytes, contiguous, no dot).
    base = tl.program_id(0).to(tl.int64) * TILES * BLOCK
    total = tl.zeros([BLOCK], dtype=tl.float32)
    for tile in range(TILES):
        offsets = base + tile * BLOCK + tl.arange(0, BLOCK)
        total += tl.load(w_ptr + offsets, mask=offsets < n_elements, other=0.0).to(tl.float32)
    tl.store(sums_ptr + tl.program_id(0), tl.sum(total))


def block_rows(n_rows: int) -> int:
    """The dot's M: x's rows padded to a power of two >= 16, as the decode kernels pad them."""
    return max(16, triton.next_power_of_2(n_rows))


def configs(smoke: bool, n_rows: int = 1) -> list[dict]:
    if smoke:
        return [dict(BLOCK_N=32, BLOCK_K=64, SPLIT_K=s, num_warps=4, num_stages=2) for s in (1, 2)]
    return [dict(BLOCK_N=n, BLOCK_K=k, SPLIT_K=s, num_warps=4, num_stages=st)
            for n, k, s, st in itertools.product((16, 32, 64), (128, 256, 512), (1, 2), (3, 4))
            if st * (n + block_rows(n_rows)) * k * 2 <= SHARED_MEMORY]


def stream(load: str, weights: list[torch.Tensor], x: torch.Tensor, partial: torch.Tensor, config: dict,
           warmup: bool = False):
    """A callable launching the stream kernel once per weight copy (x: [M, K]); with ``warmup``, compiling it only."""
    n_out, n_inner = weights[0].shape
    meta = dict(config, BLOCK_M=block_rows(x.shape[0]), TMA=load == "tma")
    grid = (triton.cdiv(n_out, meta["BLOCK_N"]), meta["SPLIT_K"])
    if load == "pointer":
        sources = [(w, w.stride(0)) for w in weights]
    else:
        from triton.tools.tensor_descriptor import TensorDescriptor

        sources = [(TensorDescriptor.from_tensor(w, [meta["BLOCK_N"], meta["BLOCK_K"]]), 0) for w in weights]
    return lambda: [_stream_kernel.run(source, x, partial, x.shape[0], n_out, n_inner, stride, grid=grid,
                                       warmup=warmup, **meta) for source, stride in sources]


def compile_all(weight: torch.Tensor, x: torch.Tensor, config_list: list[dict]) -> None:
    """Every (load, config) of the stream kernel for these shapes compiled at once in a thread pool, through triton's
    AsyncCompileMode (each would otherwise compile at its first launch, one after another: minutes for the sweep).
    A config that fails here fails again, and is recorded, at its timed launch."""
    try:
        from triton.runtime._async_compile import AsyncCompileMode
    except ImportError:  # an older triton: the launches compile one by one
        return
    partial = torch.empty((max(c["SPLIT_K"] for c in config_list), x.shape[0], weight.shape[0]), device=x.device)
    with ThreadPoolExecutor(os.cpu_count() or 1) as pool, AsyncCompileMode(pool, ignore_errors=True):
        for load, config in itertools.product(LOADS, config_list):
            with contextlib.suppress(Exception):
                stream(load, [weight], x, partial, config, warmup=True)()


def check(partial: torch.Tensor, weight: torch.Tensor, x: torch.Tensor) -> float:
    """Relative error of the partials' sum against x @ W.T in float64 (a stream that skipped or repeated tiles, or
    mixed rows, fails)."""
    expected = x.double() @ weight.double().t()
    got = partial.double().sum(0)
    return float((got - expected).norm() / expected.norm())


def rows_for(name: str, shape: tuple[int, int], config_list: list[dict], copy: float, device: str,
             n_rows: int = 1) -> list[dict]:
    n_out, n_inner = shape
    weight_bytes = n_out * n_inner * 2
    sets = 1 if device == "cpu" else max(2, math.ceil(3 * torch.cuda.get_device_properties(0).L2_cache_size
                                                      / weight_bytes))
    weights = [torch.randn(n_out, n_inner, device=device, dtype=torch.bfloat16) for _ in range(sets)]
    x = torch.randn(n_rows, n_inner, device=device, dtype=torch.bfloat16)
    rows = []

    def record(what: str, us: float, error: float | None, **extra) -> None:
        gbps = weight_bytes / (us * 1e-6) / GB
        rows.append({"what": what, "name": name, "m": n_rows, "n_out": n_out, "n_inner": n_inner, "us": round(us, 2),
                     "bytes": weight_bytes, "gbps": round(gbps, 1), "pct_of_copy": round(100 * gbps / copy, 1),
                     "rel_err": error, "input_sets": sets, **extra,
                     "formula": f"{weight_bytes} B / {us:.2f} us = {gbps:.0f} GB/s = {100 * gbps / copy:.1f} % of "
                                f"{copy:.0f} GB/s copy"})
        print(f"{name:<8} M={n_rows:<3} {what:<8} {json.dumps(extra):<96} {rows[-1]['formula']}", flush=True)

    block, tiles = 4096, 16
    sums = torch.empty(triton.cdiv(n_out * n_inner, block * tiles), device=device, dtype=torch.float32)
    read = captured(lambda: [_read_kernel[(sums.numel(),)](w, sums, w.numel(), BLOCK=block, TILES=tiles,
                                                           num_warps=8) for w in weights])
    us = median_ms(read, rep_ms=300.0, flush_l2=False) * 1e3 / sets
    record("read", us, None, BLOCK=block, TILES=tiles)
    if device != "cpu":
        compile_all(weights[0], x, config_list)
    for load, config in itertools.product(LOADS, config_list):
        partial = torch.full((config["SPLIT_K"], n_rows, n_out), float("nan"), device=device, dtype=torch.float32)
        try:
            launch = stream(load, weights, x, partial, config)
            launch()
            error = check(partial, weights[-1], x)
            us = median_ms(captured(launch), rep_ms=100.0, flush_l2=False) * 1e3 / sets
        except Exception as failure:  # noqa: BLE001 (a config past the shared memory, TMA where triton has none)
            rows.append({"what": "stream", "name": name, "m": n_rows, "load": load, **config,
                         "error": repr(failure)[:200]})
            print(f"{name:<8} M={n_rows:<3} {load:<8} {json.dumps(config)} failed: {repr(failure)[:120]}", flush=True)
            continue
        record("stream", us, error, load=load, **config)
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--shapes", nargs="+", choices=SHAPES, default=["o", "gate_up"],
                        help="weight shapes (default o and gate/up: the two sizes of K = 4096)")
    parser.add_argument("--rows", type=int, nargs="+", default=[1, 32], help="M values: rows of x (default 1 and 32)")
    parser.add_argument("--out", default="benchmarks/results/stream-h200.json")
    parser.add_argument("--smoke", action="store_true", help="tiny shapes and two configs, any device")
    args = parser.parse_args()
    device = "cuda" if torch.cuda.is_available() else "cpu"
    if device == "cpu" and not (args.smoke and INTERPRETING):
        parser.error("needs a GPU, or --smoke under TRITON_INTERPRET=1")
    copy = copy_gbps(flush_l2=False) if device == "cuda" else 1.0  # back to back, as the rows are timed
    shapes = SMOKE_SHAPES if args.smoke else {name: SHAPES[name] for name in args.shapes}
    if any(m < 1 for m in args.rows):
        parser.error(f"--rows must be positive, got {args.rows}")
    rows = [row for m in args.rows for name, shape in shapes.items()
            for row in rows_for(name, shape, configs(args.smoke, m), copy, device, m)]
    streams = [r for r in rows if r["what"] == "stream" and "us" in r]
    bad = [r for r in streams if not r["rel_err"] < 1e-2]
    result = {"gpu": torch.cuda.get_device_name() if device == "cuda" else "cpu", "torch": torch.__version__,
              "triton": triton.__version__, "date": datetime.datetime.now(datetime.timezone.utc).isoformat(),
              "copy_gbps": copy, "rows": rows,
              "formula": "GB/s = weight bytes / median us of one launch (a CUDA-graph replay over input_sets weight "
                         "copies, divided by input_sets, replays back to back); read: a contiguous read of the same "
                         "bytes; copy_gbps: back-to-back copies of 2 GiB (bytes read + written)"}
    with open(args.out, "w") as file:
        json.dump(result, file, indent=1)
    print(f"\ncopy {copy:.0f} GB/s; fastest per shape, M and load:")
    for (name, m, load), group in itertools.groupby(
            sorted(streams, key=lambda r: (r["name"], r["m"], r["load"], r["us"])),
            key=lambda r: (r["name"], r["m"], r["load"])):
        best = next(group)
        print(f"  {name:<8} M={m:<3} {load:<8} {best['us']:8.2f} us {best['pct_of_copy']:6.1f} % "
              f"BLOCK_N {best['BLOCK_N']} BLOCK_K {best['BLOCK_K']} SPLIT_K {best['SPLIT_K']} "
              f"stages {best['num_stages']}")
    if bad:
        raise SystemExit(f"{len(bad)} stream rows disagree with x @ W.T (rel_err >= 1e-2): {bad[:2]}")


if __name__ == "__main__":
    main()
