"""Training with a patched model: gradient checkpointing, PEFT LoRA (before or after get_peft_model),
a LoRA convergence run patched vs unpatched, HF Trainer and TRL SFTTrainer."""

import pytest
import torch
from peft import LoraConfig, get_peft_model

import fuselm
from tests.helpers import rel_err, train_lora_steps
from tests.models import VOCAB, tiny_model, token_ids
from tests.patching.test_families import assert_same_training_step, loss_logits_grads

ALL_LINEARS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
PHI3_LINEARS = ["qkv_proj", "o_proj", "gate_up_proj", "down_proj"]


# ----------------------------------------------------------------------------------- checkpointing
@pytest.mark.parametrize("name", ["llama", "gemma3", "phi3"])
@pytest.mark.parametrize("reentrant", [False, True])
def test_gradient_checkpointing_recomputes_and_gives_the_same_gradients(path, name, reentrant):
    model = tiny_model(name).train()
    ids = token_ids()
    expected = loss_logits_grads(model, ids)
    fuselm.patch(model)
    model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": reentrant})
    calls = []
    for layer in model.model.layers:
        layer.self_attn.register_forward_pre_hook(lambda module, args: calls.append(module))
    got = loss_logits_grads(model, ids)
    layers = list(model.model.layers)
    # the logits forward, the training forward, and the training forward again in backward (without
    # checkpointing it would be 2)
    assert len(calls) == 3 * len(layers), "each patched layer must run once more in backward"
    assert all(calls.count(layer.self_attn) == 3 for layer in layers)
    assert_same_training_step(got, expected, tolerance=1e-6)


# ----------------------------------------------------------------------------------- PEFT
def lora_model(name, targets, modules_to_save=None, patch_first=False, dtype=torch.float32):
    base = tiny_model(name, dtype=dtype).train()
    if patch_first:
        fuselm.patch(base)
    torch.manual_seed(7)
    config = LoraConfig(r=4, lora_alpha=8, target_modules=targets, modules_to_save=modules_to_save,
                        init_lora_weights=False)  # random B as well as A, so LoRA changes the output
    model = get_peft_model(base, config)
    with torch.no_grad():
        for param_name, param in model.named_parameters():
            if "modules_to_save" in param_name:  # trained copies of the norms differ from the originals
                param.add_(0.2 * torch.randn_like(param))
    return model


def trainable_grads(model, ids):
    model.zero_grad(set_to_none=True)
    logits = model(input_ids=ids).logits.detach()  # without labels: the fused loss computes no logits
    model(input_ids=ids, labels=ids).loss.backward()
    return logits, {n: p.grad.clone() for n, p in model.named_parameters() if p.requires_grad}


PEFT_CASES = {  # family, LoRA targets (None: PEFT's default, q_proj and v_proj), norms trained as modules_to_save
    "llama-default-q-v": ("llama", None, None),
    "qwen3-all-linears": ("qwen3", ALL_LINEARS, None),
    "mistral-o-up-down": ("mistral", ["o_proj", "up_proj", "down_proj"], None),
    "gemma3-k-gate-and-norms": ("gemma3", ["k_proj", "gate_proj"],
                                ["input_layernorm", "pre_feedforward_layernorm", "norm"]),
    "phi3-packed-and-norms": ("phi3", PHI3_LINEARS, ["post_attention_layernorm"]),
}


@pytest.mark.parametrize("case", list(PEFT_CASES))
@pytest.mark.parametrize("order", ["patch-then-peft", "peft-then-patch"])
def test_lora_and_disabled_adapter_match_unpatched(path, case, order):
    name, targets, modules_to_save = PEFT_CASES[case]
    ids = token_ids()
    with torch.no_grad():
        base_logits = tiny_model(name)(ids).logits
    model = lora_model(name, targets, modules_to_save, patch_first=order == "patch-then-peft")
    if order == "peft-then-patch":
        expected = trainable_grads(model, ids)
        report = fuselm.patch(model)
        assert report["rope"].patched == report["mlp"].patched == 2
    got = trainable_grads(model, ids)
    with torch.no_grad(), model.disable_adapter():
        disabled = model(input_ids=ids).logits
    if order == "patch-then-peft":
        assert fuselm.unpatch(model) > 0
        expected = trainable_grads(model, ids)
    assert rel_err(got[0], expected[0]) <= 1e-6
    assert got[1].keys() == expected[1].keys() and any("lora_B" in n for n in got[1])
    for param_name, grad in got[1].items():
        assert rel_err(grad, expected[1][param_name]) <= 1e-5, param_name
    assert rel_err(disabled, base_logits) <= 1e-6
    assert rel_err(expected[0], base_logits) > 1e-2  # the adapter does change the model


# ----------------------------------------------------------------------------------- convergence
def lora_fine_tune(dtype, patch, steps=30, first_grads=None):
    """LoRA (fp32 adapters) on every linear of a tiny Llama whose weights are ``dtype``, for ``steps`` AdamW
    steps; returns (losses, LoRA weights). ``first_grads``, a dict, receives the first step's LoRA gradients."""
    model = lora_model("llama", ALL_LINEARS, dtype=dtype)
    if patch:
        fuselm.patch(model)
    return train_lora_steps(model, steps, first_grads)


def curve_distance(losses, expected_losses):
    return ((losses - expected_losses).abs() / expected_losses).max().item()


def weight_distance(weights, expected_weights):
    return max(rel_err(weights[n], expected_weights[n]) for n in weights)


