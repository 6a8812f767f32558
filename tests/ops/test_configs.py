"""Every autotune config of every kernel, on the GPU and under the interpreter.

The autotuner may pick any config in a kernel's list (the interpreter otherwise only ever runs the
first, a GPU the fastest for the shape at hand); :func:`fuselm.ops._common.forced_config` forces
each in turn here, on small ragged sizes (rows not a multiple of ROWS, several programs, a last
partial block).
"""

import pytest
import torch

import fuselm
from fuselm.backend import INTERPRETING
from fuselm.ops import attention, glu, rms_norm, rope
from fuselm.ops._common import forced_config
from fuselm.ops.glu import gelu_tanh_mul_reference, silu_mul_reference
from fuselm.ops.rms_norm import add_rms_norm_reference, rms_norm_reference
from fuselm.ops.rope import rope_reference
from tests.conftest import DEVICE
from tests.helpers import assert_close, float64_leaf, grads
from tests.helpers import randn as randn_on
from tests.ops.test_attention import check_every_path as _check_decode_attention
from tests.ops.test_decode_linear import DECODE_CONFIG_CHECKS


def randn(*shape, **options):
    return randn_on(*shape, device=DEVICE, **options)


NORM_SHAPES = [(5, 37), (19, 37)]  # 19 rows: partial bands of ROWS, several programs per launch


def _check_rms_norm():
    for shape in NORM_SHAPES:
        x = randn(*shape, requires_grad=True)
        w = (1 + 0.1 * randn(shape[-1])).requires_grad_()
        y = fuselm.rms_norm(x, w, offset=0.5)
        dy = randn(*shape)
        x64, w64 = float64_leaf(x), float64_leaf(w)
        y64 = rms_norm_reference(x64, w64, offset=0.5)
        assert_close(y, y64, torch.float32, "y")
        for name, g, g64 in zip(("dx", "dw"), grads(y, (x, w), dy), grads(y64, (x64, w64), dy.double())):
            assert_close(g, g64, torch.float32, name)


def _check_add_rms_norm():
    for shape in NORM_SHAPES:
        x, r = randn(*shape, requires_grad=True), randn(*shape, requires_grad=True)
        w = (1 + 0.1 * randn(shape[-1])).requires_grad_()
        outputs = fuselm.add_rms_norm(x, r, w)
        seeds = [randn(*shape), randn(*shape)]
        leaves64 = [float64_leaf(t) for t in (x, r, w)]
        outputs64 = add_rms_norm_reference(*leaves64)
        for name, out, out64 in zip(("y", "total"), outputs, outputs64):
            assert_close(out, out64, torch.float32, name)
        for name, g, g64 in zip(("dx", "dresidual", "dw"), grads(outputs, (x, r, w), seeds),
                                grads(outputs64, leaves64, [s.double() for s in seeds])):
            assert_close(g, g64, torch.float32, name)


def _check_rope(inplace=False):
    for layout in ("bhsd", "bshd"):
        shape = (1, 5, 37, 16) if layout == "bhsd" else (1, 37, 5, 16)  # 5 heads of q, 3 of k, S = 37
        k_shape = (1, 3, 37, 16) if layout == "bhsd" else (1, 37, 3, 16)
        q, k = randn(*shape, requires_grad=not inplace), randn(*k_shape, requires_grad=not inplace)
        cos, sin = randn(1, 37, 12), randn(1, 37, 12)  # partial rotary: 4 tail elements copied
        q64, k64 = float64_leaf(q), float64_leaf(k)
        outputs64 = rope_reference(q64, k64, cos.double(), sin.double(), layout)
        outputs = fuselm.rope(q, k, cos, sin, layout=layout, inplace=inplace)
        for name, out, out64 in zip(("q", "k"), outputs, outputs64):
            assert_close(out, out64, torch.float32, name)
        if not inplace:
            seeds = [randn(*shape), randn(*k_shape)]
            for name, g, g64 in zip(("dq", "dk"), grads(outputs, (q, k), seeds),
                                    grads(outputs64, (q64, k64), [s.double() for s in seeds])):
                assert_close(g, g64, torch.float32, name)


def _check_glu():
    # contiguous split tensors run as one flat row of 4503 elements; packed halves run row by row
    for op, reference, packed in ((fuselm.silu_mul, silu_mul_reference, False),
                                  (fuselm.gelu_tanh_mul, gelu_tanh_mul_reference, True)):
        gate_up = randn(3, 2 * 37) if packed else randn(2, 3, 1501)
        gate_up.requires_grad_()
        out = op(gate_up) if packed else op(*gate_up)
        gate_up64 = float64_leaf(gate_up)
        out64 = reference(*gate_up64.chunk(2, dim=-1)) if packed else reference(*gate_up64)
        assert_close(out, out64, torch.float32, "out")
        dout = randn(*out.shape)
        (dgate_up,), (dgate_up64,) = grads(out, (gate_up,), dout), grads(out64, (gate_up64,), dout.double())
        assert_close(dgate_up, dgate_up64, torch.float32, "dgate_up")


CONFIG_CHECKS = [  # (name, the kernel whose configs are forced, a check that runs it)
    ("rms_norm_fwd", rms_norm._rms_norm_fwd_kernel, _check_rms_norm),
    ("rms_norm_bwd", rms_norm._rms_norm_bwd_kernel, _check_rms_norm),
    ("add_rms_norm_fwd", rms_norm._rms_norm_fwd_kernel, _check_add_rms_norm),
    ("add_rms_norm_bwd", rms_norm._rms_norm_bwd_kernel, _check_add_rms_norm),
    ("rope_fwd_bwd", rope._rope_out_of_place, _check_rope),
    ("rope_inplace", rope._rope_in_place, lambda: _check_rope(inplace=True)),
    ("glu_fwd", glu._glu_fwd_kernel, _check_glu),
    ("glu_bwd", glu._glu_bwd_kernel, _check_glu),
    ("decode_attention", attention._decode_attention, _check_decode_attention),
    *DECODE_CONFIG_CHECKS,
]


def _config_id(config):
    return "-".join(f"{name}{value}" for name, value in config.kwargs.items()) + f"-w{config.num_warps}"


@pytest.mark.parametrize(("kernel", "check", "index"), [
    pytest.param(kernel, check, index, id=f"{name}-{_config_id(config)}")
    for name, kernel, check in CONFIG_CHECKS for index, config in enumerate(kernel.configs)
])
def test_every_config_matches_float64(kernel, check, index):
    configs = kernel.configs
    with fuselm.use_backend("triton"), forced_config(kernel, index):
        check()
    assert kernel.configs is configs  # the full list is back for the other tests
    assert not INTERPRETING or kernel.best_config is configs[0]


def test_the_forced_config_is_the_one_launched(monkeypatch):
    kernel, launched = glu._glu_fwd_kernel, []
    run = kernel.fn.run
    # an instance entry, removed afterwards (setattr would leave the bound method behind on the instance)
    monkeypatch.setitem(vars(kernel.fn), "run",
                        lambda *args, **kwargs: launched.append(kwargs["BLOCK"]) or run(*args, **kwargs))
    with fuselm.use_backend("triton"), forced_config(kernel, 3):
        fuselm.silu_mul(randn(5, 37), randn(5, 37))
    assert launched == [kernel.configs[3].kwargs["BLOCK"]] != [kernel.configs[0].kwargs["BLOCK"]]
