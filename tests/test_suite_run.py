"""Running suites from the command line: exit codes, --only, summary, JSON, JUnit, shards, workers.

The suites here are tiny (E=8, H=2, L=3) so the whole module stays fast; one case points its
`impl` at a known-wrong backward so the failure paths are exercised for real.
"""

from __future__ import annotations

import json
import re
import xml.etree.ElementTree as ET

import pytest
from typer.testing import CliRunner

import attncheck
from attncheck.cli import app

runner = CliRunner()

MATRIX = """\
name: tiny
defaults:
  embed_dim: 8
  num_heads: 2
  tgt_len: 3
  attn_mask: causal
matrix:
  add_bias_kv: [false, true]
  is_causal: [false, true]
"""
WRONG_CASE = """\
cases:
  - name: wrong-softmax
    impl: attncheck.testing.wrong_impls:SoftmaxDiagonalBackward
"""
# The matrix has 4 combinations; is_causal with add_bias_kv is refused, so one is skipped.
MATRIX_RUNNABLE, MATRIX_SKIPPED = 3, 1
PROGRESS_LINE = re.compile(r"^\[(\d+)/(\d+)\] \S+ (forward|grad|sgd-step) (PASS|FAIL) \d+\.\d\ds$")


@pytest.fixture
def suites(tmp_path):
    passing = tmp_path / "passing.yaml"
    passing.write_text(MATRIX)
    failing = tmp_path / "failing.yaml"
    failing.write_text(MATRIX + WRONG_CASE)
    return {"passing": str(passing), "failing": str(failing)}


def run(*args):
    return runner.invoke(app, [str(a) for a in args])


def without_timing(data: dict) -> list[dict]:
    return [{k: v for k, v in report.items() if k != "timing"} for report in data["results"]]


@pytest.mark.parametrize("suite,args,code", [
    ("passing", ["run"], 0),
    ("failing", ["run"], 1),
    ("failing", ["run", "--only", "forward"], 0),  # the wrong backward leaves the forward right
    ("failing", ["grad"], 1),
    ("failing", ["sgd-step"], 1),
    ("passing", ["run", "--only", "forward,bogus"], 2),
    ("passing", ["run", "--only", ""], 2),
    ("passing", ["run", "--shard", "0/2"], 2),
    ("passing", ["run", "--shard", "3/2"], 2),
    ("passing", ["run", "--shard", "two"], 2),
    ("passing", ["run", "--workers", "0"], 2),
])  # fmt: skip
def test_exit_codes(suites, suite, args, code):
    result = run(*args, "-c", suites[suite])
    assert result.exit_code == code, result.output
    assert "Traceback" not in result.output


@pytest.mark.parametrize("only,commands", [
    ("forward", {"forward"}),
    ("grad,forward", {"forward", "grad"}),
    (None, {"forward", "grad", "sgd-step"}),
])  # fmt: skip
def test_only_chooses_commands(suites, tmp_path, only, commands):
    out = tmp_path / "r.json"
    result = run("run", "-c", suites["passing"], "--json", out, *(["--only", only] if only else []))
    assert result.exit_code == 0, result.output
    data = json.loads(out.read_text())
    assert {r["command"] for r in data["results"]} == commands
    assert len(data["results"]) == MATRIX_RUNNABLE * len(commands)


def test_summary_shows_every_check_and_details_only_for_failures(suites):
    result = run("run", "-c", suites["failing"])
    out = result.output
    assert "summary" in out and "skipped" in out and "is_causal" in out  # the skip and its reason
    assert "wrong-softmax" in out and "FAIL" in out
    # full tables for the failing case only: its header line, not a passing case's
    assert "attncheck grad  wrong-softmax" in out
    assert "attncheck forward  add_bias_kv=false" not in out
    verbose = run("run", "-c", suites["failing"], "--verbose").output
    assert "attncheck forward  add_bias_kv=false,is_causal=false" in verbose


