"""The ``fuselm`` command: version, ``python -m fuselm``, one-line errors for bad arguments, a tiny demo on CPU."""

import os
import re
import subprocess
import sys
from importlib import metadata
from pathlib import Path

import pytest
import torch

import fuselm
from fuselm import demo
from fuselm.cli import main

ROOT = Path(__file__).resolve().parents[1]
TINY_DEMO = ["demo", "--device", "cpu", "--layers", "1", "--seq", "8", "--new-tokens", "2", "--batch", "1",
             "--runs", "2"]


def _python_m_fuselm(*args: str) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    return subprocess.run([sys.executable, "-m", "fuselm", *args], check=False, capture_output=True, text=True,
                          env=env, timeout=120)


def _exit_code(argv: list[str]) -> int:
    with pytest.raises(SystemExit) as exit_info:
        main(argv)
    return exit_info.value.code


def test_version_is_the_package_metadata():
    try:
        installed = metadata.version("fuselm")
    except metadata.PackageNotFoundError:  # run from a source tree that pip did not install (the GPU machine's)
        pytest.skip("fuselm is not installed: no package metadata to compare with")
    assert fuselm.__version__ == installed


def test_python_m_fuselm_version():
    result = _python_m_fuselm("--version")
    assert (result.returncode, result.stdout, result.stderr) == (0, f"fuselm {fuselm.__version__}\n", "")


def test_python_m_fuselm_without_a_command_is_a_usage_error():
    result = _python_m_fuselm()
    assert result.returncode == 2 and result.stdout == ""
    assert result.stderr.splitlines()[-1] == "fuselm: error: the following arguments are required: command"


def test_every_demo_option_shows_help_and_default(capsys):
    assert _exit_code(["demo", "--help"]) == 0
    help_text = " ".join(capsys.readouterr().out.split())  # argparse wraps lines
    for option in ("--device", "--layers", "--batch", "--seq", "--new-tokens", "--runs"):
        described = help_text.split(option, 2)[-1].split(" --")[0]  # the option's row: after its metavar
        assert "(default:" in described, (option, described)


BAD_ARGUMENTS = {
    "--device foo": "argument --device: unknown device 'foo': use cpu or cuda",
    "--device mps": "argument --device: the demo runs on cpu or cuda, got 'mps'",
    "--batch 0": "argument --batch: must be at least 1, got 0",
    "--new-tokens 0": "argument --new-tokens: must be at least 1, got 0",
    "--layers -1": "argument --layers: must be at least 1, got -1",
    "--seq 0": "argument --seq: must be at least 1, got 0",
    "--runs two": "argument --runs: expected an integer, got 'two'",
}
if not torch.cuda.is_available():
    BAD_ARGUMENTS["--device cuda"] = (f"argument --device: 'cuda': CUDA is not available here (torch "
                                      f"{torch.__version__}); use --device cpu")


@pytest.mark.parametrize("arguments", BAD_ARGUMENTS)
def test_bad_demo_argument_is_a_one_line_error(arguments, capsys):
    assert _exit_code(["demo", *arguments.split()]) == 2
    captured = capsys.readouterr()
    assert captured.out == "" and "Traceback" not in captured.err
    errors = [line for line in captured.err.splitlines() if "error:" in line]
    assert errors == [f"fuselm demo: error: {BAD_ARGUMENTS[arguments]}"]


def test_backend_triton_on_cpu_without_the_interpreter_is_a_one_line_error(monkeypatch, capsys):
    monkeypatch.setattr(fuselm.backend, "INTERPRETING", False)
    with fuselm.use_backend("triton"):
        assert _exit_code(TINY_DEMO) == 2
    err = capsys.readouterr().err
    assert "Traceback" not in err
    assert err.splitlines()[-1].startswith("fuselm: error: FUSELM_BACKEND=triton got a tensor on cpu")


def test_tiny_demo_on_cpu_shows_timings_and_no_speed_up(capsys):
    assert main(TINY_DEMO) == 0
    out = capsys.readouterr().out
    assert "speed-up" not in out
    assert not re.search(r"\d\.\d\d×", out)  # no ratio like 1.02×
    assert "HF (sdpa attention)" in out and "median of 2 runs each, in turns" in out
    assert "timings only" in out and "match" in out and "identical" in out


def test_demo_says_when_it_caps_seq_on_cpu(monkeypatch, capsys):
    monkeypatch.setattr(demo, "CPU_MAX_SEQ", 6)  # 64 in use; 6 keeps the test quick
    assert main([*TINY_DEMO, "--seq", "7"]) == 0
    out = capsys.readouterr().out
    assert "--seq 7 is capped to 6 tokens on cpu" in out and "batch 1 × 6 tokens" in out


@pytest.mark.gpu
def test_tiny_demo_on_cuda_shows_the_speed_up(capsys):
    argv = [*TINY_DEMO, "--device", "cuda"]  # the later --device wins
    assert main(argv) == 0
    out = capsys.readouterr().out
    assert "speed-up" in out and re.search(r"\d\.\d\d×", out) and "timings only" not in out
