"""The fused forwards that :func:`fuselm.patch` gives a model's modules.

Each is a mixin placed in front of an HF class in a subclass made once per class (see ``classes.py``);
it reads the module's own submodules and parameters, so LoRA layers, quantised linears and PEFT
wrappers keep working. The specs (``_fuselm_norm``, ``_fuselm_mlp``, ``_fuselm_layer``) are class
attributes of those subclasses.

Residual add + RMSNorm at the decoder layer: the add after attention and the norm that follows run
as one ``add_rms_norm``. The add after the MLP and the next layer's input norm do too: layer i
computes both and returns the sum (the true hidden state, which hooks and ``output_hidden_states``
see), *primed* with the normed result for that one norm module; the norm uses it only if it receives
that very tensor unmodified (same object, same version counter), else it computes as usual. Priming
is off under gradient checkpointing (a recomputed layer must save what its first run saved), under
torch.compile and in inference mode (neither has version counters to read); the add after attention
stays fused there.
"""

from __future__ import annotations

import sys
from dataclasses import dataclass

import torch
from torch import Tensor, nn

from fuselm.backend import runs_triton
from fuselm.ops._common import is_dtensor
from fuselm.ops.glu import gelu_tanh_mul, silu_mul
from fuselm.ops.lora import lora_add, lora_add_reference, lora_add_shared, lora_linear, lora_linear_shared
from fuselm.ops.rms_norm import add_rms_norm, rms_norm
from fuselm.ops.rope import rope
from fuselm.patching.quantized import nf4_group_outputs, takes_nf4_group

_PRIMED = "_fuselm_primed"  # on a residual-stream tensor: (norm module, tensor version, normed tensor)
NEXT_NORM = "_fuselm_next_norm"  # in a decoder layer's __dict__: the norm module after it (or None)


def _promoted(a: Tensor, b: Tensor) -> tuple[Tensor, Tensor]:
    """a and b in their common dtype, as PyTorch promotes ``a + b`` (e.g. a bf16 branch, an fp32 residual)."""
    dtype = torch.promote_types(a.dtype, b.dtype)
    return a.to(dtype), b.to(dtype)


def hooked(module: nn.Module) -> bool:
    """Whether a hook watches ``module`` or its forward is replaced on the instance: it must then run as called.
    transformers' output-capturing hooks count only while a forward captures outputs (:func:`_inert`)."""
    return hooked_state(module.__dict__)


def hooked_state(state: dict) -> bool:
    """:func:`hooked` of the module whose ``__dict__`` is ``state`` (a walk over many modules reads it once)."""
    hooks = state["_forward_hooks"]
    return bool((hooks and not all(map(_inert, hooks.values()))) or state["_forward_pre_hooks"]
                or state["_backward_hooks"] or state["_backward_pre_hooks"] or "forward" in state)


# transformers' output-capturing forward hook, by its function's qualified name ("capuring" sic): one forward that
# asks for hidden states or attentions leaves it on every decoder layer and attention module for good
_CAPTURING_HOOK = "install_output_capuring_hook.<locals>.output_capturing_hook"


def _inert(hook) -> bool:
    """Whether ``hook`` is transformers' output-capturing hook while no forward captures outputs: the collector it
    reads (``_active_collector``, in the hook's own module) is then unset or empty, and the hook returns at once."""
    module = getattr(hook, "__module__", None) or ""
    if getattr(hook, "__qualname__", None) != _CAPTURING_HOOK or not module.startswith("transformers."):
        return False
    collector = getattr(sys.modules.get(module), "_active_collector", None)
    return collector is not None and not collector.get()


# ----------------------------------------------------------------------------------- RMSNorm
@dataclass(frozen=True)
class NormSpec:
    eps_attr: str  # "variance_epsilon" (Llama-like) or "eps" (Gemma-like)
    casting: str
    offset: float


