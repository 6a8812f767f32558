"""What each config of the decode step's kernels costs an SM on Hopper, without a GPU.

For every config of qkv_rope's, gate/up's, linear_residual's and decode attention's kernels, at Llama-3-8B's decode
shapes (bf16, M = B rows of one token; attention over a 1024-position cache), the script records the launch fuselm's op
makes (under Triton's interpreter, the kernel not run: its arguments, constexprs, warps and stages) and compiles it for
sm_90a as a GPU launch would be compiled: ints equal to 1 as constants, 16-divisible ints and 16-byte-aligned pointers
marked divisible (without those marks the loads are neither vectorised nor pipelined and the figures say nothing). From
ptxas's output it reports per program: registers per thread, stack bytes (spills), shared memory, the tensor-core
instruction (wgmma is Hopper's asynchronous warp-group MMA; mma is mma.sync), the cp.async copies of the software
pipeline, the stores to shared memory and the barriers in the PTX (a tile that passes through registers to reach the
mma's operand layout adds a store and a barrier to the loop), and how many programs fit one SM by registers and by
shared memory (Hopper: 64 K registers and 227 KB of shared memory per SM, at most 2048 threads). Static figures, for
choosing what to time: they predict occupancy and spills, not speed. Environment settings that change the kernels
(FUSELM_CONSTANT_OFFSET=1) apply to the recording and go into the JSON.

    python benchmarks/kernel_resources.py [--rows 1 32] [--projections o down] [--out kernel-resources.json]
"""

from __future__ import annotations

import argparse
import contextlib
import datetime
import importlib
import json
import os
import re
import subprocess
import sys
import tempfile
from pathlib import Path

REGISTERS_PER_SM, SHARED_PER_SM, THREADS_PER_SM = 65536, 232448, 2048
PROJECTIONS = ("qkv_rope", "gate_up", "o", "down", "attention")
TRITON_TYPES = {"torch.bfloat16": "bf16", "torch.float16": "fp16", "torch.float32": "fp32", "torch.int64": "i64",
                "torch.int32": "i32"}


# ----------------------------------------------------------------------------------- recording (interpreter)
def record_launches(rows: list[int], names: list[str]) -> list[dict]:
    """Every config's launch of each decode projection kernel named in ``names`` at each M in ``rows`` (run in a
    process with TRITON_INTERPRET=1: the interpreter records; nothing runs)."""
    import torch
    import triton.runtime.interpreter as interpreter

    from fuselm.ops import attention, decode_linear
    from fuselm.ops._common import forced_config

    launches: list[dict] = []
    case: dict = {}

    def record(function, *args, grid, warmup, **kwargs):
        import inspect

        params = inspect.signature(function.fn).parameters
        values = dict(zip(function.arg_names, args)) | {k: v for k, v in kwargs.items() if k in params}
        arguments, constexprs = {}, {}
        for name, value in values.items():
            if "constexpr" in str(params[name].annotation):
                constexprs[name] = value
            elif isinstance(value, torch.Tensor):
                arguments[name] = {"type": "*" + TRITON_TYPES[str(value.dtype)], "aligned": value.data_ptr() % 16 == 0}
            elif isinstance(value, bool):
                arguments[name] = {"type": "i1", "value": value}
            elif isinstance(value, int):
                arguments[name] = {"type": "i32" if -2**31 <= value < 2**31 else "i64", "value": value}
            else:
                arguments[name] = {"type": "fp32"}
        # the interpreter is not handed warps and stages: they are the forced config's
        launches.append({**case, "module": function.fn.__module__, "kernel": function.fn.__name__,
                         "arguments": arguments, "constexprs": constexprs, "num_warps": case["config"]["num_warps"],
                         "num_stages": case["config"]["num_stages"]})

    interpreter.InterpretedFunction.run = record
    kernels = {"qkv_rope": decode_linear._qkv_rope_split, "gate_up": decode_linear._norm_gated_kernel,
               "o": decode_linear._linear_residual_kernel, "down": decode_linear._linear_residual_kernel,
               "attention": attention._decode_attention}
    for m in rows:
        for name in (name for name in PROJECTIONS if name in names):
            kernel, call = kernels[name], _launching_call(name, m)  # the inputs of the named kernels only
            for index, config in enumerate(kernel.configs):
                case = {"projection": name, "m": m, "config": {**config.kwargs, "num_warps": config.num_warps,
                                                                "num_stages": config.num_stages}}
                recorded = len(launches)
                with forced_config(kernel, index), torch.no_grad():
                    call()
                if len(launches) != recorded + 1:
                    raise RuntimeError(f"{name} at M = {m}: {len(launches) - recorded} launches for one call")
    return launches


