"""Host-side training diagnostics: eval-accuracy peak/final and the terminal cliff, role dominance of a
shared update, per-role output-length drift. Pure Python; each tracker has `update`, `summary`, and
JSON-safe `state_dict` / `from_state_dict` so the trainer can checkpoint it.

Terminal cliff (SPEC "Findings"): a large drop from the peak late in training that does not recover.
With peak P (the best eval so far), drop δ = `min_drop` and recovery band ρ·δ (`recovery_frac` ρ):

* an eval at or above P − ρ·δ is *healthy* and clears any drop;
* the *drop step* is the first eval after the last healthy one at or below P − δ;
* the run is *in a cliff* when a drop step exists and lies in the last `window_frac` of `total_steps`,
  i.e. drop_step ≥ (1 − window_frac)·total_steps. Every later eval then stayed below P − ρ·δ: it has
  not recovered. The band between P − δ and P − ρ·δ is hysteresis, so eval noise around one threshold
  does not flip the state; ρ = ½ asks a recovery to win back at least half the drop.

Online, `in_cliff` answers "is this a terminal cliff if training ended now"; offline (`detect_cliff`)
the same rule runs on a finished series. A drop that starts before the window and never recovers is
reported as `collapsed` but is not a terminal cliff.
"""
from __future__ import annotations

import dataclasses
import math
from collections.abc import Mapping, Sequence
from typing import Any


@dataclasses.dataclass(frozen=True)
class CliffConfig:
    """δ in accuracy units (0.05 = 5 points on a 0–1 scale), late window, recovery band fraction."""

    min_drop: float = 0.05
    window_frac: float = 0.25
    recovery_frac: float = 0.5

    def __post_init__(self):
        if self.min_drop <= 0:
            raise ValueError(f"min_drop must be > 0, got {self.min_drop}")
        if not 0 < self.window_frac <= 1:
            raise ValueError(f"window_frac must be in (0, 1], got {self.window_frac}")
        if not 0 <= self.recovery_frac < 1:
            raise ValueError(f"recovery_frac must be in [0, 1), got {self.recovery_frac}")


@dataclasses.dataclass
class AccuracyTracker:
    """Eval accuracy over training: base (first eval), peak and its step, final, and the cliff state.

    `best_step` is the step of the first eval that reached the peak: the checkpoint to roll back to.
    """

    total_steps: int
    cliff: CliffConfig = CliffConfig()
    n_evals: int = 0
    base: float | None = None
    peak: float | None = None
    best_step: int | None = None
    final: float | None = None
    final_step: int | None = None
    healthy_step: int | None = None
    drop_step: int | None = None
    cliff_events: list[int] = dataclasses.field(default_factory=list)

    def __post_init__(self):
        if self.total_steps <= 0:
            raise ValueError(f"total_steps must be > 0, got {self.total_steps}")

    @property
    def cutoff_step(self) -> float:
        """Drops at or after this step are late enough to be terminal."""
        return (1.0 - self.cliff.window_frac) * self.total_steps

    @property
    def in_cliff(self) -> bool:
        return self.drop_step is not None and self.drop_step >= self.cutoff_step

    def update(self, step: int, accuracy: float) -> bool:
        """Record one eval. Returns True iff this eval *enters* the cliff state (the rollback trigger)."""
        step, accuracy = int(step), float(accuracy)
        if not math.isfinite(accuracy):
            raise ValueError(f"accuracy at step {step} is not finite: {accuracy}")
        if self.final_step is not None and step <= self.final_step:
            raise ValueError(f"eval steps must increase: got {step} after {self.final_step}")
        was_in_cliff = self.in_cliff
        self.n_evals += 1
        if self.base is None:
            self.base = accuracy
        if self.peak is None or accuracy > self.peak:
            self.peak, self.best_step = accuracy, step
        self.final, self.final_step = accuracy, step
        if accuracy >= self.peak - self.cliff.recovery_frac * self.cliff.min_drop:
            self.healthy_step, self.drop_step = step, None
        elif self.drop_step is None and accuracy <= self.peak - self.cliff.min_drop:
            self.drop_step = step
        entered = self.in_cliff and not was_in_cliff
        if entered:
            self.cliff_events.append(step)
        return entered

    def rolled_back(self) -> None:
        """The trainer restored the peak's parameters: clear the drop (peak, history and `cliff_events`
        stay), so the next eval at or below P − δ in the window fires again."""
        self.drop_step = None

    def summary(self) -> dict[str, Any]:
        """Base/peak/final, peak − final drop, peak − base gain, drop step, cliff and collapse flags."""
        if self.n_evals == 0:
            return {"n_evals": 0}
        return {"n_evals": self.n_evals, "base": self.base, "peak": self.peak, "best_step": self.best_step,
                "final": self.final, "final_step": self.final_step, "gain": self.peak - self.base,
                "drop": self.peak - self.final, "drop_step": self.drop_step, "cliff": self.in_cliff,
                "collapsed": self.drop_step is not None, "cliff_events": list(self.cliff_events)}

    def state_dict(self) -> dict[str, Any]:
        d = dataclasses.asdict(self)
        d["cliff"] = dataclasses.asdict(self.cliff)
        return d

    @classmethod
    def from_state_dict(cls, state: Mapping[str, Any]) -> AccuracyTracker:
        state = dict(state)
        state["cliff"] = CliffConfig(**state["cliff"])
        state["cliff_events"] = list(state["cliff_events"])
        return cls(**state)


