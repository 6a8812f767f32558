"""Kernel benchmarks on one CUDA GPU: fuselm against HF eager, torch.compile and Liger-Kernel.

Run on the GPU machine (``bash benchmarks/gpu_run.sh`` does it). Every figure is a median of
``timing.median_ms`` (CUDA events, after warm-up, L2 flushed before each call); the memory-bound
kernels' rows are the median over alternating rounds of every implementation, all reading the same
inputs, since several sit within a percent of each other at the bandwidth ceiling. Bandwidth figures
count the fewest bytes each op must move (each input read once, each output written once); the formula
is printed with the row. The copy-bandwidth and bf16-GEMM ceilings are measured in the same run.

Writes a JSON file (default ``benchmarks/results/kernels-h200.json``) that ``report.py`` turns
into BENCHMARKS.md.

``--ncu`` times nothing: it runs the forward of each ``--only`` kernel once per implementation (fuselm,
then its anchors compile and Liger) inside a CUDA profiler range, compilation and autotuning done
before it, so that Nsight Compute counts the DRAM bytes each kernel really moves:

    TORCHINDUCTOR_COMPILE_THREADS=1 ncu --target-processes application-only --clock-control none \
        --profile-from-start off --metrics dram__bytes_read.sum,dram__bytes_write.sum,gpu__time_duration.sum \
        python benchmarks/kernel_bench.py --ncu --only rope

(One compile thread: with inductor's compile workers running, ncu attached to them and hung.)
"""

from __future__ import annotations

import argparse
import datetime
import importlib.metadata
import json
import platform
import statistics
from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F
import triton
from rich.console import Console
from rich.table import Table
from timing import GB, captured, copy_gbps, copy_ms, gemm_tflops, median_ms

import fuselm

ROUNDS = 5  # alternating timing rounds per row
BF16 = torch.bfloat16


@dataclass
class Case:
    """One kernel at one shape: implementations to time, their inputs and the bytes they must move."""

    kernel: str
    make_inputs: Callable[[], tuple[torch.Tensor, ...]]
    impls: dict[str, Callable[..., object]]
    fwd_bytes: int
    fwd_formula: str
    bwd_bytes: int | None  # extra bytes for the backward; None: no fwd+bwd row
    bwd_formula: str = ""
    grad_inputs: tuple[int, ...] | None = None  # which inputs get gradients (default: every float input)


def _outputs(result: object) -> list[torch.Tensor]:
    items = result if isinstance(result, (tuple, list)) else (result,)
    return [t for t in items if isinstance(t, torch.Tensor) and t.requires_grad]


def replay_rounds(case: Case, pass_: str, console: Console, rounds: int = ROUNDS, shared_inputs: bool = True,
                  ) -> tuple[dict[str, list[float]], dict[str, float]]:
    """Each of ``case.impls`` for one pass, captured in a CUDA graph and timed in ``rounds`` alternating
    rounds. With ``shared_inputs`` every implementation reads the same input tensors, else each its own.
    Returns ({impl: ms per round}, {impl: ms over plain calls, host overhead included})."""
    shared = case.make_inputs() if shared_inputs else None
    replays, call_ms, alive = {}, {}, []  # a graph replays into the memory it captured: keep it referenced
    for impl, fn in case.impls.items():
        inputs = shared if shared_inputs else case.make_inputs()
        leaves = []
        if pass_ == "fwd+bwd":
            wanted = case.grad_inputs or range(len(inputs))
            leaves = [inputs[i].requires_grad_() for i in wanted if inputs[i].is_floating_point()]
        try:
            if pass_ == "fwd":
                def forward(fn=fn, inputs=inputs):
                    return fn(*inputs)

                with torch.no_grad():
                    call_ms[impl] = median_ms(forward)
                    replays[impl] = captured(forward)
            else:
                seeds = [torch.randn_like(o) for o in _outputs(fn(*inputs))]
                for leaf in leaves:
                    leaf.grad = None

                def step(fn=fn, inputs=inputs, seeds=seeds):
                    torch.autograd.backward(_outputs(fn(*inputs)), seeds)

                call_ms[impl] = median_ms(step, grad_to_none=leaves)
                replays[impl] = captured(step, grad_to_none=leaves)
                alive.append(seeds)
            alive.append(inputs)
        except Exception as exc:  # an anchor that cannot run this case is reported, not fatal
            console.print(f"[yellow]{case.kernel} {pass_} {impl}: skipped ({type(exc).__name__}: {exc})")
    times = {impl: [] for impl in replays}
    for _ in range(rounds):
        for impl, replay in replays.items():
            times[impl].append(median_ms(replay))
    del replays, alive
    torch.cuda.empty_cache()
    return times, call_ms


