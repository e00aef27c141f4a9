"""Ahead-of-time compile of a paper cell's train step and rollout engine for a TPU topology, on a host
without one.

`python -m marljax.matrix --aot v5e-8 [--cell NAME …]` compiles, per cell, the whole training iteration:
the rollout engine (`compile_engine`) and two micro-batches of the update (`compile_cell`, shapes from
`update_shapes`: one longest row per chip, and the most short rows the token budget admits), each with
the cell's model shapes (`nnx.eval_shape`: nothing allocated), its LoRA or full parameter sets, Adam
states, mesh and sharding rules (`marljax.core.sharding`). A program is lowered with `jax.ShapeDtypeStruct`
arguments that carry their shardings and
compiles it with libtpu's compile-only client for the topology. XLA's TPU compiler reports per chip:
  bytes    XLA's peak (`Program`): arguments, outputs and temporaries live at once (the donated params
           and optimizer state alias their outputs); temp is what the peak holds beyond arguments and outputs
  flops    the compiled program's FLOPs (`cost_analysis`), beside the model FLOPs of the same tokens
           (`models/flops.py`: the useful work); their ratio is the recompute overhead (remat, the
           log-prob chunks' rematerialisation, the attention kernel's own backward)
  roofline max(flops / peak, bytes accessed / HBM bandwidth) of one such call
`compile_engine` does the same for the cell's rollout engine (`marljax.sampling.engine`): its jitted prefill and
decode chunk with the cell's weights as the sampler shards them, the page pool `marljax.matrix.engine_plan`
sizes (one per batch rank) and the TPU's ragged paged-attention kernel; per chip its bytes and one decode
step's roofline (`engine_table`).
libtpu (`pip install libtpu==0.0.42.1`, the build matching jax 0.10.2) must be importable; JAX itself
stays on the CPU backend (JAX_PLATFORMS=cpu): the TPU is only a compile target.
"""
from __future__ import annotations

import dataclasses
import importlib.util
import os
import re
import time

# accelerator name (marljax.matrix.ACCELERATORS) -> libtpu topology name
TOPOLOGIES = {"v5e-8": "v5e:2x4", "v6e-8": "v6e:2x4", "v5p-8": "v5p:2x2x1"}
# Share of HBM `CompiledEngine.fit_pages` cuts beyond the excess XLA reports: its TPU compiler fills the
# HBM it has with temporaries, so an out-of-memory program shrinks only part of a pool cut (measured on
# a Qwen3-4B engine: 0.53 GiB fewer pages, 0.13 GiB less needed; then 7.7 MiB short of fitting).
FIT_MARGIN = 0.02
# The short micro-batch's answer (`update_shapes`): with a 256-position log-prob chunk per row (the trainer
# until 2026-12-07) it was the most logits per row, 40 rows per chip of a Qwen3-4B Eval-Opt cell: 5.8 GiB
SHORT_RESPONSE = 256
GiB = 1 << 30


class AotError(RuntimeError):
    """libtpu missing, or an unknown topology; the message names the fix."""


@dataclasses.dataclass(frozen=True)
class Program:
    """One compiled program's per-chip bytes (XLA's memory analysis). The total is XLA's
    `peak_memory_in_bytes`, and temp what the peak holds beyond the arguments and outputs: XLA's TPU
    `temp_size_in_bytes` is no sum of what is live at once. It leaves out a while loop's buffers
    (measured: 0 for a loop carrying a 16 MiB product, whose peak holds it; the engine's decode chunk is
    a while loop), and counts buffers that share one allocation once each (a 28-layer train step: 12.23
    GiB, where the buffer assignment allocates 8.12 GiB of temporaries, docs/scale_out.md)."""

    argument_bytes: int
    output_bytes: int
    alias_bytes: int
    peak_bytes: int
    oom_bytes: int = 0  # the bytes XLA's out-of-memory message says the program needs
    oom: str = ""

    @property
    def over_bytes(self) -> float:
        """Bytes over what XLA can place: from its out-of-memory message (needed − available), else 0."""
        if not self.oom:
            return 0.0
        m = re.search(r"Exceeded hbm capacity by ([\d.]+)([KMGT])?", self.oom)  # more exact than the rounded totals
        if m:
            return float(m.group(1)) * {None: 1, "K": 1 << 10, "M": 1 << 20, "G": GiB, "T": 1 << 40}[m.group(2)]
        return self.oom_bytes - _oom_available(self.oom)

    @property
    def total_bytes(self) -> int:
        return self.peak_bytes or self.oom_bytes

    @property
    def temp_bytes(self) -> int:
        return self.total_bytes - (self.argument_bytes + self.output_bytes - self.alias_bytes)


