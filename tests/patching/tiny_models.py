"""Tiny random-weight models of every family fuselm.patch must handle (odd sizes, GQA, explicit head_dim)."""

from __future__ import annotations

import torch
from transformers import AutoConfig, AutoModelForCausalLM

from tests.conftest import DEVICE

VOCAB = 131
_COMMON = dict(vocab_size=VOCAB, hidden_size=56, intermediate_size=90, num_hidden_layers=2, num_attention_heads=4,
               num_key_value_heads=2, max_position_embeddings=64, tie_word_embeddings=False, initializer_range=0.1,
               pad_token_id=0, bos_token_id=1, eos_token_id=2)
_LLAMA31_ROPE = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                 "original_max_position_embeddings": 8}

# name -> (model_type, config overrides). head_dim 24 != 56 / 4 wherever the family has the option.
FAMILIES = {
    "llama2": ("llama", dict(num_key_value_heads=4)),  # multi-head attention, head_dim = 56 / 4
    "llama": ("llama", dict(head_dim=24)),
    "llama3.1": ("llama", dict(head_dim=24, rope_scaling=_LLAMA31_ROPE)),
    "mistral": ("mistral", dict(head_dim=24, sliding_window=6)),
    "qwen2": ("qwen2", dict(head_dim=24)),
    "qwen3": ("qwen3", dict(head_dim=24)),
    "gemma2": ("gemma2", dict(head_dim=24, sliding_window=6, attn_logit_softcapping=30.0, final_logit_softcapping=20.0,
                              query_pre_attn_scalar=24)),
    "gemma3": ("gemma3_text", dict(head_dim=24, sliding_window=6, layer_types=["sliding_attention", "full_attention"],
                                   query_pre_attn_scalar=24)),
    "phi3": ("phi3", dict(partial_rotary_factor=0.5, num_attention_heads=4, hidden_size=64, intermediate_size=84)),
}
# Families fuselm has no table entry for: parallel residual + interleaved RoPE + LayerNorm (Cohere),
# post-norm layers with full-width q/k norms (OLMo2), residual multipliers (Granite).
UNLISTED = {
    "cohere": ("cohere", dict()),
    "olmo2": ("olmo2", dict()),
    "granite": ("granite", dict(head_dim=24, residual_multiplier=0.7, attention_multiplier=0.3)),
}


def tiny_model(name: str, dtype: torch.dtype = torch.float32, seed: int = 0, device: str = DEVICE,
               **overrides) -> torch.nn.Module:
    """A random-weight *ForCausalLM on ``device``, norm weights moved away from their init so (1 + w) vs w shows."""
    model_type, extra = {**FAMILIES, **UNLISTED}[name]
    config = AutoConfig.for_model(model_type, **{**_COMMON, **extra, **overrides})
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config)
    with torch.no_grad():
        for param_name, param in model.named_parameters():
            if "norm" in param_name:
                param.add_(0.3 * torch.randn_like(param))
    return model.to(device, dtype).eval()


def token_ids(batch: int = 2, seq_len: int = 9, seed: int = 1, device: str = DEVICE) -> torch.Tensor:
    """[batch, seq_len] random ids that avoid the special tokens 0-2."""
    return torch.randint(3, VOCAB, (batch, seq_len), generator=torch.Generator().manual_seed(seed)).to(device)
