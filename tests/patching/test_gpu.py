"""A Llama-3.1-shaped model at a size where the kernels tile for real: patched vs unpatched on a GPU."""

import pytest
import torch
from transformers import AutoConfig, AutoModelForCausalLM

import fuselm
from tests.helpers import rel_err

pytestmark = pytest.mark.gpu

ROPE = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
        "original_max_position_embeddings": 1024}


def llama_shaped(dtype):
    config = AutoConfig.for_model("llama", vocab_size=32000, hidden_size=2048, intermediate_size=5632,
                                  num_hidden_layers=2, num_attention_heads=16, num_key_value_heads=4, head_dim=128,
                                  max_position_embeddings=4096, rope_scaling=ROPE, tie_word_embeddings=False,
                                  pad_token_id=0, bos_token_id=1, eos_token_id=2)
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if "norm" in name:
                param.add_(0.3 * torch.randn_like(param))
    return model.to("cuda", dtype)


def ids(batch, seq_len, seed=0):
    return torch.randint(3, 32000, (batch, seq_len), generator=torch.Generator().manual_seed(seed)).cuda()


def logits_and_training_step(model, tokens):
    """Eval-mode logits, then one training step's loss and gradients (a patched model in training
    computes the loss without materialising logits, so they are taken separately)."""
    with torch.no_grad():
        logits = model.eval()(tokens, use_cache=False).logits.float()
    model.train().zero_grad(set_to_none=True)
    loss = model(tokens, labels=tokens, use_cache=False).loss
    loss.backward()
    return logits, loss.detach().float(), {n: p.grad.float() for n, p in model.named_parameters()}


@pytest.mark.parametrize("dtype,tolerance", [(torch.float32, 1e-5), (torch.bfloat16, 2e-2)])
def test_gpu_forward_and_backward_match_unpatched(dtype, tolerance):
    model = llama_shaped(dtype)
    tokens = ids(2, 1000)
    expected_logits, expected_loss, expected_grads = logits_and_training_step(model, tokens)
    fuselm.patch(model)
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:  # op records only
        logits, loss, grads = logits_and_training_step(model, tokens)
    ran = {e.name for e in prof.events()}
    assert {"fuselm::rms_norm", "fuselm::add_rms_norm", "fuselm::rope", "fuselm::glu",
            "fuselm::linear_cross_entropy"} <= ran
    assert rel_err(logits, expected_logits) <= tolerance
    assert rel_err(loss, expected_loss) <= tolerance
    for name, grad in grads.items():
        assert rel_err(grad, expected_grads[name]) <= 5 * tolerance, name


@pytest.mark.parametrize("cache", ["dynamic", "static"])
def test_gpu_greedy_generate_matches_unpatched(cache):
    model = llama_shaped(torch.float32).eval()
    model.generation_config.eos_token_id = None
    tokens = ids(4, 37, seed=1)
    mask = torch.ones_like(tokens)
    mask[0, :11] = 0
    mask[2, :3] = 0
    tokens = tokens.masked_fill(mask == 0, 0)
    kwargs = dict(attention_mask=mask, max_new_tokens=24, do_sample=False, cache_implementation=cache, pad_token_id=0)
    expected = model.generate(tokens, **kwargs)
    fuselm.patch(model)
    assert torch.equal(model.generate(tokens, **kwargs), expected)
