"""flashport.torch: flash_attn 2.8's Python API on flashport.

    from flashport.torch import flash_attn_func, flash_attn_varlen_func, flash_attn_with_kvcache

Same signatures, defaults, argument order and return conventions as flash_attn 2.8, so code runs by
changing the import. flashport extras are keyword-only: ``sinks`` (per-head sink logits),
``causal_align`` ("bottom_right" as flash_attn, or "top_left" as torch SDPA), ``backend`` (force a
backend, e.g. "reference") and, for flash_attn_func/varlen, ``num_splits``.

Two routes run the same code. Eager calls on plain tensors go straight to the extension (typed
positional arguments; tensors cross through torch's C-level DLPack exchange where torch has it,
else as pointer/shape/strides), with autograd through a small torch.autograd.Function. While
torch.compile/export trace, under a dispatch mode (fake tensors, make_fx) or with tensor subclasses,
calls go through torch.library custom ops (namespace ``flashport``) with fake implementations and
registered autograd, so torch.compile(fullgraph=True) traces them; their bodies are the eager
route's calls, so both routes give the same bits. CPU and CUDA tensors; GPU calls run on the
current CUDA stream with workspace from torch's caching allocator.

Dropout RNG (CUDA-graph safe). Each dropout forward draws its Philox (seed, offset) as two random
64-bit words with a torch random op (``Tensor.random_``) from torch's default generator of the
tensors' device, into an int64 [2] tensor on that device; the kernels read it there (the C API's
``dropout_rng``, whose int32 words are this tensor's little-endian halves), and the backward reads
the same saved tensor, so it replays the forward's pattern. Nothing is read or decided on the host,
so the same code is right eagerly and inside a CUDA graph (torch.cuda.graph, torch.compile
mode="reduce-overhead"), where it inherits torch's own graph-safe RNG: the default generator is
registered with the graph, each replay starts from the generator's current (seed, offset) and
advances it, and each dropout call inside the graph has its own offset within the replay. Hence:
  * torch.manual_seed reproduces an eager run, and a replay after torch.manual_seed(s) is
    reproducible and keeps the same pattern as the eager run after torch.manual_seed(s) (same
    sequence of random ops), as for torch's own dropout;
  * every replay, and every call within one replay, gets a new pattern; the seed is not frozen at
    capture time (torch.manual_seed between replays takes effect at the next replay);
  * eager calls and replays consume the same generator, so they never reuse each other's draws.
(A pattern is keyed by 128 random bits rather than by the generator's seed plus a reserved offset
range, because the generator's seed and offset are host values that a graph would bake in; a graph
can only reach them through a torch random op.) The custom op returns the tensor as its third
output (``rng_state``: int64 [2] on the tensors' device; empty when dropout_p == 0).

Differences from flash_attn, all loud:
  * The softmax LSE returned by return_attn_probs / return_softmax_lse is not differentiable (as in
    flash_attn, whose backward ignores its gradient); it is marked non-differentiable here.
  * ``S_dmask`` (return_attn_probs=True) is None without dropout (as flash_attn); with dropout it
    is computed exactly, not as a kernel by-product: the softmax probabilities P = exp(s - lse)
    of the visible keys, shape [B, Hq, Sq, Sk] (varlen: [B, Hq, max_seqlen_q, max_seqlen_k], zero
    padded; no rounding to 128), with dropped elements negated (flash_attn's encoding). It costs
    an extra O(Sq * Sk) pass and is meant for testing, as in flash_attn.
"""
import sys
from typing import Optional, Tuple, Union

import torch
from torch import Tensor

from . import _C, Backend, CausalAlign

__all__ = [
    "flash_attn_func",
    "flash_attn_varlen_func",
    "flash_attn_with_kvcache",
    "flash_attn_qkvpacked_func",
    "flash_attn_kvpacked_func",
    "flash_attn_varlen_qkvpacked_func",
    "flash_attn_varlen_kvpacked_func",
    "merge_attn_states",
]

_NAN = float("nan")  # softmax_scale=None: the library's 1/sqrt(D)
# The int64 [2] rng_state is passed to the C API as its int32 view: {seed lo, seed hi, offset lo,
# offset hi} needs little-endian words.
assert sys.byteorder == "little", "flashport.torch: dropout_rng layout assumes a little-endian host"


# --------------------------------------------------------------------------------------------
# How torch tensors reach the extension (set once): torch's C-level DLPack exchange table where
# torch has one (>= 2.10: data pointer, shape, strides, current stream and the workspace from the
# caching allocator, with no Python object per tensor), else the tensors' attributes.
# --------------------------------------------------------------------------------------------

def _raw_stream(device_index: int) -> int:
    """torch's current stream of a GPU (attribute route only: the C route asks torch in C)."""
    return torch.cuda.current_stream(device_index).cuda_stream


_DTYPES = (torch.float16, torch.bfloat16, torch.float32, torch.float64, torch.int32, torch.uint8)


