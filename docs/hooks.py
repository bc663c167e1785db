"""mkdocs hook: fill the reference pages' generated sections from the code.

A section is the text between `<!-- generated: NAME -->` and `<!-- end generated: NAME -->`, each
marker a line of its own (one written inline, in prose, or inside a fenced code block, is left as
text). It is checked in, so the pages read whole where Markdown is shown as it is (GitHub), and
the site build fills it again from the code. `python docs/hooks.py` rewrites the pages' sections
from the code; tests/test_docs.py fails while one differs from what the code gives.

    cli             each command's options, from the typer app (attncheck.cli.app) through click
    config-keys     every key of the pydantic `Config` model: type or allowed values, default, and
                    the comment the key carries in attncheck/config/default.yaml
    default-suites  the cases of the embedded default suites, from their YAML files
    exit-codes      the EXIT_* constants of attncheck/cli.py
    adapt           the public functions and classes of attncheck.adapt (its __all__), from their docstrings

A marker the hook does not know, a config key without a comment in default.yaml, or an exit code
without a meaning here fails the build, so `mkdocs build --strict` notices when code and pages part.
"""

from __future__ import annotations

import enum
import inspect
import re
import sys
import typing
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

START = re.compile(r"^<!-- generated: ([a-z-]+) -->$", re.MULTILINE)
FENCE = re.compile(r"^[ \t]*(`{3,}|~{3,})(.*)$", re.MULTILINE)  # a line that may open or close a fenced code block
DOCS = ROOT / "docs"
CONFIG_DIR = ROOT / "attncheck" / "config"

# What each exit code means, keyed by its constant in attncheck/cli.py.
EXIT_MEANINGS = {
    "EXIT_OK": "every compared quantity agrees (and at least one was judged)",
    "EXIT_MISMATCH": "a mismatch, or a candidate that raised or returned something unusable",
    "EXIT_USAGE": "bad usage or config: one line per problem, naming file, line, key and allowed values "
    "(also a SPEC that cannot be loaded, a candidate that dies at import or whose signatures do not fit the contract, "
    "a check too big for memory); nothing is run",
    "EXIT_BUG": "an internal error (a bug in attncheck): traceback plus a request to report it",
    "EXIT_INCONCLUSIVE": "nothing proven: inconclusive (something could not be judged, torch's own values NaN or inf "
    "where no mask explains it, or nothing was) or unsupported (the candidate declared every check it was "
    "asked for unsupported); never a pass",
    "EXIT_INTERRUPTED": "interrupted (Ctrl-C); no output file is left behind",
}


def cell(text: object) -> str:
    """Text for one Markdown table cell: one line, pipes escaped."""
    return " ".join(str(text).split()).replace("|", "\\|")


def yaml_text(value: object) -> str:
    """A value as YAML writes it: null, true, false, numbers and strings as they are."""
    if value is None:
        return "null"
    if isinstance(value, bool):
        return str(value).lower()
    return str(value)


def code(value: object) -> str:
    return f"`{yaml_text(value)}`"


# -------------------------------------------------------------------------------------- cli
def option_value(param) -> str:
    """What an option takes: a flag, its choices, or its metavar (or type) in capitals."""
    if param.is_flag:
        return "flag"
    choices = getattr(getattr(param, "type", None), "choices", None)
    annotation = getattr(getattr(param, "type_descriptor", None), "annotation", None)
    if choices is None and isinstance(annotation, type) and issubclass(annotation, enum.Enum):
        choices = [member.value for member in annotation]
    if choices:
        return " \\| ".join(f"`{c}`" for c in choices)
    element = (typing.get_args(annotation) or (annotation,))[0]
    name = param.metavar or getattr(getattr(param, "type", None), "name", None) or getattr(element, "__name__", "VALUE")
    return f"`{name.upper()}`" + (" (repeatable)" if param.multiple else "")


def cli() -> str:
    import typer.main

    from attncheck.cli import app

    # typer builds click objects (its own copy of click in recent releases), so they are read by
    # their attributes rather than checked against click's classes
    group = typer.main.get_command(app)
    ctx = group.context_class(group, info_name="attncheck")
    out = []
    for name in group.list_commands(ctx):
        command = group.get_command(ctx, name)
        out += [f"## attncheck {name}", "", command.help.strip(), "", "| option | value | default | meaning |", "|---|---|---|---|"]
        for param in command.params:
            if getattr(param, "param_type_name", None) != "option":
                continue
            names = ", ".join(f"`{n}`" for n in (*param.opts, *param.secondary_opts))
            value = option_value(param)
            default = "" if param.default in (None, False, ()) or param.show_default is False else code(param.default)
            out.append(f"| {names} | {value} | {default} | {cell(param.help or '')} |")
        out.append("")
    out += ["## attncheck --version", "", "Prints the version and exits.", ""]
    epilog = group.get_command(ctx, "forward").epilog
    if epilog:
        out += ["## What every command's --help adds", "", "(Shown here for `forward`.)", "", "```text", epilog.replace("\b\n", "").rstrip(), "```", ""]
    return "\n".join(out)


