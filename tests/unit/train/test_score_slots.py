"""The LM head on the scored slots only (`score_slots`) gives the log-probs, losses and gradients
of the head on every position."""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx

from dpojax.models import init_model
from dpojax.models.tiny import tiny_config
from dpojax.train.batches import score_slot_width, score_slots, with_score_slots
from dpojax.train.forward import completion_logps
from dpojax.train.loss_settings import LossSettings
from dpojax.train.state import StepConfig, split_policy
from dpojax.train.step import Stepper
from tests.helpers.synthetic import padded_batch


def test_score_slots_lists_each_rows_scored_positions_in_order():
    ids = np.full((2, 3, 200), -1, np.int32)
    ids[0, 0, 10:15] = 0
    ids[0, 1, 150:190] = 1
    ids[0, 1, 5] = 2
    ids[1, 2, 0:70] = 3  # the most in any row: 70 -> width 128
    slots = score_slots(ids)
    assert slots.shape == (2, 3, 128) and slots.dtype == np.int32
    assert slots[0, 0, :5].tolist() == list(range(10, 15)) and (slots[0, 0, 5:] == -1).all()
    assert slots[0, 1, :41].tolist() == [5, *range(150, 190)] and (slots[0, 1, 41:] == -1).all()
    assert slots[1, 2, :70].tolist() == list(range(70)) and (slots[1, 0] == -1).all()
    # never wider than the row, at least one multiple; rows that score a quarter of their length
    # or less: the smallest power of two from 8 that holds them, where that is narrower
    assert score_slots(np.zeros((1, 100), np.int32)).shape == (1, 100)
    assert score_slots(np.full((1, 100), -1, np.int32)).shape == (1, 8)
    assert score_slots(ids, multiple=8).shape == (2, 3, 72)
    widths = {most: score_slot_width(most, 1000) for most in (0, 5, 8, 9, 16, 17, 33, 64, 65)}
    assert widths == {0: 8, 5: 8, 8: 8, 9: 16, 16: 16, 17: 32, 33: 64, 64: 64, 65: 128}
    assert score_slot_width(8, 48) == 8 and score_slot_width(13, 48) == 48  # 13 > 48 / 4
    assert score_slot_width(32, 64) == 64 and score_slot_width(16, 64) == 16
    assert score_slot_width(65, 1000, multiple=64) == 128


def test_with_score_slots_only_when_fewer_than_the_row():
    short = {"completion_ids": np.zeros((2, 64), np.int32)}
    assert "score_slots" not in with_score_slots(short)
    long = {"completion_ids": np.where(np.arange(256) < 200, -1, 0)[None].astype(np.int32)}
    assert with_score_slots(long)["score_slots"].shape == (1, 64)


def _long_prompt_batch(seed=0, vocab=300):
    """Padded pairs with 150-220-token prompts and 3-40-token completions (rows of 256)."""
    rng = np.random.default_rng(seed)
    triples = []
    for _ in range(3):
        prompt = rng.integers(3, vocab, size=int(rng.integers(150, 220))).tolist()
        chosen = rng.integers(3, vocab, size=int(rng.integers(3, 40))).tolist()
        rejected = rng.integers(3, vocab, size=int(rng.integers(3, 40))).tolist()
        triples.append((prompt, chosen, rejected))
    return padded_batch(triples, 256)


@pytest.mark.slow
@pytest.mark.parametrize(
    "cfg",
    [
        StepConfig(vocab_chunk=128),
        StepConfig(vocab_chunk=None, loss=LossSettings(ld_alpha=0.5)),
        StepConfig(vocab_chunk=64, loss=LossSettings(use_weighting=True)),
    ],
    ids=["chunked", "ld_alpha", "wpo"],
)
def test_scored_slots_equal_every_position(cfg):
    model = init_model(tiny_config("llama", vocab_size=300), seed=0)
    graphdef, params, frozen, _ = split_policy(model)
    batch = _long_prompt_batch()
    slotted = with_score_slots(batch)
    assert slotted["score_slots"].shape == (6, 64)  # 256 -> 64 head positions per row
    full = {k: jnp.asarray(v) for k, v in batch.items()}
    part = {k: jnp.asarray(v) for k, v in slotted.items()}

    def logps(params, b):
        return completion_logps(nnx.merge(graphdef, frozen, params), b, cfg)

    ref, ours = logps(params, full), logps(params, part)
    assert float(jnp.abs(ref["sums"]).min()) > 10.0
    for key in ref:
        np.testing.assert_allclose(ours[key], ref[key], rtol=1e-5, atol=1e-4)

    weights = jax.random.normal(jax.random.PRNGKey(1), ref["sums"].shape)

    def loss(params, b):
        return (logps(params, b)["sums"] * weights).sum()

    g_ref = jax.grad(loss)(params, full)
    g_ours = jax.jit(jax.grad(loss))(params, part)
    for a, b in zip(jax.tree.leaves(g_ref), jax.tree.leaves(g_ours), strict=True):
        np.testing.assert_allclose(b, a, rtol=1e-4, atol=1e-5)


def test_the_stepper_puts_score_slots_on_long_prompt_batches():
    model = init_model(tiny_config("llama", vocab_size=300), seed=0)
    graphdef, params, _, _ = split_policy(model)

    stepper = Stepper(graphdef, optax.sgd(0.1), None, StepConfig(), is_lora=False)
    put, _ = stepper.put(_long_prompt_batch(), micro_axis=False)
    assert put["score_slots"].shape == (6, 64)
    # two scored tokens a row: 8 slots on 16-token rows, none on 8-token rows (8 >= L)
    short = padded_batch([([5, 6, 7], [8, 9], [10])], 16)
    assert stepper.put(short, micro_axis=False)[0]["score_slots"].shape == (2, 8)
    shorter = padded_batch([([5, 6, 7], [8, 9], [10])], 8)
    assert "score_slots" not in stepper.put(shorter, micro_axis=False)[0]
