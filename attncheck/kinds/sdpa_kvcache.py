"""The decode kernel as a kind (`module: sdpa_kvcache`): FlashAttention's flash_attn_with_kvcache,
called exactly as FlashAttention's own Python interface is.

    out = fn(q, k_cache, v_cache, k=None, v=None, rotary_cos=None, rotary_sin=None, cache_seqlens=None,
             cache_batch_idx=None, cache_leftpad=None, block_table=None, softmax_scale=None, causal=False,
             window_size=(-1, -1), softcap=0.0, rotary_interleaved=True, alibi_slopes=None, num_splits=0,
             return_softmax_lse=False)

Dimensions: B batch, Lq query tokens (tgt_len), Lnew new tokens, S_max slots per sequence (src_len),
P page size, N cache rows (B contiguous, 2B under cache_batch_idx, num_blocks paged), Hq, Hkv heads,
E, Ev features, R the features RoPE rotates (rotary_dim, at most E; the other E - R pass through).
q (B, Lq, Hq, E); k_cache (N, S_max or P, Hkv, E); k, v (B, Lnew, Hkv, E/Ev); cache_seqlens (B,),
block_table (B, S_max / P) and cache_batch_idx (B,) int32; rotary_cos, rotary_sin (S_rot, R/2);
out (B, Lq, Hq, Ev), softmax_lse (B, Hq, Lq).

The new k, v are written into the caches in place: the one write the contract allows. The caches
are handed as copies the session does not guard (ModuleKind.written_arguments) and come back after
the call; `forward_rows` compares the appended slots with torch's and the oracle's, and fails any
other slot that changed. Slots no sequence may read hold NaN (the poisoning probe): past c_b + Lnew
and on pages no block_table row points to; an output NaN they explain is named as such. The slots
being appended hold stale finite values, as a reused cache does. Forward only: no gradients.

The probes (attncheck.checks.probes) through the kind's hooks: a sequence alone (batch_element) and
num_splits varied (invariance_switches); the caches handed as strided views and judged after the
append (written_layout, written_rows); each option turned off, rotary's layout switched (option_switches).
"""

from __future__ import annotations

from typing import Any

import numpy as np

from attncheck.kinds import ModuleKind
from attncheck.kinds.sdpa import FunctionKind, sequence_allowed

# Stream ids of the seed for the kind's own arrays (attncheck.inputs numbers the others 0-5, sdpa 6-7).
_ALIBI, _TARGET_LSE, _LENGTHS, _PAGES, _CACHE, _BATCH_IDX = 6, 7, 8, 9, 10, 11
SPARE_PAGES = 2  # pages no sequence owns: NaN, a kernel that reads them is named
CACHES = ("k_cache", "v_cache")


def lengths_of(cfg) -> np.ndarray:
    """cache_seqlens (B,) int32: the config's list, or drawn from the seed (at least one key each)."""
    from attncheck.inputs import rng

    if isinstance(cfg.cache_seqlens, list):
        return np.asarray(cfg.cache_seqlens, dtype=np.int32)
    low = 0 if cfg.new_tokens else 1
    return rng(cfg.seed, _LENGTHS).integers(low, cfg.S - cfg.new_tokens + 1, size=cfg.batch_size).astype(np.int32)


def cache_row_count(cfg, block_table: np.ndarray | None) -> int:
    """N, the cache's rows: the batch's, twice as many under cache_batch_idx (FlashAttention's tests'
    batch_size_cache), or the pages and the spare ones."""
    if block_table is not None:
        return block_table.size + SPARE_PAGES
    return cfg.batch_size * (2 if cfg.cache_batch_idx else 1)


