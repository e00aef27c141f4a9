"""The sandbox runs programs correctly, refuses to run unisolated unless asked (fail closed), shows a
program only what its interpreter needs, and contains hostile ones: each is scored 0 within its limit and
leaves the host as it was (no file outside the sandbox, no live process, trainer alive, no env leak), for
a root trainer (this process) and a non-root one (a child under uid 65534)."""
import json
import logging
import os
import pathlib
import secrets
import selectors
import shutil
import socket
import subprocess
import tempfile
import threading
import time

import pytest

import sandbox_probe
from marljax.tasks import sandbox
from marljax.tasks.code import PER_TEST_TIMEOUT_S, grade_code
from marljax.tasks.data import load_task
from marljax.tasks.sandbox import RunResult, executor, run_python

REPO = pathlib.Path(__file__).resolve().parents[1]
MODES = ["bwrap", "rlimits"]
ROOT = os.geteuid() == 0
CI = os.environ.get("CI") == "true"
NOBODY = 65534


def mode_or_skip(mode: str) -> str:
    if mode == "bwrap" and sandbox.bwrap_problem():
        message = f"bwrap does not work here ({sandbox.bwrap_problem()}); apt-get install bubblewrap"
        if CI:
            pytest.fail(f"CI must run the bwrap-mode tests: {message}")
        pytest.skip(f"{message} to run the bwrap-mode tests")
    return mode


@pytest.fixture(params=MODES)
def mode(request):
    """Runs the test in each isolation mode (tests pass it on: nothing picks a mode by itself)."""
    return mode_or_skip(request.param)


def live_sandbox_processes() -> list[str]:
    """Live processes of this trainer's sandbox runs (see `sandbox_probe.survivors`)."""
    return sandbox_probe.survivors(sandbox)


# --- ordinary programs ------------------------------------------------------------------------------

def test_stdin_stdout_stderr_and_exit_code(mode):
    r = run_python("import sys\nx = input()\nprint(x[::-1])\nprint('warn', file=sys.stderr)\nsys.exit(3)",
                   stdin="abc\n", isolation=mode)
    assert (r.stdout, r.stderr, r.returncode, r.timed_out, r.isolation) == ("cba\n", "warn\n", 3, False, mode)


def test_program_sees_a_fresh_working_dir_and_a_clean_environment(mode):
    r = run_python("import os\nprint(sorted(os.listdir('.')))\nprint(sorted(os.environ))", isolation=mode)
    listing, env = r.stdout.splitlines()
    assert eval(listing) in ([], ["main.py"])  # rlimits mode: the program file itself, nothing else
    assert set(eval(env)) <= set(sandbox._CLEAN_ENV) | {"PWD"}


def test_wall_clock_timeout_kills_the_program(mode):
    start = time.monotonic()
    r = run_python("import time\nprint('started', flush=True)\ntime.sleep(30)", timeout_s=1.0, isolation=mode)
    assert r.timed_out and r.returncode != 0 and r.stdout == "started\n"
    assert time.monotonic() - start < 3.0


def test_output_is_capped_without_buffering_it(mode):
    # a wall-clock limit well past the cap's kill: under a loaded CI (2 pytest workers) the default 3 s once
    # ran out before the program had written (timed_out, nothing read); the cap, not the clock, is tested
    r = run_python("import sys\nsys.stdout.write('x' * 10**8)", max_output_bytes=1000, timeout_s=30, isolation=mode)
    assert not r.timed_out and r.output_truncated and len(r.stdout) == 1000 and r.returncode != 0


def test_output_written_just_before_exit_is_not_lost(mode, monkeypatch):
    class LateSelector(selectors.DefaultSelector):
        def select(self, timeout=None):
            if timeout:  # a wake-up too late to see the data: the program writes and exits meanwhile
                time.sleep(timeout)
                return []
            return super().select(timeout)

    monkeypatch.setattr(sandbox.selectors, "DefaultSelector", LateSelector)
    assert [run_python("print('data')", isolation=mode).stdout for _ in range(3)] == ["data\n"] * 3


