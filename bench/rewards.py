"""Reward throughput: programs/s through the sandbox (bwrap and rlimits modes, one at a time and on the
parallel pool) and math grades/s (identical answers, math-verify in the main thread, and from threads,
which use the grading process pool). Writes the "## Rewards" section of docs/benchmarks.md.

    python bench/rewards.py [--programs 200] [--grades 1000] [--no-write]
"""
from __future__ import annotations

import argparse
import concurrent.futures
import datetime
import os
import time

from marljax.tasks import sandbox
from marljax.tasks.code import grade_code
from marljax.tasks.math import grade
from benchdoc import machine, publish  # bench/ is on sys.path when a script here runs

PROGRAM = "a, b = map(int, input().split())\nprint(a + b)"


def programs_per_s(mode: str, n: int, parallel: bool) -> float:
    run = lambda _: sandbox.run_python(PROGRAM, stdin="2 3\n", isolation=mode)  # noqa: E731
    start = time.perf_counter()
    results = list(sandbox.executor().map(run, range(n)) if parallel else map(run, range(n)))
    elapsed = time.perf_counter() - start
    assert all(r.stdout == "5\n" for r in results), results[0]
    return n / elapsed


def graded_code_per_s(n: int, mode: str) -> float:
    response = f"```python\n{PROGRAM}\n```"
    tests = [{"input": "2 3\n", "output": "5"}, {"input": "-1 1\n", "output": "0"}]
    start = time.perf_counter()
    grades = sandbox.executor().map(lambda _: grade_code(response, tests, sandbox=mode), range(n))
    assert list(grades) == [1.0] * n
    return n / (time.perf_counter() - start)


def grades_per_s(n: int, form: str, threads: int = 0) -> float:
    pairs = [(form.format(g=g, g2=2 * g), str(g)) for g in range(n)]
    start = time.perf_counter()
    if threads:
        with concurrent.futures.ThreadPoolExecutor(threads) as pool:
            rewards = list(pool.map(lambda p: grade(*p), pairs))
    else:
        rewards = [grade(*p) for p in pairs]
    assert rewards == [1.0] * n
    return n / (time.perf_counter() - start)


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--programs", type=int, default=200)
    parser.add_argument("--grades", type=int, default=1000)
    parser.add_argument("--no-write", action="store_true")
    args = parser.parse_args()
    n, g = args.programs, args.grades
    modes = ["bwrap", "rlimits"] if sandbox.isolation_mode() == "bwrap" else ["rlimits"]
    rows = []
    for mode in modes:
        for parallel, how in ((False, "one at a time"), (True, f"pool of {os.cpu_count()}")):
            rows.append((f"sandbox `{mode}`, {how}", f"{programs_per_s(mode, n, parallel):.1f} programs/s"))
    rows.append((f"`grade_code`, 2 stdin tests, pool ({sandbox.isolation_mode()})",
                 f"{graded_code_per_s(n // 2, sandbox.isolation_mode()):.1f} responses/s"))
    identical, fraction = "x \\boxed{{{g}}}", "x \\boxed{{\\frac{{{g2}}}{{2}}}}"
    rows.append(("`grade`, identical answer (`\\boxed{72}` vs 72)", f"{grades_per_s(g, identical):.0f} grades/s"))
    rows.append(("`grade` via math-verify (`\\boxed{\\frac{144}{2}}` vs 72), main thread",
                 f"{grades_per_s(g, fraction):.0f} grades/s"))
    grades_per_s(8, fraction, threads=2)  # start the grading processes before timing
    threads = os.cpu_count() or 1
    rows.append((f"`grade` via math-verify, from {threads} threads (process pool)",
                 f"{grades_per_s(g, fraction, threads=threads):.0f} grades/s"))
    table = "\n".join(f"| {what} | {value} |" for what, value in rows)
    section = (f"## Rewards\n\n`python bench/rewards.py` on {datetime.date.today()}, {machine()}, "
               f"running as {'root (programs under per-run uids)' if os.geteuid() == 0 else 'a normal user'}, "
               f"load average {os.getloadavg()[0]:.1f} at the end (other jobs share the machine)."
               f" A program is a 2-line stdin/stdout Python program; each run starts a fresh interpreter.\n\n"
               f"| what | throughput |\n|---|---|\n{table}\n")
    publish(section, not args.no_write)


if __name__ == "__main__":
    main()
