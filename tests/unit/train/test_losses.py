"""Preference losses against the reference numbers of docs/losses.md#reference-numbers, and the
step's LD-DPO and WPO per-token paths against their definitions."""

import dataclasses
import functools
import math

import chex
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from dpojax.train import losses as L
from dpojax.train.forward import ld_token_weights, wpo_log_weights
from dpojax.train.logprobs import completion_sums, token_logps
from dpojax.train.loss_settings import LossSettings

LN2 = math.log(2.0)
BETA = 0.1
EPS = 0.1

# Per-token completion log-probs of the reference fixture (3 pairs).
TOKENS = {
    "policy_chosen": [[-0.5, -1.2, -0.3], [-2.0, -0.7], [-0.1, -0.4, -0.9, -1.5]],
    "policy_rejected": [[-1.1, -0.8], [-0.6, -1.9, -0.2, -0.4], [-0.3, -1.0, -0.7, -2.2]],
    "ref_chosen": [[-0.7, -1.0, -0.6], [-1.5, -0.9], [-0.2, -0.5, -0.8, -1.2]],
    "ref_rejected": [[-0.9, -0.6], [-0.8, -1.6, -0.3, -0.5], [-0.4, -0.9, -0.6, -1.9]],
}
SUMS = {k: [sum(row) for row in rows] for k, rows in TOKENS.items()}
NC = [3, 2, 4]
NR = [2, 4, 4]

TABLE = {  # loss -> (reverse_kl, forward_kl, js_divergence, alpha_divergence α=0.5)
    "sigmoid": (0.6851013008, 0.6838883267, 0.6888316790, 0.6845830091),
    "hinge": (0.9833333333, 0.9807864324, 0.9912140731, 0.9822452131),
    "ipo": (24.4577083333, 24.3808568372, 24.7041928053, 24.4250707117),
    "exo_pair": (0.5019622590, 0.5006247138, 0.5060775013, 0.5013907031),
    "robust": (0.6830179675, 0.6814866307, 0.6877334381, 0.6823636607),
    "discopop": (0.8513807015, 0.8517254568, 0.8515605873, 0.8515576138),
    "sigmoid_norm": (0.6902818144, 0.6898583528, 0.6916258533, 0.6901015108),
}
F_DIVS = ("reverse_kl", "forward_kl", "js_divergence", "alpha_divergence")
REVERSE_KL_ONLY = {
    "sft": 0.8444444444,
    "nca_pair": 1.3823339354,
    "bco_pair": 1.3781901825,
    "sppo_hard": 48.5166666667,
    "aot": 0.6867679675,
    "aot_unpaired": 0.6865180133,
    "apo_zero": 0.9958341596,
    "apo_down": 0.9941687142,
}
NEMO = {  # loss -> (sum mode, average mode)
    "dpo": (0.6851013008, 0.6902818144),
    "ipo_sum": (23.5633333333, 24.4577083333),
    "rpo_sq": (0.9689666667, 0.9887437500),
    "rpo_bwd_kl": (0.1073805490, 0.1096475305),
    "rpo_fwd_kl": (0.1162371931, 0.1187076221),
}
ALL_LOSSES = L.LOSS_TYPES


def _tol(dtype) -> float:
    return 1e-6 if dtype == jnp.float64 else 1e-5


def _close(actual, expected, dtype) -> None:
    tol = _tol(dtype)
    np.testing.assert_allclose(np.asarray(actual, np.float64), expected, rtol=tol, atol=tol)


def _args(dtype):
    return tuple(jnp.asarray(SUMS[k], dtype) for k in TOKENS)


SETTINGS = {f.name for f in dataclasses.fields(LossSettings)}


def _preference_loss(*arrays, **kwargs):
    """`preference_loss` with its `LossSettings` given field by field among the other keywords."""
    settings = LossSettings(**{k: v for k, v in kwargs.items() if k in SETTINGS})
    rest = {k: v for k, v in kwargs.items() if k not in SETTINGS}
    return L.preference_loss(*arrays, settings=settings, **rest)


