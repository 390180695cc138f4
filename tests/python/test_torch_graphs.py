"""Dropout inside CUDA graphs (torch.cuda.graph and torch.compile mode="reduce-overhead").

The dropout (seed, offset) is drawn on the device by a torch random op from the default CUDA
generator, which torch registers with every graph it captures, so:
  * every replay (and every call within one replay) draws a new pattern;
  * a replay's output and gradients are those of an eager call with the same (seed, offset): the
    rng_state the replay returns gives the oracle's pattern, and an eager call started from the
    generator state the replay started from draws the same rng_state and gives the same bits;
  * torch.manual_seed between replays makes them reproducible, as it does eagerly.
Capture itself runs in torch's default "global" capture mode, where a host read of device memory,
a synchronization or a blocking copy inside the call fails the capture."""
import pytest
import torch

import reference as ref
from helpers import leaf64, leaf_lowp, randn

fa = pytest.importorskip("flashport.torch")
pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA graphs need a GPU")

P = 0.3
B, SQ, SK, HQ, HKV, D = 2, 77, 131, 4, 2, 64


def fwd(q, k, v):
    """The forward custom op (it returns its rng_state); deterministic backward: bitwise
    repeatable gradients, so a replay and an eager call can be compared exactly."""
    return torch.ops.flashport.attn_fwd(q, k, v, None, None, 0, 0, None, None, None, None, P,
                                        D ** -0.5, True, -1, -1, 0.0, 0, 0, True, 0)


def make_inputs():
    q = randn(B, SQ, HQ, D, dtype=torch.float16, device="cuda", requires_grad=True)
    k = randn(B, SK, HKV, D, dtype=torch.float16, device="cuda", requires_grad=True)
    v = randn(B, SK, HKV, D, dtype=torch.float16, device="cuda", requires_grad=True)
    dout = randn(B, SQ, HQ, D, dtype=torch.float16, device="cuda")
    return q, k, v, dout


def train_step(q, k, v, dout):
    """Forward with dropout and backward through autograd; returns detached results."""
    for t in (q, k, v):
        t.grad = None
    out, lse, rng = fwd(q, k, v)
    out.backward(dout)
    return out.detach(), lse, rng, q.grad, k.grad, v.grad


def capture(fn, *args):
    """torch's whole-network capture recipe: warm up on a side stream, then capture."""
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(2):
            fn(*args)
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        static = fn(*args)
    return graph, static


def replay(graph, static):
    graph.replay()
    torch.cuda.synchronize()
    return [t.clone() for t in static]


def check_against_oracle(q, k, v, dout, out, rng, grads):
    """The pattern of rng (the independent numpy Philox) gives the oracle's out and grads."""
    keep = ref.dropout_keep(*rng.tolist(), B, HQ, SQ, SK, P)
    q64, k64, v64 = leaf64(q), leaf64(k), leaf64(v)
    out64, _ = ref.attention_batched(q64, k64, v64, causal=True, keep=keep, dropout_p=P)
    ql, kl, vl = leaf_lowp(q), leaf_lowp(k), leaf_lowp(v)
    naive, _ = ref.attention_batched(ql, kl, vl, causal=True, keep=keep, dropout_p=P)
    ref.assert_close_to_ref(out, out64, naive, "out")
    out64.backward(dout.double().cpu())
    naive.backward(dout.cpu())
    for name, got, r, n in zip(("dq", "dk", "dv"), grads, (q64.grad, k64.grad, v64.grad),
                               (ql.grad, kl.grad, vl.grad)):
        ref.assert_close_to_ref(got, r, n, name, factor=3.0)


def test_graph_replays_draw_new_patterns_equal_to_eager_calls():
    q, k, v, dout = make_inputs()
    graph, static = capture(train_step, q, k, v, dout)
    gen = torch.cuda.default_generators[torch.cuda.current_device()]
    starts, runs = [], []
    for _ in range(3):
        starts.append(gen.get_state())
        runs.append(replay(graph, static))
    # New (seed, offset), output and gradients at every replay.
    for a in range(3):
        for b in range(a + 1, 3):
            assert not torch.equal(runs[a][2], runs[b][2]), "same rng_state in two replays"
            assert not torch.equal(runs[a][0], runs[b][0]), "same dropout pattern in two replays"
            assert not torch.equal(runs[a][5], runs[b][5]), "same dv in two replays"
    for start, (out, lse, rng, dq, dk, dv) in zip(starts, runs):
        # An eager call from the generator state the replay started from draws the same
        # (seed, offset) and gives the same bits, forward and backward.
        gen.set_state(start)
        e_out, e_lse, e_rng, e_dq, e_dk, e_dv = (t.clone() for t in train_step(q, k, v, dout))
        assert torch.equal(e_rng, rng)
        assert torch.equal(e_out, out) and torch.equal(e_lse, lse)
        for name, got, want in (("dq", dq, e_dq), ("dk", dk, e_dk), ("dv", dv, e_dv)):
            assert torch.equal(got, want), name
        # The eager backward op given the replay's returned rng_state: the same gradients.
        g = torch.ops.flashport.attn_bwd(dout, q, k, v, out, lse, None, None, 0, 0, None, None,
                                         None, None, rng, P, D ** -0.5, True, -1, -1, 0.0, 0,
                                         True, 0)
        for name, got, want in zip(("dq", "dk", "dv"), g[:3], (dq, dk, dv)):
            assert torch.equal(got, want), name
        # And that rng_state's pattern is the one the replay used (independent oracle).
        check_against_oracle(q, k, v, dout, out, rng, (dq, dk, dv))


