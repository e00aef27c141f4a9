"""Dataclass configs for `train` and `evaluate`: YAML files plus dotted `key=value` overrides.

The config is the entry layer: each section takes its defaults from the runtime object it builds
(`LossConfig`, `AdvantageConfig`, `StepConfig`, `LoRAConfig`, `CliffConfig`, the workflow classes), so a
default is written once, and builds it (`cfg.rl.loss()`, `cfg.rl.advantages()`, `cfg.rl.step(...)`,
`cfg.optim.build()`, `cfg.lora.build()`, `cfg.diagnostics.cliff()`, `cfg.workflow.build()`). The
dataclass defaults are the paper's settings (SPEC §1). A few of the paper's values depend on the task
and the workflow (response and prompt lengths, Eval-Opt's iterations); their keys default to `None`,
which `resolve` fills from `marljax.workflows.limits` and the workflow's declaration. The CPU demo is a
file, `configs/default.yaml`; `cli_config` is the command line's rule for which base a run starts from.

Unknown keys fail with close-match suggestions; values are parsed as YAML scalars and checked against
the field's type. A section with a `name` field also takes a bare value (`task=arith` sets
`task.name`), so both `task=gsm8k` and `task.path=data/gsm8k` work. `load_config` then checks every
enumerated value against the registry or choice set that serves it, and the cross-field rules
(`validate`), before anything is loaded.
"""
from __future__ import annotations

import copy
import dataclasses
import difflib
import functools
import pathlib
import typing
from collections.abc import Callable, Collection, Mapping
from typing import Any

import yaml
from etils import epath

from marljax.core.sharding import LORA_PLACEMENTS, RULES, MeshConfig
from marljax.core.storage import is_remote
from marljax.models.attention import ATTENTIONS
from marljax.models.decoder import REMAT
from marljax.models.lora import ALL_LINEAR, LoRAConfig
from marljax.models.precision import DTYPES
from marljax.rl import policy_map as pm
from marljax.rl.advantages import REWARD_ROUTINGS, AdvantageConfig, get_estimator, get_group_key
from marljax.rl.diagnostics import CliffConfig
from marljax.rl.losses import LossConfig, get_aggregation
from marljax.rl.schedules import SCHEDULES, lr_at
from marljax.rl.step import MINIBATCH_MODES, OPTIMIZERS, ROLE_WEIGHTINGS, StepConfig, make_optimizer
from marljax.sampling import SamplingParams
from marljax.sampling.engine.engine import CHUNK_STEPS, NUM_SLOTS, PREFILL_CHUNK_MIN
from marljax.sampling.engine.paged_attention import PAGED_ATTENTIONS
from marljax.sampling.engine.scheduler import ADMISSIONS
from marljax.sampling.policy_sampler import SamplerSettings
from marljax.tasks.data import TASKS, task_kind
from marljax.tasks.sandbox import MODES as SANDBOX_MODES
from marljax.workflows import WORKFLOWS, Workflow, paper_limits, workflow_class

DEMO_CONFIG = pathlib.Path(__file__).resolve().parent.parent / "configs" / "default.yaml"
PAPER_BASE = "paper defaults"
ALL_LINEAR_KEY = "all-linear"  # lora.targets=[all-linear]: every linear map (`models.lora.ALL_LINEAR`)


class ConfigError(ValueError):
    """A bad config key, type or value; the message names it and the fix."""


def one_of(key: str, value: Any, choices: Collection[str]) -> None:
    """ConfigError unless `value` is one of `choices`; the message lists them (and the closest)."""
    if value in choices:
        return
    close = difflib.get_close_matches(str(value), [str(c) for c in choices], n=1)
    hint = f" Did you mean {close[0]!r}?" if close else ""
    raise ConfigError(f"{key}={value!r} is not one of {sorted(choices)}.{hint}")


