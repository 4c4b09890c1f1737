"""Unpaired losses (dpojax.train.kto): float64 formula fixtures computed here with numpy, and
parity with TRL 1.16's KTOTrainer (its own `_compute_loss`, fed fixed log-probs)."""

import math
import types
from collections import defaultdict

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from dpojax.train import kto as K
from dpojax.train.loss_settings import LossSettings

# TRL 1.16's KTOConfig sets transformers' deprecated `gradient_checkpointing` itself.
pytestmark = pytest.mark.filterwarnings(
    "ignore:`gradient_checkpointing` is deprecated:FutureWarning"
)

BETA = 0.1
# Six examples: sequence log-probs of the policy and the reference, and of the KL completions.
POLICY = [-3.1, -5.4, -2.2, -7.9, -4.0, -6.3]
REF = [-3.6, -5.0, -2.9, -7.1, -4.4, -6.0]
POLICY_KL = [-6.0, -3.3, -5.1, -2.6, -8.2, -4.1]
REF_KL = [-6.8, -3.9, -5.0, -3.5, -8.0, -4.0]
DESIRABLE = [True, False, True, True, False, False]


def _sigmoid(x):
    return 1 / (1 + np.exp(-x))


def _kto_reference(loss_type, wd=1.0, wu=1.0, mask=None):
    """KTO by hand in float64: per-example losses, the batch loss and z."""
    p, r = np.asarray(POLICY), np.asarray(REF)
    good = np.asarray(DESIRABLE)
    real = np.ones(6, bool) if mask is None else np.asarray(mask)
    ratios = p - r
    if loss_type == "kto":
        kl_diff = (np.asarray(POLICY_KL) - np.asarray(REF_KL))[real]
        z = max(kl_diff.mean(), 0.0)
        chosen, rejected = 1 - _sigmoid(BETA * (ratios - z)), 1 - _sigmoid(BETA * (z - ratios))
    else:
        z = 0.0
        chosen, rejected = 1 - _sigmoid(BETA * ratios), _sigmoid(BETA * ratios)
    losses = np.where(good, wd * chosen, wu * rejected) * real
    return losses, losses.sum() / real.sum(), z


def _tol(dtype):
    return 1e-12 if dtype == jnp.float64 else 2e-6


def _arrays(dtype):
    return [jnp.asarray(v, dtype) for v in (POLICY, REF, DESIRABLE, POLICY_KL, REF_KL)]


@pytest.mark.parametrize("loss_type", K.KTO_LOSS_TYPES)
@pytest.mark.parametrize(("wd", "wu"), [(1.0, 1.0), (1.33, 0.5)])
def test_kto_formula(dtype, loss_type, wd, wu):
    p, r, d, pk, rk = _arrays(dtype)
    losses, sums = K.kto_loss(
        p,
        r,
        d.astype(bool),
        pk,
        rk,
        settings=LossSettings(
            type=loss_type, beta=BETA, desirable_weight=wd, undesirable_weight=wu
        ),
    )
    expected, total, z = _kto_reference(loss_type, wd, wu)
    tol = _tol(dtype)
    np.testing.assert_allclose(np.asarray(losses, np.float64), expected, rtol=tol, atol=tol)
    metrics = K.unpaired_metrics(sums)
    assert metrics["loss"] == pytest.approx(total, rel=tol, abs=tol)
    assert metrics["kl"] == pytest.approx(z, rel=tol, abs=tol)
    good = np.asarray(DESIRABLE)
    ratios = BETA * (np.asarray(POLICY) - np.asarray(REF))
    assert metrics["rewards/chosen"] == pytest.approx(ratios[good].mean(), rel=tol, abs=tol)
    assert metrics["rewards/rejected"] == pytest.approx(ratios[~good].mean(), rel=tol, abs=tol)
    assert metrics["logps/chosen"] == pytest.approx(np.asarray(POLICY)[good].mean(), rel=tol)
    margins = ratios[good].mean() - ratios[~good].mean()
    assert metrics["rewards/margins"] == pytest.approx(margins, rel=tol, abs=tol)
    assert float(sums["count/chosen"]) == 3 and float(sums["count/rejected"]) == 3


