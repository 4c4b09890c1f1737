"""Next-token log-probs of completion tokens, from final hidden states and the LM head.

Batch contract (every layout — padded, packed, prefix-shared, grouped — is described this way):
  tokens         int[R, L]  token ids of each row
  pred_index     int[R, L]  the row position whose hidden state predicts this token: i - 1 inside
                            a sequence; the prompt's last position for the first token of each
                            completion that follows another completion (prefix-shared, grouped)
  completion_ids int[R, L]  which completion (0..C-1, numbered over the whole batch) the token is
                            scored for; -1 for prompt tokens and padding
The log-prob of a scored token i is log softmax(hidden[pred_index[i]] @ W.T)[tokens[i]], always in
float32. `token_logps` never builds the [R, L, V] float32 logits: it walks the vocabulary in chunks
with an online log-sum-exp, and each chunk is rematerialised in the backward pass.
"""

from __future__ import annotations

import functools
from typing import NamedTuple

import jax
import jax.numpy as jnp

from dpojax.models.layers import softcap
from dpojax.models.sharding import constrain


def gather_rows(hidden: jax.Array, pred_index: jax.Array) -> jax.Array:
    """hidden [R, L, D] gathered at pred_index [R, L] -> [R, L, D]."""
    index = jnp.clip(pred_index, 0, hidden.shape[1] - 1)
    return jnp.take_along_axis(hidden, index[..., None], axis=1)


