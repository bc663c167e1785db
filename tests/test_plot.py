"""--plot: heatmaps of |candidate - reference| / allowed, drawn headless (Agg), one figure per quantity.

Each known bug must show as its shape: a causal off-by-one as a diagonal, a head bug as whole
heads, a key-padding bug as columns; and the files must be written as asked.
"""

from __future__ import annotations

import sys

import matplotlib
import numpy as np
import pytest
from matplotlib.image import imread
from typer.testing import CliRunner

from attncheck.api import check
from attncheck.cli import app
from attncheck.plot import figures, panels, write_plots
from tests.diagnose_candidates import CausalOffByOne, HeadsReversed, HeadTwoQGradZero, KeyPaddingIgnored

matplotlib.use("Agg")
runner = CliRunner()
PER_HEAD_CAUSAL = dict(attn_mask="causal", average_attn_weights=False, tgt_len=8)


def _row(report, quantity, section="forward"):
    return next(r for r in report.rows if r.quantity == quantity and r.section == section)


def test_a_causal_off_by_one_shows_as_the_diagonal_above_the_main_one():
    report = check(PER_HEAD_CAUSAL, "forward", impl=CausalOffByOne)
    ps = panels(_row(report, "attn_weights"), report.config)
    assert [p.title.split(",")[0] for p in ps] == ["head 0", "head 1", "head 2", "head 3"]  # one panel per head
    for p in ps:
        L = p.ratio.shape[0]
        above = np.array([p.ratio[i, i + 1] for i in range(L - 1)])
        assert (above > 1).all()  # the key torch masks and the candidate lets through
        assert np.array_equal(p.masked, np.triu(np.ones((L, L), bool), 1))  # hatched: torch's causal mask
        assert (p.ratio[L - 1] <= 1).all()  # the last query has no later key: that row agrees


def test_a_head_bug_shows_as_whole_heads():
    report = check({}, "grad", impl=HeadTwoQGradZero)
    (p,) = panels(_row(report, "in_proj_weight[q]", "grad"), report.config)
    assert p.head_size == (6, None)  # head boundaries drawn every D rows
    assert (p.ratio[12:18] > 1).all() and (p.ratio[:12] <= 1).all() and (p.ratio[18:] <= 1).all()


def test_a_key_padding_bug_shows_at_the_padded_columns():
    report = check(dict(key_padding_mask="random", tgt_len=8), "forward", impl=KeyPaddingIgnored)
    (p,) = panels(_row(report, "attn_weights"), report.config)
    padded = p.masked.all(axis=0)
    assert padded.any() and np.array_equal(p.masked, np.broadcast_to(padded, p.masked.shape))  # whole columns hatched
    assert (p.ratio[:, padded] > 1).all()


def test_one_figure_per_failing_quantity_with_a_panel_per_head():
    report = check(dict(average_attn_weights=False), "forward", impl=HeadsReversed)
    named = figures(report)
    assert [name.split("-", 2)[2] for name, _ in named] == ["attn_weights", "fast-path-attn_weights"]
    fig = named[0][1]
    images = [ax for ax in fig.axes if ax.get_images()]
    assert len(images) == 4
    assert len(figures(report, every_row=True)) == 4  # outputs too, passing


def test_a_kernels_output_is_drawn_per_head_over_query_and_feature(tmp_path):
    # A kernel's arrays are (batch, head, query, feature): --plot drew nothing for them and said
    # "nothing failed" under a failing verdict.
    (tmp_path / "doubled.py").write_text(
        "from attncheck.reference import ScaledDotProductAttention\n"
        "class HeadOneDoubled(ScaledDotProductAttention):\n"
        "    def forward(self, *args, **kwargs):\n"
        "        out = super().forward(*args, **kwargs).copy()\n"
        "        out[:, 1] *= 2\n"
        "        return out\n")  # fmt: skip
    report = check({"module": "sdpa", "seed": 3}, "forward", impl=f"{tmp_path / 'doubled.py'}:HeadOneDoubled")
    ps = panels(_row(report, "output"), report.config)
    assert [p.title.split(",")[0] for p in ps] == [f"head {h}" for h in range(report.config.num_heads)]
    assert all((p.ylabel, p.xlabel) == ("query", "feature") for p in ps)
    assert (ps[1].ratio > 1).any() and all((p.ratio <= 1).all() for h, p in enumerate(ps) if h != 1)
    result = runner.invoke(app, ["forward", "--module", "sdpa", "--case", "plain", "--impl", f"{tmp_path / 'doubled.py'}:HeadOneDoubled",
                                 "--plot", str(tmp_path / "plots")])  # fmt: skip
    assert result.exit_code == 1 and list((tmp_path / "plots").glob("*.png")), result.output


