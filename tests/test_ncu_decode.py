"""benchmarks/ncu_decode.py: its decode step launches at tiny shapes (the interpreter on a CPU, compiled on a GPU), and
its summary reads ncu's raw CSV (a header row, a units row, one row per kernel in launch order)."""

import csv
import importlib.util
from pathlib import Path

import pytest

from fuselm.backend import INTERPRETING
from tests.conftest import HAS_CUDA

BENCHMARKS = Path(__file__).resolve().parents[1] / "benchmarks"


@pytest.fixture
def ncu_decode():
    spec = importlib.util.spec_from_file_location("ncu_decode", BENCHMARKS / "ncu_decode.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.mark.skipif(not (INTERPRETING or HAS_CUDA), reason="needs the interpreter or a GPU")
def test_the_step_runs_at_tiny_shapes(ncu_decode):
    out = ncu_decode.layer_step(3, smoke=True)()
    assert out.shape == (3, 1, 128) and out.isfinite().all()


def test_the_summary_reads_a_raw_csv(ncu_decode, tmp_path, capsys):
    stall = ncu_decode.STALLS + "{}_per_issue_active.ratio"
    header = ["ID", "Kernel Name", "gpu__time_duration.sum", stall.format("long_scoreboard"), stall.format("barrier"),
              stall.format("mio_throttle")]
    rows = [header, ["", "", "usecond", "", "", ""]]
    rows += [[str(i), f"kernel_{i}", f"{10 + i}.5", "3.5", "1,234.0", "n/a"] for i in range(4)]
    path = tmp_path / "raw.csv"
    with open(path, "w", newline="") as file:
        file.write("==PROF== Connected to process\n")
        csv.writer(file, quoting=csv.QUOTE_ALL).writerows(rows)
    ncu_decode.summary(str(path), [1, 32])
    lines = capsys.readouterr().out.splitlines()
    assert "usecond" in lines[1]
    kernels = lines[2:]
    assert [line.split()[:2] for line in kernels] == [["kernel_0", "1"], ["kernel_1", "1"], ["kernel_2", "32"],
                                                     ["kernel_3", "32"]]
    assert kernels[3].split()[2] == "13.5"
    assert kernels[0].endswith("barrier 1234.0, long_scoreboard 3.5")  # largest first; not a number: left out
