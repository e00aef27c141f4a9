"""Sampler: logprobs match a teacher-forced pass, batching does not change a prompt's output, stops,
determinism, top-k / top-p support; and greedy text equals transformers' on the real SmolLM2."""
import os

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from marljax.models.decoder import Decoder, ModelConfig
from marljax.models.lora import LoRAConfig, init_lora, merged_model
from marljax.sampling import SamplingParams, choose, first_argmax, generate, layer_weights, model_layers
from marljax.sampling.engine.draw import blocked_categorical
from marljax.sampling.engine.engine import NUM_SLOTS

CFG = ModelConfig(vocab_size=97, hidden_size=64, intermediate_size=128, num_layers=2, num_heads=4,
                  num_kv_heads=2, head_dim=16, rope_theta=10_000.0, tie_embeddings=False)


@pytest.fixture(scope="module")
def model():
    m = Decoder(CFG, rngs=nnx.Rngs(0))
    # sharpen the random model so greedy choices have clear margins (logit std ≈ 3 instead of ≈ 0.2)
    m.lm_head[...] = m.lm_head[...] * 15.0
    return m


PROMPTS = [[5, 6, 7], list(range(10, 45)), [9], [3, 1, 4, 1, 5, 9, 2, 6]]


def _teacher_forced_logprobs(model, prompt, generated, temperature=1.0):
    logits = np.asarray(model(jnp.asarray([prompt + generated]))[0], np.float64) / temperature
    logp = logits - np.log(np.exp(logits - logits.max(-1, keepdims=True)).sum(-1, keepdims=True)) \
        - logits.max(-1, keepdims=True)
    return np.array([logp[len(prompt) - 1 + i, t] for i, t in enumerate(generated)])


@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_logprobs_equal_teacher_forced_pass(model, temperature):
    """Logprobs are those of the tempered distribution the tokens were drawn from (float64 reference)."""
    out = generate(model, PROMPTS, SamplingParams(max_new_tokens=12, temperature=temperature, seed=1))
    for p, toks, lps in zip(PROMPTS, out.tokens, out.logprobs):
        assert len(toks) == len(lps) == 12
        np.testing.assert_allclose(lps, _teacher_forced_logprobs(model, p, toks, temperature), atol=1e-4)


def test_greedy_output_independent_of_batch(model):
    sp = SamplingParams(max_new_tokens=16, temperature=0.0)
    batched = generate(model, PROMPTS, sp)
    for i, p in enumerate(PROMPTS):
        alone = generate(model, [p], sp)
        assert alone.tokens[0] == batched.tokens[i]
        np.testing.assert_allclose(alone.logprobs[0], batched.logprobs[i], atol=1e-5)


def test_stop_tokens_end_a_sequence(model):
    free = generate(model, PROMPTS, SamplingParams(max_new_tokens=10, temperature=0.0))
    stop = free.tokens[1][4]
    out = generate(model, PROMPTS, SamplingParams(max_new_tokens=10, temperature=0.0, stop_token_ids=(stop,)))
    for full, got, fin in zip(free.tokens, out.tokens, out.finished):
        if stop in full:
            k = full.index(stop)
            assert got == full[: k + 1] and fin
        else:
            assert got == full and not fin
    assert out.finished[1] and out.tokens[1][-1] == stop


def test_first_argmax_equals_argmax_with_ties():
    x = jax.random.normal(jax.random.key(0), (6, 50))
    x = x.at[1, 7].set(9.0).at[1, 30].set(9.0).at[2].set(0.0).at[3, -1].set(9.0)  # ties, flat, last
    np.testing.assert_array_equal(first_argmax(x), jnp.argmax(x, axis=-1))
    assert first_argmax(x)[1] == 7 and first_argmax(x)[2] == 0 and first_argmax(x)[3] == 49


def test_layer_weights_fold_a_lora_adapter_exactly(model):
    """Sampling from `layer_weights(model, adapter)` is sampling from the merged model: the per-layer
    weights equal `merged_model`'s bitwise, and so do the tokens and logprobs (adapters on the last
    layer only, the other layer passes through unchanged)."""
    lc = LoRAConfig(rank=4, alpha=8.0, layers=1)
    adapter = init_lora(CFG, lc, jax.random.key(3))
    adapter = jax.tree.map(lambda a: a + 0.05 * jax.random.normal(jax.random.key(4), a.shape), adapter)
    merged = merged_model(model, adapter, lc.scale)
    layers = layer_weights(model, adapter, lc.scale)
    for i, (got, want) in enumerate(zip(layers, merged.layer_list())):
        for name in want:
            np.testing.assert_array_equal(got[name], want[name], err_msg=f"layer {i} {name}")
    assert not np.array_equal(layers[1]["wq"], model.layers["wq"][...][1])  # the adapter did something
    sp = SamplingParams(max_new_tokens=8, temperature=1.0, seed=2)
    a, b = generate(model, PROMPTS, sp, layers=layers), generate(merged, PROMPTS, sp)
    assert a.tokens == b.tokens
    np.testing.assert_array_equal(np.asarray(a.logprobs), np.asarray(b.logprobs))
    plain = generate(model, PROMPTS, sp, layers=layer_weights(model))
    assert plain.tokens == generate(model, PROMPTS, sp).tokens


