"""Where linear cross-entropy's time goes per token chunk (GPU machine only).

For chunks of C = 256, 512 and 1024 tokens at the benchmark shape (8192 tokens × 4096 hidden ×
128256 vocab, bf16): the median time of each of the four steps of one chunk (logits GEMM, the
cross-entropy row kernel, the d hidden GEMM, the d weight update), their floors at the ceilings
measured in the same run, and the d hidden and d weight GEMMs run on two streams at once. Then
the Triton d weight update against cuBLAS's for several tile shapes, alone and on a capped grid
beside the d hidden GEMM. (The cross-entropy row kernel's launch sweep that chose its launch shape is
in NOTES.md, session 3.)
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

    print("\nd weight update: cuBLAS addmm_ against the Triton kernel (tile shapes), alone and beside the d hidden GEMM")
    default_tile = dict(cross_entropy.DWEIGHT_TILE)
    tiles = [default_tile, {**default_tile, "num_stages": 4}, {**default_tile, "BLOCK_H": 256},
             {**default_tile, "BLOCK_V": 256}, {**default_tile, "num_warps": 4}, {**default_tile, "BLOCK_T": 32}]
    for chunk in (256, 1024):
        buffer = torch.randn(chunk, vocab, device="cuda", dtype=BF16) * 1e-3
        dhidden = torch.empty(chunk, hidden, device="cuda", dtype=BF16)
        h_chunk = h[:chunk]
        floor = 2 * dweight.nbytes / (copy_tbps * 1e12) * 1e3
        cublas = median_ms(lambda: dweight.addmm_(buffer.t(), h_chunk))
        dh_alone = median_ms(lambda: torch.mm(buffer, w, out=dhidden))
        print(f"  C={chunk}: cuBLAS {cublas:.3f} ms (byte floor {floor:.3f} ms); d hidden GEMM alone {dh_alone:.3f} ms;"
              f" the two in sequence {cublas + dh_alone:.3f} ms")
        for tile in tiles:
            cross_entropy.DWEIGHT_TILE = tile
            try:
                alone = median_ms(lambda: cross_entropy._dweight_update(buffer, h_chunk, dweight, True))
            except Exception as error:  # e.g. out of shared memory for this tile
                print(f"    {tile}: {type(error).__name__}: {str(error)[:100]}")
                continue
            beside = []
            for programs in (33, 66, 99, 132):
                def both():
                    side.wait_stream(torch.cuda.current_stream())
                    with torch.cuda.stream(side):
                        cross_entropy._dweight_update(buffer, h_chunk, dweight, True, programs)
                    torch.mm(buffer, w, out=dhidden)
                    torch.cuda.current_stream().wait_stream(side)
                beside.append(f"{programs}: {median_ms(both):.3f}")
            print(f"    {tile}: alone {alone:.3f} ms ({floor / alone:.0%} of floor); with d hidden, by programs "
                  + ", ".join(beside))
        cross_entropy.DWEIGHT_TILE = default_tile
        del buffer


if __name__ == "__main__":
    main()
