"""flashport.jax: values, LSE and gradients against the fp64 oracle, under jax.jit and jax.grad;
GQA, masks, varlen, sinks, dropout, errors returned through XLA FFI."""
import numpy as np
import pytest

jax = pytest.importorskip("jax")
jnp = pytest.importorskip("jax.numpy")
torch = pytest.importorskip("torch")  # the oracle is written with torch fp64 autograd

import flashport  # noqa: E402

if not flashport.has_jax_support():
    pytest.skip("flashport built without JAX support", allow_module_level=True)
fj = pytest.importorskip("flashport.jax")

import reference as ref  # noqa: E402
from helpers import work_dtypes  # noqa: E402


def jax_devices():
    devs = [("cpu", jax.devices("cpu")[0])]
    try:
        devs.append(("cuda", jax.devices("cuda")[0]))
    except RuntimeError:
        pass
    return devs


DEVICES = jax_devices()


@pytest.fixture(params=[d for d, _ in DEVICES])
def jdev(request):
    return dict(DEVICES)[request.param]


TORCH_DTYPE = {jnp.float32: torch.float32, jnp.float16: torch.float16,
               jnp.bfloat16: torch.bfloat16}


def jdev_dtypes(dtypes=None):
    """Parameters for @pytest.mark.parametrize("jdev,dtype", ..., indirect=["jdev"]): every
    device with each dtype (dtypes=None: float32 on the CPU; float32, float16 and bfloat16 on
    CUDA, helpers.work_dtypes)."""
    out = []
    for name, _ in DEVICES:
        if dtypes is None:
            by_torch = {t: j for j, t in TORCH_DTYPE.items()}
            dts = [by_torch[t] for t in work_dtypes("cuda" if name == "cuda" else "cpu")]
        else:
            dts = dtypes
        for dt in dts:
            out.append(pytest.param(name, dt, id=f"{name}-{np.dtype(dt).name}"))
    return out


def to_torch(x, dtype):
    """A JAX array as a torch tensor of `dtype` (exact: x holds values of that dtype)."""
    return torch.from_numpy(np.array(x, np.float32)).to(TORCH_DTYPE[dtype])


def lowp_leaf(x, dtype):
    return to_torch(x, dtype).requires_grad_(True)


def rand(rng, shape, dtype, dev):
    return jax.device_put(jnp.asarray(rng.standard_normal(shape), dtype=dtype), dev)


def t64(x):
    return torch.from_numpy(np.asarray(x, dtype=np.float64)).requires_grad_(True)


def close(got, want, dtype, name, factor_ulps=8):
    got = np.asarray(got, dtype=np.float64)
    want = want.detach().numpy() if torch.is_tensor(want) else np.asarray(want)
    assert got.shape == want.shape, f"{name}: shape {got.shape} != {want.shape}"
    assert np.isfinite(got).all(), f"{name}: non-finite"
    eps = {jnp.float32: 2.0**-23, jnp.float16: 2.0**-10, jnp.bfloat16: 2.0**-7}[dtype]
    tol = factor_ulps * eps * max(1.0, np.abs(want).max()) + (1e-5 if dtype == jnp.float32 else 0)
    err = np.abs(got - want).max()
    assert err <= tol, f"{name}: error {err:.3e} > {tol:.3e}"


MASKS = {
    "none": ({}, {}),
    "causal": (dict(causal=True), dict(causal=True)),
    "window": (dict(window_size=(7, 3)), dict(window=(7, 3))),
    "softcap_causal": (dict(softcap=4.0, causal=True), dict(softcap=4.0, causal=True)),
    "top_left": (dict(causal=True, causal_align="top_left"),
                 dict(causal=True, align="top_left")),
}


@pytest.mark.parametrize("jdev,dtype", jdev_dtypes([jnp.float32, jnp.bfloat16, jnp.float16]),
                         indirect=["jdev"])
