"""The two routes of flashport.torch: eager calls on plain tensors go straight to the extension;
traced calls (torch.compile, export), fake tensors, dispatch modes and tensor subclasses go through
the registered custom ops. Both must give the same bits, and each must be taken when it should."""
import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from helpers import randn, work_dtype

fa = pytest.importorskip("flashport.torch")

NAN = float("nan")


class OpLog(TorchDispatchMode):
    """Records the ops dispatched while active (a dispatch mode: the custom-op route)."""

    def __init__(self):
        super().__init__()
        self.ops = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.ops.append(str(func))
        return func(*args, **(kwargs or {}))


def flashport_ops(fn):
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        fn()
    return [e.name for e in prof.events() if e.name.startswith("flashport::")]


def test_eager_calls_skip_the_custom_op_dispatch(device):
    dt = work_dtype(device)
    q, k, v = (randn(1, 9, 2, 32, dtype=dt, device=device, requires_grad=True) for _ in range(3))
    assert flashport_ops(lambda: fa.flash_attn_func(q, k, v, causal=True).sum().backward()) == []
    kc = randn(1, 16, 2, 32, dtype=dt, device=device)
    assert flashport_ops(lambda: fa.flash_attn_with_kvcache(q[:, :1].detach(), kc, kc,
                                                            cache_seqlens=5)) == []
    parts = randn(2, 1, 9, 2, 32, device=device)
    assert flashport_ops(lambda: fa.merge_attn_states(parts, randn(2, 1, 2, 9, device=device))) == []


def test_dispatch_modes_see_the_custom_ops(device):
    dt = work_dtype(device)
    q, k, v = (randn(1, 9, 2, 32, dtype=dt, device=device, requires_grad=True) for _ in range(3))
    eager = fa.flash_attn_func(q, k, v, causal=True)
    with OpLog() as log:
        traced = fa.flash_attn_func(q, k, v, causal=True)
        traced.sum().backward()
    assert "flashport.attn_fwd.default" in log.ops and "flashport.attn_bwd.default" in log.ops
    assert torch.equal(eager, traced)


def test_fake_tensors_take_the_custom_op_fakes():
    from torch._subclasses.fake_tensor import FakeTensorMode
    with FakeTensorMode():
        q = torch.empty(2, 7, 4, 32)
        k = torch.empty(2, 9, 2, 32)
        v = torch.empty(2, 9, 2, 48)
        out, lse, s_dmask = fa.flash_attn_func(q, k, v, causal=True, return_attn_probs=True)
        assert out.shape == (2, 7, 4, 48) and lse.shape == (2, 4, 7) and s_dmask is None
        _, _, s_dmask = fa.flash_attn_func(q, k, v, dropout_p=0.1, return_attn_probs=True)
        assert s_dmask.shape == (2, 4, 7, 9) and s_dmask.dtype == q.dtype
        cu = torch.empty(3, dtype=torch.int32)
        o = fa.flash_attn_varlen_func(q[0], k[0], v[0], cu, cu, 7, 9)
        assert o.shape == (7, 4, 48)


def _fwd_bwd(route, q, k, v, sinks, p, window=(-1, -1), softcap=0.0):
    """One forward+backward (deterministic backward: bitwise repeatable) by either route."""
    for t in (q, k, v, sinks):
        t.grad = None
    torch.manual_seed(21)
    if route == "eager":
        out = fa.flash_attn_func(q, k, v, dropout_p=p, causal=True, window_size=window,
                                 softcap=softcap, sinks=sinks, deterministic=True)
    else:
        out = torch.ops.flashport.attn_fwd(q, k, v, None, None, 0, 0, None, None, None, sinks, p,
                                           NAN, True, window[0], window[1], softcap, 0, 0, True,
                                           0)[0]
    out.backward(torch.arange(out.numel(), device=out.device).reshape(out.shape).sin().to(out.dtype))
    return [out.detach(), q.grad, k.grad, v.grad, sinks.grad]


