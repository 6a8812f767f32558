"""Whether a Triton GEMM with the gated activation in its epilogue beats cuBLAS's two gate/up GEMMs plus fuselm's
SwiGLU kernel at a prefill's M (session 34).

The prefill's MLP runs gate = x @ Wg.T and up = x @ Wu.T as two cuBLAS GEMMs (bf16 out, 2 x M x I x 2 B written),
then ``silu_mul`` (reads both, writes M x I): at B1 x 8192 that pass is 704 MB a layer, 7.24 ms of a 219 ms prefill
on an H100 (session 31, ``ttft-probe-*-session31-h100``), 14.6 ms of B32 x 512's 374. One kernel computing both
accumulators of a [BM, BN] tile of the activation, sharing x's tile, writes M x I once and never reads it back.
It must beat the pair: ``2 * M * K * 2I`` FLOPs at cuBLAS's rate plus the activation's bytes at the copy rate.

Variants (Llama-3-8B: K 4096, I 14336, bf16), each a few (BM, BN, BK, GROUP_M, warps, stages) configs:
- ``tiled``: one program a [BM, BN] tile, TMA descriptors for x and both weights, tiles in GROUP_M row groups;
- ``persistent``: one program per SM walking the tiles (``tl.range``, flattened), optionally warp-specialised;
- ``pointers``: as ``tiled`` with pointer loads (cp.async) instead of descriptors.

Rows: ``{"what": "gated_gemm", "impl", "config", "m", "ms", "tflops", "vs_cublas"}``; TFLOP/s = 2 * M * K * 2I / time
(the activation not counted); ``vs_cublas`` = the cuBLAS pair + silu_mul's time / the row's time (> 1: faster).
Each config is checked first against a float64 reference on 128 rows (relative error, bf16: ~1e-2).

    python benchmarks/gated_gemm_probe.py --out benchmarks/results/gated-gemm-probe-h100.json
    python benchmarks/gated_gemm_probe.py --smoke     (tiny shapes on the CPU, Triton's interpreter)
"""

from __future__ import annotations

import os
import sys

if "--smoke" in sys.argv:  # before triton is imported: the kernel runs in the interpreter on CPU
    os.environ.setdefault("TRITON_INTERPRET", "1")

import argparse
import ast
import datetime
import json
import traceback

import torch
import torch.nn.functional as F
import triton
import triton.language as tl
from timing import median_ms

from fuselm.ops.glu import silu_mul

HIDDEN, INTERMEDIATE = 4096, 14336
ROWS = [2048, 8192, 16384]
SMOKE = (40, 64, 96)  # M, K, I
CONFIGS = [  # BM, BN, BK, GROUP_M, warps, stages
    (128, 128, 64, 8, 8, 3),
    (128, 128, 64, 8, 8, 4),
    (128, 64, 64, 8, 4, 4),
    (64, 128, 64, 8, 4, 4),
    (128, 128, 128, 8, 8, 2),
]
SMOKE_CONFIGS = [(16, 32, 32, 2, 4, 2)]


