"""The backend switch: one name normalisation, a process-wide default, per-thread blocks that follow the work
into autograd (a backward takes the forward's path; a checkpointed recomputation, on autograd's threads, the
backend in force where backward() is called), and torch.compile guarding on it."""

import collections
import os
import subprocess
import sys
import threading

import pytest
import torch
from torch.utils.checkpoint import checkpoint

import fuselm
from fuselm import backend
from fuselm.ops import rms_norm as rms_norm_module
from tests.helpers import assert_close, float64_leaf, on_a_worker_like_thread, randn


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


def test_a_new_thread_sees_the_process_default_not_the_creators_block(device, restore_default):
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


def test_use_backend_blocks_nest_and_restore(device, restore_default):
    fuselm.set_backend("triton")
    with fuselm.use_backend("reference"):
        assert _path_taken(device) == "reference"
        with fuselm.use_backend("triton"):
            assert (fuselm.get_backend(), _path_taken(device)) == ("triton", "triton")
        assert fuselm.get_backend() == "reference"
    assert fuselm.get_backend() == "triton"


def test_a_block_left_by_an_exception_restores_the_outer_backend(restore_default):
    fuselm.set_backend("reference")
    with fuselm.use_backend("auto"):
        with pytest.raises(RuntimeError, match="inside"), fuselm.use_backend("triton"):
            raise RuntimeError("inside")
        assert (fuselm.get_backend(), backend._thread.override, backend._handed_over()) == ("auto", "auto", "auto")
    assert (fuselm.get_backend(), backend._thread.override, backend._handed_over()) == ("reference", None, None)


def test_compiled_code_follows_the_backend_it_is_called_under(device, restore_default):
    """torch.compile guards on the thread's block and the default: a function traced under one backend is
    traced again under another, not run with the first one's path."""
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
    assert seen == [1]  # the process default's path, not the creating thread's block


# ----------------------------------------------------------------------------------- autograd's threads
REFERENCE_RMS_NORM = rms_norm_module.rms_norm_reference
COUNTED = {"RMS_NORM": "triton forward", "RMS_NORM_BACKWARD": "triton backward",
           "rms_norm_reference": "reference forward"}


@pytest.fixture
def calls(monkeypatch):
    """How often each path of rms_norm ran, from any thread: the names rms_norm and its Triton autograd
    node call at run time, each replaced by a counting wrapper."""
    counts = collections.Counter()
    for name, path in COUNTED.items():
        original = getattr(rms_norm_module, name)

        def counting(*args, _original=original, _path=path):
            counts[_path] += 1
            return _original(*args)

        monkeypatch.setattr(rms_norm_module, name, counting)
    return counts


def _two_norms(x, weight):
    return fuselm.rms_norm(fuselm.rms_norm(x, weight) * 2, weight)


def _expected_grads(x, weight, upstream):
    x64, weight64 = float64_leaf(x), float64_leaf(weight)
    out = REFERENCE_RMS_NORM(REFERENCE_RMS_NORM(x64, weight64, 1e-6, 0.0, "llama") * 2, weight64, 1e-6, 0.0, "llama")
    return torch.autograd.grad(out, (x64, weight64), upstream.double())


def _expected_calls(path, forwards):
    return {"triton forward": forwards, "triton backward": 2} if path == "triton" else {"reference forward": forwards}


@pytest.mark.parametrize("forward_path", ["triton", "reference"])
def test_backward_takes_the_forwards_path_on_another_thread_under_another_backend(device, calls, forward_path):
    x, weight = randn(3, 40, device=device, requires_grad=True), randn(40, device=device, requires_grad=True)
    upstream = randn(3, 40, device=device)
    with fuselm.use_backend(forward_path):
        out = _two_norms(x, weight)

    def backward():
        with fuselm.use_backend("reference" if forward_path == "triton" else "triton"):
            out.backward(upstream)

    thread = threading.Thread(target=backward)
    thread.start()
    thread.join()
    assert dict(calls) == _expected_calls(forward_path, forwards=2)
    for got, expected, name in zip((x.grad, weight.grad), _expected_grads(x, weight, upstream), ("x", "weight")):
        assert_close(got, expected, torch.float32, f"grad of {name}")


@pytest.mark.parametrize("reentrant", [False, True], ids=["non-reentrant", "reentrant"])
@pytest.mark.parametrize("backward_thread", ["caller", "worker-like thread"])
@pytest.mark.parametrize(("default", "block"), [("reference", "triton"), ("triton", "reference")])
def test_checkpoint_recomputes_under_the_block_backward_is_called_in(device, calls, restore_default, default, block,
                                                                    backward_thread, reentrant):
    """The GPU failure of a thread-local switch: the recomputation runs on a thread without the block's Python
    thread-locals, and must still take the block's path, not the default's. On CUDA the caller's backward()
    runs there (autograd's device threads); on CPU a worker-like thread stands in."""
    fuselm.set_backend(default)
    x, weight = randn(3, 40, device=device, requires_grad=True), randn(40, device=device, requires_grad=True)
    upstream = randn(3, 40, device=device)
    seen = {}

    def backward():
        seen["override"] = backend._thread.override
        out.backward(upstream)

    with fuselm.use_backend(block):
        out = checkpoint(_two_norms, x, weight, use_reentrant=reentrant)
        if backward_thread == "caller":
            backward()
        else:
            assert on_a_worker_like_thread(backward) != threading.get_ident()
            assert seen["override"] is None  # the thread had none of the block's Python state
    assert dict(calls) == _expected_calls(block, forwards=4)  # 2 in the forward, 2 recomputed
    for got, expected, name in zip((x.grad, weight.grad), _expected_grads(x, weight, upstream), ("x", "weight")):
        assert_close(got, expected, torch.float32, f"grad of {name}")