@dataclasses.dataclass(frozen=True)
class Compiled:
    """One compiled micro-batch of a cell's update, per chip."""

    cell: str
    accelerator: str
    mesh: tuple[int, int, int]
    name: str  # "update/long" | "update/short" (`update_shapes`)
    role: str  # the micro-batch's role
    rows: int  # its global rows
    length: int  # their padded length T
    response: int  # their padded response length R
    program: Program  # per-chip bytes: XLA's peak, or what its out-of-memory message says is needed
    hbm_bytes: int
    flops: float  # compiled, per chip, one call
    bytes_accessed: float
    model_flops: float  # models/flops.py train_flops of the same tokens, per chip
    peak_flops: float  # per chip, FLOP/s
    hbm_bandwidth: float  # bytes/s
    compile_s: float
    model_arguments: float = 0.0  # marljax.matrix's memory model of the same step: base + LoRA + Adam
    model_temp: float = 0.0  # … and per-role gradients + train activations

    @property
    def total_bytes(self) -> int:
        return self.program.total_bytes

    @property
    def temp_bytes(self) -> int:
        return self.program.temp_bytes

    @property
    def fits(self) -> bool:
        return not self.program.oom and self.total_bytes <= self.hbm_bytes

    @property
    def recompute(self) -> float:
        return self.flops / self.model_flops if self.model_flops else float("nan")

    @property
    def roofline_s(self) -> float:
        return max(self.flops / self.peak_flops, self.bytes_accessed / self.hbm_bandwidth)


def require_libtpu() -> None:
    if importlib.util.find_spec("libtpu") is None:
        raise AotError("the AOT compile needs libtpu: `pip install libtpu==0.0.42.1` (the build matching "
                       "jax 0.10.2; requirements-test.txt pins it).")


def topology_devices(accelerator: str):
    """The devices of `accelerator`'s TPU topology (compile-only: no TPU needed). JAX itself is kept
    on the CPU backend unless JAX_PLATFORMS says otherwise."""
    if accelerator not in TOPOLOGIES:
        raise AotError(f"--aot {accelerator!r}: choose a TPU topology from {sorted(TOPOLOGIES)}.")
    require_libtpu()
    import jax
    if "JAX_PLATFORMS" not in os.environ:  # jax read the variable at import: set its config instead
        jax.config.update("jax_platforms", "cpu")
    # Compile-only: several processes may load libtpu at once (else the second fails on its lockfile).
    os.environ.setdefault("ALLOW_MULTIPLE_LIBTPU_LOAD", "1")
    from jax.experimental import topologies
    return topologies.get_topology_desc(platform="tpu", topology_name=TOPOLOGIES[accelerator]).devices


def _abstract(tree, shardings):
    """ShapeDtypeStructs of `tree` carrying `shardings` (a matching tree, or one sharding for all)."""
    import jax
    if isinstance(shardings, jax.sharding.Sharding):
        return jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=shardings), tree)
    return jax.tree.map(lambda x, s: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=s), tree, shardings)


def traced_flops(jaxpr) -> float:
    """FLOPs of a (closed) jaxpr's matrix products: 2 per multiply-add of every `dot_general`, loop
    bodies times their trip count (`scan`), both branches' maximum (`cond`), shard_map bodies times
    their shards, Pallas kernels by their own `cost_estimate`. XLA's `cost_analysis` counts every loop
    body once, which undercounts a scanned decoder by its layer count; this counts what the traced
    program computes, remat recomputation included, after removing the dead code XLA removes too (the
    frozen weights' gradients a custom VJP computes, the primal copy of a rematerialised custom VJP):
    without that, a 2-layer Qwen3-0.6B step at T = 8,192 counts 18.5 TFLOP per chip for 12.3.
    Elementwise work is not counted."""
    from jax._src.interpreters import partial_eval as pe  # dce_jaxpr: no public API

    jaxpr = getattr(jaxpr, "jaxpr", jaxpr)
    return _product_flops(pe.dce_jaxpr(jaxpr, [True] * len(jaxpr.outvars))[0])


def _product_flops(jaxpr) -> float:
    """`traced_flops` of a jaxpr as it stands (no dead-code removal)."""
    import math

    jaxpr = getattr(jaxpr, "jaxpr", jaxpr)
    total = 0.0
    for eqn in jaxpr.eqns:
        name, params = eqn.primitive.name, eqn.params
        if name == "dot_general":
            (lhs_contract, _), _ = params["dimension_numbers"]
            lhs = eqn.invars[0].aval.shape
            total += 2.0 * math.prod(eqn.outvars[0].aval.shape) * math.prod(lhs[d] for d in lhs_contract)
        elif name == "scan":
            total += params["length"] * _product_flops(params["jaxpr"])
        elif name == "cond":
            total += max(_product_flops(b) for b in params["branches"])
        elif name == "while":
            if any(e.primitive.name == "dot_general" for e in params["body_jaxpr"].jaxpr.eqns):
                raise ValueError("traced_flops: a while loop with matrix products has no static trip count")
            total += _product_flops(params["body_jaxpr"])
        elif name == "pallas_call":
            total += _kernel_flops(eqn)
        elif name == "shard_map":
            shards = math.prod(params["mesh"].shape[a] for a in params["newly_manual_axes"])
            total += shards * _product_flops(params["jaxpr"])
        else:
            for sub in jax_subjaxprs(params):
                total += _product_flops(sub)
    return total


