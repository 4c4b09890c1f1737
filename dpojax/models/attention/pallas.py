"""Flash attention as Pallas kernels (forward, and a backward in two kernels), with the layout rule
computed in the kernel from per-token ids and fully masked blocks skipped.

Each program of the forward kernel owns one block of queries of one head of one row and walks
the key blocks up to the diagonal with an online softmax; a block pair that the rule masks
entirely (another segment, the other completion of a prefix-shared or grouped row, outside a
sliding window) is skipped. The backward pass recomputes the probabilities from the saved
log-sum-exp: one kernel accumulates dq per query block over the key blocks at or below the
diagonal, the other dk and dv per key block over the query blocks at or after it (computing the
transposed scores, so every matmul is a plain or right-transposed one).

The kernels are written against the portable Pallas API. On TPU they lower through Mosaic (a
test compiles them ahead of time for a TPU topology); everywhere else, and in tests, they run in
Pallas' interpret mode (`interpret=True`), which executes the same kernel body with XLA.
Operands are padded to the block size; ids travel as int32 [B, T, 1] columns for the queries
and [B, 1, T] rows for the keys, so that every block keeps TPU-friendly 2-D shapes.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.ad_checkpoint import checkpoint_name
from jax.experimental import pallas as pl

from dpojax.models.attention.rule import TokenIds

DEFAULT_BLOCK = 128


def _interpret() -> bool:
    return jax.default_backend() != "tpu"


def _dot(a, b, *, trans_b: bool = False):
    """a @ b (or a @ b.T) accumulated in float32; float32 operands at full precision, bf16 ones
    at the MXU's native one (an explicit precision, so a caller's default_matmul_precision never
    asks Mosaic for fp32 contraction of bf16 operands)."""
    dims = (((1,), (1 if trans_b else 0,)), ((), ()))
    exact = a.dtype == jnp.float32 and b.dtype == jnp.float32
    precision = jax.lax.Precision.HIGHEST if exact else jax.lax.Precision.DEFAULT
    return jax.lax.dot_general(a, b, dims, precision=precision, preferred_element_type=jnp.float32)


def _mask(q_ids, k_ids, q_start, k_start, bq, bk, window):
    """bool [bq, bk] for queries q_start.. (ids as [bq, 1] columns) against keys k_start.. (ids
    as [1, bk] rows)."""
    (q_seg, q_part, q_pos), (k_seg, k_part, k_pos) = q_ids, k_ids
    q_index = q_start + jax.lax.broadcasted_iota(jnp.int32, (bq, bk), 0)
    k_index = k_start + jax.lax.broadcasted_iota(jnp.int32, (bq, bk), 1)
    mask = (q_seg == k_seg) & (k_index <= q_index) & ((k_part == 0) | (q_part == k_part))
    if window:
        mask &= (q_pos - k_pos) < window
    return mask


def _any(mask) -> jax.Array:
    return jnp.max(mask.astype(jnp.int32)) > 0


def _columns(refs, start, size):
    return tuple(r[pl.ds(start, size), :] for r in refs)  # [size, 1]


def _rows(refs, start, size):
    return tuple(r[:, pl.ds(start, size)] for r in refs)  # [1, size]


def _forward_kernel(*refs, scale, window, bq, bk):
    q_ref, k_ref, v_ref = refs[:3]
    qid_refs, kid_refs = refs[3:6], refs[6:9]
    out_ref, lse_ref = refs[9:]
    i = pl.program_id(2)
    q = q_ref[...]
    q_ids = tuple(r[...] for r in qid_refs)

    def key_block(j, carry):
        start = pl.multiple_of(j * bk, bk)
        mask = _mask(q_ids, _rows(kid_refs, start, bk), i * bq, start, bq, bk, window)

        def update(carry):
            m, denom, acc = carry
            s = jnp.where(mask, _dot(q, k_ref[pl.ds(start, bk), :], trans_b=True) * scale, -jnp.inf)
            m_new = jnp.maximum(m, jnp.max(s, axis=1, keepdims=True))
            m_safe = jnp.where(m_new == -jnp.inf, 0.0, m_new)
            p = jnp.exp(s - m_safe)
            alpha = jnp.exp(m - m_safe)
            v = v_ref[pl.ds(start, bk), :]
            acc = alpha * acc + _dot(p.astype(v.dtype), v)
            return m_new, alpha * denom + jnp.sum(p, axis=1, keepdims=True), acc

        return jax.lax.cond(_any(mask), update, lambda c: c, carry)

    init = (
        jnp.full((bq, 1), -jnp.inf, jnp.float32),
        jnp.zeros((bq, 1), jnp.float32),
        jnp.zeros((bq, q.shape[-1]), jnp.float32),
    )
    last = jax.lax.div((i + 1) * bq - 1, bk)  # the key block holding the diagonal
    m, denom, acc = jax.lax.fori_loop(0, last + 1, key_block, init)
    safe = denom > 0
    out_ref[...] = (acc / jnp.where(safe, denom, 1.0)).astype(out_ref.dtype)
    lse_ref[...] = jnp.where(safe, m + jnp.log(jnp.where(safe, denom, 1.0)), 0.0)


def _dq_kernel(*refs, scale, window, bq, bk):
    q_ref, k_ref, v_ref, do_ref, lse_ref, delta_ref = refs[:6]
    qid_refs, kid_refs = refs[6:9], refs[9:12]
    (dq_ref,) = refs[12:]
    i = pl.program_id(2)
    q, do, lse, delta = q_ref[...], do_ref[...], lse_ref[...], delta_ref[...]
    q_ids = tuple(r[...] for r in qid_refs)

    def key_block(j, dq):
        start = pl.multiple_of(j * bk, bk)
        mask = _mask(q_ids, _rows(kid_refs, start, bk), i * bq, start, bq, bk, window)

        def update(dq):
            k = k_ref[pl.ds(start, bk), :]
            p = jnp.where(mask, jnp.exp(_dot(q, k, trans_b=True) * scale - lse), 0.0)
            dp = _dot(do, v_ref[pl.ds(start, bk), :], trans_b=True)
            ds = p * (dp - delta)
            return dq + _dot(ds.astype(k.dtype), k) * scale

        return jax.lax.cond(_any(mask), update, lambda c: c, dq)

    last = jax.lax.div((i + 1) * bq - 1, bk)
    dq = jax.lax.fori_loop(0, last + 1, key_block, jnp.zeros(q.shape, jnp.float32))
    dq_ref[...] = dq.astype(dq_ref.dtype)


def _dkv_kernel(*refs, scale, window, bq, bk, length):
    k_ref, v_ref, q_ref, do_ref, lse_ref, delta_ref = refs[:6]
    kid_refs, qid_refs = refs[6:9], refs[9:12]
    dk_ref, dv_ref = refs[12:]
    j = pl.program_id(2)
    k, v = k_ref[...], v_ref[...]
    k_ids = tuple(r[...] for r in kid_refs)  # [bk, 1] columns: keys index the rows here

    def query_block(i, carry):
        start = pl.multiple_of(i * bq, bq)
        # transposed rule: keys are rows, queries columns
        q_ids = _rows(qid_refs, start, bq)
        k_index = j * bk + jax.lax.broadcasted_iota(jnp.int32, (bk, bq), 0)
        q_index = start + jax.lax.broadcasted_iota(jnp.int32, (bk, bq), 1)
        (k_seg, k_part, k_pos), (q_seg, q_part, q_pos) = k_ids, q_ids
        mask = (q_seg == k_seg) & (k_index <= q_index) & ((k_part == 0) | (q_part == k_part))
        if window:
            mask &= (q_pos - k_pos) < window

        def update(carry):
            dk, dv = carry
            q = q_ref[pl.ds(start, bq), :]
            do = do_ref[pl.ds(start, bq), :]
            lse = lse_ref[:, pl.ds(start, bq)]  # [1, bq]
            delta = delta_ref[:, pl.ds(start, bq)]
            p = jnp.where(mask, jnp.exp(_dot(k, q, trans_b=True) * scale - lse), 0.0)  # [bk, bq]
            dv = dv + _dot(p.astype(do.dtype), do)
            ds = p * (_dot(v, do, trans_b=True) - delta)
            return dk + _dot(ds.astype(q.dtype), q) * scale, dv

        return jax.lax.cond(_any(mask), update, lambda c: c, carry)

    first = jax.lax.div(j * bk, bq)  # the query block holding the diagonal
    zeros = jnp.zeros(k.shape, jnp.float32)
    dk, dv = jax.lax.fori_loop(first, length // bq, query_block, (zeros, zeros))
    dk_ref[...] = dk.astype(dk_ref.dtype)
    dv_ref[...] = dv.astype(dv_ref.dtype)


def _id_columns(ids: TokenIds) -> tuple[jax.Array, ...]:
    return tuple(x[:, :, None] for x in ids)  # [B, T, 1]


def _id_rows(ids: TokenIds) -> tuple[jax.Array, ...]:
    return tuple(x[:, None, :] for x in ids)  # [B, 1, T]


def _specs(b_shape, index):
    return pl.BlockSpec(b_shape, index)


def _cost(qh: jax.Array, block: int, matmuls: int, streams: int) -> pl.CostEstimate:
    """What XLA's cost analysis should count for a kernel (it cannot look inside one): `matmuls`
    [block, block, D] products per block pair at or below the diagonal (the masked ones that
    are skipped included: an upper bound), one exponential per score, and `streams` [B, H, T, D]
    arrays read or written once (each query head reads its KV head's keys and values)."""
    b, h, t, d = qh.shape
    pairs = (t // block) * (t // block + 1) // 2
    scores = b * h * pairs * block * block
    itemsize = qh.dtype.itemsize
    return pl.CostEstimate(
        flops=int(2 * matmuls * scores * d),
        transcendentals=int(scores),
        bytes_accessed=int(streams * b * h * t * d * itemsize + 4 * b * h * t * 4),
    )


def _call_forward(qh, kh, vh, ids, scale, window, block, interpret):
    b, h, t, d = qh.shape
    groups = h // kh.shape[1]
    per_query = _specs((None, None, block, d), lambda b_, h_, i: (b_, h_, i, 0))
    whole_kv = _specs((None, None, t, d), lambda b_, h_, i: (b_, jax.lax.div(h_, groups), 0, 0))
    id_cols = _specs((None, block, 1), lambda b_, h_, i: (b_, i, 0))
    id_rows = _specs((None, 1, t), lambda b_, h_, i: (b_, 0, 0))
    kernel = functools.partial(_forward_kernel, scale=scale, window=window, bq=block, bk=block)
    return pl.pallas_call(
        kernel,
        grid=(b, h, t // block),
        in_specs=[per_query, whole_kv, whole_kv, *[id_cols] * 3, *[id_rows] * 3],
        out_specs=[per_query, _specs((None, None, block, 1), lambda b_, h_, i: (b_, h_, i, 0))],
        out_shape=[
            jax.ShapeDtypeStruct(qh.shape, qh.dtype),
            jax.ShapeDtypeStruct((b, h, t, 1), jnp.float32),
        ],
        interpret=interpret,
        cost_estimate=_cost(qh, block, matmuls=2, streams=4),
        name="dpojax_flash_forward",
    )(qh, kh, vh, *_id_columns(ids), *_id_rows(ids))


def _call_backward(qh, kh, vh, ids, out, lse, dout, scale, window, block, interpret):
    b, h, t, d = qh.shape
    heads = kh.shape[1]
    groups = h // heads
    delta = jnp.sum(dout.astype(jnp.float32) * out.astype(jnp.float32), axis=-1)  # [B, H, T]
    lse = lse[..., 0]
    block_qd = _specs((None, None, block, d), lambda b_, h_, i: (b_, h_, i, 0))
    whole_kv = _specs((None, None, t, d), lambda b_, h_, i: (b_, jax.lax.div(h_, groups), 0, 0))
    block_stat = _specs((None, None, block, 1), lambda b_, h_, i: (b_, h_, i, 0))
    id_cols = _specs((None, block, 1), lambda b_, h_, i: (b_, i, 0))
    id_rows = _specs((None, 1, t), lambda b_, h_, i: (b_, 0, 0))
    dq = pl.pallas_call(
        functools.partial(_dq_kernel, scale=scale, window=window, bq=block, bk=block),
        grid=(b, h, t // block),
        in_specs=[block_qd, whole_kv, whole_kv, block_qd, block_stat, block_stat]
        + [id_cols] * 3
        + [id_rows] * 3,
        out_specs=block_qd,
        out_shape=jax.ShapeDtypeStruct(qh.shape, jnp.float32),
        interpret=interpret,
        cost_estimate=_cost(qh, block, matmuls=3, streams=5),
        name="dpojax_flash_dq",
    )(qh, kh, vh, dout, lse[..., None], delta[..., None], *_id_columns(ids), *_id_rows(ids))
    block_kv = _specs((None, None, block, d), lambda b_, h_, j: (b_, jax.lax.div(h_, groups), j, 0))
    whole_q = _specs((None, None, t, d), lambda b_, h_, j: (b_, h_, 0, 0))
    stat_rows = _specs((None, None, 1, t), lambda b_, h_, j: (b_, h_, 0, 0))
    per_head = _specs((None, None, block, d), lambda b_, h_, j: (b_, h_, j, 0))
    dk, dv = pl.pallas_call(
        functools.partial(_dkv_kernel, scale=scale, window=window, bq=block, bk=block, length=t),
        grid=(b, h, t // block),
        in_specs=[block_kv, block_kv, whole_q, whole_q, stat_rows, stat_rows]
        + [id_cols] * 3
        + [id_rows] * 3,
        out_specs=[per_head, per_head],
        out_shape=[jax.ShapeDtypeStruct((b, h, t, d), jnp.float32)] * 2,
        interpret=interpret,
        cost_estimate=_cost(qh, block, matmuls=4, streams=6),
        name="dpojax_flash_dkv",
    )(kh, vh, qh, dout, lse[:, :, None], delta[:, :, None], *_id_columns(ids), *_id_rows(ids))
    # each query head's share of its KV head's gradient, summed over the group
    dk = dk.reshape(b, heads, groups, t, d).sum(2)
    dv = dv.reshape(b, heads, groups, t, d).sum(2)
    return dq, dk, dv


@functools.partial(jax.custom_vjp, nondiff_argnums=(4, 5, 6, 7))
def _attention(qh, kh, vh, ids, scale, window, block, interpret):
    return _call_forward(qh, kh, vh, ids, scale, window, block, interpret)[0]


def _attention_fwd(qh, kh, vh, ids, scale, window, block, interpret):
    out, lse = _call_forward(qh, kh, vh, ids, scale, window, block, interpret)
    # named, so that remat="attention" keeps them and never reruns the forward kernel
    out, lse = checkpoint_name(out, "attention_out"), checkpoint_name(lse, "attention_lse")
    return out, (qh, kh, vh, ids, out, lse)


def _attention_bwd(scale, window, block, interpret, residuals, dout):
    qh, kh, vh, ids, out, lse = residuals
    dq, dk, dv = _call_backward(qh, kh, vh, ids, out, lse, dout, scale, window, block, interpret)
    return dq.astype(qh.dtype), dk.astype(kh.dtype), dv.astype(vh.dtype), None


_attention.defvjp(_attention_fwd, _attention_bwd)


def pallas_attention(
    q: jax.Array,
    k: jax.Array,
    v: jax.Array,
    ids: TokenIds,
    *,
    scale: float,
    window: int | None = None,
    block: int = DEFAULT_BLOCK,
    interpret: bool | None = None,
) -> jax.Array:
    """Grouped-query self-attention under the layout rule, as Pallas kernels. q [B, T, H, D],
    k and v [B, T, K, D] with H % K == 0; returns [B, T, H, D] in q's dtype. `interpret`
    (default: off on TPU, on elsewhere) runs the kernels in Pallas' interpreter."""
    b, t, h, d = q.shape
    interpret = _interpret() if interpret is None else interpret
    # compiled, Mosaic slices the id rows along TPU lanes: blocks are whole multiples of 128
    block = min(block, -(-t // 8) * 8) if interpret else -(-block // 128) * 128
    pad = -t % block
    qh = q.transpose(0, 2, 1, 3)  # [B, H, T, D]
    kh, vh = k.transpose(0, 2, 1, 3), v.transpose(0, 2, 1, 3)  # [B, K, T, D]
    if pad:  # padding tokens form their own segment (-1) and are dropped afterwards
        qh, kh, vh = (jnp.pad(x, [(0, 0), (0, 0), (0, pad), (0, 0)]) for x in (qh, kh, vh))
        ids = ids.padded(pad)
    out = _attention(qh, kh, vh, ids, scale, window, block, interpret)
    return out[:, :, :t].transpose(0, 2, 1, 3)