# ----------------------------------------------------------------------------- config keys
def default_yaml_comments() -> dict[str, str]:
    """Each key's comment in default.yaml; a key without one shares the comment of the key above it."""
    comments, last = {}, ""
    for line in (CONFIG_DIR / "default.yaml").read_text().splitlines():
        match = re.match(r"([a-z_]+):[^#]*(?:#\s*(.*))?$", line)
        if not match:
            continue
        key, comment = match.groups()
        comments[key] = comment if comment else f"(with the key above) {last}"
        last = comment or last
    return comments


def allowed(annotation: object) -> str:
    """A field's type as a reader wants it: its Literal values, or the type's name; `null` if optional."""
    if typing.get_origin(annotation) is typing.Literal:
        return ", ".join(code(v) for v in typing.get_args(annotation))
    parts = []
    for arg in typing.get_args(annotation) or (annotation,):
        if typing.get_origin(arg) is typing.Literal:
            parts += [code(v) for v in typing.get_args(arg)]
        elif arg is type(None):
            parts.append("`null`")
        else:
            parts.append(str(arg) if typing.get_origin(arg) else arg.__name__)
    return ", ".join(parts)


def config_keys() -> str:
    from attncheck.config.schema import Config

    comments = default_yaml_comments()
    missing = [k for k in Config.model_fields if k not in comments and k != "name"]
    if missing:
        raise ValueError(f"config keys without a comment in attncheck/config/default.yaml: {', '.join(missing)}")
    out = ["| key | values | default | meaning |", "|---|---|---|---|"]
    for key, field in Config.model_fields.items():
        meaning = "label shown in reports (default: the file's stem)" if key == "name" else comments[key]
        out.append(f"| `{key}` | {cell(allowed(field.annotation))} | {code(field.default)} | {cell(meaning)} |")
    return "\n".join(out) + "\n"


# --------------------------------------------------------------------------- default suites
SUITES = (
    ("default_suite.yaml", "multihead_attention", "`nn.MultiheadAttention`: what every command checks with no `--config`"),
    ("default_layer_suite.yaml", "transformer_encoder_layer", "`nn.TransformerEncoderLayer`: `--module transformer_encoder_layer` with no `--config`"),
    ("default_sdpa_suite.yaml", "sdpa", "the attention function: `--module sdpa` with no `--config`"),
    ("default_sdpa_varlen_suite.yaml", "sdpa_varlen", "packed sequences: `--module sdpa_varlen` with no `--config`"),
    ("default_sdpa_kvcache_suite.yaml", "sdpa_kvcache", "a decode kernel with a KV cache: `--module sdpa_kvcache` with no `--config`"),
)


def default_suites() -> str:
    import yaml

    from attncheck.config import load_suite

    out = []
    for filename, module, what in SUITES:
        text = (CONFIG_DIR / filename).read_text()
        data = yaml.safe_load(text)
        comments = dict(re.findall(r"-\s*name:\s*([\w.-]+)[^#\n]*#\s*(.*)", text))
        cases = load_suite(None, module=module).cases
        defaults = ", ".join(f"`{k}: {yaml_text(v)}`" for k, v in (data.get("defaults") or {}).items())
        out += [f"### `{data['name']}` ({len(cases)} cases)", "", f"{what}. File: `configs/{filename}`, embedded as "
                f"`attncheck/config/{filename}`. Defaults of every case: {defaults or 'none'}.", "",
                "| case | sets | commands | comment |", "|---|---|---|---|"]  # fmt: skip
        written = {c["name"]: c for c in data.get("cases", [])}
        for case in cases:
            entry = written.get(case.name, {})
            sets = ", ".join(f"`{k}: {yaml_text(v)}`" for k, v in entry.items() if k not in ("name", "commands"))
            commands = ", ".join(case.commands) if case.commands else "all"
            out.append(f"| `{case.name}` | {cell(sets) or '(the defaults)'} | {commands} | {cell(comments.get(case.name, ''))} |")
        out.append("")
    return "\n".join(out)


# ------------------------------------------------------------------------------- exit codes
def exit_codes() -> str:
    from attncheck import cli as cli_module

    constants = {name: value for name, value in vars(cli_module).items() if name.startswith("EXIT_") and isinstance(value, int)}
    unknown = sorted(set(constants) - set(EXIT_MEANINGS))
    if unknown:
        raise ValueError(f"exit codes without a meaning in docs/hooks.py: {', '.join(unknown)}")
    rows = sorted((value, name) for name, value in constants.items())
    return "\n".join(["| code | constant | meaning |", "|---|---|---|"] + [f"| {v} | `{n}` | {cell(EXIT_MEANINGS[n])} |" for v, n in rows]) + "\n"


# ------------------------------------------------------------------------------------ adapt
class _Written(str):
    """An annotation kept as the source wrote it: the module's annotations are strings
    (`from __future__ import annotations`), which a signature would show quoted."""

    def __repr__(self) -> str:
        return str(self)


