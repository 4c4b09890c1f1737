"""kto / apo_zero_unpaired in every batch layout and with a precomputed reference: one jitted
train step's loss, metrics and updated weights, and the per-example log-probs, equal the padded
layout's with a frozen reference (float32, 1e-5); the reference cache tells unpaired data (its
labels, its KL partners) apart from anything else."""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from dpojax.data.layouts import LAYOUTS, Buckets, build_batch
from dpojax.data.pipeline import BatchIterator, content_fingerprint
from dpojax.data.tokenize import TokenizedPair
from dpojax.data.unpaired import UnpairedExample
from dpojax.data.unpaired_tokens import tokenize_unpaired
from dpojax.models import init_model
from dpojax.models.tiny import build_tokenizer, tiny_config
from dpojax.train.batches import part_arrays
from dpojax.train.loss_settings import LossSettings
from dpojax.train.optim import make_optimizer
from dpojax.train.reference import attach_reference, pair_content_keys, precomputed_reference
from dpojax.train.reference_choice import KINDS
from dpojax.train.state import StepConfig, create_train_state
from dpojax.train.step import Stepper
from tests.helpers.synthetic import micro_batches

BOARD = "Board:\nX.O\n.X.\n..O\nYou are X. Your move:"
CHAT = [{"role": "user", "content": "Your move?"}]
P = 8  # examples per batch (7 real, one padding example)
BUCKETS = Buckets(lengths=(32, 64))
# every layout's batch is padded to this shape, score slots this wide: one compile for all
ROWS, LENGTH, WIDTH = 16, 64, 48


@pytest.fixture(scope="module")
def tok():
    return build_tokenizer()


def _examples() -> list[UnpairedExample]:
    """A decision point with three candidates (one prompt), two on a chat prompt, two alone."""
    turn = {"example_id": "e", "turn_id": 2}
    return [
        UnpairedExample(BOARD, " 1", True, dict(turn)),
        UnpairedExample(BOARD, " 7 wins", False, dict(turn)),
        UnpairedExample(BOARD, " 9", True, dict(turn)),
        UnpairedExample(CHAT, "the center", True),
        UnpairedExample(CHAT, "5", False),
        UnpairedExample("The boa", "rd", False),
        UnpairedExample("You are X. Your move:", " 5 because the corner wins", True),
    ]


def _tokenized(tok, kl_batch_size: int = P) -> list[TokenizedPair]:
    return tokenize_unpaired(_examples(), tok, kl_batch_size=kl_batch_size).pairs


@functools.cache
def _model(vocab: int, seed: int = 4):
    return init_model(tiny_config("llama", vocab_size=vocab, num_layers=1), seed=seed)


@functools.cache
def _stepper(vocab: int, loss_type: str, reference: str) -> Stepper:
    """One jitted step per loss and reference type, for every layout (SGD: Adam's first step
    would blow float noise in near-zero gradients up to lr-sized steps)."""
    cfg = StepConfig(loss=LossSettings(type=loss_type, beta=0.5), reference=KINDS[reference]())
    tx, schedule = make_optimizer(0.5, schedule="constant", max_grad_norm=1.0, name="sgd")
    graphdef, _ = create_train_state(_model(vocab), tx, cfg)
    return Stepper(graphdef, tx, schedule, cfg, False)


def _run(vocab: int, batch, loss_type: str, reference: str = "frozen"):
    """(train metrics, the weights after one step, eval outputs) of one batch, the policy
    `_model(vocab)` and the reference `_model(vocab, seed=3)` (another model, so that the
    rewards and the KL estimate are not 0)."""
    stepper = _stepper(vocab, loss_type, reference)
    ref = _model(vocab, seed=3) if reference == "frozen" else None
    _, state = create_train_state(_model(vocab), stepper.optimizer, stepper.cfg, reference=ref)
    state = jax.tree.map(jnp.copy, state)  # the train step donates it: keep the cached models
    out = jax.device_get(stepper.evaluate(state, batch))
    state, metrics = stepper.train(state, micro_batches([batch]))
    params = [np.asarray(x) for x in jax.tree.leaves(state.params)]
    return jax.device_get(metrics), params, out


def _batch(pairs, layout: str) -> dict[str, np.ndarray]:
    batch = build_batch(pairs, P, layout, BUCKETS)
    assert batch["labels"].tolist() == [p.label for p in pairs] + [0] * (P - len(pairs))
    assert (batch["completion_ids"] >= 0).sum(-1).max() <= WIDTH
    out = part_arrays(batch, rows=ROWS, length=LENGTH, width=WIDTH, offset=0, lead=0)
    return {**out, "pair_ids": batch["pair_ids"]}