def _empty(shape: Tuple[int, ...], code: int, device_index: int) -> Tensor:
    """A new output or workspace from torch's caching allocator (attribute route). code: the
    fp_dtype order of _DTYPES; device_index -1 is the CPU."""
    device = "cpu" if device_index < 0 else torch.device("cuda", device_index)
    return torch.empty(shape, dtype=_DTYPES[code], device=device)


def _exchange_api():
    """torch.Tensor's C exchange table (a "dlpack_exchange_api" capsule), or None."""
    api = getattr(torch.Tensor, "__dlpack_c_exchange_api__", None)
    return api if type(api).__name__ == "PyCapsule" else None


def _connect(exchange_api) -> bool:
    return _C.set_torch(torch.Tensor, exchange_api, _DTYPES[:5], _raw_stream, _empty,
                        torch.version.hip is not None)


_connect(_exchange_api())


# --------------------------------------------------------------------------------------------
# Helpers
# --------------------------------------------------------------------------------------------

def _use_custom_ops(x: Tensor) -> bool:
    """True when a call must go through the registered custom ops rather than straight to the
    extension: while torch.compile/export trace (dynamo), under a dispatch mode (FakeTensorMode,
    make_fx, FlopCounterMode, ...) and for tensor subclasses (FakeTensor, FunctionalTensor,
    DTensor, ...). Eager calls on plain tensors take the direct route; both run the same code."""
    return (torch.compiler.is_compiling() or type(x) is not Tensor
            or torch._C._len_torch_dispatch_stack() > 0)


def _lse_dtype(q: Tensor) -> torch.dtype:
    return torch.float64 if q.dtype == torch.float64 else torch.float32


def _draw_dropout_rng(rng: Tensor) -> None:
    """Fills rng (int64 [2] on the tensors' device) with one dropout call's (seed, offset): two
    uniformly random 64-bit words from torch's default generator of that device, drawn by a torch
    random op on the current stream, so under CUDA-graph capture every replay draws anew (torch's
    graph-safe generator state) and nothing is read on the host. See the module docstring."""
    rng.random_(-(1 << 63), None)  # [-2^63, 2^63 - 1]: every 64-bit pattern


def _new_rng(q: Tensor) -> Tensor:
    rng = torch.empty(2, dtype=torch.int64, device=q.device)
    _draw_dropout_rng(rng)
    return rng


def _rng_words(rng_state: Tensor, device: torch.device) -> Tensor:
    """The C API's dropout_rng (int32 [4] {seed lo, seed hi, offset lo, offset hi}) as a view of
    the int64 [2] rng_state (seed, offset); no copy, no host read."""
    if rng_state.dtype != torch.int64 or tuple(rng_state.shape) != (2,) or \
            rng_state.device != device:
        raise ValueError(f"flashport: rng_state must be the int64 [2] (seed, offset) tensor on "
                         f"{device} that the forward returned; got {rng_state.dtype} "
                         f"{tuple(rng_state.shape)} on {rng_state.device}")
    return rng_state.contiguous().view(torch.int32)


_BACKEND_IDS = {None: int(Backend.AUTO)}
_BACKEND_IDS.update({b.name.lower(): int(b) for b in Backend})


def _backend_id(backend) -> int:
    found = _BACKEND_IDS.get(backend.lower() if isinstance(backend, str) else backend)
    if found is not None:
        return found
    if isinstance(backend, str):
        raise ValueError(f"flashport: unknown backend {backend!r}; one of "
                         f"{[b.name.lower() for b in Backend]}")
    return int(Backend(backend))


_ALIGN_IDS = {"bottom_right": int(CausalAlign.BOTTOM_RIGHT), "top_left": int(CausalAlign.TOP_LEFT)}


def _align_id(causal_align) -> int:
    found = _ALIGN_IDS.get(causal_align)
    if found is not None:
        return found
    if isinstance(causal_align, str):
        align = _ALIGN_IDS.get(causal_align.lower())
        if align is None:
            raise ValueError(f"flashport: causal_align must be 'bottom_right' or 'top_left', "
                             f"got {causal_align!r}")
        return align
    return int(CausalAlign(causal_align))


def _window(window_size) -> Tuple[int, int]:
    try:
        left, right = window_size
    except (TypeError, ValueError):
        raise ValueError(f"flashport: window_size must be (left, right), got {window_size!r}") \
            from None
    return int(left), int(right)


def _scale(softmax_scale) -> float:
    """The scale the extension gets: NaN asks the library for 1/sqrt(D) (one rule, every route)."""
    return _NAN if softmax_scale is None else float(softmax_scale)


# --------------------------------------------------------------------------------------------
# The calls into the extension. Every route runs these: the eager fast path directly, the
# custom ops (torch.compile, export, fake tensors) from their bodies. The extension allocates
# the outputs (contiguous, from torch's caching allocator), as the fake implementations do.
# --------------------------------------------------------------------------------------------