def test_kto_fixture_numbers():
    """The float64 fixture's values, written down (z = 1.9 / 6: the KL term is active)."""
    _, total, z = _kto_reference("kto")
    assert z == pytest.approx(1.9 / 6, abs=1e-12)
    assert total == pytest.approx(0.4970808109, abs=1e-9)
    assert _kto_reference("apo_zero_unpaired")[1] == pytest.approx(0.4970832747, abs=1e-9)


def test_kl_is_clamped_at_zero_and_has_no_gradient():
    p, r, d, pk, rk = _arrays(jnp.float32)
    _, sums = K.kto_loss(p, r, d.astype(bool), pk, rk + 5.0)  # mean KL log-ratio -4.7
    assert float(sums["kl"]) == 0.0
    grad = jax.grad(lambda x: K.kto_loss(p, r, d.astype(bool), x, rk)[0].sum())(pk)
    assert np.all(np.asarray(grad) == 0)


def test_padding_rows_count_nowhere(dtype):
    """Masked rows (holding NaN) change neither the losses, the metrics nor the gradients."""
    mask = np.array([True, True, True, True, False, False])
    p, r, d, pk, rk = _arrays(dtype)
    nan = jnp.asarray([0, 0, 0, 0, np.nan, np.nan], dtype)
    losses, sums = K.kto_loss(p + nan, r, d.astype(bool), pk + nan, rk, jnp.asarray(mask))
    expected, total, _ = _kto_reference("kto", mask=mask)
    tol = _tol(dtype)
    np.testing.assert_allclose(np.asarray(losses, np.float64), expected, rtol=tol, atol=tol)
    assert K.unpaired_metrics(sums)["loss"] == pytest.approx(total, rel=tol)
    assert float(sums["count/examples"]) == 4 and float(sums["count/rejected"]) == 1
    grad = jax.grad(
        lambda x: K.kto_loss(x + nan, r, d.astype(bool), pk, rk, jnp.asarray(mask))[0].sum()
    )(p)
    assert np.all(np.isfinite(np.asarray(grad))) and np.all(np.asarray(grad)[4:] == 0)


def test_kto_needs_kl_logps_and_a_known_type():
    p, r, d, *_ = _arrays(jnp.float32)
    with pytest.raises(ValueError, match="needs the KL completions"):
        K.kto_loss(p, r, d.astype(bool))
    with pytest.raises(ValueError, match="unknown KTO loss type 'sigmoid'"):
        K.kto_loss(p, r, d.astype(bool), settings=LossSettings(type="sigmoid"))
    K.kto_loss(p, r, d.astype(bool), settings=LossSettings(type="apo_zero_unpaired"))  # no KL
    with pytest.raises(ValueError, match=r"desirable_weight must be >= 0, got -1"):
        K.kto_loss(
            p,
            r,
            d.astype(bool),
            settings=LossSettings(type="apo_zero_unpaired", desirable_weight=-1.0),
        )


def test_kl_completions_rotate_by_one_within_each_batch():
    """TRL: (x_1, y_n), (x_2, y_1), ..., (x_n, y_{n-1}) per batch; the last batch may be short."""
    assert K.kl_completion_indices(4, 4).tolist() == [3, 0, 1, 2]
    assert K.kl_completion_indices(7, 3).tolist() == [2, 0, 1, 5, 3, 4, 6]
    assert K.kl_completion_indices(5, 2).tolist() == [1, 0, 3, 2, 4]
    with pytest.raises(ValueError, match="batch_size"):
        K.kl_completion_indices(3, 0)
    with pytest.raises(ValueError, match="must be > 1"):
        K.check_kto_batch_size("kto", 1)
    K.check_kto_batch_size("apo_zero_unpaired", 1)


def test_balance_warning_bounds():
    """TRL's bounds (Eq. 8, rounded to 2 decimals, 1.33 for 4/3); silent when balanced."""
    assert K.balance_warning(5, 5, 1.0, 1.0) is None
    assert K.balance_warning(0, 0, 1.0, 1.0) is None  # both clamped to 1
    text = K.balance_warning(10, 3, 1.0, 1.0)
    assert "[0.3, 0.4]" in text and "[2.51, 3.33]" in text
    assert K.balance_warning(10, 3, 0.35, 1.0) is None
    assert K.balance_warning(10, 3, 1.0, 2.5) is None
    assert K.balance_warning(3, 10, 1.0, 1.0) is not None
    assert K.balance_warning(3, 10, 4.0, 1.0) is None  # 10/3 = 3.33 <= 4.0 <= 4.43


