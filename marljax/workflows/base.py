"""Workflow vocabulary and the rollout driver.

A workflow describes one episode as a script: a Python generator that yields a *stage* (the list of
role calls that can run now), receives their response texts, and finally returns an `Outcome`.
`rollout` drives the scripts of many episodes: with a streaming sampler (the rollout engine) each
episode submits its next stage as soon as its previous one returns, so no episode waits for another's
slow call; with a plain `SampleFn` every stage of every episode goes to the sampler at once, one call per
parameter set (`route[role]`). Episodes that finish early (Eval-Opt) simply stop yielding. Rewards are
computed afterwards in one batched `reward_fn` call.
"""
from __future__ import annotations

import dataclasses
import re
import zlib
from collections.abc import Callable, Generator, Mapping, Sequence
from typing import Any, ClassVar, Protocol

import numpy as np

from marljax.tasks.kinds import problem_kind
from marljax.tasks.problem import Problem
from marljax.workflows.prompts import PromptSet, prompt_set

GENERATOR = "generator"
EVALUATOR = "evaluator"
AGGREGATOR = "aggregator"
ORCHESTRATOR = "orchestrator"
WORKER = "worker"
SYNTHESIZER = "synthesizer"

Message = Mapping[str, str]  # {"role": "user" | "assistant" | "system", "content": str}


def user(content: str) -> dict[str, str]:
    return {"role": "user", "content": content}


def assistant(content: str) -> dict[str, str]:
    return {"role": "assistant", "content": content}


@dataclasses.dataclass(frozen=True)
class Completion:
    """One sampled response (what a `SampleFn` returns per prompt): ids (the stop token included if hit), their sampler logprobs, and whether
    generation hit max_new_tokens without a stop token."""

    tokens: list[int]
    logprobs: list[float]
    truncated: bool


class ChatCodec(Protocol):
    """Turns chat messages into prompt ids (generation prompt included) and response ids into text."""

    stop_token_ids: tuple[int, ...]

    def render(self, messages: list[dict[str, str]]) -> list[int]: ...

    def decode(self, ids: list[int]) -> str: ...


SampleFn = Callable[[str, list[list[int]], int], list[Completion]]  # (set_name, prompts, seed) -> completions
RewardFn = Callable[[Sequence[Problem], Sequence[str]], list[float]]


def grade_serially(problems: Sequence[Problem], texts: Sequence[str]) -> list[float]:
    """Default `reward_fn`: `Problem.reward` one text at a time. Swap in a pool-backed one for code."""
    return [float(p.reward(t)) for p, t in zip(problems, texts, strict=True)]


@dataclasses.dataclass(frozen=True)
class RoleCall:
    """A request for one generation: which role speaks (slot: parallel same-role agent index; turn:
    the role's iteration index within the episode) and the chat it sees."""

    role: str
    slot: int
    turn: int
    messages: tuple[Message, ...]


@dataclasses.dataclass(frozen=True)
class Outcome:
    """What an episode script returns: the final answer text (graded for the reward) and JSON-able
    facts about the episode; numeric ones are averaged into `workflow/<key>` metrics."""

    final: str
    info: dict[str, Any]


EpisodeScript = Generator[list[RoleCall], list[str], Outcome]


@dataclasses.dataclass(frozen=True)
class CallRecord:
    """One executed role call: one trajectory for the trainer."""

    episode: int
    problem_index: int  # index into the problems passed to `rollout`
    problem_id: str
    rollout: int  # which of the n_rollouts of its problem
    role: str
    slot: int
    turn: int
    stage: int
    set_name: str
    messages: tuple[Message, ...]
    prompt_ids: list[int]
    response_ids: list[int]
    logprobs: list[float]
    text: str
    truncated: bool
    parse_failed: bool
    correct: float | None = None  # this call's own answer re-graded, where defined (metrics only)


@dataclasses.dataclass(frozen=True)
class Episode:
    id: int
    problem_index: int
    problem_id: str
    rollout: int
    final: str
    reward: float
    info: dict[str, Any]
    call_ids: tuple[int, ...]  # indices into Rollout.calls, in execution order
    prompt_overflow: bool = False  # ended by a prompt over `max_prompt_tokens` (reward 0, final "")


