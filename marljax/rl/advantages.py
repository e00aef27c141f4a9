"""Group-relative advantages over workflow role calls, with the group key as an explicit function.

Every role call is one sample tagged with `problem_id`, `rollout` (0..G-1), `role`, `slot` (index
among parallel calls of the role in one episode: voter k, worker k) and `turn` (iteration of a
multi-turn role, Eval-Opt). A **group-key function** maps these five to a hashable key; samples with
equal keys form one group and are baselined against each other:

* `paper` (SPEC §1, the authors' code): `(problem, role, slot)` for roles listed in `split_slots`,
  else `(problem, role)`; turns are always pooled. The workflow says which roles' slots are distinct
  agents: Voting passes `split_slots={"generator"}` (three voter groups of G), Orch-Workers passes
  nothing (all workers of a problem pool into one group of ≤ 3G), Eval-Opt passes nothing (all turns
  of a role pool). This mirrors the authors' trajectory names: `generator0/1/2` vs one `worker`.
* `role`: `(problem, role)`, everything of a role pooled.
* `role_turn`: `(problem, role, turn)`, one group per turn (AT-GRPO-like); slots pooled.

Rewards are routed first (`broadcast`: the episode reward on every call, the paper; `per_role`: each
call's own `role_reward`), then an estimator turns each group's rewards into advantages. Groups of
one sample get advantage 0 (no baseline, no signal); verl instead keeps R/(1+eps) there.
"""
from __future__ import annotations

import dataclasses
from collections.abc import Callable, Collection, Hashable

import numpy as np

from marljax.rl.registry import Registry

GroupKeyFn = Callable[..., Hashable]  # (problem, rollout, role, slot, turn, *, split_slots) -> key
EstimatorFn = Callable[[np.ndarray, "AdvantageConfig"], np.ndarray]  # group rewards (n >= 2) -> adv

REWARD_ROUTINGS = ("broadcast", "per_role")  # see `route_rewards`
_GROUP_KEYS: Registry[GroupKeyFn] = Registry("group key")
_ESTIMATORS: Registry[EstimatorFn] = Registry("advantage estimator")


def register_group_key(name: str):
    """Decorator: register `fn(problem, rollout, role, slot, turn, *, split_slots) -> hashable key`."""
    return _GROUP_KEYS.register(name)


def get_group_key(name: str) -> GroupKeyFn:
    return _GROUP_KEYS.get(name)


def register_estimator(name: str):
    """Decorator: register `fn(rewards_of_one_group, cfg) -> advantages`, called for groups of ≥ 2."""
    return _ESTIMATORS.register(name)


def get_estimator(name: str) -> EstimatorFn:
    return _ESTIMATORS.get(name)


@register_group_key("paper")
def paper_key(problem, rollout, role, slot, turn, *, split_slots: Collection[str]) -> Hashable:
    """Voter slots apart, everything else of a role pooled (slots and turns)."""
    return (problem, role, slot) if role in split_slots else (problem, role)


@register_group_key("role")
def role_key(problem, rollout, role, slot, turn, *, split_slots: Collection[str]) -> Hashable:
    """All calls of a role on a problem in one group."""
    return (problem, role)


@register_group_key("role_turn")
def role_turn_key(problem, rollout, role, slot, turn, *, split_slots: Collection[str]) -> Hashable:
    """One group per (role, turn) of a problem."""
    return (problem, role, turn)


@dataclasses.dataclass(frozen=True)
class AdvantageConfig:
    """How rewards become advantages. `std_ddof=1` is torch.std's default, which verl's GRPO uses."""

    estimator: str = "grpo"  # grpo | dr_grpo | rloo | any registered
    group_key: str = "paper"  # paper | role | role_turn | any registered
    reward_routing: str = "broadcast"  # broadcast | per_role
    eps: float = 1e-6
    std_ddof: int = 1


@register_estimator("grpo")
def grpo(r: np.ndarray, cfg: AdvantageConfig) -> np.ndarray:
    """(R − mean) / (std + eps); std with `cfg.std_ddof` (1 = unbiased, as verl)."""
    return (r - r.mean()) / (r.std(ddof=cfg.std_ddof) + cfg.eps)


@register_estimator("dr_grpo")
def dr_grpo(r: np.ndarray, cfg: AdvantageConfig) -> np.ndarray:
    """R − mean (Dr. GRPO: no std scaling)."""
    return r - r.mean()


@register_estimator("rloo")
def rloo(r: np.ndarray, cfg: AdvantageConfig) -> np.ndarray:
    """R − mean of the other samples = n/(n−1)·(R − mean)."""
    n = r.size
    return (r - r.mean()) * n / (n - 1)


