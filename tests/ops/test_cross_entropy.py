import math
import os
import subprocess
import sys

import pytest
import torch
import torch.nn.functional as F
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

import fuselm
from fuselm.ops import cross_entropy as ce_module
from fuselm.ops.cross_entropy import (
    cross_entropy_reference,
    default_chunk_tokens,
    linear_cross_entropy_reference,
)
from tests.helpers import assert_close, assert_compiles_like_eager, float64_leaf, grads, randn

N = 13
DTYPES = [torch.float32, torch.bfloat16]


@pytest.fixture(autouse=True)
def _small_vocab_blocks(request, monkeypatch):
    """Small tests use 64-column blocks, so V = 257 / 1000 exercise the looped, ragged row walk, and
    split their few rows into vocabulary segments as a GPU splits a chunk of 256 tokens."""
    if request.node.get_closest_marker("gpu") is None:
        monkeypatch.setattr(ce_module, "MAX_BLOCK_V", 64)
        monkeypatch.setattr(ce_module, "PROGRAMS_PER_SM", 64)


def _labels(vocab, device, ignore_index=-100, n=N):
    """Random labels with the first, a middle and the last token ignored."""
    labels = torch.randint(0, vocab, (n,), device=device)
    labels[[0, n // 2, n - 1]] = ignore_index
    return labels


def _upstream(loss):
    """A random upstream gradient (per token for reduction='none')."""
    return torch.randn(loss.shape, device=loss.device)


# V, options. Every case also ignores three tokens (see _labels).
CE_CASES = {
    "mean": (37, {}),
    "sum-smoothing": (257, dict(reduction="sum", label_smoothing=0.1)),
    "none-softcap": (1000, dict(reduction="none", softcap=4.0)),
    "mean-zloss-ignore5": (257, dict(z_loss=1e-2, ignore_index=5)),
    "mean-num-items-int": (37, dict(num_items=29)),
    "mean-num-items-tensor": (257, dict(num_items="tensor")),
    "none-everything": (257, dict(reduction="none", label_smoothing=0.2, softcap=3.0, z_loss=1e-2, ignore_index=-1)),
    "mean-everything": (1000, dict(label_smoothing=0.05, softcap=10.0, z_loss=1e-3, num_items="tensor")),
}


def _options(opts, device):
    opts = dict(opts)
    if opts.get("num_items") == "tensor":
        opts["num_items"] = torch.tensor(31, device=device)
    return opts


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("case", CE_CASES)
def test_cross_entropy_matches_float64(path, device, dtype, case):
    vocab, opts = CE_CASES[case]
    opts = _options(opts, device)
    logits = randn(N, vocab, dtype=dtype, device=device, requires_grad=True, scale=3.0)
    labels = _labels(vocab, device, opts.get("ignore_index", -100))
    loss = fuselm.cross_entropy(logits, labels, **opts)
    upstream = _upstream(loss)
    (dlogits,) = grads(loss, (logits,), upstream)
    logits64 = float64_leaf(logits)
    loss64 = cross_entropy_reference(logits64, labels, **opts)
    (dlogits64,) = grads(loss64, (logits64,), upstream.double())
    assert loss.dtype == torch.float32 and dlogits.dtype == dtype
    assert_close(loss, loss64, torch.float32, "loss")  # fp32 math on the exact input values, in every dtype
    assert_close(dlogits, dlogits64, dtype, "dlogits")
    assert torch.all(dlogits[labels == opts.get("ignore_index", -100)] == 0)


# H, V, bias, chunk_tokens, options.
LINEAR_CASES = {
    "mean-bias-chunk4": (16, 37, True, 4, {}),
    "sum-smoothing-chunk4": (33, 257, False, 4, dict(reduction="sum", label_smoothing=0.1)),
    "none-everything-bias-chunk4": (33, 257, True, 4,
                                    dict(reduction="none", softcap=3.0, z_loss=1e-3, label_smoothing=0.1)),
    "mean-num-items-default-chunk": (16, 1000, False, None, dict(num_items="tensor", softcap=5.0, z_loss=1e-3)),
    "mean-num-items-int-chunk1": (16, 37, True, 1, dict(num_items=40, ignore_index=3)),
    "none-single-chunk": (16, 37, False, N, dict(reduction="none")),
}


def _linear_inputs(hidden_size, vocab, bias, dtype, device, n=N):
    hidden = randn(n, hidden_size, dtype=dtype, device=device, requires_grad=True)
    weight = randn(vocab, hidden_size, dtype=dtype, device=device, requires_grad=True, scale=hidden_size ** -0.5 * 2)
    b = randn(vocab, dtype=dtype, device=device, requires_grad=True) if bias else None
    return hidden, weight, b


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("case", LINEAR_CASES)
def test_linear_cross_entropy_matches_float64(path, device, dtype, case):
    hidden_size, vocab, bias, chunk_tokens, opts = LINEAR_CASES[case]
    opts = _options(opts, device)
    hidden, weight, b = _linear_inputs(hidden_size, vocab, bias, dtype, device)
    labels = _labels(vocab, device, opts.get("ignore_index", -100))
    inputs = (hidden, weight) + ((b,) if bias else ())
    loss = fuselm.linear_cross_entropy(hidden, weight, labels, b, chunk_tokens=chunk_tokens, **opts)
    upstream = _upstream(loss)
    got = grads(loss, inputs, upstream)
    inputs64 = [float64_leaf(t) for t in inputs]
    loss64 = linear_cross_entropy_reference(*inputs64[:2], labels, *inputs64[2:], **opts)
    expected = grads(loss64, inputs64, upstream.double())
    assert loss.dtype == torch.float32
    assert_close(loss, loss64, dtype, "loss")  # bf16 logits, as HF's lm_head computes them
    for name, g, g64, t in zip(("dhidden", "dweight", "dbias"), got, expected, inputs):
        assert g.dtype == t.dtype
        assert_close(g, g64, dtype, name)


def test_kernel_softcap_is_accurate_elementwise(device):
    """With V = 1 and z_loss = 1 each token's loss is the capped logit squared, so this reads the
    kernel's cap * tanh(z / cap) and its derivative element by element, on both sides of its switch
    from a series to exp at |z / cap| = 1/4 and deep into saturation. (PyTorch's own fp32 tanh
    backward, 1 - tanh^2, loses ~1e-3 relative there, so the reference path is not held to this.)"""
    cap = 30.0
    logits = (cap * torch.linspace(-6, 6, 300, device=device)).view(-1, 1).requires_grad_()  # no exact 0
    labels = torch.zeros(300, dtype=torch.long, device=device)
    with fuselm.use_backend("triton"):
        loss = fuselm.cross_entropy(logits, labels, reduction="none", softcap=cap, z_loss=1.0)
    (dlogits,) = grads(loss, (logits,), torch.ones_like(loss))
    logits64 = float64_leaf(logits)
    loss64 = cross_entropy_reference(logits64, labels, reduction="none", softcap=cap, z_loss=1.0)
    (dlogits64,) = grads(loss64, (logits64,), torch.ones_like(loss64))
    assert ((loss - loss64) / loss64).abs().max() < 1e-5
    assert ((dlogits - dlogits64) / dlogits64).abs().max() < 1e-5


@pytest.mark.parametrize("reduction", ["mean", "sum", "none"])
@pytest.mark.parametrize("label_smoothing", [0.0, 0.1])
def test_cross_entropy_matches_torch_on_fp32_logits(path, device, reduction, label_smoothing):
    """Exactly what HF computes: F.cross_entropy on the fp32 (here: fp32 and upcast bf16) logits."""
    for dtype in DTYPES:
        logits = randn(N, 257, dtype=dtype, device=device, requires_grad=True, scale=2.0)
        labels = _labels(257, device)
        loss = fuselm.cross_entropy(logits, labels, reduction=reduction, label_smoothing=label_smoothing)
        torch_loss = F.cross_entropy(logits.float(), labels, reduction=reduction, label_smoothing=label_smoothing)
        upstream = _upstream(loss)
        assert_close(loss, torch_loss, torch.float32, "loss")
        assert_close(grads(loss, (logits,), upstream)[0], grads(torch_loss, (logits,), upstream)[0], dtype, "dlogits")


def test_linear_matches_hf_arithmetic_in_bf16(path, device):
    """Against the same-dtype reference (bf16 lm_head, then fp32 loss), not only float64."""
    hidden, weight, b = _linear_inputs(33, 257, True, torch.bfloat16, device)
    labels = _labels(257, device)
    loss = fuselm.linear_cross_entropy(hidden, weight, labels, b, chunk_tokens=4, label_smoothing=0.1)
    hf = F.cross_entropy(F.linear(hidden, weight, b).float(), labels, label_smoothing=0.1)
    assert_close(loss, hf, torch.bfloat16, "loss", scale=0.1)
    for name, g, g_hf in zip(("dhidden", "dweight", "dbias"), grads(loss, (hidden, weight, b), None),
                             grads(hf, (hidden, weight, b), None)):
        assert_close(g, g_hf, torch.bfloat16, name, scale=0.5)


@pytest.mark.parametrize("reduction,num_items", [("mean", None), ("mean", 7), ("sum", None), ("none", None)])
def test_all_tokens_ignored(path, device, reduction, num_items):
    """Like F.cross_entropy: mean is 0/0 = NaN without num_items; gradients are zero, never NaN."""
    logits = randn(N, 37, device=device, requires_grad=True)
    hidden, weight, _ = _linear_inputs(16, 37, False, torch.float32, device)
    labels = torch.full((N,), -100, device=device)
    opts = dict(reduction=reduction, num_items=num_items, label_smoothing=0.1, z_loss=1e-3)
    torch_loss = F.cross_entropy(logits, labels, reduction=reduction, label_smoothing=0.1)
    if num_items is not None:
        torch_loss = torch_loss.nan_to_num(0.0)
    for loss, inputs in [(fuselm.cross_entropy(logits, labels, **opts), (logits,)),
                         (fuselm.linear_cross_entropy(hidden, weight, labels, chunk_tokens=4, **opts),
                          (hidden, weight))]:
        assert loss.shape == torch_loss.shape
        assert torch.equal(loss.isnan(), torch_loss.isnan())
        assert torch.all(loss.nan_to_num(0.0) == 0)
        for g in grads(loss, inputs, torch.ones_like(loss)):
            assert torch.all(g == 0)


@pytest.mark.parametrize("bad_label", [37, -5])
@pytest.mark.parametrize("reduction", ["mean", "none"])
def test_bad_labels_fail_loudly(path, device, bad_label, reduction):
    """A label outside [0, V) that is not ignore_index. The reference raises IndexError (F.cross_entropy's
    check). Triton cannot raise without a host sync: the row's loss is NaN, and so is every gradient the
    row reaches (its dlogits row; through the LM head its d hidden row, all of d weight and d bias),
    while every other row gets the gradient it would get with that row's loss counted as NaN. Its
    tl.device_assert, active on a GPU under TRITON_DEBUG=1, is tested in test_gpu_bad_label_asserts."""
    if path == "reference" and device != "cpu":
        pytest.skip("F.cross_entropy's CUDA device-side assert would end the test process's CUDA context")
    bad = 4
    labels = _labels(37, device)
    labels[bad] = bad_label
    logits = randn(N, 37, device=device, requires_grad=True, scale=3.0)
    hidden, weight, b = _linear_inputs(16, 37, True, torch.float32, device)
    if path == "reference":
        with pytest.raises(IndexError, match="out of bounds"):
            fuselm.cross_entropy(logits, labels, reduction=reduction)
        with pytest.raises(IndexError, match="out of bounds"):
            fuselm.linear_cross_entropy(hidden, weight, labels, b, reduction=reduction)
        return
    # What every other row must get: the bad row ignored, the mean still divided by the count including it.
    others = torch.arange(N, device=device) != bad
    ignored = labels.clone()
    ignored[bad] = -100
    reference_opts = dict(reduction=reduction, num_items=int((labels != -100).sum()) if reduction == "mean" else None)
    for inputs, call, reference in [
        ((logits,), lambda t, y, **o: fuselm.cross_entropy(*t, y, **o), cross_entropy_reference),
        ((hidden, weight, b), lambda t, y, **o: fuselm.linear_cross_entropy(*t[:2], y, t[2], chunk_tokens=4, **o),
         lambda h, w, bias, y, **o: linear_cross_entropy_reference(h, w, y, bias, **o)),
    ]:
        loss = call(inputs, labels, reduction=reduction)
        upstream = _upstream(loss)
        got = grads(loss, inputs, upstream)
        inputs64 = [float64_leaf(t) for t in inputs]
        loss64 = reference(*inputs64, ignored, **reference_opts)
        expected = grads(loss64, inputs64, upstream.double())
        if reduction == "none":
            assert loss[bad].isnan() and not loss[others].isnan().any()
            assert_close(loss[others], loss64[others], torch.float32, "other rows' loss")
        else:
            assert loss.isnan()
        first = got[0]  # dlogits or d hidden: the bad row all NaN, the others as if it were ignored
        assert first[bad].isnan().all()
        assert_close(first[others], expected[0][others], torch.float32, "other rows' gradient")
        for g in got[1:]:  # d weight and d bias: every element has a term from the bad row
            assert g.isnan().all()


@pytest.mark.gpu
def test_gpu_bad_label_asserts_under_triton_debug():
    """With TRITON_DEBUG=1 the kernels are built with their device asserts: a bad label stops the run."""
    script = ("import torch, fuselm\n"
              "logits = torch.randn(4, 37, device='cuda')\n"
              "fuselm.cross_entropy(logits, torch.tensor([1, 2, 37, 3], device='cuda'))\n"
              "torch.cuda.synchronize()\n")
    env = {**os.environ, "TRITON_DEBUG": "1", "FUSELM_BACKEND": "triton"}
    result = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True, text=True, timeout=600,
                            check=False)
    assert result.returncode != 0
    assert "a label is outside [0, vocabulary size)" in result.stdout + result.stderr


def test_masked_vocabulary_entries(path, device):
    """-inf logits (masked tokens), including a whole first block of a row, as PyTorch handles them."""
    logits = randn(N, 257, device=device, scale=3.0)
    logits[:, :100] = float("-inf")
    logits[3, 150:] = float("-inf")
    logits.requires_grad_()
    labels = torch.randint(100, 150, (N,), device=device)
    loss = fuselm.cross_entropy(logits, labels, reduction="none", label_smoothing=0.0, z_loss=1e-3)
    logits64 = float64_leaf(logits)
    loss64 = cross_entropy_reference(logits64, labels, reduction="none", z_loss=1e-3)
    upstream = _upstream(loss)
    assert_close(loss, loss64, torch.float32, "loss")
    assert_close(grads(loss, (logits,), upstream)[0], grads(loss64, (logits64,), upstream.double())[0],
                 torch.float32, "dlogits")


def test_empty_batch(path, device):
    logits = randn(0, 37, device=device, requires_grad=True)
    labels = torch.zeros(0, dtype=torch.long, device=device)
    hidden, weight, _ = _linear_inputs(16, 37, False, torch.float32, device, n=0)
    assert fuselm.cross_entropy(logits, labels).isnan()  # as F.cross_entropy
    assert fuselm.cross_entropy(logits, labels, reduction="sum") == 0
    assert fuselm.linear_cross_entropy(hidden, weight, labels, reduction="none").shape == (0,)
    loss = fuselm.linear_cross_entropy(hidden, weight, labels, reduction="sum")
    dhidden, dweight = grads(loss, (hidden, weight), None)
    assert loss == 0 and dhidden.shape == (0, 16) and torch.all(dweight == 0)


@pytest.mark.parametrize("bias", [False, True])
@pytest.mark.parametrize("reduction", ["mean", "none"])
def test_linear_hidden_size_zero(path, device, bias, reduction):
    """H = 0: every logit is 0 (or the bias alone), so a non-ignored token's loss is log V (or
    logsumexp(bias) - bias[label]); d hidden and d weight are empty, d bias is softmax(bias) - onehot."""
    vocab = 37
    hidden = randn(2, 3, 0, device=device, requires_grad=True)
    weight = randn(vocab, 0, device=device, requires_grad=True)
    b = randn(vocab, device=device, requires_grad=True) if bias else None
    labels = _labels(vocab, device, n=6).view(2, 3)
    loss = fuselm.linear_cross_entropy(hidden, weight, labels, b, reduction=reduction)
    upstream = _upstream(loss)
    got = grads(loss, (hidden, weight, b) if bias else (hidden, weight), upstream)
    assert got[0].shape == hidden.shape and got[1].shape == weight.shape
    b64 = float64_leaf(b) if bias else torch.zeros(vocab, dtype=torch.float64, device=device)
    loss64 = cross_entropy_reference(b64.expand(6, vocab), labels.view(-1), reduction=reduction)
    if reduction == "none":
        loss64 = loss64.view(2, 3)
    assert_close(loss, loss64, torch.float32, "loss")
    if bias:
        assert_close(got[2], grads(loss64, (b64,), upstream.double())[0], torch.float32, "dbias")
    else:
        valid = labels != -100
        log_v = torch.full(labels.shape, math.log(vocab), dtype=torch.float64, device=device)
        expected = log_v.where(valid, 0.0) if reduction == "none" else log_v[valid].mean()
        assert_close(loss, expected, torch.float32, "loss = log V")


def test_return_z_loss(path, device):
    logits = randn(N, 257, device=device, requires_grad=True, scale=3.0)
    hidden, weight, _ = _linear_inputs(16, 257, False, torch.float32, device)
    labels = _labels(257, device)
    valid = labels != -100
    for reduction in ("mean", "sum", "none"):
        for name, call, z_logits in [
            ("cross_entropy", lambda **kw: fuselm.cross_entropy(logits, labels, **kw), logits),
            ("linear", lambda **kw: fuselm.linear_cross_entropy(hidden, weight, labels, chunk_tokens=4, **kw),
             F.linear(hidden, weight)),
        ]:
            loss, z = call(reduction=reduction, z_loss=1e-2, label_smoothing=0.1, return_z_loss=True)
            without = call(reduction=reduction, label_smoothing=0.1)
            z_rows = torch.where(valid, 1e-2 * torch.logsumexp(z_logits.double(), -1) ** 2, 0.0)
            expected = {"mean": z_rows.sum() / valid.sum(), "sum": z_rows.sum(), "none": z_rows}[reduction]
            assert not z.requires_grad, name
            assert_close(z, expected, torch.float32, f"{name} z ({reduction})")
            assert_close(loss - z, without, torch.float32, f"{name} loss - z ({reduction})")


def test_leading_dims_are_flattened(path, device):
    logits = randn(2, 7, 37, device=device, requires_grad=True)
    hidden, weight, _ = _linear_inputs(16, 37, False, torch.float32, device, n=14)
    hidden = hidden.detach().view(2, 7, 16).requires_grad_()
    labels = _labels(37, device, n=14).view(2, 7)
    for reduction in ("mean", "none"):
        loss = fuselm.cross_entropy(logits, labels, reduction=reduction)
        flat = cross_entropy_reference(logits.double().view(14, 37), labels.view(14), reduction=reduction)
        assert loss.shape == labels.shape[: loss.dim()]
        assert_close(loss, flat.view(loss.shape), torch.float32)
        loss = fuselm.linear_cross_entropy(hidden, weight, labels, reduction=reduction, chunk_tokens=4)
        flat = linear_cross_entropy_reference(hidden.double().view(14, 16), weight.double(), labels.view(14),
                                              reduction=reduction)
        assert_close(loss, flat.view(loss.shape), torch.float32)
        assert grads(loss, (hidden,), torch.ones_like(loss))[0].shape == hidden.shape


@pytest.mark.parametrize("frozen", ["weight", "hidden", "both", "no_grad"])
def test_frozen_inputs_get_no_gradient(path, device, frozen):
    """LoRA: a frozen lm_head gets no gradient (and none is computed); the others still match."""
    hidden, weight, b = _linear_inputs(16, 37, True, torch.float32, device)
    labels = _labels(37, device)
    if frozen in ("weight", "both"):
        weight.requires_grad_(False)
        b.requires_grad_(False)
    if frozen in ("hidden", "both"):
        hidden.requires_grad_(False)
    loss64 = linear_cross_entropy_reference(float64_leaf(hidden), float64_leaf(weight), labels, float64_leaf(b))
    with torch.set_grad_enabled(frozen != "no_grad"):
        loss = fuselm.linear_cross_entropy(hidden, weight, labels, b, chunk_tokens=4)
    assert_close(loss, loss64, torch.float32)
    if frozen in ("both", "no_grad"):
        assert not loss.requires_grad
        return
    loss.backward()
    inputs64 = [float64_leaf(t) for t in (hidden, weight, b)]
    linear_cross_entropy_reference(inputs64[0], inputs64[1], labels, inputs64[2]).backward()
    for t, t64 in zip((hidden, weight, b), inputs64):
        assert (t.grad is None) == (not t.requires_grad)
        if t.requires_grad:
            assert_close(t.grad, t64.grad, torch.float32)


def test_non_contiguous_inputs(path, device):
    labels = _labels(37, device, n=2 * N)[::2]  # stride 2
    for logits in (randn(37, N, device=device).t(), randn(N, 80, device=device)[:, 3:40]):  # column / row strides
        logits.requires_grad_()
        loss = fuselm.cross_entropy(logits, labels, reduction="none", softcap=5.0)
        logits64 = float64_leaf(logits)
        loss64 = cross_entropy_reference(logits64, labels, reduction="none", softcap=5.0)
        upstream = _upstream(loss)
        assert_close(loss, loss64, torch.float32)
        assert_close(grads(loss, (logits,), upstream)[0], grads(loss64, (logits64,), upstream.double())[0],
                     torch.float32)
    hidden = randn(16, N, device=device).t().requires_grad_()
    weight = (0.5 * randn(37, 32, device=device)[:, ::2]).requires_grad_()
    loss = fuselm.linear_cross_entropy(hidden, weight, labels, chunk_tokens=4)
    hidden64, weight64 = float64_leaf(hidden), float64_leaf(weight)
    loss64 = linear_cross_entropy_reference(hidden64, weight64, labels)
    assert_close(loss, loss64, torch.float32)
    for g, g64 in zip(grads(loss, (hidden, weight), None), grads(loss64, (hidden64, weight64), None)):
        assert_close(g, g64, torch.float32)


def test_inputs_are_not_mutated(path, device):
    logits = randn(N, 257, device=device, requires_grad=True)
    hidden, weight, b = _linear_inputs(16, 257, True, torch.float32, device)
    labels = _labels(257, device)
    tensors = (logits, hidden, weight, b, labels)
    before = [t.detach().clone() for t in tensors]
    for reduction in ("mean", "none"):
        loss = fuselm.cross_entropy(logits, labels, reduction=reduction, softcap=3.0, label_smoothing=0.1) + \
            fuselm.linear_cross_entropy(hidden, weight, labels, b, reduction=reduction, chunk_tokens=4, z_loss=0.1)
        grads(loss, (logits, hidden, weight, b), torch.ones_like(loss))
    for t, saved in zip(tensors, before):
        assert torch.equal(t.detach(), saved)


class RecordNewTensors(TorchDispatchMode):
    """Records the element count of every tensor an aten op creates (in-place, out= and aliasing ops
    create none)."""

    ALIASING = (torch.ops.aten.detach.default, torch.ops.aten.view.default)

    def __init__(self):
        super().__init__()
        self.numels = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        if not func._schema.is_mutable and func not in self.ALIASING:
            self.numels += [t.numel() for t in tree_leaves(out) if isinstance(t, torch.Tensor)]
        return out


def test_linear_chunks_never_hold_the_full_logits(device):
    """Every tensor the chunk loop creates (at the aten level) is far below N x V elements."""
    n, vocab = 40, 257
    hidden, weight, _ = _linear_inputs(8, vocab, False, torch.float32, device, n=n)
    labels = _labels(vocab, device, n=n)
    with torch.no_grad(), RecordNewTensors() as record:
        rows, lse, dhidden, dweight, _ = ce_module._linear_cross_entropy_chunks(
            hidden, weight, None, labels, None, -100, 0.0, None, 0.0, 4, True, True, False)
    assert 4 * vocab <= max(record.numels) < n * vocab / 2
    loss64 = linear_cross_entropy_reference(float64_leaf(hidden), float64_leaf(weight), labels, reduction="sum")
    assert_close(rows.sum(), loss64, torch.float32)
    with RecordNewTensors() as record:  # the check can fail: the reference path does hold them
        linear_cross_entropy_reference(hidden, weight, labels)
    assert max(record.numels) == n * vocab


def test_linear_backward_allocates_no_gradient_sized_tensor(device, monkeypatch):
    """.grad is the very buffer the chunk loop filled, and the backward allocates nothing of [N, H] or
    [V, H] size (no copy of the gradients, no zero gradients for the op's gradient outputs)."""
    buffers = []
    chunks = ce_module._linear_cross_entropy_chunks

    def recording_chunks(*args):
        out = chunks(*args)
        buffers.append((out[2].data_ptr(), out[3].data_ptr()))
        return out

    monkeypatch.setattr(ce_module, "_linear_cross_entropy_chunks", recording_chunks)
    n, hidden_size, vocab = 9, 16, 67
    hidden, weight, _ = _linear_inputs(hidden_size, vocab, False, torch.float32, device, n=n)
    with fuselm.use_backend("triton"):
        loss = fuselm.linear_cross_entropy(hidden, weight, _labels(vocab, device, n=n))
    with RecordNewTensors() as record:
        loss.backward()
    assert buffers == [(hidden.grad.data_ptr(), weight.grad.data_ptr())]
    assert max(record.numels) < n * hidden_size


def test_default_chunk_tokens():
    assert default_chunk_tokens(32000, torch.bfloat16) == 4096  # 256 MiB / 64000 B = 4194.3 -> 4096
    assert default_chunk_tokens(128256, torch.float32) == 512
    assert default_chunk_tokens(2**30, torch.float32) == 1
    for vocab, dtype in [(32000, torch.bfloat16), (151936, torch.bfloat16), (37, torch.float32)]:
        chunk = default_chunk_tokens(vocab, dtype)
        chunk_bytes = chunk * vocab * dtype.itemsize
        assert chunk & (chunk - 1) == 0 and chunk_bytes <= 256 * 2**20 < 2 * chunk_bytes


@pytest.mark.parametrize(
    "call,error,match",
    [
        (lambda x, y, h, w: fuselm.cross_entropy(x.tolist(), y), TypeError, "logits must be a torch.Tensor"),
        (lambda x, y, h, w: fuselm.cross_entropy(x.long(), y), TypeError, "logits must be a floating-point"),
        (lambda x, y, h, w: fuselm.cross_entropy(x[:, :0], y), ValueError, "non-empty last"),
        (lambda x, y, h, w: fuselm.cross_entropy(x, y.float()), TypeError, "labels must be an integer"),
        (lambda x, y, h, w: fuselm.cross_entropy(x, y.bool()), TypeError, "labels must be an integer"),
        (lambda x, y, h, w: fuselm.cross_entropy(x, y[:-1]), ValueError, "labels has shape"),
        (lambda x, y, h, w: fuselm.cross_entropy(x, y.to("meta")), ValueError, "labels is on meta"),
        (lambda x, y, h, w: fuselm.cross_entropy(x, y, reduction="avg"), ValueError, "reduction must be one of"),
        (lambda x, y, h, w: fuselm.cross_entropy(x, y, label_smoothing=1.5), ValueError, "label_smoothing must"),
        (lambda x, y, h, w: fuselm.cross_entropy(x, y, softcap=0.0), ValueError, "softcap must"),
        (lambda x, y, h, w: fuselm.cross_entropy(x, y, z_loss=-1.0), ValueError, "z_loss must"),
        (lambda x, y, h, w: fuselm.cross_entropy(x, y, label_smoothing=None), TypeError, "label_smoothing must be"),
        (lambda x, y, h, w: fuselm.cross_entropy(x, y, label_smoothing=torch.tensor(0.1)), TypeError,
         "label_smoothing must be a Python float"),
        (lambda x, y, h, w: fuselm.cross_entropy(x, y, softcap=torch.tensor(5.0)), TypeError, "softcap must be a"),
        (lambda x, y, h, w: fuselm.linear_cross_entropy(h, w, y, z_loss=None), TypeError, "z_loss must be a Python"),
        (lambda x, y, h, w: fuselm.cross_entropy(x, y, num_items=torch.ones(2)), ValueError, "num_items must be a 0-d"),
        (lambda x, y, h, w: fuselm.cross_entropy(x, y, num_items=0), ValueError, "num_items must be positive"),
        (lambda x, y, h, w: fuselm.cross_entropy(x, y, num_items=2.5), TypeError, "num_items must be an int"),
        (lambda x, y, h, w: fuselm.cross_entropy(x, y, reduction="sum", num_items=3), ValueError, "num_items divides"),
        (lambda x, y, h, w: fuselm.linear_cross_entropy(h, w[:, :-1], y), ValueError, "weight's hidden size"),
        (lambda x, y, h, w: fuselm.linear_cross_entropy(h, w[0], y), ValueError, "weight must have rank 2"),
        (lambda x, y, h, w: fuselm.linear_cross_entropy(h, w[:0], y), ValueError, "weight must have a non-empty"),
        (lambda x, y, h, w: fuselm.linear_cross_entropy(h, w.double(), y), TypeError, "weight has dtype"),
        (lambda x, y, h, w: fuselm.linear_cross_entropy(h, w.to("meta"), y), ValueError, "weight is on meta"),
        (lambda x, y, h, w: fuselm.linear_cross_entropy(h, w, y, torch.ones(5)), ValueError, "bias has size"),
        (lambda x, y, h, w: fuselm.linear_cross_entropy(h, w, y, torch.ones(37).half()), TypeError, "bias has dtype"),
        (lambda x, y, h, w: fuselm.linear_cross_entropy(h, w, y.view(1, -1)), ValueError, "labels has shape"),
        (lambda x, y, h, w: fuselm.linear_cross_entropy(h, w, y, chunk_tokens=0), ValueError, "chunk_tokens must"),
        (lambda x, y, h, w: fuselm.linear_cross_entropy(h.int(), w, y), TypeError, "hidden must be a floating"),
        # a tokenizer's pad_token_id is None for Llama's
        (lambda x, y, h, w: fuselm.cross_entropy(x, y, ignore_index=None), TypeError, "ignore_index must be an int"),
        (lambda x, y, h, w: fuselm.linear_cross_entropy(h, w, y, ignore_index=None), TypeError, "ignore_index must"),
        (lambda x, y, h, w: fuselm.cross_entropy(x, y, ignore_index=5.0), TypeError, "ignore_index must be an int"),
    ],
)
def test_bad_input_names_the_argument(call, error, match):
    x, y = randn(N, 37), _labels(37, "cpu")
    h, w = randn(N, 16), randn(37, 16)
    with pytest.raises(error, match=match):
        call(x, y, h, w)


def test_torch_compile_fullgraph_traces_the_custom_ops(device):
    logits = randn(N, 257, device=device, requires_grad=True, scale=3.0)
    hidden, weight, b = _linear_inputs(16, 257, True, torch.float32, device)
    labels = _labels(257, device)
    num_items = torch.tensor(17, device=device)

    def f(logits, hidden, weight, b, labels, num_items):
        loss = fuselm.cross_entropy(logits, labels, label_smoothing=0.1, softcap=5.0)
        loss = loss + fuselm.linear_cross_entropy(hidden, weight, labels, b, num_items=num_items, z_loss=1e-3,
                                                  chunk_tokens=4)
        return loss + fuselm.linear_cross_entropy(hidden, weight, labels, reduction="none", chunk_tokens=8).sum()

    assert_compiles_like_eager(f, (logits, hidden, weight, b, labels, num_items), (logits, hidden, weight, b))


def test_triton_path_appears_in_profile(device):
    logits = randn(N, 37, device=device, requires_grad=True)
    hidden, weight, _ = _linear_inputs(16, 37, False, torch.float32, device)
    labels = _labels(37, device)
    with fuselm.use_backend("triton"), torch.profiler.profile() as prof:
        fuselm.cross_entropy(logits, labels).backward()
        fuselm.linear_cross_entropy(hidden, weight, labels).backward()
        fuselm.linear_cross_entropy(hidden, weight, labels, reduction="none").sum().backward()
    names = {e.key for e in prof.key_averages()}
    for op in ("cross_entropy", "cross_entropy_backward", "linear_cross_entropy", "linear_cross_entropy_backward"):
        assert f"fuselm::{op}" in names


# ----------------------------------------------------------------------------------- GPU, large sizes
@pytest.mark.gpu
def test_gpu_cross_entropy_llama_vocab():
    logits = randn(4096, 32000, dtype=torch.bfloat16, device="cuda", requires_grad=True, scale=3.0)
    labels = _labels(32000, "cuda", n=4096)
    opts = dict(label_smoothing=0.1, softcap=30.0, z_loss=1e-4)
    loss = fuselm.cross_entropy(logits, labels, **opts)
    (dlogits,) = grads(loss, (logits,), None)
    logits64 = float64_leaf(logits)
    loss64 = cross_entropy_reference(logits64, labels, **opts)
    (dlogits64,) = grads(loss64, (logits64,), None)
    assert_close(loss, loss64, torch.float32, "loss")
    assert_close(dlogits, dlogits64, torch.bfloat16, "dlogits")


@pytest.mark.gpu
@pytest.mark.parametrize("reduction,chunk_tokens", [("mean", None), ("none", None), ("mean", 256)])
def test_gpu_linear_cross_entropy_llama_shape(reduction, chunk_tokens):
    """Default chunks hold all 4096 tokens; 256-token chunks split each row into vocabulary segments."""
    hidden, weight, _ = _linear_inputs(4096, 32000, False, torch.bfloat16, "cuda", n=4096)
    labels = _labels(32000, "cuda", n=4096)
    loss = fuselm.linear_cross_entropy(hidden, weight, labels, reduction=reduction, z_loss=1e-4,
                                       chunk_tokens=chunk_tokens)
    upstream = _upstream(loss)
    dhidden, dweight = grads(loss, (hidden, weight), upstream)
    hidden64, weight64 = float64_leaf(hidden), float64_leaf(weight)
    loss64 = linear_cross_entropy_reference(hidden64, weight64, labels, reduction=reduction, z_loss=1e-4)
    dhidden64, dweight64 = grads(loss64, (hidden64, weight64), upstream.double())
    assert_close(loss, loss64, torch.bfloat16, "loss")
    assert_close(dhidden, dhidden64, torch.bfloat16, "dhidden")
    assert_close(dweight, dweight64, torch.bfloat16, "dweight")


@pytest.mark.gpu
def test_gpu_linear_cross_entropy_memory():
    """Frozen lm_head (LoRA): peak extra memory is the chunk buffer and d hidden, not [N, V] logits."""
    n, hidden_size, vocab = 4096, 4096, 32000
    hidden, weight, _ = _linear_inputs(hidden_size, vocab, False, torch.bfloat16, "cuda", n=n)
    weight.requires_grad_(False)
    labels = _labels(vocab, "cuda", n=n)
    chunk = 1024
    grads(fuselm.linear_cross_entropy(hidden, weight, labels, chunk_tokens=chunk), (hidden,), None)  # warm-up
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    base = torch.cuda.memory_allocated()
    grads(fuselm.linear_cross_entropy(hidden, weight, labels, chunk_tokens=chunk), (hidden,), None)
    torch.cuda.synchronize()
    extra = torch.cuda.max_memory_allocated() - base
    chunk_buffer = chunk * vocab * 2  # 62.5 MiB
    # HF's path holds the bf16 logits (n * vocab * 2 = 250 MiB here) and fp32 copies of them.
    assert extra < chunk_buffer + 2 * hidden.nbytes + 8 * 2**20 < n * vocab * 2


@pytest.mark.gpu
def test_gpu_works_under_cuda_graphs():
    """Captured forward + backward: any host synchronisation would abort the capture."""
    hidden, weight, _ = _linear_inputs(256, 4000, False, torch.bfloat16, "cuda", n=512)
    logits = randn(512, 4000, dtype=torch.bfloat16, device="cuda", requires_grad=True)
    labels = _labels(4000, "cuda", n=512)

    def step(hidden, logits):
        return fuselm.linear_cross_entropy(hidden, weight.detach(), labels, z_loss=1e-4) + \
            fuselm.cross_entropy(logits, labels, label_smoothing=0.1)

    graphed = torch.cuda.make_graphed_callables(step, (hidden, logits))
    eager = step(hidden, logits)
    eager_grads = grads(eager, (hidden, logits), None)
    loss = graphed(hidden, logits)
    for g, g_e in zip(grads(loss, (hidden, logits), None), eager_grads):
        assert_close(g, g_e, torch.bfloat16, scale=0.1)
    assert_close(loss, eager, torch.float32)


@pytest.mark.gpu
def test_gpu_more_than_2_31_logits():
    n, vocab = 2**31 // 128256 + 5, 128256
    logits = torch.randn(n, vocab, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    labels = torch.randint(0, vocab, (n,), device="cuda")
    loss = fuselm.cross_entropy(logits, labels, reduction="none")
    (dlogits,) = grads(loss, (logits,), torch.ones_like(loss))
    tail = slice(n - 5, n)
    tail64 = float64_leaf(logits[tail])
    loss64 = cross_entropy_reference(tail64, labels[tail], reduction="none")
    assert_close(loss[tail], loss64, torch.float32)
    assert_close(dlogits[tail], grads(loss64, (tail64,), torch.ones_like(loss64))[0], torch.bfloat16)


def test_second_backward_through_the_same_graph(path, device):
    """Triton computes the gradients in the forward and the first backward scales them in place, so a
    second (retain_graph) backward is refused and leaves the gradients alone. The reference keeps
    autograd's own graph: a second backward adds the same gradients again."""
    hidden, weight, _ = _linear_inputs(16, 37, False, torch.float32, device, n=5)
    labels = _labels(37, device, n=5)
    loss = fuselm.linear_cross_entropy(hidden, weight, labels)
    loss.backward(retain_graph=True)
    first = hidden.grad.clone(), weight.grad.clone()
    assert first[0].abs().sum() > 0 and first[1].abs().sum() > 0
    if path == "triton":
        with pytest.raises(RuntimeError, match="backward ran twice"):
            loss.backward()
        expected = first
    else:
        loss.backward()
        expected = 2 * first[0], 2 * first[1]
    assert torch.equal(hidden.grad, expected[0]) and torch.equal(weight.grad, expected[1])
