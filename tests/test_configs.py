"""Every committed YAML config parses into a valid Config (keys, types), and the paper cells carry SPEC §1."""
import pathlib

import pytest

from marljax.config import load_config

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
