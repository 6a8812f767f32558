"""The pieces the training benchmarks share (``train_bench.py``, ``lora_profile.py``, ``e2e.py``'s LoRA rows): the
Llama-3-8B-shaped model built on the GPU (random weights, bf16, sdpa attention), its NF4 base for QLoRA, the PEFT
LoRA on all seven projections, one AdamW step, and the peak memory of a call.

Import it from a script in benchmarks/ (``python benchmarks/<script>.py`` puts benchmarks/ first on sys.path):
``from training import build, lora_model, adamw_step, peak_gib``.
"""

from __future__ import annotations

import time
from collections.abc import Callable

import peft
import torch
import transformers
from torch import nn

TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
LLAMA_3_8B = dict(vocab_size=128256, hidden_size=4096, intermediate_size=14336, num_attention_heads=32,
                  num_key_value_heads=8)
TINY = dict(vocab_size=256, hidden_size=256, intermediate_size=96, num_attention_heads=4,
            num_key_value_heads=2)  # head_dim 64: one of the fused decode path's, so generation smoke runs take it
LORA = dict(r=16, lora_alpha=32, target_modules=TARGETS)
SETUP = (f"LoRA r{LORA['r']} alpha {LORA['lora_alpha']} on {len(TARGETS)} projections, fp32 adapters, AdamW, "
         "batch 1")


def build(layers: int, smoke: bool, qlora: bool = False, max_positions: int = 8192) -> nn.Module:
    """The frozen base: a Llama-3-8B-shaped ``LlamaForCausalLM`` with ``layers`` layers (``smoke``: a tiny fp32 one),
    made directly on the GPU when there is one; ``qlora``: its projections as bitsandbytes NF4 linears."""
    config = transformers.LlamaConfig(**(TINY if smoke else LLAMA_3_8B), num_hidden_layers=layers,
                                      max_position_embeddings=max_positions, rope_theta=500000.0, rms_norm_eps=1e-5,
                                      attn_implementation="sdpa")
    torch.manual_seed(0)
    with torch.device("cuda" if torch.cuda.is_available() else "cpu"):
        model = transformers.LlamaForCausalLM._from_config(config, dtype=torch.float32 if smoke else torch.bfloat16)
    if qlora:
        _quantise_projections(model)
    model.requires_grad_(False)
    return model


def _quantise_projections(model: nn.Module) -> None:
    """Each decoder-layer projection as a bitsandbytes NF4 Linear4bit (double quantisation, bf16 compute), as
    ``from_pretrained(..., quantization_config=BitsAndBytesConfig(load_in_4bit=True, ...))`` makes them."""
    import bitsandbytes as bnb

    for layer in model.model.layers:
        for parent in (layer.self_attn, layer.mlp):
            for name, linear in list(parent.named_children()):
                if name not in TARGETS:
                    continue
                quantised = bnb.nn.Linear4bit(linear.in_features, linear.out_features, bias=linear.bias is not None,
                                              compute_dtype=torch.bfloat16, compress_statistics=True,
                                              quant_type="nf4")
                quantised.weight = bnb.nn.Params4bit(linear.weight.data.cpu(), requires_grad=False,
                                                     compress_statistics=True, quant_type="nf4")
                setattr(parent, name, quantised.to(linear.weight.device))  # quantised on the move to the GPU
    model.is_loaded_in_4bit = True  # what PEFT reads to wrap Linear4bit layers in its 4-bit LoRA class


def lora_model(base: nn.Module) -> nn.Module:
    """``base`` under PEFT LoRA (:data:`LORA`, fp32 adapters as PEFT keeps them), in training mode. PEFT starts B at
    zero; here B is drawn (std 0.01) so that every branch's work is real."""
    torch.manual_seed(1)
    model = peft.get_peft_model(base, peft.LoraConfig(**LORA))
    with torch.no_grad():
        for name, param in model.named_parameters():
            if "lora_B" in name:
                param.normal_(std=0.01)
    return model.train()


def adamw_step(model: nn.Module, ids: torch.Tensor) -> Callable[[], None]:
    """One training step on ``ids`` ([1, tokens]) as a call: forward with the labels, backward, AdamW (lr 1e-5) on
    the trainable parameters, gradients set to None. The optimizer (and its state, made by the first call) lives as
    long as the returned call."""
    optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-5)

    def step() -> None:
        model(input_ids=ids, labels=ids).loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)

    return step


def issue_ms(step: Callable[[], object]) -> float:
    """The median wall time of 3 calls of ``step`` from a synchronised start until it returns (before the
    synchronize): the host's time for a step, near the step's own time when the host, not the GPU, sets the pace.
    Take it before any profiler runs in the process: taken after a profiled step (session 5's run), it came out
    above the step's own median, so a profiler leaves something behind that this figure must not include."""
    cuda = torch.cuda.is_available()
    issue = []
    for _ in range(3):
        if cuda:
            torch.cuda.synchronize()
        began = time.perf_counter()
        step()
        issue.append((time.perf_counter() - began) * 1e3)
        if cuda:
            torch.cuda.synchronize()
    return sorted(issue)[1]


def peak_gib(fn: Callable[[], object]) -> float:
    """``torch.cuda.max_memory_allocated`` over one call of ``fn``, GiB; NaN (after calling ``fn``) without CUDA."""
    if not torch.cuda.is_available():
        fn()
        return float("nan")
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    fn()
    torch.cuda.synchronize()
    return torch.cuda.max_memory_allocated() / 2**30
