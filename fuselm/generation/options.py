"""What a ``generate`` call asks for, read into the options fuselm's decode loop runs, or the reason it cannot.

fuselm's loop runs greedy decoding and sampling (temperature, top-k, top-p), repetition penalty, eos and
``pad_token_id`` per row, ``max_new_tokens``/``max_length``, ``min_new_tokens``/``min_length``, a streamer,
and ``output_scores``/``output_logits``/``return_dict_in_generate``. Anything else that changes what HF's
``generate`` computes (beam search, other logits processors or stopping criteria, assisted decoding, a cache of
the caller's, model inputs other than ``input_ids`` and ``attention_mask``) is a reason to hand the call to HF.
"""

from __future__ import annotations

import copy
import functools
import numbers
import operator
from dataclasses import dataclass

import torch
from transformers import GenerationConfig

# Fields the loop reads. HF fills the unset ones with GenerationConfig._get_default_generation_params().
_DEFAULTS = {"max_length": 20, "min_length": 0, "do_sample": False, "temperature": 1.0, "top_k": 50, "top_p": 1.0,
             "repetition_penalty": 1.0, "output_scores": False, "output_logits": False,
             "return_dict_in_generate": False}
_READ = {*_DEFAULTS, "max_new_tokens", "min_new_tokens", "eos_token_id", "pad_token_id", "use_cache"}
# Fields that do not change what greedy decoding or sampling computes.
# (is_assistant adds a stopping criterion, assistant_early_exit asks for assisted decoding: neither is inert)
_INERT = {"bos_token_id", "decoder_start_token_id", "transformers_version", "_from_model_config", "compile_config",
          "disable_compile", "cache_config", "max_cache_len", "early_stopping", "length_penalty", "low_memory",
          "num_assistant_tokens", "num_assistant_tokens_schedule", "assistant_confidence_threshold",
          "assistant_lookbehind", "target_lookbehind", "assistant_ensemble_weight", "max_matching_ngram_size",
          "num_beam_groups", "diversity_penalty"}
# Keyword arguments of ``generate`` that are not GenerationConfig fields, with the values that change nothing.
_CALL_ARGUMENTS = ("logits_processor", "stopping_criteria", "prefix_allowed_tokens_fn", "assistant_model",
                   "negative_prompt_ids", "negative_prompt_attention_mask", "custom_generate", "synced_gpus",
                   "assistant_tokenizer", "tokenizer")


@dataclass(frozen=True)
class DecodeOptions:
    """One call's decoding, as the loop runs it. Token ids are Python ints; ``eos`` may be empty."""

    max_new_tokens: int  # >= 1
    min_new_tokens: int
    do_sample: bool
    temperature: float
    top_k: int  # 0: no top-k filter
    top_p: float  # 1.0: no top-p filter
    repetition_penalty: float  # 1.0: none
    eos: tuple[int, ...]
    pad: int | None
    output_scores: bool
    output_logits: bool
    return_dict: bool

    @property
    def mode(self) -> tuple:
        """What the captured step's code depends on (the values live in device tensors)."""
        return (self.do_sample, self.top_k if self.do_sample else 0, self.do_sample and self.top_p < 1.0,
                self.repetition_penalty != 1.0, len(self.eos), self.min_new_tokens > 0, self.output_scores,
                self.output_logits)


@functools.cache
def _hf_defaults() -> dict:
    defaults = getattr(GenerationConfig, "_get_default_generation_params", None)
    return {**(defaults() if defaults is not None else {}), **_DEFAULTS}


@functools.cache
def _generation_parameter_names() -> frozenset[str]:
    """The names HF's ``PreTrainedConfig._get_generation_parameters`` looks for on a model's config."""
    defaults = getattr(GenerationConfig, "_get_default_generation_params", None)
    return frozenset(defaults() if defaults is not None else ()) - {"use_cache"}


def _given(value: object) -> bool:
    """Whether a call argument of ``_CALL_ARGUMENTS`` asks for something: neither None, False nor an empty list or
    tuple. Never compares ``value`` (a tensor's ``==`` is elementwise)."""
    return not (value is None or value is False or (isinstance(value, (list, tuple)) and not value))


def _config_reason(model_config: object) -> str | None:
    """Why a call without a generation_config goes to HF: the model's config sets generation parameters, which HF's
    generate refuses (a ValueError naming them). HF's full check (~0.1 ms) runs only when the config's attributes
    hold one of their names."""
    find = getattr(model_config, "_get_generation_parameters", None)
    if find is None or _generation_parameter_names().isdisjoint(vars(model_config)):
        return None
    parameters = find()
    return f"the model's config sets generation parameters {sorted(parameters)}" if parameters else None


