"""flashport.jax: flash attention for JAX through XLA FFI handlers (CPU and CUDA platforms).

    from flashport.jax import flash_attn_func, flash_attn_varlen_func

Same arguments as flashport.torch / flash_attn 2.8 where they make sense; works under jax.jit and
jax.grad (custom_vjp). The handlers take their workspace from a result buffer sized at trace time
(GPU) or from XLA's scratch allocator (CPU), read no
device buffer on the host and return every failure as an FFI error (no C++ exception crosses the
boundary). Differences from the torch API:
  * dropout takes a PRNG key: ``dropout_key=jax.random.key(0)`` (required when dropout_p > 0).
    The key's bits (4 x uint32: seed, offset) reach the kernels as a buffer on the device
    (the C API's dropout_rng), so a jitted function with a traced key works on CPU and CUDA.
  * ``return_attn_probs`` is not available (no S_dmask); use ``return_softmax_lse=True`` to get
    (out, softmax_lse). The LSE is returned under stop_gradient (its gradient is not propagated,
    as in flash_attn).
  * ``block_table`` (paged KV) is not available in JAX (no in-place caches); passing it raises.
"""
import functools
from typing import NamedTuple, Optional

import numpy as np

import jax
import jax.numpy as jnp

from . import _C, Backend, CausalAlign

if not _C.has_jax_ffi:
    raise ImportError(
        "flashport was built without JAX support: jaxlib's XLA FFI headers were not found at build "
        "time. Install jax first, then reinstall flashport (pip install --no-build-isolation .).")

__all__ = ["flash_attn_func", "flash_attn_varlen_func"]

# Presence flags of optional inputs (must match jax_ffi.cpp).
_HAS_VARLEN, _HAS_ALIBI, _HAS_SINKS, _HAS_RNG = 1, 2, 4, 8


def _register_targets():
    targets = _C.jax_ffi_targets()
    for op in ("fwd", "bwd"):
        jax.ffi.register_ffi_target(f"flashport_{op}", targets[f"flashport_{op}_cpu"],
                                    platform="cpu")
        try:
            jax.ffi.register_ffi_target(f"flashport_{op}", targets[f"flashport_{op}_cuda"],
                                        platform="CUDA")
        except Exception:  # jaxlib without the CUDA plugin: CPU only
            pass


_register_targets()


class _Cfg(NamedTuple):
    softmax_scale: float
    causal: bool
    causal_align: int
    window_left: int
    window_right: int
    softcap: float
    dropout_p: float
    num_splits: int
    backend: int
    deterministic: bool
    max_seqlen_q: int
    max_seqlen_k: int


def _flags(cu_q, alibi, sinks, rng) -> int:
    return ((_HAS_VARLEN if cu_q is not None else 0) | (_HAS_ALIBI if alibi is not None else 0)
            | (_HAS_SINKS if sinks is not None else 0) | (_HAS_RNG if rng is not None else 0))


def _attrs(cfg: _Cfg, flags: int) -> dict:
    return dict(softmax_scale=np.float32(cfg.softmax_scale), causal=np.int32(cfg.causal),
                causal_align=np.int32(cfg.causal_align), window_left=np.int32(cfg.window_left),
                window_right=np.int32(cfg.window_right), softcap=np.float32(cfg.softcap),
                dropout_p=np.float32(cfg.dropout_p), num_splits=np.int32(cfg.num_splits),
                backend=np.int32(cfg.backend), flags=np.int32(flags),
                max_seqlen_q=np.int64(cfg.max_seqlen_q), max_seqlen_k=np.int64(cfg.max_seqlen_k))


def _extras(cu_q, cu_k, alibi, sinks, rng):
    ex = []
    if cu_q is not None:
        ex += [cu_q, cu_k]
    ex += [x for x in (alibi, sinks, rng) if x is not None]
    return ex


def _lse_dtype(q):
    return jnp.float64 if q.dtype == jnp.float64 else jnp.float32


