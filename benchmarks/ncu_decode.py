"""Hardware counters (Nsight Compute) of one decode step's five fused kernels, at batch 1 and 32: what binds each.

The projections stream at ~3.9 TB/s at M = 1 and slower at M = 32, against ~4.2 for copy, and B = 32's attention over
short rows reads at ~70 % of copy (benchmarks/NOTES.md). Timing variants has not said why; the counters can: DRAM
throughput against the shared-memory pipe, the warps' stall reasons, occupancy. Launches each op of a Llama-3-8B
layer's decode step once (after a warm-up that finishes autotuning) between cudaProfilerStart and Stop, at B = 1 and
B = 32 (cache of 768 positions, 640 valid: fuselm.generate's mean row for a 512-token prompt and 256 new tokens).

    bash benchmarks/ncu_decode.sh OUT_DIR        # ncu over this script, then the summary table (FUSELM_NCU=1)
    python benchmarks/ncu_decode.py --summary OUT_DIR/ncu-decode-raw.csv
    python benchmarks/ncu_decode.py --smoke      # the launches only, tiny shapes, any device (no counters)
"""

from __future__ import annotations

import argparse
import csv

import torch

import fuselm

BF16 = torch.bfloat16
# (ncu's raw metric, the column it gets in the summary)
SUMMARY = [("gpu__time_duration.sum", "time"), ("dram__bytes_read.sum", "dram read"),
           ("dram__throughput.avg.pct_of_peak_sustained_elapsed", "dram %"),
           ("lts__throughput.avg.pct_of_peak_sustained_elapsed", "L2 %"),
           ("l1tex__data_pipe_lsu_wavefronts_mem_shared.avg.pct_of_peak_sustained_elapsed", "smem %"),
           ("sm__throughput.avg.pct_of_peak_sustained_elapsed", "sm %"),
           ("sm__warps_active.avg.pct_of_peak_sustained_active", "occ %"), ("launch__grid_size", "grid"),
           ("launch__registers_per_thread", "regs"), ("smsp__average_warp_latency_per_inst_issued.ratio", "cyc/inst")]
STALLS = "smsp__average_warps_issue_stalled_"  # + reason + "_per_issue_active.ratio": cycles per issue stalled so


def layer_step(batch: int, smoke: bool):
    """The five fused ops of one Llama-3-8B-shaped decode step at ``batch`` rows (one new token each), as a callable."""
    device = "cuda" if torch.cuda.is_available() else "cpu"
    hidden, heads, kv_heads, head_dim, inner, length, valid = (
        (128, 4, 2, 64, 96, 48, 40) if smoke else (4096, 32, 8, 128, 14336, 768, 640))
    dtype = BF16 if device == "cuda" else torch.float32

    def randn(*shape, scale=1.0):
        return torch.randn(*shape, device=device, dtype=dtype) * scale

    shapes = {"q": (heads * head_dim, hidden), "k": (kv_heads * head_dim, hidden), "v": (kv_heads * head_dim, hidden),
              "o": (hidden, heads * head_dim), "gate": (inner, hidden), "up": (inner, hidden), "down": (hidden, inner)}
    w = {name: randn(n, k, scale=k ** -0.5) for name, (n, k) in shapes.items()}
    norm = 1 + 0.1 * randn(hidden)
    x = randn(batch, 1, hidden)
    angles = torch.rand(1, 1, head_dim, device=device) * 6.28
    cos, sin = angles.cos().to(dtype), angles.sin().to(dtype)
    k_cache, v_cache = randn(batch, kv_heads, length, head_dim), randn(batch, kv_heads, length, head_dim)
    starts = torch.zeros(batch, dtype=torch.int32, device=device)
    ends = torch.full((batch,), valid, dtype=torch.int32, device=device)
    positions = (ends - 1).view(batch, 1)

    def step():
        q = fuselm.qkv_rope(x, norm, 1e-5, w["q"], w["k"], w["v"], cos, sin, k_cache, v_cache, positions,
                            num_heads=heads, num_kv_heads=kv_heads)
        attended = fuselm.decode_attention(q, k_cache, v_cache, starts, ends).transpose(1, 2).reshape(batch, 1, -1)
        residual = fuselm.linear_residual(attended, w["o"], x)
        gated = fuselm.norm_gated_linear(residual, norm, 1e-5, w["gate"], w["up"])
        return fuselm.linear_residual(gated, w["down"], residual)

    return step


def profile(batches: list[int], smoke: bool) -> None:
    steps = [layer_step(batch, smoke) for batch in batches]
    for step in steps:  # autotuning (or the tuning table) and compiling, outside the profiled range
        for _ in range(3):
            step()
    cuda = torch.cuda.is_available()
    if cuda:
        torch.cuda.synchronize()
        torch.cuda.cudart().cudaProfilerStart()
    for step in steps:
        step()
    if cuda:
        torch.cuda.synchronize()
        torch.cuda.cudart().cudaProfilerStop()


def summary(path: str, batches: list[int]) -> None:
    """One line per profiled kernel of ncu's ``--page raw --csv`` (a header row, a units row, a row per kernel, in
    launch order: the steps of ``batches`` one after another): the SUMMARY metrics and the top three stall reasons."""
    with open(path, newline="") as file:
        table = list(csv.reader(line for line in file if line.startswith('"')))
    header, units, kernels = table[0], dict(zip(table[0], table[1])), [dict(zip(table[0], row)) for row in table[2:]]
    print(f"{'kernel':<28} {'B':>3} " + " ".join(f"{column:>11}" for _, column in SUMMARY) + "  top stalls (cycles)")
    print(f"{'':<28} {'':>3} " + " ".join(f"{units.get(name, ''):>11}" for name, _ in SUMMARY))
    per_batch = max(1, len(kernels) // len(batches))
    for index, kernel in enumerate(kernels):
        stalls = sorted(((_number(value), name[len(STALLS):].replace("_per_issue_active.ratio", ""))
                         for name, value in kernel.items() if name.startswith(STALLS) and _number(value) is not None),
                        reverse=True)[:3]
        batch = batches[min(index // per_batch, len(batches) - 1)]
        print(f"{kernel.get('Kernel Name', '?')[:28]:<28} {batch:>3} "
              + " ".join(f"{kernel.get(name, '-'):>11}" for name, _ in SUMMARY) + "  "
              + ", ".join(f"{reason} {value:.1f}" for value, reason in stalls))
    if not kernels:
        print(f"no kernels in {path} (columns: {header[:5]})")


def _number(text: str) -> float | None:
    try:
        return float(text.replace(",", ""))
    except ValueError:
        return None


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--batches", type=int, nargs="+", default=[1, 32])
    parser.add_argument("--smoke", action="store_true", help="tiny shapes, any device: checks the launches only")
    parser.add_argument("--summary", metavar="CSV", help="print the table of an ncu CSV instead of launching")
    args = parser.parse_args()
    if args.summary:
        summary(args.summary, args.batches)
    else:
        profile(args.batches, args.smoke)


if __name__ == "__main__":
    main()
