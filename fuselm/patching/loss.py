"""The causal-LM training loss through :func:`fuselm.linear_cross_entropy`, for :func:`fuselm.patch`.

A ``*ForCausalLM`` whose ``__class__`` is :func:`fused_causal_lm_class` computes HF's training loss,
``ForCausalLMLoss`` on ``lm_head(hidden)`` (soft-capped for Gemma 2/3), without the [tokens, vocab]
logits. It takes this path when it is given ``labels``, is training (``model.training`` and grad
enabled) and returns a ``ModelOutput``; it then

- runs the decoder ``self.model`` with every argument HF's forward would pass it, untouched;
- slices the last hidden state by ``logits_to_keep`` with HF's own rule;
- shifts the labels as HF does (append ``ignore_index``, drop the first) or takes ``shift_labels``;
- averages over the non-ignored tokens, or sums and divides by ``num_items_in_batch`` when given (the
  Trainer's gradient accumulation); honours an ``ignore_index`` keyword as HF's loss does;
- uses ``lm_head.weight`` as it is, so a weight tied to the embedding gets both gradients, and a
  frozen head (LoRA elsewhere) gets none computed; under autocast, casts like ``nn.Linear`` would;
- returns the family's ``CausalLMOutputWithPast`` with ``logits=None`` and the decoder's cache,
  hidden states and attentions.

An inference call (no labels) whose int ``logits_to_keep`` would slice the last k of T > k positions of
several rows passes those positions to HF's forward as an index tensor instead: the same logits, but
``lm_head`` reads rows gathered contiguous rather than a strided view (:func:`_gathered_positions`).

Anything else runs HF's forward unchanged: no labels, eval mode or no grad (evaluation, ``generate``
and anything else that wants logits), ``return_dict=False``, and every model whose loss this path
cannot honour (:func:`loss_unsupported_reason`: an ``lm_head`` that is not a plain hook-free
``nn.Linear`` -- a PEFT LoRA layer, ``modules_to_save`` wrapper, quantised or sharded linear --, a
replaced ``loss_function``, a family whose forward fuselm has not read). Those reasons are checked on
every call, so an adapter added after patching is honoured, never silently skipped.

A training caller that needs the logits as well (e.g. to log token accuracy) must call the model in
eval mode or without labels: on the fused path they are never computed.
"""

from __future__ import annotations

import dataclasses
import functools
import inspect
import math
import types
from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import Tensor, nn
from transformers.loss.loss_utils import ForCausalLMLoss
from transformers.modeling_outputs import CausalLMOutputWithPast

from fuselm.ops.cross_entropy import linear_cross_entropy
from fuselm.patching.classes import fused_subclass, original_class
from fuselm.patching.families import family_name, family_of
from fuselm.patching.modules import hooked

# The *ForCausalLM.forward of every family in fuselm's table (read in transformers 5.17 - 5.24): decoder ->
# slice by logits_to_keep -> lm_head -> (Gemma 2/3: soft-cap by config.final_logit_softcapping) -> loss_function.
# Every global and attribute name such a forward uses; one more means it computes something else.
_FORWARD_NAMES = frozenset({"model", "last_hidden_state", "slice_logits_to_keep", "isinstance", "int", "slice",
                            "lm_head", "loss_function", "config", "vocab_size", "CausalLMOutputWithPast", "cache",
                            "past_key_values", "hidden_states", "attentions"})
_SOFTCAP_NAMES = frozenset({"final_logit_softcapping", "torch", "tanh"})
# The named parameters such a forward passes to the decoder, besides labels and logits_to_keep.
_DECODER_ARGS = frozenset({"input_ids", "attention_mask", "position_ids", "cache", "past_key_values",
                           "cache_position", "inputs_embeds", "use_cache"})
_OUTPUT_FIELDS = frozenset(field.name for field in dataclasses.fields(CausalLMOutputWithPast))


