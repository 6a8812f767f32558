"""The fused decode step of a patched decoder layer over a FusedKVCache.

Against HF's own layers writing the same kind of cache (unpatched model, HF attention through ``update``): the
logits after prefill and after each decode step and the cache contents, for every family with fused layers, on
both paths; tokens against HF's StaticCache; projections that are not plain linears (LoRA) run as modules,
merged or disabled adapters are plain again; a layer's step replays in a CUDA graph (GPU).
"""

import inspect
from unittest import mock

import peft
import pytest
import torch
from transformers import LlamaModel, LogitsProcessor, LogitsProcessorList, StaticCache

import fuselm
from fuselm.generation import FusedKVCache
from fuselm.patching import decode
from tests.conftest import DEVICE, HAS_CUDA
from tests.helpers import rel_err
from tests.models import FUSED_LAYERS, decode_model, tiny_model, token_ids

CACHE_ARG = "cache" if "cache" in inspect.signature(LlamaModel.forward).parameters else "past_key_values"
PADS = (4, 1, 0)  # left padding of the three rows
NEW = 4  # prefill, then 3 decode steps
MAX_LEN = 32


def left_padded(prompt: int) -> tuple[torch.Tensor, torch.Tensor]:
    ids = token_ids(len(PADS), prompt, seed=7)
    mask = torch.ones_like(ids)
    for row, pad in enumerate(PADS):
        mask[row, :pad] = 0
        ids[row, :pad] = 0
    return ids, mask


def new_cache(model, mask: torch.Tensor, poisoned: bool = False) -> FusedKVCache:
    """A planned cache for ``mask``'s rows; ``poisoned``: NaN in every slot, for paths that read only valid slots
    (HF's attention reads the whole buffer, where NaN would reach the output through the masked products)."""
    cache = FusedKVCache(model, len(PADS), MAX_LEN)
    cache.plan(mask)
    if poisoned:
        for layer in range(len(cache)):
            for buffer in cache.buffers(layer):
                buffer.fill_(float("nan"))
    return cache


def generate(model, ids, mask, cache, new=NEW, **kwargs):
    out = model.generate(ids, attention_mask=mask, max_new_tokens=new, do_sample=False, pad_token_id=0,
                         output_logits=True, return_dict_in_generate=True, disable_compile=True, **{CACHE_ARG: cache},
                         **kwargs)
    return out.sequences, out.logits


def cache_state(cache: FusedKVCache) -> tuple[list[torch.Tensor], list[list[torch.Tensor]]]:
    """Copies of ``cache``'s (starts, ends) and of each layer's buffers, as they are now."""
    return ([t.clone() for t in cache.lengths()],
            [[buffer.clone() for buffer in cache.buffers(layer)] for layer in range(len(cache))])


class AfterPrefill(LogitsProcessor):
    """Takes :func:`cache_state` of ``cache`` at generate's first logits, i.e. right after the prefill."""

    def __init__(self, cache: FusedKVCache):
        self.cache, self.state = cache, None

    def __call__(self, input_ids: torch.Tensor, scores: torch.Tensor) -> torch.Tensor:
        if self.state is None:
            self.state = cache_state(self.cache)
        return scores


def assert_same_cache(fused: tuple, hf: tuple, poisoned: bool) -> None:
    """Two :func:`cache_state` s: equal lengths; equal states at every valid slot; slots from ``ends`` on never
    written (still NaN where the fused cache was ``poisoned``). Prefill writes the left padding's slots too, as HF's
    caches do, but what a padding token holds after layer 0 is undefined (its query sees nothing), so those slots are
    not compared."""
    (fused_lengths, fused_buffers), (hf_lengths, hf_buffers) = fused, hf
    for a, b in zip(fused_lengths, hf_lengths):
        assert torch.equal(a, b)
    starts, ends = hf_lengths
    slots = torch.arange(MAX_LEN, device=starts.device)
    valid = (slots >= starts[:, None]) & (slots < ends[:, None])  # [B, L]
    for fused_layer, hf_layer in zip(fused_buffers, hf_buffers, strict=True):
        for got, expected in zip(fused_layer, hf_layer):
            got, expected = got.transpose(1, 2), expected.transpose(1, 2)  # [B, L, Hkv, D]
            assert rel_err(got[valid], expected[valid]) <= 1e-5
            if poisoned:
                assert torch.isnan(got[slots[None].expand_as(valid) >= ends[:, None]]).all()