def test_progress_on_a_pipe_is_the_first_check_then_a_line_every_few_seconds(suites):
    result = run("run", "-c", suites["failing"], "--only", "forward,grad")
    lines = [m for m in map(PROGRESS_LINE.match, result.output.splitlines()) if m]
    assert [int(m.group(1)) for m in lines] == [1]  # the run takes well under PROGRESS_EVERY_S


def test_plain_progress_lines_when_not_a_terminal(suites):
    result = run("run", "-c", suites["failing"], "--only", "forward,grad", "--verbose")
    lines = [m for m in map(PROGRESS_LINE.match, result.output.splitlines()) if m]
    total = (MATRIX_RUNNABLE + 1) * 2
    assert [int(m.group(1)) for m in lines] == list(range(1, total + 1))
    assert {int(m.group(2)) for m in lines} == {total}
    assert any(m.group(0).startswith(f"[{i}/{total}] wrong-softmax grad FAIL") for i, m in enumerate(lines, 1))


def test_single_config_renders_and_writes_as_before(tmp_path):
    out = tmp_path / "r.json"
    result = run("forward", "-c", "configs/causal.yaml", "--json", out)
    assert result.exit_code == 0, result.output
    assert "summary" not in result.output and not PROGRESS_LINE.search(result.output)
    assert "attncheck forward  causal" in result.output
    data = json.loads(out.read_text())
    assert data["command"] == "forward" and data["name"] == "causal" and "results" not in data


def test_suite_json(suites, tmp_path):
    out = tmp_path / "r.json"
    run("run", "-c", suites["failing"], "--json", out)
    data = json.loads(out.read_text())
    assert data["schema"] == 6 and data["suite"] == "tiny" and data["verdict"] == "fail"
    assert len(data["results"]) == (MATRIX_RUNNABLE + 1) * 3
    assert [s["case"] for s in data["skipped"]] == ["add_bias_kv=true,is_causal=true"]
    assert "is_causal" in data["skipped"][0]["reason"]
    failing = {(r["name"], r["command"]) for r in data["results"] if r["verdict"] == "fail"}
    assert failing == {("wrong-softmax", "grad"), ("wrong-softmax", "sgd-step")}


def test_junit_parses_and_counts_match(suites, tmp_path):
    out = tmp_path / "junit.xml"
    result = run("run", "-c", suites["failing"], "--junit", out)
    assert result.exit_code == 1
    suite = ET.parse(out).getroot()
    cases = suite.findall("testcase")
    assert suite.tag == "testsuite"
    assert int(suite.get("tests")) == len(cases) == (MATRIX_RUNNABLE + 1 + MATRIX_SKIPPED) * 3
    failed = [c for c in cases if c.find("failure") is not None]
    skipped = [c for c in cases if c.find("skipped") is not None]
    assert int(suite.get("failures")) == len(failed) == 2
    assert int(suite.get("skipped")) == len(skipped) == MATRIX_SKIPPED * 3
    assert {(c.get("classname"), c.get("name")) for c in failed} == {
        ("attncheck.grad", "wrong-softmax"), ("attncheck.sgd-step", "wrong-softmax")
    }  # fmt: skip
    message = failed[0].find("failure").get("message")
    assert "grad in_proj_weight[q]" in message and "Greatest absolute difference" in message and "allowed" in message
    assert len(message) <= 500 and "(and grad " in message  # the first row's line, the others named (junit.MESSAGE_CHARS)
    assert "is_causal" in skipped[0].find("skipped").get("message")
    assert all(float(c.get("time")) >= 0 for c in cases)


def test_unwritable_junit_is_refused_before_any_work(suites, tmp_path):
    result = run("run", "-c", suites["passing"], "--junit", tmp_path / "no-dir" / "j.xml")
    assert result.exit_code == 2 and "does not exist" in result.output
    assert not PROGRESS_LINE.search(result.output)


