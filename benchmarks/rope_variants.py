"""RoPE forward variants at the kernel benchmark's shape, to find what separates fuselm's kernel from
torch.compile's (benchmarks/NOTES.md, session 5). Each is timed as the kernel benchmark times rows:
graph replays under do_bench after its L2 flush, median. Dense [B, H, S, D] bf16 q and k only.

- tile: fuselm's kernel as shipped (its tuned config);
- tile-i32: the same tiles, int64 only in each program's base offset, int32 within the tile;
- rows-i32: full rows loaded at once (one contiguous load per tile), the partner half re-read
  by two masked loads as inductor does, int32 tile offsets;
- flat: inductor's scheme, a 1-D block of elements with int32 indices and the shape's sizes as
  constants (the upper bound of what a specialised kernel reaches).

    python benchmarks/rope_variants.py
"""

import torch
import triton
import triton.language as tl

import fuselm
from kernel_bench import build_cases, graph_replay_ms, same_size_copy_ms


@triton.jit
def _tile_i32_kernel(q_ptr, k_ptr, cos_ptr, sin_ptr, qo_ptr, ko_ptr, seq_len, n_heads_q, n_heads_k,
                     HALF: tl.constexpr, BLOCK_S: tl.constexpr, BLOCK_H: tl.constexpr, FULL_ROWS: tl.constexpr):
    # Program (p, g, b): BLOCK_S positions x BLOCK_H heads, as fuselm's tile kernel; dense [B, H, S, D].
    b, group, p = tl.program_id(2), tl.program_id(1), tl.program_id(0)
    q_groups = n_heads_q // BLOCK_H
    is_q = group < q_groups
    n_heads = tl.where(is_q, n_heads_q, n_heads_k)
    head0 = tl.where(is_q, group, group - q_groups) * BLOCK_H
    base = ((b.to(tl.int64) * n_heads + head0) * seq_len + p * BLOCK_S) * (2 * HALF)
    s = tl.arange(0, BLOCK_S)[:, None, None]
    h = tl.arange(0, BLOCK_H)[None, :, None]
    table = (p * BLOCK_S + s) * (2 * HALF)
    if FULL_ROWS:
        d = tl.arange(0, 2 * HALF)[None, None, :]
        first = d < HALF
        offs = s * (2 * HALF) + h * (seq_len * 2 * HALF) + d
        x_ptr = tl.where(is_q, q_ptr, k_ptr) + base
        y_ptr = tl.where(is_q, qo_ptr, ko_ptr) + base
        x = tl.load(x_ptr + offs).to(tl.float32)
        partner = tl.where(first, -tl.load(x_ptr + offs + HALF, mask=first, other=0.0).to(tl.float32),
                           tl.load(x_ptr + offs - HALF, mask=~first, other=0.0).to(tl.float32))
        c = tl.load(cos_ptr + table + d, eviction_policy="evict_last").to(tl.float32)
        n = tl.load(sin_ptr + table + d, eviction_policy="evict_last").to(tl.float32)
        tl.store(y_ptr + offs, (x * c + partner * n).to(y_ptr.dtype.element_ty))
    else:
        d = tl.arange(0, HALF)[None, None, :]
        offs = s * (2 * HALF) + h * (seq_len * 2 * HALF) + d
        x_ptr = tl.where(is_q, q_ptr, k_ptr) + base
        y_ptr = tl.where(is_q, qo_ptr, ko_ptr) + base
        c1 = tl.load(cos_ptr + table + d).to(tl.float32)
        c2 = tl.load(cos_ptr + table + d + HALF).to(tl.float32)
        n1 = tl.load(sin_ptr + table + d).to(tl.float32)
        n2 = tl.load(sin_ptr + table + d + HALF).to(tl.float32)
        x1 = tl.load(x_ptr + offs).to(tl.float32)
        x2 = tl.load(x_ptr + offs + HALF).to(tl.float32)
        tl.store(y_ptr + offs, (x1 * c1 - x2 * n1).to(y_ptr.dtype.element_ty))
        tl.store(y_ptr + offs + HALF, (x2 * c2 + x1 * n2).to(y_ptr.dtype.element_ty))


