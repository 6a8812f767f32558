"""Where does a fuselm op's time go: GPU kernel, or host overhead? (GPU machine only.)

For each op at the benchmark shape: median time of the public call, of the same call replayed
from a CUDA graph (no host overhead), and the autotuner's chosen config.
"""

import torch
import triton

import fuselm
from fuselm.ops import rms_norm as rms_norm_ops

BF16 = torch.bfloat16


def bench(fn):
    return triton.testing.do_bench(fn, warmup=50, rep=200, return_mode="median")


def graphed(fn):
    fn()
    torch.cuda.synchronize()
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        fn()
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        fn()
    return graph.replay


def main():
    m, n = 16384, 4096
    x = torch.randn(m, n, device="cuda", dtype=BF16)
    r = torch.randn_like(x)
    w = torch.randn(n, device="cuda", dtype=BF16)
    dy = torch.randn_like(x)
    _, rstd = torch.ops.fuselm.rms_norm(x, w, 1e-6, 0.0, "llama")
    cases = {
        "rms_norm fwd": lambda: fuselm.rms_norm(x, w),
        "add_rms_norm fwd": lambda: fuselm.add_rms_norm(x, r, w),
        "rms_norm bwd op": lambda: torch.ops.fuselm.rms_norm_backward(dy, None, x, w, rstd, 0.0, "llama"),
        "add_rms_norm bwd op": lambda: torch.ops.fuselm.rms_norm_backward(dy, r, x, w, rstd, 0.0, "llama"),
        "copy x->y": lambda: torch.empty_like(x).copy_(x),
    }
    with torch.no_grad():
        for name, fn in cases.items():
            eager = bench(fn)
            replay = bench(graphed(fn))
            print(f"{name:<22} call {eager * 1e3:8.1f} us   graph replay {replay * 1e3:8.1f} us")
    for kernel in (rms_norm_ops._rms_norm_fwd_kernel, rms_norm_ops._rms_norm_bwd_kernel):
        print(kernel.fn.__name__, "cache:", {k: str(v) for k, v in kernel.cache.items()})


if __name__ == "__main__":
    main()
