"""Every public op refuses tensors on different devices, naming the argument; on two GPUs each op runs on
``cuda:1`` while ``cuda:0`` is current (the device guard of ``fuselm.ops._common.on_input_device``)."""

from __future__ import annotations

import pytest
import torch

import fuselm
from tests.helpers import assert_close, randn


def _cases(device: str) -> dict:
    """Per public op: (call, tensors, differentiable tensor names) with valid fp32 inputs on ``device``.
    ``call(**tensors)`` runs the op; the names list the inputs whose gradients the GPU test compares."""
    r = lambda *shape: randn(*shape, device=device)  # noqa: E731
    positions = torch.tensor([[3, 0]], device=device)
    angles = r(1, 2, 16)
    return {
        "rms_norm": (lambda x, weight: fuselm.rms_norm(x, weight, 1e-6), {"x": r(3, 5, 40), "weight": r(40)},
                     ("x", "weight")),
        "add_rms_norm": (lambda x, residual, weight: fuselm.add_rms_norm(x, residual, weight),
                         {"x": r(3, 40), "residual": r(3, 40), "weight": r(40)}, ("x", "residual", "weight")),
        "rope": (lambda q, k, cos, sin: fuselm.rope(q, k, cos, sin),
                 {"q": r(2, 4, 5, 16), "k": r(2, 2, 5, 16), "cos": r(1, 5, 16), "sin": r(1, 5, 16)}, ("q", "k")),
        "silu_mul": (lambda gate, up: fuselm.silu_mul(gate, up), {"gate": r(3, 7, 30), "up": r(3, 7, 30)},
                     ("gate", "up")),
        "gelu_tanh_mul": (lambda gate, up: fuselm.gelu_tanh_mul(gate, up), {"gate": r(3, 30), "up": r(3, 30)},
                          ("gate", "up")),
        "cross_entropy": (lambda logits, labels: fuselm.cross_entropy(logits, labels),
                          {"logits": r(6, 50), "labels": torch.randint(0, 50, (6,), device=device)}, ("logits",)),
        "linear_cross_entropy": (
            lambda hidden, weight, labels, bias: fuselm.linear_cross_entropy(hidden, weight, labels, bias),
            {"hidden": r(6, 24), "weight": r(50, 24), "labels": torch.randint(0, 50, (6,), device=device),
             "bias": r(50)}, ("hidden", "weight", "bias")),
        "decode_attention": (
            lambda q, k_cache, v_cache, starts, ends: fuselm.decode_attention(q, k_cache, v_cache, starts, ends),
            {"q": r(2, 4, 1, 64), "k_cache": r(2, 2, 9, 64), "v_cache": r(2, 2, 9, 64),
             "starts": torch.tensor([0, 2], device=device), "ends": torch.tensor([9, 6], device=device)}, ()),
        "linear_residual": (lambda x, weight, residual, bias: fuselm.linear_residual(x, weight, residual, bias),
                            {"x": r(2, 24), "weight": r(40, 24), "residual": r(2, 40), "bias": r(40)}, ()),
        "norm_gated_linear": (
            lambda x, norm_weight, gate_weight, up_weight: fuselm.norm_gated_linear(x, norm_weight, 1e-6, gate_weight,
                                                                                   up_weight),
            {"x": r(2, 24), "norm_weight": r(24), "gate_weight": r(30, 24), "up_weight": r(30, 24)}, ()),
        "qkv_rope": (
            lambda x, norm_weight, q_weight, k_weight, v_weight, cos, sin, k_cache, v_cache, cache_positions,
            q_bias, k_bias, v_bias, q_norm_weight, k_norm_weight: fuselm.qkv_rope(
                x, norm_weight, 1e-6, q_weight, k_weight, v_weight, cos, sin, k_cache, v_cache, cache_positions,
                num_heads=2, num_kv_heads=1, q_bias=q_bias, k_bias=k_bias, v_bias=v_bias,
                q_norm_weight=q_norm_weight, k_norm_weight=k_norm_weight),
            {"x": r(1, 2, 24), "norm_weight": r(24), "q_weight": r(32, 24), "k_weight": r(16, 24),
             "v_weight": r(16, 24), "cos": angles.cos(), "sin": angles.sin(), "k_cache": r(1, 1, 6, 16),
             "v_cache": r(1, 1, 6, 16), "cache_positions": positions, "q_bias": r(32), "k_bias": r(16),
             "v_bias": r(16), "q_norm_weight": r(16), "k_norm_weight": r(16)}, ()),
        "lora_add": (lambda x, base_outs, lora_as, lora_bs: fuselm.lora_add(x, base_outs, lora_as, lora_bs, 0.5),
                     {"x": r(3, 24), "base_outs": r(3, 40), "lora_as": r(4, 24), "lora_bs": r(40, 4)},
                     ("x", "base_outs", "lora_as", "lora_bs")),
        "lora_add_shared": (
            lambda x, base_outs, lora_as, lora_bs: fuselm.lora_add_shared(x, [base_outs], [lora_as], [lora_bs], [0.5]),
            {"x": r(3, 24), "base_outs": r(3, 40), "lora_as": r(4, 24), "lora_bs": r(40, 4)},
            ("x", "base_outs", "lora_as", "lora_bs")),
        "lora_linear": (
            lambda x, weights, biases, lora_as, lora_bs: fuselm.lora_linear(x, weights, biases, lora_as, lora_bs, 0.5),
            {"x": r(3, 24), "weights": r(40, 24), "biases": r(40), "lora_as": r(4, 24), "lora_bs": r(40, 4)},
            ("x", "weights", "biases", "lora_as", "lora_bs")),
        "lora_linear_shared": (
            lambda x, weights, biases, lora_as, lora_bs: fuselm.lora_linear_shared(x, [weights, weights[:8]],
                                                                                  [biases, None], [lora_as] * 2,
                                                                                  [lora_bs, lora_bs[:8]], [0.5, 2.0]),
            {"x": r(3, 24), "weights": r(40, 24), "biases": r(40), "lora_as": r(4, 24), "lora_bs": r(40, 4)},
            ("x", "weights", "biases", "lora_as", "lora_bs")),
    }


