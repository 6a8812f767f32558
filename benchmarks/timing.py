"""How fuselm's benchmarks time GPU work and measure the GPU's ceilings.

One rule for every benchmark script (kernels, end to end, decode), so their figures compare:

- :func:`median_ms`: the median over CUDA-event-timed calls after warm-up calls, the L2 cache flushed
  before each timed call (``triton.testing.do_bench``'s method). Without CUDA, wall clock, so that a
  script's ``--smoke`` run on a CPU machine goes through the same code.
- :func:`captured`: a call captured in a CUDA graph; time its replay to get the GPU's time without
  the host's launch overhead.
- :func:`copy_gbps`, :func:`gemm_tflops`: the two ceilings a figure is compared with, measured in the
  same run as the figure: device-to-device copy bandwidth (bytes read + written) and the bf16 GEMM rate;
  :func:`copy_ms`: a copy moving a given number of bytes, the reference for a memory-bound kernel.
- :class:`ClockSampler`: the SM clock, power draw and throttle reasons (``nvidia-smi`` every 50 ms) during a
  timed span, since a figure under the power cap is not one at full clocks.

Import it from a script in benchmarks/ (``python benchmarks/<script>.py`` puts benchmarks/ first on
sys.path): ``from timing import median_ms``.
"""

from __future__ import annotations

import statistics
import subprocess
import threading
import time
from collections.abc import Callable, Sequence

import torch

GB = 1e9
L2_FLUSH_BYTES = 256 * 2**20  # zeroed before each timed call: larger than any current GPU's L2 (H200: 60 MB)


