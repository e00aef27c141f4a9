"""Ahead-of-time compile of the train step for a TPU topology on this CPU machine (marljax/aot.py), and
CPU runs unchanged with libtpu installed."""
import dataclasses
import importlib.util
import os
import subprocess
import sys
import time

import pytest

from marljax import matrix

HAS_LIBTPU = importlib.util.find_spec("libtpu") is not None


def test_aot_names_the_topologies_it_knows(capsys):
    with pytest.raises(SystemExit) as e:
        matrix.main(["--aot", "v4-8", "--cell", "single-math-qwen3-0.6b"])
    assert e.value.code == 2 and "choose a TPU topology from ['v5e-8', 'v5p-8', 'v6e-8']" in capsys.readouterr().err


def test_aot_refuses_a_logprob_budget_below_one_byte(capsys):
    with pytest.raises(SystemExit) as e:
        matrix.main(["--aot", "v5e-8", "--aot-logprob-bytes", "0", "--cell", "single-math-qwen3-0.6b"])
    assert e.value.code == 2 and "--aot-logprob-bytes must be ≥ 1" in capsys.readouterr().err


def test_cpu_runs_stay_on_the_cpu_with_libtpu_installed():
    """The test session's (and its subprocesses') jax runs on the CPU and an entry point that opts in keeps host memory,
    libtpu or not."""
    out = subprocess.run([sys.executable, "-c", "from marljax.core import host_memory; host_memory.retain(); import jax; "
                          "print(jax.default_backend(), host_memory.state)"],
                         env={**os.environ, "MARLJAX_HOST_MALLOC": "auto"}, capture_output=True, text=True,
                         check=True)
    print(f"libtpu importable: {HAS_LIBTPU}; {out.stdout.strip()}")
    assert out.stdout.split() == ["cpu", "retained"]
    assert "TPU" not in out.stderr  # no TPU probe (libtpu warns about its missing environment when probed)


def test_traced_flops_count_what_the_backward_pass_computes():
    """3 rematerialised layers h ← tanh(h·W) through `dot_f32` (a custom VJP), W frozen: per layer the
    forward, its recompute in the backward pass and the input's gradient are 3 products of 2·m·k² each
    (hand count). The weight's gradient the custom VJP also computes is dead code that XLA removes, and
    is not counted (the former count, without dead-code removal: 4 per layer and then some)."""
    import jax
    import jax.numpy as jnp

    from marljax import aot
    from marljax.models.precision import dot_f32

    m, k, layers = 4, 8, 3
    w = jnp.ones((k, k), jnp.bfloat16)

    def loss(x):
        def layer(h, _):
            return jnp.tanh(dot_f32("mk,kn->mn", h, w)).astype(h.dtype), None
        return jnp.sum(jax.lax.scan(jax.checkpoint(layer), x, None, length=layers)[0].astype(jnp.float32))

    jaxpr = jax.make_jaxpr(jax.grad(loss))(jnp.ones((m, k), jnp.bfloat16))
    assert aot.traced_flops(jaxpr) == layers * 3 * 2 * m * k * k
    assert aot._product_flops(jaxpr) > layers * 3 * 2 * m * k * k  # what the dead code adds