# Matrix products per grid step of the splash attention kernels (`SPLASH_BLOCK`² tiles): forward
# scores and values; backward dq: scores, dp, dq; dkv: scores, dp, dv, dk.
SPLASH_PRODUCTS = {"fwd": 2, "dq": 3, "dkv": 4}


def _kernel_flops(eqn) -> float:
    """A Pallas kernel's FLOPs: its own `cost_estimate`, else (splash attention, causal) the products
    per grid step × grid steps × the causal share of key blocks a query block sees."""
    import math

    import jax.numpy as jnp

    from marljax.models.attention import SPLASH_BLOCK
    estimate = eqn.params.get("cost_estimate")
    if estimate is not None:
        return float(estimate.flops)
    name = str(eqn.params.get("name", ""))
    kind = next((k for k in ("dkv", "dq", "fwd") if k in name), None)
    if "splash" not in name or kind is None:
        raise ValueError(f"traced_flops: Pallas kernel {name!r} has no cost_estimate")
    grid = eqn.params["grid_mapping"].grid
    blocks = grid[-1]
    # q, k, v, dout are [..., T, Dh] with T ≥ Dh (padded to whole blocks); log-sum-exps [..., T]
    head_dim = min(v.aval.shape[-1] for v in eqn.invars
                   if v.aval.ndim >= 3 and jnp.issubdtype(v.aval.dtype, jnp.floating))
    return (SPLASH_PRODUCTS[kind] * 2.0 * SPLASH_BLOCK ** 2 * head_dim * math.prod(grid)
            * (blocks + 1) / (2 * blocks))


def jax_subjaxprs(params):
    """The jaxprs nested in an equation's parameters (pjit, remat, custom_vjp, …)."""
    from jax.extend import core
    for v in params.values():
        for x in (v if isinstance(v, (tuple, list)) else (v,)):
            if isinstance(x, (core.Jaxpr, core.ClosedJaxpr)):
                yield x


def _oom_bytes(message: str) -> int:
    """The bytes XLA says the program needs, from its out-of-memory message (0 if not stated): "Used
    X of Y hbm" or "the total memory required for HLO temporaries (X) exceeds available HBM (Y)"."""
    m = re.search(r"(?:Used |HLO temporaries \()([\d.]+)([KMGT])?", message)
    if not m:
        return 0
    return int(float(m.group(1)) * {None: 1, "K": 1 << 10, "M": 1 << 20, "G": GiB, "T": 1 << 40}[m.group(2)])


def _compile(traced) -> tuple[tuple[int, int, int, int], dict, str, int]:
    """Lower and compile a traced jitted call: its per-chip (argument, output, alias, temp) bytes, XLA's
    cost analysis, XLA's out-of-memory message ("" when it fits; temp is then the bytes it says it
    needs and the cost analysis is empty) and XLA's peak bytes (0 when out of memory)."""
    import jax
    cached = jax.config.jax_enable_compilation_cache
    jax.config.update("jax_enable_compilation_cache", False)  # a TPU program has no place in the CPU's cache
    try:
        compiled = traced.lower().compile()
    except Exception as e:  # XLA's RESOURCE_EXHAUSTED: the program needs more HBM than the chip has
        if "RESOURCE_EXHAUSTED" not in str(e) and "Ran out of memory" not in str(e):
            raise
        oom = str(e).strip().splitlines()[0][:400]
        return (0, 0, 0, _oom_bytes(oom)), {}, oom, 0
    finally:
        jax.config.update("jax_enable_compilation_cache", cached)
    mem = compiled.memory_analysis()
    cost = compiled.cost_analysis()
    cost = cost[0] if isinstance(cost, list) else cost
    return (mem.argument_size_in_bytes, mem.output_size_in_bytes, mem.alias_size_in_bytes,
            mem.temp_size_in_bytes), dict(cost or {}), "", mem.peak_memory_in_bytes


def _cell_policy(cfg, devices, layers: int | None):
    """The `build.Policy` of a cell's config on `devices`, its model as shapes (`build.abstract_policy`:
    nothing allocated); `layers` overrides the layer count (tests)."""
    from marljax.build import abstract_policy
    from marljax.models.presets import PRESETS

    model_cfg = dataclasses.replace(PRESETS[cfg.model], dtype=cfg.dtype, param_dtype=cfg.param_dtype)
    if layers is not None:
        model_cfg = dataclasses.replace(model_cfg, num_layers=layers)
    return abstract_policy(cfg, model_cfg, devices)


@dataclasses.dataclass(frozen=True)
class UpdateShape:
    """One micro-batch shape of a cell's update: `role` at `rows` global rows of `length` positions, its
    response window `response`; every other role of the cell holds its gradient sums beside it."""

    name: str  # "long" | "short"
    role: str
    rows: int
    length: int
    response: int


