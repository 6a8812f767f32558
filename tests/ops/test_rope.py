import pytest
import torch

import fuselm
from fuselm.ops.rope import rope_reference
from tests.helpers import assert_close, assert_compiles_like_eager, float64_leaf, grads, randn

DTYPES = [torch.float32, torch.bfloat16, torch.float16]
LAYOUTS = ["bhsd", "bshd"]
# (batch, seq_len, heads_q, heads_k, head_dim, rotary_dim, cos_batch_is_b)
CASES = [
    (2, 37, 4, 2, 64, 64, False),  # GQA, full rotary, cos batch 1
    (1, 1, 3, 3, 8, 8, True),  # S=1, MHA, head_dim 8
    (2, 9, 2, 1, 16, 10, True),  # partial rotary: h = 5 (not a power of 2), tail of 6
    (3, 5, 4, 4, 64, 48, False),  # partial rotary as Phi-4-mini (R = 0.75 D)
]


def _shape(batch, seq_len, heads, head_dim, layout):
    return (batch, heads, seq_len, head_dim) if layout == "bhsd" else (batch, seq_len, heads, head_dim)


def _cos_sin(batch, seq_len, rotary_dim, dtype=torch.float32, device="cpu"):
    """Random cos/sin whose two halves differ (a real table has equal halves; the op must not assume it)."""
    return (randn(batch, seq_len, rotary_dim, dtype=dtype, device=device),
            randn(batch, seq_len, rotary_dim, dtype=dtype, device=device))


def _hf_cos_sin(seq_len, head_dim, device="cpu", base=10000.0):
    """The real cos/sin table HF builds: angles pos * base^(-2i/D), both halves equal, batch 1."""
    inv_freq = base ** -(torch.arange(0, head_dim, 2, dtype=torch.float32, device=device) / head_dim)
    angles = torch.arange(seq_len, dtype=torch.float32, device=device)[:, None] * inv_freq[None]
    table = torch.cat((angles, angles), dim=-1)[None]
    return table.cos(), table.sin()


def _inputs(case, dtype, layout, device="cpu", requires_grad=True):
    batch, seq_len, heads_q, heads_k, head_dim, rotary_dim, cos_batch_is_b = case
    q = randn(*_shape(batch, seq_len, heads_q, head_dim, layout), dtype=dtype, device=device,
              requires_grad=requires_grad)
    k = randn(*_shape(batch, seq_len, heads_k, head_dim, layout), dtype=dtype, device=device,
              requires_grad=requires_grad)
    cos, sin = _cos_sin(batch if cos_batch_is_b else 1, seq_len, rotary_dim, dtype=dtype, device=device)
    return q, k, cos, sin


def _check_against_float64(q, k, cos, sin, layout, dtype, scale=1.0):
    q_out, k_out = fuselm.rope(q, k, cos, sin, layout=layout)
    dq_out, dk_out = torch.randn_like(q_out), torch.randn_like(k_out)
    dq, dk = grads((q_out, k_out), (q, k), (dq_out, dk_out))
    q64, k64 = float64_leaf(q), float64_leaf(k)
    q_ref, k_ref = rope_reference(q64, k64, cos.double(), sin.double(), layout)
    dq_ref, dk_ref = grads((q_ref, k_ref), (q64, k64), (dq_out.double(), dk_out.double()))
    assert q_out.dtype == k_out.dtype == dtype
    assert q_out.shape == q.shape and k_out.shape == k.shape
    assert_close(q_out, q_ref, dtype, "q", scale)
    assert_close(k_out, k_ref, dtype, "k", scale)
    assert_close(dq, dq_ref, dtype, "dq", scale)
    assert_close(dk, dk_ref, dtype, "dk", scale)
    return q_out, k_out


@pytest.mark.parametrize("case", CASES)
@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("dtype", DTYPES)
def test_rope_matches_float64(path, device, case, layout, dtype):
    q, k, cos, sin = _inputs(case, dtype, layout, device)
    q_out, k_out = _check_against_float64(q, k, cos, sin, layout, dtype)
    rotary_dim = cos.shape[-1]
    assert torch.equal(q_out[..., rotary_dim:], q.detach()[..., rotary_dim:])  # partial rotary: tail exact
    assert torch.equal(k_out[..., rotary_dim:], k.detach()[..., rotary_dim:])


