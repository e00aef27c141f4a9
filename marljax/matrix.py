"""`python -m marljax.matrix`: the paper's experiment matrix as run configs, with a per-cell memory and
step-time estimate for an accelerator, the mesh each cell would use, and a plan to run them.

    python -m marljax.matrix --dry-run [--accelerator v5e-8|v6e-8|v5p-8|v4-8|h100|h200|cpu] [--slices K]
        [--length-fraction F | --lengths RUN_DIR]   # rollout hours also at a stated length distribution
    python -m marljax.matrix [--accelerator …] [--out DIR]          # DIR/<cell>.yaml + DIR/plan.md
    python -m marljax.matrix --cell voting-math-qwen3-1.7b-isolated --out DIR   # prints the YAML path
    python -m marljax.matrix --emit skypilot DIR --bucket gs://B/matrix [--data-root gs://B/data]
        # DIR/<cell>.yaml: a SkyPilot managed job per cell, run dir gs://B/matrix/<cell> (`marljax.core.launch_specs`)
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
          a flash-style attention (no T² scores) and log-probs in chunks of at most LOGPROB_BYTES of logits.
  time    roofline with efficiencies: decode step = max(bytes / (HBM × 0.6), FLOPs / (peak × 0.4))
          + the FSDP weight all-gather over ICI, on the rollout engine (`marljax.sampling.engine`, sized by
          `engine_plan`): continuous batching, so decode steps follow the real tokens — every response
          has its role's fraction of the cap (`Lengths`: 1, every response at its 5,120 math / 2,048
          code cap, is the upper bound the table always shows; `--length-fraction F` or a run's measured
          lengths, `--lengths RUN_DIR`, price it again beside), a step advances every slot in flight and
          reads their KV pages (or takes a compiled engine's step time, `estimate(decode_step_s=…)`), a
          finished sequence's slot is refilled at once: each stage takes max(its tokens / the sequences
          in flight, one response) steps, the
          stages one after another (an upper bound for episodes that advance on their own); prefill
          once per distinct prompt (a GRPO group's rollouts and a stage's calls share the problem's
          prompt). The engine is priced with one pool per batch rank (`engine_plan`). Every stage runs its
          full iteration count with prompts at most the paper's cap; train FLOPs = 8·N·tokens
          (forward, recompute, backward to activations; LoRA has no base weight gradient) on the
          padded rows `rl.step.pack` builds, at 40% of peak. Upper bounds at the caps (prompts are
          priced with earlier responses at their caps at any length distribution).
The mesh replicates the frozen base over `data` when it takes ≤ 25% of HBM, else shards it over the
fewest `fsdp` ranks that bring it there. The plan runs cells longest-first on `--slices` slices.
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import math
import pathlib
import sys

import yaml

from marljax.config import Config, load_config, resolve, to_dict
from marljax.core.launch_specs import REMOTE_DATA, Job, LaunchSpecError, target, write_skypilot
from marljax.core.shapes import bucket, bucket_rows, length_bucket
from marljax.core.sharding import MeshConfig
from marljax.models.decoder import LINEAR_AXES, ModelConfig
from marljax.models.logprobs import LOGPROB_BYTES
from marljax.models.presets import HUB_IDS, PRESETS
from marljax.rl.policy_map import from_config
from marljax.sampling.engine.engine import PREFILL_CHUNK_MIN, prefill_chunk
from marljax.sampling.policy_sampler import PAGE_SIZE
from marljax.workflows import WORKFLOWS as REGISTERED
from marljax.workflows import get_workflow, paper_limits, workflow_class
from marljax.workflows.limits import Limits

WORKFLOWS = tuple(sorted(name for name, cls in REGISTERED.items() if cls.paper_matrix))  # the paper's three
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


# ---- response-length distributions ----------------------------------------------------------------
@dataclasses.dataclass(frozen=True)
class Lengths:
    """A response-length distribution for the rollout time: per role, the mean response as a fraction of
    the cell's cap (`fractions`: (role, fraction) pairs), `default` for a role not listed; `label` names
    it in the table's header. The memory model and the engine stay sized for the caps either way."""

    fractions: tuple[tuple[str, float], ...] = ()
    default: float = 1.0
    label: str = "at the caps"

    def fill(self, role: str) -> float:
        return dict(self.fractions).get(role, self.default)

    def describe(self, roles) -> str:
        """The label, naming the `roles` that take `default` because the distribution does not list them."""
        missing = sorted(set(roles) - dict(self.fractions).keys())
        if not self.fractions or not missing:
            return self.label
        return f"{self.label}; not in the run, so at the mean of its roles ({self.default:.2f}): {', '.join(missing)}"


CAPS = Lengths()  # every response at its cap: the upper bound


