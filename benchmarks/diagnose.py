"""Where a fuselm call's time goes: GPU kernel or host (GPU machine only).

Part 1: per op at the benchmark shape, the median time of the public call and of the same call
replayed from a CUDA graph (no host overhead), and the GPU kernels one fwd+bwd step launches, with
their times (torch.profiler). Part 2: host microseconds per call on a tiny tensor, peeling one
layer at a time (public function, torch.ops custom op, launcher, bare kernel launch), and a
cProfile of the public call. Part 3: linear cross-entropy fwd+bwd at the benchmark shape, its
kernels against its wall time. Part 4: one batch-1 prefill of 2048 tokens through a 4-layer
Llama-3-8B-shaped model, patched by fuselm and by Liger-Kernel (when it imports): each one's kernels
with their GPU times, and the wall time. Part 5: RoPE fwd, fuselm against torch.compile, replayed
from a CUDA graph after a 256 MB L2 flush as the kernel benchmark times it: each kernel's start and
end on the GPU, from the profiler's trace. Part 6: RoPE fwd with each autotune config forced, timed
as the kernel benchmark times it (graph replays under do_bench). Part 7: the rows where fuselm led its
closest anchor by under 1 % (``CLOSE_ROWS``), both timed in alternating rounds so that drift between
two do_bench calls cannot decide the order. Part 8: eager SwiGLU fwd+bwd replayed from a CUDA
graph, on fresh inputs and on inputs shared with fuselm's graph, with its kernels.

    python benchmarks/diagnose.py [--parts 1 2 3 4 5 6 7 8]
"""

import argparse
import cProfile
import dataclasses
import pstats
import statistics
import time

import torch
import triton
from rich.console import Console

import fuselm
from fuselm.ops import glu, rms_norm, rope
from fuselm.ops._common import forced_config
from kernel_bench import (_outputs, build_cases, captured, graph_replay_ms, hf_swiglu, liger_ops, replay_rounds,
                          same_size_copy_ms)

BF16 = torch.bfloat16


def bench(fn):
    return triton.testing.do_bench(fn, warmup=50, rep=200, return_mode="median")


def host_us(fn, calls=2000):
    for _ in range(50):
        fn()
    torch.cuda.synchronize()
    start = time.perf_counter()
    for _ in range(calls):
        fn()
    elapsed = time.perf_counter() - start
    torch.cuda.synchronize()
    return elapsed / calls * 1e6


def profile_step(name, step):
    """The CUDA kernels of one call of ``step`` (after a warm-up), with their GPU times."""
    step()
    torch.cuda.synchronize()
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        step()
        torch.cuda.synchronize()
    print(f"kernels of one {name}:")
    print(prof.key_averages().table(sort_by="cuda_time_total", row_limit=25, max_name_column_width=70))


def profile_linear_cross_entropy():
    """Kernel time against wall time for one linear CE fwd+bwd at the benchmark shape (default chunks)."""
    tokens, hidden, vocab = 8192, 4096, 128256
    h = (torch.randn(tokens, hidden, device="cuda", dtype=BF16) * 0.5).requires_grad_()
    w = (torch.randn(vocab, hidden, device="cuda", dtype=BF16) * 0.02).requires_grad_()
    y = torch.randint(0, vocab, (tokens,), device="cuda")

    def step():
        h.grad = w.grad = None
        fuselm.linear_cross_entropy(h, w, y).backward()

    step()
    print(f"linear_cross_entropy fwd+bwd: {bench(step):.3f} ms per step (do_bench median)")
    profile_step("linear_cross_entropy fwd+bwd", step)
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        start.record()
        step()
        end.record()
        torch.cuda.synchronize()
    kernel_ms = sum(e.self_device_time_total for e in prof.key_averages()) / 1e3
    print(f"one step: {start.elapsed_time(end):.3f} ms wall (CUDA events), {kernel_ms:.3f} ms inside kernels")


def profile_prefill():
    """Kernels and wall time of one prefill (B1 × 2048, 4 layers), fuselm-patched against Liger-patched."""
    from e2e import build, median_ms

    prompt = torch.randint(0, 128256, (1, 2048), device="cuda")
    patchers = {"fuselm": fuselm.patch}
    try:
        from liger_kernel.transformers import apply_liger_kernel_to_llama
        patchers["liger"] = lambda model: apply_liger_kernel_to_llama(fused_linear_cross_entropy=False, model=model)
    except ImportError:
        print("liger-kernel not importable: fuselm only")
    for name, patch in patchers.items():  # fuselm first: Liger also swaps classes in transformers' module
        model = build(4, smoke=False)
        patch(model)
        with torch.no_grad():
            run = lambda: model(prompt, logits_to_keep=1, use_cache=False)  # noqa: E731
            print(f"{name} prefill, 4 layers: {median_ms(run, repeats=10, warmup=3):.2f} ms")
            profile_step(f"{name} prefill", run)
        del model
        torch.cuda.empty_cache()


