"""Multi-process pieces that run in one process: the parts of a global batch (padding, slot
numbering, score slots), data partitions, and the exchange helpers' single-process behaviour.
The multi-process runs themselves are in tests/multiprocess/test_multihost.py."""

import jax
import numpy as np
import pytest

from dpojax.data.layouts import Buckets, build_batch
from dpojax.data.tokenize import TokenizedPair
from dpojax.models import init_model
from dpojax.models.sharding import make_mesh
from dpojax.models.tiny import tiny_config
from dpojax.train import batches, hosts
from dpojax.train.batches import score_slot_width, score_slots
from dpojax.train.loss_settings import LossSettings
from dpojax.train.optim import make_optimizer
from dpojax.train.state import StepConfig, create_train_state
from dpojax.train.step import Stepper

VOCAB = 64


def _pairs(n: int, seed: int) -> list[TokenizedPair]:
    rng = np.random.default_rng(seed)
    out = []
    for i in range(n):
        prompt = rng.integers(3, VOCAB, size=int(rng.integers(2, 30)))
        chosen = rng.integers(3, VOCAB, size=int(rng.integers(1, 12)))
        rejected = rng.integers(3, VOCAB, size=int(rng.integers(1, 12)))
        out.append(TokenizedPair(prompt, chosen, rejected, len(prompt), len(prompt), pair_id=i))
    return out


@pytest.mark.slow
@pytest.mark.parametrize("layout", ["padded", "prefix_shared"])
def test_parts_of_a_global_batch_give_the_whole_batch_results(layout):
    """Two processes' parts (different row counts and lengths, padded to one shape, slots
    renumbered, one score-slot width) concatenated: per-pair log-probs equal to one batch of
    all the pairs."""
    pairs = _pairs(8, seed=0)
    buckets = Buckets(lengths=(16, 32, 64, 128))
    model = init_model(tiny_config("llama", vocab_size=VOCAB), seed=0)
    tx, _ = make_optimizer(1e-3)
    cfg = StepConfig(loss=LossSettings(type="sigmoid", beta=0.1))
    graphdef, state = create_train_state(model, tx, cfg)
    stepper = Stepper(graphdef, tx, None, cfg, False)
    whole = stepper.evaluate(state, build_batch(pairs, 8, layout, buckets))

    parts = [build_batch(pairs[:4], 4, layout, buckets), build_batch(pairs[4:], 4, layout, buckets)]
    shapes = [p["tokens"].shape for p in parts]
    assert shapes[0] != shapes[1]  # the agreement below has something to do
    rows, length = (max(s[i] for s in shapes) for i in (0, 1))
    scored = max(int((p["completion_ids"] >= 0).sum(-1).max()) for p in parts)
    width = 16 * -(-scored // 16)
    local = [
        batches.part_arrays(p, rows=rows, length=length, width=width, offset=8 * i, lead=0)
        for i, p in enumerate(parts)
    ]
    assert all(x["tokens"].shape == (rows, length) for x in local)
    assert all(x["score_slots"].shape == (rows, width) for x in local)
    joined = {k: np.concatenate([x[k] for x in local]) for k in local[0]}
    joined["pair_ids"] = np.concatenate([p["pair_ids"] for p in parts])
    out = stepper.evaluate(state, joined)
    for key in ("policy_chosen_logps", "policy_rejected_logps", "losses"):
        np.testing.assert_allclose(out[key], whole[key], atol=1e-5)
    assert out["pair_ids"].tolist() == whole["pair_ids"].tolist() == list(range(8))


def test_score_slots_of_a_given_width():
    batch = build_batch(_pairs(4, seed=1), 4, "padded", Buckets(lengths=(256,)))
    own = score_slots(batch["completion_ids"])
    most = int((batch["completion_ids"] >= 0).sum(-1).max())
    assert own.shape == (8, score_slot_width(most, 256)) and most <= own.shape[-1] < 256
    wider = score_slots(batch["completion_ids"], width=own.shape[-1] + 3)
    np.testing.assert_array_equal(wider[:, : own.shape[-1]], own)
    assert (wider[:, own.shape[-1] :] == -1).all()


def test_partition_positions_follow_the_blocks():
    contiguous = hosts.DataPartition(1, 2, ((0, 1), (2, 3)), 4, (0, 2))
    assert contiguous.positions(4).tolist() == [[0, 1, 2, 3], [4, 5, 6, 7]]
    interleaved = hosts.DataPartition(0, 2, ((0, 2), (1, 3)), 4, (0, 1))
    assert interleaved.positions(4).tolist() == [[0, 1, 4, 5], [2, 3, 6, 7]]


def test_one_process_is_one_partition_and_exchanges_are_identities():
    mesh = make_mesh(2, 2, 2)  # the 8 fake devices of this process
    assert not hosts.spans_processes(mesh)
    assert hosts.data_partition(mesh) == hosts.SINGLE == hosts.data_partition(None)
    assert hosts.allgather_json({"a": [1, 2]}) == [{"a": [1, 2]}]
    assert hosts.broadcast_json({"b": 1.5}) == {"b": 1.5}
    assert hosts.any_process(True) and not hosts.any_process(False)
    hosts.barrier("nothing to wait for")
    assert jax.process_count() == 1


def test_a_mesh_that_splits_the_batch_unevenly_over_processes_is_a_config_error(monkeypatch):
    """Before: a ValueError, which the command line reported as bad data (exit 3); on one
    process the same mesh is a config error (exit 2)."""
    from types import SimpleNamespace

    from dpojax.errors import EXIT_CONFIG, exit_code_of

    class Device:
        def __init__(self, process_index):
            self.process_index = process_index

    # Three processes' devices over a data axis of 4: process 0 holds blocks 0 and 1, the
    # others one each (an unequal split).
    devices = [Device(p) for p in (0, 0, 1, 2)]
    mesh = SimpleNamespace(devices=np.array(devices), shape={"data": 4, "fsdp": 1, "tensor": 1})

    class Sharding:
        def __init__(self, mesh, spec):
            pass

        def devices_indices_map(self, shape):
            return {d: (slice(i, i + 1),) for i, d in enumerate(devices)}

    monkeypatch.setattr(hosts, "NamedSharding", Sharding)
    with pytest.raises(ValueError) as info:
        hosts.data_partition(mesh)
    assert exit_code_of(info.value) == EXIT_CONFIG
    assert str(info.value).startswith(
        "config keys 'mesh.data', 'mesh.fsdp', 'mesh.context', 'mesh.tensor': the mesh {'data': 4"
    )
