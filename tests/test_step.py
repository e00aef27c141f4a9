"""The jitted RL step: same-role amplification and its mitigation, mini-batching (paper, balanced, mixed by
a seeded shuffle), damping, guards, remat. Diagnostics against independent gradients: test_step_diagnostics.py."""
import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx

from marljax.models.decoder import Decoder, ModelConfig
from marljax.models.lora import LoRAConfig, init_lora
from marljax.rl.step import Sample, StepConfig, Trainer, make_optimizer, minibatches, pack, train_batch

CFG = ModelConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_layers=2, num_heads=4,
                  num_kv_heads=2, head_dim=8)
LORA = LoRAConfig(rank=4, alpha=8)
LR = 1e-3


def _model():
    return Decoder(CFG, rngs=nnx.Rngs(0))


def _adapter(seed):
    ad = init_lora(CFG, LORA, jax.random.key(seed))
    # non-zero B so gradients w.r.t. A are non-zero too
    return jax.tree.map(lambda x: x + 0.02 * jax.random.normal(jax.random.key(seed + 7), x.shape), ad)


def _samples(role, n, seed):
    rng = np.random.default_rng(seed)
    return [Sample(role, list(rng.integers(1, 64, rng.integers(3, 9))), list(rng.integers(1, 64, rng.integers(1, 7))),
                   float(rng.normal())) for _ in range(n)]


def _rel(a, b):
    num = optax.tree.norm(jax.tree.map(jnp.subtract, a, b))
    return float(num / optax.tree.norm(b))


def _delta(new, old):
    return float(optax.tree.norm(jax.tree.map(jnp.subtract, new, old)))


def _voting_update(n_voters, same_role_scale, episodes=4):
    """Isolated Voting-like batch: n identical-prompt voters (same samples, same advantages) + aggregator.
    Plain SGD: the update is lr × the gradient, so a wrong factor on it shows (Adam's first step would
    normalise it away). Returns the generator set's step delta and the step's record."""
    model = _model()
    opt = optax.chain(optax.identity(), optax.inject_hyperparams(optax.sgd)(learning_rate=0.0))
    base = _samples("generator", episodes, 11)
    voters = [s for _ in range(n_voters) for s in base]
    agg = _samples("aggregator", episodes, 12)
    cfg = StepConfig(route=(("generator", "gen"), ("aggregator", "agg")), lora_scale=LORA.scale,
                     minibatch="paper", minibatch_size=episodes,
                     role_scale=(("generator", 1.0 / n_voters),) if same_role_scale else ())
    tr = Trainer(model, cfg, opt)
    params = {"gen": _adapter(1), "agg": _adapter(2)}
    before = jax.tree.map(jnp.array, params)
    state, m = train_batch(tr, tr.init_state(params), voters + agg, LR)
    new, m = state.params, m.record()
    delta = _delta(new["gen"], before["gen"])
    assert m["set/gen/step_delta"] == pytest.approx(delta, rel=1e-5)
    assert m["set/agg/step_delta"] == pytest.approx(_delta(new["agg"], before["agg"]), rel=1e-5)
    # the aggregator set steps once: its mean update norm is that step's, not diluted by the voters' mini-batches
    assert m["set/agg/update_norm"] == pytest.approx(m["set/agg/step_delta"], rel=1e-5)
    assert m["set/agg/opt_steps"] == 1
    return delta, m


def test_same_role_amplification_and_same_role_scale():
    """Paper mini-batching: N voters → N optimizer steps and a growing update. same_role_scale weighs the
    voters' loss 1/N on their own (Isolated) set too — G = g_r / N, the SGD update 1/N as long — and keeps
    the N steps (it used to cancel in the per-set normalisation and cut the steps to one instead)."""
    results = {n: _voting_update(n, False) for n in (1, 2, 4)}
    assert [results[n][1]["set/gen/opt_steps"] for n in (1, 2, 4)] == [1, 2, 4]
    norms = [results[n][0] for n in (1, 2, 4)]
    assert norms[1] > 1.5 * norms[0] and norms[2] > 1.5 * norms[1], norms
    for n in (2, 4):
        delta, m = _voting_update(n, True)
        assert m["set/gen/opt_steps"] == n
        assert m["role/generator/weight"] == pytest.approx(1 / n, rel=1e-6)
        assert m["set/gen/grad_norm"] == pytest.approx(m["role/generator/grad_norm"] / n, rel=1e-5)
        # the same N steps 1/N as long; the two runs' later gradients differ by the unscaled run's larger
        # earlier steps (lr 1e-3): 1.2e-3 relative at N = 2, 5.7e-3 at N = 4, so 2e-2
        assert delta == pytest.approx(results[n][0] / n, rel=2e-2)
        assert m["role/aggregator/weight"] == pytest.approx(1.0, rel=1e-6)  # a role without parallel agents


