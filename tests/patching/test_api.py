"""fuselm.patch / unpatch / patched: the report, instance-only changes, what stays as it was, recognition
of families and modules nobody listed, profiling, torch.compile and the FUSELM_BACKEND switch."""

import copy
import gc
import os
import pickle
import subprocess
import sys
import weakref

import pytest
import torch
from torch import nn
from transformers import AutoModelForCausalLM, DynamicCache
from transformers.models.llama import modeling_llama

import fuselm
from fuselm.patching import recognise
from fuselm.patching.modules import NEXT_NORM
from tests.conftest import DEVICE
from tests.helpers import rel_err
from tests.models import MIXTURE_OF_EXPERTS, UNLISTED, tiny_model, token_ids
from tests.patching.test_families import assert_same_training_step, loss_logits_grads

REPOSITORY = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

def logits(model, ids=None, **kwargs):
    with torch.no_grad():
        return model(token_ids() if ids is None else ids, **kwargs).logits


def fused_op_counts(run):
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:  # op records only
        run()
    counts = {}
    for event in prof.events():
        if event.name.startswith("fuselm::"):
            counts[event.name] = counts.get(event.name, 0) + 1
    return counts


# ----------------------------------------------------------------------------------- report
def test_report_says_per_kind_what_was_left_alone_and_why():
    model = tiny_model("llama", hidden_act="relu")
    expected = logits(model)
    report = fuselm.patch(model)
    assert (report["mlp"].patched, report["mlp"].total) == (0, 2)
    assert report["mlp"].left_alone == {"hidden_act 'relu' has no fused kernel": 2}
    device = torch.device(DEVICE).type
    ops = f"PyTorch reference ({device})" if device == "cpu" else f"Triton ({torch.cuda.get_device_name()})"
    assert str(report) == "\n".join([
        f"fuselm.patch(LlamaForCausalLM) — ops: {ops}",
        "  rms_norm:      5/5",
        "  rope:          2/2",
        "  mlp:           0/2",
        "                   2 × hidden_act 'relu' has no fused kernel",
        "  decoder_layer: 2/2",
        "  loss:          1/1",
        "  decode step:   HF's attention over fuselm's KV cache, no fused kernels",  # the tiny Llama's head_dim is 24
        "                   2 × layer runs HF's attention: head_dim 24 is not one decode attention supports "
        "(64, 80, 96, 128, 256)",
    ])
    assert rel_err(logits(model), expected) <= 1e-6


@pytest.mark.parametrize("name", MIXTURE_OF_EXPERTS)
def test_mixture_of_experts_blocks_are_counted_and_left_to_hf(name):
    model = tiny_model(name)
    expected = logits(model)
    report = fuselm.patch(model)
    shared_experts = 2 if name == "qwen2_moe" else 0  # Qwen2-MoE's shared expert is a plain gated MLP
    assert (report["mlp"].patched, report["mlp"].total) == (shared_experts, 2 + shared_experts)
    assert report["mlp"].left_alone == {"mixture-of-experts block (4 experts): experts left to HF": 2}
    assert "\n                   2 × mixture-of-experts block (4 experts): experts left to HF\n" in str(report)
    assert report["rms_norm"].patched == report["rms_norm"].total > 0 and report["rope"].patched == 2
    assert rel_err(logits(model), expected) <= 1e-6


def test_a_model_with_nothing_recognised_says_so():
    report = fuselm.patch(nn.Sequential(nn.Linear(4, 4), nn.ReLU()))
    assert all(entry.total == 0 for entry in report.kinds.values())
    assert str(report).splitlines()[1:] == [
        "  nothing recognised: no module is named like an HF RMSNorm, Attention, MLP, DecoderLayer or ForCausalLM"]
    report = fuselm.patch(tiny_model("llama"), rms_norm=False, rope=False, mlp=False, loss=False)
    assert str(report).endswith("\n  nothing patched")
    assert report["decoder_layer"].left_alone == {"needs rms_norm=True": 2}


