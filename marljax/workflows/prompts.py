"""Prompt sets for math and code, in our own wording, with the paper's structure and answer formats.

Templates are `str.format` strings (literal braces doubled). Placeholders: `{problem}`; `{solutions}`
(see `format_solutions`) and `{n}` for the aggregator; `{max_subtasks}` for the orchestrator;
`{strategy}` for a worker. `evaluate` and `refine` are plain text, used verbatim as the last user turn
of Eval-Opt's shared chat. `solve_shot` and `work_shot` are `solve` and `work` with one worked example of
the answer format, for small models that do not follow the format zero-shot (`workflow.worked_example`;
not the paper's setting).
"""
from __future__ import annotations

import dataclasses
from collections.abc import Sequence


@dataclasses.dataclass(frozen=True)
class PromptSet:
    solve: str  # generator (single, Eval-Opt first turn, voters); also a worker without a strategy
    evaluate: str  # evaluator: verdict \boxed{Correct} / \boxed{Incorrect}
    refine: str  # generator after a verdict that was not Correct
    aggregate: str  # aggregator: \boxed{i}
    propose: str  # orchestrator: STRATEGY k: lines
    work: str  # worker with an assigned strategy
    synthesize: str  # synthesizer: final answer
    solve_shot: str  # `solve` with one worked example (workflow.worked_example)
    work_shot: str  # `work` with one worked example (workflow.worked_example)
    aggregate_shot: str  # `aggregate` with one worked example (workflow.supervisor_example)
    propose_shot: str  # `propose` with one worked example (workflow.supervisor_example)
    synthesize_shot: str  # `synthesize` with one worked example (workflow.supervisor_example)


MATH = PromptSet(
    solve=(
        "Solve the following math problem. Work through it step by step and write the final answer "
        "inside \\boxed{{}}.\n\nProblem: {problem}"
    ),
    evaluate=(
        "Check the solution above and decide whether it is correct.\n\n"
        "- Finish with your verdict, exactly \\boxed{Correct} or \\boxed{Incorrect}.\n"
        "- If it is incorrect, say briefly where it goes wrong.\n"
        "- Do not state the correct answer."
    ),
    refine=(
        "Write a new solution to the problem that takes the reviewer's feedback above into account.\n\n"
        "- Use a different method from your previous attempt.\n"
        "- Fix the issues the feedback points out.\n"
        "- Write the final answer inside \\boxed{}."
    ),
    aggregate=(
        "Below are several candidate solutions to the same math problem. Decide which one is most "
        "likely correct.\n\nProblem: {problem}\n\nCandidate solutions:{solutions}\n\n"
        "Check the reasoning and the final answer of each candidate, then give the number of the best "
        "one as \\boxed{{i}} with i between 1 and {n}."
    ),
    propose=(
        "Plan, do not solve. Propose at most {max_subtasks} different strategies for the math problem "
        "below, each a distinct mathematical approach (for example algebraic manipulation, casework, a "
        "geometric argument, a counting argument).\n\nProblem: {problem}\n\n"
        "Describe each approach in a sentence or two; do not carry it out and do not give the answer. "
        "Use exactly this format:\nSTRATEGY 1: <approach>\nSTRATEGY 2: <approach>\n"
        "and so on, with no more than {max_subtasks} strategies."
    ),
    work=(
        "Solve the math problem below using the strategy you are given.\n\nProblem: {problem}\n\n"
        "Strategy: {strategy}\n\nMake the strategy your main approach, solve the whole problem step by "
        "step, and write the final answer inside \\boxed{{}}."
    ),
    synthesize=(
        "Several solvers each attempted the same math problem with a different strategy. Compare their "
        "complete solutions and decide the correct answer.\n\nProblem: {problem}\n\n"
        "Solutions:{solutions}\n\nCheck the reasoning of each solution. An answer that several solutions "
        "reach independently deserves more trust; where they disagree, decide whose reasoning holds. "
        "Write the final answer inside \\boxed{{}}."
    ),
    solve_shot=(
        "Solve the math problem and write the final answer inside \\boxed{{}}.\n\nExample:\n"
        "Problem: Mia has 3 pens. Then Mia gets 4 more pens. How many pens does Mia have now?\n"
        "Solution: Mia has 3 + 4 = 7 pens. The answer is \\boxed{{7}}.\n\nProblem: {problem}\nSolution:"
    ),
    work_shot=(
        "Solve the math problem using the strategy you are given, and write the final answer inside "
        "\\boxed{{}}.\n\nExample:\n"
        "Problem: Mia has 3 pens. Then Mia gets 4 more pens. How many pens does Mia have now?\n"
        "Strategy: Add the pens she gets to the pens she has.\n"
        "Solution: Mia has 3 + 4 = 7 pens. The answer is \\boxed{{7}}.\n\n"
        "Problem: {problem}\nStrategy: {strategy}\nSolution:"
    ),
    aggregate_shot=(
        "Below are several candidate solutions to the same math problem. Give the number of the one most "
        "likely correct as \\boxed{{i}} with i between 1 and {n}.\n\nExample:\n"
        "Problem: Mia has 3 pens. Then Mia gets 4 more pens. How many pens does Mia have now?\n"
        "Candidate solutions:\n--- Solution 1 ---\nMia has 3 + 4 = 8 pens. The answer is \\boxed{{8}}.\n\n"
        "--- Solution 2 ---\nMia has 3 + 4 = 7 pens. The answer is \\boxed{{7}}.\n\n"
        "Choice: 3 + 4 = 7, so solution 2 is right. The best is \\boxed{{2}}.\n\n"
        "Problem: {problem}\nCandidate solutions:{solutions}\nChoice:"
    ),
    propose_shot=(
        "Plan, do not solve. Propose at most {max_subtasks} different strategies for the math problem, "
        "one per line, and do not give the answer.\n\nExample:\n"
        "Problem: Mia has 3 pens. Then Mia gets 4 more pens. How many pens does Mia have now?\n"
        "STRATEGY 1: Add the pens she gets to the pens she has.\n"
        "STRATEGY 2: Count up from 3, one pen at a time.\n\n"
        "Problem: {problem}\n"
    ),
    synthesize_shot=(
        "Several solvers each attempted the same math problem with a different strategy. Decide the "
        "correct answer and write it inside \\boxed{{}}.\n\nExample:\n"
        "Problem: Mia has 3 pens. Then Mia gets 4 more pens. How many pens does Mia have now?\n"
        "Solutions:\n--- Solution 1 (Strategy: Add the pens she gets to the pens she has.) ---\n"
        "Mia has 3 + 4 = 7 pens. The answer is \\boxed{{7}}.\n\n"
        "--- Solution 2 (Strategy: Count up from 3, one pen at a time.) ---\n"
        "4, 5, 6, 7, 8. The answer is \\boxed{{8}}.\n\n"
        "Answer: 3 + 4 = 7, so solution 1 is right. The answer is \\boxed{{7}}.\n\n"
        "Problem: {problem}\nSolutions:{solutions}\nAnswer:"
    ),
)