def test_inverse_norm_gives_equal_mass_and_damping_reduces_coherent_role():
    model, opt = _model(), make_optimizer()
    samples = _samples("generator", 6, 4) + _samples("aggregator", 2, 5)
    route = (("generator", "s"), ("aggregator", "s"))
    tr = Trainer(model, StepConfig(route=route, lora_scale=LORA.scale, minibatch="balanced",
                                   role_weighting="inverse_norm"), opt)
    ad = _adapter(3)
    m = train_batch(tr, tr.init_state({"s": ad}), samples, LR)[1].record()
    assert m["role/generator/grad_mass"] == pytest.approx(m["role/aggregator/grad_mass"], rel=1e-5)

    tr = Trainer(model, StepConfig(route=route, lora_scale=LORA.scale, minibatch="balanced", damping_lambda=0.3),
                 opt)
    ad = _adapter(3)
    state = tr.init_state({"s": ad})  # the EMA of both roles starts at 0
    state, m1 = train_batch(tr, state, samples, LR)
    m1 = m1.record()
    assert m1["role/generator/damping"] == pytest.approx(1.0)  # EMA starts at 0: no coherence yet
    m2 = train_batch(tr, state, samples, LR)[1].record()  # same batch again: cos(g, EMA) ≈ 1
    assert 0.7 <= m2["role/generator/damping"] < 0.75


def test_nonfinite_advantage_skips_the_update():
    model, opt = _model(), make_optimizer()
    samples = _samples("generator", 4, 6)
    samples[0].advantage = float("nan")
    tr = Trainer(model, StepConfig(route=(("generator", "g"),), lora_scale=LORA.scale, minibatch="balanced"), opt)
    ad = _adapter(4)
    before = jax.tree.map(jnp.array, ad)
    state, m = train_batch(tr, tr.init_state({"g": ad}), samples, LR)
    assert m.record()["set/g/nonfinite"] == 1.0
    assert _delta(state.params["g"], before) == 0.0


def test_minibatches_paper_vs_balanced():
    samples = _samples("generator", 12, 7) + _samples("aggregator", 4, 8)
    route = (("generator", "g"), ("aggregator", "a"))
    paper = minibatches(samples, StepConfig(route=route, minibatch="paper", minibatch_size=4))
    assert len(paper) == 3
    assert [len(mb.get("generator", [])) for mb in paper] == [4, 4, 4]
    assert [len(mb.get("aggregator", [])) for mb in paper] == [4, 0, 0]
    balanced = minibatches(samples, StepConfig(route=route, minibatch="balanced", minibatch_size=4))
    assert len(balanced) == 1 and len(balanced[0]["generator"]) == 12
    shuffled = minibatches(samples, StepConfig(route=route, minibatch="paper", minibatch_size=4), seed=3)
    assert [{r: len(v) for r, v in mb.items()} for mb in shuffled] == [
        {"generator": 4, "aggregator": 4}, {"generator": 4}, {"generator": 4}]  # isolated sets: same cut


def _tagged(role, n):
    """Cheap host-side samples; the prompt carries a unique tag."""
    offset = {"generator": 0, "aggregator": 10_000}[role]
    return [Sample(role, [offset + i], [1], 0.0) for i in range(n)]


def _tags(mbs):
    return [sorted(s.prompt[0] for v in mb.values() for s in v) for mb in mbs]


