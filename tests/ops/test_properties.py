"""Property tests: the Triton path equals the float64 reference on shapes hypothesis picks."""

import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import fuselm
from fuselm.ops.glu import silu_mul_reference
from fuselm.ops.rms_norm import add_rms_norm_reference
from fuselm.ops.rope import rope_reference
from tests.helpers import assert_close

SETTINGS = settings(max_examples=20, deadline=None, derandomize=True,  # the interpreter is slow
                    suppress_health_check=[HealthCheck.function_scoped_fixture])  # fixtures hold across examples


def _randn(*shape, device):
    return torch.randn(*shape, device=device)


@SETTINGS
@given(rows=st.integers(0, 6), cols=st.integers(1, 300), offset=st.sampled_from([0.0, 1.0]),
       casting=st.sampled_from(["llama", "gemma", "none"]))
def test_add_rms_norm_any_shape(device, rows, cols, offset, casting):
    x, r, w = _randn(rows, cols, device=device), _randn(rows, cols, device=device), _randn(cols, device=device)
    with fuselm.use_backend("triton"):
        y, total = fuselm.add_rms_norm(x, r, w, 1e-6, offset, casting)
    y64, total64 = add_rms_norm_reference(x.double(), r.double(), w.double(), 1e-6, offset, casting)
    assert_close(y, y64, torch.float32)
    assert_close(total, total64, torch.float32)


@SETTINGS
@given(rows=st.integers(0, 5), cols=st.integers(1, 700), packed=st.booleans())
def test_silu_mul_any_shape(device, rows, cols, packed):
    gate_up = _randn(rows, 2 * cols, device=device)
    gate, up = gate_up[:, :cols], gate_up[:, cols:]
    with fuselm.use_backend("triton"):
        out = fuselm.silu_mul(gate_up) if packed else fuselm.silu_mul(gate, up)
    assert_close(out, silu_mul_reference(gate.double(), up.double()), torch.float32)


@SETTINGS
@given(batch=st.integers(1, 2), seq=st.integers(1, 9), heads_q=st.integers(1, 5), heads_k=st.integers(1, 3),
       half=st.integers(1, 12), tail=st.integers(0, 6), layout=st.sampled_from(["bhsd", "bshd"]))
def test_rope_any_shape(device, batch, seq, heads_q, heads_k, half, tail, layout):
    head_dim = 2 * half + tail

    def shaped(heads):
        return _randn(batch, heads, seq, head_dim, device=device) if layout == "bhsd" else \
            _randn(batch, seq, heads, head_dim, device=device)

    q, k = shaped(heads_q), shaped(heads_k)
    cos, sin = _randn(1, seq, 2 * half, device=device), _randn(1, seq, 2 * half, device=device)
    with fuselm.use_backend("triton"):
        q_out, k_out = fuselm.rope(q, k, cos, sin, layout=layout)
    q64, k64 = rope_reference(q.double(), k.double(), cos.double(), sin.double(), layout)
    assert_close(q_out, q64, torch.float32)
    assert_close(k_out, k64, torch.float32)
