"""flashport.torch: flash_attn 2.8's Python API on flashport.

    from flashport.torch import flash_attn_func, flash_attn_varlen_func, flash_attn_with_kvcache

Same signatures, defaults, argument order and return conventions as flash_attn 2.8, so code runs by
changing the import. flashport extras are keyword-only: ``sinks`` (per-head sink logits),
``causal_align`` ("bottom_right" as flash_attn, or "top_left" as torch SDPA), ``backend`` (force a
backend, e.g. "reference") and, for flash_attn_func/varlen, ``num_splits``.

The kernels are torch.library custom ops (namespace ``flashport``) with fake implementations, so
torch.compile(fullgraph=True) traces them, and autograd formulas (backward on every backend that has
one). CPU and CUDA tensors; GPU calls run on the current CUDA stream with workspace from torch's
caching allocator.

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
  * ``cache_leftpad`` is not supported: passing it raises NotImplementedError.
  * The softmax LSE returned by return_attn_probs / return_softmax_lse is not differentiable (as in
    flash_attn, whose backward ignores its gradient); it is marked non-differentiable here.
  * ``S_dmask`` (return_attn_probs=True) is computed exactly, not as a kernel by-product: the
    softmax probabilities P = exp(s - lse) of the visible keys, shape [B, Hq, Sq, Sk] (varlen:
    [B, Hq, max_seqlen_q, max_seqlen_k], zero padded; no rounding to 128), with dropped elements
    negated when dropout_p > 0 (flash_attn's encoding). It costs an extra O(Sq * Sk) pass and is
    meant for testing, as in flash_attn.
"""
import math
import sys
from typing import List, Optional, Sequence, Tuple, Union

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

_U64 = (1 << 64) - 1
# The int64 [2] rng_state is passed to the C API as its int32 view: {seed lo, seed hi, offset lo,
# offset hi} needs little-endian words.
assert sys.byteorder == "little", "flashport.torch: dropout_rng layout assumes a little-endian host"


# --------------------------------------------------------------------------------------------
# Helpers (run inside the custom ops: real tensors only)
# --------------------------------------------------------------------------------------------

def _dl(t: Optional[Tensor]):
    """A DLPack capsule of t (no stream synchronisation: we run on the current stream)."""
    if t is None:
        return None
    return t.detach().__dlpack__(stream=-1)


def _stream(device: torch.device) -> int:
    return torch.cuda.current_stream(device).cuda_stream if device.type == "cuda" else 0


def _allocator(device: torch.device):
    """Workspace from torch's caching allocator; the list keeps it alive for the call."""
    held: List[Tensor] = []

    def alloc(nbytes: int) -> int:
        t = torch.empty(nbytes, dtype=torch.uint8, device=device)
        held.append(t)
        return t.data_ptr()

    return alloc, held


def _tensors(**kw) -> dict:
    return {k: _dl(v) for k, v in kw.items() if v is not None}


def _lse_dtype(q: Tensor) -> torch.dtype:
    return torch.float64 if q.dtype == torch.float64 else torch.float32


def _draw_dropout_rng(rng: Tensor) -> None:
    """Fills rng (int64 [2] on the tensors' device) with one dropout call's (seed, offset): two
    uniformly random 64-bit words from torch's default generator of that device, drawn by a torch
    random op on the current stream, so under CUDA-graph capture every replay draws anew (torch's
    graph-safe generator state) and nothing is read on the host. See the module docstring."""
    rng.random_(-(1 << 63), None)  # [-2^63, 2^63 - 1]: every 64-bit pattern


def _rng_words(rng_state: Tensor, device: torch.device) -> Tensor:
    """The C API's dropout_rng (int32 [4] {seed lo, seed hi, offset lo, offset hi}) as a view of
    the int64 [2] rng_state (seed, offset); no copy, no host read."""
    if rng_state.dtype != torch.int64 or tuple(rng_state.shape) != (2,) or \
            rng_state.device != device:
        raise ValueError(f"flashport: rng_state must be the int64 [2] (seed, offset) tensor on "
                         f"{device} that the forward returned; got {rng_state.dtype} "
                         f"{tuple(rng_state.shape)} on {rng_state.device}")
    return rng_state.contiguous().view(torch.int32)


