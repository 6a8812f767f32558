"""benchmarks/tuning_table.py: results files merge in order (a later timed pick replaces an earlier one, a pick read
from a table never replaces a timed one), ``--skip`` leaves a file's kernel out, files of two GPU models are refused,
and ``--update`` keeps the shipped table's other keys with their sources."""

import json
from pathlib import Path

import pytest

from tests.helpers import benchmark_script


@pytest.fixture
def tuning_table():
    return benchmark_script("tuning_table")


def pick(kernel, key, block, from_table=False):
    return {"kernel": kernel, "key": key, "config": {"BLOCK": block, "num_warps": 4, "num_stages": 3},
            "of": 3, "from_table": from_table}


def results(tmp_path, name, picks, gpu="GPU A"):
    path = tmp_path / name
    path.write_text(json.dumps({"gpu": gpu, "torch": "t", "triton": "tr", "date": name, "autotune_picks": picks}))
    return str(path)


def by_key(picks):
    return {(p["kernel"], tuple(p["key"])): (p["config"]["BLOCK"], Path(p["source"]).name) for p in picks}


def test_later_timed_picks_replace_earlier_ones(tuning_table, tmp_path):
    first = results(tmp_path, "first.json", [pick("k1", [1], 16), pick("k1", [2], 16), pick("k2", [1], 16)])
    second = results(tmp_path, "second.json", [pick("k1", [1], 32), pick("k1", [2], 64, from_table=True),
                                               pick("k2", [1], 128)])
    gpu, picks, versions = tuning_table.merged_picks([first, second], {(second, "k2")})
    assert gpu == "GPU A" and set(versions) == {first, second}
    assert by_key(picks) == {("k1", (1,)): (32, "second.json"), ("k1", (2,)): (16, "first.json"),
                             ("k2", (1,)): (16, "first.json")}


def test_files_of_two_gpu_models_are_refused(tuning_table, tmp_path):
    with pytest.raises(SystemExit, match="2 GPU models"):
        tuning_table.merged_picks([results(tmp_path, "a.json", [pick("k", [1], 16)]),
                                   results(tmp_path, "b.json", [pick("k", [1], 16)], gpu="GPU B")], set())


def test_update_keeps_the_shipped_tables_other_keys(tuning_table, tmp_path):
    shipped = {"gpu": "GPU A", "measured_with": {"old.json": {"date": "d"}},
               "picks": [{**pick("k1", [1], 16), "source": "old.json"}, {**pick("k1", [2], 16), "source": "old.json"}]}
    new = results(tmp_path, "new.json", [pick("k1", [2], 64), pick("k3", [5], 8)])
    gpu, picks, versions = tuning_table.merged_picks([new], set(), shipped)
    assert gpu == "GPU A" and set(versions) == {"old.json", new}
    assert by_key(picks) == {("k1", (1,)): (16, "old.json"), ("k1", (2,)): (64, "new.json"),
                             ("k3", (5,)): (8, "new.json")}
    with pytest.raises(SystemExit, match="2 GPU models"):
        tuning_table.merged_picks([results(tmp_path, "other.json", [pick("k", [1], 16)], gpu="GPU B")], set(), shipped)


def test_a_rewrite_keeps_the_shipped_tables_settings(tuning_table, tmp_path, monkeypatch):
    """``settings`` (measured by A/B runs, written by hand) survive an --update and a rewrite from results alone."""
    table_path = tmp_path / "gpu-a.json"
    settings = {"dependent_max_rows": {"value": 8, "source": "ab.json"}}
    table_path.write_text(json.dumps({"gpu": "GPU A", "measured_with": {}, "settings": settings,
                                      "picks": [{**pick("k1", [1], 16), "source": "old.json"}]}))
    monkeypatch.setattr(tuning_table, "tuning_table_path", lambda gpu: table_path)
    new = results(tmp_path, "new.json", [pick("k1", [2], 64)])
    for argv in (["--update", new], [new]):
        monkeypatch.setattr("sys.argv", ["tuning_table.py", *argv])
        tuning_table.main()
        written = json.loads(table_path.read_text())
        assert written["settings"] == settings
        assert ("k1", (2,)) in by_key(written["picks"])
