"""Building blocks of the decoder: dense, RMSNorm, rotary embeddings and the attention rule.

Every parameter carries `logical_axes` metadata (see `dpojax.models.sharding`). Parameters are stored
in `param_dtype` and cast to the compute `dtype` where they are used.
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

# ---------------------------------------------------------------------------------------------
# Parameterised layers


class LoRAParam(nnx.Param):
    """A LoRA adapter factor: trainable when the base parameters are frozen."""


class Dense(nnx.Module):
    """y = x @ kernel (+ bias) (+ LoRA: x @ lora_a @ lora_b * alpha / rank), kernel [in, out].

    lora_a [in, r] starts random (scaled like PEFT's default) and lora_b [r, out] at zero, so a
    freshly added adapter leaves the output unchanged."""

    def __init__(
        self,
        in_features: int,
        out_features: int,
        *,
        axes: tuple[str, str],
        use_bias: bool = False,
        dtype=jnp.float32,
        param_dtype=jnp.float32,
        rngs: nnx.Rngs,
        init_std: float = 0.02,
        lora_rank: int = 0,
        lora_alpha: float = 16.0,
    ):
        kernel = init_std * jax.random.normal(rngs.params(), (in_features, out_features))
        self.kernel = nnx.Param(kernel.astype(param_dtype), logical_axes=axes)
        self.bias = (
            nnx.Param(jnp.zeros((out_features,), param_dtype), logical_axes=(axes[1],))
            if use_bias
            else None
        )
        self.dtype = dtype
        if lora_rank:
            bound = 1.0 / math.sqrt(in_features)
            a = jax.random.uniform(
                rngs.lora(), (in_features, lora_rank), minval=-bound, maxval=bound
            )
            self.lora_a = LoRAParam(a.astype(param_dtype), logical_axes=(axes[0], "lora"))
            self.lora_b = LoRAParam(
                jnp.zeros((lora_rank, out_features), param_dtype), logical_axes=("lora", axes[1])
            )
            self.lora_scale = lora_alpha / lora_rank
        else:
            self.lora_a = self.lora_b = None

    def __call__(self, x: jax.Array) -> jax.Array:
        # The leading dims are merged into one, so each matmul is a plain 2-D [N, in] @ [in, out]
        # dot, whose gradient XLA's CPU backend runs at least as fast as with a [B, T, in] operand
        # (tic-tac-toe recipe step, 128 pairs: 0.120 -> 0.111 s; 64 pairs: equal; benchmarks.md).
        lead = x.shape[:-1]
        x = x.reshape(-1, x.shape[-1]).astype(self.dtype)
        y = jnp.dot(x, self.kernel[...].astype(self.dtype))
        if self.bias is not None:
            y = y + self.bias[...].astype(self.dtype)
        if self.lora_a is not None:
            low = jnp.dot(x, self.lora_a[...].astype(self.dtype))
            y = y + jnp.dot(low, self.lora_b[...].astype(self.dtype)) * self.lora_scale
        return y.reshape(*lead, y.shape[-1])


class RMSNorm(nnx.Module):
    """x / rms(x) * weight, the normalisation computed in float32 like the HF models.

    `plus_one` (Gemma): the weight is stored as an offset from 1 (initialised at 0) and applied
    as x / rms(x) * (1 + weight) in float32 before the cast, as Gemma's norms do."""

    def __init__(
        self,
        size: int,
        *,
        eps: float,
        axis_name: str = "norm",
        dtype=jnp.float32,
        param_dtype=jnp.float32,
        plus_one: bool = False,
    ):
        init = jnp.zeros if plus_one else jnp.ones
        self.weight = nnx.Param(init((size,), param_dtype), logical_axes=(axis_name,))
        self.eps = eps
        self.dtype = dtype
        self.plus_one = plus_one

    def __call__(self, x: jax.Array) -> jax.Array:
        x32 = x.astype(jnp.float32)
        x32 = x32 * jax.lax.rsqrt(jnp.mean(x32 * x32, axis=-1, keepdims=True) + self.eps)
        if self.plus_one:
            return (x32 * (1.0 + self.weight[...].astype(jnp.float32))).astype(self.dtype)
        return self.weight[...].astype(self.dtype) * x32.astype(self.dtype)


def activation(name: str):
    """The gated MLP's activation: "silu" or "gelu_tanh" (HF's gelu_pytorch_tanh)."""
    if name == "gelu_tanh":
        return lambda x: jax.nn.gelu(x, approximate=True)
    return jax.nn.silu


def softcap(x: jax.Array, cap: float | None) -> jax.Array:
    """cap * tanh(x / cap) (Gemma's soft-capping of attention scores and logits); x if no cap."""
    return x if not cap else cap * jnp.tanh(x / cap)


# ---------------------------------------------------------------------------------------------
# Rotary position embeddings


def rope_inv_freq(head_dim: int, theta: float, rope_params: dict) -> np.ndarray:
    """Inverse frequencies [head_dim // 2] (float32), with linear or llama3 scaling applied."""
    exponents = np.arange(0, head_dim, 2, dtype=np.int64).astype(np.float32) / head_dim
    inv_freq = (1.0 / (np.float32(theta) ** exponents)).astype(np.float32)
    rope_type = rope_params.get("rope_type", "default")
    if rope_type == "linear":
        inv_freq = inv_freq / np.float32(rope_params["factor"])
    elif rope_type == "llama3":
        factor = rope_params["factor"]
        low, high = rope_params["low_freq_factor"], rope_params["high_freq_factor"]
        old_len = rope_params["original_max_position_embeddings"]
        wavelen = 2 * math.pi / inv_freq
        scaled = np.where(wavelen > old_len / low, inv_freq / factor, inv_freq)
        smooth = (old_len / wavelen - low) / (high - low)
        smoothed = (1 - smooth) * scaled / factor + smooth * scaled
        medium = (wavelen >= old_len / high) & (wavelen <= old_len / low)
        inv_freq = np.where(medium, smoothed, scaled).astype(np.float32)
    return inv_freq


def rope_cos_sin(positions: jax.Array, inv_freq: np.ndarray, dtype) -> tuple[jax.Array, jax.Array]:
    """cos and sin tables [B, T, head_dim] for integer positions [B, T]."""
    angles = positions.astype(jnp.float32)[..., None] * jnp.asarray(inv_freq)[None, None, :]
    angles = jnp.concatenate([angles, angles], axis=-1)
    return jnp.cos(angles).astype(dtype), jnp.sin(angles).astype(dtype)


def apply_rope(x: jax.Array, cos: jax.Array, sin: jax.Array) -> jax.Array:
    """Rotates x [B, T, H, D] by the position tables [B, T, R] (the half-split convention of HF
    Llama); with R < D (a partial rotary factor) only the first R dimensions turn."""
    rotary = cos.shape[-1]
    if rotary < x.shape[-1]:
        return jnp.concatenate([apply_rope(x[..., :rotary], cos, sin), x[..., rotary:]], axis=-1)
    half = x.shape[-1] // 2
    rotated = jnp.concatenate([-x[..., half:], x[..., :half]], axis=-1)
    return x * cos[:, :, None, :] + rotated * sin[:, :, None, :]


# ---------------------------------------------------------------------------------------------
# The attention rule


def attention_mask(
    batch: int,
    length: int,
    *,
    positions: jax.Array | None = None,
    segment_ids: jax.Array | None = None,
    parts: jax.Array | None = None,
    sliding_window: int | None = None,
) -> jax.Array:
    """Boolean mask [B, T, T]: token i may attend token j.

    The rule of every batch layout (docs/layouts.md#the-attention-rule): j <= i in the row, same
    segment, and part[j] is the prompt (0) or part[j] == part[i]. With a sliding window, also positions[i] - positions[j] <
    window. Every token may attend itself, so no row of the mask is empty.
    """
    idx = jnp.arange(length)
    mask = jnp.broadcast_to(idx[None, :] <= idx[:, None], (batch, length, length))
    if segment_ids is not None:
        mask = mask & (segment_ids[:, :, None] == segment_ids[:, None, :])
    if parts is not None:
        mask = mask & ((parts[:, None, :] == 0) | (parts[:, :, None] == parts[:, None, :]))
    if sliding_window:
        if positions is None:
            positions = jnp.broadcast_to(idx, (batch, length))
        mask = mask & (positions[:, :, None] - positions[:, None, :] < sliding_window)
    return mask


def causal_block(length: int, *, min_block: int | None = None, max_blocks: int = 8) -> int:
    """The query block of `dot_product_attention(..., causal=True)` for rows of `length` tokens: a
    multiple of `min_block`, at most `max_blocks` blocks (each block is its own pair of einsums
    in the compiled step); `length` itself (one block) below two blocks.

    `min_block` defaults to 64 for rows under 256 tokens and 128 from there: smaller blocks skip
    more masked keys, larger ones run larger matmuls and slice q, k and v fewer times
    (docs/benchmarks.md has the measurements behind the choice)."""
    if min_block is None:
        min_block = 64 if length < 256 else 128
    block = min_block * -(-length // (min_block * max_blocks))
    return block if length >= 2 * block else length


def dot_product_attention(
    q: jax.Array,
    k: jax.Array,
    v: jax.Array,
    mask: jax.Array,
    scale: float,
    *,
    causal: bool = False,
    cap: float | None = None,
) -> jax.Array:
    """Grouped-query attention. q [B, T, H, D], k and v [B, S, K, D] with H % K == 0, mask
    [B, T, S]. Scores and softmax in float32; returns [B, T, H, D] in q's dtype. `cap`
    soft-caps the scaled scores (`softcap`) before the mask, as Gemma 2 does.

    `causal=True` promises that the mask allows only keys j <= i to query i (T == S, as every
    `attention_mask` does): the queries are then taken in blocks (`causal_block`) and each block
    scores only the keys up to its end, the rest being masked anyway. The result is the same (the
    skipped keys' probabilities are exactly 0), with about half the attention work and memory
    traffic on long rows (3 blocks of 128 for 384 tokens: 67% of the score entries; 8 blocks of
    256 for 2,048 tokens: 56%).

    q, k and v are transposed once to head-major order ([B, K, G, T, D] and [B, K, S, D]), so
    every block's einsums read contiguous slices and write [B, K, G, t, D] directly; the result
    is transposed back once. Taking the blocks in the token-major input instead costs a transpose
    per block and operand, forward and backward (large model, `[8, 384]` rows, one layer's
    attention core: 40 -> 32 ms forward, 94 -> 73 ms gradient; docs/benchmarks.md)."""
    b, t, h, d = q.shape
    kv_heads = k.shape[2]
    groups = h // kv_heads
    block = causal_block(t) if causal and k.shape[1] == t else t
    # head-major operands; with one query head per KV head the group axis is left out (a size-1
    # axis in the einsums makes XLA's CPU backend add copies around every block's dots)
    g = "g" if groups > 1 else ""
    if g:
        qh = q.reshape(b, t, kv_heads, groups, d).transpose(0, 2, 3, 1, 4)  # [B, K, G, T, D]
        mask = mask[:, None, None]
    else:
        qh = q.transpose(0, 2, 1, 3)  # [B, K, T, D]
        mask = mask[:, None]
    kh, vh = k.transpose(0, 2, 1, 3), v.transpose(0, 2, 1, 3)  # [B, K, S, D]
    outs = []
    for start in range(0, t, block):
        end = min(start + block, t)
        keys = end if block < t else k.shape[1]
        scores = jnp.einsum(
            f"bk{g}td,bksd->bk{g}ts",
            qh[..., start:end, :],
            kh[:, :, :keys],
            preferred_element_type=jnp.float32,
        )
        scores = softcap(scores * scale, cap)
        scores = jnp.where(mask[..., start:end, :keys], scores, jnp.finfo(jnp.float32).min)
        probs = jax.nn.softmax(scores, axis=-1).astype(v.dtype)
        outs.append(jnp.einsum(f"bk{g}ts,bksd->bk{g}td", probs, vh[:, :, :keys]))
    out = outs[0] if len(outs) == 1 else jnp.concatenate(outs, axis=-2)
    out = out.transpose(0, 3, 1, 2, 4) if g else out.transpose(0, 2, 1, 3)  # [B, T, K, (G,) D]
    return out.reshape(b, t, h, d)