def _loss(dtype, **kwargs):
    kwargs.setdefault("beta", BETA)
    kwargs.setdefault("chosen_lengths", jnp.asarray(NC))
    kwargs.setdefault("rejected_lengths", jnp.asarray(NR))
    per_pair, metrics = _preference_loss(*_args(dtype), **kwargs)
    assert per_pair.dtype == dtype
    return per_pair, metrics


def _smoothing(loss_type) -> float:
    return EPS if loss_type in ("exo_pair", "robust", "aot", "aot_unpaired") else 0.0


def _padded(rows, prompt: int = 1, width: int = 6, pad: float = 7.0):
    """[N, width] per-token array with `prompt` masked-out leading positions, and its mask."""
    values = np.full((len(rows), width), pad)
    mask = np.zeros((len(rows), width), bool)
    for i, row in enumerate(rows):
        values[i, prompt : prompt + len(row)] = row
        mask[i, prompt : prompt + len(row)] = True
    return jnp.asarray(values), jnp.asarray(mask)


# ----------------------------------------------------------------------------- reference numbers


@pytest.mark.parametrize("f_divergence", F_DIVS)
@pytest.mark.parametrize("loss_type", sorted(TABLE))
def test_table_losses(dtype, loss_type, f_divergence):
    per_pair, metrics = _loss(
        dtype,
        type=loss_type,
        f_divergence=f_divergence,
        f_alpha=0.5,
        label_smoothing=_smoothing(loss_type),
    )
    expected = TABLE[loss_type][F_DIVS.index(f_divergence)]
    _close(jnp.mean(per_pair), expected, dtype)
    _close(metrics["loss"], expected, dtype)


@pytest.mark.parametrize("loss_type", sorted(REVERSE_KL_ONLY))
def test_reverse_kl_only_losses(dtype, loss_type):
    per_pair, _ = _loss(dtype, type=loss_type, label_smoothing=_smoothing(loss_type))
    _close(jnp.mean(per_pair), REVERSE_KL_ONLY[loss_type], dtype)


def test_per_pair_sigmoid(dtype):
    per_pair, _ = _loss(dtype)
    _close(per_pair, [0.65875956, 0.71334717, 0.68319718], dtype)


def test_sigmoid_ignores_label_smoothing_like_trl(dtype):
    per_pair, _ = _loss(dtype, label_smoothing=EPS)
    _close(jnp.mean(per_pair), TABLE["sigmoid"][0], dtype)


def test_cdpo_smoothing(dtype):
    per_pair, _ = _loss(dtype, label_smoothing=EPS, cdpo_smoothing=True)
    z = BETA * (np.subtract(SUMS["policy_chosen"], SUMS["ref_chosen"]))
    z -= BETA * (np.subtract(SUMS["policy_rejected"], SUMS["ref_rejected"]))
    expected = (1 - EPS) * np.logaddexp(0, -z) + EPS * np.logaddexp(0, z)
    _close(per_pair, expected, dtype)


def test_combination(dtype):
    per_pair, _ = _loss(
        dtype,
        type="sigmoid,bco_pair,sft",
        weights=(
            0.8,
            0.2,
            1.0,
        ),
    )
    _close(jnp.mean(per_pair), 1.6681635216, dtype)


def _completion_layout():
    """The fixture's four sides as one batch in the step's per-token form: row r holds pair r's
    chosen completion (completion 2r) then its rejected one (2r + 1) after a prompt token."""
    width = 10
    ids = np.full((3, width), -1)
    pos = np.full((3, width), -1)
    for r in range(3):
        at = 1
        for c, n in ((2 * r, NC[r]), (2 * r + 1, NR[r])):
            ids[r, at : at + n], pos[r, at : at + n] = c, np.arange(n)
            at += n
    return jnp.asarray(ids), jnp.asarray(pos)


