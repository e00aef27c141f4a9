"""Every committed YAML config parses into a valid Config (keys, types), and the paper cells carry SPEC §1."""
import pathlib

import pytest

from marljax.config import ConfigError, load_config

CONFIGS = sorted((pathlib.Path(__file__).parent.parent / "configs").rglob("*.yaml"))


@pytest.mark.parametrize("path", CONFIGS, ids=lambda p: str(p.relative_to(p.parents[1])))
def test_config_loads(path):
    cfg = load_config(str(path))
    assert cfg.steps > 0 and cfg.workflow.name in ("single", "eval_opt", "voting", "orch_workers")


def test_paper_cells_use_the_paper_hyperparameters():
    cells = [p for p in CONFIGS if p.parent.name == "paper"]
    assert len(cells) == 42
    for p in cells:
        c = load_config(str(p))
        assert (c.rl.problems_per_step, c.rl.rollouts, c.rl.minibatch_size) == (64, 8, 512)
        assert (c.rl.clip_low, c.rl.clip_high, c.rl.dual_clip) == (0.2, 0.28, 3.0)
        assert (c.optim.lr, c.optim.warmup_steps, c.lora.rank, c.lora.alpha) == (2e-5, 15, 64, 32)
        assert c.sampling.temperature == 0.7 and c.sampling.max_new_tokens == 5120


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
