"""``triton`` and ``triton.language as tl`` for the op files, or stand-ins where triton is not installed.

triton has wheels for Linux only. Without it the kernels are still defined at import (``@triton.jit``,
``triton.Config`` lists, ``tl.constexpr``), so the stand-ins make those decorators and constructors
return their argument unchanged; ``fuselm.backend`` then sends every op to its PyTorch reference and
no kernel is ever launched.
"""

from __future__ import annotations

import types

try:
    import triton
    import triton.language as tl

    TRITON_AVAILABLE = True
except ImportError:
    TRITON_AVAILABLE = False

    def _unchanged_decorator(fn=None, **_options):
        """``@jit`` and ``@jit(...)``: the plain Python function."""
        return fn if fn is not None else (lambda f: f)

    def _decorator_factory(*_args, **_options):
        """``@autotune(...)``, ``@heuristics(...)``: the plain Python function."""
        return lambda fn: fn

    class _Config:
        """What ``triton.Config`` holds that fuselm reads: the meta-parameters and launch options."""

        def __init__(self, kwargs: dict, num_warps: int = 4, num_stages: int = 3, **options):
            self.kwargs, self.num_warps, self.num_stages, self.options = kwargs, num_warps, num_stages, options

    triton = types.SimpleNamespace(jit=_unchanged_decorator, autotune=_decorator_factory,
                                   heuristics=_decorator_factory, Config=_Config)
    tl = types.SimpleNamespace(constexpr=lambda value: value)

try:  # grid dependency control (programmatic dependent launch, sm_90+): triton 3.3 and later
    from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait
except ImportError:
    gdc_launch_dependents = gdc_wait = None

__all__ = ["TRITON_AVAILABLE", "gdc_launch_dependents", "gdc_wait", "tl", "triton"]