def time_case(case: Case, ceiling_gbps: float, console: Console) -> list[dict]:
    """Rows of :func:`replay_rounds` on shared inputs, ms the median over rounds: rows within a percent
    of each other are decided neither by clock drift between two measurements nor by where each one's
    inputs happen to lie in memory."""
    rows = []
    for pass_ in ("fwd", "fwd+bwd") if case.bwd_bytes is not None else ("fwd",):
        n_bytes = case.fwd_bytes + (case.bwd_bytes if pass_ == "fwd+bwd" else 0)
        same_size_ms = copy_ms(n_bytes)
        times, call_ms = replay_rounds(case, pass_, console)
        formula = case.fwd_formula + (f" + {case.bwd_formula}" if pass_ == "fwd+bwd" else "")
        for impl, impl_times in times.items():
            ms = statistics.median(impl_times)
            gbps = n_bytes / (ms * 1e-3) / GB
            rows.append({"kernel": case.kernel, "pass": pass_, "impl": impl, "ms": round(ms, 4),
                         "ms_rounds": [round(t, 4) for t in impl_times], "call_ms": round(call_ms[impl], 4),
                         "gbps": round(gbps, 1), "pct_copy": round(100 * gbps / ceiling_gbps, 1),
                         "pct_same_size_copy": round(100 * same_size_ms / ms, 1),
                         "same_size_copy_gbps": round(n_bytes / (same_size_ms * 1e-3) / GB, 1),
                         "bytes": n_bytes, "formula": formula})
    return rows


def liger_ops() -> dict[str, Callable[..., object]]:
    """Liger-Kernel's autograd functions when the wheel is importable, else {}."""
    try:
        from liger_kernel.ops.fused_add_rms_norm import LigerFusedAddRMSNormFunction
        from liger_kernel.ops.fused_linear_cross_entropy import (
            LigerFusedLinearCrossEntropyFunction,
        )
        from liger_kernel.ops.rope import LigerRopeFunction
        from liger_kernel.ops.swiglu import LigerSiLUMulFunction
        from liger_kernel.transformers.rms_norm import LigerRMSNorm
    except ImportError:
        return {}
    norms: dict[int, torch.nn.Module] = {}

    def rms_norm(x, w):
        if id(w) not in norms:
            norms[id(w)] = LigerRMSNorm(w.shape[0], eps=1e-6).to(x.device, x.dtype)
            norms[id(w)].weight = torch.nn.Parameter(w.detach())
        return norms[id(w)](x)

    return {
        "rms_norm": rms_norm,
        "add_rms_norm": lambda x, r, w: LigerFusedAddRMSNormFunction.apply(x, r, w, 1e-6, 0.0, "llama", False),
        "rope": lambda q, k, cos, sin: LigerRopeFunction.apply(q, k, cos, sin),
        "swiglu": lambda a, b: LigerSiLUMulFunction.apply(a, b),
        "linear_cross_entropy": lambda h, w, y: LigerFusedLinearCrossEntropyFunction.apply(h, w, y)[0],
    }


def hf_rms_norm(x: torch.Tensor, w: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
    """HF LlamaRMSNorm.forward, as eager PyTorch."""
    x32 = x.float()
    x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + eps)
    return w * x32.to(x.dtype)


def hf_add_rms_norm(x, r, w):
    total = r + x
    return hf_rms_norm(total, w), total