def length_fraction(fraction: float) -> Lengths:
    """Every response at `fraction` of its cap (`--length-fraction`)."""
    return Lengths(default=fraction, label="at the caps" if fraction == 1 else f"at {fraction:g} of the caps")


class LengthsError(ValueError):
    """A run directory `--lengths` cannot read; the message names the file and the fix."""


_RUN_DIR = "pass the directory of a run that `python -m marljax.train` wrote (its config.yaml and metrics.jsonl)"


def run_lengths(run_dir: str | pathlib.Path) -> Lengths:
    """The length distribution of a run (`--lengths`): per role, the mean over every training record of
    its metrics.jsonl (all steps, not the last few: the matrix prices whole runs and lengths drift over
    training; eval records, `eval/…`, left out) of `role/<r>/length_mean` over the run's response cap
    (`sampling.max_new_tokens` of its config.yaml, resolved as `config.resolve` does); a role the run
    lacks takes the mean of its roles' fractions. The label also gives each role's largest step mean."""
    d = pathlib.Path(run_dir)
    cap = _run_cap(d / "config.yaml")
    steps, means = _length_means(d / "metrics.jsonl")
    fractions = {r: sum(v) / len(v) / cap for r, v in means.items()}
    roles = ", ".join(f"{r} {f:.2f} of its cap (its longest step's mean {max(means[r]) / cap:.2f})"
                      for r, f in fractions.items())
    return Lengths(tuple(fractions.items()), sum(fractions.values()) / len(fractions),
                   f"at the lengths of {run_dir} (steps {min(steps)}–{max(steps)}: the mean of each training step's "
                   f"role/<r>/length_mean over the run's cap, {cap} tokens; per role: {roles})")


def _run_cap(path: pathlib.Path) -> int:
    """The run's response cap: its config's `sampling.max_new_tokens`, resolved."""
    if not path.is_file():
        raise LengthsError(f"--lengths: {path} does not exist; {_RUN_DIR}")
    try:
        return resolve(load_config(str(path))).sampling.max_new_tokens
    except (OSError, yaml.YAMLError, ValueError) as e:  # ConfigError is a ValueError
        raise LengthsError(f"--lengths: cannot read the run's config {path} ({e}); {_RUN_DIR}") from None


def _length_means(path: pathlib.Path) -> tuple[list[int], dict[str, list[float]]]:
    """The steps of `path`'s training records with a length, and per role each such record's length_mean."""
    try:
        lines = path.read_text().splitlines()
    except OSError as e:
        raise LengthsError(f"--lengths: cannot read {path} ({e.strerror}); {_RUN_DIR}") from None
    steps, means = [], {}
    for n, line in enumerate(lines, 1):
        try:
            record = json.loads(line) if line.strip() else {}
        except json.JSONDecodeError:
            record = None
        if not isinstance(record, dict):
            raise LengthsError(f"--lengths: {path} line {n} is not a JSON record (one a line); {_RUN_DIR}")
        found = {k.split("/")[1]: v for k, v in record.items() if k.startswith("role/")
                 and k.endswith("/length_mean") and k.count("/") == 2 and isinstance(v, (int, float))}
        if found:
            steps.append(record.get("step", n))
            for role, v in found.items():
                means.setdefault(role, []).append(float(v))
    if not means:
        raise LengthsError(f"--lengths: {path} has no training record with role/<r>/length_mean; pass a run "
                           "that has trained at least one step (or price with --length-fraction F)")
    return steps, means


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
    """One LoRA set's parameters per chip as `marljax.core.sharding` places them: each factor splits only along
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
    # float32 log-prob chunks (marljax.models.logprobs): at most the budget, or one position of every row
    logits = 3 * min(m * response_len * cfg.vocab_size * 4, max(LOGPROB_BYTES, m * cfg.vocab_size * 4)) / tensor
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


DECODE_MODEL = "roofline model"
DECODE_AOT = "compiled engine's cost analysis (--aot)"


@dataclasses.dataclass(frozen=True)
class Estimate:
    cell: Cell
    mesh: tuple[int, int, int]
    memory: Memory
    max_cache_tokens: int
    fits: bool
    engine: EnginePlan
    sample_s: float  # per training step, every response at its cap (the upper bound)
    train_s: float
    eval_s: float  # one evaluation, at the caps
    steps: int
    lengths: Lengths  # the stated length distribution of `sample_at_s` and `eval_at_s` (`CAPS`: none stated)
    sample_at_s: float
    eval_at_s: float
    decode_step: str  # where the decode step time came from: DECODE_MODEL or DECODE_AOT

    def _hours(self, sample_s: float, eval_s: float) -> float:
        evals = self.steps // EVAL_EVERY + 1
        return (self.steps * (sample_s + self.train_s) + evals * eval_s) / 3600

    @property
    def run_hours(self) -> float:
        """The run's hours at the caps: the upper bound."""
        return self._hours(self.sample_s, self.eval_s)

    @property
    def run_hours_at(self) -> float:
        """The run's hours at the stated length distribution (`lengths`)."""
        return self._hours(self.sample_at_s, self.eval_at_s)


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