def registered(key: str, value: str, get: Callable[[str], Any]) -> None:
    """ConfigError unless `get(value)` finds `value` in its registry (whose KeyError lists the names)."""
    try:
        get(value)
    except KeyError as e:
        raise ConfigError(f"{key}={value!r}: {e.args[0]}.") from None


def building(key: str, build: Callable[[], Any]) -> Any:
    """`build()`, with a runtime config's ValueError (a value out of range) as a ConfigError on `key`."""
    try:
        return build()
    except (ValueError, TypeError) as e:
        raise ConfigError(f"{key}: {e}") from None


@dataclasses.dataclass
class TaskSection:
    name: str = "dapo_math"  # tasks.data.TASKS
    path: str | None = None  # file-backed tasks: a local file or dir (see marljax.tasks.data)
    split_seed: int = 42  # the train/held-out split (the paper's seed; see tasks.data.HOLDOUT)
    train_size: int | None = None  # cap on training problems (None = all)
    eval_n: int | None = None  # held-out problems per evaluation (None = all, the paper's)
    # validation problems taken from the training split (disjoint from train and test by question); > 0: the
    # cliff detector, the peak checkpoint and rollback read them each eval, the test set only reports
    val_n: int = 0
    options: dict = dataclasses.field(default_factory=dict)  # task-specific knobs (e.g. arith digits)
    sandbox: str = "bwrap"  # code grading's isolation: bwrap (required, fails closed) | rlimits (none)

    def check(self) -> None:
        one_of("task.name", self.name, TASKS)
        if self.val_n < 0:
            raise ConfigError(f"task.val_n={self.val_n} must be ≥ 0 (0: no validation split).")
        if self.sandbox not in SANDBOX_MODES:
            raise ConfigError(f"task.sandbox={self.sandbox!r}; choose 'bwrap' (isolated, needs bubblewrap) "
                              "or 'rlimits' (no filesystem or network isolation).")


@dataclasses.dataclass
class WorkflowSection:
    """`name` and, as further keys, the options every registered workflow declares (its dataclass fields,
    with their types and defaults: `workflow.n_votes` is `Voting.n_votes`). The concrete class is made
    from the registry (`workflow_section`); a workflow takes only its own options (`build`)."""

    name: str = "voting"  # a registered workflow (marljax.workflows.WORKFLOWS)

    def build(self) -> Workflow:
        """The named workflow with its options from this section."""
        cls = workflow_class(self.name)
        return cls(**{f.name: getattr(self, f.name) for f in dataclasses.fields(cls)})

    def check(self) -> Workflow:
        one_of("workflow.name", self.name, WORKFLOWS)
        return building("workflow", self.build)


_BASE_OPTIONS = frozenset(f.name for f in dataclasses.fields(Workflow))


@functools.cache
def _workflow_section_class(classes: tuple[type[Workflow], ...]) -> type[WorkflowSection]:
    """WorkflowSection with one field per declared option of `classes`: each workflow's own options in
    registration order, then the options of the `Workflow` base they share."""
    own = [(f, cls) for cls in classes for f in dataclasses.fields(cls) if f.name not in _BASE_OPTIONS]
    fields: dict[str, tuple] = {}
    for f, cls in [*own, *((f, Workflow) for f in dataclasses.fields(Workflow))]:
        hint = typing.get_type_hints(cls)[f.name]
        if f.name in fields and fields[f.name][1:] != (hint, f.default):
            raise ConfigError(f"workflow option {f.name!r} is declared twice with different types or defaults "
                              f"(by {cls.__name__} and another workflow); rename one.")
        fields[f.name] = (f.name, hint, f.default)
    return dataclasses.make_dataclass(
        "WorkflowSection", [(n, h, dataclasses.field(default=d)) for n, h, d in fields.values()],
        bases=(WorkflowSection,))


def workflow_section() -> WorkflowSection:
    """The workflow section with the options of the workflows registered now, at their defaults."""
    return _workflow_section_class(tuple(WORKFLOWS.values()))()


