"""Fused LoRA layers (``fuselm.patch`` after ``peft.get_peft_model``): the same losses and adapter gradients as PEFT's
own forward, the fused op really running, per-module fallbacks with their reasons, and a bf16 fine-tuning run."""

import pytest
import torch
from peft import LoraConfig, get_peft_model
from torch import nn

import fuselm
from fuselm.ops import lora as lora_op
from tests.helpers import HostSyncs, rel_err, train_lora_steps
from tests.models import tiny_model, token_ids
from tests.patching.test_training import ALL_LINEARS, curve_distance, trainable_grads, weight_distance

ATTENTION = ["q_proj", "k_proj", "v_proj", "o_proj"]
MLP = ["gate_proj", "up_proj", "down_proj"]


def peft_model(targets=None, dtype=torch.float32, name="llama", **lora_options):
    base = tiny_model(name, dtype=dtype).train()
    torch.manual_seed(7)
    options = {"r": 4, "lora_alpha": 8, "init_lora_weights": False, **lora_options}  # random B: the branch shows
    return get_peft_model(base, LoraConfig(target_modules=targets, **options))


@pytest.fixture
def fused_calls(monkeypatch):
    """Per ``fuselm::lora_add`` or ``fuselm::lora_linear`` call, the number of projections it computed, or "glu" for
    a down projection whose input backward recomputes from the GLU's."""
    calls = []

    def counting(op, per_projection):
        def call(x, *args):
            projections = sum(arg is not None for arg in args[:per_projection * lora_op.MAX_SHARED:per_projection])
            glu_gate = args[per_projection * lora_op.MAX_SHARED]
            calls.append("glu" if glu_gate is not None else projections)
            return op(x, *args)

        return call

    monkeypatch.setattr(lora_op, "LORA_ADD", counting(lora_op.LORA_ADD, 3))
    monkeypatch.setattr(lora_op, "LORA_LINEAR", counting(lora_op.LORA_LINEAR, 4))
    return calls


def assert_matches_peft(got, expected, tolerance=1e-5):
    assert rel_err(got[0], expected[0]) <= tolerance
    assert got[1].keys() == expected[1].keys() and any("lora_A" in n for n in got[1])
    for name, grad in got[1].items():
        assert rel_err(grad, expected[1][name]) <= tolerance, name


LORA_CASES = {  # LoRA targets and options: every projection subset kind, rsLoRA, rank 1, another family
    "all-linears": ("llama", ALL_LINEARS, {}),
    "attention": ("llama", ATTENTION, {}),
    "mlp": ("llama", MLP, {}),
    "q-v-default": ("llama", None, {}),
    "gate-and-down": ("llama", ["gate_proj", "down_proj"], {}),
    "rslora": ("llama", ALL_LINEARS, {"use_rslora": True, "r": 8, "lora_alpha": 4}),
    "rank-1": ("llama", ["k_proj", "up_proj", "o_proj"], {"r": 1, "lora_alpha": 3}),
    "qwen2-biased-base": ("qwen2", ALL_LINEARS, {}),  # Qwen2's q/k/v have biases
    "phi3-packed": ("phi3", ["qkv_proj", "o_proj", "gate_up_proj", "down_proj"], {}),
}
EVERY_LINEAR_CALLS = [3, 1, 2, "glu"]  # q with k and v, o, gate with up, down
LORA_CALLS = {"all-linears": EVERY_LINEAR_CALLS, "attention": [3, 1], "mlp": [2, "glu"], "q-v-default": [2],
              "gate-and-down": [1, "glu"], "rslora": EVERY_LINEAR_CALLS, "rank-1": [1] * 3,
              "qwen2-biased-base": EVERY_LINEAR_CALLS, "phi3-packed": [1, 1, 1, "glu"]}  # per layer, in call order
CALLS_PER_FORWARD = 2 * len(EVERY_LINEAR_CALLS)  # two layers, LoRA on every linear


