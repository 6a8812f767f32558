"""benchmarks/decode_bench.py's layer-step options and smoke check (CPU)."""

import argparse

import pytest

from tests.helpers import benchmark_script


@pytest.fixture
def bench(monkeypatch):
    return benchmark_script("decode_bench", monkeypatch)


def test_layer_shapes_read_batch_by_context(bench):
    assert bench.layer_shape("32x1024") == (32, 1024)
    assert bench.layer_shape("1X512") == (1, 512)
    for bad in ("32", "0x8", "2x0", "2y8", "-1x8", "x8"):
        with pytest.raises(argparse.ArgumentTypeError, match="BxCONTEXT"):
            bench.layer_shape(bad)


def test_a_chain_of_steps_fits_each_cache(bench):
    """HF's StaticCache writes each chained step at its next position: a short context still has room for them."""
    config = bench.llama_config(smoke=True)
    for context in (3, 8, 512):
        inputs = bench.step_inputs(config, 1, context, "cpu")
        assert inputs.max_len >= context + 1 + bench.CHAIN_STEPS
        assert inputs.keys.shape[2] == inputs.max_len


def _step(impl, batch, out_shape, **more):
    return {"what": "layer_step", "impl": impl, "batch": batch, "finite": True, "out_shape": out_shape, **more}


def test_the_smoke_check_takes_each_shapes_batch_and_names_a_wrong_output(bench, capsys):
    bench.check_smoke([_step("fuselm", 1, [1, 1, 64]), _step("fuselm", 2, [2, 1, 64])])
    assert "2 layer-step rows" in capsys.readouterr().out
    with pytest.raises(SystemExit, match=r"fuselm: output \[1, 1, 64\] at batch 2"):
        bench.check_smoke([_step("fuselm", 2, [1, 1, 64])])
    with pytest.raises(SystemExit, match="hf_eager: IndexError"):
        bench.check_smoke([_step("hf_eager", 2, [2, 1, 64], finite=False, error="IndexError: x")])
