"""cuDNN's fused attention (`jax.nn.dot_product_attention(implementation="cudnn")`) for the rows
whose attention rule its masks express exactly.

A `padded` row (docs/layouts.md#padded) holds one sequence from column 0 (segment 1: its prompt,
part 0, then its completion, part 1) and padding after it (segment 0), with positions equal to
the columns. On such a row the layout rule is plain causal attention over the row's first n
tokens, n the row's real tokens: cuDNN's causal mask with per-row query and key sequence lengths
of n, and on a sliding layer its left window (query i attends key j iff i - j < window). Its GQA
takes K/V with fewer heads as they are; the scale is the model's (Gemma's
`query_pre_attn_scalar`). A row of plain causal tokens (no segment ids) is the case n = T.

Padding queries (column >= n) get a zero output from cuDNN where the other implementations let
padding attend padding; no real token reads them, so the log-probs are the same. A row of
padding only gets n = 1, not 0.

Under `remat="attention"` cuDNN's forward runs again in the backward pass: the statistics its
backward call needs are residuals inside JAX's own VJP, which no checkpoint name reaches (a
compiled two-layer step has 4 forward calls instead of 2), so its output is not named for that
policy either (saving it would cost memory and spare nothing).

Other layouts (packed segments, a prompt shared by two or more completions) need masks that
`jax.nn.dot_product_attention` cannot take (it has sequence lengths, no segment ids or offsets;
checked on JAX 0.10.2), so they run `flash`; which implementation a call runs is decided
from the config and the layout (`dpojax.models.attention.choose`), never from the values.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

from dpojax.models.attention.rule import TokenIds


def row_lengths(ids: TokenIds) -> jax.Array:
    """int32 [B]: each padded row's real tokens (segment id not 0), at least 1."""
    return jnp.maximum(jnp.sum(ids.segment_ids != 0, axis=1, dtype=jnp.int32), 1)


def arguments(ids: TokenIds, *, scale: float, window: int | None) -> dict:
    """The keywords of `jax.nn.dot_product_attention` that put the rule of padded rows with
    `ids` (and a sliding `window`, in tokens) into cuDNN's masks."""
    n = row_lengths(ids)
    return {
        "scale": scale,
        "is_causal": True,
        "query_seq_lengths": n,
        "key_value_seq_lengths": n,
        "local_window_size": (window - 1, 0) if window else None,
    }


def cudnn_attention(
    q: jax.Array,
    k: jax.Array,
    v: jax.Array,
    ids: TokenIds,
    *,
    scale: float,
    window: int | None = None,
    implementation: str = "cudnn",
) -> jax.Array:
    """Grouped-query self-attention of padded rows: q [B, T, H, D], k and v [B, T, K, D]
    (bfloat16 or float16 for cuDNN), ids of the T tokens; [B, T, H, D] in q's dtype.
    `implementation="xla"` runs JAX's own version of the same call (the CPU tests compare it,
    argument for argument, with the reference attention)."""
    return jax.nn.dot_product_attention(
        q, k, v, implementation=implementation, **arguments(ids, scale=scale, window=window)
    )


@functools.cache
def available() -> bool:
    """Whether JAX finds cuDNN (its CUDA plugin and the nvidia-cudnn-cu12 libraries): without it
    a cuDNN call fails when traced."""
    try:
        from jax._src.lib import cuda_versions

        return cuda_versions is not None and cuda_versions.cudnn_get_version() > 0
    except Exception:  # no plugin, no libraries, or another JAX's internals: not usable
        return False
