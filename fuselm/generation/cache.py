"""fuselm's KV cache: preallocated, graph-safe, and an HF ``Cache``.

Per layer, one key buffer and one value buffer of shape [B, Hkv, max_cache_len, D], every layer at full length
(sliding-window layers too: attention applies the window, the cache keeps every position). Per row b, the valid
cache positions are ``starts[b] <= slot < ends[b]`` (two int32 [B] device tensors shared by all layers):
``starts`` skips the row's left padding, ``ends`` is one past the last written slot.

Plan/run, as FlashInfer does:

- ``plan(attention_mask)`` once per batch of sequences: sets ``starts`` from the left-padded 2-D mask and empties
  the cache (``ends = 0``), on the device, without reallocating.
- per forward, device-only work: ``advance(T)`` (``ends += T``) once, then each layer writes its T new positions at
  slots ``ends - T .. ends - 1`` and attends over ``[starts, ends)``. HF's attention goes through ``update``, which
  advances on layer 0 and writes with ``index_put_``; fused kernels take ``buffers(layer_idx)`` and ``lengths()``
  and write in place themselves.

A forward into an empty cache (the prefill after ``plan``) attends over its own new keys and values alone: the
layers still write them into the buffers, but hand HF's attention the [B, Hkv, T, D] states with a [T, T] mask
instead of the whole buffers with a [T, max_cache_len] one, so SDPA runs its fastest kernels (fuselm's fused
layers write them from their projections' epilogue and attend over the buffers' first T slots: ``starts_empty``).
The host knows this without asking the device: it counts the positions written since ``plan`` or ``reset``
(every row advances alike).

Nothing in a step reads a length back to the host or has a data-dependent shape, and no tensor is ever
reallocated, so a step can be captured in a CUDA graph and replayed while the lengths change.
"""

from __future__ import annotations

import torch
from torch import Tensor
from transformers import PreTrainedConfig, StaticCache
from transformers.cache_utils import Cache, CacheLayerMixin, get_layer_types_and_kwargs

CACHE_DTYPES = (torch.float32, torch.float16, torch.bfloat16)


def _positive_int(name: str, value: object) -> int:
    if isinstance(value, bool) or not isinstance(value, int):
        raise TypeError(f"{name} must be an int, got {type(value).__name__}")
    if value <= 0:
        raise ValueError(f"{name} must be > 0, got {value}")
    return value


def _config_int(config: PreTrainedConfig, attr: str) -> int | None:
    value = getattr(config, attr, None)
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
        raise ValueError(f"model_or_config: config.{attr} must be a positive int, got {value!r}")
    return value


def head_facts(config: PreTrainedConfig) -> tuple[int, int]:
    """(num_key_value_heads, head_dim) of a decoder (layer's) config, read the way HF's attention modules read them:
    ``head_dim`` or ``hidden_size // num_attention_heads``; ``num_key_value_heads`` or ``num_attention_heads``."""
    heads = _config_int(config, "num_attention_heads")
    if heads is None:
        raise ValueError("model_or_config: the config has no num_attention_heads")
    head_dim = _config_int(config, "head_dim")
    if head_dim is None:
        hidden = _config_int(config, "hidden_size")
        if hidden is None:
            raise ValueError("model_or_config: the config has neither head_dim nor hidden_size")
        if hidden % heads:
            raise ValueError(f"model_or_config: config.hidden_size {hidden} is not a multiple of "
                             f"num_attention_heads {heads}, and the config has no head_dim")
        head_dim = hidden // heads
    kv_heads = _config_int(config, "num_key_value_heads") or heads
    return kv_heads, head_dim


def sliding_windows(config: PreTrainedConfig) -> tuple[int | None, ...]:
    """Per layer, the sliding window of a ``sliding_attention`` layer or None for a ``full_attention`` one.

    transformers' own reading of the config: before 5.24 one kwargs dict shared by every layer, from 5.24 a list
    with one per layer."""
    layer_types, layer_kwargs = get_layer_types_and_kwargs(config)
    unsupported = sorted(set(layer_types) - {"full_attention", "sliding_attention"})
    if unsupported:
        raise ValueError(f"model_or_config: layer types {unsupported} are not supported (full_attention and "
                         "sliding_attention are)")
    if isinstance(layer_kwargs, dict):
        layer_kwargs = [layer_kwargs] * len(layer_types)
    return tuple(kwargs.get("sliding_window") if kind == "sliding_attention" else None
                 for kind, kwargs in zip(layer_types, layer_kwargs, strict=True))


