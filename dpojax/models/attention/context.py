"""Attention on rows split over the `context` mesh axis (docs/long_context.md): each device keeps
its stretch of every row's queries, keys and values; the keys and values (and the token ids)
are all-gathered over the axis, and the local kernel (flash, or the Pallas kernels on TPU) runs
the stretch's queries against the whole rows with their row indices, so the layout rule
(segments, parts, sliding windows, causality) holds across stretch boundaries.

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
device has the same share of the triangle. Flash puts the gathered keys back in row order
locally and gives each query block its row index (`Queries.starts`); the Pallas kernels take
every token's row index on both sides (`pallas.Side`) and the keys as gathered. For the static
(GPU) variant this is what bounds the trip count: in row order every device walks the last
device's pairs.

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


def to_rows(x: jax.Array, spec: PartitionSpec) -> jax.Array:
    """`x` [B, T, ...] held in `order` over the current mesh's context axis (laid out as `spec`,
    whose second entry is that axis) put back in row order with two collective permutes of half
    a stretch each, so no device holds more than its own stretch (a gather by `argsort(order)`
    on the split array has XLA gather whole rows). Chunk c goes to device c // 2, place c % 2:
    device d's two chunks (d and 2n - 1 - d) differ in parity, so each permute moves one of
    them from every device, and the chunks of one parity pair devices one to one."""
    mesh = jax.sharding.get_abstract_mesh()
    n = context_size(mesh)

    def chunk(d: int, place: int) -> int:  # device d's chunk of that parity
        return d if d % 2 == place else 2 * n - 1 - d

    moves = [[(d, chunk(d, place) // 2) for d in range(n)] for place in (0, 1)]

    def local(x):
        half = x.shape[1] // 2
        first, second = x[:, :half], x[:, half:]
        even = jax.lax.axis_index(AXIS) % 2 == 0
        outgoing = (jnp.where(even, first, second), jnp.where(even, second, first))
        placed = [jax.lax.ppermute(y, AXIS, m) for y, m in zip(outgoing, moves, strict=True)]
        return jnp.concatenate(placed, axis=1)

    return jax.shard_map(local, mesh=mesh, in_specs=spec, out_specs=spec)(x)


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


def context_attention(
    q: jax.Array,
    k: jax.Array,
    v: jax.Array,
    ids: TokenIds,
    *,
    implementation: str,
    scale: float,
    window: int | None,
    static: bool = False,
    is_balanced: bool = False,
    block: int | None = None,
    interpret: bool = False,
) -> jax.Array:
    """Attention of q [B, T, H, D] over k, v [B, T, K, D] (global arrays whose length is split
    over the current mesh's context axis) under the layout rule of `ids`; [B, T, H, D] split
    like q. `implementation` is the local kernel: "flash" (`static`: its GPU variant) or
    "pallas" (`block` and `interpret` as `pallas_attention`'s). `is_balanced`: the tokens are in
    `order` (the model permuted them), else in row order. Inside `shard_map`: the batch over
    data x fsdp, the heads over tensor where it divides both head counts."""
    mesh = jax.sharding.get_abstract_mesh()
    context = context_size(mesh)
    batch, heads = kernel_axes(mesh, q.shape[2], k.shape[2])
    length = q.shape[1]
    if implementation == "pallas":
        local = _pallas_local(length, context, window, scale, is_balanced, block, interpret)
    else:
        local = _flash_local(length, context, window, scale, is_balanced, static)
    per_head = PartitionSpec(batch, AXIS, heads, None)
    per_token = PartitionSpec(batch, AXIS)
    return jax.shard_map(
        local,
        mesh=mesh,
        in_specs=(per_head, per_head, per_head, TokenIds(per_token, per_token, per_token)),
        out_specs=per_head,
        check_vma=False,
    )(q, k, v, ids)


def _gather(x: jax.Array) -> jax.Array:
    return jax.lax.all_gather(x, AXIS, axis=1, tiled=True)


def _flash_local(length, context, window, scale, is_balanced, static):
    """One device's flash: the gathered keys put back in row order (a static permutation of the
    local copy), each local query block with its row index (and its pair table when static)."""
    stretch = length // context
    block = block_size(length // (2 * context) if is_balanced else stretch)
    starts = jnp.asarray(_local_starts(length, context, stretch, block, is_balanced), jnp.int32)
    tables = jnp.asarray(pair_tables(length, context, block, is_balanced)) if static else None
    row_order = np.argsort(order(length, context)) if is_balanced else None

    def local(q, k, v, ids):
        def gather(x):
            x = _gather(x)
            return x if row_order is None else jnp.take(x, row_order, axis=1)

        index = jax.lax.axis_index(AXIS)
        pairs = None if tables is None else tables[index]
        queries = Queries(ids, starts[index], block, pairs)
        return flash_attention(
            q, gather(k), gather(v), TokenIds(*(gather(x) for x in ids)), scale=scale,
            window=window, static=static, queries=queries,
        )  # fmt: skip

    return local


def _pallas_local(length, context, window, scale, is_balanced, block, interpret):
    """One device's Pallas kernels: its stretch's queries against the gathered keys as the
    devices hold them (no permutation: every token carries its row index, which the rule and the
    block table compare), in blocks no longer than one chunk."""
    from dpojax.models.attention.pallas import Side, kernel_block, pallas_attention

    stretch = length // context
    held = order(length, context) if is_balanced else np.arange(length)
    block = kernel_block(stretch // 2 if is_balanced else stretch, block, interpret=interpret)

    def local(q, k, v, ids):
        rows = jnp.asarray(held, jnp.int32)
        mine = jax.lax.dynamic_slice_in_dim(rows, jax.lax.axis_index(AXIS) * stretch, stretch)
        keys = Side(TokenIds(*(_gather(x) for x in ids)), rows)
        return pallas_attention(
            q, _gather(k), _gather(v), ids, scale=scale, window=window, block=block,
            interpret=interpret, keys=keys, query_rows=mine,
        )  # fmt: skip

    return local