def _token_values(model: str, ids) -> np.ndarray:
    """The fixture's per-token log-probs of `model` (policy or ref) laid out like `ids`."""
    values = np.full(ids.shape, 7.0)  # never read: outside every completion
    for r in range(3):
        for side, c in (("chosen", 2 * r), ("rejected", 2 * r + 1)):
            values[r][np.asarray(ids[r]) == c] = TOKENS[f"{model}_{side}"][r]
    return values


def test_completion_sums_and_counts(dtype):
    ids, _ = _completion_layout()
    for model in ("policy", "ref"):
        sums, counts = completion_sums(jnp.asarray(_token_values(model, ids), dtype), ids, 6)
        _close(sums[0::2], SUMS[f"{model}_chosen"], dtype)
        _close(sums[1::2], SUMS[f"{model}_rejected"], dtype)
        np.testing.assert_array_equal(counts[0::2], NC)
        np.testing.assert_array_equal(counts[1::2], NR)


def test_ld_alpha(dtype):
    """The step's LD-DPO token weights give the reference number (alpha 0.5) and, with alpha 1,
    the plain sums."""
    ids, pos = _completion_layout()
    chosen, rejected = jnp.arange(0, 6, 2), jnp.arange(1, 6, 2)
    counts = completion_sums(jnp.zeros(ids.shape), ids, 6)[1]
    sides = {}
    for alpha in (0.5, 1.0):
        weights = ld_token_weights(ids, pos, chosen, rejected, counts, alpha)
        for model in ("policy", "ref"):
            values = jnp.asarray(_token_values(model, ids), dtype) * weights
            sums = completion_sums(values, ids, 6)[0]
            sides[model, alpha] = (sums[chosen], sums[rejected])
    per_pair, _ = _preference_loss(*sides["policy", 0.5], *sides["ref", 0.5], beta=BETA)
    _close(jnp.mean(per_pair), 0.6858273713, dtype)
    _close(sides["policy", 1.0][0], SUMS["policy_chosen"], dtype)


def test_trl_metrics(dtype):
    _, metrics = _loss(dtype)
    expected = {
        "rewards/chosen": -0.0066666667,
        "rewards/rejected": -0.0233333333,
        "rewards/accuracies": 2 / 3,
        "rewards/margins": 0.0166666667,
        "logps/chosen": -2.5333333333,
        "logps/rejected": -3.0666666667,
        "loss": TABLE["sigmoid"][0],
        "preference_loss": TABLE["sigmoid"][0],
    }
    for key, value in expected.items():
        _close(metrics[key], value, dtype)


@pytest.mark.parametrize("average", [False, True])
@pytest.mark.parametrize("loss_type", sorted(NEMO))
def test_nemo_losses(dtype, loss_type, average):
    per_pair, _ = _loss(
        dtype,
        type=loss_type,
        preference_average_log_probs=average,
        gt_chosen_rewards=jnp.ones(3),
        gt_rejected_rewards=jnp.zeros(3),
        gt_reward_scale=1.0,
    )
    _close(jnp.mean(per_pair), NEMO[loss_type][int(average)], dtype)


def test_nemo_gt_rewards_default_to_one_and_zero(dtype):
    for loss_type in ("rpo_sq", "rpo_bwd_kl", "rpo_fwd_kl"):
        per_pair, _ = _loss(dtype, type=loss_type)
        _close(jnp.mean(per_pair), NEMO[loss_type][0], dtype)


def test_nemo_metrics_sum_mode(dtype):
    _, metrics = _loss(dtype, type="dpo", sft_loss_weight=0.1)
    expected = {
        "acc": 2 / 3,
        "rewards_chosen_mean": -0.0666666667,
        "rewards_rejected_mean": -0.2333333333,
        "rewards_all_mean": -0.15,
        "rewards_all_std": 0.2880972058,
        "sft_loss": 2.5333333333,
        "preference_loss": NEMO["dpo"][0],
        "loss": 0.9384346342,
    }
    for key, value in expected.items():
        _close(metrics[key], value, dtype)