def test_gemma_exact_gelu_is_not_mistaken_for_its_tanh_approximation():
    model = tiny_model("gemma2", hidden_activation="gelu")
    report = fuselm.patch(model)
    assert report["mlp"].left_alone == {"hidden_activation 'gelu' has no fused kernel": 2}


def test_switched_off_kinds_are_left_alone_and_reported():
    model = tiny_model("qwen3")
    expected = logits(model)
    report = fuselm.patch(model, rope=False, mlp=False)
    assert report["rope"].left_alone == {"disabled by rope=False": 2}
    assert report["mlp"].left_alone == {"disabled by mlp=False": 2}
    assert report["rms_norm"].patched == 9 and report["decoder_layer"].patched == 2
    assert type(model.model.layers[0].mlp).__module__ == "transformers.models.qwen3.modeling_qwen3"
    assert model.model.layers[0].mlp not in patched_modules(model)
    assert rel_err(logits(model), expected) <= 1e-6
    report = fuselm.patch(model, rms_norm=False)
    assert report["decoder_layer"].left_alone == {"needs rms_norm=True": 2}


# ----------------------------------------------------------------------------------- instance only
def classes(model):
    return [(name, type(module)) for name, module in model.named_modules()]


def patched_modules(model):
    return [m for m in model.modules() if "_fuselm_original" in type(m).__dict__]


def test_patching_twice_is_harmless():
    model = tiny_model("gemma3")
    first = str(fuselm.patch(model))
    after_first = classes(model), logits(model)
    assert str(fuselm.patch(model)) == first
    assert classes(model) == after_first[0]
    assert torch.equal(logits(model), after_first[1])
    assert all(sum("_fuselm_original" in vars(c) for c in type(m).__mro__) == 1 for m in patched_modules(model))


def test_unpatch_restores_the_original_modules_and_outputs_bit_for_bit(path):
    model = tiny_model("phi3")
    before_classes, before_dicts = classes(model), [set(m.__dict__) for m in model.modules()]
    expected = logits(model)
    fuselm.patch(model)
    logits(model)
    assert fuselm.unpatch(model) == 5 + 2 + 2 + 2 + 1  # norms, attentions, MLPs, decoder layers, the loss
    assert classes(model) == before_classes
    assert [set(m.__dict__) for m in model.modules()] == before_dicts
    assert torch.equal(logits(model), expected)
    assert fuselm.unpatch(model) == 0


@pytest.mark.parametrize("call", [fuselm.patch, fuselm.unpatch])
def test_a_model_that_is_not_a_module_names_the_argument(call):
    with pytest.raises(TypeError, match="model must be a torch.nn.Module, got NoneType"):
        call(None)


def test_patched_context_manager_unpatches_on_exit():
    model = tiny_model("llama")
    before = classes(model)
    with fuselm.patched(model, rope=False) as report:
        assert report["rope"].patched == 0 and report["rms_norm"].patched == 5
        assert classes(model) != before
    assert classes(model) == before


def test_patching_one_model_leaves_another_and_the_hf_classes_untouched():
    hf_objects = (modeling_llama.apply_rotary_pos_emb, modeling_llama.LlamaAttention.forward,
                  modeling_llama.LlamaDecoderLayer.forward, modeling_llama.LlamaRMSNorm.forward,
                  modeling_llama.LlamaMLP.forward)
    hf_class_dicts = [dict(vars(c)) for c in (modeling_llama.LlamaAttention, modeling_llama.LlamaDecoderLayer,
                                               modeling_llama.LlamaRMSNorm, modeling_llama.LlamaMLP)]
    model_a, model_b = tiny_model("llama"), tiny_model("llama", seed=1)
    b_classes, b_logits = classes(model_b), logits(model_b)
    fuselm.patch(model_a)
    assert classes(model_b) == b_classes and not patched_modules(model_b)
    with fuselm.use_backend("triton"):
        assert fused_op_counts(lambda: logits(model_b)) == {}
        assert torch.equal(logits(model_b), b_logits)
        assert fused_op_counts(lambda: logits(model_a))
    assert (modeling_llama.apply_rotary_pos_emb, modeling_llama.LlamaAttention.forward,
            modeling_llama.LlamaDecoderLayer.forward, modeling_llama.LlamaRMSNorm.forward,
            modeling_llama.LlamaMLP.forward) == hf_objects
    assert [dict(vars(c)) for c in (modeling_llama.LlamaAttention, modeling_llama.LlamaDecoderLayer,
                                     modeling_llama.LlamaRMSNorm, modeling_llama.LlamaMLP)] == hf_class_dicts
    fresh = tiny_model("llama")
    assert fused_op_counts(lambda: logits(fresh)) == {}


