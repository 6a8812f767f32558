"""Where linear cross-entropy's time goes per token chunk (GPU machine only).

For chunks of C = 256, 512 and 1024 tokens at the benchmark shape (8192 tokens × 4096 hidden ×
128256 vocab, bf16): the median time of each of the four steps of one chunk (logits GEMM, the
cross-entropy row kernel, the d hidden GEMM, the d weight update), their floors at the ceilings
measured in the same run, and the d hidden and d weight GEMMs run on two streams at once. Then
the d weight update written three ways, and the d hidden and d weight GEMMs on two streams with the
SMs split between them (cuBLASLt's SM count target). The cross-entropy row kernel's launch sweep,
which chose its launch shape, is in NOTES.md (session 3).

    python benchmarks/linear_ce_probe.py [--parts steps layouts sm-split]
"""

from __future__ import annotations

import argparse

import torch
import triton

from fuselm.ops.cross_entropy import _cross_entropy_rows

BF16 = torch.bfloat16


def median_ms(fn) -> float:
    return triton.testing.do_bench(fn, warmup=25, rep=100, return_mode="median")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--parts", nargs="+", default=["steps", "layouts", "sm-split"],
                        choices=["steps", "layouts", "sm-split"])
    parts = parser.parse_args().parts
    tokens, hidden, vocab = 8192, 4096, 128256
    h = torch.randn(tokens, hidden, device="cuda", dtype=BF16) * 0.5
    w = torch.randn(vocab, hidden, device="cuda", dtype=BF16) * 0.02
    labels = torch.randint(0, vocab, (tokens,), device="cuda")
    dweight = torch.zeros_like(w)
    src = torch.randn(2**29, device="cuda", dtype=BF16)
    copy_tbps = 2 * src.nbytes / (median_ms(lambda: src.clone()) * 1e-3) / 1e12
    del src
    a = torch.randn(8192, 8192, device="cuda", dtype=BF16)
    gemm_tflops = 2 * 8192**3 / (median_ms(lambda: a @ a) * 1e-3) / 1e12
    del a
    print(f"ceilings: copy {copy_tbps:.2f} TB/s, GEMM {gemm_tflops:.0f} TFLOP/s")
    side = torch.cuda.Stream()

    for chunk in (256, 512, 1024) if "steps" in parts else ():
        buffer = torch.empty(chunk, vocab, device="cuda", dtype=BF16)
        dhidden = torch.empty(chunk, hidden, device="cuda", dtype=BF16)
        h_chunk, y_chunk = h[:chunk], labels[:chunk]
        loss, lse = torch.empty(chunk, device="cuda"), torch.empty(chunk, device="cuda")

        def both_streams():
            side.wait_stream(torch.cuda.current_stream())
            torch.mm(buffer, w, out=dhidden)
            with torch.cuda.stream(side):
                dweight.addmm_(buffer.t(), h_chunk)
            torch.cuda.current_stream().wait_stream(side)

        flop_ms = 2 * chunk * hidden * vocab / (gemm_tflops * 1e12) * 1e3
        steps = {
            "logits GEMM": (lambda: torch.mm(h_chunk, w.t(), out=buffer),
                            max(flop_ms, w.nbytes / (copy_tbps * 1e12) * 1e3)),
            "CE row kernel": (lambda: _cross_entropy_rows(buffer, y_chunk, -100, 0.0, None, 0.0, None, True,
                                                          out=(loss, lse)),
                              3 * buffer.nbytes / (copy_tbps * 1e12) * 1e3),
            "d hidden GEMM": (lambda: torch.mm(buffer, w, out=dhidden),
                              max(flop_ms, w.nbytes / (copy_tbps * 1e12) * 1e3)),
            "d weight addmm_": (lambda: dweight.addmm_(buffer.t(), h_chunk),
                                max(flop_ms, 2 * dweight.nbytes / (copy_tbps * 1e12) * 1e3)),
            "d hidden ∥ d weight (2 streams)": (both_streams, None),
        }
        total = 0.0
        print(f"\nC = {chunk} tokens ({tokens // chunk} chunks; buffer {buffer.nbytes / 2**20:.0f} MiB)")
        for name, (fn, floor) in steps.items():
            ms = median_ms(fn)
            total += ms if floor is not None else 0.0
            floor_text = f"floor {floor:.3f} ms ({floor / ms:.0%})" if floor is not None else ""
            print(f"  {name:<34} {ms:7.3f} ms  {floor_text}")
        print(f"  four steps in sequence: {total:.3f} ms/chunk → {total * tokens / chunk:.1f} ms for {tokens} tokens")
        del buffer

    if "layouts" in parts:
        print("\nd weight update at C = 256 written three ways (cuBLAS picks its kernel by layout and shape)")
        buffer = torch.randn(256, vocab, device="cuda", dtype=BF16) * 1e-3
        h_chunk, half = h[:256], vocab // 2
        floor = 2 * dweight.nbytes / (copy_tbps * 1e12) * 1e3
        ways = {
            "dW.addmm_(Gᵀ, h)": lambda: dweight.addmm_(buffer.t(), h_chunk),
            "dWᵀ.addmm_(hᵀ, G) (the transposed product)": lambda: dweight.t().addmm_(h_chunk.t(), buffer),
            "two vocabulary halves": lambda: (dweight[:half].addmm_(buffer[:, :half].t(), h_chunk),
                                              dweight[half:].addmm_(buffer[:, half:].t(), h_chunk)),
        }
        for name, fn in ways.items():
            ms = median_ms(fn)
            print(f"  {name:<44} {ms:.3f} ms ({floor / ms:.0%} of the {floor:.3f} ms byte floor)")
        del buffer
    if "sm-split" not in parts:
        return
    print("\nd hidden ∥ d weight on two streams, SMs split between them by cuBLASLt's SM count target"
          " (torch._C._set_sm_carveout_experimental)")
    n_sms = torch.cuda.get_device_properties(0).multi_processor_count
    torch.backends.cuda.preferred_blas_library("cublaslt")
    carve = torch._C._set_sm_carveout_experimental
    for chunk in (256, 512):
        buffer = torch.randn(chunk, vocab, device="cuda", dtype=BF16) * 1e-3
        dhidden = torch.empty(chunk, hidden, device="cuda", dtype=BF16)
        h_chunk = h[:chunk]
        dweight_alone = median_ms(lambda: dweight.addmm_(buffer.t(), h_chunk))
        dhidden_alone = median_ms(lambda: torch.mm(buffer, w, out=dhidden))
        print(f"  C={chunk}: cuBLASLt, all {n_sms} SMs: d weight {dweight_alone:.3f} ms, d hidden {dhidden_alone:.3f}"
              f" ms, in sequence {dweight_alone + dhidden_alone:.3f} ms")
        for dweight_sms in (16, 33, 50, 66):
            def on_sms(sms, fn):
                def run():
                    carve(n_sms - sms)
                    fn()
                    carve(None)
                return run
            dw_only = median_ms(on_sms(dweight_sms, lambda: dweight.addmm_(buffer.t(), h_chunk)))
            dh_only = median_ms(on_sms(n_sms - dweight_sms, lambda: torch.mm(buffer, w, out=dhidden)))

            def both():
                side.wait_stream(torch.cuda.current_stream())
                carve(n_sms - dweight_sms)
                with torch.cuda.stream(side):
                    dweight.addmm_(buffer.t(), h_chunk)
                carve(dweight_sms)
                torch.mm(buffer, w, out=dhidden)
                carve(None)
                torch.cuda.current_stream().wait_stream(side)
            print(f"    d weight on {dweight_sms:>3} SMs {dw_only:.3f} ms, d hidden on the other {n_sms - dweight_sms:>3}"
                  f" {dh_only:.3f} ms; both at once {median_ms(both):.3f} ms")
        del buffer
    torch.backends.cuda.preferred_blas_library("default")


if __name__ == "__main__":
    main()
