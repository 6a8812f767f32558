"""fuselm: fused Triton kernels for Hugging Face decoder LLMs, with PyTorch fallbacks.

Ops pick Triton or the PyTorch reference per call (see :mod:`fuselm.backend`). Model patching (``fuselm.patch``)
and ``fuselm.generate`` need transformers (``pip install fuselm[hf]``) and are imported on first use.
"""

from importlib import metadata as _metadata

from fuselm.backend import get_backend, set_backend, use_backend
from fuselm.ops.attention import decode_attention
from fuselm.ops.cross_entropy import cross_entropy, linear_cross_entropy
from fuselm.ops.decode_linear import linear_residual, norm_gated_linear, qkv_rope
from fuselm.ops.glu import gelu_tanh_mul, silu_mul
from fuselm.ops.lora import lora_add, lora_add_shared, lora_linear, lora_linear_shared
from fuselm.ops.rms_norm import add_rms_norm, rms_norm
from fuselm.ops.rope import rope

try:  # the version lives in pyproject.toml; this reads it from the installed package's metadata
    __version__ = _metadata.version("fuselm")
except _metadata.PackageNotFoundError:  # imported from a source tree that was never installed
    __version__ = "0+unknown"

_PATCHING = ("patch", "unpatch", "patched", "PatchReport")
_GENERATION = ("generate",)

_BACKEND = ("get_backend", "set_backend", "use_backend")

__all__ = ["rms_norm", "add_rms_norm", "rope", "silu_mul", "gelu_tanh_mul", "cross_entropy", "linear_cross_entropy",
           "decode_attention", "linear_residual", "norm_gated_linear", "qkv_rope", "lora_add", "lora_add_shared",
           "lora_linear", "lora_linear_shared",
           "get_backend", "set_backend", "use_backend", *_PATCHING, *_GENERATION]
_OPS = tuple(name for name in __all__ if name not in (*_BACKEND, *_PATCHING, *_GENERATION))  # the fuselm:: ops


def __getattr__(name: str):
    if name in _PATCHING:
        from fuselm import patching

        return getattr(patching, name)
    if name in _GENERATION:
        from fuselm import generation

        return getattr(generation, name)
    raise AttributeError(f"module 'fuselm' has no attribute {name!r}")
