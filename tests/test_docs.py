"""The numbers the documentation states are the code's: tolerance tables, suite sizes, exit codes,
and the README's five-minute adapter, which must run and give the verdict the README prints.

The prose lives in the site under docs/ (docs/explanation/budget.md holds the tolerance rules) and
in the README; both are read with their line breaks folded, as a reader reads them.
"""

from __future__ import annotations

import json
import re
from collections import Counter
from pathlib import Path

import pytest

from attncheck.compare import BUDGET_FACTOR, BUDGET_FLOOR, FIXED
from attncheck.config import default_config_text, load_suite

ROOT = Path(__file__).resolve().parent.parent
DOCS = ROOT / "docs"
README_TEXT = (ROOT / "README.md").read_text()
MAX_README_LINES = 200


def folded(text: str) -> str:
    """Prose with its line breaks folded."""
    return " ".join(text.split())


def page(name: str) -> str:
    return folded((DOCS / name).read_text())


README = folded(README_TEXT)
BUDGET = page("explanation/budget.md")


def number(x: float) -> str:
    """1e-05 -> 1e-5, 2.0 -> 2, 1.3e-06 -> 1.3e-6: how the prose writes numbers."""
    return re.sub(r"e-0*(\d)", r"e-\1", f"{x:g}")


def comment_of(key: str) -> str:
    line = next(line for line in default_config_text().splitlines() if line.startswith(f"{key}:"))
    return line.split("#", 1)[1]


def code_blocks(text: str, language: str) -> list[str]:
    return re.findall(rf"```{language}\n(.*?)```", text, flags=re.S)


# ------------------------------------------------------------------------------- tolerances
def test_default_config_states_the_budget_tables():
    factors = ", ".join(f"{number(v)} {kind}" for kind, v in BUDGET_FACTOR.items())
    floors = ", ".join(f"{number(v)} {dtype}" for dtype, v in BUDGET_FLOOR.items())
    assert comment_of("budget_factor").endswith(f"null: {factors}"), comment_of("budget_factor")
    assert comment_of("budget_floor").endswith(f"null: {floors}"), comment_of("budget_floor")


def test_budget_page_states_the_budget_tables():
    f = BUDGET_FACTOR
    assert f"`factor` is {number(f['forward'])} for forward values, {number(f['grad'])} for gradients" in BUDGET
    assert f"and {number(f['sgd'])} for weights after SGD" in BUDGET
    floors = " and ".join(f"{number(v)} in {dtype}" for dtype, v in BUDGET_FLOOR.items())
    assert f"`floor` is {floors}" in BUDGET, floors


def test_budget_page_states_the_fixed_table_for_float32_forward():
    atol, rtol = FIXED["forward", "float32"]
    assert f"forward float32: {number(atol)} / {number(rtol)}" in BUDGET
    grad_atol, _ = FIXED["grad", "float32"]
    assert grad_atol == 10 * atol and "gradients 10x looser" in BUDGET


def test_the_readme_reports_the_budget_rules_gradient_factor():
    assert f"grad  ({number(BUDGET_FACTOR['grad'])}x torch + {BUDGET_FLOOR['float32']:.0e})" in README_TEXT


# ------------------------------------------------------------------------- the default suites
def checks_of(suite) -> int:
    """Checks a no-config `attncheck run` makes: each case once per command it is for."""
    all_commands = 3 if suite.cases[0].config.module != "sdpa" else 2  # sgd-step does not apply to a kernel
    return sum(all_commands if case.commands is None else len(case.commands) for case in suite.cases)


def test_the_default_suites_size_is_what_the_prose_says():
    suite = load_suite(None)
    cases, checks = len(suite.cases), checks_of(suite)
    assert f"{cases} cases (0 skipped) · {checks} checks" in page("tutorials/first-check.md")
    assert f"(a case of any suite may list the commands it is for): {checks} checks." in page("reference/default-suites.md")
    assert f"on the default suite's {cases} cases" in README
    assert f"runs all three commands over its {cases} cases" in page("development/performance.md")
    for measured in re.findall(r"passes \d+ of (\d+) checks", page("how-to/torch-modules.md") + page("how-to/jax.md")):
        assert int(measured) == checks


def test_the_default_suite_table_names_every_case():
    written = (DOCS / "reference/default-suites.md").read_text().partition("## The cases as written")[0]  # not the generated tables
    documented = set(re.findall(r"^\| `([a-z0-9-]+)` \|", written, flags=re.M))
    assert documented == {case.name for case in load_suite(None).cases}


