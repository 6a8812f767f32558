import math

import pytest
import torch

import fuselm
from fuselm.ops.lora import lora_add_reference, lora_linear_reference
from tests.helpers import TOLERANCE, assert_close, assert_compiles_like_eager, float64_leaf, grads, randn

DTYPES = [torch.float32, torch.bfloat16, torch.float16]
# (leading shape of x, K, [(N, r) per projection]): odd sizes, rank 1, no rows, three projections of one x
CASES = [((5,), 37, [(19, 1)]), ((2, 3), 24, [(40, 4)]), ((0,), 16, [(8, 2)]),
         ((7,), 33, [(33, 3), (9, 5)]), ((2, 5), 20, [(24, 4), (12, 4), (12, 1)])]


def _float64_outputs(x, base_outs, lora_as, lora_bs, scalings):
    """The projections' outputs and the float64 reference of each, with the same leaves and float64 copies."""
    leaves = [x, *base_outs, *lora_as, *lora_bs]
    leaves64 = [float64_leaf(t) for t in leaves]
    x64, rest = leaves64[0], leaves64[1:]
    n = len(base_outs)
    outs64 = [lora_add_reference(x64, base, a, b, s)
              for base, a, b, s in zip(rest[:n], rest[n:2 * n], rest[2 * n:], scalings)]
    return leaves, leaves64, outs64


def _inputs(lead, k, projections, dtype, adapter_dtype, device):
    x = randn(*lead, k, dtype=dtype, device=device, requires_grad=True)
    base_outs = [randn(*lead, n, dtype=dtype, device=device, requires_grad=True) for n, _ in projections]
    # B as large as A, as after some training (PEFT initialises B to zeros)
    lora_as = [randn(r, k, dtype=adapter_dtype, device=device, requires_grad=True, scale=k ** -0.5)
               for _, r in projections]
    lora_bs = [randn(n, r, dtype=adapter_dtype, device=device, requires_grad=True) for n, r in projections]
    ranks = [r for _, r in projections]
    scalings = [16 / ranks[0], 16 / math.sqrt(ranks[-1]), 0.5][:len(projections)]  # alpha / r, rsLoRA's, any
    return x, base_outs, lora_as, lora_bs, scalings


@pytest.mark.parametrize("lead,k,projections", CASES)
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("adapters", ["fp32", "x's dtype"])
def test_outputs_and_gradients_match_float64(path, device, lead, k, projections, dtype, adapters):
    adapter_dtype = torch.float32 if adapters == "fp32" else dtype
    x, base_outs, lora_as, lora_bs, scalings = _inputs(lead, k, projections, dtype, adapter_dtype, device)
    if len(projections) == 1:
        outs = [fuselm.lora_add(x, base_outs[0], lora_as[0], lora_bs[0], scalings[0])]
    else:
        outs = fuselm.lora_add_shared(x, base_outs, lora_as, lora_bs, scalings)
    upstream = [randn(*out.shape, dtype=dtype, device=device) for out in outs]
    leaves, leaves64, outs64 = _float64_outputs(x, base_outs, lora_as, lora_bs, scalings)
    got = grads(outs, leaves, upstream)
    expected = grads(outs64, leaves64, [dy.double() for dy in upstream])
    for i, (out, out64) in enumerate(zip(outs, outs64)):
        assert out.dtype == dtype and out.shape == out64.shape
        assert_close(out, out64, dtype, f"out {i}")
    # the adapters' gradients are fp32 masters' gradients made from half-precision products: x's dtype's bound
    for leaf, grad, grad64 in zip(leaves, got, expected):
        assert grad.dtype == leaf.dtype
        assert_close(grad, grad64, dtype, f"gradient of a {tuple(leaf.shape)} {leaf.dtype} input")


def test_shared_equals_separate_calls(path, device):
    x, base_outs, lora_as, lora_bs, scalings = _inputs((6,), 20, [(24, 4), (10, 2), (10, 3)], torch.float32,
                                                       torch.float32, device)
    shared = fuselm.lora_add_shared(x, base_outs, lora_as, lora_bs, scalings)
    separate = [fuselm.lora_add(x, *args) for args in zip(base_outs, lora_as, lora_bs, scalings)]
    upstream = [randn(*out.shape, device=device) for out in shared]
    leaves = [x, *base_outs, *lora_as, *lora_bs]
    for out, single in zip(shared, separate):
        assert_close(out, single, torch.float32)
    for got, expected in zip(grads(shared, leaves, upstream), grads(separate, leaves, upstream)):
        assert_close(got, expected, torch.float32)


