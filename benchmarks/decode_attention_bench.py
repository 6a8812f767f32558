"""Decode attention on one CUDA GPU: fuselm.decode_attention against SDPA's flash and cuDNN backends.

    python benchmarks/decode_attention_bench.py --out benchmarks/results/decode-attention-h200.json

Llama-3-8B shapes (Hq = 32, Hkv = 8, D = 128, bf16), one query per row (T = 1), at B = 1 x L = 32768 and
B = 32 x L = 4096, with the cache full (valid = L) and half full (valid = L / 2). fuselm reads the whole
[B, Hkv, L, D] buffer's valid positions through starts = 0, ends = valid; SDPA gets the valid prefix as
contiguous tensors (copied outside the timing, SDPA's best case), its GQA either by ``enable_gqa=True`` or
by K/V expanded to Hq heads beforehand (``repeat``, expansion not timed).

Every figure is the median of ``triton.testing.do_bench`` (CUDA events, warm-up, L2 flushed before each
run) over replays of a CUDA graph of the call (captured after a warm-up that finishes autotuning), i.e.
GPU time without host overhead. Bandwidth counts the valid KV bytes every implementation must read,
2 (K and V) * B * Hkv * valid * D * 2 bytes, against a copy's bandwidth measured in the same run
(read + write of 1 GiB). q and the output (B * Hq * D * 2 bytes each) are left out: under 0.01 %.
"""

from __future__ import annotations

import argparse
import datetime
import json
import platform
from collections.abc import Callable

import torch
import torch.nn.functional as F
import triton
from torch.nn.attention import SDPBackend, sdpa_kernel

import fuselm
from fuselm.ops import attention

GB = 1e9
BF16 = torch.bfloat16
HEADS, KV_HEADS, HEAD_DIM = 32, 8, 128
SHAPES = [(1, 32768), (32, 4096)]  # (batch, context L)
SDPA_BACKENDS = {"flash": SDPBackend.FLASH_ATTENTION, "cudnn": SDPBackend.CUDNN_ATTENTION}


def median_ms(fn: Callable[[], object]) -> float:
    return triton.testing.do_bench(fn, warmup=50, rep=200, return_mode="median")


def graph_replay_ms(fn: Callable[[], object]) -> float:
    """Median time of ``fn`` replayed from a CUDA graph (warm-up, compilation and autotuning outside it)."""
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(3):
            fn()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        fn()
    return median_ms(graph.replay)


def measure_copy_gbps() -> float:
    src = torch.randn(2**29, device="cuda", dtype=BF16)  # 1 GiB
    dst = torch.empty_like(src)
    return 2 * src.nbytes / (median_ms(lambda: dst.copy_(src)) * 1e-3) / GB


def implementations(batch: int, context: int, valid: int) -> dict[str, Callable[[], object]]:
    """Each implementation's call, on shared inputs: fuselm over the buffer, SDPA over the valid prefix."""
    q = torch.randn(batch, HEADS, 1, HEAD_DIM, device="cuda", dtype=BF16)
    k_cache = torch.randn(batch, KV_HEADS, context, HEAD_DIM, device="cuda", dtype=BF16)
    v_cache = torch.randn_like(k_cache)
    starts = torch.zeros(batch, dtype=torch.int32, device="cuda")
    ends = torch.full((batch,), valid, dtype=torch.int32, device="cuda")
    k, v = k_cache[:, :, :valid].contiguous(), v_cache[:, :, :valid].contiguous()
    group = HEADS // KV_HEADS
    k_repeated, v_repeated = k.repeat_interleave(group, dim=1), v.repeat_interleave(group, dim=1)
    calls = {"fuselm": lambda: fuselm.decode_attention(q, k_cache, v_cache, starts, ends)}
    for name, backend in SDPA_BACKENDS.items():
        def gqa(backend=backend):
            with sdpa_kernel(backend):
                return F.scaled_dot_product_attention(q, k, v, enable_gqa=True)

        def repeat(backend=backend):
            with sdpa_kernel(backend):
                return F.scaled_dot_product_attention(q, k_repeated, v_repeated)

        calls[f"sdpa_{name}_gqa"], calls[f"sdpa_{name}_repeat"] = gqa, repeat
    return calls


