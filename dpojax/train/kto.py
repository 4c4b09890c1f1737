"""Unpaired losses: KTO (`kto`, `apo_zero_unpaired`) as TRL 1.16's `KTOTrainer` computes them, and
BCO with its running reward mean (TRL's experimental `BCOTrainer`, without its UDM part).

Pure functions of per-example sequence log-probs (sums over the completion tokens); each example
is desirable (`desirable=True`, TRL's `label=True`) or undesirable. `mask` marks the real
examples of a padded batch (padding rows count nowhere). The training step calls `kto_loss`
(`dpojax.train.forward.unpaired_losses`) or `bco_loss` (`dpojax.train.forward.bco_losses`, the
running moments held in `TrainState.moments`) and `finalize_unpaired`.

KTO (Ethayarajh et al., https://arxiv.org/abs/2402.01306, Eq. 7), with r = log π(y|x) - log
π_ref(y|x) and z = max(0, mean over the batch of log π(y'|x) - log π_ref(y'|x)) on the KL
completions y' (another example's completion, `kl_completion_indices`), held constant:

    desirable:   w_d (1 - σ(β (r - z)))        undesirable:   w_u (1 - σ(β (z - r)))

`apo_zero_unpaired` (D'Oosterlinck et al., https://arxiv.org/abs/2408.06266, unpaired Eq. 7) needs
no KL completions:

    desirable:   w_d (1 - σ(β r))              undesirable:   w_u σ(β r)

The batch loss is the mean of the weighted per-example losses over the real examples (TRL's
`losses.nanmean()`: the weights are not normalised).

BCO (Jung et al., https://arxiv.org/abs/2404.04656): rewards ρ = β r; the running mean δ of every
reward seen so far (updated with this batch's rewards first, then used):

    desirable:   -log σ(ρ - δ)                  undesirable:   -log σ(-(ρ - δ))

The running moments follow TRL's `RunningMoments` (start mean 0, var 1, count 1e-24; the batch's
population variance merged with Chan's update). BCO's "underlying distribution matching" (a
logistic classifier on prompt embeddings that reweights undesirable examples) is not implemented.
"""

from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp

from dpojax.data.unpaired_tokens import kl_partners
from dpojax.schema import out_of_range
from dpojax.train.loss_settings import LossSettings

KTO_LOSS_TYPES = ("kto", "apo_zero_unpaired")
UNPAIRED_LOSS_TYPES = (*KTO_LOSS_TYPES, "bco")
NEEDS_KL = ("kto",)
"""Loss types that need the KL completions' log-probs."""
RUNNING_MOMENTS = ("bco",)
KTO_SETTINGS = LossSettings(type="kto")
BCO_SETTINGS = LossSettings(type="bco")


def _check_ranges(settings: LossSettings) -> None:
    """The settings' numbers against their fields' ranges (as the config check does), for a
    caller that is not the config; traced numbers are not judged."""
    problems = out_of_range(settings)
    if problems:
        raise ValueError("; ".join(problems))


"""Loss types whose running reward moments are part of the train state."""

Array = jax.Array


kl_completion_indices = kl_partners
"""For every example, the index of the example whose completion is its KL completion: TRL rotates
the completions by +1 within each run of `batch_size` consecutive examples (the last run may be
shorter): (x_1, y_1), ..., (x_n, y_n) -> (x_1, y_n), (x_2, y_1), ..., (x_n, y_{n-1}); so example i
(0-based, within its run) takes the completion of example (i - 1) mod n, and a run of one example
takes its own completion (`dpojax.data.unpaired_tokens.kl_partners`)."""


def check_kto_batch_size(loss_type: str, batch_size: int) -> None:
    """TRL refuses KTO's KL term on batches of one example (the KL completion would be the
    completion itself, and the KL term the reward)."""
    if loss_type in NEEDS_KL and batch_size <= 1:
        raise ValueError(
            f"loss_type {loss_type!r} estimates its KL term from the other examples of a batch: "
            f"the batch size must be > 1, got {batch_size}"
        )


