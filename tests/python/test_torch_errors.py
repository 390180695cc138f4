"""Bad inputs raise ValueError (bad argument) or RuntimeError/NotImplementedError, carrying the
library's message, and write nothing."""
import pytest
import torch

from helpers import randn

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


def test_causal_with_right_window(device):
    q, k, v = qkv(device)
    with pytest.raises(ValueError, match="window"):
        fa.flash_attn_func(q, k, v, causal=True, window_size=(-1, 3))


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


def test_cache_leftpad_rejected(device):
    q = randn(1, 1, 2, 32, device=device)
    kc, vc = randn(1, 16, 2, 32, device=device), randn(1, 16, 2, 32, device=device)
    with pytest.raises(NotImplementedError, match="cache_leftpad"):
        fa.flash_attn_with_kvcache(q, kc, vc, cache_seqlens=4,
                                   cache_leftpad=torch.zeros(1, dtype=torch.int32, device=device))


def test_kvcache_error_writes_nothing(device):
    """A rejected append (cache too short for the new rows) leaves the cache untouched."""
    q = randn(1, 4, 2, 32, device=device)
    kc, vc = randn(1, 8, 2, 32, device=device), randn(1, 8, 2, 32, device=device)
    kn, vn = randn(1, 4, 2, 32, device=device), randn(1, 4, 2, 32, device=device)
    k0, v0 = kc.clone(), vc.clone()
    with pytest.raises(ValueError):
        fa.flash_attn_with_kvcache(q, kc, vc, kn, vn, cache_seqlens=torch.tensor(
            [6], dtype=torch.int32, device=device))
    assert torch.equal(kc, k0) and torch.equal(vc, v0)


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


def test_mixed_devices():
    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    q, k, v = qkv("cuda")
    with pytest.raises((ValueError, RuntimeError), match="device"):
        fa.flash_attn_func(q, k.cpu(), v)
