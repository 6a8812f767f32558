"""QLoRA: fuselm.patch on a bitsandbytes 4-bit model (NF4, double quantisation, bf16 compute) with PEFT LoRA: the
4-bit projections run bitsandbytes' kernels, the LoRA branches fuselm's; the same training as unpatched. On a GPU
through the Triton path; on CPU (bitsandbytes' CPU backend runs 4-bit since 0.46) through fuselm's PyTorch
references, as the other bf16 training tests do there: Triton's interpreter rounds fp32 -> bf16 toward zero, which
bf16 training amplifies (through it one step's gradients were 6.4 % off unpatched, 3.6 % through the references).
Without bitsandbytes the tests skip."""

import pytest
import torch

import fuselm
from fuselm.ops import lora as lora_op
from tests.conftest import DEVICE, HAS_CUDA
from tests.helpers import rel_err
from tests.models import tiny_model, token_ids
from tests.patching.test_training import ALL_LINEARS, curve_distance

BACKEND = "triton" if HAS_CUDA else "reference"


def qlora_model(tmp_path):
    """A tiny Llama (sizes that bitsandbytes' 64-element blocks divide) saved and loaded in 4 bits, with LoRA (fp32
    adapters, random B) on every projection."""
    bnb = pytest.importorskip("bitsandbytes")
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM, BitsAndBytesConfig

    tiny_model("llama", hidden_size=128, intermediate_size=256, head_dim=32).save_pretrained(tmp_path)
    quantisation = BitsAndBytesConfig(load_in_4bit=True, bnb_4bit_quant_type="nf4", bnb_4bit_use_double_quant=True,
                                      bnb_4bit_compute_dtype=torch.bfloat16)
    base = AutoModelForCausalLM.from_pretrained(tmp_path, quantization_config=quantisation, dtype=torch.bfloat16,
                                                device_map={"": DEVICE})
    torch.manual_seed(7)
    model = get_peft_model(base, LoraConfig(r=4, lora_alpha=8, target_modules=ALL_LINEARS, init_lora_weights=False))
    assert isinstance(model.base_model.model.model.layers[0].self_attn.q_proj.base_layer, bnb.nn.Linear4bit)
    return model.train()


def fine_tune(model, steps):
    optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=3e-3)
    batches = [token_ids(2, 8, seed=100 + i) for i in range(5)]
    losses, first_grads = [], {}
    for step in range(steps):
        ids = batches[step % len(batches)]
        loss = model(input_ids=ids, labels=ids).loss
        loss.backward()
        if step == 0:
            first_grads = {n: p.grad.float().clone() for n, p in model.named_parameters() if p.grad is not None}
        optimizer.step()
        optimizer.zero_grad()
        losses.append(loss.item())
    return torch.tensor(losses), first_grads


def test_qlora_patched_trains_like_unpatched(tmp_path, monkeypatch):
    calls = []
    original = lora_op.LORA_ADD
    monkeypatch.setattr(lora_op, "LORA_ADD", lambda *args: calls.append(1) or original(*args))
    expected_losses, expected_grads = fine_tune(qlora_model(tmp_path / "unpatched"), steps=30)
    model = qlora_model(tmp_path / "patched")
    report = fuselm.patch(model)
    assert (report["lora"].patched, report["lora"].total) == (14, 14), str(report)
    assert report["rms_norm"].patched == 5 and report["mlp"].patched == 2 and report["loss"].patched == 1
    with fuselm.use_backend(BACKEND):
        losses, grads = fine_tune(model, steps=30)
    # per layer: q with k and v, o, gate with up, down; the reference backend leaves the branches to PEFT
    assert len(calls) == (30 * 2 * 4 if BACKEND == "triton" else 0)
    assert grads.keys() == expected_grads.keys()
    worst = max(rel_err(grads[n], expected_grads[n]) for n in grads)
    assert worst <= 5e-2, f"first-step adapter gradients vs unpatched QLoRA: {worst:.3g}"
    per_pass, expected_per_pass = losses.view(-1, 5).mean(1), expected_losses.view(-1, 5).mean(1)
    assert expected_per_pass[-1] < 0.8 * expected_per_pass[0], "the run must actually learn"
    assert curve_distance(per_pass, expected_per_pass) <= 3e-2