def test_default_call_samples_as_the_tuned_call(model):
    """`generate(model, prompts, params)` (its layers made once per model, slots from the request) gives
    the tokens of the tuned call (layers passed, `NUM_SLOTS` slots); logprobs within 1e-5."""
    sp = SamplingParams(max_new_tokens=12, temperature=0.7, seed=3)
    plain = generate(model, PROMPTS, sp)
    tuned = generate(model, PROMPTS, sp, layers=layer_weights(model), num_slots=NUM_SLOTS)
    assert plain.tokens == tuned.tokens
    for a, b in zip(plain.logprobs, tuned.logprobs):
        np.testing.assert_allclose(a, b, atol=1e-5)


def test_model_layers_are_reused_until_a_parameter_changes():
    """An unchanged model reuses its per-layer weights; a new parameter value makes them (and the
    samples) anew."""
    m = Decoder(CFG, rngs=nnx.Rngs(1))
    m.lm_head[...] = m.lm_head[...] * 15.0
    first = model_layers(m)
    assert model_layers(m) is first
    sp = SamplingParams(max_new_tokens=10, temperature=0.0)
    before = generate(m, PROMPTS, sp)
    m.layers["w_down"][...] = 40.0 * jax.random.normal(jax.random.key(5), m.layers["w_down"].shape)
    assert model_layers(m) is not first
    after = generate(m, PROMPTS, sp)
    assert after.tokens != before.tokens
    assert after.tokens == generate(m, PROMPTS, sp, layers=layer_weights(m)).tokens


def test_sampling_is_deterministic_per_seed(model):
    sp = SamplingParams(max_new_tokens=10, temperature=1.0, top_p=0.9, top_k=20, seed=7)
    a, b = generate(model, PROMPTS, sp), generate(model, PROMPTS, sp)
    assert a.tokens == b.tokens
    c = generate(model, PROMPTS, SamplingParams(max_new_tokens=10, temperature=1.0, top_p=0.9, top_k=20, seed=8))
    assert a.tokens != c.tokens


def test_top_k_and_top_p_restrict_the_support():
    logits = jnp.log(jnp.asarray([[0.5, 0.3, 0.15, 0.05]] * 4000, jnp.float32))
    keys = jax.random.key(0)
    k2 = np.asarray(choose(logits, keys, 1.0, 1.0, 2))
    assert set(k2) == {0, 1}
    p = np.asarray(choose(logits, keys, 1.0, 0.7, 0))  # 0.5 < 0.7 → needs token 1 too; stops there
    assert set(p) == {0, 1}
    assert abs(np.mean(p == 0) - 0.5 / 0.8) < 0.03
    assert set(np.asarray(choose(logits, keys, 0.0, 1.0, 0))) == {0}


def test_blocked_categorical_draws_the_softmax():
    """Two-stage Gumbel-max over blocks of 4 (10 entries: the last block padded) draws each entry at its
    softmax probability: 60,000 draws, every frequency within 4.5 s.e.; a zero-probability entry never."""
    p = np.asarray([0.02, 0.08, 0.30, 0.10, 0.05, 0.15, 0.0, 0.12, 0.03, 0.15])
    n = 60_000
    logits = jnp.broadcast_to(jnp.log(jnp.asarray(p, jnp.float32)), (n, p.size))
    tok = np.asarray(blocked_categorical(jax.random.key(3), logits, block=4))
    freq = np.bincount(tok, minlength=p.size) / n
    assert freq[6] == 0 and tok.max() < p.size
    np.testing.assert_array_less(np.abs(freq - p), 4.5 * np.sqrt(p * (1 - p) / n) + 1e-12)


def test_bad_sampling_params_are_rejected():
    with pytest.raises(ValueError, match="top_p"):
        SamplingParams(top_p=0.0)
    with pytest.raises(ValueError, match="temperature"):
        SamplingParams(temperature=-1)


@pytest.mark.parametrize("question", ["What is 12 + 35?", "Name three colors.",
                                      "Write a haiku about rain.", "What is the capital of France?"])
def test_smollm2_greedy_text_equals_transformers(question, smollm2_gguf):
    """48 greedy tokens from our sampler and from HF `generate` on the same GGUF give identical text."""
    gguf = smollm2_gguf
    torch = pytest.importorskip("torch", reason="torch==2.13.0 is the parity reference (requirements-test.txt)")
    os.environ["HF_HUB_OFFLINE"] = "1"
    from transformers import AutoModelForCausalLM

    from marljax.models import ChatCodec, load_model, load_tokenizer
    global _HF, _OURS, _CODEC
    if "_HF" not in globals():
        _HF = AutoModelForCausalLM.from_pretrained(str(gguf.parent), gguf_file=gguf.name, dtype=torch.float32)
        _OURS = load_model("smollm2-135m-instruct")
        _CODEC = ChatCodec(load_tokenizer("smollm2-135m-instruct"))
    prompt = _CODEC.render([{"role": "user", "content": question}])
    ours = generate(_OURS, [prompt], SamplingParams(max_new_tokens=48, temperature=0.0,
                                                    stop_token_ids=_CODEC.stop_token_ids)).tokens[0]
    with torch.no_grad():
        ref = _HF.generate(torch.tensor([prompt]), attention_mask=torch.ones(1, len(prompt), dtype=torch.long),
                           max_new_tokens=48, do_sample=False, eos_token_id=list(_CODEC.stop_token_ids),
                           pad_token_id=_CODEC.stop_token_ids[0])[0, len(prompt):].tolist()
    assert _CODEC.decode(ours) == _CODEC.decode(ref)
    assert ours == ref
