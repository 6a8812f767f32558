"""The backend switch: one name normalisation, a process-wide default, per-thread overrides that
torch.compile guards on."""

import os
import subprocess
import sys
import threading

import pytest
import torch

import fuselm
from fuselm import backend
from tests.helpers import randn


@pytest.fixture
def restore_default():
    previous = backend._default
    yield
    backend.set_backend(previous)


def _path_taken(device: str) -> str:
    """Which path an op took: the Triton op records its own autograd node, the reference torch's."""
    x = randn(3, 8, device=device, requires_grad=True)
    node = type(fuselm.rms_norm(x, torch.ones(8, device=device)).grad_fn).__name__
    return "triton" if node.startswith("rms_norm_autograd") else "reference"


@pytest.mark.parametrize(("name", "expected"), [("TRITON", "triton"), (" Reference ", "reference"), ("Auto\n", "auto")])
def test_set_backend_normalises_as_the_environment_variable_does(name, expected, restore_default):
    fuselm.set_backend(name)
    assert fuselm.get_backend() == expected
    fuselm.set_backend("auto" if expected != "auto" else "triton")
    with fuselm.use_backend(name):
        assert fuselm.get_backend() == expected
    script = "import fuselm; print(fuselm.get_backend())"
    env = {**os.environ, "FUSELM_BACKEND": name}
    out = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True, text=True, check=True)
    assert out.stdout.strip() == expected


def test_bad_names_are_refused_naming_the_choices(restore_default):
    for bad in ("", "cuda", "tri ton"):
        with pytest.raises(ValueError, match="must be one of"):
            fuselm.set_backend(bad)
        with pytest.raises(ValueError, match="must be one of"), fuselm.use_backend(bad):
            pass
    with pytest.raises(TypeError, match="backend must be a str"):
        fuselm.set_backend(None)
    assert fuselm.get_backend() == backend._default


def test_two_threads_run_under_different_backends_at_once(device):
    """Both threads are inside their use_backend block at the same time, each op takes its own path."""
    inside = threading.Barrier(2, timeout=30)  # a thread that fails leaves the other one here: it times out
    seen = {}

    def run(name):
        with fuselm.use_backend(name):
            inside.wait()  # both blocks entered
            seen[name] = (fuselm.get_backend(), _path_taken(device))
            inside.wait()  # neither leaves before the other has run its op

    threads = [threading.Thread(target=run, args=(name,)) for name in ("reference", "triton")]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert seen == {"reference": ("reference", "reference"), "triton": ("triton", "triton")}


def test_a_new_thread_sees_the_process_default_not_the_creators_override(device, restore_default):
    fuselm.set_backend("triton")
    seen = []
    with fuselm.use_backend("reference"):
        assert _path_taken(device) == "reference"
        thread = threading.Thread(target=lambda: seen.append((fuselm.get_backend(), _path_taken(device))))
        thread.start()
        thread.join()
    assert seen == [("triton", "triton")]


def test_set_backend_inside_a_block_changes_the_default_once_the_block_exits(restore_default):
    fuselm.set_backend("auto")
    with fuselm.use_backend("reference"):
        fuselm.set_backend("triton")
        assert fuselm.get_backend() == "reference"
    assert fuselm.get_backend() == "triton"


def test_compiled_code_follows_the_backend_it_is_called_under(device, restore_default):
    """torch.compile guards on the thread's override and the default: a function traced under one
    backend is traced again under another, not run with the first one's path."""
    compiled = torch.compile(lambda x: x + 1 if backend.runs_triton(x) else x - 1, fullgraph=True, backend="eager")
    x = torch.zeros(1, device=device)
    fuselm.set_backend("reference")
    assert compiled(x).item() == -1
    fuselm.set_backend("triton")
    assert compiled(x).item() == 1
    seen = []
    with fuselm.use_backend("reference"):
        assert compiled(x).item() == -1
        thread = threading.Thread(target=lambda: seen.append(compiled(x).item()))
        thread.start()
        thread.join()
        with fuselm.use_backend("triton"):
            assert compiled(x).item() == 1
    assert seen == [1]  # the process default's path, not the creating thread's override
