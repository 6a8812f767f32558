"""``fuselm.generate``: HF's ``generate`` for a patched causal LM, with each decode step one CUDA-graph replay.

Plan/run, per call:

1. **plan**: the batch is padded to its bucket (a power of two; filler rows repeat row 0 and are done from the
   start), the bucket's :class:`FusedKVCache` (one per batch bucket, grown when a call needs more positions) is
   planned from the attention mask, and the call's options are loaded into device tensors.
2. **prefill**: the model's own forward over the prompt, writing the cache (each fused layer's q/k/v epilogue writes
   the prompt's keys and values into it, and SDPA reads them there: ``prefill_attention`` in
   ``fuselm/patching/decode.py``); the first token is chosen from its last logits. On CUDA a prompt length the
   bucket has prefilled before (unpadded rows, at most ``PREFILL_GRAPH_TOKENS`` tokens) is captured as a CUDA graph
   and replayed from then on: the eager forward launches hundreds of kernels, and a host slower than the GPU sets
   its pace. The first call of a length runs eagerly, which also finishes its autotuning.
3. **decode**: one step per new token, each the whole model over one token per row (the fused decoder layers'
   decode step, final norm, lm_head) plus the token choice (:mod:`fuselm.generation.choice`), with no host
   sync. On CUDA the step is captured once per (bucket, options mode) after a warm-up that finishes every
   autotune, and replayed. Whether every row is done is read every ``EOS_CHECK_EVERY`` steps, one check late,
   so the host never waits on the device; the few extra steps only emit padding and are cut off. With a streamer,
   which reads every step's tokens back anyway, it is read before each step: the streamer gets HF's steps alone.

Graphs and caches belong to the engine of one model (held weakly: they are freed with it). A step is captured
again when the model's parameters, classes or fuselm's backend changed since it was captured.
"""

from __future__ import annotations

import inspect
import math
import operator
import sys
import warnings
import weakref
from collections.abc import Hashable

import torch
from torch import Tensor, nn
from transformers.generation.utils import GenerateDecoderOnlyOutput

from fuselm.backend import get_backend
from fuselm.generation.cache import FusedKVCache
from fuselm.generation.choice import ChoiceState
from fuselm.generation.options import DecodeOptions
from fuselm.generation.rotary import RotaryTables
from fuselm.patching.decode import CAUSAL_PREFILL, UNMASKED
from fuselm.patching.modules import hooked, hooked_state

CACHE_GRANULE = 256  # cache lengths are multiples of this: calls of nearby lengths share a cache and its graphs
EOS_CHECK_EVERY = 8  # decode steps between two reads of "every row done"
WARMUP_STEPS = 2  # eager steps before a capture: every autotune has finished by then
# prefills of at most this many tokens (rows x prompt) are captured when a length repeats: a graph's activations stay
# in the pool (~115 KB a token for Llama-3-8B), and a longer prefill keeps the GPU busier than the host anyway
PREFILL_GRAPH_TOKENS = 4096
PREFILL_GRAPHS = 4  # captured prefill lengths kept per bucket; the least recently used is freed first


def batch_bucket(batch: int) -> int:
    """The batch size a call of ``batch`` rows runs at: the next power of two."""
    return 1 << max(batch - 1, 0).bit_length()


def _cache_keyword(model: nn.Module) -> str:
    """The name HF's forward takes the cache by (``cache`` from transformers 5.24, ``past_key_values`` before)."""
    return "cache" if "cache" in inspect.signature(model.forward).parameters else "past_key_values"


_PARAMETER_FIELDS = operator.attrgetter("dtype", "device", "shape")


def _fingerprint(model: nn.Module) -> tuple:
    """What a captured step and :func:`model_reason` depend on beyond the buffers, in one walk over the modules:
    fuselm's backend, the model's mode, every module's class and whether a hook watches it (``hooked_state``),
    and every parameter's storage, dtype, device and shape. Host time before the prefill is the first token's:
    the walk reads each module's ``__dict__`` once and the parameters' fields with C-level maps."""
    classes, watched, parameters, stack = [], [], [], [model]
    while stack:  # depth first, as Module.modules() but without its generators (2.5x faster)
        module = stack.pop()
        state = module.__dict__
        classes.append(type(module))
        if hooked_state(state):
            watched.append(len(classes))
        parameters += state["_parameters"].values()
        stack += state["_modules"].values()
    parameters = [p for p in parameters if p is not None]
    return (get_backend(), model.training, tuple(classes), tuple(watched), tuple(map(Tensor.data_ptr, parameters)),
            tuple(map(_PARAMETER_FIELDS, parameters)))


