"""Packed sequences as a kind (`module: sdpa_varlen`): a kernel called exactly as FlashAttention's
flash_attn_varlen_func, so that a kernel written against it is a candidate unchanged.

    out = fn(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, dropout_p=0.0,
             softmax_scale=None, causal=False, **extras)

Dimensions: N sequences, Tq = total_q packed query rows, Tk = total_k packed keys, Hq query heads,
Hkv key-value heads, E query and key features per head, Ev value features per head. q (Tq, Hq, E),
k (Tk, Hkv, E), v (Tk, Hkv, Ev), out (Tq, Hq, Ev); cu_seqlens_q, cu_seqlens_k (N + 1,) int32,
starting at 0. Sequence s is attention of its Lq queries over its Lk keys alone; causal is
bottom-right aligned in each (query i sees keys j <= i + Lk - Lq), and so are the window and ALiBi.

`extras` appear only when the config uses them: window_size=(left, right), softcap=c,
alibi_slopes (N, Hq) float32, return_attn_probs=True (then a tuple whose first two items are out
and softmax_lse (Hq, Tq)). Both the oracle (attncheck.reference.sdpa_varlen) and torch's side (torch's
attention of module: sdpa on each sequence alone) run the sequences one at a time; everything
else (scale, softcap, GQA, the LSE and the rows with no allowed key) is the sdpa kind's.
"""

from __future__ import annotations

import functools
from dataclasses import replace
from typing import Any

import numpy as np

from attncheck.kinds.sdpa import FunctionKind, sequence_allowed

# Stream ids of the seed (attncheck.inputs numbers 0-5, the sdpa kind 6-7: ALiBi and the LSE's target).
_ALIBI, _TARGET_LSE, _SEQLENS = 6, 7, 8
DEFAULT_NUM_SEQS = 3


def seqlens(cfg) -> tuple[list[int], list[int]]:
    """Each sequence's (query lengths, key lengths): the config's lists, or drawn from its seed
    (0..tgt_len and 0..src_len, keys as the queries' when seqlens_k is unset), with at least one
    sequence of both queries and keys."""
    q, k = cfg.seqlens_q, cfg.seqlens_k
    if isinstance(q, list):
        return list(q), list(q if k is None else k)
    from attncheck.inputs import rng

    gen = rng(cfg.seed, _SEQLENS)
    n = cfg.num_seqs or DEFAULT_NUM_SEQS
    lengths_q = [int(x) for x in gen.integers(0, cfg.tgt_len + 1, size=n)]
    lengths_k = lengths_q if k is None else [int(x) for x in gen.integers(0, cfg.S + 1, size=n)]
    if not any(lq and lk for lq, lk in zip(lengths_q, lengths_k)):
        lengths_q[0] = cfg.tgt_len
        lengths_k = lengths_q if k is None else [cfg.S, *lengths_k[1:]]
    return lengths_q, list(lengths_k)


def cumulative(lengths: list[int]) -> np.ndarray:
    """cu_seqlens: (N + 1,) int32, 0 then the running sums."""
    return np.concatenate([[0], np.cumsum(lengths)]).astype(np.int32)


def _pairs(cu) -> list[tuple[int, int, int]]:
    """[(start, stop, length)] of each sequence of cumulative lengths (NumPy, torch or JAX: tolist)."""
    cu = [int(x) for x in cu.tolist()]
    return [(a, b, b - a) for a, b in zip(cu, cu[1:])]


def empty_rows(cfg, cu_seqlens_q: np.ndarray, cu_seqlens_k: np.ndarray) -> np.ndarray:
    """(Tq,) bool: the query rows with no allowed key (in every head alike), sequence by sequence."""
    empty = np.zeros(int(cu_seqlens_q[-1]), dtype=bool)
    for (q0, q1, Lq), (_, _, Lk) in zip(_pairs(cu_seqlens_q), _pairs(cu_seqlens_k)):
        if Lq:
            empty[q0:q1] = ~sequence_allowed(cfg, Lq, Lk).any(axis=-1)  # causal is lower_right here (config/varlen.py)
    return empty


