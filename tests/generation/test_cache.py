"""FusedKVCache as HF's Cache: greedy generate gives HF's tokens for every family (left padding, prompts past the
sliding window, more new tokens than prompt), the device lengths follow the mask at every step, the buffers hold
StaticCache's states, storage is reused, a patched model agrees, and bad arguments are named."""

import copy
import inspect
import io
import pickle
from contextlib import nullcontext
from unittest import mock

import pytest
import torch
from transformers import AutoConfig, LlamaModel, LogitsProcessor, LogitsProcessorList, PreTrainedConfig, StaticCache

import fuselm
from fuselm.generation import FusedKVCache
from tests.conftest import DEVICE
from tests.helpers import rel_err
from tests.models import FUSED_LAYERS, decode_model, tiny_model, token_ids

FAMILY_NAMES = FUSED_LAYERS
SLIDING = ("mistral", "gemma2", "gemma3")

PADS = (4, 1, 0)  # left padding of each row: rows of 5, 8 and 9 tokens, windows of 6
PROMPT, NEW = 9, 12


def family_model(name: str, **overrides) -> torch.nn.Module:
    model = tiny_model(name, **overrides)
    model.generation_config.eos_token_id = None  # always NEW tokens
    return model


def all_buffers(cache: FusedKVCache) -> list[torch.Tensor]:
    return [buffer for layer_idx in range(len(cache)) for buffer in cache.buffers(layer_idx)]


def left_padded_batch(pads=PADS, seq_len=PROMPT):
    ids = token_ids(len(pads), seq_len, seed=5)
    mask = torch.ones_like(ids)
    for row, pad in enumerate(pads):
        mask[row, :pad] = 0
    return ids.masked_fill(mask == 0, 0), mask


class LengthsRecorder(LogitsProcessor):
    """Records the cache's (starts, ends) after each forward of generate, beside the sequence length then."""

    def __init__(self, cache: FusedKVCache):
        self.cache, self.seen = cache, []

    def __call__(self, input_ids, scores):
        starts, ends = self.cache.lengths()
        self.seen.append((input_ids.shape[1], starts.clone(), ends.clone()))
        return scores


# the cache argument's name: transformers 5.24 renamed past_key_values (kept as a deprecated alias) to cache
CACHE_ARG = "cache" if "cache" in inspect.signature(LlamaModel.forward).parameters else "past_key_values"


def greedy(model, ids, mask, auto_compile=False, **kwargs):
    """HF's greedy generate; on CUDA it compiles the decode forward for a compileable cache only when asked."""
    return model.generate(ids, attention_mask=mask, max_new_tokens=NEW, do_sample=False, pad_token_id=0,
                          disable_compile=not auto_compile, **kwargs)


def generate_with_fused_cache(model, ids, mask, cache=None, auto_compile=False):
    cache = cache or FusedKVCache(model, ids.shape[0], ids.shape[1] + NEW)
    cache.plan(mask)
    recorder = LengthsRecorder(cache)
    tokens = greedy(model, ids, mask, auto_compile, **{CACHE_ARG: cache},
                    logits_processor=LogitsProcessorList([recorder]))
    return tokens, cache, recorder.seen


def assert_lengths_follow_the_mask(seen, mask):
    pads = (mask == 0).sum(-1).to(torch.int32).cpu()
    assert len(seen) == NEW  # the prefill, then one decode step per new token after the first
    for seq_len, starts, ends in seen:
        assert starts.device.type == ends.device.type == DEVICE
        assert torch.equal(starts.cpu(), pads), (seq_len, starts)
        assert torch.equal(ends.cpu(), torch.full_like(pads, seq_len)), (seq_len, ends)


