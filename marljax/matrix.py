"""`python -m marljax.matrix`: the paper's experiment matrix as run configs, with a per-cell memory and
step-time estimate for an accelerator, the mesh each cell would use, and a plan to run them.

    python -m marljax.matrix --dry-run [--accelerator v5e-8|v6e-8|v5p-8|v4-8|h100|h200|cpu] [--slices K]
    python -m marljax.matrix [--accelerator …] [--out DIR]          # DIR/<cell>.yaml + DIR/plan.md
    python -m marljax.matrix --cell voting-math-qwen3-1.7b-isolated --out DIR   # prints the YAML path
    python -m marljax.matrix --aot v5e-8 [--cell NAME …] [--aot-part both|train|engine]
        # compile each cell's train step and rollout engine for a TPU topology (needs libtpu; `marljax.aot`)

42 cells: {eval_opt, voting, orch_workers} × {math, code} × {qwen3-0.6b, 1.7b, 4b} × {shared,
isolated}, plus single-agent × {math, code} × the three models. Hyperparameters are SPEC §1's: the
dataclass defaults of `marljax.config`, with the response and prompt lengths and Eval-Opt iterations of
`marljax.workflows.paper_limits` for the cell's task and workflow written out. Roles and sampler stages
are the workflow's declaration (`Workflow.roles`, `Workflow.sampler_stages`).

The estimates are an explicit model, per chip, stated so they can be checked:
  memory  base weights (bfloat16; sharded over fsdp × tensor, replicated over data) + LoRA float32
          × parameter sets + Adam moments (2 × LoRA) + per-role LoRA gradients + train activations
          or the sampler's KV cache plus its per-layer copy of the weights with LoRA folded in
          (`sampling.layer_weights`), whichever is larger (training and sampling alternate). The KV
          budget left over becomes `sampling.max_cache_tokens`. Activations assume what the paper's
          lengths need from a trainer: micro-batches of one row per chip, layer rematerialisation,
          a flash-style attention (no T² scores) and log-probs in the trainer's chunks (LOGPROB_CHUNK).
  time    roofline with efficiencies: decode step = max(bytes / (HBM × 0.6), FLOPs / (peak × 0.4))
          + the FSDP weight all-gather over ICI, on the rollout engine (`marljax.engine`, sized by
          `engine_plan`): continuous batching, so decode steps follow the real tokens — every response
          has `--response-fill` × the cap (1: 5,120 math / 2,048 code, the upper bound), a step
          advances every slot in flight and reads their KV pages, a finished sequence's slot is refilled
          at once: each stage takes max(its tokens / the sequences in flight, one response) steps, the
          stages one after another (an upper bound for episodes that advance on their own); prefill
          once per distinct prompt (a GRPO group's rollouts and a stage's calls share the problem's
          prompt). The engine is priced with one pool per batch rank (`engine_plan`). Every stage runs its
          full iteration count with prompts at most the paper's cap; train FLOPs = 8·N·tokens
          (forward, recompute, backward to activations; LoRA has no base weight gradient) on the
          padded rows `rl.step.pack` builds, at 40% of peak. Upper bounds at fill 1.
The mesh replicates the frozen base over `data` when it takes ≤ 25% of HBM, else shards it over the
fewest `fsdp` ranks that bring it there. The plan runs cells longest-first on `--slices` slices.
"""
from __future__ import annotations

import argparse
import dataclasses
import math
import pathlib
import sys

import yaml

from marljax.config import Config, resolve, to_dict
from marljax.engine.engine import PREFILL_CHUNK_MIN, prefill_chunk
from marljax.models.decoder import LINEAR_AXES, ModelConfig
from marljax.models.logprobs import LOGPROB_CHUNK
from marljax.models.presets import PRESETS
from marljax.policy_sampler import PAGE_SIZE
from marljax.rl.policy_map import from_config
from marljax.shapes import bucket, bucket_rows, length_bucket
from marljax.sharding import MeshConfig
from marljax.workflows import get_workflow, paper_limits, workflow_class
from marljax.workflows.limits import Limits

WORKFLOWS = ("eval_opt", "voting", "orch_workers")
TASKS = {"math": "dapo_math", "code": "deepcoder"}
MODELS = ("qwen3-0.6b", "qwen3-1.7b", "qwen3-4b")
POLICIES = ("shared", "isolated")

