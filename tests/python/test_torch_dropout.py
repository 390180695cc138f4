"""Dropout: the kept elements follow the contract's Philox rule (checked with an independent
numpy Philox), torch.manual_seed reproduces a run, the generator advances between calls, the
backward replays the forward's pattern, and S_dmask encodes it."""
import pytest
import torch

import reference as ref
from helpers import backward_or_xfail, leaf64, randn

fa = pytest.importorskip("flashport.torch")


def fwd_with_rng(q, k, v, p, causal=False):
    """The custom op itself returns the (seed, offset) it drew."""
    scale = q.shape[-1] ** -0.5
    return torch.ops.flashport.attn_fwd(q, k, v, None, None, 0, 0, None, None, None, None, p,
                                        scale, causal, -1, -1, 0.0, 0, 0, False, 0)


@pytest.mark.parametrize("p", [0.17, 0.5])
@pytest.mark.parametrize("causal", [False, True])
def test_values_and_grads_follow_philox_rule(device, p, causal):
    b, sq, sk, hq, hkv, d = 2, 19, 37, 4, 2, 32
    q = randn(b, sq, hq, d, device=device, requires_grad=True)
    k = randn(b, sk, hkv, d, device=device, requires_grad=True)
    v = randn(b, sk, hkv, d, device=device, requires_grad=True)
    out, lse, rng = fwd_with_rng(q, k, v, p, causal)
    seed, offset = rng.tolist()
    keep = ref.dropout_keep(seed, offset, b, hq, sq, sk, p)
    frac = keep.double().mean().item()
    assert abs(frac - (1 - p)) < 0.03, frac
    q64, k64, v64 = leaf64(q), leaf64(k), leaf64(v)
    out64, lse64 = ref.attention_batched(q64, k64, v64, causal=causal, keep=keep, dropout_p=p)
    ref.assert_close_to_ref(out, out64, None, "out")
    ref.assert_lse_close(lse, lse64)  # the LSE of the undropped softmax
    dout = torch.randn_like(out)
    backward_or_xfail(device, lambda: out.backward(dout))
    out64.backward(dout.double().cpu())
    for name, got, r in (("dq", q.grad, q64.grad), ("dk", k.grad, k64.grad),
                         ("dv", v.grad, v64.grad)):
        ref.assert_close_to_ref(got, r, None, name)


def test_manual_seed_reproduces(device):
    q, k, v = (randn(2, 33, 4, 32, device=device) for _ in range(3))
    torch.manual_seed(7)
    a = fa.flash_attn_func(q, k, v, dropout_p=0.3)
    b = fa.flash_attn_func(q, k, v, dropout_p=0.3)  # generator advanced: a new pattern
    torch.manual_seed(7)
    a2 = fa.flash_attn_func(q, k, v, dropout_p=0.3)
    assert torch.equal(a, a2)
    assert not torch.equal(a, b)
    torch.manual_seed(8)
    c = fa.flash_attn_func(q, k, v, dropout_p=0.3)
    assert not torch.equal(a, c)


def test_s_dmask_encodes_pattern(device):
    b, sq, sk, h, d, p = 1, 12, 21, 2, 16, 0.4
    q, k, v = (randn(b, s, h, d, device=device) for s in (sq, sk, sk))
    torch.manual_seed(3)
    out, lse, s_dmask = fa.flash_attn_func(q, k, v, dropout_p=p, causal=True,
                                           return_attn_probs=True)
    torch.manual_seed(3)
    _, _, rng = fwd_with_rng(q, k, v, p, causal=True)
    keep = ref.dropout_keep(*rng.tolist(), b, h, sq, sk, p)
    _, lse64 = ref.attention_one(q[0].double().cpu(), k[0].double().cpu(), v[0].double().cpu(),
                                 causal=True)
    p64 = ref.probs_one(q[0].double().cpu(), k[0].double().cpu(), lse64, scale=d ** -0.5,
                        causal=True)
    got = s_dmask[0].double().cpu()
    assert (got.abs() - p64).abs().max() < 1e-5
    visible = p64 > 0
    assert torch.equal((got < 0)[visible], ~keep[0][visible])


def test_varlen_dropout_reproducible_with_grad(device):
    lens = [5, 17]
    cu = torch.tensor([0, 5, 22], dtype=torch.int32, device=device)
    q, k, v = (randn(22, 2, 32, device=device, requires_grad=True) for _ in range(3))
    grads = []
    for _ in range(2):
        torch.manual_seed(11)
        for t in (q, k, v):
            t.grad = None
        out = fa.flash_attn_varlen_func(q, k, v, cu, cu, max(lens), max(lens), dropout_p=0.25,
                                        causal=True)
        backward_or_xfail(device, lambda: out.sum().backward())
        grads.append([out.detach().clone()] + [t.grad.clone() for t in (q, k, v)])
    for a, b in zip(*grads):
        assert torch.equal(a, b)
