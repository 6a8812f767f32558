"""benchmarks/ncu_decode.py: its decode step launches at tiny shapes (the interpreter on a CPU, compiled on a GPU), and
its summary reads ncu's raw CSV (a header row, a units row, one row per kernel in launch order)."""

import csv

import pytest

from fuselm.backend import INTERPRETING
from tests.conftest import HAS_CUDA
from tests.helpers import benchmark_script


@pytest.fixture
def ncu_decode():
    return benchmark_script("ncu_decode")


@pytest.mark.skipif(not (INTERPRETING or HAS_CUDA), reason="needs the interpreter or a GPU")
def test_every_launch_runs_at_tiny_shapes(ncu_decode):
    calls = ncu_decode.launches([1, 3], smoke=True)
    assert [label for label, _ in calls] == ["step B1", "step B3", "attention B1 x 32k", "cuDNN B1 x 32k",
                                             *ncu_decode.GATE_UP_CONFIGS, *ncu_decode.QKV_CONFIGS]
    assert calls[1][1]().shape == (3, 1, 128)
    fused, sdpa = calls[2][1](), calls[3][1]()
    assert fused.isfinite().all() and (fused - sdpa).abs().max() < 1e-4  # fp32 off the GPU: both the same math
    first, second = calls[4][1](), calls[5][1]()
    assert first.shape == (1, 1, 96) and (first - second).abs().max() < 1e-5  # two configs, one result
    qkv = [call() for _, call in calls[6:]]
    assert len(qkv) == 3 and qkv[0].shape == (32, 4, 1, 64) and qkv[0].isfinite().all()
    assert all((other - qkv[0]).abs().max() < 1e-4 for other in qkv[1:])  # three configs (split-K sums), one result
    assert len(ncu_decode.labels([1, 3])) == (2 * len(ncu_decode.STEP_KERNELS) + 2 + len(ncu_decode.GATE_UP_CONFIGS)
                                              + len(ncu_decode.QKV_CONFIGS))


def test_the_summary_reads_a_raw_csv(ncu_decode, tmp_path, capsys):
    stall = ncu_decode.STALLS + "{}_per_issue_active.ratio"
    header = ["ID", "Kernel Name", "gpu__time_duration.sum", stall.format("long_scoreboard"), stall.format("barrier"),
              stall.format("mio_throttle")]
    rows = [header, ["", "", "usecond", "", "", ""]]
    rows += [[str(i), f"kernel_{i}", f"{10 + i}.5", "3.5", "1,234.0", "n/a"] for i in range(17)]
    path = tmp_path / "raw.csv"
    with open(path, "w", newline="") as file:
        file.write("==PROF== Connected to process\n")
        csv.writer(file, quoting=csv.QUOTE_ALL).writerows(rows)
    ncu_decode.summary(str(path), [1, 32])  # 17 kernels: two steps of five, two 32k attentions, 2 + 3 forced configs
    lines = capsys.readouterr().out.splitlines()
    assert "usecond" in lines[1]
    kernels = lines[2:]
    assert [line[:24].strip() for line in kernels] == ncu_decode.labels([1, 32])
    assert kernels[3][24:].split()[0] == "13.5"
    assert kernels[0].endswith("barrier 1234.0, long_scoreboard 3.5")  # largest first; not a number: left out
    ncu_decode.summary(str(path), [1])  # 12 labels for 17 kernels: ncu's own names instead
    assert [line.split()[0] for line in capsys.readouterr().out.splitlines()[2:]] == [f"kernel_{i}" for i in range(17)]
