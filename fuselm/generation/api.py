"""``fuselm.generate(model, input_ids, ...)`` and the ``generate`` of a patched causal LM.

Both run :class:`~fuselm.generation.engine.DecodeEngine` when the model and the call allow it, and HF's own
``generate`` otherwise: ``fuselm.generate`` says why in one warning, a patched model's ``generate`` falls back
silently (it is HF's method, with fuselm's loop as a fast path). Nothing is ever computed differently: what the
loop cannot run exactly as HF does goes to HF.
"""

from __future__ import annotations

import warnings
import weakref

import torch
from torch import Tensor, nn

from fuselm.generation.engine import DecodeEngine
from fuselm.generation.options import DecodeOptions, read_options

_ENGINES: weakref.WeakKeyDictionary[nn.Module, DecodeEngine] = weakref.WeakKeyDictionary()
_HF_ARGUMENTS = ("generation_config", "logits_processor", "stopping_criteria", "prefix_allowed_tokens_fn",
                 "synced_gpus", "assistant_model", "streamer", "negative_prompt_ids", "negative_prompt_attention_mask",
                 "custom_generate")


def engine_of(model: nn.Module) -> DecodeEngine:
    """The model's decode engine (its caches and captured graphs), made on first use, freed with the model."""
    engine = _ENGINES.get(model)
    if engine is None:
        engine = _ENGINES[model] = DecodeEngine(model)
    return engine


def _causal_lm(model: nn.Module) -> nn.Module:
    """The transformers causal LM inside ``model`` (a PEFT model's base model, whose LoRA layers stay active)."""
    get_base = getattr(model, "get_base_model", None)
    return get_base() if callable(get_base) and type(model).__module__.startswith("peft") else model


def _check_inputs(input_ids: object, attention_mask: object) -> None:
    if not isinstance(input_ids, Tensor):
        raise TypeError(f"input_ids must be a torch.Tensor, got {type(input_ids).__name__}")
    if input_ids.dim() != 2 or input_ids.dtype.is_floating_point or input_ids.dtype.is_complex \
            or input_ids.dtype == torch.bool:
        raise TypeError(f"input_ids must be a 2-D integer tensor [batch, prompt], got {input_ids.dim()}-D "
                        f"{input_ids.dtype}")
    if input_ids.shape[0] == 0 or input_ids.shape[1] == 0:
        raise ValueError(f"input_ids must have at least one row and one token, got shape {tuple(input_ids.shape)}")
    if attention_mask is not None:
        if not isinstance(attention_mask, Tensor):
            raise TypeError(f"attention_mask must be a torch.Tensor, got {type(attention_mask).__name__}")
        if attention_mask.is_complex():
            raise TypeError(f"attention_mask must be a bool, integer or floating tensor, got {attention_mask.dtype}")
        if attention_mask.shape != input_ids.shape:
            raise ValueError(f"attention_mask must have input_ids' shape {tuple(input_ids.shape)}, got "
                             f"{tuple(attention_mask.shape)}")


def _inferred_mask(input_ids: Tensor, options: DecodeOptions) -> Tensor | None:
    """The attention mask HF's generate makes for a call without one (``_prepare_attention_mask_for_generation``):
    0 at every ``pad_token_id`` of the prompt, when that id is set and is no eos id; None (no padding) otherwise. A
    prompt without the pad id then reads as unpadded."""
    if options.pad is None or options.pad in options.eos:
        return None
    return (input_ids != options.pad).long()


def run_or_reason(model: nn.Module, input_ids: Tensor, attention_mask: Tensor | None, kwargs: dict):
    """(output, None) from fuselm's loop, or (None, reason) when the call must go to HF. ``model`` is patched."""
    streamer = kwargs.pop("streamer", None)
    generation_config = kwargs.pop("generation_config", None)
    if kwargs.get("past_key_values") is not None or kwargs.get("cache") is not None:
        return None, "a cache was passed in"
    kwargs = {k: v for k, v in kwargs.items() if k not in ("past_key_values", "cache")}
    options = read_options(model, input_ids.shape[1], generation_config, kwargs)
    if isinstance(options, str):
        return None, options
    engine = engine_of(model)
    reason = engine.model_reason()
    if reason is not None:
        return None, reason
    if attention_mask is None:
        attention_mask = _inferred_mask(input_ids, options)
    if attention_mask is not None:
        attention_mask = attention_mask.to(input_ids.device)
        attends = attention_mask != 0  # as HF reads any mask (a float one too)
        left_only, all_ones = torch.stack(((attends.int().diff(dim=-1) >= 0).all(),
                                           (attention_mask == 1).all())).tolist()  # one read for both
        if not left_only:
            return None, "attention_mask has padding after a real token (only left padding is supported)"
        if all_ones:  # HF's masks and positions are those of no mask (its sdpa path skips an all-ones one); other
            attention_mask = None  # nonzero values number the positions by the mask's running sum, as HF does
    return engine.run(input_ids, attention_mask, options, streamer), None


