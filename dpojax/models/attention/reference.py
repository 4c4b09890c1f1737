"""The reference attention: the layout rule as a full boolean mask [B, T, T] and grouped-query
attention over it, with causal query blocks (each block scores only the keys up to its end).

Fast on short rows, where a [T, T] mask and score blocks are cheap; memory grows with T^2, so
long rows go to `dpojax.models.attention.flash` (or the Pallas kernel). The decoder's KV-cache
path uses it too.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from dpojax.models.layers import softcap


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
