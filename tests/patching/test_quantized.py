"""bitsandbytes 4-bit base projections of one input in one autograd node (``patching/quantized.py``): the same
outputs and input gradient as each layer's own call, against a float64 product of the dequantised weights; calls it
must leave to bitsandbytes. On CPU through bitsandbytes' CPU backend, and on the GPU through its CUDA kernels
(``-m gpu``); skipped without bitsandbytes."""

import pytest
import torch

import fuselm
from fuselm.patching import quantized
from tests.conftest import DEVICE
from tests.helpers import assert_close, rel_err
from tests.patching.test_qlora import fine_tune, qlora_model

bnb = pytest.importorskip("bitsandbytes")


def _nf4_linear(k: int, n: int, *, bias: bool = False, dtype=torch.bfloat16, seed: int = 0, nested: bool = True,
                quant_type: str = "nf4"):
    torch.manual_seed(seed)
    layer = bnb.nn.Linear4bit(k, n, bias=bias, compute_dtype=torch.bfloat16, compress_statistics=nested,
                              quant_type=quant_type)
    layer.weight = bnb.nn.Params4bit((0.05 * torch.randn(n, k)).to(dtype), requires_grad=False,
                                     compress_statistics=nested, quant_type=quant_type)
    return layer.to(DEVICE)


def _dequantized64(layer):
    return bnb.functional.dequantize_4bit(layer.weight, layer.weight.quant_state).double()


@pytest.mark.parametrize("quantisation", [dict(), dict(nested=False), dict(quant_type="fp4")],
                         ids=["nf4 double-quantised", "nf4 fp32 scales", "fp4"])
@pytest.mark.parametrize("widths", [(128,), (128, 64, 64), (192, 64)])
def test_outputs_and_input_gradient_match_each_layers_call(widths, quantisation):
    layers = [_nf4_linear(128, n, seed=i, **quantisation) for i, n in enumerate(widths)]
    x = torch.randn(5, 3, 128, dtype=torch.bfloat16, device=DEVICE).transpose(0, 1).requires_grad_()  # not dense
    assert all(quantized.takes_nf4_group(layer, x) for layer in layers)
    outs = quantized.nf4_group_outputs(layers, x)
    expected = [layer(x) for layer in layers]
    upstream = [torch.randn_like(out) for out in outs]
    (dx,) = torch.autograd.grad(outs, x, upstream)
    (expected_dx,) = torch.autograd.grad(expected, x, upstream)
    x64 = x.detach().double()
    dx64 = sum(dy.double() @ _dequantized64(layer) for dy, layer in zip(upstream, layers))
    for out, own, layer in zip(outs, expected, layers):
        assert out.shape == own.shape and out.dtype == own.dtype
        assert torch.equal(out, own)  # the same dequantised weight through the same GEMM
        assert_close(out, x64 @ _dequantized64(layer).t(), torch.bfloat16, "out")
    assert_close(dx, dx64, torch.bfloat16, "dx")
    assert rel_err(dx, expected_dx) <= 1e-2


def test_an_unused_output_and_no_gradient_wanted():
    layers = [_nf4_linear(64, 64, seed=1), _nf4_linear(64, 128, seed=2)]
    x = torch.randn(4, 64, dtype=torch.bfloat16, device=DEVICE, requires_grad=True)
    first, _ = quantized.nf4_group_outputs(layers, x)
    upstream = torch.randn_like(first)
    (dx,) = torch.autograd.grad(first, x, upstream)
    assert_close(dx, upstream.double() @ _dequantized64(layers[0]), torch.bfloat16, "dx")
    with torch.no_grad():
        outs = quantized.nf4_group_outputs(layers, x)
    assert not any(out.requires_grad for out in outs)


def test_kept_block_scales_follow_a_requantised_weight():
    """The dequantised weight equals bitsandbytes' own, before and after the layer's weight is quantised afresh
    (new scales) and after its quantised scales change in place: the kept fp32 scales never go stale."""
    layer = _nf4_linear(128, 64, seed=3)
    assert torch.equal(quantized._dequantized(layer), bnb.functional.dequantize_4bit(layer.weight,
                                                                                      layer.weight.quant_state))
    layer.weight = bnb.nn.Params4bit((0.05 * torch.randn(64, 128)).to(torch.bfloat16), requires_grad=False,
                                     compress_statistics=True, quant_type="nf4").to(DEVICE)
    state = layer.weight.quant_state
    assert torch.equal(quantized._dequantized(layer), bnb.functional.dequantize_4bit(layer.weight, state))
    state.absmax[0] = (int(state.absmax[0]) + 7) % 256  # an 8-bit code of the first scale, changed in place
    assert torch.equal(quantized._dequantized(layer), bnb.functional.dequantize_4bit(layer.weight, state))


