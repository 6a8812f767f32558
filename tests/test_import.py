"""fuselm without triton (no wheels off Linux): it imports, every op runs its PyTorch reference, and
``FUSELM_BACKEND=triton`` says that triton is missing. Each check runs in a fresh interpreter in which
``import triton`` fails (``sys.modules["triton"] = None``)."""

import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

WITHOUT_TRITON = """
import sys
sys.modules["triton"] = None  # every `import triton...` now raises ImportError
import torch
import fuselm
from fuselm.ops import _triton
from fuselm.ops.attention import decode_attention_reference
from fuselm.ops.cross_entropy import cross_entropy_reference, linear_cross_entropy_reference
from fuselm.ops.decode_linear import linear_residual_reference, norm_gated_linear_reference, qkv_rope_reference
from fuselm.ops.glu import gelu_tanh_mul_reference, silu_mul_reference
from fuselm.ops.lora import lora_add_reference, lora_linear_reference
from fuselm.ops.rms_norm import add_rms_norm_reference, rms_norm_reference
from fuselm.ops.rope import rope_reference

assert not _triton.TRITON_AVAILABLE and "triton.language" not in sys.modules
torch.manual_seed(0)
x, r, w = torch.randn(5, 24), torch.randn(5, 24), 1 + 0.1 * torch.randn(24)
q, k, cos, sin = torch.randn(2, 4, 6, 16), torch.randn(2, 2, 6, 16), torch.randn(1, 6, 16), torch.randn(1, 6, 16)
gate, up, labels = torch.randn(5, 24), torch.randn(5, 24), torch.randint(0, 24, (5,))
head = torch.randn(24, 24)
qd, kc, vc = torch.randn(2, 4, 1, 64), torch.randn(2, 2, 10, 64), torch.randn(2, 2, 10, 64)
starts, ends = torch.tensor([0, 3], dtype=torch.int32), torch.tensor([7, 10], dtype=torch.int32)
hx, wq, wkv = torch.randn(2, 1, 24), torch.randn(4 * 8, 24), torch.randn(2 * 8, 24)
rc, rs, slots = torch.randn(1, 1, 8), torch.randn(1, 1, 8), torch.tensor([3])
caches, caches64 = [torch.zeros(2, 2, 5, 8) for _ in range(2)], [torch.zeros(2, 2, 5, 8).double() for _ in range(2)]
d = lambda *ts: [t.double() for t in ts]  # the float64 oracle's inputs
CASES = {  # op: (fuselm's result on fp32 inputs, the reference's on float64 copies)
    "rms_norm": (fuselm.rms_norm(x, w, 1e-6), [rms_norm_reference(*d(x, w), 1e-6)]),
    "add_rms_norm": (fuselm.add_rms_norm(x, r, w, 1e-6), add_rms_norm_reference(*d(x, r, w), 1e-6)),
    "rope": (fuselm.rope(q, k, cos, sin), rope_reference(*d(q, k, cos, sin))),
    "silu_mul": (fuselm.silu_mul(gate, up), [silu_mul_reference(*d(gate, up))]),
    "gelu_tanh_mul": (fuselm.gelu_tanh_mul(gate, up), [gelu_tanh_mul_reference(*d(gate, up))]),
    "cross_entropy": (fuselm.cross_entropy(x, labels), [cross_entropy_reference(x.double(), labels)]),
    "linear_cross_entropy": (fuselm.linear_cross_entropy(x, head, labels),
                             [linear_cross_entropy_reference(*d(x, head), labels)]),
    "decode_attention": (fuselm.decode_attention(qd, kc, vc, starts, ends),
                         [decode_attention_reference(*d(qd, kc, vc), starts, ends, 64**-0.5, 0.0, 0)]),
    "linear_residual": (fuselm.linear_residual(x, head, r), [linear_residual_reference(*d(x, head, r))]),
    "norm_gated_linear": (fuselm.norm_gated_linear(x, w, 1e-6, head, head.flip(0)),
                          [norm_gated_linear_reference(*d(x, w), 1e-6, *d(head, head.flip(0)))]),
    "qkv_rope": ([fuselm.qkv_rope(hx, w, 1e-6, wq, wkv, wkv.flip(0), rc, rs, *caches, slots, num_heads=4,
                                  num_kv_heads=2), *caches],
                 [qkv_rope_reference(*d(hx, w), 1e-6, *d(wq, wkv, wkv.flip(0), rc, rs), *caches64, slots, 4, 2),
                  *caches64]),
    "lora_add": (fuselm.lora_add(x, gate, head[:4], head[:, :4], 0.5),
                 [lora_add_reference(*d(x, gate, head[:4], head[:, :4]), 0.5)]),
    "lora_add_shared": (fuselm.lora_add_shared(x, [gate, up], [head[:4], head[4:6]], [head[:, :4], head[:, 4:6]],
                                               [0.5, 2.0]),
                        [lora_add_reference(*d(x, gate, head[:4], head[:, :4]), 0.5),
                         lora_add_reference(*d(x, up, head[4:6], head[:, 4:6]), 2.0)]),
    "lora_linear": (fuselm.lora_linear(x, head, w, head[:4], head[:, :4], 0.5),
                    [lora_linear_reference(*d(x, head, w, head[:4], head[:, :4]), 0.5)]),
    "lora_linear_shared": (fuselm.lora_linear_shared(x, [head, head[:8]], [w, None], [head[:4], head[4:6]],
                                                     [head[:, :4], head[:8, 4:6]], [0.5, 2.0]),
                           [lora_linear_reference(*d(x, head, w, head[:4], head[:, :4]), 0.5),
                            lora_linear_reference(*d(x, head[:8]), None, *d(head[4:6], head[:8, 4:6]), 2.0)]),
}
assert set(CASES) == set(fuselm._OPS), "a public op without a case here"
for name, (out, ref) in CASES.items():
    out = [out] if isinstance(out, torch.Tensor) else list(out)
    assert len(out) == len(ref), name
    for o, e in zip(out, ref):
        assert o.dtype == torch.float32 and o.shape == e.shape, (name, o.dtype, o.shape, e.shape)
        err = ((o.double() - e).norm() / e.norm()).item()
        assert err < 1e-5, (name, err)  # NaN fails too
with fuselm.use_backend("triton"):
    try:
        fuselm.rms_norm(x, w, 1e-6)
    except ModuleNotFoundError as error:
        assert "needs triton, which is not installed" in str(error), error
    else:
        raise AssertionError("backend triton ran without triton")
print("ok", fuselm.backend.path_name("cpu"))
"""