def test_the_kernel_suites_size_is_what_the_prose_says():
    suite = load_suite(None, module="sdpa")
    kernels = page("how-to/kernels.md")
    assert f"(`configs/default_sdpa_suite.yaml`, {len(suite.cases)} cases;" in kernels
    assert f"passes 36 of {checks_of(suite)} checks" in kernels


def test_the_varlen_and_decode_suites_size_is_what_the_prose_says():
    kernels = page("how-to/kernels.md")
    varlen, decode = load_suite(None, module="sdpa_varlen"), load_suite(None, module="sdpa_kvcache")
    varlen_checks = sum(2 if case.commands is None else len(case.commands) for case in varlen.cases)  # forward and grad
    assert f"(`configs/default_sdpa_varlen_suite.yaml`, {len(varlen.cases)} cases;" in kernels
    assert f"The NumPy example passes all {varlen_checks} checks" in kernels
    assert f"(`configs/default_sdpa_kvcache_suite.yaml`, {len(decode.cases)} cases;" in kernels
    assert f"It passes 19 of the {len(decode.cases)} cases" in kernels  # forward only: one check a case


def test_the_known_bad_count_is_the_corpus():
    from attncheck.testing.detection import DEFAULT_SUITE_CATCHES

    count = len({entry[0] for entry in DEFAULT_SUITE_CATCHES})
    assert f"holds {count} deliberately wrong implementations" in page("development/detection.md")
    assert f"**{count} of {count}** (100%)" in page("development/detection.md")


def _hooks():
    import importlib.util

    spec = importlib.util.spec_from_file_location("docs_hooks", DOCS / "hooks.py")
    hooks = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(hooks)
    return hooks


def test_the_reference_pages_generated_sections_are_the_codes():
    # Checked in, so the pages read whole on GitHub; the site build fills them again from the code.
    stale = [str(path.relative_to(ROOT)) for path in _hooks().stale_pages()]
    assert stale == [], f"run `python docs/hooks.py` to rewrite the generated sections of {', '.join(stale)}"


def test_a_marker_written_inline_is_text_not_a_section():
    # A page saying "between `<!-- generated: exit-codes -->` and ..." was filled there, and the
    # section's match ran on to the real end marker, deleting the prose between.
    page = ("The table between `<!-- generated: exit-codes -->` and its end marker is generated.\n\n"
            "<!-- generated: exit-codes -->\n\nold\n\n<!-- end generated: exit-codes -->\n\nAfter.\n")  # fmt: skip
    filled = _hooks().fill(page, "page.md")
    prose, _, rest = filled.partition("\n\n")
    assert prose == page.partition("\n\n")[0] and rest.startswith("<!-- generated: exit-codes -->\n\n| code |")
    assert filled.count("<!-- end generated: exit-codes -->") == 1 and "old" not in filled and filled.endswith("\n\nAfter.\n")


def test_a_marker_inside_a_code_block_is_text_not_a_section():
    # A page showing how a section is written, in a fenced block, must keep its example as written.
    example = "```markdown\n<!-- generated: exit-codes -->\n\n(the table)\n\n<!-- end generated: exit-codes -->\n```\n"
    page = f"How a section is written:\n\n{example}\n<!-- generated: exit-codes -->\n\nold\n\n<!-- end generated: exit-codes -->\n"
    filled = _hooks().fill(page, "page.md")
    assert filled.startswith(f"How a section is written:\n\n{example}\n<!-- generated: exit-codes -->\n\n| code |"), filled
    assert "old" not in filled and filled.count("(the table)") == 1


def test_a_code_block_is_found_as_markdown_fences_it():
    # Counting fence lines (odd: inside) filled a marker in a 4-backtick block around a ``` one, or
    # in a ``` block after a ~~~ line; an example's start marker alone ran on to the real section's
    # end marker, which was then never filled; a line starting with ``` inline code hid the next one.
    section = "<!-- generated: exit-codes -->\n\nold\n\n<!-- end generated: exit-codes -->\n"
    for example in (f"````markdown\n```markdown\n{section}```\n````\n", f"```text\n~~~\n{section}```\n", f"~~~\n{section}~~~\n",
                    f"1. An item:\n\n    ```markdown\n{section}    ```\n", f"```\n{section}"):  # fmt: skip
        assert _hooks().fill(example, "page.md") == example, example
    for before in ("```\n<!-- generated: exit-codes -->\n```\n\n", "```code``` is inline.\n\n"):
        filled = _hooks().fill(before + section, "page.md")
        assert filled.startswith(before + "<!-- generated: exit-codes -->\n\n| code |") and "old" not in filled, filled


