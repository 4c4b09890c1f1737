"""Preference losses for DPO and its relatives, as pure JAX functions (no model code).

Entry point: `preference_loss(policy_chosen_logps, policy_rejected_logps, ref_chosen_logps,
ref_rejected_logps, settings, *, chosen_lengths=..., ...) -> (per_pair_losses, metrics)`, with
`settings` the loss settings (`dpojax.train.loss_settings.LossSettings`, the config's `loss.*`).

- Inputs are per-pair sequence log-prob sums, shape [N] (`dpojax.train.forward` builds them from
  a batch, LD-DPO weights included; docs/losses.md has the formulas). Losses are computed in at least float32 (bfloat16 and
  float16 inputs are promoted; float64 stays float64), finite for saturated inputs.
- `settings.type` takes every TRL 1.16 name and NeMo's (`dpo`, `ipo_sum`, `rpo_sq`,
  `rpo_bwd_kl`, `rpo_fwd_kl`); several joined with "," combine: per pair `Σ_k w_k · loss_k` with
  `settings.weights`.
- The settings are static Python values: under `jax.jit` close over them (`functools.partial`)
  or mark them static. `settings.beta`, the lengths, rewards and pair weights may be traced arrays.
- The batch loss is the mean of `per_pair_losses` over the valid pairs (`pair_mask`).

Metrics as sums (gradient accumulation, multi-device)
-----------------------------------------------------
By default `metrics` are batch means under TRL names (`rewards/chosen`, `rewards/rejected`,
`rewards/accuracies`, `rewards/margins`, `logps/chosen`, `logps/rejected`), NeMo names (`acc`,
`rewards_chosen_mean`, `rewards_rejected_mean`, `rewards_all_mean`, `rewards_all_std`,
`preference_loss`, `sft_loss`) and `loss`. Means of means are wrong when micro-batches or devices
differ in size, so a step that accumulates or reduces should pass `metrics_as_sums=True`: every
entry is then a plain sum over the valid pairs, plus `count` (number of pairs) and
`rewards_all_sumsq` (Σ r_c² + r_r², for the std). Add the sums of all micro-batches / devices
(`jax.tree.map(jnp.add, a, b)` or `jax.lax.psum`) and call `finalize_metrics` once. The global loss
to differentiate is `Σ per_pair_losses / global count`.

One loss is not a sum of per-pair terms: TRL's `sft` (`−Σπc / Σnc` over all chosen tokens of the
batch). Pass `sft_tokens_per_pair` (global chosen tokens / global pairs) to make it exact across
micro-batches: each pair then contributes `−πc_i / sft_tokens_per_pair`. `aot`/`aot_unpaired` sort
within the batch they are given (as TRL does per device), so they depend on micro-batch composition.
"""

from __future__ import annotations

from collections.abc import Mapping

import jax
import jax.numpy as jnp

from dpojax.schema import out_of_range
from dpojax.train.loss_settings import F_DIVERGENCE_TYPES, LossSettings
from dpojax.train.loss_terms import (
    CPO_TYPES,
    F_DIVERGENCES,
    LENGTH_NORMALISED_LOSSES,
    LOSS_FUNCTIONS,
    NLL_LOSSES,
    RANKED_LOSSES,
    REFERENCE_FREE_LOSSES,
    PairInputs,
    log1mexp,
    log_sigmoid,
    wpo_pair_weights,
)

__all__ = [
    "LOSS_TYPES",
    "preference_loss",
    "finalize_metrics",
    "TOKEN_METRICS",
    "wpo_pair_weights",
]

Array = jax.Array

LOSS_TYPES: tuple[str, ...] = tuple(sorted(LOSS_FUNCTIONS))

_NEEDS_BOTH_LENGTHS = LENGTH_NORMALISED_LOSSES
DEFAULT_SETTINGS = LossSettings()  # sigmoid (DPO), beta 0.1
_SUM_ONLY_KEYS = ("count", "rewards_all_sumsq")