def _bco_reference(batches):
    """BCO by hand: TRL's RunningMoments (mean 0, var 1, count 1e-24) and its loss."""
    mean, var, count = 0.0, 1.0, 1e-24
    out = []
    for p, r, good in batches:
        rewards = BETA * (np.asarray(p) - np.asarray(r))
        n, m, v = rewards.size, rewards.mean(), rewards.var()
        delta, total = m - mean, count + rewards.size
        var = (var * count + delta**2 * count * n / total + v * n) / total
        mean, count = mean + delta * n / total, total
        losses = np.where(
            good, -np.log(_sigmoid(rewards - mean)), -np.log(_sigmoid(-(rewards - mean)))
        )
        out.append((losses, mean, var, count))
    return out


def test_bco_formula_over_several_batches(dtype):
    batches = [
        (POLICY[:3], REF[:3], DESIRABLE[:3]),
        (POLICY[3:], REF[3:], DESIRABLE[3:]),
        (POLICY_KL, REF_KL, DESIRABLE),
    ]
    state = K.RunningMoments.initial(dtype)
    tol = _tol(dtype)
    for (p, r, good), (losses, mean, var, count) in zip(
        batches, _bco_reference(batches), strict=True
    ):
        got, sums, state = K.bco_loss(
            jnp.asarray(p, dtype),
            jnp.asarray(r, dtype),
            jnp.asarray(good),
            state,
            settings=LossSettings(type="bco", beta=BETA),
        )
        np.testing.assert_allclose(np.asarray(got, np.float64), losses, rtol=tol, atol=tol)
        assert float(sums["delta"]) == pytest.approx(mean, rel=tol, abs=tol)
        assert float(state.var) == pytest.approx(var, rel=tol, abs=tol)
        assert float(state.count) == pytest.approx(count)
        assert float(state.std) == pytest.approx(math.sqrt(var * count / (count - 1)), rel=tol)
    # evaluation: δ as it is, state unchanged
    _, sums, after = K.bco_loss(
        jnp.asarray(POLICY, dtype),
        jnp.asarray(REF, dtype),
        jnp.asarray(DESIRABLE),
        state,
        settings=LossSettings(type="bco", beta=BETA),
        update=False,
    )
    assert float(sums["delta"]) == pytest.approx(float(state.mean)) and after is state


def test_bco_padding_and_empty_batches():
    state = K.RunningMoments.initial()
    p, r, d, *_ = _arrays(jnp.float32)
    none = jnp.zeros(6, bool)
    losses, _, after = K.bco_loss(p, r, d.astype(bool), state, none)
    assert np.all(np.asarray(losses) == 0) and float(after.count) == pytest.approx(1e-24)
    mask = jnp.asarray([True, True, True, False, False, False])
    _, _, half = K.bco_loss(p, r, d.astype(bool), state, mask)
    _, _, first = K.bco_loss(p[:3], r[:3], d[:3].astype(bool), state)
    np.testing.assert_allclose(np.asarray(half), np.asarray(first), rtol=1e-6)


def test_losses_jit_with_traced_beta_and_state():
    """Both losses trace once for changing values (beta, weights, labels, mask, BCO's state)."""
    p, r, d, pk, rk = _arrays(jnp.float32)
    traces = []

    @jax.jit
    def step(p, d, mask, beta, wd, running):
        traces.append(1)
        settings = LossSettings(type="kto", beta=beta, desirable_weight=wd)
        losses, sums = K.kto_loss(p, r, d, pk, rk, mask, settings)
        _, bco_sums, running = K.bco_loss(
            p, r, d, running, mask, LossSettings(type="bco", beta=beta)
        )
        return sums["loss_sum"], bco_sums["delta"], running

    running = K.RunningMoments.initial()
    for beta in (0.1, 0.2):
        total, delta, running = step(p, d > 0, d >= 0, beta, 1.5, running)
    assert len(traces) == 1 and float(running.count) == pytest.approx(12)
    eager, _ = K.kto_loss(
        p, r, d > 0, pk, rk, settings=LossSettings(beta=0.2, type="kto", desirable_weight=1.5)
    )
    assert float(total) == pytest.approx(float(eager.sum()), rel=1e-6)