# What `--aot --aot-record` compiled to fit where the plan did not: {accelerator: {cell: {"pages": pages per rank
# of the engine's pool, "micro_batch_tokens": the update's token budget}}}; `engine_plan` and `cell_config` plan
# at most these for that accelerator.
FITS_FILE = pathlib.Path(__file__).resolve().parent.parent / "configs" / "aot_fits.yaml"


def recorded_fit(accelerator: str, cell: str, key: str, path: pathlib.Path | None = None) -> int | None:
    """The recorded `key` ("pages" or "micro_batch_tokens") of `cell` on `accelerator`, or None."""
    path = path or FITS_FILE
    fits = (yaml.safe_load(path.read_text()) or {}) if path.exists() else {}
    return fits.get(accelerator, {}).get(cell, {}).get(key)


def record_fit(accelerator: str, cell: str, key: str, value: int, path: pathlib.Path | None = None) -> None:
    """Record that `cell` fits `accelerator` with `key` = `value` (an AOT refit; see FITS_FILE)."""
    path = path or FITS_FILE
    fits = (yaml.safe_load(path.read_text()) or {}) if path.exists() else {}
    fits.setdefault(accelerator, {}).setdefault(cell, {})[key] = int(value)
    path.write_text("# what `python -m marljax.matrix --aot TOPOLOGY --aot-record` compiled to fit where the memory "
                    "model's plan did not:\n# pages per rank of the engine's pool, the update's micro_batch_tokens; "
                    "marljax.matrix plans at most these\n" + yaml.safe_dump(fits, sort_keys=True))


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
    its pool holds one sequence of the longest stage. A pool the AOT compile recorded for the cell on `acc`
    (`FITS_FILE`) caps the pages."""
    data, fsdp, tensor = mesh
    ranks = data * fsdp
    ps = PAGE_SIZE  # the sampler's engine pages
    pages = 1 + max_cache_tokens // ranks // ps
    pages = min(pages, recorded_fit(acc.name, cell.name, "pages") or pages)
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
                      group: int, lengths: Lengths, decode_step_s: float | None = None) -> float:
    """Rollout time of `episodes` episodes on the cell's engine (see the module docstring); `group`:
    episodes that share the first stage's prompt (the GRPO group), `lengths`: each stage's mean response
    as a fraction of the cap, by the stage's role. Each stage's calls take max(their tokens / the
    sequences in flight, one response) decode steps, each the roofline model's step at the stage's rows
    and context, or `decode_step_s` where given (a compiled engine's step, `aot.CompiledEngine.step_s`:
    its slots reading its whole pool), plus the FSDP all-gather either way."""
    data, fsdp, tensor = mesh
    b = dtype_bytes(acc.dtype)
    kv_tensor = tensor if cfg.num_kv_heads % tensor == 0 else 1
    weights = cfg.num_params() * b / tensor + lora_params(cfg, LORA_RANK) * LORA_BYTES / (fsdp * tensor)
    gather = (fsdp - 1) / fsdp * cfg.num_params() * b / tensor / (acc.ici_gbs * 1e9)
    n_matmul = matmul_params(cfg)
    attn = 4 * cfg.num_layers * cfg.num_heads * cfg.head_dim  # FLOPs per query per key position
    total, prefill_flops = 0.0, 0.0
    for i, st in enumerate(cell.stages()):
        r = lengths.fill(st.role) * cell.max_response
        calls = episodes * st.calls
        slots = stage_slots(plan, st, cell.max_response)
        steps = max(calls * r / (slots * plan.ranks), r)
        rows_chip = calls * r / steps / plan.ranks  # sequences in flight per rank, on average
        ctx = st.prompt + r / 2  # keys a step reads per sequence, on average
        step_bytes = weights + rows_chip * ctx * kv_bytes_per_token(cfg, acc.dtype) / kv_tensor
        step_flops = rows_chip * (2 * n_matmul + attn * ctx) / tensor
        step_s = max(step_bytes / (acc.hbm_gbs * 1e9 * HBM_EFFICIENCY), step_flops / (acc.tflops * 1e12 * MFU))
        total += steps * ((step_s if decode_step_s is None else decode_step_s) + gather)
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


def estimate(cell: Cell, acc: Accelerator, steps: int = STEPS, lengths: Lengths = CAPS,
             decode_step_s: float | None = None) -> Estimate:
    """The cell's memory, engine and times on `acc`: the rollout at the caps and at `lengths`;
    `decode_step_s`: a compiled engine's decode step time (`aot.CompiledEngine.step_s`) in place of the
    roofline model's (see `_sampling_seconds`)."""
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

    def rollout(episodes: int, group: int, at: Lengths) -> float:
        return _sampling_seconds(cell, cfg, acc, mesh, plan, episodes, group, at,
                                 decode_step_s) if engine_fits else math.inf
    return Estimate(cell=cell, mesh=mesh, memory=mem, max_cache_tokens=max_cache_tokens, fits=fits, engine=plan,
                    sample_s=rollout(PROBLEMS * ROLLOUTS, ROLLOUTS, CAPS), train_s=_train_seconds(cell, cfg, acc),
                    eval_s=rollout(EVAL_N[cell.task], 1, CAPS), steps=steps, lengths=lengths,
                    sample_at_s=rollout(PROBLEMS * ROLLOUTS, ROLLOUTS, lengths),
                    eval_at_s=rollout(EVAL_N[cell.task], 1, lengths),
                    decode_step=DECODE_MODEL if decode_step_s is None else DECODE_AOT)


