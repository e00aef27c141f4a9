"""Workflows with a scripted fake policy: parsers, fallbacks, branches, batching and metrics."""
from __future__ import annotations

import collections
import hashlib
import itertools
import json
import re

import numpy as np
import pytest

from marljax.tasks.problem import Problem
from marljax.workflows import WORKFLOWS, EvalOpt, OrchWorkers, SingleAgent, Voting, get_workflow, rollout
from marljax.workflows.base import Completion, last_boxed, stage_seed
from marljax.workflows.evaluation import evaluate_workflow
from marljax.workflows.eval_opt import parse_verdict
from marljax.workflows.metrics import rollout_metrics
from marljax.workflows.orch_workers import parse_strategies
from marljax.workflows.voting import parse_choice

STOP, GEN_PROMPT = 256, 257


class FakeCodec:
    """Byte-level codec; the prompt is the JSON of the messages, so a fake policy can read it back."""

    stop_token_ids = (STOP,)

    def render(self, messages):
        return list(json.dumps(messages).encode()) + [GEN_PROMPT]

    def decode(self, ids):
        return bytes(i for i in ids if i < 256).decode()

    def messages(self, ids):
        assert ids[-1] == GEN_PROMPT
        return json.loads(bytes(ids[:-1]).decode())


CODEC = FakeCodec()
ROLES = ("generator", "evaluator", "aggregator", "orchestrator", "worker", "synthesizer")
ISOLATED = {r: r for r in ROLES}
SHARED = {r: "shared" for r in ROLES}


def encode(text, max_tokens=10_000):
    ids = list(text.encode())
    if len(ids) >= max_tokens:
        return Completion(ids[:max_tokens], [-1.0] * max_tokens, True)
    return Completion(ids + [STOP], [-1.0] * (len(ids) + 1), False)


class ScriptedPolicy:
    """A `sample_fn` answering `reply(role, slot, turn, messages)`. Under the ISOLATED route the set name
    is the role; slot = occurrence of an identical prompt within one sampler call (voters; with several rollouts
    take it modulo n_votes); turn =
    assistant messages in the chat // 2 (Eval-Opt). Records every sampler call."""

    def __init__(self, reply, max_tokens=10_000):
        self.reply, self.max_tokens, self.calls = reply, max_tokens, []

    def __call__(self, set_name, prompts, seed):
        self.calls.append((set_name, len(prompts), seed))
        seen = collections.Counter()
        out = []
        for p in prompts:
            slot = seen[tuple(p)]
            seen[tuple(p)] += 1
            msgs = CODEC.messages(p)
            turn = sum(m["role"] == "assistant" for m in msgs) // 2
            out.append(encode(self.reply(set_name, slot, turn, msgs), self.max_tokens))
        return out


def hashed_policy(set_name, prompts, seed):
    """Deterministic in (prompt, seed) only: a stand-in for a greedy sampler."""
    out = []
    for p in prompts:
        h = int(hashlib.sha256(json.dumps([p, seed]).encode()).hexdigest(), 16)
        verdict = "Correct" if h % 3 else "Incorrect"
        out.append(encode(f"r{h % 1000} \\boxed{{{h % 5}}} STRATEGY 1: way {h % 7}\n\\boxed{{{verdict}}}"))
    return out


def fake_reward(problems, texts):
    """1.0 iff the last plain `\\boxed{...}` equals the gold answer (no math_verify: fast)."""
    scores = []
    for p, t in zip(problems, texts):
        found = re.findall(r"\\boxed\{([^{}]*)\}", t)
        scores.append(float(bool(found) and found[-1].strip() == p.answer))
    return scores


def problem(i=0, answer="42"):
    return Problem(id=f"p{i}", question=f"What is {i} + 42 - {i}?", kind="math", answer=answer)


def run(workflow, reply, problems=None, route=ISOLATED, **kw):
    policy = ScriptedPolicy(reply, kw.pop("max_tokens", 10_000))
    out = rollout(workflow, problems or [problem()], policy, CODEC, route, reward_fn=fake_reward, **kw)
    return out, policy