def balance_warning(
    num_desirable: int, num_undesirable: int, desirable_weight: float, undesirable_weight: float
) -> str | None:
    """TRL's warning on unbalanced data (KTO paper Eq. 8: w_d n_d / (w_u n_u) in [1, 4/3]), or
    None. As TRL: the counts are at least 1 (the undesirable one from the total less the clamped
    desirable one), the bounds are rounded to 2 decimals with 1.33 for 4/3, and it warns when
    neither weight lies in its range."""
    total = num_desirable + num_undesirable
    n_d = max(num_desirable, 1)
    n_u = max(total - n_d, 1)
    if n_d == n_u:
        return None
    des_lo = round(n_u * undesirable_weight / n_d, 2)
    des_hi = round(n_u * undesirable_weight / n_d * 1.33, 2)
    und_lo = round(n_d * desirable_weight / n_u / 1.33, 2)
    und_hi = round(n_d * desirable_weight / n_u, 2)
    if des_lo <= desirable_weight <= des_hi or und_lo <= undesirable_weight <= und_hi:
        return None
    return (
        f"{n_d} desirable and {n_u} undesirable examples, but loss.desirable_weight="
        f"{desirable_weight} and loss.undesirable_weight={undesirable_weight} are not in the "
        f"ideal range: set EITHER desirable_weight in [{des_lo}, {des_hi}] OR undesirable_weight "
        f"in [{und_lo}, {und_hi}] (not both; KTO paper, Eq. 8)"
    )


def _masks(desirable: Array, mask: Array | None, like: Array) -> tuple[Array, Array, Array]:
    """(real, desirable, undesirable) as 0/1 arrays of `like`'s dtype."""
    real = jnp.ones(like.shape, bool) if mask is None else jnp.asarray(mask, bool)
    good = jnp.asarray(desirable, bool) & real
    bad = ~jnp.asarray(desirable, bool) & real
    return tuple(m.astype(like.dtype) for m in (real, good, bad))


def _safe(values: Array, real: Array) -> Array:
    """Padding rows set to 0 (so a NaN or inf there reaches no sum and no gradient)."""
    return jnp.where(real > 0, values, jnp.zeros_like(values))


def kl_estimate(policy_kl_logps: Array, ref_kl_logps: Array, mask: Array | None = None) -> Array:
    """KTO's z: the mean over the real examples of the KL completions' log-ratios, at least 0,
    with no gradient (TRL: `(KL_logps - ref_KL_logps).mean().detach()`, averaged over processes,
    `clamp(min=0)`; here the mean is over the whole global batch)."""
    real = jnp.ones(policy_kl_logps.shape) if mask is None else jnp.asarray(mask)
    real = real.astype(policy_kl_logps.dtype)
    diff = _safe(policy_kl_logps - ref_kl_logps, real)
    mean = jnp.sum(diff) / jnp.maximum(jnp.sum(real), 1)
    return jax.lax.stop_gradient(jnp.maximum(mean, 0))


def _metric_sums(
    policy_logps: Array, logratios: Array, real: Array, good: Array, bad: Array, beta: float
) -> dict[str, Array]:
    rewards = jax.lax.stop_gradient(beta * logratios)
    logps = jax.lax.stop_gradient(policy_logps)
    return {
        "rewards/chosen_sum": jnp.sum(rewards * good),
        "rewards/rejected_sum": jnp.sum(rewards * bad),
        "logps/chosen_sum": jnp.sum(logps * good),
        "logps/rejected_sum": jnp.sum(logps * bad),
        "count/chosen": jnp.sum(good),
        "count/rejected": jnp.sum(bad),
        "count/examples": jnp.sum(real),
    }


