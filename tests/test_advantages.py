"""Group keys and advantages, checked against values computed by hand (float64, rtol 1e-12)."""
import numpy as np
import pytest

from marljax.rl import advantages as adv
from marljax.rl.advantages import AdvantageConfig, compute_advantages

EPS = 1e-6
TOL = dict(rtol=1e-12, atol=1e-12)


def batch(rows):
    """rows: (problem, rollout, role, slot, turn, episode_reward) -> keyword arrays."""
    p, r, role, s, t, rew = zip(*rows)
    return dict(problem_id=np.array(p), rollout=np.array(r), role=np.array(role), slot=np.array(s),
                turn=np.array(t), episode_reward=np.array(rew, dtype=float))


def voting_batch():
    """2 problems × 4 rollouts; each episode: voters (role generator, slots 0-2), then the aggregator."""
    reward = {"p0": [1, 0, 0, 0], "p1": [1, 1, 0, 1]}
    rows = []
    for p in ("p0", "p1"):
        for r in range(4):
            rows += [(p, r, "generator", k, 0, reward[p][r]) for k in range(3)]
            rows.append((p, r, "aggregator", 0, 0, reward[p][r]))
    return batch(rows)


def test_voting_paper_groups_and_advantages():
    b = voting_batch()
    out = compute_advantages(**b, split_slots={"generator"})
    assert out.keys == (("p0", "generator", 0), ("p0", "generator", 1), ("p0", "generator", 2),
                        ("p0", "aggregator"),
                        ("p1", "generator", 0), ("p1", "generator", 1), ("p1", "generator", 2),
                        ("p1", "aggregator"))
    # Sample i = 16·problem + 4·rollout + call, call 0-2 the voters, 3 the aggregator.
    assert out.group_id.tolist() == [0, 1, 2, 3] * 4 + [4, 5, 6, 7] * 4
    assert out.group_size.tolist() == [4] * 32
    # p0 rewards (1,0,0,0): mean 1/4, unbiased std sqrt((9/16 + 3/16)/3) = 1/2.
    # p1 rewards (1,1,0,1): mean 3/4, std 1/2 as well.
    a0 = np.array([0.75, -0.25, -0.25, -0.25]) / (0.5 + EPS)
    a1 = np.array([0.25, 0.25, -0.75, 0.25]) / (0.5 + EPS)
    expected = np.concatenate([np.repeat(a0, 4), np.repeat(a1, 4)])  # every call of an episode alike
    np.testing.assert_allclose(out.advantage, expected, **TOL)
    np.testing.assert_allclose(out.advantage[:4], [1.5 / (1 + 2 * EPS)] * 4, **TOL)


def test_voting_population_std_option_and_per_role_rewards():
    b = voting_batch()
    pop = compute_advantages(**b, cfg=AdvantageConfig(std_ddof=0), split_slots={"generator"})
    np.testing.assert_allclose(pop.advantage[0], 0.75 / (np.sqrt(3 / 16) + EPS), **TOL)
    # per_role: voters carry their own correctness, the aggregator NaN -> falls back to the episode reward.
    voters_p0 = np.array([4 * r + k for r in range(4) for k in range(3)])
    role_reward = np.full(32, np.nan)
    role_reward[voters_p0] = [1, 1, 0] * 4  # p0: voters 0 and 1 always right, voter 2 always wrong
    out = compute_advantages(**b, role_reward=role_reward, cfg=AdvantageConfig(reward_routing="per_role"),
                             split_slots={"generator"})
    assert out.reward[:4].tolist() == [1, 1, 0, 1]
    np.testing.assert_allclose(out.advantage[voters_p0], 0.0, **TOL)  # flat voter groups: no signal
    np.testing.assert_allclose(out.advantage[3], 0.75 / (0.5 + EPS), **TOL)
    assert out.metrics()["adv/frac_flat_groups"] == 3 / 8
    with pytest.raises(ValueError, match="needs role_reward"):
        compute_advantages(**b, cfg=AdvantageConfig(reward_routing="per_role"))