def test_manual_seed_between_replays_reproduces_them():
    q, k, v, dout = make_inputs()
    graph, static = capture(train_step, q, k, v, dout)
    torch.manual_seed(2024)
    first = replay(graph, static)
    second = replay(graph, static)
    torch.manual_seed(2024)
    again = replay(graph, static)
    torch.manual_seed(2024)
    eager = [t.clone() for t in train_step(q, k, v, dout)]
    assert not torch.equal(first[0], second[0])
    for a, b, c in zip(first, again, eager):
        assert torch.equal(a, b) and torch.equal(a, c)


def test_calls_within_one_graph_get_their_own_patterns():
    q, k, v, _ = make_inputs()

    def two_calls(q, k, v):
        with torch.no_grad():
            o1, _, r1 = fwd(q, k, v)
            o2, _, r2 = fwd(q, k, v)
        return o1, r1, o2, r2

    graph, static = capture(two_calls, q, k, v)
    runs = [replay(graph, static) for _ in range(2)]
    rngs = [r for run in runs for r in (run[1], run[3])]
    for a in range(4):
        for b in range(a + 1, 4):
            assert not torch.equal(rngs[a], rngs[b])
    for o1, _, o2, _ in runs:
        assert not torch.equal(o1, o2)


def test_compile_reduce_overhead_dropout():
    """torch.compile(mode="reduce-overhead") cudagraphs the call (no skip: every tensor of the op,
    its rng_state included, lives on the GPU) and still draws a new pattern per call."""
    from torch._dynamo.utils import counters
    q, k, v, _ = make_inputs()
    q, k, v = (t.detach() for t in (q, k, v))
    torch._dynamo.reset()
    counters.clear()
    f = torch.compile(lambda q, k, v: fa.flash_attn_func(q, k, v, dropout_p=P, causal=True),
                      mode="reduce-overhead", fullgraph=True)

    def call():
        torch.compiler.cudagraph_mark_step_begin()
        return f(q, k, v).clone()

    outs = [call() for _ in range(5)]  # warm-up, recording, then replays
    assert not counters["inductor"].get("cudagraph_skips", 0), dict(counters["inductor"])
    for a in range(5):
        for b in range(a + 1, 5):
            assert not torch.equal(outs[a], outs[b])
    torch.manual_seed(99)
    x = call()
    torch.manual_seed(99)
    y = call()
    torch.manual_seed(99)
    eager = fa.flash_attn_func(q, k, v, dropout_p=P, causal=True)
    assert torch.equal(x, y) and torch.equal(x, eager)


def test_public_api_eager_route_in_a_graph():
    """flash_attn_func itself (the eager route: straight to the extension, outputs and workspace
    from torch's allocator, the current stream from torch) captured with its backward: every
    replay draws a new pattern, and the replay after torch.manual_seed(s) equals the eager call
    after torch.manual_seed(s), forward and backward."""
    q, k, v, dout = make_inputs()

    def step(q, k, v, dout):
        for t in (q, k, v):
            t.grad = None
        out = fa.flash_attn_func(q, k, v, dropout_p=P, causal=True, deterministic=True)
        out.backward(dout)
        return out.detach(), q.grad, k.grad, v.grad

    graph, static = capture(step, q, k, v, dout)
    first, second = replay(graph, static), replay(graph, static)
    assert not torch.equal(first[0], second[0]) and not torch.equal(first[3], second[3])
    torch.manual_seed(77)
    replayed = replay(graph, static)
    torch.manual_seed(77)
    eager = [t.clone() for t in step(q, k, v, dout)]
    for name, a, b in zip(("out", "dq", "dk", "dv"), replayed, eager):
        assert torch.equal(a, b), name


def test_split_kv_decode_in_a_graph_takes_workspace_from_the_graph_pool():
    """A split-KV decode needs workspace: inside capture it comes from torch's allocator (the
    graph's pool), and replays give the eager call's bits as the cache changes in place."""
    q = randn(4, 1, 32, 128, dtype=torch.bfloat16, device="cuda")
    kc, vc = (randn(4, 8192, 8, 128, dtype=torch.bfloat16, device="cuda") for _ in range(2))
    seqlens = torch.tensor([8192, 5000, 17, 8000], dtype=torch.int32, device="cuda")

    def decode(q, kc, vc, seqlens):
        return (fa.flash_attn_with_kvcache(q, kc, vc, cache_seqlens=seqlens, num_splits=8),)

    graph, static = capture(decode, q, kc, vc, seqlens)
    for _ in range(2):
        kc.normal_()
        seqlens.sub_(3)
        got = replay(graph, static)[0]
        want = fa.flash_attn_with_kvcache(q, kc, vc, cache_seqlens=seqlens, num_splits=8)
        assert torch.equal(got, want)