@dataclasses.dataclass(frozen=True)
class CallColumns:
    """Calls as flat per-call columns in call order (ragged token arrays as lists): what advantages and
    the trainer consume, e.g. `compute_advantages(problem_id=c.problem_id, rollout=c.rollout,
    role=c.role, slot=c.slot, turn=c.turn, episode_reward=c.reward, role_reward=c.correct,
    split_slots=rollout.slot_grouped_roles)`."""

    role: np.ndarray  # str [N]
    set_name: np.ndarray  # str [N]
    prompt_ids: list[np.ndarray]  # int32 each
    response_ids: list[np.ndarray]  # int32 each
    logprobs: list[np.ndarray]  # float32 each, aligned with response_ids
    episode: np.ndarray  # int32 [N]
    problem_index: np.ndarray  # int32 [N]
    problem_id: np.ndarray  # str [N]
    rollout: np.ndarray  # int32 [N]
    slot: np.ndarray  # int32 [N]
    turn: np.ndarray  # int32 [N]
    reward: np.ndarray  # float32 [N]: the episode's reward broadcast to the call (outcome broadcast)
    correct: np.ndarray  # float32 [N]: the call's own re-graded correctness, NaN where undefined
    truncated: np.ndarray  # bool [N]
    parse_failed: np.ndarray  # bool [N]


@dataclasses.dataclass(frozen=True)
class Rollout:
    """The result of running a workflow on a batch: every call and every episode."""

    workflow: str
    graded_roles: frozenset[str]
    slot_grouped_roles: frozenset[str]
    n_problems: int
    calls: tuple[CallRecord, ...]
    episodes: tuple[Episode, ...]
    sampler_calls: int

    def columns(self, role: str | None = None) -> CallColumns:
        """Flat per-call arrays of every call, or of one role's calls."""
        return _columns([c for c in self.calls if role is None or c.role == role], self.episodes)

    def transcripts(self) -> list[dict[str, Any]]:
        """One JSON-able dict per episode: the outcome and every call's chat and response."""
        return [_transcript(e, [self.calls[i] for i in e.call_ids], self.workflow) for e in self.episodes]

    @staticmethod
    def concat(parts: Sequence[Rollout]) -> Rollout:
        """Join rollouts of one workflow over disjoint problem batches; indices are offset."""
        if not parts:
            raise ValueError("Rollout.concat needs at least one rollout.")
        if len({p.workflow for p in parts}) != 1:
            raise ValueError(f"Rollout.concat: mixed workflows {sorted({p.workflow for p in parts})}.")
        calls: list[CallRecord] = []
        episodes: list[Episode] = []
        n_problems = 0
        for p in parts:
            ep0, call0 = len(episodes), len(calls)
            calls += [dataclasses.replace(c, episode=c.episode + ep0,
                                          problem_index=c.problem_index + n_problems) for c in p.calls]
            episodes += [dataclasses.replace(e, id=e.id + ep0, problem_index=e.problem_index + n_problems,
                                             call_ids=tuple(i + call0 for i in e.call_ids))
                         for e in p.episodes]
            n_problems += p.n_problems
        return Rollout(parts[0].workflow, parts[0].graded_roles, parts[0].slot_grouped_roles, n_problems,
                       tuple(calls), tuple(episodes), sum(p.sampler_calls for p in parts))


@dataclasses.dataclass(frozen=True)
class SamplerStage:
    """One sampler round of an episode in its longest case, as the experiment matrix prices it: `calls`
    calls of `role`, each prompt holding the problem, `responses` earlier full responses and `notes` short
    texts of a few lines (an Orch-Workers strategy each)."""

    role: str
    calls: int
    responses: int = 0
    notes: int = 0


