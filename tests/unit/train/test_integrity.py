"""Checkpoint content checksums: the same however an array is sharded, and changed by any
changed, moved or retyped element."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import NamedSharding, PartitionSpec

from dpojax.train.integrity import (
    array_checksums,
    compare,
    seal,
    shard_checksums,
    unseal,
)


def _problems(record, extra, restored):
    return compare(record, extra, restored)[0]


def _leaves():
    rng = np.random.default_rng(0)
    return {
        ("w",): jnp.asarray(rng.standard_normal((8, 12)), jnp.float32),
        ("b",): jnp.asarray(rng.standard_normal(16), jnp.bfloat16),
        ("n",): jnp.arange(24, dtype=jnp.int32).reshape(8, 3),
        ("step",): jnp.int32(7),
    }


@pytest.mark.slow  # compiles the reduction for three shardings
@pytest.mark.skipif(jax.device_count() < 8, reason="needs 8 (fake) devices")
def test_a_checksum_does_not_depend_on_the_sharding():
    """Each process of a multi-process run reduces its own shards; the sum is the same."""
    leaves = _leaves()
    mesh = jax.make_mesh((4, 2), ("a", "b"))
    spread = {
        ("w",): jax.device_put(leaves[("w",)], NamedSharding(mesh, PartitionSpec("a", "b"))),
        ("b",): jax.device_put(leaves[("b",)], NamedSharding(mesh, PartitionSpec(("a", "b")))),
        ("n",): jax.device_put(leaves[("n",)], NamedSharding(mesh, PartitionSpec("a"))),
        ("step",): leaves[("step",)],
    }
    assert array_checksums(spread) == array_checksums(leaves)


def test_any_changed_or_moved_element_changes_the_checksum():
    leaves = _leaves()
    base = array_checksums(leaves)
    assert base["w"].startswith("float32:") and base["b"].startswith("bfloat16:")
    w = leaves[("w",)]
    changed = {
        "one bit": w.view(jnp.uint32).at[3, 5].add(1).view(jnp.float32),
        "two swapped": w.at[0, 0].set(w[0, 1]).at[0, 1].set(w[0, 0]),
        "last element": w.at[7, 11].set(0.0),
    }
    for what, value in changed.items():
        assert array_checksums({("w",): value})["w"] != base["w"], what


def test_sealed_extra_and_arrays_verify_and_report_what_differs():
    leaves = _leaves()
    saved = seal({"step": 3}, leaves)
    extra, record = unseal(saved)
    assert extra == {"step": 3} and _problems(record, extra, leaves) == []
    hurt = {**leaves, ("w",): leaves[("w",)].at[1, 1].set(2.0)}
    assert _problems(record, {"step": 4}, hurt) == ["extra", "w"]
    # restored in another dtype (a cast): not comparable, left out; a missing array is named
    cast = {**leaves, ("b",): leaves[("b",)].astype(jnp.float32)}
    del cast[("n",)]
    assert _problems(record, extra, cast) == ["n (recorded, not restored)"]
    assert unseal({"step": 3}) == ({"step": 3}, None)


def _spread(leaves, mesh, specs=(("a", "b"), (("a", "b"),), ("a",))):
    """The leaves sharded over `mesh` (w, b, n by `specs`; step on one device)."""
    return {
        **{
            k: jax.device_put(leaves[k], NamedSharding(mesh, PartitionSpec(*spec)))
            for k, spec in zip((("w",), ("b",), ("n",)), specs, strict=True)
        },
        ("step",): leaves[("step",)],
    }


def _flip_a_byte(x: jax.Array, row: int, col: int) -> jax.Array:
    """`x` with one byte of element [row, col] changed, in the same sharding."""
    raw = np.array(x)
    raw[row : row + 1, col : col + 1].view(np.uint8)[0, 0] ^= 0x10
    return jax.device_put(raw, x.sharding)


@pytest.mark.skipif(jax.device_count() < 8, reason="needs 8 (fake) devices")
def test_a_shard_record_names_the_changed_shard():
    """Multi-process runs (format 2): each process hashes its replica-0 shards, keyed by their
    place; here one process holds all 8 devices' shards. Before: no array checksums at all."""
    mesh = jax.make_mesh((4, 2), ("a", "b"))
    spread = _spread(_leaves(), mesh)
    extra, record = unseal(seal({"step": 3}, spread, shards=True))
    assert record["format"] == 2 and "arrays" not in record
    assert sorted(record["shards"]["w"]) == [
        f"[{r}:{r + 2},{c}:{c + 6}]" for r in (0, 2, 4, 6) for c in (0, 6)
    ]
    assert list(record["shards"]["n"]) == ["[0:2,0:3]", "[2:4,0:3]", "[4:6,0:3]", "[6:8,0:3]"]
    assert record["shards"]["step"] == {"[]": array_checksums({("s",): spread[("step",)]})["s"]}
    assert compare(record, extra, spread) == ([], [])
    hurt = {**spread, ("w",): _flip_a_byte(spread[("w",)], 5, 7)}
    assert _problems(record, extra, hurt) == ["w [4:6,6:12]"]
    assert _problems(record, {"step": 4}, hurt) == ["extra", "w [4:6,6:12]"]
    # restored in another dtype (a cast): left out; a missing array is named
    cast = {**spread, ("b",): spread[("b",)].astype(jnp.float32)}
    del cast[("n",)]
    assert compare(record, extra, cast) == (["n (recorded, not restored)"], [])


