"""Decode on one GPU: a decoder layer's decode step, decode attention and the fused projections, in one run.

    python benchmarks/decode_bench.py --out benchmarks/results/decode-h200.json
    python benchmarks/decode_bench.py --only layer_step          # or attention, projection (repeatable)
    python benchmarks/decode_bench.py --smoke                    # tiny shapes on CPU, wall clock: checks the script

Writes one JSON: rows ``{"what": "layer_step" | "attention" | "projection" | "prefill_layer", "impl", "batch",
"context", "us", "bytes", "pct_of_copy", ...}``, the GPU, versions, date, the copy bandwidth measured in this run
and the text of every formula. The attention rows come from ``decode_attention_bench.rows``, the projection rows from
``decode_linear_bench.rows``; this file adds the layer-step rows and the prefill-layer rows (one layer's forward
over T = 2048 new tokens, patched and unpatched, against its GEMMs and SDPA timed alone plus the byte bound of the
elementwise work: ``PREFILL_FORMULA``).

Layer step: one Llama-3-8B-shaped ``LlamaDecoderLayer`` (hidden 4096, 32 q heads, 8 kv heads of 128, MLP 14336,
RMSNorm eps 1e-5, bf16, SDPA) stepping one new token per row over a cache already holding ``context`` positions,
captured in a CUDA graph and timed as the median replay (timing.median_ms, L2 flushed). The layer is a middle one
(layer_idx 1 of 2): what a model does once per step for all its layers stays outside the timed step, for every impl
alike: HF's causal mask (its model builds it once per forward), and the opening of the step on fuselm's cache (ends
+= T and the slots the step writes: two small kernels that layer 0 runs once per forward), done once before
capture. Each replay first resets the cache's length (one small fill kernel, inside the timed graph: HF's StaticCache
layer counts its positions up each call; fuselm's is the same fill, its value unchanged), so every replay runs at the
same context. The chained figures time one graph of ``CHAIN_STEPS`` steps after one reset, per step: a decode runs its
layers back to back, each one's first kernel after the last one's final kernel, with no graph launch or reset between
them (HF's cache then counts ``CHAIN_STEPS`` more positions over the graph). Implementations:

- ``fuselm``: ``fuselm.patch(layer)`` with a ``fuselm.generation.FusedKVCache`` (the fused decode path when the
  patched layer has one; else HF's attention through the cache's ``update``), ``attention_mask=None``;
- ``hf_eager``: the unpatched layer with HF's ``StaticCache`` and the causal mask HF's model builds for it;
- ``hf_compile``: the same under ``torch.compile(layer)`` (default mode, compiled before timing);
- ``hf_fuselm_ops``: the patched layer with HF's ``StaticCache``: cuBLAS + SDPA + fuselm's elementwise ops.

Every cache holds the same random K/V. ``clocks`` (CUDA): nvidia-smi's SM clock, power and throttle reasons
sampled over a row's timed replays. ``kernels``: CUDA kernels of one eager step (torch.profiler; the length
reset is outside the profiled step), memcpy/memset counted apart.
"""

from __future__ import annotations

import os
import sys

if "--smoke" in sys.argv:  # before triton is imported: the Triton paths run in the interpreter on CPU
    os.environ.setdefault("TRITON_INTERPRET", "1")

import argparse
import datetime
import inspect
import json
import platform
import subprocess
import time
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass

import decode_attention_bench
import decode_linear_bench
import torch
import torch.nn.functional as F
import transformers
import triton
from timing import GB, ClockSampler, captured, copy_gbps, median_ms
from transformers import LlamaConfig, StaticCache
from transformers.masking_utils import create_causal_mask
from transformers.models.llama.modeling_llama import (
    LlamaDecoderLayer,
    LlamaRotaryEmbedding,
)

import fuselm
from fuselm.generation import FusedKVCache
from fuselm.ops import _common
from fuselm.ops._common import autotune_picks

WHATS = ("layer_step", "attention", "projection", "prefill_layer")
LAYER_CONFIG_KEYS = ("hidden_size", "num_attention_heads", "num_key_value_heads", "head_dim", "intermediate_size",
                     "rms_norm_eps")