def signature_of(obj: object) -> str:
    """The signature as written in the source."""
    sig = inspect.signature(obj)
    written = lambda a: _Written(a) if isinstance(a, str) else a  # noqa: E731
    named = lambda d: _Written(d.__name__) if d is not inspect.Parameter.empty and inspect.isfunction(d) else d  # noqa: E731 - `mha_call`, not `<function ... at 0x...>`
    params = [p.replace(annotation=written(p.annotation), default=named(p.default)) for p in sig.parameters.values()]
    return str(sig.replace(parameters=params, return_annotation=written(sig.return_annotation)))


def prose(text: str) -> str:
    """Docstring text as Markdown: code spans kept, asterisks and underscores outside them escaped."""
    pieces = text.split("`")
    return "`".join(p if i % 2 else re.sub(r"([*_])", r"\\\1", p) for i, p in enumerate(pieces))


def docstring(obj: object) -> list[str]:
    """A docstring as its first paragraph (prose) and the rest verbatim (it holds aligned code)."""
    doc = inspect.getdoc(obj) or ""
    first, _, rest = doc.partition("\n\n")
    out = [prose(" ".join(first.split())), ""]
    if rest.strip():
        out += ["```text", rest.rstrip(), "```", ""]
    return out


def adapt() -> str:
    from attncheck import adapt as module

    out = ["## Overview", "", "```text", inspect.getdoc(module).rstrip(), "```", ""]
    exported = [(n, getattr(module, n)) for n in module.__all__]  # the package's API, defined in its submodules
    public = [(n, o) for n, o in exported if inspect.isfunction(o) or inspect.isclass(o)]
    for name, obj in public:
        signature = signature_of(obj)
        out += [f"## `{name}`", "", "```python", f"{'class ' if inspect.isclass(obj) else ''}adapt.{name}{signature}", "```", "", *docstring(obj)]
        if inspect.isclass(obj):
            for method_name, method in vars(obj).items():
                if method_name.startswith("_") or not inspect.isfunction(method):
                    continue
                out += [f"### `{name}.{method_name}`", "", "```python", f"{method_name}{signature_of(method)}", "```", "", *docstring(method)]
    constants = [f"`{n}` = `{v!r}`" for n, v in exported if n.isupper()]
    if constants:
        out += ["## Constants", "", *(f"- {c}" for c in constants), ""]
    return "\n".join(out)


GENERATORS = {"cli": cli, "config-keys": config_keys, "default-suites": default_suites, "exit-codes": exit_codes, "adapt": adapt}


def fill(markdown: str, where: str) -> str:
    """`markdown` with each generated section (see the module's docstring) as the code gives it now."""
    blocks = _code_blocks(markdown)

    def in_block(position: int) -> bool:  # an example of a marker, left as written
        return any(start <= position < end for start, end in blocks)

    out, done = [], 0
    for start in START.finditer(markdown):
        if start.start() < done or in_block(start.start()):
            continue
        name = start.group(1)
        if name not in GENERATORS:
            raise ValueError(f"{where}: unknown generated section {name!r}; known: {', '.join(GENERATORS)}")
        ends = re.finditer(rf"^<!-- end generated: {name} -->$", markdown[start.end():], re.MULTILINE)
        end = next((start.end() + e.end() for e in ends if not in_block(start.end() + e.start())), start.end())  # a new marker: its line alone
        out += [markdown[done:start.start()], f"<!-- generated: {name} -->\n\n{GENERATORS[name]().strip()}\n\n<!-- end generated: {name} -->"]
        done = end
    return "".join(out) + markdown[done:]


def _code_blocks(markdown: str) -> list[tuple[int, int]]:
    """Where `markdown`'s fenced code blocks are, (start, end): from a line opening one (three or
    more ` or ~, indented or not, a language after them or not) to the first line closing it (the
    same character, at least as many, nothing after), or to the page's end where none does. A
    line of ``` with a ` after it is inline code, not a fence."""
    blocks: list[tuple[int, int]] = []
    opened: tuple[int, str] | None = None
    for line in FENCE.finditer(markdown):
        fence, rest = line.group(1), line.group(2)
        if opened is None:
            if not (fence[0] == "`" and "`" in rest):
                opened = (line.start(), fence)
        elif fence[0] == opened[1][0] and len(fence) >= len(opened[1]) and not rest.strip():
            blocks.append((opened[0], line.end()))
            opened = None
    if opened is not None:
        blocks.append((opened[0], len(markdown)))
    return blocks


def on_page_markdown(markdown: str, page, config, files) -> str:
    return fill(markdown, page.file.src_path)


def stale_pages() -> dict[Path, str]:
    """Each page whose generated sections differ from the code's, with its text as they should be."""
    pages = {path: path.read_text() for path in sorted(DOCS.rglob("*.md"))}  # every page the site build fills
    return {path: filled for path, text in pages.items() if (filled := fill(text, str(path.relative_to(ROOT)))) != text}


if __name__ == "__main__":  # python docs/hooks.py: rewrite the pages' generated sections from the code
    for path, text in stale_pages().items():
        path.write_text(text)
        print(f"rewrote {path.relative_to(ROOT)}")