def _run_without_triton(code: str, **env: str) -> subprocess.CompletedProcess:
    environment = {key: value for key, value in os.environ.items() if key != "FUSELM_BACKEND"}
    environment.update(PYTHONPATH=str(ROOT), **env)
    return subprocess.run([sys.executable, "-c", code], check=False, capture_output=True, text=True, env=environment,
                          timeout=120)


def test_ops_run_their_references_without_triton():
    result = _run_without_triton(WITHOUT_TRITON, TRITON_INTERPRET="0")
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == "ok PyTorch reference (cpu)"


def test_backend_triton_without_triton_names_the_missing_package():
    code = ("import sys; sys.modules['triton'] = None\nimport torch, fuselm\n"
            "fuselm.silu_mul(torch.randn(2, 8), torch.randn(2, 8))")
    result = _run_without_triton(code, FUSELM_BACKEND="triton", TRITON_INTERPRET="1")
    assert result.returncode == 1
    assert result.stderr.strip().splitlines()[-1] == (
        "ModuleNotFoundError: FUSELM_BACKEND=triton needs triton, which is not installed (its wheels are for "
        "Linux only); use 'auto' or 'reference' for the PyTorch reference")


def test_patched_model_without_triton_computes_the_same_logits():
    code = ("import sys; sys.modules['triton'] = None\nimport torch, fuselm\n"
            "from tests.models import tiny_model\n"
            "model = tiny_model('llama', device='cpu')\nids = torch.randint(0, model.config.vocab_size, (2, 7))\n"
            "with torch.no_grad():\n    before = model(ids).logits\n    report = fuselm.patch(model)\n"
            "    after = model(ids).logits\n"
            "assert report['rms_norm'].patched and torch.equal(before, after), report\nprint('ok')")
    result = _run_without_triton(code, TRITON_INTERPRET="0")
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == "ok"
