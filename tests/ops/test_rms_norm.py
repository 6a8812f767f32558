import pytest
import torch

import fuselm
from fuselm.ops.rms_norm import add_rms_norm_reference, rms_norm_reference
from tests.helpers import TOLERANCE, assert_close, assert_compiles_like_eager, float64_leaf, grads, randn

DTYPES = [torch.float32, torch.bfloat16, torch.float16]
CASTINGS = [("llama", 0.0), ("gemma", 1.0), ("none", 0.0)]
SHAPES = [(0, 37), (3, 1), (5, 37), (4, 4097), (2, 3, 64), (2, 20000)]  # 20000 > one block: looped


def _inputs(shape, dtype, device, residual=False):
    x = randn(*shape, device=device)
    if shape[-1] == 1:  # keep |x| >> sqrt(eps): there dx ~ eps/|x|^3 and the case is ill-conditioned
        x = x.sign() * (0.5 + x.abs())
    x = x.to(dtype).requires_grad_()
    w = (1 + 0.3 * randn(shape[-1], device=device)).to(dtype).requires_grad_()
    r = randn(*shape, dtype=dtype, device=device, requires_grad=True) if residual else None
    return x, w, r


@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("casting,offset", CASTINGS)
def test_rms_norm_matches_float64(path, device, shape, dtype, casting, offset):
    x, w, _ = _inputs(shape, dtype, device)
    y = fuselm.rms_norm(x, w, 1e-6, offset, casting)
    dy = randn(*shape, dtype=y.dtype, device=device)
    dx, dw = grads(y, (x, w), dy)
    x64, w64 = float64_leaf(x), float64_leaf(w)
    y64 = rms_norm_reference(x64, w64, 1e-6, offset, casting)
    dx64, dw64 = grads(y64, (x64, w64), dy.double())
    assert y.dtype == dtype
    assert_close(y, y64, dtype, "y")
    if shape[-1] == 1:  # y = sign(x) * w: dx is ~eps/x^2, pure rounding noise relative to itself
        assert (dx.double() - dx64).abs().max() <= 4 * TOLERANCE[dtype]
    else:
        assert_close(dx, dx64, dtype, "dx")
    assert_close(dw, dw64, dtype, "dweight", scale=2)


@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("casting,offset", CASTINGS)
def test_add_rms_norm_matches_float64(path, device, shape, dtype, casting, offset):
    x, w, r = _inputs(shape, dtype, device, residual=True)
    y, total = fuselm.add_rms_norm(x, r, w, 1e-5, offset, casting)
    dy, dtotal = randn(*shape, dtype=dtype, device=device), randn(*shape, dtype=dtype, device=device)
    dx, dr, dw = grads((y, total), (x, r, w), (dy, dtotal))
    x64, r64, w64 = float64_leaf(x), float64_leaf(r), float64_leaf(w)
    y64, total64 = add_rms_norm_reference(x64, r64, w64, 1e-5, offset, casting)
    dx64, dr64, dw64 = grads((y64, total64), (x64, r64, w64), (dy.double(), dtotal.double()))
    assert_close(y, y64, dtype, "y")
    assert_close(total, total64, dtype, "sum")
    assert_close(dx, dx64, dtype, "dx", scale=1 if shape[-1] > 1 else 3)  # n=1: only the dtotal path is left
    assert_close(dr, dr64, dtype, "dresidual", scale=1 if shape[-1] > 1 else 3)
    assert_close(dw, dw64, dtype, "dweight", scale=2)


@pytest.mark.parametrize("shape", [(5, 37), (2, 20000)])  # one pass, looped
@pytest.mark.parametrize("residual", [False, True])
def test_gradients_with_a_frozen_weight(path, device, shape, residual):
    """A frozen norm weight (LoRA): the backward kernel then computes no weight gradient (no partial sums, no
    reduction launch); x's (and the residual's) gradients are still the float64 reference's."""
    x, w, r = _inputs(shape, torch.float32, device, residual=residual)
    w.requires_grad_(False)
    outputs = fuselm.add_rms_norm(x, r, w, 1e-5) if residual else (fuselm.rms_norm(x, w, 1e-5),)
    upstream = [randn(*shape, device=device) for _ in outputs]
    leaves = (x, r) if residual else (x,)
    got = grads(outputs, leaves, upstream)
    leaves64 = [float64_leaf(t) for t in leaves]
    w64 = w.detach().double()
    outputs64 = (add_rms_norm_reference(*leaves64, w64, 1e-5) if residual
                 else (rms_norm_reference(leaves64[0], w64, 1e-5),))
    expected = grads(outputs64, leaves64, [dy.double() for dy in upstream])
    for name, grad, grad64 in zip(("dx", "dresidual"), got, expected):
        assert_close(grad, grad64, torch.float32, name)