def test_a_weight_quantised_under_inference_mode():
    """Its scales are inference tensors, which keep no version counter: dequantised per call, equal to
    bitsandbytes' own."""
    with torch.inference_mode():
        layer = _nf4_linear(128, 64, seed=4)
    state = layer.weight.quant_state
    assert state.absmax.is_inference()
    for _ in range(2):
        assert torch.equal(quantized._dequantized(layer), bnb.functional.dequantize_4bit(layer.weight, state))


@pytest.mark.gpu
def test_on_the_gpu():
    """The two tests above through bitsandbytes' CUDA kernels, which its CPU backend does not share."""
    for quantisation in (dict(), dict(nested=False), dict(quant_type="fp4")):
        test_outputs_and_input_gradient_match_each_layers_call((128, 64, 64), quantisation)
    test_an_unused_output_and_no_gradient_wanted()
    test_kept_block_scales_follow_a_requantised_weight()
    test_a_weight_quantised_under_inference_mode()


@pytest.mark.parametrize("case", ["bias", "fp32 weights", "one row, no gradient", "fp32 input"])
def test_calls_left_to_bitsandbytes(case):
    layer = _nf4_linear(64, 64, bias=case == "bias", dtype=torch.float32 if case == "fp32 weights" else torch.bfloat16)
    rows = 1 if case == "one row, no gradient" else 4
    x = torch.randn(rows, 64, dtype=torch.float32 if case == "fp32 input" else torch.bfloat16, device=DEVICE)
    assert not quantized.takes_nf4_group(layer, x)
    assert not quantized.takes_nf4_group(torch.nn.Linear(64, 64, device=DEVICE), x)


@pytest.mark.skipif(not hasattr(torch.ops.bitsandbytes, "gemm_4bit"),
                    reason="before 0.50 bitsandbytes dequantises any double-quantised weight itself")
def test_double_quantised_scales_that_bitsandbytes_refuses():
    """bitsandbytes' gemm_4bit takes double-quantised scales in blocks of 256 only (else NotImplementedError): such a
    layer is left to bitsandbytes, which raises its own error."""
    layer = _nf4_linear(64, 64)
    x = torch.randn(4, 64, dtype=torch.bfloat16, device=DEVICE)
    assert quantized.takes_nf4_group(layer, x)
    layer.weight.quant_state.state2.blocksize = 128
    assert not quantized.takes_nf4_group(layer, x)


def test_patched_qlora_step_takes_one_node_per_group(tmp_path, monkeypatch):
    """Through the fused LoRA path (Triton's interpreter on CPU), every layer's 4 projection groups take the grouped
    4-bit path, and the first step's adapter gradients match the same patched model with bitsandbytes' own calls."""
    groups = []
    original = quantized.nf4_group_outputs
    monkeypatch.setattr(quantized, "nf4_group_outputs", lambda layers, x: groups.append(len(layers)) or
                        original(layers, x))
    monkeypatch.setattr(fuselm.patching.modules, "nf4_group_outputs", quantized.nf4_group_outputs)
    results = []
    for grouped in (True, False):
        model = qlora_model(tmp_path / str(grouped))
        fuselm.patch(model)
        if not grouped:
            monkeypatch.setattr(fuselm.patching.modules, "takes_nf4_group", lambda layer, x: False)
        with fuselm.use_backend("triton"):
            results.append(fine_tune(model, steps=1)[1])
    assert groups == [3, 1, 2, 1] * 2  # per layer: q/k/v, o, gate/up, down
    grads, expected = results
    assert grads.keys() == expected.keys() and grads
    worst = max(rel_err(grads[name], expected[name]) for name in grads)
    assert worst <= 2e-2, f"first-step adapter gradients, grouped vs bitsandbytes' calls: {worst:.3g}"
