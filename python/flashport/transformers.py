"""flashport.transformers: Hugging Face transformers models on flashport's attention.

    import flashport.transformers
    name = flashport.transformers.register()
    model = AutoModelForCausalLM.from_pretrained(path, attn_implementation=name)

`register()` adds an attention function to transformers' `AttentionInterface` and a mask function
to its `AttentionMaskInterface`, both under one name, and returns that name. The name contains
no "flash": transformers 5.x sends every implementation name containing "flash" to its own
flash-attention / hub-kernel loader, which would try to download a kernel instead of calling us.

What the attention function does with what transformers hands it:
  * padding (a 2D mask from the mask function below): causal attention drops the padded queries
    and keys and runs varlen; non-causal attention keeps every query and drops the padded keys;
  * packed sequences: the `cu_seq_lens_q/k` (and `max_length_q/k`) kwargs of transformers'
    padding-free collator, or `position_ids` that restart inside a row, run varlen per sequence;
  * cached decode (Sq < Sk): causal aligned bottom-right, as flash_attn; a left-padded batch
    reads the cache in place (cache_leftpad) when no gradient is needed;
  * `sliding_window` w (the kwarg, else `module.sliding_window`): window (w - 1, 0) with causal,
    the keys transformers' sliding masks keep; (w, w) without;
  * `softcap` (the kwarg, else `module.config.attn_logit_softcapping`), `s_aux` sinks (GPT-OSS;
    the kwarg, else `module.sinks`), `dropout`, `scaling`, `is_causal`, GQA (no repeat_kv);
  * `deterministic` (the kwarg, else torch.are_deterministic_algorithms_enabled()).
It returns (attn_output [B, S, Hq, Dv], None); attention weights are never materialised
(`output_attentions=True` raises: use "eager"). Mask patterns the kernels cannot express (a
custom 4D mask, a model's own mask overlay, chunked attention) raise NotImplementedError or
ValueError naming "sdpa"/"eager" as the way out; nothing is silently dropped.

The mask function never builds a 4D mask: it returns the 2D padding mask (bool [B, kv_length],
True = token) or None when nothing is padded.
"""
import torch
from torch import Tensor

from .torch import flash_attn_func, flash_attn_varlen_func, flash_attn_with_kvcache

__all__ = ["register", "attention_forward", "padding_mask", "DEFAULT_NAME"]

DEFAULT_NAME = "fport"

_ABSENT = object()  # "the model did not pass this kwarg" (None means "passed: off")


# --------------------------------------------------------------------------------------------
# Registration
# --------------------------------------------------------------------------------------------

def _transformers_interfaces():
    try:
        from transformers import AttentionInterface
        from transformers.masking_utils import AttentionMaskInterface
    except ImportError as e:
        raise ImportError("flashport.transformers needs transformers >= 5.0 (its "
                          "AttentionInterface and masking_utils.AttentionMaskInterface): pip "
                          "install 'flashport[transformers]'") from e
    return AttentionInterface, AttentionMaskInterface


def register(name: str = DEFAULT_NAME) -> str:
    """Registers flashport as the attention implementation `name` (attention and mask functions)
    and returns the name to pass as `attn_implementation=` to from_pretrained / from_config /
    set_attn_implementation. Idempotent."""
    if not isinstance(name, str) or not name:
        raise ValueError(f"flashport.transformers.register: name must be a non-empty str, got "
                         f"{name!r}")
    # transformers routes by substring: these would reach its own code paths instead of ours.
    for reserved in ("flash", "sdpa", "flex_attention", "eager", "paged", "/", "|"):
        if reserved in name:
            raise ValueError(f"flashport.transformers.register: name must not contain "
                             f"{reserved!r} (transformers treats such names as its own "
                             f"implementations or hub kernels), got {name!r}")
    attention_interface, mask_interface = _transformers_interfaces()
    attention_interface.register(name, attention_forward)
    mask_interface.register(name, padding_mask)
    return name