def _workspace_types(op, cfg, named):
    """On GPUs, the workspace is a result buffer sized here, at trace time: XLA's scratch
    allocator is unavailable inside command buffers, and GPU planning reads no device memory, so
    shapes alone give the exact size. On CPU the handler uses XLA's scratch allocator."""
    if jax.default_backend() != "gpu":
        return ()
    meta = {n: (jnp.dtype(x.dtype).name, tuple(int(d) for d in x.shape))
            for n, x in named.items() if x is not None}
    try:
        nbytes = _C.gpu_workspace_bytes(op, meta, cfg.softmax_scale, cfg.causal, cfg.causal_align,
                                        cfg.window_left, cfg.window_right, cfg.softcap,
                                        cfg.dropout_p, cfg.num_splits, cfg.backend,
                                        cfg.max_seqlen_q, cfg.max_seqlen_k, cfg.deterministic)
    except (ValueError, RuntimeError):
        # Not a call the CUDA backend plans (e.g. arrays placed on the CPU of a GPU machine):
        # the handler then takes scratch memory, and a real CUDA error surfaces at run time.
        return ()
    return (jax.ShapeDtypeStruct((nbytes,), jnp.uint8),) if nbytes else ()


def _forward(cfg, q, k, v, cu_q, cu_k, alibi, sinks, rng):
    out_type = jax.ShapeDtypeStruct((*q.shape[:-1], v.shape[-1]), q.dtype)
    if cu_q is None:
        lse_shape = (q.shape[0], q.shape[2], q.shape[1])
    else:
        lse_shape = (q.shape[1], q.shape[0])
    lse_type = jax.ShapeDtypeStruct(lse_shape, _lse_dtype(q))
    ws = _workspace_types("fwd", cfg, dict(q=q, k=k, v=v, out=out_type, lse=lse_type,
                                          cu_seqlens_q=cu_q, cu_seqlens_k=cu_k,
                                          alibi_slopes=alibi, sinks=sinks))
    call = jax.ffi.ffi_call("flashport_fwd", (out_type, lse_type, *ws), vmap_method="sequential")
    res = call(q, k, v, *_extras(cu_q, cu_k, alibi, sinks, rng),
               **_attrs(cfg, _flags(cu_q, alibi, sinks, rng)))
    return res[0], res[1]


@functools.partial(jax.custom_vjp, nondiff_argnums=(0,))
def _attention(cfg, q, k, v, cu_q, cu_k, alibi, sinks, rng):
    return _forward(cfg, q, k, v, cu_q, cu_k, alibi, sinks, rng)


def _attention_fwd(cfg, q, k, v, cu_q, cu_k, alibi, sinks, rng):
    out, lse = _forward(cfg, q, k, v, cu_q, cu_k, alibi, sinks, rng)
    return (out, lse), (q, k, v, cu_q, cu_k, alibi, sinks, rng, out, lse)


def _zero_cotangent(x):
    if x is None:
        return None
    if jnp.issubdtype(x.dtype, jnp.integer):
        return np.zeros(x.shape, dtype=jax.dtypes.float0)
    return jnp.zeros_like(x)


def _attention_bwd(cfg, res, cotangents):
    q, k, v, cu_q, cu_k, alibi, sinks, rng, out, lse = res
    dout, _dlse = cotangents  # the LSE leaves the public functions under stop_gradient
    types = [jax.ShapeDtypeStruct(x.shape, x.dtype) for x in (q, k, v)]
    if sinks is not None:
        types.append(jax.ShapeDtypeStruct(sinks.shape, jnp.float32))
    types += _workspace_types("bwd", cfg, dict(q=q, k=k, v=v, out=out, lse=lse, dout=out,
                                               dq=q, dk=k, dv=v, cu_seqlens_q=cu_q,
                                               cu_seqlens_k=cu_k, alibi_slopes=alibi, sinks=sinks,
                                               d_sinks=sinks))
    call = jax.ffi.ffi_call("flashport_bwd", tuple(types), vmap_method="sequential")
    grads = call(q, k, v, out, lse, dout.astype(out.dtype),
                 *_extras(cu_q, cu_k, alibi, sinks, rng),
                 **_attrs(cfg, _flags(cu_q, alibi, sinks, rng)),
                 deterministic=np.int32(cfg.deterministic))
    dq, dk, dv = grads[:3]
    d_sinks = grads[3].astype(sinks.dtype) if sinks is not None else None
    return (dq, dk, dv, _zero_cotangent(cu_q), _zero_cotangent(cu_k), _zero_cotangent(alibi),
            d_sinks, _zero_cotangent(rng))


_attention.defvjp(_attention_fwd, _attention_bwd)


