"""Decode projection rows for ``decode_bench.py``: fuselm's fused weight-streaming ops against cuBLAS plus
separate kernels.

Llama-3-8B shapes in bf16 (hidden 4096, 32 q heads and 8 kv heads of 128, MLP 14336, a 1024-position KV
cache), M = B * T = 1, 8, 32, 64 rows (decode: B = M, T = 1):

- qkv_rope 4096 -> 6144 with RoPE and the KV-cache write;
- norm_gated_linear 4096 -> 2 x 14336 (SwiGLU);
- linear_residual 4096 -> 4096 (o) and 14336 -> 4096 (down).

Each implementation's call is captured in a CUDA graph (:func:`timing.captured`) over several independent sets
of weights and inputs (enough that one set's weights have left L2 when its turn comes again: 3 x L2 of weights
per graph), replayed, and timed as the median replay time (:func:`timing.median_ms`) divided by the sets: with its
L2 flush before each replay (``us``), and back to back without it (``us_steady``: the flush's dirty lines are
written back during the timed replay, a cost divided by the sets, which decode does not pay). Bytes counted: the
weights plus every activation read or written once (x, norm weight, residual, cos/sin, outputs, the cache rows
written); GB/s = bytes / time, against the copy bandwidth measured in the same run the same way.

The streaming kernels are timed at every M whatever the dispatch thresholds say, by calling their ``fuselm::`` ops
(decode_linear.QKV_ROPE, NORM_GATED_LINEAR, LINEAR_RESIDUAL) directly, so one run gives the numbers that set them:
the fused norm ops both ways (norm in the kernel's prologue, each row's rstd summed from the operand tiles, against
fuselm.rms_norm first: GATED_/QKV_PROLOGUE_NORM_MAX_ROWS) and linear_residual's kernel against cuBLAS addmm
(LINEAR_RESIDUAL_MAX_ROWS), next to what the public op dispatches to.

    python benchmarks/decode_bench.py --only projection [--rows 1 8 32 64 2048]
    python benchmarks/decode_bench.py --only projection --smoke   # tiny shapes, no GPU (interpreter, wall clock)
"""


from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass
from unittest import mock

import torch
import torch.nn.functional as F
import triton
from timing import GB, captured, median_ms

import fuselm
from fuselm.ops import decode_linear

BF16 = torch.bfloat16
ROWS = (1, 8, 32, 64)


@dataclass(frozen=True)
class Shapes:
    hidden: int
    heads: int
    kv_heads: int
    head_dim: int
    intermediate: int
    cache_len: int


LLAMA3_8B = Shapes(hidden=4096, heads=32, kv_heads=8, head_dim=128, intermediate=14336, cache_len=1024)
SMOKE = Shapes(hidden=64, heads=4, kv_heads=2, head_dim=16, intermediate=96, cache_len=16)


# ----------------------------------------------------------------------------------- projections
DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


def randn(*shape, scale=1.0, dtype=BF16):
    return (torch.randn(*shape, device=DEVICE) * scale).to(dtype)


@dataclass
class Projection:
    """One projection at one M: its implementations (each a call on one input set), inputs and byte count."""

    name: str
    m: int
    make_set: Callable[[], dict]
    impls: dict[str, Callable[[dict], object]]
    weight_bytes: int
    activation_bytes: int


def _fused_norm_variants(fused: Callable[[dict, str], object]) -> dict[str, Callable[[dict], object]]:
    """``fused(s, norm)`` four ways: the kernel's prologue norm, the same with its offset compiled in
    (FUSELM_CONSTANT_OFFSET=1's kernel, whatever the environment says), fuselm.rms_norm first, and no norm at all (the
    kernel alone on x as if a previous kernel had normed it: what moving the norm out of the prologue could save)."""

    def constant_offset(s):
        with mock.patch.object(decode_linear, "CONSTANT_OFFSET", True):
            return fused(s, "prologue")

    return {"fused, norm in prologue": lambda s: fused(s, "prologue"),
            "fused, norm in prologue, offset a constant": constant_offset,
            "fused, rms_norm first": lambda s: fused(s, "first"),
            "fused, x normed elsewhere (kernel alone)": lambda s: fused(s, "none")}


def _norm_operand(s: dict, norm: str) -> tuple:
    """(x, norm weight) for a streaming op: as given (``norm`` "prologue": in its prologue), fuselm.rms_norm(x)
    and None ("first"), or x and None ("none": no norm anywhere)."""
    if norm == "prologue":
        return s["x"], s["norm"]
    if norm == "first":
        return fuselm.rms_norm(s["x"], s["norm"], 1e-5).to(s["x"].dtype), None
    return s["x"], None