def _launching_call(name: str, m: int):
    """A call of fuselm's op that launches kernel ``name`` at M = m, on inputs made now."""
    from decode_linear_bench import LLAMA3_8B, gate_up_projection, qkv_projection, residual_projection

    if name == "attention":
        return _attention_call(m)
    projection, impl = {
        "qkv_rope": lambda: (qkv_projection(LLAMA3_8B, m, as_generate=True), "fused, norm in prologue"),
        "gate_up": lambda: (gate_up_projection(LLAMA3_8B, m), "fused, norm in prologue"),
        "o": lambda: (residual_projection("o", LLAMA3_8B.heads * LLAMA3_8B.head_dim, LLAMA3_8B.hidden, m),
                      "fused streaming kernel"),
        "down": lambda: (residual_projection("down", LLAMA3_8B.intermediate, LLAMA3_8B.hidden, m),
                         "fused streaming kernel"),
    }[name]()
    return _call(projection, impl)


def _call(projection, impl: str):
    inputs = projection.make_set()
    return lambda: projection.impls[impl](inputs)


def _attention_call(batch: int):
    """fuselm's decode attention op over Llama-3-8B's heads: ``batch`` rows of one query, a 1024-position cache."""
    import torch
    from decode_linear_bench import LLAMA3_8B, randn

    from fuselm.ops import attention

    q = randn(batch, LLAMA3_8B.heads, 1, LLAMA3_8B.head_dim)
    k, v = (randn(batch, LLAMA3_8B.kv_heads, 1024, LLAMA3_8B.head_dim) for _ in range(2))
    starts, ends = torch.zeros(batch, dtype=torch.int32), torch.full((batch,), 640, dtype=torch.int32)
    return lambda: attention.DECODE_ATTENTION(q, k, v, starts, ends, LLAMA3_8B.head_dim**-0.5, 0.0, 0)