def kto_loss(
    policy_logps: Array,
    ref_logps: Array,
    desirable: Array,
    policy_kl_logps: Array | None = None,
    ref_kl_logps: Array | None = None,
    mask: Array | None = None,
    settings: LossSettings = KTO_SETTINGS,
) -> tuple[Array, dict[str, Array]]:
    """Per-example losses (0 on padding rows) and metric sums (module docstring). `settings`:
    the loss settings (`LossSettings`: `type` kto or apo_zero_unpaired, `beta`,
    `desirable_weight`, `undesirable_weight`; the numbers may be traced).

    Metric sums: `rewards/chosen_sum`, `rewards/rejected_sum`, `logps/chosen_sum`,
    `logps/rejected_sum` (policy log-probs), `count/chosen`, `count/rejected`, `count/examples`,
    `loss_sum` (of the per-example losses) and `kl` (z; 0 for `apo_zero_unpaired`).
    `unpaired_metrics` turns them into TRL's logged means. The batch loss is
    `loss_sum / count/examples`."""
    loss_type, beta = settings.type, settings.beta
    if loss_type not in KTO_LOSS_TYPES:
        raise ValueError(f"unknown KTO loss type {loss_type!r}; known: {', '.join(KTO_LOSS_TYPES)}")
    _check_ranges(settings)
    real, good, bad = _masks(desirable, mask, policy_logps)
    logratios = _safe(policy_logps - ref_logps, real)
    if loss_type in NEEDS_KL:
        if policy_kl_logps is None or ref_kl_logps is None:
            raise ValueError(f"loss_type {loss_type!r} needs the KL completions' log-probs")
        kl = kl_estimate(policy_kl_logps, ref_kl_logps, real)
        chosen = 1 - jax.nn.sigmoid(beta * (logratios - kl))
        rejected = 1 - jax.nn.sigmoid(beta * (kl - logratios))
    else:
        kl = jnp.zeros((), policy_logps.dtype)
        chosen = 1 - jax.nn.sigmoid(beta * logratios)
        rejected = jax.nn.sigmoid(beta * logratios)
    losses = (
        settings.desirable_weight * chosen * good + settings.undesirable_weight * rejected * bad
    )
    sums = _metric_sums(_safe(policy_logps, real), logratios, real, good, bad, beta)
    sums["loss_sum"] = jnp.sum(losses)
    sums["kl"] = kl
    return losses, sums


class RunningMoments(NamedTuple):
    """BCO's running reward moments (TRL's `RunningMoments` fields; `std` is the unbiased one)."""

    mean: Array
    var: Array
    std: Array
    count: Array

    @classmethod
    def initial(cls, dtype=jnp.float32) -> RunningMoments:
        return cls(*(jnp.asarray(v, dtype) for v in (0.0, 1.0, 1.0, 1e-24)))


def update_moments(state: RunningMoments, xs: Array, mask: Array | None = None) -> RunningMoments:
    """`state` merged with the real entries of `xs` (their population mean and variance), as
    TRL's `RunningMoments.update` does (across processes: over the whole global batch). A batch
    with no real entry leaves the state as it is."""
    real = jnp.ones(xs.shape, xs.dtype) if mask is None else jnp.asarray(mask).astype(xs.dtype)
    xs = jax.lax.stop_gradient(_safe(xs, real))
    n = jnp.sum(real)
    n_safe = jnp.maximum(n, 1)
    xs_mean = jnp.sum(xs) / n_safe
    xs_var = jnp.sum(real * (xs - xs_mean) ** 2) / n_safe
    delta = xs_mean - state.mean
    total = state.count + n
    old_sum = state.var * state.count + delta**2 * state.count * n / total
    new_var = (old_sum + xs_var * n) / total
    updated = RunningMoments(
        mean=state.mean + delta * n / total,
        var=new_var,
        std=jnp.sqrt(new_var * total / (total - 1)),
        count=total,
    )
    keep = n > 0
    return RunningMoments(
        *(jnp.where(keep, new, old) for new, old in zip(updated, state, strict=True))
    )


