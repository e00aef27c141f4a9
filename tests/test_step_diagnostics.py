"""Per-role diagnostics of `Trainer.update` against gradients computed another way.

The reference builds each role's loss directly: the model's full logits, `log_softmax`, the response
tokens gathered by position, `losses.sequence_losses` (token mean per sequence, mean over sequences), and
takes a plain `jax.grad` of that role's loss on that role's samples alone (no `pack`, no
`response_logprobs`, no role weighting). The expected weights, masses, shares, cosines and the combined
gradient G = Σ_r c_r g_r are then derived in float64 NumPy from the configuration. The step runs with a
plain-SGD optimizer that also keeps the gradient it was given, so G is read exactly from the optimizer
state and a wrong global factor cannot hide behind Adam's scale-free first step.

Tolerances: norms, masses, shares, weights and G within 1e-5 relative; cosines and update shares (O(1)
numbers that may be near 0) within 1e-5 absolute.
"""
import functools
import itertools

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx

from marljax.models import load_model
from marljax.models.lora import LoRAConfig, init_lora
from marljax.rl.losses import sequence_losses
from marljax.rl.state import with_learning_rate
from marljax.rl.step import Sample, StepConfig, Trainer, make_optimizer, pack
from marljax.rl.step_metrics import average

MODEL = load_model("tiny-qwen3")
GRAPHDEF, BASE = nnx.split(MODEL)
LORA = LoRAConfig(rank=4, alpha=8)
N_PAD, T_PAD, R_PAD = 8, 16, 8  # the reference's own padding (every role and the mixed batch fit)
ROLES = ("generator", "aggregator")
TOL = 1e-5


def _samples(role, n, seed):
    rng = np.random.default_rng(seed)
    vocab = MODEL.config.vocab_size
    return [Sample(role, list(rng.integers(1, vocab, rng.integers(3, 9))),
                   list(rng.integers(1, vocab, rng.integers(1, R_PAD + 1))), float(rng.normal()))
            for _ in range(n)]


SAMPLES = {"generator": _samples("generator", 6, 0), "aggregator": _samples("aggregator", 2, 1)}  # 3 : 1


def _params(lora: bool):
    if not lora:
        return jax.tree.map(jnp.array, BASE)
    ad = init_lora(MODEL.config, LORA, jax.random.key(1))
    # non-zero B, so gradients w.r.t. A are non-zero too
    return jax.tree.map(lambda x: x + 0.02 * jax.random.normal(jax.random.key(8), x.shape), ad)


def _arrays(samples):
    """Right-padded tokens, response positions / targets / mask and advantages, built independently of
    `step.pack` (fixed sizes, so one compilation serves every role)."""
    tokens, pos, target = (np.zeros((N_PAD, T_PAD), np.int32), np.zeros((N_PAD, R_PAD), np.int32),
                           np.zeros((N_PAD, R_PAD), np.int32))
    mask, adv = np.zeros((N_PAD, R_PAD), np.float32), np.zeros((N_PAD,), np.float32)
    for i, s in enumerate(samples):
        seq, n = s.prompt + s.response, len(s.response)
        tokens[i, :len(seq)] = seq
        pos[i, :n] = len(s.prompt) - 1 + np.arange(n)  # the logits at p predict token p + 1
        target[i, :n] = s.response
        mask[i, :n], adv[i] = 1.0, s.advantage
    return tuple(map(jnp.asarray, (tokens, pos, target, mask, adv)))


@functools.partial(jax.jit, static_argnames="lora")
def _reference_grad(trainable, arrays, lora: bool):
    def loss(t):
        tokens, pos, target, mask, adv = arrays
        if lora:
            logits = nnx.merge(GRAPHDEF, BASE)(tokens, lora=t, lora_scale=LORA.scale)
        else:
            logits = nnx.merge(GRAPHDEF, t)(tokens)
        logp_ntv = jax.nn.log_softmax(logits, axis=-1)
        logp_nr = logp_ntv[jnp.arange(N_PAD)[:, None], pos, target]
        seq_b, denom, _ = sequence_losses(logp_nr, jax.lax.stop_gradient(logp_nr), adv, mask)
        return jnp.sum(seq_b) / denom
    return jax.grad(loss)(trainable)