def run_many(sources: list[str], stdins: list[str], **kwargs) -> list[RunResult]:
    """Programs run on the shared `executor()`, results in input order."""
    futures = [executor().submit(run_python, s, i, **kwargs) for s, i in zip(sources, stdins, strict=True)]
    return [f.result() for f in futures]


def test_run_many_keeps_order_and_runs_in_parallel(mode):
    sources = [f"import time\ntime.sleep(0.5)\nprint({i} * int(input()))" for i in range(4)]
    start = time.monotonic()
    results = run_many(sources, stdins=["2\n"] * 4, isolation=mode)
    assert [r.stdout for r in results] == [f"{2 * i}\n" for i in range(4)]
    if (os.cpu_count() or 1) >= 2:
        assert time.monotonic() - start < 4 * 0.5 + 0.5


def test_code_grading_fails_closed_without_bwrap(monkeypatch, caplog):
    """Without working bwrap, grading refuses (naming the fix) unless rlimits was asked for explicitly, and
    the mode reaches the grader from the Problem (task.sandbox), not from a process-wide setting."""
    sandbox.interpreter()  # found before `which` is patched
    monkeypatch.setattr(sandbox.shutil, "which", lambda name, path=None: None)
    assert sandbox.bwrap_problem.__wrapped__() == "bwrap is not installed"
    monkeypatch.setattr(sandbox, "bwrap_problem", lambda: "bwrap is not installed")
    response, tests = "```python\nprint(int(input()) + 1)\n```", [{"input": "1", "output": "2"}]
    fix = r"bwrap is not installed\. Install bubblewrap \(apt-get install bubblewrap\), or set task\.sandbox=rlimits"
    with pytest.raises(sandbox.SandboxUnavailable, match=fix):
        grade_code(response, tests)
    with pytest.raises(sandbox.SandboxUnavailable, match=fix):
        run_python("print(1)")
    [problem] = load_task("humaneval", split="all", limit=1)
    [unisolated] = load_task("humaneval", split="all", limit=1, sandbox="rlimits")
    solution = f"```python\n{problem.meta['prompt']}    return any(abs(a - b) < threshold for i, a in " \
               "enumerate(numbers) for b in numbers[i + 1:])\n```"
    with pytest.raises(sandbox.SandboxUnavailable, match=fix):
        problem.reward(solution)
    sandbox._warn_unisolated.cache_clear()
    with caplog.at_level(logging.WARNING, logger="marljax.tasks.sandbox"):
        assert unisolated.reward(solution) == 1.0
        assert grade_code(response, tests, sandbox="rlimits") == 1.0
    assert "NO filesystem or network isolation" in caplog.text
    with pytest.raises(ValueError, match="task.sandbox"):
        load_task("humaneval", split="all", limit=1, sandbox="none")


def test_ci_has_working_bwrap():
    if not CI:
        pytest.skip("only under CI=true (.ci/run), where a missing or broken bwrap must fail the suite")
    assert sandbox.bwrap_problem() is None
    assert sandbox.isolation_mode() == "bwrap"


def test_unknown_isolation_is_an_error():
    with pytest.raises(ValueError, match="isolation"):
        run_python("pass", isolation="docker")


# --- hostile programs -------------------------------------------------------------------------------
# Each is a response to a one-test problem; it must score 0 within the test's limit plus slack.

def _program(body: str) -> str:
    return f"```python\n{body}\n```"


IO_TEST = [{"input": "", "output": "ok"}]
ASSERT_TEST = [{"assert": "assert f(1) == 2"}]


def _grade_hostile(body: str, mode: str, tests=IO_TEST) -> float:
    start = time.monotonic()
    reward = grade_code(_program(body), tests, sandbox=mode)
    assert time.monotonic() - start < PER_TEST_TIMEOUT_S * 2 + 3, "not contained within its limit"
    return reward