@pytest.mark.parametrize("prompt", [9, 20], ids=["decode-prefill", "sdpa-prefill"])
@pytest.mark.parametrize("name", FUSED_LAYERS)
def test_decode_steps_match_hf_layers(name, prompt, path):
    """A prompt of 9 (<= DECODE_MAX_TOKENS) prefills through the fused decode step too; one of 20 through the
    fused prefill attention (HF's SDPA function over the cache's first slots), or HF's own attention for a model
    whose attention is not ``sdpa`` (Gemma 2 here: eager, for its soft-capping). Either way each step's logits and
    the cache equal HF's, after the prefill and after 3 decode steps, and no forward reads a slot it has not
    written."""
    model = decode_model(name)
    ids, mask = left_padded(prompt)
    hf_cache = new_cache(model, mask)
    hf_prefill = AfterPrefill(hf_cache)
    with fuselm.use_backend("reference"):
        hf_tokens, hf_logits = generate(model, ids, mask, hf_cache, logits_processor=LogitsProcessorList([hf_prefill]))
    fuselm.patch(model)
    try:
        fused_cache = new_cache(model, mask, poisoned=True)
        fused_prefill = AfterPrefill(fused_cache)
        with (mock.patch.object(decode, "decode_attention", wraps=decode.decode_attention) as attention,
              mock.patch.object(decode, "prefill_attention", wraps=decode.prefill_attention) as prefill):
            tokens, logits = generate(model, ids, mask, fused_cache,
                                      logits_processor=LogitsProcessorList([fused_prefill]))
    finally:
        fuselm.unpatch(model)
    layers = model.config.num_hidden_layers
    long_prompt = prompt > decode.DECODE_MAX_TOKENS
    assert attention.call_count == layers * (NEW - long_prompt)
    sdpa_prefill = long_prompt and model.config._attn_implementation == "sdpa"
    assert prefill.call_count == layers * sdpa_prefill
    assert torch.equal(tokens, hf_tokens)
    assert len(logits) == len(hf_logits) == NEW
    for step, (got, expected) in enumerate(zip(logits, hf_logits)):
        assert rel_err(got, expected) <= 1e-5, f"step {step}"
    (_, prefill_ends), _ = hf_prefill.state
    assert torch.equal(hf_cache.lengths()[1] - prefill_ends, torch.full_like(prefill_ends, NEW - 1))  # the prefill's
    assert_same_cache(fused_prefill.state, hf_prefill.state, poisoned=True)
    assert_same_cache(cache_state(fused_cache), cache_state(hf_cache), poisoned=True)


