"""One flax.nnx decoder for Qwen3 (q/k RMSNorm per head) and the Llama family (SmolLM2).

Layers are stored stacked (leading `layers` axis) and run under `jax.lax.scan`, so a 36-layer model
compiles as fast as a 1-layer one. Every parameter carries logical axis names (`logical_axes`)
that `marljax.core.sharding` maps onto a device mesh; activations are constrained by logical name too
(`marljax.core.sharding.constrain`, a no-op without a mesh).

The forward pass optionally takes LoRA adapters as a plain pytree (`lora`), so one frozen base serves
any number of adapter sets (one per parameter set of the role map), and, for sampling, a KV cache with the
hook that reads and writes it (the rollout engine's pages, `marljax.sampling.engine.paged_attention`); with a
cache, one batch may mix the sets, each row applying its own (`hidden`'s `lora_groups`).

Shape suffixes, the one legend of the package: an array's name ends in one lower-case letter per axis,
in order (`q_bthd` is [B, T, H, D]); docstrings and comments write the same letters upper-case. The
model letters are the initials of the logical axis names in `marljax.core.sharding`.
  b  batch rows (sequences, samples; the trainer's rows, the rollout engine's prefill and decode rows)
  t  positions of a sequence (the token axis; the queries in attention)
  s  key positions attended to: the KV cache's columns (in the uncached pass the keys are the t axis)
  p  prompt positions (the sampler's right-padded prompt block)
  r  response positions (the response window of a sequence)
  c  positions within one chunk (a decode chunk's steps; entries within a block of the vocabulary)
  n  chunks (of positions; blocks of the vocabulary)
  e  embed: the model dimension (`hidden_size`)
  h  query heads;  k  KV heads;  g  query heads per KV head (H = K·G)
  d  head dimension (`head_dim`)
  f  MLP hidden dimension (`intermediate_size`)
  v  vocabulary
  l  layers (the stacked leading axis of parameters and adapters)
  1  an axis of size one
The rollout engine's KV pages and requests (`marljax.sampling.engine`):
  a  data-parallel ranks (one page pool each)
  m  pages of a pool
  i  positions within one page (`page_size`)
  j  a page's combined KV heads, 2·K: keys at the even, values at the odd
  w  pages of a row's page table (its width)
  q  requests, in submission order
  u  words of a raw PRNG key (`jax.random.key_data`)
"""
from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
from flax import nnx
from jax.ad_checkpoint import checkpoint_name

from marljax.core import sharding
from marljax.models.attention import causal_attention, resolve_attention
from marljax.models.precision import check_dtype, dot_f32

# Linear maps of one layer: name -> (input logical axes, output logical axes).
LINEAR_AXES: dict[str, tuple[tuple[str, ...], tuple[str, ...]]] = {
    "wq": (("embed",), ("heads", "head_dim")),
    "wk": (("embed",), ("kv_heads", "head_dim")),
    "wv": (("embed",), ("kv_heads", "head_dim")),
    "wo": (("heads", "head_dim"), ("embed",)),
    "w_gate": (("embed",), ("mlp",)),
    "w_up": (("embed",), ("mlp",)),
    "w_down": (("mlp",), ("embed",)),
}


