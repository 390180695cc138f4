"""flash_attn_with_kvcache: contiguous and paged caches, cache_batch_idx, in-place append, rotary,
split-KV, LSE, masks."""
import pytest
import torch

import reference as ref
from helpers import device_dtypes, eps, is_lowp, randn

fa = pytest.importorskip("flashport.torch")


def logical_cache(k_cache, b, batch_idx=None, block_table=None):
    """The keys of sequence b as one [S, H, D] tensor (gathered from pages when paged)."""
    if block_table is not None:
        return k_cache[block_table[b].long().cpu()].reshape(-1, *k_cache.shape[2:])
    row = b if batch_idx is None else int(batch_idx[b])
    return k_cache[row]


def oracle(q, k_cache, v_cache, seqlens, k_new=None, v_new=None, batch_idx=None,
           block_table=None, rot=None, dtype=torch.float64, **kw):
    """Append (with rotary) and attend, on the host, per the contract: in fp64 (the oracle), or
    in q's 16-bit dtype (the naive same-precision computation that sets the tolerance)."""
    outs, lses = [], []
    for b in range(q.shape[0]):
        kc = logical_cache(k_cache, b, batch_idx, block_table).to("cpu", dtype)
        vc = logical_cache(v_cache, b, batch_idx, block_table).to("cpu", dtype)
        qb = q[b].to("cpu", dtype)
        n = int(seqlens[b])
        kb, vb = kc[:n], vc[:n]
        if k_new is not None:
            kn, vn = k_new[b].to("cpu", dtype), v_new[b].to("cpu", dtype)
            if rot is not None:
                cos, sin, interleaved, causal_like = rot
                kn = ref.rotary(kn, cos.double(), sin.double(),
                                torch.arange(kn.shape[0]) + n, interleaved)
                qpos = (torch.arange(qb.shape[0]) + n if causal_like
                        else torch.full((qb.shape[0],), n))
                qb = ref.rotary(qb, cos.double(), sin.double(), qpos, interleaved)
            kb, vb = torch.cat([kb, kn]), torch.cat([vb, vn])
        kw_dt = {key: (val.to(dtype) if torch.is_tensor(val) else val) for key, val in kw.items()}
        o, l = ref.attention_one(qb, kb, vb, **kw_dt)
        outs.append(o)
        lses.append(l)
    return torch.stack(outs), torch.stack(lses)


DTYPES = [torch.float16, torch.bfloat16, torch.float32]


@pytest.mark.parametrize("device,dtype", device_dtypes(DTYPES))
@pytest.mark.parametrize("snew", [0, 1, 3])
@pytest.mark.parametrize("causal", [False, True])
def test_contiguous_cache_append(device, dtype, snew, causal):
    b, smax, hq, hkv, d, sq = 3, 64, 4, 2, 64, max(snew, 1)
    k_cache = randn(b, smax, hkv, d, dtype=dtype, device=device)
    v_cache = randn(b, smax, hkv, d, dtype=dtype, device=device)
    seqlens = torch.tensor([5, 0, 40], dtype=torch.int32, device=device)
    q = randn(b, sq, hq, d, dtype=dtype, device=device)
    k_new = randn(b, snew, hkv, d, dtype=dtype, device=device) if snew else None
    v_new = randn(b, snew, hkv, d, dtype=dtype, device=device) if snew else None
    k_before, v_before = k_cache.clone(), v_cache.clone()
    out, lse = fa.flash_attn_with_kvcache(q, k_cache, v_cache, k_new, v_new, cache_seqlens=seqlens,
                                          causal=causal, return_softmax_lse=True)
    out64, lse64 = oracle(q, k_before, v_before, seqlens, k_new, v_new, causal=causal)
    ref.assert_close_to_ref(out, out64, None, "out", factor=0)
    ref.assert_lse_close(lse, lse64)
    # In-place append: exactly the new rows changed, everything else untouched.
    expect_k, expect_v = k_before.clone(), v_before.clone()
    for bb in range(b):
        n = int(seqlens[bb])
        if snew:
            expect_k[bb, n:n + snew] = k_new[bb]
            expect_v[bb, n:n + snew] = v_new[bb]
    assert torch.equal(k_cache, expect_k) and torch.equal(v_cache, expect_v)


