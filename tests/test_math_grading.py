"""Math reward: answer extraction, equivalence on tricky pairs, GSM8K golds, speed, no hangs, threads."""
import concurrent.futures
import json
import pathlib
import subprocess
import sys
import time

import pytest

from marljax.tasks.math import extract_answer, grade

GSM8K = pathlib.Path(__file__).resolve().parents[2] / "shared" / "data" / "gsm8k"


@pytest.mark.parametrize("text, expected", [
    (r"so \boxed{72}.", "72"),
    (r"\boxed{1} then \boxed{2}", "2"),  # the last box
    (r"\boxed{\frac{1}{\sqrt{2}}}", r"\frac{1}{\sqrt{2}}"),  # nested braces
    (r"\boxed{ {a}+{b} }", "{a}+{b}"),
    (r"\fbox{5}", "5"),
    (r"\boxed 7 apples", "7"),  # LaTeX's brace-less form
    (r"\boxed{3} and finally \boxed{4", "3"),  # an unclosed (truncated) box is skipped
    ("step 1\n#### 1,234\n", "1,234"),  # GSM8K
    (r"\boxed{}", ""),
    ("The answer is 42.", None),  # no fallback to the last number
    ("", None),
])
def test_extract_answer(text, expected):
    assert extract_answer(text) == expected


# (response, gold, reward): equivalent and non-equivalent forms.
TRICKY = [
    (r"\boxed{72}", "72", 1),
    (r"\boxed{1000}", "1,000", 1),
    (r"\boxed{1,000}", "1000", 1),
    (r"\boxed{2125}", "2,125", 1),
    (r"\boxed{0.5}", r"\frac{1}{2}", 1),
    (r"\boxed{\frac12}", "0.5", 1),
    (r"\boxed{\dfrac{3}{4}}", "3/4", 1),
    (r"\boxed{50\%}", "50", 1),
    (r"\boxed{50}", r"50\%", 1),
    (r"\boxed{\$18}", "18", 1),
    (r"\boxed{18 \text{ dollars}}", "18", 1),
    (r"\boxed{5 \text{ cm}}", "5", 1),
    (r"\boxed{3^\circ}", "3", 1),
    (r"\boxed{18.00}", "18", 1),
    (r"\boxed{[0,1)}", "[0,1)", 1),
    (r"\boxed{(0,1]}", "[0,1)", 0),
    (r"\boxed{(1,2)}", "(1,2)", 1),
    (r"\boxed{(2,1)}", "(1,2)", 0),
    (r"\boxed{3, 5}", "5, 3", 1),
    (r"\boxed{\{1,2,3\}}", r"\{3,2,1\}", 1),
    (r"\boxed{\sqrt{2}/2}", r"\frac{\sqrt{2}}{2}", 1),
    (r"\boxed{\frac{1}{\sqrt{2}}}", r"\frac{\sqrt{2}}{2}", 1),
    (r"\boxed{x^2+2x+1}", "(x+1)^2", 1),
    (r"\boxed{x=3}", "3", 1),
    (r"\boxed{3}", "x=3", 1),
    (r"\boxed{10^{3}}", "1000", 1),
    (r"\boxed{\frac{\frac{1}{2}}{2}}", "1/4", 1),
    (r"\boxed{2\pi}", r"2\pi", 1),
    (r"\boxed{6.28}", r"2\pi", 0),
    (r"\boxed{\infty}", r"\infty", 1),
    (r"\boxed{\text{(B)}}", "B", 1),
    (r"\boxed{1/3}", "0.333", 0),
    (r"\boxed{0.3333333333}", "1/3", 1),  # math-verify compares floats rounded to 6 decimals
    (r"\boxed{73}", "72", 0),
    (r"\boxed{-72}", "72", 0),
    (r"\boxed{}", "72", 0),
    ("The answer is 72.", "72", 0),
    (r"\boxed{72", "72", 0),
    (r"first \boxed{5} then \boxed{72}", "72", 1),
    (r"first \boxed{72} then \boxed{5}", "72", 0),
    (r"\fbox{72}", "72", 1),
    (r"\boxed 7", "7", 1),
    ("work...\n#### 72", "72", 1),
]


def test_tricky_pairs():
    assert len(TRICKY) >= 30
    wrong = [(r, g, want) for r, g, want in TRICKY if grade(r, g) != want]
    assert wrong == []


def test_huge_expression_cannot_hang_the_grader():
    start = time.monotonic()
    assert grade(r"\boxed{9^{9^{9^{9}}}}", "5") == 0.0
    assert time.monotonic() - start < 3 * 5 + 5


def test_empty_gold_is_a_data_error():
    with pytest.raises(ValueError, match="gold answer is empty"):
        grade(r"\boxed{1}", "")


def test_grading_from_threads_matches_the_main_thread():
    pairs = [(r, g) for r, g, _ in TRICKY]
    with concurrent.futures.ThreadPoolExecutor(4) as pool:
        threaded = list(pool.map(lambda p: grade(*p), pairs))
        start = time.monotonic()
        hang = pool.submit(grade, r"\boxed{(10^{1000000})!}", "5")
        assert hang.result(timeout=60) == 0.0 and time.monotonic() - start < 3 * 5 + 5
    assert threaded == [float(want) for _, _, want in TRICKY]


def test_the_grading_pool_is_terminated_at_exit():
    """Exit handlers terminate the pool, so it is not left running for Pool.__del__ during interpreter
    shutdown (which prints 'Exception ignored ... Pool.__del__' once module globals are gone)."""
    code = ("import atexit, threading\nfrom marljax.tasks import math\n"
            "t = threading.Thread(target=math.grade, args=(r'\\boxed{\\frac{1}{2}}', '0.5'))\nt.start()\nt.join()\n"
            "atexit._run_exitfuncs()\nprint(math._pool._state)\n")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0 and out.stdout.split() == ["TERMINATE"], (out.stdout, out.stderr[-2000:])


def _gsm8k_golds() -> list[str]:
    path = GSM8K / "test.jsonl"
    if not path.exists():
        pytest.skip(f"GSM8K test set not found at {path}; put test.jsonl there to run this test")
    return [json.loads(line)["answer"].split("####")[-1].strip() for line in path.open()]


def test_every_gsm8k_test_gold_as_boxed_scores_1():
    golds = _gsm8k_golds()
    assert len(golds) == 1319
    assert [g for g in golds if grade(f"The answer is \\boxed{{{g}}}.", g) != 1.0] == []
    with_commas = [g for g in golds if "," in g]
    assert with_commas and all(grade(f"\\boxed{{{g.replace(',', '')}}}", g) == 1.0 for g in with_commas)


def test_grading_1000_answers_reports_its_time():
    golds = _gsm8k_golds()[:1000]
    # Equivalent but not identical forms (2g/2), so every grade goes through math-verify.
    responses = [f"So \\boxed{{\\frac{{{2 * int(g.replace(',', ''))}}}{{2}}}}" for g in golds]
    start = time.monotonic()
    rewards = [grade(r, g) for r, g in zip(responses, golds)]
    elapsed = time.monotonic() - start
    print(f"graded 1000 math answers through math-verify in {elapsed:.2f} s ({1000 / elapsed:.0f}/s)")
    assert rewards == [1.0] * 1000 and elapsed < 120