@pytest.mark.slow
def test_lora_convergence_in_fp32_through_the_triton_kernels():
    expected_losses, expected_weights = lora_fine_tune(torch.float32, patch=False)
    with fuselm.use_backend("triton"):
        losses, weights = lora_fine_tune(torch.float32, patch=True)
    assert expected_losses[-5:].mean() < 0.8 * expected_losses[:5].mean(), "the run must actually learn"
    assert curve_distance(losses, expected_losses) <= 5e-5
    assert weight_distance(weights, expected_weights) <= 2e-4


@pytest.mark.parametrize("backend", [
    "reference",  # on CPU: Triton's interpreter rounds fp32 -> bf16 toward zero, GPUs to nearest even
    pytest.param("triton", marks=pytest.mark.gpu),
])
def test_lora_convergence_in_bf16_stays_within_bf16_noise(backend):
    """bf16 training is chaotic: runs whose arithmetic differs in the last bit drift apart by an amount
    that depends on the hardware (one step of the unpatched bf16 run on an H200 was 6 % off fp32).
    So: one step's gradients must be as accurate as HF's own bf16 ones (against fp32), and the loss
    curve, averaged over each pass through the 5 batches, and the final weights must stay near the
    unpatched bf16 run."""
    fp32_grads, expected_grads, got_grads = {}, {}, {}
    lora_fine_tune(torch.float32, patch=False, steps=1, first_grads=fp32_grads)
    expected_losses, expected_weights = lora_fine_tune(torch.bfloat16, patch=False, first_grads=expected_grads)
    with fuselm.use_backend(backend):
        losses, weights = lora_fine_tune(torch.bfloat16, patch=True, first_grads=got_grads)
    expected_error = max(rel_err(expected_grads[n], fp32_grads[n]) for n in fp32_grads)
    error = max(rel_err(got_grads[n], fp32_grads[n]) for n in fp32_grads)
    assert error <= 1.5 * expected_error, f"first-step gradients vs fp32: {error:.3g}, HF bf16's {expected_error:.3g}"
    per_pass, expected_per_pass = losses.view(-1, 5).mean(1), expected_losses.view(-1, 5).mean(1)
    assert expected_per_pass[-1] < 0.8 * expected_per_pass[0], "the run must actually learn"
    assert curve_distance(per_pass, expected_per_pass) <= 3e-2
    assert weight_distance(weights, expected_weights) <= 1e-1


# ----------------------------------------------------------------------------------- trainers
class TokenDataset(torch.utils.data.Dataset):
    def __init__(self, rows=8, seq_len=10):
        self.ids = token_ids(rows, seq_len, seed=11)

    def __len__(self):
        return len(self.ids)

    def __getitem__(self, i):
        return {"input_ids": self.ids[i], "labels": self.ids[i]}


def train_with_hf_trainer(tmp_path, patch):
    from transformers import Trainer, TrainingArguments

    model = tiny_model("qwen3").train()
    if patch:
        fuselm.patch(model)  # the documented one-liner, before building the trainer
    args = TrainingArguments(output_dir=str(tmp_path), max_steps=4, per_device_train_batch_size=2, learning_rate=1e-3,
                             logging_steps=1, save_strategy="no", report_to=[], use_cpu=True, seed=3,
                             gradient_checkpointing=True)
    trainer = Trainer(model=model, args=args, train_dataset=TokenDataset())
    trainer.train()
    losses = [entry["loss"] for entry in trainer.state.log_history if "loss" in entry]
    return torch.tensor(losses), {n: p.detach().clone() for n, p in model.named_parameters()}


def test_hf_trainer_with_gradient_checkpointing_trains_like_unpatched(tmp_path):
    expected_losses, expected_weights = train_with_hf_trainer(tmp_path / "unpatched", patch=False)
    losses, weights = train_with_hf_trainer(tmp_path / "patched", patch=True)
    assert len(losses) == 4
    assert rel_err(losses, expected_losses) <= 1e-5
    assert all(rel_err(weights[n], expected_weights[n]) <= 1e-5 for n in weights)


def train_with_sft_trainer(tmp_path, patch, bf16):
    trl = pytest.importorskip("trl")
    from datasets import Dataset
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {f"t{i}": i for i in range(VOCAB)}
    backend = Tokenizer(models.WordLevel(vocab, unk_token="t3"))
    backend.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=backend, pad_token="t0", bos_token="t1", eos_token="t2",
                                        unk_token="t3")
    texts = [" ".join(f"t{int(i)}" for i in row) for row in token_ids(8, 10, seed=13)]
    model = tiny_model("gemma3").train()
    if patch:
        fuselm.patch(model)  # the documented one-liner, before building the trainer
    args = trl.SFTConfig(output_dir=str(tmp_path), max_steps=3, per_device_train_batch_size=2, learning_rate=1e-3,
                         logging_steps=1, save_strategy="no", report_to=[], use_cpu=True, seed=3, max_length=16,
                         bf16=bf16)  # SFTConfig's default: bf16 autocast
    trainer = trl.SFTTrainer(model=model, args=args, train_dataset=Dataset.from_dict({"text": texts}),
                             processing_class=tokenizer)
    trainer.train()
    return torch.tensor([entry["loss"] for entry in trainer.state.log_history if "loss" in entry])


@pytest.mark.parametrize("bf16,tolerance", [(False, 1e-5), (True, 4e-3)])  # bf16: one rounding of bf16
def test_trl_sft_trainer_trains_like_unpatched(tmp_path, bf16, tolerance):
    expected = train_with_sft_trainer(tmp_path / "unpatched", patch=False, bf16=bf16)
    got = train_with_sft_trainer(tmp_path / "patched", patch=True, bf16=bf16)
    assert len(got) == 3
    assert rel_err(got, expected) <= tolerance
