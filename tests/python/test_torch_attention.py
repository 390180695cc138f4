"""flashport.torch.flash_attn_func / flash_attn_varlen_func against the fp64 oracle: values, LSE,
gradients, GQA, every mask option, awkward sizes, dtypes."""
import pytest
import torch

import reference as ref
from helpers import device_dtypes, eps, is_lowp, leaf64, leaf_lowp, randn, work_dtype

fa = pytest.importorskip("flashport.torch")

DTYPES = [torch.float16, torch.bfloat16, torch.float32]

# Every mask option (and some combinations), as flash_attn_func keyword arguments.
MASKS = {
    "none": {},
    "causal": dict(causal=True),
    "window_left": dict(window_size=(9, -1)),
    "window_right": dict(window_size=(-1, 4)),
    "window_both": dict(window_size=(6, 2)),
    "causal_window": dict(causal=True, window_size=(5, 0)),
    "softcap": dict(softcap=3.0),
    "scale": dict(softmax_scale=0.37),
    "alibi_heads": dict(alibi="heads"),
    "alibi_batch_causal": dict(alibi="batch", causal=True),
    "sinks": dict(sinks=True),
    "sinks_causal_softcap": dict(sinks=True, causal=True, softcap=5.0),
    "top_left_causal": dict(causal=True, causal_align="top_left"),
    "top_left_window_alibi": dict(window_size=(4, 4), causal_align="top_left", alibi="heads"),
}


def make_mask_args(opts, batch, hq, device):
    """flash_attn kwargs for the library, and the matching oracle kwargs."""
    lib, oracle = {}, {}
    for key, val in opts.items():
        if key == "alibi":
            shape = (hq,) if val == "heads" else (batch, hq)
            slopes = (torch.rand(*shape) * 0.5 + 0.05).float()
            lib["alibi_slopes"] = slopes.to(device)
            oracle["alibi"] = slopes.double()
        elif key == "sinks":
            s = torch.randn(hq).float()
            lib["sinks"] = s.to(device)
            oracle["sinks"] = s.double()
        elif key == "window_size":
            lib[key] = val
            oracle["window"] = val
        elif key == "causal_align":
            lib[key] = val
            oracle["align"] = val
        elif key == "softmax_scale":
            lib[key] = val
            oracle["scale"] = val
        else:
            lib[key] = val
            oracle[key] = val
    return lib, oracle


def run_batched(shape, dtype, device, opts, grad=True):
    b, sq, sk, hq, hkv, d, dv = shape
    q = randn(b, sq, hq, d, dtype=dtype, device=device, requires_grad=grad)
    k = randn(b, sk, hkv, d, dtype=dtype, device=device, requires_grad=grad)
    v = randn(b, sk, hkv, dv, dtype=dtype, device=device, requires_grad=grad)
    lib_kw, ora_kw = make_mask_args(opts, b, hq, device)
    out, lse, _ = fa.flash_attn_func(q, k, v, return_attn_probs=True, **lib_kw)
    assert out.shape == (b, sq, hq, dv) and out.dtype == dtype and out.device == q.device
    assert lse.shape == (b, hq, sq) and lse.dtype == torch.float32

    q64, k64, v64 = leaf64(q), leaf64(k), leaf64(v)
    out64, lse64 = ref.attention_batched(q64, k64, v64, **ora_kw)
    ql, kl, vl = leaf_lowp(q), leaf_lowp(k), leaf_lowp(v)
    low_kw = {kk: (vv.to(dtype) if torch.is_tensor(vv) else vv) for kk, vv in ora_kw.items()}
    out_lp, _ = ref.attention_batched(ql, kl, vl, **low_kw)

    ref.assert_close_to_ref(out, out64, out_lp, "out")
    ref.assert_lse_close(lse, lse64)
    if not grad:
        return
    dout = torch.randn_like(out)
    out.backward(dout)
    out64.backward(dout.double().cpu())
    out_lp.backward(dout.cpu())
    for name, got, r, n in (("dq", q.grad, q64.grad, ql.grad), ("dk", k.grad, k64.grad, kl.grad),
                            ("dv", v.grad, v64.grad, vl.grad)):
        ref.assert_close_to_ref(got, r, n, name, factor=3.0)


