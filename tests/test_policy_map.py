"""PolicyMap: constructors, config parsing, validation errors, helpers."""
import pytest

from marljax.rl import policy_map as pm

VOTING = ("generator", "aggregator")
ORCH = ("orchestrator", "worker", "synthesizer")


def test_shared_routes_every_role_to_one_set():
    m = pm.shared(ORCH)
    assert m.route == {"orchestrator": "shared", "worker": "shared", "synthesizer": "shared"}
    assert m.sets == ("shared",)
    assert m.roles_of("shared") == ORCH
    assert pm.shared(VOTING, name="base").sets == ("base",)


def test_isolated_one_set_per_role_named_after_it():
    m = pm.isolated(ORCH)
    assert m.route == {r: r for r in ORCH}
    assert m.sets == ORCH
    assert m.roles_of("worker") == ("worker",)
    assert m.set_of("synthesizer") == "synthesizer"


def test_from_config_strings_and_mapping_ordered_by_roles():
    assert pm.from_config("shared", VOTING) == pm.shared(VOTING)
    assert pm.from_config("isolated", VOTING) == pm.isolated(VOTING)
    m = pm.from_config({"synthesizer": "sup", "worker": "workers", "orchestrator": "sup"}, ORCH)
    assert m.roles == ORCH
    assert m.sets == ("sup", "workers")  # first use in the workflow's role order
    assert m.roles_of("sup") == ("orchestrator", "synthesizer")


def test_validation_errors_are_clear():
    with pytest.raises(ValueError, match=r"workflow roles \['aggregator'\] are not routed"):
        pm.from_config({"generator": "g"}, VOTING)
    with pytest.raises(ValueError, match=r"routed roles \['critic'\] are not roles of the workflow"):
        pm.from_config({"generator": "g", "aggregator": "a", "critic": "a"}, VOTING)
    with pytest.raises(ValueError, match="empty set name"):
        pm.from_config({"generator": "", "aggregator": "a"}, VOTING)
    with pytest.raises(ValueError, match=r"sets \['spare'\] are declared but no role is routed"):
        pm.PolicyMap({"generator": "g"}, sets=("g", "spare"))
    with pytest.raises(ValueError, match="missing from sets"):
        pm.PolicyMap({"generator": "g", "aggregator": "a"}, sets=("g",))
    with pytest.raises(ValueError, match="must match"):
        pm.from_config({"generator": "a/b", "aggregator": "a"}, VOTING)
    with pytest.raises(TypeError, match="set names are strings"):
        pm.from_config({"generator": 1, "aggregator": "a"}, VOTING)
    with pytest.raises(ValueError, match="not one of"):
        pm.from_config("isolate", VOTING)
    with pytest.raises(ValueError, match="duplicate roles"):
        pm.isolated(["worker", "worker"])
    with pytest.raises(ValueError, match="no roles"):
        pm.shared([])
    with pytest.raises(KeyError, match="unknown parameter set 'nope'"):
        pm.shared(VOTING).roles_of("nope")
    with pytest.raises(KeyError, match="role 'critic' is not routed"):
        pm.shared(VOTING).set_of("critic")


def test_init_params_and_params_for():
    m = pm.from_config({"generator": "voters", "aggregator": "judge"}, VOTING)
    params = pm.init_params(m, lambda name: {"lora": f"state-{name}"})
    assert list(params) == ["voters", "judge"]
    assert m.params_for(params, "aggregator") == {"lora": "state-judge"}
    with pytest.raises(KeyError, match="params has no set 'judge'"):
        m.params_for({"voters": 0}, "aggregator")


def test_hashable_and_equal_regardless_of_route_order():
    a = pm.PolicyMap({"generator": "s", "aggregator": "s"})
    b = pm.PolicyMap({"aggregator": "s", "generator": "s"})
    assert a == b and hash(a) == hash(b)
    assert len({pm.isolated(VOTING), pm.isolated(VOTING), pm.shared(VOTING)}) == 2
