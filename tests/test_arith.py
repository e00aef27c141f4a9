"""Synthetic arithmetic: deterministic, knobs respected, gold answers right by an independent reading."""
import re

import pytest

from marljax.tasks.arith import ArithConfig, generate

OPS = {  # sentence pattern -> (operation symbol, how the total changes)
    r"gets (\d+) more": ("+", lambda t, b: t + b),
    r"gives away (\d+)": ("-", lambda t, b: t - b),
    r"becomes (\d+) times as large": ("*", lambda t, b: t * b),
    r"into (\d+) groups and keeps one": ("/", lambda t, b: t / b),
}


def solve(question: str) -> tuple[int, list[str], int]:
    """Re-derive the answer from the text: (answer, operations used, number of distractor sentences)."""
    sentences = question.split(". ")
    name, start = re.match(r"(\w+) has (\d+)", sentences[0]).groups()
    total, used, distractors = int(start), [], 0
    for s in sentences[1:]:
        for pattern, (symbol, apply) in OPS.items():
            if s.startswith("Then ") and name in s and (m := re.search(pattern, s)):
                total = apply(total, int(m.group(1)))
                used.append(symbol)
                break
        else:
            if re.match(r"\w+ has \d+ \w+$", s):
                distractors += 1
    assert total == int(total) and total >= 0
    return int(total), used, distractors


@pytest.mark.parametrize("config", [ArithConfig(), ArithConfig(operands=5, digits=3, operations="+-*/"),
                                    ArithConfig(operands=2, digits=1, operations="*", distractor=1.0),
                                    ArithConfig(operands=4, operations="-/", distractor=0.5)])
def test_gold_answers_and_knobs(config):
    problems = generate(200, seed=1, config=config)
    distractor_count = 0
    for p in problems:
        answer, used, distractors = solve(p.question)
        assert str(answer) == p.answer, p.question
        assert len(used) == config.operands - 1
        assert set(used) <= set(config.operations) | {"+"}  # "+" stands in where "-" or "/" cannot apply
        numbers = [int(x) for x in re.findall(r"\d+", p.question.split(". ")[0])]
        assert all(n < 10 ** config.digits for n in numbers)
        distractor_count += distractors
    if config.distractor == 0.0:
        assert distractor_count == 0
    elif config.distractor == 1.0:
        assert distractor_count == len(problems)
    else:
        assert 0 < distractor_count < len(problems)


def test_seeded_and_split_streams_differ():
    assert generate(20, seed=7) == generate(20, seed=7)
    assert generate(20, seed=7) != generate(20, seed=8)
    assert [p.question for p in generate(20, seed=7)] != [p.question for p in generate(20, seed=7, split="test")]
    assert generate(5, seed=7) == generate(20, seed=7)[:5]


def test_rewards_through_the_math_grader():
    p = generate(1, seed=0)[0]
    assert p.reward(f"The answer is \\boxed{{{p.answer}}}.") == 1.0
    assert p.reward(f"\\boxed{{{int(p.answer) + 1}}}") == 0.0


@pytest.mark.parametrize("bad", [dict(operands=1), dict(digits=0), dict(operations="+^"), dict(operations=""),
                                 dict(distractor=1.5)])
def test_bad_knobs_are_rejected(bad):
    with pytest.raises(ValueError):
        ArithConfig(**bad)


def test_validation_split_shares_no_question_with_train_or_test():
    """`task.val_n`: validation comes out of the training split; arith repeats questions within and across
    its streams, so the split goes by question text, and asking for more than exist is an error."""
    from marljax.config import load_config
    from marljax.tasks.data import DataError, validation_split
    from marljax.build import build_problems
    cfg = load_config("configs/default.yaml", ["task.val_n=64", "task.eval_n=64"])
    p = build_problems(cfg)
    q = {name: [x.question for x in getattr(p, name)] for name in ("train", "val", "eval")}
    assert len(q["val"]) == len(set(q["val"])) == 64 and len(q["eval"]) == 64
    assert not set(q["val"]) & set(q["eval"]) and not set(q["val"]) & set(q["train"])
    full = build_problems(load_config("configs/default.yaml", ["task.eval_n=64"]))
    assert full.val == [] and len(full.train) == 1000  # val_n = 0 leaves the training set as it was
    assert [x.question for x in full.train if x.question not in set(q["val"])] == q["train"]
    with pytest.raises(DataError, match=r"task\.val_n=3: only 2 training problems"):
        validation_split(full.train[:2], [], 3)