def _flat(tree) -> np.ndarray:
    return np.concatenate([np.asarray(x, np.float64).ravel() for x in jax.tree.leaves(tree)])


@functools.cache
def reference_grad(lora: bool, roles: tuple[str, ...]) -> np.ndarray:
    """float64 copy of the gradient of the plain loss on the samples of `roles` together."""
    return _flat(_reference_grad(_params(lora), _arrays([s for r in roles for s in SAMPLES[r]]), lora))


def sgd_keeping_the_gradient():
    """Plain SGD (lr injected as `make_optimizer`'s is) whose state[0] keeps the gradient it received."""
    keep = optax.GradientTransformation(lambda p: jax.tree.map(jnp.zeros_like, p),
                                        lambda g, state, params=None: (g, g))
    return optax.chain(keep, optax.inject_hyperparams(optax.sgd)(learning_rate=0.0))


def run_step(tr: Trainer, lora: bool, samples=None):
    """One `Trainer.update` over `samples` (default SAMPLES), every set starting from `_params(lora)`."""
    samples = SAMPLES if samples is None else samples
    state = tr.init_state({s: _params(lora) for s in tr.cfg.sets})
    batches = {r: pack(samples[r]) for r in tr.cfg.roles}
    new, m = tr.update(state, batches, jnp.float32(0.1), recompute_old=False)
    return new.params, new.opt_state, average([jax.device_get(m)], tr.cfg.sets).record()


def expected_metrics(cfg: StepConfig, lora: bool) -> tuple[dict, dict]:
    """Weights, masses, shares, cosines and SGD update shares from the independent per-role gradients;
    and G per set."""
    g = {r: reference_grad(lora, (r,)) for r in cfg.roles}
    norm = {r: np.linalg.norm(v) for r, v in g.items()}
    scale, out, g_set = dict(cfg.role_scale), {}, {}
    for set_name in cfg.sets:
        roles = [r for r in cfg.roles if cfg.set_of(r) == set_name]
        raw = {"count": {r: len(SAMPLES[r]) for r in roles},
               "equal": {r: 1.0 for r in roles},
               "inverse_norm": {r: 1.0 / norm[r] for r in roles}}[cfg.role_weighting]
        c = {r: raw[r] / sum(raw.values()) * scale.get(r, 1.0) for r in roles}  # same_role_scale after normalising
        mass = {r: c[r] * norm[r] for r in roles}
        G = g_set[set_name] = sum(c[r] * g[r] for r in roles)
        for r in roles:
            out[f"role/{r}/grad_norm"], out[f"role/{r}/weight"] = norm[r], c[r]
            out[f"role/{r}/grad_mass"], out[f"role/{r}/grad_share"] = mass[r], mass[r] / sum(mass.values())
            out[f"role/{r}/update_share"] = c[r] * (g[r] @ G) / (G @ G)  # SGD: U ∝ −G
        for a, b in itertools.combinations(sorted(roles), 2):  # the step names pairs in sorted order
            out[f"cos/{a}/{b}"] = (g[a] @ g[b]) / (norm[a] * norm[b])
    return out, g_set


SHARED, ISOLATED = (("generator", "s"), ("aggregator", "s")), (("generator", "g"), ("aggregator", "a"))
SCALE = (("generator", 1 / 3),)  # same_role_scale of 3 voters
CASES = {  # every policy, weighting and weight type; role_scale where it matters (count) and where not
    "shared-lora-count": (SHARED, True, "count", ()),
    "shared-lora-equal": (SHARED, True, "equal", ()),
    "shared-lora-inverse_norm": (SHARED, True, "inverse_norm", ()),
    "shared-lora-count-role_scale": (SHARED, True, "count", SCALE),
    "shared-full-count": (SHARED, False, "count", ()),
    "shared-full-inverse_norm-role_scale": (SHARED, False, "inverse_norm", SCALE),
    "isolated-lora-equal": (ISOLATED, True, "equal", ()),
    "isolated-full-count": (ISOLATED, False, "count", ()),
    "isolated-lora-count-role_scale": (ISOLATED, True, "count", SCALE),
}


