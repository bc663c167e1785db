"""Candidate processes forked from the judge's fork server start as a fresh interpreter would: the
judge's environment, working directory and sys.path at the fork, a session of their own, only their
channel open, pristine modules, fresh random state; and the judge survives the server's death."""

from __future__ import annotations

import importlib.util
import json
import os
import signal
import subprocess
import sys
import textwrap
import time

import pytest

import attncheck
from attncheck import forkserver, remote

PROBE = textwrap.dedent('''
    import gc, json, os, sys
    import numpy as np
    seen = {"marker": os.environ.get("ATTNCHECK_TEST_MARKER"), "cwd": os.getcwd(), "own_session": os.getsid(0) == os.getpid(),
            "collecting": gc.isenabled(), "frozen": gc.get_freeze_count(),
            "argv": sys.argv[1:], "random": float(np.random.random()), "fds": sorted(int(f) for f in os.listdir("/proc/self/fd")),
            "stdin": os.readlink("/proc/self/fd/0"), "patched_before": getattr(np, "patched_by_a_candidate", False),
            "path_has_tmp": os.path.dirname(__file__) in sys.path or any(p == os.path.dirname(__file__) for p in sys.path)}
    with open(os.environ["ATTNCHECK_TEST_SEEN"], "a") as f:
        f.write(json.dumps(seen) + "\\n")
    np.patched_by_a_candidate = True  # a candidate patching a module: the next fork must not see it
    from attncheck.reference import MultiheadAttention
''')


@pytest.fixture
def probe(tmp_path, monkeypatch):
    (tmp_path / "probe_candidate.py").write_text(PROBE)
    seen = tmp_path / "seen.jsonl"
    monkeypatch.setenv("ATTNCHECK_TEST_SEEN", str(seen))
    monkeypatch.chdir(tmp_path)

    def load(marker: str) -> dict:
        monkeypatch.setenv("ATTNCHECK_TEST_MARKER", marker)  # set after the server started: the fork must see it
        process = remote.CandidateProcess(str(tmp_path / "probe_candidate.py") + ":MultiheadAttention", None)
        try:
            process.ensure()
            kind = type(process.process).__name__
        finally:
            process.stop()
        return {**json.loads(seen.read_text().splitlines()[-1]), "kind": kind}

    return load


def test_a_forked_candidate_process_starts_as_a_fresh_interpreter_would(probe, tmp_path, monkeypatch):
    monkeypatch.setenv(forkserver.ENV, "0")
    fresh = probe("fresh")
    monkeypatch.setenv(forkserver.ENV, "1")
    first, second = probe("first"), probe("second")
    assert (fresh["kind"], first["kind"], second["kind"]) == ("Popen", "ForkedProcess", "ForkedProcess")
    for seen, marker in ((fresh, "fresh"), (first, "first"), (second, "second")):
        assert seen["marker"] == marker and seen["cwd"] == str(tmp_path) and seen["own_session"], seen
        assert seen["stdin"] == os.devnull and seen["path_has_tmp"] and not seen["patched_before"], seen
        # stdin, stdout, stderr, the two channel ends named in argv (and the listing's own descriptor)
        read_fd, write_fd = map(int, seen["argv"][:2])
        assert len(set(seen["fds"]) - {0, 1, 2, read_fd, write_fd}) <= 1, seen
    assert first["random"] != second["random"]  # NumPy's global state reseeded, not the server's copy
    # No collection while the candidate is imported; a fork's collections never scan what the server imported.
    assert not any(seen["collecting"] for seen in (fresh, first, second))
    assert fresh["frozen"] == 0 and first["frozen"] > 10_000 and second["frozen"] > 10_000, (fresh, first, second)