def update_shapes(cell, budget: int, chips: int, *, length: int | None = None) -> dict[str, UpdateShape]:
    """The two micro-batches that bound a cell's update under a token budget of `budget` packed positions per
    data-parallel chip (`rl.micro_batch_tokens`; 0: one longest row) on `chips` such chips:
      long   one longest sample per chip: the role of the longest stage prompt + the response cap;
      short  the most rows the budget admits (`rl.step.micro_batches` packs `bucket_rows(n)` rows of the
             longest length) of the shortest stage prompt + a `SHORT_RESPONSE`-token answer: many short
             rows, the shape where rows, not positions, set the size (the log-probs' rows × positions).
    `length` overrides the long row's T (tests)."""
    from marljax.core.shapes import bucket, bucket_rows, length_bucket

    r = cell.max_response
    prompts = {role: [s.prompt for s in cell.stages() if s.role == role] for role in cell.roles}
    long_role = max(cell.roles, key=lambda x: max(prompts[x]))
    T_long = length or length_bucket(max(prompts[long_role]) + r + 1)
    short_role = min(cell.roles, key=lambda x: min(prompts[x]))
    T_short = length_bucket(min(prompts[short_role]) + SHORT_RESPONSE + 1)
    total = (budget or T_long) * chips
    n = max(1, total // T_short)
    while n > 1 and (bucket_rows(n) * T_short > total or bucket_rows(n) % chips):
        n -= 1
    return {"long": UpdateShape("long", long_role, chips, T_long, min(bucket(r, 8), T_long - 1)),
            "short": UpdateShape("short", short_role, max(bucket_rows(n), chips), T_short,
                                 bucket(SHORT_RESPONSE, 8))}


def compile_cell(cell, cfg, accelerator: str, acc, *, shape: str = "long", attention: str = "splash",
                 logprob_bytes: int | None = None, layers: int | None = None,
                 length: int | None = None) -> Compiled:
    """Compile one micro-batch of `cell`'s update (a `marljax.matrix.Cell`, with its config `cfg` and `acc`
    the `marljax.matrix.Accelerator` named `accelerator`) for that accelerator's topology: the trainer's
    forward/backward of one role's micro-batch (`Trainer.role_part`, what `accumulated_update` jits per
    micro-batch) at `update_shapes(...)[shape]`, with everything the step keeps on the chips during that
    call as live arguments (kept and returned): the frozen base, the whole `TrainState` (every set's
    parameters, Adam moments, damping EMAs) and the gradient sums of every role (the others' finished,
    this role's running total) — XLA's TPU compiler spends the HBM it is not told about on temporaries.
    The trainer and its state are `train`'s (`_abstract_trainer`). `attention`: `rl.attention`;
    `logprob_bytes`: the log-prob chunks' budget (None: the trainer's); `layers` / `length`: override the
    layer count and the long row's length (tests). The matrix's memory model of the same step is the
    caller's to add (`model_arguments`, `model_temp`)."""
    devices = topology_devices(accelerator)
    import jax
    import jax.numpy as jnp

    from marljax.core import sharding

    trainer, policy, state = _abstract_trainer(cfg, devices, layers, attention, logprob_bytes)
    mesh, rules = policy.mesh, policy.rules
    data, fsdp, tensor = (mesh.shape[a] for a in sharding.MESH_AXES)
    chips = data * fsdp
    sh = update_shapes(cell, cfg.rl.micro_batch_tokens, chips, length=length)[shape]
    batch = _abstract_batch(mesh, rules, sh.rows, sh.length, sh.response)
    set_of = trainer.cfg.set_of
    # every role's gradient sums, laid out like its set (f32, as `RolePart.grad`): the role's own running
    # total and the others' finished sums
    sums = {r: jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, jnp.float32, sharding=x.sharding),
                            state.params[set_of(r)]) for r in cell.roles}
    base = _abstract(trainer.base_state, sharding.param_shardings(trainer.base_state, mesh, rules))
    part = jax.jit(lambda base, state, sums, batch: (
        trainer.role_part(base, state.params[set_of(sh.role)], batch, role=sh.role, recompute_old=False),
        state, sums), donate_argnums=(1, 2), keep_unused=True)
    t0 = time.perf_counter()
    with sharding.use_mesh(mesh, rules):
        traced = part.trace(base, state, sums, batch)
        program, cost = _program(*_compile(traced))
    compile_s = time.perf_counter() - t0
    return Compiled(cell=cell.name, accelerator=accelerator, mesh=(data, fsdp, tensor), name=f"update/{shape}",
                    role=sh.role, rows=sh.rows, length=sh.length, response=sh.response, program=program,
                    hbm_bytes=int(acc.hbm_gb * GiB), flops=traced_flops(traced.jaxpr) / (data * fsdp * tensor),
                    bytes_accessed=float(cost.get("bytes accessed", 0.0)),
                    model_flops=_model_flops(policy.model.config, policy.lora_cfg, sh) / chips,
                    peak_flops=acc.tflops * 1e12, hbm_bandwidth=acc.hbm_gbs * 1e9, compile_s=compile_s)