def hf_generate(model: nn.Module, *args, **kwargs):
    """The model's own HF ``generate`` (a patched model's original class's), never fuselm's."""
    from fuselm.patching.classes import original_class

    return original_class(type(model)).generate(model, *args, **kwargs)


def generate(model: nn.Module, input_ids: Tensor, attention_mask: Tensor | None = None, **generation_kwargs):
    """``model.generate(input_ids, attention_mask=..., **generation_kwargs)``, through fuselm's decode loop.

    Args:
        model: a transformers causal LM (or a PEFT model around one), patched by ``fuselm.patch`` or not (then it
            is patched for the call and unpatched after).
        input_ids: [B, S] integer token ids, left-padded when rows differ in length.
        attention_mask: [B, S], 1 (or True, or 1.0) at real tokens, 0 at the left padding; None: as HF's, the
            prompt's ``pad_token_id`` tokens are the padding (none when that id is unset or an eos id).
        generation_kwargs: HF's ``generate`` arguments: GenerationConfig fields (``max_new_tokens``,
            ``do_sample``, ``temperature``, ``top_k``, ``top_p``, ``repetition_penalty``, ``eos_token_id``,
            ``pad_token_id``, ``min_new_tokens``, ``output_scores``, ``output_logits``,
            ``return_dict_in_generate``, ...), ``generation_config``, ``streamer``.

    Returns what ``model.generate`` returns: the [B, S + new] token ids, or a ``GenerateDecoderOnlyOutput``
    with ``return_dict_in_generate=True`` (``scores``/``logits`` when asked; ``past_key_values`` is None: the
    cache belongs to fuselm's engine and is reused by the next call).

    On CUDA each decode step is one CUDA-graph replay (captured on the first call per batch bucket, reused
    after), and so is the prefill of an unpadded prompt length the bucket prefilled before (up to 4096 tokens).
    Sampling is seeded by ``torch.manual_seed`` (the same seed gives the same tokens), but draws differ from HF's.
    A call the loop cannot run exactly (beam search, other logits processors or stopping criteria, assisted
    decoding, a model fuselm does not fuse) goes to ``model.generate``, with one warning saying why.
    """
    if not isinstance(model, nn.Module):
        raise TypeError(f"model must be a torch.nn.Module, got {type(model).__name__}")
    _check_inputs(input_ids, attention_mask)
    from fuselm.patching import patch, unpatch
    from fuselm.patching.classes import ORIGINAL

    lm = _causal_lm(model)
    patched_here = not any(ORIGINAL in type(m).__dict__ for m in lm.modules())  # the caller's own patch is kept
    if patched_here:
        patch(lm)
    try:
        output, reason = run_or_reason(lm, input_ids, attention_mask, dict(generation_kwargs))
    finally:
        if patched_here:
            unpatch(lm)
    if reason is None:
        return output
    warnings.warn(f"fuselm.generate: {reason}; running model.generate instead", UserWarning, stacklevel=2)
    call = dict(generation_kwargs)
    if attention_mask is not None:
        call["attention_mask"] = attention_mask
    return model.generate(input_ids, **call) if model is not lm else hf_generate(model, input_ids, **call)


def patched_generate(self: nn.Module, inputs: Tensor | None = None, *args, **kwargs):
    """A patched causal LM's ``generate``: fuselm's loop when the call allows it, else HF's own (silently). Takes
    HF's arguments as HF's signature does: ``generation_config``, ``logits_processor``, ... by position too."""
    positional = dict(zip(_HF_ARGUMENTS, args))
    if (len(args) > len(_HF_ARGUMENTS) or positional.keys() & kwargs.keys()
            or (inputs is not None and kwargs.get("input_ids") is not None)):
        return hf_generate(self, inputs, *args, **kwargs)  # HF raises its TypeError (its ValueError: two prompts)
    input_ids = inputs if inputs is not None else kwargs.get("input_ids")
    attention_mask = kwargs.get("attention_mask")
    loop_kwargs = {k: v for k, v in {**positional, **kwargs}.items() if k not in ("input_ids", "attention_mask")}
    usable = isinstance(input_ids, Tensor) and not any(k in loop_kwargs for k in ("inputs_embeds",))
    if usable:
        try:
            _check_inputs(input_ids, attention_mask)
        except (TypeError, ValueError):
            usable = False  # HF raises its own error for these
    if usable:
        output, reason = run_or_reason(self, input_ids, attention_mask, loop_kwargs)
        if reason is None:
            return output
    return hf_generate(self, inputs, *args, **kwargs)