IMPLS = ("fuselm", "hf_eager", "hf_compile", "hf_fuselm_ops")
BF16 = torch.bfloat16
LAYER_SHAPES = [(1, 512), (1, 4096), (32, 1024)]  # (batch, context: positions in the cache before the step)
SMOKE_LAYER_SHAPES = [(2, 8)]
# each cache holds max_len = MAX_LEN_FACTOR * context positions (HF's SDPA reads all of them), and at least context + 1
# + CHAIN_STEPS: HF's StaticCache writes each step of a chain at its next position
MAX_LEN_FACTOR = 2
CHAIN_STEPS = 8  # steps of one graph in the chained figures
LAYER_FORMULA = ("bytes = layer weights (every parameter) + KV read (valid positions only: 2 * B * Hkv * context "
                 "* D * 2) + KV written (2 * B * Hkv * D * 2) + activations (hidden in and out: 2 * B * hidden * 2); "
                 "bound_us = bytes / copy_gbps; pct_of_bound = bound_us / us = pct_of_copy (bytes / us against "
                 "copy_gbps); us: median CUDA-graph replay of one step, the length reset included, a 256 MiB buffer "
                 "zeroed before each (timing.median_ms's L2 flush, whose dirty lines are written back during the "
                 "step); us_steady: the same replays back to back, no flush (a step reads 436 MB or more, 7x L2, so "
                 "no replay finds the last one's bytes in L2: as consecutive decode steps run), against "
                 "copy_gbps_steady, back-to-back copies of the same 2 GiB: pct_of_bound_steady; us_chained, "
                 f"us_chained_steady: the same per step in one graph of {CHAIN_STEPS} steps after one reset (as a "
                 f"decode runs its layers back to back: one graph launch, one reset and, flushed, one flush's "
                 f"write-back per {CHAIN_STEPS} steps; a step's predecessor is the last step's final kernel, as in a "
                 f"model), the graph's median time / {CHAIN_STEPS}: pct_of_bound_chained, pct_of_bound_chained_steady")
COPY_BYTES, SMOKE_COPY_BYTES = 2**31, 2**20
COPY_FORMULA = "copy_gbps = {moved} B moved (half read, half written, bf16 copy_) / median time (timing.copy_gbps)"


def llama_config(smoke: bool) -> LlamaConfig:
    """A two-layer Llama-3-8B-shaped config (tiny with ``smoke``), SDPA attention: the caches hold two layers, so the
    layer step can time layer 1, a middle layer (``LAYER_STEP_INDEX``)."""
    sizes = ({"hidden_size": 64, "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 64,
              "intermediate_size": 96} if smoke else
             {"hidden_size": 4096, "num_attention_heads": 32, "num_key_value_heads": 8, "head_dim": 128,
              "intermediate_size": 14336})
    config = LlamaConfig(**sizes, rms_norm_eps=1e-5, num_hidden_layers=2, vocab_size=128, rope_theta=500000.0,
                         max_position_embeddings=16384)
    config._attn_implementation = "sdpa"
    return config


LAYER_STEP_INDEX = 1  # the layer-step layer: not layer 0, which opens each step on fuselm's cache


def new_layer(config: LlamaConfig, device: str, layer_idx: int = 0) -> LlamaDecoderLayer:
    """bf16, nn.Linear's random init, norm weights 1 + N(0, 0.1) (not all ones)."""
    with torch.device(device):
        layer = LlamaDecoderLayer(config, layer_idx=layer_idx).to(BF16).eval()
    with torch.no_grad():
        for norm in (layer.input_layernorm, layer.post_attention_layernorm):
            norm.weight.add_(0.1 * torch.randn_like(norm.weight))
    return layer


# The layer's cache argument: "past_key_values" in transformers <= 5.17, "cache" after (with a deprecation shim)
CACHE_ARG = "cache" if "cache" in inspect.signature(LlamaDecoderLayer.forward).parameters else "past_key_values"


@dataclass
class StepInputs:
    """What one decode step of B rows at ``context`` takes, shared by every implementation."""

    batch: int
    context: int
    max_len: int
    hidden: torch.Tensor  # [B, 1, hidden]
    cos_sin: tuple[torch.Tensor, torch.Tensor]  # [B, 1, D] each
    cache_position: torch.Tensor  # [1] int64: the new token's slot
    position_ids: torch.Tensor  # [B, 1]
    keys: torch.Tensor  # [B, Hkv, max_len, D]: every cache's contents
    values: torch.Tensor