@dataclasses.dataclass(frozen=True)
class Workflow:
    """A multi-agent workflow: a pure description of an episode's role calls, and its declaration.

    Subclasses set `name`, `roles`, `graded_roles` (roles whose own output is a complete answer, re-graded
    for per-role accuracy), `slot_grouped_roles` (parallel same-role slots that stay separate GRPO
    groups under the paper preset), `max_prompt_tokens` (the paper's prompt cap by problem kind) and
    `paper_matrix` (one of the paper's workflows, a row of the experiment matrix);
    implement `episode` and `sampler_stages`, and `same_role_counts` when a role runs in parallel; and
    register with `workflows.registry.register`. Its options are its dataclass fields (config keys
    `workflow.<field>`). `worked_example`: the solve and worker prompts show one worked example of the
    answer format (for small models; the paper's prompts are zero-shot); `supervisor_example`: so do the
    aggregator's, orchestrator's and synthesizer's.
    """

    worked_example: bool = False
    supervisor_example: bool = False

    name: ClassVar[str]
    roles: ClassVar[tuple[str, ...]]
    graded_roles: ClassVar[frozenset[str]] = frozenset()
    slot_grouped_roles: ClassVar[frozenset[str]] = frozenset()
    max_prompt_tokens: ClassVar[Mapping[str, int]]
    paper_matrix: ClassVar[bool] = False  # one of the paper's workflows: a row of `marljax.matrix`

    def same_role_counts(self) -> dict[str, int]:
        """N parallel same-role agents per role that has them (voters, workers), for `rl.same_role_scale`."""
        return {}

    def sampler_stages(self, kind: str) -> tuple[SamplerStage, ...]:
        """The episode's sampler rounds in order, in the longest case (every iteration and subtask runs)."""
        raise NotImplementedError

    def prompts(self, kind: str) -> PromptSet:
        """This workflow's prompt set for a problem kind."""
        return prompt_set(kind, self.worked_example, self.supervisor_example)

    def episode(self, problem: Problem) -> EpisodeScript:
        """The episode script: yields stages of `RoleCall`s, receives their texts, returns an `Outcome`."""
        raise NotImplementedError

    def parse_failed(self, role: str, text: str, kind: str) -> bool:
        """Whether an output lacks the form its role must produce. Default: an answer (`\\boxed{}` for
        math, a fenced code block for code); workflows override it for their supervisory roles."""
        return answer_missing(text, kind)

    def score_calls(self, calls: Sequence[CallRecord], grade: Callable[[str], float]) -> list[float | None]:
        """Per-call correctness of one episode for metrics; `grade(text)` looks up a precomputed grade
        (available for the texts of `graded_roles`). Default: graded roles get their grade, others None."""
        return [grade(c.text) if c.role in self.graded_roles else None for c in calls]


def answer_missing(text: str, kind: str) -> bool:
    """True when an answer text gives the grader nothing (the problem kind's `answer_missing`: math no
    non-empty `\\boxed{}`, code no program)."""
    return problem_kind(kind).answer_missing(text)


def last_boxed(text: str, content: str) -> str | None:
    """Content of the last `\\boxed{X}` (or `\\boxed{\\text{X}}`) in `text` whose X fully matches the
    regex `content`, case-insensitive; None if there is none (the evaluator's verdict; the aggregator's
    choice is read as the paper's parser does, `voting.parse_choice`)."""
    pattern = rf"\\boxed\s*\{{\s*(?:\\text\w*\s*\{{\s*({content})\s*\}}|({content}))\s*\}}"
    matches = list(re.finditer(pattern, text, re.IGNORECASE))
    if not matches:
        return None
    return matches[-1].group(1) or matches[-1].group(2)


def stage_seed(seed: int, stage: int, set_name: str) -> int:
    """A distinct, deterministic 31-bit seed for one (stage, parameter set) sampler call."""
    words = [seed & 0xFFFFFFFF, seed >> 32 & 0xFFFFFFFF, stage, zlib.crc32(set_name.encode())]
    return int(np.random.SeedSequence(words).generate_state(1)[0]) & 0x7FFFFFFF


def call_seed(seed: int, episode: int, stage: int, index: int) -> int:
    """A distinct, deterministic 31-bit seed for one role call: call `index` of stage `stage` of episode
    `episode` (what a streaming sampler draws that call from, whatever else is in flight)."""
    words = [seed & 0xFFFFFFFF, seed >> 32 & 0xFFFFFFFF, episode, stage, index]
    return int(np.random.SeedSequence(words).generate_state(1)[0]) & 0x7FFFFFFF


class StreamSampler(Protocol):
    """What `rollout` drives: role calls submitted one at a time as episodes reach them, completions taken
    as they finish (the rollout engine: no stage waits for another episode's calls)."""

    calls: int  # sampler calls (or decode rounds) made so far, for `Rollout.sampler_calls`

    def submit(self, set_name: str, prompt: list[int], seed: int) -> int:
        """Queue one request from set `set_name`, drawn with `seed` (`call_seed`); returns its ticket."""
        ...

    def poll(self) -> list[tuple[int, Completion]]:
        """Run until at least one queued request is done; return (ticket, completion) of every done one."""
        ...