@pytest.mark.skipif(jax.device_count() < 8, reason="needs 8 (fake) devices")
def test_arrays_restored_in_another_layout_are_unchecked_not_refused():
    """A resume on another mesh restores other shards than were recorded: those arrays cannot
    be compared (reported as unchecked), the others still are."""
    leaves = _leaves()
    saved = seal({"step": 3}, _spread(leaves, jax.make_mesh((4, 2), ("a", "b"))), shards=True)
    extra, record = unseal(saved)
    other = _spread(leaves, jax.make_mesh((2, 4), ("a", "b")), specs=(("a", "b"), ("a",), ("b",)))
    assert compare(record, extra, other) == ([], ["b", "w"])  # n: 4 row blocks, as saved
    other[("n",)] = _flip_a_byte(other[("n",)], 2, 1)
    assert compare(record, extra, other) == (["n [2:4,0:3]"], ["b", "w"])


def test_a_multi_process_save_exchanges_the_shard_records(monkeypatch):
    """Several processes: each one's shard record goes to every process (a host all-gather in
    `seal`); the merged record is the one a single process holding all shards makes."""
    from dpojax.train import integrity

    leaves = _leaves()
    mine = shard_checksums(leaves)
    halves = [{k: v for k, v in mine.items() if k in ("w", "b")}, {"n": mine["n"]}]
    halves[1]["step"] = mine["step"]
    monkeypatch.setattr(jax, "process_count", lambda: 2)
    monkeypatch.setattr(integrity.hosts, "allgather_json", lambda value: halves)
    extra, record = unseal(seal({"step": 3}, leaves))
    assert record["format"] == 2 and record["shards"] == {k: mine[k] for k in sorted(mine)}
    assert _problems(record, extra, leaves) == []


def test_format_1_records_still_restore():
    """Records of whole arrays (single-process saves, format 1) and those of earlier
    multi-process saves ("arrays": null: the JSON dict alone) restore as before."""
    leaves = _leaves()
    extra, record = unseal(seal({"step": 3}, leaves))
    assert record["format"] == 1 and sorted(record["arrays"]) == ["b", "n", "step", "w"]
    hurt = {**leaves, ("w",): leaves[("w",)].at[1, 1].set(2.0)}
    assert _problems(record, extra, hurt) == ["w"]
    earlier = {"format": 1, "extra": record["extra"], "arrays": None}
    assert _problems(earlier, extra, hurt) == [] and _problems(earlier, {}, hurt) == ["extra"]
    assert _problems({**record, "format": 3}, extra, leaves) == [
        "the checksum record (format 3, expected 1 or 2)"
    ]
