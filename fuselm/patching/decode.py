"""The decode step of a fused decoder layer over fuselm's KV cache: the layer as five fused kernels.

A patched decoder layer called with a :class:`fuselm.generation.FusedKVCache` and at most
``DECODE_MAX_TOKENS`` new tokens per row (decode, or a short speculative/chunked step) runs:

1. ``qkv_rope``: the input RMSNorm in the prologue, the q/k/v projections (+ biases), the q/k head norms,
   RoPE and the write of the new k and v into the layer's cache buffers, in one weight-streaming kernel;
2. ``decode_attention`` over each row's valid slots ``[starts, ends)`` (sliding window, soft-capping);
3. ``linear_residual``: the o projection with the residual add in its epilogue;
4. ``norm_gated_linear``: the post-attention RMSNorm in the prologue, gate/up, the activation;
5. ``linear_residual``: the down projection with the residual add.

Layers with sandwich norms (Gemma 2/3) norm each branch before its residual add, which needs the whole output
row: there the o and down projections run as plain GEMMs and the norms and adds around them as fuselm's
add+norm. Each projection that is not a plain ``nn.Linear`` (a PEFT LoRA layer with an active, unmerged
adapter, a quantised linear, a hooked module) runs as its own module, per call, so nothing it adds is lost;
:func:`decode_fallbacks` names them for the patch report.

The layer that owns layer index 0 opens each step on the cache (``ends += T``; ``starts`` from the rows'
position ids, so left padding is skipped; the slots the step writes): all device work, no host sync, and no
shape that depends on the lengths, so the step can be captured in a CUDA graph.

A longer forward into an empty cache (the prefill, with HF's ``sdpa`` attention) keeps the layer's large-M path
(cuBLAS GEMMs, fuselm's add+norm and activation kernels) but fuses its attention block (:func:`prefill_attention`):
``qkv_rope`` runs cuBLAS GEMMs and one epilogue kernel that writes q and the keys and values straight into the
cache's first T slots, and HF's SDPA attention function reads them there, so the prefill has no RoPE kernel and no
copy into the cache.
"""

from __future__ import annotations

from torch import Tensor, nn
from transformers import AttentionInterface
from transformers.integrations.sdpa_attention import sdpa_attention_forward

from fuselm.ops.attention import decode_attention
from fuselm.ops.decode_linear import linear_residual, norm_gated_linear, qkv_rope
from fuselm.ops.glu import gelu_tanh_mul, silu_mul
from fuselm.ops.rope import rope
from fuselm.patching.families import AttentionFacts, attention_facts, family_of
from fuselm.patching.modules import FusedGatedMLP, FusedRMSNorm, add_then_norm, hooked

DECODE_MAX_TOKENS = 16  # new tokens per row up to which a step takes the fused decode path
# Attention implementations a config names while fuselm's engine runs a forward that needs no mask from HF. HF has
# no mask function for either, so its model builds none (fuselm/generation/engine.py):
# - a decode step, whose fused layers read none (no attention function either: an unfused layer fails loudly);
UNMASKED = "fuselm_unmasked"
# - an unpadded prefill with no sliding window as short as the prompt and no soft-capping, which attends causally
#   over the whole prompt: SDPA's is_causal, in the fused prefill attention and in HF's sdpa function alike.
CAUSAL_PREFILL = "fuselm_causal_prefill"
AttentionInterface.register(CAUSAL_PREFILL, sdpa_attention_forward)
ATTENTION_FACTS = "_fuselm_attention_facts"  # in a decoder layer's __dict__, computed on its first fused step
_GATED = {"silu": silu_mul, "gelu_tanh": gelu_tanh_mul}


def plain_linear(module: nn.Module) -> tuple[Tensor, Tensor | None] | None:
    """(weight, bias) when ``module`` computes exactly ``F.linear(x, weight, bias)``, else None.

    That is a plain ``nn.Linear`` no hook watches, or a PEFT LoRA ``Linear`` whose adapters add nothing now
    (disabled, or every active adapter of this module merged into the base weight) around such a base.
    """
    if type(module) is nn.Linear:
        return None if hooked(module) else (module.weight, module.bias)
    base = getattr(module, "base_layer", None)
    if (type(module).__name__ != "Linear" or not type(module).__module__.startswith("peft.tuners.lora")
            or type(base) is not nn.Linear or hooked(module) or hooked(base)):
        return None
    if module.disable_adapters:  # PEFT unmerges a merged adapter before running the base alone
        return None if module.merged else (base.weight, base.bias)
    active = [name for name in module.active_adapters if name in module.lora_A]
    return (base.weight, base.bias) if all(name in module.merged_adapters for name in active) else None


def _norm_args(norm: nn.Module) -> tuple[Tensor, float, str, float] | None:
    """(weight, eps, casting, offset) of a fused RMSNorm no hook watches, else None (call the module)."""
    if not isinstance(norm, FusedRMSNorm) or hooked(norm):
        return None
    spec = norm._fuselm_norm
    return norm.weight, getattr(norm, spec.eps_attr), spec.casting, spec.offset