def _backend_id(backend) -> int:
    if backend is None:
        return int(Backend.AUTO)
    if isinstance(backend, str):
        try:
            return int(Backend[backend.upper()])
        except KeyError:
            raise ValueError(f"flashport: unknown backend {backend!r}") from None
    return int(Backend(backend))


def _align_id(causal_align) -> int:
    if isinstance(causal_align, str):
        try:
            return int(CausalAlign[causal_align.upper()])
        except KeyError:
            raise ValueError(f"flashport: causal_align must be 'bottom_right' or 'top_left', "
                             f"got {causal_align!r}") from None
    return int(CausalAlign(causal_align))


def _rng_from_key(dropout_p, dropout_key):
    if dropout_p == 0.0:
        return None
    if dropout_key is None:
        raise ValueError("flashport.jax: dropout_p > 0 needs dropout_key (a jax.random key)")
    return jax.random.bits(dropout_key, (4,), jnp.uint32)


def _run(q, k, v, cu_q, cu_k, max_q, max_k, dropout_p, softmax_scale, causal, window_size,
         softcap, alibi_slopes, deterministic, return_attn_probs, dropout_key, sinks,
         causal_align, num_splits, backend, return_softmax_lse):
    if return_attn_probs:
        raise NotImplementedError(
            "flashport.jax: return_attn_probs (S_dmask) is not available; use "
            "return_softmax_lse=True for (out, softmax_lse), or flashport.torch for S_dmask")
    if len(window_size) != 2:
        raise ValueError(f"flashport: window_size must be (left, right), got {window_size!r}")
    scale = q.shape[-1] ** (-0.5) if softmax_scale is None else softmax_scale
    cfg = _Cfg(float(scale), bool(causal), _align_id(causal_align), int(window_size[0]),
               int(window_size[1]), float(softcap), float(dropout_p), int(num_splits),
               _backend_id(backend), bool(deterministic), int(max_q), int(max_k))
    rng = _rng_from_key(float(dropout_p), dropout_key)
    out, lse = _attention(cfg, q, k, v, cu_q, cu_k, alibi_slopes, sinks, rng)
    if return_softmax_lse:
        return out, jax.lax.stop_gradient(lse)
    return out


def flash_attn_func(
    q,
    k,
    v,
    dropout_p=0.0,
    softmax_scale=None,
    causal=False,
    window_size=(-1, -1),
    softcap=0.0,
    alibi_slopes=None,
    deterministic=False,
    return_attn_probs=False,
    *,
    dropout_key=None,
    sinks=None,
    causal_align="bottom_right",
    num_splits=0,
    backend=None,
    return_softmax_lse=False,
):
    """q [B, Sq, Hq, D], k/v [B, Sk, Hkv, D|Dv] -> out [B, Sq, Hq, Dv]
    (with return_softmax_lse: (out, lse [B, Hq, Sq]))."""
    return _run(q, k, v, None, None, 0, 0, dropout_p, softmax_scale, causal, window_size, softcap,
                alibi_slopes, deterministic, return_attn_probs, dropout_key, sinks, causal_align,
                num_splits, backend, return_softmax_lse)


def flash_attn_varlen_func(
    q,
    k,
    v,
    cu_seqlens_q,
    cu_seqlens_k,
    max_seqlen_q,
    max_seqlen_k,
    dropout_p=0.0,
    softmax_scale=None,
    causal=False,
    window_size=(-1, -1),
    softcap=0.0,
    alibi_slopes=None,
    deterministic=False,
    return_attn_probs=False,
    block_table=None,
    *,
    dropout_key=None,
    sinks=None,
    causal_align="bottom_right",
    num_splits=0,
    backend=None,
    return_softmax_lse=False,
):
    """q [Tq, Hq, D], k/v [Tk, Hkv, D|Dv], cu_seqlens int32 [B+1]; max_seqlen_q/k are Python
    ints (static under jit) -> out [Tq, Hq, Dv] (with return_softmax_lse: (out, lse [Hq, Tq]))."""
    if block_table is not None:
        raise NotImplementedError("flashport.jax: block_table (paged KV cache) is not supported")
    return _run(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, dropout_p,
                softmax_scale, causal, window_size, softcap, alibi_slopes, deterministic,
                return_attn_probs, dropout_key, sinks, causal_align, num_splits, backend,
                return_softmax_lse)