@triton.jit
def _tile(tile, n_tiles_m, n_tiles_n, GROUP_M: tl.constexpr):
    """Tile index -> (row tile, column tile), GROUP_M row tiles at a time walking the columns (x's rows reused in L2)."""
    per_group = GROUP_M * n_tiles_n
    first_m = (tile // per_group) * GROUP_M
    group_rows = tl.minimum(n_tiles_m - first_m, GROUP_M)
    return first_m + (tile % per_group) % group_rows, (tile % per_group) // group_rows


@triton.jit
def _silu_times(gate, up):
    return gate * tl.sigmoid(gate) * up


@triton.jit
def _gated_tiled(x_ptr, g_ptr, u_ptr, out_ptr, M, N, K, BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr,
                 GROUP_M: tl.constexpr):
    # Program owns out[BM rows, BN columns]: streams x[BM, K] and Wg, Wu[BN, K] once each through TMA, two fp32
    # accumulators, writes silu(gate) * up once (BM x BN x 2 B).
    x_desc = tl.make_tensor_descriptor(x_ptr, shape=[M, K], strides=[K, 1], block_shape=[BM, BK])
    g_desc = tl.make_tensor_descriptor(g_ptr, shape=[N, K], strides=[K, 1], block_shape=[BN, BK])
    u_desc = tl.make_tensor_descriptor(u_ptr, shape=[N, K], strides=[K, 1], block_shape=[BN, BK])
    o_desc = tl.make_tensor_descriptor(out_ptr, shape=[M, N], strides=[N, 1], block_shape=[BM, BN])
    pid_m, pid_n = _tile(tl.program_id(0), tl.cdiv(M, BM), tl.cdiv(N, BN), GROUP_M)
    gate = tl.zeros([BM, BN], tl.float32)
    up = tl.zeros([BM, BN], tl.float32)
    for k in range(0, K, BK):
        a = x_desc.load([pid_m * BM, k])
        gate = tl.dot(a, g_desc.load([pid_n * BN, k]).T, gate)
        up = tl.dot(a, u_desc.load([pid_n * BN, k]).T, up)
    o_desc.store([pid_m * BM, pid_n * BN], _silu_times(gate, up).to(out_ptr.dtype.element_ty))


@triton.jit
def _gated_persistent(x_ptr, g_ptr, u_ptr, out_ptr, M, N, K, BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr,
                      GROUP_M: tl.constexpr, NUM_SMS: tl.constexpr, WARP_SPECIALIZE: tl.constexpr):
    # Program p owns tiles p, p + NUM_SMS, ...: each as in _gated_tiled.
    x_desc = tl.make_tensor_descriptor(x_ptr, shape=[M, K], strides=[K, 1], block_shape=[BM, BK])
    g_desc = tl.make_tensor_descriptor(g_ptr, shape=[N, K], strides=[K, 1], block_shape=[BN, BK])
    u_desc = tl.make_tensor_descriptor(u_ptr, shape=[N, K], strides=[K, 1], block_shape=[BN, BK])
    o_desc = tl.make_tensor_descriptor(out_ptr, shape=[M, N], strides=[N, 1], block_shape=[BM, BN])
    n_tiles_m, n_tiles_n = tl.cdiv(M, BM), tl.cdiv(N, BN)
    for tile in tl.range(tl.program_id(0), n_tiles_m * n_tiles_n, NUM_SMS, flatten=True,
                         warp_specialize=WARP_SPECIALIZE):
        pid_m, pid_n = _tile(tile, n_tiles_m, n_tiles_n, GROUP_M)
        gate = tl.zeros([BM, BN], tl.float32)
        up = tl.zeros([BM, BN], tl.float32)
        for k in range(0, K, BK):
            a = x_desc.load([pid_m * BM, k])
            gate = tl.dot(a, g_desc.load([pid_n * BN, k]).T, gate)
            up = tl.dot(a, u_desc.load([pid_n * BN, k]).T, up)
        o_desc.store([pid_m * BM, pid_n * BN], _silu_times(gate, up).to(out_ptr.dtype.element_ty))


@triton.jit
def _gated_pointers(x_ptr, g_ptr, u_ptr, out_ptr, M, N, K, BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr,
                    GROUP_M: tl.constexpr):
    # As _gated_tiled, with pointer loads (K a multiple of BK; rows and columns masked).
    pid_m, pid_n = _tile(tl.program_id(0), tl.cdiv(M, BM), tl.cdiv(N, BN), GROUP_M)
    rows = pid_m * BM + tl.arange(0, BM)
    cols = pid_n * BN + tl.arange(0, BN)
    ks = tl.arange(0, BK)
    x_ptrs = x_ptr + rows[:, None].to(tl.int64) * K + ks[None, :]
    w_offsets = cols[:, None].to(tl.int64) * K + ks[None, :]
    gate = tl.zeros([BM, BN], tl.float32)
    up = tl.zeros([BM, BN], tl.float32)
    for k in range(0, K, BK):
        a = tl.load(x_ptrs + k, mask=(rows < M)[:, None], other=0.0)
        gate = tl.dot(a, tl.load(g_ptr + w_offsets + k, mask=(cols < N)[:, None], other=0.0).T, gate)
        up = tl.dot(a, tl.load(u_ptr + w_offsets + k, mask=(cols < N)[:, None], other=0.0).T, up)
    out = _silu_times(gate, up).to(out_ptr.dtype.element_ty)
    tl.store(out_ptr + rows[:, None].to(tl.int64) * N + cols[None, :], out, mask=(rows < M)[:, None] & (cols < N)[None, :])


def launcher(variant: str, config: tuple, sms: int, warp_specialize: bool = False):
    bm, bn, bk, group_m, warps, stages = config

    def run(x, wg, wu, out):
        m, k = x.shape
        n = wg.shape[0]
        tiles = triton.cdiv(m, bm) * triton.cdiv(n, bn)
        args = (x, wg, wu, out, m, n, k)
        meta = {"BM": bm, "BN": bn, "BK": bk, "GROUP_M": group_m, "num_warps": warps, "num_stages": stages}
        if variant == "persistent":
            _gated_persistent[(min(sms, tiles),)](*args, NUM_SMS=sms, WARP_SPECIALIZE=warp_specialize, **meta)
        elif variant == "tiled":
            _gated_tiled[(tiles,)](*args, **meta)
        else:
            _gated_pointers[(tiles,)](*args, **meta)
        return out

    return run


def reference(x: torch.Tensor, wg: torch.Tensor, wu: torch.Tensor) -> torch.Tensor:
    x64 = x.double()
    return F.silu(x64 @ wg.double().T) * (x64 @ wu.double().T)


def cublas_pair(x, wg, wu, out):
    return silu_mul(F.linear(x, wg), F.linear(x, wu))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", default=None)
    parser.add_argument("--smoke", action="store_true")
    parser.add_argument("--rows", type=int, nargs="*", default=None)
    parser.add_argument("--variants", nargs="*", default=["tiled", "persistent", "persistent+ws", "pointers"])
    parser.add_argument("--configs", default=None, help="configs as a Python list of (BM, BN, BK, GROUP_M, warps, "
                        "stages) tuples, for every variant")
    args = parser.parse_args()
    device = "cpu" if args.smoke else "cuda"
    torch.manual_seed(0)
    triton.set_allocator(lambda size, alignment, stream: torch.empty(size, dtype=torch.int8, device=device))
    if args.smoke:
        rows, (_, hidden, inter), configs, sms = [SMOKE[0]], SMOKE, SMOKE_CONFIGS, 4
    else:
        rows, hidden, inter, configs = args.rows or ROWS, HIDDEN, INTERMEDIATE, CONFIGS
        sms = torch.cuda.get_device_properties(0).multi_processor_count
    dtype = torch.float32 if args.smoke else torch.bfloat16
    wg = torch.randn(inter, hidden, device=device, dtype=dtype) / hidden**0.5
    wu = torch.randn(inter, hidden, device=device, dtype=dtype) / hidden**0.5
    if args.configs:
        configs = [tuple(c) for c in ast.literal_eval(args.configs)]
        variants = [(v.removesuffix("+ws"), c, v.endswith("+ws")) for v in args.variants for c in configs]
    else:
        variants = [("tiled", c, False) for c in configs] + [("persistent", c, False) for c in configs]
        variants += [("persistent", c, True) for c in configs[:2]] + [("pointers", c, False) for c in configs[:3]]
    result = {"gpu": "cpu (interpreter)" if args.smoke else torch.cuda.get_device_name(0),
              "torch": torch.__version__, "triton": triton.__version__,
              "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"), "rows": []}
    for m in rows:
        x = torch.randn(m, hidden, device=device, dtype=dtype)
        out = torch.empty(m, inter, device=device, dtype=dtype)
        expected = reference(x[:128], wg, wu)
        flops = 2 * m * hidden * 2 * inter
        base_ms = median_ms(lambda: cublas_pair(x, wg, wu, out))
        gemms_ms = median_ms(lambda: (F.linear(x, wg), F.linear(x, wu)))
        for impl, ms in (("cublas_pair+silu_mul", base_ms), ("cublas_pair", gemms_ms)):
            result["rows"].append({"what": "gated_gemm", "impl": impl, "config": None, "m": m, "ms": ms,
                                   "tflops": flops / ms / 1e9, "vs_cublas": base_ms / ms})
            print(f"M {m:6d}  {impl:28s} {'':26s} {ms:8.3f} ms  {flops / ms / 1e9:6.1f} TFLOP/s")
        for variant, config, ws in variants:
            name = variant + ("+ws" if ws else "")
            run = launcher(variant, config, sms, ws)
            try:
                out.fill_(float("nan"))
                got = run(x, wg, wu, out)[:128].double()
                error = ((got - expected).norm() / expected.norm()).item()
                if not error < (1e-4 if dtype == torch.float32 else 2e-2):
                    raise AssertionError(f"relative error {error:.3g}")
                ms = median_ms(lambda run=run: run(x, wg, wu, out))
            except Exception as failure:  # a config that does not compile or is wrong: recorded, the others run
                print(f"M {m:6d}  {name:28s} {str(config):26s} failed: {type(failure).__name__}: {failure}"[:300])
                traceback.print_exc(limit=1)
                result["rows"].append({"what": "gated_gemm", "impl": name, "config": list(config), "m": m,
                                       "error": f"{type(failure).__name__}: {failure}"[:500]})
                continue
            result["rows"].append({"what": "gated_gemm", "impl": name, "config": list(config), "m": m, "ms": ms,
                                   "tflops": flops / ms / 1e9, "vs_cublas": base_ms / ms, "rel_err": error})
            print(f"M {m:6d}  {name:28s} {str(config):26s} {ms:8.3f} ms  {flops / ms / 1e9:6.1f} TFLOP/s  "
                  f"x{base_ms / ms:.3f} vs cuBLAS + silu_mul  (err {error:.1e})")
        again_ms = median_ms(lambda: cublas_pair(x, wg, wu, out))  # the baseline after the GPU has warmed up
        result["rows"].append({"what": "gated_gemm", "impl": "cublas_pair+silu_mul (again)", "config": None, "m": m,
                               "ms": again_ms, "tflops": flops / again_ms / 1e9, "vs_cublas": base_ms / again_ms})
        print(f"M {m:6d}  {'cublas_pair+silu_mul (again)':28s} {'':26s} {again_ms:8.3f} ms")
    if args.out:
        with open(args.out, "w") as f:
            json.dump(result, f, indent=1)


if __name__ == "__main__":
    main()