def unmasked_prefill_limit(model: nn.Module) -> int:
    """Unpadded prompts shorter than this need no attention mask in their prefill: every layer attends causally
    over the whole prompt (no sliding window as short, no soft-capping, which the fused prefill attention leaves to
    HF), so SDPA's ``is_causal`` is HF's mask. 0 when some layer needs HF's mask. Call after ``model_reason``."""
    from fuselm.patching.decode import layer_facts
    from fuselm.patching.modules import FusedDecoderLayer

    limit = sys.maxsize
    for layer in (m for m in model.modules() if isinstance(m, FusedDecoderLayer)):
        facts = layer_facts(layer)
        if facts.softcap is not None or not facts.causal:
            return 0
        if facts.sliding_window is not None:
            limit = min(limit, facts.sliding_window)
    return limit


def model_reason(model: nn.Module) -> str | None:
    """Why fuselm's loop cannot run ``model`` (already patched), or None. Depends only on what
    :func:`_fingerprint` holds (and the config, fixed for a model)."""
    from fuselm.ops.attention import HEAD_DIMS
    from fuselm.patching.decode import layer_facts
    from fuselm.patching.modules import FusedDecoderLayer

    config = getattr(model, "config", None)
    if config is None or getattr(config, "is_encoder_decoder", False) or model.get_output_embeddings() is None:
        return f"{type(model).__name__} is not a decoder-only causal LM"
    if model.training:
        return "the model is in training mode (call model.eval())"
    device = next(model.parameters()).device
    if device.type not in ("cpu", "cuda"):
        return f"the model is on {device.type}"
    if any(p.device != device for p in model.parameters()):
        return "the model's parameters span several devices"
    layers = [m for m in model.modules() if type(m).__name__.endswith("DecoderLayer")]
    if not layers:
        return "the model has no decoder layers fuselm recognises"
    for layer in layers:
        if not isinstance(layer, FusedDecoderLayer):
            return f"decoder layer {type(layer).__name__} is not fused by fuselm.patch"
        facts = layer_facts(layer)
        if facts is None:
            return f"decoder layer {type(layer).__name__}: its attention cannot be read"
        if facts.head_dim not in HEAD_DIMS:
            return f"head_dim {facts.head_dim} is not one of decode_attention's {HEAD_DIMS}"
        if hooked(layer.self_attn):
            return (f"a hook watches the attention module of decoder layer {layer.self_attn.layer_idx} (the fused "
                    "decode step does not call it)")
    return None


class _Bucket:
    """One batch bucket: its cache, its decoding state, its rotary tables and its captured steps (per options
    mode)."""

    def __init__(self, model: nn.Module, batch: int, max_cache_len: int, vocab: int):
        self.cache = FusedKVCache(model, batch, max_cache_len)
        self.state = ChoiceState(batch, vocab, max_cache_len, model.device)
        self.rotary = RotaryTables(model, max_cache_len)
        self.positions = torch.arange(max_cache_len, device=self.cache.device)  # an unpadded row's position ids
        # a prefill's logits_to_keep: the last position as an index, which HF's causal LMs gather whether the last
        # layer returned every position or, with the cache's last_position_only, that one alone
        self.last_position = None if self.cache.spans_devices else torch.tensor([-1], device=self.cache.device)
        self.graphs: dict[tuple, torch.cuda.CUDAGraph] = {}
        self.prefills = PrefillGraphs()
        self.fingerprint: tuple | None = None


class _PrefillGraph:
    """One captured prefill: the graph, its input buffers (ids and positions, [B, T]), its last logits [B, V] and
    what the host knows of the cache after it (``FusedKVCache.host_fill``, which a replay does not update)."""

    def __init__(self, graph: torch.cuda.CUDAGraph, ids: Tensor, positions: Tensor, logits: Tensor, fill: tuple):
        self.graph, self.ids, self.positions, self.logits, self.fill = graph, ids, positions, logits, fill

    def replay(self, ids: Tensor, positions: Tensor, cache: FusedKVCache) -> Tensor:
        self.ids.copy_(ids)
        self.positions.copy_(positions)
        self.graph.replay()
        cache.restore_host_fill(self.fill)
        return self.logits