def test_nemo_total_average_mode(dtype):
    _, metrics = _loss(
        dtype,
        type="dpo",
        preference_average_log_probs=True,
        sft_average_log_probs=True,
        sft_loss_weight=0.1,
        preference_loss_weight=1.0,
    )
    _close(metrics["preference_loss"], NEMO["dpo"][1], dtype)
    _close(metrics["sft_loss"], np.mean([2.0 / 3, 2.7 / 2, 2.9 / 4]), dtype)
    _close(metrics["loss"], 0.7816707033, dtype)


def test_preference_loss_weight(dtype):
    per_pair, _ = _loss(dtype, preference_loss_weight=2.0)
    _close(jnp.mean(per_pair), 2 * TABLE["sigmoid"][0], dtype)


# ----------------------------------------------------------------------------- options


def test_reference_free(dtype):
    pc, pr, _, _ = _args(dtype)
    per_pair, metrics = _preference_loss(pc, pr, None, None, reference_free=True, beta=BETA)
    zeros = jnp.zeros_like(pc)
    expected, _ = _preference_loss(pc, pr, zeros, zeros, beta=BETA)
    _close(per_pair, np.asarray(expected), dtype)
    _close(metrics["rewards/chosen"], BETA * np.mean(SUMS["policy_chosen"]), dtype)


def test_wpo_weights(dtype):
    """The step's WPO weights (chunked log sum p^2, per-completion means) equal the definition
    exp(mean_t(log p_t - log sum_v p_v^2)), carry no gradient, and pair as min(w_c w_r, 1)."""
    rng = np.random.default_rng(0)
    hidden = jnp.asarray(rng.normal(size=(2, 5, 4)), dtype)
    head = jnp.asarray(rng.normal(size=(7, 4)) * 2, dtype)
    tokens = jnp.array([[1, 2, 3, 4, 5], [0, 6, 6, 1, 2]])
    pred = jnp.broadcast_to(jnp.arange(5) - 1, (2, 5)).clip(0)
    ids = jnp.array([[-1, 0, 0, 0, -1], [-1, -1, 1, 1, 1]])
    lp, lsq = token_logps(hidden, head, tokens, pred, vocab_chunk=3, with_log_sum_p_sq=True)
    logits = np.einsum("rld,vd->rlv", np.asarray(hidden, np.float64), np.asarray(head, np.float64))
    logits = np.take_along_axis(logits, np.asarray(pred)[..., None], 1)
    logp = logits - np.log(np.exp(logits).sum(-1, keepdims=True))
    adjusted = np.take_along_axis(logp, np.asarray(tokens)[..., None], -1)[..., 0]
    adjusted -= np.log(np.sum(np.exp(logp) ** 2, -1))
    mask = np.asarray(ids) >= 0
    expected_w = np.exp(np.sum(adjusted * mask, -1) / np.sum(mask, -1))
    w = jnp.exp(wpo_log_weights(lp, lsq, ids, 2))
    _close(w, expected_w, dtype)
    grad = jax.grad(lambda x: jnp.sum(wpo_log_weights(x, lsq, ids, 2)))(lp)
    assert not np.any(np.asarray(grad))
    pair_w = L.wpo_pair_weights(w, w[::-1])
    _close(pair_w, np.minimum(expected_w * expected_w[::-1], 1.0), dtype)


def test_weights_scale_preference_term(dtype):
    weights = jnp.asarray([0.5, 1.0, 2.0], dtype)
    per_pair, _ = _loss(dtype, pair_weights=weights, sft_loss_weight=0.1)
    plain, _ = _loss(dtype, sft_loss_weight=0.1)
    sft = -np.asarray(SUMS["policy_chosen"])
    _close(per_pair, (np.asarray(plain) - 0.1 * sft) * np.asarray(weights) + 0.1 * sft, dtype)


