"""Which implementation an op runs: the fused Triton kernel or the PyTorch reference.

One rule for every op, chosen by ``FUSELM_BACKEND`` (read at import) or :func:`set_backend`, and
overridden for one block of code by :func:`use_backend`:

- ``auto`` (default): CUDA tensors of a supported dtype run Triton; everything else (CPU, MPS,
  float64, ...) runs the PyTorch reference, silently and correctly.
- ``reference``: the PyTorch reference everywhere. Use it to check a model with fused kernels off.
- ``triton``: Triton everywhere. CPU tensors need ``TRITON_INTERPRET=1`` set before fuselm is
  imported; the kernels then run in Triton's interpreter (slow; how CPU-only CI checks them).

Names are case-insensitive and may carry surrounding blanks, in the environment variable and in the
functions alike.

Scope: ``FUSELM_BACKEND`` and :func:`set_backend` set the process-wide default, seen by every thread.
:func:`use_backend` overrides it in the current thread only: two threads can run under different backends
at once, a thread started inside a block starts from the default, asyncio tasks of one thread share its
blocks. In autograd:

- A backward pass needs no backend: a Triton forward records its own autograd node, whose backward runs the
  Triton backward kernels, and a reference forward records torch's nodes. Backward takes the forward's path
  on whatever thread, under whatever backend, it runs.
- Gradient checkpointing recomputes the forward inside backward, on CUDA on autograd's device threads,
  where Python's thread-locals and ``contextvars`` are not seen. So a block is also kept in torch's own
  thread-local state (``at::ThreadLocalState``), which autograd copies from the thread calling
  ``backward()`` into its workers, as it does autocast. A recomputation thus runs under the backend in
  force where ``backward()`` is called: call it inside the forward's block, as a training step does.
  (Of the forward's state, torch.utils.checkpoint restores only RNG, autocast, a ``torch.device`` block
  and its ``context_fn``'s contexts: a backward called under another backend recomputes on that one's
  path, which non-reentrant checkpointing refuses, as it saved other tensors.)

The override lives in a ``threading.local`` rather than a ``ContextVar``: torch.compile traces an
attribute read of the former and guards on its value (a compiled function is traced again under another
backend), and cannot trace ``ContextVar.get``. Nor can it trace the read of torch's thread-local state:
compiled code sees the thread's own block and the default, so a compiled region recomputed by eager
checkpointing on a CUDA worker thread takes the default.
"""

from __future__ import annotations

import contextlib
import os
import threading
from collections.abc import Iterator

import torch

from fuselm.ops._triton import TRITON_AVAILABLE

BACKENDS = ("auto", "triton", "reference")
TRITON_DTYPES = (torch.float32, torch.float16, torch.bfloat16)
INTERPRETING = os.environ.get("TRITON_INTERPRET", "0") == "1"


def _validated(name: object) -> str:
    """``name`` normalised (blanks stripped, lower case) and checked against :data:`BACKENDS`."""
    if not isinstance(name, str):
        raise TypeError(f"backend must be a str, one of {BACKENDS}, got {type(name).__name__}")
    normalised = name.strip().lower()
    if normalised not in BACKENDS:
        raise ValueError(f"FUSELM_BACKEND / backend must be one of {BACKENDS} (any case), got {name!r}")
    return normalised


_default = _validated(os.environ.get("FUSELM_BACKEND", "").strip() or "auto")  # the process-wide backend


class _ThreadState(threading.local):
    override: str | None = None  # this thread's innermost use_backend name (a class default: no per-thread set-up)


_thread = _ThreadState()
_TORCH_TLS_KEY = "fuselm.backend.override"  # the same name in torch's thread-local state, which autograd hands on
_tls_has, _tls_get = torch._C._is_key_in_tls, torch._C._get_obj_in_tls


def _handed_over() -> str | None:
    """The override in torch's thread-local state: this thread's own, or on an autograd worker thread the
    override of the thread that called ``backward()`` (module docstring)."""
    return _tls_get(_TORCH_TLS_KEY) if _tls_has(_TORCH_TLS_KEY) else None


def get_backend() -> str:
    """The backend in force in this thread: 'auto', 'triton' or 'reference' (its :func:`use_backend`
    override, else the process-wide default)."""
    override = _thread.override  # torch.compile guards on this read
    # autograd's worker threads have no thread-local override but torch's state has it. torch.compile cannot
    # trace that read and must not bake one thread's value into a graph every thread runs: it skips it.
    if override is None and not torch.compiler.is_compiling() and _tls_has(_TORCH_TLS_KEY):
        override = _tls_get(_TORCH_TLS_KEY)
    return override or _default


def set_backend(name: str) -> None:
    """Set the process-wide default backend (overrides ``FUSELM_BACKEND``), seen by every thread.

    An active :func:`use_backend` block keeps its own backend until it exits.
    """
    global _default
    _default = _validated(name)


def _set_override(thread_override: str | None, torch_override: str | None) -> None:
    _thread.override = thread_override
    if torch_override is None:
        if _tls_has(_TORCH_TLS_KEY):
            torch._C._remove_obj_from_tls(_TORCH_TLS_KEY)
    else:
        torch._C._stash_obj_in_tls(_TORCH_TLS_KEY, torch_override)


@contextlib.contextmanager
def use_backend(name: str) -> Iterator[None]:
    """Run a block under another backend: ``with fuselm.use_backend("reference"): ...``.

    The override holds in the current thread only (and in autograd's work for a ``backward()`` called
    inside the block, module docstring); other threads keep theirs. Blocks nest.
    """
    name = _validated(name)
    outer = _thread.override, _handed_over()
    _set_override(name, name)
    try:
        yield
    finally:
        _set_override(*outer)


def runs_triton(*tensors: torch.Tensor) -> bool:
    """Whether an op on these tensors takes the Triton path under the current backend.

    The first tensor decides (the callers have already checked that all share device and dtype).
    """
    x = tensors[0]
    backend = get_backend()
    if backend == "reference":
        return False
    if backend == "auto":
        return TRITON_AVAILABLE and x.is_cuda and x.dtype in TRITON_DTYPES
    if not TRITON_AVAILABLE:
        raise ModuleNotFoundError("FUSELM_BACKEND=triton needs triton, which is not installed (its wheels are for "
                                  "Linux only); use 'auto' or 'reference' for the PyTorch reference", name="triton")
    if x.dtype not in TRITON_DTYPES:
        raise TypeError(
            f"FUSELM_BACKEND=triton supports dtypes {TRITON_DTYPES}, got {x.dtype}; "
            "use 'auto' to fall back to the PyTorch reference"
        )
    if not x.is_cuda and not INTERPRETING:
        raise ValueError(
            f"FUSELM_BACKEND=triton got a tensor on {x.device}: Triton runs on CUDA tensors, or on CPU "
            "tensors only with TRITON_INTERPRET=1 set before importing fuselm"
        )
    return True


def path_name(device: torch.device | str) -> str:
    """Human-readable name of the path ops take for tensors on ``device`` (used by the demo)."""
    device = torch.device(device)
    backend = get_backend()
    if backend == "reference" or (backend == "auto" and (device.type != "cuda" or not TRITON_AVAILABLE)):
        return f"PyTorch reference ({device.type})"
    if device.type == "cuda":
        return f"Triton ({torch.cuda.get_device_name(device)})"
    return "Triton interpreter (cpu)"
