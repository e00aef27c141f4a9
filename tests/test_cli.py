"""The command line's base config: no arguments run the CPU demo (configs/default.yaml); key=value alone
starts from the paper's settings; `--print-config` prints the resolved config and loads nothing; every run
first names its base and its departures from the paper."""
import os
import pathlib
import subprocess
import sys
import time

import pytest
import yaml

from marljax import build, evaluate, train
from marljax.config import DEMO_CONFIG, PAPER_BASE, Config, cli_config, describe, load_config, resolve, to_dict

ROOT = pathlib.Path(__file__).resolve().parent.parent


class _Stop(Exception):
    pass


def _refuse(*args, **kwargs):
    raise AssertionError("loaded something it should not have")


def test_base_rule():
    demo, base = cli_config(None, [])
    assert demo == load_config(str(DEMO_CONFIG)) and base.startswith(str(DEMO_CONFIG))
    paper, base = cli_config(None, ["steps=2"])
    assert base == PAPER_BASE and paper.model == Config().model and paper.steps == 2
    assert paper.rl.group_preset == "paper" and paper.workflow.worked_example is False  # not the demo's
    own, base = cli_config(str(DEMO_CONFIG), ["steps=2"])
    assert base == str(DEMO_CONFIG) and own.model == "smollm2-135m-instruct" and own.steps == 2


def test_print_config_prints_the_resolved_config_and_loads_nothing(capsys, monkeypatch):
    for name in ("load_model", "load_tokenizer", "load_task"):
        monkeypatch.setattr(build, name, _refuse)
    monkeypatch.setattr(train, "train", _refuse)
    monkeypatch.setattr(train.sharding, "initialize_distributed", _refuse)
    train.main(["--print-config", "task=deepcoder", "workflow=single", "rl.clip_high=0.3"])
    out, err = capsys.readouterr()
    printed = yaml.safe_load(out)
    assert printed == to_dict(resolve(load_config(None, ["task=deepcoder", "workflow=single", "rl.clip_high=0.3"])))
    assert (printed["sampling"]["max_new_tokens"], printed["sampling"]["max_prompt_tokens"]) == (2048, 4096)
    assert err.splitlines()[:4] == [f"config: {PAPER_BASE}", "differs from the paper's settings in 3 key(s):",
                                    "  task.name=deepcoder", "  workflow.name=single"]
    assert "  rl.clip_high=0.3" in err
    assert "left to the paper's values for code × single: workflow.max_iterations=2, " \
           "sampling.max_new_tokens=2048, sampling.max_prompt_tokens=4096" in err
    train.main(["--print-config"])  # no other argument: the demo
    out, err = capsys.readouterr()
    assert yaml.safe_load(out) == to_dict(resolve(load_config(str(DEMO_CONFIG))))
    assert err.startswith(f"config: {DEMO_CONFIG} (the CPU demo")


def test_print_config_is_fast_in_a_fresh_process():
    """A 4B model whose weights are not here: loading anything would fail or take long."""
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    t0 = time.perf_counter()
    out = subprocess.run([sys.executable, "-m", "marljax.train", "--print-config", "model=qwen3-4b"], env=env,
                         capture_output=True, text=True, timeout=120, cwd=ROOT)
    elapsed = time.perf_counter() - t0
    assert out.returncode == 0, out.stderr
    assert yaml.safe_load(out.stdout)["model"] == "qwen3-4b" and "  model=qwen3-4b" in out.stderr
    assert elapsed < 30, f"--print-config took {elapsed:.1f} s"  # ≈ 7 s on a loaded 2-core machine: imports


def test_a_run_names_its_base_and_departures_before_it_starts(capsys, monkeypatch):
    def stop(cfg, preemption=None):
        raise _Stop(cfg)

    monkeypatch.setattr(train, "train", stop)
    with pytest.raises(_Stop) as got:
        train.main(["model=tiny-qwen3", "task=arith", "sampling.max_new_tokens=12"])
    err = capsys.readouterr().err.splitlines()
    assert err[:2] == [f"config: {PAPER_BASE}", "differs from the paper's settings in 3 key(s):"]
    assert err[2:5] == ["  model=tiny-qwen3", "  task.name=arith", "  sampling.max_new_tokens=12"]
    assert got.value.args[0].rl.rollouts == 8  # the paper's base, not the demo's 4
    with pytest.raises(_Stop) as got:
        train.main([])
    assert capsys.readouterr().err.startswith(f"config: {DEMO_CONFIG}")
    assert got.value.args[0] == load_config(str(DEMO_CONFIG))


