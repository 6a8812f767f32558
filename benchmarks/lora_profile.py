"""Where one LoRA training step's GPU time goes: unpatched HF + PEFT, fuselm.patch without and with the fused LoRA
projections, on a Llama-3-8B-shaped model (random weights, bf16, sdpa attention, batch 1).

Each variant trains the same PEFT model (r16, alpha 32, all seven projections, fp32 adapters as PEFT keeps them)
with AdamW: forward, backward, optimizer step. Per variant: the step's time (``timing.median_ms``), tokens/s and
peak memory, then one profiled step (torch.profiler, CUDA kernels) summed by kind of kernel, named by a regex on the
kernel's name (:data:`KINDS`, first match wins; the top kernels are kept in the JSON to check the sorting):

- bf16 GEMMs, next to their FLOP time: the frozen base's forward and input-gradient GEMMs and the lm_head's,
  ``4 · tokens · Σ(K·N)`` FLOPs, at the bf16 GEMM rate measured in the same run (``timing.gemm_tflops``);
- fp32 SIMT GEMMs (PEFT's fp32 adapters), casts and copies, other elementwise work, attention, fuselm's Triton
  kernels, the optimizer, the rest.

``--qlora``: the projections as bitsandbytes 4-bit linears (NF4, double quantisation, bf16 compute) under the
adapters. ``--smoke``: a tiny fp32 model on any device, CPU ops profiled instead of kernels (checks the script).
Writes benchmarks/results/lora-profile-h200.json (or --out).
"""

from __future__ import annotations

import argparse
import cProfile
import datetime
import json
import pstats
import re

import peft
import torch
import transformers
from timing import gemm_tflops, median_ms
from torch import nn
from training import SETUP, adamw_step, build, issue_ms, lora_model, peak_gib

import fuselm
from fuselm.ops import attention, cross_entropy, decode_linear, glu, rms_norm, rope


def _fuselm_kernel_names() -> set[str]:
    """The function names of fuselm's Triton kernels (a kernel appears in a profile under its function's name)."""
    names = set()
    for module in (attention, cross_entropy, decode_linear, glu, rms_norm, rope):
        for name, value in vars(module).items():
            if type(value).__module__.startswith("triton") and hasattr(value, "run"):
                names.add(name)
    return names


# (kind, regex on the kernel name): the first that matches names the kind
KINDS = [
    ("attention", r"flash|fmha|sdpa|attention|cudnn"),
    ("fp32 SIMT GEMM", r"(gemm|gemv).*f32f32.*ffma|sgemm|f32f32_f32f32.*ffma|gemmSN|gemv2T_kernel_val<int, int, float"),
    ("bf16 GEMM", r"gemm|nvjet|cutlass|xmma|cublas|splitKreduce|aten::(mm|addmm|bmm|linear|matmul)$"),
    ("fuselm kernel", "|".join(sorted(_fuselm_kernel_names())) or "$^"),
    ("optimizer", r"multi_tensor_apply|adam|aten::_foreach"),
    ("cast / copy", r"copy|cast|convert|Memcpy|Memset|CatArrayBatched|aten::(to|_to_copy|copy_|cat|clone)$"),
    ("elementwise", r"elementwise|reduce|vectorized|unrolled|index|scatter|gather|fill|softmax|embedding|aten::"),
]


