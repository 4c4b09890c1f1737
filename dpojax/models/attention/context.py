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

Causal load balancing: with a causal mask the last stretch of a row has the most (query,
earlier key) pairs. Where the chunks are whole kernel blocks, the model hands the rows over in
`order`: cut into 2 x context chunks, device d holding chunks d and 2 x context - 1 - d, so every
device has the same share of the triangle; the gathered keys are put back in row order locally
and each query block carries its row index (`Queries.starts`). For the static (GPU) variant this
is what bounds the trip count: in row order every device walks the last device's pairs.

Gradients: `all_gather`'s transpose is a reduce-scatter, so each device gets the key and value
gradients of its own stretch summed over every device's queries.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import PartitionSpec

from dpojax.models.attention.flash import Queries, block_size, flash_attention, pair_table
from dpojax.models.attention.rule import TokenIds
from dpojax.models.sharding import context_size, kernel_axes

AXIS = "context"


def balanced(length: int, context: int) -> bool:
    """Whether rows of `length` tokens on `context` devices are held load-balanced (`order`):
    each device's two chunks (length / (2 * context) tokens) a whole number of kernel blocks."""
    if context == 1 or length % (2 * context):
        return False
    chunk = length // (2 * context)
    return chunk % block_size(chunk) == 0


def order(length: int, context: int) -> np.ndarray:
    """Causal load balancing: the row indices in the order the context devices hold them. The
    row is cut into 2 x context chunks and device d holds chunks d and 2 x context - 1 - d, so
    every device has as many (query, earlier key) pairs of the causal triangle as any other."""
    chunk = length // (2 * context)
    held = [c for d in range(context) for c in (d, 2 * context - 1 - d)]
    return np.concatenate([np.arange(c * chunk, (c + 1) * chunk) for c in held])


def _local_starts(length: int, context: int, stretch: int, block: int, is_balanced: bool):
    """int [context, stretch / block] (padded up): the row index of each local query block's
    first token on each device."""
    n = -(-stretch // block)
    if not is_balanced:
        return np.stack([d * stretch + np.arange(n) * block for d in range(context)])
    rows = order(length, context).reshape(context, stretch)
    return rows[:, ::block].astype(np.int64)


@functools.cache
def pair_tables(length: int, context: int, block: int, is_balanced: bool = False) -> np.ndarray:
    """int32 [context, P, 3]: the static flash variant's block pairs of each device's queries for
    rows of `length` tokens (device d holding rows d * length / context ... in row order, its two
    chunks of `order` balanced), every table padded with fillers to the longest (with load
    balancing all are as long)."""
    stretch = length // context
    starts = _local_starts(length, context, stretch, block, is_balanced)
    n_k = -(-length // block)
    longest = max(len(pair_table(s, n_k, block)) for s in starts)
    return np.stack([pair_table(s, n_k, block, longest) for s in starts])


def context_flash(
    q: jax.Array,
    k: jax.Array,
    v: jax.Array,
    ids: TokenIds,
    *,
    scale: float,
    window: int | None,
    static: bool,
    is_balanced: bool = False,
) -> jax.Array:
    """Flash attention of q [B, T, H, D] over k, v [B, T, K, D] (global arrays whose length is
    split over the current mesh's context axis) under the layout rule of `ids`; [B, T, H, D]
    split like q. `is_balanced`: the tokens are in `order` (the model permuted them), else in
    row order. Inside `shard_map`: the batch over data x fsdp, the heads over tensor where it
    divides both head counts."""
    mesh = jax.sharding.get_abstract_mesh()
    context = context_size(mesh)
    batch, heads = kernel_axes(mesh, q.shape[2], k.shape[2])
    length = q.shape[1]
    stretch = length // context
    block = block_size(length // (2 * context) if is_balanced else stretch)
    starts = jnp.asarray(_local_starts(length, context, stretch, block, is_balanced), jnp.int32)
    tables = jnp.asarray(pair_tables(length, context, block, is_balanced)) if static else None
    # the gathered keys back in row order (a static permutation of each device's local copy)
    to_rows = np.argsort(order(length, context)) if is_balanced else None

    def local(q, k, v, ids):
        def gather(x):
            x = jax.lax.all_gather(x, AXIS, axis=1, tiled=True)
            return x if to_rows is None else jnp.take(x, to_rows, axis=1)

        index = jax.lax.axis_index(AXIS)
        pairs = None if tables is None else tables[index]
        queries = Queries(ids, starts[index], block, pairs)
        return flash_attention(
            q, gather(k), gather(v), TokenIds(*(gather(x) for x in ids)), scale=scale,
            window=window, static=static, queries=queries,
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