def assert_buffers_hold_static_cache_states(cache: FusedKVCache, static: StaticCache):
    """At each row's valid slots, every layer's keys and values equal StaticCache's. Its sliding layers keep only
    the last ``window`` slots (in order), compared with the same slots here. Slots past ``ends`` were never written."""
    starts, ends = (t.cpu() for t in cache.lengths())
    used = int(ends.max())
    for layer_idx, hf_layer in enumerate(static.layers):
        for ours, theirs in zip(cache.buffers(layer_idx), (hf_layer.keys, hf_layer.values)):
            assert not ours[:, :, used:].any(), f"layer {layer_idx}: slots past ends were written"
            first = max(used - theirs.shape[2], 0)  # the first slot StaticCache still holds
            for row in range(ours.shape[0]):
                valid = slice(max(int(starts[row]), first), used)
                got = ours[row, :, valid]
                expected = theirs[row, :, valid.start - first:valid.stop - first]
                assert got.shape == expected.shape and got.numel() > 0
                assert rel_err(got, expected) <= 1e-6, f"layer {layer_idx} row {row}: {rel_err(got, expected):.1e}"


@pytest.mark.parametrize("name", FAMILY_NAMES)
def test_greedy_generate_matches_static_and_dynamic_caches(name):
    model = family_model(name)
    ids, mask = left_padded_batch()
    tokens, cache, seen = generate_with_fused_cache(model, ids, mask)
    assert torch.equal(tokens, greedy(model, ids, mask))  # HF's default DynamicCache
    static = StaticCache(config=model.config, max_cache_len=PROMPT + NEW)
    assert torch.equal(tokens, greedy(model, ids, mask, **{CACHE_ARG: static}))
    assert tokens.shape == (len(PADS), PROMPT + NEW)
    assert_lengths_follow_the_mask(seen, mask)
    assert_buffers_hold_static_cache_states(cache, static)


@pytest.mark.parametrize("name", SLIDING)
def test_generate_far_past_the_sliding_window_with_room_to_spare(name):
    """A cache longer than needed (the mask covers all of it), 3x more new tokens than the window, and the cache
    passed under generate's older (deprecated) name."""
    model = family_model(name)
    ids, mask = left_padded_batch(pads=(2, 0), seq_len=7)
    cache = FusedKVCache(model, 2, 7 + NEW + 13)
    cache.plan(mask)
    assert cache.sliding_windows == tuple(6 if kind == "sliding_attention" else None
                                          for kind in getattr(model.config, "layer_types", ["sliding_attention"] * 2))
    deprecated = pytest.warns(FutureWarning, match="past_key_values") if CACHE_ARG == "cache" else nullcontext()
    with deprecated:
        tokens = greedy(model, ids, mask, past_key_values=cache)
    assert torch.equal(tokens, greedy(model, ids, mask))
    assert cache.lengths()[1].tolist() == [7 + NEW - 1] * 2


@pytest.mark.parametrize("name", FAMILY_NAMES)
def test_patched_model_generates_the_same_tokens_with_the_cache(name):
    model = family_model(name)
    ids, mask = left_padded_batch()
    expected = greedy(model, ids, mask)
    fuselm.patch(model)
    tokens, _, seen = generate_with_fused_cache(model, ids, mask)
    assert torch.equal(tokens, expected)
    assert_lengths_follow_the_mask(seen, mask)


def test_patched_model_through_triton_kernels_with_the_cache():
    model = family_model("gemma3")  # sliding and full layers, q/k norms
    ids, mask = left_padded_batch()
    expected = greedy(model, ids, mask)
    fuselm.patch(model)
    with fuselm.use_backend("triton"):
        tokens, _, _ = generate_with_fused_cache(model, ids, mask)
    assert torch.equal(tokens, expected)


def test_reset_and_plan_reuse_the_storage_across_calls():
    model = family_model("gemma2")
    ids, mask = left_padded_batch()
    cache = FusedKVCache(model, len(PADS), PROMPT + NEW)

    def pointers():
        return [t.data_ptr() for t in (*all_buffers(cache), *cache.lengths())]

    storage = pointers()
    first, _, _ = generate_with_fused_cache(model, ids, mask, cache)
    assert pointers() == storage
    cache.reset()
    assert pointers() == storage
    assert not any(t.any() for t in (*all_buffers(cache), *cache.lengths()))
    # a second call after reset, and a third straight after plan (stale states beyond ends are never attended)
    assert torch.equal(generate_with_fused_cache(model, ids, mask, cache)[0], first)
    other_ids, other_mask = left_padded_batch(pads=(0, 3, 2))
    expected = greedy(model, other_ids, other_mask)
    tokens, _, seen = generate_with_fused_cache(model, other_ids, other_mask, cache)
    assert torch.equal(tokens, expected)
    assert_lengths_follow_the_mask(seen, other_mask)
    assert pointers() == storage


