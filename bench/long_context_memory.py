"""Compiled temp memory (XLA CPU `memory_analysis`, nothing allocated) of the two long-context pieces:
  attention  gradient of a 2-layer Qwen3-0.6B-shaped decoder's hidden states (remat full, layers under
             lax.scan) w.r.t. its weights, one row of T tokens, dense vs blockwise attention;
  log-probs  gradient of the trainer's summed response log-probs (tiny-qwen3 widths, 1 layer, Qwen3's
             151,936-token vocabulary, full fine-tuning), one row of R response tokens, chunked
             (at most LOGPROB_BYTES of float32 logits per chunk) vs one pass.

    python bench/long_context_memory.py [--lengths 2048 4096 8192] [--responses 1024 2048 5120]
"""
from __future__ import annotations

import argparse
import dataclasses

from benchdoc import machine  # first (before jax); bench/ is on sys.path when a script here runs
import jax
import jax.numpy as jnp
from flax import nnx

from marljax.build import abstract_policy, build_trainer, build_workflow, fresh_params
from marljax.config import load_config, resolve
from marljax.models import logprobs
from marljax.models.decoder import Decoder
from marljax.models.presets import PRESETS
from marljax.rl.step import RoleBatch

MIB = 2 ** 20


def abstract_state(cfg):
    return nnx.split(nnx.eval_shape(lambda: Decoder(cfg, rngs=nnx.Rngs(0))))


def attention_temp(impl: str, T: int) -> float:
    cfg = dataclasses.replace(PRESETS["qwen3-0.6b"], num_layers=2, vocab_size=1024)
    graphdef, state = abstract_state(cfg)
    grad = jax.jit(jax.grad(lambda s, t: jnp.sum(jnp.sin(
        nnx.merge(graphdef, s).hidden(t, remat="full", attention_impl=impl)[0]))))
    return grad.lower(state, jax.ShapeDtypeStruct((1, T), jnp.int32)).compile().memory_analysis().temp_size_in_bytes


def logprob_temp(R: int, budget: int | None) -> float:
    """Temp bytes of the log-probs' gradient for one row of R response tokens, chunks of `budget` bytes of
    logits (None: the trainer's LOGPROB_BYTES), in the trainer `train` builds (`marljax.build`) for a
    single-agent full fine-tuning run over shapes."""
    cfg = resolve(load_config(None, ["workflow=single", "lora.enabled=false"]))
    policy = abstract_policy(cfg, dataclasses.replace(PRESETS["tiny-qwen3"], num_layers=1))
    workflow, policy_map = build_workflow(cfg)
    params = jax.eval_shape(lambda model: fresh_params(model, policy.lora_cfg, cfg.seed, policy_map.sets), policy.model)
    trainer, _ = build_trainer(cfg, policy, workflow, policy_map, params, logprob_bytes=budget)
    s = jax.ShapeDtypeStruct
    batch = RoleBatch(s((1, R + 16), jnp.int32), s((1,), jnp.int32), s((1, R), jnp.float32), s((1,), jnp.float32),
                      s((1, R), jnp.float32), s((1, R), jnp.float32), s((1,), jnp.float32))
    grad = jax.jit(jax.grad(lambda p, b: jnp.sum(trainer.response_logprobs(p, b))))
    return grad.lower(trainer.base_state, batch).compile().memory_analysis().temp_size_in_bytes


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--lengths", type=int, nargs="+", default=[2048, 4096, 8192])
    ap.add_argument("--responses", type=int, nargs="+", default=[1024, 2048, 5120])
    a = ap.parse_args()
    print(machine(malloc=False))
    print("| T | dense MiB | blockwise MiB |\n|---|---|---|")
    for T in a.lengths:
        print(f"| {T} | {attention_temp('dense', T) / MIB:.0f} | {attention_temp('blockwise', T) / MIB:.0f} |",
              flush=True)
    print(f"\n| R | one pass MiB | chunked ({logprobs.LOGPROB_BYTES >> 20} MiB of logits) MiB |\n|---|---|---|")
    for R in a.responses:
        one_pass = R * PRESETS["tiny-qwen3"].vocab_size * 4
        print(f"| {R} | {logprob_temp(R, one_pass) / MIB:.0f} | {logprob_temp(R, None) / MIB:.0f} |", flush=True)


if __name__ == "__main__":
    main()