def hf_rope(q, k, cos, sin):
    from transformers.models.llama.modeling_llama import apply_rotary_pos_emb

    return apply_rotary_pos_emb(q, k, cos, sin)


def hf_swiglu(a, b):
    return F.silu(a) * b


def hf_linear_cross_entropy(h, w, y):
    return F.cross_entropy((h @ w.T).float(), y)


def build_cases(liger: dict) -> list[Case]:
    def impls(kernel, eager, ours):
        table = {"fuselm": ours, "eager": eager, "compile": torch.compile(eager)}
        if kernel in liger:
            table["liger"] = liger[kernel]
        return table

    m, n = 16384, 4096
    norm_tensor = m * n * 2  # bytes of one [M, N] bf16 tensor
    b, hq, hk, s, d = 4, 32, 8, 4096, 128
    qk_bytes = b * (hq + hk) * s * d * 2
    i = 14336
    glu_bytes = m * i * 2

    def norm_inputs():
        return (torch.randn(m, n, device="cuda", dtype=BF16), 1 + 0.1 * torch.randn(n, device="cuda", dtype=BF16))

    def add_norm_inputs():
        x, w = norm_inputs()
        return x, torch.randn_like(x), w

    def rope_inputs():
        pos = torch.arange(s, device="cuda", dtype=torch.float32)
        inv_freq = 1.0 / 500000 ** (torch.arange(0, d, 2, device="cuda", dtype=torch.float32) / d)
        angles = torch.cat([torch.outer(pos, inv_freq)] * 2, dim=-1)[None]
        q, k = (torch.randn(b, heads, s, d, device="cuda", dtype=BF16) for heads in (hq, hk))
        return q, k, angles.cos().to(BF16), angles.sin().to(BF16)

    def glu_inputs():
        return torch.randn(m, i, device="cuda", dtype=BF16), torch.randn(m, i, device="cuda", dtype=BF16)

    return [
        Case("rms_norm", norm_inputs, impls("rms_norm", hf_rms_norm, fuselm.rms_norm),
             2 * norm_tensor, "read x + write y (2·M·N·2 B)", 3 * norm_tensor, "read x, dy + write dx (3·M·N·2 B)"),
        Case("add_rms_norm", add_norm_inputs, impls("add_rms_norm", hf_add_rms_norm, fuselm.add_rms_norm),
             4 * norm_tensor, "read x, r + write y, sum (4·M·N·2 B)", 4 * norm_tensor,
             "read sum, dy, dsum + write dx (4·M·N·2 B)"),
        Case("rope", rope_inputs, impls("rope", hf_rope, fuselm.rope), 2 * qk_bytes,
             "read q, k + write q, k", 2 * qk_bytes, "read dq, dk + write dq, dk",
             grad_inputs=(0, 1)),  # HF's cos/sin need no gradient
        Case("swiglu", glu_inputs, impls("swiglu", hf_swiglu, fuselm.silu_mul), 3 * glu_bytes,
             "read a, b + write c (3·M·I·2 B)", 5 * glu_bytes, "read a, b, dc + write da, db (5·M·I·2 B)"),
    ]


def profile_forwards(case: Case, console: Console) -> None:
    """``case``'s forward once per implementation, fuselm first, then the anchors, each inside a CUDA
    profiler range (for ``ncu --profile-from-start off``) after three calls outside it."""
    impls = [impl for impl in ("fuselm", "compile", "liger") if impl in case.impls]
    inputs = case.make_inputs()
    console.print(f"{case.kernel} fwd: counted {case.fwd_bytes / 1e6:.1f} MB ({case.fwd_formula}); the profiled "
                  f"kernels follow in this order: {', '.join(impls)}")
    with torch.no_grad():
        for impl in impls:
            fn = case.impls[impl]
            for _ in range(3):
                fn(*inputs)
            torch.cuda.synchronize()
            torch.cuda.profiler.start()
            fn(*inputs)
            torch.cuda.synchronize()
            torch.cuda.profiler.stop()


