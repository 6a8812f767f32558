"""The generation path: fuselm's preallocated, graph-safe KV cache, usable as an HF ``Cache``."""

from fuselm.generation.cache import FusedKVCache, FusedKVLayer

__all__ = ["FusedKVCache", "FusedKVLayer"]