def step_inputs(config: LlamaConfig, batch: int, context: int, device: str) -> StepInputs:
    max_len = max(MAX_LEN_FACTOR * context, context + 1 + CHAIN_STEPS)
    kv_heads, head_dim = config.num_key_value_heads, config.head_dim
    hidden = torch.randn(batch, 1, config.hidden_size, device=device, dtype=BF16)
    position_ids = torch.full((batch, 1), context, device=device)
    cos_sin = LlamaRotaryEmbedding(config).to(device)(hidden, position_ids)
    keys, values = (torch.randn(batch, kv_heads, max_len, head_dim, device=device, dtype=BF16) for _ in range(2))
    return StepInputs(batch, context, max_len, hidden, cos_sin, torch.tensor([context], device=device), position_ids,
                      keys, values)


def fused_cache(config: LlamaConfig, s: StepInputs, device: str) -> tuple[FusedKVCache, Callable[[], None]]:
    """A FusedKVCache whose layer ``LAYER_STEP_INDEX`` holds ``s``'s K/V at ``context`` positions, with the step
    opened as layer 0 opens it (ends = context + 1, the new token's slot at context), and the length reset (a fill
    of ends with that same value: the same one kernel as HF's reset)."""
    cache = FusedKVCache(config, s.batch, s.max_len, dtype=BF16, device=device)
    keys, values = cache.buffers(LAYER_STEP_INDEX)
    keys.copy_(s.keys)
    values.copy_(s.values)
    cache.plan(None)
    cache.advance(s.context)
    cache.open_step(1, s.position_ids)
    ends = cache.lengths(LAYER_STEP_INDEX)[1]
    return cache, lambda: ends.fill_(s.context + 1)


def static_cache(config: LlamaConfig, s: StepInputs, device: str) -> tuple[StaticCache, Callable[[], None]]:
    """HF's StaticCache whose layer ``LAYER_STEP_INDEX`` holds ``s``'s K/V at ``context`` positions, and the reset of
    its length to context."""
    cache = StaticCache(config=config, max_cache_len=s.max_len)
    cache.early_initialization(batch_size=s.batch, num_heads=config.num_key_value_heads, head_dim=config.head_dim,
                               dtype=BF16, device=device)
    for each in cache.layers:  # every layer at context positions, as after a prefill (the mask reads layer 0's)
        each.cumulative_length.fill_(s.context)
    layer = cache.layers[LAYER_STEP_INDEX]
    layer.keys.copy_(s.keys)
    layer.values.copy_(s.values)
    return cache, lambda: layer.cumulative_length.fill_(s.context)


def patch_checked(layer: torch.nn.Module) -> str:
    report = fuselm.patch(layer)
    if (report["decoder_layer"].patched, report["decoder_layer"].total) != (1, 1):
        raise RuntimeError(f"fuselm.patch did not patch the decoder layer:\n{report}")
    return str(report)


def count_kernels(step: Callable[[], object], reset: Callable[[], None]) -> dict:
    """CUDA kernels (and memcpy/memset) of one eager ``step``, the reset before it not profiled."""
    if not torch.cuda.is_available():
        return {}
    reset()
    torch.cuda.synchronize()
    try:
        with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU,
                                                torch.profiler.ProfilerActivity.CUDA]) as profile:
            step()
            torch.cuda.synchronize()
    except RuntimeError as error:  # a profiler that cannot start (CUPTI) costs the count, not the row
        return {"kernels_error": f"{type(error).__name__}: {error}"}
    device_events = [e.name for e in profile.events() if e.device_type == torch.autograd.DeviceType.CUDA]
    kernels = [name for name in device_events if not name.startswith(("Memcpy", "Memset"))]
    return {"kernels": len(kernels), "copies": len(device_events) - len(kernels),
            "kernel_names": dict(Counter(kernels))}


def layer_step_bytes(layer: torch.nn.Module, config: LlamaConfig, batch: int, context: int) -> dict[str, int]:
    item = BF16.itemsize
    kv_row = config.num_key_value_heads * config.head_dim * item  # one position of K (or V) in one row
    return {"weights": sum(p.numel() * p.element_size() for p in layer.parameters()),
            "kv_read": 2 * batch * context * kv_row, "kv_written": 2 * batch * kv_row,
            "activations": 2 * batch * config.hidden_size * item}


