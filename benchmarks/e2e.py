"""Generation end to end on one GPU: a Llama-3-8B-shaped model (random weights, bf16), greedy, every impl in one run.

impls: ``fuselm.generate``; ``fuselm+hf_generate`` (a patched model's own ``generate``); ``eager`` (unpatched HF);
``compile_static`` (unpatched HF with ``cache_implementation="static"``, which auto-compiles the decode step);
``liger`` (Liger-Kernel's ``apply_liger_kernel_to_llama`` on a fresh copy, last: it patches transformers' classes).

Rows (``benchmarks/results/e2e-h200.json``):
- ``generate``: tok/s = batch x new / the median time of whole ``generate`` calls (prompt, prefill included),
  with ``gbps``: (weight bytes + KV bytes read per step) x steps/s, the formula in ``formula``; and
  ``first_token_ms`` (the same prompt's call with one new token: its prefill) and ``decode_tok_per_s``, the rate of
  the decode steps alone: batch x (new - 1) / (call time - first_token_ms); and ``clocks`` (CUDA): nvidia-smi's SM
  clock, power and throttle reasons sampled over the timed calls (the H200 and H100 cap power at 700 W), and
  ``clocks_decode``, the samples past each timed call's first ``first_token_ms`` (its decode steps alone);
- ``prefill``: ms of a ``generate`` call with one new token (time to first token), batch 1, the same prompt length
  each call (fuselm's engine replays a captured prefill from a length's third call, up to 4096 tokens);
- ``prefill_eager`` (fuselm's impls): the same with prefill graphs off, as the first call of a prompt length runs;
- ``prefill_after_idle``: the ``prefill`` call again, each after ``--prefill-idle-s`` with the GPU idle (as an
  interactive user's prompt finds it), the median of single calls: the ``prefill`` rows run back to back after the
  generate rows, on a GPU under its power cap, whose clocks fall under sustained GEMMs (``gemm_clock_probe.py``);
  the prefill rows carry their ``clocks`` too;
- ``first_call_s``: the first call of a batch bucket (fuselm: warm-up, autotune, capture; compile_static: its
  compilation), s; with an empty Triton cache (``--no-cold-triton-cache`` keeps the one found) and inductor's caches
  off (gpu_run.sh), so the fuselm rows include compiling the kernels' configs;
- ``launches_per_layer``: GPU kernels per decoder layer in one decode step, (kernels of a 4-layer model - kernels
  of a 2-layer one) / 2, counted with torch.profiler.

Training (``--no-train`` leaves it out; ``--no-generate`` runs it alone): AdamW steps of PEFT LoRA r16 on the seven
projections (``training.py``'s model and step, as ``lora_profile.py`` runs them), batch 1, per impl ``unpatched``,
``fuselm`` (``fuselm.patch`` after PEFT) and ``liger`` (``apply_liger_kernel_to_llama`` before PEFT), each impl's rows
in subprocesses of their own, so that neither Liger's class patches nor a peak of one impl reach another; its
checkpointed rows in one more (a checkpointed run starts in a fresh process, as a user's does: measured after the
other rows in one process, the checkpointed LoRA step came out at 7116-9600 tok/s against 10221 alone, NOTES.md):
- ``lora_step``: a bf16 base, at ``--train-tokens``; ``qlora_step``: the projections as bitsandbytes NF4 linears
  (unpatched and fuselm only; a ``skipped`` row where bitsandbytes does not import), at ``--qlora-tokens``;
- both again at ``--checkpointing-tokens`` with gradient checkpointing (non-reentrant), ``checkpointing: true``;
- ``ms``: the median of ``--train-steps`` timed steps after two untimed ones; ``tok_per_s`` = tokens / that median;
  ``peak_gib``: ``torch.cuda.max_memory_allocated`` over one more step (NaN without CUDA).
"""

from __future__ import annotations

import argparse
import contextlib
import cProfile
import datetime
import gc
import json
import os
import pstats
import statistics
import subprocess
import sys
import tempfile
import time
from importlib.util import find_spec

import peft
import torch
import transformers
import triton
from timing import ClockSampler, copy_gbps, median_ms, once_ms, synchronize
from training import SETUP, adamw_step, issue_ms, lora_model, peak_gib
from training import build as build_base