@pytest.mark.parametrize("case", list(LORA_CASES))
def test_fused_lora_matches_peft(path, case, fused_calls):
    name, targets, options = LORA_CASES[case]
    model = peft_model(targets, name=name, **options)
    ids = token_ids()
    expected = trainable_grads(model, ids)
    report = fuselm.patch(model)
    lora_layers = sum(type(m).__name__ == "Linear" and hasattr(m, "lora_A") for m in model.modules())
    assert (report["lora"].patched, report["lora"].total) == (lora_layers, lora_layers) and lora_layers > 0
    assert f"  lora:          {lora_layers}/{lora_layers}" in str(report)
    got = trainable_grads(model, ids)
    assert_matches_peft(got, expected)
    per_layer = LORA_CALLS[case]
    # two forwards (logits, then the loss), two layers; the reference backend runs PEFT's own forward
    assert fused_calls == (per_layer * 4 if path == "triton" else [])
    assert all(p.grad is None for n, p in model.named_parameters() if "lora_" not in n), "the base must stay frozen"


def test_frozen_linear_bases_run_inside_lora_linear_and_a_trainable_base_is_called(monkeypatch):
    """Frozen ``nn.Linear`` bases are computed by ``fuselm::lora_linear`` (x's gradient summed in its GEMMs); a base
    whose weight trains (unfrozen by the user) is called as PEFT calls it, its group then runs ``lora_add``, and its
    weight's gradient is PEFT's."""
    ops = []
    for name in ("LORA_ADD", "LORA_LINEAR"):
        op = getattr(lora_op, name)
        monkeypatch.setattr(lora_op, name, lambda *args, op=op, name=name: ops.append(name) or op(*args))
    model = peft_model(ALL_LINEARS)
    first_q = model.base_model.model.model.layers[0].self_attn.q_proj.base_layer
    first_q.weight.requires_grad_(True)
    ids = token_ids()
    expected = trainable_grads(model, ids)
    fuselm.patch(model)
    with fuselm.use_backend("triton"):
        got = trainable_grads(model, ids)
    assert_matches_peft(got, expected)
    assert any("self_attn.q_proj.base_layer.weight" in name for name in got[1])
    # per forward: layer 0's q/k/v group through lora_add, everything else through lora_linear (two forwards)
    per_forward = ["LORA_ADD", *["LORA_LINEAR"] * 3, *["LORA_LINEAR"] * 4]
    assert ops == per_forward * 2


def test_a_fused_lora_step_never_reads_device_values_back(path, fused_calls):
    """Forward, loss and backward of a patched LoRA model queue their kernels without one host sync (that would
    drain the GPU's queue once per sync: a step that cannot hide its host time)."""
    model = peft_model(ALL_LINEARS)
    fuselm.patch(model)
    ids = token_ids()
    with HostSyncs() as syncs:
        model(input_ids=ids, labels=ids).loss.backward()
    assert bool(fused_calls) == (path == "triton")  # the reference backend runs PEFT's own forward
    assert syncs.seen == []


@pytest.mark.parametrize("order", ["patch-then-peft", "patch-then-peft-then-patch"])
def test_patching_before_get_peft_model_trains_on_peft_and_patching_again_fuses(order, fused_calls):
    base = tiny_model("llama").train()
    fuselm.patch(base)
    torch.manual_seed(7)
    model = get_peft_model(base, LoraConfig(r=4, lora_alpha=8, target_modules=ALL_LINEARS, init_lora_weights=False))
    ids = token_ids()
    if order == "patch-then-peft-then-patch":
        assert fuselm.patch(model)["lora"].patched == 14
    with fuselm.use_backend("triton"):
        got = trainable_grads(model, ids)
    assert bool(fused_calls) == (order == "patch-then-peft-then-patch")
    fuselm.unpatch(model)
    assert_matches_peft(got, trainable_grads(model, ids))


