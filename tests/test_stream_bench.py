"""benchmarks/stream_bench.py in smoke mode: on a CPU through the interpreter (on a GPU, compiled), both loads of the
weight stream (pointer tiles and a TMA descriptor) at two split-K settings sum to x @ W.T over odd sizes, for one row
of x and for several, from partials poisoned with NaN beforehand."""


import pytest

from fuselm.backend import INTERPRETING
from tests.conftest import HAS_CUDA
from tests.helpers import benchmark_script


@pytest.fixture
def stream_bench(monkeypatch):
    return benchmark_script("stream_bench", monkeypatch)


@pytest.mark.skipif(not (INTERPRETING or HAS_CUDA), reason="needs the interpreter or a GPU")
@pytest.mark.parametrize("n_rows", [1, 3])
def test_every_stream_sums_to_x_at_w(stream_bench, n_rows):
    device = "cuda" if HAS_CUDA and not INTERPRETING else "cpu"
    configs = stream_bench.configs(smoke=True)
    rows = stream_bench.rows_for("small", stream_bench.SMOKE_SHAPES["small"], configs, copy=1.0, device=device,
                                 n_rows=n_rows)
    streams = [row for row in rows if row["what"] == "stream"]
    assert [(row["load"], row["SPLIT_K"]) for row in streams] == [
        (load, config["SPLIT_K"]) for load in stream_bench.LOADS for config in configs]
    for row in streams:
        assert "error" not in row, row
        assert row["rel_err"] < 1e-5, row  # fp32 sums of bf16 products: rounding only
    assert [row["what"] for row in rows].count("read") == 1
    assert {row["m"] for row in rows} == {n_rows}