def _integer(value: object, name: str) -> int:
    """``value`` as an int: a Python or numpy integer, or an integer tensor of one element (``operator.index``)."""
    if not isinstance(value, bool):
        try:
            return operator.index(value)
        except TypeError:
            pass
    raise TypeError(f"{name} must be an int, got {type(value).__name__}")


def _token_ids(value: object, name: str) -> tuple[int, ...]:
    """``value`` (None, an id, or a list, tuple or tensor of ids) as a tuple of ints."""
    if value is None:
        return ()
    if hasattr(value, "tolist"):  # a tensor, or a numpy integer or array
        value = value.tolist()
    return tuple(_integer(v, name) for v in (value if isinstance(value, (list, tuple)) else [value]))


def _call_config(base: GenerationConfig, generation_config: GenerationConfig | None,
                 kwargs: dict) -> tuple[GenerationConfig, dict]:
    """The call's config as HF's ``_prepare_generation_config`` makes it, and the kwargs that are no field of it:
    ``generation_config`` (else the model's ``base``) with its unset fields taken from ``base``, then from HF's
    defaults, then ``kwargs`` set on it. Shallow copies where HF deep-copies: nothing here changes a field's value in
    place (HF's copies cost ~0.1 ms of the first token's host time on every call)."""
    config = copy.copy(generation_config if generation_config is not None else base)
    for source in (vars(base), _hf_defaults()) if generation_config is not None else (_hf_defaults(),):
        for name, value in source.items():
            if not name.startswith("_") and getattr(config, name, None) is None:
                setattr(config, name, value)
    model_inputs = config.update(**kwargs)
    if config.cache_implementation == "hybrid":  # as HF reads it: Gemma 2/3 configs name it for the default cache
        config.cache_implementation = None
    return config, model_inputs


def _float_length_reason(config: GenerationConfig) -> str | None:
    """Why a call whose length is a float (``max_new_tokens=5.5``) goes to HF: its generate takes one, as its
    stopping criteria compare it with the sequence length; fuselm's loop counts whole tokens. Any other type that is
    no integer stays :func:`_integer`'s TypeError."""
    for name in ("max_new_tokens", "max_length", "min_new_tokens", "min_length"):
        value = getattr(config, name, None)
        if isinstance(value, numbers.Real) and not isinstance(value, numbers.Integral):
            return f"{name}={value!r} is no integer"
    return None


def _max_new_tokens(model: torch.nn.Module, config: GenerationConfig, prompt_length: int,
                    default_max_length: bool) -> int:
    """New tokens at most, as HF's ``_prepare_generated_length`` counts them: ``max_new_tokens``; else up to
    ``max_length`` in all, which, when neither the call nor a config set it, means 20 new tokens (HF's default)
    within the model's ``max_position_embeddings``. Raises ValueError, as HF does, when that leaves none."""
    if config.max_new_tokens is not None:
        max_new = _integer(config.max_new_tokens, "max_new_tokens")
        if max_new <= 0:
            raise ValueError(f"max_new_tokens must be > 0, got {max_new}")
        return max_new
    max_length = _integer(config.max_length, "max_length")
    if default_max_length:
        max_length += prompt_length
        positions = getattr(model.config, "max_position_embeddings", None)
        max_length = max_length if positions is None else min(max_length, positions)
    if max_length <= prompt_length:
        raise ValueError(f"max_length is {max_length}, but input_ids has {prompt_length} tokens: max_length counts "
                         "the prompt (set max_new_tokens instead)")
    return max_length - prompt_length


def _sampling_values(config: GenerationConfig) -> tuple[float, int, float]:
    """(temperature, top_k, top_p) of a sampling call, 1.0, 0 and 1.0 where they filter nothing; checked as HF's
    warpers check them, which ``generate`` makes only for a temperature other than 1, a top_k other than 0 and a
    top_p below 1 (None: no warper)."""
    temperature = 1.0 if config.temperature is None else config.temperature
    if temperature != 1.0 and not (isinstance(temperature, float) and temperature > 0):
        raise ValueError(f"temperature must be a float > 0 when sampling, got {temperature!r}")
    top_k = config.top_k or 0
    if top_k != 0 and not (isinstance(top_k, int) and top_k > 0):
        raise ValueError(f"top_k must be an int > 0 (or 0: no top-k filter) when sampling, got {top_k!r}")
    top_p = 1.0 if config.top_p is None else float(config.top_p)
    if top_p < 0:
        raise ValueError(f"top_p must be >= 0 when sampling, got {top_p}")
    return float(temperature), top_k, min(top_p, 1.0)


