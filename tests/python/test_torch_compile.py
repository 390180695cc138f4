"""torch.compile(fullgraph=True) traces the custom ops (fake implementations) forward and
backward; torch.library.opcheck validates schemas, fake kernels and autograd registration.
Each test runs in work_dtype(device): float32 on the CPU, float16 on CUDA (whose dtypes are
float16/bfloat16; one of them keeps the number of slow compiles down)."""
import pytest
import torch

from helpers import eps, is_lowp, randn, work_dtype

fa = pytest.importorskip("flashport.torch")


def attn_block(q, k, v, sinks):
    out = fa.flash_attn_func(q, k, v, causal=True, sinks=sinks)
    return (out.float() ** 2).sum()


@pytest.mark.parametrize("compiler", ["aot_eager", "inductor"])
def test_compile_fullgraph_fwd_bwd(device, compiler):
    dtype = work_dtype(device)
    q, k, v = (randn(2, 24, 4, 32, dtype=dtype, device=device, requires_grad=True)
               for _ in range(3))
    sinks = randn(4, device=device, requires_grad=True)
    eager = attn_block(q, k, v, sinks)
    eager.backward()
    grads = [t.grad.clone() for t in (q, k, v, sinks)]
    for t in (q, k, v, sinks):
        t.grad = None
    torch._dynamo.reset()
    compiled = torch.compile(attn_block, fullgraph=True, backend=compiler)
    loss = compiled(q, k, v, sinks)
    loss.backward()
    assert torch.allclose(loss, eager, rtol=1e-5, atol=1e-5)
    # 16-bit: CUDA's default backward adds dQ with atomics (any order), so dq may differ from
    # the eager run's by a rounding of its dtype.
    rtol, atol = (2 * eps(dtype), 2 * eps(dtype)) if is_lowp(dtype) else (1e-4, 1e-5)
    for g, t in zip(grads, (q, k, v, sinks)):
        assert torch.allclose(t.grad, g, rtol=rtol, atol=atol)


def test_compile_varlen_kvcache_merge(device):
    cu = torch.tensor([0, 5, 12], dtype=torch.int32, device=device)

    def fn(q, k, v, kc, vc, seqlens, kn, vn):
        a = fa.flash_attn_varlen_func(q, k, v, cu, cu, 7, 7, causal=True)
        b, lse_b = fa.flash_attn_with_kvcache(q[:2, None], kc, vc, kn, vn, cache_seqlens=seqlens,
                                              return_softmax_lse=True)
        m, _ = fa.merge_attn_states(torch.stack([b, b]).float(), torch.stack([lse_b, lse_b]))
        return a, b, m

    dt = work_dtype(device)
    q, k, v = (randn(12, 2, 32, dtype=dt, device=device) for _ in range(3))
    kc, vc = (randn(2, 16, 2, 32, dtype=dt, device=device) for _ in range(2))
    kn, vn = (randn(2, 1, 2, 32, dtype=dt, device=device) for _ in range(2))
    seqlens = torch.tensor([3, 9], dtype=torch.int32, device=device)
    kc2, vc2 = kc.clone(), vc.clone()
    eager = fn(q, k, v, kc, vc, seqlens, kn, vn)
    torch._dynamo.reset()
    got = torch.compile(fn, fullgraph=True, backend="aot_eager")(q, k, v, kc2, vc2, seqlens, kn,
                                                                 vn)
    for a, b in zip(eager, got):
        assert torch.allclose(a, b, atol=1e-6)
    assert torch.equal(kc, kc2) and torch.equal(vc, vc2)  # the in-place append happened once


def test_compile_dropout_reproducible(device):
    q, k, v = (randn(1, 16, 2, 32, dtype=work_dtype(device), device=device) for _ in range(3))
    f = torch.compile(lambda q, k, v: fa.flash_attn_func(q, k, v, dropout_p=0.2), fullgraph=True,
                      backend="aot_eager")
    torch.manual_seed(5)
    a = f(q, k, v)
    torch.manual_seed(5)
    b = f(q, k, v)
    torch.manual_seed(5)
    c = fa.flash_attn_func(q, k, v, dropout_p=0.2)
    assert torch.equal(a, b) and torch.equal(a, c)


def test_opcheck(device):
    q, k, v = (randn(1, 9, 4, 16, dtype=work_dtype(device), device=device, requires_grad=True)
               for _ in range(3))
    sinks = randn(4, device=device)
    args = (q, k, v, None, None, 0, 0, None, None, None, sinks, 0.0, 0.25, True, -1, -1, 0.0, 0, 0,
            False, 0)
    torch.library.opcheck(torch.ops.flashport.attn_fwd.default, args)
    outs = randn(2, 1, 9, 4, 16, device=device, requires_grad=True)
    lses = randn(2, 1, 4, 9, device=device, requires_grad=True)
    torch.library.opcheck(torch.ops.flashport.merge_fwd.default, (outs, lses, 0))