@pytest.mark.parametrize("device,dtype", device_dtypes(DTYPES))
@pytest.mark.parametrize("mask", list(MASKS), ids=list(MASKS))
def test_masks(device, dtype, mask):
    run_batched((2, 37, 53, 4, 2, 64, 64), dtype, device, MASKS[mask])


SHAPES = [  # (B, Sq, Sk, Hq, Hkv, D, Dv)
    (1, 1, 1, 1, 1, 32, 32),
    (2, 3, 113, 4, 4, 64, 64),
    (1, 113, 3, 6, 2, 40, 40),     # Sq > Sk, GQA 3
    (2, 65, 129, 8, 1, 128, 128),  # MQA
    (1, 17, 33, 4, 2, 256, 256),
    (2, 20, 31, 2, 1, 8, 8),
]


@pytest.mark.parametrize("device,dtype", device_dtypes(DTYPES))
@pytest.mark.parametrize("shape", SHAPES, ids=[str(s) for s in SHAPES])
@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
def test_shapes(device, dtype, shape, causal):
    run_batched(shape, dtype, device, dict(causal=causal))


def test_value_head_dim_differs(device):
    run_batched((1, 19, 23, 4, 2, 64, 32), torch.float16, device, dict(causal=True))


@pytest.mark.cuda_declines("float64: the CUDA backend has float32/float16/bfloat16 kernels only")
def test_fp64_inputs(device):
    """fp64 in, fp64 LSE: the library must then agree with the oracle to ~1e-12."""
    b, s, h, d = 1, 21, 2, 16
    q, k, v = (randn(b, s, h, d, dtype=torch.float64, device=device) for _ in range(3))
    out, lse, _ = fa.flash_attn_func(q, k, v, causal=True, return_attn_probs=True)
    out64, lse64 = ref.attention_batched(q.cpu(), k.cpu(), v.cpu(), causal=True)
    assert lse.dtype == torch.float64
    assert (out.cpu() - out64).abs().max() < 1e-10
    assert (lse.cpu() - lse64).abs().max() < 1e-10


@pytest.mark.parametrize("device,dtype", device_dtypes())
def test_rows_without_keys_are_zero(device, dtype):
    """Sq > Sk with bottom-right causal: the first Sq - Sk rows see no key -> out 0, lse -inf."""
    q = randn(1, 9, 2, 32, dtype=dtype, device=device)
    k = randn(1, 4, 2, 32, dtype=dtype, device=device)
    v = randn(1, 4, 2, 32, dtype=dtype, device=device)
    out, lse, _ = fa.flash_attn_func(q, k, v, causal=True, return_attn_probs=True)
    assert torch.equal(out[0, :5].cpu(), torch.zeros(5, 2, 32, dtype=dtype))
    assert torch.isinf(lse[0, :, :5]).all() and (lse[0, :, :5] < 0).all()
    assert torch.isfinite(lse[0, :, 5:]).all()


@pytest.mark.parametrize("device,dtype", device_dtypes())
def test_sinks_gradient(device, dtype):
    """d_sinks (float32 sinks) against the fp64 oracle's autograd; with 16-bit q/k/v the
    tolerance is the error of the same computation in q's dtype."""
    b, sq, sk, hq, hkv, d = 2, 13, 29, 4, 2, 32
    q = randn(b, sq, hq, d, dtype=dtype, device=device, requires_grad=True)
    k = randn(b, sk, hkv, d, dtype=dtype, device=device, requires_grad=True)
    v = randn(b, sk, hkv, d, dtype=dtype, device=device, requires_grad=True)
    sinks = randn(hq, device=device, requires_grad=True)
    out = fa.flash_attn_func(q, k, v, causal=True, sinks=sinks)
    dout = torch.randn_like(out)
    out.backward(dout)
    s64 = leaf64(sinks)
    out64, _ = ref.attention_batched(leaf64(q), leaf64(k), leaf64(v), causal=True, sinks=s64)
    out64.backward(dout.double().cpu())
    naive = None
    if is_lowp(dtype):  # sinks stay a float32 leaf; the oracle code casts them to q's dtype
        s_lp = leaf_lowp(sinks)
        out_lp, _ = ref.attention_batched(leaf_lowp(q), leaf_lowp(k), leaf_lowp(v), causal=True,
                                          sinks=s_lp)
        out_lp.backward(dout.cpu())
        naive = s_lp.grad
    ref.assert_close_to_ref(sinks.grad, s64.grad, naive, "d_sinks", factor=3.0)
    assert (s64.grad.abs() > 0).any()