@dataclasses.dataclass
class SamplingSection:
    max_new_tokens: int | None = None  # per role call; None: the paper's (5120 math, 2048 code)
    max_prompt_tokens: int | None = None  # a longer prompt ends the episode; None: the paper's; 0: no cap
    temperature: float = 0.7
    top_p: float = SamplingParams.top_p  # 1: off
    top_k: int = SamplingParams.top_k  # 0: off
    max_cache_tokens: int = 0  # KV positions each batch rank's page pool of the rollout engine holds (0: grows)
    num_slots: int = NUM_SLOTS  # sequences the rollout engine decodes at once per batch rank
    prefill_tokens: int = 0  # positions one prefill call of the engine computes (chunked prefill); 0: a whole prompt
    # decode steps per jitted chunk of the engine: fewer, a finished call returns sooner (an episode's next role
    # call starts sooner); more, less fixed work per step (host scheduling, the CPU path's dense copy)
    chunk_steps: int = CHUNK_STEPS
    # LoRA: decode every parameter set in one batch (per-row adapters, no merged copies). Off, each set in
    # flight holds its own stream: its own page pool (max_cache_tokens each) and merged copy of the layers
    mix_sets: bool = False
    # engine.paged_attention.PAGED_ATTENTIONS: auto (TPU kernel, CPU cpu_kernel or chunk, else gather) | gather |
    # chunk | cpu_kernel | kernel | gpu_kernel (Pallas' Triton decode kernel: opt-in, not yet run on a GPU)
    paged_attention: str = "auto"
    # engine.scheduler.ADMISSIONS: what a request must find free in the pool to start. worst_case: the pages of
    # prompt + max_new_tokens; optimistic: of its first decode chunk (a pool sized by the tokens in flight; a
    # max_cache_tokens pool that runs short preempts the latest requests, which restart: the same samples)
    admission: str = "worst_case"

    def build(self, stop_token_ids: tuple[int, ...]) -> SamplerSettings:
        """The policy sampler's settings (every field but the temperatures, which are per call, and the
        prompt cap, which the workflows apply); `stop_token_ids`: the chat codec's."""
        fields = {f.name: getattr(self, f.name) for f in dataclasses.fields(SamplerSettings)
                  if f.name != "stop_token_ids"}
        return SamplerSettings(stop_token_ids=tuple(stop_token_ids), **fields)

    def check(self) -> None:
        if self.chunk_steps < 1:
            raise ConfigError(f"sampling.chunk_steps={self.chunk_steps}: a decode chunk takes at least 1 step "
                              f"(default {CHUNK_STEPS}).")
        one_of("sampling.paged_attention", self.paged_attention, PAGED_ATTENTIONS)
        one_of("sampling.admission", self.admission, ADMISSIONS)
        if self.prefill_tokens and self.prefill_tokens < PREFILL_CHUNK_MIN:
            raise ConfigError(f"sampling.prefill_tokens={self.prefill_tokens}: a prefill call computes at least "
                              f"{PREFILL_CHUNK_MIN} positions; give 0 (whole prompts) or ≥ {PREFILL_CHUNK_MIN}.")


