"""Precomputed reference log-probs: equal to the live reference, cached under the right key."""

import numpy as np
import pytest

from dpojax.data.pipeline import BatchIterator
from dpojax.data.tokenize import TokenizedPair
from dpojax.models import init_model
from dpojax.train import reference as ref_mod
from dpojax.train.loss_settings import LossSettings
from dpojax.train.optim import make_optimizer
from dpojax.train.reference import attach_reference, precomputed_reference
from dpojax.train.state import StepConfig, create_train_state
from dpojax.train.step import Stepper
from tests.helpers.synthetic import copy_task, micro_batches, padded_batch
from tests.unit.train.test_step import VOCAB, _config


def _batches(n_batches=3, per=4, seed=0):
    triples = copy_task(n_batches * per, seed, VOCAB)
    out = []
    for b in range(n_batches):
        batch = padded_batch(triples[b * per : (b + 1) * per], 8)
        batch["pair_ids"] = np.arange(b * per, (b + 1) * per)
        out.append(batch)
    return out


def _assert_live_reference_equals(model, cfg, batches, chosen, rejected):
    """The frozen reference that the step evaluates with `cfg` gives `chosen` / `rejected`."""
    tx, sched = make_optimizer(1e-3)
    graphdef, state = create_train_state(model, tx, cfg)
    live = Stepper(graphdef, tx, sched, cfg, False)
    for batch in batches:
        out = live.evaluate(state, batch)
        np.testing.assert_allclose(chosen[batch["pair_ids"]], out["ref_chosen_logps"], atol=1e-5)
        np.testing.assert_allclose(
            rejected[batch["pair_ids"]], out["ref_rejected_logps"], atol=1e-5
        )


@pytest.mark.slow
def test_precomputed_equals_live_reference_and_is_cached(tmp_path, monkeypatch):
    model = init_model(_config(), seed=0)
    batches = _batches()
    kw = dict(cache_dir=tmp_path, data_fingerprint="data-v1", settings={"max_length": 8})
    chosen, rejected, cached = precomputed_reference(model, lambda: batches, 12, **kw)
    assert not cached
    assert len(list(tmp_path.glob("reference_logps_*.npz"))) == 1

    # live reference on the same batches
    _assert_live_reference_equals(
        model, StepConfig(loss=LossSettings(type="sigmoid")), batches, chosen, rejected
    )

    # a second call reads the cache and computes nothing
    def fail(*a, **k):
        raise AssertionError("recomputed despite a cache hit")

    monkeypatch.setattr(ref_mod, "compute_reference_logps", fail)
    again_c, again_r, cached = precomputed_reference(model, lambda: batches, 12, **kw)
    assert cached
    np.testing.assert_array_equal(again_c, chosen)
    # other weights, data or settings -> another key -> recomputed
    for changed in (
        dict(kw, data_fingerprint="data-v2"),
        dict(kw, settings={"max_length": 16}),
    ):
        with pytest.raises(AssertionError, match="recomputed"):
            precomputed_reference(model, lambda: batches, 12, **changed)
    with pytest.raises(AssertionError, match="recomputed"):
        precomputed_reference(init_model(_config(), seed=1), lambda: batches, 12, **kw)


def test_missing_pairs_are_reported_and_attach_handles_padding():
    model = init_model(_config(), seed=0)
    with pytest.raises(ValueError, match="no batch for 4 of 12 pairs"):
        ref_mod.compute_reference_logps(model, _batches()[:2], 12)
    batch = micro_batches(_batches(1))
    batch["pair_ids"][0, -1] = -1
    out = attach_reference(batch, np.arange(4.0), -np.arange(4.0))
    np.testing.assert_array_equal(out["ref_chosen_logps"], [[0, 1, 2, 0]])
    np.testing.assert_array_equal(out["ref_rejected_logps"], [[0, -1, -2, 0]])


