"""Incremental decoding for `CausalLM`: a KV cache, prefill and one-token decode steps.

The functions reuse the model's own modules (projections with their LoRA adapters, norms, MLPs,
embedding and head) and the attention rule of `dpojax.models.layers`, so every family the model
supports (GQA, sliding windows, q/k norm, biases, RoPE scaling, bf16) decodes the same way the
full forward computes.

Layout: prompts are **right-padded** (row b holds its `lengths[b]` tokens in columns
0..lengths[b]-1, anything after is padding). Cache slot s of a row holds the key/value of that
row's position s, so positions are simply slot indices and `cache.lengths[b]` is both the number
of filled slots and the position of row b's next token. Padding keys written by `prefill` sit in
slots >= lengths[b]; they are masked out and overwritten as the row decodes.

    cache = init_cache(model.config, batch, max_len)
    logits, cache = prefill(model, tokens, lengths, cache)  # logits of each row's last token
    logits, cache = decode_step(model, next_token, cache)  # and so on, one token per row

**Shared prompts.** For n continuations of each prompt (sampling candidates), prefill the P
prompts once and decode P * n rows with `decode_step(model, token, own, prefix=prompt_cache)`:
`own` (P * n rows) holds only the generated tokens and each group of n consecutive rows attends
to its prompt's keys in `prompt_cache` directly, so the prompt cache is neither recomputed nor
copied n times.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp

from dpojax.models.attention.reference import attention_mask, dot_product_attention
from dpojax.models.layers import softcap
from dpojax.models.model_config import ModelConfig
from dpojax.models.transformer import CausalLM


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class KVCache:
    """Keys and values per layer, each [B, S, num_kv_heads, head_dim] (post-RoPE keys), and
    `lengths` int32[B]: the filled slots of each row (= the position of its next token)."""

    k: tuple[jax.Array, ...]
    v: tuple[jax.Array, ...]
    lengths: jax.Array

    @property
    def max_len(self) -> int:
        """The number of slots S per row."""
        return self.k[0].shape[1]

    def repeat(self, n: int) -> KVCache:
        """Each row repeated n times in place (row b becomes rows b*n .. b*n+n-1)."""
        return jax.tree.map(lambda x: jnp.repeat(x, n, axis=0), self)


def init_cache(config: ModelConfig, batch: int, max_len: int, dtype=None) -> KVCache:
    """An empty cache of `max_len` slots per row, in `dtype` (default: the compute dtype)."""
    dtype = jnp.dtype(config.dtype if dtype is None else dtype)
    shape = (batch, max_len, config.num_kv_heads, config.resolved_head_dim)
    zeros = tuple(jnp.zeros(shape, dtype) for _ in range(config.num_layers))
    return KVCache(k=zeros, v=zeros, lengths=jnp.zeros((batch,), jnp.int32))


def prefill(
    model: CausalLM,
    tokens: jax.Array,
    lengths: jax.Array,
    cache: KVCache,
    *,
    all_logits: bool = False,
) -> tuple[jax.Array, KVCache]:
    """Runs right-padded prompts int[B, T] (T <= cache.max_len) into an empty cache.

    Returns float32 logits [B, V] of each row's last prompt token (column lengths[b] - 1), or
    [B, T, V] for every column with `all_logits=True`, and the filled cache.
    """
    config = model.config
    b, t = tokens.shape
    lengths = jnp.asarray(lengths, jnp.int32)
    positions = jnp.broadcast_to(jnp.arange(t, dtype=jnp.int32), (b, t))
    full_mask = attention_mask(b, t)
    sliding_mask = (
        attention_mask(b, t, positions=positions, sliding_window=config.sliding_window)
        if config.sliding_window
        else None
    )
    tables = model.rope_tables(positions)
    x = model.embed(tokens)
    new_k, new_v = [], []
    for i, layer in enumerate(model.layer_list()):
        attn = layer.self_attn
        q, k, v = attn.qkv(layer.input_layernorm(x), *tables[layer.sliding])
        mask = sliding_mask if layer.sliding else full_mask
        out = dot_product_attention(q, k, v, mask, attn.scale, cap=attn.cap)
        x = layer.add_attention(x, attn.o_proj(out.reshape(b, t, attn.num_heads * attn.head_dim)))
        x, _ = layer.add_mlp(x)
        start = (0, 0, 0, 0)
        new_k.append(jax.lax.dynamic_update_slice(cache.k[i], k.astype(cache.k[i].dtype), start))
        new_v.append(jax.lax.dynamic_update_slice(cache.v[i], v.astype(cache.v[i].dtype), start))
    x = model.norm(x)
    if not all_logits:
        x = jnp.take_along_axis(x, jnp.maximum(lengths - 1, 0)[:, None, None], axis=1)[:, 0]
    return model.logits(x), KVCache(k=tuple(new_k), v=tuple(new_v), lengths=lengths)


def _shared_prefix_attention(
    q, k, v, mask, pk, pv, pmask, scale: float, cap: float | None = None
) -> jax.Array:
    """Attention of q [R, 1, H, D] over two key sets under one softmax: each row's own keys k, v
    [R, S, K, D] (mask [R, S]) and the keys pk, pv [P, T, K, D] (mask [R, T]) of the prefix row
    it continues, shared by the n = R / P consecutive rows of a group. Float32 scores and softmax,
    as in `dot_product_attention`."""
    r, _, h, d = q.shape
    p, t, kv_heads, _ = pk.shape
    n, s, g = r // p, k.shape[1], h // kv_heads
    qg = q.reshape(p, n, kv_heads, g, d)
    pre = jnp.einsum("bnkgd,btkd->bnkgt", qg, pk, preferred_element_type=jnp.float32)
    own = jnp.einsum(
        "bnkgd,bnskd->bnkgs",
        qg,
        k.reshape(p, n, s, kv_heads, d),
        preferred_element_type=jnp.float32,
    )
    masks = jnp.concatenate([pmask, mask], axis=-1).reshape(p, n, 1, 1, t + s)
    scores = softcap(jnp.concatenate([pre, own], axis=-1) * scale, cap)
    scores = jnp.where(masks, scores, jnp.finfo(jnp.float32).min)
    probs = jax.nn.softmax(scores, axis=-1).astype(v.dtype)
    out = jnp.einsum("bnkgt,btkd->bnkgd", probs[..., :t], pv)
    out = out + jnp.einsum("bnkgs,bnskd->bnkgd", probs[..., t:], v.reshape(p, n, s, kv_heads, d))
    return out.reshape(r, 1, h, d)


def decode_step(
    model: CausalLM, token: jax.Array, cache: KVCache, prefix: KVCache | None = None
) -> tuple[jax.Array, KVCache]:
    """Feeds one token int[B] per row; returns float32 logits [B, V] of the next token and the
    cache with that token appended (lengths + 1).

    Without `prefix`, row b's token sits at position cache.lengths[b]. With `prefix` (a filled
    cache of P rows, e.g. the prompts after `prefill`), the B = P * n rows are groups of n
    consecutive rows continuing the same prefix row (n candidates of one prompt): the prefix keys
    are shared, never copied, `cache` holds only the generated tokens, and row b's token sits at
    position prefix.lengths[b // n] + cache.lengths[b].

    A row whose cache is full (lengths[b] == max_len) gets its key dropped: size the cache for
    the tokens to come.
    """
    config = model.config
    dtype = jnp.dtype(config.dtype)
    b = token.shape[0]
    filled = cache.lengths
    slots = jnp.arange(cache.max_len, dtype=jnp.int32)
    mask = slots[None, :] <= filled[:, None]  # [B, S]: own slots written so far, this one too
    if prefix is None:
        pos = filled
    else:
        start = jnp.repeat(prefix.lengths, b // prefix.lengths.shape[0])
        pos = start + filled
        pslots = jnp.arange(prefix.max_len, dtype=jnp.int32)
        pmask = pslots[None, :] < start[:, None]  # [B, T]
    window = config.sliding_window
    if window:
        sliding = mask & ((filled[:, None] - slots[None, :]) < window)
        if prefix is not None:
            psliding = pmask & ((pos[:, None] - pslots[None, :]) < window)
    tables = model.rope_tables(pos[:, None])
    x = model.embed(token[:, None])
    rows = jnp.arange(b)
    new_k, new_v = [], []
    for i, layer in enumerate(model.layer_list()):
        attn = layer.self_attn
        q, k, v = attn.qkv(layer.input_layernorm(x), *tables[layer.sliding])
        k_all = cache.k[i].at[rows, filled].set(k[:, 0].astype(cache.k[i].dtype), mode="drop")
        v_all = cache.v[i].at[rows, filled].set(v[:, 0].astype(cache.v[i].dtype), mode="drop")
        new_k.append(k_all)
        new_v.append(v_all)
        k_all, v_all = k_all.astype(dtype), v_all.astype(dtype)
        own_mask = sliding if layer.sliding else mask
        if prefix is None:
            out = dot_product_attention(
                q, k_all, v_all, own_mask[:, None, :], attn.scale, cap=attn.cap
            )
        else:
            out = _shared_prefix_attention(
                q,
                k_all,
                v_all,
                own_mask,
                prefix.k[i].astype(dtype),
                prefix.v[i].astype(dtype),
                psliding if layer.sliding else pmask,
                attn.scale,
                attn.cap,
            )
        x = layer.add_attention(x, attn.o_proj(out.reshape(b, 1, attn.num_heads * attn.head_dim)))
        x, _ = layer.add_mlp(x)
    logits = model.logits(model.norm(x))[:, 0]
    return logits, KVCache(k=tuple(new_k), v=tuple(new_v), lengths=filled + 1)