# ---------------------------------------------------------------- parsers


@pytest.mark.parametrize("text,expected", [
    ("so \\boxed{2}", (2, "boxed")),
    ("\\boxed{1} then finally \\boxed{3}", (1, "boxed")),  # the first match, as the paper's parser
    ("Solution 2 looks good, but \\boxed{3}", (3, "boxed")),  # a boxed pick beats an earlier digit
    ("\\boxed{5}, no, \\boxed{2}", (1, "default")),  # first boxed out of range; first digit 5 too
    ("\\boxed{ \\text{2} }", (2, "digit")),  # not \boxed{N}: the digit fallback finds the 2
    ("\\boxed{two}, i.e. Solution 2", (2, "digit")),
    ("\\boxed{7} is out of range; solution 2 it is", (1, "default")),  # first digit is the 7
    ("Solution 3 is best", (3, "digit")),
    ("I like option 12 and 5", (1, "default")),  # first standalone digit 5 > n: candidate 1
    ("no idea", (1, "default")),
])
def test_parse_choice(text, expected):
    c = parse_choice(text, 3)
    assert (c.index, c.source) == expected


@pytest.mark.parametrize("text,expected", [
    ("Looks fine. \\boxed{Correct}", "correct"),
    ("\\boxed{incorrect}: step 2 is wrong", "incorrect"),
    ("\\boxed{\\text{Correct}}", "correct"),
    ("\\boxed{Incorrect} ... the solution's \\boxed{12}", "incorrect"),
    ("It is correct.", None),
    ("\\boxed{maybe}", None),
])
def test_parse_verdict(text, expected):
    assert parse_verdict(text) == expected


def test_last_boxed_takes_the_last_matching_token():
    assert last_boxed("\\boxed{1} \\boxed{x} \\boxed{2}", r"\d+") == "2"
    assert last_boxed("\\boxed {3}", r"\d+") == "3"
    assert last_boxed("\\boxed{12a}", r"\d+") is None


def test_parse_strategies_rules():
    five = "\n".join(f"STRATEGY {k}: approach number {k}" for k in range(1, 6))
    s = parse_strategies(five, 3)
    assert s.source == "strategy" and s.items == ("approach number 1", "approach number 2", "approach number 3")
    assert parse_strategies("**STRATEGY 2:** second\n**STRATEGY 1:** first\nspans\ntwo lines", 3).items == (
        "first\nspans\ntwo lines", "second")
    numbered = parse_strategies("Ideas:\n1. Use algebra\n2) Draw a picture\n3. Guess and check\n4. Four", 3)
    assert numbered.source == "numbered" and numbered.items == ("Use algebra", "Draw a picture", "Guess and check")
    lines = parse_strategies("short\nwork backwards from the end\n\ntry small cases first", 3)
    assert lines.source == "lines" and lines.items == ("work backwards from the end", "try small cases first")
    assert parse_strategies("ok\n\nhmm", 3) == parse_strategies("", 3)
    assert parse_strategies("", 3).source == "none" and parse_strategies("", 3).items == ()


# ---------------------------------------------------------------- single


def test_single_agent():
    out, policy = run(SingleAgent(), lambda *_: "so \\boxed{42}")
    [e] = out.episodes
    assert e.reward == 1.0 and e.final == "so \\boxed{42}" and len(policy.calls) == 1
    [c] = out.calls
    assert (c.role, c.slot, c.turn, c.parse_failed, c.correct) == ("generator", 0, 0, False, 1.0)
    assert "\\boxed{}" in c.messages[0]["content"] and "What is 0 + 42" in c.messages[0]["content"]


# ---------------------------------------------------------------- prompt cap (the paper's max prompt length)