# The paper's setup (SPEC §1): the config's defaults.
_PAPER = Config()
PROBLEMS, ROLLOUTS, MINIBATCH = _PAPER.rl.problems_per_step, _PAPER.rl.rollouts, _PAPER.rl.minibatch_size
STEPS, EVAL_EVERY = _PAPER.steps, _PAPER.eval.every
LORA_RANK, LORA_ALPHA = _PAPER.lora.rank, _PAPER.lora.alpha
EVAL_N = {"math": 1412, "code": 1000}  # held-out problems (for the time estimate; the configs evaluate all)

# Length assumptions (tokens): a problem prompt with chat template and the empty think block; one
# note in a prompt (`SamplerStage.notes`: an Orch-Workers strategy line).
PROMPT_TOKENS = {"math": 300, "code": 900}
STRATEGY_TOKENS = 128

# Model efficiencies and budgets (see the module docstring).
MFU, HBM_EFFICIENCY, HBM_USABLE, BASE_BUDGET = 0.4, 0.6, 0.9, 0.25
LORA_BYTES = 4  # adapters, their gradients and Adam moments are float32
RESPONSE_FILL = 1.0  # mean response length / the cap: 1 prices every response at the cap (upper bound)
PREFILL_TOKENS_PER_RANK = 8192  # positions one rank's prefill call computes (`sampling.prefill_tokens`)


@dataclasses.dataclass(frozen=True)
class Accelerator:
    """One slice or host: per-chip peak bf16 FLOP/s, HBM size and bandwidth, ICI bandwidth."""

    name: str
    chips: int
    hbm_gb: float
    tflops: float
    hbm_gbs: float
    ici_gbs: float
    dtype: str = "bfloat16"


ACCELERATORS = {
    "v5e-8": Accelerator("v5e-8", 8, 16, 197, 819, 200),
    "v4-8": Accelerator("v4-8", 4, 32, 275, 1228, 300),  # 4 chips (8 TensorCores)
    "v6e-8": Accelerator("v6e-8", 8, 32, 918, 1640, 448),
    "v5p-8": Accelerator("v5p-8", 4, 95, 459, 2765, 600),  # 4 chips (8 TensorCores)
    "h100": Accelerator("h100", 8, 80, 989, 3350, 450),
    "h200": Accelerator("h200", 8, 141, 989, 4800, 450),
    # this project's shared 2-core CPU box, as `python bench/roofline.py --samples 10` measured it on
    # 2026-12-02 00:48 at load average 0.5 (docs/benchmarks.md, "CPU roof"): medians of XLA float32 matmul
    # 186 GFLOP/s (range 137-198) and elementwise memory traffic 22 GB/s, 25.3 GB of memory. Under load
    # the box measures far less (25 GFLOP/s and 4 GB/s at load average 9, 2026-12-01 23:20).
    "cpu": Accelerator("cpu", 1, 25.3, 0.186, 22, 1, dtype="float32"),
}


@dataclasses.dataclass(frozen=True)
class Stage:
    """One sequential round of role calls: `calls` per episode, each with a prompt of ≤ `prompt` tokens."""

    role: str
    calls: int
    prompt: int


@dataclasses.dataclass(frozen=True)
class Cell:
    workflow: str
    task: str
    model: str
    policy: str  # shared | isolated (single-agent: shared)

    @property
    def name(self) -> str:
        if self.workflow == "single":
            return f"single-{self.task}-{self.model}"
        return f"{self.workflow}-{self.task}-{self.model}-{self.policy}"

    @property
    def roles(self) -> tuple[str, ...]:
        return workflow_class(self.workflow).roles

    @property
    def n_sets(self) -> int:
        return len(self.roles) if self.policy == "isolated" else 1

    @property
    def limits(self) -> Limits:
        """The paper's response and prompt lengths and Eval-Opt iterations for this task and workflow."""
        return paper_limits(self.task, self.workflow)

    @property
    def max_response(self) -> int:
        return self.limits.response

    def stages(self) -> list[Stage]:
        """The cell's sampler rounds per episode as its workflow declares them (`sampler_stages`, the
        longest case: every iteration runs) with the paper's options, each prompt priced as the problem
        plus its earlier responses and notes; no prompt is longer than the paper's cap (a longer one ends
        the episode)."""
        q, r = PROMPT_TOKENS[self.task], self.max_response
        return [Stage(st.role, st.calls, min(q + st.responses * r + st.notes * STRATEGY_TOKENS, self.limits.prompt))
                for st in get_workflow(self.workflow).sampler_stages(self.task)]


def cells() -> list[Cell]:
    """The 42 cells: 36 multi-agent, then 6 single-agent."""
    out = [Cell(w, t, m, p) for w in WORKFLOWS for t in TASKS for m in MODELS for p in POLICIES]
    return out + [Cell("single", t, m, "shared") for t in TASKS for m in MODELS]