# two TPU compiles, 46 s and 49 s on this project's idle 2-core box (2026-12-03); 116-139 s of wall in the
# full suite (2026-12-05), the suite's longest test: `-m slow`
@pytest.mark.slow
@pytest.mark.skipif(not HAS_LIBTPU, reason="libtpu not installed (pip install libtpu==0.0.42.1, requirements-test.txt)")
def test_long_context_train_step_compiles_for_v5e_with_linear_temp_memory():
    """Qwen3-0.6B shapes, 2 layers, splash attention and chunked log-probs, one 4096- and one 8192-token row
    per chip on v5e-8 (mesh data=8): doubling the context less than doubles-and-a-quarter the temp bytes
    (dense T×T scores would quadruple their share)."""
    from marljax import aot
    cell = next(c for c in matrix.cells() if c.name == "single-math-qwen3-0.6b")
    runs = {}
    for T in (4096, 8192):
        t0 = time.perf_counter()
        acc = matrix.ACCELERATORS["v5e-8"]
        runs[T] = aot.compile_cell(cell, matrix.cell_config(matrix.estimate(cell, acc), acc), "v5e-8", acc,
                                   layers=2, length=T)
        print(f"T={T}: temp {runs[T].temp_bytes / 2**20:.0f} MiB, total {runs[T].total_bytes / 2**20:.0f} MiB, "
              f"{runs[T].flops / 1e12:.2f} TFLOP/chip (model {runs[T].model_flops / 1e12:.2f}), "
              f"{time.perf_counter() - t0:.0f} s")
    small, large = runs[4096], runs[8192]
    assert small.fits and large.fits and small.mesh == (8, 1, 1)
    assert small.temp_bytes > 0 and large.temp_bytes < 2.25 * small.temp_bytes
    # the traced program's FLOPs: at least the model's, at most the full remat's recompute (3/2 of the LoRA
    # step's 2 passes) plus splash's recomputed scores
    assert 1.0 < large.recompute < 2.0


_SPLASH_ON_A_MESH = """
import numpy as np, jax, jax.numpy as jnp
from marljax.config import MeshConfig
from marljax.core import sharding
from marljax.models.attention import causal_attention
B, T, H, K, Dh = 4, 130, 4, 2, 8
q, k, v = (jax.random.normal(jax.random.key(i), (B, T, h, Dh)) for i, h in enumerate((H, K, K)))
pos = jnp.broadcast_to(jnp.arange(T), (B, T))
mask = jnp.arange(T)[None, :] < jnp.array([130, 97, 64, 1])[:, None]
ref = causal_attention(q, k, v, pos, mask, "dense")
mesh = sharding.make_mesh(MeshConfig(data=2, fsdp=1, tensor=2))
with sharding.use_mesh(mesh, sharding.RULES["fsdp_tp"]):
    out = jax.jit(lambda *a: causal_attention(*a, "splash"))(q, k, v, pos, mask)
real = np.asarray(mask)[:, :, None, None]
print(float(np.max(np.abs(np.where(real, np.asarray(out) - np.asarray(ref), 0)))), out.sharding.spec)
"""


