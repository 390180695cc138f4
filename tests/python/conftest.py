import os
import sys

import pytest

sys.path.insert(0, os.path.dirname(__file__))  # reference.py

try:
    import torch
except ImportError:  # the JAX tests still run
    torch = None


# Without torch only the JAX suite can run (it skips itself without torch, its oracle's home).
collect_ignore = []
if torch is None:
    collect_ignore = [f for f in os.listdir(os.path.dirname(__file__))
                      if f.startswith(("test_torch", "test_binding", "test_signatures"))]


if torch is not None:
    from helpers import DEVICES  # noqa: E402  (cpu, and cuda where a GPU is present)
else:
    DEVICES = ["cpu"]


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


def pytest_configure(config):
    config.addinivalue_line(
        "markers",
        "cuda_declines(reason): the CUDA backend declines this test's case by design "
        "(FP_ERR_UNSUPPORTED from its capability check); on the GPU the test is an expected "
        "failure with the library's message, and fails if CUDA runs it after all.")


def _on_gpu(item) -> bool:
    params = getattr(getattr(item, "callspec", None), "params", {})
    return params.get("device") == "cuda" or params.get("jdev") == "cuda"


@pytest.hookimpl(wrapper=True)
def pytest_pyfunc_call(pyfuncitem):
    """Only a test marked cuda_declines(reason) may end in FP_ERR_UNSUPPORTED on the GPU: it is
    then an expected failure, listed by `pytest -rx` with the reason and the library's message.
    A marked test that runs through on the GPU fails (the decline is gone: drop the mark). Any
    other FP_ERR_UNSUPPORTED, on the GPU or the CPU, fails its test."""
    mark = pyfuncitem.get_closest_marker("cuda_declines")
    if mark is None or not _on_gpu(pyfuncitem):
        return (yield)
    reason = mark.args[0] if mark.args else mark.kwargs.get("reason", "")
    try:
        result = yield
    except Exception as e:  # noqa: BLE001 - jax raises its own runtime error types
        if "FP_ERR_UNSUPPORTED" in str(e):
            pytest.xfail(f"CUDA declines by design ({reason}): {str(e).splitlines()[0][:300]}")
        raise
    pytest.fail(f"marked cuda_declines({reason!r}) but the CUDA backend ran it: drop the mark")
    return result