def test_describe_lists_the_demos_departures():
    lines = describe(load_config(str(DEMO_CONFIG)), "configs/default.yaml").splitlines()
    for key in ("model=smollm2-135m-instruct", "steps=6", "task.name=arith", "workflow.worked_example=True",
                "sampling.max_new_tokens=32", "rl.group_preset=role", "rl.reward_routing=per_role",
                "rl.minibatch=balanced", "optim.lr=0.001", "lora.rank=16", "lora.layers=4"):
        assert f"  {key}" in lines, key
    assert not any(line.startswith(("  rl.clip_high", "  workflow.name", "  optim.weight_decay")) for line in lines)


def test_evaluate_takes_its_base_the_same_way(capsys, monkeypatch):
    for name in ("build_policy", "build_problems"):
        monkeypatch.setattr(build, name, _refuse)
    evaluate.main(["--print-config", "n=5"])
    out, err = capsys.readouterr()
    assert yaml.safe_load(out)["task"]["eval_n"] == 5 and yaml.safe_load(out)["model"] == Config().model
    assert err.splitlines()[0] == f"config: {PAPER_BASE}"
    evaluate.main(["--print-config"])
    out, err = capsys.readouterr()
    assert yaml.safe_load(out)["model"] == "smollm2-135m-instruct" and err.startswith(f"config: {DEMO_CONFIG}")


def test_a_checkpoint_is_evaluated_under_its_own_config(tmp_path, capsys, monkeypatch):
    """checkpoint=RUN reads RUN/config.yaml (its first line says so); with --config beside it the pair is
    refused, naming both files, before anything loads."""
    for name in ("build_policy", "build_problems"):
        monkeypatch.setattr(build, name, _refuse)
    run = tmp_path / "run"
    run.mkdir()
    (run / "config.yaml").write_text(DEMO_CONFIG.read_text().replace("name: voting", "name: single"))
    evaluate.main(["--print-config", f"checkpoint={run}", "n=3"])
    out, err = capsys.readouterr()
    assert err.splitlines()[0] == f"config: {run / 'config.yaml'}"
    assert yaml.safe_load(out)["workflow"]["name"] == "single"
    with pytest.raises(SystemExit) as e:
        evaluate.main(["--config", str(DEMO_CONFIG), f"checkpoint={run}", "workflow=voting", "transfer=all"])
    err = capsys.readouterr().err
    assert e.value.code == 2 and "both given" in err
    assert str(DEMO_CONFIG) in err and str(run / "config.yaml") in err and "Drop --config" in err


def test_make_run_passes_the_demo_explicitly():
    makefile = (ROOT / "Makefile").read_text()
    recipe = makefile.split("\nrun:", 1)[1].split("\n\n", 1)[0]
    assert "-m marljax.train --config configs/default.yaml $(ARGS)" in recipe


def test_the_run_resolves_its_config_and_caps_prompts(tmp_path):
    """`Run` takes the paper's values for `None` keys, and its rollouts (training and eval) end an episode
    whose prompt is over `sampling.max_prompt_tokens`: capped at the longest voter prompt, every Voting
    aggregator prompt (the problem plus three candidates) is over it."""
    from marljax.workflows.base import RoleCall

    args = ["model=tiny-qwen3", "sampling.max_new_tokens=6", "rl.problems_per_step=1", "rl.rollouts=2",
            "task.eval_n=2", "task.train_size=4", "lora.rank=2", "lora.layers=null", f"run_dir={tmp_path}"]
    run = train.Run(load_config(str(DEMO_CONFIG), args))
    assert (run.cfg.sampling.max_prompt_tokens, run.cfg.workflow.max_iterations) == (20480, 3)
    voter = max(len(run.policy.codec.render([dict(m) for m in call.messages]))
                for p in run.problems.train + run.problems.eval for call in next(run.workflow.episode(p))
                if isinstance(call, RoleCall))
    run.cfg.sampling.max_prompt_tokens = voter
    ev = run.evaluate(seed=0)
    assert ev.metrics["workflow/prompt_overflow"] == 1.0 and ev.metrics["pass@1"] == 0.0
    assert ev.metrics["role/generator/calls_per_episode"] == 3 and "role/aggregator/length_mean" not in ev.metrics
    record = run.train_step(1).record()
    assert record["workflow/prompt_overflow"] == 1.0 and record["reward/mean"] == 0.0
    assert (record["role/generator/n_samples"], record["role/aggregator/n_samples"]) == (6, 0)