@dataclasses.dataclass(frozen=True)
class _ForwardSpec:
    """What fuselm read off one HF *ForCausalLM.forward."""

    original: Callable  # the forward, decorators included
    parameters: tuple[str, ...]  # its named parameters after self, in order (each defaults to None,
    logits_to_keep_default: int | Tensor  # but logits_to_keep to this)
    softcaps: bool  # applies config.final_logit_softcapping to the logits
    slice_hidden: Callable[[Tensor, int | Tensor], Tensor]  # its logits_to_keep rule


def _slice_positions(hidden: Tensor, logits_to_keep: int | Tensor) -> Tensor:
    """The logits_to_keep rule of transformers before ``slice_logits_to_keep``: an int keeps the last
    that many positions (0: all), a tensor indexes the sequence dimension. hidden: [batch, seq, H]."""
    positions = slice(-logits_to_keep, None) if isinstance(logits_to_keep, int) else logits_to_keep
    return hidden[:, positions, :]


_SPECS: dict[type, _ForwardSpec | str] = {}


def _read_forward(cls: type) -> _ForwardSpec | str:
    """The spec of ``cls.forward``, or why the fused loss cannot stand in for it."""
    forward = getattr(cls, "forward", None)
    code = inspect.unwrap(forward) if callable(forward) else None
    if not isinstance(code, types.FunctionType):
        return f"{cls.__name__}.forward is not a Python function"
    owner = code.__qualname__.rpartition(".")[0]
    if not owner.endswith("ForCausalLM") or family_name(code) is None:
        return f"{cls.__name__}.forward is {code.__module__}.{code.__qualname__}, not a transformers *ForCausalLM's"
    if family_of(code) is None:
        return f"{cls.__name__}.forward: family {family_name(code)!r} is not in fuselm's table"
    names = set(code.__code__.co_names)
    softcaps = "final_logit_softcapping" in names
    unknown = names - _FORWARD_NAMES - (_SOFTCAP_NAMES if softcaps else set())
    if unknown:
        return f"{owner}.forward also uses {', '.join(sorted(unknown))} (a transformers version fuselm has not read)"
    parameters = list(inspect.signature(code).parameters.values())[1:]
    named = [p for p in parameters if p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY)]
    loss_args = {"labels", "logits_to_keep"}
    unknown = {p.name for p in named} - _DECODER_ARGS - loss_args
    takes_kwargs = bool(parameters) and parameters[-1].kind is inspect.Parameter.VAR_KEYWORD
    none_defaults = all(p.default is None for p in named if p.name != "logits_to_keep")
    if unknown or not takes_kwargs or not none_defaults or not loss_args <= {p.name for p in named}:
        return f"{owner}.forward takes {inspect.signature(code)}, not what fuselm has read"
    slicer = code.__globals__.get("slice_logits_to_keep") if "slice_logits_to_keep" in names else _slice_positions
    keep_default = next(p.default for p in named if p.name == "logits_to_keep")
    return _ForwardSpec(forward, tuple(p.name for p in named), keep_default, softcaps, slicer)


def _spec(cls: type) -> _ForwardSpec | str:
    cls = original_class(cls)
    if cls not in _SPECS:
        _SPECS[cls] = _read_forward(cls)
    return _SPECS[cls]


def loss_unsupported_reason(model: nn.Module) -> str | None:
    """None when the model instance's loss can take the fused path, else why not (for the report): its
    class's forward, its lm_head, loss_function and config. A model of a fused class checks its original."""
    if "forward" in vars(model):
        return "forward replaced on the instance (e.g. by an accelerate hook or TRL's fused LM head)"
    return _call_reason(model)


