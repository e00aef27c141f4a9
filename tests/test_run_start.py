"""What a run does before its first step: a re-run without a checkpoint starts clean (never a second copy
of a step), the metrics log refuses a repeated step, and code grading fails closed without bwrap unless
`task.sandbox=rlimits` is set, which the run then states on its first line and in its step-0 record."""
import pathlib
import signal
import subprocess
import sys
import time

import pytest

from marljax.config import ConfigError, load_config
from marljax.core.metrics import MetricsLogger, read_metrics
from marljax.tasks import sandbox
from marljax.train import main as train_main
from test_train import TINY


def _steps(run_dir: pathlib.Path) -> list[int]:
    return [r["step"] for r in read_metrics(run_dir)]


def test_rerun_after_a_kill_before_the_first_checkpoint_starts_clean(tmp_path):
    run_dir = tmp_path / "run"
    cmd = [sys.executable, "-m", "marljax.train", *TINY, "workflow=single", "steps=2", f"run_dir={run_dir}",
           "seed=0", "eval.at_start=true", "eval.every=2", "checkpoint.every=100"]
    proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    deadline = time.time() + 600
    while proc.poll() is None and time.time() < deadline:
        if (run_dir / "metrics.jsonl").exists() and 1 in _steps(run_dir):
            break
        time.sleep(0.02)
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    if (run_dir / "checkpoints").exists() and any((run_dir / "checkpoints").iterdir()):
        pytest.fail("the run checkpointed before it could be killed; the test did not exercise a re-run")
    assert _steps(run_dir) == [0, 1]  # what the killed attempt left
    out = subprocess.run(cmd, capture_output=True, text=True)
    assert out.returncode == 0, out.stderr[-3000:]  # the report builds ("eval steps must increase" before)
    assert "has no checkpoint: starting afresh, removed what an earlier attempt left (metrics.jsonl, tb" \
        in out.stderr
    assert out.stdout.strip().splitlines()[-1] == f"report: {run_dir / 'report.md'}"
    assert _steps(run_dir) == [0, 1, 2]


def test_metrics_log_refuses_a_step_it_already_holds(tmp_path):
    log = MetricsLogger(tmp_path, tensorboard=False)
    log.log({"step": 0, "x": 1.0})
    log.log({"step": 1, "x": 2.0})
    with pytest.raises(ValueError, match=r"already holds step 1; refusing to log step 1"):
        log.log({"step": 1, "x": 3.0})
    again = MetricsLogger(tmp_path, tensorboard=False)  # a second logger on the same file knows it too
    with pytest.raises(ValueError, match=r"already holds step 1; refusing to log step 0"):
        again.log({"step": 0})
    again.truncate_after(0)  # resuming from a step-0 checkpoint
    again.log({"step": 1, "x": 4.0})
    assert [(r["step"], r.get("x")) for r in read_metrics(tmp_path)] == [(0, 1.0), (1, 4.0)]


FIXTURES = pathlib.Path(__file__).parent / "fixtures"
CODE_RUN = [*TINY, "task=mbpp", f"task.path={FIXTURES / 'mbpp.jsonl'}", "task.options={}", "workflow=single",
            "steps=1", "rl.problems_per_step=1", "sampling.max_new_tokens=4", "eval.at_start=false",
            "eval.every=0"]


def test_code_task_fails_closed_without_bwrap_unless_rlimits_is_asked_for(tmp_path, monkeypatch, capsys):
    monkeypatch.setattr(sandbox, "bwrap_problem", lambda: "bwrap is not installed")
    with pytest.raises(sandbox.SandboxUnavailable, match=r"apt-get install bubblewrap.*task\.sandbox=rlimits"):
        train_main([*CODE_RUN, f"run_dir={tmp_path / 'refused'}"])
    assert not (tmp_path / "refused" / "metrics.jsonl").exists()  # refused before any rollout
    with pytest.raises(ConfigError, match=r"task\.sandbox='docker'; choose 'bwrap'.* or 'rlimits'"):
        load_config(None, [*CODE_RUN, f"run_dir={tmp_path / 'typo'}", "task.sandbox=docker"])  # refused at load
    capsys.readouterr()
    run_dir = tmp_path / "unisolated"
    train_main([*CODE_RUN, f"run_dir={run_dir}", "task.sandbox=rlimits"])
    err = capsys.readouterr().err.splitlines()
    header = 1 + next(i for i, line in enumerate(err) if line.startswith("differs from the paper's settings"))
    header += sum(1 for line in err[header:] if line.startswith(("  ", "left to the paper's values")))
    assert "  task.sandbox=rlimits" in err[:header]  # the config header names the departure ...
    first_line = err[header]  # ... and the first line after it says what it means
    assert first_line.startswith("task.sandbox=rlimits: model-written code runs with rlimits and a process "
                                 "group only, NO filesystem or network isolation"), first_line
    assert read_metrics(run_dir)[0] == {"step": 0, "sandbox/mode": "rlimits"}
    assert _steps(run_dir) == [0, 1]


def test_a_missing_dataset_is_one_line_from_the_cli(tmp_path, capsys):
    """`python -m marljax.train task=gsm8k task.path=/nonexistent`: exit 2 with the data error, no traceback."""
    with pytest.raises(SystemExit) as e:
        train_main([*TINY, "task=gsm8k", "task.path=/nonexistent", "task.options={}", f"run_dir={tmp_path}"])
    assert e.value.code == 2
    last = capsys.readouterr().err.splitlines()[-1]
    assert last.startswith("data error: /nonexistent: no such file or directory. Download the dataset")
