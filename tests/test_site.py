"""The documentation site builds with `mkdocs build --strict`: every page in the nav, every link and
anchor resolving, every generated reference section filled from the code (docs/hooks.py)."""

from __future__ import annotations

import html
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent

mkdocs = pytest.importorskip("mkdocs", reason="mkdocs is not installed (pip install 'mkdocs>=1.6' 'mkdocs-material>=9.5')")
pytest.importorskip("material", reason="mkdocs-material is not installed (pip install 'mkdocs-material>=9.5')")


@pytest.fixture(scope="module")
def site(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("site")
    env = {**os.environ, "NO_MKDOCS_2_WARNING": "1", "PYTHONPATH": str(ROOT)}
    built = subprocess.run([sys.executable, "-m", "mkdocs", "build", "--strict", "-q", "-d", str(out)],
                           cwd=ROOT, env=env, capture_output=True, text=True, timeout=120)  # fmt: skip
    assert built.returncode == 0, built.stdout + built.stderr
    return out


def test_the_site_builds_strictly(site):
    assert (site / "index.html").is_file()
    assert (site / "tutorials" / "first-check" / "index.html").is_file()


def test_the_heatmaps_are_in_the_site(site):
    page = (site / "tutorials" / "finding-a-bug" / "index.html").read_text()
    for name in ("heatmap-weights.png", "heatmap-output.png", "heatmap-grad.png"):
        assert f"../../{name}" in page and (site / name).is_file(), name


def test_the_hook_is_not_published(site):
    assert not (site / "hooks.py").exists()


def html_of(site: Path, page: str) -> str:
    return (site / page / "index.html").read_text()


def test_the_cli_reference_has_every_option_of_every_command(site):
    import typer.main

    from attncheck.cli import app

    group = typer.main.get_command(app)
    ctx = group.context_class(group, info_name="attncheck")
    text = html_of(site, "reference/cli")
    for name in group.list_commands(ctx):
        assert f"attncheck {name}" in text, name
        for param in group.get_command(ctx, name).params:
            for opt in param.opts:
                assert f"<code>{opt}</code>" in text, (name, opt)


def test_the_config_reference_has_every_key_with_its_default(site):
    from attncheck.config.schema import Config

    text = html_of(site, "reference/config")
    for key, field in Config.model_fields.items():
        default = "null" if field.default is None else str(field.default).lower() if isinstance(field.default, bool) else str(field.default)
        assert f"<td><code>{key}</code></td>" in text, key
        assert f"<code>{default}</code>" in text, (key, default)


def test_the_default_suites_page_has_every_case_of_every_suite(site):
    from attncheck.config import load_suite
    from attncheck.kinds import kinds

    text = html_of(site, "reference/default-suites")
    for module in kinds():  # every kind has a default suite, and the page lists it
        suite = load_suite(None, module=module)
        assert f"({len(suite.cases)} cases)" in text, module
        for case in suite.cases:
            assert f"<code>{case.name}</code>" in text, (module, case.name)


def test_the_adapt_reference_has_every_public_helper(site):
    import inspect

    from attncheck import adapt

    text = html_of(site, "reference/adapt")
    prose = " ".join(html.unescape(re.sub(r"<[^>]+>", "", text)).split())  # the page's text, tags removed
    for name in adapt.__all__:
        obj = getattr(adapt, name)
        if callable(obj):
            assert f'<h2 id="{name.lower()}"' in text, name
            first_paragraph = " ".join(inspect.getdoc(obj).split("\n\n")[0].replace("`", "").split())
            assert first_paragraph in prose, name


def test_the_exit_codes_page_has_every_code(site):
    from attncheck import cli

    text = html_of(site, "reference/exit-codes")
    for name, value in vars(cli).items():
        if name.startswith("EXIT_"):
            assert f"<td>{value}</td>" in text and f"<code>{name}</code>" in text, name