def _pickled(cache):
    return pickle.loads(pickle.dumps(cache))


def _saved(cache):
    buffer = io.BytesIO()
    torch.save(cache, buffer)
    buffer.seek(0)
    return torch.load(buffer, weights_only=False)


@pytest.mark.parametrize("copier", [_pickled, copy.deepcopy, _saved], ids=["pickle", "deepcopy", "torch.save"])
def test_a_copied_cache_plans_and_generates_on_its_own(copier):
    """A used cache copied (pickle copies each tensor apart, views included) plans and generates HF's tokens: its
    layers read the copy's lengths, and the original is left as it was."""
    model = family_model("llama")
    ids, mask = left_padded_batch()
    cache = FusedKVCache(model, len(PADS), PROMPT + NEW)
    generate_with_fused_cache(model, ids, mask, cache)
    before = [t.clone() for t in (*all_buffers(cache), *cache.lengths())]
    copied = copier(cache)
    other_ids, other_mask = left_padded_batch(pads=(0, 3, 2))
    tokens, _, seen = generate_with_fused_cache(model, other_ids, other_mask, copied)
    assert torch.equal(tokens, greedy(model, other_ids, other_mask))
    assert_lengths_follow_the_mask(seen, other_mask)
    assert all(torch.equal(a, b) for a, b in zip(before, (*all_buffers(cache), *cache.lengths()), strict=True))


@pytest.mark.parametrize("mask_dtype", [torch.bool, torch.int64, torch.int32, torch.float32])
def test_plan_sets_starts_from_left_padding_and_empties_the_cache(mask_dtype):
    model = family_model("llama")
    cache = FusedKVCache(model, 4, 10)
    starts, ends = cache.lengths()
    ends.fill_(7)
    mask = torch.tensor([[0, 0, 1, 1, 1], [1, 1, 1, 1, 1], [0, 0, 0, 0, 1], [0, 0, 0, 0, 0]], dtype=mask_dtype)
    cache.plan(mask.to(DEVICE))
    assert cache.lengths()[0] is starts and cache.lengths()[1] is ends  # the same tensors, written in place
    assert starts.tolist() == [2, 0, 4, 5] and ends.tolist() == [0, 0, 0, 0]
    assert starts.dtype == ends.dtype == torch.int32
    assert cache.get_seq_length().item() == 0
    cache.plan(None)
    assert starts.tolist() == ends.tolist() == [0, 0, 0, 0]


def test_update_writes_only_each_rows_step_slots():
    """Per-row ends (rows at different lengths): layer 0 opens the step, every layer writes at ends - T .. ends - 1;
    poisoned buffers stay NaN everywhere else."""
    model = family_model("llama")
    cache = FusedKVCache(model, 2, 8)
    for layer_idx in range(len(cache)):
        for buffer in cache.buffers(layer_idx):
            buffer.fill_(float("nan"))
    batch, kv_heads, _, head_dim = cache.buffers(0)[0].shape
    assert (batch, kv_heads, head_dim) == (2, 2, 24)
    _, ends = cache.lengths()
    ends.copy_(torch.tensor([1, 4], dtype=torch.int32))
    cache.restore_host_fill((None, False))  # ends set behind the host's count: it knows no fill
    written = {0: {0: [], 1: []}, 1: {0: [], 1: []}}  # layer -> row -> [(slot, key, value)]
    for step_len in (3, 1):
        for layer_idx in range(len(cache)):
            key, value = (torch.randn(2, kv_heads, step_len, head_dim, device=DEVICE) for _ in range(2))
            keys, values = cache.update(key, value, layer_idx)
            assert (keys, values) == cache.buffers(layer_idx)  # whole buffers back, for HF's attention
            for row in range(2):
                for t in range(step_len):
                    written[layer_idx][row].append((int(ends[row]) - step_len + t, key[row, :, t], value[row, :, t]))
    assert ends.tolist() == [5, 8]
    assert cache.get_seq_length().item() == 8
    for layer_idx in range(len(cache)):
        keys, values = cache.buffers(layer_idx)
        for row in range(2):
            slots = [slot for slot, _, _ in written[layer_idx][row]]
            assert slots == (list(range(1, 5)) if row == 0 else list(range(4, 8)))
            for slot, key, value in written[layer_idx][row]:
                assert torch.equal(keys[row, :, slot], key) and torch.equal(values[row, :, slot], value)
            untouched = [s for s in range(8) if s not in slots]
            assert torch.isnan(keys[row, :, untouched]).all() and torch.isnan(values[row, :, untouched]).all()


