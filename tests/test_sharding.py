"""Sharding: meshes from config, logical-axis rules, clear errors, and — on 8 simulated CPU devices in a
subprocess (tests/sharding_check.py) — logits, greedy samples and a train step equal to one device,
really sharded state, and an Orbax checkpoint restored under another mesh."""
import json
import os
import pathlib
import subprocess
import sys

import jax
import jax.numpy as jnp
import pytest
from flax import nnx
from jax.sharding import AbstractMesh, PartitionSpec

from marljax.config import load_config
from marljax.core import sharding
from marljax.core.sharding import MeshConfig
from marljax.models.decoder import Decoder
from marljax.models.presets import PRESETS

HERE = pathlib.Path(__file__).resolve().parent
TOL = 1e-5


@pytest.fixture(scope="module")
def mesh_result(tmp_path_factory):
    flags = os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=8"
    env = dict(os.environ, XLA_FLAGS=flags.strip(), JAX_PLATFORMS="cpu")
    ckpt = tmp_path_factory.mktemp("ckpt")
    proc = subprocess.run([sys.executable, str(HERE / "sharding_check.py"), str(ckpt)], env=env,
                          capture_output=True, text=True, timeout=600, cwd=HERE.parent)
    lines = [ln for ln in proc.stdout.splitlines() if ln.startswith("RESULT ")]
    assert proc.returncode == 0 and lines, proc.stdout[-3000:] + proc.stderr[-3000:]
    return json.loads(lines[-1][len("RESULT "):])


@pytest.mark.parametrize("mesh", ["fsdp2_tensor4", "data2_fsdp4"])
def test_mesh_run_equals_single_device(mesh_result, mesh):
    r = mesh_result["meshes"][mesh]
    assert r["logits_rel"] <= TOL
    assert r["greedy_equal"]
    assert set(r["metric_rel"]) >= {"role/generator/loss", "role/aggregator/loss",
                                    "role/generator/grad_norm", "role/aggregator/grad_norm"}
    assert max(r["metric_rel"].values()) <= TOL, r["metric_rel"]
    assert r["params_changed"] > 1e-3  # the step did move the parameters
    assert r["params_rel"] <= TOL


def test_state_is_really_sharded(mesh_result):
    tp, dp = mesh_result["meshes"]["fsdp2_tensor4"]["facts"], mesh_result["meshes"]["data2_fsdp4"]["facts"]
    # wq [layers, embed, heads, head_dim] = [2, 64, 4, 16]
    assert tp["wq_spec"] == "P(None, 'fsdp', 'tensor', None)" and tp["wq_shard_shape"] == [2, 32, 1, 16]
    assert dp["wq_spec"] == "P(None, 'fsdp', None, None)" and dp["wq_shard_shape"] == [2, 16, 4, 16]
    assert tp["embed_spec"] == "P('tensor', 'fsdp')" and dp["embed_spec"] == "P(None, 'fsdp')"
    assert tp["lora_wq_b_spec"] == "P(None, None, 'tensor', None)"
    for facts in (tp, dp):
        assert facts["mu_wq_a_spec"] == "P(None, 'fsdp', None)"  # Adam moments follow their params
        assert facts["params_keep_sharding"] and facts["updated_wq_a_spec"] == "P(None, 'fsdp', None)"
        assert facts["logits_devices"] == 8


def test_checkpoint_written_under_one_mesh_restores_under_another(mesh_result):
    c = mesh_result["checkpoint"]
    assert c["step"] == 1 and c["meta"] == {"step": 1}
    assert c["values_rel"] == 0.0
    assert c["restored_on_target_sharding"]
    assert c["written_wq_b_spec"] != c["restored_wq_b_spec"]


def test_engine_pages_and_dense_copies_stay_on_their_ranks_chip(mesh_result):
    """8 rank pools of 64 decode rows on (data=2, fsdp=4): each chip holds its own pool and its 8 rows of
    the chunk path's dense copy (a gather over the flat page axis replicated all 64 on every chip: 8x
    the memory, the OOM of issue #45), and no page operation needs a collective."""
    e = mesh_result["engine"]
    assert e["pool_rows_per_device"] == 1 and e["dense_rows_per_device"] == 8, e
    assert not any(e["collectives"].values()), e["collectives"]


# ---- in-process (one device) -------------------------------------------------------------------------
def _abstract(*sizes):
    return AbstractMesh(tuple(sizes), sharding.MESH_AXES)