@pytest.mark.parametrize("prompt", [9, 20, 24], ids=["decode-prefill", "sdpa-prefill", "sdpa-prefill-gemm"])
@pytest.mark.parametrize("name", FUSED_LAYERS)
def test_last_position_only_prefill(name, prompt, path):
    """With the cache's ``last_position_only`` (set by fuselm's engine, which reads only the last logits), a prefill
    longer than DECODE_MAX_TOKENS returns the last position alone: the last layer runs its q projection, attention
    output and MLP for it only. That position's hidden state equals HF's, and so does every layer's cache, the last
    layer's keys and values at every position included. A shorter prompt (the fused decode step) keeps its T
    positions. 3 x 20 rows take qkv_rope's streaming kernel, 3 x 24 its GEMMs (q's for the 3 last rows alone)."""
    model = decode_model(name)
    ids, mask = left_padded(prompt)
    positions = (mask.cumsum(-1) - 1).masked_fill(mask == 0, 1)
    inputs = dict(input_ids=ids, attention_mask=mask, position_ids=positions, use_cache=True)
    hf_cache = new_cache(model, mask)
    with fuselm.use_backend("reference"), torch.no_grad():
        expected = model.model(**inputs, **{CACHE_ARG: hf_cache}).last_hidden_state
    fuselm.patch(model)
    try:
        fused_cache = new_cache(model, mask, poisoned=True)
        fused_cache.last_position_only = True
        with torch.no_grad():
            hidden = model.model(**inputs, **{CACHE_ARG: fused_cache}).last_hidden_state
    finally:
        fuselm.unpatch(model)
    assert hidden.shape == (len(PADS), 1 if prompt > decode.DECODE_MAX_TOKENS else prompt, model.config.hidden_size)
    assert rel_err(hidden[:, -1], expected[:, -1]) <= 1e-5
    assert_same_cache(cache_state(fused_cache), cache_state(hf_cache), poisoned=True)


@pytest.mark.parametrize("name", ["llama", "gemma2", "phi3"])
def test_tokens_match_hf_static_cache(name):
    model = decode_model(name)
    ids, mask = left_padded(9)
    expected, _ = generate(model, ids, mask, StaticCache(config=model.config, max_cache_len=MAX_LEN), new=12)
    with fuselm.patched(model):
        tokens, _ = generate(model, ids, mask, new_cache(model, mask, poisoned=True), new=12)
    assert torch.equal(tokens, expected)


def lora_model(targets: list[str]) -> peft.PeftModel:
    model = decode_model("llama")
    config = peft.LoraConfig(r=4, lora_alpha=8, target_modules=targets, init_lora_weights=False)
    return peft.get_peft_model(model, config)


@pytest.mark.parametrize("prompt", [9, 20], ids=["decode-prefill", "sdpa-prefill"])
def test_lora_projections_run_as_modules(path, prompt):
    """An active adapter on q_proj, v_proj and down_proj: those run as PEFT's modules inside the fused step and the
    fused prefill attention (the report names them), the rest fused, and the tokens equal the unpatched adapted
    model's."""
    model = lora_model(["q_proj", "v_proj", "down_proj"])
    ids, mask = left_padded(prompt)
    with fuselm.use_backend("reference"):
        expected, expected_logits = generate(model, ids, mask, new_cache(model, mask))
    report = fuselm.patch(model)
    try:
        assert report.decode_module_calls == {"q_proj": 2, "v_proj": 2, "down_proj": 2}
        assert "2 × q_proj runs as its module" in str(report)
        layer = model.base_model.model.model.layers[0]
        assert decode.decode_fallbacks(layer) == ["q_proj", "v_proj", "down_proj"]
        with (mock.patch.object(decode, "qkv_rope", wraps=decode.qkv_rope) as fused_qkv,
              mock.patch.object(decode, "prefill_attention", wraps=decode.prefill_attention) as prefill):
            tokens, logits = generate(model, ids, mask, new_cache(model, mask, poisoned=True))
        assert fused_qkv.call_count == 0  # q and v run as modules, so the q/k/v kernel cannot run
        assert prefill.call_count == model.config.num_hidden_layers * (prompt > decode.DECODE_MAX_TOKENS)
    finally:
        fuselm.unpatch(model)
    assert torch.equal(tokens, expected)
    for got, want in zip(logits, expected_logits):
        assert rel_err(got, want) <= 1e-5


def test_merged_or_disabled_adapters_are_plain_again():
    model = lora_model(["q_proj", "o_proj", "gate_proj"])
    layer = model.base_model.model.model.layers[0]
    with fuselm.patched(model):
        assert decode.decode_fallbacks(layer) == ["q_proj", "o_proj", "gate_proj"]
        with model.disable_adapter():
            assert decode.decode_fallbacks(layer) == []
        model.merge_adapter()
        assert decode.decode_fallbacks(layer) == []
        ids, mask = left_padded(9)
        tokens, _ = generate(model, ids, mask, new_cache(model, mask, poisoned=True))
    expected, _ = generate(model, ids, mask, new_cache(model, mask))
    assert torch.equal(tokens, expected)


