"""A decode step's rotary embedding as one gather from tables of every cache position.

HF's rotary modules compute cos/sin from the position ids on every forward: about eight small kernels a decode
step (the float cast, the frequency product, the concatenation, cos, sin, the scaling, the casts back). A bucket's
:class:`RotaryTables` computes them once, with the model's own modules over positions ``0 .. length - 1``, and the
step then gathers each row's positions: one kernel. Each value a rotary module returns depends on its position
alone for every static rope type, so a gathered row is what the module returns for that position. HF updates the
frequencies during the forward for the dynamic and longrope types (``dynamic_rope_update``): those modules, and
any module a hook watches, keep running as they are.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

import torch
from torch import Tensor, nn

from fuselm.patching.modules import hooked


def _static_rotary(module: nn.Module) -> bool:
    """Whether ``module`` is an HF rotary embedding whose output depends on the positions alone."""
    rope_type = getattr(module, "rope_type", None)
    if not type(module).__name__.endswith("RotaryEmbedding") or rope_type is None:
        return False
    types = rope_type.values() if isinstance(rope_type, dict) else (rope_type,)
    return all(isinstance(kind, str) and "dynamic" not in kind and kind != "longrope" for kind in types)


class RotaryTables:
    """cos/sin tables of positions ``0 .. length - 1`` for the static rotary modules of one model.

    A table is made on the first step that asks for it (an eager warm-up step, before any capture), per
    (module, dtype, device, extra arguments such as Gemma 3's ``layer_type``): [2, length, rotary dim].
    """

    def __init__(self, model: nn.Module, length: int):
        self._modules = [module for module in model.modules() if _static_rotary(module)]
        self._length = length
        self._tables: dict[tuple, Tensor] = {}

    def clear(self) -> None:
        self._tables.clear()

    @contextmanager
    def gathering(self) -> Iterator[None]:
        """Within: each static rotary module returns rows of its tables instead of computing them."""
        gathered = [module for module in self._modules if not hooked(module)]  # hooks as they are at this step
        for module in gathered:
            module.forward = self._gather_for(module)
        try:
            yield
        finally:
            for module in gathered:
                del module.forward

    def _gather_for(self, module: nn.Module):
        compute = type(module).forward.__get__(module)

        def gather(x: Tensor, position_ids: Tensor, *args, **kwargs) -> tuple[Tensor, Tensor]:
            """(cos, sin), each [B, T, rotary dim] in x's dtype, for position_ids [B, T] (other shapes, such as
            multimodal RoPE's [3, B, T], run the module)."""
            if position_ids.dim() != 2:
                return compute(x, position_ids, *args, **kwargs)
            key = (id(module), x.dtype, x.device, args, tuple(sorted(kwargs.items())))
            table = self._tables.get(key)
            if table is None:
                positions = torch.arange(self._length, device=position_ids.device)[None]
                cos, sin = compute(x, positions, *args, **kwargs)
                table = self._tables[key] = torch.stack((cos[0], sin[0]))
            rows = table.index_select(1, position_ids.reshape(-1)).view(2, *position_ids.shape, -1)
            return rows[0], rows[1]

        return gather
