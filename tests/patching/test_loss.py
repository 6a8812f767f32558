"""The fused causal-LM loss (fuselm/patching/loss.py): the patched model's loss and every parameter's
gradient equal HF's (unpatched, float64) in each semantic of HF's forward; it falls back to HF's forward
wherever it cannot honour one (LoRA / modules_to_save on lm_head, eval, no grad, tuples, hooks), and
logits, generate, Trainer and PEFT see what they saw before."""

import contextlib
import copy
import inspect

import pytest
import torch
from peft import LoraConfig, get_peft_model
from transformers import DynamicCache, Trainer, TrainingArguments, default_data_collator, modeling_utils

import fuselm
from fuselm.patching import loss as fused_loss
from fuselm.patching.loss import fused_causal_lm_class, loss_unsupported_reason
from tests.conftest import DEVICE
from tests.helpers import rel_err
from tests.models import VOCAB, tiny_model, token_ids

SEMANTICS_FAMILIES = ["llama", "qwen2", "gemma2", "phi3"]  # every semantic of HF's loss in these
# Gemma 2's cap small enough to bend the tiny model's logits (std ~1), so a missing cap would show.
OVERRIDES = {"gemma2": dict(final_logit_softcapping=1.5)}
FP32 = 1e-5  # relative error of fp32 against HF in float64


@contextlib.contextmanager
def fused(model):
    """``model`` (a *ForCausalLM) with its class swapped to the fused one inside the block, as patch() does."""
    original = type(model)
    model.__class__ = fused_causal_lm_class(original)
    try:
        yield model
    finally:
        model.__class__ = original


@pytest.fixture
def fused_calls(monkeypatch):
    """The (hidden dtype, weight dtype) of each linear_cross_entropy call the fused path makes."""
    calls = []
    real = fused_loss.linear_cross_entropy

    def recording(hidden, weight, *args, **kwargs):
        calls.append((hidden.dtype, weight.dtype))
        return real(hidden, weight, *args, **kwargs)

    monkeypatch.setattr(fused_loss, "linear_cross_entropy", recording)
    return calls


def training_model(name, **overrides):
    return tiny_model(name, **{**OVERRIDES.get(name, {}), **overrides}).train()


def loss_and_grads(model, **inputs):
    model.zero_grad(set_to_none=True)
    out = model(**inputs)
    out.loss.backward()
    return out, {name: p.grad for name, p in model.named_parameters() if p.requires_grad}


def assert_same_loss_and_grads(got, expected, tolerance=FP32):
    (out, grads), (ref_out, ref_grads) = got, expected
    err = rel_err(out.loss, ref_out.loss)
    assert err <= tolerance, f"loss {out.loss.item()} vs HF {ref_out.loss.item()}: relative error {err:.2e}"
    assert grads.keys() == ref_grads.keys()
    for name, ref in ref_grads.items():
        if ref is None:
            assert grads[name] is None, name
            continue
        assert grads[name] is not None, f"{name}: no gradient"
        err = rel_err(grads[name], ref)
        assert err <= tolerance, f"{name}: gradient relative error {err:.2e}"


def hf_float64(model):
    """An unpatched float64 copy: the oracle. (HF's loss casts its float64 logits to fp32, so the oracle's
    loss and d logits carry fp32 rounding, ~1e-7 relative: far below the tolerance.)"""
    return copy.deepcopy(model).double()


