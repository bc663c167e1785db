"""The rules of packed sequences' keys (module: sdpa_varlen), each problem naming its keys.

    seqlens_q: [13, 0, 1, 40]      each sequence's query length (0 allowed: it contributes no rows)
    seqlens_k: [29, 5, 1, 40]      its key length, the same count; null: seqlens_q's
    seqlens_q: random              num_seqs lengths drawn from the seed, 0..tgt_len (keys: 0..src_len)

The packed buffers are exactly sum(seqlens_q) query rows and sum(seqlens_k) keys; batch_size and
the masks do not apply, and tgt_len and src_len only bound random lengths. causal is FlashAttention's
bottom-right alignment per sequence (lower_right); upper_left is refused.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from attncheck.config.display import show

if TYPE_CHECKING:
    from attncheck.config.schema import Config

Problems = list[tuple[tuple[str, ...], str]]


def varlen_problems(cfg: Config) -> Problems:
    """Every broken rule of module: sdpa_varlen's keys."""
    from attncheck.config.schema import MAX_BATCH, MAX_LEN

    problems: Problems = []
    q, k = cfg.seqlens_q, cfg.seqlens_k
    for key, lengths in (("seqlens_q", q), ("seqlens_k", k)):
        if isinstance(lengths, list):
            if not 1 <= len(lengths) <= MAX_BATCH:
                problems.append(((key,), f"must list between 1 and {MAX_BATCH} sequence lengths, got {len(lengths)}"))
            bad = [n for n in lengths if not 0 <= n <= MAX_LEN]
            if bad:
                problems.append(((key,), f"each length must be between 0 and {MAX_LEN}, got {show(bad[0])}"))
    listed = isinstance(q, list)
    if k is not None and isinstance(k, list) != listed:
        problems.append((("seqlens_k", "seqlens_q"), f"lists or random for both: seqlens_q is {show(q)}, seqlens_k {show(k)}"))
    elif listed and isinstance(k, list) and len(k) != len(q):
        problems.append((("seqlens_k", "seqlens_q"), f"must have one length per sequence: seqlens_q has {len(q)}, seqlens_k {len(k)}"))
    elif listed and not problems:
        keys = k if isinstance(k, list) else q
        if sum(q) == 0 or not any(lq and lk for lq, lk in zip(q, keys)):
            problems.append((("seqlens_q", "seqlens_k"), "at least one sequence needs both queries and keys, got "
                             f"seqlens_q: {show(q)}, seqlens_k: {show(keys)}"))  # fmt: skip
    if listed:
        if cfg.num_seqs is not None:
            problems.append((("num_seqs", "seqlens_q"), "counts random sequences; lists give their own count: remove it"))
        for key in ("tgt_len", "src_len"):
            if key in cfg.model_fields_set:
                problems.append(((key, "seqlens_q"), f"bounds random lengths only; with lists the lengths are seqlens_q and seqlens_k: remove {key}"))
    if "batch_size" in cfg.model_fields_set:
        problems.append((("batch_size", "module"), "packed sequences have no batch dimension: the count is seqlens_q's (or num_seqs); remove it"))
    if cfg.attn_mask != "none" or cfg.attn_mask_dims != 2 or "mask_dtype" in cfg.model_fields_set:
        key = "attn_mask" if cfg.attn_mask != "none" else "attn_mask_dims" if cfg.attn_mask_dims != 2 else "mask_dtype"
        problems.append(((key, "module"), "flash_attn_varlen_func takes no attention mask (causal, window_size and "
                         "alibi_slopes only): remove it"))  # fmt: skip
    if cfg.causal == "upper_left":
        problems.append((("causal", "module"), "upper_left is SDPA's alignment; flash_attn_varlen_func's causal=True is "
                         "bottom-right per sequence (query i sees keys j <= i + Lk - Lq): use causal: lower_right"))  # fmt: skip
    return problems