def layer_step_rows(copy: float, copy_steady: float, *, smoke: bool = False, impls: tuple[str, ...] = IMPLS,
                    sampler: ClockSampler | None = None,
                    shapes: tuple[tuple[int, int], ...] | None = None) -> tuple[list[dict], str]:
    """The layer-step rows (every impl at each (batch, context) of ``shapes``, default LAYER_SHAPES) and fuselm.patch's
    report on the layer; with ``sampler``, each row's ``clocks``: nvidia-smi's SM clock, power and throttle reasons
    over its timed replays."""
    device = "cuda" if torch.cuda.is_available() else "cpu"
    config = llama_config(smoke)
    layer = new_layer(config, device, LAYER_STEP_INDEX)
    rows, report = [], ""
    for batch, context in shapes or (SMOKE_LAYER_SHAPES if smoke else LAYER_SHAPES):
        s = step_inputs(config, batch, context, device)
        counted = layer_step_bytes(layer, config, batch, context)
        total = sum(counted.values())
        outputs = {}
        for impl in impls:
            row = {"what": "layer_step", "impl": impl, "batch": batch, "context": context, "max_len": s.max_len,
                   "bytes": total, "bytes_counted": counted}
            try:
                if impl in ("fuselm", "hf_fuselm_ops"):
                    report = patch_checked(layer)
                else:
                    fuselm.unpatch(layer)
                cache, reset = fused_cache(config, s, device) if impl == "fuselm" else static_cache(config, s, device)
                # HF's model builds this mask once per step for every layer: outside the timed step
                mask = None if impl == "fuselm" else create_causal_mask(config, s.hidden, None, cache, s.position_ids)
                if impl == "hf_compile":
                    torch._dynamo.reset()
                call = torch.compile(layer, dynamic=False) if impl == "hf_compile" else layer
                kwargs = {"position_embeddings": s.cos_sin, "attention_mask": mask, CACHE_ARG: cache,
                          "cache_position": s.cache_position}
                held = {}

                def step(call=call, hidden=s.hidden, kwargs=kwargs, held=held):
                    held["out"] = call(hidden, **kwargs)

                def replayed(step=step, reset=reset, steps=1):
                    reset()
                    for _ in range(steps):
                        step()

                with torch.no_grad():
                    replayed()  # compiles (hf_compile), autotunes (fuselm), and is the output checked
                    out = held["out"].clone()
                    replay = captured(replayed)
                    began = time.time()
                    us = median_ms(replay) * 1e3
                    us_steady = median_ms(replay, flush_l2=False) * 1e3
                    chain = captured(lambda replayed=replayed: replayed(steps=CHAIN_STEPS))
                    us_chained = median_ms(chain) * 1e3 / CHAIN_STEPS
                    us_chained_steady = median_ms(chain, flush_l2=False) * 1e3 / CHAIN_STEPS
                    if sampler is not None:
                        row["clocks"] = sampler.between(began, time.time())
                    row.update(count_kernels(step, reset))
                outputs[impl] = out
                bound_us, bound_steady_us = total / (copy * GB) * 1e6, total / (copy_steady * GB) * 1e6
                row.update({"us": round(us, 2), "bound_us": round(bound_us, 2),
                            "pct_of_bound": round(100 * bound_us / us, 1), "pct_of_copy": round(100 * bound_us / us, 1),
                            "us_steady": round(us_steady, 2), "bound_steady_us": round(bound_steady_us, 2),
                            "pct_of_bound_steady": round(100 * bound_steady_us / us_steady, 1),
                            "us_chained": round(us_chained, 2),
                            "pct_of_bound_chained": round(100 * bound_us / us_chained, 1),
                            "us_chained_steady": round(us_chained_steady, 2),
                            "pct_of_bound_chained_steady": round(100 * bound_steady_us / us_chained_steady, 1),
                            "finite": bool(torch.isfinite(out).all()), "out_shape": list(out.shape),
                            "mask": "none" if mask is None else f"HF causal mask {list(mask.shape)}",
                            "formula": f"({' + '.join(f'{v} B {k}' for k, v in counted.items())}) / {copy:.0f} GB/s "
                                       f"= {bound_us:.1f} us bound; / {us:.1f} us = {100 * bound_us / us:.1f} %"})
                del cache, call, held
            except Exception as error:  # noqa: BLE001 (e.g. torch.compile failing): recorded, the other impls go on
                row["error"] = f"{type(error).__name__}: {str(error).splitlines()[0] if str(error) else ''}"
            finally:
                fuselm.unpatch(layer)
                if torch.cuda.is_available():
                    torch.cuda.empty_cache()
            rows.append(row)
            detail = row.get("error") or (f"{row['us']:9.1f} us  {row['pct_of_bound']:5.1f} % of bound  "
                                          f"(back to back {row['us_steady']:.1f} us, {row['pct_of_bound_steady']:.1f} "
                                          f"%; chained {row['us_chained']:.1f} us, "
                                          f"{row['pct_of_bound_chained']:.1f} %, "
                                          f"back to back {row['us_chained_steady']:.1f} us, "
                                          f"{row['pct_of_bound_chained_steady']:.1f} %)  {row.get('kernels', '-')} "
                                          f"kernels   {row['formula']}"
                                          + (f"  clocks {row['clocks']}" if row.get("clocks") else ""))
            print(f"  layer_step {impl:<14} B={batch:<3} context={context:<5} {detail}", flush=True)
        if "hf_eager" in outputs:  # same weights, inputs and cache contents: the outputs compare
            reference = outputs["hf_eager"].float()
            for row in rows[-len(impls):]:
                if row["impl"] in outputs:
                    error = ((outputs[row["impl"]].float() - reference).norm() / reference.norm()).item()
                    row["rel_err_vs_hf_eager"] = float(f"{error:.2e}")
    return rows, report