# ----------------------------------------------------------------------------- TRL 1.16 parity


def _trl_batch(torch, index, policy, ref, policy_kl, ref_kl, labels):
    """A KTOTrainer batch whose fake model answers the log-probs above: one completion token a
    row, the row found by the first input id (KL rows offset by 1000)."""
    n = len(labels)
    ids = torch.stack([torch.arange(n) + index, torch.zeros(n, dtype=torch.long)], 1)
    mask = torch.tensor([[0, 1]] * n)
    return {
        "input_ids": ids,
        "attention_mask": torch.ones_like(ids),
        "completion_mask": mask,
        "KL_input_ids": ids + torch.tensor([1000, 0]),
        "KL_attention_mask": torch.ones_like(ids),
        "KL_completion_mask": mask,
        "label": torch.tensor(labels),
        "ref_logps": torch.tensor(ref, dtype=torch.float64),
        "ref_KL_logps": torch.tensor(ref_kl, dtype=torch.float64),
    }


def _trl_trainer(torch, loss_type, table, wd, wu):
    """A stand-in `self` for KTOTrainer._compute_loss: what it reads of its trainer, and a model
    that returns the table's log-prob for each row."""
    from trl import KTOTrainer

    def model(input_ids, **_):
        rows = input_ids[:, 0].tolist()
        values = torch.stack([table[i] for i in rows])[:, None]
        zeros = torch.zeros_like(values)
        return types.SimpleNamespace(log_probs=values, entropy=zeros, mean_logits=zeros)

    model.training = True
    accelerator = types.SimpleNamespace(device="cpu", gather_for_metrics=lambda x: x)
    trainer = types.SimpleNamespace(
        model=model,
        accelerator=accelerator,
        loss_type=loss_type,
        beta=BETA,
        desirable_weight=wd,
        undesirable_weight=wu,
        calculate_KL=loss_type == "kto",
        precompute_ref_logps=True,
        aux_loss_enabled=False,
        _metrics={"train": defaultdict(list)},
        _total_train_tokens=0,
        _tp_size=1,
    )
    trainer._compute_kl_logps = types.MethodType(KTOTrainer._compute_kl_logps, trainer)
    return trainer, types.MethodType(KTOTrainer._compute_loss, trainer)


@pytest.mark.slow
@pytest.mark.parametrize("loss_type", K.KTO_LOSS_TYPES)
@pytest.mark.parametrize(("wd", "wu"), [(1.0, 1.0), (1.33, 0.6)])
@pytest.mark.parametrize("batch_size", [6, 2, 4])
def test_kto_equals_trl_s_kto_trainer(loss_type, wd, wu, batch_size):
    """One batch (6) and several (3 of 2; 4 then 2): TRL's loss, its gradient with respect to
    the policy log-probs, and its logged kl, rewards, logps and margins per batch, within 1e-5
    relative. Batches of 2 include one with only desirable examples, one with only undesirable
    ones, and one whose KL mean is negative (clamped)."""
    torch = pytest.importorskip("torch")
    pytest.importorskip("trl")
    table = {
        i: torch.tensor(v, dtype=torch.float64, requires_grad=True)
        for i, v in [*enumerate(POLICY), *((1000 + i, v) for i, v in enumerate(POLICY_KL))]
    }
    trainer, compute_loss = _trl_trainer(torch, loss_type, table, wd, wu)
    with jax.enable_x64(True):
        for start in range(0, 6, batch_size):
            part = slice(start, start + batch_size)
            batch = _trl_batch(
                torch,
                start,
                POLICY[part],
                REF[part],
                POLICY_KL[part],
                REF_KL[part],
                DESIRABLE[part],
            )
            trainer._metrics["train"].clear()
            trl_loss = compute_loss(model=trainer.model, inputs=batch, return_outputs=False)
            trl_loss.backward()
            expected = {k: v[-1] for k, v in trainer._metrics["train"].items()}
            rows = range(start, min(start + batch_size, 6))
            trl_grad = [float(table[i].grad) for i in rows]
            assert all(table[1000 + i].grad is None for i in rows)  # the KL term: detached

            def batch_loss(policy, part=part):
                _, sums = K.kto_loss(
                    policy,
                    jnp.asarray(REF[part], jnp.float64),
                    jnp.asarray(DESIRABLE[part]),
                    *(jnp.asarray(v[part], jnp.float64) for v in (POLICY_KL, REF_KL)),
                    settings=LossSettings(
                        type=loss_type, beta=BETA, desirable_weight=wd, undesirable_weight=wu
                    ),
                )
                return sums["loss_sum"] / sums["count/examples"], sums

            grad, sums = jax.grad(batch_loss, has_aux=True)(jnp.asarray(POLICY[part], jnp.float64))
            np.testing.assert_allclose(np.asarray(grad), trl_grad, rtol=1e-5, atol=1e-12)
            got = K.unpaired_metrics(sums)
            assert got["loss"] == pytest.approx(float(trl_loss.detach()), rel=1e-5, abs=1e-12)
            for key in (
                "kl",
                "rewards/chosen",
                "rewards/rejected",
                "logps/chosen",
                "logps/rejected",
                "rewards/margins",
            ):
                assert (key in got) == (key in expected), key
                if key in expected:
                    assert got[key] == pytest.approx(expected[key], rel=1e-5, abs=1e-12), key


