"""flashport: exact FlashAttention for CPUs and GPUs.

    import flashport.torch as fa        # flash_attn 2.8-compatible API for PyTorch
    import flashport.jax as fj          # XLA FFI API for JAX

One compiled extension (flashport._C) over the C API; tensors cross as DLPack, so nothing here
is compiled against a particular torch or jax.
"""
from enum import IntEnum

from . import _C

__version__ = _C.version()


class Backend(IntEnum):
    """fp_backend of the C API; pass as `backend=` to force one (AUTO picks the best)."""
    AUTO = 0
    REFERENCE = 1
    CPU = 2
    CUDA = 3
    HIP = 4


class CausalAlign(IntEnum):
    """Alignment of the causal mask, the window and ALiBi distances (fp_causal_align)."""
    BOTTOM_RIGHT = 0  # flash_attn >= 2.1 (the default)
    TOP_LEFT = 1      # torch SDPA's is_causal


def backend_available(backend) -> bool:
    """True if the backend (Backend, int or name such as "cpu") is compiled in and, for GPUs,
    a device is present."""
    b = Backend[backend.upper()] if isinstance(backend, str) else Backend(backend)
    return _C.backend_available(int(b))


def available_backends():
    return [b for b in Backend if b != Backend.AUTO and backend_available(b)]


def has_jax_support() -> bool:
    """True if the extension was built with jaxlib's XLA FFI headers."""
    return bool(_C.has_jax_ffi)


__all__ = ["Backend", "CausalAlign", "backend_available", "available_backends", "has_jax_support",
           "__version__"]
