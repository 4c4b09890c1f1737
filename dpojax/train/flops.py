"""Model FLOPs of a DPO step, for model FLOP utilisation (MFU) figures.

Counted: the decoder's projections per token (a mixture of experts' router and the experts each
token runs through), QK^T and PV per (query, key) pair the attention mask
allows, the LM head per scored token (embedding lookups, norms and elementwise work are not). A
step is the policy's forward and backward (3x the forward) plus, when the reference runs in the
step, its forward (1x).
"""

from __future__ import annotations

import functools
from collections.abc import Mapping

import jax
import jax.numpy as jnp
import numpy as np

from dpojax.models.attention.rule import TokenIds, allowed
from dpojax.models.model_config import ModelConfig


def forward_flops(config: ModelConfig, tokens: float, attention_pairs: float, scored: float):
    """Forward FLOPs for `tokens` tokens, `attention_pairs` allowed (query, key) pairs and `scored`
    tokens through the LM head."""
    d, n = config.hidden_size, config.num_layers
    h, k, hd = config.num_heads, config.num_kv_heads, config.resolved_head_dim
    mlp = sum(config.mlp_params(i, active=True) for i in range(n))  # top-k experts + router
    per_token = 2 * (n * (d * hd * (h + 2 * k) + h * hd * d) + mlp)
    per_pair = 4 * n * h * hd
    return per_token * tokens + per_pair * attention_pairs + 2 * config.vocab_size * d * scored


def step_flops(
    config: ModelConfig,
    tokens: float,
    attention_pairs: float,
    scored: float,
    *,
    reference_forward: bool,
    lm_head_everywhere: bool = False,
) -> float:
    """One DPO step: policy forward + backward, and the reference's forward if it runs. With
    `lm_head_everywhere` the policy's LM head runs on all `tokens`, not the `scored` ones (orpo's
    NLL over whole chosen sequences, `StepConfig.nll_prompt`); the reference still scores the
    completions only."""
    policy = forward_flops(
        config, tokens, attention_pairs, tokens if lm_head_everywhere else scored
    )
    reference = forward_flops(config, tokens, attention_pairs, scored) if reference_forward else 0
    return 3 * policy + reference


def recompute_flops(
    config: ModelConfig, tokens: float, attention_pairs: float, remat: str, attention: str
) -> float:
    """Forward FLOPs the backward pass reruns under the remat policy `remat` (on top of
    `step_flops`): the decoder layers' projections and MLP per token and the attention's QK^T and
    PV per pair, as far as the policy does not save them. `full` reruns both; `attention` reruns
    the projections and MLP, and the attention too unless the flash or Pallas kernel saved its
    output (cuDNN's forward reruns: `dpojax.models.attention.cudnn`); `dots_no_batch` reruns the
    attention's batched matmuls; `dots` and `none` nothing."""
    d, n = config.hidden_size, config.num_layers
    h, k, hd = config.num_heads, config.num_kv_heads, config.resolved_head_dim
    mlp = sum(config.mlp_params(i, active=True) for i in range(n))
    layers = 2 * (n * (d * hd * (h + 2 * k) + h * hd * d) + mlp) * tokens
    pairs = 4 * n * h * hd * attention_pairs
    if remat == "full" or (remat == "attention" and attention in ("reference", "cudnn")):
        return layers + pairs
    return {"attention": layers, "dots_no_batch": pairs}.get(remat, 0.0)


def batch_work(batch: Mapping[str, np.ndarray]) -> tuple[int, int, int]:
    """(tokens, attention pairs, scored tokens) of a layout batch (`dpojax.data.layouts`): its
    non-padding slots, the (query, key) pairs of non-padding tokens that the model's attention
    rule allows, and its scored slots. The pairs are counted a block of queries at a time in one
    compiled loop (about 2^24 pairs a block), so long rows need no [B, T, T] mask in memory.

    The count runs on the host's CPU device: on an accelerator it would queue behind the train
    step in flight, and reading it back would make the batch pipeline wait for that step."""
    seg = np.asarray(batch["segment_ids"], np.int32)
    rows, length = seg.shape
    block = min(length, max(1, 2**24 // (rows * length)))
    pad = -length % block
    seg = np.pad(seg, ((0, 0), (0, pad)))  # segment 0: padding, never counted
    parts = np.pad(np.asarray(batch["parts"], np.int32), ((0, 0), (0, pad)))
    seg, parts = jax.device_put((seg, parts), _host_device())
    counts = _allowed_pairs(seg, parts, block)
    pairs = int(np.asarray(counts).sum(dtype=np.int64))
    return int((seg > 0).sum()), pairs, int((np.asarray(batch["completion_ids"]) >= 0).sum())


@functools.cache
def _host_device() -> jax.Device | None:
    """The host's CPU device; None (the default device) where JAX_PLATFORMS leaves out the CPU."""
    try:
        return jax.local_devices(backend="cpu")[0]
    except RuntimeError:
        return None


@functools.partial(jax.jit, static_argnums=2)
def _allowed_pairs(seg: jax.Array, parts: jax.Array, block: int) -> jax.Array:
    """int32 [T / block]: the allowed pairs of real tokens per block of queries."""
    rows, length = seg.shape
    ids = TokenIds.of(rows, length, segment_ids=seg, parts=parts)
    index = jnp.arange(length)

    def count(start):
        queries = ids.slice(start, block)
        q_index = jax.lax.dynamic_slice_in_dim(index, start, block)
        mask = allowed(queries, ids, q_index, index)
        mask &= (queries.segment_ids > 0)[:, :, None] & (seg > 0)[:, None, :]
        return mask.sum(dtype=jnp.int32)

    return jax.lax.map(count, jnp.arange(0, length, block))
