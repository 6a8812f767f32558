"""The generation path: fuselm's KV cache (and, later, the CUDA-graph decode loop over the fused kernels)."""

from fuselm.generate.cache import FusedKVCache, FusedKVLayer

__all__ = ["FusedKVCache", "FusedKVLayer"]
