"""The ``fuselm`` command (also ``python -m fuselm``)."""

from __future__ import annotations

import argparse
import importlib.util
import os
import subprocess
import sys
from pathlib import Path

import torch
from rich.console import Console
from rich.progress import Progress, SpinnerColumn, TextColumn, TimeElapsedColumn

import fuselm
from fuselm.backend import runs_triton


def _at_least(minimum: int):
    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected an integer, got {text!r}") from None
        if value < minimum:
            raise argparse.ArgumentTypeError(f"must be at least {minimum}, got {value}")
        return value

    return parse


def _device_of(command: str):
    def parse(text: str) -> torch.device:
        return _device(text, command)

    return parse


def _device(text: str, command: str = "demo") -> torch.device:
    try:
        device = torch.device(text)
    except RuntimeError:
        raise argparse.ArgumentTypeError(f"unknown device {text!r}: use cpu or cuda") from None
    if device.type not in ("cpu", "cuda"):
        raise argparse.ArgumentTypeError(f"the {command} runs on cpu or cuda, got {text!r}")
    if device.type == "cuda" and not torch.cuda.is_available():
        raise argparse.ArgumentTypeError(f"{text!r}: CUDA is not available here (torch {torch.__version__}); "
                                         "use --device cpu")
    if device.type == "cuda" and (device.index or 0) >= torch.cuda.device_count():
        raise argparse.ArgumentTypeError(f"{text!r}: this machine has {torch.cuda.device_count()} CUDA device(s)")
    return device


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="fuselm", description="Fused Triton kernels for Hugging Face decoder LLMs, "
                                     "with PyTorch fallbacks.")
    parser.add_argument("--version", action="version", version=f"fuselm {fuselm.__version__}")
    commands = parser.add_subparsers(dest="command", required=True, metavar="command")
    demo = commands.add_parser(
        "demo", help="run a small random-weight Llama with and without fuselm",
        description="Run a small Llama-shaped model with random weights (nothing is downloaded), unpatched and "
                    "patched with fuselm: check that logits and greedy tokens match, and time both in turns. "
                    "Needs transformers (pip install 'fuselm[hf]').")
    demo.set_defaults(command_parser=demo)
    demo.add_argument("--device", type=_device_of("demo"),
                      help="cpu or cuda[:N] (default: cuda when available, else cpu)")
    demo.add_argument("--layers", type=_at_least(1), default=4, help="decoder layers (default: %(default)s)")
    demo.add_argument("--batch", type=_at_least(1), default=2, help="sequences per batch (default: %(default)s)")
    demo.add_argument("--seq", type=_at_least(1),
                      help="tokens per sequence (default: 256 on CUDA; on CPU 64, which is also the most there)")
    demo.add_argument("--new-tokens", type=_at_least(1), default=16,
                      help="tokens each generation adds (default: %(default)s)")
    demo.add_argument("--runs", type=_at_least(1), default=5,
                      help="timed runs of each model, after one warm-up; the median is shown (default: %(default)s)")
    _add_profile(commands)
    _add_bench(commands)
    return parser


def _add_profile(commands) -> None:
    from fuselm.profiling import MODELS, PHASES

    profile = commands.add_parser(
        "profile", help="kernels launched per decoder layer, GPU time by op kind and the bound, unpatched and patched",
        description="Profile a model unpatched and patched with fuselm under torch.profiler: per phase, the kernels "
                    "each decoder layer launches, GPU time by op kind, bytes or FLOPs against the measured bound "
                    "(with the formula) and the share of the step the GPU idles between kernels. Without CUDA it "
                    "counts the ops only. Needs transformers (pip install 'fuselm[hf]').")
    profile.set_defaults(command_parser=profile)
    profile.add_argument("model", help=f"a local Hugging Face model directory (its config.json; its weights where "
                         f"present, else random ones) or one of: {', '.join(MODELS)} (random weights)")
    profile.add_argument("--phase", choices=PHASES, action="append",
                         help="prefill, decode or train; repeat for several (default: all three)")
    profile.add_argument("--batch", type=_at_least(1), default=1, help="sequences per batch (default: %(default)s)")
    profile.add_argument("--prompt", type=_at_least(1),
                         help="tokens per sequence: prefill and train length, decode's context before its first "
                              "step (default: 512 on CUDA, 32 on CPU)")
    profile.add_argument("--layers", type=_at_least(2),
                         help="decoder layers to build; per-layer figures compare them with half as many "
                              "(default: all of the model's)")
    profile.add_argument("--steps", type=_at_least(1), default=4,
                         help="profiled steps per run, after 2 warm-up steps; figures are per step "
                              "(default: %(default)s)")
    profile.add_argument("--device", type=_device_of("profile"),
                         help="cpu or cuda[:N] (default: cuda when available, else cpu)")
    profile.add_argument("--json", type=Path, metavar="PATH", help="also write the results to PATH (default: none)")
    profile.add_argument("--trace", type=Path, metavar="PATH",
                         help="Chrome traces, one per phase and model: PATH's stem + -<phase>-<impl>.json "
                              "(default: none)")