def layer_devices(model: torch.nn.Module, count: int) -> list[torch.device]:
    """Per decoder layer, the device it runs on: where ``device_map="auto"`` (or any manual placement) put it, so
    that its cache buffers sit beside its attention. That is the execution device of accelerate's hook on the layer
    (an offloaded layer's parameters are on the meta device), else the device of its parameters. A model whose
    decoder layers cannot be found, or a layer without either, gets the model's device."""
    layers = getattr(getattr(model, "get_decoder", lambda: None)(), "layers", None)
    if not isinstance(layers, torch.nn.ModuleList) or len(layers) != count:
        return [model.device] * count
    return [_execution_device(layer) or next(layer.parameters(), torch.empty(0, device=model.device)).device
            for layer in layers]


def _execution_device(layer: torch.nn.Module) -> torch.device | None:
    """The execution device of accelerate's hook on ``layer`` (one hook, or one of a SequentialHook's), or None."""
    hook = getattr(layer, "_hf_hook", None)
    for one in getattr(hook, "hooks", (hook,)):
        device = getattr(one, "execution_device", None)
        if device is not None:
            return torch.device(device)
    return None


def layer_configs(config: PreTrainedConfig) -> list[PreTrainedConfig]:
    """One config per decoder layer: transformers >= 5.24's per-layer configs (heterogeneous models), else the
    model's own for every layer."""
    per_layer = getattr(config, "per_layer_config", None)
    return list(per_layer) if per_layer else [config] * config.num_hidden_layers


class HostFill:
    """What the host knows of a cache's fill, shared by its layers: positions written per row since ``plan`` or
    ``reset`` (``filled``; None before either), whether the forward now running started on a cache known to be
    empty (``fresh``), whether ``plan`` was called since the cache was made or reset (``planned``), and whether
    ``starts`` came from an attention mask given to it (``masked``)."""

    def __init__(self):
        self.filled: int | None = None
        self.fresh = False
        self.planned = self.masked = False

    def advance(self, num_tokens: int) -> None:
        self.fresh = self.filled == 0
        self.filled = None if self.filled is None else self.filled + num_tokens

    def clear(self, planned: bool = False, masked: bool = False) -> None:
        self.filled, self.fresh, self.planned, self.masked = 0, False, planned, masked

    def crop(self, num_tokens: int) -> None:
        self.filled = None if self.filled is None else self.filled - num_tokens


