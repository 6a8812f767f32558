"""The quirks of each model family that fuselm's one generic patching path cannot read off a module.

A family is one Hugging Face modeling file (``transformers/models/<family>/modeling_<family>.py``):
every class defined there (its RMSNorm, MLP, Attention, DecoderLayer, ForCausalLM) is recognised as
that family's. Classes from anywhere else (custom or remote code) have no family; fuselm then patches
only what a probe at patch time proves equal (see :mod:`fuselm.patching.recognise`), never their
decoder layers nor their loss. Every family here has a ``*ForCausalLM.forward`` that
:mod:`fuselm.patching.loss` has read.

What the table does not need to say, because the generic path reads it from the modules or the
tensors at run time:

- ``q_norm``/``k_norm`` modules are instances of the family's RMSNorm class and get patched like
  every other; the attention itself stays HF's code, only the rotary call inside it is swapped;
- partial rotary (Phi-3), an explicit ``head_dim`` != hidden / heads, rope scaling (Llama 3.1's
  ``llama3``, YaRN, ...): the rotary width and the scaled angles arrive in ``cos``/``sin``.

What an attention block computes (projections, bias, q/k norms, scaling, soft-capping, sliding
window) is partly the table's and partly the config's: :func:`attention_facts` joins them per layer.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

LAYER_NORMS = ("pre", "sandwich", "post")


@dataclass(frozen=True)
class Family:
    """How one model family's modules compute, where that differs from Llama."""

    # RMSNorm
    norm_casting: str = "llama"  # fuselm.rms_norm's casting: Llama rounds the normalised x, Gemma the product
    norm_offset: float = 0.0  # the norm multiplies by offset + weight (Gemma stores w, uses 1 + w)
    # gated MLP
    activation_config: str = "hidden_act"  # config attribute naming the MLP activation (Gemma 2/3: GeGLU)
    mlp_inputs: tuple[str, ...] = ("gate_proj", "up_proj")  # or one packed [gate | up] projection (Phi-3)
    mlp_output: str = "down_proj"
    mlp_activation: str = "act_fn"  # the MLP's attribute holding the activation module
    # decoder layer
    layer_norms: str = "pre"  # where the layer's norms sit (one of LAYER_NORMS):
    #   "pre": input_layernorm feeds attention, post_attention_layernorm the MLP (Llama);
    #   "sandwich": also post_attention_ / post_feedforward_layernorm norm each branch before its residual
    #     add, and pre_feedforward_layernorm feeds the MLP (Gemma 2/3);
    #   "post": the norms only norm each branch before its add (OLMo2): no add feeds a norm, nothing to fuse
    residual_dropouts: tuple[str, str] | None = None  # Phi-3: dropout on the attention / MLP branch before the add
    final_norm: str = "norm"  # the decoder model's norm after its last layer
    # attention
    qkv_projections: tuple[str, ...] = ("q_proj", "k_proj", "v_proj")  # or one packed [q | k | v] (Phi-3)
    output_projection: str = "o_proj"
    qkv_bias: bool | None = None  # None: as config.attention_bias says
    output_bias: bool | None = None  # None: as config.attention_bias says
    qk_norm: str | None = None  # "head": q_norm/k_norm norm each head (Qwen3, Gemma3); "projection": the
    #                             whole q / k projection before it is split into heads (OLMo2)
    scale_config: str | None = None  # config attribute s, scores scaled by s ** -0.5 (Gemma 2/3); else head_dim
    softcap_config: str | None = None  # config attribute: scores soft-capped, cap * tanh(scores / cap) (Gemma 2)
    sliding_windows: str | None = None  # where config.sliding_window applies: "every" layer (Mistral, Phi-3),
    #                                     or the "sliding_attention" ones of config.layer_types (Qwen2/3, Gemma 2/3)
    bidirectional_config: str | None = None  # config attribute that, when true, makes attention non-causal

    def __post_init__(self):
        if self.layer_norms not in LAYER_NORMS:
            raise ValueError(f"layer_norms must be one of {LAYER_NORMS}, got {self.layer_norms!r}")


LLAMA = Family()
_GEMMA_ARITHMETIC = dict(norm_casting="gemma", norm_offset=1.0, bidirectional_config="use_bidirectional_attention")
_GEMMA_SANDWICH = dict(_GEMMA_ARITHMETIC, activation_config="hidden_activation", layer_norms="sandwich",
                       scale_config="query_pre_attn_scalar", sliding_windows="layer_types")