def test_matches_transformers_apply_rotary_pos_emb(path, device):
    from transformers.models.llama.modeling_llama import apply_rotary_pos_emb

    q = randn(2, 4, 19, 32, device=device)
    k = randn(2, 2, 19, 32, device=device)
    cos, sin = _hf_cos_sin(19, 32, device)
    q_hf, k_hf = apply_rotary_pos_emb(q, k, cos, sin)
    q_out, k_out = fuselm.rope(q, k, cos, sin)
    assert_close(q_out, q_hf, torch.float32, "q", scale=0.1)
    assert_close(k_out, k_hf, torch.float32, "k", scale=0.1)
    q_out, k_out = fuselm.rope(q.transpose(1, 2), k.transpose(1, 2), cos, sin, layout="bshd")
    assert_close(q_out.transpose(1, 2), q_hf, torch.float32, "q bshd", scale=0.1)
    assert_close(k_out.transpose(1, 2), k_hf, torch.float32, "k bshd", scale=0.1)


def test_fp32_cos_sin_with_bf16_q(path, device):
    q, k, _, _ = _inputs((2, 11, 4, 2, 32, 32, True), torch.bfloat16, "bhsd", device)
    cos, sin = _cos_sin(2, 11, 32, device=device)
    _check_against_float64(q, k, cos, sin, "bhsd", torch.bfloat16)


@pytest.mark.parametrize("layout", LAYOUTS)
def test_slices_of_packed_qkv(path, device, layout):
    """q and k as strided views into one [B, S, (Hq + 2 Hk) * D] projection output; cos/sin strided too."""
    batch, seq_len, heads_q, heads_k, head_dim = 2, 13, 4, 2, 16
    qkv = randn(batch, seq_len, (heads_q + 2 * heads_k) * head_dim, device=device).view(
        batch, seq_len, heads_q + 2 * heads_k, head_dim)
    q, k = qkv[:, :, :heads_q], qkv[:, :, heads_q:heads_q + heads_k]
    if layout == "bhsd":
        q, k = q.transpose(1, 2), k.transpose(1, 2)
    q, k = q.detach().requires_grad_(), k.detach().requires_grad_()  # still views of the packed storage
    assert not q.is_contiguous() and not k.is_contiguous()
    cos, sin = randn(batch, seq_len, 2 * 12, device=device)[..., ::2], randn(1, 12, seq_len, device=device).mT
    _check_against_float64(q, k, cos, sin, layout, torch.float32)


def test_empty_inputs(path, device):
    for batch, seq_len in [(0, 5), (2, 0)]:
        q, k, cos, sin = _inputs((batch, seq_len, 4, 2, 16, 16, False), torch.float32, "bhsd", device)
        q_out, k_out = fuselm.rope(q, k, cos, sin)
        assert q_out.shape == q.shape and k_out.shape == k.shape
        dq, dk = grads((q_out, k_out), (q, k), (torch.ones_like(q_out), torch.ones_like(k_out)))
        assert dq.shape == q.shape and dk.shape == k.shape
        with torch.no_grad():
            assert fuselm.rope(q, k, cos, sin, inplace=True)[0] is q


def test_only_one_output_used_in_backward(path, device):
    q, k, cos, sin = _inputs((1, 6, 2, 1, 16, 16, False), torch.float32, "bshd", device)
    q_out, _ = fuselm.rope(q, k, cos, sin, layout="bshd")
    q_out.sum().backward()
    q64 = float64_leaf(q)
    rope_reference(q64, k.detach().double(), cos.double(), sin.double(), "bshd")[0].sum().backward()
    assert_close(q.grad, q64.grad, torch.float32, "dq")
    assert k.grad is None or not k.grad.any()  # the Triton op's backward gets zeros for the unused output