def _assert_same_step(got, want):
    metrics, params, out = got
    want_metrics, want_params, want_out = want
    assert set(metrics) == set(want_metrics)
    for name in set(want_metrics) - {"tokens"}:  # the batch's tokens: fewer with shared prompts
        np.testing.assert_allclose(metrics[name], want_metrics[name], atol=1e-5, err_msg=name)
    real = want_out["pair_ids"] >= 0  # a padding example's reference log-probs are anything
    for name in ("policy", "ref"):
        for which in ("chosen", "rejected"):  # own and KL completions
            key = f"{name}_{which}_logps"
            np.testing.assert_allclose(out[key][real], want_out[key][real], atol=1e-5, err_msg=key)
    np.testing.assert_allclose(out["losses"], want_out["losses"], atol=1e-5)
    for x, y in zip(params, want_params, strict=True):
        np.testing.assert_allclose(x, y, atol=1e-5)


# each loss type compiles its train and eval steps (10-35 s on 2 cores): the slow tier
@pytest.mark.slow
@pytest.mark.parametrize("loss_type", ["kto", "apo_zero_unpaired"])
def test_every_layout_steps_like_the_padded_one(tok, loss_type):
    pairs = _tokenized(tok)
    want = _run(len(tok), _batch(pairs, "padded"), loss_type)
    assert want[0]["kl"] > 0 if loss_type == "kto" else want[0]["kl"] == 0
    for layout in LAYOUTS[1:]:
        batch = _batch(pairs, layout)
        if layout == "grouped":  # a turn's candidates and KL completions behind one prompt
            slots = np.concatenate([batch["chosen_index"][:7], batch["rejected_index"][:7]])
            assert len(np.unique(slots)) < 14
        _assert_same_step(_run(len(tok), batch, loss_type), want)


@pytest.mark.slow  # a third step config and the reference pass compile (about 10 s)
def test_precomputed_reference_steps_like_the_frozen_one(tok, tmp_path):
    """The reference pass caches the own and the KL completion's log-probs per example; the step
    then reads them from the batch (prefix_shared batches for the pass, grouped ones to train)."""
    pairs = _tokenized(tok)

    def batches_for(subset):
        return BatchIterator(
            subset, batch_pairs=P, layout="prefix_shared", buckets=BUCKETS, shuffle=False,
            num_epochs=1,
        )  # fmt: skip

    own, kl, cached = precomputed_reference(
        _model(len(tok), seed=3),
        lambda: batches_for(pairs),
        len(pairs),
        cache_dir=tmp_path,
        data_fingerprint="unused with pairs",
        settings={},
        pairs=pairs,
        batches_for=batches_for,
    )
    assert not cached and not np.isnan(own).any() and not np.isnan(kl).any()
    batch = _batch(pairs, "grouped")
    want = _run(len(tok), batch, "kto")
    got = _run(len(tok), attach_reference(batch, own, kl), "kto", "precomputed")
    _assert_same_step(got, want)


def test_reference_cache_keys_cover_labels_and_kl_partners(tok):
    """A paired twin of an example (the same tokens, no label) and an example whose KL partner
    changed with the micro-batch size (train.batch_size) never share a stored log-prob, nor does
    the data fingerprint (a whole-data cache's key) stay the same."""
    by8, by4 = _tokenized(tok, 8), _tokenized(tok, 4)
    paired = [
        TokenizedPair(
            p.prompt_ids, p.chosen_ids, p.rejected_ids, p.chosen_prompt_len,
            p.rejected_prompt_len, pair_id=p.pair_id, group=p.group,
        )
        for p in by8
    ]  # fmt: skip
    keys8, keys4, keys_paired = (pair_content_keys(x) for x in (by8, by4, paired))
    assert not (keys8 == keys_paired).all(-1).any()
    moved = [
        i for i in range(len(by8)) if not np.array_equal(by8[i].rejected_ids, by4[i].rejected_ids)
    ]
    assert moved  # the rotation runs over 4 examples instead of 8
    assert not (keys8[moved] == keys4[moved]).all(-1).any()
    prints = {content_fingerprint(x) for x in (by8, by4, paired)}
    assert len(prints) == 3