class FusedRMSNorm:
    """RMSNorm as ``fuselm.rms_norm`` with the family's casting and offset."""

    _fuselm_norm: NormSpec

    def forward(self, hidden_states: Tensor) -> Tensor:
        """hidden_states: [..., hidden] -> [..., hidden] (dtype as the HF class returns it)."""
        primed = _take_primed(hidden_states, self)
        if primed is not None:
            return primed
        spec = self._fuselm_norm
        return rms_norm(hidden_states, self.weight, getattr(self, spec.eps_attr), spec.offset, spec.casting)

    def add_forward(self, x: Tensor, residual: Tensor) -> tuple[Tensor, Tensor]:
        """(norm(residual + x), residual + x) in one ``add_rms_norm``; x, residual: [..., hidden]."""
        spec = self._fuselm_norm
        x, residual = _promoted(x, residual)
        return add_rms_norm(x, residual, self.weight, getattr(self, spec.eps_attr), spec.offset, spec.casting)


def _fusable(norm: nn.Module) -> bool:
    """Whether ``norm(x + residual)`` may run as ``norm.add_forward``: a fused norm that no hook watches."""
    return isinstance(norm, FusedRMSNorm) and not hooked(norm)


def _take_primed(hidden_states: Tensor, norm: nn.Module) -> Tensor | None:
    if torch.compiler.is_compiling():
        return None
    primed = getattr(hidden_states, _PRIMED, None)
    if primed is None:
        return None
    delattr(hidden_states, _PRIMED)
    owner, version, normed = primed
    return normed if owner is norm and version == hidden_states._version else None


def add_then_norm(norm: nn.Module, x: Tensor, residual: Tensor) -> tuple[Tensor, Tensor]:
    """(norm(residual + x), residual + x): fused when ``norm`` allows it, else as HF computes it."""
    if _fusable(norm):
        return norm.add_forward(x, residual)
    total = residual + x
    return norm(total), total


# ----------------------------------------------------------------------------------- gated MLP
_GATED = {"silu": silu_mul, "gelu_tanh": gelu_tanh_mul}


@dataclass(frozen=True)
class MlpSpec:
    inputs: tuple[str, ...]  # (gate, up) projections, or one packed [gate | up] projection
    output: str
    activation: str  # a key of _GATED


def gated_mlp(mlp: nn.Module, spec: MlpSpec, x: Tensor) -> Tensor:
    """``output(act(gate(x)) * up(x))`` through ``mlp``'s own projections; x: [..., hidden] -> [..., hidden]."""
    gated = _GATED[spec.activation]
    if len(spec.inputs) == 1:
        gate, up = getattr(mlp, spec.inputs[0])(x), None
        hidden = gated(gate)
    else:
        gate, up = shared_projections([getattr(mlp, name) for name in spec.inputs], x)
        hidden = gated(*_promoted(gate, up))
    return down_projection(getattr(mlp, spec.output), hidden, gate, up, spec.activation)


class FusedGatedMLP:
    """The gated MLP with the activation and the product in one fused op (:func:`gated_mlp`)."""

    _fuselm_mlp: MlpSpec

    def forward(self, x: Tensor) -> Tensor:
        return gated_mlp(self, self._fuselm_mlp, x)


# ----------------------------------------------------------------------------------- RoPE
_LAYOUTS = {1: "bhsd", 2: "bshd"}  # HF's unsqueeze_dim -> where the heads axis of q and k is


def _rope_fits(q: Tensor, k: Tensor, cos: Tensor, sin: Tensor, layout: str, partial: bool) -> bool:
    """Whether fuselm.rope computes exactly what HF's apply_rotary_pos_emb would for these tensors."""
    if q.dim() != 4 or k.dim() != 4 or cos.dim() != 3 or sin.shape != cos.shape:
        return False
    if k.dtype != q.dtype or sin.dtype != cos.dtype or not (q.is_floating_point() and cos.is_floating_point()):
        return False
    if k.device != q.device or cos.device != q.device or sin.device != q.device:
        return False
    seq_axis = 2 if layout == "bhsd" else 1
    batch, seq_len, head_dim = q.shape[0], q.shape[seq_axis], q.shape[3]
    if (k.shape[0], k.shape[seq_axis], k.shape[3]) != (batch, seq_len, head_dim):
        return False
    rotary_dim = cos.shape[-1]
    return (cos.shape[0] in (1, batch) and cos.shape[1] == seq_len and rotary_dim % 2 == 0
            and 0 < rotary_dim <= head_dim and (partial or rotary_dim == head_dim))


