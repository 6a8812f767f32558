"""The generation path: fuselm's preallocated, graph-safe KV cache (usable as an HF ``Cache``) and
:func:`generate`, HF's ``generate`` with each decode step one CUDA-graph replay."""

from fuselm.generation.api import generate
from fuselm.generation.cache import FusedKVCache, FusedKVLayer

__all__ = ["FusedKVCache", "FusedKVLayer", "generate"]