def _longrope_reason(model: torch.nn.Module, prompt_length: int, max_new: int) -> str | None:
    """Why a longrope model's call must go to HF: its sequence would first pass ``original_max_position_embeddings``
    during the decode steps, where HF's Phi-3 ``prepare_inputs_for_generation`` drops the cache and computes every
    key again with the long factors (fuselm's cache keeps the short-factor ones). The last step feeds position
    ``prompt_length + max_new - 2``; HF drops the cache when it feeds position ``original_max_position_embeddings``."""
    config = model.config
    limit = getattr(config, "original_max_position_embeddings", None)
    rope = getattr(config, "rope_parameters", None) or {}
    if limit is None or rope.get("rope_type") != "longrope":
        return None
    if not prompt_length <= limit <= prompt_length + max_new - 2:
        return None
    return (f"the sequence passes original_max_position_embeddings ({limit}) while decoding, where HF computes the "
            "cache again with longrope's long factors")


def read_options(model: torch.nn.Module, prompt_length: int, generation_config: GenerationConfig | None,
                 kwargs: dict) -> DecodeOptions | str:
    """The call's :class:`DecodeOptions`, or a one-line reason fuselm's loop cannot run it.

    ``kwargs``: ``generate``'s keyword arguments other than input_ids, attention_mask, generation_config and
    streamer (GenerationConfig fields, or model inputs). Raises TypeError or ValueError for an argument that HF's
    ``generate`` refuses (or that is no integer where one is needed).
    """
    for name in _CALL_ARGUMENTS:
        if _given(kwargs.get(name)):
            return f"{name} is not supported by fuselm's decode loop"
    kwargs = {k: v for k, v in kwargs.items() if k not in _CALL_ARGUMENTS}
    reason = _config_reason(model.config) if generation_config is None else None
    if reason is not None:
        return reason
    base = getattr(model, "generation_config", None)
    base = base if base is not None else GenerationConfig()
    config, model_inputs = _call_config(base, generation_config, kwargs)
    model_inputs.pop("use_cache", None)
    if model_inputs:
        return f"model inputs {sorted(model_inputs)} are not supported by fuselm's decode loop"
    defaults = _hf_defaults()
    # the config's fields, as ``to_dict`` names them (its instance attributes, less HF's private bookkeeping) without
    # its deep copy of every value (~0.1 ms of the first token's host time per call)
    values = {name: value for name, value in vars(config).items() if not name.startswith("_")}
    for name, value in values.items():
        if value is None or value is False or name in _READ or name in _INERT or value == defaults.get(name, None):
            continue
        if name == "cache_implementation" and value in ("dynamic", "static"):
            return f"cache_implementation={value!r} asks for HF's own cache"
        return f"generation option {name}={value!r} is not supported by fuselm's decode loop"
    if config.use_cache is False:
        return "use_cache=False"

    reason = _float_length_reason(config)
    if reason is not None:
        return reason
    # HF's "default max_length": set by neither the call, its generation_config nor the model's
    default_max_length = (kwargs.get("max_length") is None and base.max_length is None
                          and (generation_config is None or generation_config.max_length is None))
    max_new = _max_new_tokens(model, config, prompt_length, default_max_length)
    # min_new_tokens, when set, wins over min_length (as in HF's _prepare_generated_length)
    min_new = (_integer(config.min_new_tokens, "min_new_tokens") if config.min_new_tokens is not None
               else _integer(config.min_length or 0, "min_length") - prompt_length)
    eos = _token_ids(config.eos_token_id, "eos_token_id")
    if any(i < 0 for i in eos):  # HF warns, and runs: such an id never ends a row
        return f"eos_token_id {list(eos)} has a negative id"
    pad = config.pad_token_id
    pad = _integer(pad, "pad_token_id") if pad is not None else eos[0] if eos else None  # eos[0]: as HF does
    do_sample = bool(config.do_sample)
    temperature, top_k, top_p = _sampling_values(config) if do_sample else (1.0, 0, 1.0)  # HF ignores them greedy
    penalty = 1.0 if config.repetition_penalty is None else config.repetition_penalty
    if penalty != 1.0 and not (isinstance(penalty, float) and penalty > 0):  # HF's check
        raise ValueError(f"repetition_penalty must be a float > 0, got {penalty!r}")
    reason = _longrope_reason(model, prompt_length, max_new)
    if reason is not None:
        return reason
    return DecodeOptions(max_new_tokens=max_new, min_new_tokens=max(min_new, 0), do_sample=do_sample,
                         temperature=temperature, top_k=top_k, top_p=top_p, repetition_penalty=float(penalty),
                         eos=eos, pad=pad, output_scores=bool(config.output_scores),
                         output_logits=bool(config.output_logits),
                         return_dict=bool(config.return_dict_in_generate))
