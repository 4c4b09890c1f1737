"""orpo's NLL over the chosen sequences' prompt and completion tokens (TRL's ORPOTrainer,
`loss.orpo_nll_prompt`): `logprobs.sequence_sums` covers each pair's whole chosen sequence once
in every batch layout (shared prompts, split segments, grouped prompt tails, unscored leading
tokens), and an orpo train step is the same in every layout and under gradient accumulation."""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from dpojax.config import frozen
from dpojax.data.layouts import LAYOUTS, Buckets, build_batch
from dpojax.data.tokenize import TokenizedPair
from dpojax.models import init_model
from dpojax.models.tiny import tiny_config
from dpojax.train.batches import pad_batch
from dpojax.train.forward import num_completions
from dpojax.train.logprobs import sequence_sums
from dpojax.train.loss_settings import LossSettings
from dpojax.train.optim import make_optimizer
from dpojax.train.state import StepConfig, create_train_state
from dpojax.train.step import Stepper
from tests.helpers.synthetic import micro_batches

P, VOCAB = 8, 64
BUCKETS = Buckets(lengths=(16, 32, 48))


def _ids(rng, n: int) -> np.ndarray:
    return rng.integers(3, VOCAB, size=n).astype(np.int32)


def _pairs(seed: int = 0) -> list[TokenizedPair]:
    """Seven pairs: three behind one prompt (a turn; one with a longer prompt, whose tail the
    grouped layout puts in its completions), one whose chosen sequence has unscored leading
    completion tokens, one without a prompt, two alone."""
    rng = np.random.default_rng(seed)
    shared = _ids(rng, 9)
    longer = np.concatenate([shared, _ids(rng, 3)])
    out = []
    for i, prompt in enumerate((shared, shared, longer)):
        chosen, rejected = _ids(rng, 3 + i), _ids(rng, 5 - i)
        out.append(TokenizedPair(prompt, chosen, rejected, len(prompt), len(prompt), i, "turn"))
    prompt = _ids(rng, 6)
    out.append(TokenizedPair(prompt, _ids(rng, 7), _ids(rng, 4), len(prompt) + 2, len(prompt), 3))
    out.append(TokenizedPair(_ids(rng, 0), _ids(rng, 5), _ids(rng, 6), 0, 0, 4))
    for i in (5, 6):
        prompt = _ids(rng, 12 + i)
        out.append(
            TokenizedPair(prompt, _ids(rng, 20), _ids(rng, 2 + i), len(prompt), len(prompt), i)
        )
    return out


@pytest.mark.parametrize("layout", LAYOUTS)
def test_sequence_sums_cover_each_chosen_sequence_once_in_every_layout(layout):
    """A value per token that depends on the token and its position only: each chosen
    completion's sequence sum is the sum over its sequence's tokens but the first."""
    pairs = _pairs()
    batch = build_batch(pairs, P, layout, BUCKETS)
    if layout in ("prefix_shared", "grouped"):  # the longest segments are split
        assert (batch["positions"] == 0).sum() > len(pairs) + (layout == "prefix_shared")
    values = batch["tokens"] * 100.0 + batch["positions"]
    sums, counts = sequence_sums(jnp.asarray(values), batch, num_completions(batch))
    for i, p in enumerate(pairs):
        seq = p.sequence("chosen")
        c = batch["chosen_index"][i]
        assert counts[c] == len(seq) - 1, (layout, i)
        assert sums[c] == (seq[1:] * 100.0 + np.arange(1, len(seq))).sum(), (layout, i)


@functools.cache
def _stepper() -> Stepper:
    """One jitted orpo step (SGD: Adam's first step would blow float noise in near-zero
    gradients up to lr-sized steps)."""
    cfg = StepConfig(loss=LossSettings(type="orpo", orpo_lambda=0.5), nll_prompt=True)
    tx, schedule = make_optimizer(0.5, schedule="constant", max_grad_norm=1.0, name="sgd")
    graphdef, _ = create_train_state(_model(), tx, cfg)
    return Stepper(graphdef, tx, schedule, cfg, False)