@pytest.fixture
def host_unchanged():
    """After the test: no live process of this trainer's sandbox runs is left."""
    yield
    assert live_sandbox_processes() == []


HOSTILE = {
    "allocate_16GB": "x = bytearray(16 * 2**30)\nprint('ok')",
    "write_1GB_file": "with open('big.bin', 'wb') as f:\n    for _ in range(1024):\n        f.write(b'0' * 2**20)\n"
                      "print('ok')",
}


@pytest.mark.parametrize("name", sorted(HOSTILE))
def test_hostile_program_is_contained(name, mode, host_unchanged):
    assert _grade_hostile(HOSTILE[name], mode) == 0.0


# --- containment, checked directly (tests/sandbox_probe.py) ------------------------------------------
# A hostile run must return within its timeout + WALL_SLACK_S, with at most the output cap, and leave no
# process of it alive: for a root trainer none of its per-run uids, for a non-root one no process of its
# own running the sandbox prelude.

def assert_contained(key: str, got: dict) -> None:
    mode, name = key.split("/")
    assert got["survivors"] == [], f"{key}: processes of the run survived"
    assert got["wall_s"] <= got["timeout_s"] + sandbox_probe.WALL_SLACK_S, f"{key}: took {got['wall_s']:.2f} s"
    assert got["stdout_bytes"] <= sandbox_probe.OUTPUT_CAP and got["stderr_bytes"] <= sandbox_probe.OUTPUT_CAP
    if name == "orphan_child":  # returned when the parent exited, though its child sleeps 60 s
        assert got["stdout_head"].startswith("child\n") and not got["timed_out"], (key, got)
    elif name == "print_100MB":
        assert got["truncated"] and got["stdout_bytes"] == sandbox_probe.OUTPUT_CAP, (key, got)
    else:  # a loop or a fork bomb: killed at the timeout, after it started
        assert got["stdout_head"].startswith("started\n") and got["timed_out"], (key, got)


@pytest.mark.parametrize("name", sorted(sandbox_probe.HOSTILE))
def test_hostile_program_leaves_nothing_running(name, mode):
    if name in sandbox_probe.UNCONTAINABLE.get((mode, ROOT), ()):
        pytest.skip("rlimits mode as a non-root trainer cannot stop a program that leaves its process group")
    assert_contained(f"{mode}/{name}", sandbox_probe.contain(sandbox, name, mode))



def test_the_program_runs_at_the_callers_nice_and_the_caller_gets_it_back(mode):
    """A root trainer's thread takes nice -20 while it waits on and kills a run (so a fork bomb cannot
    starve the kill), but the program itself must start at the caller's nice, and the caller end at it."""
    tid = threading.get_native_id()
    before = os.getpriority(os.PRIO_PROCESS, tid)
    r = run_python("import os\nprint(os.getpriority(os.PRIO_PROCESS, 0))", isolation=mode)
    assert (r.returncode, r.stdout) == (0, f"{before}\n"), r
    assert os.getpriority(os.PRIO_PROCESS, tid) == before

# --- what a sandboxed program sees -------------------------------------------------------------------

SYSTEM = {"usr", "bin", "sbin", "lib", "lib32", "lib64", "libx32", "etc", "tmp", "proc", "dev"}


@pytest.fixture(scope="module")
def canaries(tmp_path_factory):
    """World-readable files where a sandboxed program must see nothing: the trainer's home, the checkout,
    beside it, the working dir, a run dir, /var/tmp, /srv, /opt, /mnt, /etc, /home (those a non-root
    trainer may write to). Removed afterwards."""
    token = secrets.token_hex(4)
    dirs = [pathlib.Path.home(), REPO, REPO.parent, pathlib.Path.cwd(), tmp_path_factory.mktemp("run_dir"),
            *map(pathlib.Path, ("/var/tmp", "/srv", "/opt", "/mnt", "/etc", "/home"))]
    made, files = [], []
    for d in dict.fromkeys(dirs):
        f = d / f"marljax-canary-{token}"
        try:
            if not d.exists():
                d.mkdir(mode=0o755)
                made.append(d)
            f.write_text("secret\n")
        except PermissionError:
            assert not ROOT, f"cannot write {f} as root"
            continue
        f.chmod(0o644)
        files.append(f)
    yield [str(f) for f in files]
    for f in files:
        f.unlink()
    for d in made:
        d.rmdir()


