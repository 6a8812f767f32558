"""Tunes the decode projections' kernels the way ``decode_linear_bench`` times them back to back, for a GPU's table.

triton's autotuner times each config alone, after zeroing a 256 MiB buffer (its L2 flush), once per key; the dirty
lines of that flush are written back while the timed kernel runs (benchmarks/NOTES.md, "Measuring at the copy
ceiling"), and its picks for one key moved between runs (linear_residual down at M = 32: 38.5 us one day, 45.3 the
next). Here each config of each key the decode path launches (Llama-3-8B shapes, bf16, M = 1, 8, 32, 64, each op as
``fuselm``'s dispatch calls it) runs as a CUDA-graph replay over 3 x L2 of weights, replays back to back with no
flush (the sets already leave nothing in L2; consecutive decode kernels pay no flush's write-back either), the median
replay time per call taken over ``--rep-ms``; the fastest is the pick. qkv_rope is tuned twice: with the benchmarks'
fp32 cos/sin and int64 positions, and with the bf16 cos/sin and int32 positions of ``fuselm.generate`` (another key).
Writes ``{"gpu", ..., "autotune_picks"}`` (the keys' picks, with every config's time) for
``benchmarks/tuning_table.py``. ``--warmup-ms``: replays of each config before its timed ones; a long warm-up (a second
or more) times it as a sustained decode runs, after the GPU's power cap has set its clocks for that config's own draw
(each config's ``clocks``: nvidia-smi's SM clock, power and throttle reasons over its warm-up and timed replays).

    python benchmarks/tune_decode.py --out benchmarks/results/tune-decode-h200.json
"""

from __future__ import annotations

import argparse
import datetime
import json
import math
import time

import torch
import triton
from decode_linear_bench import LLAMA3_8B, ROWS, gate_up_projection, input_sets, qkv_projection, residual_projection
from timing import ClockSampler, captured, median_ms

import fuselm
from fuselm.ops import _common, decode_linear


def cases(m: int) -> list[tuple[object, object, str]]:
    """(the kernel's autotuner, its projection, the implementation fuselm's dispatch runs at M = m)."""
    norm_in_prologue = {True: "fused, norm in prologue", False: "fused, rms_norm first"}
    gate_up = gate_up_projection(LLAMA3_8B, m)
    qkv_impl = norm_in_prologue[m <= decode_linear.QKV_PROLOGUE_NORM_MAX_ROWS]
    chosen = [(decode_linear._qkv_rope_split, qkv_projection(LLAMA3_8B, m, as_generate), qkv_impl)
              for as_generate in (False, True)]  # the benchmarks' key, and the one fuselm.generate's launches file
    chosen += [(decode_linear._norm_gated_kernel, gate_up,
               norm_in_prologue[m <= decode_linear.GATED_PROLOGUE_NORM_MAX_ROWS])]
    if m <= decode_linear.LINEAR_RESIDUAL_MAX_ROWS:
        hidden = LLAMA3_8B.heads * LLAMA3_8B.head_dim
        chosen += [(decode_linear._linear_residual_kernel, residual_projection(label, n_in, LLAMA3_8B.hidden, m),
                    "fused streaming kernel") for label, n_in in (("o", hidden), ("down", LLAMA3_8B.intermediate))]
    return chosen


def tune(tuner, projection, impl: str, rep_ms: float, warmup_ms: float = 50.0,
         sampler: ClockSampler | None = None) -> dict | None:
    """Every config of ``tuner`` timed on ``projection``'s ``impl``; the key's pick set to the fastest. None when the
    key was tuned here already (M = 1 and 8 share linear_residual's BLOCK_M = 16 key: the first M tuned keeps it)."""
    sets = [projection.make_set() for _ in range(input_sets(projection.weight_bytes))]
    fn = projection.impls[impl]
    before = set(tuner.cache)
    with torch.no_grad():
        fn(sets[0])  # the autotuner's own pass: compiles every config (in parallel) and files the key
    new = set(tuner.cache) - before
    if not new:
        print(f"{projection.name:<34} M={projection.m:<3} {impl:<26} its key was tuned at a smaller M", flush=True)
        return None
    (key,) = new
    timings = []
    for index, config in enumerate(tuner.configs):
        began = time.time()
        try:
            with _common.forced_config(tuner, index), torch.no_grad():
                us = median_ms(captured(lambda: [fn(s) for s in sets]), warmup_ms=warmup_ms, rep_ms=rep_ms,
                               flush_l2=False) * 1e3 / len(sets)
        except Exception as error:  # noqa: BLE001 (a config this shape cannot run, e.g. pruned by its dot sizes)
            us = math.inf
            print(f"  {type(error).__name__}: {str(error).splitlines()[0] if str(error) else ''}")
        timings.append({**config.kwargs, "num_warps": config.num_warps, "num_stages": config.num_stages,
                        "us": round(us, 2)}
                       | ({"clocks": sampler.between(began, time.time())} if sampler is not None else {}))
    best = min(range(len(timings)), key=lambda i: timings[i]["us"])
    autotuner_pick = tuner.cache[key]
    tuner.cache[key] = tuner.configs[best]
    picked = timings[tuner.configs.index(autotuner_pick)]["us"] if autotuner_pick in tuner.configs else None
    print(f"{projection.name:<34} M={projection.m:<3} {impl:<26} best {timings[best]['us']:7.2f} us "
          f"{timings[best]}; the autotuner's pick {picked} us", flush=True)
    return {"name": projection.name, "m": projection.m, "impl": impl, "key": json.loads(_common._key_text(key)),
            "timings": timings, "autotuner_pick_us": picked}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", type=int, nargs="+", default=list(ROWS), help="M values")
    parser.add_argument("--rep-ms", type=float, default=100.0, help="timed replays per config, ms")
    parser.add_argument("--warmup-ms", type=float, default=50.0,
                        help="replays per config before the timed ones, ms (1000+: under the power cap, as a "
                             "sustained decode runs)")
    parser.add_argument("--out", default="benchmarks/results/tune-decode-h200.json")
    args = parser.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("tune_decode.py needs a CUDA GPU")
    _common.use_tuning_table = False  # every config compiled and filed by the autotuner's own pass first
    torch.manual_seed(0)
    tuned = []
    sampler = ClockSampler()
    with fuselm.use_backend("triton"):
        for m in args.rows:
            for tuner, projection, impl in cases(m):
                entry = tune(tuner, projection, impl, args.rep_ms, args.warmup_ms, sampler)
                tuned += [entry] if entry else []
                torch.cuda.empty_cache()
    sampler.stop()
    tuners = [decode_linear._qkv_rope_split, decode_linear._norm_gated_kernel, decode_linear._linear_residual_kernel]
    results = {"gpu": torch.cuda.get_device_name(), "torch": torch.__version__, "triton": triton.__version__,
               "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
               "method": __doc__.split("\n\n")[1].replace("\n", " "), "warmup_ms": args.warmup_ms,
               "rep_ms": args.rep_ms, "tuned": tuned,
               "autotune_picks": _common.autotune_picks(tuners)}
    with open(args.out, "w") as f:
        json.dump(results, f, indent=1)
    print(f"\n{len(tuned)} keys tuned -> {args.out}")
    for entry in tuned:
        best = min(t["us"] for t in entry["timings"])
        print(f"{entry['name']:<34} M={entry['m']:<3} best {best:7.2f} us, autotuner's {entry['autotuner_pick_us']}")


if __name__ == "__main__":
    main()