import fuselm
from fuselm.generation import engine as engine_module
from fuselm.generation.api import engine_of
from fuselm.generation.options import read_options
from fuselm.ops import _common
from fuselm.ops._common import autotune_picks


def build(layers: int, smoke: bool):
    """The generation model: training.py's base (Llama-3-8B shape, bf16; smoke: tiny, fp32), in eval mode."""
    model = build_base(layers, smoke, max_positions=16384)
    model.generation_config.eos_token_id = None  # random weights: every call runs its full length
    model.generation_config.pad_token_id = 0
    return model.eval()


def call(model, impl: str, prompt: torch.Tensor, new: int):
    asked = dict(max_new_tokens=new, min_new_tokens=new, do_sample=False)
    if impl == "fuselm.generate":
        return fuselm.generate(model, prompt, **asked)
    if impl == "compile_static":
        return model.generate(prompt, cache_implementation="static", **asked)
    return model.generate(prompt, **asked)


def timed_call(spans: list, model, impl: str, prompt: torch.Tensor, new: int):
    """``call``, waiting for the GPU, with the call's host-time span appended to ``spans`` (for the clock samples)."""
    start = time.time()
    out = call(model, impl, prompt, new)
    synchronize()
    spans.append((start, time.time()))
    return out


def step_bytes(model, batch: int, context: int) -> int:
    """HBM bytes one decode step must read: every weight but the embedding table (one row of it), plus each row's
    keys and values over ``context`` positions."""
    config = model.config
    weights = sum(p.numel() * p.element_size() for n, p in model.named_parameters() if "embed_tokens" not in n)
    head_dim = config.hidden_size // config.num_attention_heads
    kv = 2 * config.num_hidden_layers * config.num_key_value_heads * head_dim * 2 * context * batch
    return weights + kv


def kernels_per_step(model, impl: str, batch: int, prompt_len: int) -> int:
    """GPU kernels of one decode step (eager, not replayed: the graph replays the same kernels)."""
    prompt = torch.randint(3, model.config.vocab_size, (batch, prompt_len), device=model.device)
    activities = [torch.profiler.ProfilerActivity.CUDA]
    if impl == "fuselm.generate":
        call(model, impl, prompt, 2)
        engine = engine_of(model)
        bucket = engine._buckets[batch]
        options = read_options(model, prompt_len, None, dict(max_new_tokens=2, min_new_tokens=2, do_sample=False))
        torch.cuda.synchronize()
        with torch.profiler.profile(activities=activities) as profile:
            engine._decode_step(bucket, options)
            torch.cuda.synchronize()
    else:
        cache = transformers.DynamicCache(config=model.config)
        with torch.no_grad():
            out = model(prompt, past_key_values=cache, use_cache=True, logits_to_keep=1)
            token = out.logits[:, -1].argmax(-1, keepdim=True)
            torch.cuda.synchronize()
            with torch.profiler.profile(activities=activities) as profile:
                model(token, past_key_values=cache, use_cache=True, logits_to_keep=1).logits[:, -1].argmax(-1)
                torch.cuda.synchronize()
    return sum(1 for e in profile.events() if e.device_type == torch.autograd.DeviceType.CUDA)


def launches_per_layer(impl: str, batch: int, smoke: bool) -> float:
    counts = []
    for layers in (4, 2):
        model = build(layers, smoke)
        if impl == "fuselm.generate":
            fuselm.patch(model)
        counts.append(kernels_per_step(model, impl, batch, 64))
        del model
        gc.collect()
    return (counts[0] - counts[1]) / 2