def test_paper_minibatches_mix_the_roles_of_a_shared_set():
    """The paper's Voting counts (64 problems × 8 rollouts, 3 voters): 1536 generator + 512 aggregator
    samples on one set, M = 512 → 4 mini-batches, each about a quarter aggregator; a permutation fixed by
    (run seed, step) only, so a resumed run cuts the same mini-batches."""
    from marljax.train import minibatch_seed
    samples = _tagged("generator", 1536) + _tagged("aggregator", 512)
    cfg = StepConfig(route=(("generator", "s"), ("aggregator", "s")), minibatch="paper", minibatch_size=512)
    mbs = minibatches(samples, cfg, seed=minibatch_seed(0, 1))
    assert len(mbs) == 4
    for mb in mbs:
        assert len(mb["generator"]) + len(mb["aggregator"]) == 512
        assert abs(len(mb["aggregator"]) / 512 - 0.25) <= 0.1, len(mb["aggregator"])
        assert len(mb["aggregator"]) == 128  # dealt evenly: one packed shape for all four
    assert sorted(t for tags in _tags(mbs) for t in tags) == sorted(s.prompt[0] for s in samples)  # each once
    assert _tags(minibatches(samples, cfg, seed=minibatch_seed(0, 1))) == _tags(mbs)
    assert _tags(minibatches(samples, cfg, seed=minibatch_seed(0, 2))) != _tags(mbs)
    assert _tags(minibatches(samples, cfg, seed=minibatch_seed(1, 1))) != _tags(mbs)
    # no seed: rollout order, as before (generator-only mini-batches, then the aggregator's)
    assert [sorted(mb) for mb in minibatches(samples, cfg)] == [["generator"]] * 3 + [["aggregator"]]


def test_same_role_scale_keeps_the_minibatches():
    """same_role_scale changes loss weights only: 1536 voter + 512 aggregator samples on one set, M = 512,
    cut into the same 4 mini-batches with it as without."""
    samples = _tagged("generator", 1536) + _tagged("aggregator", 512)
    cfg = StepConfig(route=(("generator", "s"), ("aggregator", "s")), minibatch="paper", minibatch_size=512)
    scaled = dataclasses.replace(cfg, role_scale=(("generator", 1 / 3),))
    assert len(minibatches(samples, scaled, seed=7)) == 4
    assert _tags(minibatches(samples, scaled, seed=7)) == _tags(minibatches(samples, cfg, seed=7))


@pytest.mark.parametrize("lora", [True, False], ids=["lora", "full"])
def test_remat_policies_give_the_same_gradient(lora):
    """`rl.remat` only trades memory for recompute: full, dots and none give one gradient (≤ 1e-6 rel)
    for LoRA and for full fine-tuning, and an unknown policy is refused by name."""
    model = _model()
    batch = pack(_samples("generator", 4, 3))
    grads = {}
    for remat in ("full", "dots", "none"):
        cfg = StepConfig(route=(("generator", "s"),), lora_scale=LORA.scale if lora else None, remat=remat)
        tr = Trainer(model, cfg, make_optimizer())
        params = _adapter(2) if lora else jax.tree.map(jnp.array, tr.base_state)
        grads[remat] = jax.jit(jax.grad(lambda t: tr.role_loss(t, batch, "generator", False)[0]))(params)
    assert optax.tree.norm(grads["none"]) > 0
    for remat in ("full", "dots"):
        assert _rel(grads[remat], grads["none"]) <= 1e-6, remat
    with pytest.raises(ValueError, match="rl.remat='some'.*dots"):
        StepConfig(route=(("generator", "s"),), remat="some")


def test_sgd_optimizer_is_plain_clipped_sgd():
    """`make_optimizer("sgd")`: the update is −lr × the gradient clipped to global norm 1 (hand-derived),
    with no momentum or weight decay: the second step's update is the first's again, and a parameter with no
    gradient does not move (AdamW's weight decay would move w[1])."""
    from marljax.rl.state import with_learning_rate
    params = {"w": jnp.ones((3,)), "b": jnp.zeros((2,))}
    g = {"w": jnp.array([2.0, 0.0, 0.0]), "b": jnp.array([0.0, 0.0])}  # norm 2: clipped to 1
    opt = make_optimizer("sgd", grad_clip=1.0)
    state = with_learning_rate(opt.init(params), 0.5)
    u1, state = opt.update(g, state, params)
    u2, _ = opt.update(g, state, params)
    for u in (u1, u2):
        np.testing.assert_allclose(u["w"], [-0.5, 0.0, 0.0], rtol=1e-7)
        np.testing.assert_allclose(u["b"], [0.0, 0.0])
    with pytest.raises(ValueError, match=r"unknown optimizer 'adam'; expected one of \('adamw', 'sgd'\)"):
        make_optimizer("adam")