def _backend_id(backend) -> int:
    if backend is None:
        return int(Backend.AUTO)
    if isinstance(backend, str):
        try:
            return int(Backend[backend.upper()])
        except KeyError:
            raise ValueError(f"flashport: unknown backend {backend!r}; one of "
                             f"{[b.name.lower() for b in Backend]}") from None
    return int(Backend(backend))


_ALIGN_IDS = {"bottom_right": int(CausalAlign.BOTTOM_RIGHT), "top_left": int(CausalAlign.TOP_LEFT)}


def _align_id(causal_align) -> int:
    if isinstance(causal_align, str):
        align = _ALIGN_IDS.get(causal_align.lower())
        if align is None:
            raise ValueError(f"flashport: causal_align must be 'bottom_right' or 'top_left', "
                             f"got {causal_align!r}")
        return align
    return int(CausalAlign(causal_align))


def _window(window_size) -> Tuple[int, int]:
    if len(window_size) != 2:
        raise ValueError(f"flashport: window_size must be (left, right), got {window_size!r}")
    return int(window_size[0]), int(window_size[1])


def _maybe_contiguous(x: Optional[Tensor]) -> Optional[Tensor]:
    return x.contiguous() if x is not None and x.stride(-1) != 1 else x


def _scale(q: Tensor, softmax_scale) -> float:
    return float(q.shape[-1] ** (-0.5) if softmax_scale is None else softmax_scale)


# --------------------------------------------------------------------------------------------
# Custom ops: forward / backward (batched and varlen), KV cache forward, merge
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
    out, lse, rng = _attn_fwd_fake(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k,
                                   block_table, seqused_k, alibi_slopes, sinks, dropout_p,
                                   softmax_scale, causal, window_left, window_right, softcap,
                                   causal_align, num_splits, deterministic, backend)
    scalars = dict(softmax_scale=softmax_scale, causal=int(causal), causal_align=causal_align,
                   window_left=window_left, window_right=window_right, softcap=softcap,
                   dropout_p=dropout_p, num_splits=num_splits, backend=backend)
    if cu_seqlens_q is not None:
        scalars.update(max_seqlen_q=max_seqlen_q)
    if cu_seqlens_k is not None:
        scalars.update(max_seqlen_k=max_seqlen_k)
    dropout_rng = None
    if dropout_p > 0.0:
        _draw_dropout_rng(rng)
        dropout_rng = _rng_words(rng, q.device)
    alloc, _held = _allocator(q.device)
    _C.attn_fwd(_tensors(q=q, k=k, v=v, out=out, lse=lse, cu_seqlens_q=cu_seqlens_q,
                         cu_seqlens_k=cu_seqlens_k, block_table=block_table, seqused_k=seqused_k,
                         alibi_slopes=alibi_slopes, sinks=sinks, dropout_rng=dropout_rng),
                scalars, _stream(q.device), alloc)
    return out, lse, rng


@_attn_fwd.register_fake
def _attn_fwd_fake(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, block_table,
                   seqused_k, alibi_slopes, sinks, dropout_p, softmax_scale, causal, window_left,
                   window_right, softcap, causal_align, num_splits, deterministic, backend):
    out = q.new_empty((*q.shape[:-1], v.shape[-1]))
    if cu_seqlens_q is None:  # q [B, Sq, Hq, D] -> lse [B, Hq, Sq]
        lse = q.new_empty((q.shape[0], q.shape[2], q.shape[1]), dtype=_lse_dtype(q))
    else:  # q [Tq, Hq, D] -> lse [Hq, Tq]
        lse = q.new_empty((q.shape[1], q.shape[0]), dtype=_lse_dtype(q))
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
    dq, dk, dv, d_sinks = _attn_bwd_fake(dout, q, k, v, out, lse, cu_seqlens_q, cu_seqlens_k,
                                         max_seqlen_q, max_seqlen_k, block_table, seqused_k,
                                         alibi_slopes, sinks, rng_state, dropout_p,
                                         softmax_scale, causal, window_left, window_right,
                                         softcap, causal_align, deterministic, backend)
    scalars = dict(softmax_scale=softmax_scale, causal=int(causal), causal_align=causal_align,
                   window_left=window_left, window_right=window_right, softcap=softcap,
                   dropout_p=dropout_p, backend=backend, deterministic=int(deterministic))
    if cu_seqlens_q is not None:
        scalars.update(max_seqlen_q=max_seqlen_q)
    if cu_seqlens_k is not None:
        scalars.update(max_seqlen_k=max_seqlen_k)
    # The forward's saved (seed, offset), read by the kernels where it lives (graph-safe).
    dropout_rng = _rng_words(rng_state, q.device) if dropout_p > 0.0 else None
    alloc, _held = _allocator(q.device)
    _C.attn_bwd(_tensors(dout=_maybe_contiguous(dout), q=q, k=k, v=v, out=out, lse=lse,
                         cu_seqlens_q=cu_seqlens_q, cu_seqlens_k=cu_seqlens_k,
                         block_table=block_table, seqused_k=seqused_k,
                         alibi_slopes=alibi_slopes, sinks=sinks, dq=dq, dk=dk, dv=dv,
                         d_sinks=d_sinks if sinks is not None else None,
                         dropout_rng=dropout_rng),
                scalars, _stream(q.device), alloc)
    return dq, dk, dv, d_sinks


