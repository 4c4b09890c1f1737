"""Flash attention in pure JAX: memory linear in the row length, for every batch layout.

Queries and keys are taken in blocks. For each block of queries an online softmax runs over the
blocks of keys up to the diagonal (the rule is causal in the row, so the blocks above it are never
visited); a block pair that the rule masks entirely — other segments, the other completion of a
prefix-shared or grouped row, outside a sliding window — is skipped with `lax.cond`, not computed
and masked. The forward pass keeps only the output and each query's log-sum-exp; the backward
pass (a custom VJP) recomputes the probabilities block by block from them, so no [T, T] array
exists in either pass (FlashAttention-2's scheme: Dao, 2023, arXiv:2307.08691).

This is the CPU path and the fallback on every platform; `dpojax.models.attention.pallas` has the
same algorithm as a Pallas kernel.
"""

from __future__ import annotations

import functools
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from jax.ad_checkpoint import checkpoint_name

from dpojax.models.attention.rule import TokenIds, allowed

# Query and key block of the CPU path: larger blocks run larger matmuls, smaller ones skip more
# masked keys and keep the per-block scores ([B, H, block, block] float32) small.
DEFAULT_BLOCK = 128


def block_size(length: int, max_block: int = DEFAULT_BLOCK) -> int:
    """The block for rows of `length` tokens: the whole row up to `max_block`, else `max_block`
    (rows are padded to a multiple of it)."""
    return length if length <= max_block else max_block


