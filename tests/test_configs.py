"""Every committed YAML config parses into a valid Config (keys, types); the dataclass defaults and the
paper cells carry SPEC §1; the CPU demo is configs/default.yaml."""
import ast
import math
import os
import pathlib
import re
import resource
import subprocess
import sys
import time

import pytest

from marljax import matrix
from marljax.config import Config, ConfigError, departures, leaves, load_config, resolve, to_dict
from marljax.rl.advantages import AdvantageConfig
from marljax.rl.diagnostics import CliffConfig
from marljax.models.lora import LoRAConfig
from marljax.rl.losses import LossConfig
from marljax.rl.step import StepConfig
from marljax.train import main as train_main
from marljax.workflows import EvalOpt, Voting

ROOT = pathlib.Path(__file__).parent.parent
# every run config (configs/aot_fits.yaml is the matrix's record of AOT refits, not a run config)
CONFIGS = sorted(p for p in (ROOT / "configs").rglob("*.yaml") if p.name != matrix.FITS_FILE.name)


@pytest.mark.parametrize("path", CONFIGS, ids=lambda p: str(p.relative_to(p.parents[1])))
def test_config_loads(path):
    cfg = load_config(str(path))
    assert cfg.steps > 0 and cfg.workflow.name in ("single", "eval_opt", "voting", "orch_workers")


PROMPT_CAPS = {("math", "eval_opt"): 30720, ("math", "voting"): 20480, ("math", "orch_workers"): 20480,
               ("math", "single"): 15360, ("code", "eval_opt"): 10240, ("code", "voting"): 10240,
               ("code", "orch_workers"): 10240, ("code", "single"): 4096}


def test_paper_cells_use_the_paper_hyperparameters():
    cells = [p for p in CONFIGS if p.parent.name == "paper"]
    assert len(cells) == 42
    for p in cells:
        c = load_config(str(p))
        kind = "code" if c.task.name == "deepcoder" else "math"
        assert (c.rl.problems_per_step, c.rl.rollouts, c.rl.minibatch_size) == (64, 8, 512)
        assert (c.rl.clip_low, c.rl.clip_high, c.rl.dual_clip) == (0.2, 0.28, 3.0)
        assert (c.optim.lr, c.optim.warmup_steps, c.lora.rank, c.lora.alpha) == (2e-5, 15, 64, 32)
        assert c.sampling.temperature == 0.7 and c.task.eval_n is None and c.task.split_seed == 42
        assert c.sampling.max_new_tokens == {"math": 5120, "code": 2048}[kind], p.name
        assert c.sampling.max_prompt_tokens == PROMPT_CAPS[kind, c.workflow.name], p.name
        assert c.workflow.max_iterations == {"math": 3, "code": 2}[kind], p.name
        assert (c.rl.group_preset, c.rl.reward_routing, c.workflow.worked_example) == ("paper", "broadcast", False)


def test_dataclass_defaults_are_the_papers_settings():
    """With nothing set, a run is the paper's Qwen3-0.6B Voting cell on DAPO-Math (all held-out problems)."""
    c = resolve(Config())
    assert (c.model, c.task.name, c.workflow.name, c.policy, c.steps) == ("qwen3-0.6b", "dapo_math", "voting",
                                                                          "shared", 300)
    assert (c.task.eval_n, c.task.split_seed, c.workflow.n_votes, c.workflow.worked_example) == (None, 42, 3, False)
    assert (c.sampling.max_new_tokens, c.sampling.max_prompt_tokens, c.sampling.temperature) == (5120, 20480, 0.7)
    assert (c.rl.problems_per_step, c.rl.rollouts, c.rl.minibatch, c.rl.minibatch_size) == (64, 8, "paper", 512)
    assert (c.rl.group_preset, c.rl.reward_routing, c.rl.role_weighting, c.rl.same_role_scale) == (
        "paper", "broadcast", "count", False)
    assert (c.rl.clip_low, c.rl.clip_high, c.rl.dual_clip, c.rl.kl_beta, c.rl.damping_lambda) == (0.2, 0.28, 3.0, {}, 0)
    assert (c.optim.lr, c.optim.warmup_steps, c.optim.schedule, c.optim.weight_decay, c.optim.grad_clip) == (
        2e-5, 15, "cosine", 0.01, 1.0)
    assert (c.lora.enabled, c.lora.rank, c.lora.alpha, c.lora.targets, c.lora.layers) == (
        True, 64, 32.0, ["all-linear"], None)
    assert (c.eval.every, c.eval.temperature, c.eval.k) == (10, 0.7, 1)
    assert departures(Config()) == []


