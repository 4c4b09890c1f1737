"""Batched generation from a `CausalLM` with a KV cache (`dpojax.models.decode`).

`generate(model, prompts, n=K, max_new_tokens=...)` returns K `Completion`s per prompt. One jitted
function does the whole generation of a chunk of prompts: prefill, the first token, then K rows
per prompt sharing that prompt's cache (never copied: `decode_step(..., prefix=)`), then a
`while_loop` of decode steps that stops early once every row has produced a stop token.

**Compilations.** Shapes are static and bucketed: prompts per call 8 * 4**k (up to the chunk
size), prompt length 16 * 2**k, max_new_tokens and the stop-token list 8 * 2**k. Single-token
generation (`max_new_tokens=1`, e.g. one move per decision) is its own bucket: the first token is
all it needs, so its program has no decode loop, which halves its compile time. The sampling
settings (temperature, top-k, top-p, greedy, distinct) are traced, so one compilation per shape
serves greedy, sampled and distinct generation alike, and a handful serve a whole run
(`compile_count`).

**Sampling.** Logits are divided by `temperature`, then restricted to the `top_k` most likely
tokens (0 = off), then to the smallest set of those whose probability (renormalised after
top-k) reaches `top_p`; the most likely token is always kept. `temperature=0` is greedy (the
filters then act on the untempered distribution, which matters only with `distinct=True`).
`Completion.logprob` is the model's own log-probability (temperature 1, no filters), the number
DPO needs, whatever the sampling settings.

**Distinct candidates** (`distinct=True`): the K candidates of a prompt are drawn without
replacement. The first tokens come from exact Gumbel-top-k over the filtered distribution, i.e. a
Plackett-Luce draw of K distinct tokens (with `temperature=0`, the K most likely tokens); so for
single-token decisions the K candidates are K distinct tokens, and whenever the filtered support
has at least K tokens the K sequences are distinct after one pass. Otherwise the remaining rows
sample their first token with replacement, duplicate sequences are rejected and the prompt is
sampled again, at most `max_retries` times, stopping early once no sampled step could have
branched (every possible sequence was seen). Fewer than K completions come back for a prompt
that has fewer than K distinct sequences (or when the retries ran out): the list length is the
number found.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Literal

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from dpojax.models.decode import decode_step, init_cache, prefill
from dpojax.models.transformer import CausalLM

MIN_BATCH, BATCH_GROWTH, MIN_PROMPT_LEN, MIN_NEW_TOKENS, MIN_STOP_IDS = 8, 4, 16, 8, 8
_TRACES = 0


@dataclass(frozen=True, slots=True)
class Completion:
    """One generated continuation: its token ids (a final stop token included), why it ended
    ("stop": a stop token, "length": max_new_tokens reached), the model's log-probability of the
    tokens (temperature 1, unfiltered) in total and per token, and the decoded text (without the
    final stop token) when a tokenizer was given."""

    tokens: tuple[int, ...]
    finish_reason: Literal["stop", "length"]
    logprob: float
    token_logprobs: tuple[float, ...]
    text: str | None = None


def compile_count() -> int:
    """How many times the generation function has been traced (compiled) in this process."""
    return _TRACES


def _bucket(size: int, minimum: int, growth: int = 2) -> int:
    """The smallest minimum * growth**k >= size."""
    bucket = minimum
    while bucket < size:
        bucket *= growth
    return bucket


def _new_bucket(max_new_tokens: int) -> int:
    """The generated-token slots of a call: 1 for single-token generation, else a bucket."""
    return 1 if max_new_tokens == 1 else _bucket(max_new_tokens, MIN_NEW_TOKENS)


# ---------------------------------------------------------------------------------------------
# Inside the jitted function


def _filter(x, top_k, top_p) -> jax.Array:
    """x [B, V] with -inf outside the top_k (0 = all) and then the top_p nucleus."""
    b, v = x.shape
    order = jnp.argsort(-x, axis=-1)
    ranked = jnp.take_along_axis(x, order, axis=-1)
    rank = jnp.arange(v)[None, :]
    keep = (top_k <= 0) | (rank < top_k)
    probs = jax.nn.softmax(jnp.where(keep, ranked, -jnp.inf), axis=-1)
    before = jnp.cumsum(probs, axis=-1) - probs  # probability mass ranked above each token
    keep = (keep & ((top_p >= 1.0) | (before < top_p))) | (rank == 0)
    mask = jnp.zeros((b, v), bool).at[jnp.arange(b)[:, None], order].set(keep)
    return jnp.where(mask, x, -jnp.inf)


def _scores(logits, opts: dict) -> jax.Array:
    """Log-weights [B, V] of the sampling distribution (unnormalised, -inf outside the support).
    The filters skip the sort unless top_k or top_p is set."""
    x = logits / opts["temperature"]
    return jax.lax.cond(opts["filtered"], _filter, lambda x, *_: x, x, opts["top_k"], opts["top_p"])


def _draw(key, scores, greedy, n: int | None = None) -> jax.Array:
    """Tokens drawn from softmax(scores [B, V]) by inverting the CDF with one uniform per draw:
    [B], or [B, n] independent draws per row when n is given; the argmax where greedy."""
    cdf = jnp.cumsum(jnp.exp(scores - jnp.max(scores, axis=-1, keepdims=True)), axis=-1)
    u = (1.0 - jax.random.uniform(key, (scores.shape[0], n or 1))) * cdf[:, -1:]  # (0, total]
    tokens = jnp.sum(cdf[:, None, :] < u[:, :, None], axis=-1)  # first index with cdf >= u
    tokens = jnp.where(greedy, jnp.argmax(scores, axis=-1)[:, None], tokens)
    return tokens[:, 0] if n is None else tokens


def _token_logprob(logits, tokens):
    """log softmax(logits)[b, tokens[b, ...]] for logits [B, V] and tokens [B] or [B, n]."""
    lp = jax.nn.log_softmax(logits, axis=-1)
    return jnp.take_along_axis(lp, tokens.reshape(tokens.shape[0], -1), axis=-1).reshape(
        tokens.shape
    )


@functools.partial(jax.jit, static_argnames=("graphdef", "n", "new_bucket"))
def _generate_chunk(
    graphdef,
    state,
    tokens,
    lengths,
    key,
    opts: dict[str, jax.Array],
    stop_ids,
    max_new_tokens,
    *,
    n: int,
    new_bucket: int,
) -> dict[str, jax.Array]:
    """Generates n rows per prompt for right-padded prompts tokens [B, T] (see the module doc).
    `opts`: temperature, top_k, top_p, and the flags greedy, filtered, distinct (all traced)."""
    global _TRACES
    _TRACES += 1
    model: CausalLM = nnx.merge(graphdef, state)
    config = model.config
    b, t = tokens.shape
    rows = b * n
    pad = config.pad_token_id or 0
    greedy = opts["greedy"]

    logits, prompt_cache = prefill(model, tokens, lengths, init_cache(config, b, t))
    scores = _scores(logits, opts)  # [B, V]
    k_first, k_extra = jax.random.split(jax.random.fold_in(key, 0))
    noise = jnp.where(greedy, 0.0, jax.random.gumbel(k_first, scores.shape))
    top, distinct_first = jax.lax.top_k(scores + noise, min(n, scores.shape[-1]))  # Plackett-Luce
    if n > scores.shape[-1]:  # more candidates than tokens: the rest drawn with replacement
        extra = n - scores.shape[-1]
        top = jnp.pad(top, ((0, 0), (0, extra)), constant_values=-jnp.inf)
        distinct_first = jnp.pad(distinct_first, ((0, 0), (0, extra)))
    free = _draw(k_extra, scores, greedy, n)  # n draws with replacement
    first = jnp.where(opts["distinct"] & jnp.isfinite(top), distinct_first, free)
    first_lp = _token_logprob(logits, first).reshape(rows)
    first = first.reshape(rows).astype(jnp.int32)

    def is_stop(tok):
        return (tok[:, None] == stop_ids[None, :]).any(-1)

    out = jnp.full((rows, new_bucket), pad, jnp.int32).at[:, 0].set(first)
    lps = jnp.zeros((rows, new_bucket), jnp.float32).at[:, 0].set(first_lp)
    carry = dict(
        i=jnp.int32(1),
        tok=first,
        cache=init_cache(config, rows, new_bucket),
        out=out,
        lps=lps,
        done=is_stop(first),
        count=jnp.ones((rows,), jnp.int32),
        branched=jnp.zeros((rows,), bool),
    )

    def cond(c):
        return (c["i"] < max_new_tokens) & ~jnp.all(c["done"])

    def body(c):
        logits, cache = decode_step(model, c["tok"], c["cache"], prefix=prompt_cache)
        scores = _scores(logits, opts)
        nxt = _draw(jax.random.fold_in(key, c["i"]), scores, greedy).astype(jnp.int32)
        active = ~c["done"]
        nxt = jnp.where(active, nxt, pad)
        lp = jnp.where(active, _token_logprob(logits, nxt), 0.0)
        several = ~greedy & (jnp.sum(jnp.isfinite(scores), axis=-1) > 1)
        return dict(
            i=c["i"] + 1,
            tok=nxt,
            cache=cache,
            out=jax.lax.dynamic_update_slice(c["out"], nxt[:, None], (0, c["i"])),
            lps=jax.lax.dynamic_update_slice(c["lps"], lp[:, None], (0, c["i"])),
            done=c["done"] | (active & is_stop(nxt)),
            count=c["count"] + active,
            branched=c["branched"] | (active & several),
        )

    # One new token (new_bucket 1): the first token is the whole answer; no decode loop to
    # compile (it would not run: its condition is false from the start).
    c = carry if new_bucket == 1 else jax.lax.while_loop(cond, body, carry)
    logprob = jnp.sum(c["lps"], axis=-1)
    return dict(
        out=c["out"], lps=c["lps"], count=c["count"], logprob=logprob, branched=c["branched"]
    )


# ---------------------------------------------------------------------------------------------
# Host side


@dataclass(frozen=True)
class _Settings:
    n: int
    max_new_tokens: int
    temperature: float
    top_k: int
    top_p: float
    stop: tuple[int, ...]
    distinct: bool
    max_batch_rows: int
    pad_id: int


def _run(
    graphdef, state, prompts: list[list[int]], key, s: _Settings
) -> list[tuple[list[Completion], bool]]:
    """Per prompt: its n completions, and whether any of its sampled steps could have branched.
    One compiled call per chunk of prompts."""
    greedy = s.temperature == 0
    opts = dict(
        temperature=jnp.float32(1.0 if greedy else s.temperature),
        top_k=jnp.int32(s.top_k),
        top_p=jnp.float32(s.top_p),
        greedy=jnp.bool_(greedy),
        filtered=jnp.bool_(s.top_k > 0 or s.top_p < 1.0),
        distinct=jnp.bool_(s.distinct),
    )
    cap = 1 << (max(1, s.max_batch_rows // s.n).bit_length() - 1)  # prompts per call
    stop_ids = np.full((_bucket(len(s.stop), MIN_STOP_IDS),), -1, np.int32)
    stop_ids[: len(s.stop)] = s.stop
    results = []
    for c, start in enumerate(range(0, len(prompts), cap)):
        chunk = prompts[start : start + cap]
        b = min(_bucket(len(chunk), MIN_BATCH, BATCH_GROWTH), cap)
        t = _bucket(max(len(p) for p in chunk), MIN_PROMPT_LEN)
        tokens = np.full((b, t), s.pad_id, np.int32)
        lengths = np.ones((b,), np.int32)
        for i, p in enumerate(chunk):
            tokens[i, : len(p)] = p
            lengths[i] = len(p)
        raw = _generate_chunk(
            graphdef,
            state,
            jnp.asarray(tokens),
            jnp.asarray(lengths),
            jax.random.fold_in(key, c),
            opts,
            jnp.asarray(stop_ids),
            jnp.int32(s.max_new_tokens),
            n=s.n,
            new_bucket=_new_bucket(s.max_new_tokens),
        )
        raw = jax.device_get(raw)
        rows = len(chunk) * s.n
        completions = [
            Completion(
                tokens := tuple(row[:count]),
                "stop" if tokens[-1] in s.stop else "length",
                total,
                tuple(lps[:count]),
            )
            for row, lps, count, total in zip(
                raw["out"][:rows].tolist(),
                raw["lps"][:rows].tolist(),
                raw["count"][:rows].tolist(),
                raw["logprob"][:rows].tolist(),
                strict=True,
            )
        ]
        branched = raw["branched"][:rows].reshape(len(chunk), s.n).any(axis=1).tolist()
        for i in range(len(chunk)):
            results.append((completions[i * s.n : (i + 1) * s.n], branched[i]))
    return results


def _distinct(graphdef, state, prompts, key, s: _Settings, max_retries: int) -> list[list]:
    """The first n distinct sequences per prompt; prompts with fewer are sampled again (at most
    max_retries times) while some sampled step of theirs could have branched."""
    found: list[dict[tuple[int, ...], Completion]] = [{} for _ in prompts]
    pending = list(range(len(prompts)))
    for attempt in range(max_retries + 1):
        batch = [prompts[i] for i in pending]
        outputs = _run(graphdef, state, batch, jax.random.fold_in(key, attempt), s)
        still = []
        for i, (completions, branched) in zip(pending, outputs, strict=True):
            for completion in completions:
                if len(found[i]) < s.n and completion.tokens not in found[i]:
                    found[i][completion.tokens] = completion
            if len(found[i]) < s.n and branched:
                still.append(i)
        pending = still
        if not pending:
            break
    return [list(f.values()) for f in found]


def _stop_ids(stop_tokens: Sequence[int] | None, model: CausalLM) -> tuple[int, ...]:
    """The stop-token ids: `stop_tokens`, or the model's EOS id(s) when None."""
    if stop_tokens is None:
        eos = model.config.eos_token_id
        stop_tokens = () if eos is None else (eos,) if isinstance(eos, int) else tuple(eos)
    return tuple(int(x) for x in stop_tokens)


