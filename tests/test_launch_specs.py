"""`python -m marljax.matrix --emit skypilot`: one SkyPilot managed-job spec per cell, read back by SkyPilot's
own parser (tests/skypilot_parse.py, offline), and `launch/tpu_vm.sh --dry-run` with its run dir in a bucket.

The parser runs in a subprocess under `$MARLJAX_SKYPILOT_PYTHON` (the separate environment .ci/run makes,
so skypilot's pins do not move the test environment's) or this Python when it has `sky`; without either
the parse tests skip, naming the fix, except under CI=true, where they fail."""
from __future__ import annotations

import importlib.util
import json
import os
import pathlib
import subprocess
import sys

import pytest

from marljax import matrix
from marljax.config import load_config
from marljax.core import launch_specs
from marljax.models.presets import HUB_IDS

REPO = pathlib.Path(__file__).resolve().parents[1]
BUCKET = "gs://sweeps/matrix"


def skypilot_python() -> str:
    """A Python that can import SkyPilot's parser, or skip (fail under CI=true) naming the fix."""
    if os.environ.get("MARLJAX_SKYPILOT_PYTHON"):
        return os.environ["MARLJAX_SKYPILOT_PYTHON"]
    if importlib.util.find_spec("sky") is not None:
        return sys.executable
    message = ("SkyPilot is not installed: `pip install -e '.[launch]'`, or point MARLJAX_SKYPILOT_PYTHON at a "
               "Python that has it (.ci/run makes one)")
    if os.environ.get("CI") == "true":
        pytest.fail(f"CI must parse the job specs: {message}")
    pytest.skip(message)


def parse(specs: list[pathlib.Path], home: pathlib.Path) -> list[dict]:
    """What SkyPilot's parser reads from each spec (a fresh HOME: no credentials, no SkyPilot state)."""
    home.mkdir()
    done = subprocess.run([skypilot_python(), str(REPO / "tests" / "skypilot_parse.py"), *map(str, specs)],
                          capture_output=True, text=True, timeout=120, env={**os.environ, "HOME": str(home)})
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads(done.stdout.splitlines()[-1])["tasks"]


def emit(tmp_path: pathlib.Path, *args: str) -> pathlib.Path:
    """Run `--emit skypilot` into tmp_path/jobs with a local datasets dir; the jobs dir."""
    (tmp_path / "data").mkdir(exist_ok=True)
    matrix.main(["--emit", "skypilot", str(tmp_path / "jobs"), "--bucket", BUCKET,
                 "--data-root", str(tmp_path / "data"), *args])
    return tmp_path / "jobs"


def test_every_rented_accelerator_has_a_slice():
    assert set(launch_specs.SLICES) == set(matrix.ACCELERATORS) - {"cpu"}


def test_skypilot_parses_one_spot_job_per_cell(tmp_path):
    jobs = emit(tmp_path, "--accelerator", "v5e-8")
    specs = sorted(jobs.glob("*.yaml"))
    cells = {c.name: c for c in matrix.cells()}
    assert len(cells) == 42 and sorted(s.stem for s in specs) == sorted(cells)
    tasks = parse(specs, tmp_path / "home")
    assert len(tasks) == len(cells)
    for task in tasks:
        cell = cells[task["name"]]
        assert task["accelerators"] == {"tpu-v5litepod-8": 1} and task["cloud"] == "GCP"
        assert task["accelerator_args"]["runtime_version"] == "v2-alpha-tpuv5-lite"
        assert task["use_spot"] is True and task["num_nodes"] == 1
        assert task["job_recovery"] == {"strategy": "EAGER_NEXT_REGION",
                                        "max_restarts_on_errors": launch_specs.RESTARTS_ON_ERRORS}
        assert task["run"].endswith(f"python -m marljax.train --config {launch_specs.REMOTE_CONFIG} "
                                    f"run_dir={BUCKET}/{cell.name}")
        assert task["envs"] == {"MARLJAX_DISTRIBUTED": "1"}
        assert "'jax[tpu]' -e ." in task["setup"] and f"hf download {HUB_IDS[cell.model]}" in task["setup"]
        assert pathlib.Path(task["workdir"]) == REPO
        config = pathlib.Path(task["file_mounts"][launch_specs.REMOTE_CONFIG])
        assert config == jobs / "configs" / f"{cell.name}.yaml"
        cfg = load_config(str(config))
        assert cfg.model == cell.model and cfg.task.path.startswith(launch_specs.REMOTE_DATA + "/")
        assert task["file_mounts"][launch_specs.REMOTE_DATA] == str(tmp_path / "data")