# ---- configs and plan -----------------------------------------------------------------------------
def cell_config(est: Estimate, acc: Accelerator, data_root: str = "data") -> Config:
    """The run config of a cell: the paper's settings (the config's defaults, resolved for the cell's task
    and workflow) with the cell's choices, the estimate's mesh, the rollout engine of `engine_plan` (one
    page pool per batch rank: `sampling.max_cache_tokens` and `num_slots` are one rank's; an isolated
    cell's LoRA sets in one batch, `sampling.mix_sets`), and micro-batches of at most one longest row's
    positions per data-parallel chip (or the budget `--aot-record` found to fit) and the rows of the short
    micro-batch the AOT compile proves."""
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
    cfg.rl.micro_batch_tokens = recorded_fit(acc.name, c.name, "micro_batch_tokens") or longest_row(c)
    # …and at most the rows of the short micro-batch the AOT compile proves (`aot.update_shapes`)
    from marljax.aot import update_shapes
    chips = est.mesh[0] * est.mesh[1]
    cfg.rl.micro_batch_rows = update_shapes(c, cfg.rl.micro_batch_tokens, chips)["short"].rows // chips
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
    """One row per cell: memory, mesh, engine, and the rollout and run times at the caps (`sample_s`,
    `run_h`: the upper bound) and at the estimates' stated length distribution (`@L`); the plan's slices
    are the caps' (longest first), its wall-clock given at both."""
    where = plan(estimates, slices)
    gb = lambda x: f"{x / 1e9:6.2f}"  # noqa: E731
    sources = {s: sum(e.decode_step == s for e in estimates) for s in dict.fromkeys(e.decode_step for e in estimates)}
    decode = next(iter(sources)) if len(sources) == 1 else ", ".join(f"{s} for {n} of {len(estimates)} cells"
                                                                        for s, n in sources.items())
    at = estimates[0].lengths.describe({r for e in estimates for r in e.cell.roles})
    head = (f"{'cell':38} sets mesh(d,f,t)  base   lora    opt  grads    act     kv  rollw   peak  fits "
            f"cache_tok    slots  sample_s train_s  run_h sample_s@L run_h@L slice")
    lines = [f"# accelerator {acc.name}: {acc.chips} chips × {acc.hbm_gb} GB HBM, {acc.tflops} TFLOP/s, "
             f"{acc.hbm_gbs} GB/s HBM, {acc.ici_gbs} GB/s ICI; {acc.dtype} base; memory in GB per chip "
             f"(rollw: the sampler's merged per-layer weights); slots: the rollout engine's batch ranks × "
             f"decode slots per rank; times are roofline estimates (MFU {MFU}, HBM efficiency "
             f"{HBM_EFFICIENCY})",
             f"# decode step: {decode}; sample_s, run_h: every response at its cap (the upper bound); "
             f"sample_s@L, run_h@L: L = {at}", head]
    for e in estimates:
        m = e.memory
        lines.append(f"{e.cell.name:38} {e.cell.n_sets:4d} {str(e.mesh):12} {gb(m.base)} {gb(m.lora)} "
                     f"{gb(m.optimizer)} {gb(m.grads)} {gb(m.activations)} {gb(m.kv_cache)} {gb(m.rollout_weights)} "
                     f"{gb(m.peak)} "
                     f"{'yes' if e.fits else 'NO':>4} {e.max_cache_tokens:10d} "
                     f"{f'{e.engine.ranks}×{e.engine.slots}':>8} {e.sample_s:9.0f} "
                     f"{e.train_s:7.0f} {e.run_hours:6.1f} {e.sample_at_s:10.0f} {e.run_hours_at:7.1f} "
                     f"{where[e.cell.name]:5d}")
    per_slice = [sum(e.run_hours for e in estimates if where[e.cell.name] == i) for i in range(slices)]
    at_slice = [sum(e.run_hours_at for e in estimates if where[e.cell.name] == i) for i in range(slices)]
    lines.append(f"# plan: {len(estimates)} cells on {slices} slice(s) "
                 f"({'in parallel, ' if slices > 1 else 'serially, '}longest first): wall-clock ≈ "
                 f"{max(per_slice):.0f} h at the caps, {max(at_slice):.0f} h at L; per slice "
                 f"{', '.join(f'{h:.0f} h' for h in per_slice)} (at L: {', '.join(f'{h:.0f} h' for h in at_slice)})")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(prog="python -m marljax.matrix", description=__doc__.splitlines()[0])
    ap.add_argument("--dry-run", action="store_true", help="print the table (one row per cell); write nothing")
    ap.add_argument("--accelerator", default="v5e-8", choices=sorted(ACCELERATORS))
    ap.add_argument("--out", default="runs/matrix", help="where the cell configs and plan.md go")
    ap.add_argument("--cell", nargs="+", action="extend", help="only these cells (repeatable: --cell A B --cell C; "
                    "one: write its config and print the file's path)")
    ap.add_argument("--aot", metavar="TOPOLOGY", help="compile each cell's training iteration (the rollout "
                    "engine, the update's long and short micro-batches) for a TPU topology (v5e-8, v6e-8, v5p-8) "
                    "and print per program its per-chip memory, FLOPs and roofline time; exits 1 if a cell does "
                    "not fit (marljax/aot.py)")
    ap.add_argument("--aot-part", default="both", choices=("both", "train", "engine"),
                    help="--aot: compile the update, the rollout engine (prefill and decode chunk), or both")
    ap.add_argument("--aot-attention", default="splash", help="--aot: rl.attention (splash, dense, …)")
    ap.add_argument("--aot-logprob-bytes", type=int, help="--aot: float32 logits per log-prob chunk and chip "
                    "(default: the trainer's, marljax.models.logprobs.LOGPROB_BYTES)")
    ap.add_argument("--aot-record", action="store_true", help="--aot: record each refitted engine pool in "
                    f"{FITS_FILE.name} (the cells' configs for that accelerator then plan it)")
    ap.add_argument("--slices", type=int, default=1, help="slices (or hosts) running cells in parallel")
    ap.add_argument("--steps", type=int, default=STEPS)
    stated = ap.add_mutually_exclusive_group()
    stated.add_argument("--length-fraction", type=float, metavar="F", help="also price the rollouts with every "
                        "response at F × its cap, 0 < F ≤ 1 (the caps' columns stay: the upper bound)")
    stated.add_argument("--lengths", metavar="RUN_DIR", help="also price the rollouts at a run's per-role mean "
                        "response lengths, as fractions of its cap (RUN_DIR/metrics.jsonl, RUN_DIR/config.yaml)")
    ap.add_argument("--data-root", default="data", help="directory holding dapo-math-17k/ and deepcoder/ "
                    "(--emit: a local directory or gs:// URL the jobs mount)")
    ap.add_argument("--emit", nargs=2, metavar=("ORCHESTRATOR", "DIR"), help="write DIR/<cell>.yaml, a job spec "
                    "per cell for the orchestrator (skypilot: `sky jobs launch DIR/<cell>.yaml`), and the cells' "
                    "configs in DIR/configs (marljax/core/launch_specs.py)")
    ap.add_argument("--bucket", metavar="gs://BUCKET/PATH", help="--emit: the run dirs' root (a cell's: "
                    "BUCKET/PATH/<cell>)")
    args = ap.parse_args(argv)
    if args.bucket and not args.emit:
        ap.error("--bucket goes with --emit (the jobs' run dirs); launch/tpu_vm.sh takes its own --bucket")
    if args.slices < 1:
        ap.error("--slices must be ≥ 1")
    if args.aot_logprob_bytes is not None and args.aot_logprob_bytes < 1:
        ap.error("--aot-logprob-bytes must be ≥ 1 (bytes of float32 logits per log-prob chunk and chip)")
    chosen = cells()
    if args.cell:
        unknown = sorted(set(args.cell) - {c.name for c in chosen})
        if unknown:
            ap.error(f"unknown cell(s) {unknown}; `python -m marljax.matrix --dry-run` lists them.")
        by_name = {c.name: c for c in chosen}
        chosen = [by_name[n] for n in dict.fromkeys(args.cell)]  # in the order given, each once
    if args.length_fraction is not None and not 0 < args.length_fraction <= 1:
        ap.error("--length-fraction must be in (0, 1]")
    try:
        lengths = run_lengths(args.lengths) if args.lengths else length_fraction(args.length_fraction or 1.0)
    except LengthsError as e:
        ap.error(str(e))
    if args.aot:
        sys.exit(_aot(chosen, args, lengths))
    if args.cell and len(args.cell) > 1 and not (args.dry_run or args.emit):
        ap.error("writing configs takes one --cell (or none for all)")
    acc = ACCELERATORS[args.accelerator]
    estimates = [estimate(c, acc, args.steps, lengths) for c in chosen]
    if args.dry_run:
        print(table(estimates, acc, args.slices))
        return
    if args.emit:
        try:
            _emit(estimates, acc, args)
        except LaunchSpecError as e:
            ap.error(str(e))
        return
    paths = write_configs(estimates, acc, pathlib.Path(args.out), args.data_root, args.slices, plan=not args.cell)
    if args.cell:
        print(paths[0])
    else:
        print(f"{len(paths)} configs and plan.md in {args.out}", file=sys.stderr)