def test_a_prompt_over_the_cap_ends_the_episode_with_reward_0():
    """Voting whose second problem's voters write long answers: its aggregator prompt is over the cap, so
    the aggregator is not sampled, the voters' calls stay, the reward is 0 (their answers were right) and
    the episode counts in `workflow/prompt_overflow`. A prompt exactly at the cap is sampled."""
    short, long = problem(1), problem(2)

    def reply(role, slot, turn, msgs):
        if role == "aggregator":
            return "\\boxed{1}"
        return ("x" * 400 if "2 + 42" in msgs[0]["content"] else "") + " \\boxed{42}"

    free, _ = run(Voting(), reply, problems=[short, long])
    agg = {c.problem_index: len(c.prompt_ids) for c in free.calls if c.role == "aggregator"}
    cap = agg[0]
    assert max(len(c.prompt_ids) for c in free.calls if c.role == "generator") < cap < agg[1]
    assert [e.reward for e in free.episodes] == [1.0, 1.0]
    out, policy = run(Voting(), reply, problems=[short, long], max_prompt_tokens=cap)
    assert [e.reward for e in out.episodes] == [1.0, 0.0]
    assert [e.prompt_overflow for e in out.episodes] == [False, True] and out.episodes[1].final == ""
    assert [out.calls[i].role for i in out.episodes[1].call_ids] == ["generator"] * 3
    assert [n for set_name, n, _ in policy.calls if set_name == "aggregator"] == [1]
    assert rollout_metrics(out)["workflow/prompt_overflow"] == 0.5
    assert out.transcripts()[1]["prompt_overflow"] is True
    assert rollout_metrics(free)["workflow/prompt_overflow"] == 0.0


def test_a_first_prompt_over_the_cap_makes_no_call_and_eval_opt_stops_mid_chat():
    """Over the cap at the first stage: no call, no sampler call, reward 0. Eval-Opt's growing chat: the
    refine turn whose prompt is over the cap ends the episode after the first verdict."""
    out, policy = run(SingleAgent(), lambda *_: "\\boxed{42}", max_prompt_tokens=10)
    assert out.calls == () and policy.calls == [] and out.episodes[0].reward == 0.0
    assert out.episodes[0].prompt_overflow

    def reply(role, slot, turn, msgs):
        return "\\boxed{42}" if role == "generator" else "\\boxed{Incorrect}"

    free, _ = run(EvalOpt(), reply)
    first_refine = len(free.calls[2].prompt_ids)
    out, _ = run(EvalOpt(), reply, max_prompt_tokens=first_refine - 1)
    assert [(c.role, c.turn) for c in out.calls] == [("generator", 0), ("evaluator", 0)]
    assert (free.episodes[0].reward, out.episodes[0].reward) == (1.0, 0.0)


# ---------------------------------------------------------------- voting


def voting_reply(aggregator_text):
    answers = ["\\boxed{1}", "\\boxed{42}", "\\boxed{7}"]
    return lambda role, slot, turn, msgs: answers[slot % 3] if role == "generator" else aggregator_text


def test_voting_aggregator_picks_candidate_2():
    out, _ = run(Voting(), voting_reply("Solution 2 is right: \\boxed{2}"))
    [e] = out.episodes
    assert e.final == "\\boxed{42}" and e.reward == 1.0 and e.info == {"choice": 2, "choice_source": "boxed"}
    voters = [c for c in out.calls if c.role == "generator"]
    assert [c.slot for c in voters] == [0, 1, 2] and [c.correct for c in voters] == [0.0, 1.0, 0.0]
    assert len({json.dumps(c.messages) for c in voters}) == 1  # identical prompt
    [agg] = [c for c in out.calls if c.role == "aggregator"]
    prompt = agg.messages[0]["content"]
    answers = ["\\boxed{1}", "\\boxed{42}", "\\boxed{7}"]
    assert all(f"--- Solution {i} ---\n{a}" in prompt for i, a in enumerate(answers, 1))
    m = rollout_metrics(out)
    assert m["role/generator/accuracy"] == pytest.approx(1 / 3) and m["workflow/any_correct"] == 1.0
    assert m["role/aggregator/parse_fail"] == 0.0 and m["reward/mean"] == 1.0