def _abstract_trainer(cfg, devices, layers, attention, logprob_bytes):
    """The trainer `train` builds for `cfg` (`marljax.build`: `build_workflow`, `fresh_params`,
    `build_trainer`), with `attention` and `logprob_bytes`, over the cell's model as shapes on `devices`:
    (trainer, the `build.Policy`, the step-0 `TrainState` as shapes carrying their shardings)."""
    import jax

    from marljax.build import build_trainer, build_workflow, fresh_params
    from marljax.config import resolve

    cfg = resolve(cfg)
    policy = _cell_policy(cfg, devices, layers)
    workflow, policy_map = build_workflow(cfg)
    params = jax.eval_shape(lambda model: fresh_params(model, policy.lora_cfg, cfg.seed, policy_map.sets),
                            policy.model)
    trainer, shardings = build_trainer(cfg, policy, workflow, policy_map, params, attention=attention,
                                       logprob_bytes=logprob_bytes)
    return trainer, policy, _abstract(jax.eval_shape(trainer.init_state, params), shardings)


def _abstract_batch(mesh, rules, rows: int, T: int, R: int):
    """A `RoleBatch` of `rows` × `T` positions (response window R), rows split like the trainer's batch."""
    import jax
    import jax.numpy as jnp

    from marljax.core import sharding
    from marljax.rl.step import RoleBatch

    def arr(dtype, *dims):
        spec = sharding.logical_spec(("batch",) + (None,) * (len(dims) - 1), dims, mesh, rules)
        return jax.ShapeDtypeStruct(dims, dtype, sharding=jax.sharding.NamedSharding(mesh, spec))

    return RoleBatch(arr(jnp.int32, rows, T), arr(jnp.int32, rows), arr(jnp.float32, rows, R),
                     arr(jnp.float32, rows), arr(jnp.float32, rows, R), arr(jnp.float32, rows, R),
                     arr(jnp.float32, rows))


def _model_flops(model_cfg, lora_cfg, shape: UpdateShape) -> float:
    """`models/flops.py`'s train FLOPs of the micro-batch's tokens (all rows real: prompt T − 1 − R, response R)."""
    from marljax.models.flops import train_flops
    kw = {} if lora_cfg is None else {"lora_rank": lora_cfg.rank, "lora_layers": lora_cfg.layers}
    return float(train_flops(model_cfg, [shape.length - 1 - shape.response] * shape.rows,
                             [shape.response] * shape.rows, **kw))


def table(results: list[Compiled]) -> str:
    gib = lambda x: f"{x / GiB:7.2f}"  # noqa: E731
    head = (f"{'cell':38} {'program':12} mesh(d,f,t)  role          rows      T     R   args    out  alias   temp"
            f"   peak    hbm fits m.args m.temp  TFLOP  model  ratio  roof_s  compile_s")
    lines = [f"# compiled update micro-batches per chip (GiB): one role's forward/backward with the whole train "
             f"state and every role's gradient sums live; long: one longest sample per data-parallel chip; short: "
             f"the most rows of a {SHORT_RESPONSE}-token answer the token budget admits; m.args/m.temp: "
             f"marljax.matrix's memory model of the same micro-batch; TFLOP per chip per call (traced; model: "
             f"models/flops.py), roof_s: max(TFLOP / peak, XLA's bytes accessed / HBM bandwidth)", head]
    for c in results:
        p = c.program
        lines.append(f"{c.cell:38} {c.name:12} {str(c.mesh):12} {c.role:12} {c.rows:5d} {c.length:6d} "
                     f"{c.response:5d} {gib(p.argument_bytes)}{gib(p.output_bytes)}{gib(p.alias_bytes)}"
                     f"{gib(c.temp_bytes)}{gib(c.total_bytes)}{gib(c.hbm_bytes)} {'yes' if c.fits else 'NO':>4}"
                     f"{gib(c.model_arguments)}{gib(c.model_temp)} "
                     f"{c.flops / 1e12:6.1f} {c.model_flops / 1e12:6.1f} {c.recompute:6.2f} "
                     f"{c.roofline_s:7.2f} {c.compile_s:10.1f}" + (f"  OOM: {p.oom}" if p.oom else ""))
    return "\n".join(lines)