def write_configs(estimates: list[Estimate], acc: Accelerator, out: pathlib.Path, data_root: str,
                  slices: int, plan: bool = True) -> list[pathlib.Path]:
    """Write out/<cell>.yaml per estimate (`cell_config`, datasets under `data_root`) and, with `plan`,
    out/plan.md (the table on `slices`); the configs' paths."""
    out.mkdir(parents=True, exist_ok=True)
    paths = []
    for e in estimates:
        paths.append(out / f"{e.cell.name}.yaml")
        paths[-1].write_text(f"# marljax.matrix cell {e.cell.name} for {acc.name}\n"
                             + yaml.safe_dump(to_dict(cell_config(e, acc, data_root)), sort_keys=False))
    if plan:
        (out / "plan.md").write_text("```\n" + table(estimates, acc, slices) + "\n```\n")
    return paths


def _emit(estimates: list[Estimate], acc: Accelerator, args) -> None:
    """--emit: check the target first, then write the cells' configs (datasets at the jobs' mount) in
    DIR/configs and a job spec per cell in DIR."""
    orchestrator, out = args.emit[0], pathlib.Path(args.emit[1])
    where = target(orchestrator, acc.name, args.bucket, args.data_root)
    configs = write_configs(estimates, acc, out / "configs", REMOTE_DATA, args.slices)
    jobs = [Job(e.cell.name, path, HUB_IDS[e.cell.model]) for e, path in zip(estimates, configs)]
    specs = write_skypilot(jobs, where, out)
    print(f"{len(specs)} {orchestrator} job specs in {out} (configs in {out / 'configs'}); launch one with "
          f"`sky jobs launch {specs[0]}`", file=sys.stderr)


