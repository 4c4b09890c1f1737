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


def _chunked_lse_forward(h, head, chunk, squares, cap=None):
    h = constrain(h, ("tokens", "embed"))
    chunks, valid = _vocab_chunks(head, chunk)

    def step(carry, xs):
        (m, s), (m2, s2) = carry
        logits = _chunk_logits(h, *xs, cap)
        new_m = jnp.maximum(m, logits.max(-1))
        s = s * jnp.exp(m - new_m) + jnp.exp(logits - new_m[:, None]).sum(-1)
        if squares:
            sq = 2.0 * logits
            new_m2 = jnp.maximum(m2, sq.max(-1))
            s2 = s2 * jnp.exp(m2 - new_m2) + jnp.exp(sq - new_m2[:, None]).sum(-1)
            m2 = new_m2
        return ((new_m, s), (m2, s2)), None

    init = jnp.full(h.shape[:1], -jnp.inf, jnp.float32)
    zeros = jnp.zeros(h.shape[:1], jnp.float32)
    ((m, s), (m2, s2)), _ = jax.lax.scan(step, ((init, zeros), (init, zeros)), (chunks, valid))
    return m + jnp.log(s), m2 + jnp.log(s2)


@functools.partial(jax.custom_vjp, nondiff_argnums=(2, 3, 4))
def chunked_logsumexp(
    h: jax.Array, head: jax.Array, chunk: int, squares: bool = False, cap: float | None = None
):
    """(log Σ_v exp(z_v), log Σ_v exp(2 z_v)) [N], float32, for the logits z_v = h·w_v of hidden
    states h [N, D] against the head [V, D] (soft-capped, z = cap tanh(h·w / cap), with `cap`),
    walking the vocabulary in chunks of `chunk`: at most one chunk's [N, chunk] logits exist at a
    time. The second is only computed with `squares` (else -inf).

    The backward pass recomputes each chunk's logits and uses the saved log-sum-exp directly
    (d lse / d logits = exp(logits - lse)). The head's gradient is computed transposed,
    h^T [D, N] @ p [N, c], so the [N, c] probabilities are never transposed in memory; h is
    transposed once and the [D, V] result once. Autodiff of the online log-sum-exp instead
    differentiates the running maxima and writes a transposed copy of every chunk's
    probabilities (large model, [3072, 768] hidden states, vocab 8192 in chunks of 4096: the
    gradient 645 -> 379 ms; docs/benchmarks.md)."""
    return _chunked_lse_forward(h, head, chunk, squares, cap)


def _chunked_lse_fwd(h, head, chunk, squares, cap):
    out = _chunked_lse_forward(h, head, chunk, squares, cap)
    return out, (h, head, out)


def _chunked_lse_bwd(chunk, squares, cap, res, cotangents):
    h, head, (lse, lse2) = res
    h = constrain(h, ("tokens", "embed"))
    g, g2 = cotangents
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
    return dh.astype(h.dtype), dw.astype(head.dtype)


chunked_logsumexp.defvjp(_chunked_lse_fwd, _chunked_lse_bwd)


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
    """float32 log-probs [R, L] of `tokens` given hidden states [R, L, D] and head [V, D] (the
    logits soft-capped by `cap`, as Gemma 2 caps them).

    With `with_log_sum_p_sq`, also returns log Σ_v p_v² per token (for WPO weights).
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
        logp = target - lse
        if with_log_sum_p_sq:
            return logp, jax.nn.logsumexp(2.0 * logits, axis=-1) - 2.0 * lse
        return logp

    lse, lse2 = chunked_logsumexp(
        h.reshape(-1, h.shape[-1]), head, vocab_chunk, with_log_sum_p_sq, cap
    )
    lse, lse2 = lse.reshape(target.shape), lse2.reshape(target.shape)
    logp = target - lse
    if with_log_sum_p_sq:
        return logp, lse2 - 2.0 * lse
    return logp


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