def test_disabled_and_merged_adapters_run_peft(fused_calls):
    ids = token_ids()
    with torch.no_grad():
        base_logits = tiny_model("llama")(ids).logits
        model = peft_model(ALL_LINEARS)
        fuselm.patch(model)
        with fuselm.use_backend("triton"):
            with model.disable_adapter():
                disabled = model(input_ids=ids).logits
            assert fused_calls == []
            adapted = model(input_ids=ids).logits
            assert len(fused_calls) == CALLS_PER_FORWARD
            model.merge_adapter()
            merged = model(input_ids=ids).logits
            assert len(fused_calls) == CALLS_PER_FORWARD
            model.unmerge_adapter()
    assert rel_err(disabled, base_logits) <= 1e-6
    assert rel_err(merged, adapted) <= 1e-5 and rel_err(adapted, base_logits) > 1e-2


def two_adapters():
    model = peft_model(ALL_LINEARS)
    model.add_adapter("second", LoraConfig(r=2, lora_alpha=4, target_modules=["q_proj"], init_lora_weights=False))
    model.base_model.set_adapter(["default", "second"])
    return model


FALLBACKS = {  # what makes a LoRA layer keep PEFT's forward, and how many of the 14 layers it concerns
    "dropout": (lambda: peft_model(ALL_LINEARS, lora_dropout=0.1),
                {"lora_dropout=0.1 > 0 (PEFT's forward draws the dropout mask)": 14}),
    "dora": (lambda: peft_model(ALL_LINEARS, use_dora=True), {"DoRA (use_dora=True)": 14}),
    "two-adapters": (two_adapters, {"2 active adapters (fused: exactly one)": 2}),
}


@pytest.mark.parametrize("case", list(FALLBACKS))
def test_fallbacks_give_peft_s_result_and_say_why(case, fused_calls):
    make, reasons = FALLBACKS[case]
    model = make()
    ids = token_ids()
    torch.manual_seed(3)  # the same dropout masks in both runs
    expected = trainable_grads(model, ids)
    report = fuselm.patch(model)
    assert report["lora"].left_alone == reasons
    assert report["lora"].patched == report["lora"].total - sum(reasons.values())
    for reason, count in reasons.items():
        assert f"{count} × {reason}" in str(report)
    torch.manual_seed(3)
    with fuselm.use_backend("triton"):
        got = trainable_grads(model, ids)
    assert_matches_peft(got, expected)
    # with two adapters on q_proj, the other 12 layers fuse: k with v, o, gate with up, down
    assert len(fused_calls) == (0 if case != "two-adapters" else 2 * CALLS_PER_FORWARD)


def test_dropout_set_after_patching_runs_peft_in_training_only(fused_calls):
    model = peft_model(ALL_LINEARS)
    assert fuselm.patch(model)["lora"].patched == 14
    for module in model.modules():
        if hasattr(module, "lora_dropout"):
            module.lora_dropout["default"] = nn.Dropout(0.2)
    ids = token_ids()
    with torch.no_grad(), fuselm.use_backend("triton"):
        model.eval()
        evaluated = model(input_ids=ids).logits
        assert len(fused_calls) == CALLS_PER_FORWARD
        model.train()
        model(input_ids=ids)
        assert len(fused_calls) == CALLS_PER_FORWARD, "training mode: PEFT's forward draws the dropout mask"
    fuselm.unpatch(model)
    with torch.no_grad():
        assert rel_err(evaluated, model.eval()(input_ids=ids).logits) <= 1e-6


@pytest.mark.parametrize("reentrant", [False, True])
def test_gradient_checkpointing_with_fused_lora(reentrant, fused_calls):
    model = peft_model(ALL_LINEARS)
    ids = token_ids()
    expected = trainable_grads(model, ids)
    fuselm.patch(model)
    model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": reentrant})
    model.enable_input_require_grads()
    with fuselm.use_backend("triton"):
        got = trainable_grads(model, ids)
    assert len(fused_calls) == 3 * CALLS_PER_FORWARD, "logits, training forward, and its recomputation in backward"
    assert_matches_peft(got, expected)


