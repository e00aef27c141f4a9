"""Every GPU check in one go, on Qwen3-0.6B-shaped random weights in bfloat16 (no checkpoint needed):
  1. sampler decode tok/s at several batch sizes (greedy, no early stop), against the HBM roofline: a
     decode step reads every weight once plus the whole KV cache buffer (our attention reads all of its
     columns), so roofline tok/s = batch × HBM bandwidth / (weight bytes + cache bytes);
  2. train-step MFU of `Trainer.update` with the paper's LoRA (rank 64, all linear layers) and with full
     fine-tuning. Model FLOPs (`marljax/models/flops.py train_flops`, counted before anything runs): real tokens
     only (not the padding), causal attention (i + 1 keys for position i), the output head only on
     response tokens; layer matmuls ×2 for LoRA (forward, backward to the activations, no base weight
     gradient) + 6·N_lora, ×3 for full fine-tuning; attention ×3.
Writes the "## GPU (Qwen3-0.6B shape, bf16)" section of docs/benchmarks.md.

    python bench/gpu.py [--peak-tflops 989 --hbm-gbs 3350] [--no-write]
    python bench/gpu.py --tiny --no-write        # a seconds-long smoke run of the same code on any device

Peak figures are looked up from the device name (H100, H200, A100, L4) unless given.
"""
from __future__ import annotations

import argparse
import dataclasses
import datetime
import platform
import statistics
import time

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from marljax.build import Policy, build_trainer, build_workflow, init_state
from marljax.config import load_config, resolve
from marljax.core import sharding
from marljax.core.shapes import bucket
from marljax.models.decoder import Decoder
from marljax.models.lora import init_lora
from marljax.models.presets import PRESETS
from marljax.rl.step import Sample, pack
from marljax.sampling import SamplingParams, generate
from benchdoc import publish  # bench/ is on sys.path when a script here runs
from marljax.models.flops import train_flops

TITLE = "## GPU (Qwen3-0.6B shape, bf16)"
# device name fragment -> (dense bf16 TFLOP/s, HBM GB/s)
PEAKS = {"H200": (989, 4800), "H100": (989, 3350), "A100": (312, 2039), "L4": (121, 300)}
SETTINGS = ["workflow=single", "rl.minibatch=balanced"]  # on the paper's config: one set, AdamW
LORA = load_config(None, SETTINGS).lora.build()  # the paper's adapter: rank 64, all linear layers


@dataclasses.dataclass(frozen=True)
class Plan:
    batches: tuple[int, ...]
    prompt: int
    new: int
    train_rows: int
    train_prompt: int
    train_response: int


FULL = Plan(batches=(1, 16, 128), prompt=128, new=256, train_rows=8, train_prompt=128, train_response=384)
TINY = Plan(batches=(1, 4), prompt=16, new=16, train_rows=2, train_prompt=16, train_response=16)


def timed(fn, repeats: int) -> float:
    fn()  # compile
    fn()  # a state whose dtypes settle after one step (bf16 Adam hyperparameters) compiles once more
    times = []
    for _ in range(repeats):
        t = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t)
    return statistics.median(times)


def decode(model, cfg, plan: Plan, hbm_gbs: float | None, repeats: int, lora=None, scale=1.0) -> list[dict]:
    rows = []
    weight_bytes = cfg.num_params() * jnp.dtype(cfg.dtype).itemsize
    if lora is not None:
        weight_bytes += sum(x.nbytes for x in jax.tree.leaves(lora))
    for b in plan.batches:
        prompts = [list(range(1 + i, 1 + i + plan.prompt)) for i in range(b)]
        run = lambda n: jax.block_until_ready(generate(  # noqa: E731
            model, prompts, SamplingParams(max_new_tokens=n, temperature=0.0), lora=lora, lora_scale=scale).tokens)
        full, first = timed(lambda: run(plan.new), repeats), timed(lambda: run(1), repeats)
        tok_s = b * (plan.new - 1) / (full - first) if full > first else None
        cache_len = bucket(plan.prompt, 16) + plan.new
        cache_bytes = 2 * cfg.num_layers * bucket(b) * cache_len * cfg.num_kv_heads * cfg.head_dim * 2
        roof = b * hbm_gbs * 1e9 / (weight_bytes + cache_bytes) if hbm_gbs else None
        rows.append({"batch": b, "tok_s": tok_s, "roofline_tok_s": roof, "prefill_s": first})
    return rows


def train_step_flops(cfg, plan: Plan, lora: bool) -> tuple[int, int]:
    """(model FLOPs, real tokens) of one step on the plan's rows (`marljax/models/flops.py`)."""
    rows = plan.train_rows
    flops = train_flops(cfg, [plan.train_prompt] * rows, [plan.train_response] * rows,
                        lora_rank=LORA.rank if lora else None)
    return flops, rows * (plan.train_prompt + plan.train_response)