def test_mesh_shape_resolves_the_rest_and_rejects_bad_sizes():
    assert sharding.mesh_shape(MeshConfig(), 8) == (1, 8, 1)
    assert sharding.mesh_shape(MeshConfig(data=2, fsdp=-1, tensor=2), 8) == (2, 2, 2)
    with pytest.raises(sharding.ShardingError, match="multiply to the device count"):
        sharding.mesh_shape(MeshConfig(data=1, fsdp=3, tensor=1), 8)
    with pytest.raises(sharding.ShardingError, match="does not divide"):
        sharding.mesh_shape(MeshConfig(data=3, fsdp=-1), 8)
    with pytest.raises(sharding.ShardingError, match="at most one may be -1"):
        sharding.mesh_shape(MeshConfig(data=-1, fsdp=-1), 8)
    mesh = sharding.make_mesh(MeshConfig())
    assert dict(mesh.shape) == {"data": 1, "fsdp": jax.device_count(), "tensor": 1}


def test_mesh_is_a_config_section():
    cfg = load_config(None, ["mesh.fsdp=2", "mesh.tensor=4"])
    assert (cfg.mesh.data, cfg.mesh.fsdp, cfg.mesh.tensor, cfg.mesh.rules) == (1, 2, 4, "auto")


def test_rules_presets_and_errors():
    assert sharding.get_rules(MeshConfig(tensor=1), _abstract(1, 8, 1)) is sharding.RULES["fsdp"]
    assert sharding.get_rules(MeshConfig(fsdp=2, tensor=4), _abstract(1, 2, 4)) is sharding.RULES["fsdp_tp"]
    with pytest.raises(sharding.ShardingError, match="fsdp_tp"):
        sharding.get_rules(MeshConfig(fsdp=2, tensor=4, rules="fsdp"), _abstract(1, 2, 4))
    with pytest.raises(sharding.ShardingError, match="choose from"):
        sharding.get_rules(MeshConfig(rules="zero3"), _abstract(1, 8, 1))


def test_tensor_axis_that_does_not_divide_the_heads_is_a_clear_error():
    model = nnx.eval_shape(lambda: Decoder(PRESETS["smollm2-135m-instruct"], rngs=nnx.Rngs(0)))  # 9 heads
    with pytest.raises(sharding.ShardingError, match=r"'heads' has size 9.*mesh.tensor"):
        sharding.param_shardings(model, _abstract(1, 2, 4), sharding.RULES["fsdp_tp"])


def test_specs_follow_the_rules():
    rules, mesh = sharding.RULES["fsdp_tp"], _abstract(2, 2, 2)
    spec = sharding.logical_spec(("layers", "embed", "heads", "head_dim"), (4, 64, 8, 16), mesh, rules,
                                 strict=True)
    assert spec == PartitionSpec(None, "fsdp", "tensor", None)
    # batch over (data, fsdp); a batch the mesh does not divide keeps what divides, then nothing
    assert sharding.logical_spec(("batch", "length"), (8, 5), mesh, rules) == PartitionSpec(("data", "fsdp"), None)
    assert sharding.logical_spec(("batch", "length"), (2, 5), mesh, rules) == PartitionSpec("data", None)
    assert sharding.logical_spec(("batch", "length"), (1, 5), mesh, rules) == PartitionSpec(None, None)
    # fewer KV heads than tensor ranks: K/V weights stay replicated instead of failing
    kv = sharding.logical_spec(("layers", "embed", "kv_heads", "head_dim"), (4, 64, 1, 16), mesh, rules,
                               strict=True)
    assert kv == PartitionSpec(None, "fsdp", None, None)
    with pytest.raises(sharding.ShardingError, match="no sharding rule"):
        sharding.logical_spec(("batch", "colour"), (8, 3), mesh, rules)


def test_constrain_is_identity_without_a_mesh():
    x = jnp.ones((4, 3))
    assert sharding.constrain(x, ("batch", "act_embed")) is x
    assert jax.jit(lambda y: sharding.constrain(y, ("batch", "act_embed")) * 2)(x).shape == (4, 3)


def test_distributed_requested_by_environment():
    assert not sharding.distributed_requested({})
    assert sharding.distributed_requested({"MARLJAX_DISTRIBUTED": "1"})
    assert not sharding.distributed_requested({"MARLJAX_DISTRIBUTED": "0", "SLURM_NTASKS": "1"})
    assert sharding.distributed_requested({"SLURM_NTASKS": "4"})
    assert not sharding.initialize_distributed({})
