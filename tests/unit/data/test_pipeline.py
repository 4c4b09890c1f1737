"""The batch iterator: deterministic order, exact resume in a new process, per-host partitions."""

import json
import os
import random
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from dpojax.data.layouts import Buckets
from dpojax.data.pairs import PreferencePair
from dpojax.data.pipeline import BatchIterator, StepBatches, shuffled_order
from dpojax.data.tokenize import TokenizedPair, tokenize_pairs
from dpojax.models.tiny import _WORDS, build_tokenizer

ROOT = Path(__file__).resolve().parents[3]
BUCKETS = Buckets(lengths=(32, 64, 128))


def make_pairs() -> list[TokenizedPair]:
    """37 tokenized pairs: 10 turns of 1-6 pairs each (TTC metadata) and 6 loose pairs."""
    rng = random.Random(3)
    text = lambda n: " ".join(rng.choice(_WORDS) for _ in range(n))
    raw = []
    for turn in range(10):
        prompt = text(rng.randint(3, 30))
        for _ in range(1 + turn % 6):
            meta = {"example_id": f"ex{turn // 3}", "turn_id": turn}
            raw.append(PreferencePair(prompt, " " + text(rng.randint(1, 20)), " " + text(2), meta))
    raw += [PreferencePair(text(5), " " + text(3), " " + text(4)) for _ in range(6)]
    return tokenize_pairs(raw, build_tokenizer(), max_length=60).pairs


def make_iterator(pairs, layout: str, **kwargs) -> BatchIterator:
    return BatchIterator(pairs, batch_pairs=4, layout=layout, buckets=BUCKETS, seed=7, **kwargs)


def continue_from(state: dict, layouts: list[str], steps: int, out: str) -> None:
    """Run in a subprocess: restore each layout's iterator and save the next `steps` batches."""
    pairs = make_pairs()
    arrays = {}
    for layout in layouts:
        it = make_iterator(pairs, layout)
        it.restore(state[layout])
        for i in range(steps):
            for key, value in next(it).items():
                arrays[f"{layout}/{i}/{key}"] = value
    np.savez(out, **arrays)


@pytest.fixture(scope="module")
def pairs() -> list[TokenizedPair]:
    return make_pairs()


@pytest.mark.slow
def test_resume_in_a_new_process_is_exact(pairs, tmp_path):
    layouts, k, steps = ["packed", "grouped"], 9, 7  # 10 steps per epoch: crosses into epoch 1
    states, expected = {}, {}
    for layout in layouts:
        it = make_iterator(pairs, layout)
        for _ in range(k):
            next(it)
        states[layout] = json.loads(json.dumps(it.state()))
        for i in range(steps):
            for key, value in next(it).items():
                expected[f"{layout}/{i}/{key}"] = value
    out = tmp_path / "resumed.npz"
    code = (
        "import json, sys; from tests.unit.data.test_pipeline import continue_from; "
        "continue_from(json.loads(sys.argv[1]), sys.argv[2].split(','), int(sys.argv[3]), sys.argv[4])"
    )
    env = {**os.environ, "JAX_PLATFORMS": "cpu", "PYTHONPATH": str(ROOT)}
    subprocess.run(
        [sys.executable, "-c", code, json.dumps(states), ",".join(layouts), str(steps), str(out)],
        cwd=ROOT,
        env=env,
        check=True,
        timeout=120,
    )
    with np.load(out) as resumed:
        assert sorted(resumed.files) == sorted(expected)
        for key, value in expected.items():
            np.testing.assert_array_equal(resumed[key], value, err_msg=key)
            assert resumed[key].dtype == value.dtype


def test_order_is_a_function_of_seed_and_epoch(pairs):
    assert shuffled_order(10, 1, 0).tolist() == shuffled_order(10, 1, 0).tolist()
    assert sorted(shuffled_order(10, 1, 0).tolist()) == list(range(10))
    assert shuffled_order(50, 1, 0).tolist() != shuffled_order(50, 1, 1).tolist()
    assert shuffled_order(50, 1, 0).tolist() != shuffled_order(50, 2, 0).tolist()
    a, b = make_iterator(pairs, "padded"), make_iterator(pairs, "padded")
    for _ in range(15):
        x, y = next(a), next(b)
        assert all(np.array_equal(x[k], y[k]) for k in x)
    first = make_iterator(pairs, "padded", shuffle=False)
    assert next(first)["pair_ids"].tolist() == [p.pair_id for p in pairs[:4]]


