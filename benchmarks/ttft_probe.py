"""Where a generate call's time to first token goes, beyond its kernels.

e2e.py times a prefill row as CUDA events around a whole ``generate`` call with one new token, so the GPU's idle
time while the host prepares (and any host sync) counts. Here, per call path (``fuselm.generate`` and the patched
model's ``model.generate``) and per prefill path (the fused prefill attention replayed from its CUDA graph, as a
prompt length's third and later calls run; the fused prefill attention run eagerly, as a length's first call runs;
HF's attention with the fused one switched off, eagerly), ``--batch`` unpadded prompts (1 by default) of
``--prompt`` tokens:

- ``event_ms``: e2e's figure (median of ``--repeats`` calls after two warm-up calls);
- ``phases``: the same calls cut at the prefill (``DecodeEngine._prefill``, which both call paths run), by
  CUDA events and by the host's clock, medians: ``lead`` (call start to the forward's start: the GPU waits for the
  host's planning), ``forward`` (the forward's kernels and any gaps between them) and ``tail`` (the forward's end to
  the call's return: the first token's choice and the output);
- from one more call under torch.profiler: ``kernel_ms`` (the GPU's kernel time, overlaps merged), ``idle_ms``
  (the profiled span, from the call's start to the later of its return and its last kernel's end, less that),
  ``lead_ms`` (from the call's start to its first kernel), and the CUDA runtime calls that wait for the GPU
  (``cudaStreamSynchronize``, ``cudaDeviceSynchronize``, ``cudaEventSynchronize``, ``cudaMemcpy*``) with their
  count and host time, and the kernels' time by name; the profiler's top ops by self CPU time go to the log.

    python benchmarks/ttft_probe.py --out benchmarks/results/ttft-probe-h200.json
    python benchmarks/ttft_probe.py --smoke        (a tiny model on the CPU: checks the script)

``--host-parts`` adds, per row, the host's time in each part of the prefill forward (perf_counter around the
decoder layer, its attention block, q/k/v, SDPA, the linears, the norms and the MLP; inclusive, so parts nest),
per call, for the eager rows: where the host's time per layer goes when the forward is host-bound.

``--cprofile`` adds, per row, the host's Python functions by own time over ``--repeats`` calls (cProfile, which
inflates the host's time: the shares are what counts) to the log.

``--grow-to N`` runs one call of an N-token prompt first, so the B1 cache is longer than the prompt needs (as in
e2e.py, whose 2048-token rows may follow an 8192-token call).
"""

from __future__ import annotations

import argparse
import contextlib
import cProfile
import datetime
import json
import pstats
import statistics
import time

import e2e
import torch
import transformers
import triton
from timing import median_ms, synchronize

import fuselm
from fuselm.generation.api import engine_of
from fuselm.generation.engine import DecodeEngine
from fuselm.patching.modules import FusedDecoderLayer
from fuselm.profiling import Launch, busy_and_window_us

IMPLS = ("fuselm.generate", "fuselm+hf_generate")
PATHS = (("fused attention", "graph"), ("fused attention", "eager"), ("HF attention", "eager"))
WAITING_CALLS = ("cudaStreamSynchronize", "cudaDeviceSynchronize", "cudaEventSynchronize", "cudaMemcpy")


@contextlib.contextmanager
def fused_prefill_off():
    """The fused prefill attention switched off: a prefill goes through HF's attention, as before it existed."""
    fused_phase = FusedDecoderLayer._fused_phase

    def decode_only(self, hidden_states, kwargs):
        phase, facts = fused_phase(self, hidden_states, kwargs)
        return (phase, facts) if phase == "decode" else (None, None)

    FusedDecoderLayer._fused_phase = decode_only
    try:
        yield
    finally:
        FusedDecoderLayer._fused_phase = fused_phase


