"""flashport.torch's public functions have exactly flash_attn 2.8's signatures (names, order,
defaults) for the positional part; flashport's extras are keyword-only."""
import inspect

import pytest

fa = pytest.importorskip("flashport.torch")

_NONE = None
FLASH_ATTN_2_8 = {
    "flash_attn_func": [
        ("q", inspect.Parameter.empty), ("k", inspect.Parameter.empty),
        ("v", inspect.Parameter.empty), ("dropout_p", 0.0), ("softmax_scale", _NONE),
        ("causal", False), ("window_size", (-1, -1)), ("softcap", 0.0), ("alibi_slopes", _NONE),
        ("deterministic", False), ("return_attn_probs", False)],
    "flash_attn_varlen_func": [
        ("q", inspect.Parameter.empty), ("k", inspect.Parameter.empty),
        ("v", inspect.Parameter.empty), ("cu_seqlens_q", inspect.Parameter.empty),
        ("cu_seqlens_k", inspect.Parameter.empty), ("max_seqlen_q", inspect.Parameter.empty),
        ("max_seqlen_k", inspect.Parameter.empty), ("dropout_p", 0.0), ("softmax_scale", _NONE),
        ("causal", False), ("window_size", (-1, -1)), ("softcap", 0.0), ("alibi_slopes", _NONE),
        ("deterministic", False), ("return_attn_probs", False), ("block_table", _NONE)],
    "flash_attn_with_kvcache": [
        ("q", inspect.Parameter.empty), ("k_cache", inspect.Parameter.empty),
        ("v_cache", inspect.Parameter.empty), ("k", _NONE), ("v", _NONE), ("rotary_cos", _NONE),
        ("rotary_sin", _NONE), ("cache_seqlens", _NONE), ("cache_batch_idx", _NONE),
        ("cache_leftpad", _NONE), ("block_table", _NONE), ("softmax_scale", _NONE),
        ("causal", False), ("window_size", (-1, -1)), ("softcap", 0.0),
        ("rotary_interleaved", True), ("alibi_slopes", _NONE), ("num_splits", 0),
        ("return_softmax_lse", False)],
}
_COMMON = [("dropout_p", 0.0), ("softmax_scale", _NONE), ("causal", False),
           ("window_size", (-1, -1)), ("softcap", 0.0), ("alibi_slopes", _NONE),
           ("deterministic", False), ("return_attn_probs", False)]
_E = inspect.Parameter.empty
FLASH_ATTN_2_8.update({
    "flash_attn_qkvpacked_func": [("qkv", _E)] + _COMMON,
    "flash_attn_kvpacked_func": [("q", _E), ("kv", _E)] + _COMMON,
    "flash_attn_varlen_qkvpacked_func": [("qkv", _E), ("cu_seqlens", _E),
                                         ("max_seqlen", _E)] + _COMMON,
    "flash_attn_varlen_kvpacked_func": [("q", _E), ("kv", _E), ("cu_seqlens_q", _E),
                                        ("cu_seqlens_k", _E), ("max_seqlen_q", _E),
                                        ("max_seqlen_k", _E)] + _COMMON,
})


@pytest.mark.parametrize("name", list(FLASH_ATTN_2_8))
def test_signature_matches_flash_attn(name):
    params = list(inspect.signature(getattr(fa, name)).parameters.values())
    positional = [p for p in params if p.kind == p.POSITIONAL_OR_KEYWORD]
    assert [(p.name, p.default) for p in positional] == FLASH_ATTN_2_8[name]
    extras = [p for p in params if p.kind != p.POSITIONAL_OR_KEYWORD]
    assert all(p.kind == p.KEYWORD_ONLY for p in extras)
    assert {"sinks", "causal_align", "backend"} <= {p.name for p in extras}


def test_return_conventions():
    import torch
    q = torch.randn(1, 4, 2, 16)
    assert isinstance(fa.flash_attn_func(q, q, q), torch.Tensor)
    r = fa.flash_attn_func(q, q, q, return_attn_probs=True)
    assert isinstance(r, tuple) and len(r) == 3
    kc = torch.randn(1, 8, 2, 16)
    assert isinstance(fa.flash_attn_with_kvcache(q, kc, kc.clone(), cache_seqlens=4),
                      torch.Tensor)
    r = fa.flash_attn_with_kvcache(q, kc, kc.clone(), cache_seqlens=4, return_softmax_lse=True)
    assert isinstance(r, tuple) and len(r) == 2