@pytest.mark.parametrize("p", [0.0, 0.25])
def test_fwd_bwd_routes_bit_identical(device, p):
    dt = work_dtype(device)
    q = randn(2, 13, 4, 32, dtype=dt, device=device, requires_grad=True)
    k, v = (randn(2, 21, 2, 32, dtype=dt, device=device, requires_grad=True) for _ in range(2))
    sinks = randn(4, device=device, requires_grad=True)
    eager = _fwd_bwd("eager", q, k, v, sinks, p, window=(5, -1), softcap=3.0)
    ops = _fwd_bwd("ops", q, k, v, sinks, p, window=(5, -1), softcap=3.0)
    for a, b in zip(eager, ops):
        assert torch.equal(a, b)


def test_compiled_equals_eager_bitwise(device):
    dt = work_dtype(device)
    q = randn(2, 13, 4, 32, dtype=dt, device=device, requires_grad=True)
    k, v = (randn(2, 21, 2, 32, dtype=dt, device=device, requires_grad=True) for _ in range(2))

    def f(q, k, v):
        return fa.flash_attn_func(q, k, v, causal=True, deterministic=True)

    eager = f(q, k, v)
    eager.backward(torch.ones_like(eager))
    grads = [t.grad.clone() for t in (q, k, v)]
    for t in (q, k, v):
        t.grad = None
    torch._dynamo.reset()
    got = torch.compile(f, fullgraph=True, backend="aot_eager")(q, k, v)
    got.backward(torch.ones_like(got))
    assert torch.equal(eager, got)
    for g, t in zip(grads, (q, k, v)):
        assert torch.equal(g, t.grad)


def test_varlen_kvcache_merge_routes_bit_identical(device):
    dt = work_dtype(device)
    cu = torch.tensor([0, 5, 12], dtype=torch.int32, device=device)
    qv, kv, vv = (randn(12, 4, 32, dtype=dt, device=device) for _ in range(3))
    eager = fa.flash_attn_varlen_func(qv, kv, vv, cu, cu, 7, 7, causal=True)
    ops = torch.ops.flashport.attn_fwd(qv, kv, vv, cu, cu, 7, 7, None, None, None, None, 0.0, NAN,
                                       True, -1, -1, 0.0, 0, 0, False, 0)[0]
    assert torch.equal(eager, ops)

    q = randn(2, 1, 4, 32, dtype=dt, device=device)
    caches = [randn(2, 16, 2, 32, dtype=dt, device=device) for _ in range(2)]
    kc1, vc1 = (c.clone() for c in caches)
    kc2, vc2 = (c.clone() for c in caches)
    kn, vn = (randn(2, 1, 2, 32, dtype=dt, device=device) for _ in range(2))
    seqlens = torch.tensor([3, 9], dtype=torch.int32, device=device)
    v1 = kc1._version
    eager = fa.flash_attn_with_kvcache(q, kc1, vc1, kn, vn, cache_seqlens=seqlens,
                                       return_softmax_lse=True)
    assert kc1._version > v1  # the append is recorded as an in-place write
    ops = torch.ops.flashport.attn_fwd_kvcache(q, kc2, vc2, kn, vn, None, None, seqlens, None,
                                               None, None, None, NAN, False, -1, -1, 0.0, True,
                                               0, 0, 0)
    for a, b in zip(list(eager) + [kc1, vc1], list(ops) + [kc2, vc2]):
        assert torch.equal(a, b)

    parts = randn(2, 1, 9, 2, 32, device=device, requires_grad=True)
    lses = randn(2, 1, 2, 9, device=device, requires_grad=True)
    eager = fa.merge_attn_states(parts, lses)
    (eager[0].sum() + eager[1].sum()).backward()
    eager_grads = [parts.grad.clone(), lses.grad.clone()]
    parts.grad = lses.grad = None
    ops = torch.ops.flashport.merge_fwd(parts, lses, 0)
    (ops[0].sum() + ops[1].sum()).backward()
    for a, b in zip(list(eager) + eager_grads, list(ops) + [parts.grad, lses.grad]):
        assert torch.equal(a, b)