@contextlib.contextmanager
def forward_marks(marks: list):
    """``DecodeEngine._prefill`` (the prefill of both call paths, replayed or eager) appends a (time, CUDA event)
    pair to ``marks`` as it starts and as it returns."""
    forward = DecodeEngine._prefill

    def marked(self, *args, **kwargs):
        marks.append(mark())
        try:
            return forward(self, *args, **kwargs)
        finally:
            marks.append(mark())

    DecodeEngine._prefill = marked
    try:
        yield
    finally:
        DecodeEngine._prefill = forward


def mark() -> tuple[float, torch.cuda.Event | None]:
    """The host's clock and, on a GPU, a CUDA event recorded on the current stream."""
    event = None
    if torch.cuda.is_available():
        event = torch.cuda.Event(enable_timing=True)
        event.record()
    return time.perf_counter(), event


def phases(call, repeats: int) -> dict:
    """Median ms of each phase of ``call`` (lead, forward, tail: see the module's docstring), by CUDA events
    (``*_event_ms``; the host's clock without a GPU) and by the host's clock (``*_host_ms``)."""
    cuts: dict[str, list[float]] = {}
    for _ in range(repeats):
        marks: list = []
        synchronize()
        marks.append(mark())
        with forward_marks(marks):
            call()
        marks.append(mark())
        synchronize()
        if len(marks) != 4:
            raise RuntimeError(f"expected one prefill forward per call, saw {(len(marks) - 2) // 2}")
        for name, (a, b) in zip(("lead", "forward", "tail"), zip(marks, marks[1:])):
            cuts.setdefault(f"{name}_host_ms", []).append((b[0] - a[0]) * 1e3)
            gpu = a[1].elapsed_time(b[1]) if a[1] is not None else (b[0] - a[0]) * 1e3
            cuts.setdefault(f"{name}_event_ms", []).append(gpu)
    return {name: statistics.median(values) for name, values in cuts.items()}


def host_parts(model) -> list[tuple[str, object, str]]:
    """(label, owner, attribute) of the functions ``--host-parts`` times: the model's decoder layer class and what
    its prefill calls (looked up where the caller finds them, so a wrapper there is what runs)."""
    from fuselm.patching import decode, modules

    layer = model.model.layers[0]
    return [("layer", type(layer), "forward"), ("  phase check", type(layer), "_fused_phase"),
            ("  input norm", type(layer.input_layernorm), "forward"),
            ("  attention block", decode, "prefill_attention"), ("    q/k/v (_queries)", decode, "_queries"),
            ("      qkv_rope op", decode, "qkv_rope"), ("    sdpa", decode, "sdpa_attention_forward"),
            ("  add+norm", modules, "add_then_norm"), ("  mlp", type(layer.mlp), "forward"),
            ("  add+prime", type(layer), "_add_and_prime"), ("nn.Linear (all)", torch.nn.Linear, "forward")]


@contextlib.contextmanager
def timing_parts(parts: list[tuple[str, object, str]], totals: dict):
    """Each (label, owner, attribute) of ``parts`` wrapped to add its calls and host ms to ``totals[label]``."""
    saved = []
    for label, owner, name in parts:
        inner = getattr(owner, name)
        saved.append((owner, name, owner.__dict__.get(name)))

        def wrapper(*args, _inner=inner, _label=label, **kwargs):
            began = time.perf_counter()
            try:
                return _inner(*args, **kwargs)
            finally:
                count, ms = totals.get(_label, (0, 0.0))
                totals[_label] = (count + 1, ms + (time.perf_counter() - began) * 1e3)

        setattr(owner, name, wrapper)
    try:
        yield
    finally:
        for owner, name, original in reversed(saved):
            if original is None:
                delattr(owner, name)
            else:
                setattr(owner, name, original)


def profiled_span_us(start_us: float, return_us: float, kernels: list[Launch]) -> float:
    """A profiled call's span: from its start until both the host has returned and the GPU's last kernel has ended
    (a replayed graph's kernels run on after the host returned)."""
    return max([return_us, *(launch.end_us for launch in kernels)]) - start_us