def test_only_the_needed_gradients_and_an_unused_output(path, device):
    """Frozen x and base outputs (the first layer, whose input is an embedding): only A and B get gradients; one
    projection of a shared call whose output is not used gives its adapters no gradient."""
    x, base_outs, lora_as, lora_bs, scalings = _inputs((4,), 12, [(8, 2), (6, 2)], torch.bfloat16, torch.float32,
                                                       device)
    x.requires_grad_(False)
    for base in base_outs:
        base.requires_grad_(False)
    first, _ = fuselm.lora_add_shared(x, base_outs, lora_as, lora_bs, scalings)
    first.float().sum().backward()
    assert x.grad is None and all(base.grad is None for base in base_outs)
    assert lora_as[0].grad.abs().sum() > 0 and lora_bs[0].grad.abs().sum() > 0
    assert lora_as[1].grad is None and lora_bs[1].grad is None


def test_non_contiguous_inputs(path, device):
    x = randn(24, 6, device=device).t().requires_grad_()  # [6, 24], column stride 6
    base = randn(10, 6, device=device).t().requires_grad_()
    a = randn(24, 3, device=device).t().requires_grad_()
    b = randn(10, 3, device=device, requires_grad=True)
    out = fuselm.lora_add(x, base, a, b, 1.5)
    upstream = randn(6, 10, device=device).t().contiguous().t()  # a transposed gradient, as from a view
    leaves, leaves64, (out64,) = _float64_outputs(x, [base], [a], [b], [1.5])
    assert_close(out, out64, torch.float32)
    for got, expected in zip(grads(out, leaves, upstream), grads(out64, leaves64, upstream.double())):
        assert_close(got, expected, torch.float32)


def test_inputs_are_not_mutated(path, device):
    x, base_outs, lora_as, lora_bs, scalings = _inputs((5,), 16, [(8, 2)], torch.bfloat16, torch.float32, device)
    copies = [t.detach().clone() for t in (x, *base_outs, *lora_as, *lora_bs)]
    out = fuselm.lora_add(x, base_outs[0], lora_as[0], lora_bs[0], scalings[0])
    out.float().sum().backward()
    assert all(torch.equal(t, c) for t, c in zip((x, *base_outs, *lora_as, *lora_bs), copies))


def test_nan_propagates(path, device):
    x, base_outs, lora_as, lora_bs, scalings = _inputs((5,), 16, [(8, 2)], torch.float32, torch.float32, device)
    with torch.no_grad():
        x[2, 3] = float("nan")
    out = fuselm.lora_add(x, base_outs[0], lora_as[0], lora_bs[0], scalings[0])
    assert torch.isnan(out[2]).all() and not torch.isnan(out[[0, 1, 3, 4]]).any()


def test_fused_path_keeps_no_fp32_copy_of_x(device):
    """What backward keeps: x itself, t' = x A'ᵀ [M, Σr] and the adapters cast to x's dtype (A scaled and stacked,
    each B): nothing in fp32."""
    x, base_outs, lora_as, lora_bs, scalings = _inputs((64,), 48, [(40, 4), (40, 4)], torch.bfloat16,
                                                       torch.float32, device)
    saved = []
    with fuselm.use_backend("triton"), torch.autograd.graph.saved_tensors_hooks(lambda t: saved.append(t) or t,
                                                                                lambda t: t):
        fuselm.lora_add_shared(x, base_outs, lora_as, lora_bs, scalings)
    kept = sorted((tuple(t.shape), str(t.dtype)) for t in saved)
    assert kept == sorted([((64, 48), "torch.bfloat16"), ((64, 8), "torch.bfloat16"), ((8, 48), "torch.bfloat16"),
                           *[((40, 4), "torch.bfloat16")] * 2])