# --------------------------------------------------------------------------------------------
# Mask function (transformers' AttentionMaskInterface signature)
# --------------------------------------------------------------------------------------------

def padding_mask(batch_size, q_length, kv_length, q_offset=0, kv_offset=0, mask_function=None,
                 attention_mask=None, **kwargs):
    """The 2D padding mask (bool [B, <= kv_length], True = token) for the keys attention will
    see, or None when every key is a token. Causal, window and packing are applied by the kernel
    itself, so the mask_function transformers composes is not evaluated.

    A static cache hands attention kv_length cache slots of which only q_offset + q_length are
    filled; the mask then covers the filled ones, and attention drops the rest.

    Patterns the kernels cannot express raise instead of being dropped: a model's own overlay
    (transformers marks custom and/or mask functions with use_vmap; a union such as image-token
    blocks is an or_mask) and chunked attention (config.attention_chunk_size)."""
    if kwargs.get("use_vmap") or getattr(mask_function, "__name__", None) == "or_mask":
        raise NotImplementedError(
            "flashport: this model adds its own pattern to the attention mask (a mask_function "
            "overlay, e.g. bidirectional image-token blocks), which flashport's kernels cannot "
            "apply; use attn_implementation='sdpa' or 'eager'")
    if getattr(kwargs.get("config"), "attention_chunk_size", None) is not None:
        raise NotImplementedError(
            "flashport: chunked attention (config.attention_chunk_size) is not supported; use "
            "attn_implementation='sdpa' or 'eager'")
    if attention_mask is not None:
        # Sliding layers keep only the most recent kv_length keys: the mask's right end.
        attention_mask = attention_mask[:, -kv_length:].bool()
        if attention_mask.shape[1] == kv_length and bool(attention_mask.all()):
            return None
        return attention_mask
    filled = q_offset + q_length
    if not isinstance(filled, int):
        filled = int(filled)  # a static cache's offset is a 0-d tensor
    if filled < kv_length:
        return torch.ones((batch_size, filled), dtype=torch.bool,
                          device=kwargs.get("device", "cpu"))
    return None


# --------------------------------------------------------------------------------------------
# Attention function (transformers' AttentionInterface signature)
# --------------------------------------------------------------------------------------------

def _derived(tensor: Tensor, key, compute):
    """compute(tensor), kept on the tensor object: transformers hands every layer of a forward the
    same mask and position_ids objects, so their host-synchronising index work runs once per
    forward instead of once per layer. Recomputed if the tensor is modified in place."""
    store = tensor.__dict__.setdefault("_flashport_derived", {})
    hit = store.get(key)
    if hit is not None and hit[0] == tensor._version:
        return hit[1]
    value = compute(tensor)
    store[key] = (tensor._version, value)
    return value


def _cu_seqlens(lengths: Tensor) -> Tensor:
    return torch.nn.functional.pad(lengths.cumsum(0, dtype=torch.int32), (1, 0))


def _unpad_plan(mask: Tensor):
    """(batch index, position) of every token of a bool [B, L] mask, cu_seqlens, max length."""
    batch_idx, pos_idx = mask.nonzero(as_tuple=True)
    lengths = mask.sum(1, dtype=torch.int32)
    return batch_idx, pos_idx, _cu_seqlens(lengths), int(lengths.max()) if mask.numel() else 0


def _left_padding(mask: Tensor, sq: int):
    """(first token of each row, row length) as int32 [B] when every row of the bool [B, L] mask
    is padding then tokens, with at least sq tokens (the queries are the last sq positions), else
    None."""
    lengths = mask.sum(1, dtype=torch.int32)
    pads = mask.shape[1] - lengths
    positions = torch.arange(mask.shape[1], device=mask.device)
    if not bool(((positions >= pads[:, None]) == mask).all() & (lengths >= sq).all()):
        return None
    return pads, torch.full_like(lengths, mask.shape[1])


