"""Shared test helpers: random inputs, running the oracle (fp64) and the naive same-precision
computation, and the CUDA-backward guard."""
import pytest
import torch

import reference as ref


def randn(*shape, dtype=torch.float32, device="cpu", requires_grad=False):
    t = torch.randn(*shape, dtype=torch.float32).to(device=device, dtype=dtype)
    return t.requires_grad_(requires_grad)


def leaf64(t):
    return t.detach().double().cpu().requires_grad_(t.requires_grad)


def leaf_lowp(t):
    return t.detach().cpu().requires_grad_(t.requires_grad)


def backward_or_xfail(device, fn):
    """Runs a backward; on CUDA, a case the CUDA backend declines through its capability check
    (e.g. float32) is an expected failure, reported with the library's reason rather than hidden."""
    try:
        return fn()
    except RuntimeError as e:
        if device == "cuda" and "FP_ERR_UNSUPPORTED" in str(e):
            pytest.xfail(f"declined by the CUDA backend: {e}")
        raise