def fused_apply_rotary_pos_emb(original, partial: bool):
    """A drop-in for an HF ``apply_rotary_pos_emb(q, k, cos, sin, unsqueeze_dim=1)`` running fuselm.rope.

    ``partial``: whether ``original`` rotates only the first cos.shape[-1] dims (Phi-3); if not, calls
    with a narrower cos go to ``original``, as does any call fuselm.rope cannot honour exactly.
    """

    def apply_rotary_pos_emb(q, k, cos, sin, unsqueeze_dim=1):
        layout = _LAYOUTS.get(unsqueeze_dim)
        if layout is None or not _rope_fits(q, k, cos, sin, layout, partial):
            return original(q, k, cos, sin, unsqueeze_dim)
        work = torch.promote_types(q.dtype, cos.dtype)  # HF's q * cos promotes (fp32 cos under autocast)
        return rope(q.to(work), k.to(work), cos, sin, layout=layout)

    return apply_rotary_pos_emb


# ----------------------------------------------------------------------------------- decoder layer
@dataclass(frozen=True)
class LayerSpec:
    positional: tuple[str, ...]  # the HF forward's parameters after hidden_states, to name positional args
    attention_defaults: tuple[tuple[str, object], ...]  # HF's layer defaults for what self_attn requires
    sandwich_norms: bool
    residual_dropouts: tuple[str, str] | None


