"""Decode attention rows for ``decode_bench.py``: fuselm.decode_attention against SDPA's flash and cuDNN backends.

    python benchmarks/decode_bench.py --only attention [--sweep-programs-per-sm 1 2 4] [--sweep-attention-configs]
        [--sweep-min-split-positions 32 64 128 256] [--sweep-splits 1 2 3 4 6 [--sweep-attention-configs]]

Llama-3-8B shapes (Hq = 32, Hkv = 8, D = 128, bf16), one query per row (T = 1), at B = 1 x L = 32768 and
B = 32 x L = 4096, with the cache full (valid = L) and half full (valid = L / 2). fuselm reads the whole
[B, Hkv, L, D] buffer's valid positions through starts = 0, ends = valid; SDPA gets the valid prefix as
contiguous tensors (copied outside the timing, SDPA's best case), its GQA either by ``enable_gqa=True`` or
by K/V expanded to Hq heads beforehand (``repeat``, expansion not timed).

Every figure is :func:`timing.median_ms` (CUDA events, warm-up, L2 flushed before each run) over replays of a
CUDA graph of the call (:func:`timing.captured`, after a warm-up that finishes autotuning), i.e. GPU time without
host overhead. Bandwidth counts the valid KV bytes every implementation must read, 2 (K and V) * B * Hkv * valid *
D * 2 bytes, against a copy's bandwidth measured in the same run. q and the output (B * Hq * D * 2 bytes each) are
left out: under 0.01 %.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from timing import GB, captured, median_ms
from torch.nn.attention import SDPBackend, sdpa_kernel

import fuselm
from fuselm.ops import attention
from fuselm.ops._common import forced_config

BF16 = torch.bfloat16
SDPA_BACKENDS = {"flash": SDPBackend.FLASH_ATTENTION, "cudnn": SDPBackend.CUDNN_ATTENTION}
FORMULA = ("bytes = valid KV = 2 * B * Hkv * valid * D * 2; gbps = bytes / us; pct_of_copy = gbps / copy_gbps; "
           "SDPA over the valid prefix (contiguous copy, not timed)")


@dataclass(frozen=True)
class Heads:
    heads: int
    kv_heads: int
    head_dim: int


LLAMA3_8B = Heads(heads=32, kv_heads=8, head_dim=128)
SHAPES = [(1, 32768), (32, 4096)]  # (batch, context L)
SMOKE = Heads(heads=4, kv_heads=2, head_dim=64)
SMOKE_SHAPES = [(2, 64)]


def _device() -> str:
    return "cuda" if torch.cuda.is_available() else "cpu"


def implementations(heads: Heads, batch: int, context: int, valid: int) -> dict[str, Callable[[], object]]:
    """Each implementation's call, on shared inputs: fuselm over the buffer, SDPA over the valid prefix."""
    device = _device()
    q = torch.randn(batch, heads.heads, 1, heads.head_dim, device=device, dtype=BF16)
    k_cache = torch.randn(batch, heads.kv_heads, context, heads.head_dim, device=device, dtype=BF16)
    v_cache = torch.randn_like(k_cache)
    starts = torch.zeros(batch, dtype=torch.int32, device=device)
    ends = torch.full((batch,), valid, dtype=torch.int32, device=device)
    k, v = k_cache[:, :, :valid].contiguous(), v_cache[:, :, :valid].contiguous()
    group = heads.heads // heads.kv_heads
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


