"""Test set-up: without a GPU, Triton kernels run in Triton's interpreter on CPU tensors.

TRITON_INTERPRET must be set before triton (and so fuselm) is imported, hence at the top here.
"""

import os
import zlib

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest  # noqa: E402

import fuselm  # noqa: E402
from fuselm.ops import _common  # noqa: E402

HAS_CUDA = torch.cuda.is_available()
DEVICE = "cuda" if HAS_CUDA else "cpu"


@pytest.fixture(autouse=True)
def _seeded(request):
    """Fresh random inputs in every test, reproducible from the test's name."""
    torch.manual_seed(zlib.crc32(request.node.nodeid.encode()))


@pytest.fixture(autouse=True)
def _poisoned_outputs():
    """Every kernel output starts as NaN, so an element a kernel forgets to write fails the test."""
    _common.poison_outputs = True
    yield
    _common.poison_outputs = False


@pytest.fixture(autouse=True, scope="session")
def _quick_tuning():
    """On a GPU, autotuning times each config in ~1 ms: tests check results, not which config wins."""
    _common.quick_tuning = True
    yield
    _common.quick_tuning = False


# FUSELM_TEST_PATHS (e.g. "reference"): the paths the ``path`` fixture runs, for CI's second transformers, where the
# patching layer is under test and the kernels (which do not depend on transformers) already passed
PATHS = [p for p in ("reference", "triton") if p in os.environ.get("FUSELM_TEST_PATHS", "reference,triton").split(",")]
if not PATHS:
    raise ValueError(f"FUSELM_TEST_PATHS names neither 'reference' nor 'triton': {os.environ['FUSELM_TEST_PATHS']!r}")


@pytest.fixture(params=PATHS)
def path(request):
    """Run the test through the PyTorch reference and through Triton (interpreter on CPU)."""
    with fuselm.use_backend(request.param):
        yield request.param


@pytest.fixture
def device():
    return DEVICE


def pytest_collection_modifyitems(config, items):
    skip_gpu = pytest.mark.skip(reason="needs a CUDA GPU")
    for item in items:
        if "gpu" in item.keywords and not HAS_CUDA:
            item.add_marker(skip_gpu)