@pytest.mark.slow
def test_precomputed_reference_is_length_desensitised_like_the_live_one(tmp_path):
    """LD-DPO (ld_alpha): the cached reference sums get the same token weights as the frozen
    reference's in the step, and a cache computed without them is not reused."""
    model = init_model(_config(), seed=0)
    rng = np.random.default_rng(3)
    batches = []
    for b in range(3):  # completions of different lengths (LD-DPO weighs the longer one's tail)
        triples = [
            (rng.integers(3, VOCAB, 4), rng.integers(3, VOCAB, 1 + i), rng.integers(3, VOCAB, 3))
            for i in range(4)
        ]
        batch = padded_batch(triples, 12)
        batch["pair_ids"] = np.arange(b * 4, (b + 1) * 4)
        batches.append(batch)
    kw = dict(cache_dir=tmp_path, data_fingerprint="data-v1", settings={"max_length": 12})
    plain_c, _, _ = precomputed_reference(model, lambda: batches, 12, **kw)
    chosen, rejected, cached = precomputed_reference(model, lambda: batches, 12, ld_alpha=0.5, **kw)
    assert not cached  # another key than the plain sums'
    assert not np.allclose(chosen, plain_c)  # the weights change the sums
    cfg = StepConfig(loss=LossSettings(type="sigmoid", ld_alpha=0.5))
    _assert_live_reference_equals(model, cfg, batches, chosen, rejected)


def _tokenized(triples, first_id=0):
    return [
        TokenizedPair(
            np.asarray(p, np.int32),
            np.asarray(c, np.int32),
            np.asarray(r, np.int32),
            len(p),
            len(p),
            pair_id=first_id + i,
        )
        for i, (p, c, r) in enumerate(triples)
    ]


def _batches_for(pairs):
    return BatchIterator(pairs, batch_pairs=4, layout="prefix_shared", shuffle=False, num_epochs=1)


def test_the_per_pair_store_computes_only_the_pairs_it_lacks(tmp_path, monkeypatch, caplog):
    """A loop's rounds replay earlier pairs under new ids in new files: the store keyed by each
    pair's tokens computes only the new ones, once each, and gives what a whole pass gives."""
    model = init_model(_config(), seed=0)
    triples = copy_task(12, 0, VOCAB)
    real = ref_mod.compute_reference_logps
    computed = []

    def counting(model, batches, num_pairs, **kw):
        batches = list(batches)
        computed.append(sum(int((b["pair_ids"] >= 0).sum()) for b in batches))
        return real(model, batches, num_pairs, **kw)

    monkeypatch.setattr(ref_mod, "compute_reference_logps", counting)
    kw = dict(cache_dir=tmp_path, data_fingerprint="unused", settings={"max_length": 8})

    def stored(m, pairs):
        n = max(p.pair_id for p in pairs) + 1
        return precomputed_reference(m, None, n, pairs=pairs, batches_for=_batches_for, **kw)

    first = _tokenized(triples[:8])
    c1, r1, cached = stored(model, first)
    assert not cached and computed == [8]
    assert len(list(tmp_path.glob("reference_pairs_*.npz"))) == 1
    # other data: pairs 4-11 under new ids, pair 11 twice: 4 stored, 4 distinct new ones
    second = _tokenized(triples[4:12] + [triples[11]], first_id=100)
    c2, r2, cached = stored(model, second)
    assert not cached and computed == [8, 4]
    np.testing.assert_array_equal(c2[100:104], c1[4:8])
    np.testing.assert_array_equal(r2[100:104], r1[4:8])
    assert c2[107] == c2[108] and r2[107] == r2[108]
    assert np.isnan(c2[:100]).all()  # ids the data does not use
    whole_c, whole_r = real(model, _batches_for(second), 109, complete=False)
    np.testing.assert_allclose(c2[100:], whole_c[100:], atol=1e-5)
    np.testing.assert_allclose(r2[100:], whole_r[100:], atol=1e-5)
    # all stored now: nothing computed
    again_c, _, cached = stored(model, second)
    assert cached and computed == [8, 4]
    np.testing.assert_array_equal(again_c[100:], c2[100:])
    # other weights: another store; a damaged store is ignored with a warning and rewritten
    stored(init_model(_config(), seed=1), first)
    assert computed == [8, 4, 8] and len(list(tmp_path.glob("reference_pairs_*.npz"))) == 2
    for path in tmp_path.glob("reference_pairs_*.npz"):
        path.write_bytes(b"not a store")
    _, _, cached = stored(model, first)
    assert not cached and computed == [8, 4, 8, 8]
    assert "ignoring the unreadable reference log-prob store" in caplog.text