@pytest.mark.parametrize("task,workflow", [(t, w) for t in ("dapo_math", "deepcoder")
                                           for w in ("single", "eval_opt", "voting", "orch_workers")])
def test_none_takes_the_papers_value_for_the_task_and_workflow(task, workflow):
    kind = "code" if task == "deepcoder" else "math"
    c = resolve(load_config(None, [f"task={task}", f"workflow={workflow}"]))
    assert c.sampling.max_new_tokens == {"math": 5120, "code": 2048}[kind]
    assert c.sampling.max_prompt_tokens == PROMPT_CAPS[kind, workflow]
    assert c.workflow.max_iterations == {"math": 3, "code": 2}[kind]
    mine = resolve(load_config(None, [f"task={task}", f"workflow={workflow}", "sampling.max_new_tokens=7",
                                      "sampling.max_prompt_tokens=0", "workflow.max_iterations=1"]))
    assert (mine.sampling.max_new_tokens, mine.sampling.max_prompt_tokens, mine.workflow.max_iterations) == (7, 0, 1)
    # a code run's 2048 is the paper's, not a departure; 5120 there is one
    assert departures(load_config(None, [f"task={task}", "sampling.max_new_tokens=2048"])) == (
        [("task.name", "deepcoder")] if kind == "code" else [("sampling.max_new_tokens", 2048)])


def test_resolve_names_an_unknown_workflow():
    cfg = Config()
    cfg.workflow.name = "votes"
    with pytest.raises(ConfigError, match=r"workflow\.name='votes' is not one of \['eval_opt', 'orch_workers', "
                                          r"'single', 'voting'\]"):
        resolve(cfg)


def test_the_demo_is_configs_default_yaml():
    """The CPU demo's departures from the paper, pinned: what `make run` and a bare `python -m marljax.train`
    run."""
    c = load_config(str(CONFIGS[0].parent / "default.yaml"))
    assert (c.model, c.workflow.name, c.policy, c.steps, c.run_dir) == ("smollm2-135m-instruct", "voting", "shared", 6,
                                                                        "runs/default")
    assert (c.task.name, c.task.eval_n, c.task.options) == ("arith", 32,
                                                            {"operands": 2, "digits": 1, "operations": "+"})
    assert (c.sampling.max_new_tokens, c.sampling.temperature, c.workflow.worked_example) == (32, 0.7, True)
    assert (c.rl.problems_per_step, c.rl.rollouts, c.rl.group_preset, c.rl.reward_routing, c.rl.minibatch) == (
        4, 4, "role", "per_role", "balanced")
    assert (c.optim.lr, c.optim.warmup_steps, c.lora.rank, c.lora.alpha, c.lora.layers) == (1e-3, 1, 16, 32, 4)
    assert (c.eval.every, c.checkpoint.every) == (6, 6)


def test_base_file_is_read_first_and_overridden_section_by_section(tmp_path):
    (tmp_path / "a.yaml").write_text("steps: 3\nrl: {rollouts: 2, problems_per_step: 5}\n")
    (tmp_path / "b.yaml").write_text("base: a.yaml\nrl: {rollouts: 4}\n")
    cfg = load_config(str(tmp_path / "b.yaml"), ["steps=7"])
    assert (cfg.steps, cfg.rl.rollouts, cfg.rl.problems_per_step) == (7, 4, 5)
    (tmp_path / "a.yaml").write_text("base: b.yaml\n")
    with pytest.raises(ConfigError, match="includes itself"):
        load_config(str(tmp_path / "b.yaml"))
    (tmp_path / "d.yaml").write_text("base: [a.yaml]\n")
    with pytest.raises(ConfigError, match="must be a path"):
        load_config(str(tmp_path / "d.yaml"))
    (tmp_path / "c.yaml").write_text("base: missing.yaml\n")
    with pytest.raises(ConfigError, match="missing.yaml does not exist"):
        load_config(str(tmp_path / "c.yaml"))


