"""The sandbox runs programs correctly, and contains hostile ones: each is scored 0 within its limit and
leaves the host as it was (no file outside the sandbox, no live process, trainer alive, no env leak)."""
import logging
import os
import pathlib
import secrets
import selectors
import socket
import time

import pytest

from marljax.tasks import sandbox
from marljax.tasks.code import PER_TEST_TIMEOUT_S, grade_code
from marljax.tasks.sandbox import run_many, run_python

REPO = pathlib.Path(__file__).resolve().parents[1]
MODES = ["bwrap", "rlimits"]
ROOT = os.geteuid() == 0


def mode_or_skip(mode: str) -> str:
    if mode == "bwrap" and sandbox.isolation_mode() != "bwrap":
        pytest.skip("bwrap is missing or unusable here (see the sandbox log line); "
                    "apt-get install bubblewrap to run the bwrap-mode tests")
    return mode


@pytest.fixture(params=MODES)
def mode(request, monkeypatch):
    """Runs the test in each isolation mode, graders included."""
    mode_or_skip(request.param)
    monkeypatch.setattr(sandbox, "isolation_mode", lambda: request.param)
    return request.param


def live_sandbox_processes() -> list[int]:
    """Live processes owned by any per-run sandbox uid (root trainers only)."""
    pids = []
    for name in os.listdir("/proc"):
        try:
            if name.isdigit() and os.stat(f"/proc/{name}").st_uid >= sandbox._UID_BASE:
                with open(f"/proc/{name}/stat") as f:
                    if f.read().rpartition(")")[2].split()[0] != "Z":
                        pids.append(int(name))
        except OSError:
            pass
    return pids


# --- ordinary programs ------------------------------------------------------------------------------

def test_stdin_stdout_stderr_and_exit_code(mode):
    r = run_python("import sys\nx = input()\nprint(x[::-1])\nprint('warn', file=sys.stderr)\nsys.exit(3)",
                   stdin="abc\n")
    assert (r.stdout, r.stderr, r.returncode, r.timed_out, r.isolation) == ("cba\n", "warn\n", 3, False, mode)


def test_program_sees_a_fresh_working_dir_and_a_clean_environment(mode):
    r = run_python("import os\nprint(sorted(os.listdir('.')))\nprint(sorted(os.environ))")
    listing, env = r.stdout.splitlines()
    assert eval(listing) in ([], ["main.py"])  # rlimits mode: the program file itself, nothing else
    assert set(eval(env)) <= set(sandbox._CLEAN_ENV) | {"PWD"}


def test_wall_clock_timeout_kills_the_program(mode):
    start = time.monotonic()
    r = run_python("import time\nprint('started', flush=True)\ntime.sleep(30)", timeout_s=1.0)
    assert r.timed_out and r.returncode != 0 and r.stdout == "started\n"
    assert time.monotonic() - start < 3.0


def test_output_is_capped_without_buffering_it(mode):
    r = run_python("import sys\nsys.stdout.write('x' * 10**8)", max_output_bytes=1000)
    assert r.output_truncated and len(r.stdout) == 1000 and r.returncode != 0


def test_output_written_just_before_exit_is_not_lost(monkeypatch):
    class LateSelector(selectors.DefaultSelector):
        def select(self, timeout=None):
            if timeout:  # a wake-up too late to see the data: the program writes and exits meanwhile
                time.sleep(timeout)
                return []
            return super().select(timeout)

    monkeypatch.setattr(sandbox.selectors, "DefaultSelector", LateSelector)
    assert [run_python("print('data')").stdout for _ in range(3)] == ["data\n"] * 3


def test_run_many_keeps_order_and_runs_in_parallel(mode):
    sources = [f"import time\ntime.sleep(0.5)\nprint({i} * int(input()))" for i in range(4)]
    start = time.monotonic()
    results = run_many(sources, stdins=["2\n"] * 4)
    assert [r.stdout for r in results] == [f"{2 * i}\n" for i in range(4)]
    if (os.cpu_count() or 1) >= 2:
        assert time.monotonic() - start < 4 * 0.5 + 0.5


def test_isolation_mode_falls_back_and_says_so(monkeypatch, caplog):
    monkeypatch.setattr(sandbox.shutil, "which", lambda name, path=None: None)
    with caplog.at_level(logging.WARNING, logger="marljax.tasks.sandbox"):
        assert sandbox.isolation_mode.__wrapped__() == "rlimits"
    assert "rlimits" in caplog.text and "apt-get install bubblewrap" in caplog.text
    assert sandbox.isolation_mode() in ("bwrap", "rlimits")  # the cached, real probe


def test_unknown_isolation_is_an_error():
    with pytest.raises(ValueError, match="isolation"):
        run_python("pass", isolation="docker")


