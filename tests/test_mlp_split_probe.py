"""benchmarks/mlp_split_probe.py in smoke mode (CPU, Triton's interpreter): the MLP split along the intermediate
dimension (phase kernel, then the partials' sum) equals the two decode kernels and a float64 MLP, at 1 and 3 rows."""

import json
import math

from tests.helpers import benchmark_script


def test_smoke_run_checks_the_split_mlp_against_float64(monkeypatch, tmp_path):
    probe = benchmark_script("mlp_split_probe", monkeypatch)
    out = tmp_path / "probe.json"
    monkeypatch.setattr("sys.argv", ["mlp_split_probe.py", "--smoke", "--rows", "1", "3", "--out", str(out)])
    probe.main()
    rows = json.loads(out.read_text())["rows"]
    assert [(r["impl"], r["rows"]) for r in rows] == [("two_kernels", 1), ("split_j", 1), ("two_kernels", 3),
                                                      ("split_j", 3)]
    for row in rows:  # fp32: the kernels' error against float64 (the norm rounded to fp32 in both) is rounding only
        assert math.isfinite(row["max_rel_error_vs_fp64"]) and row["max_rel_error_vs_fp64"] < 1e-5
        assert row["max_rel_diff_vs_two_kernels"] < 1e-5