def test_hooked_projection_runs_as_its_module():
    model = decode_model("qwen2")  # q/k/v biases
    calls = []
    model.model.layers[1].mlp.up_proj.register_forward_hook(lambda *args: calls.append(1))
    with fuselm.patched(model) as report:
        assert report.decode_module_calls == {"up_proj": 1}
        ids, mask = left_padded(9)
        generate(model, ids, mask, new_cache(model, mask, poisoned=True))
    assert len(calls) == NEW


def test_unsupported_head_dim_runs_hf_attention_and_says_so():
    """A head_dim decode attention does not support (the tiny Llama's 24): the report says its layers' decode steps
    run HF's attention, the fused step never runs, and the tokens and logits equal the unpatched model's."""
    model = tiny_model("llama")
    model.generation_config.eos_token_id = None
    ids, mask = left_padded(9)
    expected, expected_logits = generate(model, ids, mask, new_cache(model, mask))
    with (fuselm.patched(model) as report,
          mock.patch.object(decode, "decode_step", wraps=decode.decode_step) as step):
        assert report.decode_unfused == {"head_dim 24 is not one decode attention supports (64, 80, 96, 128, 256)": 2}
        assert "HF's attention over fuselm's KV cache, no fused kernels" in str(report)
        tokens, logits = generate(model, ids, mask, new_cache(model, mask))
    assert step.call_count == 0
    assert torch.equal(tokens, expected)
    for got, want in zip(logits, expected_logits):
        assert rel_err(got, want) <= 1e-5


def test_hooked_attention_module_runs_through_hf(path):
    """A hook on a layer's attention module: that layer calls the module in the prefill and in every decode step
    (the hook runs each time, through HF's attention over the same cache), the other layers run fused, and the
    tokens and logits equal the unpatched model's."""
    model = decode_model("llama")
    calls = []
    model.model.layers[1].self_attn.register_forward_hook(lambda *args: calls.append(1))
    ids, mask = left_padded(20)
    with fuselm.use_backend("reference"):
        expected, expected_logits = generate(model, ids, mask, new_cache(model, mask))
    calls.clear()
    with (fuselm.patched(model) as report,
          mock.patch.object(decode, "prefill_attention", wraps=decode.prefill_attention) as prefill,
          mock.patch.object(decode, "decode_step", wraps=decode.decode_step) as step):
        assert report.decode_module_calls == {"self_attn": 1} and "1 × self_attn runs as its module" in str(report)
        tokens, logits = generate(model, ids, mask, new_cache(model, mask))
    layers = model.config.num_hidden_layers
    assert len(calls) == NEW and prefill.call_count == layers - 1 and step.call_count == (layers - 1) * (NEW - 1)
    assert torch.equal(tokens, expected)
    for got, want in zip(logits, expected_logits):
        assert rel_err(got, want) <= 1e-5


def test_output_capturing_hooks_count_only_while_a_forward_captures():
    """transformers' output-capturing hooks, which one forward asking for attentions leaves on every decoder layer
    and attention module, keep no layer off the fused decode step while nothing captures; a forward that captures
    attentions (asked for by the config: the layers never see the flag) runs HF's attention, hooks and all, and
    returns the unpatched model's attentions."""
    model = decode_model("llama")
    model.config._attn_implementation = "eager"  # HF captures attentions with eager attention only
    ids, mask = left_padded(9)

    def attentions():
        model.config.output_attentions = True
        try:
            with torch.no_grad():
                return model(ids, attention_mask=mask, **{CACHE_ARG: new_cache(model, mask)}).attentions
        finally:
            model.config.output_attentions = False

    expected_attentions = attentions()  # installs the hooks
    assert model.model.layers[0].self_attn._forward_hooks
    expected, expected_logits = generate(model, ids, mask, new_cache(model, mask))
    with fuselm.patched(model), mock.patch.object(decode, "decode_step", wraps=decode.decode_step) as step:
        tokens, logits = generate(model, ids, mask, new_cache(model, mask))
        assert step.call_count == model.config.num_hidden_layers * NEW  # a 9-token prefill takes the step too
        got_attentions = attentions()
        assert step.call_count == model.config.num_hidden_layers * NEW
    assert torch.equal(tokens, expected)
    for got, want in zip(logits, expected_logits):
        assert rel_err(got, want) <= 1e-5
    assert len(got_attentions) == len(expected_attentions) == model.config.num_hidden_layers
    for got, want in zip(got_attentions, expected_attentions):
        assert rel_err(got, want) <= 1e-5