def test_voting_unparsable_aggregator_falls_back_to_candidate_1():
    out, _ = run(Voting(), voting_reply("They all look plausible."))
    [e] = out.episodes
    assert e.final == "\\boxed{1}" and e.reward == 0.0 and e.info["choice_source"] == "default"
    assert rollout_metrics(out)["role/aggregator/parse_fail"] == 1.0


def test_voting_n_votes_configurable():
    out, _ = run(get_workflow("voting", n_votes=5), lambda *_: "\\boxed{42}")
    assert sum(c.role == "generator" for c in out.calls) == 5
    assert "between 1 and 5" in out.calls[-1].messages[0]["content"]


# ---------------------------------------------------------------- eval-opt


def test_eval_opt_correct_at_turn_0_stops():
    out, policy = run(EvalOpt(), lambda role, *_: "\\boxed{42}" if role == "generator" else "\\boxed{Correct}")
    assert [(c.role, c.turn) for c in out.calls] == [("generator", 0), ("evaluator", 0)]
    [e] = out.episodes
    assert e.final == "\\boxed{42}" and e.info["eval_opt_turns"] == 1 and e.info["verdicts"] == ["correct"]
    assert len(policy.calls) == 2


def test_eval_opt_always_incorrect_stops_at_max_iterations_with_last_generator_output():
    def reply(role, slot, turn, msgs):
        return f"attempt {turn} \\boxed{{{40 + turn}}}" if role == "generator" else "\\boxed{Incorrect} try again"

    out, _ = run(EvalOpt(), reply)
    assert [(c.role, c.turn) for c in out.calls] == [
        ("generator", 0), ("evaluator", 0), ("generator", 1), ("evaluator", 1), ("generator", 2), ("evaluator", 2)]
    [e] = out.episodes
    assert e.final == "attempt 2 \\boxed{42}" and e.reward == 1.0 and e.info["eval_opt_turns"] == 3
    # one growing chat: every output is an assistant message; the instruction is the last user turn
    last_eval = out.calls[-1].messages
    assert [m["role"] for m in last_eval] == ["user"] + ["assistant"] * 5 + ["user"]
    assert [m["content"] for m in last_eval[1:6]] == [c.text for c in out.calls[:5]]
    assert "\\boxed{Correct}" in last_eval[-1]["content"]
    assert "feedback" in out.calls[2].messages[-1]["content"]
    # evaluator accuracy: wrong on turns 0-1 ("Incorrect" for wrong answers: right), wrong on turn 2
    assert [c.correct for c in out.calls if c.role == "evaluator"] == [1.0, 1.0, 0.0]
    assert rollout_metrics(out)["workflow/any_correct"] == 1.0


def test_eval_opt_unparsable_verdict_continues_and_code_defaults_to_2_iterations():
    code = Problem(id="c0", question="Print 1.", kind="code", tests=())
    out, _ = run(EvalOpt(), lambda role, *_: "print(1)" if role == "generator" else "hmm", problems=[code],
                 grade_calls=False)
    assert [(c.role, c.turn) for c in out.calls] == [
        ("generator", 0), ("evaluator", 0), ("generator", 1), ("evaluator", 1)]
    assert all(c.parse_failed for c in out.calls if c.role == "evaluator")
    assert out.episodes[0].info["verdicts"] == [None, None]
    assert "```python" in out.calls[0].messages[0]["content"]
    assert len(get_workflow("eval_opt", max_iterations=1).episode(problem()).__next__()) == 1


def test_eval_opt_live_episodes_only():
    """Episodes stop at different turns; later stages carry only the live ones."""
    problems = [problem(i) for i in range(3)]

    def reply(role, slot, turn, msgs):
        i = int(re.search(r"What is (\d+)", msgs[0]["content"]).group(1))
        if role == "generator":
            return "\\boxed{42}"
        return "\\boxed{Correct}" if turn >= i else "\\boxed{Incorrect}"

    out, policy = run(EvalOpt(), reply, problems=problems)
    assert [e.info["eval_opt_turns"] for e in out.episodes] == [1, 2, 3]
    assert [(s, n) for s, n, _ in policy.calls] == [
        ("generator", 3), ("evaluator", 3), ("generator", 2), ("evaluator", 2), ("generator", 1), ("evaluator", 1)]
    assert rollout_metrics(out)["workflow/eval_opt_turns"] == pytest.approx(2.0)


