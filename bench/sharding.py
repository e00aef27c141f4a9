"""Sharded vs single-device step time on simulated CPU devices: the same random model, LoRA train step
(`Trainer.update`, two roles) and greedy sampler call on one device (in a 1-device process, and in the
8-device process) and under three 8-device meshes. The point is that the mesh runs the code path a
TPU/GPU mesh runs, not speed: the simulated devices share the same cores. Writes the
"## Sharding (CPU, simulated devices)" section of docs/benchmarks.md.

    python bench/sharding.py [--repeats 5] [--no-write] [--smoke]
"""
from __future__ import annotations

import os
import re
import sys

# The device count is fixed when jax starts: 8, or 1 for the baseline run in a child process.
BASELINE = "--baseline" in sys.argv
os.environ["XLA_FLAGS"] = (re.sub(r"--xla_force_host_platform_device_count=\d+", "", os.environ.get("XLA_FLAGS", ""))
                           + f" --xla_force_host_platform_device_count={1 if BASELINE else 8}").strip()

import argparse  # noqa: E402
import contextlib  # noqa: E402
import dataclasses  # noqa: E402
import datetime  # noqa: E402
import json  # noqa: E402
import statistics  # noqa: E402
import subprocess  # noqa: E402
import time  # noqa: E402

from marljax.core import host_memory  # noqa: E402

host_memory.retain()  # before jax: keeps freed host memory (marljax/core/host_memory.py)
import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
from flax import nnx  # noqa: E402

from marljax.build import Policy, build_trainer, build_workflow, init_state  # noqa: E402
from marljax.config import load_config, resolve  # noqa: E402
from marljax.core import sharding  # noqa: E402
from marljax.core.sharding import MeshConfig  # noqa: E402
from marljax.models.decoder import Decoder, ModelConfig  # noqa: E402
from marljax.rl.step import Sample, pack  # noqa: E402
from marljax.sampling import SamplingParams, generate  # noqa: E402
from benchdoc import machine, publish  # noqa: E402 — bench/ is on sys.path when a script here runs

TITLE = "## Sharding (CPU, simulated devices)"
CFG = ModelConfig(vocab_size=4096, hidden_size=256, intermediate_size=768, num_layers=4, num_heads=8,
                  num_kv_heads=4, head_dim=32, rope_theta=10_000.0)
# the paper's config with these: two roles, each its own LoRA set (rank 16), AdamW
CONFIG = resolve(load_config(None, ["workflow=voting", "policy=isolated", "rl.minibatch=balanced", "lora.rank=16"]))
MESHES = {"1 of 8 devices (no mesh)": None, "fsdp=8": MeshConfig(fsdp=8),
          "fsdp=2, tensor=4": MeshConfig(fsdp=2, tensor=4), "data=2, fsdp=4": MeshConfig(data=2, fsdp=4)}
SAMPLE_PROMPTS, SAMPLE_NEW = 16, 32


def batches() -> dict:
    rng = np.random.default_rng(0)
    out = {}
    for role, n in (("generator", 32), ("aggregator", 16)):
        out[role] = pack([Sample(role, list(rng.integers(1, CFG.vocab_size, 64)),
                                 list(rng.integers(1, CFG.vocab_size, 64)), float(rng.normal())) for _ in range(n)])
    return out