class BatchedSampleFn:
    """A `SampleFn` as a `StreamSampler`: each `poll` samples everything queued, one `sample_fn` call per
    parameter set (sorted by name, prompts in submission order) with `stage_seed(seed, round, set)`. Under
    `rollout` every episode then advances one stage per poll, in lockstep; per-call seeds are unused."""

    def __init__(self, sample_fn: SampleFn, seed: int):
        self.sample_fn, self.seed = sample_fn, seed
        self.queue: list[tuple[int, str, list[int]]] = []
        self.calls = self.round = self.submitted = 0

    def submit(self, set_name: str, prompt: list[int], seed: int) -> int:
        self.submitted += 1
        self.queue.append((self.submitted, set_name, prompt))
        return self.submitted

    def poll(self) -> list[tuple[int, Completion]]:
        queue, self.queue = self.queue, []
        done = []
        for set_name in sorted({s for _, s, _ in queue}):
            tickets = [t for t, s, _ in queue if s == set_name]
            prompts = [p for _, s, p in queue if s == set_name]
            samples = self.sample_fn(set_name, prompts, stage_seed(self.seed, self.round, set_name))
            if len(samples) != len(prompts):
                raise ValueError(f"sample_fn({set_name!r}) returned {len(samples)} samples for {len(prompts)} "
                                 "prompts.")
            done += zip(tickets, samples)
            self.calls += 1
        self.round += 1
        return done


@dataclasses.dataclass
class _Stage:
    """An episode's stage in flight: its calls, their prompt ids and the completions received so far."""

    index: int
    calls: list[RoleCall]
    prompts: list[list[int]]
    results: list[Completion | None]


def rollout(
    workflow: Workflow,
    problems: Sequence[Problem],
    sampler: SampleFn | StreamSampler,
    codec: ChatCodec,
    route: Mapping[str, str],
    *,
    n_rollouts: int = 1,
    seed: int = 0,
    reward_fn: RewardFn = grade_serially,
    grade_calls: bool = True,
    max_prompt_tokens: int | None = None,
) -> Rollout:
    """Run `n_rollouts` episodes of `workflow` per problem; episode `i * n_rollouts + r` is rollout r of
    problems[i].

    Each episode advances on its own: the calls of its next stage are submitted to the sampler as soon as
    its current stage's completions are all back, with no barrier across episodes. A `StreamSampler`
    draws call k of stage s of episode e with `call_seed(seed, e, s, k)`, so a call's output depends on its
    prompt and that seed only, never on the other episodes or the order they finish in. A plain `SampleFn`
    is driven in lockstep (`BatchedSampleFn`: one call per stage and parameter set, seeded
    `stage_seed(seed, stage, set)`). Calls are recorded in (stage, episode, call) order either way.
    Afterwards `reward_fn` grades, in one call, every episode's final answer and, if `grade_calls`, the
    outputs of `workflow.graded_roles` (for per-role metrics only; rewards are the final answer's).

    `max_prompt_tokens` (None or 0: no cap): as in the paper, a longer prompt ends the episode. No call
    of that stage of the episode is sampled; the episode keeps the calls it made before, its final
    answer is "" and its reward 0, and it is flagged `prompt_overflow`.
    """
    missing = [r for r in workflow.roles if r not in route]
    if missing:
        raise ValueError(f"route has no parameter set for role(s) {missing} of workflow "
                         f"{workflow.name!r}; route = {dict(route)}")
    if n_rollouts < 1:
        raise ValueError(f"n_rollouts must be >= 1, got {n_rollouts}")
    stream = sampler if hasattr(sampler, "submit") else BatchedSampleFn(sampler, seed)
    calls_before = stream.calls
    driver = _EpisodeDriver(workflow, problems, stream, codec, route, n_rollouts, seed, max_prompt_tokens)
    calls, episode_calls = driver.run()
    return _grade(workflow, problems, driver.owners, calls, episode_calls, driver.outcomes, driver.overflow,
                  stream.calls - calls_before, reward_fn, grade_calls)


