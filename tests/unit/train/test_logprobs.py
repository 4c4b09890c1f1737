"""Chunked log-probs equal the naive full-logits computation, values and gradients."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from dpojax.models import init_model
from dpojax.models.tiny import tiny_config
from dpojax.train.logprobs import completion_sums, token_logps, token_outputs
from tests.helpers.synthetic import naive_token_logps


def _inputs(seed=0, rows=3, length=9, dim=16, vocab=100):
    k1, k2, k3 = jax.random.split(jax.random.PRNGKey(seed), 3)
    hidden = jax.random.normal(k1, (rows, length, dim))
    head = 2.0 * jax.random.normal(k2, (vocab, dim))
    tokens = jax.random.randint(k3, (rows, length), 0, vocab)
    pred = jnp.broadcast_to(jnp.maximum(jnp.arange(length) - 1, 0), (rows, length))
    return hidden, head, tokens, pred


@pytest.mark.parametrize("chunk", [None, 7, 32, 99, 100, 4096])
def test_chunked_equals_naive(chunk):
    hidden, head, tokens, pred = _inputs()
    naive = naive_token_logps(jnp.einsum("rld,vd->rlv", hidden, head), tokens, pred)
    ours = token_logps(hidden, head, tokens, pred, vocab_chunk=chunk)
    assert ours.dtype == jnp.float32
    np.testing.assert_allclose(ours, naive, atol=1e-5)


def _gradients_and_float32_bounds(hidden, head, tokens, pred):
    """The exact (float64) gradients of sum(log-probs) with respect to hidden and head, and a
    first-order bound on how far a float32 computation can be from them, element by element.

    With u = 2^-24 (float32's unit roundoff) and gamma(n) = n u / (1 - n u), a sum of n terms
    computed in float32, in any order, is within gamma(n) * sum|terms| of the exact sum. Along
    the chain, for the position that predicts token t from hidden row x:
    - a logit z_v = x . w_v (D = dim terms) is off by e_v <= gamma(D) sum_d |x_d| |w_vd|;
    - the log-sum-exp over V = vocab logits is off by <= max_v e_v + gamma(2V) (the V-term sum
      and, computed chunk by chunk, the rescalings between chunks, fewer than V), so
      p_v = exp(z_v - lse) is off by dp_v <= p_v (e_v + max_v e_v + gamma(2V));
    - d/dx = w_t - sum_v p_v w_v (V terms) is off by <= sum_v dp_v |w_v| + gamma(V) sum_v
      (p_v + [v = t]) |w_v|, and d/dw_v = sum over positions of ([v = t] - p_v) x (R L terms)
      by <= sum dp_v |x| + gamma(R L) sum |[v = t] - p_v| |x|.
    The naive and the chunked computation differ in summation order, not in these bounds."""
    h, w = np.asarray(hidden, np.float64), np.asarray(head, np.float64)
    rows, length, dim = h.shape
    vocab = w.shape[0]
    u = float(np.finfo(np.float32).eps) / 2

    def gamma(n: int) -> float:
        return n * u / (1 - n * u)

    grad_h, grad_w = np.zeros_like(h), np.zeros_like(w)
    bound_h, bound_w = np.zeros_like(h), np.zeros_like(w)
    for r in range(rows):
        for i in range(length):
            j, t = int(pred[r, i]), int(tokens[r, i])
            x = h[r, j]
            z = w @ x
            p = np.exp(z - z.max())
            p /= p.sum()
            onehot = np.eye(vocab)[t]
            e = gamma(dim) * (np.abs(w) @ np.abs(x))
            dp = p * (e + e.max() + gamma(2 * vocab))
            grad_h[r, j] += (onehot - p) @ w
            grad_w += np.outer(onehot - p, x)
            bound_h[r, j] += dp @ np.abs(w) + gamma(vocab) * ((p + onehot) @ np.abs(w))
            bound_w += np.outer(dp + gamma(rows * length) * np.abs(onehot - p), np.abs(x))
    return (grad_h, grad_w), (bound_h, bound_w)


def test_chunked_gradients_equal_naive():
    hidden, head, tokens, pred = _inputs(seed=1)

    def naive(h, w):
        return naive_token_logps(jnp.einsum("rld,vd->rlv", h, w), tokens, pred).sum()

    def chunked(h, w):
        return token_logps(h, w, tokens, pred, vocab_chunk=16).sum()

    g_naive = jax.grad(naive, argnums=(0, 1))(hidden, head)
    g_chunk = jax.jit(jax.grad(chunked, argnums=(0, 1)))(hidden, head)
    exact, bounds = _gradients_and_float32_bounds(hidden, head, tokens, pred)
    for a, b, want, bound in zip(g_naive, g_chunk, exact, bounds, strict=True):
        # The bound is small against the gradients (a wrong term is O(1)), and each float32
        # computation lies within it of the exact gradient, so within twice it of the other.
        assert bound.max() < 1e-3 * np.abs(want).max()
        for got in (a, b):
            assert np.all(np.abs(np.asarray(got, np.float64) - want) <= bound)
        assert np.all(np.abs(np.asarray(a, np.float64) - np.asarray(b, np.float64)) <= 2 * bound)


def test_log_sum_p_sq_matches_definition():
    hidden, head, tokens, pred = _inputs(seed=2)
    logits = jnp.einsum("rld,vd->rlv", hidden, head)
    p = jax.nn.softmax(jnp.take_along_axis(logits, pred[..., None], axis=1), axis=-1)
    expected = jnp.log((p**2).sum(-1))
    for chunk in (None, 13):
        _, lsq = token_logps(hidden, head, tokens, pred, vocab_chunk=chunk, with_log_sum_p_sq=True)
        np.testing.assert_allclose(lsq, expected, atol=1e-5)


def test_bfloat16_hidden_gives_float32_logps_close_to_float32():
    hidden, head, tokens, pred = _inputs(seed=3)
    ref = token_logps(hidden, head, tokens, pred, vocab_chunk=32)
    low = token_logps(
        hidden.astype(jnp.bfloat16), head.astype(jnp.bfloat16), tokens, pred, vocab_chunk=32
    )
    assert low.dtype == jnp.float32
    np.testing.assert_allclose(low, ref, atol=0.5)  # bf16 inputs, float32 log-softmax


@pytest.mark.slow
def test_model_hidden_path_equals_full_logits():
    model = init_model(tiny_config("qwen3", vocab_size=300), seed=0)
    tokens = jnp.asarray(np.random.default_rng(0).integers(0, 300, size=(2, 11)))
    pred = jnp.broadcast_to(jnp.maximum(jnp.arange(11) - 1, 0), (2, 11))
    naive = naive_token_logps(model(tokens), tokens, pred)
    hidden = model(tokens, return_hidden=True)
    chunked = token_logps(hidden, model.lm_head_weight(), tokens, pred, vocab_chunk=64)
    np.testing.assert_allclose(chunked, naive, atol=1e-5)


def test_completion_sums_ignores_unscored_tokens():
    values = jnp.arange(12.0).reshape(2, 6)
    ids = jnp.array([[-1, 0, 0, -1, 1, 1], [2, 2, 2, -1, -1, -1]])
    sums, counts = completion_sums(values, ids, 4)
    np.testing.assert_array_equal(sums, [3.0, 9.0, 6.0 + 7 + 8, 0.0])
    np.testing.assert_array_equal(counts, [2, 2, 3, 0])


@pytest.mark.slow
@pytest.mark.parametrize("chunk", [16, 37, 99])
def test_chunked_gradients_with_log_sum_p_sq_equal_full_logits(chunk):
    """The custom backward of the chunked log-sum-exp, with per-token weights on both outputs
    (log-probs and log Σ p²), equals autodiff of the full-logits computation."""
    hidden, head, tokens, pred = _inputs(seed=4)
    w1, w2 = jax.random.normal(jax.random.PRNGKey(9), (2, *tokens.shape))

    def loss(h, w, c):
        lp, lsq = token_logps(h, w, tokens, pred, vocab_chunk=c, with_log_sum_p_sq=True)
        return (lp * w1).sum() + (lsq * w2).sum()

    full = jax.grad(loss, argnums=(0, 1))(hidden, head, None)
    chunked = jax.jit(jax.grad(loss, argnums=(0, 1)), static_argnums=2)(hidden, head, chunk)
    for a, b in zip(full, chunked, strict=True):
        assert float(jnp.abs(a).max()) > 0.1
        np.testing.assert_allclose(b, a, atol=2e-5, rtol=1e-5)


@pytest.mark.slow
def test_chunked_gradients_bfloat16_close_to_float32():
    hidden, head, tokens, pred = _inputs(seed=5)

    def loss(h, w):
        return token_logps(h, w, tokens, pred, vocab_chunk=32).sum()

    ref = jax.grad(loss, argnums=(0, 1))(hidden, head)
    low = jax.grad(loss, argnums=(0, 1))(hidden.astype(jnp.bfloat16), head.astype(jnp.bfloat16))
    for a, b in zip(ref, low, strict=True):
        assert b.dtype == jnp.bfloat16
        np.testing.assert_allclose(np.asarray(b, np.float32), a, atol=0.1, rtol=0.05)


def _trl_stats(hidden, head, tokens, pred, chunk, cap=None):
    """TRL 1.16's per-token entropy, mean logit and top-1 (its ChunkedLogProbFunction, the torch
    path it takes without Triton), at the positions `pred` feeds."""
    torch = pytest.importorskip("torch")
    from trl.kernels.chunked_logprob import ChunkedLogProbFunction

    h = np.asarray(jnp.take_along_axis(hidden, pred[..., None], axis=1)).reshape(
        -1, hidden.shape[-1]
    )
    out = ChunkedLogProbFunction.apply(
        torch.tensor(h),
        torch.tensor(np.asarray(head)),
        None,
        torch.tensor(np.asarray(tokens).reshape(-1)),
        1.0,
        chunk,
        cap,
        1.0,
        ("entropy", "mean_logits", "is_top1"),
    )
    _, entropy, _, mean_logits, top1 = out
    shape = tokens.shape
    return (
        entropy.detach().numpy().reshape(shape),
        mean_logits.numpy().reshape(shape),
        top1.numpy().reshape(shape).astype(np.float32),
    )


@pytest.mark.slow
@pytest.mark.parametrize(("chunk", "cap"), [(None, None), (7, None), (32, None), (13, 5.0)])
def test_token_stats_equal_trl_s_kernel(chunk, cap):
    """Entropy, mean logit and top-1 from the log-prob pass (chunked or not) equal TRL 1.16's."""
    hidden, head, tokens, pred = _inputs(seed=3)
    # Half the targets are the argmax, so top-1 is not all zeros.
    logits = jnp.einsum("rld,vd->rlv", jnp.take_along_axis(hidden, pred[..., None], axis=1), head)
    if cap:
        logits = cap * jnp.tanh(logits / cap)
    tokens = jnp.where(jnp.arange(tokens.shape[1]) % 2 == 0, logits.argmax(-1), tokens)
    out = token_outputs(hidden, head, tokens, pred, vocab_chunk=chunk, with_stats=True, cap=cap)
    entropy, mean_logit, top1 = _trl_stats(hidden, head, tokens, pred, chunk or 100, cap)
    np.testing.assert_allclose(out.stats.entropy, entropy, rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(out.stats.mean_logit, mean_logit, rtol=1e-5, atol=1e-5)
    np.testing.assert_array_equal(out.stats.is_top1, top1)
    assert 0 < float(top1.mean()) < 1
    np.testing.assert_allclose(
        out.logps, token_logps(hidden, head, tokens, pred, cap=cap), atol=1e-5
    )


def test_a_tie_with_an_earlier_token_is_not_top1():
    """As TRL (argmax's first maximum): the target ties the maximum but an earlier token has it too."""
    head = jnp.asarray([[0.0, 1.0], [1.0, 0.0], [0.0, 1.0], [-1.0, 0.0]])  # tokens 0 and 2 tie
    hidden = jnp.asarray([[[2.0, 3.0], [2.0, 3.0], [3.0, 2.0]]])
    tokens = jnp.asarray([[2, 0, 1]])
    pred = jnp.asarray([[0, 1, 2]])
    for chunk in (None, 2):  # chunks of 2 put the tied tokens 0 and 2 in different chunks
        out = token_outputs(hidden, head, tokens, pred, vocab_chunk=chunk, with_stats=True)
        np.testing.assert_array_equal(out.stats.is_top1, [[0.0, 1.0, 1.0]])


@pytest.mark.slow
def test_statistics_leave_the_gradient_unchanged():
    """With the statistics on, the log-probs' gradients are those without them."""
    hidden, head, tokens, pred = _inputs(seed=4)

    def loss(h, w, stats):
        out = token_outputs(h, w, tokens, pred, vocab_chunk=16, with_stats=stats)
        extra = out.stats.entropy.sum() + out.stats.mean_logit.sum() if stats else 0.0
        return out.logps.sum() + extra

    with_stats = jax.grad(loss, argnums=(0, 1))(hidden, head, True)
    without = jax.grad(loss, argnums=(0, 1))(hidden, head, False)
    for a, b in zip(with_stats, without, strict=True):
        np.testing.assert_array_equal(a, b)