def case_inputs(case, ids):
    """The forward's keyword arguments for one semantic of HF's causal-LM loss; ids: [2, 9]."""
    masked = ids.clone()
    masked[0, :3] = -100
    masked[1, 4:6] = -100
    if case == "labels":
        return dict(input_ids=ids, labels=ids)
    if case == "ignored":
        return dict(input_ids=ids, labels=masked)
    if case == "shift_labels":  # used as given, not shifted again, not the labels
        shift = token_ids(seed=7).to(ids.device)
        shift[:, -2:] = -100
        return dict(input_ids=ids, labels=ids, shift_labels=shift)
    if case == "num_items_int":
        return dict(input_ids=ids, labels=masked, num_items_in_batch=23)
    if case == "num_items_tensor":
        return dict(input_ids=ids, labels=masked, num_items_in_batch=torch.tensor(23, device=ids.device))
    if case == "logits_to_keep":
        return dict(input_ids=ids, labels=ids[:, -5:], logits_to_keep=5)
    if case == "logits_to_keep_positions":
        positions = torch.tensor([1, 4, 5, 8], device=ids.device)
        return dict(input_ids=ids, labels=ids[:, positions], logits_to_keep=positions)
    if case == "ignore_index":
        return dict(input_ids=ids, labels=masked.masked_fill(masked == -100, -1), ignore_index=-1)
    if case == "padded":  # right padding: left padding gives fully masked rows, NaN in HF's float64 eager
        attention_mask = torch.ones_like(ids)
        attention_mask[1, -3:] = 0
        return dict(input_ids=ids, attention_mask=attention_mask, labels=ids.masked_fill(attention_mask == 0, -100))
    raise ValueError(case)


CASES = ["labels", "ignored", "shift_labels", "num_items_int", "num_items_tensor", "logits_to_keep",
         "logits_to_keep_positions", "ignore_index", "padded"]


# ----------------------------------------------------------------------------------- HF's semantics
@pytest.mark.parametrize("name", SEMANTICS_FAMILIES)
@pytest.mark.parametrize("case", CASES)
def test_loss_and_gradients_equal_hf_in_every_semantic(path, name, case, fused_calls):
    model = training_model(name)
    inputs = case_inputs(case, token_ids())
    expected = loss_and_grads(hf_float64(model), **inputs)
    with fused(model):
        got = loss_and_grads(model, **inputs)
    assert len(fused_calls) == 1, "the fused path did not run"
    assert got[0].logits is None
    assert_same_loss_and_grads(got, expected)


@pytest.mark.skipif(not hasattr(modeling_utils, "slice_logits_to_keep"), reason="needs 2-D logits_to_keep (HF >= 5.2x)")
def test_logits_to_keep_mask_keeps_hf_flattened_positions(path, fused_calls):
    model = training_model("llama")
    ids = token_ids()
    keep = torch.rand(ids.shape, generator=torch.Generator().manual_seed(3)).to(ids.device) < 0.6
    inputs = dict(input_ids=ids, labels=ids[keep], logits_to_keep=keep)
    expected = loss_and_grads(hf_float64(model), **inputs)
    with fused(model):
        got = loss_and_grads(model, **inputs)
    assert len(fused_calls) == 1
    assert_same_loss_and_grads(got, expected)


def test_gemma2_soft_cap_matters_in_these_tests():
    capped = training_model("gemma2")
    uncapped = copy.deepcopy(capped)
    uncapped.config.final_logit_softcapping = None
    ids = token_ids()
    with torch.no_grad():
        assert rel_err(capped(ids, labels=ids).loss, uncapped(ids, labels=ids).loss) > 1e-2


@pytest.mark.parametrize("name", ["llama3.1", "mistral", "qwen3", "gemma", "gemma3", "olmo2"])
def test_the_other_read_families_equal_hf(path, name, fused_calls):
    model = training_model(name)
    assert loss_unsupported_reason(model) is None
    inputs = case_inputs("num_items_tensor", token_ids())
    expected = loss_and_grads(hf_float64(model), **inputs)
    with fused(model):
        got = loss_and_grads(model, **inputs)
    assert len(fused_calls) == 1
    assert_same_loss_and_grads(got, expected)


def test_bfloat16_model_is_as_close_to_float64_as_hf_in_bfloat16(path, fused_calls):
    model = training_model("gemma2")
    inputs = case_inputs("ignored", token_ids())
    expected = loss_and_grads(hf_float64(model), **inputs)
    model.to(torch.bfloat16)
    hf = loss_and_grads(model, **inputs)
    with fused(model):
        got = loss_and_grads(model, **inputs)
    assert fused_calls == [(torch.bfloat16, torch.bfloat16)]
    assert got[0].loss.dtype == hf[0].loss.dtype == torch.float32
    for name in ["loss", *expected[1]]:
        def pick(run, name=name):
            return run[0].loss if name == "loss" else run[1][name]
        hf_err, err = rel_err(pick(hf), pick(expected)), rel_err(pick(got), pick(expected))
        assert err <= 2 * hf_err + 1e-3, f"{name}: relative error {err:.2e}, HF's own bf16 {hf_err:.2e}"


