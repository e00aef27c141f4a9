"""Load SkyPilot task files with SkyPilot's own parser and print what it read, one JSON object per file;
`tests/test_launch_specs.py` runs this with a Python that has `skypilot` (the marljax[launch] extra, or
the separate environment .ci/run makes) and asserts on the output. Offline: parsing calls no cloud.

    python tests/skypilot_parse.py DIR/a.yaml DIR/b.yaml ...
"""
from __future__ import annotations

import json
import sys

import sky


def read(path: str) -> dict:
    task = sky.Task.from_yaml(path)
    (resources,) = task.resources
    return {"name": task.name, "accelerators": resources.accelerators, "use_spot": resources.use_spot,
            "job_recovery": resources.job_recovery, "accelerator_args": resources.accelerator_args,
            "cloud": str(resources.cloud) if resources.cloud else None, "num_nodes": task.num_nodes,
            "workdir": task.workdir, "file_mounts": task.file_mounts, "envs": task.envs, "setup": task.setup,
            "run": task.run}


if __name__ == "__main__":
    print(json.dumps({"skypilot": sky.__version__, "tasks": [read(p) for p in sys.argv[1:]]}))
