"""Mesh-equivalence checks on 8 simulated CPU devices; `tests/test_sharding.py` runs this in a subprocess
(the device count is fixed when jax starts) and asserts on the JSON it prints.

    XLA_FLAGS=--xla_force_host_platform_device_count=8 python tests/sharding_check.py CKPT_DIR

One small random Qwen3-style model (4 heads, 4 KV heads) computes logits, greedy samples and one
LoRA train step (two roles, each on its own parameter set) on one device and under two meshes; a checkpoint
written under the first mesh is restored under the second; the rollout engine's page operations stay on
each rank's own chip.
"""
from __future__ import annotations

import contextlib
import json
import sys

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx

from marljax.core import sharding
from marljax.core.checkpoint import Checkpointer
from marljax.core.sharding import MeshConfig
from marljax.models.decoder import Decoder, ModelConfig
from marljax.models.lora import LoRAConfig, init_lora
from marljax.rl.state import TrainState
from marljax.rl.step import Sample, StepConfig, Trainer, train_batch
from marljax.sampling import SamplingParams, generate
from marljax.sampling.engine.kv_pages import copy_pages, init_pages
from marljax.sampling.engine.paged_attention import gather_dense, refresh_dense, write_pages

CFG = ModelConfig(vocab_size=256, hidden_size=64, intermediate_size=128, num_layers=2, num_heads=4,
                  num_kv_heads=4, head_dim=16, rope_theta=10_000.0)
LORA = LoRAConfig(rank=8, alpha=16)
STEP = StepConfig(route=(("generator", "a"), ("aggregator", "b")),
                  lora_scale=LORA.scale, minibatch="balanced")
MESHES = {"fsdp2_tensor4": MeshConfig(fsdp=2, tensor=4), "data2_fsdp4": MeshConfig(data=2, fsdp=4)}
PROMPTS = [[5, 6, 7], list(range(10, 45)), [9], [3, 1, 4, 1, 5, 9, 2, 6], [200, 201], [7] * 20]
TOKENS = np.random.default_rng(0).integers(0, CFG.vocab_size, (8, 24)).astype(np.int32)
LR = 1e-3


def optimizer():
    """`make_optimizer` with Adam eps 1e-6: its first step divides by |g| + eps, and with the default
    1e-8 a gradient entry at the float32 noise floor (|g| ~ 1e-9) becomes an O(lr) update whose size
    is rounding noise; a larger eps keeps such entries linear in g, so params compare at 1e-5."""
    return optax.chain(optax.clip_by_global_norm(1.0),
                       optax.inject_hyperparams(optax.adamw)(learning_rate=0.0, eps=1e-6, weight_decay=0.01))


def _host(tree):
    return jax.tree.map(np.asarray, tree)


def reference_state():
    """Host copies of the model state and the LoRA sets, built once (jitted: eager init is slow)."""
    model = Decoder(CFG, rngs=nnx.Rngs(0))
    model.final_norm[...] = model.final_norm[...] * 20.0  # clear greedy margins (logit std ≈ 3)

    def lora():  # non-zero B, so gradients w.r.t. A are non-zero too
        return {s: jax.tree.map(lambda x: x + 0.02 * jax.random.normal(jax.random.key(10 + i), x.shape),
                                init_lora(CFG, LORA, jax.random.key(i)))
                for i, s in enumerate(STEP.sets)}
    return nnx.graphdef(model), _host(nnx.state(model)), _host(jax.jit(lora)())


GRAPHDEF, MODEL_STATE, LORA_SETS = reference_state()


def samples() -> list[Sample]:
    rng = np.random.default_rng(1)
    out = []
    for role, n in (("generator", 8), ("aggregator", 4)):
        for _ in range(n):
            out.append(Sample(role, list(rng.integers(1, 256, rng.integers(3, 12))),
                              list(rng.integers(1, 256, rng.integers(1, 9))), float(rng.normal())))
    return out


def run(mesh_cfg: MeshConfig | None) -> dict:
    """Everything on one device (`None`) or on a mesh; returns host copies and placement facts."""
    model = nnx.merge(GRAPHDEF, jax.tree.map(jnp.asarray, MODEL_STATE))
    opt, params, ema = optimizer(), jax.tree.map(jnp.asarray, LORA_SETS), {}
    facts: dict = {}
    if mesh_cfg is None:
        opt_states = {s: opt.init(p) for s, p in params.items()}
        trainer, ctx = Trainer(model, STEP, opt), contextlib.nullcontext()
    else:
        mesh = sharding.make_mesh(mesh_cfg)
        rules = sharding.get_rules(mesh_cfg, mesh)
        sharding.shard_model(model, mesh, rules)
        p_sh = {s: sharding.trainable_shardings(p, model, mesh, rules) for s, p in params.items()}
        o_sh = {s: sharding.optimizer_shardings(opt, params[s], p_sh[s], mesh) for s in params}
        params = jax.device_put(params, p_sh)
        opt_states = jax.jit(lambda p: {s: opt.init(x) for s, x in p.items()}, out_shardings=o_sh)(params)
        rep = sharding.replicated(mesh)
        trainer = Trainer(model, STEP, opt, out_shardings=(TrainState(p_sh, o_sh, {}, rep), rep))
        ctx = sharding.use_mesh(mesh, rules)
        wq = model.layers["wq"].get_value()
        facts = {"wq_spec": str(wq.sharding.spec), "wq_shard_shape": list(wq.addressable_shards[0].data.shape),
                 "embed_spec": str(model.embed.get_value().sharding.spec),
                 "lora_wq_b_spec": str(params["a"]["wq"]["b"].sharding.spec),
                 "mu_wq_a_spec": str(optax.tree_utils.tree_get(opt_states["a"], "mu")["wq"]["a"].sharding.spec)}
    forward = jax.jit(lambda state, t: nnx.merge(GRAPHDEF, state)(t))
    with ctx:
        logits = forward(nnx.state(model), jnp.asarray(TOKENS))
        greedy = generate(model, PROMPTS, SamplingParams(max_new_tokens=12, temperature=0.0))
        state, m = train_batch(trainer, TrainState(params, opt_states, ema, jnp.zeros((), jnp.int32)), samples(), LR)
    new, m = state.params, m.record()
    if mesh_cfg is not None:
        facts["params_keep_sharding"] = all(
            x.sharding == sh for x, sh in zip(jax.tree.leaves(new), jax.tree.leaves(p_sh)))
        facts["updated_wq_a_spec"] = str(new["a"]["wq"]["a"].sharding.spec)
        facts["logits_devices"] = len(logits.sharding.device_set)
    return {"logits": np.asarray(logits), "greedy": greedy.tokens, "metrics": m,
            "params": jax.tree.map(np.asarray, new), "facts": facts,
            "state": state}