@pytest.mark.parametrize("device,dtype", device_dtypes())
def test_attn_probs(device, dtype):
    """S_dmask: None without dropout (as flash_attn); with dropout the softmax probabilities of
    the visible keys (rounded to q's dtype: probabilities are <= 1, so 2 eps of the dtype bound
    the error of 16-bit ones), negated exactly where dropout drops, zero elsewhere; on q's
    device."""
    b, sq, sk, h, d, p = 2, 11, 17, 2, 16, 0.3
    q, k, v = (randn(b, s, h, d, dtype=dtype, device=device) for s in (sq, sk, sk))
    kw = dict(causal=True, window_size=(5, -1), softcap=4.0)
    assert fa.flash_attn_func(q, k, v, return_attn_probs=True, **kw)[2] is None
    tol, sum_tol = (2 * eps(dtype), 2 * eps(dtype)) if is_lowp(dtype) else (1e-5, 1e-4)
    torch.manual_seed(9)
    out, lse, s_dmask = fa.flash_attn_func(q, k, v, dropout_p=p, return_attn_probs=True, **kw)
    torch.manual_seed(9)
    rng = torch.ops.flashport.attn_fwd(q, k, v, None, None, 0, 0, None, None, None, None, p,
                                       d ** -0.5, True, 5, -1, 4.0, 0, 0, False, 0)[2]
    keep = ref.dropout_keep(*rng.tolist(), b, h, sq, sk, p)
    assert s_dmask.shape == (b, h, sq, sk)
    assert s_dmask.dtype == q.dtype and s_dmask.device == q.device
    for bb in range(b):
        _, lse64 = ref.attention_one(q[bb].double().cpu(), k[bb].double().cpu(),
                                     v[bb].double().cpu(), causal=True, window=(5, -1),
                                     softcap=4.0)
        p64 = ref.probs_one(q[bb].double().cpu(), k[bb].double().cpu(), lse64, scale=d ** -0.5,
                            causal=True, window=(5, -1), softcap=4.0)
        got = s_dmask[bb].double().cpu()
        assert (got.abs() - p64).abs().max() < tol
        visible = p64 > 0
        assert torch.equal((got < 0)[visible], ~keep[bb][visible])
        assert (got[~visible] == 0).all()
    assert (s_dmask.double().abs().sum(-1).cpu() - 1).abs().max() < sum_tol  # rows see keys


def test_attn_probs_varlen_zero_padded(device):
    """Varlen S_dmask is [B, Hq, max_seqlen_q, max_seqlen_k], zero past each sequence."""
    dtype = work_dtype(device)
    lens, h, d, p = [3, 9], 2, 16, 0.25
    cu_ = torch.tensor([0, 3, 12], dtype=torch.int32, device=device)
    q, k, v = (randn(12, h, d, dtype=dtype, device=device) for _ in range(3))
    _, lse, s_dmask = fa.flash_attn_varlen_func(q, k, v, cu_, cu_, 9, 9, dropout_p=p,
                                                return_attn_probs=True)
    assert s_dmask.shape == (2, h, 9, 9)
    assert (s_dmask[0, :, 3:] == 0).all() and (s_dmask[0, :, :, 3:] == 0).all()
    for bb, (a, n) in enumerate(zip([0, 3], lens)):
        _, lse64 = ref.attention_one(q[a:a + n].double().cpu(), k[a:a + n].double().cpu(),
                                     v[a:a + n].double().cpu())
        p64 = ref.probs_one(q[a:a + n].double().cpu(), k[a:a + n].double().cpu(), lse64,
                            scale=d ** -0.5)
        tol = 2 * eps(dtype) if is_lowp(dtype) else 1e-5
        assert (s_dmask[bb, :, :n, :n].double().abs().cpu() - p64).abs().max() < tol


# ---------------------------------------------------------------------------------------------
# varlen
# ---------------------------------------------------------------------------------------------

def cu(lengths, device):
    c = [0]
    for n in lengths:
        c.append(c[-1] + n)
    return torch.tensor(c, dtype=torch.int32, device=device)


VARLEN = [  # (q lengths, k lengths)
    ([1, 7, 33], [5, 7, 40]),
    ([113, 2], [3, 130]),
    ([16, 0, 9], [16, 4, 9]),  # an empty query sequence
]