def test_grouped_layout_keeps_turns_together(pairs):
    order = make_iterator(pairs, "grouped").epoch_order(0)
    groups = [pairs[i].group for i in order]
    runs = [g for i, g in enumerate(groups) if i == 0 or g != groups[i - 1]]
    assert len(runs) == len(set(groups))  # each group's pairs are consecutive


def test_group_size_cuts_large_groups_into_pieces_shuffled_apart(pairs):
    whole = make_iterator(pairs, "grouped")
    cut = make_iterator(pairs, "grouped", group_size=2)
    order = cut.epoch_order(0)
    assert sorted(order.tolist()) == list(range(len(pairs)))
    pieces = [m.tolist() for m in cut._group_members()]
    assert max(map(len, pieces)) == 2 and max(map(len, whole._group_members())) == 6
    # each piece is consecutive pairs of one group, in the data's order, and pieces of a group
    # are shuffled apart: some group's pieces are not next to each other
    assert all(len({pairs[i].group for i in m}) == 1 and m == sorted(m) for m in pieces)
    position = {i: n for n, i in enumerate(order.tolist())}
    starts = {tuple(m): position[m[0]] for m in pieces}
    assert all(position[i] == starts[tuple(m)] + k for m in pieces for k, i in enumerate(m))
    by_group = {}
    for m in pieces:
        by_group.setdefault(pairs[m[0]].group, []).append(starts[tuple(m)])
    assert any(max(s) - min(s) > 2 * (len(s) - 1) for s in by_group.values() if len(s) > 1)
    # fewer pairs share a prompt in a batch: more rows per batch than whole groups give
    rows = lambda it: sum(b["tokens"].shape[0] for b in it)
    assert rows(make_iterator(pairs, "grouped", group_size=2, num_epochs=1)) > rows(
        make_iterator(pairs, "grouped", num_epochs=1)
    )
    # the state records it: an iterator with other pieces cannot resume it
    with pytest.raises(ValueError, match="group_size"):
        whole.restore(cut.state())
    old = {k: v for k, v in whole.state().items() if k != "group_size"}  # saved before the key
    assert whole.restore(old) == []
    with pytest.raises(ValueError, match="group_size must be >= 0"):
        make_iterator(pairs, "grouped", group_size=-1)