def _trl_prepared(rows, batch_size, wd, wu, monkeypatch):
    """TRL 1.16's KTOTrainer._prepare_dataset on `rows` (the tiny tokenizer): the prepared rows
    and the warnings it logged."""
    import datasets
    from trl import KTOConfig, KTOTrainer
    from trl.trainer import kto_trainer

    from dpojax.models.tiny import build_tokenizer

    warnings = []
    fake_logger = types.SimpleNamespace(warning=warnings.append, warning_once=lambda *a: None)
    monkeypatch.setattr(kto_trainer, "logger", fake_logger)
    tok = build_tokenizer()
    args = KTOConfig(
        output_dir="unused",
        per_device_train_batch_size=batch_size,
        report_to=[],
        bf16=False,
        use_cpu=True,
    )
    trainer = types.SimpleNamespace(
        calculate_KL=True, desirable_weight=wd, undesirable_weight=wu, _tokenizer=tok
    )
    dataset = datasets.Dataset.from_list(rows)
    prepared = KTOTrainer._prepare_dataset(trainer, dataset, tok, args, "train")
    return list(prepared), warnings


@pytest.mark.slow
@pytest.mark.parametrize(
    ("labels", "wd", "wu"),
    [
        ([True] * 10 + [False] * 3, 1.0, 1.0),
        ([True] * 3 + [False] * 10, 1.0, 1.0),
        ([True] * 10 + [False] * 3, 0.35, 1.0),
        ([True] * 7, 1.0, 1.0),
        ([True, False] * 4, 1.0, 1.0),
    ],
)
def test_kl_rotation_and_balance_warning_equal_trl_s(labels, wd, wu, monkeypatch):
    """TRL's dataset preparation: its KL completion ids (batches of 3; the last one short) are
    the completions `kl_completion_indices` names, and it warns exactly when
    `balance_warning` does, with the same ranges."""
    pytest.importorskip("trl")
    import re

    rows = [{"prompt": f"p{i}", "completion": f" c{i}", "label": v} for i, v in enumerate(labels)]
    prepared, warnings = _trl_prepared(rows, 3, wd, wu, monkeypatch)
    indices = K.kl_completion_indices(len(rows), 3)
    for row, source in zip(prepared, indices, strict=True):
        assert row["KL_completion_ids"] == prepared[source]["completion_ids"]
    ours = K.balance_warning(sum(labels), len(labels) - sum(labels), wd, wu)
    assert (ours is None) == (not warnings)
    if ours is not None:
        numbers = re.compile(r"\[([\d.]+), ([\d.]+)\]")
        assert numbers.findall(ours) == numbers.findall(warnings[0])
