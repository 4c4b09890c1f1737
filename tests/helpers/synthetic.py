"""Synthetic preference data for step tests (token-id triples laid out in the padded layout) and
the full-logits log-probs that the chunked ones are tested against."""

import jax
import jax.numpy as jnp
import numpy as np

from dpojax.train.logprobs import gather_rows


def naive_token_logps(logits: jax.Array, tokens: jax.Array, pred_index: jax.Array) -> jax.Array:
    """Reference implementation from full logits [R, L, V]: float32 log-probs [R, L]."""
    logp = jax.nn.log_softmax(gather_rows(logits.astype(jnp.float32), pred_index), axis=-1)
    return jnp.take_along_axis(logp, tokens[..., None], axis=-1)[..., 0]


def padded_batch(triples, length: int) -> dict[str, np.ndarray]:
    """(prompt, chosen, rejected) token-id lists -> the padded layout: chosen rows then rejected
    rows, one prompt + completion per row (the contract of dpojax.train.logprobs)."""
    n = len(triples)
    shape = (2 * n, length)
    out = {k: np.zeros(shape, np.int32) for k in ("tokens", "positions", "segment_ids", "parts")}
    out["pred_index"] = np.zeros(shape, np.int32)
    out["completion_ids"] = np.full(shape, -1, np.int32)
    out["completion_pos"] = np.full(shape, -1, np.int32)
    for i, (prompt, chosen, rejected) in enumerate(triples):
        for row, completion in ((i, chosen), (n + i, rejected)):
            seq = list(prompt) + list(completion)
            assert len(seq) <= length
            p, m = len(prompt), len(seq)
            out["tokens"][row, :m] = seq
            out["positions"][row, :m] = np.arange(m)
            out["segment_ids"][row, :m] = 1
            out["parts"][row, p:m] = 1
            out["pred_index"][row, :m] = np.maximum(np.arange(m) - 1, 0)
            out["completion_ids"][row, p:m] = row
            out["completion_pos"][row, p:m] = np.arange(m - p)
    out["chosen_index"] = np.arange(n, dtype=np.int32)
    out["rejected_index"] = np.arange(n, 2 * n, dtype=np.int32)
    out["pair_mask"] = np.ones(n, np.float32)
    return out


def micro_batches(batches) -> dict[str, np.ndarray]:
    """Stacks batches of equal shapes along a new leading micro-batch axis."""
    return {k: np.stack([b[k] for b in batches]) for k in batches[0]}


def copy_task(n: int, seed: int, vocab: int = 64, prompt_len: int = 5):
    """Prompts of random tokens; chosen = the prompt's first two tokens, rejected = two others."""
    rng = np.random.default_rng(seed)
    triples = []
    for _ in range(n):
        prompt = rng.integers(3, vocab, size=prompt_len)
        chosen = prompt[:2]
        rejected = (chosen + rng.integers(1, vocab - 3, size=2) - 3) % (vocab - 3) + 3
        triples.append((prompt.tolist(), chosen.tolist(), rejected.tolist()))
    return triples