def test_a_candidate_process_collects_garbage_once_its_candidate_is_loaded():
    """Child.load freezes what the process imported (the candidate and its framework) out of every
    later collection and turns collecting on, whether or not the candidate could be loaded."""
    code = textwrap.dedent("""
        import gc, json
        from attncheck.child import Child
        seen = []
        for spec in ("attncheck.reference:MultiheadAttention", "attncheck.no_such_module:X"):
            gc.disable()
            frozen = gc.get_freeze_count()
            try:
                Child().load(spec, None)
            except Exception:
                pass
            seen.append([gc.isenabled(), gc.get_freeze_count() > frozen])
        print(json.dumps(seen))
        """)  # fmt: skip
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True, env=forkserver.environment()).stdout
    assert json.loads(out) == [[True, True], [True, True]]


def test_the_servers_own_imports_load_no_framework_and_start_no_thread():
    """What the server imports as it starts, before any candidate is loaded: no torch or JAX (a
    NumPy candidate's process would pay for them) and no thread beyond the one NumPy's BLAS starts
    (the server forks: a thread of its own could hold a lock in every fork). Every module kind and
    each kind's reference are among them, so a kind added later is preloaded too. What it imports
    once a torch candidate has been loaded starts no thread either (it would fork no more, and
    the judge would start fresh interpreters from then on); JAX's: the test below."""
    code = textwrap.dedent("""
        import importlib, json, os, sys
        import numpy
        threads = [len(os.listdir("/proc/self/task"))]
        from attncheck import forkserver
        forkserver._preload()
        from attncheck.kinds import kinds
        threads.append(len(os.listdir("/proc/self/task")))
        seen = {"modules": sorted(sys.modules), "references": [kind.reference_spec.split(":")[0] for kind in kinds().values()]}
        for name in forkserver.PRELOADS["torch"]:
            importlib.import_module(name)
        print(json.dumps({**seen, "threads": threads + [len(os.listdir("/proc/self/task"))]}))
        """)  # fmt: skip
    seen = json.loads(subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True, env=forkserver.environment()).stdout)
    assert seen["threads"][2] == seen["threads"][1] == seen["threads"][0], seen["threads"]
    assert not {"torch", "jax", "flax"} & {name.split(".")[0] for name in seen["modules"]}
    assert set(seen["references"]) | set(forkserver.PRELOAD) <= set(seen["modules"])
    assert {"attncheck.kinds.sdpa_kvcache", "attncheck.reference.kvcache", "threadpoolctl"} <= set(seen["modules"])


BLAS_PROBE = textwrap.dedent('''
    import json, os
    from threadpoolctl import threadpool_info
    from attncheck.reference import MultiheadAttention as Reference

    class MultiheadAttention(Reference):
        def forward(self, *args, **kwargs):
            blas = [info["num_threads"] for info in threadpool_info() if info["user_api"] == "blas"]
            with open(os.environ["ATTNCHECK_TEST_SEEN"], "a") as f:
                f.write(json.dumps({"threads": len(os.listdir("/proc/self/task")), "blas": blas}) + "\\n")
            return super().forward(*args, **kwargs)
''')


def test_a_candidate_process_starts_with_blas_on_one_thread_and_no_thread_restarted(tmp_path, monkeypatch):
    """The server holds BLAS to one thread before it forks (attncheck.threads.blas_threads_for): a
    candidate process of a small config runs on its one thread, with no BLAS thread restarted by
    setting the limit after the fork (it spun for 0.1 s of CPU in every candidate process)."""
    _a_server_of_its_own(monkeypatch)
    (tmp_path / "blas_probe.py").write_text(BLAS_PROBE)
    seen = tmp_path / "seen.jsonl"
    monkeypatch.setenv("ATTNCHECK_TEST_SEEN", str(seen))
    report = attncheck.check(None, "forward", impl=f"{tmp_path / 'blas_probe.py'}:MultiheadAttention")
    assert report.passed
    calls = [json.loads(line) for line in seen.read_text().splitlines()]
    assert calls and all(call == {"threads": 1, "blas": [1]} for call in calls), calls