def linear_cross_entropy_rows(liger: dict, console: Console) -> list[dict]:
    """Fused linear cross-entropy, fwd+bwd, with peak extra memory, against its three GEMMs."""
    tokens, hidden, vocab = 8192, 4096, 128256
    h = torch.randn(tokens, hidden, device="cuda", dtype=BF16) * 0.5
    w = torch.randn(vocab, hidden, device="cuda", dtype=BF16) * 0.02
    y = torch.randint(0, vocab, (tokens,), device="cuda")
    def three_gemms_ms() -> float:  # logits, d hidden, d weight; the [N, V] buffer is freed on return
        dlogits = torch.randn(tokens, vocab, device="cuda", dtype=BF16)
        return median_ms(lambda: h @ w.T) + median_ms(lambda: dlogits @ w) + median_ms(lambda: dlogits.T @ h)

    gemms_ms = three_gemms_ms()
    flops = 3 * 2 * tokens * hidden * vocab
    rows = [{"kernel": "linear_cross_entropy", "pass": "fwd+bwd", "impl": "3 GEMMs (cuBLAS)", "ms": round(gemms_ms, 3),
             "tflops": round(flops / (gemms_ms * 1e-3) / 1e12, 1), "formula": "3 · 2·N·H·V FLOPs"}]
    impls = {"fuselm": fuselm.linear_cross_entropy,
             "fuselm, 256-token chunks": lambda h, w, y: fuselm.linear_cross_entropy(h, w, y, chunk_tokens=256),
             "eager": hf_linear_cross_entropy, "compile": torch.compile(hf_linear_cross_entropy)}
    if "linear_cross_entropy" in liger:
        impls["liger"] = liger["linear_cross_entropy"]
    for impl, fn in impls.items():
        hh, ww = h.detach().clone().requires_grad_(), w.detach().clone().requires_grad_()
        try:
            fn(hh, ww, y).backward()
            hh.grad = ww.grad = None
            torch.cuda.synchronize()
            torch.cuda.reset_peak_memory_stats()
            base = torch.cuda.memory_allocated()
            fn(hh, ww, y).backward()
            torch.cuda.synchronize()
            grads_bytes = hh.grad.nbytes + ww.grad.nbytes
            peak_mb = (torch.cuda.max_memory_allocated() - base - grads_bytes) / 2**20
            def step(fn=fn, hh=hh, ww=ww):
                fn(hh, ww, y).backward()

            ms = median_ms(step, grad_to_none=[hh, ww])
        except Exception as exc:
            console.print(f"[yellow]linear_cross_entropy {impl}: skipped ({type(exc).__name__}: {exc})")
            continue
        rows.append({"kernel": "linear_cross_entropy", "pass": "fwd+bwd", "impl": impl, "ms": round(ms, 3),
                     "tflops": round(flops / (ms * 1e-3) / 1e12, 1), "vs_gemms": round(ms / gemms_ms, 3),
                     "peak_mb": round(peak_mb, 1),
                     "formula": "time vs the 3 GEMMs; peak_mb = max_allocated − allocated before − |dh| − |dW|"})
    return rows