PUBLIC_OPS = [name for name in fuselm.__all__ if name in _cases("cpu")]
ARGUMENTS = [(op, name) for op, (_, tensors, _) in _cases("cpu").items() for name in tensors]


def test_every_public_op_has_a_case():
    assert PUBLIC_OPS == list(fuselm._OPS)


@pytest.mark.parametrize("op, moved", ARGUMENTS, ids=[f"{op}-{name}" for op, name in ARGUMENTS])
def test_a_tensor_on_another_device_is_refused_by_name(path, op, moved):
    call, tensors, _ = _cases("cpu")[op]
    call(**tensors)  # the case itself is valid
    tensors[moved] = tensors[moved].to("meta")
    with pytest.raises(ValueError, match=rf"\b{moved}\b.* on (meta|cpu)"):
        call(**tensors)


def _outputs(result) -> list[torch.Tensor]:
    return [result] if isinstance(result, torch.Tensor) else list(result)


@pytest.mark.gpu
@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs two CUDA devices")
@pytest.mark.parametrize("op", PUBLIC_OPS)
def test_each_op_runs_on_the_second_gpu_while_the_first_is_current(op):
    """Triton launches on the current device: without the guard these launch on cuda:0 with cuda:1 pointers."""
    call, tensors, differentiable = _cases("cuda:1")[op]
    for name in differentiable:
        tensors[name].requires_grad_(True)
    expected_inputs = {name: t.detach().clone().requires_grad_(t.requires_grad) for name, t in tensors.items()}
    with torch.cuda.device(0), fuselm.use_backend("triton"):
        outputs = _outputs(call(**tensors))
        upstream = [torch.randn_like(out) for out in outputs]
        if differentiable:
            torch.autograd.backward(outputs, upstream)
    torch.cuda.synchronize(1)
    with fuselm.use_backend("reference"):
        expected = _outputs(call(**expected_inputs))
        if differentiable:
            torch.autograd.backward(expected, upstream)
    for i, (out, ref) in enumerate(zip(outputs, expected)):
        assert out.device == torch.device("cuda:1")
        assert_close(out, ref, torch.float32, f"{op} output {i}")
    for name in differentiable:
        assert_close(tensors[name].grad, expected_inputs[name].grad, torch.float32, f"{op} d{name}")
    for name, t in tensors.items():  # qkv_rope's cache writes
        if name.endswith("_cache"):
            assert_close(t, expected_inputs[name], torch.float32, f"{op} {name}")