def generate(
    model: CausalLM,
    prompts: Sequence[Sequence[int]],
    *,
    n: int = 1,
    max_new_tokens: int,
    temperature: float = 1.0,
    top_k: int = 0,
    top_p: float = 1.0,
    stop_tokens: Sequence[int] | None = None,
    seed: int = 0,
    distinct: bool = False,
    tokenizer: Any = None,
    max_retries: int = 4,
    max_batch_rows: int = 4096,
) -> list[list[Completion]]:
    """Samples `n` completions of at most `max_new_tokens` tokens for each prompt (token ids).

    `stop_tokens` end a sequence (included in its tokens); None means the model's EOS id(s).
    `distinct=True` draws the n candidates without replacement (see the module docstring); then
    fewer than n come back for a prompt with fewer than n distinct sequences. `tokenizer` adds
    `text`. At most `max_batch_rows` rows (prompts x n) run in one compiled call. The result is a
    function of the arguments (`seed` included), whatever ran before.
    """
    config = model.config
    prompts = [list(map(int, p)) for p in prompts]
    if n < 1 or max_new_tokens < 1:
        raise ValueError(f"n and max_new_tokens must be >= 1, got {n} and {max_new_tokens}")
    if temperature < 0 or not 0 < top_p <= 1 or top_k < 0:
        raise ValueError(f"bad sampling settings {temperature=}, {top_k=}, {top_p=}")
    for p in prompts:
        if not p or min(p) < 0 or max(p) >= config.vocab_size:
            raise ValueError(f"a prompt must be non-empty token ids < vocab_size, got {p[:8]}...")
    if not prompts:
        return []
    settings = _Settings(
        n=n,
        max_new_tokens=max_new_tokens,
        temperature=float(temperature),
        top_k=int(top_k),
        top_p=float(top_p),
        stop=_stop_ids(stop_tokens, model),
        distinct=distinct,
        max_batch_rows=max_batch_rows,
        pad_id=config.pad_token_id or 0,
    )
    graphdef, state = nnx.split(model)
    key = jax.random.key(seed)
    if distinct:
        results = _distinct(graphdef, state, prompts, key, settings, max_retries)
    else:
        results = [cs for cs, _ in _run(graphdef, state, prompts, key, settings)]
    if tokenizer is not None:
        results = _add_text(results, tokenizer)
    return results


def _add_text(results: list[list[Completion]], tokenizer) -> list[list[Completion]]:
    """The completions with `text`: their tokens decoded, a final stop token left out."""
    flat = [c for cs in results for c in cs]
    ids = [list(c.tokens[:-1] if c.finish_reason == "stop" else c.tokens) for c in flat]
    texts = iter(tokenizer.batch_decode(ids, skip_special_tokens=False))
    return [[dataclasses.replace(c, text=next(texts)) for c in cs] for cs in results]
