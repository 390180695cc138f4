"""Dropout: the kept elements follow the contract's Philox rule (checked with an independent
numpy Philox), torch.manual_seed reproduces a run, the generator advances between calls, the
backward replays the forward's pattern (it reads the forward's rng_state tensor), and S_dmask
encodes it. The rng_state is an int64 [2] tensor on the inputs' device (CUDA-graph safe; the graph
tests are in test_torch_graphs.py). CUDA runs float16/bfloat16 and float32, the CPU float32."""
import pytest
import torch

import reference as ref
from helpers import device_dtypes, leaf64, leaf_lowp, randn

fa = pytest.importorskip("flashport.torch")


def dtype_for(device):
    return torch.float16 if device == "cuda" else torch.float32


def fwd_with_rng(q, k, v, p, causal=False, deterministic=False):
    """The custom op itself returns the (seed, offset) it drew."""
    scale = q.shape[-1] ** -0.5
    return torch.ops.flashport.attn_fwd(q, k, v, None, None, 0, 0, None, None, None, None, p,
                                        scale, causal, -1, -1, 0.0, 0, 0, deterministic, 0)


def bwd_with_rng(dout, q, k, v, out, lse, rng, p, causal=False):
    """The backward custom op, given an rng_state (deterministic, so repeatable bit for bit)."""
    scale = q.shape[-1] ** -0.5
    return torch.ops.flashport.attn_bwd(dout, q, k, v, out, lse, None, None, 0, 0, None, None,
                                        None, None, rng, p, scale, causal, -1, -1, 0.0, 0, True,
                                        0)[:3]


@pytest.mark.parametrize("device,dtype", device_dtypes([torch.float32, torch.float16,
                                                        torch.bfloat16]))
@pytest.mark.parametrize("p", [0.17, 0.5])
@pytest.mark.parametrize("causal", [False, True])
def test_values_and_grads_follow_philox_rule(device, dtype, p, causal):
    b, sq, sk, hq, hkv, d = 2, 19, 37, 4, 2, 32
    q = randn(b, sq, hq, d, dtype=dtype, device=device, requires_grad=True)
    k = randn(b, sk, hkv, d, dtype=dtype, device=device, requires_grad=True)
    v = randn(b, sk, hkv, d, dtype=dtype, device=device, requires_grad=True)
    out, lse, rng = fwd_with_rng(q, k, v, p, causal)
    assert rng.device == q.device and rng.dtype == torch.int64 and rng.shape == (2,)
    seed, offset = rng.tolist()
    keep = ref.dropout_keep(seed, offset, b, hq, sq, sk, p)
    frac = keep.double().mean().item()
    assert abs(frac - (1 - p)) < 0.03, frac
    q64, k64, v64 = leaf64(q), leaf64(k), leaf64(v)
    out64, lse64 = ref.attention_batched(q64, k64, v64, causal=causal, keep=keep, dropout_p=p)
    naive = None
    if dtype != torch.float32:  # the same computation in the inputs' precision sets the tolerance
        ql, kl, vl = leaf_lowp(q), leaf_lowp(k), leaf_lowp(v)
        naive, _ = ref.attention_batched(ql, kl, vl, causal=causal, keep=keep, dropout_p=p)
    ref.assert_close_to_ref(out, out64, naive, "out")
    ref.assert_lse_close(lse, lse64)  # the LSE of the undropped softmax
    dout = torch.randn_like(out)
    out.backward(dout)
    out64.backward(dout.double().cpu())
    lowp_grads = [None] * 3
    if naive is not None:
        naive.backward(dout.cpu())
        lowp_grads = [ql.grad, kl.grad, vl.grad]
    for name, got, r, n in zip(("dq", "dk", "dv"), (q.grad, k.grad, v.grad),
                               (q64.grad, k64.grad, v64.grad), lowp_grads):
        ref.assert_close_to_ref(got, r, n, name, factor=3.0)


