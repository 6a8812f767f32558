"""Training and prefill end to end on one GPU: a Llama-3-8B-shaped model (random weights, bf16): unpatched,
fuselm.patch, and (when liger-kernel imports) Liger-Kernel's ``apply_liger_kernel_to_llama`` on a fresh copy.

Measures prefill latency, greedy-decode throughput and one LoRA training step (PEFT, r=16 on all
seven projections): time and peak memory. Each time is ``timing.median_ms``: the median of CUDA-event
timings after warm-up. Writes benchmarks/results/train-h200.json (or --out). Generation: ``e2e.py``.
"""

from __future__ import annotations

import argparse
import datetime
import gc
import json

import peft
import torch
import transformers
import triton
from timing import median_ms
from training import build, peak_gib

import fuselm


def last_logits(model, prompt: torch.Tensor) -> torch.Tensor:
    """fp32 logits of the last 8 positions of the first 512 prompt tokens."""
    with torch.no_grad():
        return model(prompt[:, :512]).logits[0, -8:].float()


def fp32_logits(model, prompt: torch.Tensor) -> torch.Tensor:
    """:func:`last_logits` of the unpatched model with its parameters in fp32 (bf16 -> fp32 -> bf16
    is lossless). Parameters only: ``model.float()`` would also round-trip buffers that HF keeps
    in fp32, e.g. RoPE's inv_freq, through bf16."""
    dtype = next(model.parameters()).dtype
    for param in model.parameters():
        param.data = param.data.float()
    logits = last_logits(model, prompt)
    for param in model.parameters():
        param.data = param.data.to(dtype)
    return logits


def measure(model, label: str, prompt: torch.Tensor, ids: torch.Tensor, decode_new: int) -> dict:
    from peft import LoraConfig, get_peft_model

    model.eval()
    out = {"logits": last_logits(model, prompt)}
    with torch.no_grad():
        out["prefill_ms"] = median_ms(lambda: model(prompt, logits_to_keep=1, use_cache=False), min_repeats=5)
        short = prompt[:, :512]
        generate = lambda: model.generate(short, max_new_tokens=decode_new, min_new_tokens=decode_new,  # noqa: E731
                                          do_sample=False)
        out["decode_tok_s"] = decode_new / (median_ms(generate, min_repeats=3) / 1e3)
    lora = get_peft_model(model, LoraConfig(r=16, lora_alpha=32, target_modules=[
        "q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]))
    lora.train()

    def step():
        lora(input_ids=ids, labels=ids).loss.backward()

    out["lora_ms"] = median_ms(step, min_repeats=3)
    out["lora_tok_s"] = ids.numel() / (out["lora_ms"] / 1e3)
    out["lora_peak_gib"] = peak_gib(step)
    lora.zero_grad(set_to_none=True)
    lora.unload()  # remove the LoRA layers, back to the plain model
    print(f"{label}: prefill {out['prefill_ms']:.1f} ms, decode {out['decode_tok_s']:.1f} tok/s, "
          f"LoRA {out['lora_tok_s']:.0f} tok/s {out['lora_peak_gib']:.1f} GiB", flush=True)
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--layers", type=int, default=32)
    parser.add_argument("--prefill", type=int, default=2048)
    parser.add_argument("--lora-tokens", type=int, default=4096)
    parser.add_argument("--decode-new", type=int, default=64)
    parser.add_argument("--out", default="benchmarks/results/train-h200.json")
    parser.add_argument("--smoke", action="store_true", help="tiny model, any device: checks the script only")
    args = parser.parse_args()
    model = build(args.layers, args.smoke).eval()
    tokens = torch.Generator().manual_seed(0)  # the same prompt and training ids for both measurements
    prompt = torch.randint(0, model.config.vocab_size, (1, args.prefill), generator=tokens).to(model.device)
    ids = torch.randint(0, model.config.vocab_size, (1, args.lora_tokens), generator=tokens).to(model.device)
    exact = fp32_logits(model, prompt)  # what both bf16 runs approximate
    base = measure(model, "unpatched", prompt, ids, args.decode_new)
    report = fuselm.patch(model)
    print(report, flush=True)
    fused = measure(model, "patched", prompt, ids, args.decode_new)
    liger = None
    try:
        from liger_kernel.transformers import apply_liger_kernel_to_llama
    except ImportError:
        print("liger-kernel does not import: no Liger column", flush=True)
    else:  # last: Liger also swaps classes and functions inside transformers' llama module
        del model
        gc.collect()  # nothing of the patched model (or PEFT's leftovers) may stay allocated into the Liger peak
        torch.cuda.empty_cache()
        if torch.cuda.is_available():
            print(f"allocated before the Liger copy: {torch.cuda.memory_allocated() / 2**30:.2f} GiB", flush=True)
        model = build(args.layers, args.smoke).eval()
        apply_liger_kernel_to_llama(model=model)
        try:
            liger = measure(model, "liger", prompt, ids, args.decode_new)
        except RuntimeError as error:  # e.g. no GPU for its kernels: report fuselm's results regardless
            print(f"Liger run failed, no Liger column: {error}", flush=True)
    error = {name: ((run["logits"] - reference).norm() / reference.norm()).item()
             for name, run, reference in [("patched vs unpatched", fused, base["logits"]),
                                          ("unpatched vs fp32", base, exact), ("patched vs fp32", fused, exact)]
             + ([("liger vs fp32", liger, exact)] if liger else [])}

    def row(what, key, fmt, higher_is_better):
        ratio = fused[key] / base[key] if higher_is_better else base[key] / fused[key]
        return {"what": what, "unpatched": fmt.format(base[key]), "patched": fmt.format(fused[key]),
                "ratio": f"{ratio:.2f}× {'faster' if ratio >= 1 else 'slower'}" if "GiB" not in what
                else f"{fused[key] / base[key]:.2f}× memory",
                "liger": fmt.format(liger[key]) if liger else "—"}

    results = {
        "gpu": torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu (smoke)", "torch": torch.__version__,
        "triton": triton.__version__, "transformers": transformers.__version__, "peft": peft.__version__,
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "model": f"Llama-3-8B shape ({args.layers} layers), random weights, bf16, sdpa attention",
        "rows": [
            row(f"prefill B1×{args.prefill} (ms)", "prefill_ms", "{:.1f}", False),
            row(f"greedy decode B1, prompt 512, {args.decode_new} new (tok/s)", "decode_tok_s", "{:.1f}", True),
            row(f"LoRA r16 step, 7 projections, {args.lora_tokens} tokens (tok/s)", "lora_tok_s", "{:.0f}", True),
            row(f"LoRA step peak memory (GiB), {args.lora_tokens} tokens", "lora_peak_gib", "{:.1f}", False),
        ],
        "logits_rel_error": error,
        "patch_report": str(report),
        "notes": "Relative error of the last 8 positions' logits (512-token prompt): "
                 + ", ".join(f"{name} {value:.2e}" for name, value in error.items())
                 + " (fp32: the unpatched model with its parameters in fp32). "
                 "fuselm.patch fuses the norms, RoPE, the MLP activation, the residual adds and the training "
                 "loss (linear cross-entropy); projections and attention are still HF's.",
    }
    with open(args.out, "w") as f:
        json.dump(results, f, indent=1)
    for r in results["rows"]:
        print(f"{r['what']:<60} {r['unpatched']:>10} {r['patched']:>10}  {r['ratio']:<14} Liger {r['liger']}")


if __name__ == "__main__":
    main()
