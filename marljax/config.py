"""Dataclass configs for `train` and `evaluate`: YAML files plus dotted `key=value` overrides.

Unknown keys fail with close-match suggestions; values are parsed as YAML scalars and checked against
the field's type. A section with a `name` field also takes a bare value (`task=arith` sets
`task.name`), so both `task=gsm8k` and `task.path=data/gsm8k` work.
"""
from __future__ import annotations

import dataclasses
import difflib
import pathlib
import typing
from typing import Any

import yaml


@dataclasses.dataclass
class TaskSection:
    name: str = "arith"
    path: str | None = None  # file-backed tasks: a local file or dir (see marljax.tasks.data)
    split_seed: int = 42  # the train/held-out split (the paper: 90/10, seed 42)
    train_size: int | None = None  # cap on training problems (None = all)
    eval_n: int = 100  # held-out problems per evaluation
    options: dict = dataclasses.field(default_factory=dict)  # task-specific knobs (e.g. arith digits)
    sandbox: str = "bwrap"  # code grading's isolation: bwrap (required, fails closed) | rlimits (none)


@dataclasses.dataclass
class WorkflowSection:
    name: str = "voting"  # single | eval_opt | voting | orch_workers
    n_votes: int = 3
    max_iterations: int | None = None  # None: 3 for math, 2 for code (the paper)
    max_subtasks: int = 3
    worked_example: bool = False  # solve prompt shows one worked example (small models; not the paper's)


@dataclasses.dataclass
class SamplingSection:
    max_new_tokens: int = 256
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
    rollback_on_cliff: bool = False
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
    model: str = "smollm2-135m-instruct"
    dtype: str = "float32"
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


def load_config(config_file: str | None = None, overrides: list[str] = (),
                default_file: str | None = None) -> Config:
    """Defaults ← YAML file (or `default_file` when none is given; see `read_yaml`) ← `key=value`
    overrides."""
    cfg = Config()
    path = config_file or default_file
    if path is not None:
        for k, v in read_yaml(path).items():
            _set(cfg, [k], v, k)
    for item in overrides:
        if "=" not in item:
            raise ConfigError(f"Override {item!r} is not key=value (e.g. rl.clip_high=0.28).")
        k, v = item.split("=", 1)
        _set(cfg, k.strip().split("."), parse_value(v), k.strip())
    return cfg


def to_dict(cfg: Config) -> dict:
    return dataclasses.asdict(cfg)
