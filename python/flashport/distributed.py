"""flashport.distributed: ring attention (context parallelism) over a torch.distributed group.

    import flashport.distributed as fpd

    q_local = fpd.shard_sequence(q, rank, world_size)          # zigzag: chunks r and 2W-1-r
    out_local = fpd.ring_flash_attn_func(q_local, k_local, v_local, causal=True, group=group)
    out = fpd.gather_sequence(out_local, group)                  # the full sequence, if wanted

One attention call whose sequence is sharded along the token dimension over the ranks of an
existing process group (NCCL for CUDA tensors, gloo for CPU tensors; the transport is
torch.distributed's point-to-point ops). Each rank keeps its query shard; the key/value shards
travel around the ring (rank r sends to r+1 and receives from r-1), one hop per step, and the next
shard's transfer runs while the current one is attended. Each step's partial result is merged into
the rank's output with its log-sum-exp, so the result is exact. The backward runs the same ring:
each step calls the attention backward with the forward's final out and lse, dq accumulates
locally, and the dK/dV accumulators (fp32) travel with the key/value shards and take one last hop
home.

Sharding layouts (``layout=``): "zigzag" (the default) cuts the sequence into 2W chunks and gives
rank r chunks r and 2W-1-r, so under a causal mask every rank does the same work at every step;
"contiguous" gives rank r chunk r of W (causal work is then unbalanced). shard_sequence /
unshard_sequence / gather_sequence and shard_varlen / unshard_varlen convert between full and
sharded tensors; the attention functions take the layout the shards were cut with.

Varlen (packed documents): every document is sharded separately in the same layout, so rank r
holds chunks r and 2W-1-r of each document (zigzag), packed in document order, and its local
cu_seqlens (int32 [B+1], identical on every rank) describe those local pieces. Each document's
length must be divisible by 2W (zigzag) or W (contiguous); pad documents to that.

What composes with the ring: causal masks, GQA/MQA, softcap, sliding windows (batched inputs;
masked-out steps are skipped, though the shards still travel the whole ring), different Dv.
What does not, raising RingAttentionUnsupported (a NotImplementedError): ALiBi (a block's
distances |i - j| are not expressible with the kernels' alignments), dropout (the Philox pattern
is keyed by local positions), and windows with varlen inputs (each document's chunks sit at
different offsets). Sinks and paged caches are not arguments. The full sequence is square, so the
causal alignment is that of flash_attn_func with Sq == Sk and there is no ``causal_align``.

ulysses_flash_attn_func is the head-parallel alternative on the same shards: all-to-alls turn
sequence shards into head groups over the whole sequence and back around one local call, so every
option composes (ALiBi and windows included), at the price of Hq and Hkv divisible by W.

Costs: a call checks, with one small all_gather and one host read, that every rank passes the same
shapes, dtype, options and cu_seqlens (``check_inputs=False`` skips it; mismatches then hang or
fail inside the transport). Varlen inputs with a causal mask gather the half-document rows of the
off-diagonal steps into packed copies.
"""
from dataclasses import dataclass
from typing import List, Optional, Sequence, Tuple, Union

import torch
import torch.distributed as dist
from torch import Tensor

from . import Backend, CausalAlign
from . import torch as _registers_ops  # noqa: F401  (defines torch.ops.flashport.*)

__all__ = [
    "RingAttentionUnsupported",
    "ring_flash_attn_func",
    "ulysses_flash_attn_func",
    "ring_flash_attn_varlen_func",
    "shard_sequence",
    "unshard_sequence",
    "gather_sequence",
    "shard_varlen",
    "unshard_varlen",
    "LAYOUTS",
]

LAYOUTS = ("zigzag", "contiguous")
_TOP_LEFT = int(CausalAlign.TOP_LEFT)


class RingAttentionUnsupported(NotImplementedError):
    """An attention option that does not compose with ring attention (see the module docstring)."""


# --------------------------------------------------------------------------------------------
# Layouts: which global token ranges a rank holds
# --------------------------------------------------------------------------------------------

def _check_layout(layout: str) -> str:
    if layout not in LAYOUTS:
        raise ValueError(f"flashport.distributed: layout must be one of {LAYOUTS}, got {layout!r}")
    return layout


def _num_chunks(world_size: int, layout: str) -> int:
    return 2 * world_size if layout == "zigzag" else world_size


def _chunk_ids(rank: int, world_size: int, layout: str) -> Tuple[int, ...]:
    return (rank, 2 * world_size - 1 - rank) if layout == "zigzag" else (rank,)


def _rank_ranges(length: int, rank: int, world_size: int, layout: str) -> List[Tuple[int, int]]:
    """The global [start, stop) token ranges of `rank`'s shard of a sequence of `length` tokens,
    in local order."""
    n = _num_chunks(world_size, layout)
    if length % n:
        raise ValueError(f"flashport.distributed: a sequence of {length} tokens cannot be sharded "
                         f"in layout {layout!r} over {world_size} ranks: its length must be "
                         f"divisible by {n}")
    chunk = length // n
    return [(c * chunk, (c + 1) * chunk) for c in _chunk_ids(rank, world_size, layout)]


def shard_sequence(x: Tensor, rank: int, world_size: int, *, layout: str = "zigzag",
                   dim: int = 1) -> Tensor:
    """Rank `rank`'s shard of the full tensor x along `dim` (the token dim: 1 for [B, S, H, D])."""
    _check_layout(layout)
    if not 0 <= rank < world_size:
        raise ValueError(f"flashport.distributed: rank must be in [0, world_size={world_size}), "
                         f"got {rank}")
    ranges = _rank_ranges(x.shape[dim], rank, world_size, layout)
    return torch.cat([x.narrow(dim, a, b - a) for a, b in ranges], dim=dim)