@pytest.mark.parametrize("mask", list(MASKS))
def test_values_and_grads_under_jit(jdev, dtype, mask):
    rng = np.random.default_rng(0)
    b, sq, sk, hq, hkv, d = 2, 19, 33, 4, 2, 32
    q, k, v = (rand(rng, s, dtype, jdev) for s in ((b, sq, hq, d), (b, sk, hkv, d),
                                                   (b, sk, hkv, d)))
    lib_kw, ora_kw = MASKS[mask]

    @jax.jit
    def fwd(q, k, v):
        return fj.flash_attn_func(q, k, v, return_softmax_lse=True, **lib_kw)

    out, lse = fwd(q, k, v)
    q64, k64, v64 = (t64(np.asarray(x, np.float32)) for x in (q, k, v))
    out64, lse64 = ref.attention_batched(q64, k64, v64, **ora_kw)
    close(out.astype(jnp.float32), out64, dtype, "out")
    ref.assert_lse_close(torch.from_numpy(np.asarray(lse, np.float64)), lse64)

    dout = rand(rng, out.shape, dtype, jdev)

    @jax.jit
    def grads(q, k, v):
        _, vjp = jax.vjp(lambda q, k, v: fj.flash_attn_func(q, k, v, **lib_kw), q, k, v)
        return vjp(dout)

    dq, dk, dv = grads(q, k, v)
    out64.backward(torch.from_numpy(np.asarray(dout, np.float64)))
    for name, got, want in (("dq", dq, q64.grad), ("dk", dk, k64.grad), ("dv", dv, v64.grad)):
        close(got.astype(jnp.float32), want, dtype, name, factor_ulps=32)


@pytest.mark.parametrize("jdev,dtype", jdev_dtypes(), indirect=["jdev"])
def test_grad_of_scalar_loss_with_sinks_and_alibi(jdev, dtype):
    """float32 (ulp tolerance) on the CPU and CUDA; float16/bfloat16 q/k/v (float32 sinks and
    slopes) on CUDA, with the tolerance set by the same computation in the inputs' precision."""
    rng = np.random.default_rng(1)
    b, s, hq, hkv, d = 1, 23, 4, 1, 16
    q, k, v = (rand(rng, (b, s, h, d), dtype, jdev) for h in (hq, hkv, hkv))
    sinks = rand(rng, (hq,), jnp.float32, jdev)
    slopes = jax.device_put(jnp.asarray(rng.uniform(0.05, 0.5, hq), jnp.float32), jdev)

    def loss(q, k, v, sinks):
        o = fj.flash_attn_func(q, k, v, causal=True, alibi_slopes=slopes, sinks=sinks)
        return jnp.sum(o.astype(jnp.float32) ** 2)

    g = jax.jit(jax.grad(loss, argnums=(0, 1, 2, 3)))(q, k, v, sinks)
    alibi64 = torch.from_numpy(np.asarray(slopes, np.float64))
    t = [t64(np.asarray(x, np.float32)) for x in (q, k, v, sinks)]
    o64, _ = ref.attention_batched(*t[:3], causal=True, alibi=alibi64, sinks=t[3])
    (o64 * o64).sum().backward()
    if dtype == jnp.float32:
        for name, got, want in zip(("dq", "dk", "dv", "dsinks"), g, t):
            close(got, want.grad, jnp.float32, name, factor_ulps=64)
        return
    tl = [lowp_leaf(x, dtype) for x in (q, k, v)] + [lowp_leaf(sinks, jnp.float32)]
    o_lp, _ = ref.attention_batched(*tl[:3], causal=True, alibi=alibi64.float(), sinks=tl[3])
    (o_lp.float() ** 2).sum().backward()
    for name, got, want, naive, dt in zip(("dq", "dk", "dv", "dsinks"), g, t, tl,
                                          (dtype,) * 3 + (jnp.float32,)):
        ref.assert_close_to_ref(to_torch(got, dt), want.grad, naive.grad, name, factor=3.0)