# ------------------------------------------------------------------------------- exit codes
def test_the_readme_lists_every_exit_code():
    from attncheck import cli

    codes = {value for name, value in vars(cli).items() if name.startswith("EXIT_")}
    table = set(int(c) for c in re.findall(r"^\| (\d+) \|", README_TEXT, flags=re.M))
    assert table == codes


# ------------------------------------------------------------------------------- the README
def test_the_readme_is_short():
    assert len(README_TEXT.splitlines()) <= MAX_README_LINES


def test_the_readme_quickstart_is_what_bin_has():
    block = code_blocks(README_TEXT, "bash")[0]
    assert [line.split("#")[0].strip() for line in block.splitlines()] == ["bin/attncheck forward", "bin/test"]
    assert (ROOT / "bin" / "attncheck").read_text().rstrip().endswith('exec "$root/.venv/bin/attncheck" "$@"')
    assert "-m pytest" in (ROOT / "bin" / "test").read_text()


def tutorial_file() -> str:
    """The whole mine.py of the first-check tutorial: the user's class and its adapter."""
    return next(b for b in code_blocks((DOCS / "tutorials/first-check.md").read_text(), "python") if "class MHA:" in b)


def test_the_readme_adapter_is_the_tutorials():
    readme = next(b for b in code_blocks(README_TEXT, "python") if "class MHA:" in b)
    assert readme.split("class MHA:")[1] == tutorial_file().split("class MHA:")[1]


@pytest.mark.slow
def test_the_five_minute_adapter_gives_the_verdict_the_readme_prints(tmp_path, capsys):
    from attncheck.cli import main

    (tmp_path / "mine.py").write_text(tutorial_file())
    out = tmp_path / "report.json"
    with pytest.raises(SystemExit) as ended:
        main(["run", "--impl", f"{tmp_path}/mine.py:MHA", "--json", str(out)])
    capsys.readouterr()
    assert ended.value.code == 0
    verdicts = Counter(report["verdict"] for report in json.loads(out.read_text())["results"])
    stated = re.search(r"`PASS  (\d+) of (\d+) checks pass, (\d+) unsupported`", README_TEXT)
    assert stated, "the README states the verdict"
    passed, total, unsupported = map(int, stated.groups())
    assert (verdicts["pass"], sum(verdicts.values()), verdicts["unsupported"]) == (passed, total, unsupported)
    assert f"PASS  {passed} of {total} checks pass, {unsupported} unsupported" in (DOCS / "tutorials/first-check.md").read_text()


def test_the_suites_page_states_the_short_output_limits():
    from attncheck.cli import PROGRESS_EVERY_S
    from attncheck.render_suite import FAILURE_LINES, SCREEN_LINES

    page = folded((DOCS / "how-to" / "suites.md").read_text())
    assert f"then one line every {PROGRESS_EVERY_S:g} s" in page
    assert f"cut to {SCREEN_LINES} lines" in page and f"once {FAILURE_LINES} lines are used" in page


# The failing report the README and the backward tutorial print, whose rows must be what the
# command prints now (a new user found the README's torch err and ratio stale: 2.69e-08 and
# 7.2e+06x where the command gives other figures since torch's other path joined torch's error).
PRINTED = "attncheck grad -c configs/default.yaml --impl examples/wrong_softmax_diagonal.py:MultiheadAttention"


@pytest.mark.parametrize("name", ["README.md", "docs/tutorials/backward.md"])
def test_a_printed_reports_rows_are_the_commands(name, capsys):
    from attncheck.cli import main

    text = (ROOT / name).read_text()
    block = next(b for b in code_blocks(text, "text") if b.startswith(f"$ {PRINTED}\n"))
    with pytest.raises(SystemExit):
        main(PRINTED.split()[1:])
    printed: dict[str, list[str]] = {}
    for line in capsys.readouterr().out.splitlines():
        if line.strip():
            printed.setdefault(line.split()[0], line.split())  # the grad table's row, before finite-diff's
    rows = [line.split("#")[0].split() for line in block.splitlines()[1:] if re.match(r"(in_proj|out_proj|input)\S* ", line)]
    assert len(rows) >= 4
    for row in rows:
        actual = iter(printed[row[0]])
        assert all(token in actual for token in row), (row, printed[row[0]])  # the row's words, in order