def rope_timeline(replays: int = 5):
    """Per-kernel GPU start and end (µs after the flush ends) of RoPE fwd graph replays: fuselm's one
    kernel against torch.compile's two, each replay after do_bench's L2 flush (zeroing 256 MB)."""
    case = next(case for case in build_cases(liger={}) if case.kernel == "rope")
    inputs = case.make_inputs()
    flush = torch.empty(2**26, dtype=torch.int32, device="cuda")
    for impl in ("fuselm", "compile"):
        fn = case.impls[impl]
        replay = captured(lambda: fn(*inputs))  # compiled and autotuned in its warm-up
        with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
            for _ in range(replays):
                flush.zero_()
                replay()
            torch.cuda.synchronize()
        kernels = sorted((e for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA),
                         key=lambda e: e.time_range.start)
        print(f"RoPE fwd, {impl}: kernel, start and end in µs after the flush ends")
        flush_end = None
        for event in kernels:
            if any(word in event.name.lower() for word in ("elementwise", "fill", "memset")):  # the flush
                flush_end = event.time_range.end
                continue
            start, end = event.time_range.start - flush_end, event.time_range.end - flush_end
            print(f"  {event.name[:48]:<48} {start:7.1f} {end:7.1f} ({end - start:.1f} µs)")


def rope_configs():
    """RoPE fwd at the benchmark shape with each config of the out-of-place kernel forced."""
    case = next(case for case in build_cases(liger={}) if case.kernel == "rope")
    inputs = case.make_inputs()
    kernel = rope._rope_out_of_place
    print(f"RoPE fwd per config ({case.fwd_formula}: {case.fwd_bytes / 1e6:.1f} MB; same-size copy "
          f"{same_size_copy_ms(case.fwd_bytes) * 1e3:.1f} µs)")
    with torch.no_grad():
        for index, config in enumerate(kernel.configs):
            with forced_config(kernel, index):
                us = graph_replay_ms(lambda: fuselm.rope(*inputs)) * 1e3
            print(f"  {str(config.kwargs):<44} warps {config.num_warps}: {us:6.1f} µs, "
                  f"{case.fwd_bytes / us / 1e3:5.0f} GB/s")


CLOSE_ROWS = [  # (kernel, pass, anchor): where fuselm led the closest anchor by under 1 % in one run
    ("rms_norm", "fwd", "liger"), ("add_rms_norm", "fwd", "liger"), ("add_rms_norm", "fwd", "compile"),
    ("rope", "fwd", "compile"), ("swiglu", "fwd", "compile"), ("swiglu", "fwd+bwd", "compile")]


def tie_rounds(rounds: int = 11, kernels: list[str] | None = None):
    """Each close row timed for fuselm and its anchor in alternating rounds, each on its own inputs:
    per-round µs and medians."""
    cases = {case.kernel: case for case in build_cases(liger=liger_ops())}
    for kernel, pass_, anchor in CLOSE_ROWS:
        if kernels and kernel not in kernels:
            continue
        case = cases[kernel]
        if anchor not in case.impls:
            print(f"{kernel} {pass_}: {anchor} not available")
            continue
        pair = dataclasses.replace(case, impls={impl: case.impls[impl] for impl in ("fuselm", anchor)})
        times, _ = replay_rounds(pair, pass_, Console(), rounds=rounds, shared_inputs=False)
        print(f"{kernel} {pass_}, {rounds} alternating rounds (µs):")
        for impl, values in times.items():
            print(f"  {impl:<8} median {statistics.median(values) * 1e3:7.1f}  rounds "
                  + " ".join(f"{v * 1e3:.1f}" for v in values))
        wins = sum(f < a for f, a in zip(times["fuselm"], times[anchor]))
        print(f"  fuselm faster than {anchor} in {wins} of {rounds} rounds")


