"""`python -m marljax.evaluate checkpoint=RUN_DIR`: re-evaluating the peak (`which=peak`), the paper's SA→MA
transfer controls (`transfer=all|generators`), their errors, and where the report shows them.

The single-agent run is the tiny model on arith with a scripted eval series (peak at step 2, newest step
4; `Run.evaluate` is monkeypatched during training only) and `optim.weight_decay=0.5`, so its parameters
move every step although the random model's gradients are 0 (see tests/test_rollback.py): newest, peak and
a fresh init all differ, and a check that the right one was loaded can fail.
"""
import json
import types

import numpy as np
import pytest
from test_report import _run as synthetic_run
from test_rollback import _equal
from test_train import TINY

from marljax.analysis.report import write_report
from marljax.core.checkpoint import Checkpointer
from marljax.evaluate import build
from marljax.evaluate import main as evaluate_main
from marljax.train import Run
from marljax.train import main as train_main

ACC = {0: 0.2, 2: 0.6, 4: 0.5}


@pytest.fixture(scope="module")
def single(tmp_path_factory):
    run_dir = tmp_path_factory.mktemp("transfer") / "single"
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(Run, "evaluate", lambda self, seed, problems=None: types.SimpleNamespace(
            metrics={"pass@1": ACC[seed - self.cfg.seed]}, transcripts=[]))
        train_main([*TINY, "task=arith", "workflow=single", "policy=shared", "steps=4", f"run_dir={run_dir}",
                    "optim.weight_decay=0.5", "checkpoint.every=2"])
    return run_dir


def _saved_params(run_dir, which):
    return Checkpointer(run_dir, 2, 2).restore(None, which=which)[1]["params"]["shared"]


def test_which_peak_reevaluates_the_peak(single, tmp_path, capfd):
    cfg_file = str(single / "config.yaml")
    peak, newest = _saved_params(single, "peak"), _saved_params(single, "newest")
    assert not _equal(peak, newest)
    run, step = build(single, cfg_file, ["task.eval_n=2"], "peak", None)
    assert step == 2 and _equal(run.params["shared"], peak)
    run, step = build(single, cfg_file, ["task.eval_n=2"], "newest", None)
    assert step == 4 and _equal(run.params["shared"], newest)
    evaluate_main([f"checkpoint={single}", "which=peak", "n=2"])
    out, err = capfd.readouterr()
    assert f"evaluating {single} peak at step 2" in err
    saved = json.loads((single / "evals" / "peak.json").read_text())
    assert (saved["which"], saved["step"], saved["n"], saved["transfer"]) == ("peak", 2, 2, None)
    assert out.strip().splitlines()[-1] == f"pass@1 = {saved['pass@1']:.4f}" and len(saved["rewards"]) == 2
    report = write_report([single], tmp_path / "report").read_text()
    assert f"| single | peak (2) | single | – | {saved['pass@1']:.3f} ± " in report


@pytest.mark.parametrize("workflow,mode,route", [
    ("voting", "all", {"generator": "sa", "aggregator": "sa"}),
    ("orch_workers", "generators", {"orchestrator": "base", "worker": "sa", "synthesizer": "base"}),
    ("eval_opt", "generators", {"generator": "sa", "evaluator": "base"})])
def test_transfer_routes_the_single_agent_set(single, workflow, mode, route):
    run, step = build(single, str(single / "config.yaml"), [f"workflow={workflow}", "task.eval_n=2"], "newest", mode)
    assert step == 4 and run.route == route
    assert _equal(run.params["sa"], _saved_params(single, "newest"))
    if "base" in run.params:  # untouched adapters: B = 0, so the supervisory roles run the base model
        assert all(not np.asarray(ab["b"]).any() for ab in run.params["base"].values())


def test_transfer_through_the_cli_and_the_report(single, tmp_path, capfd):
    out = tmp_path / "out"
    evaluate_main([f"checkpoint={single}", "workflow=voting", "transfer=generators", "n=2", f"--out={out}"])
    assert f"evaluating {single} newest at step 4 → voting (transfer=generators)" in capfd.readouterr().err
    calls = [c for line in (out / "transcripts.jsonl").read_text().splitlines() for c in json.loads(line)["calls"]]
    assert {(c["role"], c["set"]) for c in calls} == {("generator", "sa"), ("aggregator", "base")}
    saved = json.loads((single / "evals" / "transfer-voting-generators-newest.json").read_text())
    assert (saved["workflow"], saved["transfer"], saved["step"], saved["n"]) == ("voting", "generators", 4, 2)
    # the report: a voting run of the same task and model gets the transfer's pass@1 beside "Δ vs single"
    (single / "evals" / "transfer-voting-all-peak.json").write_text(json.dumps(
        {**saved, "transfer": "all", "which": "peak", "step": 2, "pass@1": 0.25}))
    voting = synthetic_run(tmp_path, "voting", {0: 0.30, 10: 0.50})
    report = write_report([single, voting], tmp_path / "report").read_text()
    assert "| Δ vs single | SA-transfer | cliff |" in report
    # Δ vs single is blank: the synthetic voting run is not like for like (10 steps against the single run's 4)
    assert f"| 0.500 | 0.200 | – | all (peak) 0.250; generators {saved['pass@1']:.3f} | no |" in report
    assert "| single | peak (2) | voting | all | 0.250 ± 0.306 | 2 × 1 |" in report  # √(.25·.75/2)


def test_transfer_errors(single, tmp_path, capfd):
    def error(*args):
        with pytest.raises(SystemExit) as e:
            evaluate_main([f"checkpoint={single}", "n=2", *args])
        assert e.value.code == 2
        return capfd.readouterr().err
    assert "transfer='some'; choose one of ('all', 'generators')" in error("workflow=voting", "transfer=some")
    assert "workflow.name='votes' is not one of ['eval_opt', 'orch_workers', 'single', 'voting']" in error(
        "workflow=votes", "transfer=all")
    assert "which='best'; choose one of ('newest', 'peak')" in error("which=best")
    multi = tmp_path / "multi"
    multi.mkdir()
    (multi / "config.yaml").write_text((single / "config.yaml").read_text().replace("name: single", "name: voting"))
    assert "is a workflow=voting run; pass a workflow=single run" in error(f"checkpoint={multi}", "transfer=all")
