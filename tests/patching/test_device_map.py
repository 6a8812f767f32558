"""A tiny Llama spread over two GPUs by ``device_map``: patched, it gives unpatched logits and greedy tokens,
with HF's cache and with fuselm's FusedKVCache (each layer's buffers on that layer's GPU)."""

import pytest
import torch
from transformers import AutoModelForCausalLM

import fuselm
from fuselm.generation import FusedKVCache
from tests.generation.test_cache import CACHE_ARG
from tests.helpers import rel_err
from tests.models import tiny_config

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs two CUDA devices")]

LAYERS = 4
# head_dim 64: one decode_attention supports, so a patched layer given a FusedKVCache takes the fused decode step
SIZES = {"num_hidden_layers": LAYERS, "hidden_size": 256, "intermediate_size": 512, "num_attention_heads": 4,
         "num_key_value_heads": 2, "head_dim": 64, "vocab_size": 1000, "max_position_embeddings": 128}
SPLIT = {"model.embed_tokens": 0, "model.rotary_emb": 0, "model.layers.0": 0, "model.layers.1": 0,
         "model.layers.2": 1, "model.layers.3": 1, "model.norm": 1, "lm_head": 1}


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(tiny_config("llama", **SIZES))
    with torch.no_grad():
        for name, param in model.named_parameters():
            if "norm" in name:
                param.add_(0.3 * torch.randn_like(param))
    path = tmp_path_factory.mktemp("tiny-llama")
    model.save_pretrained(path)
    return path


def _load(path, device_map):
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32, device_map=device_map).eval()
    model.generation_config.eos_token_id = None  # always max_new_tokens
    return model


def _layer_devices(model) -> set[torch.device]:
    return {next(layer.parameters()).device for layer in model.model.layers}


def _inputs():
    ids = torch.randint(3, 1000, (3, 21), generator=torch.Generator().manual_seed(1)).cuda(0)
    mask = torch.ones_like(ids)
    mask[0, :7] = 0
    return ids.masked_fill(mask == 0, 0), mask


def _greedy(model, ids, mask, **kwargs):
    return model.generate(ids, attention_mask=mask, max_new_tokens=16, do_sample=False, pad_token_id=0,
                          disable_compile=True, **kwargs)


def _max_memory_for_half(path) -> dict:
    """max_memory that makes device_map="auto" put about half of the model on GPU 0 and the rest on GPU 1."""
    total = sum(p.numel() * 4 for p in AutoModelForCausalLM.from_pretrained(path).parameters())
    return {0: total // 2, 1: 4 * total}


@pytest.mark.parametrize("placement", ["auto", "explicit"])
def test_a_model_split_over_two_gpus_patches_and_decodes_like_unpatched(checkpoint, placement):
    ids, mask = _inputs()
    whole = _load(checkpoint, {"": 0})
    with torch.no_grad():
        expected_logits = whole(ids, attention_mask=mask).logits
    expected_tokens = _greedy(whole, ids, mask)
    if placement == "auto":
        model = AutoModelForCausalLM.from_pretrained(checkpoint, dtype=torch.float32, device_map="auto",
                                                     max_memory=_max_memory_for_half(checkpoint)).eval()
        model.generation_config.eos_token_id = None
    else:
        model = _load(checkpoint, SPLIT)
    assert _layer_devices(model) == {torch.device("cuda:0"), torch.device("cuda:1")}, model.hf_device_map
    report = fuselm.patch(model)
    assert report["rms_norm"].patched and report["mlp"].patched, report
    with torch.no_grad():
        logits = model(ids, attention_mask=mask).logits
    assert rel_err(logits, expected_logits) <= 1e-5
    assert torch.equal(_greedy(model, ids, mask).to(expected_tokens.device), expected_tokens)
    cache = FusedKVCache(model, ids.shape[0], ids.shape[1] + 16)
    assert [cache.buffers(i)[0].device for i in range(LAYERS)] == [
        next(layer.parameters()).device for layer in model.model.layers]
    cache.plan(mask)
    assert torch.equal(_greedy(model, ids, mask, **{CACHE_ARG: cache}).to(expected_tokens.device), expected_tokens)


def test_patched_before_dispatch_takes_the_fused_decode_step_on_both_gpus(checkpoint):
    """Patched first, then dispatched: accelerate's hooks call the fused layers, which run the fused decode step
    with each layer's cache on its own GPU."""
    from accelerate import dispatch_model

    ids, mask = _inputs()
    whole = _load(checkpoint, {"": 0})
    expected_tokens = _greedy(whole, ids, mask)
    model = AutoModelForCausalLM.from_pretrained(checkpoint, dtype=torch.float32).eval()
    model.generation_config.eos_token_id = None
    fuselm.patch(model)
    model = dispatch_model(model, SPLIT)
    cache = FusedKVCache(model, ids.shape[0], ids.shape[1] + 16)
    cache.plan(mask)
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:  # op records only
        tokens = _greedy(model, ids, mask, **{CACHE_ARG: cache})
    assert torch.equal(tokens.to(expected_tokens.device), expected_tokens)
    ran = {e.name for e in prof.events()}
    assert {"fuselm::decode_attention", "fuselm::qkv_rope"} <= ran
