"""Hardware counters (Nsight Compute) of one decode step's five fused kernels, at batch 1 and 32: what binds each.

The projections stream at ~3.9 TB/s at M = 1 and slower at M = 32, against ~4.2 for copy; B = 32's attention over
short rows reads at ~70 % of copy, and B = 1 x 32k's at ~60 %, behind cuDNN's ~64 % (benchmarks/NOTES.md). Timing
variants has not said why; the counters can: DRAM throughput against the shared-memory pipe, the warps' stall
reasons, occupancy. Launches each op of a Llama-3-8B layer's decode step once (after a warm-up that finishes
autotuning) between cudaProfilerStart and Stop, at B = 1 and B = 32 (cache of 768 positions, 640 valid:
fuselm.generate's mean row for a 512-token prompt and 256 new tokens), then decode attention alone at B = 1 x 32k,
fuselm's and SDPA's cuDNN backend on the valid prefix, then gate/up at M = 1 under two forced configs whose times
differ 2.4x (GATE_UP_CONFIGS) and qkv_rope at M = 32 under three (QKV_CONFIGS: one program per SM, or two to three).

    bash benchmarks/ncu_decode.sh OUT_DIR        # ncu over this script, then the summary table (FUSELM_NCU=1)
    python benchmarks/ncu_decode.py --summary OUT_DIR/ncu-decode-raw.csv
    python benchmarks/ncu_decode.py --smoke      # the launches only, tiny shapes, any device (no counters)
"""

from __future__ import annotations

import argparse
import csv

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

import fuselm
from fuselm.ops import decode_linear
from fuselm.ops._common import forced_config

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
    dtype = BF16 if device == "cuda" and not smoke else torch.float32  # smoke: fp32, comparable on any device

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


STEP_KERNELS = ("qkv_rope", "attention", "o + residual", "gate/up", "down + residual")


def long_attention(smoke: bool):
    """Decode attention alone at B = 1 over a full 32k cache (Llama-3-8B heads): fuselm's, and SDPA's cuDNN backend on
    the same keys and values (GQA), as two callables."""
    device = "cuda" if torch.cuda.is_available() else "cpu"
    heads, kv_heads, head_dim, length = (4, 2, 64, 96) if smoke else (32, 8, 128, 32768)
    dtype = BF16 if device == "cuda" and not smoke else torch.float32  # smoke: fp32, comparable on any device
    q = torch.randn(1, heads, 1, head_dim, device=device, dtype=dtype)
    k, v = (torch.randn(1, kv_heads, length, head_dim, device=device, dtype=dtype) for _ in range(2))
    starts, ends = (torch.tensor([value], dtype=torch.int32, device=device) for value in (0, length))

    def cudnn():
        with sdpa_kernel(SDPBackend.CUDNN_ATTENTION if device == "cuda" and not smoke else SDPBackend.MATH):
            return F.scaled_dot_product_attention(q, k, v, enable_gqa=True)

    return lambda: fuselm.decode_attention(q, k, v, starts, ends), cudnn


# (label: the forced config's meta-parameters and stages): gate/up at M = 1 under two configs whose times differ 2.4x;
# qkv_rope at M = 32 under the H200 table's pick (96 programs of 181 KB shared memory, one per SM) and under two that
# launch 192 programs of 49 and 66 KB, two or three per SM
GATE_UP_CONFIGS = {"gate/up B1 32x256 s3": {"BLOCK_N": 32, "BLOCK_K": 256, "num_stages": 3},
                   "gate/up B1 32x128 s4": {"BLOCK_N": 32, "BLOCK_K": 128, "num_stages": 4}}
QKV_CONFIGS = {"qkv B32 1x256 k2 s3": {"SPLIT": 1, "BLOCK_K": 256, "SPLIT_K": 2, "num_stages": 3},
               "qkv B32 2x128 k2 s3": {"SPLIT": 2, "BLOCK_K": 128, "SPLIT_K": 2, "num_stages": 3},
               "qkv B32 1x64 k4 s4": {"SPLIT": 1, "BLOCK_K": 64, "SPLIT_K": 4, "num_stages": 4}}


def _config_index(kernel, wanted: dict) -> int:
    """The index in ``kernel.configs`` of the config whose meta-parameters and stages are ``wanted``."""
    for index, config in enumerate(kernel.configs):
        if {**config.kwargs, "num_stages": config.num_stages}.items() >= wanted.items():
            return index
    raise ValueError(f"{kernel.fn.__name__ if hasattr(kernel, 'fn') else kernel} has no config {wanted}")


def _forced(kernel, wanted: dict, call):
    def forced_call():
        with forced_config(kernel, _config_index(kernel, wanted)):
            return call()
    return forced_call