FAMILIES: dict[str, Family] = {
    "llama": LLAMA,  # Llama 2, 3, 3.1 (llama3 rope scaling)
    "mistral": Family(qkv_bias=False, output_bias=False, sliding_windows="every"),
    "qwen2": Family(qkv_bias=True, output_bias=False, sliding_windows="layer_types"),  # Qwen2 and Qwen2.5
    "qwen3": Family(qk_norm="head", sliding_windows="layer_types"),
    "gemma": Family(**_GEMMA_ARITHMETIC),
    # Gemma2's attention soft-caps its scores; Gemma3's config has attn_logit_softcapping but its attention
    # does not pass it on (transformers 5.24), so Gemma3 does not soft-cap.
    "gemma2": Family(**_GEMMA_SANDWICH, softcap_config="attn_logit_softcapping"),
    "gemma3": Family(**_GEMMA_SANDWICH, qk_norm="head"),  # Gemma3ForCausalLM and Gemma3's text model
    "phi3": Family(mlp_inputs=("gate_up_proj",), mlp_activation="activation_fn",
                   residual_dropouts=("resid_attn_dropout", "resid_mlp_dropout"), qkv_projections=("qkv_proj",),
                   qkv_bias=False, output_bias=False, sliding_windows="every"),
    "olmo2": Family(norm_casting="gemma", layer_norms="post", qk_norm="projection"),
}

_HF_MODELS = "transformers.models."


def family_name(owner: type | Callable) -> str | None:
    """The HF modeling file that defines ``owner``, a class or function ("llama" for LlamaRMSNorm), or None
    outside transformers' model files."""
    module = getattr(owner, "__module__", None) or ""
    if not module.startswith(_HF_MODELS):
        return None
    file = module.rsplit(".", 1)[-1]
    return file.removeprefix("modeling_") if file.startswith("modeling_") else None


def family_of(owner: type | Callable) -> Family | None:
    """The table's entry for the family that defines ``owner``, or None for a family not in the table."""
    name = family_name(owner)
    return FAMILIES.get(name) if name is not None else None


@dataclass(frozen=True)
class AttentionFacts:
    """What one layer's HF attention computes, beyond rotary embedding (which arrives in cos/sin)."""

    projections: tuple[str, ...]  # ("q_proj", "k_proj", "v_proj"), or ("qkv_proj",) packed [q | k | v] on the last dim
    output: str  # the output projection, "o_proj"
    num_heads: int
    num_kv_heads: int  # grouped-query attention when fewer than num_heads
    head_dim: int
    qkv_bias: bool  # whether the q/k/v projections add a bias
    output_bias: bool
    qk_norm: str | None  # as Family.qk_norm: "head", "projection" or None; the norms are q_norm and k_norm
    scaling: float  # scores = q @ k^T * scaling
    softcap: float | None  # scores -> softcap * tanh(scores / softcap) before the mask, when set
    sliding_window: int | None  # when set, query position i sees key positions j > i - window only (and, when
    #                             not causal, j < i + window)
    causal: bool


def attention_facts(family: Family, config: object, layer_idx: int) -> AttentionFacts:
    """The attention facts of layer ``layer_idx`` of a model of ``family`` with HF config ``config``.

    Raises ValueError for a layer index outside the config's layers.
    """
    layers = config.num_hidden_layers
    if not 0 <= layer_idx < layers:
        raise ValueError(f"layer_idx must be in [0, {layers}), got {layer_idx}")
    num_heads = config.num_attention_heads
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // num_heads
    config_bias = bool(getattr(config, "attention_bias", False))
    scale_base = getattr(config, family.scale_config) if family.scale_config else head_dim
    softcap = getattr(config, family.softcap_config, None) if family.softcap_config else None
    bidirectional = bool(getattr(config, family.bidirectional_config, False)) if family.bidirectional_config else False
    return AttentionFacts(
        projections=family.qkv_projections, output=family.output_projection, num_heads=num_heads,
        num_kv_heads=getattr(config, "num_key_value_heads", None) or num_heads, head_dim=head_dim,
        qkv_bias=config_bias if family.qkv_bias is None else family.qkv_bias,
        output_bias=config_bias if family.output_bias is None else family.output_bias,
        qk_norm=family.qk_norm, scaling=scale_base**-0.5, softcap=None if softcap is None else float(softcap),
        sliding_window=_sliding_window(family, config, layer_idx), causal=not bidirectional)


def _sliding_window(family: Family, config: object, layer_idx: int) -> int | None:
    window = getattr(config, "sliding_window", None)
    if family.sliding_windows is None or window is None:
        return None
    if family.sliding_windows == "layer_types":
        layer_types = getattr(config, "layer_types", None)
        if layer_types is None or layer_types[layer_idx] != "sliding_attention":
            return None
    return int(window)