@pytest.mark.parametrize("case", list(CASES))
def test_diagnostics_match_independent_gradients(case):
    route, lora, weighting, role_scale = CASES[case]
    cfg = StepConfig(route=route, lora_scale=LORA.scale if lora else None, role_weighting=weighting,
                     role_scale=role_scale, minibatch="balanced")
    _, states, m = run_step(Trainer(MODEL, cfg, sgd_keeping_the_gradient()), lora)
    expected, g_set = expected_metrics(cfg, lora)
    assert min(expected[f"role/{r}/grad_norm"] for r in ROLES) > 1e-3  # a real signal, not zeros
    for key, want in expected.items():
        tol = dict(abs=TOL) if key.startswith("cos/") or key.endswith("/update_share") else dict(rel=TOL)
        assert float(m[key]) == pytest.approx(want, **tol), key
    assert not any(k.startswith("cos/") for k in m) if route == ISOLATED else "cos/aggregator/generator" in m
    for set_name, want in g_set.items():
        got = _flat(states[set_name][0])  # the gradient the optimizer received
        assert np.linalg.norm(got - want) <= TOL * np.linalg.norm(want), set_name
        assert float(m[f"set/{set_name}/grad_norm"]) == pytest.approx(np.linalg.norm(want), rel=TOL)
    if weighting == "count" and route == SHARED and not role_scale:
        # Shared Policy, count weighting: G is the gradient of the ordinary mixed-batch loss (token mean
        # per sequence, mean over all 8 sequences of the set)
        mixed = reference_grad(lora, ROLES)
        assert np.linalg.norm(g_set["s"] - mixed) <= TOL * np.linalg.norm(mixed)
        assert m["role/generator/weight"] == pytest.approx(6 / 8, rel=TOL)
    if weighting == "count" and role_scale:  # the voters' weight is 1/3 of their unscaled one, shared or alone
        assert m["role/generator/weight"] == pytest.approx((6 / 8 if route == SHARED else 1.0) / 3, rel=TOL)
        assert m["role/aggregator/weight"] == pytest.approx(2 / 8 if route == SHARED else 1.0, rel=TOL)


def test_update_share_attributes_the_adamw_step():
    """With clip + AdamW, update_share_r = ⟨c_r g_r, U⟩ / ⟨G, U⟩ for the update U the optimizer makes from
    the reference G; the shares sum to 1. When the two roles' gradients coincide (the aggregator's
    samples repeated three times as the generator's), update and gradient shares are both the weights
    3/4 and 1/4 and the cosine is 1, whatever the optimizer does to G."""
    cfg = StepConfig(route=SHARED, lora_scale=LORA.scale, minibatch="balanced")
    opt = make_optimizer()
    tr = Trainer(MODEL, cfg, opt)
    _, _, m = run_step(tr, lora=True)
    expected, g_set = expected_metrics(cfg, lora=True)
    params = _params(lora=True)
    leaves, treedef = jax.tree.flatten(params)
    sizes = np.cumsum([x.size for x in leaves])[:-1]
    G = jax.tree.unflatten(treedef, [jnp.asarray(v.reshape(x.shape), jnp.float32)
                                     for v, x in zip(np.split(g_set["s"], sizes), leaves)])
    state = with_learning_rate(opt.init(params), jnp.float32(0.1))
    U = _flat(opt.update(G, state, params)[0])
    c = {r: expected[f"role/{r}/weight"] for r in ROLES}
    dots = {r: c[r] * (reference_grad(True, (r,)) @ U) for r in ROLES}
    for r in ROLES:
        assert float(m[f"role/{r}/update_share"]) == pytest.approx(dots[r] / sum(dots.values()), abs=TOL), r
    assert sum(float(m[f"role/{r}/update_share"]) for r in ROLES) == pytest.approx(1.0, abs=TOL)
    assert abs(float(m["role/aggregator/update_share"]) - float(m["role/aggregator/grad_share"])) > 0.01

    agg = SAMPLES["aggregator"]
    _, _, m = run_step(tr, lora=True,
                       samples={"generator": [Sample("generator", s.prompt, s.response, s.advantage)
                                              for s in agg * 3], "aggregator": agg})
    for r, share in (("generator", 0.75), ("aggregator", 0.25)):
        assert float(m[f"role/{r}/grad_share"]) == pytest.approx(share, abs=TOL)
        assert float(m[f"role/{r}/update_share"]) == pytest.approx(share, abs=TOL)
    assert float(m["cos/aggregator/generator"]) == pytest.approx(1.0, abs=TOL)