PREFILL_TOKENS, SMOKE_PREFILL_TOKENS = (2048,), (24,)  # above DECODE_MAX_TOKENS: the fused prefill attention
PREFILL_FORMULA = ("bound_us = gemm_us (the layer's 7 projections alone, F.linear at M = T) + sdpa_us (causal SDPA "
                   "alone, GQA) + elementwise bytes / copy_gbps, the elementwise bytes being each unavoidable pass's "
                   "reads and writes, bf16: input norm 2 M H, RoPE 2 M (Hq + Hkv) D, residual add + norm 4 M H, "
                   "gated activation 3 M I, residual add 3 M H; pct_of_bound = bound_us / us (the issue's target: "
                   ">= 97 %, i.e. within 3 %); us: median CUDA-graph replay of the layer's forward over T new tokens "
                   "(no cache, causal)")


# fuselm: the patched layer with no cache (HF's attention, fuselm's norms and RoPE); fuselm_cache: the patched layer
# into an empty FusedKVCache (the fused prefill attention: qkv_rope's epilogue writes the cache, SDPA reads it there)
PREFILL_IMPLS = ("fuselm", "fuselm_cache", "hf_eager")


def prefill_layer_rows(copy: float, *, smoke: bool = False) -> list[dict]:
    """One decoder layer's prefill (B = 1, T tokens) patched (without a cache, and into an empty FusedKVCache) and
    unpatched (no cache), against what it cannot go below: its GEMMs and its attention timed alone plus the byte
    bound of the elementwise work around them."""
    device = "cuda" if torch.cuda.is_available() else "cpu"
    config = llama_config(smoke)
    layer = new_layer(config, device)
    return [row for tokens in (SMOKE_PREFILL_TOKENS if smoke else PREFILL_TOKENS)
            for row in _prefill_rows(layer, config, tokens, copy, device)]


