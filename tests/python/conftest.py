import os
import sys

import pytest

sys.path.insert(0, os.path.dirname(__file__))  # reference.py

try:
    import torch
except ImportError:  # the JAX tests still run
    torch = None


def _devices():
    devs = ["cpu"]
    if torch is not None and torch.cuda.is_available():
        devs.append("cuda")
    return devs


DEVICES = _devices()


@pytest.fixture(params=DEVICES)
def device(request):
    return request.param


@pytest.fixture(autouse=True)
def _seed(request):
    """Fresh, reproducible random inputs per test (FLASHPORT_TEST_SEED overrides the base)."""
    if torch is not None:
        base = int(os.environ.get("FLASHPORT_TEST_SEED", "1234"))
        torch.manual_seed(base + (hash(request.node.nodeid) & 0xFFFF))
    yield
