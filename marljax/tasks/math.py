"""Math reward: extract the final answer of a response and check it against the gold answer.

Equivalence is math-verify's (numbers with thousands separators, units, percent, fractions vs decimals,
LaTeX, intervals, tuples, sets). math-verify bounds its sympy work with SIGALRM, which works only in the
main thread, so calls from other threads go to a small spawn-started process pool whose workers run it
in their main thread, with a hard wall-clock limit on top (a stuck worker is killed): grading never hangs
the trainer and never raises for a malformed response.
"""
from __future__ import annotations

import atexit
import logging
import multiprocessing
import os
import re
import threading

from math_verify import parse, verify

log = logging.getLogger(__name__)

TIMEOUT_S = 5  # math-verify's per-parse and per-comparison limit (whole seconds: it uses signal.alarm)
_BOX = re.compile(r"\\(?:boxed|fbox)\s*")
_GSM8K = re.compile(r"^####\s*(.+?)\s*$", re.MULTILINE)
_pool: multiprocessing.pool.Pool | None = None
_pool_lock = threading.Lock()


def _braced(text: str, start: int) -> str | None:
    """Content of the balanced {...} group opening at text[start], or None if it never closes."""
    depth = 0
    for i in range(start, len(text)):
        depth += {"{": 1, "}": -1}.get(text[i], 0)
        if depth == 0:
            return text[start + 1: i]
    return None


def extract_answer(text: str) -> str | None:
    """The final answer of a response, or None when it gives none. Rules, in order:

    1. the last complete `\\boxed{...}` or `\\fbox{...}` (nested braces allowed; `\\boxed 5`, LaTeX's
       brace-less form, counts too; an unclosed box, as in a truncated response, is skipped);
    2. else the last GSM8K-style `#### 72` line.
    Deliberately no "last number in the text" fallback: the reward is defined on the stated final
    answer, and guessing one would reward responses that never commit to an answer.
    """
    for match in reversed(list(_BOX.finditer(text))):
        end = match.end()
        if text.startswith("{", end):
            content = _braced(text, end)
            if content is not None:
                return content.strip()
        elif bare := re.match(r"[^\s$\\{}]+", text[end:]):
            return bare.group(0)
    lines = _GSM8K.findall(text)
    return lines[-1] if lines else None


def _verify(answer: str, gold: str, timeout_s: int) -> bool:
    """math-verify equivalence of two answer strings; needs the main thread (SIGALRM)."""
    parsed_gold = parse(f"${gold}$", parsing_timeout=timeout_s)
    parsed = parse(f"${answer}$", parsing_timeout=timeout_s)
    return bool(parsed_gold and parsed and verify(parsed_gold, parsed, timeout_seconds=timeout_s))


def _worker_pool() -> multiprocessing.pool.Pool:
    """Process pool for calls from non-main threads; spawn-started (safe beside JAX threads), warmed."""
    global _pool
    with _pool_lock:
        if _pool is None:
            _pool = multiprocessing.get_context("spawn").Pool(min(4, os.cpu_count() or 1))
            atexit.register(_pool.terminate)  # not left to Pool.__del__ at interpreter shutdown
            _pool.apply(_verify, ("1", "1", TIMEOUT_S))  # import sympy in the workers now, not in a grade
        return _pool


def _verify_in_pool(answer: str, gold: str, timeout_s: int) -> bool:
    global _pool
    pool = _worker_pool()
    try:
        return pool.apply_async(_verify, (answer, gold, timeout_s)).get(3 * timeout_s + 5)
    except multiprocessing.TimeoutError:
        log.warning("math grading exceeded its hard limit; killing the grading workers (answer %.80r)",
                    answer)
        with _pool_lock:
            if _pool is pool:
                pool.terminate()
                _pool = None
        return False


def is_equivalent(answer: str, gold: str, timeout_s: int = TIMEOUT_S) -> bool:
    """Whether an extracted answer equals the gold answer (identical text, else math-verify)."""
    if answer.strip() == gold.strip():
        return True
    if threading.current_thread() is threading.main_thread():
        return _verify(answer, gold, timeout_s)
    return _verify_in_pool(answer, gold, timeout_s)


def grade(response_text: str, gold_answer: str, timeout_s: int = TIMEOUT_S) -> float:
    """Binary math reward: 1.0 iff the response's final answer (`extract_answer`) equals the gold."""
    if gold_answer is None or not str(gold_answer).strip():
        raise ValueError("grade(): the gold answer is empty; fix the dataset row (every math Problem "
                         "needs a non-empty `answer`).")
    answer = extract_answer(response_text)
    if not answer:
        return 0.0
    return 1.0 if is_equivalent(answer, str(gold_answer), timeout_s) else 0.0
