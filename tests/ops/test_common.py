"""FusedOp: the direct eager path computes what the torch.library op computes."""

import torch

import fuselm
from fuselm.ops.glu import GLU
from fuselm.ops.rms_norm import ADD_RMS_NORM
from tests.helpers import grads, randn


def test_direct_eager_path_equals_the_torch_library_op(device):
    x, r = randn(5, 40, device=device, requires_grad=True), randn(5, 40, device=device, requires_grad=True)
    w = (1 + 0.1 * randn(40, device=device)).requires_grad_()
    with fuselm.use_backend("triton"):
        direct = ADD_RMS_NORM(x, r, w, 1e-6, 0.0, "llama")
        library = ADD_RMS_NORM.op(x, r, w, 1e-6, 0.0, "llama")
        assert type(direct[0].grad_fn) is not type(library[0].grad_fn)  # two routes, really taken
        for a, b in zip(direct, library):
            assert torch.equal(a, b)
        seed = [torch.randn_like(direct[0]), torch.randn_like(direct[1])]
        for a, b in zip(grads(direct[:2], (x, r, w), seed), grads(library[:2], (x, r, w), seed)):
            assert torch.equal(a, b)


def test_no_grad_calls_skip_autograd(device):
    gate, up = randn(3, 16, device=device, requires_grad=True), randn(3, 16, device=device)
    with fuselm.use_backend("triton"), torch.no_grad():
        out = GLU(gate, up, "silu")
    assert out.grad_fn is None and not out.requires_grad


def test_in_place_op_bumps_version_counters(device):
    q, k = randn(1, 2, 3, 8, device=device), randn(1, 1, 3, 8, device=device)
    cos, sin = randn(1, 3, 8, device=device), randn(1, 3, 8, device=device)
    before = q._version, k._version
    with fuselm.use_backend("triton"):
        fuselm.rope(q, k, cos, sin, inplace=True)
    assert q._version > before[0] and k._version > before[1]