def time_shape(heads: Heads, batch: int, context: int, valid: int, copy_gbps: float,
               only: tuple[str, ...] = (), label: str = "") -> list[dict]:
    """One row per implementation (or per one of ``only``), each with its error relative to fuselm's output."""
    kv_bytes = 2 * batch * heads.kv_heads * valid * heads.head_dim * BF16.itemsize
    rows = []
    calls = implementations(heads, batch, context, valid)
    reference = calls["fuselm"]()
    for impl, call in calls.items():
        if only and impl not in only:
            continue
        impl += label
        try:
            error = ((call().float() - reference.float()).norm() / reference.float().norm()).item()
            us = median_ms(captured(call)) * 1e3
        except RuntimeError as exc:  # a backend that does not take these inputs
            print(f"  {impl:<20} B={batch:<3} L={context:<6} valid={valid:<6} unavailable: {str(exc).splitlines()[0]}")
            continue
        gbps = kv_bytes / (us * 1e-6) / GB
        formula = (f"2*{batch}*{heads.kv_heads}*{valid}*{heads.head_dim}*2 B = {kv_bytes / 1e6:.1f} MB / {us:.2f} us "
                   f"= {gbps:.1f} GB/s = {100 * gbps / copy_gbps:.1f} % of {copy_gbps:.0f} GB/s copy")
        rows.append({"what": "attention", "impl": impl, "batch": batch, "context": context, "valid": valid,
                     "us": round(us, 2), "bytes": kv_bytes, "gbps": round(gbps, 1),
                     "pct_of_copy": round(100 * gbps / copy_gbps, 1), "rel_err_vs_fuselm": float(f"{error:.2e}"),
                     "formula": formula})
        print(f"  {impl:<20} B={batch:<3} L={context:<6} valid={valid:<6} {us:9.2f} us   {formula}"
              f"   (|out - fuselm| / |fuselm| = {error:.1e})", flush=True)
    return rows


SWEEPABLE = {"programs_per_sm": ("PROGRAMS_PER_SM", "pps"), "combine_elements": ("COMBINE_ELEMENTS", "ce")}


