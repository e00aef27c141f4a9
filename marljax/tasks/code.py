"""Code reward: extract the program of a response and run its tests in the sandbox; 1 iff all pass.

Two kinds of test (a list may mix them; assert tests run first):
- `{"input": stdin, "output": expected}` (LiveCodeBench / DeepCoder): one sandboxed run per test; it
  passes on exit code 0 and equal output after whitespace normalisation (surrounding blank lines dropped,
  each line's runs of spaces/tabs collapsed and ends stripped).
- `{"assert": code}` (HumanEval / MBPP), optionally with `"setup": code` (e.g. the HumanEval prompt, for
  its imports and helpers) that runs before the program. All assert tests of a list run in one harness
  process: setup, then the program (with `__name__ != "__main__"`, as the HumanEval harness does), then
  each snippet under its own timer. The harness prints a random token, passed on stdin and read before
  the program runs, only after the last test: a program that exits early (`sys.exit(0)`, `os._exit`)
  cannot pass.
Defaults follow the paper: 3 s per test, 120 s per response, 4 GB; evaluation stops at the first failure.
`sandbox` is the isolation the programs run under (`task.sandbox`): "bwrap", which raises where bwrap
does not work, or "rlimits", explicitly unisolated (see marljax.tasks.sandbox).
"""
from __future__ import annotations

import dataclasses
import re
import secrets
import time
from typing import Any, Sequence

from marljax.tasks.sandbox import MAX_OUTPUT_BYTES, RunResult, run_python

PER_TEST_TIMEOUT_S = 3.0
TOTAL_TIMEOUT_S = 120.0
MEMORY_MB = 4096
_FENCE = re.compile(r"^[ \t]*```[ \t]*([\w+-]*)[^\n]*\n(.*?)^[ \t]*```", re.DOTALL | re.MULTILINE)
_PYTHON_TAGS = {"python", "py", "python3"}
_HARNESS = """\
def _run_tests():
    import signal, sys
    token = sys.stdin.readline().strip()

    def on_alarm(signum, frame):
        raise TimeoutError("test exceeded its time limit")

    signal.signal(signal.SIGALRM, on_alarm)
    namespace = {{"__name__": "solution"}}
    for name, code in [*({setups!r}), ("solution", {program!r})]:
        exec(compile(code, "<" + name + ">", "exec"), namespace)
    for i, test in enumerate({tests!r}):
        signal.setitimer(signal.ITIMER_REAL, {per_test_s!r})
        exec(compile(test, "<test " + str(i) + ">", "exec"), namespace)
        signal.setitimer(signal.ITIMER_REAL, 0)
    print("\\n" + token)


_run_tests()
"""


@dataclasses.dataclass(frozen=True)
class Verdict:
    """Outcome of a response's tests: `passed` iff all passed; else the first failing test and why."""

    passed: bool
    reason: str = ""
    failed_test: int | None = None
    run: RunResult | None = None  # the last sandbox run, for logs


def extract_code(text: str) -> str | None:
    """The program of a response: the last closed ```python (or ```py / ```python3) block, else the
    last closed untagged ``` block, else None. Blocks tagged with another language are never run, and
    an unclosed fence (a truncated response) does not count."""
    blocks = [(m.group(1).lower(), m.group(2)) for m in _FENCE.finditer(text)]
    for wanted in (_PYTHON_TAGS, {""}):
        tagged = [code for tag, code in blocks if tag in wanted]
        if tagged:
            return tagged[-1]
    return None


def _normalize(output: str) -> list[str]:
    return [" ".join(line.split()) for line in output.strip().splitlines()]


def _kinds(tests: Sequence[dict[str, Any]]) -> list[str]:
    """Each test's kind ("io" or "assert"); malformed tests raise (a data bug, not a wrong answer)."""
    if not tests:
        raise ValueError("no tests: a code Problem needs at least one test.")
    kinds = []
    for i, test in enumerate(tests):
        if set(test) not in ({"input", "output"}, {"assert"}, {"assert", "setup"}):
            raise ValueError(f"test {i} has keys {sorted(test)}; expected {{'input', 'output'}} or "
                             "{'assert'} (optionally with 'setup').")
        kinds.append("assert" if "assert" in test else "io")
    return kinds


def _failure(i: int, run: RunResult, what: str) -> Verdict:
    if run.timed_out:
        reason = "timeout"
    elif run.output_truncated:
        reason = "output over the size cap"
    elif run.returncode != 0:
        reason = f"runtime error (exit {run.returncode}): {run.stderr[-300:].strip()}"
    else:
        reason = what
    return Verdict(False, reason, i, run)


def _run_asserts(program: str, tests: list[tuple[int, dict]], per_test_s: float, budget_s: float,
                 memory_mb: int, sandbox: str) -> Verdict:
    token = secrets.token_hex(16)
    setups = list(dict.fromkeys(("setup", t["setup"]) for _, t in tests if "setup" in t))
    source = _HARNESS.format(setups=setups, program=program, tests=[t["assert"] for _, t in tests],
                             per_test_s=per_test_s)
    run = run_python(source, stdin=token + "\n", memory_mb=memory_mb,
                     timeout_s=min(budget_s, per_test_s * (len(tests) + 1)), isolation=sandbox)
    lines = run.stdout.rstrip("\n").rsplit("\n", 1)
    if run.returncode == 0 and not run.timed_out and lines[-1] == token:
        return Verdict(True, run=run)
    failing = re.findall(r'File "<test (\d+)>"', run.stderr)  # the traceback names the snippet
    first = tests[int(failing[-1])][0] if failing else tests[0][0]
    return _failure(first, run, "exited before the tests finished (no completion token)")


def evaluate_code(program: str, tests: Sequence[dict[str, Any]], per_test_s: float = PER_TEST_TIMEOUT_S,
                  total_s: float = TOTAL_TIMEOUT_S, memory_mb: int = MEMORY_MB, sandbox: str = "bwrap") -> Verdict:
    """Run `program` against `tests` in the sandbox, stopping at the first failure."""
    kinds = _kinds(tests)
    deadline = time.monotonic() + total_s
    asserts = [(i, t) for i, (k, t) in enumerate(zip(kinds, tests)) if k == "assert"]
    if asserts:
        verdict = _run_asserts(program, asserts, per_test_s, total_s, memory_mb, sandbox)
        if not verdict.passed:
            return verdict
    run = None
    for i, (kind, test) in enumerate(zip(kinds, tests)):
        if kind != "io":
            continue
        remaining = deadline - time.monotonic()
        if remaining <= 0:
            return Verdict(False, f"total time limit of {total_s} s reached", i, run)
        expected = str(test["output"])
        run = run_python(program, stdin=str(test["input"]), timeout_s=min(per_test_s, remaining),
                         memory_mb=memory_mb, max_output_bytes=max(MAX_OUTPUT_BYTES, 2 * len(expected)),
                         isolation=sandbox)
        if run.timed_out or run.returncode != 0 or _normalize(run.stdout) != _normalize(expected):
            return _failure(i, run, "wrong answer")
    return Verdict(True, run=run)


def grade_code(response_text: str, tests: Sequence[dict[str, Any]], **limits) -> float:
    """Binary code reward: 1.0 iff the response's program (`extract_code`) passes all `tests`.
    `limits` (per_test_s, total_s, memory_mb, sandbox) go to `evaluate_code`."""
    program = extract_code(response_text)
    if program is None:
        _kinds(tests)  # a malformed test list raises even when there is nothing to run
        return 0.0
    return 1.0 if evaluate_code(program, tests, **limits).passed else 0.0
