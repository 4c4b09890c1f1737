"""Per-pair preference-loss formulas and f-divergence score transforms.

Pure `jax.numpy` functions of per-pair arrays of shape [N] (one value per preference pair).
`dpojax.train.losses` composes these pieces into `preference_loss`; the formulas, their sources
and reference numbers are in docs/losses.md (TRL 1.16 and NeMo names).

Numerics: every log-sigmoid is `jax.nn.log_sigmoid` and `1 - sigmoid(x)` is written `sigmoid(-x)`,
so saturated arguments give exact small values instead of 0 * inf. Exponentials of log-ratios go
through `capped_exp`/`capped_expm1`, exact up to `EXP_CAP` and continued linearly above it, so the
transforms and discopop stay finite in float32 for any input while matching the reference numbers.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp

Array = jax.Array

# exp(30) ~ 1.1e13: far beyond any loss value that still carries information, and its square times
# a further linear factor stays well inside the float32 range.
EXP_CAP = 30.0

log_sigmoid = jax.nn.log_sigmoid
sigmoid = jax.nn.sigmoid


# ----------------------------------------------------------------------------- numerics


def capped_exp(x: Array) -> Array:
    """`exp(x)` for `x <= EXP_CAP`, continued linearly above it (value and slope match)."""
    return jnp.exp(jnp.minimum(x, EXP_CAP)) * (1.0 + jnp.maximum(x - EXP_CAP, 0.0))


def capped_expm1(x: Array) -> Array:
    """`expm1(x)` for `x <= EXP_CAP`, continued linearly above it (see `capped_exp`)."""
    return jnp.expm1(jnp.minimum(x, EXP_CAP)) + math.exp(EXP_CAP) * jnp.maximum(x - EXP_CAP, 0.0)


# ----------------------------------------------------------------------------- f-divergences


def _reverse_kl(x: Array, alpha: float) -> Array:
    del alpha
    return x


def _forward_kl(x: Array, alpha: float) -> Array:
    del alpha
    return -capped_expm1(-x)  # 1 - exp(-x)


def _js_divergence(x: Array, alpha: float) -> Array:
    del alpha
    return math.log(2.0) + log_sigmoid(x)


def _alpha_divergence(x: Array, alpha: float) -> Array:
    if abs(alpha - 1.0) < 1e-6:
        return x
    return capped_expm1((alpha - 1.0) * x) / (alpha - 1.0)


# Score transform f applied to each log-ratio (TRL `f_divergence_type`); `alpha` is static.
F_DIVERGENCES: dict[str, Callable[[Array, float], Array]] = {
    "reverse_kl": _reverse_kl,
    "forward_kl": _forward_kl,
    "js_divergence": _js_divergence,
    "alpha_divergence": _alpha_divergence,
}


# ----------------------------------------------------------------------------- per-pair losses


class PairInputs(NamedTuple):
    """Everything a per-pair loss formula may read; arrays are [N] unless noted."""

    chosen_logratios: Array  # cl = πc - ρc (already length-averaged in NeMo average mode)
    rejected_logratios: Array  # rl = πr - ρr
    chosen_scores: Array  # f(cl)
    rejected_scores: Array  # f(rl)
    policy_margin: Array  # πc - πr (aot)
    reference_margin: Array  # ρc - ρr (aot)
    chosen_lengths: Array | None  # completion token counts, clamped at 1
    rejected_lengths: Array | None
    sft: Array | None  # TRL `sft` per-pair value
    gt_margin: Array  # g = scale * (R_c - R_r), scalar or [N]
    sort_valid: Array | None  # [N] bool: pairs that take part in the aot batch sort
    # The loss settings (`dpojax.train.loss_settings.LossSettings`: beta, label_smoothing,
    # discopop_tau, cdpo_smoothing, cpo_type, simpo_gamma, cpo_alpha, orpo_lambda, ...); a formula
    # reads the hyperparameters it needs from them.
    settings: Any


def _delta(p: PairInputs) -> Array:
    return p.chosen_scores - p.rejected_scores


def _smoothed_sigmoid(z: Array, eps: float) -> Array:
    """cDPO form `-(1-ε)logσ(z) - ε logσ(-z)`."""
    return -(1.0 - eps) * log_sigmoid(z) - eps * log_sigmoid(-z)


def _sort_for_batch(x: Array, valid: Array | None) -> Array:
    """Ascending sort; invalid pairs are pushed to the tail (equally in both sorted arrays)."""
    if valid is not None:
        x = jnp.where(valid, x, jnp.finfo(x.dtype).max / 4)
    return jnp.sort(x)


def sigmoid_loss(p: PairInputs) -> Array:
    """DPO: `-logσ(βΔ)`; with `cdpo_smoothing` the cDPO form with ε = label_smoothing."""
    z = p.settings.beta * _delta(p)
    if p.settings.cdpo_smoothing:
        return _smoothed_sigmoid(z, p.settings.label_smoothing)
    return -log_sigmoid(z)


def hinge_loss(p: PairInputs) -> Array:
    """SLiC: `max(0, 1 - βΔ)`."""
    return jax.nn.relu(1.0 - p.settings.beta * _delta(p))


def ipo_loss(p: PairInputs) -> Array:
    """IPO on length-averaged scores: `(cs/nc - rs/nr - 1/(2β))²`."""
    d = p.chosen_scores / p.chosen_lengths - p.rejected_scores / p.rejected_lengths
    return jnp.square(d - 1.0 / (2.0 * p.settings.beta))


def ipo_sum_loss(p: PairInputs) -> Array:
    """NeMo IPO on summed (or NeMo-averaged) log-ratios: `(Δ - 1/(2β))²`."""
    return jnp.square(_delta(p) - 1.0 / (2.0 * p.settings.beta))


def exo_pair_loss(p: PairInputs) -> Array:
    """EXO: reverse KL between σ(βΔ) and the smoothed label distribution (ε > 0)."""
    z = p.settings.beta * _delta(p)
    eps = p.settings.label_smoothing
    return sigmoid(z) * (log_sigmoid(z) - math.log1p(-eps)) + sigmoid(-z) * (
        log_sigmoid(-z) - math.log(eps)
    )


def nca_pair_loss(p: PairInputs) -> Array:
    """NCA: `-logσ(β cl) - ½logσ(-β cl) - ½logσ(-β rl)`."""
    c, r = p.settings.beta * p.chosen_logratios, p.settings.beta * p.rejected_logratios
    return -log_sigmoid(c) - 0.5 * log_sigmoid(-c) - 0.5 * log_sigmoid(-r)


def robust_loss(p: PairInputs) -> Array:
    """Robust DPO: `(-(1-ε)logσ(βΔ) + ε logσ(-βΔ)) / (1 - 2ε)`."""
    z = p.settings.beta * _delta(p)
    eps = p.settings.label_smoothing
    return (-(1.0 - eps) * log_sigmoid(z) + eps * log_sigmoid(-z)) / (1.0 - 2.0 * eps)


def bco_pair_loss(p: PairInputs) -> Array:
    """BCO (pairwise): `-logσ(β cl) - logσ(-β rl)`."""
    return -log_sigmoid(p.settings.beta * p.chosen_logratios) - log_sigmoid(
        -p.settings.beta * p.rejected_logratios
    )


def sppo_hard_loss(p: PairInputs) -> Array:
    """SPPO (hard labels): `(cl - 1/(2β))² + (rl + 1/(2β))²`."""
    half = 1.0 / (2.0 * p.settings.beta)
    return jnp.square(p.chosen_logratios - half) + jnp.square(p.rejected_logratios + half)


def aot_loss(p: PairInputs) -> Array:
    """AOT (paired): `d = sort(πc-πr) - sort(ρc-ρr)` over the batch; smoothed sigmoid of βd.

    The result is indexed by sorted rank, not by pair.
    """
    d = _sort_for_batch(p.policy_margin, p.sort_valid) - _sort_for_batch(
        p.reference_margin, p.sort_valid
    )
    return _smoothed_sigmoid(p.settings.beta * d, p.settings.label_smoothing)


def aot_unpaired_loss(p: PairInputs) -> Array:
    """AOT (unpaired): `d = sort(cl) - sort(rl)` over the batch; indexed by sorted rank."""
    d = _sort_for_batch(p.chosen_logratios, p.sort_valid) - _sort_for_batch(
        p.rejected_logratios, p.sort_valid
    )
    return _smoothed_sigmoid(p.settings.beta * d, p.settings.label_smoothing)


def apo_zero_loss(p: PairInputs) -> Array:
    """APO-zero: `(1 - σ(β cl)) + σ(β rl)`."""
    return sigmoid(-p.settings.beta * p.chosen_logratios) + sigmoid(
        p.settings.beta * p.rejected_logratios
    )


def apo_down_loss(p: PairInputs) -> Array:
    """APO-down: `σ(β cl) + (1 - σ(β(cl - rl)))`."""
    c = p.settings.beta * p.chosen_logratios
    return sigmoid(c) + sigmoid(-(c - p.settings.beta * p.rejected_logratios))


def discopop_loss(p: PairInputs) -> Array:
    """DiscoPOP: `-logσ(z)(1-m) + exp(-z)·m`, `z = βΔ`, `m = σ(z/τ)`.

    `exp(-z)·m` is evaluated as `exp(-z + logσ(z/τ))`, which is tiny (not inf·0) for z << 0.
    """
    z = p.settings.beta * _delta(p)
    zt = z / p.settings.discopop_tau
    return -log_sigmoid(z) * sigmoid(-zt) + capped_exp(-z + log_sigmoid(zt))


def sft_loss(p: PairInputs) -> Array:
    """TRL `sft`: negative token mean of chosen log-probs (precomputed in `PairInputs.sft`)."""
    return p.sft


# log1mexp's largest argument: log-probs are <= 0, but a rounded sum or mean can come out 0 or
# slightly above it, where log(1 - e^x) is -inf or NaN; -2^-24 gives log(2^-24) = -16.6.
LOG1MEXP_MAX = -(2.0**-24)


def log1mexp(x: Array) -> Array:
    """`log(1 - exp(x))` for x < 0, without cancellation: `log(-expm1(x))` near 0 and
    `log1p(-exp(x))` below -ln 2; x is first capped at LOG1MEXP_MAX."""
    x = jnp.minimum(x, LOG1MEXP_MAX)
    near = x > -math.log(2.0)
    return jnp.where(
        near,
        jnp.log(-jnp.expm1(jnp.where(near, x, -1.0))),
        jnp.log1p(-jnp.exp(jnp.where(near, -1.0, x))),
    )


def orpo_loss(p: PairInputs) -> Array:
    """ORPO (TRL's ORPOTrainer, reference-free): `NLL - λ·logσ(log odds)`, with the log odds of
    the length-averaged log-probs `a = π/n`: `(a_c - a_r) - (log(1 - e^{a_c}) - log(1 - e^{a_r}))`.
    The NLL is TRL `sft`'s token mean over the batch's chosen tokens (`PairInputs.sft`)."""
    a_c = p.chosen_logratios / p.chosen_lengths
    a_r = p.rejected_logratios / p.rejected_lengths
    log_odds = (a_c - a_r) - (log1mexp(a_c) - log1mexp(a_r))
    return p.sft - p.settings.orpo_lambda * log_sigmoid(log_odds)


def cpo_loss(p: PairInputs) -> Array:
    """CPO (TRL's CPOTrainer, reference-free): a preference term on the policy log-probs (summed,
    or length-averaged for cpo_type ipo and simpo), `d = c - r`, plus `cpo_alpha · NLL`:
    sigmoid `-(1-ε)logσ(βd) - ε logσ(-βd)`; hinge `relu(1 - βd)`; ipo `(d - 1/(2β))²`; simpo the
    sigmoid form of `d - γ/β` (SimPO's target margin γ)."""
    c, r = p.chosen_logratios, p.rejected_logratios
    if p.settings.cpo_type in ("ipo", "simpo"):
        c, r = c / p.chosen_lengths, r / p.rejected_lengths
    d = c - r
    if p.settings.cpo_type == "hinge":
        preference = jax.nn.relu(1.0 - p.settings.beta * d)
    elif p.settings.cpo_type == "ipo":
        preference = jnp.square(d - 1.0 / (2.0 * p.settings.beta))
    else:
        if p.settings.cpo_type == "simpo":
            d = d - p.settings.simpo_gamma / p.settings.beta
        preference = _smoothed_sigmoid(p.settings.beta * d, p.settings.label_smoothing)
    return preference + p.settings.cpo_alpha * p.sft if p.settings.cpo_alpha else preference


def sigmoid_norm_loss(p: PairInputs) -> Array:
    """Length-normalised DPO: `-logσ(β(cs/nc - rs/nr))`."""
    d = p.chosen_scores / p.chosen_lengths - p.rejected_scores / p.rejected_lengths
    return -log_sigmoid(p.settings.beta * d)


def rpo_sq_loss(p: PairInputs) -> Array:
    """NeMo RPO squared distance: `(βΔ - g)²`."""
    return jnp.square(p.settings.beta * _delta(p) - p.gt_margin)


def rpo_bwd_kl_loss(p: PairInputs) -> Array:
    """NeMo RPO backward KL: KL(Bern(σ(g)) || Bern(σ(βΔ)))."""
    z, g = p.settings.beta * _delta(p), p.gt_margin
    return sigmoid(g) * (log_sigmoid(g) - log_sigmoid(z)) + sigmoid(-g) * (
        log_sigmoid(-g) - log_sigmoid(-z)
    )


def rpo_fwd_kl_loss(p: PairInputs) -> Array:
    """NeMo RPO forward KL: KL(Bern(σ(βΔ)) || Bern(σ(g)))."""
    z, g = p.settings.beta * _delta(p), p.gt_margin
    return sigmoid(z) * (log_sigmoid(z) - log_sigmoid(g)) + sigmoid(-z) * (
        log_sigmoid(-z) - log_sigmoid(-g)
    )


# cpo's preference terms (`loss.cpo_type`).
CPO_TYPES = ("sigmoid", "hinge", "ipo", "simpo")
# Objectives on the policy's log-probs alone: a loss of only these takes the reference log-probs
# as 0 (loss.reference_free), so no reference is loaded or run.
REFERENCE_FREE_LOSSES = frozenset({"orpo", "cpo"})
# Losses whose value includes TRL `sft`'s NLL term (`PairInputs.sft`).
NLL_LOSSES = frozenset({"sft", "orpo", "cpo"})

LOSS_FUNCTIONS: dict[str, Callable[[PairInputs], Array]] = {
    "orpo": orpo_loss,
    "cpo": cpo_loss,
    "sigmoid": sigmoid_loss,
    "dpo": sigmoid_loss,
    "hinge": hinge_loss,
    "ipo": ipo_loss,
    "ipo_sum": ipo_sum_loss,
    "exo_pair": exo_pair_loss,
    "nca_pair": nca_pair_loss,
    "robust": robust_loss,
    "bco_pair": bco_pair_loss,
    "sppo_hard": sppo_hard_loss,
    "aot": aot_loss,
    "aot_unpaired": aot_unpaired_loss,
    "apo_zero": apo_zero_loss,
    "apo_down": apo_down_loss,
    "discopop": discopop_loss,
    "sft": sft_loss,
    "sigmoid_norm": sigmoid_norm_loss,
    "rpo_sq": rpo_sq_loss,
    "rpo_bwd_kl": rpo_bwd_kl_loss,
    "rpo_fwd_kl": rpo_fwd_kl_loss,
}

# Losses whose per-pair output is indexed by sorted rank over the batch.
RANKED_LOSSES = frozenset({"aot", "aot_unpaired"})
# Losses that divide by completion lengths themselves.
LENGTH_NORMALISED_LOSSES = frozenset({"ipo", "sigmoid_norm", "orpo", "cpo"})


# ----------------------------------------------------------------------------- pair weights


def wpo_pair_weights(chosen_weights: Array, rejected_weights: Array) -> Array:
    """WPO per-pair weight [N]: `min(w_c · w_r, 1)` (TRL clamps at 1); pass as `weights=`."""
    return jax.lax.stop_gradient(jnp.minimum(chosen_weights * rejected_weights, 1.0))