# ---- the rollout engine --------------------------------------------------------------------------
@dataclasses.dataclass(frozen=True)
class CompiledEngine:
    """One cell's rollout engine compiled for a topology: its prefill and decode-chunk programs, per chip."""

    cell: str
    accelerator: str
    mesh: tuple[int, int, int]
    plan: object  # marljax.matrix.EnginePlan
    rows: int  # decode rows (all ranks): ranks × slots
    width: int  # pages per row's table (the longest sequence, bucketed as the engine does)
    prefill_rows: int
    prefill_length: int
    prefill: Program
    decode: Program
    hbm_bytes: int
    page_bytes: float  # one page across layers, per chip (as compiled)
    held_bytes: float  # what the run holds beside the engine's arguments, per chip (see compile_engine)
    step_flops: float  # one decode step per chip: XLA's count (its matmuls; the kernel counts none)
    step_bytes: float  # one decode step per chip: XLA's bytes accessed + every pool page read once
    peak_flops: float
    hbm_bandwidth: float
    compile_s: float
    model_step_flops: float = 0.0  # 2 × matmul parameters per row, per chip (the caller's: marljax.matrix)
    sets: int = 0  # per-row LoRA adapters of this many sets (`sampling.mix_sets`); 0: one set's weights merged

    @property
    def total_bytes(self) -> float:
        """Per-chip peak: the larger program (they share the weights and the pool, and alternate; both
        hold `held_bytes` as an argument)."""
        return max(self.prefill.total_bytes, self.decode.total_bytes)

    @property
    def fits(self) -> bool:
        return not (self.prefill.oom or self.decode.oom) and self.total_bytes <= self.hbm_bytes

    @property
    def fit_pages(self) -> int:
        """Pages per rank's pool that fit the chip with everything else as compiled."""
        over = max(self.total_bytes - self.hbm_bytes, self.prefill.over_bytes, self.decode.over_bytes, 0.0)
        if over:  # XLA fills the HBM it is given with temporaries: a cut of `over` alone falls short
            over += FIT_MARGIN * self.hbm_bytes
        return max(0, self.plan.pages - int(-(-over // self.page_bytes)))

    @property
    def step_s(self) -> float:
        """Roofline of one decode step: max(FLOPs / peak, bytes / HBM bandwidth)."""
        return max(max(self.step_flops, self.model_step_flops) / self.peak_flops, self.step_bytes / self.hbm_bandwidth)


def compile_engine(cell, cfg, accelerator: str, acc, plan, *, held_bytes: float = 0.0, layers: int | None = None,
                   steps: int | None = None, sets: int = 0) -> CompiledEngine:
    """Compile `cell`'s rollout engine (`marljax.sampling.engine.engine`'s jitted `prefill_program` and
    `decode_program`) for `accelerator`'s topology, with abstract arguments (`_engine_inputs`): the cell's
    model (`build.abstract_policy`; `layers` overrides its layer count, for tests) sharded as the sampler
    shards it, the per-layer copy of its layers the sampler decodes with (`sampling.layer_weights`: one
    parameter set's LoRA folded in; or, with `sets` > 0, the base's own, every row adding its set's
    adapter: `sets` float32 LoRA sets of `cfg.lora` stacked once per batch rank, each rank's copy on its
    shard, as `engine.Stream` places them), the page pool of `plan` (`marljax.matrix.engine_plan`: one
    pool per batch rank, its pages in the cell's dtype), the TPU kernel path of the paged attention.
    Decode: `plan.slots` rows per rank, each with a page table as wide as the cell's longest sequence,
    `steps` steps per chunk (default: the engine's, `CHUNK_STEPS`). Prefill: one row per rank, one chunk
    (`plan.prefill_chunk` positions) of the cell's longest prompt attending all of that prompt's pages.
    Per chip: each program's bytes (arguments + outputs + temp − aliased: the donated pool aliases its
    output), and one decode step's FLOPs and bytes for a roofline (XLA counts the chunk's while-loop
    body, one step, once; the kernel's reads are added as every page of the pool read once per step, an
    upper bound). What the run holds beside the engine's arguments — the base's stacked layers (the
    decode reads the per-layer copy; XLA would drop them as unread) and `held_bytes` per chip (the
    caller's: LoRA sets and Adam moments, as one array) — stays in both programs as live arguments (kept,
    the held array donated and returned): XLA's TPU compiler spends whatever HBM it is not told about on
    temporaries (measured: cutting the pool by 1.6 GiB raised the decode chunk's temp by 1.55 GiB), so
    the fit is only checked with everything resident inside the program."""
    devices = topology_devices(accelerator)
    from marljax.core import sharding
    from marljax.core.shapes import page_bucket
    from marljax.models.presets import PRESETS
    from marljax.sampling.engine.engine import CHUNK_STEPS

    policy = _cell_policy(cfg, devices, layers)
    x = _engine_inputs(policy, plan, held_bytes, sets)
    rows, width = plan.ranks * plan.slots, page_bucket(-(-plan.context // plan.page_size))
    t0 = time.perf_counter()
    with sharding.use_mesh(policy.mesh, policy.rules):
        decode = _compile_decode(x, cfg, rows, width, CHUNK_STEPS if steps is None else steps)
        prefill = _compile_prefill(x, plan)
    compile_s = time.perf_counter() - t0
    pool_chip = plan.pool_bytes * (policy.model.config.num_layers / PRESETS[cfg.model].num_layers)
    return CompiledEngine(
        cell=cell.name, accelerator=accelerator, mesh=tuple(policy.mesh.shape[a] for a in sharding.MESH_AXES),
        plan=plan, rows=rows, width=width, prefill_rows=plan.ranks, prefill_length=plan.prefill_chunk,
        prefill=prefill[0], decode=decode[0], hbm_bytes=int(acc.hbm_gb * GiB), page_bytes=pool_chip / plan.pages,
        held_bytes=x.stacked_bytes + held_bytes, step_flops=float(decode[1].get("flops", 0.0)),
        step_bytes=float(decode[1].get("bytes accessed", 0.0)) + pool_chip,
        peak_flops=acc.tflops * 1e12, hbm_bandwidth=acc.hbm_gbs * 1e9, compile_s=compile_s, sets=sets)


@dataclasses.dataclass(frozen=True)
class _EngineInputs:
    """A cell's engine arguments as shapes carrying their shardings (`compile_engine`)."""

    graphdef: object
    state: object  # the base's state (its stacked layers)
    layers: list  # the per-layer copy of the layers the sampler decodes with
    pool: list  # per layer, the page pools of every batch rank
    held: object  # what the run holds beside the engine: one uint8 array split over every chip
    lora: dict | None  # the per-row adapters of `sets` LoRA sets, or None (one set merged)
    stacked_bytes: float  # the base's stacked layers, per chip
    arr: object  # (dtype, logical axes, *dims) -> a `jax.ShapeDtypeStruct` on the mesh


def _engine_inputs(policy, plan, held_bytes: float, sets: int) -> _EngineInputs:
    """`compile_engine`'s arguments for `policy` (`build.abstract_policy`) and the pool of `plan`."""
    import jax
    import jax.numpy as jnp
    from flax import nnx

    from marljax.core import sharding
    from marljax.sampling.engine.kv_pages import pool_shape

    mesh, rules, model_cfg = policy.mesh, policy.rules, policy.model.config
    graphdef, state = nnx.split(policy.model)
    state_sh = sharding.param_shardings(state, mesh, rules)
    layer_abs = jax.eval_shape(lambda st: nnx.merge(graphdef, st).layer_list(), state)
    layer_sh = {k: jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec(*v.get_value().spec[1:]))
                for k, v in state_sh["layers"].items()}

    def arr(dtype, axes, *dims):
        spec = sharding.logical_spec(axes, dims, mesh, rules)
        return jax.ShapeDtypeStruct(dims, dtype, sharding=jax.sharding.NamedSharding(mesh, spec))

    shape = pool_shape(model_cfg, plan.pages, plan.page_size, plan.ranks)
    pool = [{"kv": arr(model_cfg.jnp_dtype, ("batch", None, None, "act_kv_heads", "head_dim"), *shape)}
            for _ in range(model_cfg.num_layers)]
    held = jax.ShapeDtypeStruct((mesh.size * max(1, int(held_bytes)),), jnp.uint8, sharding=jax.sharding.NamedSharding(
        mesh, jax.sharding.PartitionSpec(sharding.MESH_AXES)))  # split over every chip
    stacked = sum(_chip_bytes(v.get_value(), state_sh["layers"][k].get_value()) for k, v in state["layers"].items())
    layers = [_abstract(layer, {k: layer_sh[k] for k in layer}) for layer in layer_abs]
    return _EngineInputs(graphdef, _abstract(state, state_sh), layers, pool, held,
                         _row_adapters(policy, plan, sets, arr), stacked, arr)


def _row_adapters(policy, plan, sets: int, arr) -> dict | None:
    """The decode's per-row LoRA arguments for `sets` sets, stacked once per batch rank (None: 0 sets)."""
    if not sets:
        return None
    import jax
    import jax.numpy as jnp

    from marljax.models.lora import init_lora, stack_adapters
    if policy.lora_cfg is None:
        raise AotError("compile_engine(sets=…) needs a LoRA config: per-row adapters are LoRA's.")
    adapters = jax.eval_shape(lambda: stack_adapters([init_lora(policy.model.config, policy.lora_cfg,
                                                                jax.random.key(0))] * sets))
    G = plan.ranks * sets
    per_rank = lambda x: arr(x.dtype, ("batch",) + (None,) * (x.ndim - 1), G, *x.shape[1:])  # noqa: E731
    return {"lora": jax.tree.map(per_rank, adapters), "lora_scale": arr(jnp.float32, ()),
            "lora_groups": arr(jnp.int32, (None,), G)}


def _holding(x: _EngineInputs, fn, **static):
    """`fn(graphdef, *arrays)` jitted with every argument kept (the stacked layers too) and `held` live
    throughout (donated and returned); the pool donated."""
    import jax
    return jax.jit(lambda held, *arrays: (fn(x.graphdef, *arrays, **static), held), donate_argnums=(0, 3),
                   keep_unused=True)


def _compile_decode(x: _EngineInputs, cfg, rows: int, width: int, steps: int) -> tuple[Program, dict]:
    """One decode chunk of `steps` steps over `rows` slots, page tables `width` pages wide."""
    import jax.numpy as jnp

    from marljax.sampling.engine.batch import DecodeBatch
    from marljax.sampling.engine.engine import decode_program
    sp = cfg.sampling
    row = lambda dtype: x.arr(dtype, ("batch",), rows)  # noqa: E731
    batch = DecodeBatch(table_bw=x.arr(jnp.int32, ("batch", None), rows, width), token_b=row(jnp.int32),
                        pos_b=row(jnp.int32), n_gen_b=row(jnp.int32), live_b=row(jnp.bool_), request_b=None,
                        held_b=None, lora_groups=None)  # the host's fields (request, held, groups) are not read
    traced = _holding(x, decode_program, steps=steps, stops=(0,), attention="kernel", temperature=float(sp.temperature),
                      top_p=float(sp.top_p), top_k=int(sp.top_k)).trace(
        x.held, x.state, x.layers, x.pool, None, batch, x.arr(jnp.uint32, ("batch", None), rows, 2),
        x.arr(jnp.int32, ()), x.lora, None)
    return _program(*_compile(traced))


def _compile_prefill(x: _EngineInputs, plan) -> tuple[Program, dict]:
    """One prefill chunk per batch rank: the widest chunk of the longest prompt, its pages attended."""
    import jax.numpy as jnp

    from marljax.core.shapes import page_bucket
    from marljax.sampling.engine.batch import PrefillBatch
    from marljax.sampling.engine.engine import prefill_program
    n, T = plan.ranks, plan.prefill_chunk
    batch = PrefillBatch(tokens_bt=x.arr(jnp.int32, ("batch", None), n, T), start_b=x.arr(jnp.int32, ("batch",), n),
                         table_bw=x.arr(jnp.int32, ("batch", None), n, page_bucket(-(-plan.prompt // plan.page_size))),
                         last_b=x.arr(jnp.int32, ("batch",), n))
    traced = _holding(x, prefill_program, attention="kernel").trace(x.held, x.state, x.layers, x.pool, batch, x.lora)
    return _program(*_compile(traced))


def _oom_available(message: str) -> int:
    """The HBM XLA says it has for the program, from its out-of-memory message ("… exceeds available HBM
    (15.75G)" or "Used X of 15.75G hbm": v5e's 16 GiB less what the runtime keeps), else the bytes it
    says it needs (no excess)."""
    m = re.search(r"(?:available HBM \(| of )([\d.]+)([KMGT])?", message)
    if not m:
        return _oom_bytes(message)
    return int(float(m.group(1)) * {None: 1, "K": 1 << 10, "M": 1 << 20, "G": GiB, "T": 1 << 40}[m.group(2)])


def _chip_bytes(x, named_sharding) -> float:
    """Bytes of one chip's shard of array `x` (shape and dtype) under `named_sharding`."""
    import math
    return math.prod(named_sharding.shard_shape(x.shape)) * x.dtype.itemsize


def _program(terms, cost, oom, peak) -> tuple[Program, dict]:
    args, out, alias, temp = terms
    return Program(args, out, alias, peak, oom_bytes=temp if oom else 0, oom=oom), cost


def engine_table(results: list[CompiledEngine]) -> str:
    gib = lambda x: f"{x / GiB:7.2f}"  # noqa: E731
    head = (f"{'cell':38} lora    mesh(d,f,t)  ranks×slots  pages   ctx width  pool  p.args  p.temp p.total  d.args  d.temp"
            f" d.total   held  total    hbm fits fit_pages  step_GF  step_GB  step_ms  compile_s")
    lines = [f"# compiled rollout engine per chip (GiB): one pool per batch rank (pages of "
             f"{results[0].plan.page_size if results else 0} positions), TPU paged-attention kernel; lora: one "
             f"set's adapter merged into the decode weights, or rows×G: each row adds its own of G sets' adapters "
             f"(sampling.mix_sets); p.: "
             f"prefill of one chunk of the longest prompt per rank; d.: a decode chunk over every slot (args "
             f"include held: "
             f"what the run holds beside the engine, the base's stacked layers, LoRA sets, Adam moments); "
             f"total: the larger program; fit_pages: pages per rank that fit; step_*: one decode step per chip, "
             f"roofline "
             f"max(GFLOP / peak, GB / HBM bandwidth) (a model, not a measurement)",
             head]
    for c in results:
        p, d = c.prefill, c.decode
        lines.append(
            f"{c.cell:38} {f'rows×{c.sets}' if c.sets else 'merged':7} {str(c.mesh):12} {f'{c.plan.ranks}×{c.plan.slots}':>11} {c.plan.pages:6d} "
            f"{c.plan.context:5d} {c.width:5d}{gib(c.plan.pool_bytes)[1:]} {gib(p.argument_bytes)} {gib(p.temp_bytes)} "
            f"{gib(p.total_bytes)} {gib(d.argument_bytes)} {gib(d.temp_bytes)} {gib(d.total_bytes)} "
            f"{gib(c.held_bytes)}{gib(c.total_bytes)}{gib(c.hbm_bytes)} {'yes' if c.fits else 'NO':>4} "
            f"{c.fit_pages:9d} {max(c.step_flops, c.model_step_flops) / 1e9:8.1f} "
            f"{c.step_bytes / 1e9:8.2f} {c.step_s * 1e3:8.2f} {c.compile_s:10.1f}"
            + (f"  OOM: {p.oom or d.oom}" if p.oom or d.oom else ""))
    return "\n".join(lines)
