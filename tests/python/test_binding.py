"""The extension's tensor bridge: strided views with storage offsets, poisoned outputs (every
element written) and sentinels around them (nothing else written), strided inputs (copied, as
flash_attn does) and in-place arguments (never copied), non-torch DLPack arrays, and both ways a
torch tensor crosses: torch's C-level DLPack exchange table (torch >= 2.10) and the attribute route
of older torch, which must give the same bits."""
import numpy as np
import pytest
import torch

import reference as ref
from helpers import device_dtypes, is_lowp, randn

from flashport import _C

fa = pytest.importorskip("flashport.torch")

SENTINEL = 12288.0  # exact in float16, bfloat16 and float32
NAN = float("nan")


def fwd(q, k, v, out=None, lse=None, causal=1, backend=0, num_splits=0, seqused_k=None):
    """_C.attn_fwd with the custom op's argument order; returns (out, lse)."""
    return _C.attn_fwd(q, k, v, out, lse, None, None, 0, 0, None, seqused_k, None, None, None, 0.0,
                       NAN, causal, -1, -1, 0.0, 0, num_splits, backend)


def select(q, k, v, out=None, lse=None, num_splits=0, seqused_k=None):
    return _C.attn_fwd_select(q, k, v, out, lse, None, None, 0, 0, None, seqused_k, None, None,
                              None, 0.0, NAN, 0, -1, -1, 0.0, 0, num_splits, 0)


@pytest.mark.parametrize("device,dtype", device_dtypes())
def test_strided_outputs_and_sentinels(device, dtype):
    b, sq, sk, hq, hkv, d = 2, 13, 21, 4, 2, 32
    q, k, v = (randn(b, s, h, d, dtype=dtype, device=device) for s, h in ((sq, hq), (sk, hkv),
                                                                          (sk, hkv)))
    # out: an interior view of a larger buffer (storage offset, padded row and head strides)
    big_out = torch.full((b + 2, sq + 2, hq + 1, d + 8), SENTINEL, dtype=dtype, device=device)
    out = big_out[1:-1, 1:-1, :hq, 4:4 + d]
    out.fill_(float("nan"))
    big_lse = torch.full((b, hq + 2, sq + 3), SENTINEL, device=device)
    lse = big_lse[:, 1:-1, 2:-1]
    lse.fill_(float("nan"))
    got_out, got_lse = fwd(q, k, v, out, lse)
    assert got_out is out and got_lse is lse  # given outputs are written, not replaced
    if device == "cuda":
        torch.cuda.synchronize()
    assert torch.isfinite(out).all() and torch.isfinite(lse).all()
    mask = torch.ones_like(big_out, dtype=torch.bool)
    mask[1:-1, 1:-1, :hq, 4:4 + d] = False
    assert (big_out[mask] == SENTINEL).all()
    mask = torch.ones_like(big_lse, dtype=torch.bool)
    mask[:, 1:-1, 2:-1] = False
    assert (big_lse[mask] == SENTINEL).all()
    out64, lse64 = ref.attention_batched(q.double().cpu(), k.double().cpu(), v.double().cpu(),
                                         causal=True)
    naive = None
    if is_lowp(dtype):
        naive, _ = ref.attention_batched(q.cpu(), k.cpu(), v.cpu(), causal=True)
    ref.assert_close_to_ref(out, out64, naive, "out")
    ref.assert_lse_close(lse, lse64)
    # Outputs allocated by the extension: contiguous, on q's device, the same bits.
    new_out, new_lse = fwd(q, k, v)
    assert new_out.is_contiguous() and new_lse.is_contiguous()
    assert new_out.device == q.device and new_lse.dtype == torch.float32
    assert torch.equal(new_out, out) and torch.equal(new_lse, lse)


@pytest.mark.parametrize("device,dtype", device_dtypes())
def test_strided_last_dim_inputs_are_copied_in_place_arguments_are_not(device, dtype):
    b, s, h, d = 1, 9, 2, 16
    wide = randn(b, s, h, 2 * d, dtype=dtype, device=device)
    q = wide[..., ::2]  # last-dimension stride 2
    assert q.stride(-1) == 2
    k, v = randn(b, s, h, d, dtype=dtype, device=device), randn(b, s, h, d, dtype=dtype,
                                                               device=device)
    out, lse = fwd(q, k, v)
    want_out, want_lse = fwd(q.contiguous(), k, v)
    assert torch.equal(out, want_out) and torch.equal(lse, want_lse)
    cache = randn(1, 16, h, 2 * d, dtype=dtype, device=device)[..., ::2]
    with pytest.raises(ValueError, match="k_cache.*contiguous last dimension"):
        fa.flash_attn_with_kvcache(q[:, :1], cache, cache.contiguous(), cache_seqlens=4)