def test_gradient_checkpointing(path, fused_calls):
    model = training_model("qwen2")
    model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    inputs = case_inputs("num_items_int", token_ids())
    expected = loss_and_grads(hf_float64(model), **inputs)
    with fused(model):
        got = loss_and_grads(model, **inputs)
    assert len(fused_calls) == 1
    assert_same_loss_and_grads(got, expected)


@pytest.mark.parametrize("name", ["llama", "gemma2"])
def test_tied_embeddings_get_the_loss_gradient_once(path, name, fused_calls):
    model = training_model(name, tie_word_embeddings=True)
    assert model.lm_head.weight is model.model.embed_tokens.weight
    inputs = case_inputs("ignored", token_ids())
    expected = loss_and_grads(hf_float64(model), **inputs)
    with fused(model):
        got = loss_and_grads(model, **inputs)
    assert len(fused_calls) == 1
    assert "model.embed_tokens.weight" in got[1] and "lm_head.weight" not in got[1]
    assert_same_loss_and_grads(got, expected)


def test_autocast_computes_the_logits_in_the_autocast_dtype(path, fused_calls):
    model = training_model("llama")
    inputs = case_inputs("ignored", token_ids())
    with torch.autocast(torch.device(DEVICE).type, dtype=torch.bfloat16):
        hf = loss_and_grads(model, **inputs)
        with fused(model):
            got = loss_and_grads(model, **inputs)
    assert fused_calls == [(torch.bfloat16, torch.bfloat16)]  # the final norm's output is fp32 here
    expected = loss_and_grads(hf_float64(model), **inputs)
    assert_same_loss_and_grads(got, expected, tolerance=2e-2)
    assert rel_err(got[0].loss, hf[0].loss) <= 2e-3  # as close to HF's own bf16 loss as bf16 rounding allows


def test_torch_compile_fullgraph_with_the_triton_kernel():
    model = training_model("gemma2")
    inputs = dict(case_inputs("num_items_tensor", token_ids()), use_cache=False)
    expected = loss_and_grads(hf_float64(model), **inputs)
    torch._dynamo.reset()
    with fuselm.use_backend("triton"), fused(model):
        out = torch.compile(model, fullgraph=True, backend="aot_eager")(**inputs)
        out.loss.backward()
    assert out.logits is None
    assert_same_loss_and_grads((out, {name: p.grad for name, p in model.named_parameters()}), expected)


# ----------------------------------------------------------------------------------- outputs
def test_training_output_passes_the_decoder_outputs_through(path):
    model = training_model("qwen2")
    ids = token_ids()
    expected = model(ids, labels=ids, output_hidden_states=True, output_attentions=True)
    with fused(model):
        out = model(ids, labels=ids, output_hidden_states=True, output_attentions=True)
    assert type(out) is type(expected)
    assert set(out.keys()) == set(expected.keys()) - {"logits"}
    assert all(torch.equal(a, b) for a, b in zip(out.hidden_states, expected.hidden_states, strict=True))
    assert all(torch.equal(a, b) for a, b in zip(out.attentions, expected.attentions, strict=True))
    cache_name = next(key for key in expected.keys() if key in ("cache", "past_key_values"))
    assert type(out[cache_name]) is type(expected[cache_name])


def test_positional_arguments_bind_as_in_hf(path, fused_calls):
    model = training_model("phi3")
    inputs = case_inputs("padded", token_ids())
    positional = (inputs["input_ids"], inputs["attention_mask"], None, None, None, inputs["labels"])
    expected = loss_and_grads(hf_float64(model), **inputs)
    with fused(model):
        model.zero_grad(set_to_none=True)
        out = model(*positional)
        out.loss.backward()
    assert len(fused_calls) == 1
    assert_same_loss_and_grads((out, {name: p.grad for name, p in model.named_parameters()}), expected)