def test_a_decode_kernels_output_is_drawn_per_head_over_query_and_feature():
    # Its (batch, query, head, feature) output had no named axes: --plot drew nothing for it.
    from attncheck.candidate import candidate_from_object
    from attncheck.checks import run_check
    from attncheck.config import load_suite
    from attncheck.testing.wrong_kvcache import WRONG_KVCACHE

    cfg = next(c.config for c in load_suite(None, module="sdpa_kvcache").cases if c.name == "append-causal-lq4")
    report = run_check("forward", cfg, candidate_from_object(WRONG_KVCACHE["DiagonalTopLeft"]))
    ps = panels(_row(report, "output"), report.config)
    assert [p.title.split(",")[0] for p in ps] == [f"head {h}" for h in range(cfg.num_heads)]
    assert all((p.ylabel, p.xlabel) == ("query", "feature") and p.ratio.shape == (cfg.tgt_len, cfg.head_dim_eff) for p in ps)
    assert any((p.ratio > 1).any() for p in ps)


def test_a_run_that_draws_nothing_says_why(tmp_path):
    # A packed (varlen) kernel's arrays have no named axes: its failing output drew nothing, and the
    # run said "no failing quantity is an array to draw (--plot-all draws every quantity)", neither true.
    varlen = ["forward", "--module", "sdpa_varlen", "--case", "plain", "--impl", "attncheck/testing/wrong_varlen.py:CuSeqlensOffByOne"]
    for extra in ([], ["--plot-all"]):
        result = runner.invoke(app, [*varlen, "--plot", str(tmp_path / "varlen"), *extra])
        assert result.exit_code == 1 and not list(tmp_path.glob("varlen/*")), result.output
        assert "plot: nothing drawn: --plot does not lay out the arrays of module: sdpa_varlen" in result.output, result.output
        assert "--plot-all draws" not in result.output
    result = runner.invoke(app, ["forward", "--module", "sdpa", "--case", "plain", "--plot", str(tmp_path / "passing")])
    assert result.exit_code == 0 and "plot: nothing failed, nothing drawn (--plot-all draws every quantity)" in result.output, result.output


def test_a_gqa_kernels_key_gradient_is_drawn_per_key_value_head(tmp_path):
    (tmp_path / "key_grad.py").write_text(
        "from attncheck.reference import ScaledDotProductAttention\n"
        "class KeyGradDoubled(ScaledDotProductAttention):\n"
        "    def backward(self, *args, **kwargs):\n"
        "        grads = dict(super().backward(*args, **kwargs))\n"
        "        grads['key'] = grads['key'] * 2\n"
        "        return grads\n")  # fmt: skip
    report = check({"module": "sdpa", "seed": 3, "num_heads": 6, "num_kv_heads": 2}, "grad", impl=f"{tmp_path / 'key_grad.py'}:KeyGradDoubled")
    ps = panels(_row(report, "key", "grad"), report.config)
    assert [p.title.split(",")[0] for p in ps] == ["kv head 0", "kv head 1"] and all(p.ylabel == "key" for p in ps)