@dataclasses.dataclass(frozen=True)
class ModelConfig:
    """Architecture of a decoder-only transformer (Qwen3 when `qk_norm`, else Llama)."""

    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rope_theta: float = 1_000_000.0
    rms_norm_eps: float = 1e-6
    tie_embeddings: bool = True
    qk_norm: bool = True
    max_position: int = 40_960
    dtype: str = "float32"  # compute dtype (models/precision.py): activations, matmul inputs, KV cache
    param_dtype: str | None = None  # storage dtype of the parameters; None: `dtype`

    def __post_init__(self):
        if self.num_heads % self.num_kv_heads:
            raise ValueError(
                f"num_heads={self.num_heads} is not a multiple of num_kv_heads={self.num_kv_heads}; "
                "grouped-query attention needs an integer group size.")
        check_dtype("dtype", self.dtype)
        if self.param_dtype is not None:
            check_dtype("param_dtype", self.param_dtype)

    def linear_shape(self, name: str) -> tuple[tuple[int, ...], tuple[int, ...]]:
        """(input dims, output dims) of one layer's linear map `name`."""
        sizes = {"embed": self.hidden_size, "heads": self.num_heads, "kv_heads": self.num_kv_heads,
                 "head_dim": self.head_dim, "mlp": self.intermediate_size}
        ins, outs = LINEAR_AXES[name]
        return tuple(sizes[a] for a in ins), tuple(sizes[a] for a in outs)

    def num_params(self) -> int:
        """Parameter count, equal to transformers' count for the same architecture."""
        d, per_layer = self.hidden_size, 2 * self.hidden_size
        for name in LINEAR_AXES:
            ins, outs = self.linear_shape(name)
            per_layer += _prod(ins) * _prod(outs)
        if self.qk_norm:
            per_layer += 2 * self.head_dim
        embed = self.vocab_size * d * (1 if self.tie_embeddings else 2)
        return embed + self.num_layers * per_layer + d

    @property
    def jnp_dtype(self):
        """The compute dtype."""
        return jnp.dtype(self.dtype)

    @property
    def param_jnp_dtype(self):
        """The storage dtype of the parameters."""
        return jnp.dtype(self.param_dtype or self.dtype)


def _prod(xs) -> int:
    out = 1
    for x in xs:
        out *= x
    return out


def rms_norm(x, scale, eps):
    """RMSNorm in float32, cast back to the input dtype."""
    x32 = x.astype(jnp.float32)
    y = x32 * jax.lax.rsqrt(jnp.mean(x32 * x32, axis=-1, keepdims=True) + eps)
    return (y * scale.astype(jnp.float32)).astype(x.dtype)


def rope_tables(positions_bt, head_dim: int, theta):
    """cos and sin [B, T, 1, D/2] of the rotary angles, made once per forward pass: inside the
    (rematerialised) layer XLA would fuse them into RoPE's elementwise pass, one sin/cos per head."""
    half = head_dim // 2
    inv_freq = 1.0 / (theta ** (jnp.arange(half, dtype=jnp.float32) / half))
    angles = positions_bt.astype(jnp.float32)[:, :, None] * inv_freq  # [B, T, D/2]
    return jnp.cos(angles)[:, :, None, :], jnp.sin(angles)[:, :, None, :]


def rope(x_bthd, cos, sin):
    """Rotate-half rotary embedding (the HF/Qwen/Llama convention), computed in float32."""
    half = x_bthd.shape[-1] // 2
    x1, x2 = x_bthd[..., :half].astype(jnp.float32), x_bthd[..., half:].astype(jnp.float32)
    out = jnp.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin], axis=-1)
    return out.astype(x_bthd.dtype)