class FusedDecoderLayer:
    """The pre-norm decoder layer with each residual add fused into the RMSNorm that follows it.

    Everything but hidden_states goes to ``self_attn`` unchanged (so both ``past_key_values`` and
    ``cache`` pass through), plus the HF layer's defaults for the arguments ``self_attn`` requires; the
    return value is the new residual stream, as HF's layer returns it.
    """

    _fuselm_layer: LayerSpec

    def forward(self, hidden_states: Tensor, *args, **kwargs) -> Tensor:
        """hidden_states: [batch, seq, hidden] -> [batch, seq, hidden]."""
        spec = self._fuselm_layer
        kwargs.update(zip(spec.positional, args))
        phase, facts = self._fused_phase(hidden_states, kwargs)
        if phase == "decode":
            from fuselm.patching.decode import decode_step

            cos, sin = kwargs["position_embeddings"]
            return decode_step(self, hidden_states, cos, sin, _cache_of(kwargs), kwargs.get("position_ids"), facts)
        for name, default in spec.attention_defaults:
            kwargs.setdefault(name, default)
        residual = hidden_states
        normed = self.input_layernorm(hidden_states)
        last_only = self._last_position_only(kwargs)
        if phase == "prefill":
            from fuselm.patching.decode import prefill_attention

            cos, sin = kwargs["position_embeddings"]
            attn_out = prefill_attention(self, normed, cos, sin, _cache_of(kwargs), kwargs.get("position_ids"), facts,
                                         kwargs.get("attention_mask"), last_only=last_only)
        else:
            attn_out = self.self_attn(hidden_states=normed, **kwargs)[0]
        if last_only:  # the caller reads the last position alone: the rest of the layer runs for it only
            attn_out, residual = attn_out[:, -1:], residual[:, -1:]
        if spec.sandwich_norms:
            attn_out = self.post_attention_layernorm(attn_out)
            mlp_norm = self.pre_feedforward_layernorm
        else:
            mlp_norm = self.post_attention_layernorm
        mlp_in, residual = add_then_norm(mlp_norm, self._residual_branch(attn_out, 0), residual)
        mlp_out = self.mlp(mlp_in)
        if spec.sandwich_norms:
            mlp_out = self.post_feedforward_layernorm(mlp_out)
        return self._add_and_prime(self._residual_branch(mlp_out, 1), residual)

    def _fused_phase(self, hidden_states: Tensor, kwargs: dict):
        """("decode" or "prefill", the layer's attention facts) when this call runs as fused kernels over fuselm's
        KV cache (``decode.py``), else (None, None). Both need a FusedKVCache, eval mode, no attention weights asked
        for, a [B, T, hidden] input with its rotary embedding, and no hook on the attention module (which HF's path
        then calls, hooks and all). "decode": at most DECODE_MAX_TOKENS new tokens, a head_dim that
        decode_attention supports, and no attention mask unless the cache was planned (``plan``); "prefill": more
        tokens into an empty cache, in a model whose attention is HF's ``sdpa`` (or fuselm's engine's
        ``CAUSAL_PREFILL``: sdpa with no mask) and does not soft-cap (its SDPA function then attends over the
        cache)."""
        from fuselm.generation.cache import FusedKVCache
        from fuselm.ops.attention import HEAD_DIMS
        from fuselm.patching.decode import CAUSAL_PREFILL, DECODE_MAX_TOKENS, layer_facts

        cache = _cache_of(kwargs)
        if (not isinstance(cache, FusedKVCache) or self.training or hidden_states.dim() != 3
                or kwargs.get("output_attentions") or not isinstance(kwargs.get("position_embeddings"), tuple)
                or hooked(self.self_attn)):
            return None, None
        facts = layer_facts(self)
        if facts is None:
            return None, None
        if hidden_states.shape[1] <= DECODE_MAX_TOKENS:
            # a mask over a cache never planned may mask out padding that the positions do not show (a forward given
            # no position ids numbers it): HF's path reads the mask. plan() said where the padding is (or that there
            # is none)
            masked_unplanned = kwargs.get("attention_mask") is not None and not cache.planned
            return ("decode", facts) if facts.head_dim in HEAD_DIMS and not masked_unplanned else (None, None)
        implementation = getattr(getattr(self.self_attn, "config", None), "_attn_implementation", None)
        if (implementation in ("sdpa", CAUSAL_PREFILL) and facts.softcap is None
                and cache.starts_empty(self.self_attn.layer_idx)):
            return "prefill", facts
        return None, None

    def _last_position_only(self, kwargs: dict) -> bool:
        """Whether this is the last decoder layer of a forward over a FusedKVCache whose ``last_position_only`` is
        set (fuselm's engine reads only each row's last logits): its keys and values are still written for every
        position, and its output is [B, 1, hidden]. Checked after the decode phase, which keeps its T rows."""
        cache = _cache_of(kwargs)
        return (getattr(cache, "last_position_only", False) is True
                and getattr(self.self_attn, "layer_idx", None) == len(cache.layers) - 1)

    def _residual_branch(self, branch: Tensor, index: int) -> Tensor:
        dropouts = self._fuselm_layer.residual_dropouts
        return getattr(self, dropouts[index])(branch) if dropouts else branch

    def _add_and_prime(self, branch: Tensor, residual: Tensor) -> Tensor:
        """residual + branch, primed with the next norm's output when that norm can take it."""
        if (torch.compiler.is_compiling() or torch.is_inference_mode_enabled()  # no version counters there
                or (getattr(self, "gradient_checkpointing", False) and self.training)):
            return residual + branch
        norm = self.__dict__.get(NEXT_NORM)
        # The next layer's norm may be out of reach: on the next GPU (device_map; the hook moves the stream there and
        # drops what was primed), or still sharded (FSDP2 gathers a layer's weights only when the layer runs).
        if (not isinstance(norm, FusedRMSNorm) or type(norm.weight) not in (nn.Parameter, Tensor)
                or norm.weight.device != residual.device):
            return residual + branch
        normed, total = norm.add_forward(branch, residual)
        setattr(total, _PRIMED, (norm, total._version, normed))
        return total


def _cache_of(kwargs: dict):
    """The cache a decoder layer was given (transformers >= 5.24 names it ``cache``, earlier ``past_key_values``)."""
    cache = kwargs.get("cache")
    return kwargs.get("past_key_values") if cache is None else cache


