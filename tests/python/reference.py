"""fp64 oracles for the Python tests, written from the semantics in include/flashport/flashport.h
(independently of the library): attention with every mask option, the Philox dropout rule, rotary,
and the merge of partial results. Plain torch ops, so autograd in fp64 gives the gradient oracle,
and the same code run in a low precision gives the "naive same-precision" error that sets the
tolerances (as flash_attn's own tests do)."""
import math

import numpy as np
import torch

# ---------------------------------------------------------------------------------------------
# Attention over one sequence
# ---------------------------------------------------------------------------------------------


def attention_one(q, k, v, *, scale=None, causal=False, window=(-1, -1), softcap=0.0, alibi=None,
                  sinks=None, align="bottom_right", keep=None, dropout_p=0.0):
    """q [Lq, Hq, D], k [Lk, Hkv, D], v [Lk, Hkv, Dv] -> out [Lq, Hq, Dv], lse [Hq, Lq].

    Runs in q's dtype (fp64 for the oracle). alibi: [Hq] slopes; sinks: [Hq] logits;
    keep: bool [Hq, Lq, Lk] dropout pattern."""
    lq, hq, d = q.shape
    lk, hkv = k.shape[0], k.shape[1]
    g = hq // hkv
    kk = k.repeat_interleave(g, dim=1)
    vv = v.repeat_interleave(g, dim=1)
    scale = 1.0 / math.sqrt(d) if scale is None else scale
    s = torch.einsum("ihd,jhd->hij", q, kk) * scale
    if softcap > 0:
        s = softcap * torch.tanh(s / softcap)
    shift = lk - lq if align == "bottom_right" else 0
    i = torch.arange(lq, device=q.device)[:, None]
    j = torch.arange(lk, device=q.device)[None, :]
    if alibi is not None:
        s = s - alibi.to(s.dtype)[:, None, None] * (i + shift - j).abs().to(s.dtype)
    wl, wr = window
    if causal:
        wr = 0
    visible = torch.ones(lq, lk, dtype=torch.bool, device=q.device)
    if wl >= 0:
        visible = visible & (j >= i + shift - wl)
    if wr >= 0:
        visible = visible & (j <= i + shift + wr)
    s = s.masked_fill(~visible, float("-inf"))
    if sinks is not None:
        sink_col = sinks.to(s.dtype)[:, None, None].expand(hq, lq, 1)
        lse = torch.logsumexp(torch.cat([s, sink_col], dim=-1), dim=-1)
    else:
        lse = torch.logsumexp(s, dim=-1)
    lse_safe = torch.where(torch.isinf(lse), torch.zeros_like(lse), lse)
    p = torch.exp(s - lse_safe[..., None])  # masked entries: exp(-inf) = 0
    if keep is not None:
        p = torch.where(keep, p / keep_rate(dropout_p), torch.zeros_like(p))
    out = torch.einsum("hij,jhd->ihd", p, vv)
    return out, lse