@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_inplace_rotates_the_given_tensors(path, device, layout, dtype):
    """In place on slices of a packed qkv: q and k rotated, their tails and the v slice untouched."""
    batch, seq_len, heads_q, heads_k, head_dim, rotary_dim = 2, 9, 4, 2, 16, 12
    qkv = randn(batch, seq_len, heads_q + 2 * heads_k, head_dim, dtype=dtype, device=device)
    before = qkv.clone()
    q, k = qkv[:, :, :heads_q], qkv[:, :, heads_q:heads_q + heads_k]
    if layout == "bhsd":
        q, k = q.transpose(1, 2), k.transpose(1, 2)
    cos, sin = _cos_sin(batch, seq_len, rotary_dim, device=device)
    q_expected, k_expected = rope_reference(q.double(), k.double(), cos.double(), sin.double(), layout)
    q_out, k_out = fuselm.rope(q, k, cos, sin, layout=layout, inplace=True)
    assert q_out is q and k_out is k
    assert_close(q, q_expected, dtype, "q")
    assert_close(k, k_expected, dtype, "k")
    assert torch.equal(qkv[:, :, :heads_q + heads_k, rotary_dim:], before[:, :, :heads_q + heads_k, rotary_dim:])
    assert torch.equal(qkv[:, :, heads_q + heads_k:], before[:, :, heads_q + heads_k:])


def test_inplace_refuses_tensors_that_require_grad(path, device):
    q, k, cos, sin = _inputs((1, 4, 2, 2, 8, 8, False), torch.float32, "bhsd", device)
    with pytest.raises(ValueError, match="inplace=True is not allowed when q or k requires grad"):
        fuselm.rope(q, k, cos, sin, inplace=True)
    q_before = q.detach().clone()
    with torch.no_grad():
        fuselm.rope(q, k, cos, sin, inplace=True)
    assert_close(q, rope_reference(q_before.double(), k.double(), cos.double(), sin.double())[0], torch.float32)


def test_out_of_place_does_not_mutate_inputs(path, device):
    q, k, cos, sin = _inputs(CASES[2], torch.float32, "bhsd", device)
    before = [t.detach().clone() for t in (q, k, cos, sin)]
    q_out, k_out = fuselm.rope(q, k, cos, sin)
    grads((q_out, k_out), (q, k), (torch.ones_like(q_out), torch.ones_like(k_out)))
    for t, b in zip((q, k, cos, sin), before):
        assert torch.equal(t.detach(), b)


@pytest.mark.parametrize("rotary_dim", [8, 4])
def test_outputs_keep_a_dense_inputs_memory_order(path, device, rotary_dim):
    """q and k in HF's [B, S, H, D] memory, viewed as [B, H, S, D]; full and partial rotary."""
    q = randn(2, 3, 4, 8, device=device).transpose(1, 2)
    k = randn(2, 3, 2, 8, device=device).transpose(1, 2)
    cos, sin = _cos_sin(1, 3, rotary_dim, dtype=torch.float32, device=device)
    q_out, k_out = fuselm.rope(q, k, cos, sin)
    assert q_out.stride() == q.stride() and k_out.stride() == k.stride()
    assert_close(q_out, rope_reference(q.double(), k.double(), cos.double(), sin.double())[0], torch.float32)


def test_cos_sin_requiring_grad_take_the_reference_path(path, device):
    """With cos or sin requiring grad the reference runs on either path (its gradients are checked
    below); the same call with them detached runs the Triton op on the Triton path only, which shows
    that the profiler would have seen the op had the first call run it."""
    q, k, cos, sin = _inputs((2, 5, 2, 1, 8, 8, True), torch.float32, "bhsd", device)
    cos.requires_grad_()
    sin.requires_grad_()
    with torch.profiler.profile() as prof:
        q_out, k_out = fuselm.rope(q, k, cos, sin)
    with torch.profiler.profile() as detached_prof:
        fuselm.rope(q, k, cos.detach(), sin.detach())
    assert "fuselm::rope" not in {e.key for e in prof.key_averages()}
    detached_ops = {e.key: e.count for e in detached_prof.key_averages()}
    assert detached_ops.get("fuselm::rope", 0) == (1 if path == "triton" else 0)
    dq_out, dk_out = torch.randn_like(q_out), torch.randn_like(k_out)
    got = grads((q_out, k_out), (q, k, cos, sin), (dq_out, dk_out))
    leaves = [float64_leaf(t) for t in (q, k, cos, sin)]
    expected = grads(rope_reference(*leaves), leaves, (dq_out.double(), dk_out.double()))
    for name, g, e in zip(("dq", "dk", "dcos", "dsin"), got, expected):
        assert_close(g, e, torch.float32, name)


