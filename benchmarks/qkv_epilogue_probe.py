"""The prefill's q/k/v epilogue (``decode_linear._qkv_epilogue_kernel``: RoPE on q and k, q to [B, T, H, D], k and v
into the cache, after the three cuBLAS projections), every config timed against a copy of its bytes (session 25).

On the H200 its 32 launches took 0.79 ms of a 2048-token prefill (`results/ttft-session23-h200.json`), 24.7 us each
for ~50 MB: about half the copy rate, where the other elementwise kernels of the prefill run near it. A program
walks its GQA group's head slots one after another, so the configs differ in rows and warps a program (how many
programs, and so how many loads, are in flight). Llama-3-8B shapes (Hq 32, Hkv 8, D 128), bf16 projections,
cos/sin and cache, int32 cache slots, at B1 x 2048 (a 2048-token prompt) and B32 x 512 (the batch-32 generate's prompt).

bytes = read q, k, v + write q and the new k, v into the cache (2 x M x (Hq + 2 Hkv) x D x 2 B) + cos and sin;
pct_of_copy = copy of those bytes (``timing.copy_ms``, the same flush) / the row's time. Times: ``timing.median_ms``
over a CUDA-graph replay, L2 flushed.

Then the whole ``fuselm.qkv_rope`` at those sizes and at B1 x 8192 (normed x in, the three cuBLAS projections and the
epilogue), for every position's q and with ``last_only`` (a prefill's last layer: q's GEMM for each sequence's last
row, the epilogue's q heads only where a program holds one): rows ``"what": "qkv_rope"``, ``"last_only"``, ``"us"``.

    python benchmarks/qkv_epilogue_probe.py --out benchmarks/results/qkv-epilogue-probe-h100.json
    python benchmarks/qkv_epilogue_probe.py --smoke      (tiny shapes on the CPU, Triton's interpreter)
"""

from __future__ import annotations

import os
import sys

if "--smoke" in sys.argv:  # before triton is imported: the kernel runs in the interpreter on CPU
    os.environ.setdefault("TRITON_INTERPRET", "1")

import argparse
import datetime
import json

import torch
import triton
from timing import captured, copy_ms, median_ms

import fuselm
from fuselm.ops import _common, decode_linear

SHAPES = [(1, 2048), (32, 512)]  # (B, T)
SMOKE_SHAPES = [(2, 8)]
WHOLE_OP_SHAPES = [(1, 2048), (1, 8192), (32, 512)]
SMOKE_WHOLE_OP_SHAPES = [(2, 40)]  # 80 rows: past MAX_STREAMING_ROWS, the GEMM path


def inputs(batch: int, seq_len: int, heads: int, kv_heads: int, head_dim: int, device: str, dtype: torch.dtype):
    """(the epilogue's arguments, the bytes it moves) for one prefill of ``batch`` x ``seq_len`` tokens."""
    rows = batch * seq_len
    q = torch.randn(rows, heads * head_dim, device=device, dtype=dtype)
    k, v = (torch.randn(rows, kv_heads * head_dim, device=device, dtype=dtype) for _ in range(2))
    angles = torch.randn(1, seq_len, head_dim, device=device)
    cos, sin = angles.cos().to(dtype), angles.sin().to(dtype)
    caches = [torch.zeros(batch, kv_heads, seq_len + 64, head_dim, device=device, dtype=dtype) for _ in range(2)]
    slots = torch.arange(seq_len, device=device, dtype=torch.int32).expand(batch, -1).contiguous()
    moved = 2 * rows * (heads + 2 * kv_heads) * head_dim * q.element_size() + 2 * cos.numel() * cos.element_size()
    return (q, k, v, None, None, 1e-6, cos, sin, *caches, slots, heads, seq_len, "llama", 0.0), moved