def base_gemm_flops(config, tokens: int) -> float:
    """FLOPs of the frozen base's GEMMs in a step: forward and input gradient (no weight gradient) of every
    projection and of the lm_head, 2 · tokens · K · N each."""
    hidden, inter, vocab = config.hidden_size, config.intermediate_size, config.vocab_size
    kv = config.num_key_value_heads * (hidden // config.num_attention_heads)
    per_layer = hidden * (2 * hidden + 2 * kv) + 3 * hidden * inter
    return 2 * 2 * tokens * (config.num_hidden_layers * per_layer + hidden * vocab)


def kind_of(name: str) -> str:
    return next((kind for kind, pattern in KINDS if re.search(pattern, name)), "other")


def profile_step(step, cuda: bool) -> tuple[dict[str, float], list[dict]]:
    """GPU (or, without CUDA, CPU) self time in ms per kind of kernel for one call of ``step``, and the top kernels."""
    activities = [torch.profiler.ProfilerActivity.CPU] + ([torch.profiler.ProfilerActivity.CUDA] if cuda else [])
    with torch.profiler.profile(activities=activities) as prof:
        step()
        if cuda:
            torch.cuda.synchronize()
    wanted = torch.autograd.DeviceType.CUDA if cuda else torch.autograd.DeviceType.CPU
    by_kind: dict[str, float] = {}
    kernels = []
    for event in prof.key_averages():
        if event.device_type != wanted:
            continue
        self_us = getattr(event, "self_device_time_total" if cuda else "self_cpu_time_total")
        if self_us <= 0:
            continue
        kind = kind_of(event.key)
        by_kind[kind] = by_kind.get(kind, 0.0) + self_us / 1e3
        kernels.append({"name": event.key[:160], "kind": kind, "ms": self_us / 1e3, "calls": event.count})
    kernels.sort(key=lambda k: -k["ms"])
    return dict(sorted(by_kind.items(), key=lambda item: -item[1])), kernels[:40]


LAUNCHES = ("cudaLaunchKernel", "cuLaunchKernel", "cudaLaunchKernelExC", "cuLaunchKernelEx")


def host_view(step, cuda: bool) -> dict:
    """Where the host's time goes in one call of ``step``: the kernel launches, the top operators by self CPU time
    (torch.profiler; its run takes torch.library's dispatch for fuselm's ops, which plain calls skip) and the top
    Python functions by own time (cProfile). Both inflate the host's time: their shares are what counts."""
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        step()
        if cuda:
            torch.cuda.synchronize()
    events = [e for e in prof.key_averages() if e.device_type == torch.autograd.DeviceType.CPU]
    launches = sum(e.count for e in events if e.key in LAUNCHES)
    ops = sorted(events, key=lambda e: -e.self_cpu_time_total)[:25]
    profiler = cProfile.Profile()
    profiler.runcall(step)
    if cuda:
        torch.cuda.synchronize()
    stats = pstats.Stats(profiler).stats  # (file, line, name) -> (primitive calls, calls, own s, cumulative s, ...)
    functions = sorted(stats.items(), key=lambda item: -item[1][2])[:30]
    return {
        "kernel_launches": launches,
        "top_host_ops": [{"name": e.key[:120], "self_ms": e.self_cpu_time_total / 1e3, "calls": e.count} for e in ops],
        "top_python": [{"function": f"{name} ({file.rsplit('/', 2)[-1]}:{line})", "calls": calls,
                        "own_ms": own * 1e3, "cumulative_ms": cumulative * 1e3}
                       for (file, line, name), (_, calls, own, cumulative, _) in functions],
    }


def print_host_view(variant: str, host: dict) -> None:
    print(f"\n{variant}: issue {host['issue_ms']:.1f} ms, {host['kernel_launches']} kernel launches; "
          "top operators by self CPU ms (calls):")
    for op in host["top_host_ops"][:15]:
        print(f"  {op['self_ms']:8.1f} ({op['calls']:5d})  {op['name']}")
    print("  top Python functions by own ms (calls, cumulative ms), under cProfile:")
    for fn in host["top_python"][:20]:
        print(f"  {fn['own_ms']:8.1f} ({fn['calls']:5d}, {fn['cumulative_ms']:8.1f})  {fn['function']}")


def measure(model: nn.Module, variant: str, ids: torch.Tensor, cuda: bool, host: bool = False) -> dict:
    """Time, memory and profile of AdamW LoRA steps of ``model`` (a PEFT model) patched as ``variant`` says."""
    fuselm.unpatch(model)
    report = None
    if variant != "unpatched":
        report = str(fuselm.patch(model, lora=variant == "fuselm.patch"))
    step = adamw_step(model, ids)
    step_ms = median_ms(step, min_repeats=3)
    issue = issue_ms(step) if host else None
    peak = peak_gib(step)
    by_kind, kernels = profile_step(step, cuda)
    print(f"{variant}: {step_ms:.1f} ms/step, {ids.numel() / step_ms * 1e3:.0f} tok/s, peak {peak:.1f} GiB, "
          f"profiled {sum(by_kind.values()):.1f} ms", flush=True)
    run = {"variant": variant, "step_ms": step_ms, "tok_per_s": ids.numel() / step_ms * 1e3, "peak_gib": peak,
           "profiled_ms": sum(by_kind.values()), "ms_by_kind": by_kind, "top_kernels": kernels,
           "patch_report": report}
    if host:
        run["host"] = {"issue_ms": issue, **host_view(step, cuda)}
        print_host_view(variant, run["host"])
    return run


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--layers", type=int, default=32)
    parser.add_argument("--tokens", type=int, default=4096)
    parser.add_argument("--qlora", action="store_true", help="bitsandbytes NF4 base projections")
    parser.add_argument("--variants", nargs="+", default=["unpatched", "fuselm.patch(lora=False)", "fuselm.patch"])
    parser.add_argument("--out", default=None, help="default: benchmarks/results/lora-profile-h200.json "
                                                    "(qlora-profile-h200.json with --qlora; /tmp with --smoke)")
    parser.add_argument("--smoke", action="store_true", help="tiny model, any device: checks the script only")
    parser.add_argument("--host", action="store_true", help="also where the host's time goes (see host_view)")
    parser.add_argument("--checkpointing", action="store_true",
                        help="gradient checkpointing (non-reentrant), as e2e.py's checkpointing rows")
    args = parser.parse_args()
    cuda = torch.cuda.is_available()
    name = "qlora-profile" if args.qlora else "lora-profile"
    out_path = args.out or (f"/tmp/{name}-smoke.json" if args.smoke else f"benchmarks/results/{name}-h200.json")
    model = lora_model(build(args.layers, args.smoke, args.qlora))
    if args.checkpointing:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    ids = torch.randint(0, model.config.vocab_size, (1, args.tokens), generator=torch.Generator().manual_seed(0))
    ids = ids.to(next(model.parameters()).device)
    tflops = gemm_tflops() if cuda else float("nan")
    flops = base_gemm_flops(model.config, args.tokens)
    runs = [measure(model, variant, ids, cuda, args.host) for variant in args.variants]
    results = {
        "gpu": torch.cuda.get_device_name() if cuda else "cpu (smoke)", "torch": torch.__version__,
        "transformers": transformers.__version__, "peft": peft.__version__,
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "model": f"Llama-3-8B shape ({args.layers} layers), random weights, "
                 + ("NF4 projections (bitsandbytes), " if args.qlora else "bf16, ")
                 + SETUP,
        "tokens": args.tokens, "gradient_checkpointing": args.checkpointing,
        "base_gemm_tflop": flops / 1e12,
        "bf16_gemm_tflops_measured": tflops,
        "base_gemm_flop_time_ms": flops / (tflops * 1e12) * 1e3,
        "kinds": {kind: pattern for kind, pattern in KINDS},
        "runs": runs,
    }
    with open(out_path, "w") as f:
        json.dump(results, f, indent=1)
    kinds = sorted({kind for run in runs for kind in run["ms_by_kind"]}, key=lambda k: -runs[0]["ms_by_kind"].get(k, 0))
    unit = "GPU ms" if cuda else "CPU ms"
    print(f"\n{unit + ' per step by kind':<34}" + "".join(f"{run['variant']:>28}" for run in runs))
    for kind in kinds:
        print(f"{kind:<34}" + "".join(f"{run['ms_by_kind'].get(kind, 0.0):>28.1f}" for run in runs))
    print(f"{'total profiled':<34}" + "".join(f"{run['profiled_ms']:>28.1f}" for run in runs))
    print(f"{'step (median_ms)':<34}" + "".join(f"{run['step_ms']:>28.1f}" for run in runs))
    print(f"{'tok/s':<34}" + "".join(f"{run['tok_per_s']:>28.0f}" for run in runs))
    print(f"{'peak GiB':<34}" + "".join(f"{run['peak_gib']:>28.1f}" for run in runs))
    print(f"base GEMMs: {flops / 1e12:.1f} TFLOP = {results['base_gemm_flop_time_ms']:.1f} ms at the measured "
          f"{tflops:.0f} TFLOP/s (4 · tokens · Σ K·N over the projections and the lm_head); written to {out_path}")


if __name__ == "__main__":
    main()
