"""The ``fuselm`` command (also ``python -m fuselm``)."""

from __future__ import annotations

import argparse
import importlib.util
import sys

import torch

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


def _device(text: str) -> torch.device:
    try:
        device = torch.device(text)
    except RuntimeError:
        raise argparse.ArgumentTypeError(f"unknown device {text!r}: use cpu or cuda") from None
    if device.type not in ("cpu", "cuda"):
        raise argparse.ArgumentTypeError(f"the demo runs on cpu or cuda, got {text!r}")
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
    demo.add_argument("--device", type=_device, help="cpu or cuda[:N] (default: cuda when available, else cpu)")
    demo.add_argument("--layers", type=_at_least(1), default=4, help="decoder layers (default: %(default)s)")
    demo.add_argument("--batch", type=_at_least(1), default=2, help="sequences per batch (default: %(default)s)")
    demo.add_argument("--seq", type=_at_least(1),
                      help="tokens per sequence (default: 256 on CUDA; on CPU 64, which is also the most there)")
    demo.add_argument("--new-tokens", type=_at_least(1), default=16,
                      help="tokens each generation adds (default: %(default)s)")
    demo.add_argument("--runs", type=_at_least(1), default=5,
                      help="timed runs of each model, after one warm-up; the median is shown (default: %(default)s)")
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = _parser()
    args = parser.parse_args(argv)
    if importlib.util.find_spec("transformers") is None:
        parser.error("the demo needs transformers: pip install 'fuselm[hf]'")
    device = args.device or torch.device("cuda" if torch.cuda.is_available() else "cpu")
    try:  # FUSELM_BACKEND=triton without triton, or on CPU without TRITON_INTERPRET=1
        runs_triton(torch.empty(0, device=device))
    except (ValueError, ImportError) as error:
        parser.error(str(error))

    from fuselm import demo

    try:
        ok = demo.run(device, args.layers, args.batch, args.seq, args.new_tokens, args.runs)
    except KeyboardInterrupt:
        return 130
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