# --- hostile programs -------------------------------------------------------------------------------
# Each is a response to a one-test problem; it must score 0 within the test's limit plus slack.

def _program(body: str) -> str:
    return f"```python\n{body}\n```"


IO_TEST = [{"input": "", "output": "ok"}]
ASSERT_TEST = [{"assert": "assert f(1) == 2"}]


def _grade_hostile(body: str, tests=IO_TEST) -> float:
    start = time.monotonic()
    reward = grade_code(_program(body), tests)
    assert time.monotonic() - start < PER_TEST_TIMEOUT_S * 2 + 3, "not contained within its limit"
    return reward


@pytest.fixture
def host_unchanged():
    """After the test: no live process of a sandbox uid is left (root trainers run programs under them)."""
    yield
    if ROOT:
        assert live_sandbox_processes() == []


HOSTILE = {
    "fork_bomb": "import os\nwhile True:\n    try:\n        os.fork()\n    except OSError:\n        pass",
    "fork_bomb_escaping_the_group": "import os\nwhile True:\n    try:\n        if os.fork() == 0:\n"
                                    "            os.setsid()\n    except OSError:\n        pass",
    "while_true": "while True:\n    pass",
    "allocate_16GB": "x = bytearray(16 * 2**30)\nprint('ok')",
    "write_1GB_file": "with open('big.bin', 'wb') as f:\n    for _ in range(1024):\n        f.write(b'0' * 2**20)\n"
                      "print('ok')",
    "print_100MB": "import sys\nsys.stdout.write('ok\\n' + 'x' * 10**8)",
    "orphan_child": "import os, time\nif os.fork() == 0:\n    time.sleep(60)\nprint('no')",
}


@pytest.mark.parametrize("name", sorted(HOSTILE))
def test_hostile_program_is_contained(name, mode, host_unchanged):
    if "fork" in name and not ROOT:
        pytest.skip("fork-bomb containment needs a root trainer (programs then run under their own uid)")
    assert _grade_hostile(HOSTILE[name]) == 0.0


def test_exit_before_the_tests_does_not_pass(mode, host_unchanged):
    for exit_call in ("import sys; sys.exit(0)", "import os; os._exit(0)", "raise SystemExit"):
        assert _grade_hostile(f"def f(x):\n    return 0\n{exit_call}", ASSERT_TEST) == 0.0
    assert _grade_hostile("def f(x):\n    return x + 1", ASSERT_TEST) == 1.0  # the same harness passes


def test_trainer_environment_does_not_leak(mode, monkeypatch, host_unchanged):
    secret = secrets.token_hex(8)
    monkeypatch.setenv("MARLJAX_TEST_SECRET", secret)
    body = ("import os\nenv = dict(os.environ)\n"
            "for p in ('/proc/self/environ', '/proc/1/environ'):\n"
            "    try:\n        env[p] = open(p, 'rb').read().decode(errors='replace')\n"
            "    except OSError:\n        pass\n"
            "print(env.get('MARLJAX_TEST_SECRET', 'ok'))\nprint(env)")
    assert _grade_hostile(body, [{"input": "", "output": secret}]) == 0.0
    assert secret not in run_python(body.replace("print(env.get('MARLJAX_TEST_SECRET', 'ok'))\n", "")).stdout


def test_killing_the_parent_does_not_reach_the_trainer(mode, host_unchanged):
    if mode == "rlimits" and not ROOT:
        pytest.skip("rlimits mode as a non-root user cannot protect the trainer from its own uid's signals")
    ppid_before = os.getppid()
    assert _grade_hostile("import os\nos.kill(os.getppid(), 9)\nimport time\ntime.sleep(0.5)\nprint('no')") == 0.0
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
        assert _grade_hostile(body) == 0.0
        with pytest.raises(BlockingIOError):
            listener.accept()  # nobody connected


def test_cannot_write_into_the_repo(mode, host_unchanged):
    if mode == "rlimits" and not ROOT:
        pytest.skip("rlimits mode as a non-root user writes wherever the trainer's user may")
    target = REPO / f"hostile-{secrets.token_hex(4)}.txt"
    assert _grade_hostile(f"open({str(target)!r}, 'w').write('x')\nprint('ok')") == 0.0
    assert not target.exists()


def test_cannot_write_to_the_hosts_tmp(mode, host_unchanged):
    if mode == "rlimits":
        pytest.skip("rlimits mode has no filesystem isolation: /tmp is shared with the host")
    target = pathlib.Path("/tmp") / f"hostile-{secrets.token_hex(4)}.txt"
    body = f"open({str(target)!r}, 'w').write('o')\nprint(open({str(target)!r}).read() + 'k')"
    assert run_python(body).stdout == "ok\n"  # it wrote, into its private /tmp ...
    assert not target.exists()  # ... which the host never sees