def _fwd_outputs(q: Tensor, v: Tensor, varlen: bool) -> Tuple[Tensor, Tensor]:
    """(Fake) out [.., Hq, Dv] like q, and the LSE: [B, Hq, Sq] batched, [Hq, Tq] varlen."""
    if v.shape[-1] == q.shape[-1]:
        out = q.new_empty(q.shape)
    else:
        out = q.new_empty((*q.shape[:-1], v.shape[-1]))
    if varlen:  # q [Tq, Hq, D]
        lse = q.new_empty((q.shape[1], q.shape[0]), dtype=_lse_dtype(q))
    else:  # q [B, Sq, Hq, D]
        lse = q.new_empty((q.shape[0], q.shape[2], q.shape[1]), dtype=_lse_dtype(q))
    return out, lse


def _fwd(q, k, v, cu_q, cu_k, max_q, max_k, block_table, seqused_k, alibi, sinks, rng,
         dropout_p, scale, causal, wl, wr, softcap, align, num_splits, backend):
    """One forward call -> (out, lse); rng is the drawn int64 [2] (seed, offset) when
    dropout_p > 0."""
    return _C.attn_fwd(q, k, v, None, None, cu_q, cu_k, max_q, max_k, block_table, seqused_k,
                       alibi, sinks, None if rng is None else rng.view(torch.int32), dropout_p,
                       scale, causal, wl, wr, softcap, align, num_splits, backend)


def _bwd(dout, q, k, v, out, lse, cu_q, cu_k, max_q, max_k, block_table, seqused_k, alibi, sinks,
         rng, dropout_p, scale, causal, wl, wr, softcap, align, deterministic, backend):
    """One backward call -> (dq, dk, dv, d_sinks or None); rng as in _fwd."""
    return _C.attn_bwd(dout, q, k, v, out, lse, None, None, None, None, cu_q, cu_k, max_q, max_k,
                       block_table, seqused_k, alibi, sinks,
                       None if rng is None else rng.view(torch.int32), dropout_p, scale, causal,
                       wl, wr, softcap, align, deterministic, backend)


class _Attention(torch.autograd.Function):
    """Autograd of the eager route: forward and backward straight to the extension. (The custom
    op flashport::attn_fwd has the same formula registered for the traced route.)"""

    @staticmethod
    def forward(ctx, q, k, v, sinks, aux):
        (cu_q, cu_k, max_q, max_k, block_table, seqused_k, alibi, rng, dropout_p, scale, causal,
         wl, wr, softcap, align, num_splits, deterministic, backend) = aux
        out, lse = _fwd(q, k, v, cu_q, cu_k, max_q, max_k, block_table, seqused_k, alibi, sinks,
                        rng, dropout_p, scale, causal, wl, wr, softcap, align, num_splits,
                        backend)
        ctx.save_for_backward(q, k, v, out, lse, sinks)
        ctx.aux = aux
        ctx.mark_non_differentiable(lse)
        return out, lse

    @staticmethod
    def backward(ctx, dout, _dlse):
        q, k, v, out, lse, sinks = ctx.saved_tensors
        (cu_q, cu_k, max_q, max_k, block_table, seqused_k, alibi, rng, dropout_p, scale, causal,
         wl, wr, softcap, align, _num_splits, deterministic, backend) = ctx.aux
        if torch.compiler.is_compiling():  # compiled autograd traces the backward
            no_rng = q.new_empty((0,), dtype=torch.int64) if rng is None else rng
            dq, dk, dv, d_sinks = torch.ops.flashport.attn_bwd(
                dout, q, k, v, out, lse, cu_q, cu_k, max_q, max_k, block_table, seqused_k, alibi,
                sinks, no_rng, dropout_p, scale, causal, wl, wr, softcap, align, deterministic,
                backend)
        else:
            dq, dk, dv, d_sinks = _bwd(dout, q, k, v, out, lse, cu_q, cu_k, max_q, max_k,
                                       block_table, seqused_k, alibi, sinks, rng, dropout_p,
                                       scale, causal, wl, wr, softcap, align, deterministic,
                                       backend)
        return dq, dk, dv, (d_sinks if sinks is not None else None), None


def _attention(q, k, v, cu_q, cu_k, max_q, max_k, block_table, seqused_k, alibi, sinks,
               dropout_p, scale, causal, wl, wr, softcap, align, num_splits, deterministic,
               backend):
    """The forward of flash_attn_func / flash_attn_varlen_func -> (out, lse, rng_state or None)."""
    if _use_custom_ops(q):
        out, lse, rng = torch.ops.flashport.attn_fwd(
            q, k, v, cu_q, cu_k, max_q, max_k, block_table, seqused_k, alibi, sinks, dropout_p,
            scale, causal, wl, wr, softcap, align, num_splits, deterministic, backend)
        return out, lse, rng
    rng = _new_rng(q) if dropout_p > 0.0 else None
    if torch.is_grad_enabled() and (q.requires_grad or k.requires_grad or v.requires_grad or
                                    (sinks is not None and sinks.requires_grad)):
        out, lse = _Attention.apply(q, k, v, sinks, (
            cu_q, cu_k, max_q, max_k, block_table, seqused_k, alibi, rng, dropout_p, scale,
            causal, wl, wr, softcap, align, num_splits, deterministic, backend))
    else:
        out, lse = _fwd(q, k, v, cu_q, cu_k, max_q, max_k, block_table, seqused_k, alibi, sinks,
                        rng, dropout_p, scale, causal, wl, wr, softcap, align, num_splits,
                        backend)
    return out, lse, rng