def test_nan_propagates_to_its_rotation_pair_only(path, device):
    q, k, cos, sin = _inputs((1, 3, 2, 1, 8, 8, False), torch.float32, "bhsd", device, requires_grad=False)
    q[0, 1, 2, 1] = float("nan")  # pairs with d = 5
    cos[0, 0, 6] = float("nan")  # position 0, d = 6 of every head
    q_out, k_out = fuselm.rope(q, k, cos, sin)
    q_ref, k_ref = rope_reference(q, k, cos, sin)
    assert torch.isnan(q_out[0, 1, 2, [1, 5]]).all()
    assert torch.isnan(q_out[:, :, 0, 6]).all() and torch.isnan(k_out[:, :, 0, 6]).all()
    assert torch.equal(torch.isnan(q_out), torch.isnan(q_ref)) and torch.equal(torch.isnan(k_out), torch.isnan(k_ref))
    assert torch.isnan(q_out).sum() == 2 + 2  # nothing else touched by the NaNs


@pytest.mark.parametrize(
    "call,error,match",
    [
        (lambda q, k, c, s: fuselm.rope(q[0], k, c, s), ValueError, "q must have rank 4"),
        (lambda q, k, c, s: fuselm.rope(q, k[None], c, s), ValueError, "k must have rank 4"),
        (lambda q, k, c, s: fuselm.rope(q, k, c[0], s), ValueError, "cos must have rank 3"),
        (lambda q, k, c, s: fuselm.rope(q, k, c, s.tolist()), TypeError, "sin must be a torch.Tensor"),
        (lambda q, k, c, s: fuselm.rope(q.to(torch.int32), k, c, s), TypeError, "q must be a floating-point"),
        (lambda q, k, c, s: fuselm.rope(q, k, c, s, layout="sbhd"), ValueError, "layout must be one of"),
        (lambda q, k, c, s: fuselm.rope(q, k.double(), c, s), TypeError, "k has dtype"),
        (lambda q, k, c, s: fuselm.rope(q, k.to("meta"), c, s), ValueError, "k is on meta"),
        (lambda q, k, c, s: fuselm.rope(q, k, c.to("meta"), s), ValueError, "cos is on meta"),
        (lambda q, k, c, s: fuselm.rope(q, k, c, s.double()), TypeError, "sin has dtype"),
        (lambda q, k, c, s: fuselm.rope(q, k[:, :, :-1], c, s), ValueError, "k has shape"),
        (lambda q, k, c, s: fuselm.rope(q, k[..., :8], c[..., :8], s[..., :8]), ValueError, "k has shape"),
        (lambda q, k, c, s: fuselm.rope(q, k, c, s[..., :8]), ValueError, "sin has shape"),
        (lambda q, k, c, s: fuselm.rope(q, k, c.expand(3, -1, -1), s.expand(3, -1, -1)), ValueError,
         "cos has batch size 3"),
        (lambda q, k, c, s: fuselm.rope(q, k, c[:, :-1], s[:, :-1]), ValueError, "cos has sequence length"),
        (lambda q, k, c, s: fuselm.rope(q, k, c[..., :7], s[..., :7]), ValueError, "rotary_dim"),
        (lambda q, k, c, s: fuselm.rope(q, k, torch.cat((c, c), -1), torch.cat((s, s), -1)), ValueError,
         "rotary_dim"),
        (lambda q, k, c, s: fuselm.rope(q, q, c, s, layout="bshd"), ValueError, "cos has sequence length"),
    ],
)
def test_bad_input_names_the_argument(call, error, match):
    q, k, cos, sin = _inputs((2, 5, 4, 2, 16, 16, False), torch.float32, "bhsd", requires_grad=False)
    with pytest.raises(error, match=match):
        call(q, k, cos, sin)


def test_torch_compile_fullgraph_traces_the_custom_ops(device):
    q, k, cos, sin = _inputs(CASES[2], torch.float32, "bhsd", device)

    def f(q, k, cos, sin):
        q_out, k_out = fuselm.rope(q, k, cos, sin)
        return q_out.sum(dim=1) + k_out.sum(dim=1) * 2

    assert_compiles_like_eager(f, (q, k, cos, sin), (q, k))


