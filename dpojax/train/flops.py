"""Model FLOPs of a DPO step, for model FLOP utilisation (MFU) figures.

Counted: the decoder's projections per token (a mixture of experts' router and the experts each
token runs through), QK^T and PV per (query, key) pair the attention mask
allows, the LM head per scored token (embedding lookups, norms and elementwise work are not). A
step is the policy's forward and backward (3x the forward) plus, when the reference runs in the
step, its forward (1x).
"""

from __future__ import annotations

from collections.abc import Mapping

import jax.numpy as jnp
import numpy as np

from dpojax.models.attention.reference import attention_mask
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
) -> float:
    """One DPO step: policy forward + backward, and the reference's forward if it runs."""
    return forward_flops(config, tokens, attention_pairs, scored) * (3 + reference_forward)


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
    non-padding slots, the (query, key) pairs of non-padding tokens that the model's attention mask
    allows, and its scored slots."""
    seg, parts = batch["segment_ids"], batch["parts"]
    rows, length = seg.shape
    mask = np.asarray(
        attention_mask(rows, length, segment_ids=jnp.asarray(seg), parts=jnp.asarray(parts))
    )
    real = seg > 0
    pairs = int((mask & real[:, :, None] & real[:, None, :]).sum())
    return int(real.sum()), pairs, int((batch["completion_ids"] >= 0).sum())
