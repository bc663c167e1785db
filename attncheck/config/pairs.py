"""Every two cases of a default suite merged into one (`attncheck run --pairs`).

A default suite has a case per option, so a bug that needs two options together passes it: a mask
path that ignores the scale, the LSE taken before the window, ALiBi added before the scale, key
padding dropped on the encoder-decoder path. Three red-team testers found such bugs by the dozen
(25 of 32, then 24 of 25 of their wrong implementations passed the default suites, each caught by
one case with one more option set). Adding a case per pair found does not end: each round found
new pairs. Merging every two cases reaches every pair of the options the suite's cases set.

Two cases merge into one whose options are both cases' overrides of the suite's defaults, named
`first+second`; the defaults' probes are left out (the pairs judge the options; the default suite
runs the probes). No pair is made where:
- either case sets nothing (`basic`, `plain`: the pair would be the other case);
- one case's overrides hold the other's (the pair would be the larger case);
- the two set one key to different values (two dtypes, two lengths: neither case's option would
  be what it was);
- the commands the two are for have none in common.
A pair runs the commands both cases are for; forward alone where the two cases' masks meet to leave
a query row no key and torch's row is NaN (the kind's nan_rows_reach_the_loss: a causal mask beside
key padding, need_weights: true), as the default suite's fully-masked case does: a correct
implementation may give NaN there too, and its loss spreads it into every gradient, where nothing
could be judged.
A pair the config's rules refuse (is_causal with add_bias_kv, say) is a skipped case with the reason,
as a matrix's refused combination is; so is one that can judge nothing for any implementation (the kind's
judges_nothing: `fully-masked` beside a case of one sequence, every key of every sequence padded and
every output NaN), which would make every run of the pairs inconclusive.

Measured (stop 53, benchmarks/pairs.py; forward, grad and sgd-step where the kind has them): the
built-in reference passes every pair of every kind (multihead_attention 793 pairs and 13 skipped, 2,251
checks; transformer_encoder_layer 42 pairs, 126; sdpa 569, 1,138 (603, 1,206 with bool-mask-causal,
2026-11-27); sdpa_varlen 326, 633; sdpa_kvcache 40 and 2 refused, 40), and so do the shipped
examples of every kind.
"""

from __future__ import annotations

import itertools
from pathlib import Path
from typing import Any

from attncheck.config.config_file import config_from_mapping
from attncheck.config.suite_file import Case, Suite, load_suite
from attncheck.config.yaml_reading import embedded_text, parse_document, read_suite_file
from attncheck.errors import UsageError

# Keys of a case entry that are not options of its config.
_NOT_OPTIONS = ("name", "commands", "probes")


def suite_or_pairs(path: str | Path | None, module: str | None, pairs: bool, *, asked: str, given: str) -> Suite:
    """The suite a caller names: `load_suite(path, module)`, or with `pairs` the default suite's
    pairs, where a path is a UsageError in the caller's words (`asked`: its switch for the pairs,
    `given`: what it calls the path): the command line's --pairs beside --config, attncheck.cases'
    pairs=True beside a suite."""
    if not pairs:
        return load_suite(path, module=module)
    if path is not None:
        raise UsageError(f"{asked} merges the default suite's cases two by two: leave {given} ({path}) out")
    return pair_suite(module)


def _default_suite(module: str | None) -> tuple[dict, str, str, list[tuple[str, dict, list[str] | None]]]:
    """The embedded default suite of `module`: its defaults (probes left out), source, name, and
    each case's (name, overrides, commands)."""
    from attncheck.kinds import kinds

    if module is not None and module not in kinds():
        raise UsageError(f"module {module!r}: expected one of {', '.join(kinds())}")
    embedded = None if module is None else kinds()[module].default_suite
    if embedded is None:
        text, source, name = read_suite_file(None)
    else:
        filename, source, name = embedded
        text = embedded_text(filename)
    data = parse_document(text, source).data
    defaults = {key: value for key, value in (data.get("defaults") or {}).items() if key != "probes"}
    if module is not None:
        defaults.setdefault("module", module)
    entries = [(entry["name"], {k: v for k, v in entry.items() if k not in _NOT_OPTIONS}, entry.get("commands")) for entry in data["cases"]]
    return defaults, source, data.get("name", name), entries


