"""Bad inputs raise ValueError (bad argument) or RuntimeError/NotImplementedError, carrying the
library's message, and write nothing."""
import pytest
import torch

from helpers import device_dtypes, randn

fa = pytest.importorskip("flashport.torch")


def qkv(device, b=1, sq=8, sk=8, hq=4, hkv=2, d=32, dtype=torch.float16):
    return (randn(b, sq, hq, d, dtype=dtype, device=device),
            randn(b, sk, hkv, d, dtype=dtype, device=device),
            randn(b, sk, hkv, d, dtype=dtype, device=device))


def test_dtype_mismatch(device):
    q, k, v = qkv(device)
    with pytest.raises(ValueError, match="k"):
        fa.flash_attn_func(q, k.float(), v)


def test_unsupported_dtype(device):
    q, k, v = qkv(device)
    with pytest.raises(ValueError, match="dtype"):
        fa.flash_attn_func(q.to(torch.int64), k, v)


def test_heads_not_divisible(device):
    q, k, v = qkv(device, hq=5, hkv=2)
    with pytest.raises(ValueError, match="(?i)head"):
        fa.flash_attn_func(q, k, v)


def test_head_dim_too_large(device):
    q, k, v = qkv(device, d=264)
    with pytest.raises(ValueError, match="256"):
        fa.flash_attn_func(q, k, v)


def test_negative_window_other_than_minus_one(device):
    q, k, v = qkv(device)
    with pytest.raises(ValueError, match="window"):
        fa.flash_attn_func(q, k, v, causal=True, window_size=(-3, 0))


def test_dropout_out_of_range(device):
    q, k, v = qkv(device)
    with pytest.raises(ValueError, match="dropout"):
        fa.flash_attn_func(q, k, v, dropout_p=1.0)


def test_bad_window_tuple(device):
    q, k, v = qkv(device)
    with pytest.raises(ValueError, match="window_size"):
        fa.flash_attn_func(q, k, v, window_size=(1, 2, 3))


def test_bad_backend_and_align(device):
    q, k, v = qkv(device)
    with pytest.raises(ValueError, match="backend"):
        fa.flash_attn_func(q, k, v, backend="tpu")
    with pytest.raises(ValueError, match="causal_align"):
        fa.flash_attn_func(q, k, v, causal=True, causal_align="middle")


def test_varlen_cu_seqlens_dtype(device):
    q = randn(10, 2, 32, device=device)
    cu64 = torch.tensor([0, 4, 10], dtype=torch.int64, device=device)
    with pytest.raises(ValueError, match="cu_seqlens_q"):
        fa.flash_attn_varlen_func(q, q, q, cu64, cu64, 6, 6)


def test_varlen_cu_seqlens_values_checked_on_host():
    q = randn(10, 2, 32)
    bad = torch.tensor([0, 7, 5], dtype=torch.int32)  # decreasing
    with pytest.raises(ValueError, match="cu_seqlens"):
        fa.flash_attn_varlen_func(q, q, q, bad, bad, 7, 7)


def test_cache_leftpad_past_cache_seqlens(device):
    """A pad beyond the sequence's cached rows is a named error (values checked on the host, so
    on the CPU; on CUDA the kernels clamp), and nothing is written."""
    if device != "cpu":
        pytest.skip("index values in device memory are not read on the host")
    q = randn(1, 1, 2, 32, device=device)
    kc, vc = randn(1, 16, 2, 32, device=device), randn(1, 16, 2, 32, device=device)
    kn = randn(1, 1, 2, 32, device=device)
    k0 = kc.clone()
    with pytest.raises(ValueError, match="cache_leftpad"):
        fa.flash_attn_with_kvcache(q, kc, vc, kn, kn, cache_seqlens=4,
                                   cache_leftpad=torch.tensor([5], dtype=torch.int32))
    assert torch.equal(kc, k0)
    with pytest.raises(ValueError, match="cache_leftpad"):
        fa.flash_attn_with_kvcache(q, kc, vc, cache_seqlens=4,
                                   cache_leftpad=torch.tensor([1], dtype=torch.int64))