@pytest.mark.parametrize("jdev,dtype", jdev_dtypes(), indirect=["jdev"])
def test_varlen(jdev, dtype):
    """float32 (ulp tolerance) on the CPU and CUDA; float16/bfloat16 on CUDA, with the tolerance
    set by the same computation in the inputs' precision."""
    rng = np.random.default_rng(2)
    lq, lk = [3, 17, 1], [9, 17, 30]
    hq, hkv, d = 4, 2, 32
    cu_q = jax.device_put(jnp.asarray(np.cumsum([0] + lq), jnp.int32), jdev)
    cu_k = jax.device_put(jnp.asarray(np.cumsum([0] + lk), jnp.int32), jdev)
    q = rand(rng, (sum(lq), hq, d), dtype, jdev)
    k = rand(rng, (sum(lk), hkv, d), dtype, jdev)
    v = rand(rng, (sum(lk), hkv, d), dtype, jdev)
    f = jax.jit(lambda q, k, v, cq, ck: fj.flash_attn_varlen_func(
        q, k, v, cq, ck, max(lq), max(lk), causal=True, return_softmax_lse=True))
    out, lse = f(q, k, v, cu_q, cu_k)
    cq_np, ck_np = np.asarray(cu_q), np.asarray(cu_k)
    t = [t64(np.asarray(x, np.float32)) for x in (q, k, v)]
    out64, lse64 = ref.attention_varlen(*t, cq_np, ck_np, causal=True)
    ref.assert_lse_close(torch.from_numpy(np.asarray(lse, np.float64)), lse64)
    g = jax.jit(jax.grad(lambda q, k, v: jnp.sum(fj.flash_attn_varlen_func(
        q, k, v, cu_q, cu_k, max(lq), max(lk), causal=True).astype(jnp.float32) ** 2),
        argnums=(0, 1, 2)))(q, k, v)
    (out64 ** 2).sum().backward()
    if dtype == jnp.float32:
        close(out, out64, jnp.float32, "out")
        for name, got, want in zip(("dq", "dk", "dv"), g, t):
            close(got, want.grad, jnp.float32, name, factor_ulps=64)
        return
    tl = [lowp_leaf(x, dtype) for x in (q, k, v)]
    out_lp, _ = ref.attention_varlen(*tl, cq_np, ck_np, causal=True)
    ref.assert_close_to_ref(to_torch(out, dtype), out64, out_lp, "out")
    (out_lp.float() ** 2).sum().backward()
    for name, got, want, naive in zip(("dq", "dk", "dv"), g, t, tl):
        ref.assert_close_to_ref(to_torch(got, dtype), want.grad, naive.grad, name, factor=3.0)


def test_dropout_key_reproducible_and_follows_philox(jdev):
    # The key is a traced argument of one compiled function: its bits reach the kernels as a
    # device buffer (the C API's dropout_rng), so new keys need no retrace and no host read.
    dtype = jnp.float32 if jdev.platform == "cpu" else jnp.bfloat16  # CUDA runs 16-bit inputs
    rng = np.random.default_rng(3)
    b, s, h, d, p = 1, 21, 2, 16, 0.3
    q, k, v = (rand(rng, (b, s, h, d), dtype, jdev) for _ in range(3))
    f = jax.jit(lambda q, k, v, key: fj.flash_attn_func(q, k, v, dropout_p=p, dropout_key=key))
    a = f(q, k, v, jax.random.key(0))
    a2 = f(q, k, v, jax.random.key(0))
    c = f(q, k, v, jax.random.key(1))
    assert np.array_equal(np.asarray(a, np.float32), np.asarray(a2, np.float32))
    assert not np.array_equal(np.asarray(a, np.float32), np.asarray(c, np.float32))
    # The seed/offset words are jax.random.bits(key, (4,), uint32) (documented).
    w = np.asarray(jax.random.bits(jax.random.key(0), (4,), jnp.uint32)).astype(np.uint64)
    seed, offset = int(w[0] | (w[1] << 32)), int(w[2] | (w[3] << 32))
    keep = ref.dropout_keep(seed, offset, b, h, s, s, p)
    t = [t64(np.asarray(x, np.float32)) for x in (q, k, v)]
    out64, _ = ref.attention_batched(*t, keep=keep, dropout_p=p)
    close(a.astype(jnp.float32), out64, dtype, "out", factor_ulps=16)
    # and the gradient replays the same pattern
    g = jax.grad(lambda q: jnp.sum(fj.flash_attn_func(q, k, v, dropout_p=p,
                                                      dropout_key=jax.random.key(0)
                                                      ).astype(jnp.float32) ** 2))(q)
    (out64 ** 2).sum().backward()
    close(g.astype(jnp.float32), t[0].grad, dtype, "dq", factor_ulps=64)