def _kvcache_fwd(q, k_cache, v_cache, k, v, rotary_cos, rotary_sin, cache_seqlens,
                 cache_batch_idx, block_table, alibi_slopes, sinks, softmax_scale, causal,
                 window_left, window_right, softcap, rotary_interleaved, num_splits, causal_align,
                 backend, cache_leftpad):
    """One KV-cache call (the custom op's argument order) -> (out, lse)."""
    return _C.attn_fwd_kvcache(q, k_cache, v_cache, None, None, k, v, rotary_cos, rotary_sin,
                               cache_seqlens, cache_batch_idx, cache_leftpad, block_table,
                               alibi_slopes, sinks, softmax_scale, causal, window_left,
                               window_right, softcap, rotary_interleaved, num_splits, causal_align,
                               backend)


def _merge_outputs(out_partials: Tensor, lse_partials: Tensor) -> Tuple[Tensor, Tensor]:
    return (out_partials.new_empty(out_partials.shape[1:]),
            lse_partials.new_empty(lse_partials.shape[1:]))


def _merge_fwd_run(out_partials, lse_partials, backend):
    return _C.merge_fwd(out_partials, lse_partials, None, None, backend)


def _merge_bwd_run(out_partials, lse_partials, out, lse, dout, dlse, backend):
    return _C.merge_bwd(out_partials, lse_partials, out, lse, dout, dlse, None, None, backend)


class _Merge(torch.autograd.Function):
    @staticmethod
    def forward(ctx, out_partials, lse_partials, backend):
        out, lse = _merge_fwd_run(out_partials, lse_partials, backend)
        ctx.save_for_backward(out_partials, lse_partials, out, lse)
        ctx.backend = backend
        return out, lse

    @staticmethod
    def backward(ctx, dout, dlse):
        out_partials, lse_partials, out, lse = ctx.saved_tensors
        if dout is None:
            dout = torch.zeros_like(out)
        if torch.compiler.is_compiling():
            grads = torch.ops.flashport.merge_bwd(out_partials, lse_partials, out, lse, dout,
                                                  dlse, ctx.backend)
        else:
            grads = _merge_bwd_run(out_partials, lse_partials, out, lse, dout, dlse, ctx.backend)
        return grads[0], grads[1], None


# --------------------------------------------------------------------------------------------
# Custom ops (torch.compile, export, fake tensors): forward / backward (batched and varlen), KV
# cache forward, merge. Their bodies are the eager route's calls.
# --------------------------------------------------------------------------------------------

@torch.library.custom_op("flashport::attn_fwd", mutates_args=())
def _attn_fwd(
    q: Tensor, k: Tensor, v: Tensor,
    cu_seqlens_q: Optional[Tensor], cu_seqlens_k: Optional[Tensor],
    max_seqlen_q: int, max_seqlen_k: int, block_table: Optional[Tensor],
    seqused_k: Optional[Tensor], alibi_slopes: Optional[Tensor], sinks: Optional[Tensor],
    dropout_p: float, softmax_scale: float, causal: bool, window_left: int, window_right: int,
    softcap: float, causal_align: int, num_splits: int, deterministic: bool, backend: int,
) -> Tuple[Tensor, Tensor, Tensor]:
    rng = _new_rng(q) if dropout_p > 0.0 else None
    out, lse = _fwd(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, block_table,
                    seqused_k, alibi_slopes, sinks, rng, dropout_p, softmax_scale, causal,
                    window_left, window_right, softcap, causal_align, num_splits, backend)
    return out, lse, q.new_empty((0,), dtype=torch.int64) if rng is None else rng


@_attn_fwd.register_fake
def _attn_fwd_fake(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, block_table,
                   seqused_k, alibi_slopes, sinks, dropout_p, softmax_scale, causal, window_left,
                   window_right, softcap, causal_align, num_splits, deterministic, backend):
    out, lse = _fwd_outputs(q, v, cu_seqlens_q is not None)
    # rng_state: (seed, offset) on q's device when dropout is on, else empty (no work at p = 0).
    rng = q.new_empty((2,) if dropout_p > 0.0 else (0,), dtype=torch.int64)
    return out, lse, rng


