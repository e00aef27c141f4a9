"""Config sections → the runtime parts every entry point builds alike (`train`, `evaluate`, `aot`, bench/).

  build_problems(cfg)   the training, held-out and validation problems (`Problems`)
  build_policy(cfg)     mesh and sharding rules, the base model loaded onto them, the chat codec and the
                        LoRA format (`Policy`); `abstract_policy` the same with the model as shapes (aot)
  build_workflow(cfg)   the workflow (`cfg.workflow.build()`) and its policy map (role → parameter set)
  build_trainer(...)    the jitted `Trainer` (`cfg.rl.step(...)`, `cfg.optim.build()`) and the shardings of
                        its `TrainState` (`state_shardings`); `fresh_params` the parameter sets it starts from
  Policy.sampler        the policy sampler over per-set weights (`cfg.sampling.build(...)`), and
  Policy.rollout_sampler  the same as the workflows' `StreamSampler` (`EngineSampler`)

A config section builds its own runtime object (`cfg.lora.build()`, `cfg.sampling.build(...)`, …); this
module wires those objects together, so `train` runs what `aot` compiles and `evaluate` samples from what
`train` trained. The config must be resolved (`marljax.config.resolve`).
"""
from __future__ import annotations

import dataclasses

import jax
import numpy as np
from flax import nnx

from marljax.config import Config, ConfigError
from marljax.core import sharding
from marljax.models import load_model, load_tokenizer
from marljax.models.decoder import Decoder, ModelConfig, trainable_params
from marljax.models.lora import LoRAConfig, init_lora
from marljax.models.tokenizer import ChatCodec
from marljax.rl import policy_map as pm
from marljax.rl.state import TrainState
from marljax.rl.step import Trainer
from marljax.sampling.policy_sampler import PolicySampler
from marljax.tasks.data import load_task, validation_split
from marljax.tasks.sandbox import require as require_sandbox
from marljax.workflows import Completion, Workflow


@dataclasses.dataclass
class Problems:
    """The training, held-out (test) and validation problems (empty without `task.val_n`), and the step-0
    record of how code is graded (empty without code)."""

    train: list
    eval: list
    run_info: dict
    val: list = dataclasses.field(default_factory=list)

    def batch(self, step: int, per_step: int, seed: int) -> list:
        """Problems of training step `step` (1-based), `per_step` of them: a permutation per epoch seeded by
        (`seed`, epoch), so a resumed run draws the same."""
        n = len(self.train)
        out = []
        for i in range((step - 1) * per_step, step * per_step):
            epoch, pos = divmod(i, n)
            perm = np.random.default_rng([seed, epoch]).permutation(n)
            out.append(self.train[perm[pos]])
        return out


def build_problems(cfg: Config) -> Problems:
    """The task's problems; code grading fails closed here, before any rollout (bwrap must work unless
    `task.sandbox=rlimits` is asked for)."""
    opts = dict(cfg.task.options)
    limit = None if cfg.task.train_size is None else cfg.task.train_size + cfg.task.val_n
    train_problems = load_task(cfg.task.name, path=cfg.task.path, split="train", seed=cfg.task.split_seed,
                               limit=limit, sandbox=cfg.task.sandbox, **opts)
    eval_problems = load_task(cfg.task.name, path=cfg.task.path, split="test", seed=cfg.task.split_seed,
                              limit=cfg.task.eval_n, sandbox=cfg.task.sandbox, **opts)
    val_problems, train_problems = validation_split(train_problems, eval_problems, cfg.task.val_n)
    code = any(p.kind == "code" for p in train_problems + eval_problems)
    run_info = {"sandbox/mode": require_sandbox(cfg.task.sandbox)} if code else {}  # step-0 record
    if not train_problems:
        raise ConfigError(f"task {cfg.task.name!r} gave no training problems.")
    return Problems(train_problems, eval_problems, run_info, val_problems)


def build_workflow(cfg: Config) -> tuple[Workflow, pm.PolicyMap]:
    """(the workflow, its policy map: which parameter set each role trains)."""
    workflow = cfg.workflow.build()
    return workflow, pm.from_config(cfg.policy, workflow.roles)


# ---- the policy: the model every parameter set adapts --------------------------------------------
def fresh_params(model: Decoder, lora_cfg: LoRAConfig | None, seed: int, sets: tuple[str, ...]) -> dict:
    """Step-0 parameters of every set, unplaced: {set: LoRA adapter with B = 0} (keys folded from `seed`),
    or under full fine-tuning (`lora_cfg` None) {set: float32 copies of the base's weights}. Traceable:
    `jax.eval_shape` gives their shapes without allocating."""
    key = jax.random.key(seed)
    if lora_cfg is not None:
        return {s: init_lora(model.config, lora_cfg, jax.random.fold_in(key, i)) for i, s in enumerate(sets)}
    return {s: trainable_params(model) for s in sets}  # float32 master weights