def test_alpha_divergence_near_one_is_reverse_kl(dtype):
    per_pair, _ = _loss(dtype, f_divergence="alpha_divergence", f_alpha=1.0)
    _close(jnp.mean(per_pair), TABLE["sigmoid"][0], dtype)


def test_jit_matches_eager_and_compiles_once():
    fn = functools.partial(_preference_loss, type="sigmoid,sft", beta=BETA, sft_loss_weight=0.1)
    args = _args(jnp.float32)
    lengths = (jnp.asarray(NC), jnp.asarray(NR))
    eager = fn(*args, chosen_lengths=lengths[0], rejected_lengths=lengths[1])
    jitted = jax.jit(fn)(*args, chosen_lengths=lengths[0], rejected_lengths=lengths[1])
    for a, b in zip(jax.tree.leaves(eager), jax.tree.leaves(jitted), strict=True):
        np.testing.assert_allclose(a, b, rtol=1e-6)

    @jax.jit
    @chex.assert_max_traces(n=1)
    def step(pc, pr, rc, rr, nc, nr):
        return fn(pc, pr, rc, rr, chosen_lengths=nc, rejected_lengths=nr)

    for shift in (0.0, 1.0, 2.0):
        step(*(a + shift for a in args), *lengths)
    # beta may be traced
    traced = jax.jit(lambda b: _preference_loss(*args, beta=b)[0])(BETA)
    np.testing.assert_allclose(traced, _preference_loss(*args, beta=BETA)[0], rtol=1e-6)


# ----------------------------------------------------------------------------- sums and masks


def _slice(i, j, dtype):
    return dict(
        policy_chosen_logps=jnp.asarray(SUMS["policy_chosen"][i:j], dtype),
        policy_rejected_logps=jnp.asarray(SUMS["policy_rejected"][i:j], dtype),
        ref_chosen_logps=jnp.asarray(SUMS["ref_chosen"][i:j], dtype),
        ref_rejected_logps=jnp.asarray(SUMS["ref_rejected"][i:j], dtype),
        chosen_lengths=jnp.asarray(NC[i:j]),
        rejected_lengths=jnp.asarray(NR[i:j]),
    )


def test_metric_sums_accumulate_exactly(dtype):
    opts = dict(type="dpo,sft", beta=BETA, sft_loss_weight=0.1, metrics_as_sums=True)
    opts["sft_tokens_per_pair"] = sum(NC) / 3
    loss_a, sums_a = _preference_loss(**_slice(0, 1, dtype), **opts)
    loss_b, sums_b = _preference_loss(**_slice(1, 3, dtype), **opts)
    merged = L.finalize_metrics(jax.tree.map(jnp.add, sums_a, sums_b))
    opts.pop("metrics_as_sums")
    opts.pop("sft_tokens_per_pair")
    full_loss, full = _preference_loss(**_slice(0, 3, dtype), **opts)
    assert set(merged) == set(full)
    for key in full:
        _close(merged[key], float(full[key]), dtype)
    total = (jnp.sum(loss_a) + jnp.sum(loss_b)) / 3
    _close(total, float(jnp.mean(full_loss)), dtype)
    _close(merged["rewards_all_std"], 0.2880972058, dtype)