def test_primed_k_and_v_are_taken_only_from_the_unmodified_input(fused_calls):
    """q_proj computes k's and v's outputs too and leaves them on its input: k and v take them from that very tensor,
    unmodified; after an in-place change each computes its own; in inference mode nothing is primed."""
    model = peft_model(ALL_LINEARS)
    attention = model.base_model.model.model.layers[0].self_attn
    x = torch.randn(2, 5, 56)
    with torch.no_grad():
        expected = [getattr(attention, name)(x) for name in ("q_proj", "k_proj", "v_proj")]
    fuselm.patch(model)
    with torch.no_grad(), fuselm.use_backend("triton"):
        q, k = attention.q_proj(x), attention.k_proj(x)
        assert fused_calls == [3]
        x.mul_(1.0)  # a new version of x: v must not take what q primed
        v = attention.v_proj(x)
        assert fused_calls == [3, 1]
        with torch.inference_mode():
            inferred = [getattr(attention, name)(x) for name in ("q_proj", "k_proj", "v_proj")]
        assert fused_calls == [3, 1, 1, 1, 1]
    for got in ([q, k, v], inferred):
        for out, ref in zip(got, expected):
            assert rel_err(out, ref) <= 1e-6


class Linear4bit(nn.Module):
    """A stand-in for bitsandbytes' Linear4bit (named and placed like it): a base layer fuselm only calls."""

    def __init__(self, linear):
        super().__init__()
        self.weight, self.bias = linear.weight, linear.bias
        self.calls = 0

    def forward(self, x):
        self.calls += 1
        return nn.functional.linear(x, self.weight, self.bias)


Linear4bit.__module__ = "bitsandbytes.nn.modules"


def test_a_4_bit_base_layer_is_called_and_the_branch_fused(fused_calls):
    model = peft_model(ALL_LINEARS)
    stand_ins = []
    for module in model.modules():
        if type(module).__name__ == "Linear" and hasattr(module, "base_layer"):
            module.base_layer = Linear4bit(module.base_layer)
            stand_ins.append(module.base_layer)
    ids = token_ids()
    expected = trainable_grads(model, ids)
    report = fuselm.patch(model)
    assert report["lora"].patched == 14
    with fuselm.use_backend("triton"):
        got = trainable_grads(model, ids)
    assert len(fused_calls) == 2 * CALLS_PER_FORWARD
    assert all(base.calls == 4 for base in stand_ins)  # 2 unpatched + 2 patched forwards
    assert_matches_peft(got, expected)


def test_other_base_layers_are_left_to_peft():
    model = peft_model(["q_proj"])
    layer = model.base_model.model.model.layers[0].self_attn.q_proj
    layer.base_layer = nn.Sequential(layer.base_layer)
    report = fuselm.patch(model)
    assert report["lora"].left_alone == {"its base layer is a Sequential, not an nn.Linear or a bitsandbytes "
                                         "Linear4bit": 1}


# ----------------------------------------------------------------------------------- bf16 fine-tuning
def fine_tune(dtype, patch, steps=30, first_grads=None):
    """30 AdamW steps of LoRA (fp32 adapters) on every linear of a tiny Llama in ``dtype``; only the LoRA layers
    are patched (the other fused kernels would run in Triton's interpreter, which rounds differently from a GPU)."""
    model = peft_model(ALL_LINEARS, dtype=dtype)
    if patch:
        fuselm.patch(model, rms_norm=False, rope=False, decoder_layer=False, loss=False)
    return train_lora_steps(model, steps, first_grads)