@triton.jit
def _flat_kernel(x_ptr, cos_ptr, sin_ptr, y_ptr, HALF: tl.constexpr, TABLE: tl.constexpr, BLOCK: tl.constexpr):
    # Program p: elements [p * BLOCK, (p + 1) * BLOCK) of a dense [B, H, S, D] tensor; TABLE = S * D.
    i = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    d = i % (2 * HALF)
    first = d < HALF
    x = tl.load(x_ptr + i).to(tl.float32)
    partner = tl.where(first, -tl.load(x_ptr + i + HALF, mask=first, other=0.0).to(tl.float32),
                       tl.load(x_ptr + i - HALF, mask=~first, other=0.0).to(tl.float32))
    c = tl.load(cos_ptr + i % TABLE, eviction_policy="evict_last").to(tl.float32)
    n = tl.load(sin_ptr + i % TABLE, eviction_policy="evict_last").to(tl.float32)
    tl.store(y_ptr + i, (x * c + partner * n).to(y_ptr.dtype.element_ty))


def main():
    case = next(case for case in build_cases(liger={}) if case.kernel == "rope")
    q, k, cos, sin = case.make_inputs()
    (b, hq, s, d), hk = q.shape, k.shape[1]
    q_out, k_out = torch.empty_like(q), torch.empty_like(k)
    expected = [t.float() for t in fuselm.rope(q, k, cos, sin)]

    def tiled(block_s, block_h, warps, full_rows):
        grid = (s // block_s, (hq + hk) // block_h, b)
        return lambda: _tile_i32_kernel[grid](q, k, cos, sin, q_out, k_out, s, hq, hk, HALF=d // 2, BLOCK_S=block_s,
                                              BLOCK_H=block_h, FULL_ROWS=full_rows, num_warps=warps)

    def flat(block, warps):
        def run():
            for x, y in ((q, q_out), (k, k_out)):
                _flat_kernel[(x.numel() // block,)](x, cos, sin, y, HALF=d // 2, TABLE=s * d, BLOCK=block,
                                                    num_warps=warps)
        return run

    variants = {"tile (shipped, tuned)": lambda: fuselm.rope(q, k, cos, sin)}
    for bs, bh, w in ((16, 2, 4), (8, 4, 4), (32, 2, 4), (16, 4, 8)):
        variants[f"tile-i32 {bs}x{bh} w{w}"] = tiled(bs, bh, w, False)
        variants[f"rows-i32 {bs}x{bh} w{w}"] = tiled(bs, bh, w, True)
    for block, w in ((1024, 4), (2048, 8), (512, 4)):
        variants[f"flat {block} w{w}"] = flat(block, w)
    variants["compile"] = case.impls["compile"]
    variants["compile"] = (lambda fn: lambda: fn(q, k, cos, sin))(variants["compile"])
    print(f"RoPE fwd variants ({case.fwd_formula}: {case.fwd_bytes / 1e6:.1f} MB; "
          f"same-size copy {same_size_copy_ms(case.fwd_bytes) * 1e3:.1f} µs)")
    with torch.no_grad():
        for name, run in variants.items():
            q_out.fill_(float("nan"))
            k_out.fill_(float("nan"))
            try:
                result = run()
            except Exception as exc:  # a variant that does not compile is reported, not fatal
                print(f"  {name:<24} failed: {type(exc).__name__}: {str(exc).splitlines()[0]}")
                continue
            outputs = result if isinstance(result, tuple) else (q_out, k_out)
            error = max(((o.float() - e).norm() / e.norm()).item() for o, e in zip(outputs, expected))
            us = graph_replay_ms(run) * 1e3
            print(f"  {name:<24} {us:6.1f} µs  {case.fwd_bytes / us / 1e3:5.0f} GB/s  rel. error vs fuselm {error:.1e}")


if __name__ == "__main__":
    main()