def probs_one(q, k, lse, *, scale, causal=False, window=(-1, -1), softcap=0.0, alibi=None,
              align="bottom_right"):
    """Softmax probabilities exp(s - lse) of the visible keys, [Hq, Lq, Lk] (fp64)."""
    lq, hq, d = q.shape
    lk, hkv = k.shape[0], k.shape[1]
    kk = k.repeat_interleave(hq // hkv, dim=1)
    s = torch.einsum("ihd,jhd->hij", q, kk) * scale
    if softcap > 0:
        s = softcap * torch.tanh(s / softcap)
    shift = lk - lq if align == "bottom_right" else 0
    i = torch.arange(lq)[:, None]
    j = torch.arange(lk)[None, :]
    if alibi is not None:
        s = s - alibi[:, None, None] * (i + shift - j).abs().double()
    wl, wr = window
    if causal:
        wr = 0
    visible = torch.ones(lq, lk, dtype=torch.bool)
    if wl >= 0:
        visible &= j >= i + shift - wl
    if wr >= 0:
        visible &= j <= i + shift + wr
    return torch.exp(s - lse[..., None]).masked_fill(~visible, 0.0)


def attention_batched(q, k, v, *, alibi=None, keep=None, **kw):
    """q [B, Sq, Hq, D], k/v [B, Sk, Hkv, D|Dv] -> out [B, Sq, Hq, Dv], lse [B, Hq, Sq].
    alibi: [Hq] or [B, Hq]; keep: [B, Hq, Sq, Sk]."""
    outs, lses = [], []
    for b in range(q.shape[0]):
        slopes = None if alibi is None else (alibi if alibi.dim() == 1 else alibi[b])
        o, l = attention_one(q[b], k[b], v[b], alibi=slopes,
                             keep=None if keep is None else keep[b], **kw)
        outs.append(o)
        lses.append(l)
    return torch.stack(outs), torch.stack(lses)


def attention_varlen(q, k, v, cu_q, cu_k, *, alibi=None, keep=None, **kw):
    """q [Tq, Hq, D], k/v [Tk, Hkv, D|Dv] -> out [Tq, Hq, Dv], lse [Hq, Tq]."""
    cq, ck = [int(x) for x in cu_q], [int(x) for x in cu_k]
    outs, lses = [], []
    for b in range(len(cq) - 1):
        slopes = None if alibi is None else (alibi if alibi.dim() == 1 else alibi[b])
        lq, lk = cq[b + 1] - cq[b], ck[b + 1] - ck[b]
        o, l = attention_one(q[cq[b]:cq[b + 1]], k[ck[b]:ck[b + 1]], v[ck[b]:ck[b + 1]],
                             alibi=slopes, keep=None if keep is None else keep[b, :, :lq, :lk],
                             **kw)
        outs.append(o)
        lses.append(l)
    return torch.cat(outs), torch.cat(lses, dim=1)


# ---------------------------------------------------------------------------------------------
# Philox4x32-10 dropout rule (flashport.h / philox.hpp), in numpy
# ---------------------------------------------------------------------------------------------

_M32 = np.uint64(0xFFFFFFFF)


def _philox4x32_10(c0, c1, c2, c3, k0, k1):
    c0, c1, c2, c3 = (np.asarray(x, dtype=np.uint64) for x in (c0, c1, c2, c3))
    k0, k1 = np.uint64(k0), np.uint64(k1)
    for r in range(10):
        if r > 0:
            k0 = (k0 + np.uint64(0x9E3779B9)) & _M32
            k1 = (k1 + np.uint64(0xBB67AE85)) & _M32
        p0 = np.uint64(0xD2511F53) * c0
        p1 = np.uint64(0xCD9E8D57) * c2
        hi0, lo0 = p0 >> np.uint64(32), p0 & _M32
        hi1, lo1 = p1 >> np.uint64(32), p1 & _M32
        c0, c1, c2, c3 = hi1 ^ c1 ^ k0, lo1, hi0 ^ c3 ^ k1, lo0
    return c0, c1, c2, c3


def dropout_threshold(p):
    """The 8-bit keep threshold: round(p * 256), clamped to [1, 255] for p > 0."""
    return 0 if p <= 0 else min(255, max(1, int(math.floor(float(np.float32(p)) * 256.0 + 0.5))))


def keep_rate(p):
    """The fraction of elements kept; kept values are scaled by its inverse."""
    return (256 - dropout_threshold(p)) / 256.0


def dropout_keep(seed, offset, batch, hq, sq, sk, p):
    """bool [B, Hq, Sq, Sk]: element kept iff its Philox byte >= the threshold. One call per 16
    keys (counter j // 16); key j's byte is byte j % 4 of word (j // 4) % 4."""
    seed, offset = int(seed) & (2**64 - 1), int(offset) & (2**64 - 1)
    threshold = dropout_threshold(p)
    b, h, i, j = np.meshgrid(np.arange(batch), np.arange(hq), np.arange(sq), np.arange(sk),
                             indexing="ij")
    stream = (np.uint64(offset) + (b * hq + h).astype(np.uint64))
    words = _philox4x32_10((j >> 4).astype(np.uint64), i.astype(np.uint64), stream & _M32,
                           stream >> np.uint64(32), seed & 0xFFFFFFFF, seed >> 32)
    word = np.choose((j >> 2) & 3, words)
    byte = (word >> (np.uint64(8) * (j & 3).astype(np.uint64))) & np.uint64(0xFF)
    return torch.from_numpy(byte >= np.uint64(threshold))


# ---------------------------------------------------------------------------------------------
# Rotary and merge
# ---------------------------------------------------------------------------------------------


def rotary(x, cos, sin, positions, interleaved):
    """x [L, H, D]; rotates the first 2*cos.shape[1] dims of row r at positions[r]."""
    half = cos.shape[1]
    rd = 2 * half
    c = cos[positions].to(x.dtype)[:, None, :]  # [L, 1, half]
    s = sin[positions].to(x.dtype)[:, None, :]
    rot, rest = x[..., :rd], x[..., rd:]
    if interleaved:
        x1, x2 = rot[..., 0::2], rot[..., 1::2]
        y1, y2 = x1 * c - x2 * s, x1 * s + x2 * c
        out = torch.stack([y1, y2], dim=-1).flatten(-2)
    else:
        x1, x2 = rot[..., :half], rot[..., half:]
        out = torch.cat([x1 * c - x2 * s, x1 * s + x2 * c], dim=-1)
    return torch.cat([out, rest], dim=-1)


def merge(out_partials, lse_partials, packed=False):
    """[N, B, S, H, Dv] + [N, B, H, S] (or [N, T, H, Dv] + [N, H, T]) -> out, lse."""
    empty = torch.isinf(lse_partials).all(dim=0)  # rows where every partial is empty
    lp = torch.where(empty[None], torch.zeros_like(lse_partials), lse_partials)  # no NaN grads
    lse_safe = torch.logsumexp(lp, dim=0)
    lse = torch.where(empty, torch.full_like(lse_safe, float("-inf")), lse_safe)
    w = torch.exp(lp - lse_safe) * (~empty)  # [N, B, H, S] or [N, H, T]
    w = w.transpose(-1, -2)[..., None]      # [N, B, S, H, 1] or [N, T, H, 1]
    return (w * out_partials).sum(0), lse


# ---------------------------------------------------------------------------------------------
# Tolerances
# ---------------------------------------------------------------------------------------------

EPS = {torch.float16: 2.0**-10, torch.bfloat16: 2.0**-7, torch.float32: 2.0**-23,
       torch.float64: 2.0**-52}


def assert_close_to_ref(got, ref64, naive, name, factor=2.0, fp32_floor=1e-5):
    """|got - ref| <= factor * |naive - ref| + a few ulps of the dtype, elementwise max.
    `naive` is the same computation done in got's precision (None: ulps and floor only).
    fp32_floor (relative to the largest reference value) allows for fp32 accumulation over long
    reductions, where a short naive fp32 computation beats any blocked algorithm."""
    got64 = got.detach().double().cpu()
    ref64 = ref64.detach().double().cpu()
    assert torch.isfinite(got64).all(), f"{name}: non-finite values"
    err = (got64 - ref64).abs().max().item() if got64.numel() else 0.0
    naive_err = 0.0
    if naive is not None and naive.numel():
        naive_err = (naive.detach().double().cpu() - ref64).abs().max().item()
    scale = max(1.0, ref64.abs().max().item() if ref64.numel() else 1.0)
    tol = factor * naive_err + 4 * EPS[got.dtype] * scale + fp32_floor * scale
    assert err <= tol, f"{name}: max error {err:.3e} > tol {tol:.3e} (naive {naive_err:.3e})"


def assert_lse_close(got, ref64, name="lse"):
    got64 = got.detach().double().cpu()
    ref64 = ref64.detach().double().cpu()
    assert got64.shape == ref64.shape, f"{name}: shape {tuple(got64.shape)} != {tuple(ref64.shape)}"
    inf_ref = torch.isinf(ref64)
    assert torch.equal(torch.isinf(got64), inf_ref), f"{name}: -inf rows differ"
    assert not torch.isnan(got64).any(), f"{name}: NaN"
    fin = ~inf_ref
    if fin.any():
        err = (got64[fin] - ref64[fin]).abs()
        tol = 2e-5 * (1 + ref64[fin].abs())
        assert (err <= tol).all(), f"{name}: max error {err.max().item():.3e}"
