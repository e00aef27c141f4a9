"""LoRA adapters: zero-init equals the base, partial-layer adapters, merge and HF export per set."""
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from marljax.models import load_model
from marljax.models.decoder import Decoder, ModelConfig
from marljax.models.lora import LoRAConfig, export_merged, init_lora, merged_model

CFG = ModelConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_layers=4, num_heads=4, num_kv_heads=2,
                  head_dim=8, tie_embeddings=False)
TOKENS = jnp.asarray([[1, 5, 9, 2, 7, 3]])


def _perturbed(lc, seed=0):
    ad = init_lora(CFG, lc, jax.random.key(seed))
    return jax.tree.map(lambda x: x + 0.1 * jax.random.normal(jax.random.key(seed + 1), x.shape), ad)


def test_fresh_adapter_is_the_identity():
    m = Decoder(CFG, rngs=nnx.Rngs(0))
    lc = LoRAConfig(rank=4, alpha=8)
    np.testing.assert_array_equal(m(TOKENS, lora=init_lora(CFG, lc, jax.random.key(0)), lora_scale=lc.scale), m(TOKENS))


@pytest.mark.parametrize("layers", [None, 2])
def test_merged_weights_equal_the_adapter_forward(layers):
    m = Decoder(CFG, rngs=nnx.Rngs(0))
    lc = LoRAConfig(rank=4, alpha=8, layers=layers)
    ad = _perturbed(lc)
    with_adapter = m(TOKENS, lora=ad, lora_scale=lc.scale)
    assert float(jnp.abs(with_adapter - m(TOKENS)).max()) > 1e-2  # the adapter changes the model
    np.testing.assert_allclose(merged_model(m, ad, lc.scale)(TOKENS), with_adapter, atol=1e-5)


def test_partial_layer_adapter_trains_only_its_layers():
    m = Decoder(CFG, rngs=nnx.Rngs(0))
    lc = LoRAConfig(rank=4, alpha=8, layers=1, targets=("wq",))
    ad = _perturbed(lc)
    g = jax.grad(lambda a: m(TOKENS, lora=a, lora_scale=lc.scale).sum())(ad)
    assert g["wq"]["a"].shape[0] == 1 and float(jnp.abs(g["wq"]["b"]).sum()) > 0


def test_bad_lora_configs():
    with pytest.raises(ValueError, match="unknown modules"):
        LoRAConfig(targets=("wx",))
    with pytest.raises(ValueError, match="exceeds"):
        init_lora(CFG, LoRAConfig(layers=9), jax.random.key(0))


def test_export_merged_per_set_loads_back(tmp_path):
    m = Decoder(CFG, rngs=nnx.Rngs(0))
    lc = LoRAConfig(rank=4, alpha=8)
    adapters = {"generator": _perturbed(lc, 0), "aggregator": _perturbed(lc, 5)}
    paths = export_merged(m, adapters, lc.scale, tmp_path)
    for name, ad in adapters.items():
        back = load_model(str(paths[name]))
        np.testing.assert_allclose(back(TOKENS), m(TOKENS, lora=ad, lora_scale=lc.scale), atol=1e-5)