def test_isolated_default_differs_from_the_default_only_in_policy_and_run_dir():
    root = pathlib.Path(__file__).parent.parent / "configs"
    shared, isolated = load_config(str(root / "default.yaml")), load_config(str(root / "default-isolated.yaml"))
    assert (shared.policy, isolated.policy) == ("shared", "isolated")
    shared.policy, shared.run_dir = isolated.policy, isolated.run_dir
    assert shared == isolated


# ---- validation at load -------------------------------------------------------------------------
# (override, the allowed values the message must list): every enumerated key, each against the registry
# or choice set that serves it.
ENUMERATED = [
    ("workflow=votes", "['eval_opt', 'orch_workers', 'single', 'voting']"),
    ("task=gsm9k", "'gsm8k'"),
    ("task.sandbox=docker", "choose 'bwrap'"),
    ("rl.estimator=ppo", "registered: ['dr_grpo', 'grpo', 'rloo']"),
    ("rl.group_preset=roles", "registered: ['paper', 'role', 'role_turn']"),
    ("rl.reward_routing=per-role", "['broadcast', 'per_role']"),
    ("rl.agg=mean", "registered: ['seq_mean_token_mean', 'seq_mean_token_sum', 'token_mean']"),
    ("optim.schedule=cosin", "registered: ['constant', 'cosine']"),
    ("optim.name=adam", "['adamw', 'sgd']"),
    ("rl.remat=some", "['dots', 'full', 'none']"),
    ("rl.minibatch=even", "['balanced', 'paper']"),
    ("rl.role_weighting=equally", "['count', 'equal', 'inverse_norm']"),
    ("rl.attention=flash", "['auto', 'blockwise', 'cudnn', 'dense', 'splash']"),
    ("sampling.paged_attention=triton", "['auto', 'chunk', 'cpu_kernel', 'gather', 'kernel']"),
    ("sampling.admission=lazy", "['optimistic', 'worst_case']"),
    ("mesh.rules=tp", "['auto', 'fsdp', 'fsdp_tp']"),
    ("mesh.lora=shard", "['replicated', 'sharded']"),
    ("lora.targets=[wq,w_in]", "['all-linear', 'w_down', 'w_gate', 'w_up', 'wk', 'wo', 'wq', 'wv']"),
    ("dtype=float16", "['bfloat16', 'float32']"),
    ("policy=separate", "['isolated', 'shared']"),
]


@pytest.mark.parametrize("override,allowed", ENUMERATED, ids=[o.split("=")[0] for o, _ in ENUMERATED])
def test_every_enumerated_key_is_checked_at_load(override, allowed):
    key = override.split("=")[0]
    with pytest.raises(ConfigError) as e:
        load_config(None, ["model=tiny-qwen3", override])
    assert e.value.args[0].startswith(f"{key}.name=" if key in ("workflow", "task") else f"{key}=")
    if allowed.startswith("registered: "):  # a registry: the built-in names (tests may register more)
        listed = ast.literal_eval(str(e.value).split("registered: ", 1)[1].rstrip("."))
        assert set(ast.literal_eval(allowed.split(": ", 1)[1])) <= set(listed), str(e.value)
    else:
        assert allowed in str(e.value)


def test_enumerated_keys_cover_every_choice_of_the_config():
    """Every str key of the config whose values come from a fixed set appears in ENUMERATED (free-form ones
    listed here); a new enumerated key must be validated and added."""
    free = {"model", "run_dir", "task.path"}
    keys = {k for k, v in leaves(to_dict(Config())) if isinstance(v, str)}
    covered = {o.split("=")[0] for o, _ in ENUMERATED}
    covered = {"workflow.name" if k == "workflow" else "task.name" if k == "task" else k for k in covered}
    assert keys - free == covered - {"lora.targets"}