@pytest.mark.parametrize("device,dtype", device_dtypes(DTYPES))
@pytest.mark.parametrize("lens", VARLEN, ids=["a", "b", "empty_q"])
@pytest.mark.parametrize("mask", ["none", "causal", "window_both", "alibi_batch_causal", "sinks"])
def test_varlen(device, dtype, lens, mask):
    lq, lk = lens
    hq, hkv, d = 4, 2, 64
    cu_q, cu_k = cu(lq, device), cu(lk, device)
    q = randn(sum(lq), hq, d, dtype=dtype, device=device, requires_grad=True)
    k = randn(sum(lk), hkv, d, dtype=dtype, device=device, requires_grad=True)
    v = randn(sum(lk), hkv, d, dtype=dtype, device=device, requires_grad=True)
    lib_kw, ora_kw = make_mask_args(MASKS[mask], len(lq), hq, device)
    out, lse, _ = fa.flash_attn_varlen_func(q, k, v, cu_q, cu_k, max(lq), max(lk),
                                            return_attn_probs=True, **lib_kw)
    assert out.shape == (sum(lq), hq, d) and lse.shape == (hq, sum(lq))
    q64, k64, v64 = leaf64(q), leaf64(k), leaf64(v)
    out64, lse64 = ref.attention_varlen(q64, k64, v64, cu_q.cpu(), cu_k.cpu(), **ora_kw)
    ql, kl, vl = leaf_lowp(q), leaf_lowp(k), leaf_lowp(v)
    low_kw = {kk: (vv.to(dtype) if torch.is_tensor(vv) else vv) for kk, vv in ora_kw.items()}
    out_lp, _ = ref.attention_varlen(ql, kl, vl, cu_q.cpu(), cu_k.cpu(), **low_kw)
    ref.assert_close_to_ref(out, out64, out_lp, "out")
    ref.assert_lse_close(lse, lse64)

    dout = torch.randn_like(out)
    out.backward(dout)
    out64.backward(dout.double().cpu())
    out_lp.backward(dout.cpu())
    for name, got, r, n in (("dq", q.grad, q64.grad, ql.grad), ("dk", k.grad, k64.grad, kl.grad),
                            ("dv", v.grad, v64.grad, vl.grad)):
        ref.assert_close_to_ref(got, r, n, name, factor=3.0)


@pytest.mark.parametrize("device,dtype", device_dtypes())
def test_varlen_paged_kv(device, dtype):
    """flash_attn_varlen_func with block_table: keys from a paged cache."""
    lq, lk = [3, 9], [20, 7]
    hq, hkv, d, page, max_blocks = 4, 2, 32, 8, 3
    nblocks = 7
    k_cache = randn(nblocks, page, hkv, d, dtype=dtype, device=device)
    v_cache = randn(nblocks, page, hkv, d, dtype=dtype, device=device)
    perm = torch.randperm(nblocks)[:2 * max_blocks].view(2, max_blocks)
    block_table = perm.to(torch.int32).to(device)
    q = randn(sum(lq), hq, d, dtype=dtype, device=device)
    out = fa.flash_attn_varlen_func(q, k_cache, v_cache, cu(lq, device), cu(lk, device), max(lq),
                                    max(lk), causal=True, block_table=block_table)

    def oracle(to):  # the sequences gathered from their pages, attended in `to`'s precision
        outs = []
        cq = [0, 3, 12]
        for b in range(2):
            kb = to(k_cache[perm[b]].reshape(-1, hkv, d)[:lk[b]])
            vb = to(v_cache[perm[b]].reshape(-1, hkv, d)[:lk[b]])
            o, _ = ref.attention_one(to(q[cq[b]:cq[b + 1]]), kb, vb, causal=True)
            outs.append(o)
        return torch.cat(outs)

    naive = oracle(lambda t: t.cpu()) if is_lowp(dtype) else None
    ref.assert_close_to_ref(out, oracle(lambda t: t.double().cpu()), naive, "out")