def _prefill_rows(layer: LlamaDecoderLayer, config: LlamaConfig, tokens: int, copy: float, device: str) -> list[dict]:
    hidden_size, inter = config.hidden_size, config.intermediate_size
    heads, kv_heads, head_dim = config.num_attention_heads, config.num_key_value_heads, config.head_dim
    projections = [layer.self_attn.q_proj, layer.self_attn.k_proj, layer.self_attn.v_proj, layer.self_attn.o_proj,
                   layer.mlp.gate_proj, layer.mlp.up_proj, layer.mlp.down_proj]
    hidden = torch.randn(1, tokens, hidden_size, device=device, dtype=BF16)
    positions = torch.arange(tokens, device=device)[None]
    cos_sin = LlamaRotaryEmbedding(config).to(device)(hidden, positions)
    inputs = [torch.randn(1, tokens, proj.in_features, device=device, dtype=BF16) for proj in projections]
    q = torch.randn(1, heads, tokens, head_dim, device=device, dtype=BF16)
    k, v = (torch.randn(1, kv_heads, tokens, head_dim, device=device, dtype=BF16) for _ in range(2))
    with torch.no_grad():
        gemm_us = median_ms(captured(lambda: [F.linear(x, p.weight) for x, p in zip(inputs, projections)])) * 1e3
        sdpa_us = median_ms(captured(
            lambda: F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True))) * 1e3
    elementwise = BF16.itemsize * tokens * (2 * hidden_size + 2 * (heads + kv_heads) * head_dim + 4 * hidden_size
                                            + 3 * inter + 3 * hidden_size)
    bound_us = gemm_us + sdpa_us + elementwise / (copy * GB) * 1e6
    rows, held = [], {}
    cache = FusedKVCache(config, batch_size=1, max_cache_len=tokens, dtype=BF16, device=device)

    def forward(cached: bool):
        kwargs = {}
        if cached:  # a fresh cache each call: the fused prefill attention, its keys and values written in the epilogue
            cache.plan()
            kwargs[CACHE_ARG] = cache
        held["out"] = layer(hidden, position_embeddings=cos_sin, attention_mask=None, position_ids=positions, **kwargs)

    for impl in PREFILL_IMPLS:
        if impl != "hf_eager":
            patch_checked(layer)
        with torch.no_grad():
            us = median_ms(captured(lambda cached=impl == "fuselm_cache": forward(cached))) * 1e3
        fuselm.unpatch(layer)
        out = held["out"][0] if isinstance(held["out"], tuple) else held["out"]
        rows.append({"what": "prefill_layer", "impl": impl, "batch": 1, "context": tokens, "us": round(us, 1),
                     "gemm_us": round(gemm_us, 1), "sdpa_us": round(sdpa_us, 1), "elementwise_bytes": elementwise,
                     "bound_us": round(bound_us, 1), "pct_of_bound": round(100 * bound_us / us, 1),
                     "finite": bool(torch.isfinite(out).all()),
                     "formula": f"{gemm_us:.1f} us GEMMs + {sdpa_us:.1f} us SDPA + {elementwise} B / {copy:.0f} GB/s "
                                f"= {bound_us:.1f} us bound; / {us:.1f} us = {100 * bound_us / us:.1f} %"})
        print(f"  prefill_layer {impl:<8} T={tokens:<5} {rows[-1]['formula']}", flush=True)
    return rows


SMOKE_MAX_REL_ERR = 2e-2  # bf16 layer outputs against HF eager's (the GPU runs give ~2e-3)


def check_smoke(rows: list[dict]) -> None:
    """--smoke: every layer-step impl that ran gave finite outputs of its shape's [batch, 1, hidden], within
    SMOKE_MAX_REL_ERR of HF eager's (a head_dim decode_attention supports, so fuselm's row runs the fused decode path);
    every what produced rows."""
    steps = [row for row in rows if row["what"] == "layer_step"]
    bad = [f"{row['impl']}: {row.get('error') or 'not finite'}" for row in steps
           if not row.get("finite") and not (row["impl"] == "hf_compile" and "error" in row)]
    bad += [f"{row['impl']}: {row['rel_err_vs_hf_eager']} from HF eager" for row in steps
            if row.get("rel_err_vs_hf_eager", 0) > SMOKE_MAX_REL_ERR]
    bad += [f"{row['impl']}: output {row['out_shape']} at batch {row['batch']}" for row in steps
            if "out_shape" in row and row["out_shape"][:2] != [row["batch"], 1]]
    shapes = sorted({tuple(row["out_shape"]) for row in steps if "out_shape" in row})
    if bad or not shapes:
        raise SystemExit(f"smoke check failed: {bad or ''} output shapes {shapes}")
    print(f"smoke check: {len(steps)} layer-step rows, outputs finite, shapes {shapes}")