def test_shards_partition_the_suite(suites, tmp_path):
    def results(*args):
        out = tmp_path / "r.json"
        assert run("run", "-c", suites["failing"], "--only", "forward", "--json", out, *args).exit_code in (0, 1)
        data = json.loads(out.read_text())
        return without_timing(data), [s["case"] for s in data["skipped"]]

    whole, whole_skipped = results()
    shards = [results("--shard", f"{i}/3") for i in (1, 2, 3)]
    names = [[r["name"] for r in rows] for rows, _ in shards]
    assert all(names), "every shard of 5 cases into 3 has work"
    assert sum(map(len, names)) == len({n for ns in names for n in ns}) == len(whole)  # disjoint
    union = sorted((json.dumps(r, sort_keys=True) for rows, _ in shards for r in rows))
    assert union == sorted(json.dumps(r, sort_keys=True) for r in whole)
    assert sorted(s for _, skipped in shards for s in skipped) == whole_skipped


@pytest.mark.slow
def test_workers_give_identical_results(suites, tmp_path):
    def rows(workers):
        out = tmp_path / f"w{workers}.json"
        result = run("run", "-c", suites["failing"], "--only", "forward,grad", "--workers", workers, "--json", out)
        assert result.exit_code == 1, result.output
        return without_timing(json.loads(out.read_text()))

    assert rows(2) == rows(1)


# Above LARGE_LOGITS (2^22) attention logits B * H * L * S (Config.is_large) torch runs on two threads, and
# from the reference's parallel_logits (2^23) its calls run on worker threads (one per worker
# process under --workers); each count is fixed by the config, so the numbers must not move.
# One large case (float32: its float64 oracle runs the threaded kernel too), two commands: a job
# for each of the two workers. A float64 case as well doubled the test's time for no other path.
LARGE = """\
name: large
defaults:
  embed_dim: 8
  num_heads: 2
  tgt_len: 1500
  need_weights: false
cases:
  - name: float32
"""


@pytest.mark.slow
def test_workers_give_identical_results_above_the_thread_threshold(tmp_path):
    from attncheck.config import Config
    from attncheck.reference import DEFAULT_PARALLEL_LOGITS

    cfg = Config(embed_dim=8, num_heads=2, tgt_len=1500)
    assert cfg.is_large and cfg.logits >= DEFAULT_PARALLEL_LOGITS  # the suite below is large for both
    suite = tmp_path / "large.yaml"
    suite.write_text(LARGE)

    def rows(workers):
        out = tmp_path / f"w{workers}.json"
        result = run("run", "-c", suite, "--only", "forward,grad", "--workers", workers, "--json", out)
        assert result.exit_code == 0, result.output
        return without_timing(json.loads(out.read_text()))

    one = rows(1)
    assert len(one) == 2 and all(row["status"] == "pass" for report in one for row in report["rows"])
    assert rows(2) == one


def test_ctrl_c_exits_130_and_writes_nothing(suites, tmp_path, monkeypatch):
    import attncheck.suite

    def interrupt(*args):
        raise KeyboardInterrupt

    monkeypatch.setattr(attncheck.suite, "run_job", interrupt)
    out, junit = tmp_path / "r.json", tmp_path / "j.xml"
    result = run("run", "-c", suites["passing"], "--json", out, "--junit", junit)
    assert result.exit_code == 130 and "interrupted" in result.output
    assert set(tmp_path.iterdir()) == {tmp_path / "passing.yaml", tmp_path / "failing.yaml"}  # not even a temp file


BLAS_RECORDING = '''
import threadpoolctl

from attncheck.reference import MultiheadAttention


def blas_threads():
    return max(i["num_threads"] for i in threadpoolctl.threadpool_info() if i["user_api"] == "blas")


class Recording(MultiheadAttention):
    def forward(self, *args, **kwargs):
        with open(PATH, "a") as f:
            f.write(f"{blas_threads()}\\n")
        return super().forward(*args, **kwargs)
'''


def _blas_threads() -> int:
    """BLAS's thread count in this process, as threadpoolctl reads it (the candidate's own copy is in BLAS_RECORDING)."""
    threadpoolctl = pytest.importorskip("threadpoolctl")
    return max(i["num_threads"] for i in threadpoolctl.threadpool_info() if i["user_api"] == "blas")


