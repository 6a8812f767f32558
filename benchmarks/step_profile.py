"""Where one captured decode step of ``fuselm.generate`` spends its time, kernel by kernel (Llama-3-8B shape, bf16).

For each batch: one ``fuselm.generate`` call (prompt ``--prompt``, 2 new tokens) captures the bucket's step; then
``--steps`` replays of that graph are timed with CUDA events (median) and ``--steps`` more are profiled with
torch.profiler (CUPTI reports the kernels inside a graph). Kernels are grouped by name: launches per step and GPU µs
per step; a kernel launched once per layer (``layers`` times a step) is a layer kernel, any other count is the step's
own work around the layers (embedding, rotary tables, final norm, lm_head, the token choice, the cache's opening).
``idle`` = the replay's time - the sum of its kernels' times: the gaps between kernels. ``layer_chain``: per layer
kernel, what it adds to the step's critical path (its end - the previous kernel's end; :func:`chain`).

Also the prefill of that call (the model's forward over the prompt, eager), with the same grouping.

    python benchmarks/step_profile.py --out benchmarks/results/step-profile-h200.json
"""

from __future__ import annotations

import argparse
import datetime
import json
import statistics
from collections import defaultdict

import torch
import transformers
import triton
from e2e import build
from timing import copy_gbps

import fuselm
from fuselm.generation.api import engine_of
from fuselm.generation.options import read_options
from fuselm.profiling import device_launches


def _kernels(profile) -> dict[str, list[float]]:
    """GPU kernel name -> the durations (µs) of its launches in ``profile``."""
    found = defaultdict(list)
    for launch in device_launches(profile.events()):
        found[launch.name].append(launch.end_us - launch.start_us)
    return found


# A decoder layer's kernels in launch order; the linear_residual launch after attention is o, after gate/up down
LAYER_ROLES = {"_qkv_rope_kernel": "qkv_rope", "_decode_attention_kernel": "attention",
               "_norm_gated_kernel": "gate_up"}


def _role(name: str, previous_role: str | None) -> str | None:
    if name == "_linear_residual_kernel":
        return {"attention": "o", "gate_up": "down"}.get(previous_role or "")
    return LAYER_ROLES.get(name)


def chain(launches) -> dict[str, dict]:
    """Per layer kernel (qkv_rope, attention, o, gate_up, down), medians over its launches of: ``duration_us`` (its
    own span, dependent-launch wait included), ``starts_after_previous_end_us`` (negative: it started before the
    kernel before it ended, as a dependent launch does) and ``marginal_us`` = its end - the previous kernel's end,
    what the kernel adds to the step's critical path. Launches in start order; a layer kernel right after a
    non-layer one (the step's first) is left out."""
    stats: dict[str, dict[str, list[float]]] = defaultdict(lambda: defaultdict(list))
    previous, previous_role = None, None
    for launch in sorted(launches, key=lambda launch: launch.start_us):
        role = _role(launch.name, previous_role)
        if role is not None and previous_role is not None:
            stats[role]["duration_us"].append(launch.end_us - launch.start_us)
            stats[role]["starts_after_previous_end_us"].append(launch.start_us - previous.end_us)
            stats[role]["marginal_us"].append(launch.end_us - previous.end_us)
        previous, previous_role = launch, role
    return {role: {name: round(statistics.median(values), 2) for name, values in found.items()} | {
        "launches": len(found["marginal_us"])} for role, found in stats.items()}


def _grouped(found: dict[str, list[float]], steps: int, layers: int) -> list[dict]:
    rows = []
    for name, times in found.items():
        per_step = len(times) / steps
        rows.append({"kernel": name[:120], "per_step": per_step, "us_per_step": sum(times) / steps,
                     "us_each": statistics.median(times), "layer_kernel": per_step % layers == 0})
    return sorted(rows, key=lambda row: -row["us_per_step"])