def flash_attention(
    q: jax.Array,
    k: jax.Array,
    v: jax.Array,
    ids: TokenIds,
    *,
    scale: float,
    window: int | None = None,
    max_block: int = DEFAULT_BLOCK,
    static: bool = False,
    queries: Queries | None = None,
) -> jax.Array:
    """Grouped-query self-attention under the layout rule. q [B, T, H, D], k and v [B, T, K, D]
    with H % K == 0, ids of the T tokens; returns [B, T, H, D] in q's dtype. Scores, softmax and
    accumulation in float32.

    `static=True` (the GPU path) walks every block pair at or below the diagonal in one loop of
    a fixed trip count and masks with `where`, skipping nothing: no loop bound or branch depends
    on the data, so a GPU never copies a loop predicate to the host and a mesh never all-reduces
    a "block masked?" decision (`_static_forward`).

    Split rows (`dpojax.models.attention.context`): with `queries`, q holds some of the rows'
    tokens only (T_q of them, in blocks of `queries.block`, each block a run of consecutive row
    indices from `queries.starts`), while k, v and ids cover the whole rows (T_k tokens)."""
    b, t, h, d = q.shape
    heads, tk = k.shape[2], k.shape[1]
    qh = q.reshape(b, t, heads, h // heads, d).transpose(0, 2, 3, 1, 4)  # [B, K, G, T, D]
    kh, vh = k.transpose(0, 2, 1, 3), v.transpose(0, 2, 1, 3)  # [B, K, T, D]
    if queries is None:
        block = block_size(t, max_block)
        whole = np.arange(-(-t // block)) * block  # static: the static variant's table
        starts, q_ids = jnp.asarray(whole, jnp.int32), ids
        pairs = jnp.asarray(pair_table(whole, -(-tk // block), block)) if static else None
    else:
        block, starts, q_ids, pairs = queries.block, queries.starts, queries.ids, queries.pairs
    pad, k_pad = -t % block, -tk % block
    if pad:  # padding tokens form their own segment (-1) and are dropped afterwards
        qh = jnp.pad(qh, [(0, 0)] * 3 + [(0, pad), (0, 0)])
        q_ids = q_ids.padded(pad)
    if k_pad:
        kh, vh = (jnp.pad(x, [(0, 0), (0, 0), (0, k_pad), (0, 0)]) for x in (kh, vh))
        ids = ids.padded(k_pad)
    span = Span(q_ids, ids, starts)
    if static:
        out = _static(qh, kh, vh, span, pairs, scale, window, block)
    else:
        out = _flash(qh, kh, vh, span, scale, window, block)
    out = out[..., :t, :].transpose(0, 3, 1, 2, 4)  # [B, T, K, G, D]
    return out.reshape(b, t, h, d).astype(q.dtype)


class Queries(NamedTuple):
    """Queries that are not the whole rows (`flash_attention(queries=)`): their ids [B, T_q],
    the row index of each block's first query (int32 [T_q / block], traced), the block, and for
    the static variant its (query block, key block, visited) table (`pair_table`)."""

    ids: TokenIds
    starts: jax.Array
    block: int
    pairs: jax.Array | None = None


class Span(NamedTuple):
    """The tokens of one attention call: the queries' ids [B, T_q], the keys' ids [B, T_k] and
    the row index of each query block's first query."""

    q_ids: TokenIds
    k_ids: TokenIds
    starts: jax.Array


def pair_table(starts, n_k: int, block: int, length: int | None = None) -> np.ndarray:
    """int32 [P, 3] rows (query block, key block, visited) of query blocks starting at row
    indices `starts` (in blocks of `block`) against n_k key blocks: the pairs at or below the
    diagonal (visited 1), then fillers (0, 0, 0) up to `length` rows (default: none), so that the
    queries of every device can have a table of one shape (the static variant's trip count)."""
    starts = np.asarray(starts)
    i, j = np.meshgrid(np.arange(len(starts)), np.arange(n_k), indexing="ij")
    keep = (j * block <= starts[i] + block - 1).reshape(-1)
    rows = np.stack([i.reshape(-1), j.reshape(-1), np.ones(i.size, np.int64)], axis=1)[keep]
    fillers = np.zeros(((length or len(rows)) - len(rows), 3), np.int64)
    return np.concatenate([rows, fillers]).astype(np.int32)


def _block(x: jax.Array, index, block: int, axis: int) -> jax.Array:
    return jax.lax.dynamic_slice_in_dim(x, index * block, block, axis=axis)


def _block_mask(span: Span, i, j, block: int, window: int | None) -> jax.Array:
    """bool [B, 1, 1, block, block]: the rule for query block i against key block j."""
    q_index = span.starts[i] + jnp.arange(block)
    k_index = j * block + jnp.arange(block)
    mask = allowed(
        span.q_ids.slice(i * block, block), span.k_ids.slice(j * block, block), q_index, k_index,
        window,
    )  # fmt: skip
    return mask[:, None, None]


def visited_blocks(ids: TokenIds, block: int, window: int | None = None) -> jax.Array:
    """bool [n, n]: which (query block, key block) pairs the passes compute for rows of ids
    (T a multiple of `block`): those at or below the diagonal that the rule does not mask
    entirely; every other pair is skipped. The same predicate as the loops'."""
    n = ids.segment_ids.shape[1] // block
    span = Span(ids, ids, jnp.arange(n, dtype=jnp.int32) * block)
    return jnp.array(
        [
            [j <= i and bool(_block_mask(span, i, j, block, window).any()) for j in range(n)]
            for i in range(n)
        ]
    )


def _scores(qi, kj, scale):
    return jnp.einsum("bkgqd,bksd->bkgqs", qi, kj, preferred_element_type=jnp.float32) * scale


def _forward(qh, kh, vh, span, scale, window, block):
    """Output [B, K, G, T, D] (float32) and log-sum-exp [B, K, G, T]."""
    n, n_k = qh.shape[3] // block, kh.shape[2] // block
    stats_shape = qh.shape[:3] + (block,)

    def query_block(_, i):
        qi = _block(qh, i, block, 3)

        def key_block(j, carry):
            mask = _block_mask(span, i, j, block, window)

            def update(carry):
                m, denom, acc = carry
                s = jnp.where(mask, _scores(qi, _block(kh, j, block, 2), scale), -jnp.inf)
                m_new = jnp.maximum(m, s.max(-1))
                m_safe = jnp.where(jnp.isfinite(m_new), m_new, 0.0)  # rows with no key yet
                p = jnp.exp(s - m_safe[..., None])
                alpha = jnp.exp(m - m_safe)
                vj = _block(vh, j, block, 2)
                pv = jnp.einsum(
                    "bkgqs,bksd->bkgqd", p.astype(vj.dtype), vj, preferred_element_type=jnp.float32
                )
                return m_new, alpha * denom + p.sum(-1), alpha[..., None] * acc + pv

            return jax.lax.cond(mask.any(), update, lambda c: c, carry)

        init = (
            jnp.full(stats_shape, -jnp.inf, jnp.float32),
            jnp.zeros(stats_shape, jnp.float32),
            jnp.zeros(stats_shape + (qh.shape[-1],), jnp.float32),
        )
        last = (span.starts[i] + block - 1) // block  # the key block of the diagonal
        m, denom, acc = jax.lax.fori_loop(0, jnp.minimum(last + 1, n_k), key_block, init)
        safe = denom > 0
        out = acc / jnp.where(safe, denom, 1.0)[..., None]
        lse = jnp.where(safe, m + jnp.log(jnp.where(safe, denom, 1.0)), 0.0)
        return None, (out, lse)

    _, (out, lse) = jax.lax.scan(query_block, None, jnp.arange(n))
    # [n, B, K, G, block, ...] -> [B, K, G, T, ...]
    out = jnp.moveaxis(out, 0, 3).reshape(qh.shape[:3] + (-1, qh.shape[-1]))
    lse = jnp.moveaxis(lse, 0, 3).reshape(qh.shape[:3] + (-1,))
    return out, lse


def _backward(qh, kh, vh, span, out, lse, dout, scale, window, block):
    """(dq, dk, dv) in float32, key block by key block (FlashAttention-2's loop order)."""
    n, n_k = qh.shape[3] // block, kh.shape[2] // block
    delta = jnp.sum(dout * out, axis=-1)  # [B, K, G, T]
    qf, kf, vf = (x.astype(jnp.float32) for x in (qh, kh, vh))

    def key_block(dq, j):
        kj, vj = _block(kf, j, block, 2), _block(vf, j, block, 2)

        def query_block(i, carry):
            mask = _block_mask(span, i, j, block, window)

            def update(carry):
                dq, dk, dv = carry
                qi, doi = _block(qf, i, block, 3), _block(dout, i, block, 3)
                lse_i, delta_i = _block(lse, i, block, 3), _block(delta, i, block, 3)
                p = jnp.where(mask, jnp.exp(_scores(qi, kj, scale) - lse_i[..., None]), 0.0)
                dv = dv + jnp.einsum("bkgqs,bkgqd->bksd", p, doi)
                ds = p * (jnp.einsum("bkgqd,bksd->bkgqs", doi, vj) - delta_i[..., None])
                dk = dk + jnp.einsum("bkgqs,bkgqd->bksd", ds, qi) * scale
                dqi = jnp.einsum("bkgqs,bksd->bkgqd", ds, kj) * scale
                dq = jax.lax.dynamic_update_slice_in_dim(
                    dq, _block(dq, i, block, 3) + dqi, i * block, axis=3
                )
                return dq, dk, dv

            return jax.lax.cond(mask.any(), update, lambda c: c, carry)

        zeros = jnp.zeros(kj.shape, jnp.float32)
        # the first query block reaching key block j: the blocks that do are a suffix of the
        # queries (each block's rows ascend, and so do the blocks of a run)
        reach = span.starts + block - 1 >= j * block
        first = jnp.where(reach.any(), jnp.argmax(reach), n)
        dq, dk, dv = jax.lax.fori_loop(first, n, query_block, (dq, zeros, zeros))  # at and below
        return dq, (dk, dv)

    dq, (dk, dv) = jax.lax.scan(key_block, jnp.zeros(qf.shape, jnp.float32), jnp.arange(n_k))
    dk = jnp.moveaxis(dk, 0, 2).reshape(kh.shape)
    dv = jnp.moveaxis(dv, 0, 2).reshape(vh.shape)
    return dq, dk, dv


@functools.partial(jax.custom_vjp, nondiff_argnums=(4, 5, 6))
def _flash(qh, kh, vh, span, scale, window, block):
    return _forward(qh, kh, vh, span, scale, window, block)[0]


def _flash_fwd(qh, kh, vh, span, scale, window, block):
    out, lse = _forward(qh, kh, vh, span, scale, window, block)
    # named, so that remat="attention" keeps them and never reruns the forward pass
    out, lse = checkpoint_name(out, "attention_out"), checkpoint_name(lse, "attention_lse")
    return out, (qh, kh, vh, span, out, lse)


def _flash_bwd(scale, window, block, residuals, dout):
    qh, kh, vh, span, out, lse = residuals
    dq, dk, dv = _backward(
        qh, kh, vh, span, out, lse, dout.astype(jnp.float32), scale, window, block
    )
    return dq.astype(qh.dtype), dk.astype(kh.dtype), dv.astype(vh.dtype), None


_flash.defvjp(_flash_fwd, _flash_bwd)


def _put(x: jax.Array, index, block: int, axis: int, update: jax.Array) -> jax.Array:
    return jax.lax.dynamic_update_slice_in_dim(x, update, index * block, axis=axis)


def _in_order(mask, carry):
    """The block mask tied to the loop's carry (`optimization_barrier`): XLA's GPU compiler
    otherwise computes every iteration's mask ahead of the loop, broadcast to the scores' shape
    (for an 8B model's 131,072-token rows split 8 ways: a pred[122944, 2, 8, 4, 128, 128],
    120 GiB)."""
    return jax.lax.optimization_barrier((mask, carry))


def _static_forward(qh, kh, vh, span, pairs, scale, window, block):
    """`_forward` as one `scan` over the block pairs at or below the diagonal (`pairs`, a trip
    count known at compile time), every pair computed and masked with `where` (a filler pair
    masks everything); the running statistics of all query blocks are the carry."""
    stats = qh.shape[:4]

    def pair(carry, ij):
        i, j = ij[0], ij[1]
        mask = _block_mask(span, i, j, block, window) & (ij[2] > 0)
        mask, carry = _in_order(mask, carry)
        m_all, d_all, a_all = carry
        m, denom, acc = (_block(x, i, block, 3) for x in carry)
        s = jnp.where(
            mask, _scores(_block(qh, i, block, 3), _block(kh, j, block, 2), scale), -jnp.inf
        )
        m_new = jnp.maximum(m, s.max(-1))
        m_safe = jnp.where(jnp.isfinite(m_new), m_new, 0.0)  # rows with no key yet
        p = jnp.exp(s - m_safe[..., None])
        alpha = jnp.exp(m - m_safe)
        vj = _block(vh, j, block, 2)
        pv = jnp.einsum(
            "bkgqs,bksd->bkgqd", p.astype(vj.dtype), vj, preferred_element_type=jnp.float32
        )
        return (
            _put(m_all, i, block, 3, m_new),
            _put(d_all, i, block, 3, alpha * denom + p.sum(-1)),
            _put(a_all, i, block, 3, alpha[..., None] * acc + pv),
        ), None

    init = (
        jnp.full(stats, -jnp.inf, jnp.float32),
        jnp.zeros(stats, jnp.float32),
        jnp.zeros(qh.shape, jnp.float32),
    )
    (m, denom, acc), _ = jax.lax.scan(pair, init, pairs)
    safe = denom > 0
    out = acc / jnp.where(safe, denom, 1.0)[..., None]
    return out, jnp.where(safe, m + jnp.log(jnp.where(safe, denom, 1.0)), 0.0)


def _static_backward(qh, kh, vh, span, pairs, out, lse, dout, scale, window, block):
    """`_backward` as one `scan` over the block pairs at or below the diagonal, masked with
    `where`; dq, dk and dv (float32) are the carry."""
    delta = jnp.sum(dout * out, axis=-1)  # [B, K, G, T]
    qf, kf, vf = (x.astype(jnp.float32) for x in (qh, kh, vh))

    def pair(carry, ij):
        i, j = ij[0], ij[1]
        mask = _block_mask(span, i, j, block, window) & (ij[2] > 0)
        mask, carry = _in_order(mask, carry)
        dq, dk, dv = carry
        qi, doi = _block(qf, i, block, 3), _block(dout, i, block, 3)
        kj, vj = _block(kf, j, block, 2), _block(vf, j, block, 2)
        lse_i, delta_i = _block(lse, i, block, 3), _block(delta, i, block, 3)
        p = jnp.where(mask, jnp.exp(_scores(qi, kj, scale) - lse_i[..., None]), 0.0)
        ds = p * (jnp.einsum("bkgqd,bksd->bkgqs", doi, vj) - delta_i[..., None])
        dv = _put(
            dv, j, block, 2, _block(dv, j, block, 2) + jnp.einsum("bkgqs,bkgqd->bksd", p, doi)
        )
        dk_j = jnp.einsum("bkgqs,bkgqd->bksd", ds, qi) * scale
        dq_i = jnp.einsum("bkgqs,bksd->bkgqd", ds, kj) * scale
        dk = _put(dk, j, block, 2, _block(dk, j, block, 2) + dk_j)
        dq = _put(dq, i, block, 3, _block(dq, i, block, 3) + dq_i)
        return (dq, dk, dv), None

    zeros = (jnp.zeros(qf.shape, jnp.float32), jnp.zeros(kf.shape, jnp.float32))
    (dq, dk, dv), _ = jax.lax.scan(pair, (zeros[0], zeros[1], zeros[1]), pairs)
    return dq, dk, dv


@functools.partial(jax.custom_vjp, nondiff_argnums=(5, 6, 7))
def _static(qh, kh, vh, span, pairs, scale, window, block):
    return _static_forward(qh, kh, vh, span, pairs, scale, window, block)[0]


def _static_fwd(qh, kh, vh, span, pairs, scale, window, block):
    out, lse = _static_forward(qh, kh, vh, span, pairs, scale, window, block)
    out, lse = checkpoint_name(out, "attention_out"), checkpoint_name(lse, "attention_lse")
    return out, (qh, kh, vh, span, pairs, out, lse)


def _static_bwd(scale, window, block, residuals, dout):
    qh, kh, vh, span, pairs, out, lse = residuals
    dout = dout.astype(jnp.float32)
    dq, dk, dv = _static_backward(qh, kh, vh, span, pairs, out, lse, dout, scale, window, block)
    return dq.astype(qh.dtype), dk.astype(kh.dtype), dv.astype(vh.dtype), None, None


_static.defvjp(_static_fwd, _static_bwd)