def test_torch_save_of_a_patched_model_loads_patched_in_a_fresh_process(tmp_path):
    """Pickle stores each fused module as a reference to fuselm and its HF class; loading makes the fused
    subclasses again, so the loaded model is patched, links its layers to its own norms, and unpatches."""
    model = tiny_model("gemma3").train()  # sandwich norms, q/k norms, and the fused loss in training
    ids = token_ids()
    expected = loss_logits_grads(model, ids)
    fuselm.patch(model)
    torch.save(model, tmp_path / "model.pt")
    torch.save((ids, expected), tmp_path / "expected.pt")
    script = (
        "import sys, torch, fuselm\n"
        "from fuselm.patching.modules import NEXT_NORM\n"
        "from tests.patching.test_families import assert_same_training_step, loss_logits_grads\n"
        "model = torch.load(sys.argv[1], weights_only=False)\n"
        "ids, expected = torch.load(sys.argv[2], weights_only=False)\n"
        "layers = model.model.layers\n"
        "assert layers[0].__dict__[NEXT_NORM] is layers[1].input_layernorm\n"
        "assert layers[1].__dict__[NEXT_NORM] is model.model.norm\n"
        "with fuselm.use_backend('triton'):\n"
        "    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:\n"
        "        got = loss_logits_grads(model, ids)\n"
        "assert_same_training_step(got, expected, tolerance=1e-6)\n"
        "ran = {e.name for e in prof.events() if e.name.startswith('fuselm::')}\n"
        "assert {'fuselm::add_rms_norm', 'fuselm::rope', 'fuselm::glu', 'fuselm::linear_cross_entropy'} <= ran, ran\n"
        "print(fuselm.unpatch(model))\n"
    )
    env = {**os.environ, "TRITON_INTERPRET": "1" if DEVICE == "cpu" else "0"}
    done = subprocess.run([sys.executable, "-c", script, str(tmp_path / "model.pt"), str(tmp_path / "expected.pt")],
                          env=env, capture_output=True, text=True, timeout=300, check=False, cwd=REPOSITORY)
    assert done.returncode == 0, done.stderr[-2000:]
    assert done.stdout.strip() == "20"  # 13 norms, 2 attentions, 2 MLPs, 2 decoder layers, the loss


def test_pickling_and_copying_keep_a_patched_model_patched():
    model = tiny_model("phi3")
    expected = logits(model)
    fuselm.patch(model)
    for twin in (pickle.loads(pickle.dumps(model)), copy.deepcopy(model)):
        assert classes(twin) == classes(model)
        assert rel_err(logits(twin), expected) <= 1e-6
        assert fuselm.unpatch(twin) == 12 and not patched_modules(twin)


def test_a_fused_class_that_cannot_be_made_again_on_load_says_what_to_do(monkeypatch):
    model = tiny_model("llama")
    fuselm.patch(model)
    saved = pickle.dumps(model)
    monkeypatch.setattr(modeling_llama, "apply_rotary_pos_emb", lambda q, k, cos, sin: (q, k))  # as if HF changed
    recognise._probe_rope.cache_clear()
    try:
        with pytest.raises(TypeError, match="fused subclass of LlamaAttention .*save_pretrained.*fuselm.unpatch"):
            pickle.loads(saved)
    finally:
        recognise._probe_rope.cache_clear()