class FusedKVLayer(CacheLayerMixin):
    """One layer's key and value buffers, [B, Hkv, max_cache_len, D], writing at the cache's current step.

    ``ends`` is the cache's shared [B] int32 tensor: ``update`` writes its T positions at slots ``ends - T ..
    ends - 1`` of each row, i.e. after the cache has advanced for this step. ``host``: the cache's
    :class:`HostFill`.
    """

    is_compileable = True  # fixed shapes and addresses, lengths on the device
    supports_early_init = True

    def __init__(self, keys: Tensor, values: Tensor, ends: Tensor, sliding_window: int | None,
                 host: HostFill | None = None):
        super().__init__()
        self.keys, self.values, self._ends = keys, values, ends
        self._host = host if host is not None else HostFill()
        self.batch_size, self.num_heads, self.max_cache_len, self.head_dim = keys.shape
        self.device, self.dtype = keys.device, keys.dtype
        self.sliding_window = sliding_window
        self.is_sliding = sliding_window is not None
        self._rows = torch.arange(self.batch_size, device=self.device).unsqueeze(1)  # [B, 1], indexes each row
        self.is_initialized = True

    def lazy_initialization(self, key_states: Tensor, value_states: Tensor) -> None:
        """The buffers exist from construction; this only checks that the states fit them."""
        self._check_states(key_states, value_states)

    def _check_states(self, key_states: Tensor, value_states: Tensor) -> None:
        for name, states in (("key_states", key_states), ("value_states", value_states)):
            if not isinstance(states, torch.Tensor):
                raise TypeError(f"{name} must be a torch.Tensor, got {type(states).__name__}")
            batch, heads, _, head_dim = states.shape if states.dim() == 4 else (None,) * 4
            if (batch, heads, head_dim) != (self.batch_size, self.num_heads, self.head_dim):
                raise ValueError(f"{name} must have shape [{self.batch_size}, {self.num_heads}, T, {self.head_dim}] "
                                 f"(the cache's batch, kv heads and head_dim), got {tuple(states.shape)}")
            if states.dtype != self.dtype or states.device != self.device:
                raise TypeError(f"{name} is {states.dtype} on {states.device}, the cache is {self.dtype} on "
                                f"{self.device}")
        if key_states.shape[2] != value_states.shape[2]:
            raise ValueError(f"key_states has {key_states.shape[2]} positions, value_states {value_states.shape[2]}")

    def update(self, key_states: Tensor, value_states: Tensor, *args, **kwargs) -> tuple[Tensor, Tensor]:
        """Write [B, Hkv, T, D] states at each row's slots ``ends - T .. ends - 1``; return the whole buffers,
        which HF's attention masks with the [B, 1, T, max_cache_len] mask that ``get_mask_sizes`` sizes (in a
        forward that started on an empty cache: the states themselves, with a [B, 1, T, T] mask)."""
        self._check_states(key_states, value_states)
        new = key_states.shape[2]
        if self._host.fresh:  # every row's ends is new: the step's slots are 0 .. new - 1 in every row
            self.keys[:, :, :new].copy_(key_states)
            self.values[:, :, :new].copy_(value_states)
            return key_states, value_states
        slots = self._ends.unsqueeze(1) - new + torch.arange(new, device=self.device, dtype=self._ends.dtype)
        slots = slots.long()  # [B, T]; with the [B, 1] rows, one [B, T] grid of (row, slot) pairs
        self.keys[self._rows, :, slots] = key_states.transpose(1, 2)  # each (row, slot) takes a [Hkv, D] slice
        self.values[self._rows, :, slots] = value_states.transpose(1, 2)
        return self.keys, self.values

    def get_mask_sizes(self, query_length: int) -> tuple[int, int]:
        """(kv_length, kv_offset) of the mask HF builds: the whole buffer from slot 0, or, before the first forward
        into an empty cache, that forward's own ``query_length`` positions."""
        return (query_length, 0) if self._host.filled == 0 else (self.max_cache_len, 0)

    def get_seq_length(self) -> Tensor:
        """Slots used so far (a 0-d device tensor, like StaticLayer's): the largest ``ends``."""
        return self._ends.amax()

    def get_max_length(self) -> int:
        return self.max_cache_len

    def reset(self) -> None:
        self.keys.zero_()
        self.values.zero_()

    def reorder_cache(self, beam_idx: Tensor) -> None:
        """Beam search: rows reordered in place, so the buffers keep their addresses."""
        beam_idx = beam_idx.to(self.device)
        self.keys.copy_(self.keys.index_select(0, beam_idx))
        self.values.copy_(self.values.index_select(0, beam_idx))