# ---- sizes ----------------------------------------------------------------------------------------
def dtype_bytes(dtype: str) -> int:
    return {"float32": 4, "bfloat16": 2}[dtype]


def lora_params(cfg: ModelConfig, rank: int) -> int:
    """Parameters of one LoRA set on every linear map of every layer."""
    total = 0
    for name in LINEAR_AXES:
        ins, outs = cfg.linear_shape(name)
        total += cfg.num_layers * rank * (math.prod(ins) + math.prod(outs))
    return total


def lora_params_per_chip(cfg: ModelConfig, rank: int, fsdp: int, tensor: int) -> float:
    """One LoRA set's parameters per chip as `marljax.sharding` places them: each factor splits only along
    its base weight's side — the `embed` side over fsdp, the heads/MLP side over tensor (KV heads when
    tensor divides them) — and the rank stays whole (checked against the compiled v5e-8 step: with fsdp=4
    an even split over every rank under-counted Qwen3-4B's two sets and their Adam moments by 1.5 GiB)."""
    def split(axes):
        if "embed" in axes:
            return fsdp
        if "kv_heads" in axes:
            return tensor if cfg.num_kv_heads % tensor == 0 else 1
        return tensor
    total = 0.0
    for name, (in_axes, out_axes) in LINEAR_AXES.items():
        ins, outs = cfg.linear_shape(name)
        total += cfg.num_layers * rank * (math.prod(ins) / split(in_axes) + math.prod(outs) / split(out_axes))
    return total


def matmul_params(cfg: ModelConfig) -> int:
    """Weights one token multiplies through (linear maps and the output projection)."""
    per_layer = sum(math.prod(cfg.linear_shape(n)[0]) * math.prod(cfg.linear_shape(n)[1]) for n in LINEAR_AXES)
    return cfg.num_layers * per_layer + cfg.hidden_size * cfg.vocab_size


def kv_bytes_per_token(cfg: ModelConfig, dtype: str) -> int:
    return 2 * cfg.num_layers * cfg.num_kv_heads * cfg.head_dim * dtype_bytes(dtype)


@dataclasses.dataclass(frozen=True)
class Memory:
    """Bytes per chip."""

    base: float
    lora: float
    optimizer: float
    grads: float
    activations: float
    kv_cache: float
    rollout_weights: float  # the sampler's per-layer copy of the layers' weights (+ its per-row adapters)

    @property
    def peak(self) -> float:
        return self.base + self.lora + self.optimizer + max(self.grads + self.activations,
                                                            self.kv_cache + self.rollout_weights)


def layer_params(cfg: ModelConfig) -> int:
    """Parameters of the decoder layers (everything but the embedding, output head and final norm)."""
    return cfg.num_params() - cfg.vocab_size * cfg.hidden_size * (1 if cfg.tie_embeddings else 2) - cfg.hidden_size


def memory(cfg: ModelConfig, *, dtype: str, n_sets: int, n_roles: int, rank: int,
           mesh: tuple[int, int, int], cache_rows: int, cache_len: int, train_rows: int,
           train_len: int, response_len: int) -> Memory:
    """The memory model of the module docstring; `cache_rows`/`train_rows` are global row counts."""
    data, fsdp, tensor = mesh
    shard = fsdp * tensor
    kv_tensor = tensor if cfg.num_kv_heads % tensor == 0 else 1
    rows_chip = lambda rows: rows / (data * fsdp) if rows % (data * fsdp) == 0 else rows  # noqa: E731
    lora_set = lora_params_per_chip(cfg, rank, fsdp, tensor) * LORA_BYTES
    b = dtype_bytes(dtype)
    d, f, h, k, dh = cfg.hidden_size, cfg.intermediate_size, cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
    m = rows_chip(train_rows)
    residuals = cfg.num_layers * m * train_len * d * b
    layer = 2 * m * train_len * (4 * d + 2 * (h + 2 * k) * dh + 3 * f) * b / tensor
    logits = 3 * m * min(response_len, LOGPROB_CHUNK) * cfg.vocab_size * 4 / tensor
    return Memory(
        base=cfg.num_params() * b / shard,
        lora=n_sets * lora_set,
        optimizer=2 * n_sets * lora_set,
        grads=n_roles * lora_set,
        activations=residuals + layer + logits,
        kv_cache=rows_chip(cache_rows) * cache_len * kv_bytes_per_token(cfg, dtype) / kv_tensor,
        # isolated sets decode with per-row adapters (`cell_config`'s mix_sets): each chip holds its rank's
        # copy of every set, whole
        rollout_weights=layer_params(cfg) * b / shard + (n_sets * lora_params(cfg, rank) * LORA_BYTES
                                                         if n_sets > 1 else 0))


