"""Blockwise quantization of frozen weight matrices: int8 and NF4 (docs/quantization.md).

A weight `w` [..., in, out] (the leading axes: stacked layers) is cut into blocks of `block`
consecutive entries along the input dimension; each block keeps one float32 scale per output
column, scales [..., in // block, out].

  int8  symmetric absmax: scale = absmax / 127, code = round(w / scale) in [-127, 127] (int8);
        |w - code * scale| <= scale / 2 per element.
  nf4   QLoRA's NormalFloat4 (Dettmers et al. 2023, "QLoRA: Efficient Finetuning of Quantized
        LLMs", section 3 and appendix): scale = absmax, code = the index of the codebook value
        nearest w / scale; two 4-bit codes per uint8, rows 2i (low nibble) and 2i + 1 (high
        nibble) of the input dimension, codes [..., in // 2, out];
        |w - value[code] * scale| <= scale * max_gap / 2, max_gap the widest step between
        adjacent codebook values.

Pure functions of arrays, jit-able; dequantization runs in the caller's dtype.
"""

from __future__ import annotations

from statistics import NormalDist

import jax
import jax.numpy as jnp
import numpy as np

SCHEMES = ("none", "int8", "nf4")
INT8_MAX = 127
# QLoRA's construction (bitsandbytes create_normal_map): the quantiles of N(0, 1) at 8 evenly
# spaced probabilities from 0.5 to OFFSET for the positive half and 7 for the negative half, zero
# exactly, normalised to [-1, 1]. OFFSET = (1 - 1 / (2 * 15) + 1 - 1 / (2 * 16)) / 2 = 0.9677.
NF4_OFFSET = 0.9677083


def _nf4_codebook() -> np.ndarray:
    normal = NormalDist()
    positive = [normal.inv_cdf(p) for p in np.linspace(NF4_OFFSET, 0.5, 9)[:-1]]
    negative = [-normal.inv_cdf(p) for p in np.linspace(NF4_OFFSET, 0.5, 8)[:-1]]
    values = np.sort(np.array(positive + [0.0] + negative, np.float64))
    return (values / np.max(np.abs(values))).astype(np.float32)


NF4_CODEBOOK = _nf4_codebook()  # 16 float32 values, ascending, from -1 to 1 with 0 exactly
_NF4_MIDPOINTS = (NF4_CODEBOOK[1:] + NF4_CODEBOOK[:-1]) / 2


def error_factor(scheme: str) -> float:
    """The per-element round-trip bound as a fraction of the block's scale (absmax / 127 for
    int8, absmax for nf4)."""
    if scheme == "int8":
        return 0.5
    if scheme == "nf4":
        return float(np.max(np.diff(NF4_CODEBOOK))) / 2
    raise ValueError(f"unknown quantization scheme {scheme!r}; choose int8 or nf4")


def block_problem(in_features: int, scheme: str, block: int) -> str:
    """Why `block` cannot cut an input dimension of `in_features` ("" when it can)."""
    if block < 1:
        return f"the block ({block}) must be positive"
    if scheme == "nf4" and block % 2:
        return f"nf4 packs two codes per byte: the block ({block}) must be even"
    if in_features % block:
        return f"the block ({block}) does not divide the input size {in_features}"
    return ""


def _blocks(w: jax.Array, block: int) -> jax.Array:
    """[..., in, out] -> [..., in // block, block, out]."""
    *lead, n_in, n_out = w.shape
    problem = block_problem(n_in, "int8", block)
    if problem:
        raise ValueError(problem)
    return w.reshape(*lead, n_in // block, block, n_out)


def _pack(codes: jax.Array) -> jax.Array:
    """uint8 codes [..., in, out] in 0..15 -> [..., in // 2, out], two per byte."""
    return codes[..., 0::2, :] | (codes[..., 1::2, :] << 4)


def _unpack(packed: jax.Array) -> jax.Array:
    """[..., in // 2, out] -> uint8 codes [..., in, out] (the inverse of `_pack`)."""
    *lead, half, n_out = packed.shape
    both = jnp.stack([packed & 15, packed >> 4], axis=-2)  # [..., in // 2, 2, out]
    return both.reshape(*lead, 2 * half, n_out)


def quantize(w: jax.Array, scheme: str, block: int) -> tuple[jax.Array, jax.Array]:
    """(codes, float32 scales [..., in // block, out]) of `w` [..., in, out]: int8 codes
    [..., in, out], or nf4 codes packed two per uint8 [..., in // 2, out]."""
    error_factor(scheme)  # the scheme is known
    if scheme == "nf4" and block % 2:
        raise ValueError(block_problem(w.shape[-2], scheme, block))
    x = _blocks(w.astype(jnp.float32), block)
    absmax = jnp.max(jnp.abs(x), axis=-2, keepdims=True)
    if scheme == "int8":
        scale = absmax / INT8_MAX
        safe = jnp.where(scale > 0, scale, 1.0)
        q = jnp.clip(jnp.round(x / safe), -INT8_MAX, INT8_MAX).astype(jnp.int8)
        return q.reshape(w.shape), scale[..., 0, :]
    safe = jnp.where(absmax > 0, absmax, 1.0)
    q = _nf4_index(x / safe)
    return _pack(q.reshape(w.shape)), absmax[..., 0, :]


def _nf4_index(v: jax.Array) -> jax.Array:
    """The index of the NF4 value nearest each of `v` (uint8): the number of midpoints between
    adjacent values below it, `searchsorted(midpoints, v)`'s answer, counted with one comparison
    per midpoint, which XLA fuses into one pass (a binary search keeps several int32 arrays of
    `v`'s size: 0.5 GB for a 2048 x 8192 kernel)."""
    q = jnp.zeros(v.shape, jnp.uint8)
    for mid in _NF4_MIDPOINTS.tolist():
        q = q + (v > np.float32(mid)).astype(jnp.uint8)
    return q


def dequantize(
    codes: jax.Array, scales: jax.Array, scheme: str, block: int, dtype=jnp.float32
) -> jax.Array:
    """The weight [..., in, out] in `dtype` from `quantize`'s codes and scales, computed in
    `dtype` (code value times scale, one rounding)."""
    dtype = jnp.dtype(dtype)
    if scheme == "int8":
        values = codes.astype(dtype)
    elif scheme == "nf4":
        values = jnp.take(jnp.asarray(NF4_CODEBOOK).astype(dtype), _unpack(codes).astype(jnp.int32))
    else:
        raise ValueError(f"unknown quantization scheme {scheme!r}; choose int8 or nf4")
    blocks = _blocks(values, block) * scales.astype(dtype)[..., :, None, :]
    return blocks.reshape(values.shape)


def quantized_shapes(
    shape: tuple[int, ...], scheme: str, block: int
) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """The shapes of (codes, scales) of a weight of `shape` [..., in, out]."""
    *lead, n_in, n_out = shape
    codes = (*lead, n_in // 2 if scheme == "nf4" else n_in, n_out)
    return codes, (*lead, n_in // block, n_out)