def test_a_qkv_group_runs_4_gemms_forward_and_8_backward(device):
    """One GEMM for x Aᵀ and one addmm per projection forward; backward one GEMM per projection for dy B and for dB,
    and one for the whole group for each of dx and the A gradients (which is what keeps launches few)."""
    from torch.utils._python_dispatch import TorchDispatchMode

    class CountGemms(TorchDispatchMode):
        def __init__(self):
            super().__init__()
            self.count = 0

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            self.count += func.overloadpacket in (torch.ops.aten.mm, torch.ops.aten.addmm)
            return func(*args, **(kwargs or {}))

    x, base_outs, lora_as, lora_bs, scalings = _inputs((6,), 16, [(16, 2), (8, 2), (8, 2)], torch.bfloat16,
                                                       torch.float32, device)
    with fuselm.use_backend("triton"), CountGemms() as forward:
        outs = fuselm.lora_add_shared(x, base_outs, lora_as, lora_bs, [2.0] * 3)
    with CountGemms() as backward:
        torch.autograd.backward(outs, [torch.ones_like(out) for out in outs])
    assert (forward.count, backward.count) == (4, 8)
    assert all(t.grad is not None for t in (x, *lora_as, *lora_bs))


@pytest.mark.parametrize("packed", [False, True])
@pytest.mark.parametrize("activation", ["silu", "gelu_tanh"])
def test_down_projection_recomputes_its_input_from_the_glu(path, device, packed, activation):
    """With glu_inputs the result and every gradient (through the GLU to gate and up) are those of keeping x, and
    backward keeps gate and up, which the GLU keeps anyway, instead of x."""
    gated = {"silu": fuselm.silu_mul, "gelu_tanh": fuselm.gelu_tanh_mul}[activation]
    gate = randn(6, 2 * 10 if packed else 10, dtype=torch.bfloat16, device=device, requires_grad=True)
    up = None if packed else randn(6, 10, dtype=torch.bfloat16, device=device, requires_grad=True)
    base = randn(6, 12, dtype=torch.bfloat16, device=device, requires_grad=True)
    a, b = randn(3, 10, device=device, requires_grad=True), randn(12, 3, device=device, requires_grad=True)
    leaves = [t for t in (gate, up, base, a, b) if t is not None]
    upstream = randn(6, 12, dtype=torch.bfloat16, device=device)
    results = []
    for glu_inputs in (None, (gate, up, activation)):
        saved = []
        with torch.autograd.graph.saved_tensors_hooks(lambda t, saved=saved: saved.append(t) or t, lambda t: t):
            hidden = gated(gate, up)
            out = fuselm.lora_add(hidden, base, a, b, 0.75, glu_inputs=glu_inputs)
        results.append((out, grads(out, leaves, upstream), any(t is hidden for t in saved)))
    (kept_out, kept_grads, hidden_kept), (out, got_grads, hidden_still_kept) = results
    assert torch.equal(out, kept_out)
    for got, expected in zip(got_grads, kept_grads):
        assert torch.equal(got, expected)
    if path == "triton":  # the reference (PEFT's arithmetic) keeps an fp32 copy of hidden either way
        assert hidden_kept and not hidden_still_kept


@pytest.mark.parametrize(
    "call,error,match",
    [
        (lambda x, o, a, b: fuselm.lora_add(x, o[:-1], a, b, 1.0), ValueError, "base_outs.0. has shape"),
        (lambda x, o, a, b: fuselm.lora_add(x, o, a[:, :-1], b, 1.0), ValueError, "lora_as.0. must be"),
        (lambda x, o, a, b: fuselm.lora_add(x, o, a, b[:-1], 1.0), ValueError, "lora_as.0. must be"),
        (lambda x, o, a, b: fuselm.lora_add(x, o, a[:0], b[:, :0], 1.0), ValueError, "r >= 1"),
        (lambda x, o, a, b: fuselm.lora_add(x, o.double(), a, b, 1.0), TypeError, "base_outs.0. has dtype"),
        (lambda x, o, a, b: fuselm.lora_add(x, o, a, b.double(), 1.0), TypeError, "lora_bs.0. has dtype"),
        (lambda x, o, a, b: fuselm.lora_add(x, o, a.to("meta"), b, 1.0), ValueError, "lora_as.0. is on meta"),
        (lambda x, o, a, b: fuselm.lora_add(x, o, a, b, torch.tensor(1.0)), TypeError, "scalings.0. must be"),
        (lambda x, o, a, b: fuselm.lora_add(x.tolist(), o, a, b, 1.0), TypeError, "x must be a torch.Tensor"),
        (lambda x, o, a, b: fuselm.lora_add(x, o, a[0], b, 1.0), ValueError, "lora_as.0. must have rank 2"),
        (lambda x, o, a, b: fuselm.lora_add_shared(x, [o] * 4, [a] * 4, [b] * 4, [1.0] * 4), ValueError,
         "one entry per projection"),
        (lambda x, o, a, b: fuselm.lora_add_shared(x, [o, o], [a], [b], [1.0]), ValueError,
         "one entry per projection"),
        (lambda x, o, a, b: fuselm.lora_add(x, o, a, b, 1.0, glu_inputs=(x, x, "relu")), ValueError,
         "activation must be one of"),
        (lambda x, o, a, b: fuselm.lora_add(x, o, a, b, 1.0, glu_inputs=(x[:, :-1], None, "silu")), ValueError,
         "glu_inputs' gate has shape"),
        (lambda x, o, a, b: fuselm.lora_add(x, o, a, b, 1.0, glu_inputs=(x, x[:-1], "silu")), ValueError,
         "glu_inputs' up has shape"),
    ],
)
def test_bad_input_names_the_argument(call, error, match):
    x, out, a, b = randn(4, 8), randn(4, 6), randn(2, 8), randn(6, 2)
    with pytest.raises(error, match=match):
        call(x, out, a, b)