def _model_config(cfg: Config, layers: int | None = None) -> ModelConfig:
    """The cell's model in its config's dtype; `layers` overrides the layer count (tests)."""
    return dataclasses.replace(PRESETS[cfg.model], dtype=cfg.dtype, **({"num_layers": layers} if layers else {}))


def update_bound(cell: Cell, cfg: Config, mesh: tuple[int, int, int], layers: int | None = None) -> float:
    """Bytes per chip that any micro-batch of the cell's update holds beyond the train state and the gradient
    sums, by the memory model: activations of `rl.micro_batch_tokens` packed positions per data-parallel chip
    (rows × positions; the residual stream and one layer's working set scale with that product, whatever the
    rows) and log-prob chunks of at most `LOGPROB_BYTES` — the model's activations of one budget-long row
    per chip. Holds while a chip's rows × V × 4 ≤ LOGPROB_BYTES (220 Qwen3 rows; a budget-sized micro-batch of
    the cells has at most 40)."""
    data, fsdp, tensor = mesh
    model = _model_config(cfg, layers)
    budget = cfg.rl.micro_batch_tokens or longest_row(cell)
    return memory(model, dtype=cfg.dtype, n_sets=1, n_roles=1, rank=cfg.lora.rank, mesh=mesh, cache_rows=0,
                  cache_len=0, train_rows=data * fsdp, train_len=budget, response_len=budget).activations


def with_memory_model(r, cell: Cell, cfg: Config, layers: int | None = None):
    """A compiled micro-batch (`aot.Compiled`) with this module's memory model of the same step beside it."""
    data, fsdp, tensor = r.mesh
    model = _model_config(cfg, layers)
    est = memory(model, dtype=cfg.dtype,
                 n_sets=len(from_config(cfg.policy, cell.roles).sets), n_roles=len(cell.roles),
                 rank=cfg.lora.rank, mesh=(data, fsdp, tensor), cache_rows=0, cache_len=0,
                 train_rows=r.rows, train_len=r.length, response_len=r.response)
    return dataclasses.replace(r, model_arguments=est.base + est.lora + est.optimizer,
                               model_temp=est.grads + est.activations)