def _packed_plan(position_ids: Tensor, batch: int, seqlen: int):
    """cu_seqlens and max length of the sequences packed along each row (a new one starts where a
    position is not its predecessor + 1, as transformers' packed-sequence mask), or None when
    each row holds one sequence."""
    pos = position_ids.expand(batch, seqlen)
    starts = torch.ones_like(pos, dtype=torch.bool)
    starts[:, 1:] = pos[:, 1:] != pos[:, :-1] + 1
    start_idx = starts.reshape(-1).nonzero().reshape(-1)
    if start_idx.numel() == batch:
        return None
    ends = torch.cat([start_idx[1:], start_idx.new_tensor([batch * seqlen])])
    cu = torch.cat([start_idx, start_idx.new_tensor([batch * seqlen])]).to(torch.int32)
    return cu, int((ends - start_idx).max())


def _kwarg_or(value, fallback):
    return fallback if value is _ABSENT else value


def attention_forward(module: torch.nn.Module, query: Tensor, key: Tensor, value: Tensor,
                      attention_mask, dropout: float = 0.0, scaling=None, sliding_window=_ABSENT,
                      softcap=_ABSENT, is_causal=None, s_aux=_ABSENT, **kwargs):
    """transformers attention function: query [B, Hq, Sq, D], key/value [B, Hkv, Sk, D|Dv] ->
    (out [B, Sq, Hq, Dv], None). See the module docstring for what each argument does."""
    if kwargs.get("output_attentions", False):
        raise ValueError("flashport does not materialise attention weights "
                         "(output_attentions=True); use attn_implementation='eager'")
    if attention_mask is not None and (not isinstance(attention_mask, Tensor)
                                       or attention_mask.dim() != 2):
        raise ValueError(f"flashport: attention_mask must be the 2D padding mask its mask function "
                         f"returns (bool [B, kv_length]); got "
                         f"{getattr(attention_mask, 'shape', type(attention_mask))} (a custom 4D "
                         f"mask needs attn_implementation='sdpa' or 'eager')")

    causal = bool(is_causal if is_causal is not None else getattr(module, "is_causal", True))
    window = _kwarg_or(sliding_window, getattr(module, "sliding_window", None))
    config = getattr(module, "config", None)
    softcap = _kwarg_or(softcap, getattr(config, "attn_logit_softcapping", None))
    sinks = _kwarg_or(s_aux, getattr(module, "sinks", None))
    deterministic = kwargs.get("deterministic")
    if deterministic is None:
        deterministic = torch.are_deterministic_algorithms_enabled()

    # Autocast computes attention in its dtype, as the models' own attention does.
    device_type = query.device.type
    if torch.is_autocast_enabled(device_type):
        dtype = torch.get_autocast_dtype(device_type)
        query, key, value = query.to(dtype), key.to(dtype), value.to(dtype)

    options = dict(
        dropout_p=float(dropout or 0.0),
        softmax_scale=scaling,
        causal=causal,
        window_size=(-1, -1) if not window else ((window - 1, 0) if causal else (window, window)),
        softcap=float(softcap or 0.0),
        deterministic=bool(deterministic),
        sinks=None if sinks is None else sinks.float(),
    )

    batch, sq = query.shape[0], query.shape[2]
    q = query.transpose(1, 2)  # [B, Sq, Hq, D]: flashport's layout, as strided views
    k = key.transpose(1, 2)
    v = value.transpose(1, 2)
    sk = k.shape[1]

    if attention_mask is not None:
        return _padded(q, k, v, attention_mask, causal, options), None

    cu_q, cu_k = kwargs.get("cu_seq_lens_q"), kwargs.get("cu_seq_lens_k")
    if cu_q is not None and cu_k is not None:
        max_q, max_k = kwargs.get("max_length_q"), kwargs.get("max_length_k")
        max_q = int((cu_q[1:] - cu_q[:-1]).max()) if max_q is None else int(max_q)
        max_k = int((cu_k[1:] - cu_k[:-1]).max()) if max_k is None else int(max_k)
        return _packed(q, k, v, cu_q.to(torch.int32), cu_k.to(torch.int32), max_q, max_k,
                       options), None

    position_ids = kwargs.get("position_ids")
    if (causal and isinstance(position_ids, Tensor) and position_ids.dim() == 2
            and position_ids.shape[-1] == sq == sk and sq > 1):
        plan = _derived(position_ids, ("packed", batch, sq),
                        lambda p: _packed_plan(p, batch, sq))
        if plan is not None:
            cu, max_len = plan
            return _packed(q, k, v, cu, cu, max_len, max_len, options), None

    return flash_attn_func(q, k, v, **options), None


