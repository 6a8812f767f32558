"""The ``fuselm`` command."""

from __future__ import annotations

import argparse
import sys


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="fuselm", description="Fused Triton kernels for HF decoder LLMs")
    commands = parser.add_subparsers(dest="command", required=True)
    demo = commands.add_parser("demo", help="run a small random-weight Llama with and without fuselm")
    demo.add_argument("--device", help="cuda or cpu (default: cuda when available)")
    demo.add_argument("--layers", type=int, default=4)
    demo.add_argument("--batch", type=int, default=2)
    demo.add_argument("--seq", type=int, default=256, help="tokens per sequence (at most 64 on CPU)")
    demo.add_argument("--new-tokens", type=int, default=16)
    args = parser.parse_args(argv)

    from fuselm import demo as demo_module

    ok = demo_module.run(args.device, args.layers, args.batch, args.seq, args.new_tokens)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
