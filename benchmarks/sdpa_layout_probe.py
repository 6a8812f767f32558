"""Which SDPA backend a prefill's causal attention gets, and how fast, for three memory layouts of the same q, k, v.

The prefill could write k and v once, into the [B, Hkv, L, D] cache, and hand SDPA slices of it (benchmarks/NOTES.md,
"Why the prefill keeps HF's attention and a cache copy"), if cuDNN takes such slices. Layouts, Llama-3-8B heads,
bf16, B = 1, causal, GQA:

- ``bshd``: [B, S, H, D] memory seen as [B, H, S, D] (what HF's projections give SDPA today);
- ``cache``: q contiguous [B, Hq, S, D], k and v the first S slots of a [B, Hkv, L, D] buffer (L = S + 256);
- ``bhsd``: all contiguous [B, H, S, D].

Per layout: the default dispatch, and cuDNN and flash forced (an error row where the backend refuses the layout).
Times are medians of CUDA-graph replays (timing.py).

    python benchmarks/sdpa_layout_probe.py --out benchmarks/results/sdpa-layout-h200.json [--tokens 2048 8192]
"""

from __future__ import annotations

import argparse
import datetime
import json

import torch
import torch.nn.functional as F
from timing import captured, median_ms
from torch.nn.attention import SDPBackend, sdpa_kernel

HEADS, KV_HEADS, HEAD_DIM = 32, 8, 128
BACKENDS = {"default": None, "cudnn": SDPBackend.CUDNN_ATTENTION, "flash": SDPBackend.FLASH_ATTENTION}


def inputs(layout: str, tokens: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """q [1, Hq, S, D], k and v [1, Hkv, S, D] (bf16, CUDA) in the memory layout named."""
    def randn(*shape: int) -> torch.Tensor:
        return torch.randn(*shape, device="cuda", dtype=torch.bfloat16)

    if layout == "bshd":
        return tuple(randn(1, tokens, heads, HEAD_DIM).transpose(1, 2) for heads in (HEADS, KV_HEADS, KV_HEADS))
    if layout == "cache":
        return (randn(1, HEADS, tokens, HEAD_DIM),
                *(randn(1, KV_HEADS, tokens + 256, HEAD_DIM)[:, :, :tokens] for _ in range(2)))
    return tuple(randn(1, heads, tokens, HEAD_DIM) for heads in (HEADS, KV_HEADS, KV_HEADS))


def probe(layout: str, tokens: int, backend: str) -> dict:
    q, k, v = inputs(layout, tokens)
    row = {"layout": layout, "tokens": tokens, "backend": backend, "strides": {"q": q.stride(), "k": k.stride()}}

    def attend():
        if BACKENDS[backend] is None:
            return F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
        with sdpa_kernel(BACKENDS[backend]):
            return F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)

    try:
        attend()
        row["ms"] = round(median_ms(captured(attend)), 3)
    except RuntimeError as error:  # the forced backend refused these inputs
        row["error"] = str(error).splitlines()[0][:200]
    print(f"{layout:<6} S={tokens:<6} {backend:<8} {row.get('ms', row.get('error'))}", flush=True)
    return row


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tokens", type=int, nargs="+", default=[2048, 8192])
    parser.add_argument("--out", default="benchmarks/results/sdpa-layout-h200.json")
    args = parser.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("sdpa_layout_probe.py needs a CUDA GPU")
    rows = [probe(layout, tokens, backend) for tokens in args.tokens for layout in ("bshd", "cache", "bhsd")
            for backend in BACKENDS]
    result = {"gpu": torch.cuda.get_device_name(), "torch": torch.__version__,
              "cudnn": torch.backends.cudnn.version(),
              "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
              "formula": "ms: median CUDA-graph replay of one causal SDPA call (B = 1, Hq 32, Hkv 8, D 128, bf16)",
              "rows": [{**row, "strides": {name: list(value) for name, value in row["strides"].items()}}
                       for row in rows]}
    with open(args.out, "w") as file:
        json.dump(result, file, indent=1)


if __name__ == "__main__":
    main()