def measure(mesh_cfg: MeshConfig | None, repeats: int) -> dict:
    """Step and sampler times on `mesh_cfg`'s mesh (None: on the first device, outside any mesh), the
    model, trainer and state built and placed as `train` builds them (`marljax.build`) for `CONFIG`."""
    axes = mesh_cfg or CONFIG.mesh  # None: the config's mesh over the first device alone
    mesh = sharding.make_mesh(axes, devices=None if mesh_cfg else jax.devices()[:1])
    rules = sharding.get_rules(axes, mesh)
    model = sharding.shard_model(Decoder(CFG, rngs=nnx.Rngs(0)), mesh, rules)
    policy = Policy(mesh, rules, model, None, CONFIG.lora.build())
    workflow, policy_map = build_workflow(CONFIG)
    params = policy.init_params(CONFIG, policy_map.sets)
    trainer, shardings = build_trainer(CONFIG, policy, workflow, policy_map, params)
    state = init_state(trainer, params, shardings)
    ctx = sharding.use_mesh(mesh, rules) if mesh_cfg else contextlib.nullcontext()
    data, lr = batches(), jnp.float32(1e-4)
    prompts = [list(range(3 + i, 40 + i)) for i in range(SAMPLE_PROMPTS)]
    sp = SamplingParams(max_new_tokens=SAMPLE_NEW, temperature=0.0)
    with ctx:
        t = time.perf_counter()
        state, m = trainer.update(state, data, lr, recompute_old=False)
        jax.block_until_ready(m)
        compile_train = time.perf_counter() - t
        train = []
        for _ in range(repeats):
            t = time.perf_counter()
            state, m = trainer.update(state, data, lr, recompute_old=False)
            jax.block_until_ready(m)
            train.append(time.perf_counter() - t)
        t = time.perf_counter()
        generate(model, prompts, sp)
        compile_sample = time.perf_counter() - t
        sample = []
        for _ in range(repeats):
            t = time.perf_counter()
            generate(model, prompts, sp)
            sample.append(time.perf_counter() - t)
    return {"train": statistics.median(train), "sample": statistics.median(sample),
            "compile_train": compile_train, "compile_sample": compile_sample}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--no-write", action="store_true")
    ap.add_argument("--baseline", action="store_true", help="(internal) the 1-device run; prints JSON")
    ap.add_argument("--smoke", action="store_true", help="the model's 1 layer, one mesh (fsdp=2, tensor=4)")
    args = ap.parse_args()
    if args.smoke:
        global CFG  # what measure() builds
        CFG = dataclasses.replace(CFG, num_layers=1)
    if args.baseline:
        print(json.dumps(measure(None, args.repeats)))
        return
    assert jax.device_count() == 8, f"expected 8 simulated devices, got {jax.device_count()}"
    child = subprocess.run([sys.executable, __file__, "--baseline", "--repeats", str(args.repeats),
                            *["--smoke"] * args.smoke],
                           capture_output=True, text=True, check=True)
    results = {"1 device (1-device process)": json.loads(child.stdout.splitlines()[-1])}
    meshes = {"fsdp=2, tensor=4": MESHES["fsdp=2, tensor=4"]} if args.smoke else MESHES
    results.update({name: measure(mc, args.repeats) for name, mc in meshes.items()})
    base = results["1 device (1-device process)"]
    tokens = 32 * 128 + 16 * 128
    rows = "\n".join(
        f"| {name} | {r['train'] * 1e3:.0f} ms | {base['train'] / r['train']:.2f}× | "
        f"{SAMPLE_PROMPTS * SAMPLE_NEW / r['sample']:.0f} tok/s | {base['sample'] / r['sample']:.2f}× | "
        f"{r['compile_train']:.1f} s / {r['compile_sample']:.1f} s |" for name, r in results.items())
    section = (
        f"{TITLE}\n\n`python bench/sharding.py` on {datetime.date.today()}, {machine()}, 8 devices from "
        f"`--xla_force_host_platform_device_count=8`, load average {os.getloadavg()[0]:.1f} at the end (other "
        f"jobs share the machine); median of {args.repeats} runs after one compiling call. Model: "
        f"{CFG.num_layers} layers, hidden {CFG.hidden_size}, {CFG.num_heads} heads / {CFG.num_kv_heads} KV heads, "
        f"vocab {CFG.vocab_size}, float32. Train: one `Trainer.update` with LoRA rank {CONFIG.lora.rank} on two "
        f"parameter sets ({tokens} padded tokens); sampler: {SAMPLE_PROMPTS} prompts × {SAMPLE_NEW} greedy "
        f"tokens. Speed is relative to the 1-device process (above 1 = faster). The simulated devices share "
        f"the machine's cores and every collective is a memory copy, so these ratios say little about "
        f"accelerators (and other jobs on the machine move them by ±30%); what matters is that the meshes run "
        f"the same SPMD program a TPU or GPU mesh runs, with equal results (tests/test_sharding.py).\n\n"
        f"| run | train step | speed | sampler decode | speed | compile (train / sampler) |\n"
        f"|---|---|---|---|---|---|\n{rows}\n")
    publish(section, not args.no_write)


if __name__ == "__main__":
    main()