def _packed(q, k, v, cu_q, cu_k, max_q, max_k, options):
    """Sequences packed along the rows of [B, S, H, D]: one varlen call over the B * S tokens."""
    batch, sq = q.shape[0], q.shape[1]
    out = flash_attn_varlen_func(q.reshape(-1, *q.shape[2:]), k.reshape(-1, *k.shape[2:]),
                                 v.reshape(-1, *v.shape[2:]), cu_q, cu_k, max_q, max_k, **options)
    return out.view(batch, sq, *out.shape[1:])


def _padded(q, k, v, mask, causal, options):
    """Padded batch: the mask's tokens go varlen. Causal: the queries are the last Sq positions of
    each row (left padding under a cache) and padded queries are dropped, their outputs zero;
    bottom-right alignment then lines up each sequence's queries with its keys. Non-causal (e.g.
    cross-attention): every query is kept, only padded keys are dropped."""
    batch, sq, sk = q.shape[0], q.shape[1], k.shape[1]
    if mask.shape[0] != batch or mask.shape[1] > sk:
        raise ValueError(f"flashport: the padding mask {tuple(mask.shape)} does not fit keys of "
                         f"batch {batch} and length {sk}")
    if mask.shape[1] < sk:  # static cache: slots past the mask are unfilled
        k, v = k[:, :mask.shape[1]], v[:, :mask.shape[1]]

    # Decoding a left-padded batch: the cache rows are read in place from the first token on
    # (flash_attn's cache_leftpad) instead of gathering every layer's whole K/V at every step.
    # Forward only: the KV-cache call has no backward.
    tensors = (q, k, v, options["sinks"])
    needs_grad = torch.is_grad_enabled() and any(t is not None and t.requires_grad
                                                 for t in tensors)
    if causal and sq < mask.shape[1] and not needs_grad and options["dropout_p"] == 0.0:
        left = _derived(mask, ("left", sq), lambda m: _left_padding(m, sq))
        if left is not None:
            pads, seqlens = left
            return flash_attn_with_kvcache(
                q, k, v, cache_seqlens=seqlens, cache_leftpad=pads,
                softmax_scale=options["softmax_scale"], causal=True,
                window_size=options["window_size"], softcap=options["softcap"],
                sinks=options["sinks"])

    kb, kp, cu_k, max_k = _derived(mask, "keys", _unpad_plan)
    k_tokens, v_tokens = k[kb, kp], v[kb, kp]

    if not causal or sq == 1:  # every query is a token (a decode step's query never is padding)
        q_tokens = q.reshape(batch * sq, *q.shape[2:])
        cu_q = torch.arange(0, (batch + 1) * sq, sq, dtype=torch.int32, device=q.device)
        out = flash_attn_varlen_func(q_tokens, k_tokens, v_tokens, cu_q, cu_k, sq, max_k,
                                     **options)
        return out.view(batch, sq, *out.shape[1:])

    if mask.shape[1] == sq:
        qb, qp, cu_q, max_q = kb, kp, cu_k, max_k
    else:
        qb, qp, cu_q, max_q = _derived(mask, ("queries", sq), lambda m: _unpad_plan(m[:, -sq:]))
    out = flash_attn_varlen_func(q[qb, qp], k_tokens, v_tokens, cu_q, cu_k, max_q, max_k,
                                 **options)
    full = out.new_zeros((batch, sq, *out.shape[1:]))
    return full.index_put((qb, qp), out)