def eager_swiglu_replay():
    """Eager SwiGLU fwd+bwd from a CUDA graph: on fresh inputs, and on inputs whose fuselm graph was
    captured first (as kernel_bench.time_case shares them); each replay's time and kernels."""
    case = next(case for case in build_cases(liger={}) if case.kernel == "swiglu")
    alive = []
    for label, first in (("fresh inputs", None), ("after fuselm's capture on the same inputs", fuselm.silu_mul)):
        inputs = [t.requires_grad_() for t in case.make_inputs()]
        seeds = [torch.randn_like(inputs[0])]
        alive += [inputs, seeds]
        for fn in ([first] if first else []) + [hf_swiglu]:
            replay = captured(lambda fn=fn: torch.autograd.backward(_outputs(fn(*inputs)), seeds), grad_to_none=inputs)
            alive.append(replay)
        print(f"eager SwiGLU fwd+bwd replay, {label}: {bench(replay):.3f} ms")
        profile_step(f"eager replay, {label}", replay)


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--parts", type=int, nargs="+", default=[1, 2, 3, 4, 5, 6, 7, 8])
    parser.add_argument("--close-kernels", nargs="+", help="part 7: only these kernels' close rows")
    args = parser.parse_args()
    parts = args.parts
    if 1 in parts or 2 in parts:
        per_op_and_host()
    if 3 in parts:
        profile_linear_cross_entropy()
    if 4 in parts:
        profile_prefill()
    if 5 in parts:
        rope_timeline()
    if 6 in parts:
        rope_configs()
    if 7 in parts:
        tie_rounds(kernels=args.close_kernels)
    if 8 in parts:
        eager_swiglu_replay()


def per_op_and_host():
    m, n = 16384, 4096
    x, r, dy = (torch.randn(m, n, device="cuda", dtype=BF16) for _ in range(3))
    w = torch.randn(n, device="cuda", dtype=BF16)
    a, b = torch.randn(m, 14336, device="cuda", dtype=BF16), torch.randn(m, 14336, device="cuda", dtype=BF16)
    _, rstd = torch.ops.fuselm.rms_norm(x, w, 1e-6, 0.0, "llama")
    cases = {
        "rms_norm fwd": lambda: fuselm.rms_norm(x, w),
        "add_rms_norm fwd": lambda: fuselm.add_rms_norm(x, r, w),
        "rms_norm bwd op": lambda: torch.ops.fuselm.rms_norm_backward(dy, None, x, w, rstd, 0.0, "llama", False),
        "add_rms_norm bwd op": lambda: torch.ops.fuselm.rms_norm_backward(dy, r, x, w, rstd, 0.0, "llama", False),
        "silu_mul fwd": lambda: fuselm.silu_mul(a, b),
    }
    with torch.no_grad():
        for name, fn in cases.items():
            fn()
            print(f"{name:<22} call {bench(fn) * 1e3:8.1f} us   graph replay {bench(captured(fn)) * 1e3:8.1f} us")
        print("tuned:", {k: str(v) for k, v in rms_norm._rms_norm_bwd_kernel.cache.items()})

    leaves = [t.clone().requires_grad_() for t in (x, r, w)]

    def fresh_grads(step):  # each step starts with no .grad, as the benchmark's steps do
        def run():
            for leaf in leaves:
                leaf.grad = None
            step()
        return run

    profile_step("rms_norm fwd+bwd", fresh_grads(lambda: fuselm.rms_norm(leaves[0], leaves[2]).backward(dy)))
    profile_step("add_rms_norm fwd+bwd (x and residual are leaves)",
                 fresh_grads(lambda: torch.autograd.backward(fuselm.add_rms_norm(*leaves), [dy, r])))
    with torch.no_grad():
        tiny_a, tiny_b = a[:1], b[:1]
        out = torch.empty_like(tiny_a)
        numel = tiny_a.numel()
        glu._launch(glu._glu_fwd_kernel, [tiny_a, tiny_b], [out], "silu")
        best = glu._glu_fwd_kernel.best_config

        def bare():
            glu._glu_fwd_kernel.fn[(triton.cdiv(numel, best.kwargs["BLOCK"]),)](
                tiny_a, tiny_b, out, numel, numel, numel, numel, triton.next_power_of_2(numel), 0,
                ACTIVATION="silu", **best.all_kwargs())
        layers = {
            "fuselm.silu_mul": lambda: fuselm.silu_mul(tiny_a, tiny_b),
            "torch.ops.fuselm.glu": lambda: torch.ops.fuselm.glu(tiny_a, tiny_b, "silu"),
            "launcher": lambda: glu._launch(glu._glu_fwd_kernel, [tiny_a, tiny_b], [out], "silu"),
            "bare JIT launch, tuned config": lambda: bare(),
            "torch silu*mul (2 kernels)": lambda: torch.nn.functional.silu(tiny_a) * tiny_b,
            "fuselm.rms_norm": lambda: fuselm.rms_norm(x[:1], w),
            "fuselm.add_rms_norm": lambda: fuselm.add_rms_norm(x[:1], r[:1], w),
        }
        for name, fn in layers.items():
            print(f"host {name:<28} {host_us(fn):7.1f} us/call")
        profiler = cProfile.Profile()
        profiler.enable()
        for _ in range(500):
            fuselm.add_rms_norm(x[:1], r[:1], w)
        profiler.disable()
        pstats.Stats(profiler).sort_stats("tottime").print_stats(18)


if __name__ == "__main__":
    main()