@pytest.mark.parametrize("leaves", ["both", "residual", "neither"])
def test_add_rms_norm_gradients_reach_leaf_and_inner_inputs(path, device, leaves):
    """x and residual share one gradient. A leaf's .grad must be its own tensor (the kernel then
    writes a second copy); inner inputs may share it. Either way the values are the reference's."""
    x_leaf, w, r_leaf = _inputs((6, 37), torch.float32, device, residual=True)
    x = x_leaf if leaves == "both" else x_leaf * 1.0
    r = r_leaf if leaves != "neither" else r_leaf * 1.0
    y, total = fuselm.add_rms_norm(x, r, w)
    dy, dtotal = randn(6, 37, device=device), randn(6, 37, device=device)
    if path == "triton":  # a second copy exactly where autograd would clone the shared gradient for a leaf
        dx, dresidual = y.grad_fn.apply(dy, dtotal, torch.zeros(6, device=device))[:2]
        assert (dx.data_ptr() != dresidual.data_ptr()) == (leaves != "neither")
    torch.autograd.backward((y, total), (dy, dtotal))
    x64, r64, w64 = float64_leaf(x_leaf), float64_leaf(r_leaf), float64_leaf(w)
    torch.autograd.backward(add_rms_norm_reference(x64, r64, w64), (dy.double(), dtotal.double()))
    assert_close(x_leaf.grad, x64.grad, torch.float32, "dx")
    assert_close(r_leaf.grad, r64.grad, torch.float32, "dresidual")
    assert x_leaf.grad.data_ptr() != r_leaf.grad.data_ptr()
    expected_r = r_leaf.grad.clone()
    x_leaf.grad.add_(1.0)  # accumulating into one leaf's .grad leaves the other alone
    assert torch.equal(r_leaf.grad, expected_r)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_matches_hf_casting_in_low_precision(path, device, dtype):
    """Against the same-dtype reference (HF's own arithmetic), not only float64."""
    x, w, _ = _inputs((6, 96), dtype, device)
    for casting, offset in CASTINGS:
        assert_close(fuselm.rms_norm(x, w, 1e-6, offset, casting), rms_norm_reference(x, w, 1e-6, offset, casting),
                     dtype, casting, scale=0.5)


def test_llama_casting_promotes_to_fp32_weight(path, device):
    x = randn(4, 32, dtype=torch.bfloat16, device=device)
    w = 1 + 0.1 * randn(32, device=device)
    y = fuselm.rms_norm(x, w)
    assert y.dtype == torch.float32
    assert_close(y, rms_norm_reference(x.double(), w.double()), torch.bfloat16)
    assert fuselm.rms_norm(x, w, casting="gemma").dtype == torch.bfloat16


def test_non_contiguous_inputs(path, device):
    base = randn(37, 8, 2, device=device)
    x = base[..., 0].t()  # [8, 37], column stride 2 and row stride 1
    residual = randn(37, 8, device=device).t()
    w = 1 + 0.1 * randn(74, device=device)[::2]
    assert_close(fuselm.rms_norm(x, w), rms_norm_reference(x.double(), w.double()), torch.float32)
    y, total = fuselm.add_rms_norm(x, residual, w)
    y64, total64 = add_rms_norm_reference(x.double(), residual.double(), w.double())
    assert_close(y, y64, torch.float32)
    assert_close(total, total64, torch.float32)


def test_hidden_size_65536(path, device):
    x, w, r = _inputs((2, 65536), torch.float32, device, residual=True)
    y, total = fuselm.add_rms_norm(x, r, w)
    y64, _ = add_rms_norm_reference(float64_leaf(x), float64_leaf(r), float64_leaf(w))
    assert_close(y, y64, torch.float32)


def test_wide_rows_several_blocks_per_program(path, device):
    # wider than one block (looped) and more row blocks than programs (1 or 132 SMs × 2 to 8 programs
    # each), so each program's dweight partial row is first stored, then accumulated into
    rows = 5 if device == "cpu" else 1100
    x, w, r = _inputs((rows, 16411), torch.float32, device, residual=True)
    outputs = fuselm.add_rms_norm(x, r, w)
    seeds = (randn(*x.shape, device=device), randn(*x.shape, device=device))
    leaves64 = [float64_leaf(t) for t in (x, r, w)]
    outputs64 = add_rms_norm_reference(*leaves64)
    for name, g, g64 in zip(("dx", "dresidual", "dweight"), grads(outputs, (x, r, w), seeds),
                            grads(outputs64, leaves64, [s.double() for s in seeds])):
        assert_close(g, g64, torch.float32, name)


def test_inputs_are_not_mutated(path, device):
    x, w, r = _inputs((4, 33), torch.float32, device, residual=True)
    before = [t.detach().clone() for t in (x, w, r)]
    y, total = fuselm.add_rms_norm(x, r, w)
    grads((y, total), (x, r, w), (torch.ones_like(y), torch.ones_like(total)))
    for t, b in zip((x, w, r), before):
        assert torch.equal(t.detach(), b)