class _EpisodeDriver:
    """The episodes of one `rollout` in flight: each submits its next stage as soon as its current one is
    back (`start`, `finish`), until every script has returned its outcome."""

    def __init__(self, workflow, problems, stream, codec, route, n_rollouts, seed, max_prompt_tokens):
        self.workflow, self.problems, self.stream, self.codec, self.route = workflow, problems, stream, codec, route
        self.seed, self.max_prompt_tokens = seed, max_prompt_tokens
        self.owners = [(i, r) for i in range(len(problems)) for r in range(n_rollouts)]
        self.scripts = [workflow.episode(problems[i]) for i, _ in self.owners]
        self.records: dict[tuple[int, int, int], CallRecord] = {}  # (stage, episode, call) -> record
        self.outcomes: dict[int, Outcome] = {}
        self.overflow: set[int] = set()
        self.stages: dict[int, _Stage] = {}  # episode -> its stage in flight
        self.tickets: dict[int, tuple[int, int]] = {}  # ticket -> (episode, call index in its stage)

    def run(self) -> tuple[list[CallRecord], list[list[int]]]:
        """Drive every episode to its end. Returns the calls in (stage, episode, call) order and each
        episode's indices into them."""
        for e, script in enumerate(self.scripts):
            self.start(e, 0, _first_stage(script, self.workflow))
        while self.tickets:
            done = self.stream.poll()
            if not done:
                raise RuntimeError(f"the sampler returned nothing with {len(self.tickets)} requests outstanding.")
            for e in sorted(self.receive(done)):
                self.finish(e)
        calls: list[CallRecord] = []
        episode_calls: list[list[int]] = [[] for _ in self.owners]
        for key in sorted(self.records):
            episode_calls[key[1]].append(len(calls))
            calls.append(self.records[key])
        return calls, episode_calls

    def receive(self, done: list[tuple[int, Completion]]) -> set[int]:
        """File completions under their calls; returns the episodes whose stage is now complete."""
        complete = set()
        for ticket, sample in done:
            e, k = self.tickets.pop(ticket)
            if len(sample.tokens) != len(sample.logprobs):
                raise ValueError(f"the sampler returned {len(sample.tokens)} tokens but {len(sample.logprobs)} "
                                 f"logprobs for one sample (set {self.route[self.stages[e].calls[k].role]!r}).")
            self.stages[e].results[k] = sample
            if all(x is not None for x in self.stages[e].results):
                complete.add(e)
        return complete

    def start(self, e: int, index: int, stage_calls: list[RoleCall]) -> None:
        """Submit stage `index` of episode e, or end the episode when a prompt is over the cap."""
        prompts = [self.codec.render([dict(m) for m in c.messages]) for c in stage_calls]
        if self.max_prompt_tokens and any(len(p) > self.max_prompt_tokens for p in prompts):
            self.scripts[e].close()
            self.outcomes[e] = Outcome("", {})
            self.overflow.add(e)
            return
        self.stages[e] = _Stage(index, stage_calls, prompts, [None] * len(stage_calls))
        for k, (c, p) in enumerate(zip(stage_calls, prompts)):
            self.tickets[self.stream.submit(self.route[c.role], p, call_seed(self.seed, e, index, k))] = (e, k)

    def finish(self, e: int) -> None:
        """Record episode e's completed stage and send its texts to the script."""
        st = self.stages.pop(e)
        i, r = self.owners[e]
        p = self.problems[i]
        texts = []
        for k, (call, prompt, sample) in enumerate(zip(st.calls, st.prompts, st.results)):
            text = self.codec.decode(list(sample.tokens))
            self.records[(st.index, e, k)] = CallRecord(
                episode=e, problem_index=i, problem_id=p.id, rollout=r, role=call.role, slot=call.slot,
                turn=call.turn, stage=st.index, set_name=self.route[call.role], messages=call.messages,
                prompt_ids=list(prompt), response_ids=list(sample.tokens), logprobs=list(sample.logprobs),
                text=text, truncated=bool(sample.truncated),
                parse_failed=self.workflow.parse_failed(call.role, text, p.kind))
            texts.append(text)
        try:
            nxt = self.scripts[e].send(texts)
        except StopIteration as stop:
            self.outcomes[e] = _checked_outcome(stop.value, self.workflow)
            return
        self.start(e, st.index + 1, _checked_stage(nxt, self.workflow))


def _first_stage(script: EpisodeScript, workflow: Workflow) -> list[RoleCall]:
    try:
        return _checked_stage(next(script), workflow)
    except StopIteration:
        raise ValueError(f"Workflow {workflow.name!r} ended an episode without any role call.") from None