@torch.library.custom_op("flashport::attn_bwd", mutates_args=())
def _attn_bwd(
    dout: Tensor, q: Tensor, k: Tensor, v: Tensor, out: Tensor, lse: Tensor,
    cu_seqlens_q: Optional[Tensor], cu_seqlens_k: Optional[Tensor],
    max_seqlen_q: int, max_seqlen_k: int, block_table: Optional[Tensor],
    seqused_k: Optional[Tensor], alibi_slopes: Optional[Tensor], sinks: Optional[Tensor],
    rng_state: Tensor, dropout_p: float, softmax_scale: float, causal: bool, window_left: int,
    window_right: int, softcap: float, causal_align: int, deterministic: bool, backend: int,
) -> Tuple[Tensor, Tensor, Tensor, Tensor]:
    # The forward's saved (seed, offset), read by the kernels where it lives (graph-safe).
    rng = None
    if dropout_p > 0.0:
        _rng_words(rng_state, q.device)  # checks it
        rng = rng_state.contiguous()
    dq, dk, dv, d_sinks = _bwd(dout, q, k, v, out, lse, cu_seqlens_q, cu_seqlens_k, max_seqlen_q,
                               max_seqlen_k, block_table, seqused_k, alibi_slopes, sinks, rng,
                               dropout_p, softmax_scale, causal, window_left, window_right,
                               softcap, causal_align, deterministic, backend)
    return dq, dk, dv, q.new_empty((0,), dtype=torch.float32) if d_sinks is None else d_sinks


@_attn_bwd.register_fake
def _attn_bwd_fake(dout, q, k, v, out, lse, cu_seqlens_q, cu_seqlens_k, max_seqlen_q,
                   max_seqlen_k, block_table, seqused_k, alibi_slopes, sinks, rng_state, dropout_p,
                   softmax_scale, causal, window_left, window_right, softcap, causal_align,
                   deterministic, backend):
    d_sinks = (sinks.new_empty(sinks.shape, dtype=torch.float32) if sinks is not None
               else q.new_empty((0,), dtype=torch.float32))
    return q.new_empty(q.shape), k.new_empty(k.shape), v.new_empty(v.shape), d_sinks


def _attn_setup_context(ctx, inputs, output):
    (q, k, v, cu_q, cu_k, max_q, max_k, block_table, seqused_k, alibi, sinks, dropout_p, scale,
     causal, wl, wr, softcap, align, _num_splits, deterministic, backend) = inputs
    out, lse, rng = output
    ctx.save_for_backward(q, k, v, out, lse, cu_q, cu_k, block_table, seqused_k, alibi, sinks,
                          rng)
    ctx.args = (max_q, max_k, dropout_p, scale, causal, wl, wr, softcap, align, deterministic,
                backend)
    ctx.has_sinks = sinks is not None
    ctx.mark_non_differentiable(lse, rng)


def _attn_backward(ctx, dout, _dlse, _drng):
    q, k, v, out, lse, cu_q, cu_k, block_table, seqused_k, alibi, sinks, rng = ctx.saved_tensors
    (max_q, max_k, dropout_p, scale, causal, wl, wr, softcap, align, deterministic,
     backend) = ctx.args
    dq, dk, dv, d_sinks = torch.ops.flashport.attn_bwd(
        dout, q, k, v, out, lse, cu_q, cu_k, max_q, max_k, block_table, seqused_k, alibi, sinks,
        rng, dropout_p, scale, causal, wl, wr, softcap, align, deterministic, backend)
    return (dq, dk, dv, None, None, None, None, None, None, None,
            d_sinks if ctx.has_sinks else None,
            None, None, None, None, None, None, None, None, None, None)


torch.library.register_autograd("flashport::attn_fwd", _attn_backward,
                                setup_context=_attn_setup_context)


@torch.library.custom_op("flashport::attn_fwd_kvcache", mutates_args=("k_cache", "v_cache"))
def _attn_fwd_kvcache(
    q: Tensor, k_cache: Tensor, v_cache: Tensor, k: Optional[Tensor], v: Optional[Tensor],
    rotary_cos: Optional[Tensor], rotary_sin: Optional[Tensor], cache_seqlens: Optional[Tensor],
    cache_batch_idx: Optional[Tensor], block_table: Optional[Tensor],
    alibi_slopes: Optional[Tensor], sinks: Optional[Tensor], softmax_scale: float, causal: bool,
    window_left: int, window_right: int, softcap: float, rotary_interleaved: bool,
    num_splits: int, causal_align: int, backend: int, cache_leftpad: Optional[Tensor] = None,
) -> Tuple[Tensor, Tensor]:
    return _kvcache_fwd(q, k_cache, v_cache, k, v, rotary_cos, rotary_sin, cache_seqlens,
                        cache_batch_idx, block_table, alibi_slopes, sinks, softmax_scale, causal,
                        window_left, window_right, softcap, rotary_interleaved, num_splits,
                        causal_align, backend, cache_leftpad)


@_attn_fwd_kvcache.register_fake
def _attn_fwd_kvcache_fake(q, k_cache, v_cache, k, v, rotary_cos, rotary_sin, cache_seqlens,
                           cache_batch_idx, block_table, alibi_slopes, sinks, softmax_scale,
                           causal, window_left, window_right, softcap, rotary_interleaved,
                           num_splits, causal_align, backend, cache_leftpad=None):
    return _fwd_outputs(q, v_cache, False)


