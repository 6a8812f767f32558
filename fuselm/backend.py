"""Which implementation an op runs: the fused Triton kernel or the PyTorch reference.

One rule for every op, chosen by ``FUSELM_BACKEND`` (read at import) or :func:`set_backend`, and
overridden for one block of code by :func:`use_backend`:

- ``auto`` (default): CUDA tensors of a supported dtype run Triton; everything else (CPU, MPS,
  float64, ...) runs the PyTorch reference, silently and correctly.
- ``reference``: the PyTorch reference everywhere. Use it to check a model with fused kernels off.
- ``triton``: Triton everywhere. CPU tensors need ``TRITON_INTERPRET=1`` set before fuselm is
  imported; the kernels then run in Triton's interpreter (slow; how CPU-only CI checks them).

Names are case-insensitive and may carry surrounding blanks, in the environment variable and in the
functions alike. Scope: the backend is process-wide, :func:`use_backend` included. It cannot be per thread:
a backward pass (and gradient checkpointing's recomputation of the forward) runs on autograd's own worker
threads, which must take the path the forward took; a thread-local (or ``contextvars``) switch is not seen
there, so a recomputed forward would save other tensors than the first and checkpointing would fail.
"""

from __future__ import annotations

import contextlib
import os
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


_backend = _validated(os.environ.get("FUSELM_BACKEND", "").strip() or "auto")


def get_backend() -> str:
    """The backend in force: 'auto', 'triton' or 'reference'."""
    return _backend


def set_backend(name: str) -> None:
    """Set the backend for every op in this process (overrides ``FUSELM_BACKEND``)."""
    global _backend
    _backend = _validated(name)


@contextlib.contextmanager
def use_backend(name: str) -> Iterator[None]:
    """Run a block under another backend: ``with fuselm.use_backend("reference"): ...`` (process-wide, see the
    module docstring); the previous backend is restored when the block exits. Blocks nest."""
    previous = get_backend()
    set_backend(name)
    try:
        yield
    finally:
        set_backend(previous)


def runs_triton(*tensors: torch.Tensor) -> bool:
    """Whether an op on these tensors takes the Triton path under the current backend.

    The first tensor decides (the callers have already checked that all share device and dtype).
    """
    x = tensors[0]
    backend = _backend
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