def test_nan_and_inf_propagate(path, device):
    x = randn(3, 16, device=device)
    x[0, 3] = float("nan")
    x[1, 5] = float("inf")
    w = torch.ones(16, device=device)
    y, ref = fuselm.rms_norm(x, w), rms_norm_reference(x, w)
    assert torch.isnan(y[0]).all() and torch.isnan(ref[0]).all()
    assert torch.equal(torch.isnan(y[1]), torch.isnan(ref[1]))
    assert torch.isfinite(y[2]).all()


@pytest.mark.parametrize(
    "call,error,match",
    [
        (lambda x, w: fuselm.rms_norm(x, w[:-1]), ValueError, "weight has size"),
        (lambda x, w: fuselm.rms_norm(x, w[None]), ValueError, "weight must have rank 1"),
        (lambda x, w: fuselm.rms_norm(x, w.to(torch.int32)), TypeError, "weight must be a floating-point"),
        (lambda x, w: fuselm.rms_norm(x.tolist(), w), TypeError, "x must be a torch.Tensor"),
        (lambda x, w: fuselm.rms_norm(x, w, casting="bert"), ValueError, "casting must be one of"),
        (lambda x, w: fuselm.add_rms_norm(x, x[:, :-1], w), ValueError, "residual has shape"),
        (lambda x, w: fuselm.add_rms_norm(x, x.double(), w), TypeError, "residual has dtype"),
        (lambda x, w: fuselm.add_rms_norm(x, x.to("meta"), w), ValueError, "residual is on meta"),
        (lambda x, w: fuselm.rms_norm(x, w.to("meta")), ValueError, "weight is on meta"),
    ],
)
def test_bad_input_names_the_argument(call, error, match):
    x, w = randn(4, 8), torch.ones(8)
    with pytest.raises(error, match=match):
        call(x, w)


@pytest.mark.parametrize("op", ["rms_norm", "add_rms_norm"])
def test_eps_and_offset_are_python_numbers(path, device, op):
    """Both paths take a Python float or int only: a tensor eps (which the reference alone would accept)
    or None is a TypeError naming the argument; ints give the float's result."""
    x, w = randn(4, 8, device=device), 1 + 0.1 * randn(8, device=device)
    call = (lambda **kw: fuselm.rms_norm(x, w, **kw)) if op == "rms_norm" else \
        (lambda **kw: fuselm.add_rms_norm(x, x.flip(0), w, **kw)[0])
    for name in ("eps", "offset"):
        for bad in (None, torch.tensor(1e-6, device=device), True, "1e-6"):
            message = f"{name} must be a Python float \\(or int\\), got {type(bad).__name__}"
            with pytest.raises(TypeError, match=message):
                call(**{name: bad})
    for bad in (-1e-6, float("nan"), float("inf")):
        with pytest.raises(ValueError, match="eps must be a non-negative finite number"):
            call(eps=bad)
    with pytest.raises(ValueError, match="offset must be a finite number"):
        call(offset=float("nan"))
    assert torch.equal(call(eps=1, offset=1), call(eps=1.0, offset=1.0))


def test_torch_compile_fullgraph_traces_the_custom_ops(device):
    x, w, r = _inputs((5, 48), torch.float32, device, residual=True)

    def f(x, r, w):
        y, total = fuselm.add_rms_norm(x, r, w)
        return fuselm.rms_norm(y, w, casting="gemma", offset=1.0) + total

    assert_compiles_like_eager(f, (x, r, w), (x, r, w))


def test_triton_path_appears_in_profile(device):
    x, w, _ = _inputs((4, 32), torch.float32, device)
    with fuselm.use_backend("triton"), torch.profiler.profile() as prof:
        fuselm.rms_norm(x, w).sum().backward()
    names = {e.key for e in prof.key_averages()}
    assert "fuselm::rms_norm" in names and "fuselm::rms_norm_backward" in names


@pytest.mark.gpu
def test_gpu_large_llama_shape():
    x, w, r = _inputs((4096, 4096), torch.bfloat16, "cuda", residual=True)
    y, total = fuselm.add_rms_norm(x, r, w)
    dx, dr, dw = grads((y, total), (x, r, w), (torch.ones_like(y), torch.ones_like(total)))
    x64, r64, w64 = float64_leaf(x), float64_leaf(r), float64_leaf(w)
    y64, total64 = add_rms_norm_reference(x64, r64, w64)
    dx64, _, dw64 = grads((y64, total64), (x64, r64, w64), (torch.ones_like(y64), torch.ones_like(total64)))
    assert_close(y, y64, torch.bfloat16)
    assert_close(dx, dx64, torch.bfloat16)
    assert_close(dw, dw64, torch.bfloat16, scale=2)


@pytest.mark.gpu
def test_gpu_more_than_2_31_elements():
    cols = 4096
    rows = 2**31 // cols + 3
    x = torch.randn(rows, cols, device="cuda", dtype=torch.bfloat16)
    w = torch.ones(cols, device="cuda", dtype=torch.bfloat16)
    y = fuselm.rms_norm(x, w)
    tail = slice(rows - 5, rows)
    assert_close(y[tail], rms_norm_reference(x[tail].double(), w.double()), torch.bfloat16)
