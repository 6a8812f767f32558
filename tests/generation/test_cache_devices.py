"""FusedKVCache on a model whose layers sit on several devices: each layer's buffers and lengths on its layer's
device. On CPU the second device is ``meta`` (placement only, no values); the values across two GPUs are
checked by tests/patching/test_device_map.py."""

import pytest
import torch

from fuselm.generation import FusedKVCache
from fuselm.generation.cache import layer_devices
from tests.models import tiny_model


def _split_model():
    """A tiny Llama of 3 layers with its last layer on the meta device."""
    model = tiny_model("llama", num_hidden_layers=3)
    model.model.layers[2].to("meta")
    return model


def test_layer_devices_read_each_layers_parameters():
    model = _split_model()
    assert layer_devices(model, 3) == [torch.device("cpu")] * 2 + [torch.device("meta")]
    assert layer_devices(model, 2) == [model.device] * 2  # not the decoder's layer count: the model's device


def test_each_layers_buffers_and_lengths_live_on_its_layers_device():
    cache = FusedKVCache(_split_model(), 2, 8)
    devices = [torch.device("cpu")] * 2 + [torch.device("meta")]
    assert [cache.buffers(i)[0].device for i in range(3)] == devices
    assert [cache.buffers(i)[1].device for i in range(3)] == devices
    assert [cache.lengths(i)[1].device for i in range(3)] == devices
    assert cache.lengths(0)[0] is cache.lengths(1)[0]  # one device: one set of lengths
    cache.plan(torch.tensor([[0, 1, 1], [1, 1, 1]]))
    cache.advance(3)
    assert cache.lengths(0)[0].tolist() == [1, 0] and cache.lengths(0)[1].tolist() == [3, 3]
    assert cache.slots(0).tolist() == [[0, 1, 2]] * 2
    assert cache.slots(2).device == torch.device("meta") and cache.slots(2).shape == (2, 3)
    keys, values = (torch.randn(2, 2, 3, 24, device="meta") for _ in range(2))
    assert cache.update(keys, values, 2)[0].device == torch.device("meta")  # HF's write path on the meta layer


def test_devices_given_per_layer_or_one_for_all():
    model = tiny_model("llama", num_hidden_layers=2)
    cache = FusedKVCache(model, 1, 4, device=["cpu", "meta"])
    assert [cache.buffers(i)[0].device.type for i in range(2)] == ["cpu", "meta"]
    one_device = FusedKVCache(model, 1, 4, device="meta")
    assert {one_device.buffers(i)[0].device.type for i in range(2)} == {"meta"}
    assert one_device.lengths(1)[0].device.type == "meta"
    with pytest.raises(ValueError, match="device: 3 devices given for 2 decoder layers"):
        FusedKVCache(model, 1, 4, device=["cpu"] * 3)
