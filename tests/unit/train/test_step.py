"""The jitted DPO step: reference strategies, accumulation, compile-once, learning."""

import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from dpojax.models import add_lora, init_model
from dpojax.models.tiny import tiny_config
from dpojax.train.loss_settings import LossSettings
from dpojax.train.optim import make_optimizer
from dpojax.train.reference_choice import LoraBaseReference, PrecomputedReference
from dpojax.train.state import StepConfig, create_train_state, split_policy
from dpojax.train.step import Stepper
from tests.helpers.synthetic import copy_task, micro_batches, naive_token_logps, padded_batch

VOCAB = 64
LENGTH = 8


def _config(**kw):
    return tiny_config("llama", vocab_size=VOCAB, **kw)


def _setup(
    model, cfg=None, lr=1e-3, reference=None, mesh=None, schedule="constant", opt="adamw", **kw
):
    cfg = cfg or StepConfig(loss=LossSettings(type="sigmoid", beta=0.1))
    tx, sched = make_optimizer(lr, schedule=schedule, max_grad_norm=1.0, name=opt, **kw)
    graphdef, state = create_train_state(model, tx, cfg, reference=reference)
    stepper = Stepper(graphdef, tx, sched, cfg, model.config.lora_rank > 0, mesh=mesh)
    return stepper, stepper.shard_state(state)


def _batch(n=8, seed=0, micro=1):
    triples = copy_task(n, seed, VOCAB)
    per = n // micro
    return micro_batches(
        [padded_batch(triples[i * per : (i + 1) * per], LENGTH) for i in range(micro)]
    )


def _flat(state_tree):
    return {p: np.asarray(v.get_value()) for p, v in nnx.to_flat_state(state_tree)}


def test_step_zero_is_ln2_and_policy_moves_but_reference_does_not():
    model = init_model(_config(), seed=0)
    stepper, state = _setup(model)
    ref_before = _flat(state.ref)
    params_before = _flat(state.params)
    state, metrics = stepper.train(state, _batch())
    assert float(metrics["loss"]) == pytest.approx(math.log(2), abs=1e-6)
    # policy == reference: margins vanish (up to float reassociation between the differentiated
    # policy forward and the plain reference forward)
    assert abs(float(metrics["rewards/margins"])) < 1e-6
    assert float(metrics["pairs"]) == 8
    assert "entropy" not in metrics  # the token metrics only with StepConfig.token_metrics
    for _ in range(2):
        state, metrics = stepper.train(state, _batch())
    assert float(metrics["loss"]) < math.log(2)
    assert int(state.step) == 3
    ref_after, params_after = _flat(state.ref), _flat(state.params)
    for path in ref_before:
        np.testing.assert_array_equal(ref_before[path], ref_after[path])
    assert any(not np.array_equal(params_before[p], params_after[p]) for p in params_before)
    assert stepper.train_cache_size() == 1  # compiled once across steps


@pytest.mark.slow
def test_eval_logps_equal_a_direct_full_logits_computation():
    model = init_model(_config(), seed=1)
    stepper, state = _setup(model)
    batch = {k: v[0] for k, v in _batch().items()}
    out = stepper.evaluate(state, batch)
    logits = model(jnp.asarray(batch["tokens"]), segment_ids=jnp.asarray(batch["segment_ids"]))
    lp = np.asarray(
        naive_token_logps(logits, jnp.asarray(batch["tokens"]), jnp.asarray(batch["pred_index"]))
    )
    mask = batch["completion_ids"] >= 0
    per_row = (lp * mask).sum(-1)
    np.testing.assert_allclose(out["policy_chosen_logps"], per_row[:8], atol=1e-5)
    np.testing.assert_allclose(out["policy_rejected_logps"], per_row[8:], atol=1e-5)
    np.testing.assert_allclose(out["ref_chosen_logps"], per_row[:8], atol=1e-5)