@pytest.mark.parametrize("overrides,message", [
    (["rl.kl_beta.evaluator=0.01"], r"rl\.kl_beta names roles \['evaluator'\] not in the workflow "
                                    r"\(roles: \['generator', 'aggregator'\]\)"),
    (["policy.generator=a"], "policy: .*aggregator"),  # a mapping must route every role of the workflow
    (["diagnostics.rollback_lr_scale=0.5"], "has no effect without diagnostics.rollback_on_cliff"),
    (["diagnostics.rollback_on_cliff=true", "diagnostics.rollback_lr_scale=-1"], "must be > 0"),
    (["rl.damping_lambda=1.5"], r"rl\.damping_lambda=1\.5 must be in \[0, 1\]"),
    (["rl.clip_low=1.5"], r"clip_low must be in \[0, 1\)"),
    (["rl.dual_clip=0.5"], "dual_clip must be > 1"),
    (["lora.rank=0"], r"lora\.rank=0 must be ≥ 1"),
    (["diagnostics.cliff_window=0"], r"window_frac must be in \(0, 1\]"),
    (["workflow.n_votes=0"], "n_votes must be >= 1"),
    (["workflow=eval_opt", "workflow.max_iterations=0"], "max_iterations must be >= 1"),
    (["sampling.prefill_tokens=8"], r"sampling\.prefill_tokens=8: a prefill call computes at least 16"),
    (["sampling.chunk_steps=0"], r"sampling\.chunk_steps=0: a decode chunk takes at least 1 step"),
])
def test_cross_field_and_range_checks_run_at_load(overrides, message):
    with pytest.raises(ConfigError, match=message):
        load_config(None, overrides)


def test_a_bad_value_fails_the_cli_fast_before_any_model_is_loaded():
    """`python -m marljax.train model=tiny-qwen3 optim.schedule=cosin` exits 2 with the allowed schedules,
    having imported the package only (≈ 2.5 s of CPU; the wall time is that plus the machine's load)."""
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    t0 = time.perf_counter()
    out = subprocess.run([sys.executable, "-m", "marljax.train", "model=tiny-qwen3", "optim.schedule=cosin"],
                         env=env, capture_output=True, text=True, timeout=120)
    wall = time.perf_counter() - t0
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    cpu = after.ru_utime + after.ru_stime - before.ru_utime - before.ru_stime
    assert out.returncode == 2 and out.stdout == ""
    assert out.stderr.splitlines()[-1] == ("config error: optim.schedule='cosin': unknown learning-rate schedule "
                                           "'cosin'; registered: ['constant', 'cosine'].")
    assert cpu < 10, f"CPU {cpu:.1f} s (wall {wall:.1f} s)"


def test_print_config_validates():
    with pytest.raises(SystemExit) as e:
        train_main(["--print-config", "rl.estimator=grp"])
    assert e.value.code == 2


# ---- sections build the runtime configs, whose defaults they share -------------------------------
def test_sections_build_the_runtime_configs_with_one_default_each():
    c = Config()
    assert c.rl.loss() == LossConfig() and c.rl.advantages() == AdvantageConfig()
    assert c.lora.build() == LoRAConfig() and c.diagnostics.cliff() == CliffConfig()
    route = {"generator": "shared", "aggregator": "shared"}
    assert c.rl.step(route, {"generator": 3}, 0.7, 0.5) == StepConfig(tuple(route.items()), logprob_temperature=0.7,
                                                                      lora_scale=0.5)
    mine = load_config(None, ["rl.same_role_scale=true", "rl.logprob_temperature=1.0", "lora.enabled=false",
                              "rl.kl_beta.generator=0.1", "lora.targets=[wq, wv]"])
    step = mine.rl.step(route, mine.workflow.build().same_role_counts(), 0.7, None)
    assert (step.role_scale, step.kl_beta, step.logprob_temperature, step.lora_scale) == (
        (("generator", 1 / 3),), (("generator", 0.1),), 1.0, None)
    assert mine.lora.build() is None
    mine.lora.enabled = True
    assert mine.lora.build().targets == ("wq", "wv")
    assert c.workflow.build() == Voting() and load_config(None, ["workflow=eval_opt"]).workflow.build() == EvalOpt()


@pytest.mark.parametrize("schedule", ["cosine", "constant"])
def test_learning_rate_schedule(schedule):
    """Linear warm-up over 15 steps, then cosine to 0 at step 300 (or constant): the float formula."""
    o = load_config(None, [f"optim.schedule={schedule}"]).optim
    steps = 300
    for step in (1, 7, 15, 16, 100, 299, 300):
        if step <= 15:
            want = 2e-5 * step / 15
        elif schedule == "constant":
            want = 2e-5
        else:
            want = 2e-5 * 0.5 * (1 + math.cos(math.pi * (step - 15) / 285))
        assert o.lr_at(step, steps) == want
    assert o.lr_at(steps, steps) == (2e-5 * 0.5 * (1 + math.cos(math.pi)) if schedule == "cosine" else 2e-5)
