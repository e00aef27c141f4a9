"""Adding a workflow is one file and one registration: a fifth workflow defined here, registered in one
line, runs under `rollout`, is accepted by config validation with its own options, and is priced by the
matrix per role, all from its declaration; the registration is undone afterwards."""
from __future__ import annotations

import dataclasses

import pytest
from test_workflows import CODEC, ScriptedPolicy, fake_reward, problem

from marljax import matrix
from marljax.config import Config, ConfigError, load_config, resolve, to_dict
from marljax.workflows import WORKFLOWS, register, rollout
from marljax.workflows.base import EpisodeScript, Outcome, RoleCall, SamplerStage, Workflow, user


@dataclasses.dataclass(frozen=True)
class Relay(Workflow):
    """`n_drafts` drafters answer in parallel; an editor sees every draft and writes the final answer."""

    n_drafts: int = 2

    name = "relay"
    roles = ("drafter", "editor")
    graded_roles = frozenset({"drafter"})
    max_prompt_tokens = {"math": 12288, "code": 8192}

    def __post_init__(self):
        if self.n_drafts < 1:
            raise ValueError(f"n_drafts must be >= 1, got {self.n_drafts}")

    def same_role_counts(self) -> dict[str, int]:
        return {"drafter": self.n_drafts}

    def sampler_stages(self, kind: str) -> tuple[SamplerStage, ...]:
        return SamplerStage("drafter", self.n_drafts), SamplerStage("editor", 1, responses=self.n_drafts)

    def episode(self, problem) -> EpisodeScript:
        ask = (user(problem.question),)
        drafts = yield [RoleCall("drafter", slot, 0, ask) for slot in range(self.n_drafts)]
        [final] = yield [RoleCall("editor", 0, 0, (user("Edit: " + " | ".join(drafts)),))]
        return Outcome(final, {"n_drafts": self.n_drafts})


@pytest.fixture
def relay():
    register(Relay)  # the one line a new workflow adds
    try:
        yield Relay
    finally:
        del WORKFLOWS[Relay.name]


def test_a_registered_workflow_runs_validates_and_is_priced(relay):
    with pytest.raises(ValueError, match="workflow 'relay' is already registered"):
        register(Relay)  # a name is registered once
    # rollout, with a scripted policy
    policy = ScriptedPolicy(lambda role, slot, turn, msgs: f"{role} {slot}: \\boxed{{42}}")
    out = rollout(Relay(n_drafts=3), [problem()], policy, CODEC, {"drafter": "d", "editor": "e"},
                  reward_fn=fake_reward)
    assert [(c.role, c.slot, c.stage) for c in out.calls] == [("drafter", 0, 0), ("drafter", 1, 0),
                                                             ("drafter", 2, 0), ("editor", 0, 1)]
    assert out.episodes[0].reward == 1.0 and out.sampler_calls == 2
    # config: its options are keys, validated at load; its roles serve kl_beta and policy maps
    cfg = load_config(None, ["workflow=relay", "workflow.n_drafts=3", "rl.kl_beta.editor=0.01",
                             "policy.drafter=a", "policy.editor=b", "rl.same_role_scale=true"])
    assert cfg.workflow.build() == Relay(n_drafts=3) and to_dict(cfg)["workflow"]["n_drafts"] == 3
    step = cfg.rl.step({"drafter": "a", "editor": "b"}, cfg.workflow.build().same_role_counts(), 0.7, 0.5)
    assert step.role_scale == (("drafter", 1 / 3),)
    assert resolve(cfg).sampling.max_prompt_tokens == 12288  # the paper-style cap it declares
    assert Config().workflow.n_drafts == 2  # the default is the workflow's
    with pytest.raises(ConfigError, match="n_drafts must be >= 1"):
        load_config(None, ["workflow=relay", "workflow.n_drafts=0"])
    with pytest.raises(ConfigError, match=r"rl\.kl_beta names roles \['generator'\]"):
        load_config(None, ["workflow=relay", "rl.kl_beta.generator=0.01"])
    # the matrix's per-role accounting reads the declaration
    cell = matrix.Cell("relay", "math", "qwen3-0.6b", "isolated")
    assert cell.roles == ("drafter", "editor") and cell.n_sets == 2
    q, r = matrix.PROMPT_TOKENS["math"], 5120
    assert cell.stages() == [matrix.Stage("drafter", 2, q), matrix.Stage("editor", 1, min(q + 2 * r, 12288))]
    est = matrix.estimate(cell, matrix.ACCELERATORS["h100"])
    assert est.train_s > 0 and est.sample_s > 0 and est.memory.grads == est.memory.lora  # 2 roles, 2 sets


def test_the_registration_is_undone():
    assert "relay" not in WORKFLOWS and not hasattr(Config().workflow, "n_drafts")
    with pytest.raises(ConfigError, match=r"workflow\.name='relay' is not one of"):
        load_config(None, ["workflow=relay"])
    with pytest.raises(ConfigError, match="Unknown config key 'workflow.n_drafts'"):
        load_config(None, ["workflow.n_drafts=3"])