# The token-level metrics TRL 1.16's DPOTrainer logs, as (sum, count) pairs over the step's pairs:
# the entropy over every completion token, the top-1 rate over chosen tokens only, the mean
# logit over chosen and over rejected tokens (finalize_metrics divides them;
# forward.token_metric_sums makes them).
TOKEN_METRICS = {
    "entropy": ("token_entropy_sum", "completion_tokens"),
    "mean_token_accuracy": ("chosen_top1_sum", "chosen_tokens"),
    "logits/chosen": ("chosen_logit_sum", "chosen_tokens"),
    "logits/rejected": ("rejected_logit_sum", "rejected_tokens"),
}


# ----------------------------------------------------------------------------- validation


def _resolve_loss_types(settings: LossSettings) -> tuple[tuple[str, ...], tuple[float, ...]]:
    """The loss names of `settings.type` with one weight each; reject unknown names."""
    names = settings.types
    if not names:
        raise ValueError(f"loss type is empty; choose one or more of: {', '.join(LOSS_TYPES)}")
    unknown = [n for n in names if n not in LOSS_FUNCTIONS]
    if unknown:
        raise ValueError(f"unknown loss type {unknown}; valid loss types: {', '.join(LOSS_TYPES)}")
    if not settings.weights:
        return names, (1.0,) * len(names)
    weights = tuple(float(w) for w in settings.weights)
    if len(weights) != len(names):
        raise ValueError(
            f"loss weights has {len(weights)} entries for {len(names)} loss types {list(names)}; "
            "give one weight per loss type"
        )
    return names, weights


def _validate_settings(names: tuple[str, ...], s: LossSettings) -> None:
    """Raise ValueError, naming the setting to change, for settings out of range or inconsistent
    with each other (the config check says the same of the `loss.*` keys before any compute)."""
    chosen = set(names)
    free = sorted(chosen & REFERENCE_FREE_LOSSES)
    if free and not chosen <= REFERENCE_FREE_LOSSES | {"sft"}:
        raise ValueError(
            f"{free} are reference-free objectives: combine them only with each other or 'sft', "
            f"not with {sorted(chosen - REFERENCE_FREE_LOSSES - {'sft'})}"
        )
    if free and s.f_divergence != "reverse_kl":
        raise ValueError(
            f"{free} score the policy log-probs themselves: use f_divergence 'reverse_kl'"
        )
    if s.cpo_type not in CPO_TYPES:
        raise ValueError(f"unknown cpo_type {s.cpo_type!r}; valid: {', '.join(CPO_TYPES)}")
    if s.f_divergence not in F_DIVERGENCES:
        raise ValueError(
            f"unknown f_divergence {s.f_divergence!r}; valid: {', '.join(F_DIVERGENCE_TYPES)}"
        )
    problems = out_of_range(s)
    if problems:
        raise ValueError("; ".join(problems))
    if "exo_pair" in chosen and not s.label_smoothing > 0.0:
        raise ValueError(
            f"exo_pair needs 0 < label_smoothing (it takes log ε and log(1-ε)); "
            f"got {s.label_smoothing}. The EXO paper uses 1e-3."
        )
    if "robust" in chosen and not s.label_smoothing < 0.5:
        raise ValueError(
            f"robust needs label_smoothing < 0.5 (divides by 1-2ε), got {s.label_smoothing}"
        )
    if s.cdpo_smoothing and not chosen & {"sigmoid", "dpo"}:
        raise ValueError("cdpo_smoothing=True only applies to loss type 'sigmoid' (or 'dpo')")
    if s.preference_average_log_probs and chosen & _NEEDS_BOTH_LENGTHS:
        raise ValueError(
            f"{sorted(chosen & _NEEDS_BOTH_LENGTHS)} already divide by completion lengths; with "
            "preference_average_log_probs=True use 'ipo_sum' / 'sigmoid' instead"
        )


