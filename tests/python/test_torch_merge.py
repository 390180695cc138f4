"""merge_attn_states: values, all -inf partials, gradients in out and lse, and the identity
'attention over split keys, merged == attention over all keys'."""
import pytest
import torch

import reference as ref
from helpers import device_dtypes, eps, is_lowp, leaf64, leaf_lowp, randn

fa = pytest.importorskip("flashport.torch")


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16], ids=str)
@pytest.mark.parametrize("packed", [False, True], ids=["batched", "packed"])
def test_merge_values_and_grads(device, dtype, packed):
    n, b, s, h, dv = 3, 2, 9, 4, 24
    if packed:
        outs = randn(n, s, h, dv, dtype=dtype, device=device, requires_grad=True)
        lses = (randn(n, h, s, device=device) * 3)
    else:
        outs = randn(n, b, s, h, dv, dtype=dtype, device=device, requires_grad=True)
        lses = (randn(n, b, h, s, device=device) * 3)
    lses[0].view(-1)[::5] = float("-inf")      # some partials empty
    lses[:, ..., 0] = float("-inf")            # a row where every partial is empty
    lses.requires_grad_(True)
    out, lse = fa.merge_attn_states(outs, lses)
    o64, l64 = leaf64(outs), leaf64(lses)
    out64, lse64 = ref.merge(o64, l64, packed)
    ref.assert_close_to_ref(out, out64, None, "out")
    ref.assert_lse_close(lse, lse64)
    assert (out[..., 0, :, :] == 0).all() if packed else (out[:, 0] == 0).all()
    w_out = torch.randn_like(out64).to(dtype).double()  # as the library sees it
    w_lse = torch.randn_like(lse64).masked_fill(torch.isinf(lse64), 0)
    loss = (out * w_out.to(device, dtype)).sum() + (lse.masked_fill(torch.isinf(lse), 0)
                                                    * w_lse.to(device)).sum()
    loss.backward()

    def oracle_loss(o, l):
        mo, ml = ref.merge(o, l, packed)
        return (mo * w_out.to(mo.dtype)).sum() + (ml.masked_fill(torch.isinf(ml), 0)
                                                  * w_lse.to(ml.dtype)).sum()

    oracle_loss(o64, l64).backward()
    ol, ll = leaf_lowp(outs), leaf_lowp(lses)  # same computation in the inputs' precision
    oracle_loss(ol, ll).backward()
    ref.assert_close_to_ref(outs.grad, o64.grad, ol.grad, "d_out_partials")
    # d lse_i = w_i * (dout . (out_i - out) + dlse): the backward reads the forward's out, which
    # is stored in the inputs' precision, so the oracle evaluates the formula with that out.
    lse_s = torch.where(torch.isinf(lse64), torch.zeros_like(lse64), lse64)
    w = torch.exp(l64.detach() - lse_s).transpose(-1, -2)              # [N, (B,) S, H]
    dot = (w_out * (o64.detach() - out.detach().double().cpu())).sum(-1)  # [N, (B,) S, H]
    expect = (w * (dot + w_lse.transpose(-1, -2))).transpose(-1, -2)
    ref.assert_close_to_ref(lses.grad, expect, None, "d_lse_partials", factor=0)
    assert (l64.grad - expect).abs().max() < 0.05  # and the formula is the true gradient


@pytest.mark.parametrize("device,dtype", device_dtypes())
def test_split_keys_then_merge_equals_full(device, dtype):
    """With 16-bit inputs each partial output is rounded to the dtype before the (float32) merge,
    and the full output once: they agree to about one rounding of the largest |v| (<= 2 eps)."""
    b, sq, sk, h, d = 2, 7, 50, 2, 32
    q, k, v = (randn(b, s, h, d, dtype=dtype, device=device) for s in (sq, sk, sk))
    full = fa.flash_attn_func(q, k, v)
    parts = [fa.flash_attn_func(q, k[:, a:z], v[:, a:z], return_attn_probs=True)
             for a, z in ((0, 13), (13, 41), (41, 50))]
    out, lse = fa.merge_attn_states([p[0].float() for p in parts], [p[1] for p in parts])
    _, full_lse, _ = fa.flash_attn_func(q, k, v, return_attn_probs=True)
    out_tol = 2 * eps(dtype) * max(1.0, v.abs().max().item()) if is_lowp(dtype) else 1e-5
    assert out.dtype == torch.float32
    assert (out - full.float()).abs().max() < out_tol
    lse_tol = 2e-5 * (1 + full_lse.abs().max().item()) if is_lowp(dtype) else 1e-5
    assert (lse - full_lse).abs().max() < lse_tol
