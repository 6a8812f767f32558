"""row_argmax against torch.argmax: first maximum, NaN wins, every split count, odd sizes and strides."""

import pytest
import torch

from fuselm.ops import argmax as argmax_module
from fuselm.ops.argmax import row_argmax
from tests.helpers import randn

DTYPES = [torch.float32, torch.bfloat16, torch.float16]
SHAPES = [(1, 1), (3, 5), (2, 1023), (1, 1025), (4, 4097), (5, 3000)]


@pytest.fixture(params=[1, 64], ids=["few-splits", "many-splits"])
def splits_per_sm(request, monkeypatch):
    """On the CPU (one 'SM') the default gives 1-2 programs a row; 64 spreads a row over up to MAX_SPLITS."""
    monkeypatch.setattr(argmax_module, "PROGRAMS_PER_SM", request.param)
    return request.param


@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("dtype", DTYPES)
def test_matches_torch_argmax(path, device, splits_per_sm, shape, dtype):
    x = randn(*shape, dtype=dtype, device=device, scale=3.0)
    got = row_argmax(x)
    assert got.dtype == torch.long and got.shape == (shape[0],)
    assert torch.equal(got, x.argmax(dim=-1))
    assert torch.equal(row_argmax(x), got), "a second launch (tickets reset) gives the same"


def test_ties_take_the_first_index(path, device, splits_per_sm):
    x = randn(4, 4097, device=device)
    top = x.max() + 1.0
    x[0, [4000, 17, 2500]] = top  # in different chunks once the row is split
    x[1, [1024, 1023]] = top  # either side of a block edge
    x[2] = -float("inf")  # every entry equal: index 0
    x[3, [300 + 2 * argmax_module.BLOCK, 300]] = top  # one lane of one tile, two tiles apart
    assert row_argmax(x).tolist() == [17, 1023, 0, 300]


def test_nan_wins_as_in_torch(path, device, splits_per_sm):
    x = randn(4, 3000, device=device)
    x[0, 2999] = float("nan")
    x[1, [2000, 5]] = float("nan")
    x[1, 7] = float("inf")
    x[2, 1500] = float("inf")
    x[3] = float("nan")
    got = row_argmax(x)
    assert torch.equal(got, x.argmax(dim=-1))
    assert got.tolist() == [2999, 5, 1500, 0]


def test_strided_rows(path, device, splits_per_sm):
    wide = randn(3, 2 * 1500 + 7, device=device, dtype=torch.bfloat16)
    for x in (wide[:, :1500], wide[:, ::2], wide.t().contiguous().t()[:, 3:]):
        assert torch.equal(row_argmax(x), x.argmax(dim=-1))


def test_empty_batch(path, device):
    assert row_argmax(torch.empty(0, 17, device=device)).shape == (0,)


def test_bad_input(device):
    with pytest.raises(ValueError, match="x must have at least one column"):
        row_argmax(torch.empty(2, 0, device=device))
    with pytest.raises(ValueError, match="x must have rank 2"):
        row_argmax(torch.randn(2, 3, 4, device=device))
    with pytest.raises(TypeError, match="x must be a floating-point tensor"):
        row_argmax(torch.ones(2, 3, dtype=torch.long, device=device))
