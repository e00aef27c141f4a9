"""Gradient coherence of `train_batch` (`role/<r>/agent_grad_cos`, `role/<r>/minibatch_grad_cos`) against
gradients computed another way.

The reference is test_step_diagnostics.py's: the model's full logits, `log_softmax`, response tokens
gathered by position, `losses.sequence_losses`, and a plain `jax.grad` of one group's loss on that group's
samples alone (an agent's, or a mini-batch's), with the old log-probs of the step's start (PPO) given
explicitly. Under plain SGD the reference replays the optimizer steps itself, so each mini-batch's
gradient is taken at the parameters that step started from. Cosines and their means over pairs are then
float64 NumPy. Tolerance: 1e-5 relative on cosines kept away from 0 (|cos| > 0.05, checked).
"""
import dataclasses
import functools
import itertools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from test_step_diagnostics import BASE, GRAPHDEF, LORA, MODEL, N_PAD, SAMPLES, _arrays, _flat, _params
from test_step_diagnostics import sgd_keeping_the_gradient

from marljax.rl.coherence import Coherence, add, mean_cos
from marljax.rl.losses import sequence_losses
from marljax.rl.step import StepConfig, Trainer, minibatches, train_batch

TOL = 1e-5
N_AGENTS = 3
# 2 episodes of 3 voters (agent = slot): the episode's prompt and advantage (outcome broadcast), each voter the
# episode's first response with its own last token (random responses of a tiny random model have gradients
# about orthogonal: cosines near 0 would make a relative tolerance meaningless); the aggregator is one agent
VOTERS = [dataclasses.replace(s, prompt=SAMPLES["generator"][i - i % N_AGENTS].prompt, agent=i % N_AGENTS,
                              response=SAMPLES["generator"][i - i % N_AGENTS].response + s.response[-1:],
                              advantage=(1.0, 0.6)[i // N_AGENTS]) for i, s in enumerate(SAMPLES["generator"])]
SAMPLES_ALL = VOTERS + SAMPLES["aggregator"]
SHARED, ISOLATED = (("generator", "s"), ("aggregator", "s")), (("generator", "g"), ("aggregator", "a"))


@functools.partial(jax.jit, static_argnames="lora")
def _logp(trainable, tokens, pos, target, lora: bool):
    if lora:
        logits = nnx.merge(GRAPHDEF, BASE)(tokens, lora=trainable, lora_scale=LORA.scale)
    else:
        logits = nnx.merge(GRAPHDEF, trainable)(tokens)
    return jax.nn.log_softmax(logits, axis=-1)[jnp.arange(N_PAD)[:, None], pos, target]


@functools.partial(jax.jit, static_argnames="lora")
def _grad(trainable, arrays, old_nr, lora: bool):
    """∇ of the plain loss (token mean per sequence, mean over sequences) with the given old log-probs."""
    tokens, pos, target, mask, adv = arrays

    def loss(t):
        seq_b, denom, _ = sequence_losses(_logp(t, tokens, pos, target, lora), old_nr, adv, mask)
        return jnp.sum(seq_b) / denom
    return jax.grad(loss)(trainable)


def reference_grad(trainable, samples, old_params, lora: bool):
    """The loss gradient of `samples` alone at `trainable`, old log-probs at `old_params`."""
    arrays = _arrays(samples)
    return _grad(trainable, arrays, _logp(old_params, *arrays[:3], lora), lora)


def mean_pair_cos(grads) -> float:
    flat = [_flat(g) for g in grads]
    mean = float(np.mean([a @ b / (np.linalg.norm(a) * np.linalg.norm(b)) for a, b in itertools.combinations(flat, 2)]))
    assert abs(mean) > 0.05, mean  # a relative tolerance means something
    return mean


def by_agent(samples) -> list[list]:
    agents = sorted({s.agent for s in samples})
    return [[s for s in samples if s.agent == a] for a in agents]


def run(route, lora: bool, minibatch: str, lr: float, samples=SAMPLES_ALL, seed=3, micro_batch_tokens=0):
    cfg = StepConfig(route=route, lora_scale=LORA.scale if lora else None, minibatch=minibatch,
                     minibatch_size=4, micro_batch_tokens=micro_batch_tokens)
    tr = Trainer(MODEL, cfg, sgd_keeping_the_gradient())
    state = tr.init_state({s: _params(lora) for s in cfg.sets})
    new, m = train_batch(tr, state, samples, lr, seed=seed)
    return cfg, new, m.record()


@pytest.mark.parametrize("route,lora,micro", [(SHARED, True, 0), (ISOLATED, False, 0), (SHARED, True, 1)],
                         ids=["shared-lora", "isolated-full", "shared-lora-micro"])
def test_agent_cos_in_one_minibatch(route, lora, micro):
    """Balanced: one mini-batch; the generator's 3 agents' gradients at the start parameters (one program
    for the agents, or with `micro` a budget of 1 token: one call per sample). The aggregator (one agent)
    and the single mini-batch give no value; the update is the one without agents."""
    cfg, new, m = run(route, lora, "balanced", 0.1, micro_batch_tokens=micro)
    params = _params(lora)
    want = mean_pair_cos([reference_grad(params, group, params, lora) for group in by_agent(VOTERS)])
    assert m["role/generator/agent_grad_cos"] == pytest.approx(want, rel=TOL)
    assert not any(k.endswith("minibatch_grad_cos") for k in m) and "role/aggregator/agent_grad_cos" not in m
    plain = [dataclasses.replace(s, agent=0) for s in SAMPLES_ALL]
    _, ref_state, ref_m = run(route, lora, "balanced", 0.1, samples=plain, micro_batch_tokens=micro)
    assert not any("grad_cos" in k for k in ref_m)
    for s in cfg.sets:
        got, want_p = _flat(new.params[s]), _flat(ref_state.params[s])
        assert np.linalg.norm(got - want_p) <= TOL * np.linalg.norm(want_p)


def test_minibatch_and_agent_cos_follow_the_sgd_steps():
    """Isolated, paper mini-batches of 4: the generator's 6 samples take 2 SGD steps (lr 0.5, so the
    parameters move visibly); each mini-batch's gradient is taken at the parameters its step started from,
    with the old log-probs of the step's start. Agent cos averages over the mini-batches with ≥ 2 agents."""
    lr = 0.5
    cfg, _, m = run(ISOLATED, True, "paper", lr)
    chunks = [mb["generator"] for mb in minibatches(SAMPLES_ALL, cfg, seed=3) if "generator" in mb]
    assert len(chunks) == 2
    start = params = _params(True)
    mb_grads, agent_cos = [], []
    for chunk in chunks:
        mb_grads.append(reference_grad(params, chunk, start, True))
        groups = by_agent(chunk)
        if len(groups) > 1:
            agent_cos.append(mean_pair_cos([reference_grad(params, g, start, True) for g in groups]))
        params = jax.tree.map(lambda p, g: p - lr * g, params, mb_grads[-1])  # SGD, the generator alone on its set
    assert agent_cos  # the cut holds several agents somewhere
    assert m["role/generator/minibatch_grad_cos"] == pytest.approx(mean_pair_cos(mb_grads), rel=TOL)
    assert m["role/generator/agent_grad_cos"] == pytest.approx(np.mean(agent_cos), rel=TOL)
    assert "role/aggregator/minibatch_grad_cos" not in m  # one mini-batch


def test_coherence_mean_skips_zero_gradients_and_needs_two():
    """The streamed mean over pairs equals the plain one (float64) and ignores gradients with no direction."""
    rng = np.random.default_rng(0)
    vecs = [{"a": rng.normal(size=(3, 4)), "b": rng.normal(size=5)} for _ in range(4)]
    for v in vecs[1:]:
        v["a"] += vecs[0]["a"]  # correlated, so the mean is far from 0
    acc = Coherence.zeros_like(vecs[0])
    assert mean_cos(add(acc, vecs[0])) is None
    for v in vecs[:2] + [jax.tree.map(np.zeros_like, vecs[0])] + vecs[2:]:
        acc = add(acc, jax.tree.map(jnp.float32, v))
    assert mean_cos(acc) == pytest.approx(mean_pair_cos(vecs), rel=TOL)