def test_names_state_dict_print_and_save_pretrained_stay_as_they_were(tmp_path):
    model = tiny_model("gemma2")
    names, printed, expected = list(model.state_dict()), str(model), logits(model)
    fuselm.patch(model)
    assert list(model.state_dict()) == names
    assert str(model) == printed
    model.save_pretrained(tmp_path)
    reloaded = AutoModelForCausalLM.from_pretrained(tmp_path).to(DEVICE).eval()
    assert not patched_modules(reloaded)
    assert torch.equal(logits(reloaded), expected)
    fuselm.patch(reloaded)
    assert rel_err(logits(reloaded), expected) <= 1e-6


# ----------------------------------------------------------------------------------- hooks
def test_hooks_still_fire_and_see_what_they_saw_before(path):
    model = tiny_model("llama")
    layer = model.model.layers[0]
    seen = []
    handles = [layer.post_attention_layernorm.register_forward_hook(lambda m, a, out: seen.append(out.clone())),
               layer.register_forward_pre_hook(lambda m, a: seen.append(a[0].clone())),
               model.model.layers[1].input_layernorm.register_forward_hook(lambda m, a, out: seen.append(out.clone()))]
    expected = logits(model)
    expected_seen, seen[:] = list(seen), []
    fuselm.patch(model)
    got = logits(model)
    assert len(seen) == len(expected_seen) == 3
    for out, ref in zip(seen, expected_seen):
        assert rel_err(out, ref) <= 1e-6
    assert rel_err(got, expected) <= 1e-6
    for handle in handles:
        handle.remove()


@pytest.mark.parametrize("in_place", [True, False])
def test_a_hook_changing_a_layer_output_is_respected(path, in_place):
    """The layer hands its output to the next norm pre-normed; a hook's change must void that."""

    direction = torch.randn(56, device=DEVICE)  # a shift, not a scale: RMSNorm would not notice a scale

    def steer(module, args, output):
        return output.add_(direction) if in_place else output + direction

    model = tiny_model("mistral")
    model.model.layers[0].register_forward_hook(steer)
    expected = logits(model)
    fuselm.patch(model)
    assert rel_err(logits(model), expected) <= 1e-6


def test_dropping_a_layer_after_patching_still_computes_the_same(path):
    """Layer 0 primes its output for layer 1's input norm; once layer 1 is gone the final norm must not take it."""
    model = tiny_model("llama")
    fuselm.patch(model)
    model.model.layers = nn.ModuleList(list(model.model.layers)[:1])
    model.config.num_hidden_layers = 1
    got = logits(model)
    fuselm.unpatch(model)
    assert rel_err(got, logits(model)) <= 1e-6


@pytest.mark.parametrize("name", ["llama", "gemma2"])
def test_a_patched_model_is_freed_by_del_alone(name):
    """No reference cycle: ``del model`` frees a patched model at once, as it does an unpatched one,
    so ``del model; torch.cuda.empty_cache()`` gives its memory back without waiting for the collector."""
    model = tiny_model(name)
    fuselm.patch(model)
    logits(model)
    embedding = weakref.ref(model.get_input_embeddings().weight)
    gc.disable()
    try:
        del model
        assert embedding() is None
    finally:
        gc.enable()


def test_a_deep_copy_links_its_layers_to_its_own_norms(path):
    model = tiny_model("llama", num_hidden_layers=3)
    fuselm.patch(model)
    twin = copy.deepcopy(model)
    layers = twin.model.layers
    expected = [layer.input_layernorm for layer in layers[1:]] + [twin.model.norm]
    assert all(layer.__dict__[NEXT_NORM] is norm for layer, norm in zip(layers, expected, strict=True))
    assert rel_err(logits(twin), logits(model)) <= 1e-6


@pytest.mark.parametrize("which", ["final norm", "next layer's input norm"])
def test_a_norm_replaced_after_patching_is_the_one_that_computes(path, which):
    """A layer primes the norm it was linked to at patch time; a replacement norm must compute its own output."""
    model = tiny_model("llama")
    fuselm.patch(model)
    owner, name = (model.model, "norm") if which == "final norm" else (model.model.layers[1], "input_layernorm")
    replacement = copy.deepcopy(getattr(owner, name))
    with torch.no_grad():
        replacement.weight.add_(0.5)
    setattr(owner, name, replacement)
    got = logits(model)
    fuselm.unpatch(model)
    assert rel_err(got, logits(model)) <= 1e-6


