"""Flash attention as Pallas kernels (forward, and a backward in two kernels), with the layout rule
computed in the kernel from per-token ids and fully masked blocks neither loaded nor computed.

Every kernel walks one axis of blocks as the last (sequential) axis of its grid and keeps its
running state in VMEM scratch, so a program holds one block of each operand whatever the row's
length:

| kernel | grid | accumulates (scratch) |
|---|---|---|
| forward | row, query head, query block, key block | max, denominator [bq, 1], output [bq, D] (float32) |
| dq | row, query head, query block, key block | dq [bq, D] |
| dkv | row, KV head, key block, query head of the group, query block | dk, dv [bk, D] |

All axes but the accumulating ones are marked "parallel", so a megacore chip (v4, v5p) splits
them across its two TensorCores. The dkv kernel sums a KV head's gradient over its query heads
in scratch (grouped-query attention writes dK and dV once per KV head, in the operands' dtype).
The log-sum-exp and the backward's delta travel lane-dense, as [B, H, 1, T] rows.

Which block pairs a kernel visits is decided once per batch (`block_table`, from per-block
summaries of the token ids): the pairs above the diagonal and those the rule masks entirely
(another segment, the other completion of a prefix-shared or grouped row, outside a sliding
window) are skipped with `pl.when`, and the K/V (or Q) block index of a skipped step repeats the
last visited one, so the pipeline issues no copy for it. The table rides in SMEM (scalar
prefetch) as the index each step fetches (`fetch_table`).

Blocks are sized per TPU generation (`BLOCKS`). On TPU the kernels lower through Mosaic (tests
compile them ahead of time for v5e at 2k and 16k tokens); everywhere else, and in tests, they
run in Pallas' interpret mode, which executes the same kernel bodies with XLA. Operands are
padded to the block size; ids travel as int32 [B, T, 1] columns for the side a kernel keeps
fixed and [B, 1, T] rows for the side it walks, so every block keeps TPU-friendly 2-D shapes.
"""

from __future__ import annotations

import functools
from typing import NamedTuple

import jax
import jax.numpy as jnp
from jax.ad_checkpoint import checkpoint_name
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu

from dpojax.models.attention.rule import TokenIds

# Query and key block per TPU generation (chip keys of dpojax.hardware.chips): v6e's 256x256
# MXU takes larger blocks than the 128x128 MXUs of v4 and v5e. `DEFAULT_BLOCK` for other chips.
BLOCKS = {"v4": 256, "v5e": 256, "v5p": 512, "v6e": 512, "tpu7x": 512}
DEFAULT_BLOCK = 256
BLOCK_CHOICES = (128, 256, 512)  # the blocks a plan's search compiles
LANES = 128  # compiled, block sizes are multiples of the TPU's lane count


def _interpret() -> bool:
    return jax.default_backend() != "tpu"


def chip_block(chip: str | None = None) -> int:
    """The block of chip key `chip` (default: this process's first device when it is a TPU)."""
    if chip is None and jax.default_backend() == "tpu":
        from dpojax.hardware.chips import DEVICE_KINDS

        chip = DEVICE_KINDS.get(jax.devices()[0].device_kind)
    return BLOCKS.get(chip or "", DEFAULT_BLOCK)


