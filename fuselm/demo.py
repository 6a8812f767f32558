"""``fuselm demo``: a small Llama-shaped model with random weights, run with and without fuselm.

Nothing is downloaded. On a CUDA GPU the fused Triton kernels run (bf16); elsewhere every op falls
back to its PyTorch reference (fp32), and the demo says which path ran. It checks that the logits
and greedy tokens of the patched model match the unpatched model, and exits non-zero if not.
"""

from __future__ import annotations

import copy
import functools
import statistics
import time
from collections.abc import Callable

import torch
from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, SpinnerColumn, TextColumn
from rich.table import Table

import fuselm
from fuselm.backend import path_name

# relative logit error allowed between patched and unpatched (rounding of the fused arithmetic)
LOGIT_TOLERANCE = {torch.float32: 1e-4, torch.bfloat16: 3e-2, torch.float16: 1e-2}
CPU_MAX_SEQ = 64  # tokens per sequence off CUDA, where every op runs its (slow) PyTorch reference


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


def _seconds(fn: Callable[[], object], device: torch.device) -> float:
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    start = time.perf_counter()
    fn()
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    return time.perf_counter() - start


def alternating_medians(fns: dict[str, Callable[[], object]], device: torch.device, runs: int,
                        after_round: Callable[[], object]) -> dict[str, float]:
    """Median seconds of each fn over ``runs`` rounds; every round runs each fn once, in turns (the order
    flips each round), so drift of the machine (clocks, other load) falls on every fn alike. One warm-up
    round first (compilation, autotuning) is not counted."""
    times: dict[str, list[float]] = {name: [] for name in fns}
    for round_index in range(runs + 1):
        names = list(fns) if round_index % 2 == 0 else list(reversed(fns))
        for name in names:
            seconds = _seconds(fns[name], device)
            if round_index:
                times[name].append(seconds)
        after_round()
    return {name: statistics.median(values) for name, values in times.items()}


def run(device: str | torch.device | None = None, layers: int = 4, batch: int = 2, seq: int | None = None,
        new_tokens: int = 16, runs: int = 5) -> bool:
    """Run the demo; returns True when the patched model matches the unpatched one.

    ``seq`` defaults to 256 tokens on CUDA and is at most 64 elsewhere (the PyTorch references are slow).
    """
    console = Console()
    dev = torch.device(device or ("cuda" if torch.cuda.is_available() else "cpu"))
    dtype = torch.bfloat16 if dev.type == "cuda" else torch.float32
    if dev.type != "cuda":
        if seq is not None and seq > CPU_MAX_SEQ:
            console.print(f"--seq {seq} is capped to {CPU_MAX_SEQ} tokens on {dev.type}")
        seq = min(seq or CPU_MAX_SEQ, CPU_MAX_SEQ)
    seq = seq or 256
    with console.status("building the model (random weights) …"):
        model = build_model(dev, dtype, layers)
        patched = copy.deepcopy(model)
        report = fuselm.patch(patched)
    attention = getattr(model.config, "_attn_implementation", None) or "eager"
    columns = {"unpatched": f"HF ({attention} attention)", "patched": f"fuselm ({attention} attention)"}
    tokens = torch.randint(0, model.config.vocab_size, (batch, seq), device=dev)
    prompt = tokens[:, : max(1, seq // 4)]
    console.print(f"[bold]fuselm demo[/] — Llama-shaped model, {layers} layers, hidden {model.config.hidden_size}, "
                  f"random weights, {dtype}, batch {batch} × {seq} tokens")
    console.print(f"ops run: [bold]{path_name(dev)}[/] (FUSELM_BACKEND={fuselm.get_backend()})")
    console.print(str(report), highlight=False)

    def forward(m):
        with torch.no_grad():
            return m(tokens).logits

    def generate(m):
        with torch.no_grad():
            return m.generate(prompt, attention_mask=torch.ones_like(prompt), max_new_tokens=new_tokens,
                              min_new_tokens=new_tokens, do_sample=False, pad_token_id=0)

    models = {"unpatched": model, "patched": patched}
    with Progress(SpinnerColumn(), TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(),
                  console=console, transient=True) as progress:
        task = progress.add_task("a forward pass and a generation on each model", total=len(models))
        results = {}
        for name, m in models.items():
            results[name] = {"logits": forward(m).float(), "tokens": generate(m)}
            progress.advance(task)
        timings = {}
        for key, what, fn in (("forward_s", "forward passes", forward), ("generate_s", "generations", generate)):
            task = progress.add_task(f"timing {what}, the two models in turns", total=runs + 1)
            calls = {name: functools.partial(fn, m) for name, m in models.items()}
            timings[key] = alternating_medians(calls, dev, runs, functools.partial(progress.advance, task))

    ref, ours = results["unpatched"], results["patched"]
    error = ((ours["logits"] - ref["logits"]).norm() / ref["logits"].norm()).item()
    same_tokens = torch.equal(ours["tokens"], ref["tokens"])
    logits_ok = error <= LOGIT_TOLERANCE[dtype]
    fused = dev.type == "cuda" and fuselm.backend.runs_triton(tokens.new_empty(0, dtype=dtype))
    table = Table(title=f"patched vs unpatched (median of {runs} runs each, in turns)")
    for column in ("", *columns.values(), *(("speed-up",) if fused else ())):
        table.add_column(column, justify="right")
    for key, what in (("forward_s", f"forward {batch}×{seq} (ms)"),
                      ("generate_s", f"generate {new_tokens} tokens (ms)")):
        unpatched, patched_s = timings[key]["unpatched"], timings[key]["patched"]
        speed_up = (f"{unpatched / patched_s:.2f}×",) if fused else ()
        table.add_row(what, f"{unpatched * 1e3:.2f}", f"{patched_s * 1e3:.2f}", *speed_up)
    console.print(table)
    if not fused:
        console.print(f"(timings only: the ops ran on {path_name(dev)}, not as fused Triton kernels on a CUDA GPU; "
                      "what the demo shows here is that the patched model computes the same)")
    console.print(f"logits relative error {error:.2e} (allowed {LOGIT_TOLERANCE[dtype]:.0e}): "
                  + ("[green]match[/]" if logits_ok else "[red]MISMATCH[/]"))
    console.print("greedy tokens: " + ("[green]identical[/]" if same_tokens else "[yellow]differ[/]"))
    # bf16 rounding can flip a near-tie in argmax, so identical tokens are required only in fp32
    return logits_ok and (same_tokens or dtype != torch.float32)
