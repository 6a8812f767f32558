"""RotaryTables: a gathered row equals what the model's own rotary module returns for that position."""

from __future__ import annotations

import pytest
import torch

from fuselm.generation.rotary import RotaryTables
from tests.models import FUSED_LAYERS, tiny_model

LENGTH = 48


def _rotary_modules(model):
    return [m for m in model.modules() if type(m).__name__.endswith("RotaryEmbedding")]


def _calls(model):
    """(module, extra args) of every rotary call the family's forward makes (Gemma 3: one per layer type)."""
    calls = []
    for module in _rotary_modules(model):
        rope_type = module.rope_type
        extra = [(kind,) for kind in rope_type] if isinstance(rope_type, dict) else [()]
        calls += [(module, args) for args in extra]
    return calls


@pytest.mark.parametrize("name", FUSED_LAYERS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_gathered_rows_equal_the_module(name, dtype):
    model = tiny_model(name, dtype=dtype)
    tables = RotaryTables(model, LENGTH)
    positions = torch.tensor([[0], [LENGTH - 2], [17]], device=model.device)  # [B, 1], a decode step's shape
    x = torch.randn(3, 1, 8, dtype=dtype, device=model.device)
    calls = _calls(model)
    assert calls, "every fused family has a rotary module"
    expected = [module(x, positions, *args) for module, args in calls]
    with tables.gathering():
        got = [module(x, positions, *args) for module, args in calls]
        again = [module(x, positions + 1, *args) for module, args in calls]  # the tables are reused, up to LENGTH - 1
    for (cos, sin), (ref_cos, ref_sin) in zip(got, expected, strict=True):
        assert cos.shape == ref_cos.shape and cos.dtype == ref_cos.dtype
        assert torch.equal(cos, ref_cos) and torch.equal(sin, ref_sin)
    for (cos, _), (module, args) in zip(again, calls, strict=True):
        assert torch.equal(cos, module(x, positions + 1, *args)[0])
    assert len(tables._tables) == len(calls)
    assert all("forward" not in module.__dict__ for module in _rotary_modules(model)), "the modules are restored"


def test_dynamic_and_hooked_modules_run_as_they_are():
    dynamic = tiny_model("llama", rope_scaling={"rope_type": "dynamic", "factor": 2.0})
    hooked = tiny_model("llama")
    _rotary_modules(hooked)[0].register_forward_hook(lambda *args: None)
    for model in (dynamic, hooked):
        tables = RotaryTables(model, LENGTH)
        module = _rotary_modules(model)[0]
        with tables.gathering():
            assert "forward" not in module.__dict__
            module(torch.randn(1, 1, 8), torch.tensor([[3]]))
        assert not tables._tables


def test_tables_follow_the_positions_of_several_tokens():
    model = tiny_model("phi3")  # partial rotary
    module = _rotary_modules(model)[0]
    positions = torch.tensor([[5, 6, 7], [0, 1, 2]], device=model.device)
    x = torch.randn(2, 3, 8, device=model.device)
    expected = module(x, positions)
    with RotaryTables(model, LENGTH).gathering():
        got = module(x, positions)
    assert all(torch.equal(a, b) for a, b in zip(got, expected, strict=True))


def test_positions_of_another_shape_run_the_module():
    model = tiny_model("llama")
    module = _rotary_modules(model)[0]
    positions = torch.tensor([[[3]], [[4]]], device=model.device)  # [2, 1, 1]: not a decode step's [B, T]
    x = torch.randn(1, 1, 8, device=model.device)
    expected = module(x, positions)
    tables = RotaryTables(model, LENGTH)
    with tables.gathering():
        got = module(x, positions)
    assert all(torch.equal(a, b) for a, b in zip(got, expected, strict=True)) and not tables._tables