@pytest.mark.slow
@pytest.mark.parametrize(("micro", "remat"), [(2, "none"), (4, "none"), (2, "full")])
def test_micro_batches_equal_one_big_batch(micro, remat):
    """remat="full" over micro-batches: each layer rematerialized inside the micro-batch scan,
    the reference merged in every micro-batch (flax's TraceContextError before the layers were
    checkpointed as plain pytrees).
    SGD at learning rate 1 (after clipping to norm 1): the weights move by the gradient itself,
    so 1e-5 on the weights is 1e-5 on the gradients. Under Adam an element whose gradient is near
    0 moves by lr * g / (|g| + eps), which turns float reassociation noise of 1e-9 into 1e-5 of
    weight (one element of 11,264 in [2-full] on an AVX-512 host)."""
    cfg = StepConfig(
        loss=LossSettings(type="sigmoid,sft", weights=(1.0, 0.5), beta=0.1),
        token_metrics=True,
    )
    results = []
    for k in (1, micro):
        model = init_model(_config(remat=remat if k > 1 else "none"), seed=2)
        stepper, state = _setup(model, cfg, lr=1.0, opt="sgd")
        state, _ = stepper.train(state, _batch(seed=1))  # move away from policy == reference
        state, metrics = stepper.train(state, _batch(seed=3, micro=k))
        results.append((metrics, _flat(state.params)))
    (m1, p1), (mk, pk) = results
    for key in (
        "loss",
        "rewards/margins",
        "rewards/accuracies",
        "logps/chosen",
        "grad_norm",
        "rewards_all_std",
        "entropy",
        "mean_token_accuracy",
        "logits/chosen",
        "logits/rejected",
    ):
        assert float(mk[key]) == pytest.approx(float(m1[key]), abs=1e-5), key
    for path in p1:
        np.testing.assert_allclose(pk[path], p1[path], atol=1e-5, err_msg=str(path))


@pytest.mark.slow
def test_lora_base_reference_trains_only_adapters():
    base = init_model(_config(), seed=3)
    model = add_lora(base, rank=4, alpha=8.0, targets=("q_proj", "v_proj", "up_proj"), seed=1)
    cfg = StepConfig(loss=LossSettings(type="sigmoid", beta=0.1), reference=LoraBaseReference())
    stepper, state = _setup(model, cfg, lr=1e-2)
    assert state.ref is None
    assert all(p[-1] in ("lora_a", "lora_b") for p in _flat(state.params))
    n_opt = sum(x.size for x in jax.tree.leaves(state.opt_state))
    n_lora = sum(x.size for x in _flat(state.params).values())
    assert n_opt <= 2 * n_lora + 4  # moments for the adapters only
    frozen_before = _flat(state.frozen)
    state, metrics = stepper.train(state, _batch())
    assert float(metrics["loss"]) == pytest.approx(math.log(2), abs=1e-6)
    for _ in range(3):
        state, metrics = stepper.train(state, _batch())
    assert float(metrics["loss"]) < math.log(2) - 1e-3
    for path, value in _flat(state.frozen).items():
        np.testing.assert_array_equal(value, frozen_before[path])


def test_lora_reference_validation():
    model = init_model(_config(), seed=3)
    cfg = StepConfig(reference=LoraBaseReference())
    tx, _ = make_optimizer(1e-3)
    with pytest.raises(ValueError, match="needs a policy with LoRA adapters"):
        create_train_state(model, tx, cfg)
    lora = add_lora(model, rank=2)
    lora.layers[0].self_attn.q_proj.lora_b[...] = jnp.ones_like(
        lora.layers[0].self_attn.q_proj.lora_b[...]
    )
    with pytest.raises(ValueError, match="lora_b must start at zero"):
        create_train_state(lora, tx, cfg)