@torch.library.custom_op("flashport::merge_fwd", mutates_args=())
def _merge_fwd(out_partials: Tensor, lse_partials: Tensor, backend: int) -> Tuple[Tensor, Tensor]:
    return _merge_fwd_run(out_partials, lse_partials, backend)


@_merge_fwd.register_fake
def _merge_fwd_fake(out_partials, lse_partials, backend):
    return _merge_outputs(out_partials, lse_partials)


@torch.library.custom_op("flashport::merge_bwd", mutates_args=())
def _merge_bwd(out_partials: Tensor, lse_partials: Tensor, out: Tensor, lse: Tensor, dout: Tensor,
               dlse: Optional[Tensor], backend: int) -> Tuple[Tensor, Tensor]:
    return _merge_bwd_run(out_partials, lse_partials, out, lse, dout, dlse, backend)


@_merge_bwd.register_fake
def _merge_bwd_fake(out_partials, lse_partials, out, lse, dout, dlse, backend):
    return out_partials.new_empty(out_partials.shape), lse_partials.new_empty(lse_partials.shape)


def _merge_setup_context(ctx, inputs, output):
    out_partials, lse_partials, backend = inputs
    out, lse = output
    ctx.save_for_backward(out_partials, lse_partials, out, lse)
    ctx.backend = backend


def _merge_backward(ctx, dout, dlse):
    out_partials, lse_partials, out, lse = ctx.saved_tensors
    if dout is None:
        dout = torch.zeros_like(out)
    d_out_partials, d_lse_partials = torch.ops.flashport.merge_bwd(
        out_partials, lse_partials, out, lse, dout, dlse, ctx.backend)
    return d_out_partials, d_lse_partials, None


torch.library.register_autograd("flashport::merge_fwd", _merge_backward,
                                setup_context=_merge_setup_context)


# --------------------------------------------------------------------------------------------
# S_dmask for return_attn_probs (testing aid, as in flash_attn): fp_attn_probs on the device
# --------------------------------------------------------------------------------------------

def _probs_dims(q, k, cu_q, cu_k, max_q, max_k, block_table):
    if cu_q is None:
        b, sq, hq = q.shape[0], q.shape[1], q.shape[2]
    else:
        b, sq, hq = cu_q.shape[0] - 1, max_q, q.shape[1]
    if block_table is not None:
        sk = block_table.shape[1] * k.shape[1]
    else:
        sk = k.shape[1] if cu_k is None else max_k
    return b, hq, sq, sk


@torch.library.custom_op("flashport::attn_probs", mutates_args=())
def _attn_probs_op(
    q: Tensor, k: Tensor, v: Tensor, lse: Tensor, cu_seqlens_q: Optional[Tensor],
    cu_seqlens_k: Optional[Tensor], max_seqlen_q: int, max_seqlen_k: int,
    block_table: Optional[Tensor], seqused_k: Optional[Tensor], alibi_slopes: Optional[Tensor],
    sinks: Optional[Tensor], rng_state: Tensor, dropout_p: float, softmax_scale: float,
    causal: bool, window_left: int, window_right: int, softcap: float, causal_align: int,
    backend: int,
) -> Tensor:
    return _C.attn_probs(q, k, v, lse, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k,
                         block_table, seqused_k, alibi_slopes, sinks,
                         _rng_words(rng_state, q.device) if dropout_p > 0.0 else None, dropout_p,
                         softmax_scale, causal, window_left, window_right, softcap,
                         causal_align, backend)


@_attn_probs_op.register_fake
def _attn_probs_fake(q, k, v, lse, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k,
                     block_table, seqused_k, alibi_slopes, sinks, rng_state, dropout_p,
                     softmax_scale, causal, window_left, window_right, softcap, causal_align,
                     backend):
    return q.new_empty(_probs_dims(q, k, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k,
                                   block_table))


def _attn_probs(q, k, v, lse, rng, cu_q, cu_k, max_q, max_k, block_table, seqused_k, alibi,
                sinks, dropout_p, scale, causal, wl, wr, softcap, align, backend):
    """S_dmask: None without dropout (as flash_attn); with dropout the probabilities
    exp(s - lse) of the visible keys with the dropped elements negated, [B, Hq, Sq_max, Sk_max]
    in q's dtype, zero elsewhere."""
    if dropout_p == 0.0:
        return None
    with torch.no_grad():
        if _use_custom_ops(q):
            return torch.ops.flashport.attn_probs(q, k, v, lse, cu_q, cu_k, max_q, max_k,
                                                  block_table, seqused_k, alibi, sinks, rng,
                                                  dropout_p, scale, causal, wl, wr, softcap,
                                                  align, backend)
        return _C.attn_probs(q, k, v, lse, cu_q, cu_k, max_q, max_k, block_table, seqused_k,
                             alibi, sinks, rng.view(torch.int32), dropout_p, scale, causal, wl,
                             wr, softcap, align, backend)


