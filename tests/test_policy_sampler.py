"""`PolicySampler`: per-set weights (LoRA folded, or a whole model state) against `sampling.generate` called
directly on the same weights; the page-pool cap; streams of requests from several sets."""
import dataclasses

import jax
import numpy as np
from flax import nnx

from marljax.core import sharding
from marljax.core.sharding import MeshConfig
from marljax.models.loading import load_model
from marljax.models.lora import LoRAConfig, init_lora
from marljax.models.presets import get_preset
from marljax.sampling import SamplingParams, generate, layer_weights
from marljax.sampling.policy_sampler import PolicySampler, SamplerSettings

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


def test_max_cache_tokens_caps_the_page_pool():
    """`max_cache_tokens` is the engine's page pool: 200 positions = 12 usable pages of 16 (besides the
    null page), so requests wait for pages; the samples are those of an uncapped call (per-request
    streams)."""
    model = load_model("tiny-qwen3", seed=0)
    settings = SamplerSettings(max_new_tokens=6, top_p=1.0, top_k=0, stop_token_ids=(), max_cache_tokens=200)
    capped = _sampler(model, {"a": _adapter(1)}, LORA.scale, settings)
    free = _sampler(model, {"a": _adapter(1)}, LORA.scale)
    got, want = capped.sample("a", PROMPTS * 2, 11, 0.7), free.sample("a", PROMPTS * 2, 11, 0.7)
    small, big = capped.engine("a").stats, free.engine("a").stats
    assert small.pool_bytes < big.pool_bytes and small.peak_pages <= 12 < big.peak_pages
    assert capped.engine("a").num_pages == 13
    assert got.tokens == want.tokens
    np.testing.assert_allclose(np.concatenate(got.logprobs), np.concatenate(want.logprobs), atol=1e-6)


def test_paged_attention_setting_reaches_the_engine():
    """`sampling.paged_attention` is the engine's path: a gather per decode step here (auto: chunk on CPU),
    with the samples of the default path."""
    model = load_model("tiny-qwen3", seed=0)
    gather = _sampler(model, {"a": _adapter(1)}, LORA.scale, dataclasses.replace(SETTINGS, paged_attention="gather"))
    auto = _sampler(model, {"a": _adapter(1)}, LORA.scale)
    got, want = gather.sample("a", PROMPTS, 11, 0.7), auto.sample("a", PROMPTS, 11, 0.7)
    assert gather.engine("a").attention == "gather" and auto.engine("a").attention == "auto"
    assert got.tokens == want.tokens and gather.engine("a").stats.peak_dense_bytes == 0


def test_admission_setting_reaches_the_engine():
    """`sampling.admission=optimistic` is the engine's admission: a pool of 200 positions that its worst
    case would fill with few requests, the same samples as worst-case admission on a free pool."""
    model = load_model("tiny-qwen3", seed=0)
    tight = dataclasses.replace(SETTINGS, max_new_tokens=6, max_cache_tokens=200, admission="optimistic")
    opt = _sampler(model, {"a": _adapter(1)}, LORA.scale, tight)
    free = _sampler(model, {"a": _adapter(1)}, LORA.scale, dataclasses.replace(SETTINGS, max_new_tokens=6))
    got, want = opt.sample("a", PROMPTS * 2, 11, 0.7), free.sample("a", PROMPTS * 2, 11, 0.7)
    assert opt.engine("a").admission == "optimistic" and free.engine("a").admission == "worst_case"
    assert got.tokens == want.tokens
    np.testing.assert_allclose(np.concatenate(got.logprobs), np.concatenate(want.logprobs), atol=1e-6)