def slot_states(cfg, lengths: np.ndarray, block_table: np.ndarray | None,
                cache_batch_idx: np.ndarray | None = None) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(cached, appended, unused) bool (N, S_max or P): slots of the cache holding a sequence's
    tokens, receiving its new ones, or in a row no sequence owns (a spare page, or a row no
    cache_batch_idx entry names). The rest is past c_b + Lnew."""
    from attncheck.reference.kvcache import slots

    P = cfg.S if block_table is None else cfg.page_size
    N = cache_row_count(cfg, block_table)
    cached, appended = np.zeros((N, P), dtype=bool), np.zeros((N, P), dtype=bool)
    for b, c in enumerate(lengths):
        cached[slots(np.arange(c), b, block_table, P, cache_batch_idx)] = True
        appended[slots(c + np.arange(cfg.new_tokens), b, block_table, P, cache_batch_idx)] = True
    owned = block_table.ravel() if block_table is not None else cache_batch_idx if cache_batch_idx is not None else np.arange(N)
    unused = np.zeros((N, P), dtype=bool)
    unused[np.setdiff1d(np.arange(N), owned)] = True
    return cached, appended, unused


def empty_rows(cfg, lengths: np.ndarray) -> np.ndarray:
    """(B, Hq, Lq) bool: query rows with no allowed key (a window or causal past a short sequence)."""
    Lq = cfg.tgt_len
    rows = [~sequence_allowed(cfg, Lq, int(c) + cfg.new_tokens).any(axis=-1) for c in lengths]  # causal is lower_right here
    return np.broadcast_to(np.stack(rows)[:, None, :], (cfg.batch_size, cfg.num_heads, Lq)).copy()


class KvCacheKind(FunctionKind):
    name = "sdpa_kvcache"
    takes_dropout = False  # flash_attn_with_kvcache has no dropout_p
    where_axes = {"output": ("batch", "query", "head", "feature"), "lse": ("batch", "head", "query")}  # the caches' rows are judged apart
    config_alignments = ("lower_right",)  # flash_attn_with_kvcache's causal=True (config/kvcache_rules.py)
    torch_name = "flash_attn_with_kvcache"
    reference_spec = "attncheck.reference.kvcache:flash_attn_with_kvcache"
    first_argument = "q"
    one_input = "q"
    all_input_keys = ("q", "k", "v")
    unsupported_commands = {
        "grad": "flash_attn_with_kvcache is a forward-only decode kernel (FlashAttention gives it no backward): "
                "grad does not apply to module: sdpa_kvcache",
        "sgd-step": "the decode kernel has no parameters and no backward: sgd-step does not apply to module: sdpa_kvcache",
    }  # fmt: skip
    features = (
        ("paged", lambda c: c.page_size is not None),
        ("cache_batch_idx", lambda c: c.cache_batch_idx),
        ("partial RoPE", lambda c: c.rotary != "none" and c.rotary_dim_eff < c.head_dim_eff),
        ("rotary", lambda c: c.rotary != "none"),
        ("split-KV", lambda c: c.num_splits != 0),
        ("LSE", lambda c: c.return_lse),
        ("softcap", lambda c: c.softcap > 0),
        ("ALiBi", lambda c: c.alibi),
        ("windows", lambda c: c.window_size is not None),
        ("causal", lambda c: c.causal != "none"),
        ("GQA", lambda c: c.num_kv_heads_eff != c.num_heads),
        ("append", lambda c: c.new_tokens > 0),
        ("decode", lambda c: True),
    )
    default_suite = ("default_sdpa_kvcache_suite.yaml", "<default decode-kernel suite>", "default-decode-kernel-suite")

    def describe(self, cfg) -> tuple[str, str]:
        shape = (f"B={cfg.batch_size} Lq={cfg.tgt_len} S_max={cfg.S} Lnew={cfg.new_tokens} Hq={cfg.num_heads} "
                 f"Hkv={cfg.num_kv_heads_eff} E={cfg.head_dim_eff}")  # fmt: skip
        what = ["decode kernel", "paged P=%d" % cfg.page_size if cfg.page_size else "contiguous cache"]
        what += [f"cache_batch_idx (B of {2 * cfg.batch_size} rows)"] if cfg.cache_batch_idx else []
        partial = f" on {cfg.rotary_dim_eff} of {cfg.head_dim_eff} features" if cfg.rotary_dim_eff < cfg.head_dim_eff else ""
        what += [f"rotary {cfg.rotary}{partial}"] if cfg.rotary != "none" else []
        what += [f"num_splits {cfg.num_splits}"] if cfg.num_splits else []
        what += [f"causal {cfg.causal}"] if cfg.causal != "none" else []
        what += [f"window ({cfg.window_size[0]}, {cfg.window_size[1]})"] if cfg.window_size is not None else []
        what += [f"softcap {cfg.softcap:g}"] if cfg.softcap > 0 else []
        what += ["ALiBi"] if cfg.alibi else []
        what += ["LSE"] if cfg.return_lse else []
        return shape, " · ".join(what + [f"torch: plain torch in {cfg.dtype}, per sequence"])

    def alignment_lengths(self, cfg) -> str:
        """Lq and each sequence's keys (S = cache_seqlens + new tokens), where the alignments differ."""
        S = lengths_of(cfg) + cfg.new_tokens  # (B,)
        return "" if all(s in (0, cfg.tgt_len) for s in S) else f"Lq={cfg.tgt_len} against S={', '.join(map(str, S))} keys (cache_seqlens + new tokens)"

    @property
    def reference(self):
        from attncheck.reference.kvcache import flash_attn_with_kvcache

        return flash_attn_with_kvcache

    def instantiate(self, cfg, factory: Any, params: dict[str, Any]) -> Any:
        if factory is self.reference and cfg.causal == "upper_left":  # only the diagnosis's other reading asks (CheckRun.reread)
            from attncheck.reference.kvcache import with_causal_alignment

            return with_causal_alignment("upper_left")
        return ModuleKind.instantiate(self, cfg, factory, params)

    def with_methods(self, cfg, obj: Any, methods: dict) -> Any | None:
        """The oracle is a function: the decode's own conventions (reference.kvcache.CONVENTIONS) are
        replaced by name, and each sequence's kernel (the sdpa oracle) takes the other methods
        (attend_with_kvcache's `methods`); None where that oracle has none of a name."""
        from attncheck.reference.kvcache import CONVENTIONS, with_causal_alignment
        from attncheck.reference.sdpa import takes_methods

        kernel = {name: f for name, f in methods.items() if name not in CONVENTIONS}
        if not takes_methods(kernel):
            return None
        return with_causal_alignment("upper_left" if cfg.causal == "upper_left" else "lower_right", methods=kernel,
                                     conventions={name: f for name, f in methods.items() if name in CONVENTIONS})  # fmt: skip

    def readings(self, cfg) -> list:
        """A decode kernel's own misreadings: the queries' RoPE positions counted from 0, not after
        the cache; the new keys appended and attended unrotated; the causal diagonal placed at the
        cache's old length, cache_seqlens, not cache_seqlens + new tokens (a red-team tester's three
        kernels, caught and named nothing); without causal, the new keys not attended at all (another's)."""
        from attncheck.diagnose_kernels import Reading
        from attncheck.reference.kvcache import rotary_positions

        found = []
        if cfg.rotary != "none":
            found.append(Reading({}, "the queries rotated at positions counted from 0, where RoPE places them after the cache "
                                     "(cache_seqlens + i, or cache_seqlens for every query without causal or a window)",
                                 {"query_positions": lambda c, L, every_token: rotary_positions(0, L, every_token)}))  # fmt: skip
            if cfg.new_tokens:
                found.append(Reading({}, "the new keys appended and attended unrotated, where RoPE rotates them at cache_seqlens + i",
                                     {"new_key_positions": lambda c, Lnew: None}))  # fmt: skip
                found.append(Reading({}, "the new keys rotated at positions counted from 0, where RoPE rotates them at cache_seqlens + i",
                                     {"new_key_positions": lambda c, Lnew: rotary_positions(0, Lnew, True)}))  # fmt: skip
        if cfg.new_tokens:  # the keys read before the append: under causal, its diagonal moves with them
            words = ("the causal diagonal at the cache's old length, cache_seqlens, where it is cache_seqlens + new tokens: no query "
                     "sees the keys the call appends") if cfg.causal == "lower_right" else (
                     "the new keys appended but not attended: the queries see the cache's cache_seqlens keys alone, where they see "
                     "cache_seqlens + new tokens")  # fmt: skip
            found.append(Reading({}, words, {"keys_attended": lambda c, Lnew: c}))
        return found

    def written_arguments(self, cfg) -> tuple[str, ...]:
        return CACHES

    def forward_arguments(self, cfg, query, key, value, attn_mask, key_padding_mask, **arrays) -> tuple[tuple, dict[str, Any]]:
        kwargs: dict[str, Any] = dict(k=key, v=value)
        if cfg.rotary != "none":
            kwargs.update(rotary_cos=arrays["rotary_cos"], rotary_sin=arrays["rotary_sin"])
        kwargs["cache_seqlens"] = arrays["cache_seqlens"]
        if cfg.cache_batch_idx:
            kwargs["cache_batch_idx"] = arrays["cache_batch_idx"]
        if cfg.page_size is not None:
            kwargs["block_table"] = arrays["block_table"]
        kwargs.update(softmax_scale=cfg.scale, causal=cfg.causal != "none")
        if cfg.window_size is not None:
            kwargs["window_size"] = tuple(cfg.window_size)
        if cfg.softcap > 0:
            kwargs["softcap"] = cfg.softcap
        if cfg.rotary != "none":
            kwargs["rotary_interleaved"] = cfg.rotary == "interleaved"
        if cfg.alibi:
            kwargs["alibi_slopes"] = arrays["alibi_slopes"]
        if cfg.num_splits:
            kwargs["num_splits"] = cfg.num_splits
        if cfg.return_lse:
            kwargs["return_softmax_lse"] = True
        return (query, arrays["k_cache"], arrays["v_cache"]), kwargs

    def unsupported_call(self, cfg, raised: str) -> str | None:
        used = {"rotary_cos": cfg.rotary != "none", "block_table": cfg.page_size is not None, "window_size": cfg.window_size is not None,
                "cache_batch_idx": cfg.cache_batch_idx,
                "softcap": cfg.softcap > 0, "alibi_slopes": cfg.alibi, "num_splits": cfg.num_splits != 0,
                "return_softmax_lse": cfg.return_lse}  # fmt: skip
        for name, on in used.items():
            if on and raised.startswith("TypeError") and f"'{name}'" in raised and "keyword" in raised:
                return f"the function takes no `{name}` keyword ({raised})"
        return None

    def unsupported_case(self, cfg, candidate) -> str | None:
        return None

    def output_shape(self, cfg, w) -> tuple[int, ...]:
        B, Lq, Hq, _ = w.query.shape  # the workload's, not the config's: the repeat call's are shorter at large sizes
        return (B, Lq, Hq, cfg.head_dim_v_eff)

    def axis_letters(self, cfg) -> dict[str, tuple[str, ...]]:
        return {"output": ("B", "Lq", "Hq", "Ev"), "lse": ("B", "Hq", "Lq")}

    # ------------------------------------------------------------------------ inputs
    def inputs(self, cfg, w) -> dict[str, Any]:
        return {"q": w.query, **({"k": w.key, "v": w.value} if cfg.new_tokens else {})}

    def arguments(self, cfg, named: dict[str, Any]) -> tuple[Any, Any, Any]:
        return named["q"], named.get("k"), named.get("v")

    def candidate_gradients(self, cfg, w) -> dict[str, tuple[int, ...]]:
        return {name: a.shape for name, a in self.inputs(cfg, w).items()}

    def input_gradients(self, cfg, grads) -> tuple[dict[str, Any], str]:
        return {name: grads.get(name) for name in ("q", "k", "v")}, ""

    def fully_masked(self, cfg, w) -> np.ndarray:
        return empty_rows(cfg, w.extras["cache_seqlens"])

    # ------------------------------------------------------------------------ the workload
    def make_workload(self, cfg) -> Any:
        from attncheck.dtypes import np_dtype
        from attncheck.inputs import _INPUTS, _TARGET, Workload, lse_dtype, rng

        dtype = np_dtype(cfg.dtype)
        B, Lq, Hq, Hkv, S_max, Lnew = cfg.batch_size, cfg.tgt_len, cfg.num_heads, cfg.num_kv_heads_eff, cfg.S, cfg.new_tokens
        E, Ev = cfg.head_dim_eff, cfg.head_dim_v_eff
        gen = rng(cfg.seed, _INPUTS)
        q = (gen.standard_normal((B, Lq, Hq, E)) * cfg.input_scale).astype(dtype)
        k = (gen.standard_normal((B, Lnew, Hkv, E)) * cfg.input_scale).astype(dtype)
        v = gen.standard_normal((B, Lnew, Hkv, Ev)).astype(dtype)
        lengths = lengths_of(cfg)
        block_table = None
        if cfg.page_size is not None:  # each sequence's pages at shuffled physical blocks, spare pages unowned
            per_seq = S_max // cfg.page_size
            block_table = rng(cfg.seed, _PAGES).permutation(B * per_seq + SPARE_PAGES)[: B * per_seq].reshape(B, per_seq).astype(np.int32)
        batch_idx = None
        if cfg.cache_batch_idx:  # B distinct rows of 2B, never 0 .. B - 1 in order (the rows a kernel ignoring it reads)
            batch_idx = rng(cfg.seed, _BATCH_IDX).permutation(2 * B)[:B].astype(np.int32)
            batch_idx = batch_idx + B if (batch_idx == np.arange(B)).all() else batch_idx
        cached, appended, unused = slot_states(cfg, lengths, block_table, batch_idx)
        gen = rng(cfg.seed, _CACHE)
        extras: dict[str, np.ndarray] = {}
        for name, X in (("k_cache", E), ("v_cache", Ev)):
            scale = cfg.input_scale if name == "k_cache" else 1.0
            values = gen.standard_normal(cached.shape + (Hkv, X)) * scale  # (N, P, Hkv, X); stale values where appended
            extras[name] = np.where((cached | appended)[..., None, None], values, np.nan).astype(dtype)
        extras["cache_seqlens"] = lengths
        if block_table is not None:
            extras["block_table"] = block_table
        if batch_idx is not None:
            extras["cache_batch_idx"] = batch_idx
        if cfg.rotary != "none":  # RoPE's tables over every position a sequence may reach, for the first R features
            R = cfg.rotary_dim_eff
            inv_freq = 10000.0 ** (-np.arange(0, R, 2) / R)  # (R/2,)
            # Queries under causal or a window sit at c .. c + Lq - 1, past S_max when Lq > Lnew.
            rows = max(S_max, S_max - cfg.new_tokens + cfg.tgt_len)
            angles = np.arange(rows)[:, None] * inv_freq[None, :]  # (rows, R/2)
            extras["rotary_cos"], extras["rotary_sin"] = np.cos(angles).astype(dtype), np.sin(angles).astype(dtype)
        if cfg.alibi:
            extras["alibi_slopes"] = rng(cfg.seed, _ALIBI).uniform(0.05, 1.0, size=(Hq,)).astype(np.float32)
        target = rng(cfg.seed, _TARGET).standard_normal((B, Lq, Hq, Ev)).astype(dtype)
        target_lse = rng(cfg.seed, _TARGET_LSE).standard_normal((B, Hq, Lq)).astype(lse_dtype(dtype)) if cfg.return_lse else None
        empty = empty_rows(cfg, lengths)  # (B, Hq, Lq)
        undefined = np.broadcast_to(empty.transpose(0, 2, 1)[..., None], (B, Lq, Hq, Ev)) if empty.any() else None
        return Workload(params={}, query=q, key=k, value=v, attn_mask=None, key_padding_mask=None, target=target,
                        undefined=undefined, extras=extras, target_lse=target_lse, lse_undefined=empty if empty.any() else None)  # fmt: skip

    # ------------------------------------------------------------------------ torch's side
    def call_torch(self, cfg, module, query, key, value, attn_mask, key_padding_mask, **arrays):
        from attncheck.torch_kvcache import torch_call

        out, lse, _, _ = torch_call(cfg, query, key, value, arrays)
        return out, lse

    def torch_caches(self, cfg, w) -> dict[str, np.ndarray]:
        """torch's k_cache and v_cache after the append, in the config's dtype (kept per case, read-only)."""
        from attncheck.torch_kvcache import caches_after

        return caches_after(cfg, w)

    # ------------------------------------------------------------------------ probes
    def batch_element(self, cfg, w, b: int) -> tuple[Any, Any] | None:
        """Sequence `b` alone: q, k, v (B, ...) cut to (1, ...) with its cache_seqlens; a contiguous
        cache cut to its row, a paged one handed whole (the same pool of pages) with its block_table
        row, and one reached through cache_batch_idx handed whole with its entry. The rotary tables
        and the slopes are shared."""
        from dataclasses import replace

        one = lambda a: None if a is None else a[b : b + 1]  # noqa: E731
        extras = {**w.extras, "cache_seqlens": one(w.extras["cache_seqlens"])}
        if "block_table" in extras or "cache_batch_idx" in extras:
            name = "block_table" if "block_table" in extras else "cache_batch_idx"
            extras[name] = one(w.extras[name])
        else:
            extras.update({name: one(w.extras[name]) for name in CACHES})
        alone = replace(w, query=one(w.query), key=one(w.key), value=one(w.value), target=one(w.target), undefined=one(w.undefined),
                        target_lse=one(w.target_lse), lse_undefined=one(w.lse_undefined), extras=extras)  # fmt: skip
        return cfg.model_copy(update={"batch_size": 1, "cache_seqlens": [int(w.extras["cache_seqlens"][b])]}), alone

    def invariance_switches(self, cfg) -> list[tuple[str, dict[str, Any]]]:
        """num_splits 1 (one pass over the keys) against the case's num_splits; 0 (the kernel's own
        choice) where the case's is 1. A split-KV combine sums in another order: the bits may move."""
        other = 0 if cfg.num_splits == 1 else 1
        return [(f"num_splits {other}", {"num_splits": other})]

    def written_layout(self, cfg, layout: str) -> str | None:
        """The caches in the layouts that keep their last dimension contiguous (swapped, offset,
        padded): flash_attn_with_kvcache requires k_cache.stride(-1) == 1, and appends through the
        view it is handed (a cache is often a slice of a larger buffer). Transposed: contiguous."""
        return None if layout == "transposed" else layout

    def written_rows(self, cfg, w, written, rule) -> list:
        from attncheck.kinds.kvcache_rows import cache_rows

        return cache_rows(self, cfg, w, written, rule)

    def option_switches(self, cfg) -> list[tuple[str, dict[str, Any]]]:
        """softcap, the window, ALiBi, a scale other than 1/sqrt(E), causal and rotary each turned
        off alone, and rotary's layout switched (rotary_interleaved); the inputs stay the same."""
        other = "half" if cfg.rotary == "interleaved" else "interleaved"
        switches = [("softcap", cfg.softcap > 0, {"softcap": 0.0}),
                    ("window", cfg.window_size is not None, {"window_size": None}),
                    ("ALiBi", cfg.alibi, {"alibi": False}),
                    ("scale", cfg.scale is not None and cfg.scale != 1 / np.sqrt(cfg.head_dim_eff), {"scale": None}),
                    ("causal", cfg.causal != "none", {"causal": "none"}),
                    ("rotary", cfg.rotary != "none", {"rotary": "none", "rotary_dim": None}),
                    ("rotary_interleaved", cfg.rotary != "none", {"rotary": other})]  # fmt: skip
        return [(name, off) for name, on, off in switches if on]

    # ------------------------------------------------------------------------ the kind's own rows
    def forward_rows(self, cfg, w, session, obj, out, t_out, rule) -> list:
        """The caches after the append, and the poisoning probe (see the module's docstring)."""
        from attncheck.kinds.kvcache_rows import poisoning_rows

        rows = self.written_rows(cfg, w, dict(getattr(session, "written", {})), rule)
        return rows + poisoning_rows(self, cfg, w, session, obj, out, t_out)


KVCACHE = KvCacheKind()
