"""benchmarks/gemm_clock_probe.py: its chunked sequence computes what one call per projection does (every row of
every output, odd row counts and chunks included), and its smoke run writes a row per (M, chunk, mode)."""

import json

import pytest
import torch

from tests.helpers import benchmark_script, rel_err


@pytest.fixture
def probe(monkeypatch):
    return benchmark_script("gemm_clock_probe", monkeypatch)


@pytest.mark.parametrize(("m", "chunk"), [(37, 37), (37, 8), (64, 16), (5, 64)])
def test_chunked_sequence_is_each_projection_of_every_row(probe, m, chunk):
    torch.manual_seed(0)
    shapes = {"q": (24, 40), "k": (24, 8), "down": (56, 24)}
    weights = {name: torch.randn(n, k, dtype=torch.float64) for name, (k, n) in shapes.items()}
    x, h = torch.randn(m, 24, dtype=torch.float64), torch.randn(m, 56, dtype=torch.float64)
    outs = {name: torch.full((m, n), float("nan"), dtype=torch.float64) for name, (_, n) in shapes.items()}
    probe.sequence(m, chunk, weights, x, h, outs, layers=2)()
    for name, w in weights.items():
        reference = (h if name == "down" else x) @ w.t()
        assert not outs[name].isnan().any(), name
        assert rel_err(outs[name], reference) < 1e-12, name


def test_smoke_run_writes_every_case(probe, monkeypatch, tmp_path):
    out = tmp_path / "probe.json"
    monkeypatch.setattr("sys.argv", ["gemm_clock_probe.py", "--smoke", "--repeats", "1", "--out", str(out)])
    probe.main()
    rows = json.loads(out.read_text())["rows"]
    assert [(r["m"], r["chunk_rows"], r["mode"]) for r in rows] == [
        (m, chunk, mode) for m, chunk in [(64, 64), (256, 256), (256, 64)] for mode in ("cool", "hot")]
    assert all(r["ms"] > 0 and r["tflops"] > 0 for r in rows)