def linear(x, w, name: str, lora_layer: dict | None, lora_scale: float, n_in: int, token_groups=None):
    """x[..., *in] @ w[*in, *out], plus the LoRA term scale·(x A) B when `lora_layer` has `name`.

    Leading axes are flattened to one token axis first: a weight or adapter gradient then contracts a
    single axis, where two (batch, length) make XLA CPU transpose the whole cotangent first (fused with
    its producer at a token stride: ~25% of a SmolLM2 LoRA step).

    With `token_groups` (int32 [G]), `lora_layer` holds G adapter sets (a: [G, *in, r], b: [G, r, *out])
    and the flattened tokens are grouped by set: the first token_groups[0] use set 0, the next set 1, …;
    tokens past their sum get no LoRA term (`grouped_lora_delta`).
    """
    lead = x.shape[:-n_in]
    x = x.reshape((-1,) + x.shape[len(lead):])
    in_axes = "ijk"[:n_in]
    n_out = w.ndim - n_in
    out_axes = "xyz"[:n_out]
    spec = f"t{in_axes},{in_axes}{out_axes}->t{out_axes}"
    w = w.astype(x.dtype)
    # float32 out, rounded once to the compute dtype (models/precision.py): for bfloat16 the same numbers
    # as a bfloat16-output dot, which XLA CPU runs 3-8x slower (docs/benchmarks.md "bf16 matmuls"). The LoRA
    # delta comes first and the base product last (its float32 output consumed at once by the sum): with the
    # base product first, XLA's TPU schedule held both float32 outputs and the 4B Eval-Opt cell's update
    # grew 0.57 GiB per chip out of v5e's memory (docs/scale_out.md)
    delta = None
    if lora_layer is not None and name in lora_layer:  # the delta added in float32 before the rounding
        a, b = lora_layer[name]["a"], lora_layer[name]["b"]  # a: [(G,) *in, r], b: [(G,) r, *out]
        if token_groups is None:
            h = jnp.einsum(f"t{in_axes},{in_axes}r->tr", x, a.astype(x.dtype))
            delta = lora_scale * dot_f32(f"tr,r{out_axes}->t{out_axes}", h, b.astype(x.dtype))
        else:  # in and out axes as one each: wq's out is [H, D], wo's in is [H, D]
            G, r = a.shape[0], a.shape[-1]
            delta = lora_scale * grouped_lora_delta(
                x.reshape(x.shape[0], -1), a.reshape(G, -1, r).astype(x.dtype),
                b.reshape(G, r, -1).astype(x.dtype), token_groups).reshape(x.shape[:1] + w.shape[n_in:])
    y = dot_f32(spec, x, w) if delta is None else dot_f32(spec, x, w) + delta
    y = y.astype(x.dtype)
    if x.dtype != jnp.float32:  # remat's `dots` keeps it: it does not see dot_f32's custom-VJP matmul
        y = checkpoint_name(y, LINEAR_OUTPUT)
    return y.reshape(lead + y.shape[1:])


def grouped_lora_delta(x_ni, a_gir, b_gro, groups_g):
    """(x A[g]) B[g] in float32 for each token n of set g: tokens sorted by set, `groups_g` int32 [G] of
    them per set (N ≥ their sum; the tokens past it get 0). Two `jax.lax.ragged_dot`s, x A[g] in the
    compute dtype as the single-set branch's; the padding is zeroed explicitly, as backends' kernels need
    not write rows outside every group. TPU and GPU lower ragged_dot to XLA's ragged-dot instruction (a
    grouped matmul: each token's own set only); CPU expands it to every set on masked tokens (G× the
    adapter FLOPs), which at decode shapes still beats gathering each row's A and B (B copies of the
    adapters) and ties with masking every set's delta; gathering wins only for few long rows (prefill):
    bench/lora_rows.py, docs/benchmarks.md "Per-row LoRA".

    On a mesh (`sharding.use_mesh`) with R batch ranks it runs once per batch shard: the tokens come in R
    equal rank blocks and the sets once per rank, rank-major (G = R × sets; the rollout engine's
    `batch.block_groups`), so each chip multiplies its own tokens by its own rank's sets. Left to
    XLA's partitioner, every chip all-gathers every rank's adapters per layer, and at prefill every
    rank's tokens too (compiled for v5e-8: docs/scale_out.md)."""
    ranks = sharding.active_batch_ranks()
    if groups_g.shape[0] % ranks or x_ni.shape[0] % ranks:
        raise ValueError(f"per-row adapters on a mesh of {ranks} batch ranks need the sets stacked once per rank "
                         f"and the tokens in {ranks} equal rank blocks (engine.batch.block_groups); got "
                         f"{groups_g.shape[0]} stacked sets for {x_ni.shape[0]} tokens.")
    return sharding.shard_map_logical(_grouped_lora_delta, (x_ni, a_gir, b_gro, groups_g),
                                      (("batch", None), ("batch", None, None), ("batch", None, None), ("batch",)),
                                      ("batch", None))