CODE = PromptSet(
    solve=(
        "You are an expert competitive programmer. Solve the programming problem below in Python.\n\n"
        "Problem:\n{problem}\n\nWrite clean, efficient code that handles the edge cases, and give one "
        "complete, runnable program in a single ```python code block."
    ),
    evaluate=(
        "Review the program above for correctness without running it: is the algorithm right, are the "
        "edge cases handled, are there bugs, is it fast enough for the constraints?\n\n"
        "- Finish with your verdict, exactly \\boxed{Correct} or \\boxed{Incorrect}.\n"
        "- If it is incorrect, say briefly what is wrong.\n"
        "- Do not write the corrected program."
    ),
    refine=(
        "Write an improved program that takes the reviewer's feedback above into account.\n\n"
        "- Fix the issues the review points out; change the approach if the old one is flawed.\n"
        "- Handle the edge cases.\n"
        "- Give one complete, runnable program in a single ```python code block."
    ),
    aggregate=(
        "Below are several candidate programs for the same problem. Decide which one is most likely to "
        "pass all tests.\n\nProblem:\n{problem}\n\nCandidate solutions:{solutions}\n\n"
        "Check each candidate's logic, edge cases and efficiency, then give the number of the best one "
        "as \\boxed{{i}} with i between 1 and {n}."
    ),
    propose=(
        "Plan, do not solve. Propose at most {max_subtasks} different strategies for the programming "
        "problem below, each a distinct algorithmic approach (for example greedy, dynamic programming, "
        "brute force with pruning, divide and conquer).\n\nProblem:\n{problem}\n\n"
        "Describe each approach in a sentence or two; do not write code. Use exactly this format:\n"
        "STRATEGY 1: <approach>\nSTRATEGY 2: <approach>\n"
        "and so on, with no more than {max_subtasks} strategies."
    ),
    work=(
        "You are an expert competitive programmer. Solve the problem below in Python using the strategy "
        "you are given.\n\nProblem:\n{problem}\n\nStrategy: {strategy}\n\nMake the strategy your main "
        "approach, handle the edge cases, and give one complete, runnable program in a single ```python "
        "code block."
    ),
    synthesize=(
        "Several programmers each attempted the same problem with a different strategy. Compare their "
        "complete solutions and produce the best program.\n\nProblem:\n{problem}\n\n"
        "Solutions:{solutions}\n\nCheck the logic, edge cases and efficiency of each. Finish with one "
        "complete, runnable Python program in a single ```python code block."
    ),
    solve_shot=(
        "Solve the programming problem in Python and give one complete, runnable program in a single "
        "```python code block.\n\nExample:\nProblem: Read two integers from one line and print their "
        "sum.\nSolution:\n```python\na, b = map(int, input().split())\nprint(a + b)\n```\n\n"
        "Problem:\n{problem}\nSolution:"
    ),
    work_shot=(
        "Solve the programming problem in Python using the strategy you are given, and give one complete, "
        "runnable program in a single ```python code block.\n\nExample:\nProblem: Read two integers "
        "from one line and print their sum.\nStrategy: Parse both numbers and add them.\nSolution:\n"
        "```python\na, b = map(int, input().split())\nprint(a + b)\n```\n\n"
        "Problem:\n{problem}\nStrategy: {strategy}\nSolution:"
    ),
    aggregate_shot=(
        "Below are several candidate programs for the same problem. Give the number of the one most likely "
        "to pass all tests as \\boxed{{i}} with i between 1 and {n}.\n\nExample:\nProblem:\nRead two "
        "integers from one line and print their sum.\nCandidate solutions:\n--- Solution 1 ---\n"
        "```python\na, b = input().split()\nprint(a + b)\n```\n\n--- Solution 2 ---\n```python\n"
        "a, b = map(int, input().split())\nprint(a + b)\n```\n\nChoice: solution 1 joins the strings "
        "instead of adding the numbers. The best is \\boxed{{2}}.\n\n"
        "Problem:\n{problem}\nCandidate solutions:{solutions}\nChoice:"
    ),
    propose_shot=(
        "Plan, do not solve. Propose at most {max_subtasks} different strategies for the programming "
        "problem, one per line, and do not write code.\n\nExample:\nProblem:\nRead two integers from "
        "one line and print their sum.\nSTRATEGY 1: Parse both numbers and add them.\n"
        "STRATEGY 2: Split the line, convert every part to an integer and sum the list.\n\n"
        "Problem:\n{problem}\n"
    ),
    synthesize_shot=(
        "Several programmers each attempted the same problem with a different strategy. Produce the best "
        "program, in a single ```python code block.\n\nExample:\nProblem:\nRead two integers from one "
        "line and print their sum.\nSolutions:\n--- Solution 1 (Strategy: Parse both numbers and add "
        "them.) ---\n```python\na, b = map(int, input().split())\nprint(a + b)\n```\n\n"
        "--- Solution 2 (Strategy: Split the line and sum the parts.) ---\n```python\n"
        "print(sum(input().split()))\n```\n\nAnswer: solution 2 sums strings, which fails; solution 1 "
        "is right.\n```python\na, b = map(int, input().split())\nprint(a + b)\n```\n\n"
        "Problem:\n{problem}\nSolutions:{solutions}\nAnswer:"
    ),
)