class VarlenKind(FunctionKind):
    name = "sdpa_varlen"
    where_axes = {
        "output": ("token", "head", "feature"), "q": ("token", "head", "feature"), "k": ("key token", "head", "feature"),
        "v": ("key token", "head", "feature"), "lse": ("head", "token"),
    }  # fmt: skip
    packed_axes = {"token": "query", "key token": "key"}
    config_alignments = ("lower_right",)  # flash_attn_varlen_func's causal=True (config/varlen.py)
    torch_name = "flash_attn_varlen_func"
    reference_spec = "attncheck.reference.sdpa_varlen:VarlenAttention"
    first_argument = "q"
    one_input = "q"
    all_input_keys = ("q", "k", "v")
    unsupported_commands = {
        "sgd-step": "a packed-sequence kernel has no parameters: sgd-step does not apply to module: sdpa_varlen",
    }
    features = (
        ("LSE", lambda c: c.return_lse),
        ("softcap", lambda c: c.softcap > 0),
        ("ALiBi", lambda c: c.alibi),
        ("windows", lambda c: c.window_size is not None),
        ("causal", lambda c: c.causal != "none"),
        ("GQA", lambda c: c.num_kv_heads_eff != c.num_heads),
        ("numerics", lambda c: c.dtype != "float32" or c.input_scale != 1.0 or c.scale is not None),
        ("sequences", lambda c: True),
    )
    default_suite = ("default_sdpa_varlen_suite.yaml", "<default varlen suite>", "default-varlen-suite")

    def describe(self, cfg) -> tuple[str, str]:
        lengths_q, lengths_k = seqlens(cfg)
        Hq, Hkv, E, Ev = cfg.num_heads, cfg.num_kv_heads_eff, cfg.head_dim_eff, cfg.head_dim_v_eff
        pairs = " ".join(f"{lq}x{lk}" for lq, lk in zip(lengths_q, lengths_k))
        shape = f"N={len(lengths_q)} (Lq x Lk: {pairs}) Hq={Hq} Hkv={Hkv} E={E}" + (f" Ev={Ev}" if Ev != E else "")
        _, what = super().describe(cfg)
        what = what.replace("attention function", "packed sequences (flash_attn_varlen_func)", 1)
        what = what.replace("torch: ", "torch per sequence: ", 1)
        return shape, what

    def alignment_lengths(self, cfg) -> str:
        """The sequences whose queries and keys differ in number (Lq x Lk), where the alignments differ."""
        differ = [f"{lq}x{lk}" for lq, lk in zip(*seqlens(cfg)) if lq and lk and lq != lk]
        return f"sequences of Lq x Lk {', '.join(differ)}" if differ else ""

    # ------------------------------------------------------------------------ both sides
    @property
    def reference(self):
        from attncheck.reference.sdpa_varlen import VarlenAttention

        return VarlenAttention

    def instantiate(self, cfg, factory: Any, params: dict[str, Any]) -> Any:
        """The reference follows the config's empty-row convention; a class is built with no
        arguments; a function is called as it is."""
        if factory is self.reference:  # causal upper_left: only the diagnosis's other reading asks (CheckRun.reread)
            return factory(fully_masked_rows="nan" if cfg.fully_masked_rows == "nan" else "zero",
                           causal_alignment="upper_left" if cfg.causal == "upper_left" else "lower_right")  # fmt: skip
        return super(FunctionKind, self).instantiate(cfg, factory, params)

    def keys_per_row(self, cfg) -> int:
        """The longest sequence's keys: a query row attends its own sequence's alone."""
        return max(seqlens(cfg)[1], default=0)

    def forward_arguments(self, cfg, query, key, value, attn_mask, key_padding_mask, **arrays) -> tuple[tuple, dict[str, Any]]:
        cu_q, cu_k = arrays.get("cu_seqlens_q"), arrays.get("cu_seqlens_k")
        max_q = max((n for _, _, n in _pairs(cu_q)), default=0) if cu_q is not None else 0
        max_k = max((n for _, _, n in _pairs(cu_k)), default=0) if cu_k is not None else 0
        extras: dict[str, Any] = {}
        if cfg.window_size is not None:
            extras["window_size"] = tuple(cfg.window_size)
        if cfg.softcap > 0:
            extras["softcap"] = cfg.softcap
        if cfg.alibi:
            extras["alibi_slopes"] = arrays.get("alibi_slopes")
        if cfg.return_lse:
            extras["return_attn_probs"] = True
        return (query, key, value, cu_q, cu_k, max_q, max_k), dict(dropout_p=cfg.dropout, softmax_scale=cfg.scale, causal=cfg.causal != "none", **extras)

    def call_forward(self, cfg, obj, query, key, value, attn_mask, key_padding_mask, **arrays) -> Any:
        """As the base, keeping the first two items of FlashAttention's (out, softmax_lse, S_dmask)."""
        result = super().call_forward(cfg, obj, query, key, value, attn_mask, key_padding_mask, **arrays)
        return result[:2] if cfg.return_lse and isinstance(result, tuple) and len(result) > 2 else result

    def output_shape(self, cfg, w) -> tuple[int, ...]:
        return (w.query.shape[0], cfg.num_heads, cfg.head_dim_v_eff)

    def axis_letters(self, cfg) -> dict[str, tuple[str, ...]]:
        return {"output": ("Tq", "Hq", "Ev"), "lse": ("Hq", "Tq")}

    def unsupported_case(self, cfg, candidate) -> str | None:
        return None  # one alignment, bottom-right: nothing for a candidate to declare

    def unsupported_call(self, cfg, raised: str) -> str | None:
        """A TypeError for a keyword the kernel does not take (FlashAttention 2.5 has no softcap): a gap, not a bug."""
        used = [name for name, on in (("window_size", cfg.window_size is not None), ("softcap", cfg.softcap > 0),
                                      ("alibi_slopes", cfg.alibi), ("return_attn_probs", cfg.return_lse)) if on]  # fmt: skip
        for name in used:
            if raised.startswith("TypeError") and f"'{name}'" in raised and "keyword" in raised:
                return f"the kernel takes no `{name}` keyword ({raised})"
        return None

    # ------------------------------------------------------------------------ gradients
    def inputs(self, cfg, w) -> dict[str, Any]:
        return {"q": w.query, "k": w.key, "v": w.value}

    def arguments(self, cfg, named: dict[str, Any]) -> tuple[Any, Any, Any]:
        return named["q"], named["k"], named["v"]

    def candidate_gradients(self, cfg, w) -> dict[str, tuple[int, ...]]:
        return {"q": w.query.shape, "k": w.key.shape, "v": w.value.shape}

    def input_gradients(self, cfg, grads) -> tuple[dict[str, Any], str]:
        return {name: grads.get(name) for name in ("q", "k", "v")}, ""

    # ------------------------------------------------------------------------ undefined rows
    def fully_masked(self, cfg, w) -> np.ndarray:
        """(1, Hq, Tq) bool: query rows with no allowed key."""
        empty = empty_rows(cfg, w.extras["cu_seqlens_q"], w.extras["cu_seqlens_k"])
        return np.broadcast_to(empty, (1, cfg.num_heads, empty.size)).copy()

    def masking_note(self, cfg, rows: int, total: int) -> str:
        return super().masking_note(cfg, rows, total).replace("query rows", "packed query rows (x heads)", 1)

    # ------------------------------------------------------------------------ the workload
    def make_workload(self, cfg) -> Any:
        from attncheck.dtypes import np_dtype
        from attncheck.inputs import _INPUTS, _TARGET, Workload, lse_dtype, rng

        dtype = np_dtype(cfg.dtype)
        lengths_q, lengths_k = seqlens(cfg)
        Tq, Tk, N = sum(lengths_q), sum(lengths_k), len(lengths_q)
        Hq, Hkv, E, Ev = cfg.num_heads, cfg.num_kv_heads_eff, cfg.head_dim_eff, cfg.head_dim_v_eff
        gen = rng(cfg.seed, _INPUTS)
        q = (gen.standard_normal((Tq, Hq, E)) * cfg.input_scale).astype(dtype)
        k = (gen.standard_normal((Tk, Hkv, E)) * cfg.input_scale).astype(dtype)
        v = gen.standard_normal((Tk, Hkv, Ev)).astype(dtype)
        extras = {"cu_seqlens_q": cumulative(lengths_q), "cu_seqlens_k": cumulative(lengths_k)}
        if cfg.alibi:  # per sequence, so that a kernel reading another sequence's slopes shows; float32 as FlashAttention takes
            extras["alibi_slopes"] = rng(cfg.seed, _ALIBI).uniform(0.05, 1.0, size=(N, Hq)).astype(np.float32)
        target = rng(cfg.seed, _TARGET).standard_normal((Tq, Hq, Ev)).astype(dtype)
        target_lse = rng(cfg.seed, _TARGET_LSE).standard_normal((Hq, Tq)).astype(lse_dtype(dtype)) if cfg.return_lse else None
        empty = empty_rows(cfg, extras["cu_seqlens_q"], extras["cu_seqlens_k"])  # (Tq,)
        undefined = np.broadcast_to(empty[:, None, None], (Tq, Hq, Ev)) if empty.any() else None
        lse_undefined = np.broadcast_to(empty[None, :], (Hq, Tq)).copy() if empty.any() else None
        return Workload(params={}, query=q, key=k, value=v, attn_mask=None, key_padding_mask=None, target=target,
                        undefined=undefined, extras=extras, target_lse=target_lse, lse_undefined=lse_undefined)  # fmt: skip

    # ------------------------------------------------------------------------ probes
    element_words = ("sequence", "pack")

    def probed_element(self, cfg, w) -> tuple[int, int] | None:
        """The last sequence with both queries and keys, of a pack of two or more."""
        pairs = list(zip(_pairs(w.extras["cu_seqlens_q"]), _pairs(w.extras["cu_seqlens_k"])))
        if len(pairs) < 2:
            return None
        return max(s for s, ((_, _, Lq), (_, _, Lk)) in enumerate(pairs) if Lq and Lk), len(pairs)

    def batch_element(self, cfg, w, b: int) -> tuple[Any, Any] | None:
        """Sequence `b` alone: its rows of q (Lq, Hq, E) and keys of k, v (Lk, Hkv, X), its own
        cu_seqlens [0, Lq] and [0, Lk], its row of the slopes (1, Hq); the targets cut alike."""
        from dataclasses import replace

        (q0, q1, Lq), (k0, k1, Lk) = _pairs(w.extras["cu_seqlens_q"])[b], _pairs(w.extras["cu_seqlens_k"])[b]
        rows = lambda a: None if a is None else a[q0:q1]  # noqa: E731
        extras = {"cu_seqlens_q": cumulative([Lq]), "cu_seqlens_k": cumulative([Lk])}
        if "alibi_slopes" in w.extras:
            extras["alibi_slopes"] = w.extras["alibi_slopes"][b : b + 1]  # (1, Hq)
        lse_cut = lambda a: None if a is None else a[:, q0:q1]  # noqa: E731  # (Hq, Lq)
        alone = replace(w, query=w.query[q0:q1], key=w.key[k0:k1], value=w.value[k0:k1], target=rows(w.target), undefined=rows(w.undefined),
                        extras=extras, target_lse=lse_cut(w.target_lse), lse_undefined=lse_cut(w.lse_undefined))  # fmt: skip
        return cfg.model_copy(update={"seqlens_q": [Lq], "seqlens_k": [Lk], "num_seqs": None}), alone

    def output_element(self, cfg, out: np.ndarray, b: int) -> np.ndarray:
        """Sequence `b`'s rows of a packed output (Tq, Hq, Ev), as its call alone returns them."""
        q0, q1, _ = _pairs(cumulative(seqlens(cfg)[0]))[b]
        return out[q0:q1]

    def packed_starts(self, cfg, side: str) -> np.ndarray:
        return cumulative(seqlens(cfg)[0 if side == "query" else 1])

    def readings(self, cfg) -> list:
        """A packed kernel's own misreadings (two red-team kernels, which said only where): ALiBi's
        (N, Hq) slopes read at sequence 0's row for every sequence; the causal diagonal placed by the
        batch's max_seqlen_k - max_seqlen_q, as a padded batch's, not by each sequence's Lk - Lq."""
        from attncheck.diagnose_kernels import Reading

        lengths_q, lengths_k = seqlens(cfg)
        found = []
        if cfg.alibi and len(lengths_q) > 1:
            found.append(Reading({}, "ALiBi's slopes of sequence 0 (alibi_slopes[0]) for every sequence, where sequence s has its own "
                                     "row alibi_slopes[s] of the (N, Hq) slopes", inputs=_first_slopes_row))  # fmt: skip
        offset = max(lengths_k) - max(lengths_q)
        if cfg.causal == "lower_right" and any(k - q != offset for q, k in zip(lengths_q, lengths_k)):
            found.append(Reading({}, f"the causal diagonal at max_seqlen_k - max_seqlen_q = {offset} keys past each query in every "
                                     "sequence, a padded batch's, where sequence s's is its own Lk - Lq",
                                 {"_causal": functools.partial(_causal_at, offset=offset)}))  # fmt: skip
        return found

    def with_methods(self, cfg, obj: Any, methods: dict) -> Any | None:
        """The oracle computes each sequence with the sdpa oracle, whose kernels take the methods
        (VarlenAttention.sequence_methods); None where that oracle has none of a name."""
        from attncheck.reference.sdpa import takes_methods

        if not takes_methods(methods):
            return None
        obj.sequence_methods = dict(methods)
        return obj

    def budget_groups(self, cfg, w, quantity: str) -> Any:
        """Each sequence's rows, judged on their own budget: the output (Tq, Hq, Ev) and the LSE
        (Hq, Tq) along Tq. Sequences are independent problems, and a short one's larger outputs (and
        torch's error on them) set a budget that hid a long one's accumulation error: a bfloat16
        running output at 0.25x beside a 9x64 sequence, 1.4-2.0x alone (VarlenHalfAccumulatedOutput)."""
        from attncheck.compare import Groups

        pairs_q, pairs_k = _pairs(w.extras["cu_seqlens_q"]), _pairs(w.extras["cu_seqlens_k"])
        rows = np.repeat(np.arange(len(pairs_q)), [Lq for _, _, Lq in pairs_q])  # (Tq,) each row's sequence
        if len(pairs_q) < 2 or rows.size != w.query.shape[0]:
            return None
        names = tuple(f"{s} ({Lq}x{Lk})" for s, ((_, _, Lq), (_, _, Lk)) in enumerate(zip(pairs_q, pairs_k)))
        return Groups(rows[:, None, None] if quantity == "output" else rows[None, :], names, "sequence")

    def forward_rows(self, cfg, w, session, obj, out, t_out, rule) -> list:
        """The poisoning probe: q, k, v handed with NaN rows past the last sequence (varlen_rows)."""
        from attncheck.kinds.varlen_rows import poisoning_rows

        return poisoning_rows(self, cfg, w, session, obj, out, t_out, rule)

    # ------------------------------------------------------------------------ torch's side
    def call_torch(self, cfg, module, query, key, value, attn_mask, key_padding_mask, **arrays):
        """torch's attention of module: sdpa on each sequence alone, (out (Tq, Hq, Ev), lse (Hq, Tq) or None)."""
        import torch

        from attncheck.torch_sdpa import torch_attention

        Hq, Ev = query.shape[1], value.shape[2]
        slopes = arrays.get("alibi_slopes")
        outs, lses = [], []
        for s, ((q0, q1, Lq), (k0, k1, Lk)) in enumerate(zip(_pairs(arrays["cu_seqlens_q"]), _pairs(arrays["cu_seqlens_k"]))):
            if Lq == 0:
                continue
            if Lk == 0:  # every row has no allowed key: zero, LSE -inf
                outs.append(query.new_zeros((Lq, Hq, Ev)))
                lses.append(query.new_full((Hq, Lq), -float("inf")))
                continue
            heads_first = [x.transpose(0, 1)[None] for x in (query[q0:q1], key[k0:k1], value[k0:k1])]  # (1, H, L, X) each
            out, lse, _ = torch_attention(*heads_first, causal="lower_right" if cfg.causal != "none" else "none",
                                          window_size=cfg.window_size, softcap=cfg.softcap, scale=cfg.scale,
                                          alibi_slopes=None if slopes is None else slopes[s], return_lse=cfg.return_lse)  # fmt: skip
            outs.append(out[0].transpose(0, 1))  # (Lq, Hq, Ev)
            if lse is not None:
                lses.append(lse[0])  # (Hq, Lq)
        out = torch.cat(outs, dim=0)  # (Tq, Hq, Ev)
        return out, (torch.cat([x.to(lses[0].dtype) for x in lses], dim=1) if cfg.return_lse else None)  # (Hq, Tq)


VARLEN = VarlenKind()


def _first_slopes_row(w):
    """The workload with ALiBi's (N, Hq) slopes all sequence 0's."""
    slopes = w.extras.get("alibi_slopes")
    if slopes is None or np.ndim(slopes) != 2:
        return w
    return replace(w, extras={**w.extras, "alibi_slopes": np.broadcast_to(np.asarray(slopes)[:1], np.shape(slopes)).copy()})


def _causal_at(self, L: int, S: int, alignment: str, positions: np.ndarray, offset: int) -> np.ndarray:
    """The causal mask with query i seeing keys j <= i + offset, whatever the sequence's S - L (the
    sdpa oracle's `_causal` replaced): the top-left mask moved `offset` keys right, (l, S) bool."""
    from attncheck.diagnose_kernels import _causal_shifted

    return _causal_shifted(self, L, S, "upper_left", positions, offset)