def _validate_inputs(
    names: tuple[str, ...],
    s: LossSettings,
    *,
    has_reference: bool,
    chosen_lengths: Array | None,
    rejected_lengths: Array | None,
    sft_tokens_per_pair: float | Array | None,
) -> None:
    """Raise ValueError, naming the argument to pass, for inputs the settings need."""
    chosen = set(names)
    if not s.without_reference and not has_reference:
        raise ValueError("reference log-probs are None; pass them or set reference_free=True")
    need_both = sorted(chosen & _NEEDS_BOTH_LENGTHS)
    if s.preference_average_log_probs:
        need_both = ["preference_average_log_probs"]
    if need_both and (chosen_lengths is None or rejected_lengths is None):
        raise ValueError(f"{need_both} need chosen_lengths and rejected_lengths")
    nll = chosen & NLL_LOSSES
    needs_chosen = (nll and sft_tokens_per_pair is None) or s.sft_average_log_probs
    if needs_chosen and chosen_lengths is None:
        raise ValueError(
            "loss type 'sft', 'orpo', 'cpo' and sft_average_log_probs=True need chosen_lengths"
        )
    if sft_tokens_per_pair is not None and not nll:
        raise ValueError("sft_tokens_per_pair is only used by loss type 'sft', 'orpo' and 'cpo'")


# ----------------------------------------------------------------------------- helpers


def _log_probs(policy: tuple, reference: tuple | None) -> tuple:
    """(dtype, πc, πr, ρc, ρr) in one float dtype (at least float32); the reference log-probs
    are zeros when `reference` is None (reference-free)."""
    dtype = jnp.result_type(*policy, *(reference or ()), jnp.float32)
    pc, pr = (jnp.asarray(x).astype(dtype) for x in policy)
    if reference is None:
        return dtype, pc, pr, jnp.zeros_like(pc), jnp.zeros_like(pr)
    rc, rr = (jnp.asarray(x).astype(dtype) for x in reference)
    return dtype, pc, pr, rc, rr


def _lengths(lengths: Array | None, dtype: jnp.dtype) -> Array | None:
    """Completion token counts as floats, clamped at 1 so empty completions stay finite."""
    if lengths is None:
        return None
    return jnp.maximum(jnp.asarray(lengths).astype(dtype), 1.0)


def _masked_sum(x: Array, valid: Array | None) -> Array:
    return jnp.sum(x) if valid is None else jnp.sum(jnp.where(valid, x, 0.0))


def _sft_loss_type_values(
    policy_chosen: Array,
    chosen_lengths: Array | None,
    valid: Array | None,
    sft_tokens_per_pair: float | Array | None,
) -> Array:
    """TRL `sft`: `−Σπc/Σnc` for every pair (or `−πc_i/sft_tokens_per_pair`, exactly summable)."""
    if sft_tokens_per_pair is not None:
        return -policy_chosen / sft_tokens_per_pair
    # Raw token counts here: a zero-length completion adds no tokens to the batch mean.
    tokens = jnp.asarray(chosen_lengths).astype(policy_chosen.dtype)
    total = _masked_sum(tokens, valid)
    value = -_masked_sum(policy_chosen, valid) / jnp.maximum(total, 1.0)
    return jnp.broadcast_to(value, policy_chosen.shape)


def _nll_values(
    names: tuple[str, ...],
    policy_chosen: Array,
    chosen_lengths: Array | None,
    valid: Array | None,
    sft_tokens_per_pair: float | Array | None,
    nll: tuple[Array | None, Array | None],
) -> Array | None:
    """The NLL terms' per-pair values (`_sft_loss_type_values`; None without an NLL loss) of the
    chosen log-probs and lengths, or of `nll` (log-prob sums, token counts) where given."""
    if not set(names) & NLL_LOSSES:
        return None
    logps, lengths = nll
    if logps is not None:
        policy_chosen = jnp.asarray(logps, policy_chosen.dtype)
    if lengths is not None:
        chosen_lengths = lengths
    return _sft_loss_type_values(policy_chosen, chosen_lengths, valid, sft_tokens_per_pair)