@pytest.mark.slow
def test_precomputed_reference_gives_the_same_losses():
    model = init_model(_config(), seed=4)
    live, live_state = _setup(model)
    live_state, _ = live.train(live_state, _batch(seed=5))
    batch = {k: v[0] for k, v in _batch(seed=6).items()}
    live_out = live.evaluate(live_state, batch)
    # precompute: the reference log-probs of the initial policy, attached to the batch
    pre_cfg = StepConfig(
        loss=LossSettings(type="sigmoid", beta=0.1), reference=PrecomputedReference()
    )
    graphdef, _, _, _ = split_policy(model)
    pre = Stepper(graphdef, live.optimizer, live.schedule, pre_cfg, False)
    batch_pre = dict(
        batch,
        ref_chosen_logps=np.asarray(live_out["ref_chosen_logps"]),
        ref_rejected_logps=np.asarray(live_out["ref_rejected_logps"]),
    )
    pre_state = jax.tree.map(jnp.copy, live_state.replace(ref=None))  # train() donates its state
    pre_out = pre.evaluate(pre_state, batch_pre)
    np.testing.assert_allclose(pre_out["losses"], live_out["losses"], atol=1e-6)
    # and a train step with precomputed reference equals the live one
    s1, m1 = live.train(live_state, micro_batches([batch]))
    s2, m2 = pre.train(pre_state, micro_batches([batch_pre]))
    assert float(m2["loss"]) == pytest.approx(float(m1["loss"]), abs=1e-6)


@pytest.mark.slow
def test_skip_nonfinite_keeps_the_state():
    model = init_model(_config(), seed=5)
    cfg = StepConfig(
        loss=LossSettings(type="sigmoid"), reference=PrecomputedReference(), skip_nonfinite=True
    )
    stepper, state = _setup(model, cfg)
    batch = _batch()
    batch["ref_chosen_logps"] = np.full((1, 8), np.nan, np.float32)
    batch["ref_rejected_logps"] = np.zeros((1, 8), np.float32)
    before = _flat(state.params)
    state, metrics = stepper.train(state, batch)
    assert float(metrics["nonfinite"]) == 1.0
    for path, value in _flat(state.params).items():
        np.testing.assert_array_equal(value, before[path])
    assert int(state.step) == 0


@pytest.mark.slow
def test_a_nonfinite_update_from_finite_gradients_is_caught_and_skipped():
    """Adam without epsilon: the loss and gradients are finite, but every parameter whose
    gradient is 0 (the embeddings of tokens the batch does not use) gets 0/0 = NaN. Before, the
    step reported itself finite and, with skip, kept the NaN parameters."""
    model = init_model(_config(), seed=5)
    cfg = StepConfig(loss=LossSettings(type="sigmoid"), skip_nonfinite=True)
    stepper, state = _setup(model, cfg, eps=0.0)
    before = _flat(state.params)
    state, metrics = stepper.train(state, _batch())
    assert math.isfinite(float(metrics["loss"])) and math.isfinite(float(metrics["grad_norm"]))
    assert float(metrics["nonfinite"]) == 1.0
    for path, value in _flat(state.params).items():
        np.testing.assert_array_equal(value, before[path])
    assert int(state.step) == 0


def test_all_finite_sees_one_bad_element_in_any_float_leaf():
    from dpojax.train.step import all_finite

    tree = {"a": jnp.ones((3, 4)), "b": [jnp.zeros(5, jnp.bfloat16)], "n": jnp.arange(3)}
    assert bool(all_finite(tree))
    for bad in (jnp.nan, jnp.inf, -jnp.inf):
        assert not bool(all_finite({**tree, "a": tree["a"].at[2, 1].set(bad)}))
        assert not bool(all_finite({**tree, "b": [tree["b"][0].at[4].set(bad)]}))
    assert bool(all_finite({}))