def qkv_projection(shapes: Shapes, m: int, as_generate: bool = False) -> Projection:
    """``as_generate``: cos/sin in the model's dtype and int32 positions, as ``fuselm.generate`` passes them (its
    launches file a tuning key of their own); else fp32 cos/sin and int64 positions."""
    q_size, kv_size = shapes.heads * shapes.head_dim, shapes.kv_heads * shapes.head_dim
    rope_dtype, positions_dtype = (BF16, torch.int32) if as_generate else (torch.float32, torch.int64)

    def make_set():
        angles = randn(m, 1, shapes.head_dim, scale=3.0, dtype=torch.float32)  # row b at its own position
        return {"x": randn(m, 1, shapes.hidden), "norm": 1 + randn(shapes.hidden, scale=0.1),
                "wq": randn(q_size, shapes.hidden, scale=0.02), "wk": randn(kv_size, shapes.hidden, scale=0.02),
                "wv": randn(kv_size, shapes.hidden, scale=0.02), "cos": angles.cos().to(rope_dtype),
                "sin": angles.sin().to(rope_dtype),
                "k_cache": randn(m, shapes.kv_heads, shapes.cache_len, shapes.head_dim),
                "v_cache": randn(m, shapes.kv_heads, shapes.cache_len, shapes.head_dim),
                "positions": torch.randint(0, shapes.cache_len, (m, 1), device=DEVICE, dtype=positions_dtype)}

    def fused(s, norm):
        return decode_linear.QKV_ROPE(*_norm_operand(s, norm), 1e-5, s["wq"], s["wk"], s["wv"], None, None,
                                      None, None, None, 1e-5, s["cos"], s["sin"], s["k_cache"], s["v_cache"],
                                      s["positions"], shapes.heads, "llama", 0.0)

    def separate(s):  # fuselm.rms_norm, three cuBLAS GEMMs, fuselm.rope, two index_put cache writes
        h = fuselm.rms_norm(s["x"], s["norm"], 1e-5)
        q = F.linear(h, s["wq"]).view(m, 1, shapes.heads, shapes.head_dim)
        k = F.linear(h, s["wk"]).view(m, 1, shapes.kv_heads, shapes.head_dim)
        v = F.linear(h, s["wv"]).view(m, 1, shapes.kv_heads, shapes.head_dim)
        q, k = fuselm.rope(q, k, s["cos"], s["sin"], layout="bshd")
        rows = torch.arange(m, device=DEVICE)[:, None]
        s["k_cache"][rows, :, s["positions"]] = k
        s["v_cache"][rows, :, s["positions"]] = v
        return q.transpose(1, 2)

    activations = (m * shapes.hidden * 2 + shapes.hidden * 2 + 2 * m * shapes.head_dim * rope_dtype.itemsize
                   + m * positions_dtype.itemsize + m * q_size * 2 + 2 * m * kv_size * 2)  # x, norm, cos + sin,
    # positions, q, cache rows
    name = f"qkv_rope {shapes.hidden}->{q_size + 2 * kv_size}" + (" (generate's dtypes)" if as_generate else "")
    return Projection(name, m, make_set,
                      {**_fused_norm_variants(fused), "cuBLAS + fuselm rms_norm/rope + index_put": separate},
                      (q_size + 2 * kv_size) * shapes.hidden * 2, activations)


def gate_up_projection(shapes: Shapes, m: int) -> Projection:
    n, k = shapes.intermediate, shapes.hidden

    def make_set():
        return {"x": randn(m, k), "norm": 1 + randn(k, scale=0.1), "gate": randn(n, k, scale=0.02),
                "up": randn(n, k, scale=0.02)}

    def fused(s, norm):
        return decode_linear.NORM_GATED_LINEAR(*_norm_operand(s, norm), 1e-5, s["gate"], s["up"], "silu", 0.0)

    def separate(s):  # fuselm.rms_norm, two cuBLAS GEMMs, fuselm.silu_mul
        h = fuselm.rms_norm(s["x"], s["norm"], 1e-5)
        return fuselm.silu_mul(F.linear(h, s["gate"]), F.linear(h, s["up"]))

    return Projection(f"norm_gated_linear {k}->2x{n}", m, make_set,
                      {**_fused_norm_variants(fused), "cuBLAS + fuselm rms_norm/silu_mul": separate},
                      2 * n * k * 2, m * k * 2 + k * 2 + m * n * 2)


def residual_projection(label: str, n_in: int, n_out: int, m: int) -> Projection:
    def make_set():
        return {"x": randn(m, n_in), "weight": randn(n_out, n_in, scale=0.02), "residual": randn(m, n_out)}

    return Projection(f"linear_residual {label} {n_in}->{n_out}", m, make_set, {
        "fused streaming kernel": lambda s: decode_linear.LINEAR_RESIDUAL(s["x"], s["weight"], s["residual"], None),
        "fuselm.linear_residual (dispatch)": lambda s: fuselm.linear_residual(s["x"], s["weight"], s["residual"]),
        "cuBLAS addmm(residual, x, W.T)": lambda s: torch.addmm(s["residual"], s["x"], s["weight"].t()),
        "cuBLAS + add": lambda s: s["residual"] + F.linear(s["x"], s["weight"]),
    }, n_out * n_in * 2, m * n_in * 2 + 2 * m * n_out * 2)