def _gt_margin(
    gt_chosen_rewards: Array | None,
    gt_rejected_rewards: Array | None,
    scale: float | Array,
    dtype: jnp.dtype,
) -> Array:
    """NeMo ground-truth margin `g = scale · (R_c − R_r)` (defaults R_c = 1, R_r = 0)."""
    rc = 1.0 if gt_chosen_rewards is None else jnp.asarray(gt_chosen_rewards, dtype)
    rr = 0.0 if gt_rejected_rewards is None else jnp.asarray(gt_rejected_rewards, dtype)
    return jnp.asarray(scale * (rc - rr), dtype)


def _metric_sums(
    *,
    policy_chosen: Array,
    policy_rejected: Array,
    chosen_rewards: Array,
    rejected_rewards: Array,
    beta: float | Array,
    preference: Array,
    sft: Array,
    total: Array,
    valid: Array | None,
) -> dict[str, Array]:
    """Per-batch sums over valid pairs; `finalize_metrics` turns them into means.

    `total`, `preference` and `sft` are already zero where they do not count.
    """

    def s(x: Array) -> Array:
        return _masked_sum(x, valid)

    dtype = policy_chosen.dtype
    count = jnp.asarray(policy_chosen.shape[0], dtype) if valid is None else s(jnp.ones_like(total))
    correct = (chosen_rewards > rejected_rewards).astype(dtype)  # strict: ties count 0
    return {
        "count": count,
        "loss": jnp.sum(total),
        "preference_loss": jnp.sum(preference),
        "sft_loss": jnp.sum(sft),
        "rewards/chosen": s(beta * chosen_rewards),
        "rewards/rejected": s(beta * rejected_rewards),
        "rewards/accuracies": s(correct),
        "rewards/margins": s(beta * (chosen_rewards - rejected_rewards)),
        "logps/chosen": s(policy_chosen),
        "logps/rejected": s(policy_rejected),
        "acc": s(correct),
        "rewards_chosen_mean": s(chosen_rewards),
        "rewards_rejected_mean": s(rejected_rewards),
        "rewards_all_mean": s(0.5 * (chosen_rewards + rejected_rewards)),
        "rewards_all_sumsq": s(jnp.square(chosen_rewards) + jnp.square(rejected_rewards)),
    }


def finalize_metrics(sums: Mapping[str, Array]) -> dict[str, Array]:
    """Turn (globally summed) metric sums into means; adds `rewards_all_std` (unbiased).

    Every key except `count` and `rewards_all_sumsq` is divided by `count`, but the token
    metrics' sums (TOKEN_METRICS), which are divided by their token counts. The std is taken over
    all 2·count chosen and rejected rewards.
    """
    count = sums["count"]
    n = jnp.maximum(count, 1.0)
    token_sums = {name for pair in TOKEN_METRICS.values() for name in pair}
    metrics = {k: v / n for k, v in sums.items() if k not in _SUM_ONLY_KEYS and k not in token_sums}
    for name, (total, tokens) in TOKEN_METRICS.items():
        if total in sums:  # 0 where the step has no such tokens, as TRL
            metrics[name] = jnp.where(
                sums[tokens] > 0, sums[total] / jnp.maximum(sums[tokens], 1.0), 0.0
            )
    n_all = 2.0 * count
    mean = metrics["rewards_all_mean"]
    var = (sums["rewards_all_sumsq"] - n_all * jnp.square(mean)) / jnp.maximum(n_all - 1.0, 1.0)
    metrics["rewards_all_std"] = jnp.sqrt(jnp.maximum(var, 0.0))
    return metrics


# ----------------------------------------------------------------------------- entry point