# ---------------------------------------------------------------- orchestrator-workers


def orch_reply(plan):
    def reply(role, slot, turn, msgs):
        if role == "orchestrator":
            return plan
        if role == "worker":
            strategy = re.findall(r"Strategy: (.*)", msgs[0]["content"])  # the last: after any worked example
            return f"via {strategy[-1] if strategy else 'nothing'}: \\boxed{{42}}"
        return "all agree: \\boxed{42}"
    return reply


def test_orch_workers_five_strategies_give_three_workers():
    plan = "\n".join(f"STRATEGY {k}: idea {k}" for k in range(1, 6))
    out, _ = run(OrchWorkers(), orch_reply(plan))
    workers = [c for c in out.calls if c.role == "worker"]
    assert [c.slot for c in workers] == [0, 1, 2]
    assert [c.text for c in workers] == [f"via idea {k}: \\boxed{{42}}" for k in (1, 2, 3)]
    [synth] = [c for c in out.calls if c.role == "synthesizer"]
    assert "--- Solution 2 (Strategy: idea 2) ---\nvia idea 2" in synth.messages[0]["content"]
    [e] = out.episodes
    assert e.final == "all agree: \\boxed{42}" and e.reward == 1.0
    assert e.info["n_strategies"] == 3 and e.info["strategies"] == ["idea 1", "idea 2", "idea 3"]
    m = rollout_metrics(out)
    assert m["workflow/n_strategies"] == 3 and m["role/worker/accuracy"] == 1.0
    assert m["role/orchestrator/parse_fail"] == 0.0 and "role/orchestrator/accuracy" not in m


def test_orch_workers_numbered_list_fallback():
    out, _ = run(get_workflow("orch_workers", max_subtasks=2), orch_reply("1. Use algebra\n2. Draw it\n3. Guess"))
    workers = [c.text for c in out.calls if c.role == "worker"]
    assert workers == ["via Use algebra: \\boxed{42}", "via Draw it: \\boxed{42}"]
    assert out.calls[0].parse_failed and out.episodes[0].info["strategy_source"] == "numbered"


def test_orch_workers_zero_strategies_runs_one_worker_without_strategy():
    out, _ = run(OrchWorkers(), orch_reply("ok"))
    workers = [c for c in out.calls if c.role == "worker"]
    assert len(workers) == 1 and workers[0].text == "via nothing: \\boxed{42}"
    assert "What is 0 + 42" in workers[0].messages[0]["content"]
    [synth] = [c for c in out.calls if c.role == "synthesizer"]
    assert "--- Solution 1 ---\nvia nothing" in synth.messages[0]["content"]
    assert out.episodes[0].info["n_strategies"] == 0 and out.calls[0].parse_failed


# ---------------------------------------------------------------- engine


@pytest.mark.parametrize("route", [SHARED, ISOLATED])
def test_voting_step_sampler_calls_equal_stages(route):
    problems = [problem(i) for i in range(4)]
    policy = ScriptedPolicy(lambda *_: "\\boxed{2}")
    out = rollout(Voting(), problems, policy, CODEC, route, n_rollouts=8, reward_fn=fake_reward)
    assert [n for _, n, _ in policy.calls] == [3 * 8 * 4, 8 * 4] and out.sampler_calls == 2
    assert len({seed for *_, seed in policy.calls}) == 2
    assert [e.rollout for e in out.episodes[:9]] == [0, 1, 2, 3, 4, 5, 6, 7, 0]


def test_stages_with_two_sets_call_once_per_set():
    route = {**SHARED, "aggregator": "critic"}
    policy = ScriptedPolicy(lambda *_: "\\boxed{1}")
    rollout(Voting(), [problem()], policy, CODEC, route, reward_fn=fake_reward)
    assert [(s, n) for s, n, _ in policy.calls] == [("shared", 3), ("critic", 1)]


