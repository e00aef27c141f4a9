"""Device mesh, logical-axis rules and shardings: how one model, its adapters and a batch spread over
many chips, with JAX's own SPMD (arrays on `NamedSharding`s, `jit` propagating them).

The mesh has three axes: `data` (replicas; split the batch), `fsdp` (split the batch and every
parameter's `embed` dim: fully sharded data parallel) and `tensor` (split heads, MLP and vocab:
tensor parallel). Parameters carry logical axis names (`logical_axes` metadata, e.g. ("layers",
"embed", "heads", "head_dim")); a rule set maps each name to mesh axes. Activations name their axes
through `constrain`, which is a no-op outside `use_mesh`, so single-device code runs unchanged.

Multi-host: `initialize_distributed()` starts `jax.distributed` when the environment asks for it;
every process then runs the same program on the global mesh, and only `is_primary()` writes files.
"""
from __future__ import annotations

import contextlib
import contextvars
import dataclasses
import math
import os
import sys
import traceback
from collections.abc import Callable, Iterator, Mapping
from typing import NoReturn

import jax
import optax
from flax import nnx
from jax.sharding import AxisType, Mesh, NamedSharding, PartitionSpec

MESH_AXES = ("data", "fsdp", "tensor")
LORA_PLACEMENTS = ("sharded", "replicated")

Rules = Mapping[str, "str | tuple[str, ...] | None"]

_FSDP: dict = {
    # parameters
    "layers": None, "vocab": None, "embed": "fsdp", "heads": None, "kv_heads": None,
    "head_dim": None, "mlp": None, "lora_rank": None,
    # activations
    "batch": ("data", "fsdp"), "length": None, "act_embed": None, "act_heads": None,
    "act_kv_heads": None, "act_mlp": None, "act_vocab": None,
}
_TENSOR = ("vocab", "heads", "kv_heads", "mlp", "act_heads", "act_kv_heads", "act_mlp", "act_vocab")
RULES: dict[str, dict] = {
    "fsdp": _FSDP,
    "fsdp_tp": {**_FSDP, **dict.fromkeys(_TENSOR, "tensor")},
}
# GQA models may have fewer KV heads than tensor ranks: their K/V weights then stay replicated.
_REPLICATE_IF_INDIVISIBLE = frozenset({"kv_heads"})


class ShardingError(ValueError):
    """A mesh or rule set that does not fit the devices or the model; the message names the fix."""


# ---- mesh -----------------------------------------------------------------------------------------
@dataclasses.dataclass
class MeshConfig:
    """Device mesh (a config's `mesh` section): sizes of its data, fsdp and tensor axes, -1 = the rest."""

    data: int = 1
    fsdp: int = -1
    tensor: int = 1
    rules: str = "auto"  # auto (fsdp_tp when tensor > 1, else fsdp) | a name in RULES: fsdp | fsdp_tp
    lora: str = "sharded"  # LORA_PLACEMENTS: sharded (by the base weight's rules) | replicated


def mesh_shape(cfg: MeshConfig, n_devices: int) -> tuple[int, int, int]:
    """(data, fsdp, tensor) sizes with the one -1 resolved to "the rest of the devices"."""
    sizes = [cfg.data, cfg.fsdp, cfg.tensor]
    if any(s == 0 or s < -1 for s in sizes) or sizes.count(-1) > 1:
        raise ShardingError(f"mesh.data={cfg.data}, mesh.fsdp={cfg.fsdp}, mesh.tensor={cfg.tensor}: "
                            "each size must be ≥ 1, and at most one may be -1 (the rest).")
    known = math.prod(s for s in sizes if s != -1)
    if -1 in sizes:
        if n_devices % known:
            raise ShardingError(f"mesh sizes {sizes}: the fixed sizes multiply to {known}, which does "
                                f"not divide the {n_devices} devices.")
        sizes[sizes.index(-1)] = n_devices // known
    if math.prod(sizes) != n_devices:
        raise ShardingError(f"mesh.data × mesh.fsdp × mesh.tensor = {' × '.join(map(str, sizes))} = "
                            f"{math.prod(sizes)}, but there are {n_devices} devices; make the sizes "
                            "multiply to the device count (or set one of them to -1).")
    return tuple(sizes)


