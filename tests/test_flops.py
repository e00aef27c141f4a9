"""marljax/models/flops.py: model FLOPs against XLA's own count of the same forward (CPU `cost_analysis`) and a
hand count of a training step (real tokens only, causal attention, the head on response tokens)."""
import jax
import jax.numpy as jnp
import pytest
from flax import nnx

from marljax.models import flops
from marljax.models.decoder import Decoder, ModelConfig

# One layer: XLA's cost analysis counts a `lax.scan` body once, whatever the trip count.
CFG = ModelConfig(vocab_size=512, hidden_size=128, intermediate_size=256, num_layers=1, num_heads=4,
                  num_kv_heads=2, head_dim=32, tie_embeddings=False)


@pytest.mark.parametrize("length,head", [(48, 16), (40, 1)])  # a training row; a sampler prefill
def test_forward_flops_match_xla_cost_analysis(length, head):
    """XLA counts what runs: our model count plus the masked upper half of the attention square it
    computes anyway, plus elementwise work (norms, RoPE, softmax, SiLU) we leave out: within [1, 1.03]×.
    Counting the head on every position, or the attention square, would be 20–30% over."""
    graphdef, state = nnx.split(Decoder(CFG, rngs=nnx.Rngs(0)))

    def forward(state, tokens_bt):
        model = nnx.merge(graphdef, state)
        h_btd, _ = model.hidden(tokens_bt)
        return model.logits(h_btd[:, length - head - 1: length - 1])

    cost = jax.jit(forward).lower(state, jnp.ones((1, length), jnp.int32)).compile().cost_analysis()
    xla = (cost[0] if isinstance(cost, list) else cost)["flops"]
    masked = 4 * CFG.num_heads * CFG.head_dim * (length * length - flops.causal_pairs(length))
    ours = flops.forward_flops(CFG, [length], head)
    assert 1.0 <= xla / (ours + masked) <= 1.03


def test_train_flops_hand_count():
    """Two rows of 3 + 2 and 5 + 4 real tokens (any padding a batch adds is not counted), 2 layers."""
    cfg = ModelConfig(vocab_size=100, hidden_size=8, intermediate_size=16, num_layers=2, num_heads=2,
                      num_kv_heads=1, head_dim=4)
    d, f, h, kv, dh, v = 8, 16, 2, 1, 4, 100
    per_token_macs = 2 * (d * h * dh + 2 * d * kv * dh + h * dh * d + 2 * d * f + f * d)  # 2 layers
    tokens, responses = 5 + 9, 2 + 4
    pairs = sum(i + 1 for i in range(5)) + sum(i + 1 for i in range(9))  # 15 + 45 causal (query, key) pairs
    attention_fwd = 2 * 2 * (h * dh) * 2 * pairs  # 2 layers × (QKᵀ + AV) × H·Dh MACs × 2 FLOPs
    head_fwd = 2 * d * v * responses
    layers_fwd = 2 * per_token_macs * tokens
    full = 3 * (layers_fwd + head_fwd + attention_fwd)
    assert flops.train_flops(cfg, [3, 5], [2, 4]) == full
    # rank 3 on every map of 2 layers: q, k, v, o, gate, up, down each r · (in + out)
    lora_macs = 2 * 3 * ((8 + 8) + 2 * (8 + 4) + (8 + 8) + 2 * (8 + 16) + (16 + 8))
    lora = 2 * (layers_fwd + head_fwd) + 3 * attention_fwd + 6 * lora_macs * tokens
    assert flops.train_flops(cfg, [3, 5], [2, 4], lora_rank=3) == lora
    prompt_pairs = sum(i + 1 for i in range(3)) + sum(i + 1 for i in range(5))
    prefill = 2 * per_token_macs * 8 + 2 * 2 * (h * dh) * 2 * prompt_pairs + 2 * d * v * 2  # head: 1 per prompt
    assert flops.prefill_flops(cfg, [3, 5]) == prefill