@pytest.mark.parametrize("name", ["single", "eval_opt", "voting", "orch_workers"])
def test_episode_outputs_do_not_depend_on_the_batch(name):
    wf = get_workflow(name)
    many = [problem(i) for i in range(4)]
    alone = rollout(wf, many[2:3], hashed_policy, CODEC, SHARED, seed=3, reward_fn=fake_reward).transcripts()
    batched = rollout(wf, many, hashed_policy, CODEC, SHARED, seed=3, reward_fn=fake_reward).transcripts()
    strip = lambda t: {k: v for k, v in t.items() if k != "episode"}  # noqa: E731
    assert strip(batched[2]) == strip(alone[0])


def test_columns_for_the_trainer():
    out, _ = run(Voting(), voting_reply("\\boxed{2}"), problems=[problem(0), problem(1, answer="7")], n_rollouts=2)
    assert out.slot_grouped_roles == {"generator"}
    every = out.columns()
    assert len(every.role) == 16 and every.role.tolist()[:4] == ["generator"] * 3 + ["generator"]
    g = out.columns("generator")
    assert set(g.set_name.tolist()) == {"generator"} and len(g.response_ids) == 12
    assert g.slot.tolist() == [0, 1, 2] * 4 and g.problem_index.tolist() == [0] * 6 + [1] * 6
    assert g.problem_id.tolist() == ["p0"] * 6 + ["p1"] * 6
    assert g.rollout.tolist() == [0, 0, 0, 1, 1, 1] * 2 and g.episode.tolist() == [0] * 3 + [1] * 3 + [2] * 3 + [3] * 3
    assert g.reward.tolist() == [1.0] * 6 + [0.0] * 6  # outcome broadcast
    assert g.correct.tolist() == [0, 1, 0, 0, 1, 0, 0, 0, 1, 0, 0, 1]
    assert g.response_ids[0].dtype == np.int32 and g.response_ids[0][-1] == STOP
    assert len(g.logprobs[0]) == len(g.response_ids[0]) and g.prompt_ids[0][-1] == GEN_PROMPT
    a = out.columns("aggregator")
    assert a.turn.tolist() == [0] * 4 and np.isnan(a.correct).all()
    assert not a.parse_failed.any() and not a.truncated.any()


def test_truncation_and_parse_failures_are_recorded():
    out, _ = run(SingleAgent(), lambda *_: "a very long answer without a box", max_tokens=5)
    [c] = out.calls
    assert c.truncated and c.parse_failed and c.text == "a ver" and len(c.response_ids) == 5
    m = rollout_metrics(out)
    assert m["role/generator/truncated"] == 1.0 and m["role/generator/length_mean"] == 5.0


def test_rewards_are_graded_in_one_batched_call():
    seen = []

    def counting_reward(problems, texts):
        seen.append(len(texts))
        return fake_reward(problems, texts)

    policy = ScriptedPolicy(voting_reply("\\boxed{2}"))
    rollout(Voting(), [problem(0), problem(1)], policy, CODEC, ISOLATED, n_rollouts=4, reward_fn=counting_reward)
    assert seen == [6]  # 3 distinct voter texts per problem (finals among them), deduplicated


def test_errors_are_clear():
    with pytest.raises(ValueError, match="route has no parameter set for role"):
        rollout(Voting(), [problem()], hashed_policy, CODEC, {"generator": "g"})
    with pytest.raises(ValueError, match="Unknown workflow"):
        get_workflow("debate")
    with pytest.raises(TypeError, match="n_votes"):
        get_workflow("single", n_votes=3)
    with pytest.raises(ValueError, match="n_votes"):
        Voting(n_votes=0)
    with pytest.raises(ValueError, match="returned 0 samples"):
        rollout(SingleAgent(), [problem()], lambda s, p, seed: [], CODEC, SHARED, reward_fn=fake_reward)


def test_stage_seed_is_deterministic_and_distinct():
    seeds = {stage_seed(s, st, n) for s in (0, 1) for st in range(3) for n in ("a", "b")}
    assert len(seeds) == 12 and stage_seed(0, 1, "a") == stage_seed(0, 1, "a")