@dataclasses.dataclass
class RLSection:
    """Defaults are the runtime configs' (`AdvantageConfig`, `LossConfig`, `StepConfig`), which it builds."""

    problems_per_step: int = 64
    rollouts: int = 8  # G: rollouts per problem
    group_preset: str = AdvantageConfig.group_key  # rl.advantages group keys: paper | role | role_turn
    reward_routing: str = AdvantageConfig.reward_routing  # rl.advantages.REWARD_ROUTINGS: broadcast | per_role
    estimator: str = AdvantageConfig.estimator  # rl.advantages estimators: grpo | dr_grpo | rloo
    # true: each role's advantages are shuffled across its samples every step (`permuted_within_roles`), the
    # null of the coherence figures: gradients independent of credit by construction. Not for training.
    null_advantages: bool = False
    clip_low: float = LossConfig.clip_low
    clip_high: float = LossConfig.clip_high
    dual_clip: float | None = LossConfig.dual_clip
    agg: str = LossConfig.agg  # rl.losses aggregations
    kl_beta: dict = dataclasses.field(default_factory=dict)  # role → β of the KL anchor to the base (I1)
    role_weighting: str = StepConfig.role_weighting  # rl.step.ROLE_WEIGHTINGS: count | equal | inverse_norm
    minibatch: str = StepConfig.minibatch  # paper (one optimizer step per M samples of a set) | balanced
    minibatch_size: int = StepConfig.minibatch_size
    # true: a role with N parallel same-role agents (voters, workers) has its loss weight × 1/N after the role
    # weighting, the same under Shared and Isolated policies, with the number of optimizer steps unchanged
    same_role_scale: bool = False
    damping_lambda: float = StepConfig.damping_lambda  # I6: 1 − λ·clamp(cos(g, EMA g), 0, 1); paper λ ≤ 0.3
    damping_ema: float = StepConfig.damping_ema
    logprob_temperature: float | None = None  # None: the sampling temperature (as verl)
    remat: str = StepConfig.remat  # backward-pass recompute (models.decoder.REMAT): full | dots | none
    attention: str = StepConfig.attention  # models.attention.ATTENTIONS: auto | dense | blockwise | cudnn | splash
    micro_batch_tokens: int = StepConfig.micro_batch_tokens  # per data-parallel rank and forward/backward; 0: off
    micro_batch_rows: int = StepConfig.micro_batch_rows  # … and at most this many rows per rank; 0: no cap

    def loss(self) -> LossConfig:
        return LossConfig(clip_low=self.clip_low, clip_high=self.clip_high, dual_clip=self.dual_clip, agg=self.agg)

    def advantages(self) -> AdvantageConfig:
        return AdvantageConfig(group_key=self.group_preset, reward_routing=self.reward_routing,
                               estimator=self.estimator)

    def step(self, route: Mapping[str, str], same_role_counts: Mapping[str, int], temperature: float,
             lora_scale: float | None) -> StepConfig:
        """The trainer's step config for a policy `route` (role → set); `temperature`: the sampling one,
        the log-probs' unless `logprob_temperature` is set; `lora_scale` None: full fine-tuning."""
        return StepConfig(
            route=tuple(route.items()), loss=self.loss(), role_weighting=self.role_weighting,
            role_scale=tuple((r, 1.0 / n) for r, n in same_role_counts.items()) if self.same_role_scale else (),
            kl_beta=tuple((r, float(b)) for r, b in self.kl_beta.items()),
            damping_lambda=self.damping_lambda, damping_ema=self.damping_ema,
            logprob_temperature=self.logprob_temperature or temperature or 1.0, lora_scale=lora_scale,
            minibatch=self.minibatch, minibatch_size=self.minibatch_size, remat=self.remat, attention=self.attention,
            micro_batch_tokens=self.micro_batch_tokens, micro_batch_rows=self.micro_batch_rows)

    def check(self, roles: tuple[str, ...]) -> None:
        registered("rl.estimator", self.estimator, get_estimator)
        registered("rl.group_preset", self.group_preset, get_group_key)
        one_of("rl.reward_routing", self.reward_routing, REWARD_ROUTINGS)
        registered("rl.agg", self.agg, get_aggregation)
        one_of("rl.role_weighting", self.role_weighting, ROLE_WEIGHTINGS)
        one_of("rl.minibatch", self.minibatch, MINIBATCH_MODES)
        one_of("rl.remat", self.remat, REMAT)
        one_of("rl.attention", self.attention, ATTENTIONS)
        unknown_kl = sorted(set(self.kl_beta) - set(roles))
        if unknown_kl:
            raise ConfigError(f"rl.kl_beta names roles {unknown_kl} not in the workflow (roles: {list(roles)}).")
        building("rl", lambda: self.step({r: r for r in roles}, {}, 1.0, None))