def test_bf16_fine_tuning_with_fused_lora_stays_within_bf16_noise(fused_calls):
    """As test_training's bf16 convergence test: first-step adapter gradients as accurate against fp32 as PEFT's bf16
    ones, and the loss curve and final adapters near PEFT's bf16 run."""
    fp32_grads, expected_grads, got_grads = {}, {}, {}
    fine_tune(torch.float32, patch=False, steps=1, first_grads=fp32_grads)
    expected_losses, expected_weights = fine_tune(torch.bfloat16, patch=False, first_grads=expected_grads)
    with fuselm.use_backend("triton"):
        losses, weights = fine_tune(torch.bfloat16, patch=True, first_grads=got_grads)
    assert len(fused_calls) == 30 * CALLS_PER_FORWARD
    expected_error = max(rel_err(expected_grads[n], fp32_grads[n]) for n in fp32_grads)
    error = max(rel_err(got_grads[n], fp32_grads[n]) for n in fp32_grads)
    assert error <= 1.5 * expected_error, f"first-step gradients vs fp32: {error:.3g}, PEFT bf16's {expected_error:.3g}"
    per_pass, expected_per_pass = losses.view(-1, 5).mean(1), expected_losses.view(-1, 5).mean(1)
    assert expected_per_pass[-1] < 0.8 * expected_per_pass[0], "the run must actually learn"
    assert curve_distance(per_pass, expected_per_pass) <= 3e-2
    assert weight_distance(weights, expected_weights) <= 1e-1


def test_torch_compile_fullgraph_of_a_fused_lora_training_step():
    model = peft_model(ALL_LINEARS)
    ids = token_ids()
    fuselm.patch(model)
    hf_model = model.base_model.model  # the HF model inside PEFT's wrapper, compiled as test_api compiles one
    with fuselm.use_backend("triton"):
        eager = hf_model(ids, labels=ids, use_cache=False)
        eager.loss.backward()
        eager_grads = {n: p.grad.clone() for n, p in hf_model.named_parameters() if p.grad is not None}
        hf_model.zero_grad()
        compiled = torch.compile(hf_model, fullgraph=True, backend="aot_eager")(ids, labels=ids, use_cache=False)
        compiled.loss.backward()
    assert rel_err(compiled.loss, eager.loss) <= 1e-6
    grads = {n: p.grad for n, p in hf_model.named_parameters() if p.grad is not None}
    assert grads.keys() == eager_grads.keys() and all("lora_" in n for n in grads)
    assert all(rel_err(grads[n], eager_grads[n]) <= 1e-5 for n in grads)


@pytest.mark.gpu
def test_gpu_lora_step_is_as_accurate_as_peft_s_bf16():
    """A 2-layer Llama-3.1-shaped model (hidden 2048), LoRA r16 on every linear, 2 × 1000 tokens: the fused step's
    loss and adapter gradients are as close to the fp32 model's as PEFT's own bf16 step's (within 1.5×)."""
    from tests.patching.test_gpu import ids, llama_shaped

    def lora(dtype):
        torch.manual_seed(7)
        config = LoraConfig(r=16, lora_alpha=32, target_modules=ALL_LINEARS, init_lora_weights=False)
        return get_peft_model(llama_shaped(dtype), config).train()

    def step(model):
        model.zero_grad(set_to_none=True)
        loss = model(input_ids=tokens, labels=tokens).loss
        loss.backward()
        return loss.detach().float(), {n: p.grad.float() for n, p in model.named_parameters() if p.grad is not None}

    tokens = ids(2, 1000)
    model, exact = lora(torch.bfloat16), lora(torch.float32)
    with torch.no_grad():  # the same adapter values (PEFT rounds a bf16 model's through bf16 at creation)
        adapters = dict(model.named_parameters())
        for name, param in exact.named_parameters():
            if "lora_" in name:
                param.copy_(adapters[name])
    exact_loss, exact_grads = step(exact)
    del exact
    peft_loss, peft_grads = step(model)
    fuselm.patch(model)
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:  # op records only
        loss, grads = step(model)
    assert "fuselm::lora_linear" in {e.name for e in prof.events()}
    assert grads.keys() == exact_grads.keys() and all("lora_" in n for n in grads)
    assert (loss - exact_loss).abs() <= 1.5 * (peft_loss - exact_loss).abs() + 1e-3 * exact_loss
    peft_error = max(rel_err(peft_grads[n], exact_grads[n]) for n in exact_grads)
    error = max(rel_err(grads[n], exact_grads[n]) for n in exact_grads)
    assert error <= 1.5 * peft_error, f"adapter gradients vs fp32: fused {error:.3g}, PEFT bf16 {peft_error:.3g}"
