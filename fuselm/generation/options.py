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
from dataclasses import dataclass

import torch
from torch import Tensor
from transformers import GenerationConfig

# Fields the loop reads. HF fills the unset ones with GenerationConfig._get_default_generation_params().
_DEFAULTS = {"max_length": 20, "min_length": 0, "do_sample": False, "temperature": 1.0, "top_k": 50, "top_p": 1.0,
             "repetition_penalty": 1.0, "output_scores": False, "output_logits": False,
             "return_dict_in_generate": False}
_READ = {*_DEFAULTS, "max_new_tokens", "min_new_tokens", "eos_token_id", "pad_token_id", "use_cache"}
# Fields that do not change what greedy decoding or sampling computes.
_INERT = {"bos_token_id", "decoder_start_token_id", "transformers_version", "_from_model_config", "compile_config",
          "disable_compile", "cache_config", "max_cache_len", "early_stopping", "length_penalty", "low_memory",
          "num_assistant_tokens", "num_assistant_tokens_schedule", "assistant_confidence_threshold",
          "assistant_lookbehind", "target_lookbehind", "assistant_early_exit", "assistant_ensemble_weight",
          "max_matching_ngram_size", "is_assistant", "num_beam_groups", "diversity_penalty"}
# Keyword arguments of ``generate`` that are not GenerationConfig fields, with the values that change nothing.
_CALL_ARGUMENTS = ("logits_processor", "stopping_criteria", "prefix_allowed_tokens_fn", "assistant_model",
                   "negative_prompt_ids", "negative_prompt_attention_mask", "custom_generate", "synced_gpus",
                   "assistant_tokenizer", "tokenizer")


@dataclass(frozen=True)
class DecodeOptions:
    """One call's decoding, as the loop runs it. Token ids are Python ints; ``eos`` may be empty."""

    max_new_tokens: int
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


def _token_ids(value: object, name: str) -> tuple[int, ...]:
    if value is None:
        return ()
    if isinstance(value, Tensor):
        value = value.flatten().tolist()
    values = [value] if isinstance(value, int) else list(value)
    if not all(isinstance(v, int) and not isinstance(v, bool) and v >= 0 for v in values):
        raise ValueError(f"{name} must be a token id or a list of token ids, got {value!r}")
    return tuple(values)


def read_options(model: torch.nn.Module, prompt_length: int, generation_config: GenerationConfig | None,
                 kwargs: dict) -> DecodeOptions | str:
    """The call's :class:`DecodeOptions`, or a one-line reason fuselm's loop cannot run it.

    ``kwargs``: ``generate``'s keyword arguments other than input_ids, attention_mask, generation_config and
    streamer (GenerationConfig fields, or model inputs). Raises ValueError for a bad max/min length.
    """
    for name in _CALL_ARGUMENTS:
        if kwargs.get(name) not in (None, False, [], ()):
            return f"{name} is not supported by fuselm's decode loop"
    kwargs = {k: v for k, v in kwargs.items() if k not in _CALL_ARGUMENTS}
    base = generation_config if generation_config is not None else getattr(model, "generation_config", None)
    # a shallow copy: ``update`` only sets attributes on it (a deep copy of the model's config costs ~0.1 ms of the
    # first token's host time on every call)
    config = copy.copy(base) if base is not None else GenerationConfig()
    model_inputs = config.update(**kwargs)
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
    if values.get("use_cache") is False:
        return "use_cache=False"

    read = {name: defaults[name] if values.get(name) is None else values[name] for name in _DEFAULTS}
    max_new = values.get("max_new_tokens")
    if max_new is None:
        max_new = read["max_length"] - prompt_length
    if isinstance(max_new, bool) or not isinstance(max_new, int):
        raise TypeError(f"max_new_tokens must be an int, got {type(max_new).__name__}")
    if max_new < 0:
        raise ValueError(f"max_new_tokens must be >= 0, got {max_new} (max_length {read['max_length']} is shorter "
                         f"than the prompt's {prompt_length} tokens)" if values.get("max_new_tokens") is None
                         else f"max_new_tokens must be >= 0, got {max_new}")
    min_new = values.get("min_new_tokens")
    min_new = max(min_new or 0, read["min_length"] - prompt_length)
    eos = _token_ids(values.get("eos_token_id"), "eos_token_id")
    pad = values.get("pad_token_id")
    if isinstance(pad, Tensor):
        pad = int(pad.flatten()[0])
    if pad is None and eos:
        pad = eos[0]  # as HF does, with its warning
    temperature, top_k, top_p = float(read["temperature"]), int(read["top_k"] or 0), float(read["top_p"])
    if read["do_sample"] and not temperature > 0:
        raise ValueError(f"temperature must be > 0 when sampling, got {temperature}")
    if not 0 < top_p <= 1:
        raise ValueError(f"top_p must be in (0, 1], got {top_p}")
    penalty = float(read["repetition_penalty"])
    if not penalty > 0:
        raise ValueError(f"repetition_penalty must be > 0, got {penalty}")
    return DecodeOptions(max_new_tokens=max_new, min_new_tokens=min_new, do_sample=bool(read["do_sample"]),
                         temperature=temperature, top_k=max(top_k, 0), top_p=top_p, repetition_penalty=penalty,
                         eos=eos, pad=pad, output_scores=bool(read["output_scores"]),
                         output_logits=bool(read["output_logits"]), return_dict=bool(read["return_dict_in_generate"]))