# --------------------------------------------------------------------------------------------
# Public API (flash_attn 2.8 signatures)
# --------------------------------------------------------------------------------------------

def flash_attn_func(
    q,
    k,
    v,
    dropout_p=0.0,
    softmax_scale=None,
    causal=False,
    window_size=(-1, -1),  # -1 means infinite context window
    softcap=0.0,  # 0.0 means deactivated
    alibi_slopes=None,
    deterministic=False,
    return_attn_probs=False,
    *,
    sinks=None,
    causal_align="bottom_right",
    num_splits=0,
    backend=None,
):
    """flash_attn.flash_attn_func. q [B, Sq, Hq, D], k/v [B, Sk, Hkv, D|Dv] -> out [B, Sq, Hq, Dv];
    with return_attn_probs: (out, softmax_lse [B, Hq, Sq], S_dmask or None). See the module
    docstring."""
    wl, wr = _window(window_size)
    align = _align_id(causal_align)
    args = (None, None, 0, 0, None, None, alibi_slopes, sinks, float(dropout_p),
            _scale(softmax_scale), bool(causal), wl, wr, float(softcap), align)
    out, lse, rng = _attention(q, k, v, *args, int(num_splits), bool(deterministic),
                               _backend_id(backend))
    if not return_attn_probs:
        return out
    return out, lse, _attn_probs(q, k, v, lse, rng, *args, _backend_id(backend))


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
    window_size=(-1, -1),  # -1 means infinite context window
    softcap=0.0,  # 0.0 means deactivated
    alibi_slopes=None,
    deterministic=False,
    return_attn_probs=False,
    block_table=None,
    *,
    sinks=None,
    causal_align="bottom_right",
    num_splits=0,
    backend=None,
):
    """flash_attn.flash_attn_varlen_func. q [Tq, Hq, D], k/v [Tk, Hkv, D|Dv] (or a paged cache
    [num_blocks, page_size, Hkv, D|Dv] with block_table), cu_seqlens int32 [B+1] -> out
    [Tq, Hq, Dv]; with return_attn_probs: (out, softmax_lse [Hq, Tq], S_dmask or None)."""
    wl, wr = _window(window_size)
    align = _align_id(causal_align)
    seqused_k, cu_k = None, cu_seqlens_k
    if block_table is not None:
        # Paged keys: the C API takes their per-sequence lengths as seqused_k.
        seqused_k = (cu_seqlens_k[1:] - cu_seqlens_k[:-1]).to(torch.int32)
        cu_k = None
    args = (cu_seqlens_q, cu_k, int(max_seqlen_q), int(max_seqlen_k), block_table, seqused_k,
            alibi_slopes, sinks, float(dropout_p), _scale(softmax_scale), bool(causal), wl, wr,
            float(softcap), align)
    out, lse, rng = _attention(q, k, v, *args, int(num_splits), bool(deterministic),
                               _backend_id(backend))
    if not return_attn_probs:
        return out
    return out, lse, _attn_probs(q, k, v, lse, rng, *args, _backend_id(backend))


def flash_attn_with_kvcache(
    q,
    k_cache,
    v_cache,
    k=None,
    v=None,
    rotary_cos=None,
    rotary_sin=None,
    cache_seqlens: Optional[Union[(int, torch.Tensor)]] = None,
    cache_batch_idx: Optional[torch.Tensor] = None,
    cache_leftpad: Optional[torch.Tensor] = None,
    block_table: Optional[torch.Tensor] = None,
    softmax_scale=None,
    causal=False,
    window_size=(-1, -1),  # -1 means infinite context window
    softcap=0.0,  # 0.0 means deactivated
    rotary_interleaved=True,
    alibi_slopes=None,
    num_splits=0,
    return_softmax_lse=False,
    *,
    sinks=None,
    causal_align="bottom_right",
    backend=None,
):
    """flash_attn.flash_attn_with_kvcache: appends k/v into the cache in place at cache_seqlens
    (after rotary), then attends over the cache rows [cache_leftpad, cache_seqlens + Snew).
    Returns out, or (out, softmax_lse) with return_softmax_lse. No backward (as in flash_attn)."""
    if (k is None) != (v is None):
        raise ValueError("flashport: k and v must be given together")
    if cache_seqlens is not None and isinstance(cache_seqlens, int):
        cache_seqlens = torch.full((q.shape[0],), cache_seqlens, dtype=torch.int32,
                                   device=k_cache.device)
    wl, wr = _window(window_size)
    args = (q, k_cache, v_cache, k, v, rotary_cos, rotary_sin, cache_seqlens, cache_batch_idx,
            block_table, alibi_slopes, sinks, _scale(softmax_scale), bool(causal), wl, wr,
            float(softcap), bool(rotary_interleaved), int(num_splits), _align_id(causal_align),
            _backend_id(backend))
    if _use_custom_ops(q):
        out, lse = torch.ops.flashport.attn_fwd_kvcache(*args, cache_leftpad)
    else:
        out, lse = _kvcache_fwd(*args, cache_leftpad)
        if k is not None:  # the in-place append, as a custom op's mutation would record it
            torch.autograd.graph.increment_version(k_cache)
            torch.autograd.graph.increment_version(v_cache)
    return (out, lse) if return_softmax_lse else out