@pytest.mark.parametrize("device,dtype", device_dtypes())
@pytest.mark.parametrize("paged", [False, True])
@pytest.mark.parametrize("snew", [0, 2])
@pytest.mark.parametrize("causal", [False, True])
def test_cache_leftpad(device, dtype, paged, snew, causal):
    """cache_leftpad (flash_attn's left-padded cache): sequence b attends over its cache rows
    [pad, cache_seqlens + Snew), as the same call on its keys moved to the start of a cache;
    appended rows land at cache row cache_seqlens[b]. Contiguous and paged caches, GQA."""
    b, smax, hq, hkv, d, sq = 3, 48, 4, 2, 32, max(snew, 1)
    seqlens_l, pads_l = [20, 7, 33], [5, 0, 30]
    block_table = None
    if paged:
        page = 8
        nblocks = b * smax // page + 2
        k_cache, v_cache = (randn(nblocks, page, hkv, d, dtype=dtype, device=device)
                            for _ in range(2))
        block_table = torch.randperm(nblocks)[:b * smax // page].view(b, -1).to(torch.int32)
        block_table = block_table.to(device)
    else:
        k_cache, v_cache = (randn(b, smax, hkv, d, dtype=dtype, device=device) for _ in range(2))
    q = randn(b, sq, hq, d, dtype=dtype, device=device)
    k_new = randn(b, snew, hkv, d, dtype=dtype, device=device) if snew else None
    v_new = randn(b, snew, hkv, d, dtype=dtype, device=device) if snew else None
    seqlens = torch.tensor(seqlens_l, dtype=torch.int32, device=device)
    pads = torch.tensor(pads_l, dtype=torch.int32, device=device)
    k_before, v_before = k_cache.clone(), v_cache.clone()
    out, lse = fa.flash_attn_with_kvcache(q, k_cache, v_cache, k_new, v_new, cache_seqlens=seqlens,
                                          cache_leftpad=pads, block_table=block_table,
                                          causal=causal, return_softmax_lse=True)
    bt = None if block_table is None else block_table.cpu()

    def unpadded(cache):  # [b, smax, hkv, d]: sequence b's rows from its pad on, at row 0
        rows = [logical_cache(cache, bb, block_table=bt) for bb in range(b)]
        return torch.stack([torch.roll(r, -pads_l[bb], 0) for bb, r in enumerate(rows)])

    shifted = torch.tensor([n - p for n, p in zip(seqlens_l, pads_l)])
    out64, lse64 = oracle(q, unpadded(k_before), unpadded(v_before), shifted, k_new, v_new,
                          causal=causal)
    naive = None
    if is_lowp(dtype):
        naive, _ = oracle(q, unpadded(k_before), unpadded(v_before), shifted, k_new, v_new,
                          causal=causal, dtype=dtype)
    ref.assert_close_to_ref(out, out64, naive, "out")
    ref.assert_lse_close(lse, lse64)
    for bb in range(b):
        after = logical_cache(k_cache, bb, block_table=bt)
        before = logical_cache(k_before, bb, block_table=bt)
        n = seqlens_l[bb]
        if snew:
            assert torch.equal(after[n:n + snew], k_new[bb])
        assert torch.equal(after[:n], before[:n]) and torch.equal(after[n + snew:],
                                                                   before[n + snew:])


@pytest.mark.parametrize("device,dtype", device_dtypes())
def test_cache_seqlens_int_and_batch_idx(device, dtype):
    b, bc, smax, h, d = 2, 5, 32, 2, 32
    k_cache = randn(bc, smax, h, d, dtype=dtype, device=device)
    v_cache = randn(bc, smax, h, d, dtype=dtype, device=device)
    q = randn(b, 1, h, d, dtype=dtype, device=device)
    idx = torch.tensor([3, 1], dtype=torch.int32, device=device)
    k_new = randn(b, 1, h, d, dtype=dtype, device=device)
    v_new = randn(b, 1, h, d, dtype=dtype, device=device)
    k_before, v_before = k_cache.clone(), v_cache.clone()
    out = fa.flash_attn_with_kvcache(q, k_cache, v_cache, k_new, v_new, cache_seqlens=7,
                                     cache_batch_idx=idx)
    seqlens = torch.tensor([7, 7])
    out64, _ = oracle(q, k_before, v_before, seqlens, k_new, v_new, batch_idx=idx.cpu())
    naive = None
    if is_lowp(dtype):
        naive, _ = oracle(q, k_before, v_before, seqlens, k_new, v_new, batch_idx=idx.cpu(),
                          dtype=dtype)
    ref.assert_close_to_ref(out, out64, naive, "out")
    for bb, row in enumerate([3, 1]):
        assert torch.equal(k_cache[row, 7], k_new[bb, 0])
    untouched = [0, 2, 4]
    assert torch.equal(k_cache[untouched], k_before[untouched])


@pytest.mark.parametrize("page_size", [1, 3, 16])
@pytest.mark.parametrize("snew", [0, 2])
def test_paged_cache(device, page_size, snew):
    b, hq, hkv, d, max_blocks = 2, 4, 1, 64, 40 // page_size + 1
    nblocks = b * max_blocks + 3
    k_cache = randn(nblocks, page_size, hkv, d, dtype=torch.float16, device=device)
    v_cache = randn(nblocks, page_size, hkv, d, dtype=torch.float16, device=device)
    block_table = torch.randperm(nblocks)[:b * max_blocks].view(b, max_blocks).to(torch.int32)
    block_table = block_table.to(device)
    seqlens = torch.tensor([11, 33], dtype=torch.int32, device=device)
    q = randn(b, max(snew, 1), hq, d, dtype=torch.float16, device=device)
    k_new = randn(b, snew, hkv, d, dtype=torch.float16, device=device) if snew else None
    v_new = randn(b, snew, hkv, d, dtype=torch.float16, device=device) if snew else None
    k_before, v_before = k_cache.clone(), v_cache.clone()
    out = fa.flash_attn_with_kvcache(q, k_cache, v_cache, k_new, v_new, cache_seqlens=seqlens,
                                     block_table=block_table, causal=True)
    out64, _ = oracle(q, k_before, v_before, seqlens, k_new, v_new, block_table=block_table,
                      causal=True)
    ref.assert_close_to_ref(out, out64, None, "out", factor=0)
    if snew:  # appended rows land in the right pages
        for bb in range(b):
            logical = logical_cache(k_cache, bb, block_table=block_table)
            n = int(seqlens[bb])
            assert torch.equal(logical[n:n + snew], k_new[bb])
    else:
        assert torch.equal(k_cache, k_before)


@pytest.mark.parametrize("interleaved", [True, False])
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("rotary_dim", [16, 64])
@pytest.mark.parametrize("device,dtype", device_dtypes())
def test_rotary(device, dtype, interleaved, causal, rotary_dim):
    """Rotary (float32 cos/sin) applied to the new keys (stored rotated in the cache) and to q.
    With 16-bit inputs the rotated rows are rounded to q's dtype before attention, as in the
    naive same-precision computation that sets the tolerance."""
    b, smax, h, d, snew = 2, 48, 2, 64, 3
    k_cache = randn(b, smax, h, d, dtype=dtype, device=device)
    v_cache = randn(b, smax, h, d, dtype=dtype, device=device)
    seqlens = torch.tensor([4, 20], dtype=torch.int32, device=device)
    q = randn(b, snew, h, d, dtype=dtype, device=device)
    k_new = randn(b, snew, h, d, dtype=dtype, device=device)
    v_new = randn(b, snew, h, d, dtype=dtype, device=device)
    angle = torch.rand(smax, rotary_dim // 2) * 6.28
    cos, sin = angle.cos().to(device), angle.sin().to(device)
    k_before, v_before = k_cache.clone(), v_cache.clone()
    out = fa.flash_attn_with_kvcache(q, k_cache, v_cache, k_new, v_new, rotary_cos=cos,
                                     rotary_sin=sin, cache_seqlens=seqlens, causal=causal,
                                     rotary_interleaved=interleaved)
    rot = (cos.cpu(), sin.cpu(), interleaved, causal)
    out64, _ = oracle(q, k_before, v_before, seqlens, k_new, v_new, rot=rot, causal=causal)
    if is_lowp(dtype):
        naive, _ = oracle(q, k_before, v_before, seqlens, k_new, v_new, rot=rot, causal=causal,
                          dtype=dtype)
        ref.assert_close_to_ref(out, out64, naive, "out")
    else:
        ref.assert_close_to_ref(out, out64, None, "out", factor=0)
    # The cache holds the rotated keys (rounded once to the cache's dtype).
    for bb in range(b):
        n = int(seqlens[bb])
        rk = ref.rotary(k_new[bb].double().cpu(), cos.cpu().double(), sin.cpu().double(),
                        torch.arange(snew) + n, interleaved)
        tol = eps(dtype) * max(1.0, rk.abs().max().item()) if is_lowp(dtype) else 1e-5
        assert (k_cache[bb, n:n + snew].double().cpu() - rk).abs().max() < tol


@pytest.mark.parametrize("num_splits", [0, 1, 2, 5])
@pytest.mark.parametrize("device,dtype", device_dtypes())
def test_num_splits(device, dtype, num_splits):
    b, smax, hq, hkv, d = 2, 300, 8, 2, 64
    k_cache = randn(b, smax, hkv, d, dtype=dtype, device=device)
    v_cache = randn(b, smax, hkv, d, dtype=dtype, device=device)
    seqlens = torch.tensor([257, 299], dtype=torch.int32, device=device)
    q = randn(b, 1, hq, d, dtype=dtype, device=device)
    out, lse = fa.flash_attn_with_kvcache(q, k_cache, v_cache, cache_seqlens=seqlens,
                                          num_splits=num_splits, return_softmax_lse=True)
    out64, lse64 = oracle(q, k_cache, v_cache, seqlens)
    naive = oracle(q, k_cache, v_cache, seqlens, dtype=dtype)[0] if is_lowp(dtype) else None
    ref.assert_close_to_ref(out, out64, naive, "out")
    ref.assert_lse_close(lse, lse64)


@pytest.mark.parametrize("opts", [dict(window_size=(8, -1)), dict(softcap=2.5),
                                  dict(alibi=True, causal=True), dict(sinks=True)],
                         ids=["window", "softcap", "alibi", "sinks"])
@pytest.mark.parametrize("device,dtype", device_dtypes())
def test_kvcache_masks(device, dtype, opts):
    b, smax, hq, hkv, d = 2, 40, 4, 2, 32
    k_cache = randn(b, smax, hkv, d, dtype=dtype, device=device)
    v_cache = randn(b, smax, hkv, d, dtype=dtype, device=device)
    seqlens = torch.tensor([17, 30], dtype=torch.int32, device=device)
    q = randn(b, 2, hq, d, dtype=dtype, device=device)
    lib, ora = {}, {}
    for key, val in opts.items():
        if key == "alibi":
            slopes = torch.rand(hq) * 0.3
            lib["alibi_slopes"], ora["alibi"] = slopes.to(device), slopes.double()
        elif key == "sinks":
            s = torch.randn(hq)
            lib["sinks"], ora["sinks"] = s.to(device), s.double()
        elif key == "window_size":
            lib[key], ora["window"] = val, val
        else:
            lib[key], ora[key] = val, val
    out = fa.flash_attn_with_kvcache(q, k_cache, v_cache, cache_seqlens=seqlens, **lib)
    out64, _ = oracle(q, k_cache, v_cache, seqlens, **ora)
    naive = oracle(q, k_cache, v_cache, seqlens, dtype=dtype, **ora)[0] if is_lowp(dtype) else None
    ref.assert_close_to_ref(out, out64, naive, "out")


@pytest.mark.parametrize("device,dtype", device_dtypes())
def test_no_backward(device, dtype):
    """As in flash_attn, the KV-cache path has no backward: asking for one fails loudly."""
    q = randn(1, 1, 2, 32, dtype=dtype, device=device, requires_grad=True)
    k_cache = randn(1, 8, 2, 32, dtype=dtype, device=device)
    v_cache = randn(1, 8, 2, 32, dtype=dtype, device=device)
    out = fa.flash_attn_with_kvcache(q, k_cache, v_cache, cache_seqlens=8)
    assert torch.isfinite(out).all()
    with pytest.raises(RuntimeError):
        out.sum().backward()