def test_torch_compile_fullgraph_traces_the_inplace_op(device):
    q, k, cos, sin = _inputs(CASES[0], torch.float32, "bshd", device, requires_grad=False)
    expected = rope_reference(q.double(), k.double(), cos.double(), sin.double(), "bshd")

    def f(q, k, cos, sin):
        fuselm.rope(q, k, cos, sin, layout="bshd", inplace=True)
        return q * 1

    with fuselm.use_backend("triton"), torch.no_grad():
        out = torch.compile(f, fullgraph=True, backend="aot_eager")(q, k, cos, sin)
    assert_close(out, expected[0], torch.float32, "returned q")
    assert_close(q, expected[0], torch.float32, "q")
    assert_close(k, expected[1], torch.float32, "k")


def test_triton_path_appears_in_profile(device):
    q, k, cos, sin = _inputs((1, 4, 2, 2, 8, 8, False), torch.float32, "bhsd", device)
    with fuselm.use_backend("triton"), torch.profiler.profile() as prof:
        q_out, k_out = fuselm.rope(q, k, cos, sin)
        (q_out.sum() + k_out.sum()).backward()
        with torch.no_grad():
            fuselm.rope(q, k, cos, sin, inplace=True)
    names = {e.key for e in prof.key_averages()}
    assert {"fuselm::rope", "fuselm::rope_backward", "fuselm::rope_"} <= names


@pytest.mark.gpu
@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("cos_batch", [1, 4])
def test_gpu_llama_shape(layout, cos_batch):
    q, k, _, _ = _inputs((4, 4096, 32, 8, 128, 128, False), torch.bfloat16, layout, "cuda")
    cos, sin = _cos_sin(cos_batch, 4096, 128, torch.bfloat16, "cuda")
    _check_against_float64(q, k, cos, sin, layout, torch.bfloat16)


@pytest.mark.gpu
def test_gpu_partial_rotary_packed_qkv_and_inplace():
    """Phi-4-mini-like heads (D=128, R=96) sliced from a packed projection; fp32 cos/sin; then in place."""
    batch, seq_len, heads_q, heads_k, head_dim = 2, 2048, 24, 8, 128
    qkv = randn(batch, seq_len, heads_q + 2 * heads_k, head_dim, dtype=torch.bfloat16, device="cuda")
    q, k = qkv[:, :, :heads_q].transpose(1, 2), qkv[:, :, heads_q:heads_q + heads_k].transpose(1, 2)
    cos, sin = _cos_sin(1, seq_len, 96, device="cuda")
    _check_against_float64(q.detach().requires_grad_(), k.detach().requires_grad_(), cos, sin, "bhsd", torch.bfloat16)
    expected = rope_reference(q.double(), k.double(), cos.double(), sin.double())
    v_before = qkv[:, :, heads_q + heads_k:].clone()
    fuselm.rope(q, k, cos, sin, inplace=True)
    assert_close(q, expected[0], torch.bfloat16, "q in place")
    assert_close(k, expected[1], torch.bfloat16, "k in place")
    assert torch.equal(qkv[:, :, heads_q + heads_k:], v_before)


@pytest.mark.gpu
def test_gpu_more_than_2_31_elements():
    seq_len = 2**31 // (32 * 128) + 5
    q = torch.randn(1, 32, seq_len, 128, device="cuda", dtype=torch.bfloat16)
    k = torch.randn(1, 8, seq_len, 128, device="cuda", dtype=torch.bfloat16)
    cos, sin = _hf_cos_sin(seq_len, 128, "cuda")
    q_out, k_out = fuselm.rope(q, k, cos, sin)
    tail = slice(seq_len - 7, seq_len)
    q_ref, k_ref = rope_reference(q[:, :, tail].double(), k[:, :, tail].double(), cos[:, tail].double(),
                                  sin[:, tail].double())
    assert_close(q_out[:, :, tail], q_ref, torch.bfloat16)
    assert_close(k_out[:, :, tail], k_ref, torch.bfloat16)