def test_stream_serves_sets_as_requests_come():
    """Requests of two sets submitted interleaved, some after others finished: each request's output
    depends on its set, prompt and seed only (the same in another order, alone, or with other traffic);
    greedy, it equals the batch call's."""
    model = load_model("tiny-qwen3", seed=0)
    sampler = _sampler(model, {"a": _adapter(1), "b": _adapter(3)}, LORA.scale)
    reqs = [("a" if i % 3 else "b", p, 100 + i) for i, p in enumerate(PROMPTS * 2)]

    def run(order, temperature=0.7, late=()):
        stream, out = sampler.stream(temperature), {}
        tickets = {stream.submit(*reqs[i]): i for i in order if i not in late}
        while len(out) < len(order):
            for t, res in stream.poll():
                out[tickets[t]] = res
            for i in late:  # submitted once the first results are back
                tickets[stream.submit(*reqs[i])] = i
            late = ()
        return out

    def same(a, b):  # tokens and stops exactly; logprobs to float32 noise (another batch shape)
        assert sorted(a) == sorted(b)
        for i in a:
            assert a[i][0] == b[i][0] and a[i][2] == b[i][2]
            np.testing.assert_allclose(a[i][1], b[i][1], atol=1e-5)

    base = run(range(len(reqs)))
    same(run(list(reversed(range(len(reqs)))), late=(0, 4)), base)
    same(run([3]), {3: base[3]})
    assert base[1][0] != base[2][0] or base[1] != base[2]
    greedy = run(range(len(reqs)), temperature=0.0)
    for name in ("a", "b"):
        idx = [i for i, r in enumerate(reqs) if r[0] == name]
        batch = sampler.sample(name, [reqs[i][1] for i in idx], 0, 0.0)
        assert [greedy[i][0] for i in idx] == batch.tokens


def test_mixed_sets_stream_matches_per_set_streams():
    """`mix_sets`: both sets' rows in one engine batch (per-row adapters) give the per-set streams'
    greedy tokens, logprobs within 1e-4 (merged weights vs the adapter applied per row)."""
    model = load_model("tiny-qwen3", seed=0)
    params = {"a": _adapter(1), "b": _adapter(3)}
    mixed = _sampler(model, params, LORA.scale, dataclasses.replace(SETTINGS, mix_sets=True))
    apart = _sampler(model, params, LORA.scale)
    reqs = [("a" if i % 2 else "b", p, 7 + i) for i, p in enumerate(PROMPTS)]
    outs = []
    for sampler in (mixed, apart):
        stream, got = sampler.stream(0.0), {}
        tickets = {stream.submit(*r): i for i, r in enumerate(reqs)}
        while len(got) < len(reqs):
            got.update({tickets[t]: res for t, res in stream.poll()})
        outs.append(got)
    assert len(mixed.engines) == 1 and len(outs[0]) == len(reqs)
    for i in range(len(reqs)):
        assert outs[0][i][0] == outs[1][i][0]
        np.testing.assert_allclose(outs[0][i][1], outs[1][i][1], atol=1e-4)


def test_chunk_steps_reach_the_engine_and_keep_the_samples():
    """`sampling.chunk_steps` is the engine's decode chunk: 2 steps take more chunks than the default for
    the same samples (per-request streams; logprobs within 1e-5: a chunk attends its own new keys as a
    second segment, so the chunk length moves the float32 summation order)."""
    model = load_model("tiny-qwen3", seed=0)
    short = _sampler(model, {"a": _adapter(1)}, LORA.scale, dataclasses.replace(SETTINGS, chunk_steps=2))
    default = _sampler(model, {"a": _adapter(1)}, LORA.scale)
    a, b = short.sample("a", PROMPTS, 11, 0.7), default.sample("a", PROMPTS, 11, 0.7)
    assert a.tokens == b.tokens and a.finished == b.finished
    np.testing.assert_allclose(np.concatenate(a.logprobs), np.concatenate(b.logprobs), rtol=0, atol=1e-5)
    assert short.engine("a").chunk_steps == 2 and default.engine("a").chunk_steps == SETTINGS.chunk_steps > 2
    assert short.engine("a").stats.decode_chunks > default.engine("a").stats.decode_chunks
