"""The forward pass of the DPO step: per-completion log-probs of the policy and the reference,
and the per-pair losses, from one micro-batch in any layout (`dpojax.data.layouts`).

The model runs on whole rows; the LM head and the log-softmax only on the batch's score slots
(the positions whose next token is a completion token; docs/layouts.md#score-slots). LD-DPO
weights and WPO log-weights are computed here (docs/losses.md#options).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping

import jax
import jax.numpy as jnp
from flax import nnx

from dpojax.models.transformer import CausalLM, load_balancing_loss
from dpojax.train.kto import RunningMoments, bco_loss, kto_loss
from dpojax.train.logprobs import completion_sums, sequence_sums, token_outputs
from dpojax.train.losses import preference_loss, wpo_pair_weights
from dpojax.train.reference_choice import LoraBaseReference
from dpojax.train.state import StepConfig, TrainState


def ld_token_weights(
    completion_ids: jax.Array,
    completion_pos: jax.Array,
    chosen_index: jax.Array,
    rejected_index: jax.Array,
    counts: jax.Array,
    alpha: float,
) -> jax.Array:
    """LD-DPO token weights [R, L] (docs/losses.md#ld-dpo): 1 for the first min(n_c, n_r) tokens
    of a completion (`completion_pos` counts them from 0), `alpha` after; `counts` [C] are the
    completions' token counts. Apply to policy and reference alike."""
    partner = jnp.zeros_like(counts)
    partner = partner.at[chosen_index].set(counts[rejected_index])
    partner = partner.at[rejected_index].set(counts[chosen_index])
    limit = jnp.minimum(counts, partner)[jnp.maximum(completion_ids, 0)]
    return jnp.where(completion_pos < limit, 1.0, alpha)


def wpo_log_weights(
    token_logps: jax.Array,
    log_sum_p_sq: jax.Array,
    completion_ids: jax.Array,
    num_completions: int,
) -> jax.Array:
    """WPO log-weights [C] (docs/losses.md#wpo-weights): the mean over each completion's tokens
    of log p(token) - log sum_v p_v^2, without gradient; 0 for an empty completion."""
    adjusted = jax.lax.stop_gradient(token_logps - log_sum_p_sq)
    sums, counts = completion_sums(adjusted, completion_ids, num_completions)
    return sums / jnp.maximum(counts, 1.0)


def _scored_view(batch: Mapping[str, jax.Array]) -> Mapping[str, jax.Array]:
    """The per-token arrays at the batch's `score_slots` ([R, S] instead of [R, L]); the batch
    itself when it has none."""
    if "score_slots" not in batch:
        return batch
    slots = batch["score_slots"]
    index = jnp.maximum(slots, 0)
    view = dict(batch)
    for key in ("tokens", "pred_index", "completion_ids", "completion_pos"):
        if key in batch:
            taken = jnp.take_along_axis(batch[key], index, axis=1)
            view[key] = jnp.where(slots >= 0, taken, -1) if key.startswith("completion") else taken
    return view


def completion_logps(
    model: CausalLM, batch: Mapping[str, jax.Array], cfg: StepConfig
) -> dict[str, jax.Array]:
    """Per-completion log-prob sums and token counts [C] (and WPO log-weights, and a mixture of
    experts' load-balancing loss `aux_loss` over the batch's real tokens when
    `cfg.router_aux_coef` > 0) for one batch. The model runs on the whole rows; the LM head only
    on the batch's `score_slots` if any. With `cfg.nll_prompt` the LM head runs on every position
    and `nll_sums` / `nll_counts` [C] are each completion's whole sequence's (its prompt and its
    own tokens, `logprobs.sequence_sums`), for the NLL term of TRL's ORPOTrainer."""
    count = num_completions(batch)
    mc = model.config
    with_router = cfg.router_aux_coef > 0 and mc.num_experts > 0
    hidden = model(
        batch["tokens"],
        positions=batch["positions"],
        segment_ids=batch["segment_ids"],
        parts=batch["parts"],
        return_hidden=True,
        return_router_logits=with_router,
    )
    aux = None
    if with_router:
        hidden, router_logits = hidden
        real = (batch["segment_ids"] > 0).reshape(-1)
        aux = load_balancing_loss(router_logits, mc.num_experts, mc.num_experts_per_tok, real)
    rows = batch
    if not cfg.nll_prompt:  # the prompt's log-probs are needed: no score slots
        batch = _scored_view(batch)
    out = token_outputs(
        hidden,
        model.lm_head_weight(),
        batch["tokens"],
        batch["pred_index"],
        vocab_chunk=cfg.vocab_chunk,
        with_log_sum_p_sq=cfg.loss.use_weighting,
        with_stats=cfg.token_metrics,
        cap=mc.final_softcap,
    )
    lp, lsq = out.logps, out.log_sum_p_sq
    _, counts = completion_sums(jnp.zeros_like(lp), batch["completion_ids"], count)
    weighted = lp
    if cfg.ld_alpha is not None:
        weighted = lp * ld_token_weights(
            batch["completion_ids"],
            batch["completion_pos"],
            batch["chosen_index"],
            batch["rejected_index"],
            counts,
            cfg.ld_alpha,
        )
    sums, _ = completion_sums(weighted, batch["completion_ids"], count)
    result = {"sums": sums, "counts": counts}
    if cfg.nll_prompt:
        result["nll_sums"], result["nll_counts"] = sequence_sums(lp, rows, count)
    if lsq is not None:
        result["wpo_log_w"] = wpo_log_weights(lp, lsq, batch["completion_ids"], count)
    if aux is not None:
        result["aux_loss"] = aux
    if out.stats is not None:  # per-completion sums of the token statistics (metrics)
        for name, values in out.stats._asdict().items():
            result[f"{name}_sums"] = completion_sums(values, batch["completion_ids"], count)[0]
    return result


def token_metric_sums(policy: Mapping[str, jax.Array], batch: Mapping[str, jax.Array]) -> dict:
    """The sums behind losses.TOKEN_METRICS, over the batch's real pairs. Each pair counts its own chosen
    and rejected completion, as TRL counts them, so a completion that several pairs share
    (prefix-shared, grouped layouts) counts once per pair and every layout gives TRL's numbers."""
    ci, ri = batch["chosen_index"], batch["rejected_index"]
    mask = batch["pair_mask"].astype(jnp.float32)
    counts = policy["counts"]

    def over_pairs(values, index):
        return (values[index] * mask).sum()

    chosen_tokens = over_pairs(counts, ci)
    rejected_tokens = over_pairs(counts, ri)
    entropy = policy["entropy_sums"]
    return {
        "token_entropy_sum": over_pairs(entropy, ci) + over_pairs(entropy, ri),
        "completion_tokens": chosen_tokens + rejected_tokens,
        "chosen_top1_sum": over_pairs(policy["is_top1_sums"], ci),
        "chosen_tokens": chosen_tokens,
        "chosen_logit_sum": over_pairs(policy["mean_logit_sums"], ci),
        "rejected_logit_sum": over_pairs(policy["mean_logit_sums"], ri),
        "rejected_tokens": rejected_tokens,
    }


def num_completions(batch) -> int:
    """Static number of completion slots: the length of `completion_mask` [C] when the batch has
    one (grouped layouts), else 2 per pair."""
    if "completion_mask" in batch:
        return int(batch["completion_mask"].shape[-1])
    return 2 * batch["chosen_index"].shape[-1]


def bco_losses(
    policy: Mapping[str, jax.Array],
    ref_own: jax.Array,
    batch: Mapping[str, jax.Array],
    cfg: StepConfig,
    moments: RunningMoments,
    *,
    update: bool = True,
):
    """(per-example losses, metric sums, running moments after this micro-batch) of a micro-batch
    of unpaired examples for bco (laid out as for `unpaired_losses`; the KL completions are not
    used). The moments are updated with this micro-batch's real examples' rewards (all devices':
    the global micro-batch) before δ is read, as TRL does per forward; `update=False`
    (evaluation) uses δ as it is. `delta_sum` is δ times the micro-batch's examples."""
    ci = batch["chosen_index"]
    labels = batch.get("labels", jnp.ones_like(batch["pair_mask"]))
    losses, sums, new = bco_loss(
        policy["sums"][ci],
        ref_own,
        labels > 0.5,
        moments,
        batch["pair_mask"],
        cfg.loss,
        update=update,
    )
    new = RunningMoments(*(v.astype(old.dtype) for v, old in zip(new, moments, strict=True)))
    sums["delta_sum"] = sums.pop("delta") * sums["count/examples"]
    sums["count"] = sums["count/examples"]
    return losses, sums, new


def pair_losses(
    policy: Mapping[str, jax.Array],
    ref_chosen: jax.Array,
    ref_rejected: jax.Array,
    batch: Mapping[str, jax.Array],
    cfg: StepConfig,
    sft_tokens_per_pair: jax.Array | None,
):
    """(per-pair losses, metric sums) from per-completion policy results and reference logps."""
    ci, ri = batch["chosen_index"], batch["rejected_index"]
    kwargs = {}
    weights = None
    if cfg.loss.use_weighting:
        w = jnp.exp(policy["wpo_log_w"])
        weights = wpo_pair_weights(w[ci], w[ri])
    if sft_tokens_per_pair is not None:
        kwargs["sft_tokens_per_pair"] = sft_tokens_per_pair
    if "nll_sums" in policy:  # the NLL over the chosen sequences' prompt and completion tokens
        kwargs["nll_chosen_logps"] = policy["nll_sums"][ci]
        kwargs["nll_chosen_lengths"] = policy["nll_counts"][ci]
    per_pair, sums = preference_loss(
        policy["sums"][ci],
        policy["sums"][ri],
        ref_chosen,
        ref_rejected,
        cfg.loss,
        chosen_lengths=policy["counts"][ci],
        rejected_lengths=policy["counts"][ri],
        pair_mask=batch["pair_mask"],
        pair_weights=weights,
        metrics_as_sums=True,
        **kwargs,
    )
    if "entropy_sums" in policy:
        sums.update(token_metric_sums(policy, batch))
    return per_pair, sums


def unpaired_losses(
    policy: Mapping[str, jax.Array],
    ref_own: jax.Array,
    ref_kl: jax.Array,
    batch: Mapping[str, jax.Array],
    cfg: StepConfig,
):
    """(per-example losses, metric sums) of a micro-batch of unpaired examples (kto,
    apo_zero_unpaired): each "pair" is an example's own completion (chosen slot) and its KL
    completion (rejected slot), `batch["labels"]` 1 for desirable. KTO's KL estimate is this
    micro-batch's (TRL: each device micro-batch's, averaged over the processes); `kl_sum` is it
    times the micro-batch's examples, `count` the examples."""
    ci, ri = batch["chosen_index"], batch["rejected_index"]
    # a batch without labels (a plan's or auto-fit's synthetic pairs) counts all as desirable
    labels = batch.get("labels", jnp.ones_like(batch["pair_mask"]))
    losses, sums = kto_loss(
        policy["sums"][ci],
        ref_own,
        labels > 0.5,
        policy["sums"][ri],
        ref_kl,
        batch["pair_mask"],
        cfg.loss,
    )
    sums["kl_sum"] = sums.pop("kl") * sums["count/examples"]
    sums["count"] = sums["count/examples"]
    return losses, sums


def reference_logps(
    graphdef: nnx.GraphDef,
    state: TrainState,
    batch: Mapping[str, jax.Array],
    cfg: StepConfig,
    is_lora: bool,
) -> tuple[jax.Array, jax.Array]:
    """Reference sequence log-probs (chosen, rejected) [P] of one micro-batch, no gradient; zeros
    for a reference-free loss, which takes them as 0 (no reference pass)."""
    if cfg.reference_free:
        zeros = jnp.zeros(batch["chosen_index"].shape, jnp.float32)
        return zeros, zeros
    if not cfg.reference.runs_forward:  # precomputed: the log-probs ride in the batch
        return batch["ref_chosen_logps"], batch["ref_rejected_logps"]
    # Adapters off: LoRA factors zero (a policy without LoRA has an empty adapter state), or
    # under TR-DPO the reference's own adapters.
    if state.ref_adapters is not None:
        adapters = state.ref_adapters
    else:
        adapters = jax.tree.map(jnp.zeros_like, state.params) if is_lora else state.frozen
    base = state.frozen if isinstance(cfg.reference, LoraBaseReference) else state.ref
    model = nnx.merge(graphdef, adapters, base)
    ref_cfg = dataclasses.replace(
        cfg,
        loss=dataclasses.replace(cfg.loss, use_weighting=False),
        router_aux_coef=0.0,
        token_metrics=False,
        nll_prompt=False,
    )
    out = jax.lax.stop_gradient(completion_logps(model, batch, ref_cfg))
    return out["sums"][batch["chosen_index"]], out["sums"][batch["rejected_index"]]