def median_ms(fn: Callable[[], object], *, warmup_ms: float = 50.0, rep_ms: float = 200.0, min_repeats: int = 1,
              grad_to_none: Sequence[torch.Tensor] = (), flush_l2: bool = True) -> float:
    """Median time of one call of ``fn``, in milliseconds.

    ``fn`` is called once untimed (compilation, autotuning, allocator warm-up) and once more to estimate
    how long a call takes; warm-up calls follow for about ``warmup_ms``, then timed calls for about
    ``rep_ms``, at least ``min_repeats`` of them. A timed call's time is that between two CUDA events
    recorded on the current stream before and after it: the GPU's time for its work, including any gap
    in which the GPU waits for the host to launch the next kernel. Before each timed call, untimed:
    the gradients of ``grad_to_none`` are reset to None (a fwd+bwd ``fn`` then accumulates nothing) and,
    with ``flush_l2``, a 256 MiB buffer is zeroed so that the call starts from a cold L2. This is
    ``triton.testing.do_bench``'s method (``return_mode="median"``), plus ``min_repeats`` and the CPU
    fallback: without CUDA, the wall-clock time (``time.perf_counter``) of the same calls, no flush.

    Short kernels: keep the defaults (hundreds of timed calls). Calls of a second or more (``generate``,
    a training step): ``min_repeats`` of 3 to 5 sets the count.
    """
    if min_repeats < 1:
        raise ValueError(f"min_repeats must be at least 1, got {min_repeats}")
    cuda = torch.cuda.is_available()
    flush = torch.empty(L2_FLUSH_BYTES // 4, dtype=torch.int32, device="cuda") if cuda and flush_l2 else None

    def prepare() -> None:
        for tensor in grad_to_none:
            tensor.grad = None
        if flush is not None:
            flush.zero_()

    fn()
    synchronize(cuda)
    start = _mark(cuda)  # the estimate includes the flush: the budgets are the GPU's time spent, as do_bench's
    prepare()
    fn()
    end = _mark(cuda)
    synchronize(cuda)
    estimate_ms = max(_elapsed_ms(start, end), 1e-3)
    for _ in range(int(warmup_ms / estimate_ms)):
        fn()
    spans = []
    for _ in range(max(min_repeats, int(rep_ms / estimate_ms))):
        prepare()
        before = _mark(cuda)
        fn()
        spans.append((before, _mark(cuda)))
    synchronize(cuda)
    return statistics.median(_elapsed_ms(before, after) for before, after in spans)


def captured(fn: Callable[[], object], grad_to_none: Sequence[torch.Tensor] = ()) -> Callable[[], None]:
    """``fn`` captured in a CUDA graph, after three warm-up calls on a side stream (compilation and
    autotuning stay out of the capture): returns the graph's replay, which runs ``fn``'s GPU work with no
    host overhead. A replay reads and writes the memory the capture used: keep ``fn``'s tensors referenced
    while the replay is in use. ``grad_to_none``'s gradients are reset after the warm-up and the capture.
    Without CUDA, ``fn`` itself (a script's ``--smoke`` run on a CPU machine)."""
    if not torch.cuda.is_available():
        return fn

    def clear_grads() -> None:
        for tensor in grad_to_none:
            tensor.grad = None

    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(3):
            fn()
            clear_grads()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        fn()
    clear_grads()
    return graph.replay


def copy_ms(moved_bytes: int, flush_l2: bool = True) -> float:
    """Time of a device-to-device bf16 ``copy_`` moving ``moved_bytes`` (half read, half written), timed
    by :func:`median_ms` over plain calls, as a kernel's call would be: the reference a kernel moving as
    many bytes is compared with, fixed costs of a short call (e.g. the L2 flush's write-back) included;
    ``flush_l2=False``: back-to-back calls, the steady state of a stream far beyond L2.
    Not replayed from a CUDA graph: there a copy of 512 MiB or more ran at 2.73 TB/s on an H200, against
    4.2 TB/s called plainly."""
    device = "cuda" if torch.cuda.is_available() else "cpu"  # cpu: a --smoke run
    src = torch.randn(moved_bytes // 4, device=device, dtype=torch.bfloat16)
    dst = torch.empty_like(src)
    return median_ms(lambda: dst.copy_(src), flush_l2=flush_l2)


def copy_gbps(moved_bytes: int = 2**31, flush_l2: bool = True) -> float:
    """Copy bandwidth in GB/s, bytes read + written: :func:`copy_ms` of ``moved_bytes`` (default 2 GiB:
    1 GiB read, 1 GiB written, far beyond L2)."""
    return moved_bytes / (copy_ms(moved_bytes, flush_l2) * 1e-3) / GB


def gemm_tflops(n: int = 8192) -> float:
    """bf16 GEMM rate in TFLOP/s: ``a @ b`` of two ``[n, n]`` matrices, 2·n³ FLOPs, timed by :func:`median_ms`."""
    a, b = (torch.randn(n, n, device="cuda", dtype=torch.bfloat16) for _ in range(2))
    return 2 * n**3 / (median_ms(lambda: a @ b) * 1e-3) / 1e12


def once_ms(fn: Callable[[], object], cuda: bool | None = None) -> float:
    """Milliseconds of one call of ``fn`` as it comes (no warm-up, no L2 flush), after the GPU's queued work: CUDA
    events around it on a GPU (``cuda``: None asks torch), the host's clock without one. For probes whose calls
    must run in a set state (e.g. a GPU idle or hot beforehand), where :func:`median_ms`'s warm-up would change it."""
    cuda = torch.cuda.is_available() if cuda is None else cuda
    synchronize(cuda)
    start = _mark(cuda)
    fn()
    end = _mark(cuda)
    synchronize(cuda)
    return _elapsed_ms(start, end)


def synchronize(cuda: bool | None = None) -> None:
    """Wait for the GPU's queued work (``cuda``: whether there is a GPU; None: ask torch); nothing on a CPU."""
    if torch.cuda.is_available() if cuda is None else cuda:
        torch.cuda.synchronize()


def _mark(cuda: bool) -> torch.cuda.Event | float:
    """A point in time: a CUDA event recorded on the current stream, or ``time.perf_counter()``."""
    if not cuda:
        return time.perf_counter()
    event = torch.cuda.Event(enable_timing=True)
    event.record()
    return event


def _elapsed_ms(start: torch.cuda.Event | float, end: torch.cuda.Event | float) -> float:
    """Milliseconds between two :func:`_mark` points (CUDA events: after a synchronize)."""
    if isinstance(start, float):
        return (end - start) * 1e3
    return start.elapsed_time(end)


SMI_FIELDS = "clocks.sm,power.draw,clocks_throttle_reasons.active"


class ClockSampler:
    """``nvidia-smi`` every 50 ms in the background; :meth:`between` returns the samples taken in a host-time span."""

    def __init__(self):
        self.samples: list[tuple[float, str]] = []
        try:
            self.process = subprocess.Popen(["nvidia-smi", f"--query-gpu={SMI_FIELDS}", "--format=csv,noheader",
                                             "-lms", "50"], stdout=subprocess.PIPE, text=True)
        except FileNotFoundError:
            self.process = None
            return
        threading.Thread(target=self._read, daemon=True).start()

    def _read(self):
        for line in self.process.stdout:
            self.samples.append((time.time(), line.strip()))

    def between(self, start: float, end: float) -> dict:
        return self.within([(start, end)])

    def within(self, spans: Sequence[tuple[float, float]]) -> dict:
        """The samples taken inside any of the host-time ``spans``, summarised as :meth:`between` does."""
        lines = [line for t, line in self.samples if any(start <= t <= end for start, end in spans)]
        clocks, watts, reasons = [], [], set()
        for line in lines:
            parts = [p.strip() for p in line.split(",")]
            try:
                clocks.append(float(parts[0].split()[0]))
                watts.append(float(parts[1].split()[0]))
            except (ValueError, IndexError):
                continue
            reasons.add(parts[2] if len(parts) > 2 else "?")
        if not clocks:
            return {"samples": 0}
        return {"samples": len(clocks), "sm_mhz_min": min(clocks), "sm_mhz_median": statistics.median(clocks),
                "watts_max": max(watts), "watts_median": statistics.median(watts), "throttle": sorted(reasons)}

    def stop(self):
        if self.process is not None:
            self.process.terminate()