def _needs_scipy() -> None:
    """Skip where SciPy is not installed, without importing it here: its own OpenBLAS, loaded into
    this test process, would stay on two threads for the tests after (tests/test_suite_run.py reads
    this process's BLAS libraries, and failed after this module in one process, `-n 0`)."""
    if importlib.util.find_spec("scipy") is None:
        pytest.skip("needs SciPy (a BLAS library of its own)")


def test_a_blas_library_the_candidate_loads_is_held_to_one_thread_too(tmp_path, monkeypatch):
    """SciPy's own OpenBLAS, loaded by the candidate after the server's hold: held as the session opens."""
    _needs_scipy()
    _a_server_of_its_own(monkeypatch)
    (tmp_path / "scipy_probe.py").write_text("import scipy.linalg\n" + BLAS_PROBE)
    seen = tmp_path / "seen.jsonl"
    monkeypatch.setenv("ATTNCHECK_TEST_SEEN", str(seen))
    report = attncheck.check(None, "forward", impl=f"{tmp_path / 'scipy_probe.py'}:MultiheadAttention")
    assert report.passed
    calls = [json.loads(line)["blas"] for line in seen.read_text().splitlines()]
    assert calls and all(len(blas) >= 2 and set(blas) == {1} for blas in calls), calls


def test_a_large_configs_candidate_process_gets_blas_threads_back():
    """A fork of a process that held BLAS to one thread (the server) gives BLAS its own thread count
    back for a large config, and holds it to one again for a small one."""
    code = textwrap.dedent("""
        import json, os
        from threadpoolctl import threadpool_info
        from attncheck import threads
        def blas():
            return [info["num_threads"] for info in threadpool_info() if info["user_api"] == "blas"]
        own = blas()
        threads.blas_threads_for(False)
        held = blas()
        read, write = os.pipe()
        pid = os.fork()
        if pid == 0:
            threads.blas_threads_for(False)
            small = blas()
            threads.blas_threads_for(True)
            large = blas()
            threads.blas_threads_for(False)
            os.write(write, json.dumps([small, large, blas()]).encode())
            os._exit(0)
        os.waitpid(pid, 0)
        print(json.dumps([own, held, *json.loads(os.read(read, 1000))]))
        """)  # fmt: skip
    own, held, small, large, small_again = json.loads(subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True,
                                                                     env=forkserver.environment()).stdout)  # fmt: skip
    assert held == small == small_again == [1] * len(own) and large == own, (own, held, small, large, small_again)


def test_a_blas_library_a_fork_loads_is_held_for_small_configs_alone_and_numpys_is_not_set_again():
    """In a fork of the holding server that then loads SciPy's own OpenBLAS: the first small config
    holds that library alone (NumPy's, on one thread already, is not set: setting it restarts a
    spinning thread), a large one gives both their counts back, a small one holds both again."""
    _needs_scipy()
    code = textwrap.dedent("""
        import json, os
        from threadpoolctl import threadpool_info
        from attncheck import threads
        def blas():
            return sorted((info["filepath"], info["num_threads"]) for info in threadpool_info() if info["user_api"] == "blas")
        numpys = dict(blas())  # NumPy's own counts, before the hold
        threads.blas_threads_for(False)
        read, write = os.pipe()
        pid = os.fork()
        if pid == 0:
            import scipy.linalg
            own = blas()
            threads.blas_threads_for(False)
            held = [lib.filepath for lib in threads._loaded_later[1].lib_controllers]
            seen = [blas()]
            for large in (True, False, False):
                threads.blas_threads_for(large)
                seen.append(blas())
            os.write(write, json.dumps([numpys, own, held, seen]).encode())
            os._exit(0)
        os.waitpid(pid, 0)
        print(os.read(read, 100000).decode())
        """)  # fmt: skip
    numpys, own, held, (small, large, small_again, small_still) = json.loads(subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, check=True, env=forkserver.environment()).stdout)  # fmt: skip
    later = sorted(path for path, count in own if path not in numpys and count > 1)
    if not later:
        pytest.skip("SciPy's BLAS is NumPy's here, or on one thread")
    assert sorted(held) == later, (held, later)  # NumPy's not among them
    assert small == small_again == small_still == [[path, 1] for path, _ in own], (own, small, small_again, small_still)
    assert large == [[path, numpys.get(path, count)] for path, count in own], (numpys, own, large)


