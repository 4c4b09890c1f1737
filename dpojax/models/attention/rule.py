"""The attention rule of every batch layout (docs/layouts.md#the-attention-rule), from per-token
ids, for any block of queries against any block of keys.

Token i may attend token j iff they are in the same segment, j <= i in the row, and j is a
prompt token (part 0) or in the same part as i; on a sliding-window layer also
positions[i] - positions[j] < window. Every token may attend itself.
"""

from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp


class TokenIds(NamedTuple):
    """Per-token ids of a batch of rows, each int32 [B, T]."""

    segment_ids: jax.Array
    parts: jax.Array
    positions: jax.Array

    @classmethod
    def of(
        cls,
        batch: int,
        length: int,
        *,
        positions: jax.Array | None = None,
        segment_ids: jax.Array | None = None,
        parts: jax.Array | None = None,
    ) -> TokenIds:
        """Ids of rows described like `CausalLM.__call__`'s arguments; left out: one causal
        sequence per row (segment 1, part 0, positions 0..T-1)."""
        shape = (batch, length)
        ones = jnp.ones(shape, jnp.int32)
        return cls(
            ones if segment_ids is None else segment_ids.astype(jnp.int32),
            jnp.zeros(shape, jnp.int32) if parts is None else parts.astype(jnp.int32),
            jnp.broadcast_to(jnp.arange(length, dtype=jnp.int32), shape)
            if positions is None
            else positions.astype(jnp.int32),
        )

    def padded(self, pad: int) -> TokenIds:
        """`pad` more columns of padding tokens in a segment of their own (-1), which no real
        token attends and which are dropped from the output."""
        widths = [(0, 0), (0, pad)]
        return TokenIds(
            jnp.pad(self.segment_ids, widths, constant_values=-1),
            jnp.pad(self.parts, widths),
            jnp.pad(self.positions, widths),
        )

    def slice(self, start, size: int) -> TokenIds:
        """Columns `start : start + size` (start may be traced)."""
        return TokenIds(
            *(jax.lax.dynamic_slice_in_dim(x, start, size, axis=1) for x in self)  # type: ignore[arg-type]
        )


def allowed(
    q: TokenIds,
    k: TokenIds,
    q_index: jax.Array,
    k_index: jax.Array,
    window: int | None = None,
) -> jax.Array:
    """bool [B, tq, tk]: may query q attend key k. `q` and `k` are the ids of a block of queries
    and a block of keys ([B, tq] and [B, tk]); `q_index` [tq] and `k_index` [tk] their row
    positions."""
    mask = q.segment_ids[:, :, None] == k.segment_ids[:, None, :]
    mask &= (k_index[None, :] <= q_index[:, None])[None]
    mask &= (k.parts[:, None, :] == 0) | (q.parts[:, :, None] == k.parts[:, None, :])
    if window:
        mask &= (q.positions[:, :, None] - k.positions[:, None, :]) < window
    return mask