def _grouped_lora_delta(x_ni, a_gir, b_gro, groups_g):
    h_nr = jax.lax.ragged_dot(x_ni, a_gir, groups_g)
    d_no = jax.lax.ragged_dot(h_nr, b_gro, groups_g, preferred_element_type=jnp.float32)
    real_n = jnp.arange(x_ni.shape[0]) < jnp.sum(groups_g)
    return jnp.where(real_n[:, None], d_no, 0.0)


class Decoder(nnx.Module):
    """Token ids [B, T] → logits [B, T, V]; see module docstring for the cache and LoRA inputs."""

    def __init__(self, config: ModelConfig, *, rngs: nnx.Rngs):
        self.config = c = config
        dt = c.param_jnp_dtype
        init = jax.nn.initializers.normal(0.02)
        L = c.num_layers

        def param(shape, axes, key=None, ones=False):
            value = jnp.ones(shape, dt) if ones else init(key if key is not None else rngs.params(),
                                                         shape, dt)
            return nnx.Param(value, logical_axes=axes)

        self.embed = param((c.vocab_size, c.hidden_size), ("vocab", "embed"))
        layers: dict[str, nnx.Param] = {
            "attn_norm": param((L, c.hidden_size), ("layers", "embed"), ones=True),
            "mlp_norm": param((L, c.hidden_size), ("layers", "embed"), ones=True),
        }
        for name, (ins, outs) in LINEAR_AXES.items():
            in_dims, out_dims = c.linear_shape(name)
            layers[name] = param((L, *in_dims, *out_dims), ("layers", *ins, *outs))
        if c.qk_norm:
            layers["q_norm"] = param((L, c.head_dim), ("layers", "head_dim"), ones=True)
            layers["k_norm"] = param((L, c.head_dim), ("layers", "head_dim"), ones=True)
        self.layers = nnx.Dict(layers)
        self.final_norm = param((c.hidden_size,), ("embed",), ones=True)
        if not c.tie_embeddings:
            self.lm_head = param((c.hidden_size, c.vocab_size), ("embed", "vocab"))

    # ---- forward -------------------------------------------------------------------------------
    def __call__(self, tokens_bt, positions_bt=None, *, lora=None, lora_scale=1.0, kv_mask_bs=None):
        """Logits [B, T, V] of the uncached pass (`hidden`)."""
        h, _ = self.hidden(tokens_bt, positions_bt, lora=lora, lora_scale=lora_scale, kv_mask_bs=kv_mask_bs)
        return self.logits(h)

    def logits(self, h_bte):
        """Final norm + (tied) output projection, float32 logits (float32 accumulation)."""
        c = self.config
        h = rms_norm(h_bte, self.final_norm[...], c.rms_norm_eps)
        if c.tie_embeddings:  # contract with the [V, E] table as stored: no transposed copy per call
            logits = dot_f32("...e,ve->...v", h, self.embed[...].astype(h.dtype))
        else:
            logits = dot_f32("...e,ev->...v", h, self.lm_head[...].astype(h.dtype))
        return sharding.constrain(logits, ("batch", *("length",) * (logits.ndim - 2), "act_vocab"))

    def hidden(self, tokens_bt, positions_bt=None, *, cache=None, cache_attention=None, lora=None,
               lora_scale=1.0, kv_mask_bs=None, remat: str = "none", layers=None, attention_impl: str = "auto",
               lora_groups=None):
        """Last hidden states [B, T, E] (before the final norm) and the updated cache (or None).

        Uncached (training, scoring): the stacked layers run under `lax.scan` and attention is causal
        over the T tokens (`kv_mask_bs` [B, T] may mark padded keys); `remat` (see `REMAT`) trades
        backward-pass recomputation for activation memory, and `attention_impl` (`attention.ATTENTIONS`)
        picks the attention kernel (`auto`: by backend and T; dense for short T on CPU).

        Cached (the rollout engine): `cache` holds one state per layer and `cache_attention(q, k, v, kv,
        positions_bt) -> (attn, new_kv)` writes the T new keys and values of row b at its positions
        positions_bt[b] and attends every key at a position ≤ the query's own (the engine's KV pages,
        `marljax.sampling.engine.paged_attention`). The layers run as a Python loop over per-layer weights: a scan
        would copy each layer's weight and cache slices out of the stacked arrays on every step. Pass
        `layers=self.layer_list()`, made once outside a decode loop, to read those weights in place.

        Per-row adapters (cached path only): `lora` holds G parameter sets stacked on a leading axis
        (`lora.stack_adapters`: a [G, n, *in, r], b [G, n, r, *out]) and `lora_groups` (int32 [G], traced)
        says how many rows each set has: rows are sorted by set (rows 0 … g0 − 1 set 0, then set 1, …),
        every row adds its own set's scale·(x A) B to the shared base weights (no merged copy per set),
        and the rows past sum(lora_groups) ≤ B (padding) run the base alone.
        """
        c = self.config
        B, T = tokens_bt.shape
        if (cache is None) != (cache_attention is None):
            raise ValueError("the cached path takes `cache` and `cache_attention` together (the rollout engine's "
                             "pages and hook, marljax.sampling.engine.paged_attention); the uncached pass takes neither.")
        token_groups = None if lora_groups is None else _token_groups(lora, lora_groups, cache, T)
        if positions_bt is None:
            positions_bt = jnp.broadcast_to(jnp.arange(T, dtype=jnp.int32), (B, T))
        x = jnp.take(self.embed[...], tokens_bt, axis=0).astype(c.jnp_dtype)  # the residual stream
        x = sharding.constrain(x, ("batch", "length", "act_embed"))
        impl = None if cache is not None else resolve_attention(attention_impl, T, c.jnp_dtype)
        rot = rope_tables(positions_bt, c.head_dim, c.rope_theta)

        def block(x, p, lora_l, kv):
            def lin(x, name, n_in=1):
                return linear(x, p[name], name, lora_l, lora_scale, n_in, token_groups)

            h = rms_norm(x, p["attn_norm"], c.rms_norm_eps)
            q = sharding.constrain(lin(h, "wq"), _HEADS)
            k = sharding.constrain(lin(h, "wk"), _KV_HEADS)
            v = sharding.constrain(lin(h, "wv"), _KV_HEADS)
            if c.qk_norm:
                q = rms_norm(q, p["q_norm"], c.rms_norm_eps)
                k = rms_norm(k, p["k_norm"], c.rms_norm_eps)
            q, k = rope(q, *rot), rope(k, *rot)
            if kv is None:
                attn = causal_attention(q, k, v, positions_bt, kv_mask_bs, impl)
            else:
                attn, kv = cache_attention(q, k, v, kv, positions_bt)
            attn = sharding.constrain(attn, _HEADS)
            x = x + lin(attn, "wo", 2)
            h = rms_norm(x, p["mlp_norm"], c.rms_norm_eps)
            gate = lin(h, "w_gate")
            up = lin(h, "w_up")
            act = sharding.constrain(jax.nn.silu(gate) * up, ("batch", "length", "act_mlp"))
            x = x + lin(act, "w_down")
            return sharding.constrain(x, ("batch", "length", "act_embed")), kv

        layer_axis = 0 if lora_groups is None else 1  # stacked sets: [G, n, …]
        n_adapted = c.num_layers if lora is None else jax.tree.leaves(lora)[0].shape[layer_axis]
        split = c.num_layers - n_adapted  # adapters cover the last n_adapted layers
        if cache is not None:
            return self._cached_layers(block, x, cache, layers, lora, split, layer_axis)
        return self._scanned_layers(block, x, lora, split, remat), None

    def _cached_layers(self, block, x, cache, layers, lora, split: int, layer_axis: int):
        """The cached path's layers: a Python loop over per-layer weights (`layers`, else sliced here),
        adapters on the layers from `split` on (sets stacked before the layer axis when `layer_axis` = 1)."""
        layers = self.layer_list() if layers is None else layers
        new_cache = []
        for i, p in enumerate(layers):
            at = (slice(None),) * layer_axis + (i - split,)
            lora_l = None if lora is None or i < split else jax.tree.map(lambda a: a[at], lora)
            x, kv = block(x, p, lora_l, cache[i])
            new_cache.append(kv)
        return x, new_cache

    def _scanned_layers(self, block, x, lora, split: int, remat: str):
        """The uncached path's layers under `lax.scan` with `remat`, adapters on the layers from `split` on."""
        def scan_block(x, xs):
            return block(x, *xs, None)[0], None

        if remat not in REMAT:
            raise ValueError(f"remat={remat!r}; choose from {sorted(REMAT)}.")
        if REMAT[remat] is not None:
            scan_block = jax.checkpoint(scan_block, policy=REMAT[remat])
        layer_params = {k: v[...] for k, v in self.layers.items()}
        if split:  # adapters on the last n layers only: the frozen bottom runs without them, and its
            # activations are constants for the adapters' gradient (no backward pass through it)
            x, _ = jax.lax.scan(scan_block, x, (jax.tree.map(lambda a: a[:split], layer_params), None))
        x, _ = jax.lax.scan(scan_block, x, (jax.tree.map(lambda a: a[split:], layer_params), lora))
        return x

    def layer_list(self) -> list[dict]:
        """Per-layer weights {name: array} sliced out of the stacked parameters (for the cached path),
        linear maps in the compute dtype (what `linear` reads them as; norm scales as stored)."""
        dt = self.config.jnp_dtype
        stacked = {k: v[...].astype(dt) if k in LINEAR_AXES else v[...] for k, v in self.layers.items()}
        return [{k: v[i] for k, v in stacked.items()} for i in range(self.config.num_layers)]