def test_backward_reads_the_given_rng_state(device):
    """The backward's pattern is the one of the rng_state it is given, not a fresh draw: the
    forward's state gives the oracle's gradients, another state gives others."""
    b, s, h, d, p = 1, 29, 2, 32, 0.4
    dtype = dtype_for(device)
    q, k, v = (randn(b, s, h, d, dtype=dtype, device=device) for _ in range(3))
    out, lse, rng = fwd_with_rng(q, k, v, p)
    dout = torch.randn_like(out)
    g1 = bwd_with_rng(dout, q, k, v, out, lse, rng, p)
    g2 = bwd_with_rng(dout, q, k, v, out, lse, rng.clone(), p)
    for a, c in zip(g1, g2):
        assert torch.equal(a, c)
    other = rng.clone()
    other[1] += 1 << 20  # another offset: another pattern
    g3 = bwd_with_rng(dout, q, k, v, out, lse, other, p)
    assert not torch.equal(g1[2], g3[2])
    keep = ref.dropout_keep(*rng.tolist(), b, h, s, s, p)
    q64, k64, v64 = (leaf64(t).requires_grad_(True) for t in (q, k, v))
    out64, _ = ref.attention_batched(q64, k64, v64, keep=keep, dropout_p=p)
    out64.backward(dout.double().cpu())
    for name, got, r in zip(("dq", "dk", "dv"), g1, (q64.grad, k64.grad, v64.grad)):
        tol = 5e-2 if dtype != torch.float32 else 1e-4
        assert (got.double().cpu() - r).abs().max() < tol * max(1.0, r.abs().max()), name


def test_rng_state_device_dtype_and_fake(device):
    """rng_state is int64 [2] (empty without dropout) on the inputs' device, and the fake
    implementation (torch.compile's view) says the same; a wrong rng_state is a named error."""
    from torch._subclasses.fake_tensor import FakeTensorMode
    q, k, v = (randn(1, 8, 2, 16, dtype=dtype_for(device), device=device) for _ in range(3))
    for p, shape in ((0.25, (2,)), (0.0, (0,))):
        _, _, rng = fwd_with_rng(q, k, v, p)
        assert (rng.device, rng.dtype, tuple(rng.shape)) == (q.device, torch.int64, shape)
        with FakeTensorMode(allow_non_fake_inputs=True) as mode:
            fq, fk, fv = (mode.from_tensor(t) for t in (q, k, v))
            _, _, frng = fwd_with_rng(fq, fk, fv, p)
            assert (frng.device, frng.dtype, tuple(frng.shape)) == (q.device, torch.int64, shape)
    out, lse, rng = fwd_with_rng(q, k, v, 0.25)
    dout = torch.randn_like(out)
    for bad in (rng.to(torch.int32), rng[:1], rng.cpu() if device == "cuda" else rng.reshape(1, 2)):
        with pytest.raises(ValueError, match="rng_state"):
            bwd_with_rng(dout, q, k, v, out, lse, bad, 0.25)


def test_manual_seed_reproduces(device):
    q, k, v = (randn(2, 33, 4, 32, dtype=dtype_for(device), device=device) for _ in range(3))
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
    q, k, v = (randn(b, s, h, d, dtype=dtype_for(device), device=device) for s in (sq, sk, sk))
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
    assert (got.abs() - p64).abs().max() < (1e-5 if q.dtype == torch.float32 else 2e-3)
    visible = p64 > 0
    assert torch.equal((got < 0)[visible], ~keep[0][visible])


def test_varlen_dropout_reproducible_with_grad(device):
    lens = [5, 17]
    cu = torch.tensor([0, 5, 22], dtype=torch.int32, device=device)
    q, k, v = (randn(22, 2, 32, dtype=dtype_for(device), device=device, requires_grad=True)
               for _ in range(3))
    grads = []
    for _ in range(2):
        torch.manual_seed(11)
        for t in (q, k, v):
            t.grad = None
        out = fa.flash_attn_varlen_func(q, k, v, cu, cu, max(lens), max(lens), dropout_p=0.25,
                                        causal=True, deterministic=True)  # bitwise repeatable
        out.sum().backward()
        grads.append([out.detach().clone()] + [t.grad.clone() for t in (q, k, v)])
    for a, b in zip(*grads):
        assert torch.equal(a, b)