def _call_reason(model: nn.Module) -> str | None:
    """Why this call cannot take the fused path, or None. Not the instance's own forward: a wrapper set
    there (accelerate, TRL) that calls the class's forward still gets the fused loss."""
    spec = _spec(type(model))
    if isinstance(spec, str):
        return spec
    head = getattr(model, "lm_head", None)
    if head is None:
        return "no lm_head"
    if type(head) is not nn.Linear:
        kind = f"{type(head).__module__}.{type(head).__qualname__}"
        return f"lm_head is a {kind}, not a plain torch.nn.Linear (e.g. LoRA, modules_to_save, quantised)"
    if hooked(head):
        return "lm_head has hooks or a replaced forward"
    if any(type(t) not in (nn.Parameter, Tensor) for t in (head.weight, head.bias) if t is not None):
        return f"lm_head's weight is a {type(head.weight).__name__} (sharded or quantised)"
    if not isinstance(getattr(model, "model", None), nn.Module):
        return "no decoder module at model.model"
    config = model.config
    vocab_sizes = {config.vocab_size, getattr(model, "vocab_size", config.vocab_size)}
    if vocab_sizes != {head.out_features}:
        return f"lm_head has {head.out_features} outputs but the vocabulary size is {sorted(vocab_sizes)}"
    if model.loss_function is not ForCausalLMLoss:
        loss_name = getattr(model.loss_function, "__name__", model.loss_function)
        return f"loss_function is {loss_name!r}, not ForCausalLMLoss"
    cap = getattr(config, "final_logit_softcapping", None) if spec.softcaps else None
    if cap is not None and not (isinstance(cap, (int, float)) and 0 < cap < math.inf):
        return f"final_logit_softcapping={cap!r} is not a positive finite number"
    return None


def _bind(spec: _ForwardSpec, args: tuple, kwargs: dict) -> dict | None:
    """The arguments the caller gave, by name (None if the call is malformed: HF's forward then raises
    its own error). Omitted ones are left out, so the decoder sees its own defaults (None, as the
    forward's) and a deprecated name (``past_key_values``) reaches the decoder's own renaming alone."""
    if len(args) > len(spec.parameters) or any(name in kwargs for name in spec.parameters[:len(args)]):
        return None
    return {**dict(zip(spec.parameters, args)), **kwargs}


def _wants_output_object(model: nn.Module, kwargs: dict) -> bool:
    """Whether HF's forward would return a ModelOutput rather than a tuple (its ``return_dict`` rule)."""
    return_dict = kwargs.get("return_dict")
    return bool(getattr(model.config, "return_dict", True) if return_dict is None else return_dict)


def _gathered_positions(model: nn.Module, call: dict, spec: _ForwardSpec) -> Tensor | None:
    """``logits_to_keep`` as an index tensor when it is an int k that would slice the last k of T > k positions
    of a batch of rows, else None. HF's int slice of [B, T, H] is a strided view whose rows lie T * H apart;
    cuBLAS's lm_head over it ran 28x slower than over the same rows gathered (H200, B = 32, T = 512: 7.83 ms
    against 0.28); the index gathers them, the logits are the same. Only for a model on one device with a plain
    head weight: the index is made on the tokens' device, and a model spread by ``device_map`` has its last hidden
    state elsewhere."""
    keep = call.get("logits_to_keep", spec.logits_to_keep_default)
    tokens = call.get("input_ids") if call.get("inputs_embeds") is None else call.get("inputs_embeds")
    if (isinstance(keep, bool) or not isinstance(keep, int) or keep <= 0 or not isinstance(tokens, Tensor)
            or tokens.dim() < 2 or tokens.shape[0] < 2 or tokens.shape[1] <= keep):
        return None
    weight = getattr(getattr(model, "lm_head", None), "weight", None)
    spread = len({str(device) for device in (getattr(model, "hf_device_map", None) or {}).values()}) > 1
    if spread or type(weight) not in (nn.Parameter, Tensor) or weight.device != tokens.device:
        return None  # spread over devices, or a sharded (DTensor) or quantised head: HF's slice as it is
    return torch.arange(tokens.shape[1] - keep, tokens.shape[1], device=tokens.device)