@pytest.mark.parametrize("keyword", ["past_key_values", "cache"])
def test_a_cache_under_either_keyword_reaches_the_decoder(path, keyword, fused_calls):
    model = training_model("llama")
    if keyword == "cache" and "cache" not in inspect.signature(type(model).forward).parameters:
        pytest.skip("this transformers names it past_key_values only")
    inputs = case_inputs("ignored", token_ids())

    def run():
        cache = DynamicCache(config=model.config)
        out = model(**inputs, use_cache=True, **{keyword: cache})
        return out.loss, cache.get_seq_length()

    expected_loss, expected_length = run()
    with fused(model):
        loss, length = run()
    assert len(fused_calls) == 1
    assert length == expected_length == 9
    assert rel_err(loss, expected_loss) <= FP32


def test_eval_no_grad_tuples_and_no_labels_run_hf_forward_unchanged(path, fused_calls):
    model = training_model("gemma2")
    ids = token_ids()

    def without_grad(**kwargs):
        with torch.no_grad():
            return model.train()(ids, **kwargs)

    calls = {
        "eval": lambda: model.eval()(ids, labels=ids),
        "no_grad": lambda: without_grad(labels=ids),
        "no_labels": lambda: model.train()(ids),
        "return_dict=False": lambda: model.train()(ids, labels=ids, return_dict=False),
    }
    for what, call in calls.items():
        expected = call()
        with fused(model):
            out = call()
        assert len(fused_calls) == 0, what
        assert type(out) is type(expected) and len(out) == len(expected), what
        if isinstance(out, tuple):  # (loss, logits, cache)
            out, expected = dict(loss=out[0], logits=out[1]), dict(loss=expected[0], logits=expected[1])
        assert torch.equal(out["logits"], expected["logits"]), what
        assert (out.get("loss") is None and expected.get("loss") is None) or torch.equal(out["loss"], expected["loss"])


@pytest.mark.parametrize("keep", [1, 3])
def test_logits_to_keep_of_a_batch_reaches_lm_head_gathered(path, keep, fused_calls):
    """Inference with an int logits_to_keep: the same logits as HF, from rows gathered contiguous (HF's slice
    is a strided view, over which cuBLAS ran the lm_head 28x slower); one row or all positions stay a slice."""
    model = training_model("llama").eval()
    ids = token_ids()  # [2, 9]
    seen = []
    handle = model.lm_head.register_forward_pre_hook(lambda module, args: seen.append(args[0].is_contiguous()))
    try:
        for case in (dict(input_ids=ids), dict(inputs_embeds=model.get_input_embeddings()(ids))):
            expected = model(**case, logits_to_keep=keep).logits
            with fused(model):
                out = model(**case, logits_to_keep=keep).logits
            assert out.shape == expected.shape == (2, keep, VOCAB)
            assert torch.equal(out, expected)
            assert seen[-2:] == [False, True]
        with fused(model):
            model(ids[:1], logits_to_keep=keep)  # one row: the slice is already contiguous
            model(ids[:, :keep], logits_to_keep=keep)  # keeps every position: no slice at all
        assert seen[-2:] == [True, True]
        model.hf_device_map = {"model": 0, "lm_head": 1}  # spread by device_map: the last hidden state is elsewhere
        expected = model(ids, logits_to_keep=keep).logits
        with fused(model):
            out = model(ids, logits_to_keep=keep).logits
        assert torch.equal(out, expected) and seen[-1] is False  # HF's own slice, as unpatched
    finally:
        handle.remove()
    assert len(fused_calls) == 0


def test_generate_is_unaffected(path, fused_calls):
    model = training_model("phi3").eval()
    prompt = token_ids(batch=2, seq_len=4)
    expected = model.generate(prompt, max_new_tokens=5, do_sample=False, pad_token_id=0)
    with fused(model):
        out = model.generate(prompt, max_new_tokens=5, do_sample=False, pad_token_id=0)
    assert torch.equal(out, expected)
    assert len(fused_calls) == 0


def test_profile_shows_the_fused_loss_in_training_and_not_in_eval():
    model = training_model("llama")
    ids = token_ids()

    def fused_ops(run):
        with torch.profiler.profile() as prof:
            run()
        return [event.name for event in prof.events() if event.name.startswith("fuselm::")]

    with fuselm.use_backend("triton"), fused(model):
        training = fused_ops(lambda: model(ids, labels=ids).loss.backward())
        evaluation = fused_ops(lambda: model.eval()(ids, labels=ids))
    assert "fuselm::linear_cross_entropy" in training
    assert evaluation == []