PROMPTS = {"math": MATH, "code": CODE}


def prompt_set(kind: str, worked_example: bool = False, supervisor_example: bool = False) -> PromptSet:
    """The prompt set for a problem kind ("math" | "code"); with `worked_example`, `solve` and `work`
    show one worked example; with `supervisor_example`, `aggregate`, `propose` and `synthesize` do."""
    if kind not in PROMPTS:
        raise ValueError(f"No prompt set for problem kind {kind!r}; known: {sorted(PROMPTS)}")
    prompts = PROMPTS[kind]
    if worked_example:
        prompts = dataclasses.replace(prompts, solve=prompts.solve_shot, work=prompts.work_shot)
    if supervisor_example:
        prompts = dataclasses.replace(prompts, aggregate=prompts.aggregate_shot, propose=prompts.propose_shot,
                                      synthesize=prompts.synthesize_shot)
    return prompts


def format_solutions(texts: Sequence[str], strategies: Sequence[str | None] | None = None) -> str:
    """Numbered candidate blocks: `--- Solution i ---` or, with a strategy, `--- Solution i (Strategy: s) ---`."""
    strategies = strategies if strategies is not None else [None] * len(texts)
    if len(strategies) != len(texts):
        raise ValueError(f"{len(texts)} solutions but {len(strategies)} strategies.")
    blocks = []
    for i, (text, strategy) in enumerate(zip(texts, strategies), 1):
        header = f"--- Solution {i} ---" if strategy is None else f"--- Solution {i} (Strategy: {strategy}) ---"
        blocks.append(f"\n{header}\n{text}\n")
    return "".join(blocks)