def print_layer_table(rows: list[dict], copy: float) -> None:
    steps = [row for row in rows if row["what"] == "layer_step"]
    if not steps:
        return
    print(f"\ndecoder layer decode step, Llama-3-8B shapes, bf16: us (% of byte bound at {copy:.0f} GB/s, kernels); "
          f"back to back, no L2 flush: us (% of bound at the back-to-back copy rate); chained ({CHAIN_STEPS} steps a "
          "graph), flushed and back to back: us (%)")
    impls = list(dict.fromkeys(row["impl"] for row in steps))
    print(f"{'B x context':<14}" + "".join(f"{impl:>72}" for impl in impls))
    for batch, context in dict.fromkeys((row["batch"], row["context"]) for row in steps):
        line = f"{f'{batch} x {context}':<14}"
        for impl in impls:
            row = next(r for r in steps if (r["impl"], r["batch"], r["context"]) == (impl, batch, context))
            cell = ("error" if "error" in row
                    else f"{row['us']:.1f} ({row['pct_of_bound']:.0f}%, {row.get('kernels', '-')}); "
                         f"{row['us_steady']:.1f} ({row['pct_of_bound_steady']:.0f}%); "
                         f"{row['us_chained']:.1f} ({row['pct_of_bound_chained']:.0f}%), "
                         f"{row['us_chained_steady']:.1f} ({row['pct_of_bound_chained_steady']:.0f}%)")
            line += f"{cell:>72}"
        print(line)


def layer_shape(text: str) -> tuple[int, int]:
    """'32x1024' -> (32, 1024): a layer-step shape, batch x context, both positive."""
    batch, sep, context = text.lower().partition("x")
    if not (sep and batch.isdigit() and context.isdigit() and int(batch) > 0 and int(context) > 0):
        raise argparse.ArgumentTypeError(f"a layer-step shape is BxCONTEXT with both positive, e.g. 32x1024; got "
                                         f"{text!r}")
    return int(batch), int(context)