def test_training_mode_and_unsupported_head_dims_take_hf_layers():
    model = tiny_model("llama", head_dim=24)  # decode_attention has no kernel for head_dim 24
    ids, mask = left_padded(9)
    with fuselm.patched(model), mock.patch.object(decode, "decode_step") as step:
        generate(model, ids, mask, new_cache(model, mask))
        model.train()
        positions = torch.zeros(1, 1, dtype=torch.long, device=DEVICE)
        model.model.layers[0](torch.randn(3, 1, model.config.hidden_size, device=DEVICE),
                              position_embeddings=model.model.rotary_emb(torch.zeros(1, device=DEVICE), positions),
                              position_ids=positions,
                              **{CACHE_ARG: new_cache(model, mask)})
    assert step.call_count == 0


@pytest.mark.gpu
@pytest.mark.skipif(not HAS_CUDA, reason="needs a CUDA GPU")
@pytest.mark.parametrize("name", ["llama", "qwen3", "gemma2"])
def test_layer_step_replays_in_a_cuda_graph(name):
    """One fused decode step of a layer captured once and replayed at other lengths and positions equals eager
    (bf16), and the replays write the same cache."""
    model = decode_model(name, torch.bfloat16)
    fuselm.patch(model)
    layer, rotary = model.model.layers[0], model.model.rotary_emb
    batch, hidden = 4, model.config.hidden_size
    cache = FusedKVCache(model, batch, 256)
    for buffer in cache.buffers(0):
        buffer.normal_()
    x = torch.randn(batch, 1, hidden, device=DEVICE, dtype=torch.bfloat16)
    positions = torch.zeros(batch, 1, dtype=torch.long, device=DEVICE)
    ends = cache.lengths()[1]

    def step():
        cos, sin = rotary(x, positions)
        return layer(x, position_embeddings=(cos, sin), attention_mask=None, position_ids=positions,
                     **{CACHE_ARG: cache})

    def set_lengths(end: list[int], pad: list[int]):
        ends.copy_(torch.tensor(end, device=DEVICE) - 1)  # the step advances to end
        positions.copy_(torch.tensor([e - 1 - p for e, p in zip(end, pad)], device=DEVICE)[:, None])

    with torch.no_grad():
        set_lengths([8] * batch, [0] * batch)
        step()  # warm-up: every autotune finishes before capture
        torch.cuda.synchronize()
        graph = torch.cuda.CUDAGraph()
        set_lengths([8] * batch, [0] * batch)
        with torch.cuda.graph(graph):
            out = step()
        for end, pad in (([17, 40, 100, 256], [0, 3, 50, 0]), ([5, 129, 64, 200], [1, 0, 0, 7])):
            x.normal_()
            saved = [t.clone() for t in cache.buffers(0)]
            set_lengths(end, pad)
            graph.replay()
            replayed, replayed_cache = out.clone(), [t.clone() for t in cache.buffers(0)]
            for buffer, kept in zip(cache.buffers(0), saved):
                buffer.copy_(kept)
            set_lengths(end, pad)
            eager = step()
            assert rel_err(replayed, eager) <= 1e-6
            for got, expected in zip(replayed_cache, cache.buffers(0)):
                assert torch.equal(got, expected)
    fuselm.unpatch(model)