def test_float32_on_gpu_under_jit_matches_jax_attention():
    """JAX's default dtype on the GPU: jax.jit(flash_attn_func) on float32 arrays runs (the fp32
    CUDA kernels) and agrees with jax.nn.dot_product_attention and the fp64 oracle, gradients
    included."""
    if "cuda" not in dict(DEVICES):
        pytest.skip("needs a CUDA device")
    dev = dict(DEVICES)["cuda"]
    rng = np.random.default_rng(7)
    b, sq, sk, hq, hkv, d = 2, 77, 130, 8, 2, 64
    q, k, v = (rand(rng, s, jnp.float32, dev) for s in ((b, sq, hq, d), (b, sk, hkv, d),
                                                        (b, sk, hkv, d)))
    out = jax.jit(lambda q, k, v: fj.flash_attn_func(q, k, v, causal=True))(q, k, v)
    assert out.dtype == jnp.float32
    with jax.default_matmul_precision("highest"):  # XLA's fp32 products, not TF32
        want = jax.nn.dot_product_attention(
            q, k, v, mask=jnp.tril(jnp.ones((sq, sk), bool), sk - sq)[None, None])
    assert float(jnp.max(jnp.abs(out - want))) < 1e-4
    q64, k64, v64 = (t64(np.asarray(x, np.float32)) for x in (q, k, v))
    out64, _ = ref.attention_batched(q64, k64, v64, causal=True)
    close(out, out64, jnp.float32, "out")
    dout = rand(rng, out.shape, jnp.float32, dev)
    _, vjp = jax.vjp(jax.jit(lambda q, k, v: fj.flash_attn_func(q, k, v, causal=True)), q, k, v)
    dq, dk, dv = vjp(dout)
    out64.backward(torch.from_numpy(np.asarray(dout, np.float64)))
    for name, got, want64 in (("dq", dq, q64.grad), ("dk", dk, k64.grad), ("dv", dv, v64.grad)):
        close(got, want64, jnp.float32, name, factor_ulps=32)


def test_errors_come_back_as_exceptions():
    cpu = jax.devices("cpu")[0]
    rng = np.random.default_rng(4)
    q = rand(rng, (1, 8, 5, 32), jnp.float32, cpu)
    k = rand(rng, (1, 8, 2, 32), jnp.float32, cpu)
    with pytest.raises(Exception, match="(?i)head"):  # FFI error carrying the C++ message
        jax.block_until_ready(fj.flash_attn_func(q, k, k))
    with pytest.raises(ValueError, match="dropout_key"):
        fj.flash_attn_func(q, k, k, dropout_p=0.1)
    with pytest.raises(NotImplementedError, match="return_softmax_lse"):
        fj.flash_attn_func(q, k, k, return_attn_probs=True)
    with pytest.raises(NotImplementedError, match="block_table"):
        fj.flash_attn_varlen_func(q[0], k[0], k[0], None, None, 8, 8, block_table=q)


def test_vmap_over_heads_batch():
    """vmap of the FFI call (sequential) matches the batched call."""
    cpu = jax.devices("cpu")[0]
    rng = np.random.default_rng(5)
    q, k, v = (rand(rng, (3, 1, 11, 2, 16), jnp.float32, cpu) for _ in range(3))
    batched = fj.flash_attn_func(q[:, 0], k[:, 0], v[:, 0], causal=True)
    mapped = jax.vmap(lambda q, k, v: fj.flash_attn_func(q, k, v, causal=True))(q, k, v)
    assert np.allclose(np.asarray(mapped[:, 0]), np.asarray(batched), atol=1e-6)