# ---------------------------------------------------------------- evaluation


def test_evaluate_workflow_metrics_and_transcripts():
    problems = [problem(i, answer="42" if i % 2 == 0 else "x") for i in range(5)]
    policy = ScriptedPolicy(voting_reply("\\boxed{2}"))
    ev = evaluate_workflow(Voting(), problems, policy, CODEC, ISOLATED, seed=1, k=2, batch_size=2,
                           reward_fn=fake_reward, progress=False)
    m = ev.metrics
    assert m["pass@1"] == pytest.approx(3 / 5) and m["pass@2"] == pytest.approx(3 / 5) and m["pass@1/std"] == 0.0
    assert m["n_problems"] == 5 and m["k"] == 2 and m["role/generator/accuracy"] == pytest.approx(0.6 / 3)
    assert len(policy.calls) == 3 * 2  # 3 batches x 2 stages
    assert [t["problem_id"] for t in ev.transcripts] == [f"p{i}" for i in range(5) for _ in range(2)]
    assert [t["episode"] for t in ev.transcripts] == list(range(10))
    json.dumps(ev.transcripts)


@pytest.mark.parametrize("supervisor_example", [False, True])
@pytest.mark.parametrize("worked_example", [False, True])
@pytest.mark.parametrize("kind", ["math", "code"])
def test_every_prompt_is_fully_formatted(kind, worked_example, supervisor_example):
    p = Problem(id="q", question="Add {x} and 2.", kind=kind, answer="1", tests=())
    for name in ("single", "eval_opt", "voting", "orch_workers"):
        workflow = get_workflow(name, worked_example=worked_example, supervisor_example=supervisor_example)
        out = rollout(workflow, [p], hashed_policy, CODEC, SHARED,
                      reward_fn=fake_reward,
                      grade_calls=False)
        for c in out.calls:
            for m in c.messages:
                if m["role"] == "user":
                    assert not re.search(r"\{\{|\}\}|\{(problem|solutions|n|strategy|max_subtasks)\}", m["content"])
        assert "Add {x} and 2." in out.calls[0].messages[0]["content"]


def test_worked_example_changes_only_the_solve_and_worker_prompts():
    """`worked_example` shows one solved example (answer format included) in every solve and worker
    prompt (a worker's keeps its strategy); the supervisory prompts are the paper's."""
    def prompts(workflow, reply):
        out, _ = run(workflow, reply)
        return [(c.role, c.messages[0]["content"]) for c in out.calls]
    plan = "STRATEGY 1: count up\nSTRATEGY 2: add the tens"
    for make, reply, answering in ((Voting, voting_reply("\\boxed{2}"), "generator"),
                                   (OrchWorkers, orch_reply(plan), "worker")):
        plain, shot = prompts(make(worked_example=False), reply), prompts(make(worked_example=True), reply)
        assert {r for r, _ in plain} >= {answering}
        for (role, a), (_, b) in zip(plain, shot):
            if role == answering:
                assert "Example:" in b and "\\boxed{7}" in b and "What is 0 + 42" in b and "Example:" not in a
                assert ("Strategy: count up" in b) == ("Strategy: count up" in a)
            else:
                assert a == b
    from marljax.config import Config
    cfg = Config()
    cfg.workflow.worked_example = True
    assert cfg.workflow.build().worked_example


def test_supervisor_example_changes_only_the_supervisory_prompts():
    """`supervisor_example` shows one worked example in the aggregator's, orchestrator's and synthesizer's
    prompts, each still holding the problem and its inputs; the generator and worker prompts are unchanged."""
    def prompts(workflow, reply):
        out, _ = run(workflow, reply)
        return [(c.role, c.messages[0]["content"]) for c in out.calls]
    plan = "STRATEGY 1: count up\nSTRATEGY 2: add the tens"
    for make, reply, supervisors in ((Voting, voting_reply("\\boxed{2}"), {"aggregator"}),
                                     (OrchWorkers, orch_reply(plan), {"orchestrator", "synthesizer"})):
        plain, shot = prompts(make(), reply), prompts(make(supervisor_example=True), reply)
        assert {r for r, _ in plain} >= supervisors
        for (role, a), (_, b) in zip(plain, shot):
            if role in supervisors:
                assert "Example:" in b and "Mia" in b and "What is 0 + 42" in b and "Example:" not in a
                assert ("Strategy: count up" in b) == ("Strategy: count up" in a)
                assert ("--- Solution 1" in b) == ("--- Solution 1" in a)
            else:
                assert a == b