@pytest.mark.parametrize("device,dtype", device_dtypes())
def test_deterministic_backward_is_bitwise_repeatable(device, dtype):
    q, k, v = (randn(2, 40, 4, 32, dtype=dtype, device=device, requires_grad=True)
               for _ in range(3))
    grads = []
    for _ in range(2):
        for t in (q, k, v):
            t.grad = None
        out = fa.flash_attn_func(q, k, v, causal=True, deterministic=True)
        out.sum().backward()
        grads.append([t.grad.clone() for t in (q, k, v)])
    for a, b in zip(*grads):
        assert torch.equal(a, b)


@pytest.mark.parametrize("device,dtype", device_dtypes())
def test_noncontiguous_inputs(device, dtype):
    """Arbitrary strides (here: a packed qkv tensor and a transposed view) are accepted."""
    qkv = randn(2, 31, 3, 4, 32, dtype=dtype, device=device)
    q, k, v = qkv[:, :, 0], qkv[:, :, 1], qkv[:, :, 2]
    assert not q.is_contiguous()
    out = fa.flash_attn_func(q, k, v, causal=True)
    out64, _ = ref.attention_batched(q.double().cpu(), k.double().cpu(), v.double().cpu(),
                                     causal=True)
    naive = None
    if is_lowp(dtype):
        naive, _ = ref.attention_batched(q.cpu(), k.cpu(), v.cpu(), causal=True)
    ref.assert_close_to_ref(out, out64, naive, "out")


@pytest.mark.parametrize("backend", ["reference", "cpu"])
def test_forced_backend_agrees(backend):
    import flashport
    if not flashport.backend_available(backend.upper()):
        pytest.skip(f"{backend} backend not built")
    q, k, v = (randn(1, 29, 2, 64) for _ in range(3))
    out = fa.flash_attn_func(q, k, v, causal=True, backend=backend)
    out64, _ = ref.attention_batched(q.double(), k.double(), v.double(), causal=True)
    ref.assert_close_to_ref(out, out64, None, "out")


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_runs_on_current_cuda_stream():
    """Inputs produced late on a side stream: a kernel launched on any other stream would read
    them before they are written."""
    q, k, v = (randn(2, 128, 4, 64, dtype=torch.float16, device="cuda") for _ in range(3))
    expect = fa.flash_attn_func(q, k, v, causal=True)
    torch.cuda.synchronize()
    side = torch.cuda.Stream()
    with torch.cuda.stream(side):
        torch.cuda._sleep(200_000_000)
        q2 = q * 1.0
        out = fa.flash_attn_func(q2, k, v, causal=True)
    side.synchronize()
    assert torch.equal(out, expect)


@pytest.mark.parametrize("device,dtype", device_dtypes())
def test_packed_variants_match_unpacked(device, dtype):
    """flash_attn's qkv/kv-packed entry points: same values, gradients land in the packed tensor.
    deterministic=True: CUDA's default backward adds dQ with atomics (any order), so only the
    deterministic mode's gradients can be compared bit for bit."""
    b, s, h, d = 2, 17, 2, 32
    qkv = randn(b, s, 3, h, d, dtype=dtype, device=device, requires_grad=True)
    out = fa.flash_attn_qkvpacked_func(qkv, causal=True, deterministic=True)
    q, k, v = (qkv[:, :, i].detach().clone().requires_grad_(True) for i in range(3))
    ref_out = fa.flash_attn_func(q, k, v, causal=True, deterministic=True)
    assert torch.equal(out, ref_out)
    dout = torch.randn_like(out)
    out.backward(dout)
    ref_out.backward(dout)
    assert torch.equal(qkv.grad, torch.stack([q.grad, k.grad, v.grad], dim=2))

    kv = qkv[:, :, 1:].detach()
    assert torch.equal(fa.flash_attn_kvpacked_func(q.detach(), kv, causal=True), ref_out)

    cu_seq = torch.tensor([0, 5, 17], dtype=torch.int32, device=device)
    flat = qkv.detach()[0]  # [T, 3, H, D] with two sequences
    got = fa.flash_attn_varlen_qkvpacked_func(flat, cu_seq, 12, causal=True)
    want = fa.flash_attn_varlen_func(flat[:, 0], flat[:, 1], flat[:, 2], cu_seq, cu_seq, 12, 12,
                                     causal=True)
    assert torch.equal(got, want)
    got = fa.flash_attn_varlen_kvpacked_func(flat[:, 0], flat[:, 1:], cu_seq, cu_seq, 12, 12,
                                             causal=True)
    assert torch.equal(got, want)
