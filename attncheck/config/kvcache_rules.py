"""The decode kernel's own config rules (module: sdpa_kvcache): what flash_attn_with_kvcache's
arguments must keep to, each problem named with its keys as attncheck.config.schema's are.

Dimensions: B batch_size, Lq tgt_len (query tokens), S_max src_len (the cache's length per
sequence), Lnew new_tokens (appended in place), E head_dim.
"""

from __future__ import annotations

from attncheck.config.display import show


def kvcache_problems(cfg) -> list[tuple[tuple[str, ...], str]]:
    """The rules spanning the decode kernel's keys; empty when the config keeps them."""
    problems: list[tuple[tuple[str, ...], str]] = []
    S_max, Lnew, B = cfg.S, cfg.new_tokens, cfg.batch_size
    if cfg.causal == "upper_left":
        problems.append((("causal",), "must be none or lower_right for module: sdpa_kvcache: flash_attn_with_kvcache's "
                         "causal=True is bottom-right aligned (the last query meets the last key)"))  # fmt: skip
    if cfg.attn_mask != "none":
        problems.append((("attn_mask", "module"), f"{cfg.attn_mask}: flash_attn_with_kvcache takes no mask; use causal or window_size"))
    if Lnew > S_max:
        problems.append((("new_tokens", "src_len"), f"{Lnew} new tokens do not fit a cache of src_len {S_max} slots per sequence"))
    if isinstance(cfg.cache_seqlens, list):
        lengths = cfg.cache_seqlens
        if len(lengths) != B:
            problems.append((("cache_seqlens", "batch_size"), f"has {len(lengths)} lengths for batch_size {B}: one per sequence"))
        bad = [n for n in lengths if not 0 <= n <= S_max - Lnew]
        if bad:
            problems.append((("cache_seqlens", "src_len", "new_tokens"), f"each length must be between 0 and src_len - new_tokens "
                             f"({S_max} - {Lnew} = {S_max - Lnew}) so the new tokens fit, got {show(bad)}"))  # fmt: skip
        if Lnew == 0 and 0 in lengths:
            problems.append((("cache_seqlens", "new_tokens"), "a sequence of length 0 with no new token has no key to attend to; "
                             "give it a length, or new_tokens"))  # fmt: skip
    if cfg.cache_batch_idx and cfg.page_size is not None:
        problems.append((("cache_batch_idx", "page_size"), "a paged cache is reached through block_table, not cache_batch_idx "
                         "(flash_attn_with_kvcache: \"Paged KVcache does not support cache_batch_idx\"); drop one"))  # fmt: skip
    if cfg.page_size is not None and S_max % cfg.page_size:
        problems.append((("page_size", "src_len"), f"{cfg.page_size} does not divide src_len {S_max}: each sequence holds "
                         "src_len / page_size pages"))  # fmt: skip
    if cfg.rotary != "none":
        if cfg.head_dim_eff % 2:
            problems.append((("rotary", "head_dim"), f"{cfg.rotary} rotates pairs of features: head_dim must be even, got {cfg.head_dim_eff}"))
        if Lnew == 0:
            problems.append((("rotary", "new_tokens"), f"{cfg.rotary} rotates the new k: flash_attn_with_kvcache needs new tokens "
                             "with rotary_cos/sin (new_tokens >= 1)"))  # fmt: skip
    if cfg.rotary_dim is not None:
        R, E = cfg.rotary_dim, cfg.head_dim_eff
        if cfg.rotary == "none":
            problems.append((("rotary_dim", "rotary"), f"{R} is how many features RoPE rotates: it needs rotary: interleaved or half"))
        if R % 2 or R > E:
            problems.append((("rotary_dim", "head_dim"), f"must be even and at most head_dim ({E}): RoPE rotates pairs of the first "
                             f"rotary_dim features, rotary_cos is (S, rotary_dim / 2); got {R}"))  # fmt: skip
    return problems