def test_blas_runs_on_one_thread_in_a_small_configs_checks_in_the_judge_and_the_candidates_process(tmp_path, monkeypatch):
    """attncheck.threads: BLAS's second thread waits and spins on a busy machine, so a config that is
    not large has BLAS on one thread in the judge's check and in the candidate's calls (where the
    machine has more than one core to give it)."""
    import attncheck
    import attncheck.checks

    before = _blas_threads()
    if before < 2:
        pytest.skip("BLAS has one thread here already")
    judged = []
    run_check = attncheck.checks.run_check

    def recording(*args, **kwargs):
        judged.append(_blas_threads())
        return run_check(*args, **kwargs)

    monkeypatch.setattr(attncheck.checks, "run_check", recording)
    calls = tmp_path / "calls.txt"
    source = tmp_path / "recording.py"
    source.write_text(BLAS_RECORDING.replace("PATH", repr(str(calls))))
    report = attncheck.check({"embed_dim": 8, "num_heads": 2}, "forward", impl=f"{source}:Recording")
    assert report.verdict == "pass"
    assert judged == [1] and _blas_threads() == before  # restored after the run
    assert set(calls.read_text().split()) == {"1"}


def test_a_large_configs_calls_keep_blas_s_threads():
    from attncheck import threads

    before = _blas_threads()
    with threads.blas_on_one_thread(False):
        assert _blas_threads() == before
    with threads.blas_on_one_thread():
        assert _blas_threads() == 1
    threads.blas_threads_for(large=False)  # as a candidate's process does for a small config, then a large one
    assert _blas_threads() == 1
    threads.blas_threads_for(large=True)
    assert _blas_threads() == before


def test_a_junit_failure_message_stays_within_its_cap_with_many_failing_rows():
    # The other failing quantities were named in full after the first row's line: a grad with a
    # row per head (--per-head: dozens) wrote 1,265 characters, past junit.MESSAGE_CHARS.
    from attncheck.config import Config
    from attncheck.junit import MESSAGE_CHARS, failure_message
    from attncheck.report import FAIL, Report, Row

    rows = [Row("grad", f"in_proj_weight[q] head {h}", FAIL, note="x" * 600) for h in range(40)]
    message = failure_message(Report("grad", "c", "x:Y", Config(), rows=rows))
    assert len(message) <= MESSAGE_CHARS and message.startswith("40 quantities fail: grad in_proj_weight[q] head 0: ")
    assert "(and grad in_proj_weight[q] head 1, " in message and message.endswith(" more)")
    two = failure_message(Report("grad", "c", "x:Y", Config(), rows=rows[:2]))
    assert two.endswith("... (and grad in_proj_weight[q] head 1)") and len(two) == MESSAGE_CHARS


@pytest.mark.parametrize("module, keys", [("multihead_attention", {}), ("transformer_encoder_layer", {}), ("sdpa", {}),
                                         ("sdpa_varlen", {}), ("sdpa_varlen", {"seqlens_q": [3, 0, 5], "seqlens_k": [4, 2, 5]}),
                                         ("sdpa_kvcache", {})])
def test_a_reports_json_config_holds_its_modules_keys_and_loads_back_as_the_config(module, keys):
    # Schema 4 carried every key of every module: a kernel's report had embed_dim, lr and the
    # layer's activation, and loading it back was a config error (a key of another module set).
    from attncheck.config import config_from_mapping

    cfg = config_from_mapping({"module": module, "dtype": "float64", "seed": 3, **keys})
    dumped = attncheck.check(cfg, "forward").to_dict()["config"]
    assert dumped["module"] == module and dumped["dtype"] == "float64" and dumped["framework"] == "numpy"
    assert ("embed_dim" in dumped) == (not cfg.is_function) and ("causal" in dumped) == cfg.is_function
    assert ("activation" in dumped) == cfg.is_layer and ("cache_seqlens" in dumped) == (module == "sdpa_kvcache")
    assert config_from_mapping(dumped).model_dump() == {**cfg.model_dump(), "framework": "numpy"}  # the framework checked