# ----------------------------------------------------------------------------------- PEFT
def lora_model(name, target_modules, modules_to_save=None, fuse_first=False):
    """A PEFT model whose adapters and saved copies are random (fresh LoRA B is zero: an adapter the loss
    ignored would not show); its inner *ForCausalLM fused before get_peft_model when ``fuse_first``."""
    base = training_model(name)
    if fuse_first:
        base.__class__ = fused_causal_lm_class(type(base))
    config = LoraConfig(r=4, lora_alpha=8, lora_dropout=0.0, target_modules=target_modules,
                        modules_to_save=modules_to_save)
    model = get_peft_model(base, config)
    with torch.no_grad():
        for param_name, param in model.named_parameters():
            if "lora_B" in param_name or "modules_to_save" in param_name:
                param.normal_(std=0.1)
    return model


def fuse_inner(model):
    inner = model.get_base_model()
    inner.__class__ = fused_causal_lm_class(type(inner))


def hf_peft_float64(model):
    """An unpatched float64 copy of a PEFT model whose inner model is fused: the oracle."""
    reference = copy.deepcopy(model).double()
    inner = reference.get_base_model()
    inner.__class__ = type(inner).__dict__["_fuselm_original"]
    return reference


@pytest.mark.parametrize("target_modules, modules_to_save", [
    (["q_proj", "lm_head"], None),
    (["q_proj"], ["lm_head"]),
], ids=["lora-lm_head", "modules_to_save-lm_head"])
@pytest.mark.parametrize("order", ["peft-then-fuse", "fuse-then-peft"])
def test_an_adapter_on_lm_head_is_honoured_by_falling_back(path, target_modules, modules_to_save, order, fused_calls):
    model = lora_model("llama", target_modules, modules_to_save, fuse_first=order == "fuse-then-peft")
    if order == "peft-then-fuse":
        fuse_inner(model)
    assert "lm_head is a peft." in loss_unsupported_reason(model.get_base_model())
    inputs = case_inputs("ignored", token_ids())
    expected = loss_and_grads(hf_peft_float64(model), **inputs)
    got = loss_and_grads(model, **inputs)
    assert len(fused_calls) == 0
    assert any("lm_head" in name for name in got[1])
    assert_same_loss_and_grads(got, expected)
    with model.disable_adapter(), torch.no_grad():
        assert rel_err(model(**inputs).loss, got[0].loss) > 1e-3  # the adapter changes the loss


def test_lora_elsewhere_takes_the_fused_path_with_a_frozen_head(path, fused_calls):
    model = lora_model("qwen2", ["q_proj", "v_proj", "down_proj"])
    fuse_inner(model)
    assert loss_unsupported_reason(model.get_base_model()) is None
    inputs = case_inputs("num_items_tensor", token_ids())
    expected = loss_and_grads(hf_peft_float64(model), **inputs)
    got = loss_and_grads(model, **inputs)
    assert len(fused_calls) == 1
    assert model.get_base_model().lm_head.weight.grad is None
    assert_same_loss_and_grads(got, expected)


# ----------------------------------------------------------------------------------- what falls back, and why
def test_families_whose_forward_was_not_read_are_refused():
    for name in ("cohere", "granite"):  # logit_scale / logits_scaling between lm_head and the loss
        model = tiny_model(name)
        reason = loss_unsupported_reason(model)
        assert reason == f"{type(model).__name__}.forward: family {name!r} is not in fuselm's table"
        with pytest.raises(ValueError, match="original_cls"):
            fused_causal_lm_class(type(model))
    peft_model = lora_model("llama", ["q_proj"])
    assert loss_unsupported_reason(peft_model) == (
        f"{type(peft_model).__name__}.forward is peft.peft_model.PeftModel.forward, "
        "not a transformers *ForCausalLM's")