def layer_facts(layer: nn.Module) -> AttentionFacts | None:
    """The attention facts of a fused decoder layer (cached on it), or None when they cannot be read."""
    facts = layer.__dict__.get(ATTENTION_FACTS)
    if facts is None:
        attention = layer.self_attn
        family = family_of(type(layer))
        config, index = getattr(attention, "config", None), getattr(attention, "layer_idx", None)
        if family is None or config is None or not isinstance(index, int):
            return None
        facts = attention_facts(family, config, index)
        layer.__dict__[ATTENTION_FACTS] = facts
    return facts


def decode_fallbacks(layer: nn.Module) -> list[str]:
    """The projections of ``layer`` that a fused decode step would call as modules (LoRA, quantised, hooked), or
    ``["self_attn"]`` when a hook watches its attention module (the layer then runs HF's attention module)."""
    facts = layer_facts(layer)
    if facts is None:
        return []
    attention, mlp = layer.self_attn, layer.mlp
    if hooked(attention):
        return ["self_attn"]
    spec = getattr(mlp, "_fuselm_mlp", None)
    names = [*facts.projections, facts.output]
    modules = [getattr(attention, name) for name in names]
    if spec is not None:
        names += [*spec.inputs, spec.output]
        modules += [getattr(mlp, name) for name in (*spec.inputs, spec.output)]
    return [name for name, module in zip(names, modules) if plain_linear(module) is None]


def _queries(layer: nn.Module, facts: AttentionFacts, hidden: Tensor, cos: Tensor, sin: Tensor, cache,
             index: int, normed: bool = False, last_only: bool = False) -> Tensor:
    """q [B, Hq, T, D] of the new tokens, their k and v written into the cache: one fused kernel when it can.
    ``normed``: hidden is the input norm's output already (else the norm runs here, in the kernel's prologue).
    ``last_only``: q [B, Hq, 1, D] of each row's last token alone (every token's k and v are still written)."""
    attention = layer.self_attn
    k_cache, v_cache = cache.buffers(index)
    projections = [plain_linear(getattr(attention, name)) for name in facts.projections]
    norm = None if normed else _norm_args(layer.input_layernorm)
    head_norms = ((_norm_args(attention.q_norm), _norm_args(attention.k_norm)) if facts.qk_norm == "head"
                  else (None, None))
    fused = (None not in projections and facts.qk_norm in (None, "head")
             and (facts.qk_norm is None or None not in head_norms)
             and all(weight.dtype == hidden.dtype for weight, _ in projections))
    if fused:
        (q_weight, q_bias), *rest = projections
        (k_weight, k_bias), (v_weight, v_bias) = rest if rest else ((None, None), (None, None))
        norm_weight, eps, casting, offset = norm if norm is not None else (None, 0.0, "llama", 0.0)
        if norm is None and not normed:
            hidden = layer.input_layernorm(hidden)
        q_norm, k_norm = head_norms
        if q_norm is not None:
            casting, offset = q_norm[2], q_norm[3]  # the same class as the layer norms: the same arithmetic
        return qkv_rope(hidden, norm_weight, eps, q_weight, k_weight, v_weight, cos, sin, k_cache, v_cache,
                        cache.slots(index), num_heads=facts.num_heads, num_kv_heads=facts.num_kv_heads,
                        q_bias=q_bias, k_bias=k_bias, v_bias=v_bias,
                        q_norm_weight=None if q_norm is None else q_norm[0],
                        k_norm_weight=None if k_norm is None else k_norm[0],
                        qk_norm_eps=None if q_norm is None else q_norm[1], casting=casting, offset=offset,
                        last_only=last_only)
    batch, seq_len, _ = hidden.shape
    if not normed:
        hidden = layer.input_layernorm(hidden)
    head_dim, q_width, kv_width = facts.head_dim, facts.num_heads * facts.head_dim, facts.num_kv_heads * facts.head_dim
    if len(facts.projections) == 1:
        q, k, v = getattr(attention, facts.projections[0])(hidden).split([q_width, kv_width, kv_width], dim=-1)
    else:
        q, k, v = (getattr(attention, name)(hidden) for name in facts.projections)
    if facts.qk_norm == "projection":
        q, k = attention.q_norm(q), attention.k_norm(k)
    q, k, v = (t.reshape(batch, seq_len, -1, head_dim) for t in (q, k, v))
    if facts.qk_norm == "head":
        q, k = attention.q_norm(q), attention.k_norm(k)
    q, k = rope(q, k, cos, sin, layout="bshd")
    cache.layers[index].update(k.transpose(1, 2), v.transpose(1, 2))
    return q[:, -1:].transpose(1, 2) if last_only else q.transpose(1, 2)


def _project(module: nn.Module, x: Tensor, residual: Tensor | None) -> Tensor:
    """``residual + module(x)`` (or ``module(x)``), through one fused kernel when the module is a plain linear."""
    weights = plain_linear(module)
    if weights is not None and residual is not None and weights[0].dtype == x.dtype:
        weight, bias = weights
        return linear_residual(x, weight, residual, bias)
    out = module(x)
    return out if residual is None else residual + out