def print_table(results: dict, console: Console) -> None:
    table = Table(title=f"{results['gpu']}  copy {results['copy_gbps']:.0f} GB/s  "
                        f"bf16 GEMM {results['gemm_tflops']:.0f} TFLOP/s")
    for col in ("kernel", "pass", "impl", "GPU ms", "GB/s", "% copy", "vs best anchor", "call ms"):
        table.add_column(col, justify="right" if col not in ("kernel", "pass", "impl") else "left")
    for row in results["rows"]:
        anchors = [r["ms"] for r in results["rows"] if r["kernel"] == row["kernel"] and r["pass"] == row["pass"]
                   and r["impl"] in ("compile", "liger")]
        vs = f"{min(anchors) / row['ms']:.2f}x" if anchors and row["impl"] == "fuselm" else ""
        gbps = row.get("gbps", row.get("tflops", ""))
        pct = row.get("pct_copy", row.get("peak_mb", ""))
        call = f"{row['call_ms']:.3f}" if "call_ms" in row else ""
        table.add_row(row["kernel"], row["pass"], row["impl"], f"{row['ms']:.3f}", str(gbps), str(pct), vs, call)
    console.print(table)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default="benchmarks/results/kernels-h200.json")
    parser.add_argument("--only", nargs="*", help="kernels to run (default: all)")
    parser.add_argument("--merge-into", help="an earlier results file: keep its rows for the kernels not run now")
    parser.add_argument("--ncu", action="store_true",
                        help="no timing: each --only kernel's forward once per implementation inside a CUDA "
                             "profiler range, for ncu --profile-from-start off (command in this file's docstring)")
    args = parser.parse_args()
    console = Console(width=140)
    torch.manual_seed(0)
    if args.ncu:
        for case in build_cases(liger_ops()):
            if not args.only or case.kernel in args.only:
                profile_forwards(case, console)
        return
    ceiling_gbps, ceiling_tflops = copy_gbps(), gemm_tflops()
    liger = liger_ops()
    results = {
        "gpu": torch.cuda.get_device_name(), "torch": torch.__version__, "triton": triton.__version__,
        "liger": _version("liger-kernel"), "transformers": _version("transformers"),
        "python": platform.python_version(),
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "copy_gbps": round(ceiling_gbps, 1), "gemm_tflops": round(ceiling_tflops, 1),
        "method": f"ms: median over {ROUNDS} alternating rounds (ms_rounds; every implementation of a row reads the "
                  "same input tensors) of the median of benchmarks/timing.py's median_ms (CUDA events, warm-up, L2 "
                  "flushed; do_bench's method) over replays of a CUDA graph of the call, i.e. GPU time; call_ms: "
                  "median_ms over plain calls, host overhead included; linear_cross_entropy: one median_ms over "
                  "plain calls; bf16",
        "rows": [],
    }
    for case in build_cases(liger):
        if not args.only or case.kernel in args.only:
            results["rows"] += time_case(case, ceiling_gbps, console)
            torch.cuda.empty_cache()
    if not args.only or "linear_cross_entropy" in args.only:
        results["rows"] += linear_cross_entropy_rows(liger, console)
    results["tuned_configs"] = tuned_configs()
    if args.merge_into:
        results = merged(json.load(open(args.merge_into)), results)
    with open(args.out, "w") as f:
        json.dump(results, f, indent=1)
    for row in results["rows"]:
        console.print(f"  {row['kernel']:<22}{row['pass']:<8}{row['impl']:<17}{row['formula']}")
    print_table(results, console)


def merged(earlier: dict, now: dict) -> dict:
    """``earlier`` with the rows of the kernels measured ``now`` replaced, and a note of the re-run."""
    kernels = {row["kernel"] for row in now["rows"]}
    rows = [row for row in earlier["rows"] if row["kernel"] not in kernels] + now["rows"]
    reruns = earlier.get("reruns", []) + [{key: now[key] for key in ("date", "copy_gbps", "gemm_tflops", "torch",
                                                                        "triton")} | {"kernels": sorted(kernels)}]
    return earlier | {"rows": rows, "reruns": reruns,
                      "tuned_configs": earlier.get("tuned_configs", {}) | now.get("tuned_configs", {})}


def tuned_configs() -> dict[str, dict[str, str]]:
    """The config the autotuner chose, per tuning key, for each fuselm kernel tuned in this run."""
    from fuselm.ops import cross_entropy, glu, rms_norm, rope

    tuned = {}
    for module in (rms_norm, rope, glu, cross_entropy):
        for name, kernel in vars(module).items():
            if isinstance(kernel, triton.runtime.Autotuner) and kernel.cache:
                tuned[f"{module.__name__.rsplit('.', 1)[-1]}.{name}"] = {
                    str(key): str(config) for key, config in kernel.cache.items()}
    return tuned


def _version(distribution: str) -> str | None:
    try:
        return importlib.metadata.version(distribution)
    except importlib.metadata.PackageNotFoundError:
        return None


if __name__ == "__main__":
    main()