def unshard_sequence(shards: Sequence[Tensor], *, layout: str = "zigzag", dim: int = 1) -> Tensor:
    """The full tensor from every rank's shard (shards[r] from rank r): shard_sequence undone."""
    _check_layout(layout)
    world_size = len(shards)
    pieces = {}
    for r, s in enumerate(shards):
        ids = _chunk_ids(r, world_size, layout)
        for c, piece in zip(ids, s.chunk(len(ids), dim=dim)):
            pieces[c] = piece
    return torch.cat([pieces[c] for c in range(_num_chunks(world_size, layout))], dim=dim)


def gather_sequence(local: Tensor, group=None, *, layout: str = "zigzag", dim: int = 1) -> Tensor:
    """all_gather of every rank's shard, reassembled into the full tensor (not differentiable)."""
    _, world_size = _group_rank(group)
    shards = [torch.empty_like(local) for _ in range(world_size)]
    dist.all_gather(shards, local.contiguous(), group=group)
    return unshard_sequence(shards, layout=layout, dim=dim)


def _doc_bounds(cu_seqlens) -> List[Tuple[int, int]]:
    cu = [int(c) for c in (cu_seqlens.tolist() if isinstance(cu_seqlens, Tensor) else cu_seqlens)]
    return list(zip(cu[:-1], cu[1:]))


def shard_varlen(x: Tensor, cu_seqlens, rank: int, world_size: int, *,
                 layout: str = "zigzag") -> Tuple[Tensor, Tensor, int]:
    """Rank `rank`'s shard of packed documents x [T, ...] with global cu_seqlens [B+1]: each
    document sharded in `layout`, packed in document order. Returns (x_local, cu_seqlens_local
    int32 on x's device, max_seqlen_local). Reads cu_seqlens on the host (a setup helper)."""
    _check_layout(layout)
    n = _num_chunks(world_size, layout)
    pieces, lengths = [], []
    for b, (a, e) in enumerate(_doc_bounds(cu_seqlens)):
        if (e - a) % n:
            raise ValueError(f"flashport.distributed: cu_seqlens: document {b} has {e - a} tokens; "
                             f"layout {layout!r} over {world_size} ranks needs every document's "
                             f"length divisible by {n} (pad the documents)")
        ranges = _rank_ranges(e - a, rank, world_size, layout)
        pieces += [x[a + s:a + t] for s, t in ranges]
        lengths.append(sum(t - s for s, t in ranges))
    cu_local = torch.tensor([0] + lengths, dtype=torch.int64).cumsum(0).to(torch.int32)
    return torch.cat(pieces), cu_local.to(x.device), max(lengths, default=0)


def unshard_varlen(shards: Sequence[Tensor], cu_seqlens, *, layout: str = "zigzag") -> Tensor:
    """The packed documents [T, ...] from every rank's shard_varlen shard; cu_seqlens is global."""
    _check_layout(layout)
    world_size = len(shards)
    n = _num_chunks(world_size, layout)
    docs = _doc_bounds(cu_seqlens)
    offsets = [0] * world_size
    out = []
    for a, e in docs:
        chunk = (e - a) // n
        parts = {}
        for r, s in enumerate(shards):
            for c in _chunk_ids(r, world_size, layout):
                parts[c] = s[offsets[r]:offsets[r] + chunk]
                offsets[r] += chunk
        out += [parts[c] for c in range(n)]
    return torch.cat(out)


# --------------------------------------------------------------------------------------------
# Step plans: which (query rows, key rows) blocks to attend, with which local mask
# --------------------------------------------------------------------------------------------

@dataclass(frozen=True)
class _Piece:
    """One attention call of a step: query rows q_sel against key rows k_sel (each a (start, stop)
    slice, "first"/"second" half-documents (varlen), or None for all), with a local top-left
    aligned mask: causal, window_left, window_right (-1: unbounded)."""
    q_sel: object
    k_sel: object
    causal: bool = False
    window_left: int = -1
    window_right: int = -1


def _band(delta: int, lq: int, lk: int, lo_w: Optional[int], hi_w: Optional[int],
          q_start: int, k_start: int) -> Optional[_Piece]:
    """The piece for a query chunk (lq rows) and a key chunk (lk rows) whose global positions differ
    by delta = q_pos - k_pos, under the global mask  i - lo_w <= j <= i + hi_w  (None: unbounded).
    Rows and keys that see nothing are trimmed, so every row of the piece sees at least one key
    (its partial lse is finite) and the local mask is a top-left aligned band. None if empty."""
    lo = None if lo_w is None else delta - lo_w  # in local coordinates: i + lo <= j <= i + hi
    hi = None if hi_w is None else delta + hi_w
    if (hi is not None and hi + lq - 1 < 0) or (lo is not None and lo > lk - 1):
        return None
    c = max(0, -hi) if hi is not None else 0
    q_end = min(lq, lk - lo) if lo is not None else lq
    a = max(0, c + lo) if lo is not None else 0
    k_end = min(lk, q_end + hi) if hi is not None else lk
    wl = -1 if lo is None else a - c - lo
    wr = -1 if hi is None else hi + c - a
    nq, nk = q_end - c, k_end - a
    if wl >= nq - 1:  # the band covers every (row, key): no mask
        wl = -1
    if wr >= nk - 1:
        wr = -1
    causal = wr == 0
    return _Piece((q_start + c, q_start + q_end), (k_start + a, k_start + k_end), causal, wl,
                  -1 if causal else wr)