def preference_loss(
    policy_chosen_logps: Array,
    policy_rejected_logps: Array,
    ref_chosen_logps: Array | None,
    ref_rejected_logps: Array | None,
    settings: LossSettings = DEFAULT_SETTINGS,
    *,
    chosen_lengths: Array | None = None,
    rejected_lengths: Array | None = None,
    gt_chosen_rewards: Array | None = None,
    gt_rejected_rewards: Array | None = None,
    gt_reward_scale: float | Array = 1.0,
    pair_weights: Array | None = None,
    pair_mask: Array | None = None,
    sft_tokens_per_pair: float | Array | None = None,
    nll_chosen_logps: Array | None = None,
    nll_chosen_lengths: Array | None = None,
    metrics_as_sums: bool = False,
) -> tuple[Array, dict[str, Array]]:
    """Per-pair preference losses [N] and metrics for one batch of N pairs.

    Args:
      policy_chosen_logps, policy_rejected_logps: [N] policy sequence log-prob sums (πc, πr).
      ref_chosen_logps, ref_rejected_logps: [N] reference sums (ρc, ρr); ignored (taken as 0) and
        may be None when the settings are reference-free (`LossSettings.without_reference`).
      settings: the loss and its hyperparameters (`LossSettings`; docs/config.md's `loss.*`):
        `type` names the losses (TRL `ipo` is length-averaged; NeMo's IPO on summed log-ratios is
        `ipo_sum`; `dpo` is an alias of `sigmoid`), weighted by `weights`; `beta`;
        `label_smoothing` (ε for exo_pair, robust, aot, aot_unpaired, and sigmoid only with
        `cdpo_smoothing`: TRL 1.x sigmoid ignores it, so do we by default); `f_divergence`,
        `f_alpha` (the score transform f of each log-ratio; reverse_kl = identity);
        `discopop_tau`; cpo's `cpo_type`, `simpo_gamma`, `cpo_alpha`; orpo's `orpo_lambda`;
        NeMo's `preference_average_log_probs` (rewards r = log-ratio / token count),
        `sft_average_log_probs` (the SFT term per sequence is the token mean) and the weights of
        `loss = preference_loss_weight · pref + sft_loss_weight · sft`.
      chosen_lengths, rejected_lengths: [N] completion token counts (clamped at 1), needed by ipo,
        sigmoid_norm, sft and the NeMo average modes.
      gt_chosen_rewards, gt_rejected_rewards, gt_reward_scale: NeMo RPO ground-truth margin
        `g = scale·(R_c − R_r)`, defaults R_c = 1, R_r = 0.
      pair_weights: [N] per-pair weights (e.g. `wpo_pair_weights`) multiplying the preference term;
        treated as constants (no gradient).
      pair_mask: [N] bool, False for padding pairs: their losses are 0 and metrics skip them.
      sft_tokens_per_pair: see the module docstring (exact `sft` under accumulation).
      nll_chosen_logps, nll_chosen_lengths: [N] the log-prob sums and token counts the NLL terms
        (sft, orpo, cpo) average, when they are not `policy_chosen_logps` and `chosen_lengths`:
        TRL's ORPOTrainer's over the chosen sequence's prompt and completion tokens.
      metrics_as_sums: return additive sums (plus `count`) instead of means; see module docstring.

    Returns:
      `(per_pair_losses [N], metrics)`. Losses of aot/aot_unpaired are indexed by sorted rank.
    """
    names, name_weights = _resolve_loss_types(settings)
    _validate_settings(names, settings)
    _validate_inputs(
        names,
        settings,
        has_reference=ref_chosen_logps is not None and ref_rejected_logps is not None,
        chosen_lengths=chosen_lengths,
        rejected_lengths=rejected_lengths,
        sft_tokens_per_pair=sft_tokens_per_pair,
    )
    reference_free = settings.without_reference
    dtype, policy_chosen, policy_rejected, ref_chosen, ref_rejected = _log_probs(
        (policy_chosen_logps, policy_rejected_logps),
        None if reference_free else (ref_chosen_logps, ref_rejected_logps),
    )
    n_chosen, n_rejected = _lengths(chosen_lengths, dtype), _lengths(rejected_lengths, dtype)
    valid = None if pair_mask is None else jnp.asarray(pair_mask).astype(bool)

    chosen_rewards = policy_chosen - ref_chosen
    rejected_rewards = policy_rejected - ref_rejected
    if settings.preference_average_log_probs:
        chosen_rewards, rejected_rewards = chosen_rewards / n_chosen, rejected_rewards / n_rejected
    transform = F_DIVERGENCES[settings.f_divergence]
    pair = PairInputs(
        chosen_logratios=chosen_rewards,
        rejected_logratios=rejected_rewards,
        chosen_scores=transform(chosen_rewards, settings.f_alpha),
        rejected_scores=transform(rejected_rewards, settings.f_alpha),
        policy_margin=policy_chosen - policy_rejected,
        reference_margin=ref_chosen - ref_rejected,
        chosen_lengths=n_chosen,
        rejected_lengths=n_rejected,
        sft=_nll_values(
            names,
            policy_chosen,
            chosen_lengths,
            valid,
            sft_tokens_per_pair,
            (nll_chosen_logps, nll_chosen_lengths),
        ),
        gt_margin=_gt_margin(gt_chosen_rewards, gt_rejected_rewards, gt_reward_scale, dtype),
        sort_valid=valid,
        settings=settings,
    )
    preference = _combine(names, name_weights, pair, valid)
    if pair_weights is not None:
        preference = preference * jax.lax.stop_gradient(jnp.asarray(pair_weights).astype(dtype))
    sft = -policy_chosen / n_chosen if settings.sft_average_log_probs else -policy_chosen
    if valid is not None:
        sft = jnp.where(valid, sft, 0.0)
    # Both terms are already 0 for padding pairs (ranked losses: for tail ranks).
    total = settings.preference_loss_weight * preference + settings.sft_loss_weight * sft

    shown = dict(
        policy_chosen=policy_chosen,
        policy_rejected=policy_rejected,
        chosen_rewards=chosen_rewards,
        rejected_rewards=rejected_rewards,
        beta=settings.beta,
    )
    extra = {}
    if names in (("orpo",), ("cpo",)):
        shown, extra = _objective_metrics(names[0], pair, valid)
    sums = _metric_sums(**shown, preference=preference, sft=sft, total=total, valid=valid)
    sums.update(extra)
    return total, (sums if metrics_as_sums else finalize_metrics(sums))


