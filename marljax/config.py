"""Dataclass configs for `train` and `evaluate`: YAML files plus dotted `key=value` overrides.

The dataclass defaults are the paper's settings (SPEC §1). A few of the paper's values depend on the
task and the workflow (response and prompt lengths, Eval-Opt's iterations); their keys default to `None`,
which `resolve` fills from the one table in `marljax.workflows.limits`. The CPU demo is a file,
`configs/default.yaml`; `cli_config` is the command line's rule for which base a run starts from.

Unknown keys fail with close-match suggestions; values are parsed as YAML scalars and checked against
the field's type. A section with a `name` field also takes a bare value (`task=arith` sets
`task.name`), so both `task=gsm8k` and `task.path=data/gsm8k` work.
"""
from __future__ import annotations

import copy
import dataclasses
import difflib
import pathlib
import typing
from typing import Any

import yaml

from marljax.tasks.data import task_kind
from marljax.workflows.limits import paper_limits

DEMO_CONFIG = pathlib.Path(__file__).resolve().parent.parent / "configs" / "default.yaml"
PAPER_BASE = "paper defaults"


@dataclasses.dataclass
class TaskSection:
    name: str = "dapo_math"
    path: str | None = None  # file-backed tasks: a local file or dir (see marljax.tasks.data)
    split_seed: int = 42  # the train/held-out split (the paper's seed; see tasks.data.HOLDOUT)
    train_size: int | None = None  # cap on training problems (None = all)
    eval_n: int | None = None  # held-out problems per evaluation (None = all, the paper's)
    options: dict = dataclasses.field(default_factory=dict)  # task-specific knobs (e.g. arith digits)
    sandbox: str = "bwrap"  # code grading's isolation: bwrap (required, fails closed) | rlimits (none)


@dataclasses.dataclass
class WorkflowSection:
    name: str = "voting"  # single | eval_opt | voting | orch_workers
    n_votes: int = 3
    max_iterations: int | None = None  # Eval-Opt; None: the paper's (3 math, 2 code)
    max_subtasks: int = 3
    worked_example: bool = False  # solve prompt shows one worked example (small models; not the paper's)


@dataclasses.dataclass
class SamplingSection:
    max_new_tokens: int | None = None  # per role call; None: the paper's (5120 math, 2048 code)
    max_prompt_tokens: int | None = None  # a longer prompt ends the episode; None: the paper's; 0: no cap
    temperature: float = 0.7
    top_p: float = 1.0
    top_k: int = 0
    max_cache_tokens: int = 0  # cap on batch × KV length per sampler call (0 = one call per stage)


@dataclasses.dataclass
class RLSection:
    problems_per_step: int = 64
    rollouts: int = 8  # G: rollouts per problem
    group_preset: str = "paper"  # paper | role | role_turn
    reward_routing: str = "broadcast"  # broadcast | per_role
    estimator: str = "grpo"  # grpo | dr_grpo | rloo
    clip_low: float = 0.2
    clip_high: float = 0.28
    dual_clip: float | None = 3.0
    agg: str = "seq_mean_token_mean"
    kl_beta: dict = dataclasses.field(default_factory=dict)  # role → β of the KL anchor to the base (I1)
    role_weighting: str = "count"  # count | equal | inverse_norm
    minibatch: str = "paper"  # paper (one optimizer step per M samples of a set) | balanced
    minibatch_size: int = 512
    same_role_scale: bool = False  # weigh each of N parallel same-role agents 1/N
    damping_lambda: float = 0.0  # I6: 1 − λ·clamp(cos(g, EMA g), 0, 1); the paper's λ ≤ 0.3
    damping_ema: float = 0.9
    logprob_temperature: float | None = None  # None: the sampling temperature (as verl)
    remat: str = "full"  # backward-pass recompute (models.decoder.REMAT): full | dots | none
    attention: str = "auto"  # uncached attention (models.attention): auto | dense | blockwise | cudnn | splash


@dataclasses.dataclass
class OptimSection:
    lr: float = 2e-5
    warmup_steps: int = 15
    schedule: str = "cosine"  # cosine | constant
    weight_decay: float = 0.01
    b1: float = 0.9
    b2: float = 0.999
    grad_clip: float = 1.0


@dataclasses.dataclass
class LoRASection:
    enabled: bool = True  # False: full fine-tuning of every parameter set
    rank: int = 64
    alpha: float = 32.0
    targets: list = dataclasses.field(default_factory=lambda: ["all-linear"])
    layers: int | None = None  # adapt only the last n layers (CPU speed: no backward below them)


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
    cliff_drop: float = 0.05  # δ: absolute accuracy drop from the peak (0.05 = 5 points)
    cliff_window: float = 0.25  # X: the drop must start within the last X of the run
    dominant_window: int = 5
    rollback_on_cliff: bool = False  # when the cliff detector fires, restore the peak checkpoint's state
    rollback_lr_scale: float | None = None  # after a rollback: None stops the run; a float continues, lr × it
    max_nonfinite: int = 3  # stop after this many non-finite losses in a row