@pytest.mark.parametrize(("name", "kv_heads", "head_dim"), [("llama2", 4, 14), ("llama", 2, 24), ("phi3", 2, 16)])
def test_buffers_take_head_counts_from_the_config_like_hf(name, kv_heads, head_dim):
    model = family_model(name)
    cache = FusedKVCache(model, 3, 11)
    assert len(cache) == model.config.num_hidden_layers
    for layer_idx in range(len(cache)):
        for buffer in cache.buffers(layer_idx):
            assert buffer.shape == (3, kv_heads, 11, head_dim)
            assert buffer.dtype == model.dtype and buffer.device == model.device
    assert cache.max_cache_len == cache.get_max_length() == 11 and cache.batch_size == 3
    assert cache.is_compileable and cache.is_initialized


def test_dtype_and_device_given_or_taken_from_model_or_config():
    model = family_model("qwen3")
    assert FusedKVCache(model, 1, 4, dtype=torch.bfloat16).dtype == torch.bfloat16
    config = model.config
    config.dtype = None
    cache = FusedKVCache(config, 1, 4, dtype=torch.float16, device=DEVICE)
    assert (cache.dtype, cache.device.type) == (torch.float16, DEVICE)
    config.dtype = torch.bfloat16
    assert FusedKVCache(config, 1, 4).dtype == torch.bfloat16


def test_compiled_decode_forward_traces_the_cache_in_one_graph():
    """torch.compile(fullgraph=True) of a decode forward (aot_eager: traced, no C++ build) equals eager."""
    model = family_model("llama")
    ids, mask = left_padded_batch(pads=(2, 0), seq_len=5)
    positions = (mask.cumsum(-1) - 1).clamp(min=0)
    cache = FusedKVCache(model, 2, 12)
    cache.plan(mask)
    with torch.no_grad():
        logits = model(ids, attention_mask=mask, position_ids=positions, **{CACHE_ARG: cache}).logits
        next_ids = logits[:, -1:].argmax(-1)
        step = {"input_ids": next_ids, "attention_mask": torch.cat([mask, torch.ones_like(next_ids)], 1),
                    "position_ids": positions[:, -1:] + 1, CACHE_ARG: cache}
        lengths, buffers = cache._row_lengths.clone(), [t.clone() for t in all_buffers(cache)]
        eager = model(**step).logits
        after = [t.clone() for t in all_buffers(cache)]
        cache._row_lengths.copy_(lengths)  # back to before the step
        for buffer, saved in zip(all_buffers(cache), buffers):
            buffer.copy_(saved)
        compiled = torch.compile(model.forward, backend="aot_eager", fullgraph=True)(**step).logits
    assert rel_err(compiled, eager) <= 1e-6
    assert cache.lengths()[1].tolist() == [6, 6]
    for buffer, expected in zip(all_buffers(cache), after):
        assert rel_err(buffer, expected) <= 1e-6


