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

from dpojax.models import quant as quantization
from dpojax.models.sharding import GATHERED_RULES, constrain, context_size

# ---------------------------------------------------------------------------------------------
# Parameterised layers


class LoRAParam(nnx.Param):
    """A LoRA adapter factor: trainable when the base parameters are frozen."""


class QuantParam(nnx.Param):
    """A quantized frozen weight's codes or scales (`dpojax.models.quant`): never trained (the
    base under LoRA is frozen), so `split_policy` puts it with the frozen parameters."""


# Jitted, so that a traced construction (`abstract_model`'s eval_shape, a plan of a 70B model)
# holds one equation per quantized kernel instead of the quantizer's dozens: flax reads each
# Variable's sharding there, and JAX's trace walks every equation for it, so the cost grew with
# the square of the trace (70B nf4: over 12 minutes before the compile, 1B: 15.7 s).
_quantize = jax.jit(quantization.quantize, static_argnums=(1, 2))


class Dense(nnx.Module):
    """y = x @ kernel (+ bias) (+ LoRA: x @ lora_a @ lora_b * alpha / rank), kernel [in, out].

    lora_a [in, r] starts random (scaled like PEFT's default) and lora_b [r, out] at zero, so a
    freshly added adapter leaves the output unchanged.

    `quant` = (scheme, block) stores the kernel quantized instead (`codes` and `scales`,
    `QuantParam`s with the kernel's logical axes), dequantized to the compute dtype inside each
    call."""

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
        quant: tuple[str, int] | None = None,
    ):
        kernel = init_std * jax.random.normal(rngs.params(), (in_features, out_features))
        self.quant = quant
        self.axes = axes
        if quant is None:
            self.kernel = nnx.Param(kernel.astype(param_dtype), logical_axes=axes)
        else:
            codes, scales = _quantize(kernel.astype(param_dtype), *quant)
            self.codes = QuantParam(codes, logical_axes=axes)
            self.scales = QuantParam(scales, logical_axes=axes)
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

    def weight(self) -> jax.Array:
        """The kernel [in, out] in the compute dtype (dequantized when stored quantized)."""
        if self.quant is None:
            return self.kernel[...].astype(self.dtype)
        return quantization.dequantize(self.codes[...], self.scales[...], *self.quant, self.dtype)

    def __call__(self, x: jax.Array) -> jax.Array:
        # The leading dims are merged into one, so each matmul is a plain 2-D [N, in] @ [in, out]
        # dot, whose gradient XLA's CPU backend runs at least as fast as with a [B, T, in] operand
        # (tic-tac-toe recipe step, 128 pairs: 0.120 -> 0.111 s; 64 pairs: equal; benchmarks.md).
        # Not on rows split over a context axis: there B x T merged is no tiled layout (a device
        # holds a stretch of every row), and GSPMD would gather the activations for the weight
        # gradients; the weight is gathered instead (the FSDP all-gather), never the contraction
        # split over its shards.
        split = context_size() > 1
        lead = x.shape[:-1]
        x = x.astype(self.dtype) if split else x.reshape(-1, x.shape[-1]).astype(self.dtype)
        weight = self.weight()
        if split:
            weight = constrain(weight, self.axes, GATHERED_RULES)
        y = jnp.dot(x, weight)
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
