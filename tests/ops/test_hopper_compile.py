"""Every kernel launch of the CPU tests here also compiles for Hopper (sm_90).

Triton's interpreter runs a kernel as Python and checks no types, so a kernel can pass every
interpreter test and still fail to compile for a GPU. Here every autotune config of every kernel
(the config tests' checks) and the launches no config test makes (cross-entropy, wide rows,
partial rotary) run under the interpreter with each launch recorded: argument types, constexpr
values, warps. ``tests/compile_for_hopper.py`` then compiles each distinct launch for sm_90 in a
subprocess without TRITON_INTERPRET, which needs no GPU. On a GPU machine the real tests compile
every launch they make, so this test is skipped there.
"""

import inspect
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import triton.runtime.interpreter as interpreter

import fuselm
from fuselm.ops._common import forced_config
from tests.conftest import HAS_CUDA
from tests.ops.test_configs import CONFIG_CHECKS

ROOT = Path(__file__).resolve().parents[2]
KERNELS = {  # every kernel fuselm launches: a new one belongs here and in the launches below
    "_rms_norm_fwd_kernel", "_rms_norm_bwd_kernel", "_dweight_sum_kernel", "_rope_kernel", "_glu_fwd_kernel",
    "_glu_bwd_kernel", "_cross_entropy_partials_kernel", "_cross_entropy_finish_kernel", "_cross_entropy_bwd_kernel",
    "_scale_kernel", "_decode_attention_kernel", "_linear_residual_kernel", "_norm_gated_kernel", "_qkv_rope_kernel",
    "_qkv_epilogue_kernel"}
TRITON_TYPES = {torch.bfloat16: "bf16", torch.float16: "fp16", torch.float32: "fp32", torch.float64: "fp64",
                torch.int64: "i64", torch.int32: "i32"}


class LaunchRecorder:
    """Records every interpreted kernel launch as a compilable description (see compile_for_hopper)."""

    def __init__(self, monkeypatch):
        self.launches = {}
        self.forced = (None, None)  # (the kernel whose config is forced, that config's warps)
        run = interpreter.InterpretedFunction.run

        def recording_run(function, *args, grid, warmup, **kwargs):
            self.record(function, args, kwargs)
            return run(function, *args, grid=grid, warmup=warmup, **kwargs)

        monkeypatch.setattr(interpreter.InterpretedFunction, "run", recording_run)

    def record(self, function, args, kwargs):
        params = inspect.signature(function.fn).parameters
        values = dict(zip(function.arg_names, args)) | {name: v for name, v in kwargs.items() if name in params}
        signature, constexprs = {}, {}
        for name, value in values.items():
            if "constexpr" in str(params[name].annotation):
                constexprs[name] = value
            elif isinstance(value, torch.Tensor):
                signature[name] = "*" + TRITON_TYPES[value.dtype]
            elif isinstance(value, bool):
                signature[name] = "i1"
            elif isinstance(value, int):
                signature[name] = "i32" if -2**31 <= value < 2**31 else "i64"
            elif isinstance(value, float):
                signature[name] = "fp32"
            else:
                raise TypeError(f"{function.fn.__name__}: argument {name} of type {type(value).__name__}")
        forced_function, forced_warps = self.forced
        launch = {"module": function.fn.__module__, "kernel": function.fn.__name__, "signature": signature,
                  "constexprs": constexprs,
                  "num_warps": forced_warps if function is forced_function else kwargs.get("num_warps", 4)}
        self.launches[json.dumps(launch, sort_keys=True)] = launch