def measure(model, impl: str, args, rows: list, copy: float, sampler: ClockSampler | None = None) -> None:
    """The impl's first-call, generate and prefill rows; with ``sampler``, the generate and prefill rows' ``clocks``
    are nvidia-smi's samples over their timed calls (SM MHz, watts, throttle reasons)."""
    vocab = model.config.vocab_size
    tokens = torch.Generator().manual_seed(0)
    timed = dict(warmup_ms=0, rep_ms=0, min_repeats=args.repeats, flush_l2=False)  # calls of a second or more
    for batch in args.batches:
        prompt = torch.randint(3, vocab, (batch, args.prompt), generator=tokens).to(model.device)
        synchronize()
        start = time.perf_counter()
        if args.profile_first_call:
            profiler = cProfile.Profile()
            profiler.runcall(call, model, impl, prompt, args.new)
        else:
            call(model, impl, prompt, args.new)
        synchronize()
        rows.append({"what": "first_call_s", "impl": impl, "batch": batch, "prompt": args.prompt, "new": args.new,
                     "s": time.perf_counter() - start}
                    | ({"under_cprofile": True} if args.profile_first_call else {}))  # inflated: not a user's time
        if args.profile_first_call:
            print(f"{impl} B{batch} first call under cProfile, top functions by cumulative s:", flush=True)
            pstats.Stats(profiler).sort_stats("cumulative").print_stats(40)
        began, spans = time.time(), []
        ms = median_ms(lambda prompt=prompt, spans=spans: timed_call(spans, model, impl, prompt, args.new), **timed)
        clocks = sampler.between(began, time.time()) if sampler is not None else None
        tok_s = batch * args.new / (ms / 1e3)
        steps_s = args.new / (ms / 1e3)
        moved = step_bytes(model, batch, args.prompt + args.new // 2)
        rows.append({"what": "generate", "impl": impl, "batch": batch, "prompt": args.prompt, "new": args.new,
                     "tok_per_s": tok_s, "gbps": moved * steps_s / 1e9, "copy_fraction": moved * steps_s / 1e9 / copy,
                     "bytes_per_step": moved,
                     "formula": f"gbps = (weights {step_bytes(model, batch, 0) / 1e9:.2f} GB + KV at mean context "
                                f"{args.prompt + args.new // 2}) x steps/s; steps/s = new / call time"}
                    | ({"clocks": clocks} if clocks else {}))
        print(f"{impl:>20} B{batch:<3} generate {tok_s:8.1f} tok/s ({moved * steps_s / 1e9:6.0f} GB/s, "
              f"{moved * steps_s / 1e9 / copy:.0%} of copy)" + (f", clocks {clocks}" if clocks else ""), flush=True)
        if args.new > 1:  # the same prompt with one new token: the call's prefill, and the decode steps' share
            first_ms = median_ms(lambda prompt=prompt: call(model, impl, prompt, 1), **timed)
            decode_tok_s = batch * (args.new - 1) / ((ms - first_ms) / 1e3)
            rows[-1].update(first_token_ms=first_ms, decode_tok_per_s=decode_tok_s,
                            decode_formula="decode_tok_per_s = batch x (new - 1) / (call time - first_token_ms); "
                                           "first_token_ms = the same prompt's call with one new token")
            if sampler is not None:  # the decode steps' own clocks: each timed call's span past its first token
                rows[-1]["clocks_decode"] = sampler.within([(start + first_ms / 1e3, end) for start, end in spans])
            print(f"{impl:>20} B{batch:<3} first token {first_ms:8.1f} ms, decode steps alone {decode_tok_s:8.1f} "
                  f"tok/s" + (f", their clocks {rows[-1]['clocks_decode']}" if sampler is not None else ""),
                  flush=True)
    for prefill in args.prefills:
        prompt = torch.randint(3, vocab, (1, prefill), generator=tokens).to(model.device)
        began = time.time()
        ms = median_ms(lambda prompt=prompt: call(model, impl, prompt, 1), **timed)
        clocks = sampler.between(began, time.time()) if sampler is not None else None
        rows.append({"what": "prefill", "impl": impl, "batch": 1, "prompt": prefill, "new": 1, "ms": ms}
                    | ({"clocks": clocks} if clocks else {}))
        print(f"{impl:>20} prefill B1x{prefill}: {ms:.1f} ms" + (f", clocks {clocks}" if clocks else ""), flush=True)
        if impl.startswith("fuselm"):
            with eager_prefills():
                ms = median_ms(lambda prompt=prompt: call(model, impl, prompt, 1), **timed)
            rows.append({"what": "prefill_eager", "impl": impl, "batch": 1, "prompt": prefill, "new": 1, "ms": ms})
            print(f"{impl:>20} prefill B1x{prefill}, eager: {ms:.1f} ms", flush=True)
        if args.prefill_idle_s > 0:  # as an interactive user's prompt finds the GPU: idle, at full clocks
            idle_s = args.prefill_idle_s if torch.cuda.is_available() else 0.0
            times, clocks = [], []
            for _ in range(args.repeats):
                synchronize()
                time.sleep(idle_s)
                began = time.time()
                times.append(once_ms(lambda prompt=prompt: call(model, impl, prompt, 1)))
                if sampler is not None:
                    clocks.append(sampler.between(began, time.time()))
            ms = statistics.median(times)
            rows.append({"what": "prefill_after_idle", "impl": impl, "batch": 1, "prompt": prefill, "new": 1,
                         "ms": ms, "ms_all": times, "idle_s": idle_s} | ({"clocks": clocks} if clocks else {}))
            print(f"{impl:>20} prefill B1x{prefill} after {idle_s:.1f} s idle: {ms:.1f} ms"
                  + (f", clocks {clocks[-1]}" if clocks else ""), flush=True)


@contextlib.contextmanager
def eager_prefills():
    """fuselm's engine captures no prefill: every call prefills eagerly, as a prompt length's first call does."""
    tokens = engine_module.PREFILL_GRAPH_TOKENS
    engine_module.PREFILL_GRAPH_TOKENS = 0
    try:
        yield
    finally:
        engine_module.PREFILL_GRAPH_TOKENS = tokens


TRAIN_IMPLS = {"lora_step": ("unpatched", "fuselm", "liger"), "qlora_step": ("unpatched", "fuselm")}
TRAIN_FORMULA = ("tok_per_s = tokens / median step s; issue_ms = median wall time of 3 steps from a synchronised "
                 "start until the call returns (the host's time per step: near ms, the host sets the pace); peak = "
                 "torch.cuda.max_memory_allocated over one step")
NEEDS = {"qlora_step": "bitsandbytes", "liger": "liger_kernel"}  # the module a row kind or an impl imports
ROW_MARK = "e2e train row: "  # a child's line carrying one row, as JSON


def row_key(row: dict) -> tuple:
    """What a row measures: a later run's row of the same key replaces it (--merge-into)."""
    return tuple(row.get(name) for name in ("what", "impl", "batch", "prompt", "tokens", "checkpointing"))


def merged_rows(earlier: dict, rows: list[dict]) -> list[dict]:
    """``earlier``'s rows that ``rows`` does not measure again, each keeping its ``run_date`` (or taking the date of
    ``earlier``, a file older than the tag), then ``rows``."""
    fresh = {row_key(row) for row in rows}
    return [{"run_date": earlier.get("date"), **row} for row in earlier["rows"] if row_key(row) not in fresh] + rows


def tuning_table_in_use() -> str:
    """The shipped tuning table the autotuners consult on this GPU (fuselm/ops/_common.py), or why none."""
    if not torch.cuda.is_available():
        return "none: no GPU"
    path = _common.tuning_table_path(torch.cuda.get_device_name())
    if not _common.use_tuning_table:
        return "off (FUSELM_TUNING_TABLE=0): every key tuned"
    return f"{path.relative_to(_common.TUNING_DIR.parents[2])}" if path.is_file() else "none for this GPU"


TRAIN_PARTS = ("plain", "checkpointing")  # one subprocess each per impl


def train_plan(what: str, args, part: str | None = None) -> list[tuple[int, bool]]:
    """(tokens, gradient checkpointing) of each row of one impl (of one part of them: ``TRAIN_PARTS``), in the order
    its subprocess runs them."""
    tokens = args.train_tokens if what == "lora_step" else args.qlora_tokens
    plain, checkpointed = [(count, False) for count in tokens], [(count, True) for count in args.checkpointing_tokens]
    return {"plain": plain, "checkpointing": checkpointed, None: plain + checkpointed}[part]


def train_impl_rows(what: str, impl: str, args, part: str | None = None) -> None:
    """In a subprocess of one impl: its model, then each row of :func:`train_plan` (of ``part``), printed after
    ``ROW_MARK``."""
    rows = [{"what": what, "impl": impl, "tokens": tokens, "checkpointing": checkpointing, "layers": args.layers}
            for tokens, checkpointing in train_plan(what, args, part)]
    try:
        if what == "qlora_step":
            import bitsandbytes  # noqa: F401
        if impl == "liger":
            from liger_kernel.transformers import apply_liger_kernel_to_llama
    except ImportError as error:
        print(ROW_MARK + json.dumps({"what": what, "impl": impl, "skipped": f"does not import: {error}"}), flush=True)
        return
    cuda = torch.cuda.is_available()
    base = build_base(args.layers, args.smoke, qlora=what == "qlora_step")
    if impl == "liger":
        apply_liger_kernel_to_llama(model=base)
    model = lora_model(base)
    report = str(fuselm.patch(model)) if impl == "fuselm" else None
    ids = torch.Generator().manual_seed(0)
    checkpointing = False
    for row in rows:
        if row["checkpointing"] and not checkpointing:  # the plan has these rows last
            model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
            checkpointing = True
        tokens = torch.randint(0, model.config.vocab_size, (1, row["tokens"]), generator=ids).to(base.device)
        step = adamw_step(model, tokens)
        try:
            ms = median_ms(step, warmup_ms=0, rep_ms=0, min_repeats=args.train_steps, flush_l2=False)
            row.update(ms=ms, tok_per_s=row["tokens"] / (ms / 1e3), issue_ms=issue_ms(step), peak_gib=peak_gib(step),
                       formula=TRAIN_FORMULA)
        except torch.OutOfMemoryError as error:
            row["error"] = f"out of memory: {str(error).splitlines()[0]}"
        if report is not None:
            row["patch_report"] = report
        del step, tokens
        model.zero_grad(set_to_none=True)
        gc.collect()
        if cuda:
            torch.cuda.empty_cache()
        print(ROW_MARK + json.dumps(row), flush=True)


def train_section(args, rows: list, save) -> None:
    """Each impl's training rows from its subprocesses (this script with ``--one-train-impl``, one per part of
    ``TRAIN_PARTS`` that has rows), saved as they come; a subprocess that fails leaves an ``error`` row."""
    options = ["--layers", str(args.layers), "--train-steps", str(args.train_steps),
               "--train-tokens", *map(str, args.train_tokens), "--qlora-tokens", *map(str, args.qlora_tokens),
               "--checkpointing-tokens", *map(str, args.checkpointing_tokens)] + (["--smoke"] if args.smoke else [])
    began = time.perf_counter()
    for what, impls in TRAIN_IMPLS.items():
        for impl in impls:
            if args.train_impls and f"{what}:{impl}" not in args.train_impls:
                continue
            missing = [name for name in (NEEDS.get(what), NEEDS.get(impl)) if name and not find_spec(name)]
            if missing:  # no subprocess started only to fail its import
                rows.append({"what": what, "impl": impl, "skipped": f"{missing[0]} is not installed"})
                print(train_line(rows[-1]), flush=True)
                save()
                continue
            for part in [part for part in TRAIN_PARTS if train_plan(what, args, part)]:
                start = time.perf_counter()
                command = [sys.executable, os.path.abspath(__file__), "--one-train-impl", f"{what}:{impl}:{part}",
                           *options]
                with subprocess.Popen(command, stdout=subprocess.PIPE, text=True) as child:
                    for line in child.stdout:
                        if not line.startswith(ROW_MARK):
                            print(line, end="", flush=True)
                            continue
                        row = json.loads(line[len(ROW_MARK):])
                        rows.append(row)
                        save()
                        print(train_line(row), flush=True)
                if child.returncode:
                    rows.append({"what": what, "impl": impl, "part": part,
                                 "error": f"its subprocess exited with {child.returncode}"})
                    save()
                print(f"{what} {impl} ({part} rows): {time.perf_counter() - start:.0f} s in its subprocess", flush=True)
    print(f"training rows: {time.perf_counter() - began:.0f} s", flush=True)


def train_line(row: dict) -> str:
    head = f"{row['what']:<10} {row['impl']:>10}"
    if "tok_per_s" not in row:
        return f"{head} {row.get('skipped') or row.get('error')}"
    return (f"{head} {row['tokens']:>5} tokens{' checkpointed' if row['checkpointing'] else '':<13} "
            f"{row['ms']:8.1f} ms {row['tok_per_s']:8.0f} tok/s {row['peak_gib']:6.1f} GiB"
            + (f"  issue {row['issue_ms']:.1f} ms" if "issue_ms" in row else ""))


def generation(args, rows: list, save, copy: float) -> None:
    """The generate, prefill, first-call and launch rows, every impl in this process (Liger last)."""
    cuda = torch.cuda.is_available()
    model = build(args.layers, args.smoke)
    sampler = ClockSampler() if cuda else None
    # the unpatched impls first (fuselm.patch stays on the model), then the fuselm impls in the order asked
    order = ([i for i in ("eager", "compile_static") if i in args.impls]
             + [i for i in args.impls if i in ("fuselm.generate", "fuselm+hf_generate")])
    for impl in order:
        if impl.startswith("fuselm"):
            fuselm.patch(model)
        measure(model, impl, args, rows, copy, sampler)
        save()
    del model
    gc.collect()
    if cuda:  # before Liger, which patches transformers' Llama classes for every later model
        for impl in ("eager", "fuselm.generate"):
            for batch in args.batches:
                value = launches_per_layer(impl, batch, args.smoke)
                rows.append({"what": "launches_per_layer", "impl": impl, "batch": batch, "prompt": 64, "new": 1,
                             "value": value})
                print(f"{impl:>20} B{batch:<3} kernels per layer per decode step: {value:.1f}", flush=True)
        save()
    if "liger" in args.impls:
        try:
            from liger_kernel.transformers import apply_liger_kernel_to_llama
        except ImportError:
            print("liger-kernel does not import: no liger rows", flush=True)
        else:
            if cuda:
                torch.cuda.empty_cache()
            model = build(args.layers, args.smoke)
            apply_liger_kernel_to_llama(model=model)
            measure(model, "liger", args, rows, copy, sampler)
            save()
            del model
            gc.collect()
    if sampler is not None:
        sampler.stop()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--layers", type=int, default=32)
    parser.add_argument("--prompt", type=int, default=512)
    parser.add_argument("--new", type=int, default=256)
    parser.add_argument("--batches", type=int, nargs="+", default=[1, 32])
    parser.add_argument("--prefills", type=int, nargs="*", default=[2048, 8192])
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--prefill-idle-s", type=float, default=1.0,
                        help="the prefill_after_idle rows: each call after this long with the GPU idle (0: no rows)")
    parser.add_argument("--impls", nargs="+", default=["fuselm.generate", "fuselm+hf_generate", "eager",
                                                        "compile_static", "liger"])
    parser.add_argument("--generate", action=argparse.BooleanOptionalAction, default=True,
                        help="the generation rows (--no-generate: training rows only)")
    parser.add_argument("--train", action=argparse.BooleanOptionalAction, default=True,
                        help="the lora_step and qlora_step rows")
    parser.add_argument("--train-tokens", type=int, nargs="+", help="LoRA rows (default 4096 8192; smoke 64 128)")
    parser.add_argument("--qlora-tokens", type=int, nargs="+", help="QLoRA rows (default 4096; smoke 64)")
    parser.add_argument("--checkpointing-tokens", type=int, nargs="+",
                        help="LoRA and QLoRA rows with gradient checkpointing (default 4096; smoke 64)")
    parser.add_argument("--train-impls", nargs="+", metavar="WHAT:IMPL",
                        help="only these training impls, e.g. lora_step:fuselm qlora_step:fuselm (default all; with "
                             "--merge-into the others' rows stay)")
    parser.add_argument("--train-steps", type=int, default=None, help="timed steps per row (default 5; smoke 2)")
    parser.add_argument("--cold-triton-cache", action=argparse.BooleanOptionalAction, default=True,
                        help="run with an empty Triton cache (a fresh TRITON_CACHE_DIR), so first_call_s includes "
                             "compiling every kernel config, as a user's first run does")
    parser.add_argument("--one-train-impl", help=argparse.SUPPRESS)  # what:impl[:part], a training subprocess's rows
    parser.add_argument("--out", default="benchmarks/results/e2e-h200.json")
    parser.add_argument("--merge-into", help="an earlier results file: keep its rows that this run does not measure "
                                             "again (same what, impl, batch, prompt/tokens, checkpointing), each "
                                             "tagged with its run's date, and its top-level keys of a section not "
                                             "run now (--no-generate or --no-train)")
    parser.add_argument("--profile-first-call", action="store_true",
                        help="print where each first call's time goes (cProfile, top functions by cumulative time)")
    parser.add_argument("--smoke", action="store_true", help="tiny model, any device: checks the script only")
    args = parser.parse_args()
    known = [f"{what}:{impl}" for what, impls in TRAIN_IMPLS.items() for impl in impls]
    if unknown := sorted(set(args.train_impls or ()) - set(known)):
        parser.error(f"--train-impls: unknown {', '.join(unknown)} (known: {' '.join(known)})")
    for name, full, smoke in (("train_tokens", [4096, 8192], [64, 128]), ("qlora_tokens", [4096], [64]),
                              ("checkpointing_tokens", [4096], [64]), ("train_steps", 5, 2)):
        if getattr(args, name) is None:
            setattr(args, name, smoke if args.smoke else full)
    if args.one_train_impl:
        what, impl, *part = args.one_train_impl.split(":")
        train_impl_rows(what, impl, args, *part)
        return
    if args.cold_triton_cache:  # first_call_s as on a machine that never ran fuselm (the training children inherit it)
        os.environ["TRITON_CACHE_DIR"] = tempfile.mkdtemp(prefix="fuselm-e2e-triton-cache-")
    cuda = torch.cuda.is_available()
    copy = copy_gbps() if cuda and args.generate else float("nan")
    rows: list[dict] = []
    earlier = json.load(open(args.merge_into)) if args.merge_into else None
    trained = (f"a tiny fp32 Llama (smoke, {args.layers} layers)" if args.smoke
               else f"Llama-3-8B shape ({args.layers} layers), bf16 (qlora_step: NF4 projections, bitsandbytes)")

    run_date = datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds")

    def save() -> None:  # after each impl (training: each row), so a failure later keeps what was measured
        results = {
            "gpu": torch.cuda.get_device_name() if cuda else "cpu (smoke)", "torch": torch.__version__,
            "triton": triton.__version__, "transformers": transformers.__version__, "peft": peft.__version__,
            "date": run_date, "copy_gbps": copy,
            "model": f"Llama-3-8B shape ({args.layers} layers), random weights, bf16, sdpa attention; greedy, "
                     f"prompt {args.prompt}, {args.new} new tokens",
            "triton_cache": "cold: an empty TRITON_CACHE_DIR" if args.cold_triton_cache else "as found",
            "tuning_table": tuning_table_in_use(), "dependent": _common.dependent_settings(),
            "train_model": f"{trained}, random weights, sdpa attention; {SETUP}; {args.train_steps} timed steps "
                           "after 2 untimed ones; each impl in its own process",
            "rows": [{**row, "run_date": run_date} for row in rows],
        }
        if args.generate:  # the generation rows ran in this process (the training rows each in their own)
            results["autotune_picks"] = autotune_picks()
        if earlier is not None:
            keys = (([] if args.generate else ["copy_gbps", "model", "autotune_picks"])
                    + ([] if args.train else ["train_model", "train_notes"]))
            results |= {key: earlier[key] for key in keys if key in earlier}
            results |= {"rows": merged_rows(earlier, results["rows"]),
                        "merged_into": f"{args.merge_into} of {earlier.get('date')}"}
        with open(args.out, "w") as f:
            json.dump(results, f, indent=1)

    if args.generate:
        generation(args, rows, save, copy)
    if args.train:
        if cuda and args.generate:  # the subprocesses get the GPU: nothing of this process's models stays cached
            gc.collect()
            torch.cuda.empty_cache()
            print(f"allocated before the training rows: {torch.cuda.memory_allocated() / 2**30:.2f} GiB", flush=True)
        train_section(args, rows, save)
    print(f"\ncopy {copy:.0f} GB/s" if args.generate else "")
    for row in rows:
        if row["what"] == "generate":
            print(f"generate  {row['impl']:>20} B{row['batch']:<3} {row['tok_per_s']:9.1f} tok/s  "
                  f"{row['copy_fraction']:.0%} of copy")
    for row in rows:
        if row["what"] != "generate" and "batch" in row:
            value = row.get("ms", row.get("s", row.get("value")))
            print(f"{row['what']:<18} {row['impl']:>20} B{row['batch']:<3} prompt {row['prompt']:<5} {value:.2f}")
    for row in rows:
        if row["what"] in TRAIN_IMPLS:
            print(train_line(row))


if __name__ == "__main__":
    main()