def _a_server_of_its_own(monkeypatch) -> None:
    """The test's own fork server, started on its first fork, importing no framework: not torch or
    JAX because earlier tests in this process loaded candidates of theirs (1.3 s and more of CPU
    for a server these tests end, with NumPy candidates)."""
    monkeypatch.setenv(forkserver.ENV, "1")
    monkeypatch.setattr(forkserver, "_server", None)
    monkeypatch.setattr(forkserver, "_broken", False)
    monkeypatch.setattr(remote, "_FRAMEWORKS", set())


def test_the_judge_survives_the_servers_death_and_starts_fresh_interpreters(probe, monkeypatch):
    _a_server_of_its_own(monkeypatch)
    assert probe("before")["kind"] == "ForkedProcess"
    process = remote.CandidateProcess("attncheck.testing.hostile:LoopsForever", None)
    process.ensure()
    pid = process.process.pid
    os.kill(forkserver._server.process.pid, signal.SIGKILL)
    forkserver._server.process.wait()
    deadline = time.monotonic() + 10
    while _alive(pid) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not _alive(pid)  # it died with its server (PR_SET_PDEATHSIG)
    process.stop()
    assert probe("after")["kind"] == "Popen"


def _alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().split(")")[-1].split()[0] != "Z"
    except FileNotFoundError:
        return False


def test_an_interrupted_exchange_ends_the_server_and_the_judge_starts_fresh_interpreters(probe, monkeypatch):
    """A Ctrl-C (or any exception) between a request and its reply must not leave the next request
    reading that reply: the judge closes the connection, the server and its forks end, and later
    candidate processes are fresh interpreters."""
    _a_server_of_its_own(monkeypatch)
    process = remote.CandidateProcess("attncheck.testing.hostile:LoopsForever", None)
    process.ensure()
    pid, server = process.process.pid, forkserver._server

    def interrupted(*args):
        raise KeyboardInterrupt

    with monkeypatch.context() as patch:
        patch.setattr(forkserver, "_receive", interrupted)
        with pytest.raises(KeyboardInterrupt):
            process.process.wait(timeout=1)
    assert server.broken
    process.stop()  # reads no stale reply, kills no group but the candidate's
    assert server.process.wait(timeout=10) is not None
    deadline = time.monotonic() + 10
    while _alive(pid) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not _alive(pid)
    assert probe("after")["kind"] == "Popen"


def test_polling_a_live_forked_process_asks_the_server_nothing_and_its_end_is_seen(monkeypatch):
    """The judge polls its candidate's process before every call: that must cost no round trip to
    the server while it lives (its pidfd says so), and must see its end at once."""
    _a_server_of_its_own(monkeypatch)
    process = remote.CandidateProcess("attncheck.reference:MultiheadAttention", None)
    process.ensure()
    forked = process.process
    assert isinstance(forked, forkserver.ForkedProcess)
    asked = forkserver._server.sequence
    for _ in range(50):
        assert forked.poll() is None
    assert forkserver._server.sequence == asked
    os.kill(forked.pid, signal.SIGKILL)
    deadline = time.monotonic() + 10
    while forked.poll() is None and time.monotonic() < deadline:
        time.sleep(0.01)
    assert forked.poll() == -signal.SIGKILL and forkserver._server.sequence > asked
    process.stop()