def make_mesh(cfg: MeshConfig, devices=None) -> Mesh:
    """The (data, fsdp, tensor) mesh over `devices` (default: every device of every process)."""
    devices = jax.devices() if devices is None else list(devices)
    return jax.make_mesh(mesh_shape(cfg, len(devices)), MESH_AXES,
                         axis_types=(AxisType.Auto,) * len(MESH_AXES), devices=devices)


def get_rules(cfg: MeshConfig, mesh: Mesh) -> dict:
    """The rule set `cfg.rules` names (`auto`: fsdp_tp when the tensor axis is > 1, else fsdp)."""
    name = cfg.rules
    if name == "auto":
        name = "fsdp_tp" if mesh.shape["tensor"] > 1 else "fsdp"
    if name not in RULES:
        raise ShardingError(f"mesh.rules={cfg.rules!r}; choose from {['auto', *RULES]}.")
    if name == "fsdp" and mesh.shape["tensor"] > 1:
        raise ShardingError(f"mesh.rules=fsdp shards nothing over mesh.tensor={mesh.shape['tensor']}; "
                            "use mesh.rules=fsdp_tp (or auto), or mesh.tensor=1.")
    return RULES[name]


# ---- logical axes -> PartitionSpec ----------------------------------------------------------------
def logical_spec(axes, shape, mesh, rules: Rules, *, strict: bool = False,
                 what: str = "array") -> PartitionSpec:
    """The PartitionSpec of an array whose dims have logical names `axes`.

    A mesh axis is used at most once (first dim wins) and axes of size 1 are left out. When the
    mapped mesh axes do not divide a dim, `strict` raises (parameters); otherwise the trailing mesh
    axes are dropped until they do (activations: e.g. a batch of 1 stays replicated).
    """
    if len(axes) != len(shape):
        raise ShardingError(f"{what}: logical axes {axes} do not match its shape {shape}.")
    used: set[str] = set()
    parts = []
    for name, dim in zip(axes, shape):
        if name is None:
            parts.append(None)
            continue
        if name not in rules:
            raise ShardingError(f"{what}: no sharding rule for logical axis {name!r} "
                                f"(rules cover {sorted(rules)}).")
        target = rules[name]
        targets = () if target is None else (target,) if isinstance(target, str) else tuple(target)
        targets = tuple(a for a in targets if a not in used and mesh.shape[a] > 1)
        size = math.prod(mesh.shape[a] for a in targets)
        if strict and dim % size and name not in _REPLICATE_IF_INDIVISIBLE:
            divisors = [d for d in range(1, dim + 1) if dim % d == 0 and d <= 64]
            raise ShardingError(
                f"{what}: logical axis {name!r} has size {dim}, which mesh axes "
                f"{' × '.join(f'{a}={mesh.shape[a]}' for a in targets)} = {size} do not divide; "
                f"use sizes among the divisors of {dim} ({', '.join(map(str, divisors))}) for "
                f"{'/'.join('mesh.' + a for a in targets)}.")
        while targets and dim % math.prod(mesh.shape[a] for a in targets):
            targets = targets[:-1]
        used.update(targets)
        parts.append(None if not targets else targets[0] if len(targets) == 1 else targets)
    return PartitionSpec(*parts)


def _is_variable(x) -> bool:
    return isinstance(x, nnx.Variable)


def _path_name(path) -> str:
    return ".".join(str(getattr(k, "key", getattr(k, "name", k))) for k in path)


def param_shardings(tree, mesh: Mesh, rules: Rules):
    """NamedShardings of every parameter of a module (or an `nnx.State`), from `logical_axes`.

    The result has the structure of `nnx.state(tree)`, so `jax.device_put(state, result)` and
    `jax.jit(..., out_shardings=result)` take it as is.
    """
    state = nnx.state(tree) if isinstance(tree, nnx.Module) else tree

    def one(path, v):
        axes = v.get_metadata().get("logical_axes")
        if axes is None:
            raise ShardingError(f"parameter {_path_name(path)} has no logical_axes metadata.")
        spec = logical_spec(axes, v.get_value().shape, mesh, rules, strict=True, what=_path_name(path))
        return v.replace(NamedSharding(mesh, spec))

    return jax.tree_util.tree_map_with_path(one, state, is_leaf=_is_variable)