def rel(a, b) -> float:
    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    return float(np.linalg.norm(a - b) / max(np.linalg.norm(b), 1e-30))


def tree_rel(a, b) -> float:
    la, lb = jax.tree.leaves(a), jax.tree.leaves(b)
    num = np.sqrt(sum(np.sum((np.asarray(x, np.float64) - np.asarray(y, np.float64)) ** 2) for x, y in zip(la, lb)))
    den = np.sqrt(sum(np.sum(np.asarray(y, np.float64) ** 2) for y in lb))
    return float(num / den)


def engine_pages(mesh_cfg: MeshConfig) -> dict:
    """The rollout engine's page pools and the chunk path's dense copy of 64 rows on 8 rank pools: rows
    per device, and whether any page gather, write, copy or refresh compiles to a collective."""
    mesh = sharding.make_mesh(mesh_cfg)
    rules = sharding.get_rules(mesh_cfg, mesh)
    table = np.arange(64 * 4, dtype=np.int32).reshape(64, 4) % 15 + 1
    pos = np.tile(np.arange(3, dtype=np.int32), (64, 1))
    rows, fresh = np.zeros(16, np.int32), table[:16]
    with sharding.use_mesh(mesh, rules):
        pages = init_pages(CFG, 16, 4, ranks=8)
        dense = gather_dense(pages, table)
        new = jnp.ones((64, 3, 2 * CFG.num_kv_heads, CFG.head_dim))
        programs = {"gather_dense": gather_dense.lower(pages, table),
                    "write_pages": jax.jit(write_pages).lower(pages[0]["kv"], new, table, pos),
                    "copy_pages": copy_pages.lower(pages, rows[:8], rows[:8] + 1),
                    "refresh_dense": refresh_dense.lower(dense, pages, rows, fresh)}
        collectives = {name: any(c in p.compile().as_text() for c in ("all-gather", "all-reduce", "all-to-all"))
                       for name, p in programs.items()}
    return {"pool_rows_per_device": pages[0]["kv"].addressable_shards[0].data.shape[0],
            "dense_rows_per_device": dense[0]["k"].addressable_shards[0].data.shape[0],
            "collectives": collectives}


def main(ckpt_dir: str) -> None:
    assert jax.device_count() == 8, f"needs 8 devices, got {jax.device_count()} (set XLA_FLAGS)"
    ref = run(None)
    out: dict = {"meshes": {}}
    runs = {}
    for name, mc in MESHES.items():
        r = runs[name] = run(mc)
        keys = [k for k in ref["metrics"] if k.endswith("/loss") or k.endswith("/grad_norm")]
        out["meshes"][name] = {
            "logits_rel": rel(r["logits"], ref["logits"]),
            "greedy_equal": r["greedy"] == ref["greedy"],
            "metric_rel": {k: rel(r["metrics"][k], ref["metrics"][k]) for k in keys},
            "params_rel": tree_rel(r["params"], ref["params"]),
            "params_changed": tree_rel(ref["params"], LORA_SETS),
            "facts": r["facts"]}
    # Orbax: write under the first mesh, restore onto the second mesh's shardings.
    a, b = runs["fsdp2_tensor4"]["state"], runs["data2_fsdp4"]["state"]
    ck = Checkpointer(ckpt_dir, every=1, keep=1)
    ck.save(1, a, {"step": 1})
    target = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=x.sharding), b)
    step, restored, meta = ck.restore(target)
    ck.close()
    same_sharding = all(x.sharding == y.sharding for x, y in zip(jax.tree.leaves(restored), jax.tree.leaves(b)))
    out["checkpoint"] = {"step": step, "meta": meta, "values_rel": tree_rel(restored, a),
                         "restored_on_target_sharding": same_sharding,
                         "written_wq_b_spec": str(a.params["a"]["wq"]["b"].sharding.spec),
                         "restored_wq_b_spec": str(restored.params["a"]["wq"]["b"].sharding.spec)}
    out["engine"] = engine_pages(MESHES["data2_fsdp4"])
    print("RESULT " + json.dumps(out))


if __name__ == "__main__":
    main(sys.argv[1])