@pytest.mark.parametrize("layout", ["padded", "grouped"])
def test_hosts_partition_the_data(pairs, layout):
    hosts = [make_iterator(pairs, layout, process_index=h, process_count=3) for h in range(3)]
    steps = hosts[0].steps_per_epoch
    assert steps == -(-len(pairs) // 12) and all(h.steps_per_epoch == steps for h in hosts)
    seen = []
    for _ in range(steps):
        for h in hosts:
            batch = next(h)
            seen += batch["pair_ids"][batch["pair_mask"] > 0].tolist()
            assert (batch["pair_ids"][batch["pair_mask"] == 0] == -1).all()
    assert sorted(seen) == sorted(p.pair_id for p in pairs)  # each pair once, on one host
    assert all(h.state()["epoch"] == 1 and h.state()["step"] == 0 for h in hosts)


def test_epochs_and_remainder(pairs):
    it = make_iterator(pairs, "prefix_shared", num_epochs=2, drop_remainder=True)
    batches = list(it)
    assert len(batches) == 2 * (len(pairs) // 4)
    assert all(b["pair_mask"].all() for b in batches)
    batches = list(make_iterator(pairs, "packed", num_epochs=1))
    assert len(pairs) == 37 and len(batches) == 10
    assert batches[-1]["pair_mask"].tolist() == [1, 0, 0, 0]  # the remainder, padded


def test_restore_checks_the_state(pairs):
    it = make_iterator(pairs, "packed")
    state = it.state()
    with pytest.raises(ValueError, match="seed"):
        BatchIterator(pairs, batch_pairs=4, layout="packed", seed=8).restore(state)
    with pytest.raises(ValueError, match="num_pairs"):
        make_iterator(pairs[:-1], "packed").restore(state)
    with pytest.raises(ValueError, match="position"):
        it.restore({**state, "step": 10_000})
    with pytest.raises(ValueError, match="not a"):
        it.restore({})
    with pytest.raises(ValueError, match="process_index"):
        make_iterator(pairs, "packed", process_index=2, process_count=2)


def test_state_restores_on_another_number_of_hosts(pairs):
    """A position taken on 2 hosts of 2 pairs each resumes on 1 host of 4 (the same global batch)
    and the other way round: the next global batches hold the same pairs."""
    two = [
        BatchIterator(
            pairs, batch_pairs=2, layout="padded", seed=7, process_index=h, process_count=2
        )
        for h in range(2)
    ]
    for _ in range(3):
        for h in two:
            next(h)
    one = make_iterator(pairs, "padded")
    one.restore(two[1].state())
    for _ in range(12):  # across the epoch boundary
        together = [i for h in two for i in next(h)["pair_ids"].tolist()]
        assert next(one)["pair_ids"].tolist() == together
    back = BatchIterator(
        pairs, batch_pairs=2, layout="padded", seed=7, process_index=1, process_count=2
    )
    back.restore(one.state())
    assert next(back)["pair_ids"].tolist() == next(one)["pair_ids"].tolist()[2:]
    with pytest.raises(ValueError, match="global_batch"):
        make_iterator(pairs, "padded", process_index=0, process_count=2).restore(one.state())


def test_restore_refuses_swapped_labels_with_the_same_lengths(pairs):
    """Before: the state hashed pair ids and token counts only, so one pair with its chosen and
    rejected completions swapped (same lengths) resumed silently on other data."""
    import dataclasses

    from dpojax.data.pipeline import DATA_KEYS, content_fingerprint

    it = make_iterator(pairs, "padded")
    next(it)
    state = it.state()
    swapped = list(pairs)
    p = swapped[5]
    swapped[5] = dataclasses.replace(
        p,
        chosen_ids=p.rejected_ids,
        rejected_ids=p.chosen_ids,
        chosen_prompt_len=p.rejected_prompt_len,
        rejected_prompt_len=p.chosen_prompt_len,
    )
    other = make_iterator(swapped, "padded")
    assert other.fingerprint == it.fingerprint  # the old check could not tell them apart
    assert content_fingerprint(swapped) != content_fingerprint(pairs)
    with pytest.raises(ValueError, match="content: saved"):
        other.restore(state)
    accepted = other.restore(state, allow_data_change=True)
    assert [line.split(":")[0] for line in accepted] == ["content"]
    assert (other.epoch, other.step) == (0, 1)
    assert set(DATA_KEYS) >= {"content"}
    with pytest.raises(ValueError, match="seed"):  # the override is for the data alone
        BatchIterator(swapped, batch_pairs=4, layout="padded", seed=8).restore(
            state, allow_data_change=True
        )
    old = {k: v for k, v in state.items() if k != "content"}  # saved before the content key
    make_iterator(pairs, "padded").restore(old)


def test_step_batches_are_the_next_micro_batches_and_resume_between_steps(pairs):
    """A step is the micro-batch iterator's next `micro_batches` batches (across an epoch's end:
    10 micro-batches an epoch, steps of 3), and a step iterator restored from another's state
    continues with the same steps."""
    steps = StepBatches(make_iterator(pairs, "packed"), 3)
    plain = make_iterator(pairs, "packed")
    for _ in range(4):  # 12 micro-batches
        step = next(steps)
        assert len(step) == 3
        for got in step:
            want = next(plain)
            assert got.keys() == want.keys()
            assert all(np.array_equal(got[k], want[k]) for k in want)
    assert steps.state() == plain.state() and (plain.epoch, plain.step) == (1, 2)
    assert steps.content == plain.content  # what the processes of a run compare
    resumed = StepBatches(make_iterator(pairs, "packed"), 3)
    assert resumed.restore(steps.state()) == []
    for got, want in zip(next(resumed), next(steps), strict=True):
        assert all(np.array_equal(got[k], want[k]) for k in want)
    with pytest.raises(ValueError, match="micro_batches must be >= 1"):
        StepBatches(plain, 0)