def git_commit() -> str | None:
    try:
        # -dirty: the tree differs from that commit (a copied working tree, e.g. the device tool's, whose git
        # HEAD may lag the files it runs)
        return subprocess.run(["git", "describe", "--always", "--dirty"], capture_output=True, text=True,
                              check=True).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        return None


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default=None, help="JSON path (default benchmarks/results/decode-h200.json; "
                                                    "--smoke writes only when given)")
    parser.add_argument("--only", choices=WHATS, action="append", help="run only these row kinds (repeatable)")
    parser.add_argument("--smoke", action="store_true", help="tiny shapes on CPU, wall clock (checks the script)")
    parser.add_argument("--impls", nargs="*", choices=IMPLS, default=list(IMPLS), help="layer-step impls")
    parser.add_argument("--layer-shapes", type=layer_shape, nargs="+", default=None, metavar="BxCONTEXT",
                        help="layer-step shapes, e.g. 32x1024 (default: 1x512 1x4096 32x1024; smoke: 2x8)")
    parser.add_argument("--rows", type=int, nargs="*", default=list(decode_linear_bench.ROWS),
                        help="projection M values (above decode_linear.MAX_STREAMING_ROWS the fused ops take cuBLAS)")
    parser.add_argument("--sweep-programs-per-sm", type=int, nargs="*", default=[],
                        help="also time fuselm attention with attention.PROGRAMS_PER_SM at each (impl fuselm_ppsN)")
    parser.add_argument("--sweep-combine-elements", type=int, nargs="*", default=[],
                        help="also time fuselm attention with attention.COMBINE_ELEMENTS at each (impl fuselm_ceN)")
    parser.add_argument("--sweep-min-split-positions", type=int, nargs="*", default=[],
                        help="also time fuselm attention at B = 1, short contexts, with attention.MIN_SPLIT_POSITIONS "
                             "at each (impl fuselm_mspN)")
    parser.add_argument("--sweep-splits", type=int, nargs="*", default=[],
                        help="also time fuselm attention at B = 32's short rows with the split count forced to each "
                             "(impl fuselm_splitN; with --sweep-attention-configs every config too: "
                             "fuselm_splitN_cfgI), beside its own choice and cuDNN")
    parser.add_argument("--split-shapes", choices=sorted(decode_attention_bench.SPLIT_SWEEP_SHAPES), default="b32",
                        help="where --sweep-splits times: B = 32's short rows, or B = 1 spans whose 33 splits' "
                             "partials merge in two steps")
    parser.add_argument("--sweep-attention-configs", action="store_true",
                        help="also time fuselm attention with each autotune config forced (impl fuselm_cfgI)")
    args = parser.parse_args()
    whats = args.only or list(WHATS)
    torch.manual_seed(0)
    started = time.perf_counter()
    moved = COPY_BYTES if torch.cuda.is_available() else SMOKE_COPY_BYTES
    copy, copy_formula = copy_gbps(moved), COPY_FORMULA.format(moved=moved)
    print(f"copy: {copy_formula} = {copy:.0f} GB/s", flush=True)
    copy_steady = copy_gbps(moved, flush_l2=False) if {"layer_step", "projection"} & set(whats) else None
    if copy_steady is not None:
        print(f"copy back to back (no L2 flush): {copy_steady:.0f} GB/s", flush=True)
    rows, seconds, settings, report = [], {}, {}, None
    backend = fuselm.use_backend("triton") if args.smoke else fuselm.use_backend(fuselm.get_backend())
    with backend:
        for what in whats:
            began = time.perf_counter()
            if what == "attention":
                sweeps = {"programs_per_sm": tuple(args.sweep_programs_per_sm),
                          "combine_elements": tuple(args.sweep_combine_elements)}
                rows += decode_attention_bench.rows(copy, smoke=args.smoke, sweeps=sweeps,
                                                    sweep_configs=args.sweep_attention_configs)
                rows += decode_attention_bench.split_rows(copy, tuple(args.sweep_min_split_positions), smoke=args.smoke)
                rows += decode_attention_bench.forced_split_rows(copy, tuple(args.sweep_splits),
                                                                 configs=args.sweep_attention_configs, smoke=args.smoke,
                                                                 shapes=args.split_shapes)
                settings["attention"] = decode_attention_bench.settings()
            elif what == "projection":
                rows += decode_linear_bench.rows(copy, copy_steady, smoke=args.smoke, ms=tuple(args.rows))
                settings["projection"] = decode_linear_bench.settings(args.smoke)
            elif what == "prefill_layer":
                rows += prefill_layer_rows(copy, smoke=args.smoke)
            else:
                sampler = ClockSampler() if torch.cuda.is_available() else None
                settings["layer_step"] = _common.dependent_settings()
                layer_rows, report = layer_step_rows(copy, copy_steady, smoke=args.smoke, impls=tuple(args.impls),
                                                     sampler=sampler, shapes=args.layer_shapes)
                if sampler is not None:
                    sampler.stop()
                rows += layer_rows
            seconds[what] = round(time.perf_counter() - began, 1)
    results = {
        "gpu": torch.cuda.get_device_name() if torch.cuda.is_available() else "none (smoke run)",
        "torch": torch.__version__, "triton": triton.__version__, "transformers": transformers.__version__,
        "python": platform.python_version(), "fuselm_commit": git_commit(),
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "copy_gbps": round(copy, 1), "copy_gbps_steady": None if copy_steady is None else round(copy_steady, 1),
        "seconds": seconds, "patch_report": report, "settings": settings,
        "layer_config": {key: getattr(llama_config(args.smoke), key) for key in LAYER_CONFIG_KEYS}
        | {"dtype": "bfloat16", "max_len": f"{MAX_LEN_FACTOR} * context", "attn_implementation": "sdpa"},
        "formulas": {"copy_gbps": copy_formula, "layer_step": LAYER_FORMULA, "prefill_layer": PREFILL_FORMULA,
                     "attention": decode_attention_bench.FORMULA, "projection": decode_linear_bench.FORMULA},
        "rows": rows,
        "autotune_picks": autotune_picks(),
    }
    out = args.out or (None if args.smoke else "benchmarks/results/decode-h200.json")
    if out:
        with open(out, "w") as f:
            json.dump(results, f, indent=1)
    if args.smoke and "layer_step" in whats:
        check_smoke(rows)
    decode_attention_bench.print_table([r for r in rows if r["what"] == "attention"], copy)
    decode_linear_bench.print_table([r for r in rows if r["what"] == "projection"])
    print_layer_table(rows, copy)
    print(f"\n{seconds} s per part, {time.perf_counter() - started:.0f} s in all; formulas in the JSON's 'formulas'")


if __name__ == "__main__":
    main()