def _aot_engine(cell: Cell, cfg: Config, est: Estimate, acc: Accelerator, topology: str, *,
                layers: int | None = None) -> list:
    """Compile the cell's engine as `engine_plan` sizes it (with `cfg.sampling.mix_sets` and LoRA: every
    set's adapter per row); while it does not fit (twice at most), again with the pool cut to the pages
    that fit (`aot.CompiledEngine.fit_pages`). Its compiles, the planned first."""
    from marljax import aot
    model = _model_config(cfg, layers)
    sets = cell.n_sets if cfg.sampling.mix_sets and cfg.lora.enabled else 0
    plan, out = est.engine, []
    for _ in range(3):
        held = (est.memory.lora + est.memory.optimizer) * model.num_layers / PRESETS[cell.model].num_layers
        e = aot.compile_engine(cell, cfg, topology, acc, plan, held_bytes=held, sets=sets, layers=layers)
        out.append(dataclasses.replace(e, model_step_flops=e.rows * 2.0 * matmul_params(model) / math.prod(e.mesh)))
        if out[-1].fits or out[-1].fit_pages - 1 < -(-plan.context // plan.page_size):
            break
        plan = engine_plan(cell, model, acc, est.mesh, (out[-1].fit_pages - 1) * plan.page_size * plan.ranks)
    return out


def _aot(chosen: list[Cell], args, lengths: Lengths = CAPS) -> int:
    """Compile every chosen cell's iteration for the topology (the update's micro-batches, the rollout
    engine or both, as `--aot-part` says), printing each program's row as it comes, then one table of the
    iteration per cell (`iteration_table`) and, where engines compiled, the cells' hours with the compiled
    decode step (`table`, at the caps and at `lengths`); 1 if a cell does not fit as planned."""
    from marljax import aot
    rows = []
    for c in chosen:
        try:
            aot.topology_devices(args.aot)  # an unknown topology or no libtpu: AotError naming the fix
            acc = ACCELERATORS[args.aot]
            rows.append(compile_iteration(c, args.aot, part=args.aot_part, attention=args.aot_attention,
                                          logprob_bytes=args.aot_logprob_bytes, printing=True))
            if args.aot_record and rows[-1].refit is not None:
                record_fit(args.aot, c.name, "pages", rows[-1].refit.plan.pages)
            if args.aot_record and rows[-1].budget_refit is not None:
                record_fit(args.aot, c.name, "micro_batch_tokens", rows[-1].budget_refit[0])
        except aot.AotError as e:
            print(f"python -m marljax.matrix: {e}", file=sys.stderr)
            return 2
    print(iteration_table(rows, args.aot, recorded=args.aot_record), flush=True)
    acc, names = ACCELERATORS[args.aot], [r.cell for r in rows]
    timed = [estimate(c, acc, args.steps, lengths, decode_step_s=r.engine.step_s)
             for c, r in zip(chosen, rows) if r.engine is not None and c.name in names]
    if timed:
        print(table(timed, acc, args.slices), flush=True)
    bad = [r.cell for r in rows if not r.fits]
    print(f"# {len(rows) - len(bad)} of {len(rows)} cells fit on {args.aot} as planned"
          + (f"; not: {', '.join(bad)}" if bad else ""), flush=True)
    return 1 if bad else 0


def compile_iteration(cell: Cell, topology: str, *, part: str = "both", attention: str = "splash",
                      logprob_bytes: int | None = None, layers: int | None = None, length: int | None = None,
                      printing: bool = False) -> CellIteration:
    """Compile `cell`'s training iteration for `topology` as its config (`cell_config`) plans it: the update's
    long and short micro-batches (`aot.compile_cell`, with this module's memory model beside them) and the
    rollout engine with its planned pool, refitted when it does not fit (`_aot_engine`). `part`: both, train
    or engine; `layers` / `length` override the model's layer count and the long row's positions (tests);
    `printing`: each program's row as it comes."""
    from marljax import aot
    acc = ACCELERATORS[topology]
    est = estimate(cell, acc)
    cfg = cell_config(est, acc)
    updates, engines, budgets = [], [], []

    def update(shape, cfg):
        u = with_memory_model(aot.compile_cell(cell, cfg, topology, acc, shape=shape, attention=attention,
                                               logprob_bytes=logprob_bytes, layers=layers, length=length),
                              cell, cfg, layers)
        if printing:
            print(aot.table([u]).splitlines()[-1], flush=True)
        return u

    if part in ("both", "train"):
        updates = [update("long", cfg), update("short", cfg)]
        budget = cfg.rl.micro_batch_tokens
        while not (budgets[-1][1] if budgets else updates[1]).fits and updates[0].fits and len(budgets) < 2:
            budget //= 2  # fewer short rows per micro-batch; a longer sample is a micro-batch of one
            rl = dataclasses.replace(cfg.rl, micro_batch_tokens=budget)
            budgets.append((budget, update("short", dataclasses.replace(cfg, rl=rl))))
    if part in ("both", "engine"):
        engines = _aot_engine(cell, cfg, est, acc, topology, layers=layers)
        if printing:
            print("\n".join(aot.engine_table([e]).splitlines()[-1] for e in engines), flush=True)
    return CellIteration(cell.name, updates, engines, budgets)


@dataclasses.dataclass(frozen=True)
class CellIteration:
    """A cell's compiled iteration: its update micro-batches (`aot.Compiled`), its engine as planned, then any
    refits (`aot.CompiledEngine`), and the short micro-batch at smaller token budgets where the planned one
    did not fit ((budget, `aot.Compiled`))."""

    cell: str
    updates: list
    engines: list
    budgets: list = dataclasses.field(default_factory=list)

    @property
    def budget_refit(self):
        """(token budget, short micro-batch) of the first smaller budget that fits, when the planned does not."""
        return next(((b, u) for b, u in self.budgets if u.fits), None)

    @property
    def fits(self) -> bool:
        """Every program fits, the engine with the pool the cell's config plans."""
        return all(u.fits for u in self.updates) and (not self.engines or self.engines[0].fits)

    @property
    def engine(self):
        """The engine the cell runs: as planned when it fits, else the refit that fits (None: neither)."""
        return self.engines[0] if self.engines and self.engines[0].fits else self.refit

    @property
    def refit(self):
        """The first refit engine that fits, when the planned pool does not (else None)."""
        if not self.engines or self.engines[0].fits:
            return None
        return next((e for e in self.engines[1:] if e.fits), None)


def iteration_table(rows: list[CellIteration], topology: str, *, recorded: bool = False) -> str:
    """One line per program of each cell (engine, update/long, update/short: XLA's peak GiB per chip) and
    the cell's verdict from the largest."""
    gib = lambda x: f"{x / 2**30:6.2f}"  # noqa: E731
    lines = [f"# the training iteration per cell on {topology}: XLA's peak GiB per chip of each program (engine: "
             f"the larger of prefill and decode chunk, with the pool the cell's config plans); a cell fits only if "
             f"every program does; s: compile seconds (engine: every compile, refits included)",
             f"{'cell':38} {'program':13} {'shape':44} {'peak':>6} {'hbm':>6} fits {'s':>5}  note"]
    for r in rows:
        for e in r.engines[:1]:
            note = ""
            if not e.fits:
                fit = r.refit
                note = (f"refit: fits at {fit.plan.pages} pages × {fit.plan.ranks} ranks, {fit.plan.slots} slots "
                        f"({gib(fit.total_bytes).strip()} GiB)" + (f", recorded in {FITS_FILE.name}" if recorded
                                                                     else "") if fit else "no refit fits")
            shape = f"{e.plan.ranks}×{e.plan.slots} slots, {e.plan.pages} pages/rank, ctx {e.plan.context}"
            lines.append(f"{r.cell:38} {'engine':13} {shape:44} {gib(e.total_bytes)} {gib(e.hbm_bytes)} "
                         f"{'yes' if e.fits else 'NO':>4} {sum(x.compile_s for x in r.engines):5.0f}  {note}")
        for u in r.updates:
            shape, note = f"{u.role} {u.rows}×{u.length} (R {u.response})", ""
            if u.name == "update/short" and r.budgets:
                fit = r.budget_refit
                note = (f"refit: fits at micro_batch_tokens={fit[0]} ({fit[1].rows}×{fit[1].length}, "
                        f"{gib(fit[1].total_bytes).strip()} GiB)" + (f", recorded in {FITS_FILE.name}" if recorded
                                                                     else "") if fit else "no smaller budget fits")
            lines.append(f"{r.cell:38} {u.name:13} {shape:44} {gib(u.total_bytes)} {gib(u.hbm_bytes)} "
                         f"{'yes' if u.fits else 'NO':>4} "
                         f"{u.compile_s + sum(b[1].compile_s for b in r.budgets if u.name == 'update/short'):5.0f}"
                         f"  {note}")
        peak = max([u.total_bytes for u in r.updates] + [e.total_bytes for e in r.engines[:1]], default=0)
        lines.append(f"{r.cell:38} {'= cell':13} {'largest program':44} {gib(peak)} {'':6} "
                     f"{'yes' if r.fits else 'NO':>4}")
    return "\n".join(lines)


if __name__ == "__main__":
    main()