def _launches_no_config_test_makes():
    """Cross-entropy's kernels under each option, RMSNorm's wide-row path and frozen weight, partial rotary RoPE."""
    for dtype in (torch.float32, torch.bfloat16):
        logits = torch.randn(6, 300, dtype=dtype, requires_grad=True)
        labels = torch.randint(0, 300, (6,))
        fuselm.cross_entropy(logits, labels).backward()
        fuselm.cross_entropy(logits, labels, label_smoothing=0.1, softcap=5.0, z_loss=1e-3).backward()
        hidden = torch.randn(6, 16, dtype=dtype, requires_grad=True)
        weight = torch.randn(300, 16, dtype=dtype, requires_grad=True)
        for reduction in ("mean", "sum", "none"):
            fuselm.linear_cross_entropy(hidden, weight, labels, reduction=reduction, chunk_tokens=4).sum().backward()
        x = torch.randn(2, 20000, dtype=dtype, requires_grad=True)
        w = torch.randn(20000, dtype=dtype, requires_grad=True)
        fuselm.add_rms_norm(x, x.detach() * 0.5, w)[0].sum().backward()
        # a frozen weight (LoRA): the backward without weight partials, one pass and looped
        fuselm.add_rms_norm(x, x.detach() * 0.5, w.detach())[0].sum().backward()
        fuselm.rms_norm(hidden, torch.randn(16, dtype=dtype)).sum().backward()
        q, k = torch.randn(1, 2, 3, 16, dtype=dtype, requires_grad=True), torch.randn(1, 1, 3, 16, dtype=dtype)
        cos, sin = torch.randn(1, 3, 8, dtype=dtype), torch.randn(1, 3, 8, dtype=dtype)
        sum(t.sum() for t in fuselm.rope(q, k, cos, sin)).backward()
        # a prefill's last layer (80 rows: the GEMM path): q of the last positions alone, the epilogue's Q_LAST_ONLY
        x, angles = torch.randn(2, 40, 32, dtype=dtype), torch.randn(1, 40, 16)
        weights = [torch.randn(n, 32, dtype=dtype) for n in (32, 16, 16)]
        caches = [torch.zeros(2, 1, 40, 16, dtype=dtype) for _ in range(2)]
        with torch.no_grad():
            fuselm.qkv_rope(x, None, 1e-6, *weights, angles.cos(), angles.sin(), *caches, torch.arange(40),
                            num_heads=2, num_kv_heads=1, last_only=True)


def _dependent_variants(launches):
    """Per kernel with a DEPENDENT constexpr, its first recorded launch as a dependent launch (which the interpreter
    never makes): the wait, the release and the prefetches (PREFETCH_LINES, PREFETCH_TILES) compiled too."""
    variants = {}
    for launch in launches:
        if "DEPENDENT" in launch["constexprs"] and launch["kernel"] not in variants:
            on = {"DEPENDENT": True} | {name: value for name, value in (("PREFETCH_LINES", 4), ("PREFETCH_TILES", 2))
                                        if name in launch["constexprs"]}
            variants[launch["kernel"]] = {**launch, "constexprs": {**launch["constexprs"], **on}}
    assert {"_decode_attention_kernel", "_linear_residual_kernel", "_qkv_rope_kernel"} <= set(variants)
    return list(variants.values())


def _constant_offset_variants(launches):
    """Every recorded launch with a prologue norm, its offset compiled in as a constant (FUSELM_CONSTANT_OFFSET=1,
    off by default): the gate/up and q/k/v kernels under every config they were recorded with."""
    variants = [{**launch, "constexprs": {**launch["constexprs"], "CONSTANT_OFFSET": 1.0}} for launch in launches
                if launch["constexprs"].get("HAS_NORM") and "CONSTANT_OFFSET" in launch["constexprs"]]
    assert {"_norm_gated_kernel", "_qkv_rope_kernel"} <= {launch["kernel"] for launch in variants}
    return variants


@pytest.mark.skipif(HAS_CUDA, reason="on a GPU the real tests compile every launch")
def test_every_launch_compiles_for_hopper(monkeypatch):
    recorder = LaunchRecorder(monkeypatch)
    with fuselm.use_backend("triton"):
        for _, kernel, check in CONFIG_CHECKS:
            for index, config in enumerate(kernel.configs):
                recorder.forced = (kernel.fn, config.num_warps)
                with forced_config(kernel, index):
                    check()
        recorder.forced = (None, None)
        _launches_no_config_test_makes()
    recorded = {launch["kernel"] for launch in recorder.launches.values()}
    assert recorded >= KERNELS, f"never recorded: {KERNELS - recorded}"  # else they would pass unchecked
    launches = (list(recorder.launches.values()) + _dependent_variants(recorder.launches.values())
                + _constant_offset_variants(recorder.launches.values()))
    assert any(launch["constexprs"].get("Q_LAST_ONLY") for launch in launches)  # the prefill's last-layer epilogue
    result = subprocess.run(
        [sys.executable, "-m", "tests.compile_for_hopper"], input=json.dumps(launches),
        capture_output=True, text=True, cwd=ROOT, env={k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"})
    assert result.returncode == 0, result.stdout + result.stderr[-3000:]