_ADAMW = make_optimizer.__kwdefaults__  # the optimizer's defaults (clip + AdamW), keyword-only


@dataclasses.dataclass
class OptimSection:
    name: str = "adamw"  # rl.step.OPTIMIZERS: adamw (the paper's) | sgd (no momentum: the optimizer control)
    lr: float = 2e-5
    warmup_steps: int = 15
    schedule: str = "cosine"  # rl.schedules.SCHEDULES: cosine | constant
    weight_decay: float = _ADAMW["weight_decay"]
    b1: float = _ADAMW["b1"]
    b2: float = _ADAMW["b2"]
    grad_clip: float = _ADAMW["grad_clip"]

    def build(self):
        """Clip + `name` (`rl.step.make_optimizer`); the learning rate comes per step from `lr_at`."""
        return make_optimizer(self.name, weight_decay=self.weight_decay, b1=self.b1, b2=self.b2, grad_clip=self.grad_clip)

    def lr_at(self, step: int, total_steps: int) -> float:
        """Learning rate of training step `step` (1-based) of a `total_steps` run."""
        return lr_at(self.schedule, self.lr, step, self.warmup_steps, total_steps)

    def check(self) -> None:
        registered("optim.schedule", self.schedule, SCHEDULES.get)
        one_of("optim.name", self.name, OPTIMIZERS)


@dataclasses.dataclass
class LoRASection:
    enabled: bool = True  # False: full fine-tuning of every parameter set
    rank: int = LoRAConfig.rank
    alpha: float = LoRAConfig.alpha
    targets: list = dataclasses.field(default_factory=lambda: [ALL_LINEAR_KEY])  # linear maps, or all-linear
    layers: int | None = LoRAConfig.layers  # adapt only the last n layers (CPU speed: no backward below them)

    def build(self) -> LoRAConfig | None:
        """The adapters' config; None when LoRA is off (full fine-tuning)."""
        if not self.enabled:
            return None
        targets = ALL_LINEAR if self.targets in ([ALL_LINEAR_KEY], ALL_LINEAR_KEY) else tuple(self.targets)
        return LoRAConfig(rank=self.rank, alpha=self.alpha, targets=targets, layers=self.layers)

    def check(self) -> None:
        for target in self.targets:
            one_of("lora.targets", target, [ALL_LINEAR_KEY, *ALL_LINEAR])
        building("lora", self.build)


@dataclasses.dataclass
class EvalSection:
    every: int = 10
    temperature: float = 0.7
    k: int = 1  # sampled runs per problem
    at_start: bool = True


@dataclasses.dataclass
class CheckpointSection:
    every: int = 10
    keep: int = 2


@dataclasses.dataclass
class DiagnosticsSection:
    cliff_drop: float = CliffConfig.min_drop  # δ: absolute accuracy drop from the peak (0.05 = 5 points)
    cliff_window: float = CliffConfig.window_frac  # X: the drop must start within the last X of the run
    dominant_window: int = 5
    rollback_on_cliff: bool = False  # when the cliff detector fires, restore the peak checkpoint's state
    rollback_lr_scale: float | None = None  # after a rollback: None stops the run; a float continues, lr × it
    max_nonfinite: int = 3  # stop after this many non-finite losses in a row

    def cliff(self) -> CliffConfig:
        return CliffConfig(min_drop=self.cliff_drop, window_frac=self.cliff_window)

    def check(self) -> None:
        """`rollback_lr_scale` needs `rollback_on_cliff` and must be > 0 (None: stop after rolling back)."""
        scale = self.rollback_lr_scale
        if scale is not None and not self.rollback_on_cliff:
            raise ConfigError(f"diagnostics.rollback_lr_scale={scale} has no effect without "
                              "diagnostics.rollback_on_cliff=true; set both, or drop the scale.")
        if scale is not None and not scale > 0:
            raise ConfigError(f"diagnostics.rollback_lr_scale={scale} must be > 0 (e.g. 0.5), or null to stop "
                              "the run after rolling back.")
        building("diagnostics", self.cliff)


