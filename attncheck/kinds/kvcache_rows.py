"""The decode kernel's own forward rows (module: sdpa_kvcache): the caches after the in-place append,
and the NaN-poisoning probe. Findings only: rows of a report, no verdict beyond each row's status.

Dimensions as in attncheck/kinds/sdpa_kvcache.py: B batch, Lnew new tokens, N cache rows, P slots a
row, Hkv heads, X features (E for k_cache, Ev for v_cache).
"""

from __future__ import annotations

from dataclasses import replace

import numpy as np

from attncheck.compare import compare
from attncheck.errors import CandidateProblem
from attncheck.report import FAIL, Reason, Row

CACHES = ("k_cache", "v_cache")


def _new_slots(kind, cfg, w) -> list[tuple[np.ndarray, np.ndarray]]:
    """(rows, columns) of each sequence's appended slots, in order: (Lnew,) each."""
    from attncheck.reference.kvcache import slots

    table, rows_of = w.extras.get("block_table"), w.extras.get("cache_batch_idx")
    P = w.extras["k_cache"].shape[1]
    return [slots(int(c) + np.arange(cfg.new_tokens), b, table, P, rows_of) for b, c in enumerate(w.extras["cache_seqlens"])]


def _gathered(cache: np.ndarray, places) -> np.ndarray:
    """The appended slots of every sequence, (B, Lnew, Hkv, X)."""
    return np.stack([cache[rows, cols] for rows, cols in places])


def cache_rows(kind, cfg, w, written: dict[str, np.ndarray], rule) -> list[Row]:
    """Each cache after the call: the appended slots against torch's and the oracle's, and any
    other slot changed, which the contract forbids."""
    from attncheck.kinds.sdpa_kvcache import slot_states
    from attncheck.reference.kvcache import appended

    rows: list[Row] = []
    _, new, _ = slot_states(cfg, w.extras["cache_seqlens"], w.extras.get("block_table"), w.extras.get("cache_batch_idx"))
    places = _new_slots(kind, cfg, w)
    expected = kind.torch_caches(cfg, w) if cfg.new_tokens else {}
    oracle = {}
    if cfg.new_tokens:
        oracle = dict(zip(CACHES, appended(w.extras["k_cache"], w.extras["v_cache"], w.key, w.value, w.extras.get("rotary_cos"),
                                           w.extras.get("rotary_sin"), w.extras["cache_seqlens"], w.extras.get("block_table"),
                                           cfg.rotary == "interleaved", w.extras.get("cache_batch_idx"))))  # fmt: skip
    for name in CACHES:
        handed, after = w.extras[name], written.get(name)
        if after is None or after.shape != handed.shape:
            got = "nothing" if after is None else f"shape {after.shape}"
            rows.append(Row("forward", name, FAIL, reason=Reason.SHAPE, note=f"the cache came back as {got}, expected {handed.shape}"))
            continue
        a64, h64 = after.astype(np.float64), handed.astype(np.float64)
        changed = ~((a64 == h64) | (np.isnan(a64) & np.isnan(h64))) & ~new[..., None, None]  # (N, P, Hkv, X)
        if changed.any():
            at = tuple(int(i) for i in np.argwhere(changed)[0])
            rows.append(Row("forward", f"{name}[not appended]", FAIL, reason=Reason.CONTRACT, mismatched=int(changed.sum()), numel=changed.size,
                            note=f"the call wrote `{name}` outside the appended slots: {int(changed.sum())} elements changed, "
                                 f"e.g. at {at} (only slots cache_seqlens .. cache_seqlens + new_tokens may be written)"))  # fmt: skip
        if cfg.new_tokens:
            row = compare("forward", f"{name}[appended]", _gathered(after, places), _gathered(expected[name], places), rule,
                          oracle=_gathered(oracle[name], places))  # fmt: skip
            rows.append(row)
    return rows


def poisoning_rows(kind, cfg, w, session, obj, out: np.ndarray, t_out: np.ndarray) -> list[Row]:
    """An output NaN where torch has a number, explained by the NaN slots: the call again with those
    slots zeroed, one region at a time (unused pages or rows first), names the region whose NaN
    reached the output; where no region alone explains it, every region zeroed at once may (a kernel
    reading another sequence's cache row meets both its NaN past that sequence and the rows no one
    owns). NaN that the regions do not explain is left to the output's own row."""
    from attncheck.kinds.sdpa_kvcache import slot_states

    with np.errstate(invalid="ignore"):
        nan = np.isnan(out.astype(np.float64)) & ~np.isnan(t_out.astype(np.float64))
    if w.undefined is not None:
        nan &= ~w.undefined
    if not nan.any():
        return []
    cached, new, unused = slot_states(cfg, w.extras["cache_seqlens"], w.extras.get("block_table"), w.extras.get("cache_batch_idx"))
    regions = []
    if unused.any() and "block_table" in w.extras:
        regions.append(("an unused page (no block_table entry points to it)", unused, "the kernel reads pages the sequence does not own"))
    elif unused.any():
        regions.append(("a cache row no cache_batch_idx entry names", unused, "the kernel reads rows other than cache_batch_idx's"))
    regions.append(("the cache past cache_seqlens + new tokens", ~(cached | new | unused), "the kernel reads past the sequence"))
    if len(regions) > 1:
        reads = " and ".join(meaning.removeprefix("the kernel ") for _, _, meaning in regions)
        regions.append((" and ".join(what for what, _, _ in regions), np.logical_or.reduce([region for _, region, _ in regions]),
                        f"the kernel {reads}"))
    for what, region, meaning in regions:
        cleaned = {name: np.where(region[..., None, None] & np.isnan(w.extras[name].astype(np.float64)), 0, w.extras[name]).astype(w.extras[name].dtype)
                   for name in CACHES}  # fmt: skip
        try:
            again, _ = session.forward(obj, replace(w, extras={**w.extras, **cleaned}))
        except CandidateProblem:
            return []
        with np.errstate(invalid="ignore"):
            still = np.isnan(again.astype(np.float64)) & nan
        if not still.any():
            first = tuple(int(i) for i in np.argwhere(nan)[0])
            return [Row("forward", "poisoning", FAIL, reason=Reason.NAN, mismatched=int(nan.sum()), numel=nan.size,
                        note=f"the output is NaN where {what} {'are' if ' and ' in what else 'is'} NaN: {meaning} ({int(nan.sum())} "
                             f"elements, e.g. at {first}; with those slots zeroed the NaN is gone)")]  # fmt: skip
    return []