@pytest.mark.parametrize("loss_type", ["sigmoid", "aot", "aot_unpaired", "sft", "ipo"])
def test_pair_mask_ignores_padding_pairs(dtype, loss_type):
    order = [0, 3, 1, 2, 4]  # two padding pairs (3, 4) holding garbage
    valid = jnp.asarray([True, False, True, True, False])

    def padded(values, garbage):
        return jnp.asarray([([*values, garbage, garbage])[i] for i in order], dtype)

    kw = dict(type=loss_type, beta=BETA, label_smoothing=_smoothing(loss_type))
    per_pair, metrics = _preference_loss(
        *(padded(SUMS[k], 1e4) for k in TOKENS),
        chosen_lengths=padded(NC, 0),
        rejected_lengths=padded(NR, 0),
        pair_mask=valid,
        **kw,
    )
    full, expected = _preference_loss(
        *_args(dtype), chosen_lengths=jnp.asarray(NC), rejected_lengths=jnp.asarray(NR), **kw
    )
    _close(jnp.sum(per_pair) / 3, float(jnp.mean(full)), dtype)
    for key in expected:
        _close(metrics[key], float(expected[key]), dtype)


# ----------------------------------------------------------------------------- edge cases


@pytest.mark.parametrize("f_divergence", F_DIVS)
@pytest.mark.parametrize(
    "loss_type", ["sigmoid", "dpo", "sigmoid_norm", "robust", "aot", "aot_unpaired", "cdpo"]
)
def test_policy_equals_reference_gives_ln2(dtype, loss_type, f_divergence):
    pc, pr, _, _ = _args(dtype)
    kw = dict(type=loss_type, label_smoothing=EPS, f_divergence=f_divergence)
    if loss_type == "cdpo":
        kw.update(type="sigmoid", cdpo_smoothing=True)
    per_pair, metrics = _preference_loss(
        pc, pr, pc, pr, chosen_lengths=jnp.asarray(NC), rejected_lengths=jnp.asarray(NR), **kw
    )
    _close(per_pair, [LN2] * 3, dtype)
    assert float(metrics["rewards/accuracies"]) == 0.0
    assert float(metrics["acc"]) == 0.0


@pytest.mark.parametrize("sign, expected", [(1.0, 4.248354255e-18), (-1.0, 40.0)])
@pytest.mark.parametrize("loss_type", ["sigmoid", "dpo", "discopop"])
def test_saturation_exact(dtype, loss_type, sign, expected):
    if loss_type == "discopop" and sign < 0:
        expected = 40.0  # m = σ(-800) ~ 0: -logσ(-40) and a vanishing exp term
    delta = jnp.asarray([sign * 40.0 / BETA], dtype)
    zero = jnp.zeros_like(delta)
    per_pair, _ = _preference_loss(delta, zero, zero, zero, type=loss_type, beta=BETA)
    np.testing.assert_allclose(np.asarray(per_pair, np.float64), [expected], rtol=_tol(dtype))


def test_discopop_finite_where_trl_overflows():
    delta = jnp.asarray([-1000.0], jnp.float32)  # z = -100: TRL's exp(-z)·m is inf·0 = NaN
    zero = jnp.zeros_like(delta)
    per_pair, _ = _preference_loss(delta, zero, zero, zero, type="discopop", beta=BETA)
    np.testing.assert_allclose(per_pair, [100.0], rtol=1e-6)


def _huge_inputs(scale, dtype):
    big = jnp.asarray([scale, -scale, scale, 0.0], dtype)
    other = jnp.asarray([-scale, scale, scale, -scale], dtype)
    ref = jnp.asarray([0.0, 0.0, -scale, scale], dtype)
    return big, other, ref, -ref


@pytest.mark.parametrize("in_dtype", [jnp.float32, jnp.bfloat16])
@pytest.mark.parametrize("scale", [40.0 / BETA, 1e4])
@pytest.mark.parametrize("f_divergence", F_DIVS)
def test_all_losses_finite_for_huge_inputs(in_dtype, scale, f_divergence):
    args = _huge_inputs(scale, in_dtype)
    lengths = jnp.asarray([1, 3, 0, 2])
    for loss_type in ALL_LOSSES:
        if LossSettings(type=loss_type).without_reference and f_divergence != "reverse_kl":
            continue  # orpo and cpo score the policy log-probs themselves (refused, tested below)
        per_pair, metrics = _preference_loss(
            *args,
            type=loss_type,
            beta=BETA,
            label_smoothing=_smoothing(loss_type),
            chosen_lengths=lengths,
            rejected_lengths=lengths[::-1],
            f_divergence=f_divergence,
            sft_loss_weight=0.1,
        )
        assert np.all(np.isfinite(np.asarray(per_pair))), (loss_type, per_pair)
        assert all(np.isfinite(np.asarray(v)) for v in metrics.values()), loss_type