def test_float64_runs_the_reference_under_auto(device):
    x, base_outs, lora_as, lora_bs, scalings = _inputs((3,), 8, [(5, 2)], torch.float64, torch.float64, device)
    with fuselm.use_backend("auto"):
        got = fuselm.lora_add(x, base_outs[0], lora_as[0], lora_bs[0], scalings[0])
    assert torch.equal(got, lora_add_reference(x, base_outs[0], lora_as[0], lora_bs[0], scalings[0]))


def _two_projections(x, base_q, base_k, a_q, a_k, b_q, b_k):
    q, k = fuselm.lora_add_shared(x, [base_q, base_k], [a_q, a_k], [b_q, b_k], [2.0, 0.5])
    return q.sum(-1) * k.sum(-1)


def test_torch_compile_fullgraph_traces_the_custom_op(device):
    x, (base_q, base_k), (a_q, a_k), (b_q, b_k), _ = _inputs((5,), 16, [(8, 2), (6, 3)], torch.float32,
                                                              torch.float32, device)
    leaves = (x, base_q, base_k, a_q, a_k, b_q, b_k)
    assert_compiles_like_eager(_two_projections, leaves, leaves)


def test_fused_path_appears_in_profile(device):
    x, (base_q, base_k), (a_q, a_k), (b_q, b_k), _ = _inputs((5,), 16, [(8, 2), (6, 3)], torch.bfloat16,
                                                              torch.float32, device)
    with fuselm.use_backend("triton"), torch.profiler.profile() as prof:
        _two_projections(x, base_q, base_k, a_q, a_k, b_q, b_k).float().sum().backward()
    assert "fuselm::lora_add" in {e.key for e in prof.key_averages()}
    assert a_q.grad is not None and x.grad is not None


# ----------------------------------------------------------------------------------- lora_linear (base included)
def _linear_inputs(lead, k, projections, dtype, adapter_dtype, device, trainable_base=False, bias=True):
    """x, and per projection its base weight [N, K] (frozen unless ``trainable_base``), bias [N] (every other
    projection; none when not ``bias``) and adapters, as :func:`_inputs` draws them."""
    x, _, lora_as, lora_bs, scalings = _inputs(lead, k, projections, dtype, adapter_dtype, device)
    weights = [randn(n, k, dtype=dtype, device=device, requires_grad=trainable_base, scale=k ** -0.5)
               for n, _ in projections]
    biases = [randn(n, dtype=dtype, device=device, requires_grad=trainable_base) if bias and i % 2 == 0 else None
              for i, (n, _) in enumerate(projections)]
    return x, weights, biases, lora_as, lora_bs, scalings


def _call_linear(x, weights, biases, lora_as, lora_bs, scalings, **options):
    if len(weights) == 1:
        return [fuselm.lora_linear(x, weights[0], biases[0], lora_as[0], lora_bs[0], scalings[0], **options)]
    return fuselm.lora_linear_shared(x, weights, biases, lora_as, lora_bs, scalings, **options)