def test_modules_behind_an_accelerate_hook_are_left_alone_and_not_bypassed():
    from accelerate.hooks import ModelHook, add_hook_to_module

    class Counting(ModelHook):
        calls = 0

        def pre_forward(self, module, *args, **kwargs):
            Counting.calls += 1
            return args, kwargs

    model = tiny_model("llama")
    add_hook_to_module(model.model.layers[0].post_attention_layernorm, Counting())
    expected, calls = logits(model), Counting.calls
    report = fuselm.patch(model)
    assert report["rms_norm"].left_alone == {"forward replaced on the instance (e.g. by an accelerate hook)": 1}
    assert rel_err(logits(model), expected) <= 1e-6
    assert Counting.calls == 2 * calls  # the fused decoder layer still calls the hooked norm
    add_hook_to_module(model.model.layers[1].input_layernorm, Counting())  # hooked after patching
    assert rel_err(logits(model), expected) <= 1e-6
    assert Counting.calls == 4 * calls


def test_inference_mode_matches_no_grad():
    model = tiny_model("gemma2")
    expected = logits(model)
    fuselm.patch(model)
    with torch.inference_mode():
        got = model(token_ids()).logits
    assert rel_err(got, expected) <= 1e-6


def test_output_hidden_states_are_the_true_residual_stream(path):
    model = tiny_model("gemma3")
    with torch.no_grad():
        expected = model(token_ids(), output_hidden_states=True).hidden_states
        fuselm.patch(model)
        got = model(token_ids(), output_hidden_states=True).hidden_states
    assert len(got) == len(expected) == 3
    for out, ref in zip(got, expected):
        assert rel_err(out, ref) <= 1e-6


@pytest.mark.parametrize("keyword", ["past_key_values", "cache"])
def test_both_cache_keyword_names_pass_through_the_decoder_layer(keyword):
    model = tiny_model("qwen3")
    layer, config = model.model.layers[0], model.config
    hidden = torch.randn(2, 5, config.hidden_size, device=DEVICE)
    position_ids = torch.arange(5, device=DEVICE)[None]
    position_embeddings = model.model.rotary_emb(hidden, position_ids)

    def run():
        cache = DynamicCache(config=config)
        with torch.no_grad():
            out = layer(hidden, position_embeddings=position_embeddings, position_ids=position_ids,
                        use_cache=True, **{keyword: cache})
        return out, cache.get_seq_length()

    expected, expected_length = run()
    fuselm.patch(model)
    got, length = run()
    assert length == expected_length
    assert rel_err(got, expected) <= 1e-6


# ----------------------------------------------------------------------------------- recognition
@pytest.mark.parametrize("name", UNLISTED)
def test_unlisted_families_get_what_is_recognised_and_compute_the_same(path, name):
    model = tiny_model(name).train()
    ids = token_ids()
    expected = loss_logits_grads(model, ids)
    report = fuselm.patch(model)
    assert_same_training_step(loss_logits_grads(model, ids), expected, tolerance=1e-6)
    assert report["decoder_layer"].left_alone == {f"family {name!r} is not in fuselm's table": 2}
    assert report["loss"].left_alone == {f"{type(model).__name__}.forward: family {name!r} is not in fuselm's table": 1}
    assert report["mlp"].patched == 2
    if name == "cohere":  # interleaved RoPE and LayerNorm: nothing to route
        assert report["rope"].left_alone == {"apply_rotary_pos_emb does not compute rotate_half RoPE": 2}
        assert report["rms_norm"].total == 0
    else:
        assert report["rope"].patched == 2 and report["rms_norm"].patched == report["rms_norm"].total > 0