# Packed variants (flash_attn 2.8 signatures): views into the packed tensor; autograd of the
# slicing assembles the packed gradient.

def flash_attn_qkvpacked_func(
    qkv,
    dropout_p=0.0,
    softmax_scale=None,
    causal=False,
    window_size=(-1, -1),
    softcap=0.0,
    alibi_slopes=None,
    deterministic=False,
    return_attn_probs=False,
    *,
    sinks=None,
    causal_align="bottom_right",
    num_splits=0,
    backend=None,
):
    """qkv [B, S, 3, H, D]; as flash_attn_func."""
    extras = dict(sinks=sinks, causal_align=causal_align, num_splits=num_splits, backend=backend)
    return flash_attn_func(qkv[:, :, 0], qkv[:, :, 1], qkv[:, :, 2], dropout_p, softmax_scale,
                           causal, window_size, softcap, alibi_slopes, deterministic,
                           return_attn_probs, **extras)


def flash_attn_kvpacked_func(
    q,
    kv,
    dropout_p=0.0,
    softmax_scale=None,
    causal=False,
    window_size=(-1, -1),
    softcap=0.0,
    alibi_slopes=None,
    deterministic=False,
    return_attn_probs=False,
    *,
    sinks=None,
    causal_align="bottom_right",
    num_splits=0,
    backend=None,
):
    """q [B, Sq, Hq, D], kv [B, Sk, 2, Hkv, D]; as flash_attn_func."""
    extras = dict(sinks=sinks, causal_align=causal_align, num_splits=num_splits, backend=backend)
    return flash_attn_func(q, kv[:, :, 0], kv[:, :, 1], dropout_p, softmax_scale, causal,
                           window_size, softcap, alibi_slopes, deterministic, return_attn_probs,
                           **extras)


def flash_attn_varlen_qkvpacked_func(
    qkv,
    cu_seqlens,
    max_seqlen,
    dropout_p=0.0,
    softmax_scale=None,
    causal=False,
    window_size=(-1, -1),
    softcap=0.0,
    alibi_slopes=None,
    deterministic=False,
    return_attn_probs=False,
    *,
    sinks=None,
    causal_align="bottom_right",
    num_splits=0,
    backend=None,
):
    """qkv [T, 3, H, D]; as flash_attn_varlen_func."""
    extras = dict(sinks=sinks, causal_align=causal_align, num_splits=num_splits, backend=backend)
    return flash_attn_varlen_func(qkv[:, 0], qkv[:, 1], qkv[:, 2], cu_seqlens, cu_seqlens,
                                  max_seqlen, max_seqlen, dropout_p, softmax_scale, causal,
                                  window_size, softcap, alibi_slopes, deterministic,
                                  return_attn_probs, **extras)


def flash_attn_varlen_kvpacked_func(
    q,
    kv,
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
    *,
    sinks=None,
    causal_align="bottom_right",
    num_splits=0,
    backend=None,
):
    """q [Tq, Hq, D], kv [Tk, 2, Hkv, D]; as flash_attn_varlen_func."""
    extras = dict(sinks=sinks, causal_align=causal_align, num_splits=num_splits, backend=backend)
    return flash_attn_varlen_func(q, kv[:, 0], kv[:, 1], cu_seqlens_q, cu_seqlens_k, max_seqlen_q,
                                  max_seqlen_k, dropout_p, softmax_scale, causal, window_size,
                                  softcap, alibi_slopes, deterministic, return_attn_probs,
                                  **extras)


def merge_attn_states(out_partials, lse_partials, *, backend=None):
    """Merges partial attention results computed over disjoint key sets into one:
        lse = log sum_i exp(lse_i),  out = sum_i exp(lse_i - lse) * out_i.
    out_partials [N, B, S, H, Dv] with lse_partials [N, B, H, S] (or packed [N, T, H, Dv] with
    [N, H, T]); a list of N tensors is stacked. Returns (out, lse). Differentiable in both."""
    if isinstance(out_partials, (list, tuple)):
        out_partials = torch.stack(list(out_partials))
    if isinstance(lse_partials, (list, tuple)):
        lse_partials = torch.stack(list(lse_partials))
    backend = _backend_id(backend)
    if _use_custom_ops(out_partials):
        return torch.ops.flashport.merge_fwd(out_partials, lse_partials, backend)
    if torch.is_grad_enabled() and (out_partials.requires_grad or lse_partials.requires_grad):
        return _Merge.apply(out_partials, lse_partials, backend)
    return _merge_fwd_run(out_partials, lse_partials, backend)