def forced_launches(smoke: bool) -> list[tuple[str, object]]:
    """gate/up at M = 1 under each of GATE_UP_CONFIGS and qkv_rope at M = 32 under each of QKV_CONFIGS (Llama-3-8B
    shapes), as labelled callables."""
    device = "cuda" if torch.cuda.is_available() else "cpu"
    hidden, heads, kv_heads, head_dim, inner, length = (
        (128, 4, 2, 64, 96, 48) if smoke else (4096, 32, 8, 128, 14336, 768))
    dtype = BF16 if device == "cuda" and not smoke else torch.float32  # smoke: fp32, comparable on any device

    def randn(*shape, scale=1.0):
        return torch.randn(*shape, device=device, dtype=dtype) * scale

    x, norm = randn(1, 1, hidden), 1 + 0.1 * randn(hidden)
    gate, up = (randn(inner, hidden, scale=hidden ** -0.5) for _ in range(2))
    rows = 32
    x32 = randn(rows, 1, hidden)
    wq, wk, wv = (randn(n * head_dim, hidden, scale=hidden ** -0.5) for n in (heads, kv_heads, kv_heads))
    angles = torch.rand(rows, 1, head_dim, device=device) * 6.28
    cos, sin = angles.cos().to(dtype), angles.sin().to(dtype)
    k_cache, v_cache = randn(rows, kv_heads, length, head_dim), randn(rows, kv_heads, length, head_dim)
    positions = torch.randint(0, length, (rows, 1), device=device, dtype=torch.int32)

    def gate_up():
        return fuselm.norm_gated_linear(x, norm, 1e-5, gate, up)

    def qkv():
        return fuselm.qkv_rope(x32, norm, 1e-5, wq, wk, wv, cos, sin, k_cache, v_cache, positions,
                               num_heads=heads, num_kv_heads=kv_heads)

    return ([(label, _forced(decode_linear._norm_gated_kernel, wanted, gate_up))
             for label, wanted in GATE_UP_CONFIGS.items()]
            + [(label, _forced(decode_linear._qkv_rope_split, wanted, qkv)) for label, wanted in QKV_CONFIGS.items()])


def launches(batches: list[int], smoke: bool) -> list[tuple[str, object]]:
    """(label, callable) in launch order; a step's label names its five kernels in STEP_KERNELS order."""
    fused, cudnn = long_attention(smoke)
    return ([(f"step B{batch}", layer_step(batch, smoke)) for batch in batches]
            + [("attention B1 x 32k", fused), ("cuDNN B1 x 32k", cudnn)] + forced_launches(smoke))


def labels(batches: list[int]) -> list[str]:
    """One label per profiled kernel, in launch order."""
    return ([f"{kernel} B{batch}" for batch in batches for kernel in STEP_KERNELS]
            + ["attention B1 x 32k", "cuDNN B1 x 32k", *GATE_UP_CONFIGS, *QKV_CONFIGS])


def profile(batches: list[int], smoke: bool) -> None:
    calls = launches(batches, smoke)
    for _, call in calls:  # autotuning (or the tuning table) and compiling, outside the profiled range
        for _ in range(3):
            call()
    cuda = torch.cuda.is_available()
    if cuda:
        torch.cuda.synchronize()
        torch.cuda.cudart().cudaProfilerStart()
    for _, call in calls:
        call()
    if cuda:
        torch.cuda.synchronize()
        torch.cuda.cudart().cudaProfilerStop()


def summary(path: str, batches: list[int]) -> None:
    """One line per profiled kernel of ncu's ``--page raw --csv`` (a header row, a units row, a row per kernel, in
    launch order, labelled by :func:`labels` when the counts agree): the SUMMARY metrics and the top three stalls."""
    with open(path, newline="") as file:
        table = list(csv.reader(line for line in file if line.startswith('"')))
    if len(table) < 2:
        print(f"no kernels in {path}")
        return
    header = table[0]
    units, kernels = dict(zip(header, table[1])), [dict(zip(header, row)) for row in table[2:]]
    names = labels(batches)
    if len(names) != len(kernels):  # another launch order: ncu's kernel names
        names = [kernel.get("Kernel Name", "?")[:24] for kernel in kernels]
    print(f"{'launch':<24} " + " ".join(f"{column:>11}" for _, column in SUMMARY) + "  top stalls (cycles per issue)")
    print(f"{'':<24} " + " ".join(f"{units.get(name, ''):>11}" for name, _ in SUMMARY))
    for name, kernel in zip(names, kernels):
        stalls = sorted(((_number(value), metric[len(STALLS):].replace("_per_issue_active.ratio", ""))
                         for metric, value in kernel.items()
                         if metric.startswith(STALLS) and _number(value) is not None), reverse=True)[:3]
        print(f"{name:<24} " + " ".join(f"{kernel.get(metric, '-'):>11}" for metric, _ in SUMMARY) + "  "
              + ", ".join(f"{reason} {value:.1f}" for value, reason in stalls))


def _number(text: str) -> float | None:
    try:
        return float(text.replace(",", ""))
    except ValueError:
        return None


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--batches", type=int, nargs="+", default=[1, 32])
    parser.add_argument("--smoke", action="store_true",
                        help="tiny fp32 shapes, any device (SDPA's math backend for cuDNN's row): checks the launches")
    parser.add_argument("--summary", metavar="CSV", help="print the table of an ncu CSV instead of launching")
    args = parser.parse_args()
    if args.summary:
        summary(args.summary, args.batches)
    else:
        profile(args.batches, args.smoke)


if __name__ == "__main__":
    main()