@pytest.mark.parametrize("device,dtype", device_dtypes())
def test_select_reports_backend_and_workspace(device, dtype):
    q = randn(1, 8, 2, 64, dtype=dtype, device=device)
    sel = select(q, q, q, torch.empty_like(q))
    assert sel["backend"] and sel["kernel"] and sel["workspace_bytes"] >= 0
    assert sel["num_splits"] >= 1
    if device == "cuda":
        assert "cuda" in sel["backend"].lower(), sel


@pytest.mark.parametrize("device,dtype", device_dtypes())
def test_split_kv_workspace_comes_from_torch(device, dtype):
    """A call whose plan needs workspace gets it from torch's allocator (once, after the one
    plan), with the same result as the unsplit call up to rounding of the merge."""
    q = randn(1, 1, 8, 64, dtype=dtype, device=device)
    kc = randn(1, 4096, 8, 64, dtype=dtype, device=device)
    sl = torch.tensor([4000], dtype=torch.int32, device=device)
    split, _ = fwd(q, kc, kc, causal=0, num_splits=8, seqused_k=sl)
    whole, _ = fwd(q, kc, kc, causal=0, num_splits=1, seqused_k=sl)
    tol = 1e-5 if dtype == torch.float32 else 1e-2
    assert (split.float() - whole.float()).abs().max() < tol


def test_non_tensors_rejected():
    q = randn(1, 8, 2, 64)
    with pytest.raises(ValueError, match="'q' is not a tensor"):
        select([1, 2, 3], q, q)
    with pytest.raises(ValueError, match="'k'.*dtype"):
        select(q, q.to(torch.int64), q)


def test_numpy_arrays_run_with_given_outputs():
    """Any DLPack producer's CPU arrays work (outputs given: only torch's allocator is known)."""
    q, k, v = (randn(1, 7, 2, 16) for _ in range(3))
    out, lse = np.full((1, 7, 2, 16), np.nan, np.float32), np.full((1, 2, 7), np.nan, np.float32)
    got = fwd(q.numpy(), k.numpy(), v.numpy(), out, lse)
    assert got[0] is out and got[1] is lse
    want_out, want_lse = fwd(q, k, v)
    assert np.array_equal(out, want_out.numpy()) and np.array_equal(lse, want_lse.numpy())
    with pytest.raises(ValueError, match="outputs must be given"):
        fwd(q.numpy(), k.numpy(), v.numpy())


def _run_every_call(device, dtype):
    """flash_attn_func (fwd and bwd, with sinks and dropout), varlen, kvcache append, merge."""
    torch.manual_seed(7)
    q, k, v = (randn(2, 11, 4, 32, dtype=dtype, device=device, requires_grad=True)
               for _ in range(3))
    sinks = randn(4, device=device, requires_grad=True)
    out = fa.flash_attn_func(q, k, v, dropout_p=0.2, causal=True, sinks=sinks,
                             deterministic=True)
    out.backward(torch.ones_like(out))
    res = [out.detach(), q.grad, k.grad, v.grad, sinks.grad]
    cu = torch.tensor([0, 5, 12], dtype=torch.int32, device=device)
    qv = randn(12, 2, 32, dtype=dtype, device=device)
    res.append(fa.flash_attn_varlen_func(qv, qv, qv, cu, cu, 7, 7, causal=True))
    kc, vc = (randn(2, 16, 2, 32, dtype=dtype, device=device) for _ in range(2))
    kn = randn(2, 1, 2, 32, dtype=dtype, device=device)
    seqlens = torch.tensor([3, 9], dtype=torch.int32, device=device)
    o, lse = fa.flash_attn_with_kvcache(qv[:2, None], kc, vc, kn, kn, cache_seqlens=seqlens,
                                        return_softmax_lse=True)
    res += [o, lse, kc, vc]
    res += list(fa.merge_attn_states(torch.stack([o, o]).float(), torch.stack([lse, lse + 1])))
    return res


@pytest.mark.parametrize("device,dtype", device_dtypes())
def test_attribute_route_equals_c_exchange_route(device, dtype):
    """torch < 2.10 has no C exchange table: tensors then cross as data_ptr/shape/stride/dtype,
    streams and memory come from Python callables. Same calls, same bits."""
    if fa._exchange_api() is None:
        pytest.skip("this torch has no C exchange table: every test runs the attribute route")
    assert _C.uses_c_exchange()
    exchange = _run_every_call(device, dtype)
    assert fa._connect(None) is False
    try:
        assert not _C.uses_c_exchange()
        attributes = _run_every_call(device, dtype)
    finally:
        assert fa._connect(fa._exchange_api()) is True
    for a, b in zip(exchange, attributes):
        assert torch.equal(a, b)
