"""The extension's DLPack -> fp_tensor bridge: strided views with storage offsets, poisoned
outputs (every element written) and sentinels around them (nothing else written)."""
import pytest
import torch

import reference as ref
from helpers import device_dtypes, is_lowp, randn

from flashport import _C

SENTINEL = 12288.0  # exact in float16, bfloat16 and float32


def capsule(t):
    return t.__dlpack__(stream=-1)


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
    _C.attn_fwd({"q": capsule(q), "k": capsule(k), "v": capsule(v), "out": capsule(out),
                 "lse": capsule(lse)}, {"causal": 1, "softmax_scale": None},
                torch.cuda.current_stream().cuda_stream if device == "cuda" else 0,
                lambda n: torch.empty(n, dtype=torch.uint8, device=device).data_ptr())
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


@pytest.mark.parametrize("device,dtype", device_dtypes())
def test_select_reports_backend_and_workspace(device, dtype):
    q = randn(1, 8, 2, 64, dtype=dtype, device=device)
    out = torch.empty_like(q)
    stream = torch.cuda.current_stream().cuda_stream if device == "cuda" else 0
    sel = _C.attn_fwd_select({"q": capsule(q), "k": capsule(q), "v": capsule(q),
                              "out": capsule(out)}, {}, stream)
    assert sel["backend"] and sel["kernel"] and sel["workspace_bytes"] >= 0
    assert sel["num_splits"] >= 1
    if device == "cuda":
        assert "cuda" in sel["backend"].lower(), sel


def test_unknown_names_and_non_tensors_rejected():
    q = randn(1, 8, 2, 64)
    with pytest.raises(ValueError, match="qq"):
        _C.attn_fwd_select({"qq": capsule(q)}, {})
    with pytest.raises(ValueError, match="not a DLPack"):
        _C.attn_fwd_select({"q": [1, 2, 3]}, {})
    with pytest.raises(ValueError, match="causl"):
        _C.attn_fwd_select({"q": capsule(q)}, {"causl": 1})


@pytest.mark.parametrize("device,dtype", device_dtypes())
def test_workspace_without_allocator_is_a_clear_error(device, dtype):
    """If a call needs workspace and no allocator is given, say so (never allocate inside)."""
    q = randn(1, 1, 8, 64, dtype=dtype, device=device)
    kc = randn(1, 4096, 8, 64, dtype=dtype, device=device)
    sl = torch.tensor([4000], dtype=torch.int32, device=device)
    tensors = lambda: {"q": capsule(q), "k": capsule(kc), "v": capsule(kc),  # noqa: E731
                       "out": capsule(torch.empty_like(q)), "seqused_k": capsule(sl)}
    stream = torch.cuda.current_stream().cuda_stream if device == "cuda" else 0
    sel = _C.attn_fwd_select(tensors(), {"num_splits": 8}, stream)
    if sel["workspace_bytes"] == 0:
        pytest.skip(f"{sel['backend']} needs no workspace for split-KV")
    with pytest.raises(RuntimeError, match="workspace"):
        _C.attn_fwd(tensors(), {"num_splits": 8}, stream)
