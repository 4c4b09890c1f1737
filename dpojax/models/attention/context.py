"""Attention on rows split over the `context` mesh axis (docs/long_context.md): each device keeps
its stretch of every row's queries, keys and values; the keys and values (and the token ids)
are all-gathered over the axis, and the local flash kernel runs the stretch's queries against
the whole rows with their row indices, so the layout rule (segments, parts, sliding windows,
causality) holds across stretch boundaries.

Why an all-gather and not a ring: with grouped-query attention the keys and values are a
fraction of the activations (Llama 3.1 8B: 8 KV heads of 32, so K and V of a row are a quarter
of its queries' size), the gather of one layer is one collective that XLA can start while the
previous layer computes, and the local kernel stays the one every other path runs. A ring would
hold only two stretches of K/V at a time; at the row lengths one host's devices reach, the
gathered K/V of one layer (2 x 131,072 x 8 x 128 bf16 = 0.5 GiB a row for the 8B) is small next
to what the step holds (docs/benchmarks.md has the plans).

Gradients: `all_gather`'s transpose is a reduce-scatter, so each device gets the key and value
gradients of its own stretch summed over every device's queries.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import PartitionSpec

from dpojax.models.attention.flash import block_size, flash_attention, pair_table
from dpojax.models.attention.rule import TokenIds

AXIS = "context"


@functools.cache
def pair_tables(context: int, stretch: int, block: int) -> np.ndarray:
    """int32 [context, P, 3]: the static flash variant's block pairs for each device's stretch
    of `stretch` tokens (device d holds row indices d * stretch ...), every table padded with
    fillers to the last device's count (the most pairs)."""
    n_q = -(-stretch // block)
    n_k = -(-(context * stretch) // block)
    tables = [pair_table(n_q, n_k, d * stretch, block) for d in range(context)]
    length = max(len(t) for t in tables)
    return np.stack([pair_table(n_q, n_k, d * stretch, block, length) for d in range(context)])


def context_flash(
    q: jax.Array,
    k: jax.Array,
    v: jax.Array,
    ids: TokenIds,
    *,
    scale: float,
    window: int | None,
    static: bool,
) -> jax.Array:
    """Flash attention of q [B, T, H, D] over k, v [B, T, K, D] (global arrays whose length is
    split over the current mesh's context axis) under the layout rule of `ids`; [B, T, H, D]
    split like q. Inside `shard_map`: the batch over data x fsdp, the heads over tensor where
    it divides both head counts."""
    mesh = jax.sharding.get_abstract_mesh()
    shape = dict(zip(mesh.axis_names, mesh.axis_sizes, strict=True))
    context = shape[AXIS]
    batch = tuple(a for a in ("data", "fsdp") if shape.get(a, 1) > 1) or None
    tensor = shape.get("tensor", 1)
    heads = (
        "tensor" if tensor > 1 and q.shape[2] % tensor == 0 and k.shape[2] % tensor == 0 else None
    )
    stretch = q.shape[1] // context
    block = block_size(stretch)
    tables = jnp.asarray(pair_tables(context, stretch, block)) if static else None

    def local(q, k, v, ids):
        def gather(x):
            return jax.lax.all_gather(x, AXIS, axis=1, tiled=True)

        index = jax.lax.axis_index(AXIS)
        return flash_attention(
            q, gather(k), gather(v), TokenIds(*(gather(x) for x in ids)), scale=scale,
            window=window, static=static, query_start=index * q.shape[1],
            pairs=None if tables is None else tables[index],
        )  # fmt: skip

    per_head = PartitionSpec(batch, AXIS, heads, None)
    per_token = PartitionSpec(batch, AXIS)
    return jax.shard_map(
        local,
        mesh=mesh,
        in_specs=(per_head, per_head, per_head, TokenIds(per_token, per_token, per_token)),
        out_specs=per_head,
        check_vma=False,
    )(q, k, v, ids)
