"""Where linear cross-entropy's time goes per token chunk (GPU machine only).

For chunks of C = 256, 512 and 1024 tokens at the benchmark shape (8192 tokens × 4096 hidden ×
128256 vocab, bf16): the median time of each of the four steps of one chunk (logits GEMM, the
cross-entropy row kernel, the d hidden GEMM, the d weight update), their floors at the ceilings
measured in the same run, and the d hidden and d weight GEMMs run on two streams at once. Then
the Triton d weight update against cuBLAS's, alone and on a capped grid beside the d hidden GEMM,
and the cross-entropy row kernel's launch choices (block width and warps, programs per SM before rows
are split into vocabulary segments) against its byte floor.
"""

from __future__ import annotations

import torch
import triton

from fuselm.ops import cross_entropy
from fuselm.ops.cross_entropy import _cross_entropy_rows

BF16 = torch.bfloat16


def median_ms(fn) -> float:
    return triton.testing.do_bench(fn, warmup=25, rep=100, return_mode="median")


def main() -> None:
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

    for chunk in (256, 512, 1024):
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

    print("\nd weight update: cuBLAS addmm_ against the Triton kernel, alone and beside the d hidden GEMM")
    for chunk in (256, 512, 1024):
        buffer = torch.randn(chunk, vocab, device="cuda", dtype=BF16) * 1e-3
        dhidden = torch.empty(chunk, hidden, device="cuda", dtype=BF16)
        h_chunk = h[:chunk]
        floor = 2 * dweight.nbytes / (copy_tbps * 1e12) * 1e3
        cublas = median_ms(lambda: dweight.addmm_(buffer.t(), h_chunk))
        triton_full = median_ms(lambda: cross_entropy._dweight_update(buffer, h_chunk, dweight, True))
        print(f"  C={chunk:<5} cuBLAS {cublas:.3f} ms, Triton {triton_full:.3f} ms (byte floor {floor:.3f} ms)")
        for programs in (33, 66, 99):
            def beside():
                side.wait_stream(torch.cuda.current_stream())
                with torch.cuda.stream(side):
                    cross_entropy._dweight_update(buffer, h_chunk, dweight, True, programs)
                torch.mm(buffer, w, out=dhidden)
                torch.cuda.current_stream().wait_stream(side)
            print(f"    d hidden (cuBLAS) ∥ Triton d weight on {programs} programs: {median_ms(beside):.3f} ms")
        del buffer

    print("\nCE row kernel launch choices (ms; floor = 3 passes over the chunk's logits at copy speed)")
    original_config, original_per_sm = cross_entropy._launch_config, cross_entropy.PROGRAMS_PER_SM
    for chunk in (256, 1024):
        buffer = torch.randn(chunk, vocab, device="cuda", dtype=BF16)
        loss, lse = torch.empty(chunk, device="cuda"), torch.empty(chunk, device="cuda")
        floor = 3 * buffer.nbytes / (copy_tbps * 1e12) * 1e3
        for block_v, warps in ((4096, 16), (4096, 8), (2048, 8), (2048, 4), (1024, 4)):
            for per_sm in (4, 8, 16, 32):
                cross_entropy._launch_config = lambda n_cols, b=block_v, w=warps: {"BLOCK_V": b, "num_warps": w}
                cross_entropy.PROGRAMS_PER_SM = per_sm
                ms = median_ms(lambda: _cross_entropy_rows(buffer, labels[:chunk], -100, 0.0, None, 0.0, None, True,
                                                           out=(loss, lse)))
                print(f"  C={chunk:<5} BLOCK_V={block_v:<5} warps={warps:<3} programs/SM={per_sm:<3} {ms:.3f} "
                      f"({floor / ms:.0%} of floor)")
        del buffer
    cross_entropy._launch_config, cross_entropy.PROGRAMS_PER_SM = original_config, original_per_sm


if __name__ == "__main__":
    main()
