"""The one list of tiny random-weight test models: every family fuselm's table lists, and a few it does not.

Sizes are odd on purpose (hidden 56, intermediate 90, vocabulary 131), attention is grouped-query (4 heads,
2 key/value heads) and head_dim is 24 != 56 / 4 wherever the family has the option. Import from here::

    from tests.models import FUSED_LAYERS, tiny_config, tiny_model, token_ids

    @pytest.mark.parametrize("name", FUSED_LAYERS)
    def test_something(name):
        model = tiny_model(name)  # a *ForCausalLM on the test device, in eval mode
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
from transformers import AutoConfig, AutoModelForCausalLM

from fuselm.patching.families import FAMILIES as TABLE
from tests.conftest import DEVICE

VOCAB = 131
_COMMON = {"vocab_size": VOCAB, "hidden_size": 56, "intermediate_size": 90, "num_hidden_layers": 2,
           "num_attention_heads": 4, "num_key_value_heads": 2, "max_position_embeddings": 64,
           "tie_word_embeddings": False, "initializer_range": 0.1, "pad_token_id": 0, "bos_token_id": 1,
           "eos_token_id": 2}
_LLAMA31_ROPE = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                 "original_max_position_embeddings": 8}


@dataclass(frozen=True)
class TinyModel:
    model_type: str  # AutoConfig's name for the config class
    family: str | None  # its key in fuselm's family table, or None where the table does not list it
    overrides: dict = field(default_factory=dict)  # config arguments on top of the common tiny sizes


TINY_MODELS: dict[str, TinyModel] = {
    "llama2": TinyModel("llama", "llama", {"num_key_value_heads": 4}),  # multi-head attention, head_dim 56 / 4
    "llama": TinyModel("llama", "llama", {"head_dim": 24}),
    "llama3.1": TinyModel("llama", "llama", {"head_dim": 24, "rope_scaling": _LLAMA31_ROPE}),
    "mistral": TinyModel("mistral", "mistral", {"head_dim": 24, "sliding_window": 6}),
    "qwen2": TinyModel("qwen2", "qwen2", {"head_dim": 24}),
    "qwen3": TinyModel("qwen3", "qwen3", {"head_dim": 24}),
    "gemma": TinyModel("gemma", "gemma", {"head_dim": 24}),
    "gemma2": TinyModel("gemma2", "gemma2", {"head_dim": 24, "sliding_window": 6, "attn_logit_softcapping": 30.0,
                                             "final_logit_softcapping": 20.0, "query_pre_attn_scalar": 24}),
    "gemma3": TinyModel("gemma3_text", "gemma3", {"head_dim": 24, "sliding_window": 6, "query_pre_attn_scalar": 24,
                                                  "layer_types": ["sliding_attention", "full_attention"]}),
    "phi3": TinyModel("phi3", "phi3", {"partial_rotary_factor": 0.5, "hidden_size": 64, "intermediate_size": 84}),
    # post-norm layers with q/k norms over the whole projection: in the table, its layers left to HF
    "olmo2": TinyModel("olmo2", "olmo2"),
    # not in the table: parallel residual + interleaved RoPE + LayerNorm (Cohere), residual multipliers (Granite)
    "cohere": TinyModel("cohere", None),
    "granite": TinyModel("granite", None, {"head_dim": 24, "residual_multiplier": 0.7, "attention_multiplier": 0.3}),
    # mixture of experts, not in the table: the experts stay HF's
    "mixtral": TinyModel("mixtral", None, {"num_local_experts": 4, "num_experts_per_tok": 2,
                                           "intermediate_size": 96}),  # HF's grouped matmul wants 16-byte strides
    "qwen2_moe": TinyModel("qwen2_moe", None, {"num_experts": 4, "num_experts_per_tok": 2, "moe_intermediate_size": 32,
                                               "shared_expert_intermediate_size": 40}),
    "qwen3_moe": TinyModel("qwen3_moe", None, {"num_experts": 4, "num_experts_per_tok": 2, "moe_intermediate_size": 32,
                                               "head_dim": 24}),
}

LISTED = tuple(name for name, tiny in TINY_MODELS.items() if tiny.family is not None)
# Every kind of module fuselm patches, decoder layers included, is patched in these.
FUSED_LAYERS = tuple(name for name in LISTED if TABLE[TINY_MODELS[name].family].layer_norms != "post")
UNLISTED = ("cohere", "granite")
MIXTURE_OF_EXPERTS = ("mixtral", "qwen2_moe", "qwen3_moe")


def tiny_config(name: str, **overrides):
    """The HF config of tiny model ``name`` (a key of TINY_MODELS), with ``overrides`` on top."""
    tiny = TINY_MODELS[name]
    return AutoConfig.for_model(tiny.model_type, **{**_COMMON, **tiny.overrides, **overrides})


def tiny_model(name: str, dtype: torch.dtype = torch.float32, seed: int = 0, device: str = DEVICE,
               **overrides) -> torch.nn.Module:
    """A random-weight *ForCausalLM on ``device``, in eval mode, norm weights moved away from their init so
    (1 + w) vs w shows."""
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(tiny_config(name, **overrides))
    with torch.no_grad():
        for param_name, param in model.named_parameters():
            if "norm" in param_name:
                param.add_(0.3 * torch.randn_like(param))
    return model.to(device, dtype).eval()


def token_ids(batch: int = 2, seq_len: int = 9, seed: int = 1, device: str = DEVICE) -> torch.Tensor:
    """[batch, seq_len] random ids that avoid the special tokens 0-2."""
    return torch.randint(3, VOCAB, (batch, seq_len), generator=torch.Generator().manual_seed(seed)).to(device)


def decode_model(name: str, dtype: torch.dtype = torch.float32) -> torch.nn.Module:
    """Tiny model ``name`` with a head_dim that decode_attention supports (64; Phi-3 and Llama 2 derive it), eos
    unset (tests that want one set it)."""
    sizes = {"hidden_size": 256} if name in ("phi3", "llama2") else {"head_dim": 64}
    model = tiny_model(name, dtype=dtype, **sizes)
    model.generation_config.eos_token_id = None
    if name == "gemma2":  # HF's sdpa attention drops Gemma 2's logit soft-capping before transformers 5.24
        model.config._attn_implementation = "eager"
    return model
