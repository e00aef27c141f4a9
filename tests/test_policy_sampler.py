"""`PolicySampler`: per-set weights (LoRA folded, or a whole model state) and chunked sampler calls, against
`sampling.generate` called directly on the same weights."""
import jax
import numpy as np
from flax import nnx

from marljax import sharding
from marljax.models.loading import load_model
from marljax.models.presets import get_preset
from marljax.policy_sampler import PolicySampler, SamplerSettings
from marljax.models.lora import LoRAConfig, init_lora
from marljax.sampling import SamplingParams, generate, layer_weights
from marljax.sharding import MeshConfig

LORA = LoRAConfig(rank=4, alpha=8)
PROMPTS = [[5, 6, 7], list(range(10, 41)), [9], [3, 1, 4, 1, 5, 9, 2, 6], [100, 2000, 30000, 7, 8]]
SETTINGS = SamplerSettings(max_new_tokens=6, top_p=1.0, top_k=0, stop_token_ids=(), max_cache_tokens=0)


def _adapter(seed):
    ad = init_lora(get_preset("tiny-qwen3"), LORA, jax.random.key(seed))
    return jax.tree.map(lambda x: x + 0.05 * jax.random.normal(jax.random.key(seed + 1), x.shape), ad)  # B ≠ 0


def _sampler(model, params, lora_scale, settings=SETTINGS):
    mesh = sharding.make_mesh(MeshConfig())
    return PolicySampler(model, params, lora_scale, mesh, sharding.get_rules(MeshConfig(), mesh), settings)


def test_each_set_samples_from_its_own_weights():
    model = load_model("tiny-qwen3", seed=0)
    params = {"a": _adapter(1), "b": _adapter(3)}
    sampler = _sampler(model, params, LORA.scale)
    sp = SamplingParams(max_new_tokens=6, temperature=0.7, seed=11)
    for name in ("a", "b"):
        want = generate(model, PROMPTS, sp, layers=layer_weights(model, params[name], LORA.scale))
        assert sampler.sample(name, PROMPTS, 11, 0.7) == want
    assert sampler.sample("a", PROMPTS, 11, 0.7).tokens != sampler.sample("b", PROMPTS, 11, 0.7).tokens

    graphdef, _ = nnx.split(model)  # full fine-tuning: a set is the whole model's parameters
    full = jax.tree.map(lambda x: x + 0.02 * jax.random.normal(jax.random.key(4), x.shape),
                        nnx.state(model, nnx.Param))
    tuned = nnx.merge(graphdef, full)
    got = _sampler(model, {"s": full}, None).sample("s", PROMPTS, 11, 0.7)
    assert got.tokens == generate(tuned, PROMPTS, sp, layers=layer_weights(tuned)).tokens


def test_chunks_cap_batch_times_length_in_power_of_two_rows():
    model = load_model("tiny-qwen3", seed=0)
    settings = SamplerSettings(max_new_tokens=6, top_p=1.0, top_k=0, stop_token_ids=(), max_cache_tokens=200)
    sampler = _sampler(model, {"a": _adapter(1)}, LORA.scale, settings)
    # longest prompt 31 → bucket 32, + 6 new = 38 columns; 200 // 38 = 5 rows → 4, a power of two
    assert [len(c) for c in sampler.chunks(PROMPTS * 2)] == [4, 4, 2]
    assert [p for c in sampler.chunks(PROMPTS * 2) for p in c] == PROMPTS * 2
    assert _sampler(model, {}, LORA.scale).chunks(PROMPTS) == [PROMPTS]  # 0: one call
    # chunk 0 keeps the call's seed: the first 4 samples equal one unchunked call on those prompts
    got = sampler.sample("a", PROMPTS, 11, 0.7)
    want = generate(model, PROMPTS[:4], SamplingParams(max_new_tokens=6, temperature=0.7, seed=11),
                    layers=layer_weights(model, _adapter(1), LORA.scale))
    assert len(got.tokens) == len(PROMPTS) and got.tokens[:4] == want.tokens
    np.testing.assert_array_equal(np.concatenate(got.logprobs[:4]), np.concatenate(want.logprobs))