@pytest.mark.parametrize("lead,k,projections", CASES)
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("trainable_base", [False, True])
def test_lora_linear_outputs_and_gradients_match_float64(path, device, lead, k, projections, dtype, trainable_base):
    x, weights, biases, lora_as, lora_bs, scalings = _linear_inputs(lead, k, projections, dtype, torch.float32,
                                                                    device, trainable_base)
    outs = _call_linear(x, weights, biases, lora_as, lora_bs, scalings)
    upstream = [randn(*out.shape, dtype=dtype, device=device) for out in outs]
    leaves = [t for t in (x, *weights, *biases, *lora_as, *lora_bs) if t is not None and t.requires_grad]
    n = len(projections)
    d = lambda t: None if t is None else float64_leaf(t)  # noqa: E731
    x64, weights64, biases64 = d(x), [d(w) for w in weights], [d(b) for b in biases]
    as64, bs64 = [d(a) for a in lora_as], [d(b) for b in lora_bs]
    outs64 = [lora_linear_reference(x64, *args) for args in zip(weights64, biases64, as64, bs64, scalings)]
    leaves64 = [t for t in (x64, *weights64, *biases64, *as64, *bs64) if t is not None and t.requires_grad]
    assert len(outs) == n
    for i, (out, out64) in enumerate(zip(outs, outs64)):
        assert out.dtype == dtype and out.shape == out64.shape
        assert_close(out, out64, dtype, f"out {i}")
    got = grads(outs, leaves, upstream)
    expected = grads(outs64, leaves64, [dy.double() for dy in upstream])
    for leaf, grad, grad64 in zip(leaves, got, expected):
        assert grad.dtype == leaf.dtype
        assert_close(grad, grad64, dtype, f"gradient of a {tuple(leaf.shape)} {leaf.dtype} input")


def test_lora_linear_equals_the_base_then_lora_add(path, device):
    """The base computed inside is the base layer's own F.linear: the same outputs and gradients as F.linear followed
    by lora_add (fp32, so the one order of additions cannot hide behind rounding)."""
    x, weights, biases, lora_as, lora_bs, scalings = _linear_inputs((6,), 20, [(24, 4), (10, 2), (10, 3)],
                                                                    torch.float32, torch.float32, device)
    fused = fuselm.lora_linear_shared(x, weights, biases, lora_as, lora_bs, scalings)
    bases = [torch.nn.functional.linear(x, w, b) for w, b in zip(weights, biases)]
    separate = fuselm.lora_add_shared(x, bases, lora_as, lora_bs, scalings)
    upstream = [randn(*out.shape, device=device) for out in fused]
    leaves = [x, *lora_as, *lora_bs]
    for out, expected in zip(fused, separate):
        assert_close(out, expected, torch.float32)
    for got, expected in zip(grads(fused, leaves, upstream), grads(separate, leaves, upstream)):
        assert_close(got, expected, torch.float32)


def test_lora_linear_an_unused_output_and_frozen_x(path, device):
    x, weights, biases, lora_as, lora_bs, scalings = _linear_inputs((4,), 12, [(8, 2), (6, 2)], torch.bfloat16,
                                                                    torch.float32, device)
    x.requires_grad_(False)
    first, _ = fuselm.lora_linear_shared(x, weights, biases, lora_as, lora_bs, scalings)
    first.float().sum().backward()
    assert x.grad is None and all(w.grad is None for w in weights)
    assert lora_as[0].grad.abs().sum() > 0 and lora_bs[0].grad.abs().sum() > 0
    assert lora_as[1].grad is None and lora_bs[1].grad is None


def test_lora_linear_non_contiguous_and_not_mutated(path, device):
    x = randn(24, 6, device=device).t().requires_grad_()  # [6, 24], column stride 6
    weight = randn(24, 10, device=device).t()  # [10, 24], transposed storage
    a = randn(24, 3, device=device).t().requires_grad_()
    b = randn(10, 3, device=device, requires_grad=True)
    copies = [t.detach().clone() for t in (x, weight, a, b)]
    out = fuselm.lora_linear(x, weight, None, a, b, 1.5)
    upstream = randn(6, 10, device=device).t().contiguous().t()
    x64, w64, a64, b64 = (float64_leaf(t) for t in (x, weight, a, b))
    out64 = lora_linear_reference(x64, w64, None, a64, b64, 1.5)
    assert_close(out, out64, torch.float32)
    for got, expected in zip(grads(out, [x, a, b], upstream), grads(out64, [x64, a64, b64], upstream.double())):
        assert_close(got, expected, torch.float32)
    assert all(torch.equal(t, c) for t, c in zip((x, weight, a, b), copies))


