"""Host cost of the device guard every fused op runs under (``fuselm.ops._common.on_input_device``).

Host time per call, in ns, as the median of ``--rounds`` rounds of ``--calls`` back-to-back calls timed with
``time.perf_counter_ns`` (no GPU sync inside a round: the kernels are tiny, so the host is the bottleneck and the
figure is host time). Rows:

- ``guard only``: the guard around a no-op, minus the bare no-op: what the guard adds when the tensor's device
  is already current (one GPU, or each call of a ``device_map`` model whose layer is on the current device);
- ``guard, other device``: the same for a tensor on ``cuda:1`` while ``cuda:0`` is current (two GPUs only);
  the guard then switches the device and back;
- ``silu_mul``: a whole public op on a 1x1024 fp32 tensor (Triton launch included), for scale.

    python benchmarks/device_guard_bench.py [--calls 20000] [--rounds 7]

On a machine without CUDA it runs the guard rows on CPU tensors (where the guard is one ``get_device()`` call)
so the script is checked; the figures that matter are the GPU ones.
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

import fuselm
from fuselm.ops._common import on_input_device


def host_ns(fn, x, calls: int, rounds: int) -> float:
    """Median over rounds of the host time of one call of ``fn(x)``, in ns."""
    for _ in range(calls // 10):  # warm-up: compilation, autotuning, caches
        fn(x)
    per_call = []
    for _ in range(rounds):
        if x.is_cuda:
            torch.cuda.synchronize(x.device)
        start = time.perf_counter_ns()
        for _ in range(calls):
            fn(x)
        per_call.append((time.perf_counter_ns() - start) / calls)
    if x.is_cuda:
        torch.cuda.synchronize(x.device)
    return statistics.median(per_call)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--calls", type=int, default=20000)
    parser.add_argument("--rounds", type=int, default=7)
    args = parser.parse_args()

    def nothing(t):
        return t

    guarded = on_input_device(nothing)
    devices = [f"cuda:{i}" for i in range(torch.cuda.device_count())] or ["cpu"]
    rows = []
    for device in devices[:2]:
        x = torch.randn(1, 1024, device=device)
        if x.is_cuda:
            torch.cuda.set_device(0)  # cuda:0 current: a cuda:1 tensor makes the guard switch
        bare = host_ns(nothing, x, args.calls, args.rounds)
        with_guard = host_ns(guarded, x, args.calls, args.rounds)
        label = "guard only" if device in ("cpu", "cuda:0") else "guard, other device"
        rows.append((f"{label} ({device})", with_guard - bare, f"guarded {with_guard:.0f} - bare {bare:.0f}"))
        if x.is_cuda:
            with fuselm.use_backend("triton"):
                rows.append((f"silu_mul 1x1024 ({device})", host_ns(lambda t: fuselm.silu_mul(t, t), x, args.calls,
                                                                    args.rounds), "whole op, host time"))
    print(f"host ns per call, median of {args.rounds} rounds x {args.calls} calls (perf_counter_ns, no sync)")
    for name, ns, formula in rows:
        print(f"{name:36s} {ns:9.0f} ns   {formula}")


if __name__ == "__main__":
    main()