def variable_sharding(mesh: Mesh, rules: Rules) -> Callable[[nnx.Variable], NamedSharding]:
    """Variable -> its NamedSharding; the hook `load_model(shardings=...)` places each tensor with."""
    def one(v: nnx.Variable) -> NamedSharding:
        shape = v.get_value().shape
        return NamedSharding(mesh, logical_spec(v.get_metadata()["logical_axes"], shape, mesh, rules,
                                                strict=True, what=f"parameter of shape {shape}"))
    return one


def shard_model(model: nnx.Module, mesh: Mesh, rules: Rules) -> nnx.Module:
    """Move every parameter of `model` onto its sharding (in place); returns the model."""
    state = nnx.state(model)
    nnx.update(model, jax.device_put(state, param_shardings(state, mesh, rules)))
    return model


def lora_shardings(adapter, model: nnx.Module, mesh: Mesh, rules: Rules, *,
                   replicate: bool = False) -> dict:
    """Shardings of one LoRA set {target: {"a": [L, *in, r], "b": [L, r, *out]}}: the base weight's
    in/out rules (the rank replicated), or everything replicated."""
    out = {}
    for name, ab in adapter.items():
        if replicate:
            out[name] = {k: NamedSharding(mesh, PartitionSpec()) for k in ab}
            continue
        axes = model.layers[name].get_metadata()["logical_axes"]  # ("layers", *in, *out)
        n_in = len(ab["a"].shape) - 2
        a_axes, b_axes = (*axes[:1 + n_in], "lora_rank"), ("layers", "lora_rank", *axes[1 + n_in:])
        out[name] = {
            "a": NamedSharding(mesh, logical_spec(a_axes, ab["a"].shape, mesh, rules, strict=True,
                                                  what=f"lora {name}.a")),
            "b": NamedSharding(mesh, logical_spec(b_axes, ab["b"].shape, mesh, rules, strict=True,
                                                  what=f"lora {name}.b"))}
    return out


def trainable_shardings(trainable, model: nnx.Module, mesh: Mesh, rules: Rules, *,
                        replicate_lora: bool = False):
    """Shardings of one parameter set: an `nnx.State` (full fine-tuning) or a LoRA adapter dict."""
    if isinstance(trainable, nnx.State):
        return param_shardings(trainable, mesh, rules)
    return lora_shardings(trainable, model, mesh, rules, replicate=replicate_lora)


def optimizer_shardings(optimizer: optax.GradientTransformation, params, params_shardings,
                        mesh: Mesh):
    """Shardings of `optimizer.init(params)`: moments like their parameters, scalars replicated."""
    abstract = jax.eval_shape(optimizer.init, params)
    return optax.tree_map_params(optimizer, lambda _, s: s, abstract, params_shardings,
                                 transform_non_params=lambda _: replicated(mesh),
                                 is_leaf=lambda x: isinstance(x, NamedSharding))


def batch_ranks(mesh: Mesh, rules: Rules) -> int:
    """How many shards a batch's rows are split into: the product of the mesh axes `rules` map `batch` to."""
    axes = rules.get("batch")
    axes = () if axes is None else (axes,) if isinstance(axes, str) else axes
    return math.prod(mesh.shape[a] for a in axes)


def active_batch_ranks() -> int:
    """`batch_ranks` of the mesh and rules that `use_mesh` made active; 1 outside it."""
    rules = _ACTIVE_RULES.get()
    mesh = jax.sharding.get_abstract_mesh()
    return 1 if rules is None or mesh.empty else batch_ranks(mesh, rules)


def replicated(mesh: Mesh) -> NamedSharding:
    return NamedSharding(mesh, PartitionSpec())


# ---- activations ----------------------------------------------------------------------------------
_ACTIVE_RULES: contextvars.ContextVar[Rules | None] = contextvars.ContextVar("marljax_rules",
                                                                              default=None)


@contextlib.contextmanager
def use_mesh(mesh: Mesh, rules: Rules) -> Iterator[None]:
    """Run (and trace) under `mesh` with `rules`: activates `constrain`. Rules are read at trace
    time, so one process should use one rule set per mesh."""
    token = _ACTIVE_RULES.set(rules)
    try:
        with jax.set_mesh(mesh):
            yield
    finally:
        _ACTIVE_RULES.reset(token)