def step_rows(model, batch: int, prompt_len: int, steps: int) -> dict:
    layers = model.config.num_hidden_layers
    prompt = torch.randint(3, model.config.vocab_size, (batch, prompt_len), device=model.device)
    fuselm.generate(model, prompt, max_new_tokens=2, min_new_tokens=2, do_sample=False)
    engine = engine_of(model)
    options = read_options(model, prompt_len, None, dict(max_new_tokens=2, min_new_tokens=2, do_sample=False))
    bucket = engine._buckets[batch]
    graph = bucket.graphs[options.mode]
    times = []
    for _ in range(steps):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        graph.replay()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) * 1e3)
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as profile:
        for _ in range(steps):
            graph.replay()
        torch.cuda.synchronize()
    kernels = _grouped(_kernels(profile), steps, layers)
    layer_chain = chain(device_launches(profile.events()))
    replay_us = statistics.median(times)
    busy = sum(row["us_per_step"] for row in kernels)
    layer_us = sum(row["us_per_step"] for row in kernels if row["layer_kernel"])
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as profile:
        fuselm.generate(model, prompt, max_new_tokens=1, do_sample=False)
        torch.cuda.synchronize()
    prefill = _grouped(_kernels(profile), 1, layers)
    return {"batch": batch, "prompt": prompt_len, "replay_us": replay_us, "busy_us": busy,
            "idle_us": replay_us - busy, "layer_kernels_us": layer_us, "other_kernels_us": busy - layer_us,
            "other_launches": sum(row["per_step"] for row in kernels if not row["layer_kernel"]),
            "kernels": kernels, "layer_chain": layer_chain,
            "prefill_busy_us": sum(row["us_per_step"] for row in prefill), "prefill": prefill[:25]}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--batches", type=int, nargs="*", default=[1, 32])
    parser.add_argument("--prompt", type=int, default=512)
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--layers", type=int, default=32)
    parser.add_argument("--out", default=None)
    args = parser.parse_args()
    model = build(args.layers, smoke=False)
    fuselm.patch(model)
    result = {"gpu": torch.cuda.get_device_name(), "torch": torch.__version__, "triton": triton.__version__,
              "transformers": transformers.__version__, "date": datetime.datetime.now(datetime.UTC).isoformat(),
              "copy_gbps": copy_gbps(), "layers": args.layers, "formula": __doc__.split("\n\n")[1].replace("\n", " "),
              "rows": [step_rows(model, batch, args.prompt, args.steps) for batch in args.batches]}
    for row in result["rows"]:
        print(f"B{row['batch']}: replay {row['replay_us']:.1f} us = layer kernels {row['layer_kernels_us']:.1f} + "
              f"other kernels {row['other_kernels_us']:.1f} ({row['other_launches']:.0f} launches) + idle "
              f"{row['idle_us']:.1f}; prefill kernels {row['prefill_busy_us'] / 1e3:.2f} ms")
        for kernel in row["kernels"]:
            print(f"  {kernel['per_step']:5.1f} x {kernel['us_each']:7.2f} us = {kernel['us_per_step']:8.1f} us  "
                  f"{'layer' if kernel['layer_kernel'] else 'step '}  {kernel['kernel'][:90]}")
        print("  layer chain (medians, us): kernel, duration, start after the previous end, marginal (end - the "
              "previous end)")
        for role, found in row["layer_chain"].items():
            print(f"  {role:<10} {found['duration_us']:7.2f} {found['starts_after_previous_end_us']:7.2f} "
                  f"{found['marginal_us']:7.2f}  ({found['launches']} launches)")
        print("  prefill top:")
        for kernel in row["prefill"][:12]:
            print(f"  {kernel['per_step']:5.1f} x {kernel['us_each']:8.1f} us = {kernel['us_per_step'] / 1e3:7.2f} ms"
                  f"  {kernel['kernel'][:90]}")
    if args.out:
        with open(args.out, "w") as file:
            json.dump(result, file, indent=1)


if __name__ == "__main__":
    main()