class PrefillGraphs:
    """A bucket's captured prefills by key (the prompt length and the attention the config names): a key is
    captured the second time it comes (the first call runs eagerly and finishes its autotuning), at most
    ``PREFILL_GRAPHS`` are kept (least recently used freed first), and after a capture fails none is tried again
    until :meth:`clear`."""

    def __init__(self):
        self.graphs: dict[Hashable, _PrefillGraph] = {}  # in order of use, the most recent last
        self.seen: set[Hashable] = set()
        self.failed = False

    def lookup(self, key: Hashable) -> tuple[_PrefillGraph | None, bool]:
        """(the graph for ``key`` or None, whether to capture it now); counts this call as a sighting."""
        graph = self.graphs.pop(key, None)
        if graph is not None:
            self.graphs[key] = graph
            return graph, False
        capture = key in self.seen and not self.failed
        self.seen.add(key)
        return None, capture

    def keep(self, key: Hashable, graph: _PrefillGraph) -> None:
        while len(self.graphs) >= PREFILL_GRAPHS:
            del self.graphs[next(iter(self.graphs))]
        self.graphs[key] = graph

    def clear(self) -> None:
        self.graphs.clear()
        self.seen.clear()
        self.failed = False


class DecodeEngine:
    """The prefill, decode loop and captured steps of one model. Use :func:`fuselm.generate`."""

    def __init__(self, model: nn.Module):
        self._model = weakref.ref(model)
        self._buckets: dict[int, _Bucket] = {}
        self._cache_keyword = _cache_keyword(model)
        self.captures = 0  # decode steps captured so far (tests and benchmarks read it)
        self.prefill_captures = 0  # prefills captured so far
        self._fingerprint: tuple | None = None  # the model's at the last model_reason() call,
        self._reason: str | None = None  # and model_reason's answer for it
        self._unmasked_below = 0  # and unmasked_prefill_limit's, when model_reason found nothing

    @property
    def model(self) -> nn.Module:
        model = self._model()
        if model is None:
            raise RuntimeError("the engine's model was freed")
        return model

    # ------------------------------------------------------------------ one call
    def model_reason(self) -> str | None:
        """:func:`model_reason` of the model, computed again only when its fingerprint changed since the last call:
        one walk over the modules per call (the host's time before the prefill is the first token's)."""
        fingerprint = _fingerprint(self.model)
        if fingerprint != self._fingerprint:
            self._reason, self._fingerprint = model_reason(self.model), fingerprint
            self._unmasked_below = unmasked_prefill_limit(self.model) if self._reason is None else 0
        return self._reason

    def run(self, input_ids: Tensor, attention_mask: Tensor | None, options: DecodeOptions, streamer=None):
        """Generate for [B, S] ``input_ids``; returns what HF's ``generate`` returns for these options, on the device of
        ``input_ids`` (HF keeps them there, moving only the model's inputs to the model). Call it after
        :meth:`model_reason` found nothing, which took the fingerprint the captured steps are checked against.
        ``attention_mask``: None (no padding) or [B, S], found by the caller to pad on the left only."""
        batch, prompt_len = input_ids.shape
        if streamer is not None:
            streamer.put(input_ids.cpu())
        bucket = self._bucket(batch, prompt_len + options.max_new_tokens)
        state, cache = bucket.state, bucket.cache
        ids, mask = _padded(input_ids.to(cache.device), attention_mask, state.tokens.shape[0])  # mask there too
        state.start(options, ids, mask, batch)
        if mask is None:
            cache.plan(None)
            positions = bucket.positions[:prompt_len].expand(ids.shape[0], -1)
        else:  # run_or_reason found it left-padded; plan would read that from the device again
            cache._plan_left_padded(mask != 0)
            positions = (mask.long().cumsum(-1) - 1).masked_fill(mask == 0, 1)
        logits = self._prefill(bucket, ids, positions, mask)
        state.positions.copy_(positions[:, -1:] + 1)
        state.choose(logits, options)
        scores, raw = [], []
        self._collect(state, batch, options, scores, raw, streamer)
        step = self._step_function(bucket, options) if options.max_new_tokens > 1 else None
        steps, pending = 1, None
        while steps < options.max_new_tokens:
            # a streamer reads each step's tokens back anyway, and must get the kept steps alone: done is read now
            if streamer is not None and options.eos and state.done[:batch].all():
                break
            step()
            steps += 1
            self._collect(state, batch, options, scores, raw, streamer)
            if options.eos and streamer is None and steps % EOS_CHECK_EVERY == 0:
                if pending is not None and _read(pending):
                    break
                pending = _all_done_later(state.done[:batch])
        if streamer is not None:
            streamer.end()
        kept = self._kept_steps(state, batch, steps, options)
        return self._output(input_ids, state.generated[:batch, :kept], scores[:kept], raw[:kept], options)

    def _bucket(self, batch: int, positions: int) -> _Bucket:
        """The bucket for ``batch`` rows, its cache holding at least ``positions`` per row (grown if needed)."""
        model = self.model
        rows = batch_bucket(batch)
        bucket = self._buckets.get(rows)
        if bucket is None or bucket.cache.max_cache_len < positions:
            length = max(CACHE_GRANULE * math.ceil(positions / CACHE_GRANULE),
                         bucket.cache.max_cache_len if bucket is not None else 0)
            self._buckets.pop(rows, None)
            del bucket  # free the old cache and graphs before allocating the new ones
            bucket = self._buckets[rows] = _Bucket(model, rows, length, model.get_output_embeddings().out_features)
        fingerprint = self._fingerprint if self._fingerprint is not None else _fingerprint(model)
        if bucket.fingerprint != fingerprint:
            bucket.graphs.clear()
            bucket.prefills.clear()
            bucket.rotary.clear()
            bucket.fingerprint = fingerprint
        return bucket

    def _forward(self, ids: Tensor, positions: Tensor, cache: FusedKVCache, mask: Tensor | None,
                 implementation: str | None = None, last_position: Tensor | None = None) -> Tensor:
        """The model over ``ids`` [B, T] at ``positions`` [B, T], writing ``cache``; the last logits [B, V], in the
        model's dtype (the choice casts them to fp32 where HF's processors would).

        ``last_position``: a prefill's (the bucket's ``last_position``, [-1] on the cache's device) or None (a
        decode step: one position). Given, it is the forward's ``logits_to_keep`` and the cache's
        ``last_position_only`` is set meanwhile, so the model's last decoder layer computes its attention output
        and MLP for the last position alone (its keys and values for all): nearly 1/L of the prefill's GEMMs and
        attention less, for L layers.

        ``implementation``: the attention the config names during the forward, one HF builds no mask for
        (``UNMASKED`` for a decode step, whose fused layers read none; ``CAUSAL_PREFILL`` for a prefill that
        attends with SDPA's ``is_causal``: ``fuselm/patching/decode.py``); None keeps the config's. HF skips a
        plain causal mask only when it may read the mask and offsets on the host, so it makes a full [T, T] mask
        inside a CUDA-graph capture (the prefill then took 4x longer at 8192 tokens), and with ``eager`` attention
        it makes a decode step's mask with host-to-device copies, which a graph cannot capture.

        No hidden states or attentions are captured, whatever the config says: transformers' capturing hooks stay
        inert (``fuselm.patching.modules.hooked``), so the fused layers run."""
        config = self.model.config
        named = config._attn_implementation
        config._attn_implementation = implementation or named
        cache.last_position_only = last_position is not None
        try:
            with torch.no_grad():
                out = self.model(input_ids=ids, attention_mask=mask, position_ids=positions, use_cache=True,
                                 logits_to_keep=1 if last_position is None else last_position,
                                 output_attentions=False, output_hidden_states=False,
                                 **{self._cache_keyword: cache})
        finally:
            config._attn_implementation = named
            cache.last_position_only = False
        return out.logits[:, -1, :]

    def _prefill(self, bucket: _Bucket, ids: Tensor, positions: Tensor, mask: Tensor | None) -> Tensor:
        """:meth:`_forward` over the prompt into the bucket's planned cache: a captured graph's replay for a length
        the bucket prefilled before (:class:`PrefillGraphs`), else eagerly. Captured: CUDA, one device, no mask
        (HF's mask for padded rows reads its values on the host) and at most ``PREFILL_GRAPH_TOKENS`` tokens (the
        graph's activations stay in the graphs' memory pool)."""
        cache, length, named = bucket.cache, ids.shape[1], self.model.config._attn_implementation
        implementation = (CAUSAL_PREFILL if mask is None and length < self._unmasked_below and named == "sdpa"
                          else None)
        last = self._last_position(bucket)
        if (mask is not None or cache.device.type != "cuda" or cache.spans_devices
                or ids.numel() > PREFILL_GRAPH_TOKENS):
            return self._forward(ids, positions, cache, mask, implementation, last)
        key = (length, named)
        graph, capture = bucket.prefills.lookup(key)
        if capture:
            graph = self._capture_prefill(bucket, key, ids, positions, implementation, last)
        if graph is None:
            return self._forward(ids, positions, cache, None, implementation, last)
        return graph.replay(ids, positions, cache)

    def _last_position(self, bucket: _Bucket) -> Tensor | None:
        """The prefill's ``last_position`` for :meth:`_forward`: the bucket's, or None when a hook watches a module
        of the model (it would see the last layer's output, or the model's, for the last position alone). Reads the
        fingerprint :meth:`_bucket` gave the bucket before this call."""
        watched = bucket.fingerprint[3]  # the modules a hook watches (_fingerprint's order)
        return None if watched else bucket.last_position

    def _capture_prefill(self, bucket: _Bucket, key: Hashable, ids: Tensor, positions: Tensor,
                         implementation: str | None, last_position: Tensor | None) -> _PrefillGraph | None:
        """Capture the prefill of ``ids`` [B, T] into the planned cache (not run: the caller replays it), or None
        with a warning when it cannot be captured. The bucket's eager prefill of this length ran before, so every
        kernel is tuned and every lazy setup done."""
        cache = bucket.cache
        fill = cache.host_fill()
        static_ids, static_positions = ids.clone(), positions.clone()
        graph = torch.cuda.CUDAGraph()
        try:
            with torch.cuda.graph(graph, pool=self._graph_pool()):
                logits = self._forward(static_ids, static_positions, cache, None, implementation, last_position)
        except Exception as error:  # noqa: BLE001 - any capture failure leaves the eager prefill, which is correct
            torch.cuda.synchronize(cache.device)
            cache.restore_host_fill(fill)
            bucket.prefills.failed = True
            warnings.warn(f"fuselm.generate: the prefill could not be captured in a CUDA graph "
                          f"({type(error).__name__}: {error}); it runs eagerly", RuntimeWarning, stacklevel=4)
            return None
        captured = _PrefillGraph(graph, static_ids, static_positions, logits, cache.host_fill())
        cache.restore_host_fill(fill)
        bucket.prefills.keep(key, captured)
        self.prefill_captures += 1
        return captured

    def _graph_pool(self):
        """The CUDA-graph memory pool every graph of this engine shares (they never replay concurrently): a live
        graph's, or a new one when none lives. A pool lives only while a graph captured into it does: once its last
        graph is freed (its bucket's cache grown, its graphs cleared or least recently used), a capture into its
        old handle fails the caching allocator's assert, and left the CUDA generator mid-capture (session 31)."""
        for bucket in self._buckets.values():
            for graph in bucket.graphs.values():
                return graph.pool()
            for prefill in bucket.prefills.graphs.values():
                return prefill.graph.pool()
        return torch.cuda.graph_pool_handle()

    def _decode_step(self, bucket: _Bucket, options: DecodeOptions) -> None:
        """One decode step on the bucket's buffers: the model over each row's last token, then the choice.

        Every layer takes the fused step (``model_reason`` checked it), which never reads HF's attention mask, so
        HF builds none (``UNMASKED``), and the rotary embedding is gathered from the bucket's tables."""
        state = bucket.state
        with bucket.rotary.gathering():
            logits = self._forward(state.tokens, state.positions, bucket.cache, None, UNMASKED)
        state.choose(logits, options)
        state.advance_positions()

    # ------------------------------------------------------------------ capture
    def _step_function(self, bucket: _Bucket, options: DecodeOptions):
        """A callable running one decode step: a graph replay on CUDA, the eager step elsewhere."""
        if bucket.cache.device.type != "cuda":
            return lambda: self._decode_step(bucket, options)
        graph = bucket.graphs.get(options.mode)
        if graph is None:
            graph = self._capture(bucket, options)
            if graph is None:
                return lambda: self._decode_step(bucket, options)
            bucket.graphs[options.mode] = graph
        return graph.replay

    def _capture(self, bucket: _Bucket, options: DecodeOptions) -> torch.cuda.CUDAGraph | None:
        """Warm up and capture one decode step; the bucket's state and the RNG are as before. None (with a
        warning) when the step cannot be captured: it then runs eagerly, still without host syncs in fuselm."""
        device = bucket.cache.device
        state, cache = bucket.state, bucket.cache
        kept = [t.clone() for t in _state_tensors(state, cache)]
        rng = torch.cuda.get_rng_state(device)
        side = torch.cuda.Stream(device)
        side.wait_stream(torch.cuda.current_stream(device))
        graph = torch.cuda.CUDAGraph()
        try:
            with torch.cuda.stream(side):
                for _ in range(WARMUP_STEPS):
                    self._decode_step(bucket, options)
            torch.cuda.current_stream(device).wait_stream(side)
            _restore(state, cache, kept)
            with torch.cuda.graph(graph, pool=self._graph_pool()):
                self._decode_step(bucket, options)
        except Exception as error:  # noqa: BLE001 - any capture failure leaves the eager step, which is correct
            torch.cuda.synchronize(device)
            warnings.warn(f"fuselm.generate: the decode step could not be captured in a CUDA graph "
                          f"({type(error).__name__}: {error}); it runs eagerly", RuntimeWarning, stacklevel=4)
            graph = None
        _restore(state, cache, kept)
        torch.cuda.set_rng_state(rng, device)
        self.captures += graph is not None
        return graph

    # ------------------------------------------------------------------ outputs
    @staticmethod
    def _collect(state: ChoiceState, batch: int, options: DecodeOptions, scores: list, raw: list, streamer) -> None:
        if options.output_scores:
            scores.append(state.scores[:batch].clone())
        if options.output_logits:
            raw.append(state.logits[:batch].clone())
        if streamer is not None:
            streamer.put(state.tokens[:batch, 0].cpu())

    @staticmethod
    def _kept_steps(state: ChoiceState, batch: int, steps: int, options: DecodeOptions) -> int:
        """Steps HF would have run: up to the step where the last row emitted eos, if every row did."""
        if not options.eos:
            return steps
        finish = state.finish[:batch].tolist()
        return steps if min(finish) < 0 else min(steps, max(finish) + 1)

    @staticmethod
    def _output(input_ids: Tensor, new: Tensor, scores: list, raw: list, options: DecodeOptions):
        device = input_ids.device
        sequences = torch.cat((input_ids, new.to(device)), dim=1)  # int64, as HF's, whatever the prompt's
        if not options.return_dict:
            return sequences
        scores, raw = (tuple(step.to(device) for step in steps) for steps in (scores, raw))
        return GenerateDecoderOnlyOutput(sequences=sequences, scores=scores if options.output_scores else None,
                                         logits=raw if options.output_logits else None)


