"""Shared test helpers: random inputs, running the oracle (fp64) and the naive same-precision
computation, and the dtypes each device runs.

The CUDA backend runs float32, float16 and bfloat16 (float64 is declined by its capability check,
tested once in test_torch_errors.py::test_cuda_declines_float64). So a test that works in float32
on the CPU runs the same checks on CUDA in float32 (same fp32 tolerances), float16 and bfloat16,
against the fp64 oracle with tolerances set by the naive same-precision computation
(reference.assert_close_to_ref)."""
import os

import pytest
import torch

import reference as ref

DEVICES = ["cpu"] + (["cuda"] if torch.cuda.is_available() else [])

LOWP_DTYPES = (torch.float16, torch.bfloat16)
CUDA_DTYPES = (torch.float32,) + LOWP_DTYPES

# FLASHPORT_TEST_CPU_LOWP=1 also runs the CUDA dtypes on the CPU: the low-precision variants of
# the float32 tests (and their tolerances) can then be checked on a machine without a GPU.
_CPU_LOWP = os.environ.get("FLASHPORT_TEST_CPU_LOWP", "") not in ("", "0")


def work_dtypes(device):
    """The dtypes a float32 test runs in on `device`: float32 on the CPU, float32, fp16 and bf16
    on CUDA."""
    if device == "cuda":
        return list(CUDA_DTYPES)
    return [torch.float32] + (list(LOWP_DTYPES) if _CPU_LOWP else [])


def work_dtype(device):
    """One dtype per device, for tests where one suffices (torch.compile: each compile is slow)."""
    return torch.float16 if device == "cuda" else torch.float32


def device_dtypes(dtypes=None):
    """Parameters for @pytest.mark.parametrize("device,dtype", ...): every device with each of
    `dtypes` it supports (dtypes=None: work_dtypes(device)). The direct parametrization of
    `device` replaces conftest's fixture."""
    out = []
    for dev in DEVICES:
        for dt in (work_dtypes(dev) if dtypes is None else dtypes):
            if dev == "cuda" and dt not in CUDA_DTYPES:
                continue
            out.append(pytest.param(dev, dt, id=f"{dev}-{str(dt).replace('torch.', '')}"))
    return out


def randn(*shape, dtype=torch.float32, device="cpu", requires_grad=False):
    t = torch.randn(*shape, dtype=torch.float32).to(device=device, dtype=dtype)
    return t.requires_grad_(requires_grad)


def leaf64(t):
    return t.detach().double().cpu().requires_grad_(t.requires_grad)


def leaf_lowp(t):
    return t.detach().cpu().requires_grad_(t.requires_grad)


def is_lowp(dtype):
    return dtype in (torch.float16, torch.bfloat16)


def eps(dtype):
    return ref.EPS[dtype]