def assert_sees_only_the_interpreter(look: dict, canaries: list[str]) -> None:
    assert {path: what for path, what in look["seen"].items() if what} == {}
    tops = {p.strip("/").split("/")[0] for p in sandbox.interpreter().prefixes}
    assert set(look["root"]) <= SYSTEM | tops, look["root"]
    assert set(look["etc"]) <= {"ld.so.cache", "localtime"}, look["etc"]


def test_sandboxed_program_sees_only_what_the_interpreter_needs(canaries):
    mode_or_skip("bwrap")
    assert sandbox_probe.readable(canaries) == canaries  # the trainer reads them all ...
    assert_sees_only_the_interpreter(sandbox_probe.look(sandbox, canaries), canaries)  # ... the program none


def test_binds_show_an_interpreter_install_dir_not_the_dirs_around_it():
    python = sandbox.Interpreter("/root/.pyenv/versions/3.11.7/bin/python3.11",
                                 ("/work/main/.venv", "/root/.pyenv/versions/3.11.7"))
    args = sandbox._read_only_binds(python)
    binds = {args[i + 1] for i, a in enumerate(args) if a in ("--ro-bind", "--ro-bind-try", "--bind")}
    system = {d for d in sandbox._SYSTEM_DIRS if os.path.isdir(d) and not os.path.islink(d)}
    assert binds == system | set(python.prefixes) | set(sandbox._ETC_FILES)  # not "/", "/root", "/work"


def test_a_venv_interpreter_shows_its_venv_and_nothing_beside_it(monkeypatch):
    mode_or_skip("bwrap")
    base = sandbox.interpreter().path
    home = pathlib.Path(tempfile.mkdtemp(dir="/var/tmp"))  # traversable by the run's unprivileged uid
    try:
        home.chmod(0o755)
        subprocess.run([base, "-m", "venv", "--without-pip", str(home / "venv")], check=True)
        site = next((home / "venv" / "lib").glob("python*/site-packages"))
        (site / "marljax_venv_module.py").write_text("")
        (home / "beside").write_text("secret\n")
        monkeypatch.setenv("MARLJAX_SANDBOX_PYTHON", str(home / "venv" / "bin" / "python"))
        sandbox.interpreter.cache_clear()
        r = run_python(f"import marljax_venv_module, os, sys\nprint(sys.prefix)\nprint(os.listdir({str(home)!r}))")
        assert r.stdout.splitlines() == [str(home / "venv"), "['venv']"], r.stderr
    finally:
        sandbox.interpreter.cache_clear()
        shutil.rmtree(home)


def test_non_root_trainer(canaries):
    """As uid 65534: every hostile program contained in both modes, and the canaries invisible under bwrap,
    though this trainer can read some of them itself."""
    if not ROOT:
        pytest.skip("starting a trainer under another uid needs root; as non-root the tests above are that case")
    mode_or_skip("bwrap")
    with tempfile.TemporaryDirectory() as code:  # world-readable copies: the checkout may not be
        os.chmod(code, 0o755)
        for module in (sandbox.__file__, sandbox_probe.__file__):
            shutil.copy(module, code)
        out = subprocess.run([sandbox.interpreter().path, os.path.join(code, "sandbox_probe.py"), *canaries],
                             cwd=code, env={"PATH": sandbox._CLEAN_ENV["PATH"], "HOME": "/nonexistent"},
                             user=NOBODY, group=NOBODY, extra_groups=[], capture_output=True, text=True,
                             timeout=300)
    assert out.returncode == 0, out.stderr
    got = json.loads(out.stdout)
    assert got["uid"] == NOBODY
    expected = {f"{m}/{n}" for m in MODES for n in sandbox_probe.HOSTILE
                if n not in sandbox_probe.UNCONTAINABLE.get((m, False), ())}
    assert set(got["containment"]) == expected
    for key, result in got["containment"].items():
        assert_contained(key, result)
    assert [c for c in canaries if c.startswith("/var/tmp/")] == \
        [c for c in got["readable_outside"] if c.startswith("/var/tmp/")]  # the trainer can read it ...
    assert_sees_only_the_interpreter(got["look"], canaries)  # ... the program cannot