def _coalesce(pieces: List[_Piece]) -> List[_Piece]:
    """Joins unmasked pieces that share their key rows and have adjacent query rows (or the
    converse), so a step makes few large calls."""
    pieces = list(pieces)
    joined = True
    while joined:
        joined = False
        for i, p in enumerate(pieces):
            for j, o in enumerate(pieces):
                if i == j or (p.causal or p.window_left >= 0 or p.window_right >= 0) or \
                        (o.causal or o.window_left >= 0 or o.window_right >= 0):
                    continue
                if p.k_sel == o.k_sel and p.q_sel[1] == o.q_sel[0]:
                    new = _Piece((p.q_sel[0], o.q_sel[1]), p.k_sel)
                elif p.q_sel == o.q_sel and p.k_sel[1] == o.k_sel[0]:
                    new = _Piece(p.q_sel, (p.k_sel[0], o.k_sel[1]))
                else:
                    continue
                pieces = [x for n, x in enumerate(pieces) if n not in (i, j)] + [new]
                joined = True
                break
            if joined:
                break
    return sorted(pieces, key=lambda p: (p.q_sel, p.k_sel))


def _batched_plan(cfg, local_len: int, q_rank: int, kv_rank: int) -> List[_Piece]:
    """Pieces for the local queries of q_rank against the key/value shard of kv_rank."""
    lo_w, hi_w = cfg.mask_bounds
    if q_rank == kv_rank and lo_w is None:
        # Shards keep global order, so on the diagonal a causal mask (or none) is the local one.
        return [_Piece(None, None, causal=hi_w == 0)] if hi_w in (0, None) else \
            _batched_plan_by_chunks(cfg, local_len, q_rank, kv_rank)
    return _batched_plan_by_chunks(cfg, local_len, q_rank, kv_rank)


def _batched_plan_by_chunks(cfg, local_len, q_rank, kv_rank):
    world, layout = cfg.world_size, cfg.layout
    lo_w, hi_w = cfg.mask_bounds
    total = local_len * world
    q_ranges = _rank_ranges(total, q_rank, world, layout)
    k_ranges = _rank_ranges(total, kv_rank, world, layout)
    pieces = []
    q_local = 0
    for qa, qb in q_ranges:
        k_local = 0
        for ka, kb in k_ranges:
            p = _band(qa - ka, qb - qa, kb - ka, lo_w, hi_w, q_local, k_local)
            if p is not None:
                pieces.append(p)
            k_local += kb - ka
        q_local += qb - qa
    return _coalesce(pieces)


def _varlen_plan(cfg, q_rank: int, kv_rank: int) -> List[_Piece]:
    """Varlen pieces: whole-shard calls (every document is sharded alike, so the shards' document
    boundaries line up), with half-documents ("first"/"second") for zigzag's off-diagonal steps."""
    if not cfg.causal or q_rank == kv_rank:
        return [_Piece(None, None, causal=cfg.causal)]
    if cfg.layout == "contiguous":
        return [_Piece(None, None)] if kv_rank < q_rank else []
    # zigzag: an earlier rank's first chunks precede all our rows and its second chunks follow
    # them; a later rank's first chunks precede only our second chunks, its second ones likewise.
    return [_Piece(None, "first")] if kv_rank < q_rank else [_Piece("second", None)]


# --------------------------------------------------------------------------------------------
# Rows: slices, half-document index sets, all
# --------------------------------------------------------------------------------------------