# ---- per-cell estimate ----------------------------------------------------------------------------
def choose_mesh(cfg: ModelConfig, acc: Accelerator) -> tuple[int, int, int]:
    """(data, fsdp, tensor): replicate the frozen base unless it takes > BASE_BUDGET of HBM."""
    base = cfg.num_params() * dtype_bytes(acc.dtype)
    fsdp = 1
    while fsdp < acc.chips and base / fsdp > BASE_BUDGET * acc.hbm_gb * 1e9:
        fsdp *= 2
    return acc.chips // fsdp, fsdp, 1


@dataclasses.dataclass(frozen=True)
class Estimate:
    cell: Cell
    mesh: tuple[int, int, int]
    memory: Memory
    max_cache_tokens: int
    fits: bool
    engine: EnginePlan
    sample_s: float  # per training step
    train_s: float
    eval_s: float  # one evaluation
    steps: int

    @property
    def run_hours(self) -> float:
        evals = self.steps // EVAL_EVERY + 1
        return (self.steps * (self.sample_s + self.train_s) + evals * self.eval_s) / 3600


@dataclasses.dataclass(frozen=True)
class EnginePlan:
    """The rollout engine a cell runs (see `engine_plan`): per batch rank (data × fsdp of the mesh; its
    `tensor` chips split the KV heads) a pool and its slots."""

    ranks: int
    slots: int  # decode slots per rank
    pages: int  # pages of each rank's pool, the null page included
    page_size: int
    prompt: int  # the longest prompt, padded as the engine pads a prefill (`bucket(·, 16)`)
    prefill_chunk: int  # positions of that prompt one prefill call computes (chunked prefill)
    context: int  # the longest sequence: the longest stage prompt + the response cap
    in_flight: int  # samples the rollout asks for at once, all ranks
    pool_bytes: float  # KV pool per chip