def test_bad_construction_arguments_are_named():
    model = family_model("llama")
    for bad, error in [(0, ValueError), (-2, ValueError), (1.5, TypeError), (True, TypeError)]:
        with pytest.raises(error, match="batch_size"):
            FusedKVCache(model, bad, 8)
        with pytest.raises(error, match="max_cache_len"):
            FusedKVCache(model, 2, bad)
    with pytest.raises(ValueError, match="dtype"):
        FusedKVCache(model, 2, 8, dtype=torch.int8)
    with pytest.raises(TypeError, match="dtype"):
        FusedKVCache(model, 2, 8, dtype="float16")
    with pytest.raises(TypeError, match="model_or_config"):
        FusedKVCache({"num_attention_heads": 4}, 2, 8)
    config = AutoConfig.for_model("llama", num_attention_heads=4, hidden_size=56, num_key_value_heads=2)
    config.dtype = None
    with pytest.raises(ValueError, match="dtype"):
        FusedKVCache(config, 2, 8)
    heads = {"num_attention_heads": 4}
    for facts, missing in [({}, "num_attention_heads"), (heads, "hidden_size"),
                           ({**heads, "hidden_size": 54}, "hidden_size"), ({**heads, "head_dim": 0}, "head_dim"),
                           ({**heads, "hidden_size": 56, "num_key_value_heads": 2.0}, "num_key_value_heads"),
                           ({**heads, "hidden_size": 56, "layer_types": ["chunked_attention"] * 2,
                             "attention_chunk_size": 4}, "chunked_attention")]:
        with pytest.raises(ValueError, match=missing):
            FusedKVCache(PreTrainedConfig(num_hidden_layers=2, **facts), 2, 8, dtype=torch.float32)


def test_bad_plan_and_update_arguments_are_named():
    cache = FusedKVCache(family_model("llama"), 2, 8)
    for bad, error in [(torch.ones(2, 4, dtype=torch.complex64), TypeError), (torch.ones(3, 4), ValueError),
                       (torch.ones(2, 4, 1, dtype=torch.long), ValueError),
                       (torch.ones(2, 9, dtype=torch.long), ValueError), ([[1, 1], [1, 1]], TypeError)]:
        with pytest.raises(error, match="attention_mask"):
            cache.plan(bad)
    good = torch.randn(2, 2, 1, 24, device=DEVICE)
    for bad, error in [(torch.randn(2, 4, 1, 24, device=DEVICE), ValueError),
                       (torch.randn(2, 2, 1, 16, device=DEVICE), ValueError),
                       (torch.randn(2, 2, 24, device=DEVICE), ValueError), (good.double(), TypeError)]:
        with pytest.raises(error, match="key_states"):
            cache.update(bad, good, 0)
        with pytest.raises(error, match="value_states"):
            cache.update(good, bad, 1)
    with pytest.raises(ValueError, match="early_initialization"):
        cache.early_initialization(batch_size=3, num_heads=2, head_dim=24, dtype=torch.float32, device=DEVICE)


@pytest.mark.gpu
@pytest.mark.parametrize("patched", [False, True])
def test_hf_generate_on_cuda_compiles_the_decode_forward_over_the_cache(patched):
    """On CUDA, generate compiles the decode forward for a compileable cache (mode reduce-overhead: cudagraphs)."""
    model = family_model("gemma2")
    ids, mask = left_padded_batch()
    expected = greedy(model, ids, mask)
    if patched:
        fuselm.patch(model)
    tokens, _, seen = generate_with_fused_cache(model, ids, mask, auto_compile=True)
    assert hasattr(model, "_compiled_call"), "generate did not compile the forward"
    assert torch.equal(tokens, expected)
    assert_lengths_follow_the_mask(seen, mask)


