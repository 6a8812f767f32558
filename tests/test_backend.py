"""The backend switch: one name normalisation, process-wide (autograd's worker threads must see it: a
backward or a checkpointed recomputation takes the forward's path), nested blocks, and torch.compile
guarding on it."""

import os
import subprocess
import sys

import pytest
import torch

import fuselm
from fuselm import backend
from tests.helpers import randn


@pytest.fixture
def restore_default():
    previous = backend._backend
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
    assert fuselm.get_backend() == backend._backend


def test_use_backend_blocks_nest_and_restore(device, restore_default):
    fuselm.set_backend("triton")
    with fuselm.use_backend("reference"):
        assert _path_taken(device) == "reference"
        with fuselm.use_backend("triton"):
            assert (fuselm.get_backend(), _path_taken(device)) == ("triton", "triton")
        assert fuselm.get_backend() == "reference"
    assert fuselm.get_backend() == "triton"


def test_compiled_code_follows_the_backend_it_is_called_under(device, restore_default):
    """torch.compile guards on the backend: a function traced under one backend is traced again under
    another, not run with the first one's path."""
    compiled = torch.compile(lambda x: x + 1 if backend.runs_triton(x) else x - 1, fullgraph=True, backend="eager")
    x = torch.zeros(1, device=device)
    fuselm.set_backend("reference")
    assert compiled(x).item() == -1
    fuselm.set_backend("triton")
    assert compiled(x).item() == 1
    with fuselm.use_backend("reference"):
        assert compiled(x).item() == -1
        with fuselm.use_backend("triton"):
            assert compiled(x).item() == 1