def test_a_post_norm_family_keeps_its_layers_and_fuses_the_rest(path):
    """OLMo2 norms each branch before its residual add: no add feeds a norm, so its layers stay HF's."""
    model = tiny_model("olmo2").train()
    ids = token_ids()
    expected = loss_logits_grads(model, ids)
    report = fuselm.patch(model)
    assert_same_training_step(loss_logits_grads(model, ids), expected, tolerance=1e-6)
    assert report["decoder_layer"].left_alone == {
        "its norms follow attention and MLP (post-norm): no residual add feeds a norm": 2}
    assert [(report[kind].patched, report[kind].total) for kind in ("rms_norm", "rope", "mlp", "loss")] == [
        (9, 9), (2, 2), (2, 2), (1, 1)]  # q_norm, k_norm and two norms per layer, and the final norm


class ToyRMSNorm(nn.Module):
    def __init__(self, hidden, divide):
        super().__init__()
        self.weight = nn.Parameter(1 + 0.3 * torch.randn(hidden))
        self.eps = 1e-6
        self.divide = divide

    def forward(self, x):
        x32 = x.float()
        if self.divide:  # x / sqrt(mean + eps): not the same rounding as x * rsqrt(mean + eps)
            normed = x32 / torch.sqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps)
        else:
            normed = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * normed.to(x.dtype)


class ToyMLP(nn.Module):
    def __init__(self, hidden, swapped):
        super().__init__()
        self.gate_proj, self.up_proj = nn.Linear(hidden, 24), nn.Linear(hidden, 24)
        self.down_proj, self.act_fn = nn.Linear(24, hidden), nn.SiLU()
        self.swapped = swapped

    def forward(self, x):
        gate, up = (self.up_proj(x), self.gate_proj(x)) if self.swapped else (self.gate_proj(x), self.up_proj(x))
        return self.down_proj(self.act_fn(gate) * up)


def test_custom_modules_are_patched_only_when_a_probe_proves_them_equal():
    model = nn.Sequential(ToyRMSNorm(16, divide=False), ToyMLP(16, swapped=False),
                          ToyRMSNorm(16, divide=True), ToyMLP(16, swapped=True))
    x = torch.randn(3, 16)
    expected = model(x)
    report = fuselm.patch(model)
    assert report["rms_norm"].patched == 1 and report["mlp"].patched == 1
    assert report["rms_norm"].left_alone == {
        "ToyRMSNorm does not compute any of fuselm's castings ('llama', 'gemma', 'none') with offset 0 or 1": 1}
    assert report["mlp"].left_alone == {"forward differs from a gated MLP (family not in fuselm's table)": 1}
    assert type(model[0]).__name__ == "ToyRMSNorm" and type(model[0]) is not ToyRMSNorm
    assert type(model[2]) is ToyRMSNorm and type(model[3]) is ToyMLP
    assert rel_err(model(x), expected) <= 1e-6


@pytest.mark.parametrize("name", ["llama", "gemma2", "granite"])
def test_a_model_built_on_the_meta_device_patches_like_any_other_and_computes_once_materialised(name):
    """FSDP2's recommended init: build under torch.device("meta"), patch (probes run on CPU stand-ins of their own,
    an unlisted family's MLP included), then materialise (to_empty + weights) and compute like the unpatched."""
    with torch.device("meta"):
        model = tiny_model(name, device="meta")
    report = fuselm.patch(model)
    expected_report = fuselm.patch(tiny_model(name))
    assert {k: (v.patched, v.left_alone) for k, v in report.kinds.items()} == {
        k: (v.patched, v.left_alone) for k, v in expected_report.kinds.items()}
    assert report["mlp"].patched == report["mlp"].total == 2
    unpatched = tiny_model(name)
    model.to_empty(device=DEVICE)
    model.load_state_dict(unpatched.state_dict())
    for buffer, value in zip(model.buffers(), unpatched.buffers()):
        buffer.copy_(value)  # rotary inv_freq: not in the state dict
    ids = token_ids()
    with torch.no_grad():
        assert rel_err(model.eval()(ids).logits, unpatched(ids).logits) <= 1e-5