def check_mesh(mesh: MeshConfig) -> None:
    """The mesh section (`sharding.MeshConfig`): its rule set and LoRA placement are known names."""
    one_of("mesh.rules", mesh.rules, ["auto", *RULES])
    one_of("mesh.lora", mesh.lora, LORA_PLACEMENTS)


@dataclasses.dataclass
class Config:
    model: str = "qwen3-0.6b"
    dtype: str = "float32"  # compute dtype (activations, matmul inputs, KV cache): models.precision.DTYPES
    # storage dtype of the frozen base model (null: `dtype`); trainable state is float32 regardless
    param_dtype: str | None = None
    policy: Any = "shared"  # shared | isolated | {role: set_name}
    steps: int = 300
    run_dir: str = "runs/default"
    seed: int = 0
    task: TaskSection = dataclasses.field(default_factory=TaskSection)
    workflow: WorkflowSection = dataclasses.field(default_factory=workflow_section)
    sampling: SamplingSection = dataclasses.field(default_factory=SamplingSection)
    rl: RLSection = dataclasses.field(default_factory=RLSection)
    optim: OptimSection = dataclasses.field(default_factory=OptimSection)
    lora: LoRASection = dataclasses.field(default_factory=LoRASection)
    eval: EvalSection = dataclasses.field(default_factory=EvalSection)
    checkpoint: CheckpointSection = dataclasses.field(default_factory=CheckpointSection)
    diagnostics: DiagnosticsSection = dataclasses.field(default_factory=DiagnosticsSection)
    mesh: MeshConfig = dataclasses.field(default_factory=MeshConfig)


def validate(cfg: Config) -> Config:
    """`cfg` when every enumerated value is one its registry or choice set serves and the cross-field
    rules hold (kl_beta and policy roles are the workflow's, rollback, the ranges the runtime configs
    check); else a ConfigError naming the key and the allowed values. Loads nothing."""
    workflow = cfg.workflow.check()
    cfg.task.check()
    cfg.sampling.check()
    one_of("dtype", cfg.dtype, DTYPES)
    if cfg.param_dtype is not None:
        one_of("param_dtype", cfg.param_dtype, DTYPES)
    if isinstance(cfg.policy, str):
        one_of("policy", cfg.policy, pm.POLICY_CHOICES)
    building("policy", lambda: pm.from_config(cfg.policy, workflow.roles))
    cfg.rl.check(workflow.roles)
    cfg.optim.check()
    cfg.lora.check()
    cfg.diagnostics.check()
    check_mesh(cfg.mesh)
    return cfg


def _fields(obj) -> dict[str, dataclasses.Field]:
    return {f.name: f for f in dataclasses.fields(obj)}


def _check_type(path: str, value: Any, hint: Any) -> Any:
    """Coerce `value` to the annotated type (int→float allowed) or raise ConfigError."""
    origin, args = typing.get_origin(hint), typing.get_args(hint)
    if hint is Any:
        return value
    if origin in (typing.Union, getattr(__import__("types"), "UnionType", None)):
        if value is None and type(None) in args:
            return None
        for a in args:
            if a is type(None):
                continue
            try:
                return _check_type(path, value, a)
            except ConfigError:
                pass
        raise ConfigError(f"{path}={value!r}: expected {hint}, got {type(value).__name__}.")
    if hint is float and isinstance(value, int) and not isinstance(value, bool):
        return float(value)
    if hint is float and isinstance(value, str):  # YAML 1.1 reads "1e-3" (no dot) as a string
        try:
            return float(value)
        except ValueError:
            pass
    if hint in (int, float, str, bool, dict, list):
        if isinstance(value, hint) and not (hint is int and isinstance(value, bool)):
            return value
        if hint is list and isinstance(value, tuple):
            return list(value)
        raise ConfigError(f"{path}={value!r}: expected {hint.__name__}, got {type(value).__name__}.")
    return value


