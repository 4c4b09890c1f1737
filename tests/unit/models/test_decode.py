"""KV-cache decoding: prefill + one-token steps reproduce the full forward pass."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from dpojax.models import LoRAParam, init_model
from dpojax.models.decode import decode_step, init_cache, prefill
from dpojax.models.tiny import TINY_FAMILIES, tiny_config

VOCAB = 96
LENGTHS = (3, 11, 6)  # prompts of different lengths in one batch
TOTAL = 16  # every row is decoded up to this many tokens (mistral's window is 6)


def _sequences(seed: int, count: int, length: int) -> list[np.ndarray]:
    rng = np.random.default_rng(seed)
    return [rng.integers(3, VOCAB, size=length) for _ in range(count)]


def _right_padded(rows: list[np.ndarray], lengths) -> tuple[jax.Array, jax.Array]:
    tokens = np.zeros((len(rows), max(lengths)), np.int32)
    for i, (row, n) in enumerate(zip(rows, lengths, strict=True)):
        tokens[i, :n] = row[:n]
    return jnp.asarray(tokens), jnp.asarray(lengths, jnp.int32)


_forward = jax.jit(lambda model, tokens: model(tokens))
_prefill = jax.jit(prefill, static_argnames="all_logits")
_step = jax.jit(decode_step)


def _full_logits(model, rows: list[np.ndarray]) -> np.ndarray:
    """Logits [B, T, V] of the full forward pass over rows right-padded to one length (causal, so
    the padding after a row's tokens changes none of its logits)."""
    tokens, _ = _right_padded(rows, [len(row) for row in rows])
    return np.asarray(_forward(model, tokens))


def _max_error_vs_full(model, dtype=None, *, check_all_logits: bool = False) -> float:
    rows = _sequences(0, len(LENGTHS), TOTAL)
    full = _full_logits(model, rows)
    tokens, lengths = _right_padded(rows, LENGTHS)
    cache = init_cache(model.config, len(rows), 2 * TOTAL, dtype)
    err = 0.0
    if check_all_logits:
        all_logits, _ = _prefill(model, tokens, lengths, cache, all_logits=True)
        for i, n in enumerate(LENGTHS):
            err = max(err, np.abs(np.asarray(all_logits[i, :n]) - full[i, :n]).max())
    last, cache = _prefill(model, tokens, lengths, cache)
    for i, n in enumerate(LENGTHS):
        err = max(err, np.abs(np.asarray(last[i]) - full[i, n - 1]).max())
    pos = np.array(LENGTHS)
    while pos.min() < TOTAL:
        token = np.array([row[min(p, TOTAL - 1)] for row, p in zip(rows, pos, strict=True)])
        logits, cache = _step(model, jnp.asarray(token, jnp.int32), cache)
        for i, p in enumerate(pos):
            if p < TOTAL:
                err = max(err, np.abs(np.asarray(logits[i]) - full[i, p]).max())
        pos = pos + 1
    return float(err)


@pytest.mark.slow
@pytest.mark.parametrize("family", TINY_FAMILIES)
def test_prefill_and_decode_match_full_forward(family):
    model = init_model(tiny_config(family, vocab_size=VOCAB), seed=1)
    assert _max_error_vs_full(model, check_all_logits=family == "mistral") < 1e-5


def test_sliding_window_is_exercised():
    config = tiny_config("mistral", vocab_size=VOCAB)
    assert config.sliding_window < max(LENGTHS)  # a prompt longer than the window
    assert config.sliding_window < TOTAL - min(LENGTHS)  # decode steps slide past the window


@pytest.mark.slow
def test_lora_adapters_are_used():
    config = tiny_config("llama", vocab_size=VOCAB, lora_rank=4, lora_targets=("q_proj", "v_proj"))
    model = init_model(config, seed=2)
    lora = nnx.state(model, LoRAParam)
    keys = iter(jax.random.split(jax.random.key(0), 64))
    tokens = jnp.asarray(_sequences(0, 1, TOTAL)[0])[None]
    before = _forward(model, tokens)  # lora_b = 0: the base model's output
    nnx.update(model, jax.tree.map(lambda x: 0.3 * jax.random.normal(next(keys), x.shape), lora))
    assert np.abs(np.asarray(_forward(model, tokens) - before)).max() > 1e-3
    assert _max_error_vs_full(model) < 1e-5


@pytest.mark.slow
def test_bfloat16_cache_and_compute():
    config = tiny_config("qwen3", vocab_size=VOCAB, dtype="bfloat16", param_dtype="bfloat16")
    model = init_model(config, seed=3)
    cache = init_cache(config, 2, 8)
    assert cache.k[0].dtype == jnp.bfloat16
    assert _max_error_vs_full(model) < 0.05  # logits are O(0.3); bf16 rounding differs slightly


@pytest.mark.slow
def test_shared_prefix_rows_match_full_forward():
    """Rows b*n .. b*n+n-1 continue prompt b through a shared (never copied) prompt cache."""
    for family in ("mistral", "qwen3"):
        model = init_model(tiny_config(family, vocab_size=VOCAB), seed=4)
        n, new = 2, 9
        prompts = _sequences(5, len(LENGTHS), max(LENGTHS))
        tails = _sequences(6, len(LENGTHS) * n, new)
        rows = [
            np.concatenate([prompts[r // n][: LENGTHS[r // n]], tails[r]])
            for r in range(len(tails))
        ]
        tokens, lengths = _right_padded(prompts, LENGTHS)
        _, prompt_cache = _prefill(model, tokens, lengths, init_cache(model.config, 3, 16))
        cache = init_cache(model.config, len(tails), new)
        full = _full_logits(model, rows)
        err = 0.0
        for step in range(new):
            token = jnp.asarray([tail[step] for tail in tails], jnp.int32)
            logits, cache = _step(model, token, cache, prompt_cache)
            for r in range(len(rows)):
                ref = full[r, LENGTHS[r // n] + step]
                err = max(err, np.abs(np.asarray(logits[r]) - ref).max())
        assert err < 1e-5, family
