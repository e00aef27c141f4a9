"""Chunked response log-probs (`models.logprobs.target_logprobs`): equal to the one-pass computation and a
float64 reference in value and gradient, and the trainer's backward no longer holds [n, R, vocab] logits."""
import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from marljax.models.decoder import Decoder
from marljax.models import logprobs
from marljax.models.logprobs import target_logprobs
from marljax.models.presets import PRESETS
from marljax.rl.step import RoleBatch, StepConfig, Trainer, make_optimizer

N, R, D, V, TEMP = 3, 10, 8, 50, 0.7


def reference(h, w, target, g):
    """Float64 log-probs of `target` under logits h @ w / TEMP, and the gradients of sum(logp · g)."""
    z = h @ w / TEMP
    z = z - z.max(-1, keepdims=True)
    p = np.exp(z) / np.exp(z).sum(-1, keepdims=True)
    logp = np.take_along_axis(np.log(p), target[..., None], -1)[..., 0]
    dz = (np.eye(V)[target] - p) * g[..., None] / TEMP  # d logp / d z, weighted
    return logp, dz @ w.T, np.einsum("nrd,nrv->dv", h, dz)


@pytest.mark.parametrize("chunk", [1, 3, 4, 10, 256])  # R = 10: chunks that divide it, do not, and one pass
def test_chunked_logprobs_match_float64(chunk):
    """Chunks of `chunk` positions (a budget of N rows × chunk × V float32 logits) against float64."""
    rng = np.random.default_rng(0)
    h, g = rng.normal(size=(N, R, D)), rng.normal(size=(N, R))
    w = rng.normal(size=(D, V))
    target = rng.integers(0, V, (N, R))
    logp_ref, dh_ref, dw_ref = reference(h, w, target, g)

    def loss(h, w):
        logp = target_logprobs(lambda x: x @ w, h, jnp.asarray(target), TEMP, budget=N * chunk * V * 4)
        return jnp.sum(logp * g), logp

    (_, logp), (dh, dw) = jax.jit(jax.value_and_grad(loss, argnums=(0, 1), has_aux=True))(
        jnp.asarray(h, jnp.float32), jnp.asarray(w, jnp.float32))
    # float32 vs float64 on log-probs up to 19 in size: observed ≤ 3e-6 (value and gradient); a misplaced
    # chunk is off by O(1)
    np.testing.assert_allclose(logp, logp_ref, rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(dh, dh_ref, rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(dw, dw_ref, rtol=1e-5, atol=1e-5)


def test_budget_must_be_positive():
    with pytest.raises(ValueError, match="at least one position"):
        target_logprobs(lambda x: x, jnp.zeros((1, 2, 3)), jnp.zeros((1, 2), jnp.int32), 1.0, 0)


def test_chunk_positions_follow_rows_and_vocabulary():
    """A chunk holds at most the budget's logits over the rows per chip (at least one position), evened out
    over the chunks a response needs."""
    qwen3 = 151936
    assert logprobs.chunk_positions(1, 5120, qwen3) == 214  # 220 fit 128 MiB; 24 chunks of 214 (not 23 + 60)
    assert logprobs.chunk_positions(40, 256, qwen3) == 5  # 40 rows: 5 positions fit (97 MiB)
    assert logprobs.chunk_positions(40, 256, qwen3, budget=40 * 6 * qwen3 * 4) == 6
    assert logprobs.chunk_positions(10_000, 256, qwen3) == 1
    assert logprobs.chunk_positions(1, 100, qwen3) == 100  # fits: one pass


def _trainer(vocab: int):
    cfg = dataclasses.replace(PRESETS["tiny-qwen3"], vocab_size=vocab, num_layers=1)
    model = Decoder(cfg, rngs=nnx.Rngs(0))
    step_cfg = StepConfig(route=(("solver", "shared"),), lora_scale=None)
    return Trainer(model, step_cfg, make_optimizer())


R_LONG = 2048


def test_trainer_logprobs_do_not_hold_full_logits():
    """Gradient of the summed response log-probs at R = 2048, Qwen3's vocabulary (151,936): compiled temp
    memory under half of one [n, R, vocab] float32 array (the one-pass version holds at least that, 1.16 GiB)."""
    n, vocab = 1, 151936
    trainer = _trainer(vocab)
    spec = jax.ShapeDtypeStruct
    batch = RoleBatch(spec((n, R_LONG + 16), jnp.int32), spec((n,), jnp.int32), spec((n, R_LONG), jnp.float32),
                      spec((n,), jnp.float32), spec((n, R_LONG), jnp.float32), spec((n, R_LONG), jnp.float32),
                      spec((n,), jnp.float32))
    grad = jax.jit(jax.grad(lambda p, b: jnp.sum(trainer.response_logprobs(p, b))))
    temp = grad.lower(trainer.base_state, batch).compile().memory_analysis().temp_size_in_bytes
    full = n * R_LONG * vocab * 4
    assert temp < full / 2, f"temp {temp / 2**20:.0f} MiB vs one [n, R, V] array {full / 2**20:.0f} MiB"


def test_trainer_logprobs_unchanged_by_chunking(monkeypatch):
    """The trainer's log-probs and their gradient at R = 600 (a budget of 256 positions: 3 chunks of 200)
    equal one pass to 1e-5."""
    n, R_, vocab = 2, 600, 512
    trainer = _trainer(vocab)
    rng = np.random.default_rng(1)
    batch = RoleBatch(jnp.asarray(rng.integers(0, vocab, (n, R_ + 8)), jnp.int32), jnp.asarray([5, 7], jnp.int32),
                      jnp.ones((n, R_), jnp.float32), jnp.ones((n,), jnp.float32), jnp.zeros((n, R_), jnp.float32),
                      jnp.zeros((n, R_), jnp.float32), jnp.zeros((n,), jnp.float32))
    g = jnp.asarray(rng.normal(size=(n, R_)), jnp.float32)

    def run():
        f = lambda p: jnp.sum(trainer.response_logprobs(p, batch) * g)
        return jax.jit(jax.value_and_grad(f))(trainer.base_state)

    monkeypatch.setattr(logprobs, "LOGPROB_BYTES", n * 256 * vocab * 4)
    value, grad = run()
    monkeypatch.setattr(logprobs, "LOGPROB_BYTES", n * R_ * vocab * 4)  # one pass
    value_ref, grad_ref = run()
    np.testing.assert_allclose(value, value_ref, rtol=1e-5)
    for a, b in zip(jax.tree.leaves(grad), jax.tree.leaves(grad_ref)):
        np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-5 * float(jnp.abs(b).max()))
