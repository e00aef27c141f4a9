"""Run logging at the edge: one JSON object per line in RUN_DIR/metrics.jsonl, plus TensorBoard (RUN_DIR/tb).

A run dir in a bucket (`marljax.core.storage`) cannot append to an object: there metrics.jsonl is rewritten whole
on each record (an object write is atomic, so a killed run leaves the last complete file), and the
TensorBoard events are written to a local temporary folder and copied up on each flush.
"""
from __future__ import annotations

import json
import math
import shutil
import tempfile
from typing import Any

from etils import epath

from marljax.core import storage


def _clean(v: Any) -> Any:
    if hasattr(v, "item"):
        v = v.item()
    if isinstance(v, float) and not math.isfinite(v):
        return str(v)  # JSON has no NaN/inf; keep them visible as strings
    return v


class MetricsLogger:
    """Appends records to metrics.jsonl (surviving resume) and mirrors scalars to TensorBoard. Steps must
    increase: a record whose step the file already holds (or passed) is refused, so a re-run can never
    write a second copy of a step."""

    def __init__(self, run_dir: epath.PathLike, *, tensorboard: bool = True):
        run_dir = epath.Path(run_dir)
        self.path = run_dir / "metrics.jsonl"
        self.remote = storage.is_remote(run_dir)
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self.lines = [line for line in self.path.read_text().splitlines() if line.strip()] if self.path.exists() else []
        self.last_step = max((json.loads(line).get("step", 0) for line in self.lines), default=None)
        self.tb, self.tb_dir, self.tb_local = None, run_dir / "tb", None
        if tensorboard:
            from tensorboardX import SummaryWriter
            self.tb_local = tempfile.mkdtemp(prefix="marljax-tb-") if self.remote else None
            self.tb = SummaryWriter(self.tb_local or str(self.tb_dir))

    def truncate_after(self, step: int) -> None:
        """Drop records of steps > `step` (written after the checkpoint a resumed run restarts from)."""
        if not self.path.exists():
            return
        self.lines = [line for line in self.lines if json.loads(line).get("step", 0) <= step]
        self._write_all()
        self.last_step = max((json.loads(line).get("step", 0) for line in self.lines), default=None)

    def log(self, record: dict[str, Any]) -> None:
        step = record.get("step", 0)
        if self.last_step is not None and step <= self.last_step:
            raise ValueError(f"{self.path} already holds step {self.last_step}; refusing to log step {step} "
                             "(each step is logged once, in order). Resume from a checkpoint, or start afresh "
                             "in a run_dir without this file.")
        self.last_step = step
        record = {k: _clean(v) for k, v in record.items()}
        self.lines.append(json.dumps(record, sort_keys=True))
        if self.remote:
            self._write_all()
        else:
            with self.path.open("a") as f:
                f.write(self.lines[-1] + "\n")
        if self.tb is not None:
            for k, v in record.items():
                if k != "step" and isinstance(v, (int, float)) and not isinstance(v, bool):
                    self.tb.add_scalar(k, v, step)
            self.tb.flush()
            if self.tb_local:
                storage.mirror(self.tb_local, self.tb_dir)

    def _write_all(self) -> None:
        self.path.write_text("".join(line + "\n" for line in self.lines))

    def close(self):
        if self.tb is not None:
            self.tb.close()
        if self.tb_local:
            storage.mirror(self.tb_local, self.tb_dir)
            shutil.rmtree(self.tb_local)


def read_metrics(run_dir: epath.PathLike) -> list[dict[str, Any]]:
    """All records of a run, in order."""
    path = epath.Path(run_dir) / "metrics.jsonl"
    if not path.exists():
        raise FileNotFoundError(f"{path} does not exist; is {run_dir} a marljax run directory?")
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
