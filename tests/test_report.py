"""benchmarks/report.py's plots: one PNG per kernel family from the committed kernel results, the decode chart from
e2e results in the generate schema, and a printed line (no plot) for the old schema."""

import importlib.util
import json
from pathlib import Path

import pytest

pytest.importorskip("matplotlib")  # [bench], which [test] includes

ROOT = Path(__file__).resolve().parents[1]
PNG = b"\x89PNG\r\n\x1a\n"


@pytest.fixture(scope="module")
def report():
    spec = importlib.util.spec_from_file_location("report", ROOT / "benchmarks" / "report.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _generate_row(impl, batch, tok_per_s, **extra):
    return {"what": "generate", "impl": impl, "batch": batch, "prompt": 512, "new": 256, "tok_per_s": tok_per_s,
            **extra}


E2E = {"gpu": "NVIDIA H200", "date": "2026-12-01T13:00:00+00:00", "copy_gbps": 4000.0, "rows": [
    _generate_row("fuselm.generate", 1, 230.0), _generate_row("eager", 1, 44.0),
    _generate_row("fuselm.generate", 32, 5000.0, bytes_per_step=16e9), _generate_row("eager", 32, 1000.0),
    {"what": "bound", "impl": "bound", "batch": 1, "prompt": 512, "new": 256, "tok_per_s": 287.0},
    {"what": "prefill", "impl": "eager", "batch": 1, "prompt": 2048, "new": 0, "ms": 60.9},
]}


def test_kernel_plots_one_png_per_family(report, tmp_path):
    results = json.loads((ROOT / "benchmarks" / "results" / "kernels-h200.json").read_text())
    written = report.kernel_plots(results, tmp_path)
    families = {row["kernel"] for row in results["rows"]}
    assert sorted(path.name for path in written) == sorted(f"kernels-{family}.png" for family in families)
    assert all(path.read_bytes().startswith(PNG) for path in written)


def test_decode_bound_from_a_bound_row_or_the_bytes_per_step(report):
    assert report._decode_bound(E2E, E2E["rows"], 1) == 287.0
    assert report._decode_bound(E2E, E2E["rows"], 32) == pytest.approx(32 * 4000e9 / 16e9)
    assert report._decode_bound(E2E, E2E["rows"], 8) is None


def test_decode_plot_from_the_generate_schema(report, tmp_path):
    path = report.decode_plot(E2E, tmp_path)
    assert path == tmp_path / report.DECODE_PLOT and path.read_bytes().startswith(PNG)


def test_old_e2e_schema_gets_a_line_and_no_plot(report, tmp_path, capsys):
    old = {"gpu": "NVIDIA H200", "rows": [{"what": "prefill B1×2048 (ms)", "unpatched": "60.9", "patched": "49.6"}]}
    assert report.decode_plot(old, tmp_path) is None
    assert "no decode plot" in capsys.readouterr().out and not any(tmp_path.iterdir())
