"""The quirks of each model family that fuselm's one generic patching path cannot read off a module.

A family is one Hugging Face modeling file (``transformers/models/<family>/modeling_<family>.py``):
every class defined there (its RMSNorm, MLP, Attention, DecoderLayer) is recognised as that family's.
Classes from anywhere else (custom or remote code) have no family; fuselm then patches only what a
probe at patch time proves equal (see :mod:`fuselm.patching.patch`) and never their decoder layers.

What the table does not need to say, because the generic path reads it from the modules or the
tensors at run time:

- q/k/v bias (Qwen2), fused ``qkv_proj`` (Phi-3), attention soft-capping (Gemma2): the projections
  and the attention stay HF's own code, only the rotary call inside it is swapped;
- ``q_norm``/``k_norm`` (Qwen3, Gemma3): they are instances of the family's RMSNorm class and get
  patched like every other;
- partial rotary (Phi-3), an explicit ``head_dim`` != hidden / heads, rope scaling (Llama 3.1's
  ``llama3``, YaRN, ...): the rotary width and the scaled angles arrive in ``cos``/``sin``.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Family:
    """How one model family's modules compute, where that differs from Llama."""

    norm_casting: str = "llama"  # fuselm.rms_norm's casting: Llama rounds the normalised x, Gemma the product
    norm_offset: float = 0.0  # the norm multiplies by offset + weight (Gemma stores w, uses 1 + w)
    activation_config: str = "hidden_act"  # config attribute naming the MLP activation (Gemma 2/3: GeGLU)
    mlp_inputs: tuple[str, ...] = ("gate_proj", "up_proj")  # or one packed [gate | up] projection (Phi-3)
    mlp_output: str = "down_proj"
    mlp_activation: str = "act_fn"  # the MLP's attribute holding the activation module
    sandwich_norms: bool = False  # Gemma 2/3: post_attention_ and post_feedforward_layernorm norm each
    #                               branch before its residual add; pre_feedforward_layernorm feeds the MLP
    residual_dropouts: tuple[str, str] | None = None  # Phi-3: dropout on the attention / MLP branch before the add
    final_norm: str = "norm"  # the decoder model's norm after its last layer


LLAMA = Family()
GEMMA = Family(norm_casting="gemma", norm_offset=1.0)
GEMMA_SANDWICH = Family(norm_casting="gemma", norm_offset=1.0, activation_config="hidden_activation",
                        sandwich_norms=True)
PHI3 = Family(mlp_inputs=("gate_up_proj",), mlp_activation="activation_fn",
              residual_dropouts=("resid_attn_dropout", "resid_mlp_dropout"))

FAMILIES: dict[str, Family] = {
    "llama": LLAMA,  # Llama 2, 3, 3.1 (llama3 rope scaling)
    "mistral": LLAMA,
    "qwen2": LLAMA,  # Qwen2 and Qwen2.5
    "qwen3": LLAMA,
    "gemma": GEMMA,
    "gemma2": GEMMA_SANDWICH,
    "gemma3": GEMMA_SANDWICH,  # Gemma3ForCausalLM and the text model inside Gemma3ForConditionalGeneration
    "phi3": PHI3,
}

_HF_MODELS = "transformers.models."


def family_name(cls: type) -> str | None:
    """The HF modeling file that defines ``cls`` ("llama" for LlamaRMSNorm), or None outside transformers."""
    module = cls.__module__
    if not module.startswith(_HF_MODELS):
        return None
    file = module.rsplit(".", 1)[-1]
    return file.removeprefix("modeling_") if file.startswith("modeling_") else None


def family_of(cls: type) -> Family | None:
    """The table's entry for the family that defines ``cls``, or None for a family not in the table."""
    name = family_name(cls)
    return FAMILIES.get(name) if name is not None else None
