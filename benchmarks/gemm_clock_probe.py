"""Whether a prefill's GEMM time depends on M or on the GPU's clocks (session 23).

On the H200 the same prefill kernels summed 43.3 to 48.2 ms across six profiled calls of one TTFT run (B1 x 2048),
and B32 x 512's cuBLAS GEMMs ran at ~670 TFLOP/s against ~770 at 2048 tokens. Two questions, one run:

- **M**: a prefill's seven projections (Llama-3-8B, bf16: q and o 4096->4096, k and v 4096->1024, gate and up
  4096->14336, down 14336->4096) over 32 layers, at M = 2048 tokens, at M = 16384, and at M = 16384 as row chunks
  of 2048 (each chunk one cuBLAS call writing its rows of the output). If the chunks beat one call of 16384 rows,
  a large batch's prefill should run in chunks.
- **clocks**: each sequence timed "cool" (after ``--idle-s`` seconds with the GPU idle) and "hot" (the fifth of
  five back-to-back runs), while a background ``nvidia-smi`` samples the SM clock, the power draw and the active
  throttle reasons every 50 ms; each timing is reported with the samples taken during it.

TFLOP/s = 2 * M * sum(K * N) * 32 layers / time. CUDA events around the sequence, no L2 flush (every operand is far
larger than L2). Medians of ``--repeats``.

    python benchmarks/gemm_clock_probe.py --out benchmarks/results/gemm-clock-probe-h200.json
    python benchmarks/gemm_clock_probe.py --smoke        (tiny shapes on the CPU: checks the script)
"""

from __future__ import annotations

import argparse
import datetime
import json
import statistics
import time

import torch
from timing import ClockSampler, once_ms, synchronize

PROJECTIONS = {"q": (4096, 4096), "k": (4096, 1024), "v": (4096, 1024), "o": (4096, 4096),
               "gate": (4096, 14336), "up": (4096, 14336), "down": (14336, 4096)}
LAYERS = 32
def sequence(m: int, chunk: int, weights: dict, x: torch.Tensor, h: torch.Tensor, outs: dict, layers: int):
    """The projections of ``layers`` layers over ``m`` rows, each as cuBLAS calls of ``chunk`` rows."""
    def run():
        for _ in range(layers):
            for name, w in weights.items():
                source = h if name == "down" else x
                for first in range(0, m, chunk):
                    torch.mm(source[first:first + chunk], w.t(), out=outs[name][first:first + chunk])
    return run


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", help="JSON path")
    parser.add_argument("--smoke", action="store_true", help="tiny shapes on the CPU")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--idle-s", type=float, default=1.0, help="idle seconds before a cool run")
    args = parser.parse_args()
    cuda = torch.cuda.is_available() and not args.smoke
    device, dtype = ("cuda", torch.bfloat16) if cuda else ("cpu", torch.float32)
    scale = 1 if cuda else 64
    layers = LAYERS if cuda else 2
    shapes = {name: (k // scale, n // scale) for name, (k, n) in PROJECTIONS.items()}
    cases = [(2048, 2048), (16384, 16384), (16384, 2048)] if cuda else [(64, 64), (256, 256), (256, 64)]
    idle_s = args.idle_s if cuda else 0.0
    torch.manual_seed(0)
    weights = {name: torch.randn(n, k, device=device, dtype=dtype) / k ** 0.5 for name, (k, n) in shapes.items()}
    biggest = max(m for m, _ in cases)
    x = torch.randn(biggest, shapes["q"][0], device=device, dtype=dtype)
    h = torch.randn(biggest, shapes["down"][0], device=device, dtype=dtype)
    outs = {name: torch.empty(biggest, n, device=device, dtype=dtype) for name, (_, n) in shapes.items()}
    sampler = ClockSampler() if cuda else None
    rows = []
    for m, chunk in cases:
        flops = 2 * m * sum(k * n for k, n in shapes.values()) * layers
        run = sequence(m, chunk, weights, x[:m], h[:m], {k: v[:m] for k, v in outs.items()}, layers)
        run()  # cuBLAS's heuristics and workspace
        for mode in ("cool", "hot"):
            times, clocks = [], []
            for _ in range(args.repeats):
                if mode == "cool":
                    synchronize(cuda)
                    time.sleep(idle_s)
                else:
                    for _ in range(4):
                        run()
                began = time.time()
                times.append(once_ms(run, cuda))
                if sampler is not None:
                    clocks.append(sampler.between(began, time.time()))
            ms = statistics.median(times)
            row = {"what": "gemm_sequence", "m": m, "chunk_rows": chunk, "mode": mode, "layers": layers, "ms": ms,
                   "ms_all": times, "tflops": flops / ms / 1e9, "clocks": clocks}
            rows.append(row)
            print(f"M={m:6d} chunks of {chunk:6d} {mode:4s}  {ms:9.2f} ms  "
                  f"2*M*sum(K*N)*{layers} = {flops / 1e12:.1f} TFLOP / {ms:.2f} ms = {row['tflops']:6.1f} TFLOP/s  "
                  f"clocks {clocks[-1] if clocks else '-'}", flush=True)
    if sampler is not None:
        sampler.stop()
    gpu = torch.cuda.get_device_name() if cuda else "cpu"
    result = {"gpu": gpu, "torch": torch.__version__, "date": datetime.datetime.now(datetime.UTC).isoformat(),
              "method": __doc__, "rows": rows}
    if args.out:
        with open(args.out, "w") as handle:
            json.dump(result, handle, indent=1)


if __name__ == "__main__":
    main()