def _padded(input_ids: Tensor, attention_mask: Tensor | None, rows: int) -> tuple[Tensor, Tensor | None]:
    """``input_ids`` and its mask (None: no padding) on the model's device, with filler rows (copies of row 0)
    up to ``rows``."""
    mask = None if attention_mask is None else attention_mask.to(input_ids.device)
    fill = rows - input_ids.shape[0]
    if fill:
        input_ids = torch.cat((input_ids, input_ids[:1].expand(fill, -1)))
        mask = None if mask is None else torch.cat((mask, mask[:1].expand(fill, -1)))
    return input_ids, mask


def _state_tensors(state: ChoiceState, cache: FusedKVCache) -> list[Tensor]:
    return [state.tokens, state.positions, state.done, state.finish, state.count, state.seen, cache.lengths()[0],
            cache.lengths()[1]]


def _restore(state: ChoiceState, cache: FusedKVCache, kept: list[Tensor]) -> None:
    for tensor, saved in zip(_state_tensors(state, cache), kept, strict=True):
        tensor.copy_(saved)


def _all_done_later(done: Tensor):
    """Start reading ``done.all()`` without waiting: (host tensor, event) for :func:`_read`."""
    flag = done.all().to("cpu", non_blocking=True)
    if done.device.type != "cuda":
        return flag, None
    event = torch.cuda.Event()
    event.record()
    return flag, event


def _read(pending) -> bool:
    flag, event = pending
    if event is not None:
        event.synchronize()
    return bool(flag)
