"""Job specs that run many matrix cells on many slices through an orchestrator: one SkyPilot managed-job
task per cell (`python -m marljax.matrix --emit skypilot DIR --bucket gs://B/matrix`), launched with
`sky jobs launch DIR/<cell>.yaml`.

Each task asks for the cell's slice on spot capacity; SkyPilot's managed jobs bring a preempted job back on a
new slice, and the run there resumes from the newest checkpoint in its run dir, BUCKET/<cell> (a bucket, so
the checkpoints outlive the slice). SkyPilot, not xpk: `skypilot==0.14.1` installs beside marljax's pinned
jax, flax, orbax and numpy and parses a task offline (`sky.Task.from_yaml`, no cloud credentials); xpk
1.16.0 pins protobuf 5.29 and packaging 24.2 below what marljax's environment runs, and takes a workload as
command-line flags against a live GKE cluster rather than as a file (SkyPilot also reaches GKE, through its
Kubernetes cloud). The checkout travels as SkyPilot's `workdir`; the cell's config and the datasets as
`file_mounts` (the config is written under `runs/`, which a workdir upload leaves out as git does).
"""
from __future__ import annotations

import dataclasses
import pathlib
import shlex

import yaml

REMOTE_CONFIG = "/marljax/cell.yaml"  # where a job's cell config lands on the slice
REMOTE_DATA = "/marljax/data"  # where the datasets land (the cells' configs read task.path below it)
VENV = "~/marljax-venv"
# A run resumes from its newest checkpoint, so a restart after an error loses at most checkpoint.every
# steps; a failure that repeats costs this many setups before the job gives up.
RESTARTS_ON_ERRORS = 3


class LaunchSpecError(ValueError):
    """A job spec that cannot be written as asked; the message names the fix."""


@dataclasses.dataclass(frozen=True)
class Slice:
    """How one matrix accelerator is asked for: SkyPilot's accelerator name (`tpu-<gcloud type>` for a TPU
    VM slice, `<GPU>:<count>` for a GPU host) and, for a TPU, the TPU VM runtime image."""

    accelerator: str
    runtime: str | None = None

    @property
    def tpu(self) -> bool:
        return self.runtime is not None

    @property
    def jax_extra(self) -> str:
        return "jax[tpu]" if self.tpu else "jax[cuda12]"


# The accelerators of `marljax.matrix.ACCELERATORS` that a cloud rents (its `cpu` is this project's box).
SLICES = {
    "v5e-8": Slice("tpu-v5litepod-8", "v2-alpha-tpuv5-lite"),
    "v4-8": Slice("tpu-v4-8", "tpu-ubuntu2204-base"),
    "v6e-8": Slice("tpu-v6e-8", "v2-alpha-tpuv6e"),
    "v5p-8": Slice("tpu-v5p-8", "v2-alpha-tpuv5"),
    "h100": Slice("H100:8"),
    "h200": Slice("H200:8"),
}
ORCHESTRATORS = ("skypilot",)


@dataclasses.dataclass(frozen=True)
class Job:
    """One cell to launch: its name, its config file on this machine, the hub id of its model's weights."""

    cell: str
    config: pathlib.Path
    weights: str


@dataclasses.dataclass(frozen=True)
class Target:
    """Where the jobs run and write: the slice, the bucket holding the run dirs, the datasets' source, and
    the checkout that travels as the workdir."""

    slice: Slice
    bucket: str
    data: str
    checkout: pathlib.Path


def slice_for(accelerator: str) -> Slice:
    """The slice of a matrix accelerator, or LaunchSpecError naming those a cloud rents."""
    if accelerator not in SLICES:
        raise LaunchSpecError(f"accelerator {accelerator!r} has no cloud slice to ask for; choose one of "
                              f"{', '.join(SLICES)} (--accelerator)")
    return SLICES[accelerator]


def tpu_vm(accelerator: str) -> tuple[str, str]:
    """The TPU VM accelerator type (gcloud's) and runtime image of a matrix TPU; `launch/tpu_vm.sh` reads
    them here, so the single-slice path and the specs ask for the same slice."""
    s = slice_for(accelerator)
    if not s.tpu:
        raise LaunchSpecError(f"accelerator {accelerator!r} is a GPU host, not a TPU slice: launch/gpu_host.sh "
                              "runs it (or --emit skypilot)")
    return s.accelerator.removeprefix("tpu-"), s.runtime