# ----------------------------------------------------------------------------------- what runs
def test_profile_shows_the_fused_ops_ran_and_the_residual_adds_fused():
    model = tiny_model("llama").train()
    ids = token_ids()
    fuselm.patch(model)

    def step():
        model(ids, labels=ids).loss.backward()

    with fuselm.use_backend("triton"):
        counts = fused_op_counts(step)
    layers = model.config.num_hidden_layers
    # Only the first layer's input norm runs alone; every other norm gets its residual add fused in.
    assert counts["fuselm::rms_norm"] == 1
    assert counts["fuselm::add_rms_norm"] == 2 * layers
    assert counts["fuselm::rope"] == counts["fuselm::glu"] == layers
    assert counts["fuselm::rope_backward"] == counts["fuselm::glu_backward"] == layers
    assert counts["fuselm::rms_norm_backward"] == 2 * layers + 1


def test_reference_backend_runs_the_same_patched_model_without_fused_kernels():
    model = tiny_model("phi3")
    fuselm.patch(model)
    with fuselm.use_backend("reference"):
        assert fused_op_counts(lambda: logits(model)) == {}
        reference = logits(model)
    with fuselm.use_backend("triton"):
        assert rel_err(logits(model), reference) <= 1e-6


def test_fuselm_backend_environment_variable_selects_the_references():
    script = (
        "import torch, fuselm\n"
        "from tests.models import tiny_model, token_ids\n"
        "model = tiny_model('llama')\n"
        "expected = model(token_ids()).logits\n"
        "report = fuselm.patch(model)\n"
        "with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:\n"
        "    got = model(token_ids()).logits\n"
        "assert not [e for e in prof.events() if e.name.startswith('fuselm::')]\n"
        "assert torch.equal(got, expected)\n"
        "print(fuselm.get_backend(), report.ops_path)\n"
    )
    env = {**os.environ, "FUSELM_BACKEND": "reference", "TRITON_INTERPRET": "1"}
    done = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True, text=True, timeout=300,
                          check=False, cwd=REPOSITORY)
    assert done.returncode == 0, done.stderr[-2000:]
    assert done.stdout.strip().endswith(f"reference PyTorch reference ({torch.device(DEVICE).type})")


@pytest.mark.parametrize("name", ["llama", "gemma3", "phi3"])
def test_torch_compile_fullgraph_of_the_patched_forward(name):
    model = tiny_model(name)
    fuselm.patch(model)
    with fuselm.use_backend("triton"):
        eager = logits(model, use_cache=False)
        compiled = torch.compile(model, fullgraph=True, backend="aot_eager")
        assert rel_err(logits(compiled, use_cache=False), eager) <= 1e-6
        ran = fused_op_counts(lambda: logits(compiled, use_cache=False))
    assert {"fuselm::rms_norm", "fuselm::add_rms_norm", "fuselm::rope"} <= ran.keys()


@pytest.mark.parametrize("name", [
    "llama",
    "gemma3",  # norms q/k of a transposed view: the fakes must report the kernels' contiguous outputs
])
def test_torch_compile_fullgraph_of_a_patched_training_step(name):
    model = tiny_model(name).train()
    ids = token_ids()
    fuselm.patch(model)
    with fuselm.use_backend("triton"):
        eager = model(ids, labels=ids, use_cache=False)
        eager.loss.backward()
        eager_grads = {n: p.grad.clone() for n, p in model.named_parameters()}
        model.zero_grad()
        compiled = torch.compile(model, fullgraph=True, backend="aot_eager")(ids, labels=ids, use_cache=False)
        compiled.loss.backward()
    assert rel_err(compiled.loss, eager.loss) <= 1e-6
    assert all(rel_err(p.grad, eager_grads[n]) <= 1e-5 for n, p in model.named_parameters())


def test_autocast_mixed_precision_matches_unpatched(path):
    """bf16 matmuls with an fp32 residual stream and fp32 cos/sin: the fused ops must promote as HF does."""
    model = tiny_model("qwen3")
    with torch.autocast(torch.device(DEVICE).type, dtype=torch.bfloat16):
        expected = logits(model)
        fuselm.patch(model)
        got = logits(model)
    assert got.dtype == expected.dtype
    assert rel_err(got, expected) <= 1e-2