@_attn_bwd.register_fake
def _attn_bwd_fake(dout, q, k, v, out, lse, cu_seqlens_q, cu_seqlens_k, max_seqlen_q,
                   max_seqlen_k, block_table, seqused_k, alibi_slopes, sinks, rng_state, dropout_p,
                   softmax_scale, causal, window_left, window_right, softcap, causal_align,
                   deterministic, backend):
    d_sinks = (torch.empty_like(sinks, dtype=torch.float32) if sinks is not None
               else q.new_empty((0,), dtype=torch.float32))
    return torch.empty_like(q), torch.empty_like(k), torch.empty_like(v), d_sinks


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
    num_splits: int, causal_align: int, backend: int,
) -> Tuple[Tensor, Tensor]:
    out, lse = _attn_fwd_kvcache_fake(q, k_cache, v_cache, k, v, rotary_cos, rotary_sin,
                                      cache_seqlens, cache_batch_idx, block_table, alibi_slopes,
                                      sinks, softmax_scale, causal, window_left, window_right,
                                      softcap, rotary_interleaved, num_splits, causal_align,
                                      backend)
    scalars = dict(softmax_scale=softmax_scale, causal=int(causal), causal_align=causal_align,
                   window_left=window_left, window_right=window_right, softcap=softcap,
                   rotary_interleaved=int(rotary_interleaved), num_splits=num_splits,
                   backend=backend)
    alloc, _held = _allocator(q.device)
    _C.attn_fwd(_tensors(q=q, k=k_cache, v=v_cache, out=out, lse=lse, k_new=k, v_new=v,
                         rotary_cos=rotary_cos, rotary_sin=rotary_sin, seqused_k=cache_seqlens,
                         cache_batch_idx=cache_batch_idx, block_table=block_table,
                         alibi_slopes=alibi_slopes, sinks=sinks),
                scalars, _stream(q.device), alloc)
    return out, lse


@_attn_fwd_kvcache.register_fake
def _attn_fwd_kvcache_fake(q, k_cache, v_cache, k, v, rotary_cos, rotary_sin, cache_seqlens,
                           cache_batch_idx, block_table, alibi_slopes, sinks, softmax_scale,
                           causal, window_left, window_right, softcap, rotary_interleaved,
                           num_splits, causal_align, backend):
    out = q.new_empty((*q.shape[:-1], v_cache.shape[-1]))
    lse = q.new_empty((q.shape[0], q.shape[2], q.shape[1]), dtype=_lse_dtype(q))
    return out, lse


@torch.library.custom_op("flashport::merge_fwd", mutates_args=())
def _merge_fwd(out_partials: Tensor, lse_partials: Tensor, backend: int) -> Tuple[Tensor, Tensor]:
    out, lse = _merge_fwd_fake(out_partials, lse_partials, backend)
    _C.merge_fwd(_tensors(out_partials=out_partials, lse_partials=lse_partials, out=out, lse=lse),
                 backend, _stream(out_partials.device))
    return out, lse


@_merge_fwd.register_fake
def _merge_fwd_fake(out_partials, lse_partials, backend):
    return (out_partials.new_empty(out_partials.shape[1:]),
            lse_partials.new_empty(lse_partials.shape[1:]))


