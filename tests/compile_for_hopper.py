"""Compiles recorded Triton kernel launches for Hopper (sm_90) without a GPU.

    python -m tests.compile_for_hopper < launches.json

Reads a JSON list of launches, each ``{"module", "kernel", "signature", "constexprs", "num_warps"}``
(signature: argument name to a Triton type such as ``"*bf16"`` or ``"i32"``; constexprs: name to
value), and compiles each with ``triton.compile`` for ``GPUTarget("cuda", 90, 32)``: the frontend,
the TTGIR passes, PTX and ptxas, everything a GPU launch would run before the kernel starts. Run it
without TRITON_INTERPRET, so that ``triton.jit`` builds compilable kernels. Prints one line per
launch that fails and exits 1 if any did.
"""

from __future__ import annotations

import importlib
import json
import sys

import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource
from triton.runtime.jit import JITFunction

HOPPER = GPUTarget("cuda", 90, 32)


def jit_function(module: str, name: str) -> JITFunction:
    """The module's kernel ``name``, unwrapped from any autotuner or heuristics around it."""
    kernel = getattr(importlib.import_module(module), name)
    while not isinstance(kernel, JITFunction):
        kernel = kernel.fn
    return kernel


def compile_launch(launch: dict) -> None:
    kernel = jit_function(launch["module"], launch["kernel"])
    constexprs = {(kernel.arg_names.index(name),): value for name, value in launch["constexprs"].items()}
    signature = {**launch["signature"], **{name: "constexpr" for name in launch["constexprs"]}}
    source = ASTSource(fn=kernel, signature=signature, constexprs=constexprs)
    triton.compile(source, target=HOPPER, options={"num_warps": launch["num_warps"]})


def main() -> int:
    failures = 0
    for launch in json.load(sys.stdin):
        try:
            compile_launch(launch)
        except Exception as exc:  # report every failing launch, not only the first
            failures += 1
            print(f"{launch['module']}.{launch['kernel']} {launch['constexprs']} num_warps={launch['num_warps']}: "
                  f"{type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}")
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