# ----------------------------------------------------------------------------------- compiling (no interpreter)
def resources(launch: dict) -> dict:
    """Compiles one recorded launch for sm_90a and reads what it costs a program."""
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource
    from triton.runtime.jit import JITFunction

    kernel = getattr(importlib.import_module(launch["module"]), launch["kernel"])
    while not isinstance(kernel, JITFunction):
        kernel = kernel.fn
    signature, constants, attrs = {}, dict(launch["constexprs"]), {}
    for name in kernel.arg_names:
        argument = launch["arguments"].get(name)
        if argument is None:
            signature[name] = "constexpr"
        elif argument.get("value") == 1 and argument["type"] != "i1":
            signature[name], constants[name] = "constexpr", 1  # as a launch specialises an int equal to 1
        else:
            signature[name] = argument["type"]
            divisible = argument.get("aligned") or (argument["type"] in ("i32", "i64") and argument["value"] % 16 == 0)
            if divisible:
                attrs[(kernel.arg_names.index(name),)] = [["tt.divisibility", 16]]
    source = ASTSource(kernel, signature, constexprs={(kernel.arg_names.index(k),): v for k, v in constants.items()},
                       attrs=attrs)
    compiled = triton.compile(source, target=GPUTarget("cuda", 90, 32),
                              options={"num_warps": launch["num_warps"], "num_stages": launch["num_stages"]})
    with tempfile.NamedTemporaryFile(suffix=".cubin") as cubin:
        cubin.write(compiled.asm["cubin"])
        cubin.flush()
        tool = Path(triton.__file__).parent / "backends" / "nvidia" / "bin" / "cuobjdump"
        usage = subprocess.run([str(tool), "--dump-resource-usage", cubin.name], capture_output=True, text=True,
                               check=True).stdout
    registers, stack = (int(re.search(rf"{field}:(\d+)", usage).group(1)) for field in ("REG", "STACK"))
    ptx, threads = compiled.asm["ptx"], 32 * launch["num_warps"]
    shared = compiled.metadata.shared
    return {"registers": registers, "stack_bytes": stack, "shared_bytes": shared,
            "mma": "wgmma" if "wgmma.mma_async" in ptx else "mma" if "mma.sync" in ptx else "none",
            "cp_async": len(re.findall(r"cp\.async\.c[ag]", ptx)),
            "shared_stores": len(re.findall(r"\bst\.shared", ptx)), "barriers": len(re.findall(r"\bbar\.sync", ptx)),
            "programs_per_sm_by_registers": min(REGISTERS_PER_SM // (max(registers, 1) * threads),
                                                THREADS_PER_SM // threads),
            "programs_per_sm_by_shared": SHARED_PER_SM // shared if shared else THREADS_PER_SM // threads}


def compile_all(launches: list[dict]) -> list[dict]:
    rows = []
    for launch in launches:
        row = {key: launch[key] for key in ("projection", "m", "config")}
        try:
            row.update(resources(launch))
        except Exception as exc:  # a config that does not compile is a finding too
            row["error"] = f"{type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}"
        rows.append(row)
    return rows


def print_table(rows: list[dict]) -> None:
    print(f"{'projection':<9} {'M':>3}  {'config':<66} {'regs':>4} {'stack':>5} {'shared KB':>9} {'mma':>5} "
          f"{'cp.async':>8} {'st.shared':>9} {'bar.sync':>8} {'per SM':>6}")
    for row in rows:
        config = " ".join(f"{k}={v}" for k, v in row["config"].items())
        if "error" in row:
            print(f"{row['projection']:<9} {row['m']:>3}  {config:<66} {row['error']}")
            continue
        per_sm = min(row["programs_per_sm_by_registers"], row["programs_per_sm_by_shared"])
        print(f"{row['projection']:<9} {row['m']:>3}  {config:<66} {row['registers']:>4} {row['stack_bytes']:>5} "
              f"{row['shared_bytes'] / 1024:>9.1f} {row['mma']:>5} {row['cp_async']:>8} {row['shared_stores']:>9} "
              f"{row['barriers']:>8} {per_sm:>6}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rows", type=int, nargs="+", default=[1, 32], help="M = B decode rows")
    parser.add_argument("--projections", nargs="+", choices=PROJECTIONS, default=list(PROJECTIONS))
    parser.add_argument("--out", help="JSON of the rows")
    parser.add_argument("--record", action="store_true", help=argparse.SUPPRESS)  # the interpreter's half
    args = parser.parse_args()
    if args.record:
        json.dump(record_launches(args.rows, args.projections), sys.stdout)
        return
    here = Path(__file__).resolve().parent
    env = {**os.environ, "TRITON_INTERPRET": "1",
           "PYTHONPATH": os.pathsep.join(filter(None, [str(here), str(here.parent), os.environ.get("PYTHONPATH")]))}
    recorded = subprocess.run([sys.executable, __file__, "--record", "--rows", *map(str, args.rows),
                               "--projections", *args.projections], env=env, capture_output=True, text=True)
    if recorded.returncode:
        sys.exit(f"recording the launches failed:\n{recorded.stderr[-3000:]}")
    os.environ.pop("TRITON_INTERPRET", None)
    with contextlib.redirect_stderr(open(os.devnull, "w")):  # triton's warnings per compile
        rows = compile_all(json.loads(recorded.stdout))
    print_table(rows)
    if args.out:
        import triton

        Path(args.out).write_text(json.dumps({
            "target": "sm_90a", "triton": triton.__version__,
            "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
            "settings": {name: os.environ.get(name, "0") for name in ("FUSELM_CONSTANT_OFFSET",)},
            "method": __doc__, "rows": rows}, indent=1))


if __name__ == "__main__":
    main()
