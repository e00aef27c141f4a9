"""Every committed YAML config parses into a valid Config (keys, types); the dataclass defaults and the
paper cells carry SPEC §1; the CPU demo is configs/default.yaml."""
import pathlib

import pytest

from marljax.config import Config, ConfigError, departures, load_config, resolve

CONFIGS = sorted((pathlib.Path(__file__).parent.parent / "configs").rglob("*.yaml"))


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