def _set(cfg, path: list[str], value: Any, full: str) -> None:
    fields = _fields(cfg)
    key = path[0]
    if key not in fields:
        close = difflib.get_close_matches(key, fields, n=3)
        hint = f" Did you mean {', '.join(close)}?" if close else f" Valid keys: {', '.join(fields)}."
        raise ConfigError(f"Unknown config key {full!r}.{hint}")
    current = getattr(cfg, key)
    hints = typing.get_type_hints(type(cfg))
    if dataclasses.is_dataclass(current):
        if len(path) == 1:
            if isinstance(value, dict):
                for k, v in value.items():
                    _set(current, [k], v, f"{full}.{k}")
                return
            if "name" in _fields(current):
                _set(current, ["name"], value, f"{full}.name")
                return
            raise ConfigError(f"{full!r} is a section; set its keys, e.g. {full}.<key>=value.")
        _set(current, path[1:], value, full)
        return
    if len(path) > 1:
        if isinstance(current, dict):  # free-form dict field (e.g. rl.kl_beta.evaluator=0.01)
            current = dict(current)
            node = current
            for p in path[1:-1]:
                node = node.setdefault(p, {})
            node[path[-1]] = value
            setattr(cfg, key, current)
            return
        if key == "policy":  # policy.<role>=<set> builds an explicit map
            mapping = dict(current) if isinstance(current, dict) else {}
            mapping[".".join(path[1:])] = value
            setattr(cfg, key, mapping)
            return
        raise ConfigError(f"{full!r}: {key!r} is not a section.")
    setattr(cfg, key, _check_type(full, value, hints[key]))


def parse_value(text: str) -> Any:
    """A command-line value as YAML (numbers, booleans, null, lists, dicts) or the plain string."""
    try:
        return yaml.safe_load(text)
    except yaml.YAMLError:
        return text


def _merged(base: dict, over: dict) -> dict:
    """`base` with `over`'s keys on top; nested mappings merge key by key."""
    out = dict(base)
    for k, v in over.items():
        out[k] = _merged(out[k], v) if isinstance(v, dict) and isinstance(out.get(k), dict) else v
    return out


def read_yaml(path: epath.PathLike, _seen: tuple = ()) -> dict:
    """A config file's mapping (a local path, or a URI such as a bucket run dir's config.yaml); a top-level
    `base: other.yaml` (relative to the file) is read first and this file's keys override it, section by section."""
    p = epath.Path(path)
    if not p.exists():
        raise ConfigError(f"Config file {p} does not exist; pass an existing YAML (see configs/).")
    here = p if is_remote(p) else pathlib.Path(p).resolve()  # a URI has no symlinks to resolve
    if here in _seen:
        raise ConfigError(f"Config file {p} includes itself through `base:`.")
    data = yaml.safe_load(p.read_text()) or {}
    if not isinstance(data, dict):
        raise ConfigError(f"Config file {p} must hold a YAML mapping of keys to values.")
    base = data.pop("base", None)
    if base is not None and not isinstance(base, str):
        raise ConfigError(f"Config file {p}: `base:` must be a path to another YAML, got {base!r}.")
    return _merged(read_yaml(p.parent / base, (*_seen, here)), data) if base else data


def load_config(config_file: str | None = None, overrides: list[str] = ()) -> Config:
    """Defaults (the paper's settings) ← YAML file (see `read_yaml`) ← `key=value` overrides, validated
    (`validate`). Keys left at `None` stay so; `resolve` fills them."""
    cfg = Config()
    if config_file is not None:
        for k, v in read_yaml(config_file).items():
            _set(cfg, [k], v, k)
    for item in overrides:
        if "=" not in item:
            raise ConfigError(f"Override {item!r} is not key=value (e.g. rl.clip_high=0.28).")
        k, v = item.split("=", 1)
        _set(cfg, k.strip().split("."), parse_value(v), k.strip())
    return validate(cfg)