def train_mfu(model, cfg, plan: Plan, peak_tflops: float | None, repeats: int, lora: bool,
              count: tuple[int, int]) -> dict:
    """Time `Trainer.update` as `train` builds it (`marljax.build`, the paper's config with `SETTINGS`);
    `count`: its (model FLOPs, real tokens) from `train_step_flops`."""
    flops, tokens = count
    rng = np.random.default_rng(0)
    samples = [Sample("generator", list(rng.integers(1, cfg.vocab_size, plan.train_prompt)),
                      list(rng.integers(1, cfg.vocab_size, plan.train_response)), float(rng.normal()))
               for _ in range(plan.train_rows)]
    batch = {"generator": pack(samples)}
    run = resolve(load_config(None, [*SETTINGS, f"lora.enabled={lora}"]))
    mesh = sharding.make_mesh(run.mesh)
    policy = Policy(mesh, sharding.get_rules(run.mesh, mesh), model, None, run.lora.build())
    workflow, policy_map = build_workflow(run)
    # full fine-tuning trains bfloat16 copies of the weights (`train`: float32 master copies, `fresh_params`)
    params = {s: init_lora(cfg, policy.lora_cfg, jax.random.key(0), jnp.float32) if lora
              else jax.tree.map(jnp.array, nnx.state(model, nnx.Param)) for s in policy_map.sets}
    trainer, shardings = build_trainer(run, policy, workflow, policy_map, params)
    state = {"train": init_state(trainer, params, shardings)}

    def one():
        state["train"], m = trainer.update(state["train"], batch, jnp.float32(1e-5), recompute_old=False)
        jax.block_until_ready(m)

    seconds = timed(one, repeats)
    return {"mode": "LoRA r64" if lora else "full", "tokens": tokens, "seconds": seconds,
            "tflops": flops / seconds / 1e12,
            "mfu": flops / seconds / (peak_tflops * 1e12) if peak_tflops else None}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--peak-tflops", type=float, help="dense bf16 TFLOP/s per device (default: by name)")
    ap.add_argument("--hbm-gbs", type=float, help="HBM GB/s per device (default: by name)")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--tiny", action="store_true", help="tiny shapes: a smoke run on any device")
    ap.add_argument("--no-write", action="store_true")
    args = ap.parse_args()
    device = jax.devices()[0]
    if device.platform != "gpu" and not args.tiny:
        ap.error(f"no GPU here ({device.platform}); use --tiny for a smoke run")
    known = next((v for k, v in PEAKS.items() if k in device.device_kind), (None, None))
    peak, hbm = args.peak_tflops or known[0], args.hbm_gbs or known[1]
    plan = TINY if args.tiny else FULL
    cfg = dataclasses.replace(PRESETS["qwen3-0.6b"], dtype="bfloat16")
    if args.tiny:
        cfg = dataclasses.replace(cfg, num_layers=2, hidden_size=64, intermediate_size=128, num_heads=4,
                                  num_kv_heads=2, head_dim=16, vocab_size=1024)
    counts = {lora: train_step_flops(cfg, plan, lora) for lora in (True, False)}  # before any device time
    for lora, (flops, tokens) in counts.items():
        print(f"train step ({'LoRA r64' if lora else 'full'}): {flops / 1e12:.4f} model TFLOP over {tokens} "
              "real tokens", flush=True)
    model = Decoder(cfg, rngs=nnx.Rngs(0))
    plain = decode(model, cfg, plan, hbm, args.repeats)
    with_lora = decode(model, cfg, dataclasses.replace(plan, batches=plan.batches[-1:]), hbm, args.repeats,
                       lora=init_lora(cfg, LORA, jax.random.key(1)), scale=LORA.scale)
    train = [train_mfu(model, cfg, plan, peak, args.repeats, lora, counts[lora]) for lora in (True, False)]

    fmt = lambda x, spec: "n/a" if x is None else format(x, spec)  # noqa: E731
    dec_rows = "\n".join(
        f"| {r['batch']}{' + LoRA r64' if lab else ''} | {fmt(r['tok_s'], '.0f')} | "
        f"{fmt(r['roofline_tok_s'], '.0f')} | "
        f"{fmt(r['roofline_tok_s'] and r['tok_s'] and r['tok_s'] / r['roofline_tok_s'], '.0%')} | "
        f"{r['prefill_s'] * 1e3:.0f} ms |"
        for lab, rows in ((False, plain), (True, with_lora)) for r in rows)
    train_rows = "\n".join(
        f"| {t['mode']} | {t['tokens']} | {t['seconds'] * 1e3:.0f} ms | {t['tflops']:.1f} | {fmt(t['mfu'], '.0%')} |"
        for t in train)
    section = (
        f"{TITLE}\n\n`python bench/gpu.py{' --tiny' if args.tiny else ''}` on {datetime.date.today()}, "
        f"{device.device_kind}, jax {jax.__version__}, Python {platform.python_version()}; peak "
        f"{fmt(peak, 'g')} TFLOP/s bf16, HBM {fmt(hbm, 'g')} GB/s. Random weights, "
        f"{cfg.num_layers} layers, hidden {cfg.hidden_size}, vocab {cfg.vocab_size}, bfloat16.\n\n"
        f"Decode ({plan.prompt}-token prompts, {plan.new} greedy tokens, prefill timed separately):\n\n"
        f"| batch | tok/s | HBM roofline tok/s | of roofline | prefill |\n|---|---|---|---|---|\n{dec_rows}\n\n"
        f"Train step (`Trainer.update`, {plan.train_rows} rows of {plan.train_prompt} + "
        f"{plan.train_response} tokens; model FLOPs of the real tokens, causal attention, head on the response "
        "tokens, as `marljax/models/flops.py` counts them):\n\n"
        f"| mode | tokens | step | model TFLOP/s | MFU |\n|---|---|---|---|---|\n{train_rows}\n")
    publish(section, not args.no_write)


if __name__ == "__main__":
    main()