@functools.cache
def _model():
    return init_model(tiny_config("llama", vocab_size=VOCAB, num_layers=1), seed=4)


def _train(batches):
    """(metrics, weights) after one step over the micro-batches `batches` (one shape)."""
    stepper = _stepper()
    _, state = create_train_state(_model(), stepper.optimizer, stepper.cfg)
    state = jax.tree.map(jnp.copy, state)  # the step donates it: keep the cached model
    state, metrics = stepper.train(state, micro_batches(batches))
    return jax.device_get(metrics), [np.asarray(x) for x in jax.tree.leaves(state.params)]


def _padded(batch, rows: int = 16, length: int = 48):
    out = pad_batch(batch, rows, length)
    return {k: v for k, v in out.items() if k != "pair_ids"}


def _assert_same(got, want):
    (metrics, params), (want_metrics, want_params) = got, want
    for name in set(want_metrics) - {"tokens"}:  # the batch's tokens: fewer with shared prompts
        np.testing.assert_allclose(metrics[name], want_metrics[name], 1e-5, 1e-5, err_msg=name)
    for x, y in zip(params, want_params, strict=True):
        np.testing.assert_allclose(x, y, atol=1e-6)


# compiles the orpo train step for two shapes (about 15 s on 2 cores): the slow tier
@pytest.mark.slow
def test_an_orpo_step_is_the_same_in_every_layout_and_under_accumulation():
    pairs = _pairs()
    want = _train([_padded(build_batch(pairs, P, "padded", BUCKETS))])
    sequences = sum(len(p.sequence("chosen")) - 1 for p in pairs)
    completions = sum(p.num_scored("chosen") for p in pairs)
    assert sequences > completions  # the NLL's tokens: prompts included
    for layout in LAYOUTS[1:]:
        _assert_same(_train([_padded(build_batch(pairs, P, layout, BUCKETS))]), want)
    halves = [
        _padded(build_batch(part, P // 2, "padded", BUCKETS)) for part in (pairs[:4], pairs[4:])
    ]
    _assert_same(_train(halves), want)


def test_only_orpo_steps_take_the_prompt_into_the_nll():
    """`loss.orpo_nll_prompt` (default true) sets the step's `nll_prompt` for orpo alone: other
    losses' steps (cpo, sft, dpo) keep their score slots and completion-only NLL."""
    from dpojax.jobs.build import step_config
    from tests.helpers.repo_files import load_file

    config = load_file("configs/tiny_test.py").get_config()
    for loss_type, on in (("orpo", True), ("orpo,sft", True), ("cpo", False), ("sigmoid", False)):
        config.loss.type = loss_type
        assert step_config(frozen(config)).nll_prompt is on, loss_type
    config.loss.type, config.loss.orpo_nll_prompt = "orpo", False
    assert not step_config(frozen(config)).nll_prompt


def test_the_nll_arguments_replace_the_chosen_log_probs_in_the_nll_term_only():
    from dpojax.train.losses import preference_loss

    pc, pr = jnp.array([-3.0, -5.0]), jnp.array([-4.0, -4.5])
    lengths = jnp.array([2.0, 4.0])
    kw = dict(settings=LossSettings(type="orpo"), chosen_lengths=lengths, rejected_lengths=lengths)
    _, base = preference_loss(pc, pr, None, None, **kw)
    _, full = preference_loss(
        pc, pr, None, None, nll_chosen_logps=pc - 6.0, nll_chosen_lengths=lengths + 3.0, **kw
    )
    np.testing.assert_allclose(base["nll_loss"], 8.0 / 6.0, rtol=1e-6)
    np.testing.assert_allclose(full["nll_loss"], 20.0 / 12.0, rtol=1e-6)
    for name in ("log_odds_ratio", "rewards/chosen", "logps/chosen"):
        np.testing.assert_allclose(full[name], base[name], rtol=1e-6)
    odds = base["loss"] - base["nll_loss"]
    np.testing.assert_allclose(full["loss"] - full["nll_loss"], odds, rtol=1e-5)