@pytest.mark.parametrize("loss_type", ALL_LOSSES)
def test_gradients_finite_under_saturation(loss_type):
    args = _huge_inputs(1e4, jnp.float32)
    lengths = jnp.asarray([1, 3, 0, 2])

    def mean_loss(policy_chosen, policy_rejected):
        per_pair, _ = _preference_loss(
            policy_chosen,
            policy_rejected,
            *args[2:],
            type=loss_type,
            beta=BETA,
            label_smoothing=_smoothing(loss_type),
            chosen_lengths=lengths,
            rejected_lengths=lengths[::-1],
            sft_loss_weight=0.1,
        )
        return jnp.mean(per_pair)

    for scale_args in (args, _huge_inputs(40.0 / BETA, jnp.float32)):
        grads = jax.grad(mean_loss, argnums=(0, 1))(*scale_args[:2])
        assert all(np.all(np.isfinite(np.asarray(g))) for g in grads), loss_type


@pytest.mark.parametrize("loss_type", ALL_LOSSES)
def test_zero_length_completions_finite(dtype, loss_type):
    zero = jnp.zeros(2, dtype)
    lengths = jnp.zeros(2, jnp.int32)
    per_pair, metrics = _preference_loss(
        zero,
        zero,
        zero,
        zero,
        type=loss_type,
        label_smoothing=_smoothing(loss_type),
        chosen_lengths=lengths,
        rejected_lengths=lengths,
        sft_average_log_probs=True,
    )
    assert np.all(np.isfinite(np.asarray(per_pair)))
    assert all(np.isfinite(np.asarray(v)) for v in metrics.values())


# ----------------------------------------------------------------------------- validation


@pytest.mark.parametrize(
    "kwargs, match",
    [
        (dict(type="dpop"), "unknown loss type.*valid loss types: .*sigmoid"),
        (dict(type=""), "loss type is empty"),
        (dict(label_smoothing=0.6), r"label_smoothing must be in \[0, 0.5\], got 0.6"),
        (dict(ld_alpha=1.5), r"ld_alpha must be in \[0, 1\]"),
        (dict(type="exo_pair", label_smoothing=0.0), "exo_pair needs 0 < label_smoothing"),
        (dict(type="robust", label_smoothing=0.5), "robust needs label_smoothing < 0.5"),
        (dict(f_divergence="kl"), "unknown f_divergence"),
        (dict(beta=0.0), "beta must be > 0"),
        (dict(type="sigmoid,hinge", weights=(1.0,)), "one weight per loss type"),
        (dict(type="hinge", cdpo_smoothing=True), "cdpo_smoothing"),
        (dict(type="ipo", preference_average_log_probs=True), "use 'ipo_sum'"),
        (dict(type="ipo", chosen_lengths=None), "need chosen_lengths and rejected_lengths"),
        (dict(type="sft", chosen_lengths=None), "need chosen_lengths"),
        (dict(sft_tokens_per_pair=3.0), "only used by loss type 'sft'"),
        (dict(discopop_tau=0.0, type="discopop"), "discopop_tau"),
    ],
)
def test_validation_errors(kwargs, match):
    with pytest.raises(ValueError, match=match):
        _loss(jnp.float32, **kwargs)


def test_missing_reference_needs_reference_free():
    pc, pr, _, _ = _args(jnp.float32)
    with pytest.raises(ValueError, match="reference_free=True"):
        _preference_loss(pc, pr, None, None)