# ----------------------------------------------------------------------------------- LoRA
def lora_call_args(layer: nn.Module, x: Tensor) -> tuple[Tensor, Tensor, float] | None:
    """(A, B, scaling) when this call of the PEFT LoRA ``layer`` may run as ``lora_add(x, base_layer(x), A, B,
    scaling)``, else None (PEFT's own forward runs).

    Decided per call, as PEFT decides: one active, unmerged adapter, adapters enabled, plain LoRA (no DoRA or other
    variant, no lora_bias), its dropout inactive (p = 0, or eval mode), no hook on the adapter's submodules (the
    fused path does not call them), a Python number as scaling, the fused path on for x (``fuselm.backend``), and
    autocast off or casting to x's own dtype (then the fused path's arithmetic is autocast's).
    """
    if layer.disable_adapters or layer.merged or not x.is_floating_point() or not runs_triton(x):
        return None
    names = [name for name in layer.active_adapters if name in layer.lora_A]
    if len(names) != 1:
        return None
    name = names[0]
    lora_a, lora_b, dropout = layer.lora_A[name], layer.lora_B[name], layer.lora_dropout[name]
    if (name in getattr(layer, "lora_variant", {}) or layer.use_dora.get(name) or lora_b.bias is not None
            or (dropout.training and getattr(dropout, "p", 0.0) > 0) or hooked(lora_a) or hooked(lora_b)):
        return None
    device = x.device.type
    scaling = layer.scaling[name]
    if (torch.is_autocast_enabled(device) and torch.get_autocast_dtype(device) != x.dtype) or isinstance(
            scaling, bool) or not isinstance(scaling, (int, float)):
        return None
    return lora_a.weight, lora_b.weight, scaling


class FusedLoraLinear:
    """A PEFT LoRA layer whose adapter branch runs as ``fuselm.lora_add`` (see ``fuselm/ops/lora.py``): the base
    layer's own forward (``nn.Linear``, ...; bitsandbytes 4-bit bases of one input as one dequantised weight and one
    GEMM, ``quantized.py``), then the branch on tensor cores in x's dtype, with no fp32 copy of x. Calls that
    :func:`lora_call_args` refuses run PEFT's forward.

    q/k/v share one read of x: the first fused one of an attention's q/k/v projections (which HF calls first)
    holds the others (:data:`SHARES_INPUT_WITH`, linked by ``patch``), computes all their outputs in one
    ``lora_add_shared`` and leaves theirs on x, *primed* as the residual stream is for the norms (module docstring):
    each takes its output only if it receives that very tensor unmodified; priming is off under torch.compile and
    in inference mode.
    """

    def forward(self, x: Tensor, *args, **kwargs) -> Tensor:
        if args or kwargs:
            return super().forward(x, *args, **kwargs)
        primed = _take_primed_output(x, self)
        if primed is not None:
            return primed
        adapter = lora_call_args(self, x)
        if adapter is None:
            return super().forward(x)
        siblings = self.__dict__.get(SHARES_INPUT_WITH)
        if siblings and _can_prime(x):
            adapters = _fused_adapters(siblings, x)
            if adapters is not None:
                own, *others = _lora_outputs([self, *siblings], [adapter, *adapters], x)
                setattr(x, _PRIMED_OUTPUTS, (x._version, dict(zip(siblings, others))))
                return own
        return _lora_outputs([self], [adapter], x)[0]


SHARES_INPUT_WITH = "_fuselm_shares_input_with"  # in a fused LoRA q_proj's __dict__: the k/v layers it computes too
_PRIMED_OUTPUTS = "_fuselm_primed_outputs"  # on an attention's input: (version, {LoRA layer: its output})


def _can_prime(x: Tensor) -> bool:
    return not (torch.compiler.is_compiling() or torch.is_inference_mode_enabled() or x.is_inference())


def _take_primed_output(x: Tensor, layer: nn.Module) -> Tensor | None:
    if not _can_prime(x):
        return None
    primed = getattr(x, _PRIMED_OUTPUTS, None)
    if primed is None:
        return None
    version, outputs = primed
    output = outputs.pop(layer, None)
    if not outputs:
        delattr(x, _PRIMED_OUTPUTS)
    return output if version == x._version else None


