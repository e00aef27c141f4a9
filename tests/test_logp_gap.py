"""`role/<r>/logp_gap`: the sampler's logprobs of the sampled tokens against the trainer's, at the same
parameters and temperature, on tiny-qwen3 in float32 (LoRA folded into the sampler's weights, and full
weights); response tokens only; a known perturbation reads back."""
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from marljax.models.loading import load_model
from marljax.models.lora import LoRAConfig, init_lora
from marljax.models.presets import get_preset
from marljax.rl.step import Sample, StepConfig, Trainer, make_optimizer, pack, train_batch
from marljax.rl.step_metrics import average
from marljax.sampling import SamplingParams, generate, layer_weights

LORA = LoRAConfig(rank=4, alpha=8, layers=1)
T = 0.7  # sampling temperature = the trainer's logprob_temperature
BOUND = 1e-4  # observed max 1.9e-6, mean ≤ 3.2e-7 (float32; the two paths sum in different orders)
PROMPTS = [[5, 6, 7], list(range(10, 41)), [9], [3, 1, 4, 1, 5, 9, 2, 6], [100, 2000, 30000, 7, 8]]


@pytest.fixture(scope="module")
def model():
    return load_model("tiny-qwen3", seed=0)


def _adapter():
    ad = init_lora(get_preset("tiny-qwen3"), LORA, jax.random.key(1))
    return jax.tree.map(lambda x: x + 0.05 * jax.random.normal(jax.random.key(2), x.shape), ad)  # B ≠ 0


def _rollout(sampler_model, layers, seed=3):
    out = generate(sampler_model, PROMPTS, SamplingParams(max_new_tokens=9, temperature=T, seed=seed),
                   layers=layers)
    rng = np.random.default_rng(seed)
    return [Sample("generator" if i % 2 else "aggregator", p, t, float(rng.normal()), sampler_logprobs=lp)
            for i, (p, t, lp) in enumerate(zip(PROMPTS, out.tokens, out.logprobs))]


def _cfg(lora_scale, **kw):
    return StepConfig(route=(("generator", "s"), ("aggregator", "s")), lora_scale=lora_scale,
                      logprob_temperature=T, **kw)


def _step(trainer, params, samples, lr=1e-2):
    params = jax.tree.map(jnp.array, params)  # train_batch donates its inputs
    return train_batch(trainer, trainer.init_state({"s": params}), samples, lr)[1].record()


@pytest.mark.parametrize("minibatch", ["balanced", "paper"])
def test_gap_is_zero_at_equal_parameters_lora(model, minibatch):
    """LoRA folded into the sampler's weights vs added unmerged by the trainer: gap ≤ 1e-4. The samples'
    prompts differ in length, so a gap read at prompt positions (or off by one) would be ~1. `paper` with
    M = 2 takes 3 optimizer steps: the gap is read at the rollout's parameters, not the updated ones."""
    ad = _adapter()
    samples = _rollout(model, layer_weights(model, ad, LORA.scale))
    m = _step(Trainer(model, _cfg(LORA.scale, minibatch=minibatch, minibatch_size=2), make_optimizer()),
              ad, samples)
    if minibatch == "paper":
        assert m["set/s/opt_steps"] == 3
    for role in ("generator", "aggregator"):
        assert 0.0 <= m[f"role/{role}/logp_gap"] <= m[f"role/{role}/logp_gap_max"] < BOUND


def test_gap_is_zero_at_equal_parameters_full_weights(model):
    graphdef, state = nnx.split(model)
    params = jax.tree.map(lambda x: x + 0.02 * jax.random.normal(jax.random.key(4), x.shape),
                          nnx.state(model, nnx.Param))
    tuned = nnx.merge(graphdef, params)
    samples = _rollout(tuned, layer_weights(tuned))
    m = _step(Trainer(model, _cfg(None, minibatch="balanced"), make_optimizer()), params, samples)
    for role in ("generator", "aggregator"):
        assert m[f"role/{role}/logp_gap_max"] < BOUND


def test_gap_reads_back_a_known_perturbation_on_response_tokens_only(model):
    """Sampler logprobs = the trainer's own + a known offset on chosen tokens: mean and max read back
    (≤ 1e-5). Garbage beyond each response (padding columns), on padding rows, and on a row that
    carries no sampler logprobs changes nothing."""
    ad = _adapter()
    cfg = _cfg(LORA.scale, minibatch="balanced")
    trainer = Trainer(model, cfg, make_optimizer())
    samples = [s for s in _rollout(model, layer_weights(model, ad, LORA.scale), seed=5) if s.role == "generator"]
    own = np.asarray(trainer.logprobs({"s": ad}, {"generator": pack(samples)})["generator"])
    offsets = [np.zeros(len(s.response)) for s in samples]
    offsets[0][0], offsets[1][-1], offsets[1][2] = 0.25, -0.5, 0.125
    perturbed = [Sample(s.role, s.prompt, s.response, s.advantage,
                        sampler_logprobs=list(own[i, : len(s.response)] + offsets[i]))
                 for i, s in enumerate(samples)]
    n_tokens = sum(len(s.response) for s in samples)
    expected_mean = sum(np.abs(o).sum() for o in offsets) / n_tokens

    batch = pack(perturbed + [Sample("generator", [1, 2], [3, 4, 5], 1.0)])  # last row: no sampler logprobs
    outside = 1.0 - batch.resp_mask_br  # prompt/padding columns, and all of the padding rows
    garbage = batch._replace(sampler_logp_br=batch.sampler_logp_br + 1e3 * outside)
    state = trainer.init_state({"s": jax.tree.map(jnp.array, ad)})
    m = average([jax.device_get(trainer.update(state, {"generator": garbage}, jnp.float32(0.0),
                                               recompute_old=False)[1])], cfg.sets).record()
    assert float(garbage.has_sampler_b[len(samples)]) == 0.0 and garbage.resp_mask_br.shape[0] > len(samples) + 1
    assert m["role/generator/logp_gap"] == pytest.approx(expected_mean, abs=1e-5)
    assert m["role/generator/logp_gap_max"] == pytest.approx(0.5, abs=1e-5)


def test_pack_rejects_misaligned_sampler_logprobs():
    with pytest.raises(ValueError, match="sampler logprobs"):
        pack([Sample("generator", [1, 2], [3, 4], 1.0, sampler_logprobs=[-1.0])])
