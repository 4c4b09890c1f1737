"""The reference-free objectives, orpo and cpo (SimPO as cpo_type simpo): against TRL 1.16's
ORPOTrainer and CPOTrainer, against their formulas, and the settings they refuse."""

import jax.numpy as jnp
import numpy as np
import pytest

from dpojax.train.loss_settings import LossSettings
from tests.unit.train.test_losses import BETA, NC, NR, SUMS, _close, _preference_loss


def _trl_self(**attributes):
    """A stand-in `self` for TRL's loss methods (what they read of their trainer)."""
    from types import SimpleNamespace

    return SimpleNamespace(accelerator=SimpleNamespace(device="cpu"), **attributes)


@pytest.mark.slow
@pytest.mark.parametrize(
    ("cpo_type", "cpo_alpha", "smoothing"),
    [
        ("sigmoid", 1.0, 0.0),
        ("sigmoid", 0.5, 0.1),
        ("hinge", 1.0, 0.0),
        ("ipo", 1.0, 0.0),
        ("simpo", 0.0, 0.0),
        ("simpo", 1.0, 0.2),
    ],
)
def test_cpo_equals_trl_s_cpo_trainer(cpo_type, cpo_alpha, smoothing):
    """cpo: TRL 1.16's CPOTrainer.cpo_loss (log-probs averaged for ipo and simpo) plus cpo_alpha
    times its NLL, the token mean over the batch's chosen tokens; no reference."""
    torch = pytest.importorskip("torch")
    from trl.experimental.cpo.cpo_trainer import CPOTrainer

    pc, pr = np.asarray(SUMS["policy_chosen"]), np.asarray(SUMS["policy_rejected"])
    nc, nr = np.asarray(NC, float), np.asarray(NR, float)
    average = cpo_type in ("ipo", "simpo")
    trl_self = _trl_self(
        alpha=0.0, loss_type=cpo_type, beta=BETA, simpo_gamma=0.3, label_smoothing=smoothing
    )
    losses, chosen_rewards, rejected_rewards = CPOTrainer.cpo_loss(
        trl_self,
        torch.tensor(pc / nc if average else pc),
        torch.tensor(pr / nr if average else pr),
    )
    nll = -pc.sum() / nc.sum()
    expected = float(losses.mean()) + cpo_alpha * nll
    total, metrics = _preference_loss(
        jnp.asarray(pc),
        jnp.asarray(pr),
        None,
        None,
        type="cpo",
        beta=BETA,
        cpo_type=cpo_type,
        simpo_gamma=0.3,
        cpo_alpha=cpo_alpha,
        label_smoothing=smoothing,
        chosen_lengths=jnp.asarray(NC),
        rejected_lengths=jnp.asarray(NR),
    )
    assert float(total.mean()) == pytest.approx(expected, rel=1e-6, abs=1e-7)
    # the metrics as CPOTrainer logs them: its rewards beta * log-probs (averaged for ipo, simpo)
    logps = (pc / nc, pr / nr) if average else (pc, pr)
    _assert_trl_metrics(metrics, chosen_rewards, rejected_rewards, logps, nll)


def _assert_trl_metrics(metrics, chosen_rewards, rejected_rewards, logps, nll, **extra):
    """The metrics of a reference-free objective as TRL's ORPO / CPO trainers log them."""
    cr, rr = chosen_rewards.numpy(), rejected_rewards.numpy()
    expected = {
        "rewards/chosen": cr.mean(),
        "rewards/rejected": rr.mean(),
        "rewards/accuracies": (cr > rr).mean(),
        "rewards/margins": (cr - rr).mean(),
        "logps/chosen": logps[0].mean(),
        "logps/rejected": logps[1].mean(),
        "nll_loss": nll,
        **extra,
    }
    for name, value in expected.items():
        assert float(metrics[name]) == pytest.approx(float(value), rel=1e-5, abs=1e-7), name


@pytest.mark.slow
@pytest.mark.parametrize("scale", [1.0, 0.01, 30.0])
def test_orpo_equals_trl_s_orpo_trainer(scale):
    """orpo: TRL 1.16's ORPOTrainer, `NLL - mean(λ logσ(log odds))` on length-averaged log-probs
    (λ = its `beta`), near 0 (log-probs scaled by 0.01: log1mexp's cancellation branch) and far."""
    torch = pytest.importorskip("torch")
    from trl.experimental.orpo.orpo_trainer import ORPOTrainer

    pc = np.asarray(SUMS["policy_chosen"]) * scale
    pr = np.asarray(SUMS["policy_rejected"]) * scale
    nc, nr = np.asarray(NC, float), np.asarray(NR, float)
    losses, chosen_rewards, rejected_rewards, ratio, log_odds = ORPOTrainer.odds_ratio_loss(
        _trl_self(beta=0.25), torch.tensor(pc / nc), torch.tensor(pr / nr)
    )
    expected = -pc.sum() / nc.sum() - float(losses.mean())
    total, metrics = _preference_loss(
        jnp.asarray(pc),
        jnp.asarray(pr),
        None,
        None,
        type="orpo",
        orpo_lambda=0.25,
        chosen_lengths=jnp.asarray(NC),
        rejected_lengths=jnp.asarray(NR),
    )
    assert float(total.mean()) == pytest.approx(expected, rel=1e-6, abs=1e-7)
    _assert_trl_metrics(
        metrics,
        chosen_rewards,
        rejected_rewards,
        (pc / nc, pr / nr),
        -pc.sum() / nc.sum(),
        log_odds_ratio=ratio,
        log_odds_chosen=log_odds,
    )