def cli_config(config_file: str | None, overrides: list[str]) -> tuple[Config, str]:
    """The command line's config and the name of its base: `--config FILE` when given; else, with no
    `key=value` either, the CPU demo `configs/default.yaml` (what a bare `python -m marljax.train` runs);
    else the paper's settings (the dataclass defaults), which the overrides then change."""
    if config_file is None and not overrides:
        return load_config(str(DEMO_CONFIG)), f"{DEMO_CONFIG} (the CPU demo: no arguments given)"
    return load_config(config_file, overrides), config_file or PAPER_BASE


def resolve(cfg: Config) -> Config:
    """A validated copy of `cfg` whose `None`s that mean "the paper's value for this task and workflow"
    are filled from `workflows.paper_limits`: sampling.max_new_tokens, sampling.max_prompt_tokens,
    workflow.max_iterations."""
    limits = paper_limits(task_kind(validate(cfg).task.name), cfg.workflow.name)
    out = copy.deepcopy(cfg)
    for section, key, value in (("sampling", "max_new_tokens", limits.response),
                                ("sampling", "max_prompt_tokens", limits.prompt),
                                ("workflow", "max_iterations", limits.iterations)):
        if getattr(getattr(out, section), key) is None:
            setattr(getattr(out, section), key, value)
    return out


def leaves(d: dict, prefix: str = ""):
    """(dotted key, value) for every leaf of a nested config mapping."""
    for k, v in d.items():
        if isinstance(v, dict) and v:
            yield from leaves(v, f"{prefix}{k}.")
        else:
            yield f"{prefix}{k}", v


def config_value(cfg: dict, key: str) -> Any:
    """The value at dotted `key` of a nested config mapping, e.g. a run's config.yaml (None when absent)."""
    node: Any = cfg
    for part in key.split("."):
        if not isinstance(node, dict) or part not in node:
            return None
        node = node[part]
    return node


def departures(cfg: Config) -> list[tuple[str, Any]]:
    """(dotted key, value) of every resolved setting of `cfg` that is not the paper's: compared with the
    dataclass defaults resolved for the same task and workflow, so a code run's 2048-token responses are
    the paper's, and a 5120 there is not. The task and workflow themselves count when not the defaults."""
    paper = Config()
    defaults = {"task.name": paper.task.name, "workflow.name": paper.workflow.name}
    paper.task.name, paper.workflow.name = cfg.task.name, cfg.workflow.name
    ref = {**dict(leaves(to_dict(resolve(paper)))), **defaults}
    return [(k, v) for k, v in leaves(to_dict(resolve(cfg))) if ref.get(k, object()) != v]


def describe(cfg: Config, base: str) -> str:
    """The lines every run prints first: its base, each key that departs from the paper's settings, and
    the paper's values its `None` keys took for this task and workflow."""
    lines = [f"config: {base}"]
    diff = departures(cfg)
    lines.append(f"differs from the paper's settings in {len(diff)} key(s)" + (":" if diff else ""))
    lines += [f"  {k}={v}" for k, v in diff]
    raw, done = dict(leaves(to_dict(cfg))), dict(leaves(to_dict(resolve(cfg))))
    filled = [f"{k}={done[k]}" for k, v in raw.items() if v is None and done[k] is not None]
    if filled:
        lines.append(f"left to the paper's values for {task_kind(cfg.task.name)} × {cfg.workflow.name}: "
                     f"{', '.join(filled)}")
    return "\n".join(lines)


def to_dict(cfg: Config) -> dict:
    return dataclasses.asdict(cfg)