def time_shape(batch: int, context: int, valid: int, copy_gbps: float, only: str | None = None,
               label: str = "") -> list[dict]:
    """One row per implementation (or only ``only``), each with its error relative to fuselm's output."""
    kv_bytes = 2 * batch * KV_HEADS * valid * HEAD_DIM * BF16.itemsize
    rows = []
    calls = implementations(batch, context, valid)
    reference = calls["fuselm"]()
    for impl, call in calls.items():
        if only and impl != only:
            continue
        impl += label
        try:
            error = ((call().float() - reference.float()).norm() / reference.float().norm()).item()
            us = graph_replay_ms(call) * 1e3
        except RuntimeError as exc:  # a backend that does not take these inputs
            print(f"  {impl:<20} B={batch:<3} L={context:<6} valid={valid:<6} unavailable: {str(exc).splitlines()[0]}")
            continue
        gbps = kv_bytes / (us * 1e-6) / GB
        rows.append({"what": "attention", "impl": impl, "batch": batch, "context": context, "valid": valid,
                     "us": round(us, 2), "bytes": kv_bytes, "gbps": round(gbps, 1),
                     "pct_of_copy": round(100 * gbps / copy_gbps, 1), "rel_err_vs_fuselm": float(f"{error:.2e}")})
        print(f"  {impl:<20} B={batch:<3} L={context:<6} valid={valid:<6} {us:9.2f} us   "
              f"2*{batch}*{KV_HEADS}*{valid}*{HEAD_DIM}*2 B = {kv_bytes / 1e6:.1f} MB / {us:.2f} us = {gbps:7.1f} GB/s"
              f" = {100 * gbps / copy_gbps:5.1f} % of copy   (|out - fuselm| / |fuselm| = {error:.1e})")
    return rows


def split_sweep(copy_gbps: float, factors: list[int]) -> list[dict]:
    """fuselm alone with attention.PROGRAMS_PER_SM set to each factor (the split count's one tunable)."""
    rows, chosen = [], attention.PROGRAMS_PER_SM
    try:
        for factor in factors:
            attention.PROGRAMS_PER_SM = factor
            for batch, context in SHAPES:
                for valid in (context, context // 2):
                    rows += time_shape(batch, context, valid, copy_gbps, only="fuselm", label=f"_pps{factor}")
    finally:
        attention.PROGRAMS_PER_SM = chosen
    return rows


def print_table(rows: list[dict], copy_gbps: float) -> None:
    impls = list(dict.fromkeys(row["impl"] for row in rows))
    cells = {(row["impl"], row["batch"], row["context"], row["valid"]): row for row in rows}
    shapes = list(dict.fromkeys((row["batch"], row["context"], row["valid"]) for row in rows))
    print(f"\ndecode attention, bf16, Hq={HEADS} Hkv={KV_HEADS} D={HEAD_DIM}, T=1: us (GB/s of valid KV, % of "
          f"copy {copy_gbps:.0f} GB/s)")
    header = f"{'B x L, valid':<22}" + "".join(f"{impl:>26}" for impl in impls)
    print(header)
    for batch, context, valid in shapes:
        line = f"{f'{batch} x {context}, {valid}':<22}"
        for impl in impls:
            row = cells.get((impl, batch, context, valid))
            cell = f"{row['us']:.1f} ({row['gbps']:.0f}, {row['pct_of_copy']:.0f}%)" if row else "-"
            line += f"{cell:>26}"
        print(line)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default="benchmarks/results/decode-attention-h200.json")
    parser.add_argument("--sweep-programs-per-sm", type=int, nargs="*", default=[],
                        help="also time fuselm with attention.PROGRAMS_PER_SM set to each of these (impl fuselm_ppsN)")
    args = parser.parse_args()
    torch.manual_seed(0)
    copy_gbps = measure_copy_gbps()
    print(f"copy: 2 * 1 GiB / time = {copy_gbps:.1f} GB/s")
    rows = []
    for batch, context in SHAPES:
        for valid in (context, context // 2):
            rows += time_shape(batch, context, valid, copy_gbps)
            torch.cuda.empty_cache()
    rows += split_sweep(copy_gbps, args.sweep_programs_per_sm)
    results = {
        "gpu": torch.cuda.get_device_name(), "torch": torch.__version__, "triton": triton.__version__,
        "python": platform.python_version(),
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "copy_gbps": round(copy_gbps, 1), "programs_per_sm": attention.PROGRAMS_PER_SM,
        "method": "us: median of triton.testing.do_bench (CUDA events, warm-up, L2 flushed) over CUDA-graph replays; "
                  "bytes: valid KV, 2 * B * Hkv * valid * D * 2; gbps = bytes / us; pct_of_copy = gbps / copy_gbps",
        "tuned_configs": {str(key): str(config) for key, config in attention._decode_attention.cache.items()},
        "rows": rows,
    }
    with open(args.out, "w") as f:
        json.dump(results, f, indent=1)
    print_table(rows, copy_gbps)


if __name__ == "__main__":
    main()