JAX_PROBE = textwrap.dedent('''
    import json, os, sys
    preloaded = "jax" in sys.modules  # imported by the server before this fork
    import jax.numpy as jnp
    total = float(jnp.ones(3).sum())  # JAX's backend starts here, in the candidate's process
    with open(os.environ["ATTNCHECK_TEST_SEEN"], "a") as f:
        f.write(json.dumps({"preloaded": preloaded, "total": total}) + "\\n")


    def scaled_dot_product_attention(query, key, value, attn_mask=None, dropout_p=0.0, is_causal=False, scale=None, enable_gqa=False):
        return query
''')


def test_the_server_imports_jax_once_a_jax_candidate_is_loaded_and_starts_no_thread(tmp_path, monkeypatch):
    pytest.importorskip("jax", reason="JAX is not installed: ATTNCHECK_EXTRAS=test,jax bin/setup")
    _a_server_of_its_own(monkeypatch)
    (tmp_path / "jax_probe.py").write_text(JAX_PROBE)
    seen = tmp_path / "seen.jsonl"
    monkeypatch.setenv("ATTNCHECK_TEST_SEEN", str(seen))
    monkeypatch.chdir(tmp_path)
    for _ in range(2):
        process = remote.CandidateProcess(str(tmp_path / "jax_probe.py") + ":scaled_dot_product_attention", None)
        try:
            process.ensure()
            assert isinstance(process.process, forkserver.ForkedProcess)
        finally:
            process.stop()
    first, second = (json.loads(line) for line in seen.read_text().splitlines())
    assert (first["preloaded"], second["preloaded"]) == (False, True) and first["total"] == second["total"] == 3.0
    assert forkserver._server.preloaded == {"jax"} and not forkserver._broken
    server = forkserver._server.process.pid
    assert len(os.listdir(f"/proc/{server}/task")) <= 2  # the main thread, and one NumPy may start at import


JUDGES_OWN = textwrap.dedent('''
    import json, os, sys, traceback
    server = os.getppid()
    seen = {"torch_before_the_candidate": "torch" in sys.modules, "server": server,
            "stack": [f"{frame.filename}:{frame.name}" for frame in traceback.extract_stack()],
            "servers_parent": int(open(f"/proc/{server}/stat").read().rpartition(")")[2].split()[1]),
            "servers_command": open(f"/proc/{server}/cmdline").read().split("\\0"),
            "servers_fds": {f: os.readlink(f"/proc/{server}/fd/{f}") for f in os.listdir(f"/proc/{server}/fd")},
            "servers_session": os.getsid(server)}
    with open(os.environ["ATTNCHECK_TEST_SEEN"], "a") as f:
        f.write(json.dumps(seen) + "\\n")
    from attncheck.reference import MultiheadAttention as Reference

    class MultiheadAttention(Reference):
        def forward(self, *args, **kwargs):
            crashed = os.environ["ATTNCHECK_TEST_SEEN"] + ".crashed"
            if not os.path.exists(crashed):
                open(crashed, "w").close()
                os._exit(3)  # once: grad's check runs in another process, forked from the same server
            if not os.path.exists(crashed + ".printed"):
                open(crashed + ".printed", "w").close()
                print("printed by the candidate, not flushed")
            return super().forward(*args, **kwargs)
''')