def test_the_nonfinite_diagnosis_blames_the_learning_rate_only_where_it_can_be_the_cause():
    from dpojax.train.step import nonfinite_cause

    nan = float("nan")
    # finite loss and gradients, non-finite update: the optimizer's settings (before: "lower
    # optim.learning_rate", for a run that optim.eps=0 broke)
    update = nonfinite_cause(7, {"loss": 0.69, "grad_norm": 0.3})
    assert "update or the updated parameters are not finite" in update
    assert "optim.eps" in update and "learning_rate" not in update
    # the first step, before any update: the weights or the data
    first = nonfinite_cause(1, {"loss": nan, "grad_norm": nan})
    assert "before any update" in first and "vocabulary" in first
    assert "optim.learning_rate" not in first
    later = nonfinite_cause(40, {"loss": nan, "grad_norm": float("inf")})
    assert "lower optim.learning_rate" in later and "loss nan, grad_norm inf" in later


@pytest.mark.slow
def test_bfloat16_compute_with_float32_master_weights():
    model = init_model(_config(dtype="bfloat16"), seed=6)
    stepper, state = _setup(model)
    for _ in range(2):
        state, metrics = stepper.train(state, _batch())
    assert np.isfinite(float(metrics["loss"]))
    assert all(v.dtype == np.float32 for v in _flat(state.params).values())


@pytest.mark.slow
def test_learns_a_synthetic_preference_to_high_heldout_accuracy():
    """Copying the prompt's first two tokens is preferred; held-out prompts are new."""
    model = init_model(_config(), seed=7)
    cfg = StepConfig(loss=LossSettings(type="sigmoid", beta=0.5))
    tx, schedule = make_optimizer(1e-3, schedule="cosine", warmup_steps=20, total_steps=300)
    graphdef, state = create_train_state(model, tx, cfg)
    stepper = Stepper(graphdef, tx, schedule, cfg, False)
    for step in range(300):
        state, metrics = stepper.train(state, _batch(n=32, seed=100 + step))
    assert float(metrics["learning_rate"]) < 1e-5  # the cosine schedule ran to its end
    heldout = {k: v[0] for k, v in _batch(n=64, seed=99_999).items()}
    out = stepper.evaluate(state, heldout)
    margin = (np.asarray(out["policy_chosen_logps"]) - np.asarray(out["ref_chosen_logps"])) - (
        np.asarray(out["policy_rejected_logps"]) - np.asarray(out["ref_rejected_logps"])
    )
    accuracy = float((margin > 0).mean())
    assert accuracy >= 0.95, accuracy


@pytest.mark.slow
def test_a_reference_free_loss_holds_no_reference_and_compiles_no_reference_pass():
    """loss.reference_free takes the reference log-probs as 0: the state holds no reference
    copy and the step has no reference forward (fewer matmuls), with the loss it had."""
    free = StepConfig(loss=LossSettings(type="sigmoid", beta=0.1, reference_free=True))
    stepper, state = _setup(init_model(_config(), seed=5), free)
    with_ref, ref_state = _setup(init_model(_config(), seed=5))
    assert state.ref is None and ref_state.ref is not None
    batch = _batch(seed=2)

    def matmuls(s, st):
        return s.lower(st, batch).as_text().count("dot_general")

    assert matmuls(stepper, state) < matmuls(with_ref, ref_state)
    out = stepper.evaluate(state, {k: v[0] for k, v in batch.items()})
    np.testing.assert_array_equal(out["ref_chosen_logps"], 0.0)
    margin = out["policy_chosen_logps"] - out["policy_rejected_logps"]
    expected = float(np.mean(-jax.nn.log_sigmoid(0.1 * margin)))
    _, metrics = stepper.train(state, batch)
    assert float(metrics["loss"]) == pytest.approx(expected, abs=1e-5)
    for objective in ("orpo", "cpo"):  # reference-free by definition: no reference held either
        cfg = StepConfig(loss=LossSettings(type=objective, beta=0.1))
        assert cfg.reference_free and cfg.needs_sft_tokens
        assert _setup(init_model(_config(), seed=5), cfg)[1].ref is None