def _vocab_chunks(head: jax.Array, chunk: int) -> tuple[jax.Array, jax.Array]:
    """head [V, D] -> chunks [ceil(V / chunk), chunk, D], zero-padded, and which of their rows are
    real vocabulary entries [ceil(V / chunk), chunk] (the padding is masked to -inf)."""
    vocab = head.shape[0]
    n = -(-vocab // chunk)
    if n * chunk > vocab:
        head = jnp.concatenate([head, jnp.zeros((n * chunk - vocab, head.shape[1]), head.dtype)])
    valid = jnp.arange(n * chunk).reshape(n, chunk) < vocab
    return head.reshape(n, chunk, head.shape[1]), valid


def _chunk_logits(h: jax.Array, w: jax.Array, valid: jax.Array, cap: float | None) -> jax.Array:
    """float32 logits [N, c] of hidden states [N, D] against one vocabulary chunk [c, D]
    (soft-capped by `cap`)."""
    logits = softcap(jnp.einsum("nd,vd->nv", h, w, preferred_element_type=jnp.float32), cap)
    return constrain(jnp.where(valid, logits, -jnp.inf), ("tokens", "vocab"))


class TokenStats(NamedTuple):
    """Per-token statistics of the next-token distribution, for the metrics TRL 1.16 logs (no
    gradient flows through them): the entropy in nats, the mean logit over the vocabulary, and
    whether the target token is the distribution's first argmax (1.0 / 0.0; a tie with an earlier
    token does not count, as `argmax` returns the first maximum)."""

    entropy: jax.Array
    mean_logit: jax.Array
    is_top1: jax.Array


def _full_stats(logits: jax.Array, tokens: jax.Array) -> TokenStats:
    """TokenStats of whole-vocabulary float32 logits [..., V]. The entropy is taken of the logits
    less their maximum (log s - Σ e·z / s with e = exp(z), s = Σ e): from the raw logits, log Z -
    E[z] cancels two numbers of the logits' size (3e-5 off at logits ~30)."""
    z = logits - logits.max(-1, keepdims=True)
    e = jnp.exp(z)
    s = e.sum(-1)
    first = jnp.argmax(logits, axis=-1)
    return TokenStats(
        entropy=jnp.log(s) - (e * z).sum(-1) / s,
        mean_logit=logits.mean(-1),
        is_top1=(first == tokens).astype(jnp.float32),
    )


def _chunked_lse_forward(h, head, targets, chunk, squares, cap, stats):
    """(lse, lse2, TokenStats or None) of hidden states h [N, D] against the head [V, D] in
    vocabulary chunks; `targets` [N] are the tokens the statistics score (with `stats`).

    The statistics ride on the log-sum-exp's pass: Σ exp(z - m)·z rescaled with the running
    maximum m as the sum is (entropy = log Z - that / Σ exp(z - m)), and the first index of the
    running maximum (a later chunk takes over only with a strictly larger maximum, as `argmax`
    keeps the first). Σ_v z_v is h·Σ_v w_v without a soft cap (one matrix-vector product), else
    summed chunk by chunk."""
    h = constrain(h, ("tokens", "embed"))
    chunks, valid = _vocab_chunks(head, chunk)
    starts = jnp.arange(chunks.shape[0], dtype=jnp.int32) * chunk

    def step(carry, xs):
        (m, s), (m2, s2), (t, zsum, first) = carry
        w, ok, start = xs
        logits = _chunk_logits(h, w, ok, cap)
        chunk_max = logits.max(-1)
        new_m = jnp.maximum(m, chunk_max)
        scale = jnp.exp(m - new_m)
        e = jnp.exp(logits - new_m[:, None])
        s = s * scale + e.sum(-1)
        if squares:
            sq = 2.0 * logits
            new_m2 = jnp.maximum(m2, sq.max(-1))
            s2 = s2 * jnp.exp(m2 - new_m2) + jnp.exp(sq - new_m2[:, None]).sum(-1)
            m2 = new_m2
        if stats:
            z = jnp.where(ok, logits, 0.0)  # the padding's -inf would make 0·inf
            t = t * scale + (e * z).sum(-1)
            if cap:
                zsum = zsum + z.sum(-1)
            here = start + jnp.argmax(logits, axis=-1).astype(jnp.int32)
            first = jnp.where(chunk_max > m, here, first)
        return ((new_m, s), (m2, s2), (t, zsum, first)), None

    init = jnp.full(h.shape[:1], -jnp.inf, jnp.float32)
    zeros = jnp.zeros(h.shape[:1], jnp.float32)
    none = jnp.full(h.shape[:1], -1, jnp.int32)
    carry = ((init, zeros), (init, zeros), (zeros, zeros, none))
    ((m, s), (m2, s2), (t, zsum, first)), _ = jax.lax.scan(step, carry, (chunks, valid, starts))
    lse = m + jnp.log(s)
    if not stats:
        return lse, m2 + jnp.log(s2), None
    if not cap:
        column_sums = jnp.sum(head, axis=0, dtype=jnp.float32)  # Σ_v w_v, summed in float32
        zsum = jnp.einsum("nd,d->n", h.astype(jnp.float32), column_sums)
    top1 = (first == targets).astype(jnp.float32)
    return lse, m2 + jnp.log(s2), TokenStats(lse - t / s, zsum / head.shape[0], top1)


@functools.partial(jax.custom_vjp, nondiff_argnums=(3, 4, 5, 6))
def chunked_logsumexp(
    h: jax.Array,
    head: jax.Array,
    targets: jax.Array | None,
    chunk: int,
    squares: bool = False,
    cap: float | None = None,
    stats: bool = False,
):
    """(log Σ_v exp(z_v), log Σ_v exp(2 z_v), TokenStats or None) [N], float32, for the logits
    z_v = h·w_v of hidden states h [N, D] against the head [V, D] (soft-capped, z = cap tanh(h·w
    / cap), with `cap`), walking the vocabulary in chunks of `chunk`: at most one chunk's [N,
    chunk] logits exist at a time. The second is only computed with `squares` (else -inf); the
    statistics of the tokens `targets` [N] only with `stats` (metrics: no gradient flows
    through them; `targets` may be None without).

    The backward pass recomputes each chunk's logits and uses the saved log-sum-exp directly
    (d lse / d logits = exp(logits - lse)). The head's gradient is computed transposed,
    h^T [D, N] @ p [N, c], so the [N, c] probabilities are never transposed in memory; h is
    transposed once and the [D, V] result once. Autodiff of the online log-sum-exp instead
    differentiates the running maxima and writes a transposed copy of every chunk's
    probabilities (large model, [3072, 768] hidden states, vocab 8192 in chunks of 4096: the
    gradient 645 -> 379 ms; docs/benchmarks.md)."""
    return _chunked_lse_forward(h, head, targets, chunk, squares, cap, stats)


def _chunked_lse_fwd(h, head, targets, chunk, squares, cap, stats):
    out = _chunked_lse_forward(h, head, targets, chunk, squares, cap, stats)
    return out, (h, head, targets, out[:2])


def _chunked_lse_bwd(chunk, squares, cap, stats, res, cotangents):
    h, head, targets, (lse, lse2) = res
    h = constrain(h, ("tokens", "embed"))
    g, g2 = cotangents[:2]  # the statistics are metrics: their cotangents are dropped
    chunks, valid = _vocab_chunks(head, chunk)
    h_t = h.T  # [D, N], transposed once

    def step(dh, xs):
        logits = _chunk_logits(h, *xs, cap)
        p = jnp.exp(logits - lse[:, None]) * g[:, None]
        if squares:
            p = p + 2.0 * jnp.exp(2.0 * logits - lse2[:, None]) * g2[:, None]
        if cap:  # d(cap tanh(x / cap)) / dx = 1 - (z / cap)^2; masked entries have p = 0
            p = p * jnp.where(xs[1], 1.0 - jnp.square(logits / cap), 0.0)
        p = p.astype(h.dtype)
        dh = dh + jnp.einsum("nv,vd->nd", p, xs[0], preferred_element_type=jnp.float32)
        dh = constrain(dh, ("tokens", "embed"))
        dw_t = jnp.einsum("dn,nv->dv", h_t, p, preferred_element_type=jnp.float32)
        return dh, dw_t

    dh, dw_t = jax.lax.scan(step, jnp.zeros(h.shape, jnp.float32), (chunks, valid))
    dw = dw_t.transpose(0, 2, 1).reshape(-1, head.shape[1])[: head.shape[0]]
    return dh.astype(h.dtype), dw.astype(head.dtype), None


chunked_logsumexp.defvjp(_chunked_lse_fwd, _chunked_lse_bwd)


class TokenOutputs(NamedTuple):
    """`token_outputs`' results, each [R, L]: the log-probs; log Σ_v p_v² (with
    `with_log_sum_p_sq`, else None); the TokenStats (with `with_stats`, else None)."""

    logps: jax.Array
    log_sum_p_sq: jax.Array | None
    stats: TokenStats | None


def token_outputs(
    hidden: jax.Array,
    head: jax.Array,
    tokens: jax.Array,
    pred_index: jax.Array,
    *,
    vocab_chunk: int | None = 4096,
    with_log_sum_p_sq: bool = False,
    with_stats: bool = False,
    cap: float | None = None,
) -> TokenOutputs:
    """float32 log-probs [R, L] of `tokens` given hidden states [R, L, D] and head [V, D] (the
    logits soft-capped by `cap`, as Gemma 2 caps them); with `with_log_sum_p_sq` also
    log Σ_v p_v² per token (for WPO weights), with `with_stats` the TokenStats of each token's
    distribution (entropy, mean logit, top-1), from the same pass over the vocabulary.
    `vocab_chunk=None` (or >= V) computes the logits of the whole vocabulary at once.
    """
    h = constrain(gather_rows(hidden, pred_index), ("batch", "length", "embed"))
    head = head.astype(h.dtype)
    target = jnp.einsum(
        "rld,rld->rl", h, jnp.take(head, tokens, axis=0), preferred_element_type=jnp.float32
    )
    target = softcap(target, cap)
    vocab = head.shape[0]
    if vocab_chunk is None or vocab_chunk >= vocab:
        logits = jnp.einsum("rld,vd->rlv", h, head, preferred_element_type=jnp.float32)
        logits = softcap(logits, cap)
        lse = jax.nn.logsumexp(logits, axis=-1)
        lsq = jax.nn.logsumexp(2.0 * logits, axis=-1) - 2.0 * lse if with_log_sum_p_sq else None
        stats = None
        if with_stats:
            stats = jax.tree.map(jax.lax.stop_gradient, _full_stats(logits, tokens))
        return TokenOutputs(target - lse, lsq, stats)

    lse, lse2, stats = chunked_logsumexp(
        h.reshape(-1, h.shape[-1]),
        head,
        tokens.reshape(-1) if with_stats else None,
        vocab_chunk,
        with_log_sum_p_sq,
        cap,
        with_stats,
    )
    lse, lse2 = lse.reshape(target.shape), lse2.reshape(target.shape)
    if stats is not None:
        stats = jax.tree.map(lambda x: jax.lax.stop_gradient(x.reshape(target.shape)), stats)
    return TokenOutputs(target - lse, lse2 - 2.0 * lse if with_log_sum_p_sq else None, stats)


def token_logps(
    hidden: jax.Array,
    head: jax.Array,
    tokens: jax.Array,
    pred_index: jax.Array,
    *,
    vocab_chunk: int | None = 4096,
    with_log_sum_p_sq: bool = False,
    cap: float | None = None,
) -> jax.Array | tuple[jax.Array, jax.Array]:
    """float32 log-probs [R, L] of `tokens` (`token_outputs`); with `with_log_sum_p_sq`, the
    pair (log-probs, log Σ_v p_v²)."""
    out = token_outputs(
        hidden,
        head,
        tokens,
        pred_index,
        vocab_chunk=vocab_chunk,
        with_log_sum_p_sq=with_log_sum_p_sq,
        cap=cap,
    )
    return (out.logps, out.log_sum_p_sq) if with_log_sum_p_sq else out.logps


def completion_sums(
    values: jax.Array, completion_ids: jax.Array, num_completions: int
) -> tuple[jax.Array, jax.Array]:
    """Per-completion sums of per-token `values` [R, L] and token counts: ([C], [C])."""
    ids = completion_ids.reshape(-1)
    scored = ids >= 0
    seg = jnp.where(scored, ids, num_completions)  # unscored tokens go to a dropped bucket
    flat = jnp.where(scored, values.reshape(-1), 0.0)
    sums = jax.ops.segment_sum(flat, seg, num_segments=num_completions + 1)[:-1]
    counts = jax.ops.segment_sum(scored.astype(jnp.float32), seg, num_completions + 1)[:-1]
    return sums, counts


def _run_keys(*arrays: jax.Array) -> jax.Array:
    """A key [R * L] per token of the run it lies in, a run being the tokens of a row, side by
    side, on which every array [R, L] of `arrays` is constant: row * L + the run's first column."""
    rows, length = arrays[0].shape
    starts = jnp.zeros((rows, length), bool).at[:, 0].set(True)
    for a in arrays:
        starts = starts.at[:, 1:].set(starts[:, 1:] | (a[:, 1:] != a[:, :-1]))
    column = jnp.arange(length, dtype=jnp.int32)
    first = jax.lax.cummax(jnp.where(starts, column, 0), axis=1)
    return (jnp.arange(rows, dtype=jnp.int32)[:, None] * length + first).reshape(-1)


def _run_max(values: jax.Array, keys: jax.Array) -> jax.Array:
    """Each token's run's largest `values` [R, L] (runs: `_run_keys`)."""
    top = jax.ops.segment_max(values.reshape(-1), keys, num_segments=values.size)
    return top[keys].reshape(values.shape)


def sequence_sums(values: jax.Array, batch, num_completions: int) -> tuple[jax.Array, jax.Array]:
    """Per-completion sums of per-token `values` [R, L] and token counts ([C], [C]) over each
    completion's whole sequence: its segment's prompt (part 0) and its own part, every token but
    the sequence's first (position 0), the unscored leading tokens of its part included. Every
    layout holds a completion's sequence in one segment (a split segment repeats the prompt), so
    a prompt that several completions share counts once for each of them (TRL's NLL of a pair's
    chosen sequence over `input_ids`). Reads the full rows of `batch`: `segment_ids`, `parts`,
    `positions`, `completion_ids`; a completion part without a scored token counts nothing."""
    segments, parts, ids = batch["segment_ids"], batch["parts"], batch["completion_ids"]
    predicted = (segments > 0) & (batch["positions"] > 0)
    own = _run_max(ids, _run_keys(segments, parts))  # a part's slot; -1 in prompts and padding
    piece = _run_max(ids, _run_keys(segments))  # the segment's largest slot names its prompt
    in_part = predicted & (parts > 0) & (own >= 0)
    in_prompt = predicted & (parts == 0) & (piece >= 0)
    part_sums, part_counts = completion_sums(values, jnp.where(in_part, own, -1), num_completions)
    prompt_sums, prompt_counts = completion_sums(
        values, jnp.where(in_prompt, piece, -1), num_completions
    )
    # each completion's segment, by the slot naming its prompt (-1: a completion without tokens)
    flat_own = own.reshape(-1)
    bucket = jnp.where(flat_own >= 0, flat_own, num_completions)
    named = jax.ops.segment_max(
        jnp.where(flat_own >= 0, piece.reshape(-1), -1), bucket, num_segments=num_completions + 1
    )[:-1]
    has = named >= 0
    index = jnp.maximum(named, 0)
    sums = part_sums + jnp.where(has, prompt_sums[index], 0.0)
    counts = part_counts + jnp.where(has, prompt_counts[index], 0.0)
    return sums, counts