def test_lora_linear_nan_propagates(path, device):
    x, weights, biases, lora_as, lora_bs, scalings = _linear_inputs((5,), 16, [(8, 2)], torch.float32,
                                                                    torch.float32, device)
    with torch.no_grad():
        x[2, 3] = float("nan")
    (out,) = _call_linear(x, weights, biases, lora_as, lora_bs, scalings)
    assert torch.isnan(out[2]).all() and not torch.isnan(out[[0, 1, 3, 4]]).any()


class _CountOps:
    """Counts GEMMs (mm, addmm, addmm_) and additions (add) of aten ops run under it."""

    def __enter__(self):
        from torch.utils._python_dispatch import TorchDispatchMode

        counts = self

        class Mode(TorchDispatchMode):
            def __torch_dispatch__(self, func, types, args=(), kwargs=None):
                counts.gemms += func.overloadpacket in (torch.ops.aten.mm, torch.ops.aten.addmm, torch.ops.aten.addmm_)
                counts.adds += func.overloadpacket is torch.ops.aten.add
                return func(*args, **(kwargs or {}))

        self.gemms = self.adds = 0
        self.mode = Mode()
        self.mode.__enter__()
        return self

    def __exit__(self, *exc):
        self.mode.__exit__(*exc)


def test_a_qkv_lora_linear_group_sums_its_input_gradient_in_the_gemms(device):
    """Forward: 3 base GEMMs, x A'ᵀ, and 3 in-place addmm of the branches. Backward: dy B and dB per projection, the A
    gradients in one GEMM, and dx as one GEMM plus one accumulating addmm per base weight: no separate add, where a
    base layer of its own would leave autograd three to sum x's gradient; no GEMM for the frozen weights."""
    x, weights, biases, lora_as, lora_bs, scalings = _linear_inputs((6,), 16, [(16, 2), (8, 2), (8, 2)],
                                                                    torch.bfloat16, torch.float32, device)
    with fuselm.use_backend("triton"), _CountOps() as forward:
        outs = fuselm.lora_linear_shared(x, weights, biases, lora_as, lora_bs, [2.0] * 3)
    with _CountOps() as backward:
        torch.autograd.backward(outs, [torch.ones_like(out) for out in outs])
    assert (forward.gemms, backward.gemms, backward.adds) == (7, 11, 0)
    assert all(t.grad is not None for t in (x, *lora_as, *lora_bs))


@pytest.mark.parametrize("packed", [False, True])
def test_lora_linear_down_projection_recomputes_its_input_from_the_glu(path, device, packed):
    gate = randn(6, 2 * 10 if packed else 10, dtype=torch.bfloat16, device=device, requires_grad=True)
    up = None if packed else randn(6, 10, dtype=torch.bfloat16, device=device, requires_grad=True)
    weight = randn(12, 10, dtype=torch.bfloat16, device=device)
    a, b = randn(3, 10, device=device, requires_grad=True), randn(12, 3, device=device, requires_grad=True)
    leaves = [t for t in (gate, up, a, b) if t is not None]
    upstream = randn(6, 12, dtype=torch.bfloat16, device=device)
    results = []
    for glu_inputs in (None, (gate, up, "silu")):
        hidden = fuselm.silu_mul(gate, up)
        out = fuselm.lora_linear(hidden, weight, None, a, b, 0.75, glu_inputs=glu_inputs)
        results.append((out, grads(out, leaves, upstream)))
    (kept_out, kept_grads), (out, got_grads) = results
    assert torch.equal(out, kept_out)
    for got, expected in zip(got_grads, kept_grads):
        assert torch.equal(got, expected)


@pytest.mark.parametrize(
    "call,error,match",
    [
        (lambda x, w, a, b: fuselm.lora_linear(x, w[:, :-1], None, a, b, 1.0), ValueError, r"weights.0. must be"),
        (lambda x, w, a, b: fuselm.lora_linear(x, w, w[0, :-1], a, b, 1.0), ValueError, r"biases.0. must be \[6\]"),
        (lambda x, w, a, b: fuselm.lora_linear(x, w.double(), None, a, b, 1.0), TypeError, "weights.0. has dtype"),
        (lambda x, w, a, b: fuselm.lora_linear(x, w, None, a, b[:-1], 1.0), ValueError, "lora_as.0. must be"),
        (lambda x, w, a, b: fuselm.lora_linear(x, w[0], None, a, b, 1.0), ValueError, "weights.0. must have rank 2"),
        (lambda x, w, a, b: fuselm.lora_linear_shared(x, [w, w], [None], [a, a], [b, b], [1.0, 1.0]), ValueError,
         "biases must have one entry"),
        (lambda x, w, a, b: fuselm.lora_linear_shared(x, [w] * 4, [None] * 4, [a] * 4, [b] * 4, [1.0] * 4),
         ValueError, "weights, lora_as, lora_bs and scalings must have one entry per projection"),
    ],
)
def test_lora_linear_bad_input_names_the_argument(call, error, match):
    x, w, a, b = randn(4, 8), randn(6, 8), randn(2, 8), randn(6, 2)
    with pytest.raises(error, match=match):
        call(x, w, a, b)