def test_lm_head_hooks_and_a_replaced_loss_function_fall_back(path, fused_calls):
    model = training_model("llama")
    ids = token_ids()
    seen = []
    handle = model.lm_head.register_forward_hook(lambda module, args, out: seen.append(out.shape))
    assert loss_unsupported_reason(model) == "lm_head has hooks or a replaced forward"
    with fused(model):
        model(ids, labels=ids)
    handle.remove()
    assert seen == [(2, 9, VOCAB)] and len(fused_calls) == 0

    model.loss_function = lambda logits, labels, vocab_size, **kwargs: logits.float().mean()
    assert "not ForCausalLMLoss" in loss_unsupported_reason(model)
    with fused(model):
        out = model(ids, labels=ids)
    assert len(fused_calls) == 0 and torch.equal(out.loss, out.logits.float().mean())


def test_a_forward_replaced_on_the_instance_is_reported_and_its_calls_still_fused(path, fused_calls):
    model = training_model("llama")
    with fused(model):
        inner_forward = model.forward
        model.forward = lambda *args, **kwargs: inner_forward(*args, **kwargs)
        assert "forward replaced on the instance" in loss_unsupported_reason(model)
        ids = token_ids()
        model(ids, labels=ids)
    assert len(fused_calls) == 1


def test_the_fused_class_looks_like_hf_and_unpatch_restores_it():
    model = training_model("gemma2")
    original = type(model)
    fused_class = fused_causal_lm_class(original)
    assert fused_causal_lm_class(original) is fused_class and fused_causal_lm_class(fused_class) is fused_class
    assert fused_class.__name__ == original.__name__ and fused_class.__module__ == original.__module__
    assert inspect.signature(fused_class.forward) == inspect.signature(original.forward)
    model.__class__ = fused_class
    assert fuselm.unpatch(model) >= 1 and type(model) is original


# ----------------------------------------------------------------------------------- HF Trainer
TRAIN_IDS = token_ids(batch=4, seq_len=9, seed=5).cpu()
TRAIN_LABELS = TRAIN_IDS.clone()
TRAIN_LABELS[0, :6] = -100  # unequal counts per micro-batch: a per-micro-batch mean would weigh them wrongly
TRAIN_LABELS[3, 2:4] = -100


def trainer_run(model, tmp_path):
    """One SGD step over 2 accumulated micro-batches of 2 (so num_items_in_batch spans both): the
    logged loss and each parameter's update."""
    datasets = pytest.importorskip("datasets")  # absent from the GPU image
    data = datasets.Dataset.from_dict({"input_ids": TRAIN_IDS.tolist(), "labels": TRAIN_LABELS.tolist(),
                                       "text": ["unused"] * 4})  # dropped by Trainer, which reads forward's signature
    args = TrainingArguments(output_dir=str(tmp_path), per_device_train_batch_size=2, gradient_accumulation_steps=2,
                             max_steps=1, learning_rate=0.5, optim="sgd", lr_scheduler_type="constant",
                             logging_steps=1, report_to=[], save_strategy="no", use_cpu=DEVICE == "cpu",
                             disable_tqdm=True, dataloader_pin_memory=False)
    before = {name: p.detach().clone() for name, p in model.named_parameters()}
    trainer = Trainer(model=model, args=args, train_dataset=data, data_collator=default_data_collator)
    trainer.train()
    updates = {name: p.detach() - before[name] for name, p in model.named_parameters()}
    return trainer.state.log_history[0]["loss"], updates


def test_hf_trainer_with_gradient_accumulation_trains_like_unpatched(path, tmp_path, monkeypatch, fused_calls):
    num_items = []
    real_loss = fused_loss._causal_lm_loss

    def recording(*args):
        num_items.append(args[4])
        return real_loss(*args)

    monkeypatch.setattr(fused_loss, "_causal_lm_loss", recording)
    model = training_model("llama")
    expected_loss, expected = trainer_run(copy.deepcopy(model), tmp_path / "hf")
    with fused(model):
        loss, got = trainer_run(model, tmp_path / "fused")
    assert len(fused_calls) == 2
    counted = int((TRAIN_LABELS[:, 1:] != -100).sum())  # the whole accumulated batch, in each micro-batch
    assert [int(n) for n in num_items] == [counted, counted]
    assert rel_err(torch.tensor(loss), torch.tensor(expected_loss)) <= FP32
    for name, update in expected.items():
        assert rel_err(got[name], update) <= FP32, name