def kernel_block(length: int, block: int | None = None, *, interpret: bool) -> int:
    """The block the kernels use for rows of `length` tokens: `block` (default `chip_block()`),
    at most the row rounded up to 8 (interpreted) or to 128 (compiled, where blocks are whole
    multiples of 128: Mosaic slices the id rows along TPU lanes)."""
    block = block or chip_block()
    if interpret:
        return min(block, -(-length // 8) * 8)
    return min(-(-block // LANES) * LANES, -(-length // LANES) * LANES)


class Side(NamedTuple):
    """One side of the attention (the queries or the keys): the per-token ids [B, T] and each
    token's index in its row, int32 [T] (the same for every row of the batch). On whole rows both
    sides are the row (`whole`); on rows split over a context axis the queries are a device's
    stretch (its two chunks under causal load balancing) and the keys the gathered row."""

    ids: TokenIds
    rows: jax.Array

    @classmethod
    def whole(cls, ids: TokenIds) -> Side:
        return cls(ids, jnp.arange(ids.segment_ids.shape[1], dtype=jnp.int32))

    def padded(self, pad: int) -> Side:
        """`pad` more padding tokens (`TokenIds.padded`) at row index `PAD_ROW`."""
        rows = jnp.pad(self.rows.astype(jnp.int32), (0, pad), constant_values=PAD_ROW)
        return Side(self.ids.padded(pad), rows)

    def streams(self) -> tuple[jax.Array, ...]:
        """The four int32 [B, T] id streams the kernels read: segment, part, position, row."""
        b, t = self.ids.segment_ids.shape
        return (*self.ids, jnp.broadcast_to(self.rows.astype(jnp.int32), (b, t)))


PAD_ROW = 2**30  # the row index of padding tokens (their own segment, -1: nothing attends them)


def block_table(queries: Side, keys: Side, block: int, window: int | None = None) -> jax.Array:
    """bool [B, nq, nk]: which (query block, key block) pairs of the sides' `block`-token blocks
    (each side a multiple of `block` long) the kernels visit. A pair is skipped when every key
    comes after every query in the row or the rule provably masks all of it, from per-block
    ranges of the ids: disjoint segment ranges; a key block without prompt tokens (part 0)
    whose part range misses the query block's; or, with a window, the query block's earliest
    position `window` or more after the key block's latest. Never skips a pair holding an
    allowed entry (the kernels apply the exact rule inside)."""

    def ranges(side: Side):
        b, t = side.ids.segment_ids.shape
        n = t // block
        blocks = [x.reshape(b, n, block) for x in side.streams()]
        return [(x.min(-1), x.max(-1)) for x in blocks]

    q_ranges, k_ranges = ranges(queries), ranges(keys)
    q = [(lo[:, :, None], hi[:, :, None]) for lo, hi in q_ranges]  # [B, nq, 1]
    k = [(lo[:, None, :], hi[:, None, :]) for lo, hi in k_ranges]  # [B, 1, nk]
    (qs_lo, qs_hi), (qp_lo, qp_hi), (qx_lo, _), (_, qr_hi) = q
    (ks_lo, ks_hi), (kp_lo, kp_hi), (_, kx_hi), (kr_lo, _) = k
    visit = (qs_lo <= ks_hi) & (ks_lo <= qs_hi)
    visit &= (kp_lo == 0) | ((qp_lo <= kp_hi) & (kp_lo <= qp_hi))
    if window:
        visit &= (qx_lo - kx_hi) < window
    return visit & (kr_lo <= qr_hi)


def fetch_table(visit: jax.Array) -> jax.Array:
    """int32 [..., m] of bool `visit` [..., m]: the block each step of the walk along the last
    axis loads — its own where visited, else the last visited one before it (the first after
    it when none is), so a skipped step repeats a block index and copies nothing. A step is
    visited iff its entry equals its own index."""
    m = visit.shape[-1]
    steps = jnp.arange(m, dtype=jnp.int32)
    last = jax.lax.cummax(jnp.where(visit, steps, -1), axis=visit.ndim - 1)
    following = jax.lax.cummin(jnp.where(visit, steps, m), axis=visit.ndim - 1, reverse=True)
    return jnp.where(last >= 0, last, jnp.minimum(following, m - 1)).astype(jnp.int32)


def _dot(a, b, *, trans_b: bool = False):
    """a @ b (or a @ b.T) accumulated in float32; float32 operands at full precision, bf16 ones
    at the MXU's native one (an explicit precision, so a caller's default_matmul_precision never
    asks Mosaic for fp32 contraction of bf16 operands)."""
    dims = (((1,), (1 if trans_b else 0,)), ((), ()))
    exact = a.dtype == jnp.float32 and b.dtype == jnp.float32
    precision = jax.lax.Precision.HIGHEST if exact else jax.lax.Precision.DEFAULT
    return jax.lax.dot_general(a, b, dims, precision=precision, preferred_element_type=jnp.float32)


def _rule(q_ids, k_ids, window):
    """bool: the rule between queries and keys of a block pair, each side's four streams
    (`Side.streams`: segment, part, position, row index) as [r, 1] columns or [1, c] rows,
    broadcast to the pair's score shape."""
    (q_seg, q_part, q_pos, q_row), (k_seg, k_part, k_pos, k_row) = q_ids, k_ids
    mask = (q_seg == k_seg) & (k_row <= q_row) & ((k_part == 0) | (q_part == k_part))
    if window:
        mask &= (q_pos - k_pos) < window
    return mask


def _ids(refs):
    return tuple(r[...] for r in refs)


def _forward_kernel(fetch_ref, *refs, scale, window, block, nq, nk):
    q_ref, k_ref, v_ref = refs[:3]
    qid_refs, kid_refs = refs[3:7], refs[7:11]
    out_ref, lse_ref, m_ref, l_ref, acc_ref = refs[11:]
    b, i, j = pl.program_id(0), pl.program_id(2), pl.program_id(3)

    @pl.when(j == 0)
    def _init():
        m_ref[...] = jnp.full(m_ref.shape, -jnp.inf, jnp.float32)
        l_ref[...] = jnp.zeros(l_ref.shape, jnp.float32)
        acc_ref[...] = jnp.zeros(acc_ref.shape, jnp.float32)

    @pl.when(fetch_ref[(b * nq + i) * nk + j] == j)
    def _visit():
        mask = _rule(_ids(qid_refs), _ids(kid_refs), window)
        s = jnp.where(mask, _dot(q_ref[...], k_ref[...], trans_b=True) * scale, -jnp.inf)
        m = m_ref[...]
        m_new = jnp.maximum(m, jnp.max(s, axis=1, keepdims=True))
        m_safe = jnp.where(m_new == -jnp.inf, 0.0, m_new)  # rows with no key yet
        p = jnp.exp(s - m_safe)
        alpha = jnp.exp(m - m_safe)
        v = v_ref[...]
        acc_ref[...] = alpha * acc_ref[...] + _dot(p.astype(v.dtype), v)
        l_ref[...] = alpha * l_ref[...] + jnp.sum(p, axis=1, keepdims=True)
        m_ref[...] = m_new

    @pl.when(j == nk - 1)
    def _finish():
        denom = l_ref[...]
        safe = denom > 0
        out_ref[...] = (acc_ref[...] / jnp.where(safe, denom, 1.0)).astype(out_ref.dtype)
        lse = jnp.where(safe, m_ref[...] + jnp.log(jnp.where(safe, denom, 1.0)), 0.0)  # [bq, 1]
        # lane-dense: the column as a [1, bq] row (through a 2-D transpose Mosaic supports)
        lse_ref[...] = jnp.broadcast_to(lse, (block, LANES)).T[:1]


def _dq_kernel(fetch_ref, *refs, scale, window, nq, nk):
    q_ref, k_ref, v_ref, do_ref, lse_ref, delta_ref = refs[:6]
    qid_refs, kid_refs = refs[6:10], refs[10:14]
    dq_ref, acc_ref = refs[14:]
    b, i, j = pl.program_id(0), pl.program_id(2), pl.program_id(3)

    @pl.when(j == 0)
    def _init():
        acc_ref[...] = jnp.zeros(acc_ref.shape, jnp.float32)

    @pl.when(fetch_ref[(b * nq + i) * nk + j] == j)
    def _visit():
        mask = _rule(_ids(qid_refs), _ids(kid_refs), window)
        lse = jnp.expand_dims(lse_ref[0], -1)  # [bq, 1]
        delta = jnp.expand_dims(delta_ref[0], -1)
        k = k_ref[...]
        p = jnp.where(mask, jnp.exp(_dot(q_ref[...], k, trans_b=True) * scale - lse), 0.0)
        ds = p * (_dot(do_ref[...], v_ref[...], trans_b=True) - delta)
        acc_ref[...] += _dot(ds.astype(k.dtype), k) * scale

    @pl.when(j == nk - 1)
    def _finish():
        dq_ref[...] = acc_ref[...].astype(dq_ref.dtype)


def _dkv_kernel(fetch_ref, *refs, scale, window, nq, nk, groups):
    k_ref, v_ref, q_ref, do_ref, lse_ref, delta_ref = refs[:6]
    kid_refs, qid_refs = refs[6:10], refs[10:14]
    dk_ref, dv_ref, dk_acc, dv_acc = refs[14:]
    b, j, g, i = pl.program_id(0), pl.program_id(2), pl.program_id(3), pl.program_id(4)

    @pl.when((g == 0) & (i == 0))
    def _init():
        dk_acc[...] = jnp.zeros(dk_acc.shape, jnp.float32)
        dv_acc[...] = jnp.zeros(dv_acc.shape, jnp.float32)

    @pl.when(fetch_ref[(b * nk + j) * nq + i] == i)
    def _visit():
        # transposed scores [bk, bq]: keys are rows, queries columns
        mask = _rule(_ids(qid_refs), _ids(kid_refs), window)
        q, do = q_ref[...], do_ref[...]
        p = jnp.where(mask, jnp.exp(_dot(k_ref[...], q, trans_b=True) * scale - lse_ref[...]), 0.0)
        dv_acc[...] += _dot(p.astype(do.dtype), do)
        ds = p * (_dot(v_ref[...], do, trans_b=True) - delta_ref[...])
        dk_acc[...] += _dot(ds.astype(q.dtype), q) * scale

    @pl.when((g == groups - 1) & (i == nq - 1))
    def _finish():
        dk_ref[...] = dk_acc[...].astype(dk_ref.dtype)
        dv_ref[...] = dv_acc[...].astype(dv_ref.dtype)


def _columns(streams: tuple[jax.Array, ...]) -> tuple[jax.Array, ...]:
    return tuple(x[:, :, None] for x in streams)  # [B, T, 1]


def _rows(streams: tuple[jax.Array, ...]) -> tuple[jax.Array, ...]:
    return tuple(x[:, None, :] for x in streams)  # [B, 1, T]


def _cost(qh, kh, block: int, matmuls: int, streams: int) -> pl.CostEstimate:
    """What XLA's cost analysis should count for a kernel (it cannot look inside one): `matmuls`
    [block, block, D] products per block pair on or below the causal boundary (half the pairs
    plus the diagonal's; the masked ones that are skipped included: an upper bound), one
    exponential per score, and `streams` [B, H, T, D] arrays read or written once, T the mean
    of the two sides' lengths (each query head reads its KV head's keys and values)."""
    b, h, tq, d = qh.shape
    tk = kh.shape[2]
    pairs = (tq // block) * (tk // block + 1) // 2
    scores = b * h * pairs * block * block
    itemsize = qh.dtype.itemsize
    return pl.CostEstimate(
        flops=int(2 * matmuls * scores * d),
        transcendentals=int(scores),
        bytes_accessed=int(streams * b * h * (tq + tk) // 2 * d * itemsize + 4 * b * h * tq * 4),
    )


def _call(kernel, name, grid, semantics, in_specs, out_specs, out_shape, scratch, interpret, cost):
    return pl.pallas_call(
        kernel,
        grid_spec=pltpu.PrefetchScalarGridSpec(
            num_scalar_prefetch=1,
            grid=grid,
            in_specs=in_specs,
            out_specs=out_specs,
            scratch_shapes=[pltpu.VMEM(shape, jnp.float32) for shape in scratch],
        ),
        out_shape=out_shape,
        compiler_params=pltpu.CompilerParams(dimension_semantics=semantics),
        interpret=interpret,
        cost_estimate=cost,
        name=name,
    )


_QUERY_WALK = ("parallel", "parallel", "parallel", "arbitrary")  # row, head, query block; keys


def _call_forward(qh, kh, vh, q_ids, k_ids, visit, scale, window, block, interpret):
    b, h, tq, d = qh.shape
    nq, nk, groups = tq // block, kh.shape[2] // block, h // kh.shape[1]
    fetch = fetch_table(visit).reshape(-1)

    def key(b_, h_, i, j, f):
        return f[(b_ * nq + i) * nk + j]

    per_query = pl.BlockSpec((None, None, block, d), lambda b_, h_, i, j, f: (b_, h_, i, 0))
    kv = pl.BlockSpec(
        (None, None, block, d),
        lambda b_, h_, i, j, f: (b_, jax.lax.div(h_, groups), key(b_, h_, i, j, f), 0),
    )
    id_cols = pl.BlockSpec((None, block, 1), lambda b_, h_, i, j, f: (b_, i, 0))
    id_rows = pl.BlockSpec((None, 1, block), lambda b_, h_, i, j, f: (b_, 0, key(b_, h_, i, j, f)))
    stat = pl.BlockSpec((None, None, 1, block), lambda b_, h_, i, j, f: (b_, h_, 0, i))
    kernel = functools.partial(
        _forward_kernel, scale=scale, window=window, block=block, nq=nq, nk=nk
    )
    return _call(
        kernel,
        "dpojax_flash_forward",
        (b, h, nq, nk),
        _QUERY_WALK,
        [per_query, kv, kv, *[id_cols] * 4, *[id_rows] * 4],
        [per_query, stat],
        [
            jax.ShapeDtypeStruct(qh.shape, qh.dtype),
            jax.ShapeDtypeStruct((b, h, 1, tq), jnp.float32),
        ],
        [(block, 1), (block, 1), (block, d)],
        interpret,
        _cost(qh, kh, block, matmuls=2, streams=4),
    )(fetch, qh, kh, vh, *_columns(q_ids), *_rows(k_ids))


def _call_dq(qh, kh, vh, q_ids, k_ids, visit, lse, delta, dout, scale, window, block, interpret):
    b, h, tq, d = qh.shape
    nq, nk, groups = tq // block, kh.shape[2] // block, h // kh.shape[1]
    fetch = fetch_table(visit).reshape(-1)

    def key(b_, i, j, f):
        return f[(b_ * nq + i) * nk + j]

    per_query = pl.BlockSpec((None, None, block, d), lambda b_, h_, i, j, f: (b_, h_, i, 0))
    kv = pl.BlockSpec(
        (None, None, block, d),
        lambda b_, h_, i, j, f: (b_, jax.lax.div(h_, groups), key(b_, i, j, f), 0),
    )
    stat = pl.BlockSpec((None, None, 1, block), lambda b_, h_, i, j, f: (b_, h_, 0, i))
    id_cols = pl.BlockSpec((None, block, 1), lambda b_, h_, i, j, f: (b_, i, 0))
    id_rows = pl.BlockSpec((None, 1, block), lambda b_, h_, i, j, f: (b_, 0, key(b_, i, j, f)))
    kernel = functools.partial(_dq_kernel, scale=scale, window=window, nq=nq, nk=nk)
    return _call(
        kernel,
        "dpojax_flash_dq",
        (b, h, nq, nk),
        _QUERY_WALK,
        [per_query, kv, kv, per_query, stat, stat, *[id_cols] * 4, *[id_rows] * 4],
        per_query,
        jax.ShapeDtypeStruct(qh.shape, qh.dtype),
        [(block, d)],
        interpret,
        _cost(qh, kh, block, matmuls=3, streams=5),
    )(fetch, qh, kh, vh, dout, lse, delta, *_columns(q_ids), *_rows(k_ids))


def _call_dkv(qh, kh, vh, q_ids, k_ids, visit, lse, delta, dout, scale, window, block, interpret):
    b, h, tq, d = qh.shape
    heads = kh.shape[1]
    nq, nk, groups = tq // block, kh.shape[2] // block, h // heads
    fetch = fetch_table(jnp.swapaxes(visit, 1, 2)).reshape(-1)  # per key block, over queries

    def query(b_, j, i, f):
        return f[(b_ * nk + j) * nq + i]

    per_key = pl.BlockSpec((None, None, block, d), lambda b_, k_, j, g, i, f: (b_, k_, j, 0))
    per_query = pl.BlockSpec(
        (None, None, block, d),
        lambda b_, k_, j, g, i, f: (b_, k_ * groups + g, query(b_, j, i, f), 0),
    )
    stat = pl.BlockSpec(
        (None, None, 1, block),
        lambda b_, k_, j, g, i, f: (b_, k_ * groups + g, 0, query(b_, j, i, f)),
    )
    id_cols = pl.BlockSpec((None, block, 1), lambda b_, k_, j, g, i, f: (b_, j, 0))
    id_rows = pl.BlockSpec((None, 1, block), lambda b_, k_, j, g, i, f: (b_, 0, query(b_, j, i, f)))
    kernel = functools.partial(_dkv_kernel, scale=scale, window=window, nq=nq, nk=nk, groups=groups)
    return _call(
        kernel,
        "dpojax_flash_dkv",
        (b, heads, nk, groups, nq),
        ("parallel", "parallel", "parallel", "arbitrary", "arbitrary"),
        [per_key, per_key, per_query, per_query, stat, stat, *[id_cols] * 4, *[id_rows] * 4],
        [per_key, per_key],
        [jax.ShapeDtypeStruct(kh.shape, kh.dtype), jax.ShapeDtypeStruct(vh.shape, vh.dtype)],
        [(block, d), (block, d)],
        interpret,
        _cost(qh, kh, block, matmuls=4, streams=6),
    )(fetch, kh, vh, qh, dout, lse, delta, *_columns(k_ids), *_rows(q_ids))


@functools.partial(jax.custom_vjp, nondiff_argnums=(6, 7, 8, 9))
def _attention(qh, kh, vh, q_ids, k_ids, visit, scale, window, block, interpret):
    return _call_forward(qh, kh, vh, q_ids, k_ids, visit, scale, window, block, interpret)[0]


def _attention_fwd(qh, kh, vh, q_ids, k_ids, visit, scale, window, block, interpret):
    args = (qh, kh, vh, q_ids, k_ids, visit, scale, window, block, interpret)
    out, lse = _call_forward(*args)
    # named, so that remat="attention" keeps them and never reruns the forward kernel
    out, lse = checkpoint_name(out, "attention_out"), checkpoint_name(lse, "attention_lse")
    return out, (qh, kh, vh, q_ids, k_ids, visit, out, lse)


def _attention_bwd(scale, window, block, interpret, residuals, dout):
    qh, kh, vh, q_ids, k_ids, visit, out, lse = residuals
    dout = dout.astype(qh.dtype)
    delta = jnp.sum(dout.astype(jnp.float32) * out.astype(jnp.float32), axis=-1)[:, :, None]
    args = (qh, kh, vh, q_ids, k_ids, visit, lse, delta, dout, scale, window, block, interpret)
    dq = _call_dq(*args)
    dk, dv = _call_dkv(*args)
    return dq, dk, dv, None, None, None


_attention.defvjp(_attention_fwd, _attention_bwd)


def padded_table(ids: TokenIds, block: int, window: int | None) -> jax.Array:
    """`block_table` of whole rows of `ids` padded to a multiple of `block` (as
    `pallas_attention` pads them): what `Rows` builds once per batch for every layer's kernels."""
    side = Side.whole(ids)
    pad = -ids.segment_ids.shape[1] % block
    side = side.padded(pad) if pad else side
    return block_table(side, side, block, window)


def pallas_attention(
    q: jax.Array,
    k: jax.Array,
    v: jax.Array,
    ids: TokenIds,
    *,
    scale: float,
    window: int | None = None,
    block: int | None = None,
    interpret: bool | None = None,
    visit: jax.Array | None = None,
    keys: Side | None = None,
    query_rows: jax.Array | None = None,
) -> jax.Array:
    """Grouped-query attention under the layout rule, as Pallas kernels. q [B, Tq, H, D], k and
    v [B, Tk, K, D] with H % K == 0; returns [B, Tq, H, D] in q's dtype. Self-attention of whole
    rows by default (`ids` both sides' ids, Tq == Tk); on rows split over a context axis the
    queries are a stretch of the row at `query_rows` (int [Tq], their row indices) with ids
    `ids`, and `keys` the ids and row indices of the keys (any order: the rule compares row
    indices). `block` (default: the chip's, `kernel_block` of Tq), `interpret` (default: off on
    TPU, on elsewhere: Pallas' interpreter), `visit` the batch's `padded_table` for this block
    and window (whole rows; built here when left out)."""
    tq, tk = q.shape[1], k.shape[1]
    interpret = _interpret() if interpret is None else interpret
    block = kernel_block(tq, block, interpret=interpret)
    queries = Side.whole(ids) if query_rows is None else Side(ids, query_rows)
    q_pad, k_pad = -tq % block, -tk % block
    qh = q.transpose(0, 2, 1, 3)  # [B, H, Tq, D]
    kh, vh = k.transpose(0, 2, 1, 3), v.transpose(0, 2, 1, 3)  # [B, K, Tk, D]
    # padding tokens form their own segment (-1) and are dropped afterwards
    if q_pad:
        qh = jnp.pad(qh, [(0, 0), (0, 0), (0, q_pad), (0, 0)])
    if k_pad:
        kh, vh = (jnp.pad(x, [(0, 0), (0, 0), (0, k_pad), (0, 0)]) for x in (kh, vh))
    queries = queries.padded(q_pad) if q_pad else queries
    if keys is None:  # self-attention of whole rows: one side, padded once
        keys = queries
    elif k_pad:
        keys = keys.padded(k_pad)
    if visit is None:
        visit = block_table(queries, keys, block, window)
    q_ids = queries.streams()
    k_ids = q_ids if keys is queries else keys.streams()
    out = _attention(qh, kh, vh, q_ids, k_ids, visit, scale, window, block, interpret)
    return out[:, :, :tq].transpose(0, 2, 1, 3)