def detect_cliff(steps: Sequence[int], accuracies: Sequence[float], total_steps: int | None = None,
                 cfg: CliffConfig = CliffConfig()) -> dict[str, Any]:
    """Offline: run the online tracker over a finished eval series; `total_steps` defaults to the last step."""
    if len(steps) != len(accuracies) or not steps:
        raise ValueError(f"need equal, non-empty series; got {len(steps)} steps, {len(accuracies)} values")
    tracker = AccuracyTracker(total_steps=int(total_steps if total_steps is not None else steps[-1]), cliff=cfg)
    for s, a in zip(steps, accuracies):
        tracker.update(s, a)
    return tracker.summary()


@dataclasses.dataclass
class DominanceTracker:
    """Which role dominates an update: max over roles of its gradient share averaged over the last
    `window` steps. Feed shares of roles on one parameter set (they sum to 1 there); a role missing from
    a step counts as share 0. With n roles, 1/n means balanced and 1 means one role takes everything."""

    window: int = 10
    history: list[dict[str, float]] = dataclasses.field(default_factory=list)

    def __post_init__(self):
        if self.window <= 0:
            raise ValueError(f"window must be > 0, got {self.window}")

    def update(self, shares: Mapping[str, float]) -> None:
        self.history.append({r: float(v) for r, v in shares.items()})
        del self.history[:-self.window]

    def mean_shares(self) -> dict[str, float]:
        """Windowed mean share per role (roles in order of first appearance)."""
        roles = dict.fromkeys(r for h in self.history for r in h)
        n = max(len(self.history), 1)
        return {r: sum(h.get(r, 0.0) for h in self.history) / n for r in roles}

    def index(self) -> tuple[str | None, float]:
        """(dominant role, its windowed mean share); (None, nan) before any update, (None, 0.0) when no role
        had a gradient in the window (flat GRPO groups everywhere: nothing to dominate)."""
        means = self.mean_shares()
        if not means:
            return None, math.nan
        role = max(means, key=means.get)
        return (role, means[role]) if means[role] > 0 else (None, 0.0)

    def summary(self) -> dict[str, Any]:
        role, value = self.index()
        return {"dominant_role": role, "dominance": value, "n_roles": len(self.mean_shares()),
                "window_used": len(self.history)}

    def state_dict(self) -> dict[str, Any]:
        return {"window": self.window, "history": [dict(h) for h in self.history]}

    @classmethod
    def from_state_dict(cls, state: Mapping[str, Any]) -> DominanceTracker:
        return cls(window=int(state["window"]), history=[dict(h) for h in state["history"]])


@dataclasses.dataclass
class LengthDrift:
    """Per-role mean output length relative to the role's first observation (step 0 normally).

    Aggregator drift from `\\boxed{2}` to long text, or an evaluator starting to write code, shows up as
    a ratio far from 1."""

    base: dict[str, float] = dataclasses.field(default_factory=dict)
    base_step: dict[str, int] = dataclasses.field(default_factory=dict)
    last: dict[str, float] = dataclasses.field(default_factory=dict)
    max_ratio: dict[str, float] = dataclasses.field(default_factory=dict)

    def update(self, step: int, mean_lengths: Mapping[str, float]) -> dict[str, float]:
        """Record per-role mean lengths (tokens); returns each given role's ratio to its base."""
        ratios = {}
        for role, length in mean_lengths.items():
            length = float(length)
            if not math.isfinite(length) or length < 0:
                raise ValueError(f"mean length of role {role!r} at step {step} must be finite and ≥ 0: {length}")
            if role not in self.base:
                self.base[role], self.base_step[role] = length, int(step)
            self.last[role] = length
            ratios[role] = self.ratio(role)
            self.max_ratio[role] = max(self.max_ratio.get(role, ratios[role]), ratios[role])
        return ratios

    def ratio(self, role: str) -> float:
        base = self.base[role]
        return self.last[role] / base if base > 0 else math.inf

    def summary(self) -> dict[str, dict[str, float]]:
        return {r: {"base": self.base[r], "base_step": self.base_step[r], "last": self.last[r],
                    "ratio": self.ratio(r), "max_ratio": self.max_ratio[r]} for r in self.base}

    def state_dict(self) -> dict[str, Any]:
        return {k: dict(v) for k, v in dataclasses.asdict(self).items()}

    @classmethod
    def from_state_dict(cls, state: Mapping[str, Any]) -> LengthDrift:
        return cls(**{k: dict(state[k]) for k in ("base", "base_step", "last", "max_ratio")})