def route_rewards(routing: str, episode_reward, role_reward=None) -> np.ndarray:
    """Reward per call. `per_role` takes `role_reward` where it is finite and the episode reward where it
    is NaN (a role without its own reward, e.g. the aggregator whose reward is the outcome)."""
    ep = np.asarray(episode_reward, dtype=np.float64)
    if not np.all(np.isfinite(ep)):
        raise ValueError(f"episode_reward has non-finite values at {np.flatnonzero(~np.isfinite(ep))[:10]}")
    if routing == "broadcast":
        return ep
    if routing == "per_role":
        if role_reward is None:
            raise ValueError("reward_routing='per_role' needs role_reward (NaN where a role has none).")
        rr = np.asarray(role_reward, dtype=np.float64)
        if rr.shape != ep.shape:
            raise ValueError(f"role_reward shape {rr.shape} != episode_reward shape {ep.shape}")
        if np.any(np.isinf(rr)):
            raise ValueError("role_reward has infinite values; use NaN for 'no role-specific reward'.")
        return np.where(np.isnan(rr), ep, rr)
    raise ValueError(f"unknown reward_routing {routing!r}; expected one of {REWARD_ROUTINGS}.")


def group_keys(problem_id, rollout, role, slot, turn, *, preset: str = "paper",
               split_slots: Collection[str] = ()) -> list[Hashable]:
    """The group key of every sample under `preset` (see module doc). Arrays of equal length N."""
    cols = [np.asarray(c) for c in (problem_id, rollout, role, slot, turn)]
    n = cols[0].shape[0] if cols[0].ndim else -1
    if any(c.ndim != 1 or c.shape[0] != n for c in cols):
        raise ValueError("problem_id, rollout, role, slot, turn must be 1-D arrays of one length; got shapes "
                         f"{[c.shape for c in cols]}")
    fn, split = get_group_key(preset), frozenset(split_slots)
    return [fn(*row, split_slots=split) for row in zip(*(c.tolist() for c in cols))]


@dataclasses.dataclass(frozen=True)
class Advantages:
    """Per-sample `advantage` (float64), routed `reward`, `group_id` into `keys`, and `group_size`."""

    advantage: np.ndarray
    reward: np.ndarray
    group_id: np.ndarray
    group_size: np.ndarray
    keys: tuple[Hashable, ...]

    def metrics(self) -> dict[str, float]:
        """Group statistics for logging: count, mean size, fraction with no reward spread (no signal)."""
        n = len(self.keys)
        if n == 0:
            return {"adv/n_groups": 0.0}
        sizes = np.bincount(self.group_id, minlength=n)
        lo = np.full(n, np.inf)
        hi = np.full(n, -np.inf)
        np.minimum.at(lo, self.group_id, self.reward)
        np.maximum.at(hi, self.group_id, self.reward)
        return {"adv/n_groups": float(n), "adv/group_size_mean": float(sizes.mean()),
                "adv/frac_flat_groups": float(np.mean(lo == hi)),
                "adv/abs_mean": float(np.abs(self.advantage).mean())}


def compute_advantages(*, problem_id, rollout, role, slot, turn, episode_reward, role_reward=None,
                       cfg: AdvantageConfig = AdvantageConfig(),
                       split_slots: Collection[str] = ()) -> Advantages:
    """Advantages for one batch of role calls (1-D arrays, one entry per call).

    `split_slots`: roles whose parallel slots are distinct agents with separate groups under `paper`
    (Voting: {"generator"}). Groups are numbered in order of first appearance.
    """
    keys = group_keys(problem_id, rollout, role, slot, turn, preset=cfg.group_key, split_slots=split_slots)
    reward = route_rewards(cfg.reward_routing, episode_reward, role_reward)
    if reward.shape != (len(keys),):
        raise ValueError(f"rewards have shape {reward.shape}, expected ({len(keys)},)")
    estimator = get_estimator(cfg.estimator)
    index: dict[Hashable, int] = {}
    group_id = np.array([index.setdefault(k, len(index)) for k in keys], dtype=np.int64)
    sizes = np.bincount(group_id, minlength=len(index))
    advantage = np.zeros(len(keys), dtype=np.float64)
    for g in np.flatnonzero(sizes > 1):
        members = np.flatnonzero(group_id == g)
        advantage[members] = estimator(reward[members], cfg)
    return Advantages(advantage=advantage, reward=reward, group_id=group_id, group_size=sizes[group_id],
                      keys=tuple(index))


def permuted_within_roles(advantage, role, seed) -> np.ndarray:
    """`advantage` with each role's entries shuffled among that role's samples (seeded): each sample keeps
    an advantage from its role's distribution, but one unrelated to its own text and group, so gradients
    that align only through real credit no longer do. The null of the gradient-coherence figures. `seed`:
    anything `np.random.default_rng` takes."""
    adv, role = np.asarray(advantage, dtype=np.float64), np.asarray(role)
    out, rng = adv.copy(), np.random.default_rng(seed)
    for r in np.unique(role):
        idx = np.flatnonzero(role == r)
        out[idx] = adv[rng.permutation(idx)]
    return out
