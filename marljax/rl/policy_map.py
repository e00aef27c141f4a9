"""Role → parameter-set routing: which trainable state each workflow role samples from and updates.

Parameters live as a plain dict `params = {set_name: trainable_state}`; a `PolicyMap` says which set
each role uses. Shared-Policy routes every role to one set, Isolated-Policy gives each role its own,
and any other map is legal (e.g. voters and workers alone, supervisory roles together).
Same-role parallel agents (Voting's three voters) are one role, hence always one set.
"""
from __future__ import annotations

import dataclasses
import re
from collections.abc import Callable, Mapping, Sequence
from typing import Any, TypeVar

T = TypeVar("T")

POLICY_CHOICES = ("shared", "isolated")

# Set names become pytree keys, checkpoint directories and metric keys (`set/<name>/...`).
_SET_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.-]*$")


@dataclasses.dataclass(frozen=True)
class PolicyMap:
    """`route[role] = set_name`; `sets` lists every set once, in first-use order of the roles.

    Build with `shared`, `isolated` or `from_config`; direct construction validates too. `sets` may be
    omitted (derived from `route`); if given it must name exactly the routed sets.
    """

    route: Mapping[str, str]
    sets: tuple[str, ...] = ()

    def __post_init__(self):
        route = dict(self.route)
        if not route:
            raise ValueError("PolicyMap: route is empty; every workflow role needs a parameter set.")
        for role, name in route.items():
            if not isinstance(role, str) or not role:
                raise ValueError(f"PolicyMap: role names must be non-empty strings, got {role!r}.")
            if not isinstance(name, str):
                raise TypeError(f"PolicyMap: role {role!r} is routed to {name!r}; set names are strings.")
            if not name.strip():
                raise ValueError(f"PolicyMap: role {role!r} is routed to an empty set name.")
            if not _SET_NAME.match(name):
                raise ValueError(
                    f"PolicyMap: set name {name!r} (role {role!r}) must match {_SET_NAME.pattern}; it is "
                    "used as a checkpoint directory and a metric key.")
        used = tuple(dict.fromkeys(route.values()))
        sets = tuple(self.sets) or used
        if len(set(sets)) != len(sets):
            raise ValueError(f"PolicyMap: duplicate set names in sets={sets}.")
        unused = [s for s in sets if s not in used]
        if unused:
            raise ValueError(f"PolicyMap: sets {unused} are declared but no role is routed to them "
                             f"(route={route}); remove them or route a role there.")
        undeclared = [s for s in used if s not in sets]
        if undeclared:
            raise ValueError(f"PolicyMap: roles are routed to sets {undeclared} missing from sets={sets}.")
        object.__setattr__(self, "route", route)
        object.__setattr__(self, "sets", sets)

    def __hash__(self):  # hashable, so it can be a static argument of jax.jit
        return hash((tuple(sorted(self.route.items())), self.sets))

    @property
    def roles(self) -> tuple[str, ...]:
        """Routed roles, in route order."""
        return tuple(self.route)

    def set_of(self, role: str) -> str:
        """The set `role` uses."""
        try:
            return self.route[role]
        except KeyError:
            raise KeyError(f"role {role!r} is not routed; routed roles: {list(self.route)}") from None

    def roles_of(self, set_name: str) -> tuple[str, ...]:
        """Roles routed to `set_name`, in route order."""
        if set_name not in self.sets:
            raise KeyError(f"unknown parameter set {set_name!r}; sets: {list(self.sets)}")
        return tuple(r for r, s in self.route.items() if s == set_name)

    def params_for(self, params: Mapping[str, T], role: str) -> T:
        """`params[route[role]]`, with an error naming the missing set."""
        name = self.set_of(role)
        if name not in params:
            raise KeyError(f"params has no set {name!r} (for role {role!r}); it has {list(params)}")
        return params[name]

    def validate(self, roles: Sequence[str]) -> PolicyMap:
        """Check the map against a workflow's roles: each routed, none extra. Returns self."""
        missing = [r for r in roles if r not in self.route]
        if missing:
            raise ValueError(f"PolicyMap: workflow roles {missing} are not routed to any parameter set "
                             f"(route={self.route}).")
        extra = [r for r in self.route if r not in roles]
        if extra:
            raise ValueError(f"PolicyMap: routed roles {extra} are not roles of the workflow "
                             f"(workflow roles: {list(roles)}).")
        return self


def _check_roles(roles: Sequence[str]) -> list[str]:
    roles = list(roles)
    if not roles:
        raise ValueError("PolicyMap: the workflow has no roles.")
    dup = sorted({r for r in roles if roles.count(r) > 1})
    if dup:
        raise ValueError(f"PolicyMap: duplicate roles {dup}.")
    return roles


def shared(roles: Sequence[str], name: str = "shared") -> PolicyMap:
    """Shared-Policy: every role uses one parameter set called `name`."""
    return PolicyMap({r: name for r in _check_roles(roles)})


def isolated(roles: Sequence[str]) -> PolicyMap:
    """Isolated-Policy: one parameter set per role, named after the role."""
    return PolicyMap({r: r for r in _check_roles(roles)})


def from_config(spec: str | Mapping[str, str], roles: Sequence[str]) -> PolicyMap:
    """Build from a config value: "shared", "isolated", or an explicit {role: set_name} mapping.

    The mapping must route exactly the workflow's `roles`; its sets are ordered by the roles' order.
    """
    roles = _check_roles(roles)
    if isinstance(spec, str):
        if spec == "shared":
            return shared(roles)
        if spec == "isolated":
            return isolated(roles)
        raise ValueError(f"policy {spec!r} is not one of {POLICY_CHOICES} or a {{role: set_name}} mapping.")
    if not isinstance(spec, Mapping):
        raise TypeError(f"policy must be a string {POLICY_CHOICES} or a mapping, got {type(spec).__name__}.")
    pm = PolicyMap(dict(spec)).validate(roles)
    return PolicyMap({r: pm.route[r] for r in roles})


def init_params(policy_map: PolicyMap, make_state_fn: Callable[[str], Any]) -> dict[str, Any]:
    """`{set_name: make_state_fn(set_name)}` for every set, in `policy_map.sets` order.

    For distinct random inits per set, derive the key inside `make_state_fn`, e.g.
    `jax.random.fold_in(key, policy_map.sets.index(set_name))`.
    """
    return {name: make_state_fn(name) for name in policy_map.sets}


TRANSFER_MODES = ("all", "generators")


def transfer(roles: Sequence[str], solving_roles: Sequence[str], mode: str, *, trained: str = "sa",
             base: str = "base") -> PolicyMap:
    """The paper's SA→MA transfer controls: a single-agent run's set (`trained`) on every role (`all`), or on
    the solving roles only (generator and voters, workers) with the untrained base model (`base`) on the
    supervisory ones (evaluator, aggregator, orchestrator, synthesizer) (`generators`)."""
    roles = _check_roles(roles)
    if mode not in TRANSFER_MODES:
        raise ValueError(f"transfer={mode!r}; choose one of {TRANSFER_MODES}.")
    return PolicyMap({r: trained if mode == "all" or r in solving_roles else base for r in roles})
