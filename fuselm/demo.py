"""``fuselm demo``: a small Llama-shaped model with random weights, run with and without fuselm.

Nothing is downloaded. On a CUDA GPU the fused Triton kernels run (bf16); elsewhere every op falls
back to its PyTorch reference (fp32), and the demo says which path ran. It checks that the logits
and greedy tokens of the patched model match the unpatched model, and exits non-zero if not.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable

import torch
from rich.console import Console
from rich.table import Table

import fuselm
from fuselm.backend import path_name

# relative logit error allowed between patched and unpatched (rounding of the fused arithmetic)
LOGIT_TOLERANCE = {torch.float32: 1e-4, torch.bfloat16: 3e-2, torch.float16: 1e-2}


def build_model(device: torch.device, dtype: torch.dtype, layers: int):
    from transformers import LlamaConfig, LlamaForCausalLM

    big = device.type == "cuda"
    config = LlamaConfig(
        vocab_size=32000 if big else 2048, hidden_size=2048 if big else 256,
        intermediate_size=5632 if big else 688, num_hidden_layers=layers,
        num_attention_heads=16 if big else 8, num_key_value_heads=4 if big else 2,
        max_position_embeddings=4096, rope_theta=500000.0, rms_norm_eps=1e-5,
    )
    torch.manual_seed(0)
    model = LlamaForCausalLM(config).to(device=device, dtype=dtype).eval()
    with torch.no_grad():  # move the norm weights off their init of 1, so a wrong norm shows
        for name, param in model.named_parameters():
            if "norm" in name:
                param.add_(0.1 * torch.randn_like(param))
    return model


def median_seconds(fn: Callable[[], object], device: torch.device, repeats: int) -> float:
    times = []
    for _ in range(repeats + 1):  # the first run is warm-up (compilation, autotuning)
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        start = time.perf_counter()
        fn()
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        times.append(time.perf_counter() - start)
    return statistics.median(times[1:])


def run(device: str | None = None, layers: int = 4, batch: int = 2, seq: int = 256, new_tokens: int = 16,
        repeats: int = 5) -> bool:
    """Run the demo; returns True when the patched model matches the unpatched one."""
    console = Console()
    dev = torch.device(device or ("cuda" if torch.cuda.is_available() else "cpu"))
    dtype = torch.bfloat16 if dev.type == "cuda" else torch.float32
    if dev.type != "cuda":
        seq, repeats = min(seq, 64), min(repeats, 3)
    model = build_model(dev, dtype, layers)
    tokens = torch.randint(0, model.config.vocab_size, (batch, seq), device=dev)
    prompt = tokens[:, : max(1, seq // 4)]
    console.print(f"[bold]fuselm demo[/] — Llama-shaped model, {layers} layers, hidden {model.config.hidden_size}, "
                  f"random weights, {dtype}, batch {batch} × {seq} tokens")
    console.print(f"ops run: [bold]{path_name(dev)}[/] (FUSELM_BACKEND={fuselm.get_backend()})")

    def forward():
        with torch.no_grad():
            return model(tokens).logits

    def generate():
        with torch.no_grad():
            return model.generate(prompt, attention_mask=torch.ones_like(prompt), max_new_tokens=new_tokens,
                                  min_new_tokens=new_tokens, do_sample=False, pad_token_id=0)

    results = {}
    for label in ("HF eager", "fuselm"):
        if label == "fuselm":
            console.print(str(fuselm.patch(model)), highlight=False)
        results[label] = {"logits": forward().float(), "tokens": generate(),
                          "forward_s": median_seconds(forward, dev, repeats),
                          "generate_s": median_seconds(generate, dev, max(1, repeats // 2))}
    fuselm.unpatch(model)

    ref, ours = results["HF eager"], results["fuselm"]
    error = ((ours["logits"] - ref["logits"]).norm() / ref["logits"].norm()).item()
    same_tokens = torch.equal(ours["tokens"], ref["tokens"])
    logits_ok = error <= LOGIT_TOLERANCE[dtype]
    table = Table(title="patched vs unpatched")
    for column in ("", "HF eager", "fuselm", "speed-up"):
        table.add_column(column, justify="right")
    for key, what in (("forward_s", f"forward {batch}×{seq} (ms)"), ("generate_s", f"generate {new_tokens} tokens (ms)")):
        table.add_row(what, f"{ref[key] * 1e3:.2f}", f"{ours[key] * 1e3:.2f}", f"{ref[key] / ours[key]:.2f}×")
    console.print(table)
    if not fuselm.backend.runs_triton(tokens.new_empty(0, dtype=dtype)):
        console.print("(the fused kernels need a CUDA GPU: here fuselm ran its PyTorch references, so the timings "
                      "show no speed-up, only that the patched model computes the same)")
    console.print(f"logits relative error {error:.2e} (allowed {LOGIT_TOLERANCE[dtype]:.0e}): "
                  + ("[green]match[/]" if logits_ok else "[red]MISMATCH[/]"))
    console.print("greedy tokens: " + ("[green]identical[/]" if same_tokens else "[yellow]differ[/]"))
    # bf16 rounding can flip a near-tie in argmax, so identical tokens are required only in fp32
    return logits_ok and (same_tokens or dtype != torch.float32)