@pytest.mark.gpu
def test_decode_step_replays_in_a_cuda_graph_as_it_runs_eagerly():
    """One decode step of the model over the cache, captured once and replayed while starts, ends and positions
    change between replays: logits, lengths and buffers equal the same steps run eagerly on a second cache."""
    model = family_model("llama")
    ids, mask = left_padded_batch()
    positions = (mask.cumsum(-1) - 1).clamp(min=0)
    caches = [FusedKVCache(model, len(PADS), PROMPT + NEW) for _ in range(2)]
    slots = torch.arange(PROMPT + NEW, device=DEVICE)

    def decode_step(cache, next_ids):
        starts, ends = cache.lengths()  # the step attends over [starts, ends + 1), its token sits at ends
        valid = (slots >= starts[:, None]) & (slots <= ends[:, None])
        return model(next_ids, attention_mask=valid[:, None, None, :], position_ids=(ends - starts)[:, None].long(),
                     **{CACHE_ARG: cache}).logits[:, -1]

    with torch.no_grad():
        first = []
        for cache in caches:
            cache.plan(mask)
            first.append(model(ids, attention_mask=mask, position_ids=positions, **{CACHE_ARG: cache}).logits[:, -1])
        graph_cache, eager_cache = caches
        static_ids = first[0].argmax(-1, keepdim=True)
        saved = graph_cache._row_lengths.clone()
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):  # warm-up (it advances the cache: the lengths are put back)
            decode_step(graph_cache, static_ids)
        torch.cuda.current_stream().wait_stream(side)
        graph_cache._row_lengths.copy_(saved)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            static_logits = decode_step(graph_cache, static_ids)
        eager_ids = static_ids.clone()
        for _ in range(NEW - 1):
            graph.replay()
            eager_logits = decode_step(eager_cache, eager_ids)
            assert rel_err(static_logits, eager_logits) <= 1e-5
            assert all(torch.equal(a, b) for a, b in zip(graph_cache.lengths(), eager_cache.lengths()))
            static_ids.copy_(static_logits.argmax(-1, keepdim=True))
            eager_ids = eager_logits.argmax(-1, keepdim=True)
    assert graph_cache.lengths()[1].tolist() == [PROMPT + NEW - 1] * len(PADS)
    for layer_idx in range(len(graph_cache)):
        for got, expected in zip(graph_cache.buffers(layer_idx), eager_cache.buffers(layer_idx)):
            assert rel_err(got, expected) <= 1e-5


def test_beam_search_reorders_rows_in_place():
    model = family_model("qwen2")
    ids, mask = left_padded_batch()
    beams = {"num_beams": 3, "max_new_tokens": 6, "do_sample": False, "pad_token_id": 0, "disable_compile": True}
    expected = model.generate(ids, attention_mask=mask, **beams)
    cache = FusedKVCache(model, len(PADS) * 3, PROMPT + 6)
    cache.plan(mask.repeat_interleave(3, 0))
    storage = [t.data_ptr() for t in (*all_buffers(cache), *cache.lengths())]
    with mock.patch.object(cache, "reorder_cache", wraps=cache.reorder_cache) as reorder:
        assert torch.equal(model.generate(ids, attention_mask=mask, **{CACHE_ARG: cache}, **beams), expected)
    assert reorder.call_count > 0
    assert [t.data_ptr() for t in (*all_buffers(cache), *cache.lengths())] == storage


def forward_steps(model, cache, ids, mask, chunks):
    """The model over ``ids`` [B, S] in chunks of the given token counts, each with the mask so far ([B, S] left
    padded) and no position ids: HF's default then numbers every row's slots from 0, padding included. Returns the
    logits [B, S, V]."""
    logits, done = [], 0
    with torch.no_grad():
        for size in chunks:
            step = ids[:, done:done + size]
            logits.append(model(step, attention_mask=mask[:, :done + size], **{CACHE_ARG: cache}).logits)
            done += size
    return torch.cat(logits, 1)