@dataclasses.dataclass
class MeshConfig:
    """Device mesh (see marljax.sharding): sizes of its data, fsdp and tensor axes, -1 = the rest."""

    data: int = 1
    fsdp: int = -1
    tensor: int = 1
    rules: str = "auto"  # auto (fsdp_tp when tensor > 1, else fsdp) | fsdp | fsdp_tp
    lora: str = "sharded"  # sharded (by the base weight's rules) | replicated


@dataclasses.dataclass
class Config:
    model: str = "qwen3-0.6b"
    dtype: str = "float32"  # compute dtype (activations, matmul inputs, KV cache): float32 | bfloat16
    # storage dtype of the frozen base model (null: `dtype`); trainable state is float32 regardless
    param_dtype: str | None = None
    policy: Any = "shared"  # shared | isolated | {role: set_name}
    steps: int = 300
    run_dir: str = "runs/default"
    seed: int = 0
    task: TaskSection = dataclasses.field(default_factory=TaskSection)
    workflow: WorkflowSection = dataclasses.field(default_factory=WorkflowSection)
    sampling: SamplingSection = dataclasses.field(default_factory=SamplingSection)
    rl: RLSection = dataclasses.field(default_factory=RLSection)
    optim: OptimSection = dataclasses.field(default_factory=OptimSection)
    lora: LoRASection = dataclasses.field(default_factory=LoRASection)
    eval: EvalSection = dataclasses.field(default_factory=EvalSection)
    checkpoint: CheckpointSection = dataclasses.field(default_factory=CheckpointSection)
    diagnostics: DiagnosticsSection = dataclasses.field(default_factory=DiagnosticsSection)
    mesh: MeshConfig = dataclasses.field(default_factory=MeshConfig)


class ConfigError(ValueError):
    """A bad config key, type or value; the message names it and the fix."""


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


def read_yaml(path: str | pathlib.Path, _seen: tuple = ()) -> dict:
    """A config file's mapping; a top-level `base: other.yaml` (relative to the file) is read first and
    this file's keys override it, section by section."""
    p = pathlib.Path(path)
    if not p.exists():
        raise ConfigError(f"Config file {p} does not exist; pass an existing YAML (see configs/).")
    if p.resolve() in _seen:
        raise ConfigError(f"Config file {p} includes itself through `base:`.")
    data = yaml.safe_load(p.read_text()) or {}
    if not isinstance(data, dict):
        raise ConfigError(f"Config file {p} must hold a YAML mapping of keys to values.")
    base = data.pop("base", None)
    if base is not None and not isinstance(base, str):
        raise ConfigError(f"Config file {p}: `base:` must be a path to another YAML, got {base!r}.")
    return _merged(read_yaml(p.parent / base, (*_seen, p.resolve())), data) if base else data


def load_config(config_file: str | None = None, overrides: list[str] = ()) -> Config:
    """Defaults (the paper's settings) ← YAML file (see `read_yaml`) ← `key=value` overrides. Keys left
    at `None` stay so; `resolve` fills them."""
    cfg = Config()
    if config_file is not None:
        for k, v in read_yaml(config_file).items():
            _set(cfg, [k], v, k)
    for item in overrides:
        if "=" not in item:
            raise ConfigError(f"Override {item!r} is not key=value (e.g. rl.clip_high=0.28).")
        k, v = item.split("=", 1)
        _set(cfg, k.strip().split("."), parse_value(v), k.strip())
    return cfg


def cli_config(config_file: str | None, overrides: list[str]) -> tuple[Config, str]:
    """The command line's config and the name of its base: `--config FILE` when given; else, with no
    `key=value` either, the CPU demo `configs/default.yaml` (what a bare `python -m marljax.train` runs);
    else the paper's settings (the dataclass defaults), which the overrides then change."""
    if config_file is None and not overrides:
        return load_config(str(DEMO_CONFIG)), f"{DEMO_CONFIG} (the CPU demo: no arguments given)"
    return load_config(config_file, overrides), config_file or PAPER_BASE


def resolve(cfg: Config) -> Config:
    """A copy of `cfg` whose `None`s that mean "the paper's value for this task and workflow" are filled
    from `workflows.limits`: sampling.max_new_tokens, sampling.max_prompt_tokens, workflow.max_iterations."""
    try:
        limits = paper_limits(task_kind(cfg.task.name), cfg.workflow.name)
    except ValueError as e:
        raise ConfigError(f"{e} Set workflow= to one of single, eval_opt, voting, orch_workers.") from None
    from marljax.models.precision import DTYPES  # not at the top: marljax.models imports sharding → config
    for key, value in (("dtype", cfg.dtype), ("param_dtype", cfg.param_dtype or cfg.dtype)):
        if value not in DTYPES:
            raise ConfigError(f"{key}={value!r} is not supported; use one of {DTYPES}.")
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