def bco_loss(
    policy_logps: Array,
    ref_logps: Array,
    desirable: Array,
    running: RunningMoments,
    mask: Array | None = None,
    settings: LossSettings = BCO_SETTINGS,
    *,
    update: bool = True,
) -> tuple[Array, dict[str, Array], RunningMoments]:
    """Per-example BCO losses (0 on padding rows), metric sums (those of `kto_loss`, with
    `delta` for `kl`) and the running moments after this batch; `settings.beta` is β (it may be
    traced). `update=False` (evaluation) uses δ as it is and returns `running` unchanged."""
    _check_ranges(settings)
    beta = settings.beta
    real, good, bad = _masks(desirable, mask, policy_logps)
    logratios = _safe(policy_logps - ref_logps, real)
    rewards = beta * logratios
    if update:
        running = update_moments(running, rewards, real)
    delta = jax.lax.stop_gradient(running.mean).astype(rewards.dtype)
    chosen = -jax.nn.log_sigmoid(rewards - delta)
    rejected = -jax.nn.log_sigmoid(-(rewards - delta))
    losses = chosen * good + rejected * bad
    sums = _metric_sums(_safe(policy_logps, real), logratios, real, good, bad, beta)
    sums["loss_sum"] = jnp.sum(losses)
    sums["delta"] = delta
    return losses, sums, running


def unpaired_metrics(sums: dict[str, Array | float]) -> dict[str, float]:
    """TRL's logged values from one batch's metric sums: `loss`, `kl` (or `delta`),
    `rewards/chosen`, `logps/chosen` (when the batch has a desirable example),
    `rewards/rejected`, `logps/rejected` (an undesirable one) and `rewards/margins` (both)."""
    get = {k: float(v) for k, v in sums.items()}
    out = {"loss": get["loss_sum"] / max(get["count/examples"], 1)}
    for key in ("kl", "delta"):
        if key in get:
            out[key] = get[key]
    for side in ("chosen", "rejected"):
        count = get[f"count/{side}"]
        if count > 0:
            out[f"rewards/{side}"] = get[f"rewards/{side}_sum"] / count
            out[f"logps/{side}"] = get[f"logps/{side}_sum"] / count
    if "rewards/chosen" in out and "rewards/rejected" in out:
        out["rewards/margins"] = out["rewards/chosen"] - out["rewards/rejected"]
    return out


def finalize_unpaired(sums: dict[str, Array]) -> dict[str, Array]:
    """A step's logged metrics (jnp, inside the step) from its metric sums over the micro-batches
    (`dpojax.train.forward.unpaired_losses`, `bco_losses`): TRL's names (`loss`, `kl`,
    `rewards/chosen`, `logps/chosen`, `rewards/rejected`, `logps/rejected`, `rewards/margins`)
    and the counts `count/chosen`, `count/rejected`. TRL leaves out a side the batch has no example of; here it
    is 0 (its count says so). `kl` is the mean over the step's micro-batches of each one's KL
    estimate, weighted by their examples; for bco (sums with `delta_sum`) `delta` instead, the
    same mean of each micro-batch's δ."""
    n = jnp.maximum(sums["count/examples"], 1.0)
    key = "delta" if "delta_sum" in sums else "kl"
    out = {"loss": sums["loss_sum"] / n, key: sums[f"{key}_sum"] / n}
    for side in ("chosen", "rejected"):
        count = sums[f"count/{side}"]
        for name in ("rewards", "logps"):
            total = sums[f"{name}/{side}_sum"]
            out[f"{name}/{side}"] = jnp.where(count > 0, total / jnp.maximum(count, 1.0), 0.0)
        out[f"count/{side}"] = count
    out["rewards/margins"] = out["rewards/chosen"] - out["rewards/rejected"]
    return out