def pair_suite(module: str | None = None) -> Suite:
    """The pairs of the embedded default suite of `module` (None: multihead_attention's), in the
    suite's order: each case with every case after it."""
    from attncheck.kinds import kind_of

    defaults, source, name, entries = _default_suite(module)
    cases = []
    for (a, first, a_commands), (b, second, b_commands) in itertools.combinations(entries, 2):
        if _unpaired((a, first, a_commands), (b, second, b_commands)):
            continue
        commands = _common(a_commands, b_commands)
        pair = f"{a}+{b}"
        try:
            cfg = config_from_mapping({**defaults, **first, **second, "name": pair}, source)
        except UsageError as refused:
            cases.append(Case(pair, None, skip_reason=str(refused).splitlines()[0].removeprefix(f"{source}: ")))  # the pair names the place
            continue
        kind = kind_of(cfg)
        nothing = kind.judges_nothing(cfg)
        if nothing:
            cases.append(Case(pair, None, skip_reason=nothing))
            continue
        if commands != ("forward",) and kind.nan_rows_reach_the_loss(cfg):
            commands = ("forward",)  # as the suite's fully-masked case: the NaN a correct candidate may give reaches every gradient
        cases.append(Case(pair, cfg, commands=commands, own=frozenset(first) | frozenset(second)))
    return Suite(f"{name}-pairs", source, cases, pairs=True)


def no_pair(module: str | None, first: str, second: str) -> str | None:
    """Why the default suite of `module` has no pair of its cases `first` and `second` (in either
    order), by the rules of the module's docstring; None where either is no case of it, or the pair is made."""
    entries = {entry[0]: entry for entry in _default_suite(module)[3]}
    if first not in entries or second not in entries or first == second:
        return None
    return _unpaired(entries[first], entries[second])


def _unpaired(first: tuple[str, dict[str, Any], list[str] | None], second: tuple[str, dict[str, Any], list[str] | None]) -> str | None:
    """Why two cases, each (name, overrides, commands), make no pair (see the module's docstring);
    None where they make one."""
    (a_name, a, a_commands), (b_name, b, b_commands) = first, second
    for case, options in ((a_name, a), (b_name, b)):
        if not options:
            return f"{case} sets no option of its own: its pair would be the other case"
    if a.items() <= b.items() or b.items() <= a.items():
        inner, outer = (a_name, b_name) if a.items() <= b.items() else (b_name, a_name)
        return f"{outer} has every option {inner} sets: their pair would be {outer} itself"
    for key, value in a.items():
        if key in b and b[key] != value:
            return f"the two set {key} to different values ({value!r} and {b[key]!r}): neither's option would be what it was"
    if _common(a_commands, b_commands) == ():
        return f"the two have no command in common ({', '.join(a_commands or [])}; {', '.join(b_commands or [])})"
    return None


def _common(first: list[str] | None, second: list[str] | None) -> tuple[str, ...] | None:
    """The commands both cases are for, in the first's order (None: every command)."""
    if first is None or second is None:
        return None if first is None and second is None else tuple(first if second is None else second)
    return tuple(c for c in first if c in second)


def pair_case_names(suite: Suite, names: str, module: str | None = None) -> str:
    """`--case` for the pairs of `module`'s default suite (comma-separated): a pair's name in either
    order (`scale+window-4-0` is `window-4-0+scale`), and a default case's own name for every pair it
    is in (`--case scale`: scale beside every other option). Two of its cases that make no pair are
    a UsageError saying why; any other name is left as it is, for --case's own error."""
    known = {case.name for case in suite.cases}
    chosen: list[str] = []
    for name in (part.strip() for part in names.split(",")):
        first, plus, second = name.partition("+")
        if name in known or not name:
            chosen.append(name)
        elif plus and f"{second}+{first}" in known:
            chosen.append(f"{second}+{first}")
        elif plus and (why := no_pair(module, first, second)):
            raise UsageError(f"--case {name!r}: {first} and {second} make no pair: {why}")
        else:
            chosen.extend([case.name for case in suite.cases if name in case.name.split("+")] or [name])
    return ",".join(dict.fromkeys(chosen))