def profiled(call) -> tuple[dict, str]:
    """One call under torch.profiler: the row's profile figures and the top-ops table."""
    synchronize()
    activities = [torch.profiler.ProfilerActivity.CPU, torch.profiler.ProfilerActivity.CUDA]
    with torch.profiler.profile(activities=activities) as profile:
        with torch.profiler.record_function("call"):
            call()
        synchronize()
    events = profile.events()
    marker = next(e for e in events if e.name == "call" and e.device_type == torch.autograd.DeviceType.CPU)
    # the GPU's work: every CUDA-side event but the "call" range itself, which the profiler mirrors there too
    on_gpu = [e for e in events if e.device_type == torch.autograd.DeviceType.CUDA and e.name != "call"]
    kernels = [Launch(e.name, "other", e.time_range.start, e.time_range.end) for e in on_gpu]
    span_ms = profiled_span_us(marker.time_range.start, marker.time_range.end, kernels) / 1e3
    kernel_ms = busy_and_window_us(kernels)[0] / 1e3  # overlaps merged
    waits = {}
    for e in events:
        if e.device_type == torch.autograd.DeviceType.CPU and e.name.startswith(WAITING_CALLS):
            count, ms = waits.get(e.name, (0, 0.0))
            waits[e.name] = (count + 1, ms + (e.time_range.end - e.time_range.start) / 1e3)
    by_name: dict[str, list] = {}
    for e in on_gpu:
        entry = by_name.setdefault(e.name[:90], [0, 0.0])
        entry[0] += 1
        entry[1] += (e.time_range.end - e.time_range.start) / 1e3
    first = min((launch.start_us for launch in kernels), default=marker.time_range.start)
    row = {"span_ms": span_ms, "kernel_ms": kernel_ms, "idle_ms": span_ms - kernel_ms,
           "lead_ms": (first - marker.time_range.start) / 1e3, "kernels": len(kernels),
           "waits": {name: {"count": c, "ms": round(ms, 3)} for name, (c, ms) in waits.items()},
           "kernels_by_name": {name: {"count": c, "ms": round(ms, 3)}
                               for name, (c, ms) in sorted(by_name.items(), key=lambda item: -item[1][1])}}
    return row, profile.key_averages().table(sort_by="self_cpu_time_total", row_limit=15)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--prompt", type=int, default=2048)
    parser.add_argument("--batch", type=int, default=1, help="prompts per call (e2e's decode rows prefill 32 x 512)")
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--layers", type=int, default=32)
    parser.add_argument("--grow-to", type=int, default=0, help="one call of a prompt this long first (cache length)")
    parser.add_argument("--host-parts", action="store_true", help="the host's ms per part of the prefill forward")
    parser.add_argument("--cprofile", action="store_true", help="the host's Python functions by own time, per row")
    parser.add_argument("--out", default=None)
    parser.add_argument("--smoke", action="store_true", help="a tiny fp32 model on the CPU (checks the script)")
    args = parser.parse_args()
    model = e2e.build(args.layers, smoke=args.smoke)
    fuselm.patch(model)
    prompt = torch.randint(3, model.config.vocab_size, (args.batch, args.prompt), device=model.device)
    if args.grow_to:
        grown = torch.randint(3, model.config.vocab_size, (args.batch, args.grow_to), device=model.device)
        e2e.call(model, IMPLS[0], grown, 1)
    rows = []
    for path, mode in PATHS:
        switches = contextlib.ExitStack()
        if path == "HF attention":
            switches.enter_context(fused_prefill_off())
        if mode == "eager":
            switches.enter_context(e2e.eager_prefills())
        with switches:
            for impl in IMPLS:
                def call(impl=impl):
                    return e2e.call(model, impl, prompt, 1)

                for _ in range(2):
                    call()
                event_ms = median_ms(call, warmup_ms=0, rep_ms=0, min_repeats=args.repeats, flush_l2=False)
                walls = []
                for _ in range(args.repeats):
                    synchronize()
                    began = time.perf_counter()
                    call()
                    synchronize()
                    walls.append((time.perf_counter() - began) * 1e3)
                cut = phases(call, args.repeats)
                figures, table = profiled(call)
                buckets = engine_of(model)._buckets.values()
                replayed = mode == "graph" and any(length == args.prompt for bucket in buckets
                                                   for length, _ in bucket.prefills.graphs)
                row = {"impl": impl, "prefill": path, "mode": mode, "replayed": replayed, "batch": args.batch,
                       "prompt": args.prompt, "grow_to": args.grow_to, "event_ms": event_ms,
                       "wall_ms": statistics.median(walls), "phases": cut, **figures}
                rows.append(row)
                print(f"{impl:>20} {path:<16} {mode:<5} event {event_ms:7.2f} ms  wall {row['wall_ms']:7.2f}  "
                      f"kernels {figures['kernel_ms']:7.2f} ({figures['kernels']})  idle {figures['idle_ms']:6.2f}  "
                      f"lead {figures['lead_ms']:6.2f}  waits {figures['waits']}", flush=True)
                print("    phases (event / host ms): " + "  ".join(
                    f"{name} {cut[name + '_event_ms']:.2f} / {cut[name + '_host_ms']:.2f}"
                    for name in ("lead", "forward", "tail")), flush=True)
                if args.host_parts and mode == "eager":
                    totals: dict = {}
                    parts = host_parts(model)
                    with timing_parts(parts, totals):
                        for _ in range(args.repeats):
                            call()
                            synchronize()
                    row["host_parts"] = {label: {"calls": totals[label][0] / args.repeats,
                                                 "ms": totals[label][1] / args.repeats}
                                         for label, _, _ in parts if label in totals}
                    print("    host ms per call by part (inclusive; calls per call):", flush=True)
                    for label, entry in row["host_parts"].items():
                        print(f"      {label:<24} {entry['ms']:8.2f} ms {entry['calls']:6.0f}x  "
                              f"{entry['ms'] / max(entry['calls'], 1) * 1e3:7.1f} us each", flush=True)
                if args.cprofile:
                    profiler = cProfile.Profile()
                    for _ in range(args.repeats):
                        profiler.runcall(call)
                    synchronize()
                    print(f"    {args.repeats} calls under cProfile, top functions by own time:", flush=True)
                    pstats.Stats(profiler).sort_stats("tottime").print_stats(30)
                for name, entry in list(figures["kernels_by_name"].items())[:12]:
                    print(f"    kernel {entry['ms']:8.3f} ms {entry['count']:5d}x  {name}", flush=True)
                print(table, flush=True)
    gpu = torch.cuda.get_device_name() if torch.cuda.is_available() else "none (smoke run)"
    results = {"gpu": gpu, "torch": torch.__version__, "triton": triton.__version__,
               "transformers": transformers.__version__,
               "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
               "method": __doc__, "rows": rows}
    if args.out:
        with open(args.out, "w") as f:
            json.dump(results, f, indent=1)
    print(f"\n{'impl':>20} {'prefill':<16} {'mode':<5} {'event':>8} {'wall':>8} {'kernels':>8} {'idle':>7} {'lead':>7}"
          f" {'lead/fwd/tail (events)':>24}")
    for row in rows:
        cut = row["phases"]
        print(f"{row['impl']:>20} {row['prefill']:<16} {row['mode']:<5} {row['event_ms']:8.2f} {row['wall_ms']:8.2f} "
              f"{row['kernel_ms']:8.2f} {row['idle_ms']:7.2f} {row['lead_ms']:7.2f} "
              f"{cut['lead_event_ms']:8.2f}{cut['forward_event_ms']:8.2f}{cut['tail_event_ms']:8.2f}")


if __name__ == "__main__":
    main()