def projections(shapes: Shapes, rows: list[int]) -> list[Projection]:
    cases = []
    for m in rows:
        cases += [qkv_projection(shapes, m), gate_up_projection(shapes, m),
                  residual_projection("o", shapes.heads * shapes.head_dim, shapes.hidden, m),
                  residual_projection("down", shapes.intermediate, shapes.hidden, m)]
    return cases


def input_sets(weight_bytes: int) -> int:
    """Sets of weights per graph: 3 x L2 of weights, so each set's weights come from HBM on every replay."""
    if not torch.cuda.is_available():
        return 1
    return max(2, math.ceil(3 * torch.cuda.get_device_properties(0).L2_cache_size / weight_bytes))


def time_projection(case: Projection, copy: float, copy_steady: float) -> list[dict]:
    sets = [case.make_set() for _ in range(input_sets(case.weight_bytes))]
    rows = []
    for impl, fn in case.impls.items():
        with torch.no_grad():
            replay = captured(lambda fn=fn: [fn(s) for s in sets])
            us = median_ms(replay, rep_ms=300.0) * 1e3 / len(sets)
            us_steady = median_ms(replay, rep_ms=300.0, flush_l2=False) * 1e3 / len(sets)
        total = case.weight_bytes + case.activation_bytes
        gbps, gbps_steady = total / (us * 1e-6) / GB, total / (us_steady * 1e-6) / GB
        rows.append({"what": "projection", "impl": impl, "batch": case.m, "context": None, "m": case.m,
                     "name": case.name, "us": round(us, 2),
                     "bytes": total, "gbps": round(gbps, 1), "pct_of_copy": round(100 * gbps / copy, 1),
                     "us_steady": round(us_steady, 2), "pct_of_copy_steady": round(100 * gbps_steady / copy_steady, 1),
                     "formula": f"({case.weight_bytes} B weights + {case.activation_bytes} B activations) / "
                                f"{us:.2f} us = {gbps:.0f} GB/s = {100 * gbps / copy:.1f} % of {copy:.0f} GB/s copy",
                     "input_sets": len(sets)})
        print(f"{case.name:<34} M={case.m:<3} {impl:<44} {rows[-1]['formula']}", flush=True)
    return rows


def tuned_configs() -> dict[str, dict[str, str]]:
    return {name: {str(key): str(config) for key, config in kernel.cache.items()}
            for name, kernel in vars(decode_linear).items()
            if isinstance(kernel, triton.runtime.Autotuner) and kernel.cache}


def print_table(rows: list[dict]) -> None:
    if not rows:
        return
    ms = list(dict.fromkeys(row["m"] for row in rows))
    impls = list(dict.fromkeys(row["impl"] for row in rows))
    print("\nus (% of copy bandwidth) per projection and M; impls:")
    for index, impl in enumerate(impls):
        print(f"  [{index}] {impl}")
    for name in dict.fromkeys(row["name"] for row in rows):
        for m in ms:
            cells = [f"[{impls.index(r['impl'])}] {r['us']:7.1f} ({r['pct_of_copy']:4.1f} %; back to back "
                     f"{r['us_steady']:.1f}, {r['pct_of_copy_steady']:.1f} %)"
                     for r in rows if r["name"] == name and r["m"] == m]
            print(f"{name:<34} M={m:<3} " + "  ".join(cells))


FORMULA = ("bytes = weights + activations read or written once; us = graph replay / input_sets, L2 flushed before "
           "each replay; gbps = bytes / us; pct_of_copy = gbps / copy_gbps; us_steady, pct_of_copy_steady: replays "
           "back to back, no flush, against copy_gbps_steady")


def rows(copy_gbps: float, copy_gbps_steady: float, *, smoke: bool = False, ms: tuple[int, ...] = ROWS) -> list[dict]:
    """The projection rows: each projection at each M in ``ms``, every implementation (tiny shapes with ``smoke``);
    ``copy_gbps_steady``: the copy rate back to back, the ceiling of the back-to-back figures."""
    shapes = SMOKE if smoke else LLAMA3_8B
    out = []
    with fuselm.use_backend("triton"):
        for case in projections(shapes, list(ms)):
            out += time_projection(case, copy_gbps, copy_gbps_steady)
            if torch.cuda.is_available():
                torch.cuda.empty_cache()
    return out


def settings(smoke: bool = False) -> dict:
    """What the rows ran with: shapes, the dispatch thresholds, the configs the autotuner chose."""
    return {"shapes": vars(SMOKE if smoke else LLAMA3_8B),
            "gated_prologue_norm_max_rows": decode_linear.GATED_PROLOGUE_NORM_MAX_ROWS,
            "qkv_prologue_norm_max_rows": decode_linear.QKV_PROLOGUE_NORM_MAX_ROWS,
            "linear_residual_max_rows": decode_linear.LINEAR_RESIDUAL_MAX_ROWS,
            "tuned_configs": tuned_configs()}