def _objective_metrics(
    name: str, pair: PairInputs, valid: Array | None
) -> tuple[dict[str, Array | float], dict[str, Array]]:
    """The log-probs and rewards TRL's ORPOTrainer / CPOTrainer log for a loss of `orpo` or `cpo`
    alone: orpo's length-averaged log-probs and rewards `λ·logp`, with `nll_loss`,
    `log_odds_ratio` (the mean of logσ(log odds)) and `log_odds_chosen` (of the log odds); cpo's
    log-probs (averaged for cpo_type ipo and simpo) and rewards `β·logp`, with `nll_loss`. As
    `_metric_sums`'s arguments, and the extra metric sums."""
    c, r = pair.chosen_logratios, pair.rejected_logratios  # reference-free: the log-probs
    if name == "orpo" or pair.settings.cpo_type in ("ipo", "simpo"):
        c, r = c / pair.chosen_lengths, r / pair.rejected_lengths
    shown = dict(
        policy_chosen=c,
        policy_rejected=r,
        chosen_rewards=c,
        rejected_rewards=r,
        beta=pair.settings.orpo_lambda if name == "orpo" else pair.settings.beta,
    )
    extra = {"nll_loss": _masked_sum(pair.sft, valid)}
    if name == "orpo":
        log_odds = (c - r) - (log1mexp(c) - log1mexp(r))
        extra["log_odds_ratio"] = _masked_sum(log_sigmoid(log_odds), valid)
        extra["log_odds_chosen"] = _masked_sum(log_odds, valid)
    return shown, extra


def _combine(
    names: tuple[str, ...], name_weights: tuple[float, ...], pair: PairInputs, valid: Array | None
) -> Array:
    """`Σ_k w_k · loss_k` per pair; padding pairs (or, for ranked losses, tail ranks) are 0."""
    total = jnp.zeros_like(pair.chosen_logratios)
    rank_valid = None
    if valid is not None:
        rank_valid = jnp.arange(valid.shape[0]) < jnp.sum(valid)
    for name, w in zip(names, name_weights, strict=True):
        value = LOSS_FUNCTIONS[name](pair)
        mask = rank_valid if name in RANKED_LOSSES else valid
        if mask is not None:
            value = jnp.where(mask, value, 0.0)
        total = total + w * value
    return total