def test_gpu_hosts_ask_for_eight_gpus_without_jax_distributed(tmp_path):
    jobs = emit(tmp_path, "--accelerator", "h100", "--cell", "single-math-qwen3-0.6b", "voting-code-qwen3-4b-shared",
                "--data-root", "gs://sweeps/data")
    tasks = parse(sorted(jobs.glob("*.yaml")), tmp_path / "home")
    assert [t["name"] for t in tasks] == ["single-math-qwen3-0.6b", "voting-code-qwen3-4b-shared"]
    for task in tasks:
        assert task["accelerators"] == {"H100": 8} and task["use_spot"] is True and not task["envs"]
        assert "'jax[cuda12]' -e ." in task["setup"] and f"run_dir={BUCKET}/{task['name']}" in task["run"]
        assert task["file_mounts"][launch_specs.REMOTE_DATA] == "gs://sweeps/data"


@pytest.mark.parametrize("args, fix", [
    (["--emit", "skypilot", "{jobs}"], "--bucket (missing): the run dirs need a bucket URL, --bucket gs://"),
    (["--emit", "skypilot", "{jobs}", "--bucket", "/mnt/runs"], "--bucket gs://BUCKET/PATH"),
    (["--emit", "skypilot", "{jobs}", "--bucket", "gs://"], "--bucket gs://BUCKET/PATH"),
    (["--emit", "xpk", "{jobs}", "--bucket", BUCKET], "use --emit skypilot"),
    (["--emit", "skypilot", "{jobs}", "--bucket", BUCKET, "--accelerator", "cpu"],
     "accelerator 'cpu' has no cloud slice to ask for; choose one of v5e-8"),
    (["--emit", "skypilot", "{jobs}", "--bucket", BUCKET, "--data-root", "{jobs}/no-data"],
     "no such directory; pass the local directory or the gs:// URL"),
    (["--bucket", BUCKET, "--out", "{jobs}"], "--bucket goes with --emit"),
])
def test_emit_refuses_naming_the_fix_and_writes_nothing(tmp_path, capsys, args, fix):
    jobs = tmp_path / "jobs"
    with pytest.raises(SystemExit) as e:
        matrix.main([a.format(jobs=jobs) for a in args] + ["--cell", "single-math-qwen3-0.6b"])
    assert e.value.code == 2 and fix in capsys.readouterr().err
    assert not jobs.exists()


def tpu_vm(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run(["bash", str(REPO / "launch" / "tpu_vm.sh"), "--dry-run", *args], capture_output=True,
                          text=True, timeout=120, env={**os.environ, "PYTHON": sys.executable}, cwd=REPO)


def test_tpu_vm_keeps_its_run_dir_in_the_bucket():
    cell = "voting-math-qwen3-0.6b-isolated"
    done = tpu_vm("--cell", cell, "--bucket", BUCKET + "/", "--accelerator", "v6e-8", "--spot")
    assert done.returncode == 0, done.stderr
    create = next(line for line in done.stdout.splitlines() if " tpu-vm create " in line)
    assert "--accelerator-type v6e-8 --version v2-alpha-tpuv6e --spot" in create
    assert f"run_dir={BUCKET}/{cell}" in done.stdout and "run_dir=runs/" not in done.stdout
    assert f"gcloud storage cp --recursive {BUCKET}/{cell} runs/" in done.stdout


@pytest.mark.parametrize("args, fix", [
    (["--cell", "single-math-qwen3-0.6b"], "--bucket (missing): pass --bucket gs://BUCKET/PATH"),
    (["--cell", "single-math-qwen3-0.6b", "--bucket", "runs"], "--bucket runs: pass --bucket gs://"),
    (["--cell", "single-math-qwen3-0.6b", "--bucket", BUCKET, "--accelerator", "h100"],
     "'h100' is a GPU host, not a TPU slice: launch/gpu_host.sh runs it"),
])
def test_tpu_vm_refuses_naming_the_fix(args, fix):
    done = tpu_vm(*args)
    assert done.returncode == 2 and fix in done.stderr and "tpu-vm create" not in done.stdout