def test_the_command_lines_own_process_forks_its_server_from_itself_once_torch_is_imported(tmp_path):
    """`attncheck` in a process of its own (cli.entry) imports torch before any candidate's process
    starts, and its server is a fork of it taken then (forkserver.fork_from_here): no server or
    candidate process imports torch again. The server keeps nothing of the judge's that a fresh one
    would not have: no descriptor but its socket and /dev/null, a session of its own, standard
    streams made afresh (block-buffered here), and none of the judge's frames beneath a
    candidate's (Python's frame stack thrashed at that depth)."""
    (tmp_path / "judges_own.py").write_text(JUDGES_OWN)
    seen = tmp_path / "seen.jsonl"
    env = {key: value for key, value in os.environ.items() if key != "PYTHONUNBUFFERED"}  # print()s block-buffered
    judge = subprocess.Popen([sys.executable, "-m", "attncheck", "run", "--only", "forward,grad", "-c", "configs/causal.yaml",
                              "--impl", f"{tmp_path / 'judges_own.py'}:MultiheadAttention"], stdout=subprocess.PIPE,
                             stderr=subprocess.STDOUT, text=True, env={**env, "ATTNCHECK_TEST_SEEN": str(seen), forkserver.ENV: "1"},
                             cwd=os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # fmt: skip
    out = judge.communicate(timeout=300)[0]
    assert judge.returncode == 1 and "exited with code 3 during forward()" in out, out
    assert "the candidate printed: printed by the candidate, not flushed" in out, out  # flushed after the call
    first, second = (json.loads(line) for line in seen.read_text().splitlines())
    assert first["server"] == second["server"] and first["torch_before_the_candidate"] and second["torch_before_the_candidate"]
    assert first["servers_parent"] == judge.pid and first["servers_command"][1:3] == ["-m", "attncheck"], first
    assert first["servers_session"] == first["server"], first
    # The fork left the judge's stack (typer's, the suite's) before serving: cli.entry serves.
    assert not [f for f in first["stack"] if any(part in f for part in ("click", "typer", "attncheck/suite.py", "attncheck/remote.py"))], first
    assert any(f.endswith("attncheck/cli.py:entry") for f in first["stack"]), first
    fds = first["servers_fds"]  # stdin, stdout and stderr on /dev/null, and its socket to the judge
    assert len(fds) == 4 and [fds[str(i)] for i in (0, 1, 2)] == [os.devnull] * 3 and fds[max(fds, key=int)].startswith("socket:"), fds


def test_the_server_is_forked_from_a_process_only_if_nothing_but_numpy_started_a_thread_and_no_option_was_given():
    """fork_from_here records the threads once NumPy is imported; the fork is refused if another
    thread has started since, if NumPy was imported before (its threads could not be told apart),
    or if the interpreter was given options that a fresh server would not get (`python -O`)."""
    code = textwrap.dedent("""
        import threading, time
        from attncheck import forkserver
        forkserver.PRELOADS["torch"] = ("json",)  # what it imports first is not the point here (1.5 s of CPU for torch)
        forkserver.fork_from_here()
        seen = [forkserver._may_fork_here()]
        threading.Thread(target=time.sleep, args=(3,), daemon=True).start()
        print(seen + [forkserver._may_fork_here()])
        """)  # fmt: skip
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True, env=forkserver.environment()).stdout
    assert out.strip() == "[True, False]"
    options = "from attncheck import forkserver; forkserver.fork_from_here(); print(forkserver._interpreter_options(), forkserver._may_fork_here())"
    out = subprocess.run([sys.executable, "-O", "-W", "error", "-c", options], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "True False"
    forkserver.fork_from_here()  # in this worker, which has imported NumPy
    assert not forkserver._may_fork_here()


@pytest.mark.parametrize("unbuffered", ["", "1"])
def test_a_forked_servers_standard_streams_are_made_as_a_fresh_interpreter_makes_them(unbuffered):
    """serve_forked replaces the judge's sys.stdin, sys.stdout and sys.stderr (their buffers, the
    terminal's line buffering) with streams made as Python makes them at start-up."""
    code = textwrap.dedent("""
        import sys
        from attncheck import forkserver
        def described():
            return [(s.line_buffering, s.write_through, s.encoding, s.errors, s.mode, type(s.buffer).__name__,
                     getattr(s.buffer, "raw", s.buffer).name) for s in (sys.stdin, sys.stdout, sys.stderr)]
        made = described()
        before = sys.stdout
        forkserver._fresh_stdio()
        print(sys.stdout is not before and sys.__stdout__ is sys.stdout and described() == made)
        """)  # fmt: skip
    env = {**os.environ, "PYTHONUNBUFFERED": unbuffered}
    out = subprocess.run([sys.executable, "-c", code], stdin=subprocess.DEVNULL, capture_output=True, text=True, check=True, env=env).stdout
    assert out.strip() == "True"