@pytest.mark.slow
def test_files_in_a_directory(tmp_path):
    report = check(PER_HEAD_CAUSAL, "forward", impl=CausalOffByOne)
    written = write_plots([report], tmp_path / "plots")
    assert sorted(p.name for p in written) == sorted(
        ["config-forward-output.png", "config-forward-attn_weights.png",
         "config-forward-fast-path-output.png", "config-forward-fast-path-attn_weights.png"])  # fmt: skip
    height, width, _ = imread(tmp_path / "plots" / "config-forward-attn_weights.png").shape
    assert width > 1000 and 300 < height < width  # four panels side by side


@pytest.mark.slow
def test_one_svg_for_one_quantity_and_one_pdf_page_per_quantity(tmp_path):
    report = check({}, "grad", impl=HeadTwoQGradZero)
    (svg,) = write_plots([report], tmp_path / "q.svg")
    assert svg == tmp_path / "q.svg" and svg.read_text().lstrip().startswith("<?xml")
    forward = check(PER_HEAD_CAUSAL, "forward", impl=CausalOffByOne)
    (pdf,) = write_plots([report, forward], tmp_path / "all.pdf")
    data = pdf.read_bytes()
    assert data.startswith(b"%PDF") and data.count(b"/Type /Page\n") + data.count(b"/Type /Page ") + data.count(b"/Type /Page>") >= 5


@pytest.mark.slow
def test_cli_plot_and_plot_all(tmp_path):
    one = ["-c", "configs/default.yaml"]  # one config: the default suite would draw every case's quantities
    result = runner.invoke(app, ["grad", *one, "--impl", "tests/diagnose_candidates.py:HeadTwoQGradZero", "--plot", str(tmp_path / "g.png")])
    assert result.exit_code == 1 and (tmp_path / "g.png").is_file()
    result = runner.invoke(app, ["forward", *one, "--plot", str(tmp_path / "pass"), "--plot-all"])
    assert result.exit_code == 0 and len(list((tmp_path / "pass").glob("*.png"))) == 4


def test_plot_without_matplotlib_is_a_usage_error(tmp_path, monkeypatch):
    monkeypatch.setitem(sys.modules, "matplotlib", None)  # import matplotlib now raises ImportError
    result = runner.invoke(app, ["forward", "--plot", str(tmp_path / "x.png")])
    assert result.exit_code == 2 and "pip install matplotlib" in result.output and "attncheck[plot]" not in result.output


@pytest.mark.parametrize("args,fragment", [
    (["--plot", "x.gif"], "expected a .png, .svg or .pdf"),
    (["--plot-all"], "--plot-all needs --plot"),
])  # fmt: skip
def test_bad_plot_options_are_usage_errors(args, fragment):
    result = runner.invoke(app, ["forward", *args])
    assert result.exit_code == 2 and fragment in result.output


def test_ctrl_c_while_the_plots_are_drawn_leaves_no_file_and_says_so(tmp_path, monkeypatch):
    # The reports were renamed into place before the figures were drawn, and typer turned the
    # KeyboardInterrupt into a silent exit 130: both reports written, no message (drawing
    # --plot-all over the default suite takes about a second).
    import attncheck.plot

    def interrupted(report, every_row=False):
        raise KeyboardInterrupt

    monkeypatch.setattr(attncheck.plot, "figures", interrupted)
    result = runner.invoke(app, ["forward", "--case", "basic", "--plot", str(tmp_path / "plots"), "--plot-all",
                                 "--json", str(tmp_path / "r.json"), "--junit", str(tmp_path / "r.xml")])  # fmt: skip
    assert result.exit_code == 130 and "interrupted; no output file was written" in result.output, result.output
    assert list(tmp_path.iterdir()) == []


def test_a_file_is_named_case_command_quantity_with_the_section_only_where_it_is_another(tmp_path):
    report = check({"tgt_len": 4, "seed": 3}, "grad", impl=HeadTwoQGradZero)
    names = sorted(p.name for p in write_plots([report], tmp_path / "plots"))
    assert names and all(n.startswith("config-grad-") for n in names), names
    assert names == ["config-grad-in_proj_weight_q.png"] and not [n for n in names if "grad-grad" in n], names