@dataclasses.dataclass
class Policy:
    """The model every parameter set adapts: its mesh and sharding rules, the frozen base, the chat codec
    (None where nothing is sampled: `abstract_policy`), the LoRA format (None: full fine-tuning, a set
    is the whole model) and whether LoRA sets are replicated rather than sharded (`mesh.lora`)."""

    mesh: jax.sharding.Mesh
    rules: dict
    model: Decoder
    codec: ChatCodec | None
    lora_cfg: LoRAConfig | None
    replicate_lora: bool = False

    @property
    def lora_scale(self) -> float | None:
        return self.lora_cfg.scale if self.lora_cfg is not None else None

    def init_params(self, cfg: Config, sets: tuple[str, ...]) -> dict:
        """Fresh parameters of every set (`fresh_params`), placed on the mesh (`param_shardings`)."""
        params = fresh_params(self.model, self.lora_cfg, cfg.seed, sets)
        return jax.device_put(params, self.param_shardings(params))

    def param_shardings(self, params: dict) -> dict:
        """{set: the shardings of its parameters} (arrays or shapes)."""
        return {s: sharding.trainable_shardings(p, self.model, self.mesh, self.rules,
                                                replicate_lora=self.replicate_lora) for s, p in params.items()}

    def sampler(self, cfg: Config, params: dict) -> PolicySampler:
        """A sampler over `params` ({set: parameters}) with the run's sampling settings."""
        settings = cfg.sampling.build(tuple(self.codec.stop_token_ids))
        return PolicySampler(self.model, params, self.lora_scale, self.mesh, self.rules, settings)

    def rollout_sampler(self, cfg: Config, params: dict, temperature: float) -> EngineSampler:
        """What the workflows sample from over `params` at `temperature`: role calls stream through the
        rollout engine as episodes reach them."""
        return EngineSampler(self.sampler(cfg, params).stream(temperature))


def build_policy(cfg: Config) -> Policy:
    """Mesh, rules, the base model loaded onto them, the codec and the LoRA format of a resolved config."""
    mesh = sharding.make_mesh(cfg.mesh)
    rules = sharding.get_rules(cfg.mesh, mesh)
    model = load_model(cfg.model, dtype=cfg.dtype, seed=cfg.seed, param_dtype=cfg.param_dtype,
                       shardings=sharding.variable_sharding(mesh, rules))
    codec = ChatCodec(load_tokenizer(cfg.model))
    return Policy(mesh, rules, model, codec, cfg.lora.build(), cfg.mesh.lora == "replicated")


def abstract_policy(cfg: Config, model_cfg: ModelConfig, devices=None) -> Policy:
    """`build_policy`'s parts for a model of `model_cfg` as shapes (`nnx.eval_shape`: nothing allocated, no
    tokenizer), on `devices` (default: JAX's), for compiling ahead of time."""
    mesh = sharding.make_mesh(cfg.mesh, devices=devices)
    rules = sharding.get_rules(cfg.mesh, mesh)
    model = nnx.eval_shape(lambda: Decoder(model_cfg, rngs=nnx.Rngs(0)))
    return Policy(mesh, rules, model, None, cfg.lora.build(), cfg.mesh.lora == "replicated")


class EngineSampler:
    """A `PolicyStream` as the workflows' `StreamSampler`: its results as `Completion`s."""

    def __init__(self, stream):
        self.stream = stream

    @property
    def calls(self) -> int:
        return self.stream.calls

    def submit(self, set_name: str, prompt: list[int], seed: int) -> int:
        return self.stream.submit(set_name, prompt, seed)

    def poll(self) -> list[tuple[int, Completion]]:
        return [(t, Completion(tokens, logprobs, not hit)) for t, (tokens, logprobs, hit) in self.stream.poll()]

    def close(self) -> None:
        """Free the rollout's KV pools, dense caches and merged weights now, before the update needs the
        memory (on an accelerator they would otherwise meet its temporaries until Python collects them)."""
        self.stream.close(release=True)


# ---- the trainer ---------------------------------------------------------------------------------
def build_trainer(cfg: Config, policy: Policy, workflow: Workflow, policy_map: pm.PolicyMap, params: dict,
                  **step) -> tuple[Trainer, TrainState]:
    """The jitted trainer of `workflow`'s roles over `policy`'s model (`cfg.rl.step(...)`, `cfg.optim.build()`)
    and the shardings of its `TrainState` for `params` ({set: parameters}, arrays or shapes); `step`:
    `StepConfig` fields that replace the config's (aot: `attention`, `logprob_bytes`). The state itself:
    `trainer.init_state(params)` placed on these shardings (`init_state`), or its shapes (`jax.eval_shape`)."""
    route = dict(policy_map.route)
    step_cfg = cfg.rl.step(route, workflow.same_role_counts(), cfg.sampling.temperature, policy.lora_scale)
    if step:
        step_cfg = dataclasses.replace(step_cfg, **step)
    optimizer = cfg.optim.build()
    state_sh = state_shardings(policy, optimizer, params, route if step_cfg.damping_lambda > 0 else {})
    metrics_sh = sharding.replicated(policy.mesh)
    return Trainer(policy.model, step_cfg, optimizer, out_shardings=(state_sh, metrics_sh)), state_sh


def state_shardings(policy: Policy, optimizer, params: dict, ema_route: dict[str, str]) -> TrainState:
    """The shardings of a `TrainState` over `params` ({set: parameters}, arrays or shapes) on `policy`'s mesh:
    each set's parameters (`Policy.param_shardings`) and its `optimizer` state laid out like them, an EMA
    per damped role (`ema_route`: {role: its set}) like its set, the step counter replicated."""
    p_sh = policy.param_shardings(params)
    o_sh = {s: sharding.optimizer_shardings(optimizer, x, p_sh[s], policy.mesh) for s, x in params.items()}
    return TrainState(p_sh, o_sh, {r: p_sh[s] for r, s in ema_route.items()}, sharding.replicated(policy.mesh))


def init_state(trainer: Trainer, params: dict, shardings: TrainState) -> TrainState:
    """The step-0 `TrainState` of `params`, placed on `shardings` (`build_trainer`'s)."""
    return jax.device_put(trainer.init_state(params), shardings)