def _mlp_hidden(layer: nn.Module, x: Tensor, norm: nn.Module | None) -> Tensor | None:
    """act(gate(norm(x))) * up(norm(x)) for the MLP's down projection (norm None: x is already normed), or None
    when the gate/up projections are not plain linears (then the caller runs the MLP module)."""
    mlp = layer.mlp
    spec = mlp._fuselm_mlp if isinstance(mlp, FusedGatedMLP) and not hooked(mlp) else None
    if spec is None:
        return None
    weights = [plain_linear(getattr(mlp, name)) for name in spec.inputs]
    if None in weights or any(w.dtype != x.dtype or b is not None for w, b in weights):
        return None
    norm_args = None if norm is None else _norm_args(norm)
    if norm is not None and norm_args is None:
        x, norm = norm(x), None
    norm_weight, eps, casting, offset = norm_args if norm_args is not None else (None, 0.0, "llama", 0.0)
    up_weight = weights[1][0] if len(weights) == 2 else None
    return norm_gated_linear(x, norm_weight, eps, weights[0][0], up_weight, activation=spec.activation,
                             casting=casting, offset=offset)


def decode_step(layer: nn.Module, hidden: Tensor, cos: Tensor, sin: Tensor, cache, position_ids: Tensor | None,
                facts: AttentionFacts) -> Tensor:
    """One fused decoder layer over ``cache``: hidden [B, T, hidden] (the residual stream) -> the new stream.

    cos, sin: [1 or B, T, rotary dim], the layer's rotary embedding of the new tokens; position_ids: [1 or B, T]
    (used by the layer of index 0 to open the step; None keeps the cache's planned starts).
    """
    index = layer.self_attn.layer_idx
    batch, seq_len, _ = hidden.shape
    if index == 0:
        cache.open_step(seq_len, position_ids)
    q = _queries(layer, facts, hidden, cos, sin, cache, index)
    k_cache, v_cache = cache.buffers(index)
    starts, ends = cache.lengths(index)
    attended = decode_attention(q, k_cache, v_cache, starts, ends, scale=facts.scaling,
                                softcap=facts.softcap or 0.0, window=facts.sliding_window or 0)
    attended = attended.transpose(1, 2).reshape(batch, seq_len, -1)
    attention, mlp, spec = layer.self_attn, layer.mlp, layer._fuselm_layer
    if spec.sandwich_norms:
        branch = layer.post_attention_layernorm(_project(getattr(attention, facts.output), attended, None))
        mlp_in, residual = add_then_norm(layer.pre_feedforward_layernorm, branch, hidden)
        gated = _mlp_hidden(layer, mlp_in, None)
        out = mlp(mlp_in) if gated is None else _project(getattr(mlp, mlp._fuselm_mlp.output), gated, None)
        return residual + layer.post_feedforward_layernorm(out)
    residual = _project(getattr(attention, facts.output), attended, hidden)
    gated = _mlp_hidden(layer, residual, layer.post_attention_layernorm)
    if gated is None:
        return residual + mlp(layer.post_attention_layernorm(residual))
    return _project(getattr(mlp, mlp._fuselm_mlp.output), gated, residual)


def prefill_attention(layer: nn.Module, normed: Tensor, cos: Tensor, sin: Tensor, cache,
                      position_ids: Tensor | None, facts: AttentionFacts, attention_mask: Tensor | None,
                      last_only: bool = False) -> Tensor:
    """The attention block of a fused decoder layer's forward of T tokens into an empty ``cache`` (the prefill):
    normed [B, T, hidden] (the input norm's output) -> o_proj(attention) [B, T, hidden], or [B, 1, hidden] for the
    last position alone when ``last_only``.

    q/k/v as :func:`decode_step` computes them (at this M: cuBLAS GEMMs and one epilogue kernel that writes q and
    the cache's slots 0 .. T - 1), then HF's ``sdpa`` attention function over those slots, with the mask HF built
    for this layer (attention_mask: [B, 1, T, T], sized by the cache's ``get_mask_sizes``, or None: causal, no
    padding), so is_causal, GQA and the mask are handled as for HF's own attention; then the o projection module.
    With ``last_only`` q is projected for the last position alone (every position's k and v are still written)
    and attends with the mask's last row (with no mask, a single query is not causal in HF's function and sees
    every slot, as the causal mask's last row does); o projects that row alone.
    """
    attention = layer.self_attn
    index = attention.layer_idx
    batch, seq_len, _ = normed.shape
    if index == 0:
        cache.open_step(seq_len, position_ids)
    q = _queries(layer, facts, normed, cos, sin, cache, index, normed=True, last_only=last_only)
    if last_only and attention_mask is not None:
        attention_mask = attention_mask[..., -1:, :]
    k_cache, v_cache = cache.buffers(index)
    attended, _ = sdpa_attention_forward(attention, q, k_cache[:, :, :seq_len], v_cache[:, :, :seq_len],
                                         attention_mask, dropout=0.0, scaling=facts.scaling)
    return getattr(attention, facts.output)(attended.reshape(batch, q.shape[2], -1))