def whole_op_rows(batch: int, seq_len: int, heads: int, kv_heads: int, head_dim: int, device: str,
                  dtype: torch.dtype) -> list[dict]:
    """fuselm.qkv_rope over a prefill of batch x seq_len normed tokens, q for every position and for the last."""
    hidden = heads * head_dim
    x = torch.randn(batch, seq_len, hidden, device=device, dtype=dtype)
    weights = [torch.randn(n * head_dim, hidden, device=device, dtype=dtype) / hidden**0.5
               for n in (heads, kv_heads, kv_heads)]
    angles = torch.randn(1, seq_len, head_dim, device=device)
    caches = [torch.zeros(batch, kv_heads, seq_len, head_dim, device=device, dtype=dtype) for _ in range(2)]
    slots = torch.arange(seq_len, device=device, dtype=torch.int32)
    call = (x, None, 1e-6, *weights, angles.cos().to(dtype), angles.sin().to(dtype), *caches, slots)
    rows = []
    for last_only in (False, True):
        def run(last_only=last_only):
            return fuselm.qkv_rope(*call, num_heads=heads, num_kv_heads=kv_heads, last_only=last_only)
        q = run()
        ms = median_ms(captured(run))
        rows.append({"what": "qkv_rope", "batch": batch, "seq_len": seq_len, "last_only": last_only,
                     "us": round(ms * 1e3, 2), "q_shape": list(q.shape)})
        print(f"qkv_rope B{batch:<3} T={seq_len:<5} last_only={last_only!s:<5} {rows[-1]['us']:9.2f} us  "
              f"q {tuple(q.shape)}", flush=True)
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", help="JSON path")
    parser.add_argument("--smoke", action="store_true", help="tiny shapes on the CPU")
    args = parser.parse_args()
    cuda = torch.cuda.is_available() and not args.smoke
    device, dtype = ("cuda", torch.bfloat16) if cuda else ("cpu", torch.float32)
    heads, kv_heads, head_dim = (32, 8, 128) if cuda else (4, 2, 16)
    tuner = decode_linear._qkv_epilogue_kernel
    rows = []
    with fuselm.use_backend("triton"), torch.no_grad():
        for batch, seq_len in SHAPES if cuda else SMOKE_SHAPES:
            call, moved = inputs(batch, seq_len, heads, kv_heads, head_dim, device, dtype)
            reference_ms = copy_ms(moved) if cuda else float("nan")
            expected = decode_linear.QKV_EPILOGUE(*call)  # the autotuner's pick (and every config compiled)
            picked = getattr(tuner, "best_config", None)  # the pick for this shape (GPU: its launch just set it)
            for index, config in enumerate(tuner.configs):
                with _common.forced_config(tuner, index):
                    out = decode_linear.QKV_EPILOGUE(*call)
                    same = bool(torch.equal(out, expected))
                    ms = median_ms(captured(lambda call=call: decode_linear.QKV_EPILOGUE(*call)))
                row = {"what": "epilogue", "batch": batch, "seq_len": seq_len,
                       "config": {**config.kwargs, "num_warps": config.num_warps},
                       "autotuner_pick": config is picked, "us": round(ms * 1e3, 2), "bytes": moved,
                       "gbps": round(moved / ms / 1e6, 1), "pct_of_copy": round(100 * reference_ms / ms, 1),
                       "equal_to_pick": same}
                rows.append(row)
                print(f"B{batch:<3} T={seq_len:<5} {str(row['config']):<48} {row['us']:8.2f} us  "
                      f"{row['gbps']:7.0f} GB/s  {row['pct_of_copy']:5.1f} % of copy"
                      + ("  (autotuner's pick)" if row["autotuner_pick"] else "") + ("" if same else "  DIFFERS"),
                      flush=True)
        for batch, seq_len in WHOLE_OP_SHAPES if cuda else SMOKE_WHOLE_OP_SHAPES:
            rows += whole_op_rows(batch, seq_len, heads, kv_heads, head_dim, device, dtype)
    if args.out:
        result = {"gpu": torch.cuda.get_device_name() if cuda else "cpu (smoke)", "torch": torch.__version__,
                  "triton": triton.__version__, "date": datetime.datetime.now(datetime.UTC).isoformat(),
                  "method": __doc__.split("\n\n")[2].replace("\n", " "), "rows": rows}
        with open(args.out, "w") as handle:
            json.dump(result, handle, indent=1)


if __name__ == "__main__":
    main()