@pytest.mark.parametrize("name", ["llama", "gemma3"])
@pytest.mark.parametrize("prepared", ["plan(mask)", "never", "reset"])
def test_patched_forwards_attend_over_the_masks_rows_whatever_the_positions(name, prepared):
    """A left-padded batch decoded by hand with no position ids (HF's default numbers the padding): the forwards
    attend over each row's real tokens as HF's masks do, as with a StaticCache. A cache planned with the mask decodes
    fused from its starts; one never planned (made, or reset) takes HF's path wherever a mask is given (the fused
    steps took each row's start from its positions, attending over the padding)."""
    ids, mask = left_padded_batch(pads=(4, 0), seq_len=PROMPT + 3)
    reference = decode_model(name)
    expected = forward_steps(reference, StaticCache(config=reference.config, max_cache_len=PROMPT + 3), ids, mask,
                             (PROMPT, 1, 1, 1))
    model = decode_model(name)
    fuselm.patch(model)
    cache = FusedKVCache(model, 2, PROMPT + 3)
    if prepared == "plan(mask)":
        cache.plan(mask)
    elif prepared == "reset":
        cache.plan(mask)
        cache.reset()
    got = forward_steps(model, cache, ids, mask, (PROMPT, 1, 1, 1))
    real = mask.bool()
    assert rel_err(got[real], expected[real]) <= 1e-5
    if prepared == "plan(mask)":
        assert cache.lengths()[0].tolist() == [4, 0]


@pytest.mark.parametrize("patched", [False, True])
def test_a_step_past_max_cache_len_raises_and_changes_nothing(patched):
    model = decode_model("llama")
    if patched:
        fuselm.patch(model)
    cache = FusedKVCache(model, 2, PROMPT + 1)
    ids, mask = left_padded_batch(pads=(2, 0), seq_len=PROMPT + 2)
    cache.plan(mask[:, :PROMPT])
    forward_steps(model, cache, ids, mask, (PROMPT, 1))  # exactly full
    lengths, buffers = cache._row_lengths.clone(), [t.clone() for t in all_buffers(cache)]
    with pytest.raises(ValueError, match="max_cache_len"):
        forward_steps(model, cache, ids[:, PROMPT + 1:], mask, (1,))
    assert torch.equal(cache._row_lengths, lengths)
    assert all(torch.equal(t, saved) for t, saved in zip(all_buffers(cache), buffers))
    cache.plan(None)
    with pytest.raises(ValueError, match="max_cache_len"):  # a prefill longer than the cache
        forward_steps(model, cache, token_ids(2, PROMPT + 2), torch.ones(2, PROMPT + 2, dtype=torch.long),
                      (PROMPT + 2,))
    assert not cache._row_lengths.any()


@pytest.mark.parametrize("patched", [False, True])
def test_a_cache_never_planned_counts_its_fill_from_construction(patched):
    """A cache passed to generate straight after construction (no plan or reset) is empty: a step past max_cache_len
    raises the ValueError (its count started unknown: the step went on to an IndexError on CPU, past the buffers'
    end on a GPU)."""
    model = family_model("llama")
    if patched:
        fuselm.patch(model)
    ids, mask = left_padded_batch(pads=(2, 0), seq_len=5)
    cache = FusedKVCache(model, 2, 5 + 3)
    with pytest.raises(ValueError, match="max_cache_len"):
        model.generate(ids, attention_mask=mask, max_new_tokens=5, do_sample=False, pad_token_id=0,
                       disable_compile=True, **{CACHE_ARG: cache})
    assert cache.lengths()[1].tolist() == [8, 8]
    expected = greedy(model, ids, mask)
    assert torch.equal(greedy(model, ids, mask, **{CACHE_ARG: FusedKVCache(model, 2, 5 + NEW)}), expected)


def test_an_offloaded_layers_buffers_sit_on_its_execution_device(tmp_path):
    """accelerate's offload leaves a layer's weights on the meta device and runs it on its hook's execution device:
    the cache puts that layer's buffers there, as HF's StaticCache allocates them from the states (they were on
    meta: generate raised the cache's device TypeError)."""
    from accelerate import dispatch_model

    model = family_model("llama")
    ids, mask = left_padded_batch()
    expected = greedy(model, ids, mask)
    main = "cuda:0" if DEVICE == "cuda" else "cpu"
    placement = {name: main for name in ("model.embed_tokens", "model.rotary_emb", "model.layers.0", "model.norm",
                                         "lm_head")}
    model = dispatch_model(model, {**placement, "model.layers.1": "disk"}, main_device=main,
                           offload_dir=str(tmp_path))
    assert next(model.model.layers[1].parameters()).device.type == "meta"
    cache = FusedKVCache(model, len(PADS), PROMPT + NEW)
    assert [cache.buffers(i)[0].device for i in range(2)] == [torch.device(main)] * 2
    assert torch.equal(generate_with_fused_cache(model, ids, mask, cache)[0], expected)