def rows(copy_gbps: float, *, smoke: bool = False, sweeps: dict[str, tuple[int, ...]] | None = None,
         sweep_configs: bool = False) -> list[dict]:
    """The attention rows: every implementation at each shape, full and half-full caches; then fuselm alone with a
    module constant of :data:`SWEEPABLE` set to each of ``sweeps[name]`` (impl ``fuselm_ppsN`` for
    attention.PROGRAMS_PER_SM, ``fuselm_ceN`` for attention.COMBINE_ELEMENTS), and with ``sweep_configs`` each
    autotune config forced in turn (impl ``fuselm_cfgI``, I its index in the configs)."""
    heads, shapes = (SMOKE, SMOKE_SHAPES) if smoke else (LLAMA3_8B, SHAPES)
    out = []
    for batch, context in shapes:
        for valid in (context, context // 2):
            out += time_shape(heads, batch, context, valid, copy_gbps)
            if torch.cuda.is_available():
                torch.cuda.empty_cache()
    for name, values in (sweeps or {}).items():
        constant, prefix = SWEEPABLE[name]
        chosen = getattr(attention, constant)
        try:
            for value in values:
                setattr(attention, constant, value)
                for batch, context in shapes:
                    for valid in (context, context // 2):
                        out += time_shape(heads, batch, context, valid, copy_gbps, only=("fuselm",),
                                          label=f"_{prefix}{value}")
        finally:
            setattr(attention, constant, chosen)
    for index in range(len(attention._decode_attention.configs) if sweep_configs else 0):
        with forced_config(attention._decode_attention, index):
            for batch, context in shapes:
                for valid in (context, context // 2):
                    out += time_shape(heads, batch, context, valid, copy_gbps, only=("fuselm",), label=f"_cfg{index}")
    return out


SHORT_SHAPES = [(1, 768, 640), (1, 1024, 512), (1, 8192, 4096)]  # (batch, L, valid): generate's contexts at B = 1


def split_rows(copy_gbps: float, values: tuple[int, ...], *, smoke: bool = False) -> list[dict]:
    """fuselm alone at B = 1 and short contexts with attention.MIN_SPLIT_POSITIONS at each of ``values`` (impl
    ``fuselm_mspN``): how many splits a short row wants, where latency, not bandwidth, sets the time."""
    heads, shapes = (SMOKE, [(1, 64, 40)]) if smoke else (LLAMA3_8B, SHORT_SHAPES)
    chosen, out = attention.MIN_SPLIT_POSITIONS, []
    try:
        for value in values:
            attention.MIN_SPLIT_POSITIONS = value
            for batch, context, valid in shapes:
                out += time_shape(heads, batch, context, valid, copy_gbps, only=("fuselm",), label=f"_msp{value}")
    finally:
        attention.MIN_SPLIT_POSITIONS = chosen
    return out


# (batch, L, valid) at B = 32: fuselm.generate's bucket for a 512-token prompt and 256 new tokens (L = 768; valid 513
# at its first step, 640 on average), and the layer step's 1024 context (L = 2 x 1024). Its (row, kv head) units (256)
# outnumber the SMs, so _num_splits gives one split, and a program loops over the whole row.
B32_SHAPES = [(32, 768, 513), (32, 768, 640), (32, 2048, 1024)]
# (batch, L, valid) at B = 1 where 33 splits (132 SMs, 8 kv heads) leave 33 chunks active, whose partials merge in
# two steps of 32: the layer step's 4096 context (4097 visible at its step), and a span of 33 x 256. At 32 splits
# each merges in one (attention._num_splits rounds 33 down to the merge width).
B1_MERGE_SHAPES = [(1, 8192, 4097), (1, 8448, 8448), (1, 32768, 32768)]
SPLIT_SWEEP_SHAPES = {"b32": B32_SHAPES, "b1-merge": B1_MERGE_SHAPES}


def forced_split_rows(copy_gbps: float, splits: tuple[int, ...], *, configs: bool = False, smoke: bool = False,
                      shapes: str = "b32") -> list[dict]:
    """At ``shapes`` (B = 32's short rows, or B = 1's spans whose partials merge in two steps): fuselm with its
    own split count and cuDNN's GQA, then fuselm with the split count forced to each of ``splits`` (impl
    ``fuselm_splitN``; the autotuner picks each one's config), and with ``configs`` each autotune config forced
    as well (``fuselm_splitN_cfgI``). Whether a row of a few hundred positions wants splits even where the units
    alone fill the SMs; whether one merge step is worth a split. Nothing without ``splits``."""
    if not splits:
        return []
    heads, shapes = (SMOKE, [(2, 64, 40)]) if smoke else (LLAMA3_8B, SPLIT_SWEEP_SHAPES[shapes])
    out = []
    for batch, context, valid in shapes:
        out += time_shape(heads, batch, context, valid, copy_gbps, only=("fuselm", "sdpa_cudnn_gqa"))
    kernel = attention._decode_attention
    forced = [(None, "")] + [(index, f"_cfg{index}") for index in range(len(kernel.configs) if configs else 0)]
    chosen = attention._num_splits
    try:
        for value in splits:
            attention._num_splits = lambda *shape, value=value: value
            for index, suffix in forced:
                with forced_config(kernel, index) if index is not None else contextlib.nullcontext():
                    for batch, context, valid in shapes:
                        out += time_shape(heads, batch, context, valid, copy_gbps, only=("fuselm",),
                                          label=f"_split{value}{suffix}")
    finally:
        attention._num_splits = chosen
    return out


def settings() -> dict:
    """What the rows ran with: the split factor and the configs the autotuner chose (none under the interpreter)."""
    tuned = getattr(attention._decode_attention, "cache", {})
    return {"programs_per_sm": attention.PROGRAMS_PER_SM, "combine_elements": attention.COMBINE_ELEMENTS,
            "tuned_configs": {str(key): str(config) for key, config in tuned.items()}}


WIDE_TABLE_IMPLS = 8  # more impls than this (the sweeps): one line per shape and impl instead of a column per impl


def print_table(rows: list[dict], copy_gbps: float) -> None:
    if not rows:
        return
    impls = list(dict.fromkeys(row["impl"] for row in rows))
    cells = {(row["impl"], row["batch"], row["context"], row["valid"]): row for row in rows}
    shapes = list(dict.fromkeys((row["batch"], row["context"], row["valid"]) for row in rows))
    print(f"\ndecode attention, bf16, T=1: us (GB/s of valid KV, % of copy {copy_gbps:.0f} GB/s)")

    def cell(impl: str, shape: tuple[int, int, int]) -> str:
        row = cells.get((impl, *shape))
        return f"{row['us']:.1f} ({row['gbps']:.0f}, {row['pct_of_copy']:.0f}%)" if row else "-"

    if len(impls) > WIDE_TABLE_IMPLS:
        for shape in shapes:
            for impl in impls:
                if (impl, *shape) in cells:
                    print(f"{'{} x {}, {}'.format(*shape):<22}{impl:<24}{cell(impl, shape):>26}")
        return
    print(f"{'B x L, valid':<22}" + "".join(f"{impl:>26}" for impl in impls))
    for shape in shapes:
        print(f"{'{} x {}, {}'.format(*shape):<22}" + "".join(f"{cell(impl, shape):>26}" for impl in impls))