def test_splash_runs_per_shard_on_a_mesh():
    """On a (data=2, tensor=2) mesh of simulated CPU devices the splash kernel runs per shard (rows and
    heads split, as XLA cannot partition a Pallas kernel) and equals the dense kernel on real tokens."""
    env = {**os.environ, "XLA_FLAGS": os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=4"}
    out = subprocess.run([sys.executable, "-c", _SPLASH_ON_A_MESH], env=env, capture_output=True, text=True)
    assert out.returncode == 0, out.stderr[-3000:]
    err, spec = out.stdout.strip().split(" ", 1)
    print(f"max |splash - dense| = {err}; output sharding {spec}")
    assert float(err) < 1e-5 and "data" in spec and "tensor" in spec


@pytest.mark.slow  # two TPU compiles of a 2-layer engine: ~45 s wall on this project's 2-core box
@pytest.mark.skipif(not HAS_LIBTPU, reason="libtpu not installed (pip install libtpu==0.0.42.1, requirements-test.txt)")
def test_rollout_engine_compiles_for_v5e_with_its_pool_in_place():
    """The engine's prefill and decode chunk (the real jitted functions, the TPU kernel path, one pool per
    data rank) for a Qwen3-0.6B-shaped cell at 2 layers on v5e-8: they fit; the decode chunk's arguments
    are the bf16 weights, the sampler's per-layer copy of the layers and one rank's pool (to 1%); the pool
    is donated (aliased, not copied); XLA counts one decode step's matmuls (the while body once) at the
    model's 2 × matmul parameters per row (within 10%)."""
    from marljax import aot
    from marljax.models.presets import PRESETS
    from marljax.sampling.engine.kv_pages import page_bytes
    cell = next(c for c in matrix.cells() if c.name == "single-code-qwen3-0.6b")
    acc = matrix.ACCELERATORS["v5e-8"]
    est = matrix.estimate(cell, acc)
    cfg = matrix.cell_config(est, acc)
    t0 = time.perf_counter()
    e = aot.compile_engine(cell, cfg, "v5e-8", acc, est.engine, layers=2)
    model = dataclasses.replace(PRESETS[cfg.model], dtype=cfg.dtype, num_layers=2)
    print(aot.engine_table([e]), f"\n{time.perf_counter() - t0:.0f} s")
    assert e.fits and e.mesh == (8, 1, 1) and e.rows == 8 * est.engine.slots
    pool = est.engine.pages * page_bytes(model, est.engine.page_size)  # one rank's pool per chip
    # bf16: the embedding and final norm, the stacked layers (held as one live argument: the decode reads
    # the per-layer copy) and that copy, and the pool
    weights = (model.num_params() + matrix.layer_params(model)) * 2
    assert abs(e.decode.argument_bytes - (weights + pool)) < 0.01 * (weights + pool)
    assert e.held_bytes == matrix.layer_params(model) * 2
    assert e.decode.alias_bytes >= pool and e.decode.output_bytes - e.decode.alias_bytes < 0.01 * pool
    model_flops = e.rows / 8 * 2 * matrix.matmul_params(model)
    assert abs(e.step_flops - model_flops) < 0.1 * model_flops


@pytest.mark.slow  # two TPU compiles of two 2-layer engines: ~110 s wall on this project's 2-core box
@pytest.mark.skipif(not HAS_LIBTPU, reason="libtpu not installed (pip install libtpu==0.0.42.1, requirements-test.txt)")
def test_per_row_lora_engine_compiles_for_v5e_with_each_ranks_adapters_on_its_chip():
    """The Isolated-Policy Voting cell's engine with per-row adapters (`sampling.mix_sets`: the generator's
    and the aggregator's rows in one batch on the shared base) for Qwen3-0.6B at 2 layers on v5e-8: it
    fits, and the decode chunk's arguments are the merged-weight engine's plus the 2 float32 LoRA sets
    once per chip (each rank's copy of the stacked adapters on its own chip; replicated, the 8 ranks'
    copies would be 8×), to 1%. Each chip multiplies only its own rows by its own rank's sets
    (`grouped_lora_delta` per shard): a decode step's FLOPs over the merged-weight engine's are the
    adapters' 2 × parameters per row for at least one set and at most the rank's 2 sets (XLA counts a
    ragged dot as dense over the groups it sees: measured 2.04× one set; left to XLA's partitioner, every
    chip would see all 8 ranks' 16 sets), and the merged engine's step is 2 × matmul parameters per row
    plus the token draw over Qwen3's 151,936 logits (13% more at 2 layers, measured; under 20%). The
    prefill's temporaries stay under 0.5 GiB (XLA's partitioner also all-gathers the 8 ranks' 8,192-token
    chunks: 0.83 GiB)."""
    from marljax import aot
    from marljax.models.presets import PRESETS
    from marljax.rl.policy_map import from_config
    from marljax.sampling.engine.kv_pages import page_bytes
    cell = next(c for c in matrix.cells() if c.name == "voting-math-qwen3-0.6b-isolated")
    acc = matrix.ACCELERATORS["v5e-8"]
    est = matrix.estimate(cell, acc)
    cfg = matrix.cell_config(est, acc)
    sets = len(from_config(cfg.policy, cell.roles).sets)
    e = aot.compile_engine(cell, cfg, "v5e-8", acc, est.engine, layers=2, sets=sets)
    print(aot.engine_table([e]))
    model = dataclasses.replace(PRESETS[cfg.model], dtype=cfg.dtype, num_layers=2)
    assert sets == 2 and e.sets == 2 and e.fits and e.mesh == (8, 1, 1)
    pool = est.engine.pages * page_bytes(model, est.engine.page_size)
    merged = (model.num_params() + matrix.layer_params(model)) * 2 + pool
    adapters = sets * matrix.lora_params(model, cfg.lora.rank) * 4
    assert abs(e.decode.argument_bytes - (merged + adapters)) < 0.01 * (merged + adapters)
    assert abs(e.prefill.argument_bytes - (merged + adapters)) < 0.01 * (merged + adapters)
    merged_engine = aot.compile_engine(cell, cfg, "v5e-8", acc, est.engine, layers=2)
    rows = e.rows / 8  # per chip
    one_set = rows * 2 * matrix.lora_params(model, cfg.lora.rank)
    assert 0.9 * one_set <= e.step_flops - merged_engine.step_flops <= 1.1 * sets * one_set
    matmuls = rows * 2 * matrix.matmul_params(model)
    assert matmuls <= merged_engine.step_flops < 1.2 * matmuls
    assert e.prefill.temp_bytes < 0.5 * aot.GiB


VOTING_0_6B = "voting-math-qwen3-0.6b-shared"


def _voting_iteration(**kw):
    """The Qwen3-0.6B-shaped Voting cell's iteration at 2 layers on v5e-8 (its long row cut to 8,192
    positions: the compile time), its config and its update bound."""
    from marljax import aot
    cell = next(c for c in matrix.cells() if c.name == VOTING_0_6B)
    acc = matrix.ACCELERATORS["v5e-8"]
    cfg = matrix.cell_config(matrix.estimate(cell, acc), acc)
    t0 = time.perf_counter()
    it = matrix.compile_iteration(cell, "v5e-8", layers=2, length=8192, **kw)
    bound = matrix.update_bound(cell, cfg, it.updates[0].mesh, layers=2)
    print(matrix.iteration_table([it], "v5e-8"), f"\nupdate bound {bound / aot.GiB:.2f} GiB per chip; "
          f"{time.perf_counter() - t0:.0f} s")
    return it, bound


# three TPU compiles (2-layer engine, two update micro-batches): 75 s on this project's 2-core box with another
# compile running beside it (2026-12-07, session 30), 169 s alone and 395 s in the loaded default suite in
# session 31, the suite's longest test: in the slow suite (`make test ARGS="-m slow"`), which CI also runs
@pytest.mark.slow
@pytest.mark.skipif(not HAS_LIBTPU, reason="libtpu not installed (pip install libtpu==0.0.42.1, requirements-test.txt)")
def test_iteration_compiles_for_v5e_within_the_update_bound():
    """The whole iteration of a Qwen3-0.6B-shaped Voting cell at 2 layers on v5e-8, through
    `matrix.compile_iteration` (what `python -m marljax.matrix --aot` runs): the engine with its planned pool,
    the update's long micro-batch (one longest row per chip) and its short one (the most 256-token answers
    the cell's token budget admits: 32 rows per chip). Both micro-batches' temporaries stay within
    `matrix.update_bound` (the memory model's activations of one budget-long row per chip), whatever the
    rows: before the log-prob chunks were sized by bytes, the short one's [32, 256, vocab] float32 logits
    alone took 4.6 GiB per chip (`test_per_row_logprob_chunks_break_the_update_bound`)."""
    it, bound = _voting_iteration()
    long, short = it.updates
    assert it.fits and it.refit is None and [u.name for u in it.updates] == ["update/long", "update/short"]
    assert short.rows // 8 == 32 and short.response == 256 and long.rows == 8
    assert long.temp_bytes <= bound and short.temp_bytes <= bound


@pytest.mark.slow  # three TPU compiles, ~75 s
@pytest.mark.skipif(not HAS_LIBTPU, reason="libtpu not installed (pip install libtpu==0.0.42.1, requirements-test.txt)")
def test_per_row_logprob_chunks_break_the_update_bound():
    """The same iteration with the trainer's former log-prob chunking (256 positions of every row at once,
    as `--aot-logprob-bytes` emulates it for the short micro-batch's 32 rows per chip): the short
    micro-batch's temporaries exceed the bound that the byte-sized chunks keep."""
    it, bound = _voting_iteration(logprob_bytes=32 * 256 * 151936 * 4, part="train")
    assert it.updates[1].temp_bytes > bound