def test_exit_before_the_tests_does_not_pass(mode, host_unchanged):
    for exit_call in ("import sys; sys.exit(0)", "import os; os._exit(0)", "raise SystemExit"):
        assert _grade_hostile(f"def f(x):\n    return 0\n{exit_call}", mode, ASSERT_TEST) == 0.0
    assert _grade_hostile("def f(x):\n    return x + 1", mode, ASSERT_TEST) == 1.0  # the same harness passes


def test_trainer_environment_does_not_leak(mode, monkeypatch, host_unchanged):
    secret = secrets.token_hex(8)
    monkeypatch.setenv("MARLJAX_TEST_SECRET", secret)
    body = ("import os\nenv = dict(os.environ)\n"
            "for p in ('/proc/self/environ', '/proc/1/environ'):\n"
            "    try:\n        env[p] = open(p, 'rb').read().decode(errors='replace')\n"
            "    except OSError:\n        pass\n"
            "print(env.get('MARLJAX_TEST_SECRET', 'ok'))\nprint(env)")
    assert _grade_hostile(body, mode, [{"input": "", "output": secret}]) == 0.0
    body = body.replace("print(env.get('MARLJAX_TEST_SECRET', 'ok'))\n", "")
    assert secret not in run_python(body, isolation=mode).stdout


def test_killing_the_parent_does_not_reach_the_trainer(mode, host_unchanged):
    if mode == "rlimits" and not ROOT:
        pytest.skip("rlimits mode as a non-root user cannot protect the trainer from its own uid's signals")
    ppid_before = os.getppid()
    assert _grade_hostile("import os\nos.kill(os.getppid(), 9)\nimport time\ntime.sleep(0.5)\nprint('no')", mode) == 0.0
    assert os.getppid() == ppid_before  # we (the trainer) are alive and still have our parent


def test_no_network_even_to_loopback(mode, host_unchanged):
    if mode == "rlimits":
        pytest.skip("rlimits mode has no network namespace; only bwrap isolates the network")
    with socket.socket() as listener:
        listener.bind(("127.0.0.1", 0))
        listener.listen(1)
        listener.settimeout(0.0)
        port = listener.getsockname()[1]
        body = f"import socket\nsocket.create_connection(('127.0.0.1', {port}), timeout=2)\nprint('ok')"
        assert _grade_hostile(body, mode) == 0.0
        with pytest.raises(BlockingIOError):
            listener.accept()  # nobody connected


def test_cannot_write_into_the_repo(mode, host_unchanged):
    if mode == "rlimits" and not ROOT:
        pytest.skip("rlimits mode as a non-root user writes wherever the trainer's user may")
    target = REPO / f"hostile-{secrets.token_hex(4)}.txt"
    assert _grade_hostile(f"open({str(target)!r}, 'w').write('x')\nprint('ok')", mode) == 0.0
    assert not target.exists()


def test_cannot_write_to_the_hosts_tmp(mode, host_unchanged):
    if mode == "rlimits":
        pytest.skip("rlimits mode has no filesystem isolation: /tmp is shared with the host")
    target = pathlib.Path("/tmp") / f"hostile-{secrets.token_hex(4)}.txt"
    body = f"open({str(target)!r}, 'w').write('o')\nprint(open({str(target)!r}).read() + 'k')"
    assert run_python(body, isolation=mode).stdout == "ok\n"  # it wrote, into its private /tmp ...
    assert not target.exists()  # ... which the host never sees