def target(orchestrator: str, accelerator: str, bucket: str | None, data: str) -> Target:
    """Check everything a spec needs before anything is written: the orchestrator, the slice, a gs:// bucket
    for the run dirs, and the datasets (a gs:// URL, or a local directory that exists)."""
    if orchestrator not in ORCHESTRATORS:
        raise LaunchSpecError(f"--emit {orchestrator}: marljax writes specs for {', '.join(ORCHESTRATORS)} only "
                              "(xpk pins protobuf and packaging below marljax's environment; see "
                              "marljax/core/launch_specs.py); use --emit skypilot")
    rented = slice_for(accelerator)
    if not bucket or not bucket.startswith("gs://") or not bucket[5:].strip("/"):
        raise LaunchSpecError(f"--bucket {bucket or '(missing)'}: the run dirs need a bucket URL, "
                              "--bucket gs://BUCKET/PATH, so that a job recovered on a new slice resumes "
                              "from the checkpoints the preempted one wrote")
    if not data.startswith("gs://"):
        if not pathlib.Path(data).is_dir():
            raise LaunchSpecError(f"--data-root {data}: no such directory; pass the local directory or the "
                                  "gs:// URL holding dapo-math-17k/ and deepcoder/ (the jobs mount it at "
                                  f"{REMOTE_DATA})")
        data = str(pathlib.Path(data).resolve())
    checkout = pathlib.Path(__file__).resolve().parents[2]
    if not (checkout / "pyproject.toml").is_file():
        raise LaunchSpecError(f"{checkout} is not a marljax checkout (no pyproject.toml); the jobs carry the "
                              "checkout as their workdir: run from a clone installed with `pip install -e .`")
    return Target(rented, bucket.rstrip("/"), data, checkout)


def skypilot_task(job: Job, where: Target) -> dict:
    """The SkyPilot task of one cell: its slice on spot with automatic recovery, the checkout installed
    with JAX for the slice and the weights fetched (setup), and training that resumes by itself (run)."""
    resources = {"accelerators": where.slice.accelerator, "use_spot": True,
                 "job_recovery": {"strategy": "EAGER_NEXT_REGION", "max_restarts_on_errors": RESTARTS_ON_ERRORS}}
    if where.slice.tpu:
        resources["accelerator_args"] = {"runtime_version": where.slice.runtime}
    pip = f"{VENV}/bin/pip install -q"
    setup = [f"python3 -m venv {VENV}", f"{pip} -U pip", f"{pip} {shlex.quote(where.slice.jax_extra)} -e .",
             f"{VENV}/bin/hf download {shlex.quote(job.weights)}"]
    run = (f"source {VENV}/bin/activate && python -m marljax.train --config {REMOTE_CONFIG} "
           f"{shlex.quote(f'run_dir={run_dir(where, job.cell)}')}")
    task = {"name": job.cell, "resources": resources, "workdir": str(where.checkout),
            "file_mounts": {REMOTE_CONFIG: str(job.config.resolve()), REMOTE_DATA: where.data},
            "setup": " && ".join(setup), "run": run}
    if where.slice.tpu:  # jax.distributed finds a TPU slice's hosts itself, one or many
        task["envs"] = {"MARLJAX_DISTRIBUTED": "1"}
    return task


def run_dir(where: Target, cell: str) -> str:
    """A cell's run dir: BUCKET/<cell>."""
    return f"{where.bucket}/{cell}"


def write_skypilot(jobs: list[Job], where: Target, out: pathlib.Path) -> list[pathlib.Path]:
    """Write `out/<cell>.yaml`, one SkyPilot task per job; their paths."""
    out.mkdir(parents=True, exist_ok=True)
    paths = []
    for job in jobs:
        path = out / f"{job.cell}.yaml"
        path.write_text(f"# marljax.matrix cell {job.cell}: sky jobs launch {path}\n"
                        + yaml.safe_dump(skypilot_task(job, where), sort_keys=False))
        paths.append(path)
    return paths
