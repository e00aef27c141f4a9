"""Token-budget micro-batches (`rl.micro_batch_tokens`): the accumulated update equals the single call's.

Plain SGD, so the applied update is −lr × G and every diagnostic is compared on the gradient itself (Adam
would normalise small gradient differences into large relative ones). Tolerance: 1e-5 relative (1e-7
absolute near 0), what float32 summation in another order allows; metrics that are differences of two
log-probs (`ppo_kl`, `approx_kl`, `kl_ref`, `logp_gap`) 1e-6 absolute, since a micro-batch's forward pads to
another shape and each log-prob (|log p| up to ~5) moves by a few float32 ulps."""
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from marljax.core.shapes import bucket_rows
from marljax.rl.step import Sample, StepConfig, Trainer, micro_batches, packed_tokens, train_batch
from test_step import LORA, _adapter, _model

ROUTES = {"shared": (("generator", "s"), ("aggregator", "s")),
          "isolated": (("generator", "g"), ("aggregator", "a"))}


def _samples():
    """Varied lengths (3–40 prompt, 1–24 response tokens), sampler log-probs on some rows."""
    rng = np.random.default_rng(0)
    out = []
    for role, n in (("generator", 14), ("aggregator", 5)):
        for i in range(n):
            resp = list(rng.integers(1, 64, rng.integers(1, 25)))
            out.append(Sample(role, list(rng.integers(1, 64, rng.integers(3, 41))), resp, float(rng.normal()),
                              sampler_logprobs=list(-rng.random(len(resp))) if i % 2 else None))
    return out


def _run(route, budget, **kw):
    sgd = optax.chain(optax.identity(), optax.inject_hyperparams(optax.sgd)(learning_rate=0.0))
    cfg = StepConfig(route=route, lora_scale=LORA.scale, micro_batch_tokens=budget, **kw)
    tr = Trainer(_model(), cfg, sgd)
    sets = dict.fromkeys(s for _, s in route)
    state, m = train_batch(tr, tr.init_state({s: _adapter(i) for i, s in enumerate(sets)}), _samples(), 0.1, seed=3)
    return state.params, m.record()


BALANCED = dict(minibatch="balanced")
PAPER = dict(minibatch="paper", minibatch_size=8, kl_beta=(("aggregator", 0.1),), damping_lambda=0.3,
             role_weighting="inverse_norm")


# The default suite checks each policy and each mode once (shared × balanced, isolated × paper); the other
# two pairs are `-m slow` (together ~100 s of the suite's wall on 2 cores).
@pytest.mark.parametrize("policy, mode", [
    pytest.param("shared", BALANCED, id="shared-balanced"), pytest.param("isolated", PAPER, id="isolated-paper"),
    pytest.param("shared", PAPER, id="shared-paper", marks=pytest.mark.slow),
    pytest.param("isolated", BALANCED, id="isolated-balanced", marks=pytest.mark.slow)])
def test_micro_batched_update_equals_the_single_call(policy, mode):
    params0, rec0 = _run(ROUTES[policy], 0, **mode)
    for budget in (64, 400):
        params, rec = _run(ROUTES[policy], budget, **mode)
        assert rec.keys() == rec0.keys()
        for k, v in rec0.items():
            logp_diff = k.rsplit("/", 1)[-1] in ("ppo_kl", "approx_kl", "kl_ref", "logp_gap", "logp_gap_max")
            assert rec[k] == pytest.approx(v, rel=1e-5, abs=1e-6 if logp_diff else 1e-7), (budget, k)
        for a, b in zip(jax.tree.leaves(params), jax.tree.leaves(params0)):
            np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-7)
    # the budget really cut: 64 tokens hold at most a 2-row or 1-row batch of these lengths
    gen = [s for s in _samples() if s.role == "generator"]
    assert len(micro_batches(gen, 64)) >= 7


def test_micro_batches_respect_the_budget_and_keep_every_sample_once():
    samples = _samples()
    for budget in (1, 64, 160, 10_000):
        mbs = micro_batches(samples, budget)
        assert sorted(id(s) for mb in mbs for s in mb) == sorted(id(s) for s in samples)
        assert all(packed_tokens(mb) <= budget or len(mb) == 1 for mb in mbs)
    assert len(micro_batches(samples, 1)) == len(samples)  # each sample alone when none fits
    assert micro_batches(samples, 0) == [samples] and len(micro_batches(samples, 10_000)) == 1


def test_micro_batches_cap_their_rows():
    """With `max_rows`, no micro-batch packs more rows than that (a token budget alone admits as many short
    rows as fit), and every sample stays, once."""
    samples = _samples()
    assert max(bucket_rows(len(mb)) for mb in micro_batches(samples, 10_000)) > 2
    for rows in (1, 2, 4):
        mbs = micro_batches(samples, 10_000, rows)
        assert sorted(id(s) for mb in mbs for s in mb) == sorted(id(s) for s in samples)
        assert max(bucket_rows(len(mb)) for mb in mbs) <= rows