BENCHES = {  # command: (script in benchmarks/, what it measures)
    "kernels": ("kernel_bench.py", "each fused kernel against HF eager, torch.compile and Liger-Kernel"),
    "generate": ("e2e.py", "generation (fuselm.generate, a patched model's generate, HF eager, static+compile, "
                           "Liger) and the LoRA / QLoRA training steps (--no-train: generation only)"),
    "train": ("train_bench.py", "a LoRA training step and prefill, unpatched, patched and Liger"),
    "decode": ("decode_bench.py", "a decoder layer's decode step, decode attention and the decode projections"),
    "stream": ("stream_bench.py", "a decode projection's weight stream alone at M = 1 and 32: tiles, split-K, pointer "
                               "loads and TMA"),
}


def benchmarks_dir() -> Path:
    """benchmarks/ of the source tree fuselm was imported from (absent where fuselm came from a wheel)."""
    return Path(fuselm.__file__).resolve().parent.parent / "benchmarks"


def _add_bench(commands) -> None:
    bench = commands.add_parser(
        "bench", help="run a GPU benchmark of the source tree, results to benchmarks/results/",
        description="Run one of the benchmark scripts of fuselm's source tree (benchmarks/, not part of an installed "
                    "wheel) with the arguments that follow, from the repository root, so that its results go to the "
                    "committed benchmarks/results/*.json; `python benchmarks/report.py` renders them into "
                    "BENCHMARKS.md. "
                    + "; ".join(f"{name}: benchmarks/{script}, {what}" for name, (script, what) in BENCHES.items())
                    + ". `fuselm bench NAME --help` shows the script's own options.")
    bench.set_defaults(command_parser=bench)
    bench.add_argument("benchmark", choices=BENCHES, help="which benchmark")
    bench.add_argument("arguments", nargs=argparse.REMAINDER, help="passed to the script unchanged")


def _bench(parser: argparse.ArgumentParser, args: argparse.Namespace) -> int:
    script = benchmarks_dir() / BENCHES[args.benchmark][0]
    if not script.is_file():
        parser.error(f"{script} is not here: the benchmarks live in fuselm's source tree (a git checkout), not in "
                     "the installed package")
    return run_script(script, args.arguments)


def run_script(script: Path, arguments: list[str]) -> int:
    """``python script *arguments`` from the repository root (the scripts' default result paths are relative to
    it), this fuselm first on the path; its output streams above a spinner with the elapsed time. Returns its exit
    status."""
    root = script.parent.parent
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, (str(root), os.environ.get("PYTHONPATH")))),
           "PYTHONUNBUFFERED": "1"}
    console = Console()
    command = [sys.executable, str(script), *arguments]
    with Progress(SpinnerColumn(), TextColumn("{task.description}"), TimeElapsedColumn(), console=console,
                  transient=True) as progress:
        progress.add_task(f"{script.relative_to(root)} {' '.join(arguments)}".strip(), total=None)
        with subprocess.Popen(command, cwd=root, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                              text=True, bufsize=1) as child:
            try:
                for line in child.stdout:
                    console.print(line.rstrip("\n"), markup=False, highlight=False, soft_wrap=True)
            except KeyboardInterrupt:
                child.terminate()
                raise
    return child.returncode


def _profile(parser: argparse.ArgumentParser, args: argparse.Namespace, device: torch.device) -> int:
    from fuselm import profiling

    try:
        profiling.run(args.model, device=device, phases=tuple(dict.fromkeys(args.phase or profiling.PHASES)),
                      batch=args.batch, prompt=args.prompt, layers=args.layers, steps=args.steps,
                      json_path=args.json, trace=args.trace)
    except profiling.ArgumentError as error:
        parser.error(str(error))
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = _parser()
    args = parser.parse_args(argv)
    command = args.command_parser
    if args.command == "bench":
        return _bench(command, args)
    if importlib.util.find_spec("transformers") is None:
        parser.error(f"the {args.command} needs transformers: pip install 'fuselm[hf]'")
    device = args.device or torch.device("cuda" if torch.cuda.is_available() else "cpu")
    try:  # FUSELM_BACKEND=triton without triton, or on CPU without TRITON_INTERPRET=1
        runs_triton(torch.empty(0, device=device))
    except (ValueError, ImportError) as error:
        parser.error(str(error))
    try:
        if args.command == "profile":
            return _profile(command, args, device)
        from fuselm import demo

        ok = demo.run(device, args.layers, args.batch, args.seq, args.new_tokens, args.runs)
    except KeyboardInterrupt:
        return 130
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