def orch_batch():
    """1 problem × 3 rollouts with 3, 2 and 1 workers; rewards 1, 0, 0."""
    rows = []
    for r, (n_workers, rew) in enumerate([(3, 1.0), (2, 0.0), (1, 0.0)]):
        rows.append(("q", r, "orchestrator", 0, 0, rew))
        rows += [("q", r, "worker", k, 0, rew) for k in range(n_workers)]
        rows.append(("q", r, "synthesizer", 0, 0, rew))
    return batch(rows)


def test_orch_workers_pool_all_worker_slots():
    out = compute_advantages(**orch_batch())
    assert out.keys == (("q", "orchestrator"), ("q", "worker"), ("q", "synthesizer"))
    assert out.group_size.tolist() == [3, 6, 6, 6, 3, 3, 6, 6, 3, 3, 6, 3]
    w = out.group_id == 1
    # workers: rewards (1,1,1,0,0,0), mean 1/2, unbiased std sqrt(6/4/5) = sqrt(0.3)
    np.testing.assert_allclose(out.advantage[w], np.array([1, 1, 1, -1, -1, -1]) * 0.5 / (np.sqrt(0.3) + EPS), **TOL)
    # orchestrator: (1,0,0), mean 1/3, std sqrt(1/3)
    o = out.group_id == 0
    np.testing.assert_allclose(out.advantage[o], np.array([2, -1, -1]) / 3 / (np.sqrt(1 / 3) + EPS), **TOL)


def test_size_one_groups_get_zero():
    # Splitting worker slots leaves slot 2 with one sample (only rollout 0 has a third worker).
    out = compute_advantages(**orch_batch(), split_slots={"worker"})
    i = out.keys.index(("q", "worker", 2))
    assert (out.group_size[out.group_id == i] == 1).all()
    assert out.advantage[out.group_id == i].tolist() == [0.0]
    single = compute_advantages(**batch([("x", 0, "generator", 0, 0, 1.0)]))
    assert single.advantage.tolist() == [0.0] and single.group_size.tolist() == [1]


def eval_opt_batch():
    """1 problem × 3 rollouts: (g0 e0), (g0 e0 g1 e1), (g0 e0 g1 e1 g2); rewards 1, 1, 0."""
    rows = []
    for r, (n_turns, rew) in enumerate([(1, 1.0), (2, 1.0), (3, 0.0)]):
        for t in range(n_turns):
            rows.append(("e", r, "generator", 0, t, rew))
            if t < 2:
                rows.append(("e", r, "evaluator", 0, t, rew))
    return batch(rows)


def test_eval_opt_pools_turns_under_paper_and_splits_under_role_turn():
    b = eval_opt_batch()
    out = compute_advantages(**b)
    assert out.keys == (("e", "generator"), ("e", "evaluator"))
    assert out.group_size.tolist() == [6, 5] * 5 + [6]
    gen = out.group_id == 0  # rewards (1,1,1,0,0,0)
    np.testing.assert_allclose(out.advantage[gen], np.array([1, 1, 1, -1, -1, -1]) * 0.5 / (np.sqrt(0.3) + EPS), **TOL)
    ev = out.group_id == 1  # rewards (1,1,1,0,0): mean 3/5, unbiased var (3·0.16 + 2·0.36)/4 = 0.3
    np.testing.assert_allclose(out.advantage[ev], np.array([0.4, 0.4, 0.4, -0.6, -0.6]) / (np.sqrt(0.3) + EPS), **TOL)

    rt = compute_advantages(**b, cfg=AdvantageConfig(group_key="role_turn"))
    assert rt.keys == (("e", "generator", 0), ("e", "evaluator", 0), ("e", "generator", 1),
                       ("e", "evaluator", 1), ("e", "generator", 2))
    assert [len(np.flatnonzero(rt.group_id == g)) for g in range(5)] == [3, 3, 2, 2, 1]
    g1 = rt.group_id == 2  # rewards (1, 0): mean 1/2, unbiased std sqrt(1/2)
    np.testing.assert_allclose(rt.advantage[g1], np.array([0.5, -0.5]) / (np.sqrt(0.5) + EPS), **TOL)
    assert rt.advantage[rt.group_id == 4].tolist() == [0.0]


