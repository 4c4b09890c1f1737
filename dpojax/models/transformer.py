"""The Llama-family decoder in Flax NNX (Llama 2/3, Mistral, Qwen2/2.5, Qwen3).

`CausalLM(config, rngs=...)(tokens)` returns float32 logits [B, T, V]; `return_hidden=True` returns
the final (normed) hidden states [B, T, D] instead, so log-probs can be computed in chunks against
`lm_head_weight()` without materialising the full logits.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx

from dpojax.models import attention
from dpojax.models.attention.rule import TokenIds
from dpojax.models.layers import (
    Dense,
    LoRAParam,
    RMSNorm,
    apply_rope,
    rope_cos_sin,
    rope_inv_freq,
)
from dpojax.models.model_config import ModelConfig

_REMAT_POLICIES = {
    "full": None,
    "dots": jax.checkpoint_policies.checkpoint_dots,
    "dots_no_batch": jax.checkpoint_policies.checkpoint_dots_with_no_batch_dims,
    # everything recomputed but the flash / Pallas attention's output and log-sum-exp: the
    # backward pass never reruns the attention kernel (the reference attention reruns in full)
    "attention": jax.checkpoint_policies.save_only_these_names("attention_out", "attention_lse"),
}


def _lora(config: ModelConfig, name: str) -> dict:
    if config.lora_rank and name in config.lora_targets:
        return dict(lora_rank=config.lora_rank, lora_alpha=config.lora_alpha)
    return {}


class Attention(nnx.Module):
    def __init__(self, config: ModelConfig, *, rngs: nnx.Rngs):
        d, hd = config.hidden_size, config.resolved_head_dim
        h, k = config.num_heads, config.num_kv_heads
        dt, pdt = jnp.dtype(config.dtype), jnp.dtype(config.param_dtype)
        kw = dict(dtype=dt, param_dtype=pdt, rngs=rngs)
        self.q_proj = Dense(
            d,
            h * hd,
            axes=("embed", "heads"),
            use_bias=config.qkv_bias,
            **kw,
            **_lora(config, "q_proj"),
        )
        self.k_proj = Dense(
            d,
            k * hd,
            axes=("embed", "kv_heads"),
            use_bias=config.qkv_bias,
            **kw,
            **_lora(config, "k_proj"),
        )
        self.v_proj = Dense(
            d,
            k * hd,
            axes=("embed", "kv_heads"),
            use_bias=config.qkv_bias,
            **kw,
            **_lora(config, "v_proj"),
        )
        self.o_proj = Dense(
            h * hd,
            d,
            axes=("heads", "embed"),
            use_bias=config.o_bias,
            **kw,
            **_lora(config, "o_proj"),
        )
        if config.qk_norm:
            norm_kw = dict(eps=config.rms_norm_eps, axis_name="head_dim", dtype=dt, param_dtype=pdt)
            self.q_norm = RMSNorm(hd, **norm_kw)
            self.k_norm = RMSNorm(hd, **norm_kw)
        else:
            self.q_norm = self.k_norm = None
        self.num_heads, self.num_kv_heads, self.head_dim = h, k, hd

    def qkv(self, x, cos, sin):
        """Projected, normed (q/k norm) and rotated q [B, T, H, D], k and v [B, T, K, D]."""
        b, t, _ = x.shape
        q = self.q_proj(x).reshape(b, t, self.num_heads, self.head_dim)
        k = self.k_proj(x).reshape(b, t, self.num_kv_heads, self.head_dim)
        v = self.v_proj(x).reshape(b, t, self.num_kv_heads, self.head_dim)
        if self.q_norm is not None:
            q, k = self.q_norm(q), self.k_norm(k)
        return apply_rope(q, cos, sin), apply_rope(k, cos, sin), v

    def __call__(self, x, rows: attention.Rows, cos, sin, sliding: bool):
        b, t, _ = x.shape
        q, k, v = self.qkv(x, cos, sin)
        out = attention.attend(rows, q, k, v, scale=self.head_dim**-0.5, sliding=sliding)
        return self.o_proj(out.reshape(b, t, self.num_heads * self.head_dim))


class MLP(nnx.Module):
    def __init__(self, config: ModelConfig, *, rngs: nnx.Rngs):
        d, f = config.hidden_size, config.intermediate_size
        kw = dict(
            use_bias=config.mlp_bias,
            dtype=jnp.dtype(config.dtype),
            param_dtype=jnp.dtype(config.param_dtype),
            rngs=rngs,
        )
        self.gate_proj = Dense(d, f, axes=("embed", "mlp"), **kw, **_lora(config, "gate_proj"))
        self.up_proj = Dense(d, f, axes=("embed", "mlp"), **kw, **_lora(config, "up_proj"))
        self.down_proj = Dense(f, d, axes=("mlp", "embed"), **kw, **_lora(config, "down_proj"))

    def __call__(self, x):
        return self.down_proj(jax.nn.silu(self.gate_proj(x)) * self.up_proj(x))


class DecoderLayer(nnx.Module):
    def __init__(self, config: ModelConfig, index: int, *, rngs: nnx.Rngs):
        norm_kw = dict(
            eps=config.rms_norm_eps,
            dtype=jnp.dtype(config.dtype),
            param_dtype=jnp.dtype(config.param_dtype),
        )
        self.input_layernorm = RMSNorm(config.hidden_size, **norm_kw)
        self.self_attn = Attention(config, rngs=rngs)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, **norm_kw)
        self.mlp = MLP(config, rngs=rngs)
        self.sliding = config.layer_is_sliding(index)

    def __call__(self, x, rows: attention.Rows, cos, sin):
        x = x + self.self_attn(self.input_layernorm(x), rows, cos, sin, self.sliding)
        return x + self.mlp(self.post_attention_layernorm(x))


def _layer_forward(layer: DecoderLayer, x, rows: attention.Rows, cos, sin):
    return layer(x, rows, cos, sin)


class CausalLM(nnx.Module):
    """Decoder-only transformer with an LM head (tied to the embedding or separate)."""

    def __init__(self, config: ModelConfig, *, rngs: nnx.Rngs):
        self.config = config
        pdt = jnp.dtype(config.param_dtype)
        emb = 0.02 * jax.random.normal(rngs.params(), (config.vocab_size, config.hidden_size))
        self.embed_tokens = nnx.Param(emb.astype(pdt), logical_axes=("vocab", "embed"))
        self.layers = nnx.List(
            [DecoderLayer(config, i, rngs=rngs) for i in range(config.num_layers)]
        )
        self.norm = RMSNorm(
            config.hidden_size,
            eps=config.rms_norm_eps,
            dtype=jnp.dtype(config.dtype),
            param_dtype=pdt,
        )
        if config.tie_word_embeddings:
            self.lm_head = None
        else:
            head = 0.02 * jax.random.normal(rngs.params(), (config.vocab_size, config.hidden_size))
            self.lm_head = nnx.Param(head.astype(pdt), logical_axes=("vocab", "embed"))

    def lm_head_weight(self) -> jax.Array:
        """The output projection [V, D] (the embedding when tied)."""
        return (self.embed_tokens if self.lm_head is None else self.lm_head)[...]

    def logits(self, hidden: jax.Array) -> jax.Array:
        """float32 logits [..., V] from hidden states [..., D]."""
        w = self.lm_head_weight().astype(hidden.dtype)
        flat = hidden.reshape(-1, hidden.shape[-1])  # a 2-D dot, as in `Dense`
        logits = jnp.einsum("nd,vd->nv", flat, w, preferred_element_type=jnp.float32)
        return logits.reshape(*hidden.shape[:-1], w.shape[0])

    def __call__(
        self,
        tokens: jax.Array,
        *,
        positions: jax.Array | None = None,
        segment_ids: jax.Array | None = None,
        parts: jax.Array | None = None,
        return_hidden: bool = False,
    ) -> jax.Array:
        """tokens int[B, T] -> float32 logits [B, T, V] (or hidden states [B, T, D]).

        `positions`, `segment_ids` and `parts` (all int[B, T]) describe packed or prefix-shared
        rows (docs/layouts.md); left out, the row is one causal sequence at positions 0..T-1.
        """
        config = self.config
        dtype = jnp.dtype(config.dtype)
        b, t = tokens.shape
        ids = TokenIds.of(b, t, positions=positions, segment_ids=segment_ids, parts=parts)
        positions = ids.positions
        platform = config.target_platform or None
        implementation = attention.resolve(config.attention, platform, length=t)
        rows = attention.rows(implementation, ids, config.sliding_window, platform=platform)
        inv_freq = rope_inv_freq(config.resolved_head_dim, config.rope_theta, config.rope_params)
        cos, sin = rope_cos_sin(positions, inv_freq, dtype)
        x = jnp.take(self.embed_tokens[...], tokens, axis=0).astype(dtype)
        forward = _layer_forward
        if config.remat != "none":
            forward = nnx.remat(_layer_forward, policy=_REMAT_POLICIES[config.remat])
        for layer in self.layers:
            x = forward(layer, x, rows, cos, sin)
        x = self.norm(x)
        return x if return_hidden else self.logits(x)


def init_model(config: ModelConfig, seed: int = 0) -> CausalLM:
    """A randomly initialised model (normal(0.02) weights, unit norms, zero biases)."""
    return CausalLM(config, rngs=nnx.Rngs(params=seed, lora=seed + 1))


def abstract_model(config: ModelConfig) -> CausalLM:
    """The model with ShapeDtypeStruct leaves: no memory, no compute (for sharding and loading)."""
    return nnx.eval_shape(lambda: CausalLM(config, rngs=nnx.Rngs(params=0, lora=1)))


def add_lora(
    model: CausalLM,
    rank: int,
    alpha: float = 16.0,
    targets: tuple[str, ...] = ("q_proj", "k_proj", "v_proj", "o_proj"),
    seed: int = 0,
) -> CausalLM:
    """A model sharing `model`'s base weights with fresh LoRA adapters (lora_b = 0, so its outputs
    equal the base model's). Only the adapter factors are allocated."""
    config = model.config.replace(lora_rank=rank, lora_alpha=alpha, lora_targets=tuple(targets))
    graphdef = nnx.graphdef(abstract_model(config))

    @jax.jit
    def init_adapters():
        fresh = CausalLM(config, rngs=nnx.Rngs(params=0, lora=seed))
        return nnx.state(fresh, LoRAParam)

    lora = init_adapters()  # XLA drops the unused base initialisation
    return nnx.merge(graphdef, lora, nnx.state(model, nnx.Param))


def merge_lora(model: CausalLM) -> CausalLM:
    """A plain model (no adapters) whose kernels are W + lora_a @ lora_b * alpha / rank."""
    config = model.config
    if not config.lora_rank:
        return model
    plain = config.replace(lora_rank=0)
    merged = []
    for path, var in nnx.to_flat_state(nnx.state(model, nnx.Param)):
        if isinstance(var, LoRAParam):
            continue
        value = var.get_value()
        if path[-1] == "kernel" and path[-2] in config.lora_targets:
            owner = model
            for key in path[:-1]:
                owner = owner[key] if isinstance(key, int) else getattr(owner, key)
            delta = jnp.dot(
                owner.lora_a[...].astype(jnp.float32), owner.lora_b[...].astype(jnp.float32)
            )
            value = (value.astype(jnp.float32) + delta * owner.lora_scale).astype(value.dtype)
        merged.append((path, var.replace(value)))
    return nnx.merge(nnx.graphdef(abstract_model(plain)), nnx.from_flat_state(merged))
