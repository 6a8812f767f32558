"""benchmarks/kernel_resources.py: every config of a decode projection's kernel compiled for sm_90a from its
recorded launch, with registers, spills, shared memory and the MMA instruction (no GPU needed)."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests.conftest import HAS_CUDA

ROOT = Path(__file__).resolve().parents[1]


@pytest.mark.skipif(HAS_CUDA, reason="compiles on the CPU machine; a GPU machine times the configs instead")
def test_every_o_projection_config_gets_its_figures(tmp_path):
    from fuselm.ops import decode_linear

    out = tmp_path / "resources.json"
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}  # the script interprets in its child
    result = subprocess.run([sys.executable, "benchmarks/kernel_resources.py", "--rows", "1", "--projections", "o",
                             "--out", str(out)], cwd=ROOT, env=env, capture_output=True, text=True)
    assert result.returncode == 0, result.stderr[-3000:]
    rows = json.loads(out.read_text())["rows"]
    configs = decode_linear._linear_residual_kernel.configs
    assert [row["config"] for row in rows] == [
        {**config.kwargs, "num_warps": config.num_warps, "num_stages": config.num_stages} for config in configs]
    for row in rows:
        assert "error" not in row, row
        assert 0 < row["registers"] <= 255 and row["stack_bytes"] >= 0 and row["shared_bytes"] > 0
        assert row["cp_async"] > 0  # divisibility marked: the weight loads are pipelined, as on a GPU
        assert row["mma"] == "mma"  # M = 1: the x rows (16 with padding) are the dot's M side
        assert min(row["programs_per_sm_by_registers"], row["programs_per_sm_by_shared"]) >= 1
    assert "BLOCK_N=16" in result.stdout  # the table
