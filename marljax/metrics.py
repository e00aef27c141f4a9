"""Run logging at the edge: one JSON object per line in RUN_DIR/metrics.jsonl, plus TensorBoard."""
from __future__ import annotations

import json
import math
import pathlib
from typing import Any


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

    def __init__(self, run_dir: str | pathlib.Path, *, tensorboard: bool = True):
        self.path = pathlib.Path(run_dir) / "metrics.jsonl"
        self.path.parent.mkdir(parents=True, exist_ok=True)
        records = read_metrics(run_dir) if self.path.exists() else []
        self.last_step = max((r.get("step", 0) for r in records), default=None)
        self.tb = None
        if tensorboard:
            from tensorboardX import SummaryWriter
            self.tb = SummaryWriter(str(pathlib.Path(run_dir) / "tb"))

    def truncate_after(self, step: int) -> None:
        """Drop records of steps > `step` (written after the checkpoint a resumed run restarts from)."""
        if not self.path.exists():
            return
        keep = [line for line in self.path.read_text().splitlines()
                if line.strip() and json.loads(line).get("step", 0) <= step]
        self.path.write_text("".join(line + "\n" for line in keep))
        self.last_step = max((json.loads(line).get("step", 0) for line in keep), default=None)

    def log(self, record: dict[str, Any]) -> None:
        step = record.get("step", 0)
        if self.last_step is not None and step <= self.last_step:
            raise ValueError(f"{self.path} already holds step {self.last_step}; refusing to log step {step} "
                             "(each step is logged once, in order). Resume from a checkpoint, or start afresh "
                             "in a run_dir without this file.")
        self.last_step = step
        record = {k: _clean(v) for k, v in record.items()}
        with self.path.open("a") as f:
            f.write(json.dumps(record, sort_keys=True) + "\n")
        if self.tb is not None:
            for k, v in record.items():
                if k != "step" and isinstance(v, (int, float)) and not isinstance(v, bool):
                    self.tb.add_scalar(k, v, step)
            self.tb.flush()

    def close(self):
        if self.tb is not None:
            self.tb.close()


def read_metrics(run_dir: str | pathlib.Path) -> list[dict[str, Any]]:
    """All records of a run, in order."""
    path = pathlib.Path(run_dir) / "metrics.jsonl"
    if not path.exists():
        raise FileNotFoundError(f"{path} does not exist; is {run_dir} a marljax run directory?")
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