def trainable_params(model: Decoder) -> nnx.State:
    """float32 copies of `model`'s parameters: full fine-tuning's trainable state (its master weights,
    models/precision.py), whatever their storage dtype."""
    return jax.tree.map(lambda x: jnp.array(x, jnp.float32), nnx.state(model, nnx.Param))


LINEAR_OUTPUT = "linear_output"  # checkpoint name of a linear map's output in bfloat16

# Activation rematerialisation in the backward pass: what each layer keeps from its forward pass.
REMAT = {
    "full": jax.checkpoint_policies.nothing_saveable,  # memory ∝ layers × B·T·E; one more forward
    # keep the linear maps' outputs (q, k, v, o, gate, up, down: 9·E floats per token and layer for
    # SmolLM2); only norms, RoPE, attention and the MLP activation are recomputed
    "dots": jax.checkpoint_policies.save_from_both_policies(
        jax.checkpoint_policies.dots_with_no_batch_dims_saveable,
        jax.checkpoint_policies.save_only_these_names(LINEAR_OUTPUT)),
    "none": None,  # keep everything, attention probabilities included (∝ layers × B·heads·T²)
}


def _token_groups(lora, lora_groups, cache, tokens_per_row: int):
    """Per-set token counts of the flattened [B·T] tokens (each row's T tokens are contiguous), after
    checking that `lora_groups` comes with a cache and one count per stacked set."""
    if cache is None:
        raise ValueError("lora_groups (per-row adapters) needs the cached path: pass `cache` and `cache_attention` "
                         "(the engine's pages and hook); the uncached pass takes one adapter set (`lora`).")
    if lora is None:
        raise ValueError("lora_groups needs `lora`: the sets' adapters stacked by lora.stack_adapters.")
    sets = jax.tree.leaves(lora)[0].shape[0]
    if jnp.shape(lora_groups) != (sets,):
        raise ValueError(f"lora_groups has shape {jnp.shape(lora_groups)}; the stacked adapters hold {sets} "
                         f"sets, so it needs one row count per set: shape ({sets},).")
    return jnp.asarray(lora_groups, jnp.int32) * tokens_per_row


_HEADS = ("batch", "length", "act_heads", "head_dim")
_KV_HEADS = ("batch", "length", "act_kv_heads", "head_dim")