@pytest.mark.parametrize("device,dtype", device_dtypes())
def test_kvcache_error_writes_nothing(device, dtype):
    """An append past the cache's capacity (cache_seqlens 6 + 4 new rows > 8). On the CPU it is
    rejected with a named error and writes nothing. On CUDA cache_seqlens lives in device memory,
    which the library never reads on the host (flashport.h: index values are checked only in host
    memory; GPU kernels clamp instead of faulting): the call runs and must write nothing outside
    the cache's rows [cache_seqlens, capacity) - the cache is a view between sentinel rows."""
    q = randn(1, 4, 2, 32, dtype=dtype, device=device)
    big_k, big_v = (randn(3, 8, 2, 32, dtype=dtype, device=device) for _ in range(2))
    kc, vc = big_k[1:2], big_v[1:2]  # batch rows 0 and 2 of the buffers are sentinels
    kn, vn = (randn(1, 4, 2, 32, dtype=dtype, device=device) for _ in range(2))
    k0, v0 = big_k.clone(), big_v.clone()
    seqlens = torch.tensor([6], dtype=torch.int32, device=device)
    if device == "cpu":
        with pytest.raises(ValueError, match="(?i)cache"):
            fa.flash_attn_with_kvcache(q, kc, vc, kn, vn, cache_seqlens=seqlens)
        assert torch.equal(big_k, k0) and torch.equal(big_v, v0)
        return
    out = fa.flash_attn_with_kvcache(q, kc, vc, kn, vn, cache_seqlens=seqlens)
    torch.cuda.synchronize()
    assert torch.isfinite(out).all()
    may_write = torch.zeros(big_k.shape[:2], dtype=torch.bool, device=device)
    may_write[1, 6:] = True
    assert torch.equal(big_k[~may_write], k0[~may_write])
    assert torch.equal(big_v[~may_write], v0[~may_write])


def test_k_without_v(device):
    q = randn(1, 1, 2, 32, device=device)
    kc, vc = randn(1, 8, 2, 32, device=device), randn(1, 8, 2, 32, device=device)
    with pytest.raises(ValueError, match="together"):
        fa.flash_attn_with_kvcache(q, kc, vc, k=randn(1, 1, 2, 32, device=device),
                                   cache_seqlens=2)


def test_rotary_without_new_keys(device):
    q = randn(1, 1, 2, 32, device=device)
    kc, vc = randn(1, 8, 2, 32, device=device), randn(1, 8, 2, 32, device=device)
    cos = torch.ones(8, 8, device=device)
    with pytest.raises(ValueError, match="rotary"):
        fa.flash_attn_with_kvcache(q, kc, vc, rotary_cos=cos, rotary_sin=cos, cache_seqlens=2)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_cuda_declines_float64():
    """The CUDA backend runs float32, float16 and bfloat16: float64 is declined through its
    capability check with a named FP_ERR_UNSUPPORTED error naming the dtype (forward, the KV-cache
    append, which then writes nothing, and the backward op given float64 tensors). The other
    tests run CUDA in float32/float16/bfloat16; this is the one that checks the decline."""
    for dtype in (torch.float64,):
        name = str(dtype).replace("torch.", "")
        q, k, v = qkv("cuda", dtype=dtype)
        with pytest.raises(RuntimeError, match=rf"FP_ERR_UNSUPPORTED.*cuda backend: dtype {name}"):
            fa.flash_attn_func(q, k, v, causal=True)
        kc, vc = randn(1, 16, 2, 32, dtype=dtype, device="cuda"), randn(1, 16, 2, 32, dtype=dtype,
                                                                        device="cuda")
        k0, v0 = kc.clone(), vc.clone()
        with pytest.raises(RuntimeError, match=rf"FP_ERR_UNSUPPORTED.*dtype {name}"):
            fa.flash_attn_with_kvcache(q[:, :2], kc, vc, k[:, :2], v[:, :2], cache_seqlens=3)
        torch.cuda.synchronize()
        assert torch.equal(kc, k0) and torch.equal(vc, v0)
    # The backward's own check, reached directly: float64 tensors with a float32 lse.
    q, k, v = qkv("cuda", dtype=torch.float64)
    out, dout = torch.zeros_like(q), torch.randn_like(q)
    lse = torch.zeros(1, 4, 8, device="cuda")
    no_rng = torch.empty(0, dtype=torch.int64, device="cuda")
    with pytest.raises(RuntimeError, match=r"FP_ERR_UNSUPPORTED.*backward dtype float64"):
        torch.ops.flashport.attn_bwd(dout, q, k, v, out, lse, None, None, 0, 0, None, None, None,
                                     None, no_rng, 0.0, 0.25, True, -1, -1, 0.0, 0, False, 0)


def test_mixed_devices():
    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    q, k, v = qkv("cuda")
    with pytest.raises((ValueError, RuntimeError), match="device"):
        fa.flash_attn_func(q, k.cpu(), v)
