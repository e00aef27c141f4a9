"""Mixed precision: the dtypes a model computes and stores in, and the float32-output matmul.

`dtype` (ModelConfig, the `dtype` config key) is the compute dtype: the residual stream, every
activation, the matmuls' inputs (weights are cast to it where they are read) and the sampler's KV cache.
`param_dtype` is how the frozen base is stored (None: `dtype`; bfloat16 halves its HBM). Trainable state
is float32 whatever the two: LoRA adapters (`init_lora`) and full fine-tuning's master weights
(`decoder.trainable_params`), so AdamW's moments and small updates are not rounded to 8 bits; they are
cast to the compute dtype where the forward pass reads them.

Matmuls accumulate in float32. XLA's bfloat16 dots do so on every backend (TPU MXU; GPU cuBLAS with a
float32 compute type; CPU, which upcasts to float32): a bfloat16-output dot is the float32-accumulated
one rounded once (tests/test_bf16.py), and its backward keeps bfloat16 operands. The linear maps use
`dot_f32` (float32 output) and round once themselves: the same numbers up to summation order, and on XLA
CPU with AMX a float32-output bfloat16 dot runs 3-8x faster than a bfloat16-output one (YNNPACK takes
it; docs/benchmarks.md "bf16 matmuls"); a LoRA-adapted map adds scale·(x A) B in float32 before that
rounding, so a small adapter delta is not rounded away against a bfloat16 base output. `dot_f32` also
computes attention scores (softmax in float32) and the logits. RMSNorm, RoPE, softmax, the logits,
log-softmax and log-probs run in float32 (`decoder`, `attention`, `logprobs`). Parity budgets of bfloat16 against float32:
tests/test_bf16.py, measured in docs/benchmarks.md ("bf16 parity").
"""
from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

DTYPES = ("float32", "bfloat16")


def check_dtype(key: str, value: str) -> str:
    """`value` if it is one of `DTYPES`, else a ValueError naming `key` and the choices."""
    if value not in DTYPES:
        raise ValueError(f"{key}={value!r} is not supported; use one of {DTYPES}.")
    return value


def dot_f32(spec: str, x, w):
    """einsum(spec, x, w) accumulated and returned in float32. For inputs in a lower compute dtype its
    backward runs in that dtype, the cotangent rounded to it first: exact when the float32 result is
    rounded to that dtype right after (a LoRA-adapted map), one rounding of the gradient of attention
    scores and logits (as FlashAttention rounds dS, and a TPU's default-precision matmul rounds a
    float32 operand). Plain autodiff would meet a float32 cotangent and make the backward matmuls mixed,
    converting the other operand (a weight) to float32."""
    if x.dtype == jnp.float32:
        return jnp.einsum(spec, x, w, preferred_element_type=jnp.float32)
    return _dot_f32(spec, x, w)


@functools.partial(jax.custom_vjp, nondiff_argnums=(0,))
def _dot_f32(spec: str, x, w):
    return jnp.einsum(spec, x, w, preferred_element_type=jnp.float32)


def _dot_f32_fwd(spec, x, w):
    return _dot_f32(spec, x, w), (x, w)


def _dot_f32_bwd(spec, residuals, ct):
    _, vjp = jax.vjp(lambda x, w: jnp.einsum(spec, x, w), *residuals)
    return vjp(ct.astype(residuals[0].dtype))


_dot_f32.defvjp(_dot_f32_fwd, _dot_f32_bwd)


def set_at(array, index, values, **how):
    """`array.at[index].set(values, **how)` (`how`: e.g. mode="drop"), values cast to the array's dtype.
    A 16-bit float array is scattered as its uint16 bits (the same result): XLA CPU scatters into
    bfloat16 by converting the whole array to float32 and back at every write, which for a bf16 KV cache
    cost more than the decode step's matmuls (a profiled engine call: docs/benchmarks.md "Rollout
    engine", session 17)."""
    values = jnp.asarray(values).astype(array.dtype)
    if not (jnp.issubdtype(array.dtype, jnp.floating) and array.dtype.itemsize == 2):
        return array.at[index].set(values, **how)
    bits = jax.lax.bitcast_convert_type
    return bits(bits(array, jnp.uint16).at[index].set(bits(values, jnp.uint16), **how), array.dtype)