class FusedKVCache(StaticCache):
    """A preallocated KV cache for ``batch_size`` rows of up to ``max_cache_len`` positions, usable as HF's
    ``Cache`` (``model.generate(..., cache=FusedKVCache(model, B, L))``) and by fuselm's fused kernels.

    Args:
        model_or_config: a HF causal LM (dtype and device default to the model's) or its config (then ``dtype``
            is needed, unless the config names one; ``device`` defaults to torch's default device).
        batch_size: rows B.
        max_cache_len: positions per row L, prompt plus new tokens (padding included).
        dtype: float32, float16 or bfloat16.
        device: where the buffers live: one device, or a sequence of one per decoder layer. Default, given a model:
            each layer's buffers on that layer's device (a model spread over GPUs by ``device_map="auto"``);
            given a config: torch's default device.

    Per layer ``i``, ``buffers(i)`` is (keys, values), each [B, Hkv, L, D] in ``dtype``; ``lengths()`` is
    (starts, ends), each [B] int32, valid slots ``starts[b] <= s < ends[b]`` (``lengths(i)``: the copy on layer
    ``i``'s device, when the layers are on several devices). Call ``plan(attention_mask)``
    before each new batch of prompts (``generate`` does not: a cache with tokens in it is continued).

    ``last_position_only`` (default False) is set by fuselm's engine around a prefill whose caller reads only each
    row's last logits: the model's last fused decoder layer then writes the keys and values of every position but
    computes its attention output, MLP and result for the last position alone, so the forward's last hidden state
    is [B, 1, hidden].
    """

    def __init__(self, model_or_config, batch_size: int, max_cache_len: int, *, dtype: torch.dtype | None = None,
                 device: torch.device | str | None = None):
        if isinstance(model_or_config, PreTrainedConfig):
            config = model_or_config
            config_dtype = getattr(config, "dtype", None)
            dtype = dtype if dtype is not None else (config_dtype if isinstance(config_dtype, torch.dtype) else None)
            if dtype is None:
                raise ValueError("dtype: the config names no dtype; pass dtype= (or pass the model)")
            device = device if device is not None else torch.get_default_device()
        elif isinstance(model_or_config, torch.nn.Module) and isinstance(getattr(model_or_config, "config", None),
                                                                          PreTrainedConfig):
            config = model_or_config.config
            dtype = dtype if dtype is not None else model_or_config.dtype
        else:
            raise TypeError("model_or_config must be a transformers model or PreTrainedConfig, got "
                            f"{type(model_or_config).__name__}")
        batch_size = _positive_int("batch_size", batch_size)
        max_cache_len = _positive_int("max_cache_len", max_cache_len)
        if not isinstance(dtype, torch.dtype):
            raise TypeError(f"dtype must be a torch.dtype, got {type(dtype).__name__}")
        if dtype not in CACHE_DTYPES:
            raise ValueError(f"dtype must be one of {CACHE_DTYPES}, got {dtype}")

        config = config.get_text_config(decoder=True)
        windows = sliding_windows(config)
        devices = _per_layer_devices(model_or_config, device, len(windows))
        # starts and ends side by side, so plan() sets both with one copy
        self._row_lengths = torch.zeros(2, batch_size, dtype=torch.int32, device=devices[0])
        self._starts, self._ends = self._row_lengths.unbind(0)
        self._offsets = torch.arange(max_cache_len, dtype=torch.int32, device=devices[0])  # slot offsets of a step
        self.step_slots = self._offsets[:0].expand(batch_size, 0)
        self._host = HostFill()
        self._host.clear()  # empty, as after reset: a cache used without plan counts its fill too
        self.last_position_only = False
        # layers on other devices than layer 0 read copies of the lengths, refreshed after every change
        self._mirrors = {d: torch.zeros_like(self._row_lengths, device=d) for d in dict.fromkeys(devices[1:])
                         if d != devices[0]}
        mirrored = {d: tuple(mirror.unbind(0)) for d, mirror in self._mirrors.items()}
        self._layer_lengths = [mirrored.get(d, (self._starts, self._ends)) for d in devices]  # (starts, ends)
        self._mirror_slots = {d: self.step_slots.to(d) for d in self._mirrors}
        layers = []
        for layer_config, window, (_, ends) in zip(layer_configs(config), windows, self._layer_lengths, strict=True):
            kv_heads, head_dim = head_facts(layer_config)
            shape = (batch_size, kv_heads, max_cache_len, head_dim)
            keys, values = (torch.zeros(shape, dtype=dtype, device=ends.device) for _ in range(2))
            layers.append(FusedKVLayer(keys, values, ends, window, self._host))
        Cache.__init__(self, layers=layers)
        if not torch.compiler.is_compiling():  # fixed addresses for compile's cudagraphs, as HF's StaticLayer marks
            for tensor in (self._row_lengths, *(t for layer in layers for t in (layer.keys, layer.values))):
                torch._dynamo.mark_static_address(tensor)

    def __setstate__(self, state: dict) -> None:
        """Unpickling: pickle copies each tensor apart (deepcopy and torch.save keep views), so the lengths are made
        views of ``_row_lengths`` (and of the other devices' copies) again, and every layer reads its device's."""
        self.__dict__.update(state)
        self._starts, self._ends = self._row_lengths.unbind(0)
        mirrored = {device: tuple(mirror.unbind(0)) for device, mirror in self._mirrors.items()}
        self._layer_lengths = [mirrored.get(layer.keys.device, (self._starts, self._ends)) for layer in self.layers]
        for layer, (_, ends) in zip(self.layers, self._layer_lengths, strict=True):
            layer._ends = ends

    # ------------------------------------------------------------------ fused kernels' view
    def buffers(self, layer_idx: int) -> tuple[Tensor, Tensor]:
        """(keys, values) of one layer, each [B, Hkv, max_cache_len, D], written in place by fused kernels."""
        layer = self.layers[layer_idx]
        return layer.keys, layer.values

    def lengths(self, layer_idx: int = 0) -> tuple[Tensor, Tensor]:
        """(starts, ends), each [B] int32 on layer ``layer_idx``'s device: row b's valid slots are
        starts[b] <= s < ends[b]."""
        return self._layer_lengths[layer_idx]

    def slots(self, layer_idx: int = 0) -> Tensor:
        """The open step's slots (:meth:`advance`), [B, T] int32 on layer ``layer_idx``'s device."""
        device = self.layers[layer_idx].device
        return self._mirror_slots[device] if device in self._mirror_slots else self.step_slots

    def _refresh_mirrors(self) -> None:
        """The other devices' copies of the lengths and step slots, after layer 0's changed (device copies)."""
        for device, mirror in self._mirrors.items():
            mirror.copy_(self._row_lengths, non_blocking=True)
            self._mirror_slots[device] = self.step_slots.to(device, non_blocking=True)

    @property
    def spans_devices(self) -> bool:
        """Whether the layers' buffers lie on more than one device (a model split with ``device_map``)."""
        return bool(self._mirrors)

    def host_fill(self) -> tuple[int | None, bool]:
        """What the host knows of the fill (positions written per row since ``plan``, and whether the forward now
        running started on an empty cache), to set again with :meth:`restore_host_fill` after a CUDA-graph replay
        of a forward, which runs no Python."""
        return self._host.filled, self._host.fresh

    def restore_host_fill(self, fill: tuple[int | None, bool]) -> None:
        self._host.filled, self._host.fresh = fill

    @property
    def planned(self) -> bool:
        """Whether :meth:`plan` was called since the cache was made or reset. Until then fused steps do not know
        which slots are padding: a forward given an attention mask takes HF's path, which reads it."""
        return self._host.planned

    @property
    def sliding_windows(self) -> tuple[int | None, ...]:
        """Per layer, the window a decode attention applies, or None (full attention)."""
        return tuple(layer.sliding_window for layer in self.layers)

    @property
    def max_cache_len(self) -> int:
        return self.layers[0].max_cache_len

    @property
    def dtype(self) -> torch.dtype:
        return self.layers[0].dtype

    @property
    def device(self) -> torch.device:
        return self.layers[0].device

    # ------------------------------------------------------------------ plan / run
    def plan(self, attention_mask: Tensor | None = None) -> None:
        """Start a new batch of sequences: ``starts`` = each row's left padding in ``attention_mask`` ([B, S], non-zero
        (1, True or 1.0) at real tokens, zeros only at the left; None: no padding, and fused steps then take each row's
        start from the forwards' position ids, reading no mask), ``ends`` = 0. Device work, but for one host read of a
        mask (that it pads on the left only: ValueError otherwise)."""
        if attention_mask is None:
            self._host.clear(planned=True)
            self._row_lengths.zero_()
            self._refresh_mirrors()
            return
        if not isinstance(attention_mask, torch.Tensor):
            raise TypeError(f"attention_mask must be a torch.Tensor, got {type(attention_mask).__name__}")
        if attention_mask.is_complex():
            raise TypeError(f"attention_mask must be a bool, integer or floating tensor, got dtype "
                            f"{attention_mask.dtype}")
        if attention_mask.dim() != 2 or attention_mask.shape[0] != self.batch_size:
            raise ValueError(f"attention_mask must have shape [{self.batch_size}, S] (the cache's batch), got "
                             f"{tuple(attention_mask.shape)}")
        if attention_mask.shape[1] > self.max_cache_len:
            raise ValueError(f"attention_mask has {attention_mask.shape[1]} positions, more than max_cache_len "
                             f"{self.max_cache_len}")
        mask = attention_mask.to(self.device, non_blocking=True) != 0
        if (mask[:, 1:] < mask[:, :-1]).any():  # the one host read: fused steps attend over [starts, ends)
            raise ValueError("attention_mask has padding after a real token: only left padding is supported")
        self._plan_left_padded(mask)

    def _plan_left_padded(self, mask: Tensor) -> None:
        """:meth:`plan` for a [batch_size, S <= max_cache_len] bool mask on the cache's device that its caller has
        found to pad on the left only (fuselm's engine: ``run_or_reason`` read that): no host read."""
        self._host.clear(planned=True, masked=True)
        left_padding = (mask.cumsum(-1) == 0).sum(-1)  # zeros before the row's first real token
        self._row_lengths.copy_(torch.stack((left_padding, torch.zeros_like(left_padding))))
        self._refresh_mirrors()

    def advance(self, num_tokens: int) -> None:
        """Open a step of ``num_tokens`` new positions in every row: ``ends += num_tokens`` (device, in place).
        Each layer then writes them at slots ``ends - num_tokens .. ends - 1``: ``step_slots``, [B, T] int32.
        Raises ValueError, changing nothing, when the step would pass ``max_cache_len`` (checked on the host: against
        the positions written since construction, ``plan`` or ``reset``, or, where the host knows no count, against
        ``max_cache_len`` alone)."""
        self._check_room(num_tokens)
        self.step_slots = self._ends.unsqueeze(1) + self._offsets[:num_tokens]  # before the add: 2 kernels, not 3
        self._ends.add_(num_tokens)
        self._host.advance(num_tokens)
        self._refresh_mirrors()

    def open_step(self, num_tokens: int, position_ids: Tensor | None = None) -> None:
        """A fused forward's :meth:`advance`, also setting ``starts`` from the new tokens' position ids
        ([1 or B, T]; a row's start is its last slot minus that token's position, which skips its left padding,
        as HF's ``generate`` numbers positions) unless ``plan`` was given an attention mask: its padding is what HF's
        attention masks, whatever the positions (a forward given none numbers padded rows from 0). None keeps the
        planned starts. Device work only."""
        if position_ids is not None:
            self._check_position_ids(num_tokens, position_ids)
        self.advance(num_tokens)
        if position_ids is not None and not self._host.masked:
            self._starts.copy_(self._ends - 1 - position_ids[:, -1].to(self._ends.device))
            self._refresh_mirrors()

    def _check_room(self, num_tokens: int) -> None:
        filled = self._host.filled or 0
        if filled + num_tokens > self.max_cache_len:
            held = f" after the {filled} it holds" if filled else ""
            raise ValueError(f"num_tokens: {num_tokens} new positions{held} do not fit the cache's max_cache_len "
                             f"{self.max_cache_len} (make a longer cache, or plan() a new batch)")

    def _check_position_ids(self, num_tokens: int, position_ids: Tensor) -> None:
        if position_ids.dim() != 2 or position_ids.shape[0] not in (1, self.batch_size) \
                or position_ids.shape[1] != num_tokens:
            raise ValueError(f"position_ids must have shape [1 or {self.batch_size}, {num_tokens}] (the cache's "
                             f"batch, the step's tokens), got {tuple(position_ids.shape)}")

    def starts_empty(self, layer_idx: int) -> bool:
        """Whether the forward now at layer ``layer_idx`` started on a cache known to be empty (the prefill after
        ``plan`` or ``reset``), as the host counts it: no device read. Layer 0 asks before it opens the step."""
        return self._host.filled == 0 if layer_idx == 0 else self._host.fresh

    def update(self, key_states: Tensor, value_states: Tensor, layer_idx: int, *args, **kwargs
               ) -> tuple[Tensor, Tensor]:
        """HF's write path: layer 0 opens the step (``advance(T)``, after checking the states: a bad call changes
        nothing), then the layer writes its [B, Hkv, T, D] states; returns that layer's whole (keys, values)
        buffers."""
        layer = self.layers[layer_idx]
        if layer_idx == 0:
            layer._check_states(key_states, value_states)
            self.advance(key_states.shape[2])
        return layer.update(key_states, value_states)

    def reset(self) -> None:
        """Zero every buffer and both lengths in place (no reallocation)."""
        super().reset()
        self._row_lengths.zero_()
        self._host.clear()
        self._refresh_mirrors()

    @property
    def is_croppable(self) -> bool:
        """Every layer keeps every position (sliding ones too), so ``crop`` always puts the cache back."""
        return True

    def crop(self, tokens_to_remove: int | Tensor) -> None:
        """Forget the last ``|tokens_to_remove|`` positions of every row (``ends -= |tokens_to_remove|``, device, in
        place; the buffers keep their stale states, overwritten by the next writes), as HF's static layers crop:
        ``tokens_to_remove`` <= 0 (HF's assisted decoding passes ``-n``, as a 0-d integer tensor in transformers 5.17:
        read on the host here)."""
        if (isinstance(tokens_to_remove, Tensor) and tokens_to_remove.numel() == 1
                and not tokens_to_remove.is_floating_point() and tokens_to_remove.dtype != torch.bool):
            tokens_to_remove = int(tokens_to_remove.item())
        if isinstance(tokens_to_remove, bool) or not isinstance(tokens_to_remove, int):
            raise TypeError(f"tokens_to_remove must be an int, got {type(tokens_to_remove).__name__}")
        if tokens_to_remove > 0:
            raise ValueError(f"tokens_to_remove must be <= 0 (minus the positions to remove, as for HF's static "
                             f"caches), got {tokens_to_remove}")
        removed = -tokens_to_remove
        if self._host.filled is not None and removed > self._host.filled:
            raise ValueError(f"tokens_to_remove: cannot remove {removed} positions, the cache holds "
                             f"{self._host.filled}")
        self._ends.sub_(removed)
        self._host.crop(removed)
        self._refresh_mirrors()

    def reorder_cache(self, beam_idx: Tensor) -> None:
        super().reorder_cache(beam_idx)
        beam_idx = beam_idx.to(self.device)
        self._row_lengths.copy_(self._row_lengths.index_select(1, beam_idx))
        self._refresh_mirrors()

    def early_initialization(self, batch_size: int, num_heads: int | list[int], head_dim: int | list[int],
                             dtype: torch.dtype, device) -> None:
        """Already allocated at construction: checks that what HF asks for is what the cache holds."""
        num_heads = num_heads if isinstance(num_heads, list) else [num_heads] * len(self.layers)
        head_dim = head_dim if isinstance(head_dim, list) else [head_dim] * len(self.layers)
        wanted = (batch_size, num_heads, head_dim, dtype, torch.device(device).type)
        held = (self.batch_size, [layer.num_heads for layer in self.layers], [layer.head_dim for layer in self.layers],
                self.dtype, self.device.type)
        if wanted != held:
            raise ValueError(f"early_initialization asks for (batch, kv heads, head_dim, dtype, device) {wanted}, "
                             f"the cache holds {held}")


def _per_layer_devices(model_or_config, device, count: int) -> list[torch.device]:
    """``device`` for every layer, or its one-per-layer sequence checked, or (None, given a model) each layer's."""
    if device is None:
        return layer_devices(model_or_config, count)
    if isinstance(device, (list, tuple)):
        if len(device) != count:
            raise ValueError(f"device: {len(device)} devices given for {count} decoder layers")
        return [torch.device(d) for d in device]
    return [torch.device(device)] * count