def test_calls_for_another_batch_size_raise_before_the_step_opens():
    model = decode_model("llama")
    fuselm.patch(model)
    cache = FusedKVCache(model, 2, 12)
    cache.plan(None)
    with pytest.raises(ValueError, match="position_ids"), torch.no_grad():
        model(token_ids(4, 3), position_ids=torch.arange(3).expand(4, 3), **{CACHE_ARG: cache})
    with pytest.raises(ValueError, match="key_states"):
        cache.update(*(torch.randn(4, 2, 3, 64, device=DEVICE) for _ in range(2)), 0)
    assert not cache._row_lengths.any()
    beams = {"num_beams": 2, "max_new_tokens": 3, "do_sample": False, "pad_token_id": 0, "disable_compile": True}
    with pytest.raises(ValueError, match=r"position_ids must have shape \[1 or 2"):
        model.generate(token_ids(2, 5), **{CACHE_ARG: cache}, **beams)  # 4 rows of beams in a cache of 2


@pytest.mark.parametrize("name", ["llama", "gemma3"])
def test_assisted_generate_crops_the_cache_like_hf(name):
    """Assisted decoding crops the rejected draft tokens (crop(-n)); a sliding window does not stop it here (every
    position is kept), as it stops HF's StaticCache."""
    model, draft = family_model(name), family_model(name, seed=1)
    ids = token_ids(1, 5)
    assisted = {"max_new_tokens": 6, "do_sample": False, "pad_token_id": 0, "disable_compile": True,
                "assistant_model": draft}
    expected = model.generate(ids, **assisted)
    cache = FusedKVCache(model, 1, 5 + 6 + 6)
    cache.plan(None)
    assert cache.is_croppable
    with mock.patch.object(cache, "crop", wraps=cache.crop) as crop:
        assert torch.equal(model.generate(ids, **{CACHE_ARG: cache}, **assisted), expected)
    assert any(call.args[0] < 0 for call in crop.call_args_list)


def test_crop_forgets_the_last_positions_of_every_row():
    cache = FusedKVCache(family_model("llama"), 2, 12)
    cache.plan(torch.tensor([[0, 1, 1, 1, 1], [1, 1, 1, 1, 1]]))
    cache.advance(5)
    cache.crop(-1)
    cache.crop(torch.tensor(-1))  # transformers 5.17's assisted decoding passes a 0-d tensor
    cache.crop(0)
    assert cache.lengths()[0].tolist() == [1, 0] and cache.lengths()[1].tolist() == [3, 3]
    assert cache.get_mask_sizes(1, 0) == (12, 0)
    for bad, error in [(1, ValueError), (-4, ValueError), (-1.0, TypeError), (torch.tensor(-1.0), TypeError),
                       (torch.tensor([-1, -1]), TypeError)]:
        with pytest.raises(error, match="tokens_to_remove"):
            cache.crop(bad)
    cache.crop(-3)
    assert cache.get_mask_sizes(4, 0) == (4, 0)  # empty again: the next forward attends over its own states


def test_plan_refuses_padding_after_a_real_token():
    """HF's masks hide such padding from a later step; a fused step would attend over it (every slot in [starts,
    ends)): a right-padded prompt continued by decode steps gave other logits than HF's StaticCache."""
    cache = FusedKVCache(family_model("llama"), 2, 8)
    cache.plan(torch.tensor([[0, 0, 1, 1], [0, 1, 1, 1]], device=DEVICE))
    for bad in ([[1, 1, 0, 0], [1, 1, 1, 1]], [[0, 1, 0, 1], [1, 1, 1, 1]]):
        with pytest.raises(ValueError, match="attention_mask has padding after a real token"):
            cache.plan(torch.tensor(bad, device=DEVICE))
        assert cache.lengths()[0].tolist() == [2, 1]  # unchanged
