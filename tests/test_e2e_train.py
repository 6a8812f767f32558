"""benchmarks/e2e.py's training rows in smoke mode (a tiny fp32 model, CPU): one impl's rows as its subprocess prints
them (its entry point run in this process), and the skipped rows the parent writes for a module that is missing."""

import json
import math
import sys
from types import SimpleNamespace

import pytest

from tests.conftest import HAS_CUDA
from tests.helpers import benchmark_script


@pytest.fixture
def e2e(monkeypatch):
    return benchmark_script("e2e", monkeypatch)


SMOKE = SimpleNamespace(layers=1, smoke=True, train_tokens=[12, 16], qlora_tokens=[16], checkpointing_tokens=[8],
                        train_steps=1, train_impls=None)


def printed_rows(e2e, out: str) -> list[dict]:
    return [json.loads(line[len(e2e.ROW_MARK):]) for line in out.splitlines() if line.startswith(e2e.ROW_MARK)]


def test_a_part_runs_only_its_rows(e2e, capsys):
    """The checkpointed rows run in a subprocess of their own, after a fresh model build; the plain rows in another."""
    e2e.train_impl_rows("lora_step", "fuselm", SMOKE, "checkpointing")
    assert [(row["tokens"], row["checkpointing"]) for row in printed_rows(e2e, capsys.readouterr().out)] == [(8, True)]
    assert e2e.train_plan("lora_step", SMOKE, "plain") == [(12, False), (16, False)]
    assert e2e.train_plan("qlora_step", SMOKE, "checkpointing") == [(8, True)]


@pytest.mark.parametrize("impl", ["unpatched", "fuselm"])
def test_one_impl_prints_a_row_per_planned_step(e2e, impl, capsys):
    e2e.train_impl_rows("lora_step", impl, SMOKE)
    rows = printed_rows(e2e, capsys.readouterr().out)
    assert [(row["tokens"], row["checkpointing"]) for row in rows] == [(12, False), (16, False), (8, True)]
    for row in rows:
        assert (row["what"], row["impl"], row["layers"]) == ("lora_step", impl, 1)
        assert row["issue_ms"] > 0  # the host's time per step
        assert row["ms"] > 0 and row["tok_per_s"] == pytest.approx(row["tokens"] / (row["ms"] / 1e3))
        assert row["peak_gib"] > 0 if HAS_CUDA else math.isnan(row["peak_gib"])
        assert ("patch_report" in row) == (impl == "fuselm")
    if impl == "fuselm":
        assert "lora:" in rows[0]["patch_report"]


class FakeChild:
    """A subprocess that printed a progress line and one row (``exit_code`` 0), or nothing (failed)."""

    def __init__(self, e2e, command: list[str], exit_code: int):
        what, impl, part = command[command.index("--one-train-impl") + 1].split(":")
        row = {"what": what, "impl": impl, "tokens": 16, "checkpointing": part == "checkpointing", "ms": 1.0,
               "tok_per_s": 16e3, "peak_gib": 1.0}
        self.stdout = iter(["building\n"] + ([e2e.ROW_MARK + json.dumps(row) + "\n"] if exit_code == 0 else []))
        self.returncode = exit_code

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return False


def test_the_parent_saves_each_row_and_skips_what_cannot_import(e2e, monkeypatch, capsys):
    """liger and QLoRA skipped (their modules "not installed"), unpatched's row read from its child, a child that
    fails leaves an error row; the file is saved after each row."""
    commands = []

    def popen(command, **options):
        commands.append(command)
        failing = command[command.index("--one-train-impl") + 1].startswith("lora_step:fuselm:")
        return FakeChild(e2e, command, exit_code=1 if failing else 0)

    monkeypatch.setattr(e2e, "find_spec", lambda name: None)
    monkeypatch.setattr(e2e.subprocess, "Popen", popen)
    rows, saves = [], []
    e2e.train_section(SMOKE, rows, lambda: saves.append(len(rows)))
    assert [command[command.index("--one-train-impl") + 1] for command in commands] == [
        "lora_step:unpatched:plain", "lora_step:unpatched:checkpointing", "lora_step:fuselm:plain",
        "lora_step:fuselm:checkpointing"]
    assert all("--smoke" in command for command in commands)
    assert [(row["what"], row["impl"], next(key for key in ("tok_per_s", "error", "skipped") if key in row))
            for row in rows] == [("lora_step", "unpatched", "tok_per_s"), ("lora_step", "unpatched", "tok_per_s"),
                                 ("lora_step", "fuselm", "error"), ("lora_step", "fuselm", "error"),
                                 ("lora_step", "liger", "skipped"), ("qlora_step", "unpatched", "skipped"),
                                 ("qlora_step", "fuselm", "skipped")]
    assert saves == list(range(1, len(rows) + 1))
    assert "building" in capsys.readouterr().out


def test_train_impls_runs_only_the_named_impls(e2e, monkeypatch):
    commands = []
    monkeypatch.setattr(e2e, "find_spec", lambda name: object())
    monkeypatch.setattr(e2e.subprocess, "Popen", lambda command, **options: commands.append(command) or
                        FakeChild(e2e, command, exit_code=0))
    args = SimpleNamespace(**{**vars(SMOKE), "train_impls": ["qlora_step:fuselm", "lora_step:liger"]})
    e2e.train_section(args, [], lambda: None)
    assert [command[command.index("--one-train-impl") + 1] for command in commands] == [
        "lora_step:liger:plain", "lora_step:liger:checkpointing", "qlora_step:fuselm:plain",
        "qlora_step:fuselm:checkpointing"]


def test_an_unknown_train_impl_is_refused_by_name(e2e, monkeypatch, capsys):
    monkeypatch.setattr(sys, "argv", ["e2e.py", "--train-impls", "lora_step:fuselm", "lora_step:nope"])
    with pytest.raises(SystemExit):
        e2e.main()
    assert "--train-impls: unknown lora_step:nope" in capsys.readouterr().err


def test_merge_keeps_the_earlier_rows_not_measured_again(e2e):
    earlier = {"date": "then", "rows": [
        {"what": "generate", "impl": "eager", "batch": 1, "prompt": 512, "tok_per_s": 40.0},
        {"what": "generate", "impl": "fuselm.generate", "batch": 1, "prompt": 512, "tok_per_s": 200.0},
        {"what": "lora_step", "impl": "fuselm", "tokens": 4096, "checkpointing": True, "tok_per_s": 1.0,
         "run_date": "before then"}]}
    now = [{"what": "generate", "impl": "fuselm.generate", "batch": 1, "prompt": 512, "tok_per_s": 230.0},
           {"what": "lora_step", "impl": "fuselm", "tokens": 4096, "checkpointing": False, "tok_per_s": 2.0}]
    merged = e2e.merged_rows(earlier, now)
    assert merged == [{"run_date": "then", **earlier["rows"][0]}, earlier["rows"][2], *now]
