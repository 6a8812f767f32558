"""DRAM bytes each forward kernel actually moves: fuselm against torch.compile (GPU machine, under ncu).

Where fuselm and torch.compile tie at the copy limit (RoPE, SwiGLU), the question is whether they
move the same bytes at the same speed, or one moves fewer. This runs one op's forward once per
implementation, at the kernel benchmark's shapes, inside a profiler range that Nsight Compute
counts; compilation and autotuning happen before the range:

    TORCHINDUCTOR_COMPILE_THREADS=1 ncu --target-processes application-only --clock-control none \
        --profile-from-start off --metrics dram__bytes_read.sum,dram__bytes_write.sum,gpu__time_duration.sum \
        python benchmarks/ncu_bytes.py rope

(One compile thread: ncu attached to inductor's compile workers and hung in an earlier attempt.)
The kernels come in the order fuselm's, then torch.compile's; the bytes kernel_bench.py counts are
printed first.
"""

from __future__ import annotations

import argparse

import torch

from kernel_bench import build_cases


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("op", choices=["rms_norm", "add_rms_norm", "rope", "swiglu"])
    op = parser.parse_args().op
    case = next(case for case in build_cases(liger={}) if case.kernel == op)
    inputs = case.make_inputs()
    print(f"{op}: counted {case.fwd_bytes / 1e6:.1f} MB ({case.fwd_formula}); kernels follow for fuselm, then "
          "compile", flush=True)
    with torch.no_grad():
        for impl in ("fuselm", "compile"):
            fn = case.impls[impl]
            for _ in range(3):  # compile, tune and warm up outside the profiled range
                fn(*inputs)
            torch.cuda.synchronize()
            torch.cuda.profiler.start()
            fn(*inputs)
            torch.cuda.synchronize()
            torch.cuda.profiler.stop()


if __name__ == "__main__":
    main()