def test_default_reward_is_the_problems_own():
    half = Problem(id="h", question="Half of 1?", kind="math", answer="0.5")
    policy = ScriptedPolicy(lambda role, slot, *_: ["\\boxed{1}", "\\boxed{\\frac{1}{2}}"][slot % 2]
                            if role == "generator" else "\\boxed{2}")
    out = rollout(Voting(n_votes=2), [half], policy, CODEC, ISOLATED)  # reward_fn: Problem.reward (math-verify)
    assert out.episodes[0].reward == 1.0 and [c.correct for c in out.calls[:2]] == [0.0, 1.0]


def test_code_voting_rewards_the_chosen_program_in_the_sandbox():
    add = Problem(id="add", question="Read a and b, print a + b.", kind="code",
                  tests=({"input": "2 3\n", "output": "5"},))
    programs = ["```python\nprint(0)\n```", "```python\na, b = map(int, input().split())\nprint(a + b)\n```"]
    policy = ScriptedPolicy(lambda role, slot, *_: programs[slot % 2] if role == "generator" else "\\boxed{2}")
    out = rollout(Voting(n_votes=2), [add], policy, CODEC, ISOLATED)  # reward_fn: Problem.reward (sandbox)
    assert out.episodes[0].final == programs[1] and out.episodes[0].reward == 1.0
    assert [c.correct for c in out.calls[:2]] == [0.0, 1.0] and not any(c.parse_failed for c in out.calls)


# ---------------------------------------------------------------- declarations


def longest_reply():
    """Every call a distinct text; the evaluator never satisfied, the orchestrator over-delivering: the
    longest episode each workflow can run."""
    count = itertools.count()

    def reply(role, slot, turn, msgs):
        if role == "orchestrator":
            return "\n".join(f"STRATEGY {k}: plan idea {k}" for k in range(1, 6))
        return f"{role} text {next(count)}: \\boxed{{Incorrect}}"
    return reply


@pytest.mark.parametrize("kind", ["math", "code"])
@pytest.mark.parametrize("name", sorted(WORKFLOWS))
def test_declared_stages_and_counts_are_the_episode_scripts(name, kind):
    """`sampler_stages` (what the matrix prices) is what the script runs in its longest case: per stage the
    role, its calls, and how many earlier responses and notes (strategies) each prompt holds;
    `same_role_counts` are the parallel calls of those roles; `roles` the roles that speak."""
    workflow = get_workflow(name)
    p = Problem(id="p0", question="What is 0 + 42?", kind=kind, answer="42")
    out, _ = run(workflow, longest_reply(), problems=[p])
    [episode] = out.episodes
    calls = [out.calls[i] for i in episode.call_ids]
    strategies = [f"plan idea {k}" for k in range(1, 6)]
    seen = []
    for st, stage in zip(workflow.sampler_stages(kind), sorted({c.stage for c in calls}), strict=True):
        here = [c for c in calls if c.stage == stage]
        assert [c.role for c in here] == [st.role] * st.calls
        for c in here:
            prompt = "".join(m["content"] for m in c.messages)
            assert sum(t in prompt for t in seen) == st.responses
            assert sum(s in prompt for s in strategies) == st.notes
        seen += [c.text for c in here]
    assert sorted({c.role for c in calls}) == sorted(workflow.roles)
    assert workflow.same_role_counts() == {r: n for r, n in collections.Counter(c.role for c in calls).items()
                                           if max(c.slot for c in calls if c.role == r) > 0}