class _Rows:
    """Row selections along the token dim: (start, stop) slices, or (varlen) the packed first and
    second halves of every local document as index tensors, built on the device without a sync."""

    def __init__(self, cu_seqlens: Optional[Tensor], num_tokens: int, device: torch.device,
                 need_halves: bool):
        self.halves = {}
        if cu_seqlens is not None and need_halves:
            t = torch.arange(num_tokens, device=device)
            cu = cu_seqlens.to(device=device, dtype=torch.int64)
            doc = torch.searchsorted(cu[1:], t, right=True).clamp_(max=cu.numel() - 2)
            in_second = (t - cu[doc]) >= (cu[doc + 1] - cu[doc]) // 2
            order = torch.sort(in_second.to(torch.uint8), stable=True).indices
            self.halves = {"first": order[:num_tokens // 2], "second": order[num_tokens // 2:]}

    def take(self, x: Tensor, sel, dim: int) -> Tensor:
        if sel is None:
            return x
        if isinstance(sel, str):
            return x.index_select(dim, self.halves[sel])
        return x.narrow(dim, sel[0], sel[1] - sel[0])

    def add(self, acc: Tensor, val: Tensor, sel, dim: int) -> None:
        if sel is None:
            acc.add_(val)
        elif isinstance(sel, str):
            acc.index_add_(dim, self.halves[sel], val.to(acc.dtype))
        else:
            acc.narrow(dim, sel[0], sel[1] - sel[0]).add_(val)

    def put(self, acc: Tensor, val: Tensor, sel, dim: int) -> None:
        if sel is None:
            acc.copy_(val)
        elif isinstance(sel, str):
            acc.index_copy_(dim, self.halves[sel], val.to(acc.dtype))
        else:
            acc.narrow(dim, sel[0], sel[1] - sel[0]).copy_(val)


# --------------------------------------------------------------------------------------------
# Transport: one ring hop of a list of tensors, overlapped with compute
# --------------------------------------------------------------------------------------------

class _Transfer:
    def __init__(self, received: List[Tensor], requests, stream, sent: List[Tensor]):
        self.received, self._requests, self._stream, self._sent = received, requests, stream, sent

    def wait(self) -> List[Tensor]:
        for req in self._requests:
            req.wait()  # on CUDA: the current stream waits for the transfer, the host does not
        if self._stream is not None:
            torch.cuda.current_stream(self._stream.device).wait_stream(self._stream)
        self._sent = None
        return self.received


class _Ring:
    """Sends to the next rank of the group and receives from the previous one with
    batch_isend_irecv, issued on a side stream (CUDA) that first waits for the compute stream, so
    the tensors sent are complete and the transfer runs while the next block is computed."""

    def __init__(self, group, rank: int, world_size: int, device: torch.device):
        self.group, self.rank, self.world_size = group, rank, world_size
        self.next = _global_rank(group, (rank + 1) % world_size)
        self.prev = _global_rank(group, (rank - 1) % world_size)
        self.stream = torch.cuda.Stream(device) if device.type == "cuda" else None

    def start(self, tensors: List[Tensor], tag: int) -> _Transfer:
        received = [torch.empty_like(t) for t in tensors]
        ops = []
        for n, (t, r) in enumerate(zip(tensors, received)):
            # Distinct tags keep the key/value hop apart from the dK/dV hop on gloo (NCCL orders
            # them by issue, which is the same on both ends).
            ops.append(dist.P2POp(dist.isend, t, self.next, self.group, tag + n))
            ops.append(dist.P2POp(dist.irecv, r, self.prev, self.group, tag + n))
        if self.stream is not None:
            self.stream.wait_stream(torch.cuda.current_stream(self.stream.device))
            with torch.cuda.stream(self.stream):
                requests = dist.batch_isend_irecv(ops)
        else:
            requests = dist.batch_isend_irecv(ops)
        return _Transfer(received, requests, self.stream, tensors)


_KV_TAG, _DKV_TAG = 0, 2


# --------------------------------------------------------------------------------------------
# Validation
# --------------------------------------------------------------------------------------------

def _group_rank(group) -> Tuple[int, int]:
    if not dist.is_available() or not dist.is_initialized():
        raise ValueError("flashport.distributed: group: torch.distributed is not initialized "
                         "(call torch.distributed.init_process_group first)")
    if group is dist.GroupMember.NON_GROUP_MEMBER:  # what new_group returns to non-members
        raise ValueError("flashport.distributed: group: this process is not a member of the "
                         "group it passed")
    if group is not None and not isinstance(group, dist.ProcessGroup):
        raise ValueError(f"flashport.distributed: group must be a torch.distributed ProcessGroup "
                         f"or None (the default group), got {type(group).__name__}")
    rank = dist.get_rank(group)
    if rank < 0:
        raise ValueError("flashport.distributed: group: this process is not a member of the "
                         "group it passed")
    return rank, dist.get_world_size(group)


def _global_rank(group, group_rank: int) -> int:
    return group_rank if group is None else dist.get_global_rank(group, group_rank)


def _check_device(group, q: Tensor) -> None:
    backend = str(dist.get_backend(group)).lower()
    if q.device.type == "cuda" and "nccl" not in backend:
        raise ValueError(f"flashport.distributed: group: CUDA tensors need an NCCL group, got a "
                         f"{backend!r} group")
    if q.device.type == "cpu" and "gloo" not in backend:
        raise ValueError(f"flashport.distributed: group: CPU tensors need a gloo group, got a "
                         f"{backend!r} group")


_DTYPE_CODES = {torch.float16: 1, torch.bfloat16: 2, torch.float32: 3, torch.float64: 4}


def _check_across_ranks(cfg, q: Tensor, k: Tensor, v: Tensor, cu: Optional[Tensor]) -> None:
    """One all_gather of a signature (shapes, dtype, options, cu_seqlens summary); every rank sees
    the same mismatch and raises the same ValueError, so none is left waiting in the ring."""
    shapes = [list(q.shape), list(k.shape), list(v.shape)]
    host = [len(s) for s in shapes] + [x for s in shapes for x in s] + [
        _DTYPE_CODES.get(q.dtype, 0), int(cfg.causal), LAYOUTS.index(cfg.layout),
        cfg.window[0], cfg.window[1], int(round(cfg.softcap * 1e6)),
        int(round(cfg.softmax_scale * 1e9))]
    names = ["q.dim", "k.dim", "v.dim"] + [f"{n}.shape" for n, s in zip("qkv", shapes) for _ in s]
    names += ["dtype", "causal", "layout", "window_size", "window_size", "softcap",
              "softmax_scale"]
    sig = torch.tensor(host, dtype=torch.int64, device=q.device)
    if cu is not None:
        cu64 = cu.to(torch.int64)
        lengths = cu64[1:] - cu64[:-1]
        n = 2 if cfg.layout == "zigzag" and cfg.causal else 1
        local_ok = (cu64[0] == 0) & (cu64[-1] == q.shape[0]) & (lengths >= 0).all() & \
            ((lengths % n) == 0).all()
        weights = torch.arange(1, cu64.numel() + 1, device=cu64.device, dtype=torch.int64)
        sig = torch.cat([sig, torch.stack([torch.tensor(cu.numel(), device=q.device),
                                           (cu64 * weights).sum().to(q.device),
                                           local_ok.to(torch.int64).to(q.device)])])
        names += ["cu_seqlens", "cu_seqlens", "cu_seqlens_ok"]
    gathered = [torch.empty_like(sig) for _ in range(cfg.world_size)]
    dist.all_gather(gathered, sig, group=cfg.group)
    table = torch.stack(gathered).tolist()  # the one host read of a call
    if cu is not None:
        bad = [r for r, row in enumerate(table) if row[-1] != 1]
        if bad:
            raise ValueError(
                f"flashport.distributed: cu_seqlens on rank(s) {bad} must start at 0, end at the "
                f"number of local tokens (q.shape[0]) and have every document's local length "
                f"divisible by {2 if cfg.layout == 'zigzag' and cfg.causal else 1}")
    for col, name in enumerate(names):
        values = [row[col] for row in table]
        if any(x != values[0] for x in values):
            per_rank = ", ".join(f"rank {r}: {_shapes_of(row)}" for r, row in enumerate(table))
            raise ValueError(f"flashport.distributed: {name} must be the same on every rank of the "
                             f"group (every shard the same shape); got {per_rank}")


def _shapes_of(row: List[int]) -> str:
    dims = row[:3]
    at, parts = 3, []
    for n, d in zip("qkv", dims):
        parts.append(f"{n} {tuple(row[at:at + d])}")
        at += d
    return " ".join(parts)


@dataclass
class _Config:
    group: object
    rank: int
    world_size: int
    layout: str
    causal: bool
    window: Tuple[int, int]
    softcap: float
    softmax_scale: float
    deterministic: bool
    backend: int
    cu_seqlens: Optional[Tensor] = None
    max_seqlen: int = 0
    half_cu: Optional[Tensor] = None  # cu_seqlens // 2: the half-documents of zigzag's varlen steps

    @property
    def mask_bounds(self) -> Tuple[Optional[int], Optional[int]]:
        """The global mask as  i - lo <= j <= i + hi  (None: unbounded)."""
        wl, wr = self.window
        lo = wl if wl >= 0 else None
        hi = 0 if self.causal else (wr if wr >= 0 else None)
        return lo, hi


def _backend_id(backend) -> int:
    if backend is None:
        return int(Backend.AUTO)
    if isinstance(backend, str):
        try:
            return int(Backend[backend.upper()])
        except KeyError:
            raise ValueError(f"flashport.distributed: unknown backend {backend!r}; one of "
                             f"{[b.name.lower() for b in Backend]}") from None
    return int(Backend(backend))


def _make_config(q, k, v, group, layout, causal, window_size, softcap, softmax_scale, alibi_slopes,
                 dropout_p, deterministic, backend, varlen, cu_seqlens=None, max_seqlen=0):
    if alibi_slopes is not None:
        raise RingAttentionUnsupported(
            "flashport.distributed: alibi_slopes does not compose with ring attention (the ALiBi "
            "distance |i - j| of a block is not expressible with the kernels' alignment); "
            "ulysses_flash_attn_func supports it")
    if dropout_p:
        raise RingAttentionUnsupported(
            "flashport.distributed: dropout_p > 0 is not supported by ring attention (the dropout "
            "pattern would be keyed by local positions)")
    rank, world_size = _group_rank(group)
    _check_layout(layout)
    for name, t in (("q", q), ("k", k), ("v", v)):
        if not isinstance(t, Tensor):
            raise ValueError(f"flashport.distributed: {name} must be a torch.Tensor")
        if t.dim() != (3 if varlen else 4):
            raise ValueError(f"flashport.distributed: {name} must be "
                             f"{'[T, H, D]' if varlen else '[B, S_local, H, D]'}, got shape "
                             f"{tuple(t.shape)}")
        if t.device != q.device or t.dtype != q.dtype:
            raise ValueError(f"flashport.distributed: {name} must have q's device and dtype")
    tdim = 0 if varlen else 1
    if k.shape[tdim] != q.shape[tdim] or v.shape[tdim] != q.shape[tdim]:
        raise ValueError(f"flashport.distributed: q, k and v shards must hold the same tokens "
                         f"(dim {tdim}); got {q.shape[tdim]}, {k.shape[tdim]}, {v.shape[tdim]}")
    if not varlen and (k.shape[0] != q.shape[0] or v.shape[0] != q.shape[0]):
        raise ValueError("flashport.distributed: q, k and v must have the same batch size")
    hq, hkv = q.shape[-2], k.shape[-2]
    if v.shape[-2] != hkv or hkv == 0 or hq % hkv:
        raise ValueError(f"flashport.distributed: k: the query heads ({hq}) must be a multiple of "
                         f"the key/value heads ({hkv}), and v must have k's heads "
                         f"({v.shape[-2]})")
    if not varlen and q.shape[1] % (2 if layout == "zigzag" else 1):
        raise ValueError(f"flashport.distributed: q: a zigzag shard holds two equal chunks, so its "
                         f"token count must be even, got {q.shape[1]}")
    _check_device(group, q)
    if len(window_size) != 2:
        raise ValueError(f"flashport.distributed: window_size must be (left, right), got "
                         f"{window_size!r}")
    wl, wr = int(window_size[0]), int(window_size[1])
    if wl < -1 or wr < -1:
        raise ValueError(f"flashport.distributed: window_size entries must be >= -1, got "
                         f"{window_size!r}")
    if causal and wr > 0:
        raise ValueError("flashport.distributed: window_size: causal=True needs window_size[1] "
                         "in (-1, 0)")
    if varlen and (wl >= 0 or wr >= 0):
        raise RingAttentionUnsupported(
            "flashport.distributed: window_size does not compose with varlen ring attention "
            "(a document's chunk offsets differ per document); use batched inputs")
    scale = float(q.shape[-1] ** (-0.5) if softmax_scale is None else softmax_scale)
    return _Config(group, rank, world_size, layout, bool(causal), (wl, wr), float(softcap), scale,
                   bool(deterministic), _backend_id(backend), cu_seqlens, int(max_seqlen))


# --------------------------------------------------------------------------------------------
# Forward and backward rings
# --------------------------------------------------------------------------------------------

def _piece_args(cfg, piece: _Piece):
    """cu_seqlens and max_seqlen of a piece's queries and keys (varlen; halves use cu // 2)."""
    if cfg.cu_seqlens is None:
        return None, None, 0, 0
    cu, mx = cfg.cu_seqlens, cfg.max_seqlen
    half_cu, half_mx = cfg.half_cu, mx // 2
    cu_q, mq = (half_cu, half_mx) if isinstance(piece.q_sel, str) else (cu, mx)
    cu_k, mk = (half_cu, half_mx) if isinstance(piece.k_sel, str) else (cu, mx)
    return cu_q, cu_k, mq, mk


def _plan(cfg, local_len: int, kv_rank: int) -> List[_Piece]:
    if cfg.cu_seqlens is not None:
        return _varlen_plan(cfg, cfg.rank, kv_rank)
    return _batched_plan(cfg, local_len, cfg.rank, kv_rank)


def _needs_halves(cfg) -> bool:
    return cfg.cu_seqlens is not None and cfg.causal and cfg.layout == "zigzag" and \
        cfg.world_size > 1


def _ring_forward(cfg, q: Tensor, k: Tensor, v: Tensor, ring) -> Tuple[Tensor, Tensor]:
    varlen = cfg.cu_seqlens is not None
    tdim = 0 if varlen else 1
    local_len = q.shape[tdim]
    rows = _Rows(cfg.cu_seqlens, local_len, q.device, _needs_halves(cfg))
    acc_dtype = torch.float64 if q.dtype == torch.float64 else torch.float32
    acc_out = torch.zeros((*q.shape[:-1], v.shape[-1]), dtype=acc_dtype, device=q.device)
    lse_shape = (q.shape[1], q.shape[0]) if varlen else (q.shape[0], q.shape[2], q.shape[1])
    acc_lse = torch.full(lse_shape, float("-inf"), dtype=acc_dtype, device=q.device)
    kv = [k, v]
    for step in range(ring.world_size):
        kv_rank = (ring.rank - step) % ring.world_size
        transfer = ring.start(kv, _KV_TAG) if step + 1 < ring.world_size else None
        for piece in _plan(cfg, local_len, kv_rank):
            qp = rows.take(q, piece.q_sel, tdim)
            kp, vp = (rows.take(t, piece.k_sel, tdim) for t in kv)
            cu_q, cu_k, mq, mk = _piece_args(cfg, piece)
            out_p, lse_p, _ = torch.ops.flashport.attn_fwd(
                qp, kp, vp, cu_q, cu_k, mq, mk, None, None, None, None, 0.0, cfg.softmax_scale,
                piece.causal, piece.window_left, piece.window_right, cfg.softcap, _TOP_LEFT, 0,
                cfg.deterministic, cfg.backend)
            _merge_rows(rows, acc_out, acc_lse, out_p, lse_p, piece.q_sel, tdim)
        if transfer is not None:
            kv = transfer.wait()
    return acc_out.to(q.dtype), acc_lse


def _merge_rows(rows: _Rows, acc_out, acc_lse, out_p, lse_p, sel, tdim) -> None:
    """acc <- merge(acc, partial) on the partial's rows: lse = logaddexp, out weighted by
    exp(lse_i - lse). The partial's lse is finite on every row (pieces are trimmed), so the
    accumulator's -inf start needs no special case."""
    old_lse = rows.take(acc_lse, sel, -1)
    old_out = rows.take(acc_out, sel, tdim)
    lse_p = lse_p.to(acc_lse.dtype)
    new_lse = torch.logaddexp(old_lse, lse_p)

    def as_row_weight(w):  # [B, H, S] -> [B, S, H, 1]; varlen [H, T] -> [T, H, 1]
        return w.transpose(-1, -2).unsqueeze(-1)

    new_out = old_out.mul_(as_row_weight(torch.exp(old_lse - new_lse))).add_(
        out_p * as_row_weight(torch.exp(lse_p - new_lse)))  # in place where old_out is a view
    if isinstance(sel, str):  # index_select made copies: write them back
        rows.put(acc_out, new_out, sel, tdim)
    rows.put(acc_lse, new_lse, sel, -1)


def _ring_backward(cfg, dout, q, k, v, out, lse, ring) -> Tuple[Tensor, Tensor, Tensor]:
    varlen = cfg.cu_seqlens is not None
    tdim = 0 if varlen else 1
    local_len = q.shape[tdim]
    rows = _Rows(cfg.cu_seqlens, local_len, q.device, _needs_halves(cfg))
    acc_dtype = torch.float64 if q.dtype == torch.float64 else torch.float32
    dout = dout.contiguous()
    dq = torch.zeros(q.shape, dtype=acc_dtype, device=q.device)
    no_rng = torch.empty(0, dtype=torch.int64, device=q.device)
    kv = [k, v]
    dkv_transfer = None
    dk_step = dv_step = None
    for step in range(ring.world_size):
        kv_rank = (ring.rank - step) % ring.world_size
        kv_transfer = ring.start(kv, _KV_TAG) if step + 1 < ring.world_size else None
        dk_step = torch.zeros(k.shape, dtype=acc_dtype, device=k.device)
        dv_step = torch.zeros(v.shape, dtype=acc_dtype, device=v.device)
        for piece in _plan(cfg, local_len, kv_rank):
            qp, dop, op = (rows.take(t, piece.q_sel, tdim) for t in (q, dout, out))
            lp = rows.take(lse, piece.q_sel, -1)
            kp, vp = (rows.take(t, piece.k_sel, tdim) for t in kv)
            cu_q, cu_k, mq, mk = _piece_args(cfg, piece)
            # The forward's final out and lse: each step's probabilities are then exactly its
            # share of the global softmax, so the steps' gradients add up.
            dq_p, dk_p, dv_p, _ = torch.ops.flashport.attn_bwd(
                dop, qp, kp, vp, op, lp, cu_q, cu_k, mq, mk, None, None, None, None, no_rng, 0.0,
                cfg.softmax_scale, piece.causal, piece.window_left, piece.window_right,
                cfg.softcap, _TOP_LEFT, cfg.deterministic, cfg.backend)
            rows.add(dq, dq_p, piece.q_sel, tdim)
            rows.add(dk_step, dk_p, piece.k_sel, tdim)
            rows.add(dv_step, dv_p, piece.k_sel, tdim)
        if dkv_transfer is not None:  # the accumulators of this block from the ranks before us
            dk_prev, dv_prev = dkv_transfer.wait()
            dk_step.add_(dk_prev)
            dv_step.add_(dv_prev)
        if ring.world_size > 1:  # on to the next rank; the last hop takes them home
            dkv_transfer = ring.start([dk_step, dv_step], _DKV_TAG)
        if kv_transfer is not None:
            kv = kv_transfer.wait()
    if dkv_transfer is not None:
        dk_step, dv_step = dkv_transfer.wait()
    return dq.to(q.dtype), dk_step.to(k.dtype), dv_step.to(v.dtype)


class _RingAttention(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, cfg):
        ring = _Ring(cfg.group, cfg.rank, cfg.world_size, q.device)
        out, lse = _ring_forward(cfg, q, k, v, ring)
        ctx.save_for_backward(q, k, v, out, lse)
        ctx.cfg = cfg
        ctx.mark_non_differentiable(lse)
        return out, lse

    @staticmethod
    def backward(ctx, dout, _dlse):
        q, k, v, out, lse = ctx.saved_tensors
        cfg = ctx.cfg
        ring = _Ring(cfg.group, cfg.rank, cfg.world_size, q.device)
        dq, dk, dv = _ring_backward(cfg, dout, q, k, v, out, lse, ring)
        return dq, dk, dv, None


def _contiguous_last(x: Tensor) -> Tensor:
    return x.contiguous() if x.stride(-1) != 1 else x


# --------------------------------------------------------------------------------------------
# Public API
# --------------------------------------------------------------------------------------------

def ring_flash_attn_func(
    q: Tensor, k: Tensor, v: Tensor, *,
    group=None,
    layout: str = "zigzag",
    softmax_scale: Optional[float] = None,
    causal: bool = False,
    window_size: Tuple[int, int] = (-1, -1),
    softcap: float = 0.0,
    alibi_slopes: Optional[Tensor] = None,
    dropout_p: float = 0.0,
    deterministic: bool = False,
    return_softmax_lse: bool = False,
    check_inputs: bool = True,
    backend: Union[None, str, int] = None,
):
    """Ring attention over `group` (None: the default group). q [B, S_local, Hq, D],
    k/v [B, S_local, Hkv, D|Dv]: this rank's shards (shard_sequence with the same `layout`) of a
    sequence of S_local * world_size tokens. Returns this rank's rows of flash_attn_func on the
    full sequence (out [B, S_local, Hq, Dv]; with return_softmax_lse: (out, lse [B, Hq, S_local]),
    lse not differentiable). Differentiable in q, k and v; every rank must call the backward."""
    cfg = _make_config(q, k, v, group, layout, causal, window_size, softcap, softmax_scale,
                       alibi_slopes, dropout_p, deterministic, backend, varlen=False)
    q, k, v = (_contiguous_last(t) for t in (q, k, v))
    if check_inputs:
        _check_across_ranks(cfg, q, k, v, None)
    out, lse = _RingAttention.apply(q, k, v, cfg)
    return (out, lse) if return_softmax_lse else out


def ring_flash_attn_varlen_func(
    q: Tensor, k: Tensor, v: Tensor, cu_seqlens: Tensor, max_seqlen: int, *,
    group=None,
    layout: str = "zigzag",
    softmax_scale: Optional[float] = None,
    causal: bool = False,
    window_size: Tuple[int, int] = (-1, -1),
    softcap: float = 0.0,
    alibi_slopes: Optional[Tensor] = None,
    dropout_p: float = 0.0,
    deterministic: bool = False,
    return_softmax_lse: bool = False,
    check_inputs: bool = True,
    backend: Union[None, str, int] = None,
):
    """Ring attention over packed documents. q [T_local, Hq, D], k/v [T_local, Hkv, D|Dv] and the
    local cu_seqlens (int32 [B+1]) and max_seqlen (int) from shard_varlen: every document sharded
    in `layout`, so cu_seqlens is the same on every rank. Returns this rank's rows of
    flash_attn_varlen_func on the full documents (out [T_local, Hq, Dv]; with
    return_softmax_lse: (out, lse [Hq, T_local]))."""
    if not isinstance(cu_seqlens, Tensor) or cu_seqlens.dim() != 1 or \
            cu_seqlens.dtype != torch.int32:
        raise ValueError("flashport.distributed: cu_seqlens must be an int32 [B+1] tensor")
    cfg = _make_config(q, k, v, group, layout, causal, window_size, softcap, softmax_scale,
                       alibi_slopes, dropout_p, deterministic, backend, varlen=True,
                       cu_seqlens=cu_seqlens.to(q.device), max_seqlen=max_seqlen)
    cfg.half_cu = cfg.cu_seqlens // 2
    q, k, v = (_contiguous_last(t) for t in (q, k, v))
    if check_inputs:
        _check_across_ranks(cfg, q, k, v, cfg.cu_seqlens)
    out, lse = _RingAttention.apply(q, k, v, cfg)
    return (out, lse) if return_softmax_lse else out


# --------------------------------------------------------------------------------------------
# Ulysses (head-parallel): two all-to-alls around one local call on the whole sequence
# --------------------------------------------------------------------------------------------

def _seq_to_heads(x: Tensor, group, world_size: int, layout: str) -> Tensor:
    """[B, S_local, H, ...] sequence shards -> [B, S, H / W, ...]: this rank's head group over the
    whole sequence in global order."""
    b, sl, h = x.shape[:3]
    parts = x.reshape(b, sl, world_size, h // world_size, *x.shape[3:]).movedim(2, 0).contiguous()
    received = torch.empty_like(parts)  # received[r]: rank r's tokens of our head group
    dist.all_to_all_single(received, parts, group=group)
    return unshard_sequence(list(received.unbind(0)), layout=layout, dim=1)


def _heads_to_seq(x: Tensor, group, world_size: int, layout: str) -> Tensor:
    """The inverse of _seq_to_heads: [B, S, H / W, ...] -> [B, S_local, H, ...]."""
    parts = torch.stack([shard_sequence(x, r, world_size, layout=layout)
                         for r in range(world_size)])
    received = torch.empty_like(parts)  # received[r]: head group r of our tokens
    dist.all_to_all_single(received, parts, group=group)
    b, sl = received.shape[1:3]
    return received.movedim(0, 2).reshape(b, sl, -1, *received.shape[4:])


class _SeqToHeads(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group, world_size, layout):
        ctx.args = (group, world_size, layout)
        return _seq_to_heads(x, group, world_size, layout)

    @staticmethod
    def backward(ctx, grad):
        return _heads_to_seq(grad.contiguous(), *ctx.args), None, None, None


class _HeadsToSeq(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group, world_size, layout):
        ctx.args = (group, world_size, layout)
        return _heads_to_seq(x, group, world_size, layout)

    @staticmethod
    def backward(ctx, grad):
        return _seq_to_heads(grad.contiguous(), *ctx.args), None, None, None


def ulysses_flash_attn_func(
    q: Tensor, k: Tensor, v: Tensor, *,
    group=None,
    layout: str = "zigzag",
    softmax_scale: Optional[float] = None,
    causal: bool = False,
    window_size: Tuple[int, int] = (-1, -1),
    softcap: float = 0.0,
    alibi_slopes: Optional[Tensor] = None,
    dropout_p: float = 0.0,
    deterministic: bool = False,
    return_softmax_lse: bool = False,
    check_inputs: bool = True,
    backend: Union[None, str, int] = None,
):
    """Head-parallel (Ulysses) attention on the same shards as ring_flash_attn_func: an all-to-all
    turns the sequence shards into head groups over the whole sequence (rank r: query heads
    r*Hq/W .. (r+1)*Hq/W - 1 and their key/value heads), one local attention call runs with every
    option (alibi_slopes [Hq] or [B, Hq] are sliced to the rank's heads; windows and ALiBi need no
    ring rule here), and an all-to-all turns the result back into sequence shards. Needs Hq and
    Hkv divisible by W. Differentiable in q, k, v. With dropout the pattern differs from a single
    call's (it is keyed by local heads). Communication: all-to-alls of q, k, v and out (and of
    their gradients), not overlapped with compute."""
    rank, world_size = _group_rank(group)
    _check_layout(layout)
    for name, t in (("q", q), ("k", k), ("v", v)):
        if not isinstance(t, Tensor) or t.dim() != 4:
            raise ValueError(f"flashport.distributed: {name} must be a [B, S_local, H, D] tensor")
    hq, hkv = q.shape[2], k.shape[2]
    if hq % world_size or hkv % world_size:
        raise ValueError(f"flashport.distributed: k: Ulysses needs the query heads ({hq}) and the "
                         f"key/value heads ({hkv}) divisible by the group size ({world_size})")
    _check_device(group, q)
    if len(window_size) != 2:
        raise ValueError(f"flashport.distributed: window_size must be (left, right), got "
                         f"{window_size!r}")
    scale = float(q.shape[-1] ** (-0.5) if softmax_scale is None else softmax_scale)
    cfg = _Config(group, rank, world_size, layout, bool(causal),
                  (int(window_size[0]), int(window_size[1])), float(softcap), scale,
                  bool(deterministic), _backend_id(backend))
    if check_inputs:
        _check_across_ranks(cfg, q, k, v, None)
    if alibi_slopes is not None:
        per = hq // world_size
        alibi_slopes = alibi_slopes[..., rank * per:(rank + 1) * per].contiguous()
    qh, kh, vh = (_SeqToHeads.apply(_contiguous_last(t), group, world_size, layout)
                  for t in (q, k, v))
    out, lse, _ = torch.ops.flashport.attn_fwd(
        qh, kh, vh, None, None, 0, 0, None, None, alibi_slopes, None, float(dropout_p), scale,
        cfg.causal, cfg.window[0], cfg.window[1], cfg.softcap, int(CausalAlign.BOTTOM_RIGHT), 0,
        cfg.deterministic, cfg.backend)
    out = _HeadsToSeq.apply(out, group, world_size, layout)
    if not return_softmax_lse:
        return out
    # lse [B, H/W, S] -> [B, S, H/W, 1] -> sequence shards [B, S_local, H, 1] -> [B, H, S_local]
    lse_local = _heads_to_seq(lse.detach().transpose(1, 2).unsqueeze(-1).contiguous(), group,
                              world_size, layout)
    return out, lse_local.squeeze(-1).transpose(1, 2).contiguous()