def _checked_stage(stage: list[RoleCall], workflow: Workflow) -> list[RoleCall]:
    if not stage:
        raise ValueError(f"Workflow {workflow.name!r} yielded an empty stage.")
    bad = [c.role for c in stage if c.role not in workflow.roles]
    if bad:
        raise ValueError(f"Workflow {workflow.name!r} called undeclared role(s) {bad}; roles = {workflow.roles}")
    return stage


def _checked_outcome(outcome: Any, workflow: Workflow) -> Outcome:
    if not isinstance(outcome, Outcome):
        raise TypeError(f"Workflow {workflow.name!r} episode returned {type(outcome).__name__}, not Outcome.")
    return outcome


def _grade(workflow, problems, owners, calls, episode_calls, outcomes, overflow, sampler_calls, reward_fn,
           grade_calls):
    """One batched `reward_fn` call over the distinct (problem, text) pairs: final answers (but those of
    `overflow` episodes, whose reward is 0) and, if asked, the outputs of graded roles. Fills episode
    rewards and per-call correctness."""
    wanted = {(owners[e][0], o.final): None for e, o in outcomes.items() if e not in overflow}
    if grade_calls:
        wanted.update({(c.problem_index, c.text): None for c in calls if c.role in workflow.graded_roles})
    keys = list(wanted)
    scores = reward_fn([problems[i] for i, _ in keys], [t for _, t in keys]) if keys else []
    if len(scores) != len(keys):
        raise ValueError(f"reward_fn returned {len(scores)} rewards for {len(keys)} texts.")
    grades = {k: float(s) for k, s in zip(keys, scores)}
    calls = list(calls)
    episodes = []
    for e, (i, r) in enumerate(owners):
        if grade_calls:
            ep_calls = [calls[k] for k in episode_calls[e]]
            correct = workflow.score_calls(ep_calls, lambda text, i=i: grades[(i, text)])
            for k, c in zip(episode_calls[e], correct):
                calls[k] = dataclasses.replace(calls[k], correct=c)
        o = outcomes[e]
        episodes.append(Episode(id=e, problem_index=i, problem_id=problems[i].id, rollout=r, final=o.final,
                                reward=0.0 if e in overflow else grades[(i, o.final)], info=o.info,
                                call_ids=tuple(episode_calls[e]), prompt_overflow=e in overflow))
    return Rollout(workflow.name, frozenset(workflow.graded_roles), frozenset(workflow.slot_grouped_roles),
                   len(problems), tuple(calls), tuple(episodes), sampler_calls)


def _columns(calls: list[CallRecord], episodes: Sequence[Episode]) -> CallColumns:
    def ints(field: str) -> np.ndarray:
        return np.asarray([getattr(c, field) for c in calls], np.int32)

    def strs(field: str) -> np.ndarray:
        return np.asarray([getattr(c, field) for c in calls], np.str_)

    return CallColumns(
        role=strs("role"), set_name=strs("set_name"),
        prompt_ids=[np.asarray(c.prompt_ids, np.int32) for c in calls],
        response_ids=[np.asarray(c.response_ids, np.int32) for c in calls],
        logprobs=[np.asarray(c.logprobs, np.float32) for c in calls],
        episode=ints("episode"), problem_index=ints("problem_index"), problem_id=strs("problem_id"),
        rollout=ints("rollout"), slot=ints("slot"), turn=ints("turn"),
        reward=np.asarray([episodes[c.episode].reward for c in calls], np.float32),
        correct=np.asarray([np.nan if c.correct is None else c.correct for c in calls], np.float32),
        truncated=np.asarray([c.truncated for c in calls], bool),
        parse_failed=np.asarray([c.parse_failed for c in calls], bool),
    )


def _transcript(e: Episode, calls: list[CallRecord], workflow: str) -> dict[str, Any]:
    return {
        "workflow": workflow, "episode": e.id, "problem_id": e.problem_id, "rollout": e.rollout,
        "reward": e.reward, "final": e.final, "info": e.info, "prompt_overflow": e.prompt_overflow,
        "calls": [{"role": c.role, "slot": c.slot, "turn": c.turn, "stage": c.stage, "set": c.set_name,
                   "messages": [dict(m) for m in c.messages], "response": c.text,
                   "response_tokens": len(c.response_ids), "truncated": c.truncated,
                   "parse_failed": c.parse_failed, "correct": c.correct} for c in calls],
    }