@torch.library.custom_op("flashport::merge_bwd", mutates_args=())
def _merge_bwd(out_partials: Tensor, lse_partials: Tensor, out: Tensor, lse: Tensor, dout: Tensor,
               dlse: Optional[Tensor], backend: int) -> Tuple[Tensor, Tensor]:
    d_out_partials, d_lse_partials = _merge_bwd_fake(out_partials, lse_partials, out, lse, dout,
                                                     dlse, backend)
    _C.merge_bwd(_tensors(out_partials=out_partials, lse_partials=lse_partials, out=out, lse=lse,
                          dout=_maybe_contiguous(dout), dlse=_maybe_contiguous(dlse),
                          d_out_partials=d_out_partials, d_lse_partials=d_lse_partials),
                 backend, _stream(out_partials.device))
    return d_out_partials, d_lse_partials


@_merge_bwd.register_fake
def _merge_bwd_fake(out_partials, lse_partials, out, lse, dout, dlse, backend):
    return torch.empty_like(out_partials), torch.empty_like(lse_partials)


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
# S_dmask for return_attn_probs (testing aid, as in flash_attn)
# --------------------------------------------------------------------------------------------

def _probs_one(q, k, lse, keep, scale, causal, wl, wr, softcap, slopes, align):
    """P for one sequence: q [Lq, Hq, D], k [Lk, Hkv, D], lse [Hq, Lq] -> [Hq, Lq, Lk]."""
    lq, hq = q.shape[0], q.shape[1]
    lk, hkv = k.shape[0], k.shape[1]
    kk = k.float().repeat_interleave(hq // hkv, dim=1)
    s = torch.einsum("ihd,jhd->hij", q.float(), kk) * scale
    if softcap > 0:
        s = softcap * torch.tanh(s / softcap)
    shift = (lk - lq) if align == int(CausalAlign.BOTTOM_RIGHT) else 0
    i = torch.arange(lq, device=q.device)[:, None]
    j = torch.arange(lk, device=q.device)[None, :]
    if slopes is not None:
        s = s - slopes.float()[:, None, None] * (i + shift - j).abs()
    visible = torch.ones(lq, lk, dtype=torch.bool, device=q.device)
    if causal:
        wr = 0
    if wl >= 0:
        visible &= j >= i + shift - wl
    if wr >= 0:
        visible &= j <= i + shift + wr
    p = torch.exp(s - lse.float()[:, :, None]).masked_fill(~visible, 0.0)
    if keep is not None:
        p = torch.where(keep, p, -p)
    return p


def _attn_probs(q, k, lse, rng, dropout_p, scale, causal, window, softcap, alibi, align,
                cu_q=None, cu_k=None, max_q=0, max_k=0, block_table=None):
    if block_table is not None:
        raise NotImplementedError("flashport: return_attn_probs with a paged KV cache "
                                  "(block_table) is not supported")
    wl, wr = window
    with torch.no_grad():
        if cu_q is None:
            batch, sq, hq = q.shape[0], q.shape[1], q.shape[2]
            sk = k.shape[1]
            seqs = [(q[b], k[b], lse[b]) for b in range(batch)]
        else:
            batch, hq = cu_q.numel() - 1, q.shape[1]
            sq, sk = max_q, max_k
            cq, ck = cu_q.tolist(), cu_k.tolist()
            seqs = [(q[cq[b]:cq[b + 1]], k[ck[b]:ck[b + 1]], lse[:, cq[b]:cq[b + 1]])
                    for b in range(batch)]
        keep_all = None
        if dropout_p > 0.0:
            # Host read of the (seed, offset): S_dmask is a testing aid (as in flash_attn), built
            # on the host; it syncs and so cannot be captured in a CUDA graph. Attention itself
            # never reads the rng state on the host.
            seed, offset = (int(x) & _U64 for x in rng.tolist())
            keep_all = torch.from_numpy(
                _C.dropout_keep_mask(seed, offset, batch, hq, sq, sk, float(dropout_p))
            ).to(device=q.device, dtype=torch.bool)
        s_dmask = torch.zeros((batch, hq, sq, sk), dtype=q.dtype, device=q.device)
        for b, (qb, kb, lb) in enumerate(seqs):
            lq, lk = qb.shape[0], kb.shape[0]
            slopes = None
            if alibi is not None:
                slopes = alibi if alibi.dim() == 1 else alibi[b]
            keep = None if keep_all is None else keep_all[b, :, :lq, :lk]
            s_dmask[b, :, :lq, :lk] = _probs_one(qb, kb, lb, keep, scale, causal, wl, wr, softcap,
                                                 slopes, align).to(q.dtype)
        return s_dmask


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
    with return_attn_probs: (out, softmax_lse [B, Hq, Sq], S_dmask). See the module docstring."""
    q, k, v = (_maybe_contiguous(x) for x in (q, k, v))
    scale = _scale(q, softmax_scale)
    wl, wr = _window(window_size)
    align = _align_id(causal_align)
    out, lse, rng = torch.ops.flashport.attn_fwd(
        q, k, v, None, None, 0, 0, None, None, alibi_slopes, sinks, float(dropout_p), scale,
        bool(causal), wl, wr, float(softcap), align, int(num_splits), bool(deterministic),
        _backend_id(backend))
    if not return_attn_probs:
        return out
    s_dmask = _attn_probs(q, k, lse, rng, dropout_p, scale, causal, (wl, wr), softcap,
                          alibi_slopes, align)
    return out, lse, s_dmask


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
    [Tq, Hq, Dv]; with return_attn_probs: (out, softmax_lse [Hq, Tq], S_dmask)."""
    q, k, v = (_maybe_contiguous(x) for x in (q, k, v))
    scale = _scale(q, softmax_scale)
    wl, wr = _window(window_size)
    align = _align_id(causal_align)
    seqused_k, cu_k = None, cu_seqlens_k
    if block_table is not None:
        # Paged keys: the C API takes their per-sequence lengths as seqused_k.
        seqused_k = (cu_seqlens_k[1:] - cu_seqlens_k[:-1]).to(torch.int32)
        cu_k = None
    out, lse, rng = torch.ops.flashport.attn_fwd(
        q, k, v, cu_seqlens_q, cu_k, int(max_seqlen_q), int(max_seqlen_k), block_table,
        seqused_k, alibi_slopes, sinks, float(dropout_p), scale, bool(causal), wl, wr,
        float(softcap), align, int(num_splits), bool(deterministic), _backend_id(backend))
    if not return_attn_probs:
        return out
    s_dmask = _attn_probs(q, k, lse, rng, dropout_p, scale, causal, (wl, wr), softcap,
                          alibi_slopes, align, cu_seqlens_q, cu_seqlens_k, int(max_seqlen_q),
                          int(max_seqlen_k), block_table)
    return out, lse, s_dmask


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
    (after rotary), then attends. Returns out, or (out, softmax_lse) with return_softmax_lse.
    No backward (as in flash_attn)."""
    if cache_leftpad is not None:
        raise NotImplementedError(
            "flashport: cache_leftpad is not supported (the C API has no left-padded KV cache); "
            "shift the cache rows or use flash_attn_varlen_func")
    if k_cache.stride(-1) != 1 or v_cache.stride(-1) != 1:
        raise ValueError("flashport: k_cache and v_cache must have a contiguous last dimension")
    if (k is None) != (v is None):
        raise ValueError("flashport: k and v must be given together")
    q, k, v = (_maybe_contiguous(x) for x in (q, k, v))
    if cache_seqlens is not None and isinstance(cache_seqlens, int):
        cache_seqlens = torch.full((q.shape[0],), cache_seqlens, dtype=torch.int32,
                                   device=k_cache.device)
    wl, wr = _window(window_size)
    out, lse = torch.ops.flashport.attn_fwd_kvcache(
        q, k_cache, v_cache, k, v, rotary_cos, rotary_sin, cache_seqlens,
        _maybe_contiguous(cache_batch_idx), _maybe_contiguous(block_table), alibi_slopes, sinks,
        _scale(q, softmax_scale), bool(causal), wl, wr, float(softcap), bool(rotary_interleaved),
        int(num_splits), _align_id(causal_align), _backend_id(backend))
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
    return torch.ops.flashport.merge_fwd(_maybe_contiguous(out_partials),
                                         _maybe_contiguous(lse_partials), _backend_id(backend))