def _fused_forward(model: nn.Module, spec: _ForwardSpec, args: tuple, kwargs: dict):
    call = _bind(spec, args, kwargs)
    if call is not None and call.get("labels") is None:
        positions = _gathered_positions(model, call, spec)
        if positions is not None:
            return spec.original(model, **{**call, "logits_to_keep": positions})
    if (call is None or call.get("labels") is None or not (model.training and torch.is_grad_enabled())
            or not _wants_output_object(model, kwargs) or _call_reason(model) is not None):
        return spec.original(model, *args, **kwargs)
    labels, logits_to_keep = call.pop("labels"), call.pop("logits_to_keep", spec.logits_to_keep_default)
    call.pop("return_dict", None)
    outputs = model.model(**call)  # the loss keywords (num_items_in_batch, ...) go along, as in HF
    hidden = spec.slice_hidden(outputs.last_hidden_state, logits_to_keep)
    cap = model.config.final_logit_softcapping if spec.softcaps else None
    loss = _causal_lm_loss(hidden, model.lm_head, labels, call.get("shift_labels"), call.get("num_items_in_batch"),
                           call.get("ignore_index", -100), None if cap is None else float(cap))
    passed_on = {name: value for name, value in outputs.items() if name in _OUTPUT_FIELDS}
    return CausalLMOutputWithPast(loss=loss, logits=None, **passed_on)


def _causal_lm_loss(hidden: Tensor, head: nn.Linear, labels: Tensor, shift_labels: Tensor | None,
                    num_items_in_batch: int | Tensor | None, ignore_index: int, softcap: float | None) -> Tensor:
    """HF's ForCausalLMLoss of ``head(hidden)`` (soft-capped), fused. hidden: [..., H] with as many
    positions as the labels; labels / shift_labels: integer, any shape. Returns the fp32 0-dim loss."""
    if shift_labels is None:
        shift_labels = F.pad(labels, (0, 1), value=ignore_index)[..., 1:]
    weight, bias = head.weight, head.bias
    device_type = hidden.device.type
    if torch.is_autocast_enabled(device_type):  # as autocast's nn.Linear would compute the logits
        dtype = torch.get_autocast_dtype(device_type)
        hidden, weight = hidden.to(dtype), weight.to(dtype)
        bias = bias.to(dtype) if bias is not None else None
    reduction = "mean" if num_items_in_batch is None else "sum"
    loss = linear_cross_entropy(hidden.reshape(-1, hidden.shape[-1]), weight,
                                shift_labels.reshape(-1).to(hidden.device), bias,
                                ignore_index=ignore_index, reduction=reduction, softcap=softcap)
    if num_items_in_batch is None:
        return loss
    if isinstance(num_items_in_batch, Tensor):
        num_items_in_batch = num_items_in_batch.to(loss.device)
    return loss / num_items_in_batch


def fused_causal_lm_class(original_cls: type) -> type:
    """The subclass of a HF *ForCausalLM class whose forward computes the training loss with
    fuselm.linear_cross_entropy when it can, and otherwise runs the original forward unchanged.

    The subclass has the original's name, module and forward signature (Trainer and PEFT inspect it),
    and records the original for ``fuselm.unpatch``. A fused class given here maps to its original's.
    Raises ValueError for a class whose forward fuselm has not read (:func:`loss_unsupported_reason`).
    """
    original_cls = original_class(original_cls)
    spec = _spec(original_cls)
    if isinstance(spec, str):
        raise ValueError(f"original_cls {original_cls.__name__}: {spec}")

    def make_forward():
        @functools.wraps(spec.original)
        def forward(self, *args, **kwargs):
            return _fused_forward(self, spec, args, kwargs)

        return forward

    from fuselm.generation.api import patched_generate

    return fused_subclass(original_cls, make_forward=make_forward, rebuild=(fused_causal_lm_class, (original_cls,)),
                          _fuselm_loss=spec, generate=patched_generate)