def engine_plan(cell: Cell, cfg: ModelConfig, acc: Accelerator, mesh: tuple[int, int, int],
                max_cache_tokens: int) -> EnginePlan:
    """How many pages and slots the cell's engine needs, from the rollout plan and the memory model.
    Pages: the pool holds what the memory model leaves for KV (`max_cache_tokens`: HBM × HBM_USABLE −
    base, LoRA, Adam and the rollout weights, over all batch ranks), one pool per batch rank (rows spread
    evenly over the ranks). Samples in flight: every episode of a step (problems × rollouts) runs at
    once, each holding at most one stage's calls (its next call is submitted when the last returns), so
    at most episodes × the widest stage's calls. The scheduler admits a sequence when the pool can hold
    its worst case (its prompt + the response cap; shared prompt pages not counted here: an upper
    bound), so slots per rank = min(samples in flight / ranks, the sequences of the cell's shortest
    stage the pool holds); the longest stage runs fewer at a time (`stage_slots`). The engine fits when
    its pool holds one sequence of the longest stage."""
    data, fsdp, tensor = mesh
    ranks = data * fsdp
    ps = PAGE_SIZE  # the sampler's engine pages
    pages = 1 + max_cache_tokens // ranks // ps
    in_flight = PROBLEMS * ROLLOUTS * max(s.calls for s in cell.stages())
    shortest = min(s.prompt for s in cell.stages()) + cell.max_response
    slots = min(-(-in_flight // ranks), (pages - 1) // -(-shortest // ps))
    kv_tensor = tensor if cfg.num_kv_heads % tensor == 0 else 1
    prompt = bucket(max(s.prompt for s in cell.stages()), PREFILL_CHUNK_MIN)
    return EnginePlan(ranks=ranks, slots=slots, pages=pages, page_size=ps, prompt=prompt,
                      prefill_chunk=prefill_chunk(PREFILL_TOKENS_PER_RANK * ranks, ranks, prompt),
                      context=max(s.prompt for s in cell.stages()) + cell.max_response, in_flight=in_flight,
                      pool_bytes=pages * ps * kv_bytes_per_token(cfg, acc.dtype) / kv_tensor)


def stage_slots(plan: EnginePlan, stage: Stage, response: int) -> int:
    """Sequences of `stage` one rank's engine runs at once: its slots, or fewer when the pool holds fewer
    of the stage's worst case (prompt + response cap)."""
    return min(plan.slots, (plan.pages - 1) // -(-(stage.prompt + response) // plan.page_size))


def _sampling_seconds(cell: Cell, cfg: ModelConfig, acc: Accelerator, mesh, plan: EnginePlan, episodes: int,
                      group: int, fill: float) -> float:
    """Rollout time of `episodes` episodes on the cell's engine (see the module docstring); `group`:
    episodes that share the first stage's prompt (the GRPO group), `fill`: mean response / the cap.
    Each stage's calls take max(their tokens / the sequences in flight, one response) decode steps."""
    data, fsdp, tensor = mesh
    b = dtype_bytes(acc.dtype)
    kv_tensor = tensor if cfg.num_kv_heads % tensor == 0 else 1
    weights = cfg.num_params() * b / tensor + lora_params(cfg, LORA_RANK) * LORA_BYTES / (fsdp * tensor)
    gather = (fsdp - 1) / fsdp * cfg.num_params() * b / tensor / (acc.ici_gbs * 1e9)
    n_matmul = matmul_params(cfg)
    attn = 4 * cfg.num_layers * cfg.num_heads * cfg.head_dim  # FLOPs per query per key position
    r = fill * cell.max_response
    total, prefill_flops = 0.0, 0.0
    for i, st in enumerate(cell.stages()):
        calls = episodes * st.calls
        slots = stage_slots(plan, st, cell.max_response)
        steps = max(calls * r / (slots * plan.ranks), r)
        rows_chip = calls * r / steps / plan.ranks  # sequences in flight per rank, on average
        ctx = st.prompt + r / 2  # keys a step reads per sequence, on average
        step_bytes = weights + rows_chip * ctx * kv_bytes_per_token(cfg, acc.dtype) / kv_tensor
        step_flops = rows_chip * (2 * n_matmul + attn * ctx) / tensor
        total += steps * (max(step_bytes / (acc.hbm_gbs * 1e9 * HBM_EFFICIENCY),
                              step_flops / (acc.tflops * 1e12 * MFU)) + gather)
        distinct = episodes // group if i == 0 else calls  # the first stage's calls read the problem's prompt
        prefill_flops += distinct * st.prompt * (2 * n_matmul + attn * st.prompt / 2)
    return total + prefill_flops / (acc.chips * acc.tflops * 1e12 * MFU)


def _train_seconds(cell: Cell, cfg: ModelConfig, acc: Accelerator) -> float:
    """One training step's update FLOPs on the padded rows `train_batch` builds, at MFU of peak."""
    episodes = PROBLEMS * ROLLOUTS
    n_matmul = matmul_params(cfg)
    attn = 4 * cfg.num_layers * cfg.num_heads * cfg.head_dim
    samples = {r: episodes * sum(s.calls for s in cell.stages() if s.role == r) for r in cell.roles}
    sets = {r: (r if cell.policy == "isolated" else "shared") for r in cell.roles}
    per_set = {s: sum(n for r, n in samples.items() if sets[r] == s) for s in set(sets.values())}
    chunks = {s: math.ceil(n / MINIBATCH) for s, n in per_set.items()}  # paper mini-batching
    recompute_old = max(chunks.values()) > 1  # old log-probs before the first update
    flops = 0.0
    for role, n in samples.items():
        k = chunks[sets[role]]
        rows = k * bucket_rows(math.ceil(n / k))
        length = length_bucket(max(s.prompt for s in cell.stages() if s.role == role) + cell.max_response + 1)
        per_token = 8 * n_matmul + 3 * attn * length  # forward, recompute, backward to activations
        if recompute_old:
            per_token += 2 * n_matmul + attn * length
        flops += rows * length * per_token
    return flops / (acc.chips * acc.tflops * 1e12 * MFU)


def longest_row(cell: Cell) -> int:
    """Packed positions of the cell's longest sample (longest prompt + the response cap): one such row per
    data-parallel chip is the train step the memory model sizes, and the cell's `rl.micro_batch_tokens`."""
    return max(length_bucket(s.prompt + cell.max_response + 1) for s in cell.stages())


def estimate(cell: Cell, acc: Accelerator, steps: int = STEPS, response_fill: float = RESPONSE_FILL) -> Estimate:
    cfg = PRESETS[cell.model]
    mesh = choose_mesh(cfg, acc)
    data, fsdp, tensor = mesh
    r = cell.max_response
    longest = longest_row(cell)
    fixed = memory(cfg, dtype=acc.dtype, n_sets=cell.n_sets, n_roles=len(cell.roles), rank=LORA_RANK,
                   mesh=mesh, cache_rows=0, cache_len=0, train_rows=data * fsdp, train_len=longest,
                   response_len=r)
    free = HBM_USABLE * acc.hbm_gb * 1e9 - (fixed.base + fixed.lora + fixed.optimizer + fixed.rollout_weights)
    kv_tensor = tensor if cfg.num_kv_heads % tensor == 0 else 1
    max_cache_tokens = max(0, int(free * data * fsdp * kv_tensor / kv_bytes_per_token(cfg, acc.dtype)))
    max_cache_tokens -= max_cache_tokens % 1024
    biggest = max(s.calls * PROBLEMS * ROLLOUTS * (bucket(s.prompt, 16) + r) for s in cell.stages())
    max_cache_tokens = min(max_cache_tokens, biggest)
    cache_len = bucket(max(s.prompt for s in cell.stages()), 16) + r
    cache_rows = 1 << max(0, (max_cache_tokens // cache_len).bit_length() - 1)
    mem = dataclasses.replace(fixed, kv_cache=memory(
        cfg, dtype=acc.dtype, n_sets=cell.n_sets, n_roles=len(cell.roles), rank=LORA_RANK, mesh=mesh,
        cache_rows=cache_rows, cache_len=cache_len, train_rows=0, train_len=0, response_len=0).kv_cache)
    fits = mem.peak <= HBM_USABLE * acc.hbm_gb * 1e9 and max_cache_tokens >= cache_len
    plan = engine_plan(cell, cfg, acc, mesh, max_cache_tokens)
    engine_fits = plan.pages - 1 >= -(-plan.context // plan.page_size)
    fits = fits and engine_fits
    return Estimate(cell=cell, mesh=mesh, memory=mem, max_cache_tokens=max_cache_tokens, fits=fits, engine=plan,
                    sample_s=_sampling_seconds(cell, cfg, acc, mesh, plan, PROBLEMS * ROLLOUTS, ROLLOUTS,
                                               response_fill) if engine_fits else math.inf,
                    train_s=_train_seconds(cell, cfg, acc),
                    eval_s=_sampling_seconds(cell, cfg, acc, mesh, plan, EVAL_N[cell.task], 1, response_fill)
                    if engine_fits else math.inf,
                    steps=steps)


# ---- configs and plan -----------------------------------------------------------------------------
def cell_config(est: Estimate, acc: Accelerator, data_root: str = "data") -> Config:
    """The run config of a cell: the paper's settings (the config's defaults, resolved for the cell's task
    and workflow) with the cell's choices, the estimate's mesh, the rollout engine of `engine_plan` (one
    page pool per batch rank: `sampling.max_cache_tokens` and `num_slots` are one rank's; an isolated
    cell's LoRA sets in one batch, `sampling.mix_sets`), and micro-batches of at most one longest row per
    data-parallel chip."""
    c, cfg = est.cell, Config()
    cfg.model, cfg.dtype, cfg.policy, cfg.steps = c.model, acc.dtype, c.policy, est.steps
    cfg.run_dir = f"runs/matrix/{c.name}"
    cfg.task.name = TASKS[c.task]
    cfg.task.path = f"{data_root}/{'dapo-math-17k' if c.task == 'math' else 'deepcoder'}"
    cfg.workflow.name = c.workflow
    cfg.sampling.max_cache_tokens = (est.engine.pages - 1) * est.engine.page_size
    cfg.sampling.num_slots = max(1, est.engine.slots)
    cfg.sampling.prefill_tokens = PREFILL_TOKENS_PER_RANK * est.engine.ranks
    # Isolated LoRA sets decode in one batch on the shared base: merged, each set's stream would hold its
    # own pool and its own merged copy of the layers while the rollout has its rows in flight
    cfg.sampling.mix_sets = cfg.lora.enabled and c.n_sets > 1
    cfg.rl.micro_batch_tokens = longest_row(c)
    data, fsdp, tensor = est.mesh
    cfg.mesh = MeshConfig(data=data, fsdp=fsdp, tensor=tensor, rules="auto", lora="sharded")
    return resolve(cfg)


def plan(estimates: list[Estimate], slices: int) -> dict[str, int]:
    """Cell name -> slice index: longest run first onto the least loaded slice."""
    load = [0.0] * slices
    out = {}
    for e in sorted(estimates, key=lambda e: -e.run_hours):
        i = min(range(slices), key=load.__getitem__)
        out[e.cell.name] = i
        load[i] += e.run_hours
    return out


def table(estimates: list[Estimate], acc: Accelerator, slices: int) -> str:
    where = plan(estimates, slices)
    gb = lambda x: f"{x / 1e9:6.2f}"  # noqa: E731
    head = (f"{'cell':38} sets mesh(d,f,t)  base   lora    opt  grads    act     kv  rollw   peak  fits "
            f"cache_tok    slots  sample_s train_s  run_h slice")
    lines = [f"# accelerator {acc.name}: {acc.chips} chips × {acc.hbm_gb} GB HBM, {acc.tflops} TFLOP/s, "
             f"{acc.hbm_gbs} GB/s HBM, {acc.ici_gbs} GB/s ICI; {acc.dtype} base; memory in GB per chip "
             f"(rollw: the sampler's merged per-layer weights); slots: the rollout engine's batch ranks × "
             f"decode slots per rank; times are roofline upper bounds (MFU {MFU}, HBM efficiency "
             f"{HBM_EFFICIENCY})", head]
    for e in estimates:
        m = e.memory
        lines.append(f"{e.cell.name:38} {e.cell.n_sets:4d} {str(e.mesh):12} {gb(m.base)} {gb(m.lora)} "
                     f"{gb(m.optimizer)} {gb(m.grads)} {gb(m.activations)} {gb(m.kv_cache)} {gb(m.rollout_weights)} "
                     f"{gb(m.peak)} "
                     f"{'yes' if e.fits else 'NO':>4} {e.max_cache_tokens:10d} "
                     f"{f'{e.engine.ranks}×{e.engine.slots}':>8} {e.sample_s:9.0f} "
                     f"{e.train_s:7.0f} {e.run_hours:6.1f} {where[e.cell.name]:5d}")
    per_slice = [sum(e.run_hours for e in estimates if where[e.cell.name] == i) for i in range(slices)]
    lines.append(f"# plan: {len(estimates)} cells on {slices} slice(s) "
                 f"({'in parallel, ' if slices > 1 else 'serially, '}longest first): wall-clock ≈ "
                 f"{max(per_slice):.0f} h; per slice {', '.join(f'{h:.0f} h' for h in per_slice)}")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(prog="python -m marljax.matrix", description=__doc__.splitlines()[0])
    ap.add_argument("--dry-run", action="store_true", help="print the table (one row per cell); write nothing")
    ap.add_argument("--accelerator", default="v5e-8", choices=sorted(ACCELERATORS))
    ap.add_argument("--out", default="runs/matrix", help="where the cell configs and plan.md go")
    ap.add_argument("--cell", nargs="+", help="only these cells (one: write its config and print the file's "
                    "path)")
    ap.add_argument("--aot", metavar="TOPOLOGY", help="compile each cell's train step for a TPU topology "
                    "(v5e-8, v6e-8, v5p-8) and print its per-chip memory, FLOPs and roofline time; exits 1 if "
                    "a cell does not fit (marljax/aot.py)")
    ap.add_argument("--aot-part", default="both", choices=("both", "train", "engine"),
                    help="--aot: compile the train step, the rollout engine (prefill and decode chunk), or both")
    ap.add_argument("--aot-rows", type=int, default=1, help="--aot: rows of the longest sample per chip")
    ap.add_argument("--aot-attention", default="splash", help="--aot: rl.attention (splash, dense, …)")
    ap.add_argument("--aot-logprob-chunk", type=int, help="--aot: response positions per log-prob chunk "
                    "(default: the trainer's)")
    ap.add_argument("--slices", type=int, default=1, help="slices (or hosts) running cells in parallel")
    ap.add_argument("--steps", type=int, default=STEPS)
    ap.add_argument("--response-fill", type=float, default=RESPONSE_FILL, help="mean response length as a "
                    "share of the cap, for the rollout time (1: every response runs to the cap)")
    ap.add_argument("--data-root", default="data", help="directory holding dapo-math-17k/ and deepcoder/")
    args = ap.parse_args(argv)
    if args.slices < 1:
        ap.error("--slices must be ≥ 1")
    chosen = cells()
    if args.cell:
        unknown = sorted(set(args.cell) - {c.name for c in chosen})
        if unknown:
            ap.error(f"unknown cell(s) {unknown}; `python -m marljax.matrix --dry-run` lists them.")
        chosen = [c for c in chosen if c.name in args.cell]
    if args.aot:
        sys.exit(_aot(chosen, args))
    if args.cell and len(args.cell) > 1 and not args.dry_run:
        ap.error("writing configs takes one --cell (or none for all)")
    acc = ACCELERATORS[args.accelerator]
    if not 0 < args.response_fill <= 1:
        ap.error("--response-fill must be in (0, 1]")
    estimates = [estimate(c, acc, args.steps, args.response_fill) for c in chosen]
    if args.dry_run:
        print(table(estimates, acc, args.slices))
        return
    out = pathlib.Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    for e in estimates:
        path = out / f"{e.cell.name}.yaml"
        path.write_text(f"# marljax.matrix cell {e.cell.name} for {acc.name}\n"
                        + yaml.safe_dump(to_dict(cell_config(e, acc, args.data_root)), sort_keys=False))
        if args.cell:
            print(path)
    if not args.cell:
        (out / "plan.md").write_text("```\n" + table(estimates, acc, args.slices) + "\n```\n")
        print(f"{len(estimates)} configs and plan.md in {out}", file=sys.stderr)


def with_memory_model(r, cell: Cell, cfg: Config):
    """A compiled cell (`aot.Compiled`) with this module's memory model of the same step beside it."""
    data, fsdp, tensor = r.mesh
    est = memory(dataclasses.replace(PRESETS[cfg.model], dtype=cfg.dtype), dtype=cfg.dtype,
                 n_sets=len(from_config(cfg.policy, cell.roles).sets), n_roles=len(cell.roles),
                 rank=cfg.lora.rank, mesh=(data, fsdp, tensor), cache_rows=0, cache_len=0,
                 train_rows=r.rows, train_len=r.length, response_len=r.response)
    return dataclasses.replace(r, model_arguments=est.base + est.lora + est.optimizer,
                               model_temp=est.grads + est.activations)


def _aot_engine(cell: Cell, cfg: Config, est: Estimate, acc: Accelerator, topology: str, *, printing: bool,
                first: bool) -> list:
    """Compile the cell's engine as `engine_plan` sizes it (with `cfg.sampling.mix_sets` and LoRA: every
    set's adapter per row); while it does not fit (twice at most), again with the pool cut to the pages
    that fit (`aot.CompiledEngine.fit_pages`). Its rows."""
    from marljax import aot
    model = dataclasses.replace(PRESETS[cell.model], dtype=cfg.dtype)
    sets = cell.n_sets if cfg.sampling.mix_sets and cfg.lora.enabled else 0
    plan, out = est.engine, []
    for _ in range(3):
        e = aot.compile_engine(cell, cfg, topology, acc, plan, held_bytes=est.memory.lora + est.memory.optimizer,
                               sets=sets)
        out.append(dataclasses.replace(e, model_step_flops=e.rows * 2.0 * matmul_params(model) / math.prod(e.mesh)))
        if printing:
            lines = aot.engine_table(out[-1:]).splitlines()
            print("\n".join(lines if first and len(out) == 1 else lines[-1:]), flush=True)
        if out[-1].fits or out[-1].fit_pages - 1 < -(-plan.context // plan.page_size):
            break
        plan = engine_plan(cell, model, acc, est.mesh, (out[-1].fit_pages - 1) * plan.page_size * plan.ranks)
    return out


def _aot(chosen: list[Cell], args) -> int:
    """Compile every chosen cell for the topology (the train step, the rollout engine or both, as
    `--aot-part` says), printing rows as they come: the train steps' table, then the engines'; 1 if
    one does not fit."""
    from marljax import aot
    train, engines = [], []
    for c in chosen:
        try:
            aot.topology_devices(args.aot)  # an unknown topology or no libtpu: AotError naming the fix
            acc = ACCELERATORS[args.aot]
            est = estimate(c, acc)
            cfg = cell_config(est, acc)
            if args.aot_part in ("both", "train"):
                r = aot.compile_cell(c, cfg, args.aot, acc, rows_per_chip=args.aot_rows,
                                     attention=args.aot_attention, logprob_chunk=args.aot_logprob_chunk)
                train.append(with_memory_model(r, c, cfg))
                lines = aot.table(train[-1:]).splitlines()
                print("\n".join(lines if len(train) == 1 else lines[-1:]), flush=True)
            if args.aot_part in ("both", "engine"):
                engines += _aot_engine(c, cfg, est, acc, args.aot, printing=args.aot_part == "engine",
                                       first=not engines)
        except aot.AotError as e:
            print(f"python -m marljax.matrix: {e}", file=sys.stderr)
            return 2
    if engines and args.aot_part == "both":
        print(aot.engine_table(engines), flush=True)
    fitting = {e.cell for e in engines if e.fits}
    bad = [r.cell for r in train if not r.fits] + [f"{e.cell} (engine)" for e in engines if e.cell not in fitting]
    bad = list(dict.fromkeys(bad))
    print(f"# {len(chosen) - len({b.split()[0] for b in bad})} of {len(chosen)} cells fit on {args.aot}"
          + (f"; not: {', '.join(bad)}" if bad else ""), flush=True)
    return 1 if bad else 0


if __name__ == "__main__":
    main()