def test_role_preset_pools_voters():
    out = compute_advantages(**voting_batch(), cfg=AdvantageConfig(group_key="role"), split_slots={"generator"})
    assert out.keys == (("p0", "generator"), ("p0", "aggregator"), ("p1", "generator"), ("p1", "aggregator"))
    assert out.group_size.tolist() == [12, 12, 12, 4] * 4 + [12, 12, 12, 4] * 4


def test_dr_grpo_and_rloo_values():
    b = voting_batch()
    dr = compute_advantages(**b, cfg=AdvantageConfig(estimator="dr_grpo"), split_slots={"generator"})
    np.testing.assert_allclose(dr.advantage[0:16:4], [0.75, -0.25, -0.25, -0.25], **TOL)
    rl = compute_advantages(**b, cfg=AdvantageConfig(estimator="rloo"), split_slots={"generator"})
    # leave-one-out: 1 − mean(0,0,0) = 1;  0 − mean(1,0,0) = −1/3
    np.testing.assert_allclose(rl.advantage[0:16:4], [1.0, -1 / 3, -1 / 3, -1 / 3], **TOL)
    np.testing.assert_allclose(rl.advantage[16:32:4], [1 / 3, 1 / 3, -1.0, 1 / 3], **TOL)


def test_group_keys_function_and_registries():
    keys = adv.group_keys(["a", "a"], [0, 1], ["generator", "worker"], [2, 2], [1, 1],
                          preset="paper", split_slots={"generator"})
    assert keys == [("a", "generator", 2), ("a", "worker")]
    assert adv.group_keys(["a"], [0], ["worker"], [2], [1], preset="role_turn") == [("a", "worker", 1)]

    @adv.register_estimator("test_sign")
    def sign(r, cfg):
        return np.sign(r - r.mean())

    out = compute_advantages(**voting_batch(), cfg=AdvantageConfig(estimator="test_sign"))
    assert out.advantage[:4].tolist() == [1.0, 1.0, 1.0, 1.0]
    with pytest.raises(ValueError, match="already registered"):
        adv.register_estimator("grpo")(sign)
    with pytest.raises(KeyError, match=r"unknown advantage estimator 'ppo'; registered: \["):
        compute_advantages(**voting_batch(), cfg=AdvantageConfig(estimator="ppo"))
    with pytest.raises(KeyError, match="unknown group key"):
        compute_advantages(**voting_batch(), cfg=AdvantageConfig(group_key="slot"))
    with pytest.raises(ValueError, match="1-D arrays of one length"):
        adv.group_keys(["a"], [0, 1], ["g"], [0], [0])
    with pytest.raises(ValueError, match="non-finite"):
        compute_advantages(**batch([("x", 0, "g", 0, 0, float("nan"))]))


def test_null_permutes_each_roles_advantages_among_its_own_samples():
    """The coherence null: a role's advantages are the same multiset, reassigned; roles never swap values;
    the same seed gives the same shuffle (a resumed step repeats it), another seed another."""
    b = voting_batch()
    a = compute_advantages(**b, cfg=AdvantageConfig(group_key="paper"), split_slots={"generator"}).advantage
    role = b["role"]
    p = adv.permuted_within_roles(a, role, seed=[0, 1])
    for r in ("generator", "aggregator"):
        np.testing.assert_array_equal(np.sort(p[role == r]), np.sort(a[role == r]))
    np.testing.assert_array_equal(p, adv.permuted_within_roles(a, role, seed=[0, 1]))
    assert not np.array_equal(p, a)
    assert not np.array_equal(p, adv.permuted_within_roles(a, role, seed=[0, 2]))
    # under broadcast and paper groups the three voters of an episode share an advantage; the null breaks it
    voters = p[role == "generator"].reshape(8, 3)
    assert np.any(voters[:, 0] != voters[:, 1])