def test_reference_free_objectives_refuse_what_they_cannot_mean():
    """orpo and cpo imply reference_free, combine only with each other or sft, and score the
    policy log-probs themselves (no f-divergence)."""

    def free(types: str) -> bool:
        return LossSettings(type=types).without_reference

    assert free("orpo") and free("cpo,sft") is False
    assert free("cpo,orpo") and not free("sigmoid")
    assert LossSettings(type="sigmoid", reference_free=True).without_reference
    args = (jnp.asarray([-1.0]), jnp.asarray([-2.0]), None, None)
    lengths = dict(chosen_lengths=jnp.asarray([2]), rejected_lengths=jnp.asarray([3]))
    with pytest.raises(ValueError, match=r"\['cpo'\] are reference-free objectives"):
        _preference_loss(*args, type="cpo,sigmoid", reference_free=True, **lengths)
    with pytest.raises(ValueError, match="use f_divergence 'reverse_kl'"):
        _preference_loss(*args, type="orpo", f_divergence="js_divergence", **lengths)
    with pytest.raises(ValueError, match="unknown cpo_type 'dpo'"):
        _preference_loss(*args, type="cpo", cpo_type="dpo", **lengths)
    total, _ = _preference_loss(*args, type="orpo", **lengths)  # no reference needed
    assert np.isfinite(float(total[0]))


def _logsig(x):
    return -np.logaddexp(0.0, -x)


@pytest.mark.parametrize("cpo_type", ["sigmoid", "hinge", "ipo", "simpo"])
def test_cpo_formula(dtype, cpo_type):
    """cpo by hand in float64 (no reference; log-probs averaged for ipo and simpo), plus
    cpo_alpha times the NLL (the token mean over the batch's chosen completion tokens)."""
    pc, pr = np.asarray(SUMS["policy_chosen"]), np.asarray(SUMS["policy_rejected"])
    nc, nr = np.asarray(NC, float), np.asarray(NR, float)
    gamma, alpha, eps = 0.3, 0.5, 0.1 if cpo_type == "sigmoid" else 0.0
    if cpo_type in ("ipo", "simpo"):
        pc, pr = pc / nc, pr / nr
    delta = pc - pr
    expected = {
        "sigmoid": -_logsig(BETA * delta) * (1 - eps) - _logsig(-BETA * delta) * eps,
        "hinge": np.maximum(0.0, 1 - BETA * delta),
        "ipo": (delta - 1 / (2 * BETA)) ** 2,
        "simpo": -_logsig(BETA * (delta - gamma / BETA)),
    }[cpo_type]
    nll = -np.sum(SUMS["policy_chosen"]) / np.sum(NC)
    per_pair, metrics = _preference_loss(
        *(jnp.asarray(SUMS[k], dtype) for k in ("policy_chosen", "policy_rejected")),
        None,
        None,
        type="cpo",
        beta=BETA,
        cpo_type=cpo_type,
        simpo_gamma=gamma,
        cpo_alpha=alpha,
        label_smoothing=eps,
        chosen_lengths=jnp.asarray(NC),
        rejected_lengths=jnp.asarray(NR),
    )
    _close(float(per_pair.mean()), expected.mean() + alpha * nll, dtype)
    _close(metrics["nll_loss"], nll, dtype)


@pytest.mark.parametrize("scale", [1.0, 0.01])
def test_orpo_formula(dtype, scale):
    """orpo by hand in float64: NLL - λ mean(log σ(log odds)), log odds = (a_c - a_r) -
    (log(1 - e^a_c) - log(1 - e^a_r)) on length-averaged log-probs a (scale 0.01: near 0, where
    log(1 - e^a) cancels unless computed with care)."""
    pc = np.asarray(SUMS["policy_chosen"]) * scale
    pr = np.asarray(SUMS["policy_rejected"]) * scale
    ac, ar = pc / np.asarray(NC, float), pr / np.asarray(NR, float)
    log_odds = (ac - ar) - (np.log(-np.expm1(ac)) - np.log(-np.expm1(ar)))
    lam = 0.25
    nll = -pc.sum() / np.sum(NC)
    per_pair, metrics = _preference_loss(
        jnp.asarray(pc, dtype),
        jnp.asarray(pr, dtype),
        None,
        None,
        type="orpo",
        orpo_lambda=lam,
        chosen_lengths=jnp.asarray(NC),
        rejected_lengths=jnp.asarray(NR),
    )
    _close(float(per_pair.mean()), nll - lam * _logsig(log_odds).mean(), dtype)
    _close(metrics["log_odds_ratio"], _logsig(log_odds).mean(), dtype)
    _close(metrics["log_odds_chosen"], log_odds.mean(), dtype)