def _fused_adapters(layers: list[nn.Module], x: Tensor) -> list[tuple[Tensor, Tensor, float]] | None:
    """Each layer's :func:`lora_call_args` when all are fused LoRA layers no hook watches that may fuse this call."""
    adapters = [lora_call_args(layer, x) if isinstance(layer, FusedLoraLinear) and not hooked(layer) else None
                for layer in layers]
    return None if None in adapters else adapters


def _base_outputs(layers: list[nn.Module], x: Tensor) -> list[Tensor]:
    """The LoRA layers' base layers' outputs for x: bitsandbytes 4-bit bases of one input in one autograd node
    (``quantized.py``) where bitsandbytes' own call would compute the same, else each base layer's own call."""
    bases = [layer.base_layer for layer in layers]
    if all(takes_nf4_group(base, x) and not hooked(base) for base in bases):
        return nf4_group_outputs(bases, x)
    return [base(x) for base in bases]


def _frozen_linear(base: nn.Module, x: Tensor) -> bool:
    """Whether ``base`` is a plain ``nn.Linear`` that ``lora_linear`` may compute instead of calling it: no hook, a
    frozen weight (and bias) in x's dtype, plain tensors (not an FSDP2 shard)."""
    weight, bias = base.weight, base.bias
    return (type(base) is nn.Linear and not hooked(base) and not weight.requires_grad and weight.dtype == x.dtype
            and not is_dtensor(weight) and (bias is None or (not bias.requires_grad and bias.dtype == x.dtype)))


def _lora_outputs(layers: list[nn.Module], adapters: list[tuple[Tensor, Tensor, float]], x: Tensor) -> list[Tensor]:
    """The layers' outputs for x: frozen ``nn.Linear`` bases and their branches in one ``lora_linear_shared`` (whose
    backward sums x's gradient in one buffer), else their base layers' outputs plus their branches in one
    ``lora_add_shared``."""
    lora_as, lora_bs, scalings = zip(*adapters)
    bases = [layer.base_layer for layer in layers]
    if all(_frozen_linear(base, x) for base in bases):
        return lora_linear_shared(x, [base.weight for base in bases], [base.bias for base in bases], lora_as,
                                  lora_bs, scalings)
    base_outs = _base_outputs(layers, x)
    if any(out.dtype != x.dtype for out in base_outs):  # a base layer that returns another dtype: PEFT's arithmetic
        return [lora_add_reference(x, out, *adapter) for out, adapter in zip(base_outs, adapters)]
    return lora_add_shared(x, base_outs, lora_as, lora_bs, scalings)


def shared_projections(layers: list[nn.Module], x: Tensor) -> list[Tensor]:
    """``[layer(x) for layer in layers]``, with one read of x for all LoRA branches when every layer is a fused LoRA
    layer no hook watches and every call may take the fused path; else each layer is called."""
    adapters = _fused_adapters(layers, x)
    return [layer(x) for layer in layers] if adapters is None else _lora_outputs(layers, adapters, x)


def down_projection(layer: nn.Module, hidden: Tensor, gate: Tensor, up: Tensor | None, activation: str) -> Tensor:
    """``layer(hidden)`` for hidden = act(gate) * up (up None: gate packed); a fused LoRA layer's branch keeps gate
    and up for backward, not hidden (see ``lora_add``'s ``glu_inputs``)."""
    adapter = lora_call_args(layer, hidden) if isinstance(layer, FusedLoraLinear) and not hooked(layer) else None
    if adapter is None or hidden.dtype != gate.dtype or (up is not None and up.dtype != gate.dtype):
        return layer(hidden)
    if _frozen_linear(layer.base_layer, hidden):
        base = layer.base_layer
        return lora_linear(hidden, base.weight, base.bias, *adapter, glu_inputs=(gate, up, activation))
    (base_out,) = _base_outputs([layer], hidden)
    if base_out.dtype != hidden.dtype:
        return lora_add_reference(hidden, base_out, *adapter)
    return lora_add(hidden, base_out, *adapter, glu_inputs=(gate, up, activation))