def _two_linears(x, w_q, w_k, a_q, a_k, b_q, b_k):
    q, k = fuselm.lora_linear_shared(x, [w_q, w_k], [None, None], [a_q, a_k], [b_q, b_k], [2.0, 0.5])
    return q.sum(-1) * k.sum(-1)


def test_lora_linear_compiles_and_appears_in_profile(device):
    x, weights, _, (a_q, a_k), (b_q, b_k), _ = _linear_inputs((5,), 16, [(8, 2), (6, 3)], torch.float32,
                                                              torch.float32, device)
    leaves = (x, a_q, a_k, b_q, b_k)
    assert_compiles_like_eager(_two_linears, (x, *weights, a_q, a_k, b_q, b_k), leaves)
    with fuselm.use_backend("triton"), torch.profiler.profile() as prof:
        _two_linears(x, *weights, a_q, a_k, b_q, b_k).float().sum().backward()
    assert "fuselm::lora_linear" in {e.key for e in prof.key_averages()}


# ----------------------------------------------------------------------------------- GPU
@pytest.mark.gpu
@pytest.mark.parametrize("rank", [16, 1])
def test_gpu_llama_8b_shaped_q_k_v(rank):
    """q/k/v of Llama-3-8B at 4096 tokens with fp32 adapters: bf16 bounds against float64."""
    projections = [(4096, rank), (1024, rank), (1024, rank)]
    x, base_outs, lora_as, lora_bs, scalings = _inputs((4096,), 4096, projections, torch.bfloat16, torch.float32,
                                                       "cuda")
    with fuselm.use_backend("triton"):
        outs = fuselm.lora_add_shared(x, base_outs, lora_as, lora_bs, scalings)
    upstream = [randn(*out.shape, dtype=torch.bfloat16, device="cuda") for out in outs]
    leaves, leaves64, outs64 = _float64_outputs(x, base_outs, lora_as, lora_bs, scalings)
    got = grads(outs, leaves, upstream)
    expected = grads(outs64, leaves64, [dy.double() for dy in upstream])
    for out, out64 in zip(outs, outs64):
        assert_close(out, out64, torch.bfloat16)
    for grad, grad64 in zip(got, expected):
        err = (grad.double() - grad64).norm() / grad64.norm()
        assert err <= TOLERANCE[torch.bfloat16], err


@pytest.mark.gpu
def test_gpu_llama_8b_shaped_lora_linear_gate_up():
    """gate/up of Llama-3-8B at 4096 tokens, bases included, fp32 adapters: bf16 bounds against float64."""
    x, weights, biases, lora_as, lora_bs, scalings = _linear_inputs((4096,), 4096, [(14336, 16), (14336, 16)],
                                                                    torch.bfloat16, torch.float32, "cuda",
                                                                    bias=False)
    with fuselm.use_backend("triton"):
        outs = fuselm.lora_linear_shared(x, weights, biases, lora_as, lora_bs, scalings)
    upstream = [randn(*out.shape, dtype=torch.bfloat16, device="cuda") for out in outs]
    leaves = [x, *lora_as, *lora_bs]
    leaves64 = [float64_leaf(t) for t in leaves]
    outs64 = [lora_linear_reference(leaves64[0], w.double(), None, a, b, s)
              for w, a, b, s in zip(weights, leaves64[1:3], leaves64[3:], scalings)]
    for out, out64 in zip(outs, outs64):
        assert_close(out, out64, torch.bfloat16)
    for grad, grad64 in zip(grads(outs, leaves, upstream), grads(outs64, leaves64, [dy.double() for dy in upstream])):
        err = (grad.double() - grad64).norm() / grad64.norm()
        assert err <= TOLERANCE[torch.bfloat16], err