def constrain(x, axes):
    """`with_sharding_constraint` by logical axis names inside `use_mesh`; the identity elsewhere.
    Mesh axes that do not divide a dim are dropped for that dim (see `logical_spec`)."""
    rules = _ACTIVE_RULES.get()
    mesh = jax.sharding.get_abstract_mesh()
    if rules is None or mesh.empty:
        return x
    return jax.lax.with_sharding_constraint(x, logical_spec(axes, x.shape, mesh, rules))


def shard_map_logical(fn, args, in_axes, out_axes, out_like: tuple[int, ...] | None = None):
    """`fn(*args)` run once per shard (`jax.shard_map`) inside `use_mesh`, each argument and the
    output split by the specs of their logical axis names (see `constrain`); `fn(*args)` elsewhere.
    For kernels XLA cannot partition itself (Pallas/Mosaic custom calls). One output shaped like
    args[0], or, with `out_like`, a tuple of outputs shaped like args[i] for i in `out_like`, whose
    axes `out_axes` lists in order."""
    rules = _ACTIVE_RULES.get()
    mesh = jax.sharding.get_abstract_mesh()
    if rules is None or mesh.empty:
        return fn(*args)
    specs = [logical_spec(axes, x.shape, mesh, rules) for axes, x in zip(in_axes, args)]
    if out_like is None:
        out_spec = logical_spec(out_axes, args[0].shape, mesh, rules)
    else:
        out_spec = tuple(logical_spec(axes, args[i].shape, mesh, rules) for axes, i in zip(out_axes, out_like))
    return jax.shard_map(fn, mesh=mesh, in_specs=tuple(specs), out_specs=out_spec, check_vma=False)(*args)


def replicate(tree):
    """Constrain every array of `tree` to be replicated (readable on every host); see `constrain`."""
    return jax.tree.map(lambda x: constrain(x, (None,) * x.ndim), tree)


# ---- multi-host -----------------------------------------------------------------------------------
def distributed_requested(environ: Mapping[str, str] = os.environ) -> bool:
    """True when MARLJAX_DISTRIBUTED=1, or SLURM / Open MPI started more than one task."""
    if environ.get("MARLJAX_DISTRIBUTED", "") not in ("", "0"):
        return True
    return any(int(environ.get(k, "1") or 1) > 1 for k in ("SLURM_NTASKS", "OMPI_COMM_WORLD_SIZE"))


def initialize_distributed(environ: Mapping[str, str] = os.environ) -> bool:
    """`jax.distributed.initialize()` when `distributed_requested`; returns whether it ran.

    Cloud TPU, SLURM, Open MPI and Kubernetes are detected by JAX itself; elsewhere set
    JAX_COORDINATOR_ADDRESS (host:port of process 0), JAX_NUM_PROCESSES and JAX_PROCESS_ID.
    Must run before anything else touches the devices.
    """
    if not distributed_requested(environ):
        return False
    num = environ.get("JAX_NUM_PROCESSES")
    pid = environ.get("JAX_PROCESS_ID")
    jax.distributed.initialize(coordinator_address=environ.get("JAX_COORDINATOR_ADDRESS"),
                               num_processes=int(num) if num else None,
                               process_id=int(pid) if pid else None)
    return True


def exit_on_failure(error: BaseException, run_dir: str, command: str) -> NoReturn:
    """End this process of a multi-process run at once after `error`: its traceback, then `exit_now`. A
    process that dies takes its collectives with it and the others' next one may fail; exiting at once
    skips `jax.distributed`'s shutdown barrier, which would wait out the heartbeat timeout (100 s) for the
    dead process and then abort in C++."""
    traceback.print_exception(error)
    exit_now(f"{type(error).__name__}: {str(error).splitlines()[0] if str(error) else ''} (on several processes "
             "this most often means another one died; see its log)", run_dir, command)


def exit_now(reason: str, run_dir: str, command: str) -> NoReturn:
    """One line saying why this process stops and how to resume, then exit 1 at once (`os._exit`: no
    shutdown barrier, no atexit hooks). The newest complete checkpoint stays the one to resume from."""
    print(f"process {jax.process_index()} of {jax.process_count()} stopped: {reason}. The newest checkpoint in "
          f"{run_dir} is complete: run the same command on every host again to resume: {command}",
          file=sys.stderr, flush=True)
    sys.stdout.flush()
    os._exit(1)


def is_primary() -> bool:
    """Process 0: the one that writes logs, reports and run files."""
    return jax.process_index() == 0

