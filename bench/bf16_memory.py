"""Compiled memory of one train step (XLA CPU `memory_analysis`, nothing allocated), float32 vs bfloat16
compute: the trainer's jitted update as `train` builds it (`marljax.build`) on SmolLM2-135M shapes (LoRA rank 64
on all linear maps, one role),
`rows` × `length` tokens, half of them response, with each remat policy. bfloat16 stores the frozen base
in bfloat16 (param_dtype = dtype); the adapters and AdamW state stay float32 in both.

    python bench/bf16_memory.py [--rows 2] [--length 256] [--remat full dots] [--write] [--smoke]
"""
from __future__ import annotations

import argparse
import dataclasses

from benchdoc import machine, publish, smoke_config  # first (before jax); bench/ is on sys.path when a script here runs
import jax
import jax.numpy as jnp

from marljax.build import abstract_policy, build_trainer, build_workflow, fresh_params
from marljax.config import load_config, resolve
from marljax.models.presets import PRESETS
from marljax.rl.step import RoleBatch

MIB = 2 ** 20


def step_memory(config, rows: int, length: int, remat: str, rank: int = 64):
    """`memory_analysis()` of the trainer's update as `train` builds it (`marljax.build`: a single-agent
    run, LoRA on all linear maps) over a model of `config`, compiled for abstract inputs."""
    cfg = resolve(load_config(None, ["workflow=single", f"rl.remat={remat}", f"lora.rank={rank}",
                                     f"lora.alpha={2 * rank}"]))
    policy = abstract_policy(cfg, config)
    workflow, policy_map = build_workflow(cfg)
    params = jax.eval_shape(lambda model: fresh_params(model, policy.lora_cfg, 0, policy_map.sets), policy.model)
    trainer, _ = build_trainer(cfg, policy, workflow, policy_map, params)
    state = jax.eval_shape(trainer.init_state, params)
    s, R = jax.ShapeDtypeStruct, length // 2
    f32 = jnp.float32
    batch = {workflow.roles[0]: RoleBatch(s((rows, length), jnp.int32), s((rows,), jnp.int32), s((rows, R), f32),
                                          s((rows,), f32), s((rows, R), f32), s((rows, R), f32), s((rows,), f32))}
    return trainer.lower_update(state, batch, s((), f32), recompute_old=False).compile().memory_analysis()


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--rows", type=int, default=2)
    ap.add_argument("--length", type=int, default=256)
    ap.add_argument("--remat", nargs="+", default=["full", "dots"])
    ap.add_argument("--write", action="store_true", help="put the table into docs/benchmarks.md")
    ap.add_argument("--smoke", action="store_true", help="a tiny model (benchdoc.smoke_config): seconds")
    a = ap.parse_args()
    base = PRESETS["smollm2-135m-instruct"]
    if a.smoke:
        base = smoke_config(base)
    lines = ["## bf16 step memory (compiled, XLA CPU)", "",
             f"`python bench/bf16_memory.py --rows {a.rows} --length {a.length}` on {machine(malloc=False)}: "
             f"the trainer's update on SmolLM2-135M shapes, LoRA rank 64 on all linear maps, {a.length}-token "
             f"rows ({a.length // 2} response), compiled for abstract inputs (nothing allocated); "
             "`memory_analysis()` in MiB at "
             f"{a.rows} rows, and the temp that {a.rows} more rows add (the activations: constants cancel).", "",
             "| remat | dtype | arguments | temp | temp per extra row | per row bf16 / f32 |",
             "|---|---|---:|---:|---:|---:|"]
    for remat in a.remat:
        per_row = {}
        for dtype in ("float32", "bfloat16"):
            config = dataclasses.replace(base, dtype=dtype)
            m, m2 = (step_memory(config, r, a.length, remat) for r in (a.rows, 2 * a.rows))
            per_row[dtype] = (m2.temp_size_in_bytes - m.temp_size_in_bytes) / a.rows
            ratio = f"{per_row['bfloat16'] / per_row['float32']:.2f}" if dtype == "bfloat16" else ""
            lines.append(f"| {remat} | {dtype} | {m.argument_size_in_bytes / MIB:.0f} | "
                         f"{m.temp_size_in_bytes / MIB:.0f} | {per_row[dtype] / MIB:.1f} | {ratio} |")
    publish("\n".join(lines) + "\n", a.write)


if __name__ == "__main__":
    main()
