"""Checkpoint content checksums: the same however an array is sharded, and changed by any
changed, moved or retyped element."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import NamedSharding, PartitionSpec

from dpojax.train.integrity import array_checksums, differences, seal, unseal


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
    assert extra == {"step": 3} and differences(record, extra, leaves) == []
    hurt = {**leaves, ("w",): leaves[("w",)].at[1, 1].set(2.0)}
    assert differences(record, {"step": 4}, hurt) == ["extra", "w"]
    # restored in another dtype (a cast): not comparable, left out; a missing array is named
    cast = {**leaves, ("b",): leaves[("b",)].astype(jnp.float32)}
    del cast[("n",)]
    assert differences(record, extra, cast) == ["n (recorded, not restored)"]
    assert unseal({"step": 3}) == ({"step": 3}, None)


def test_a_multi_process_save_records_the_extra_only(monkeypatch):
    """Several processes: no collective array checksum (it deadlocked a 2-process run at its
    first save); the JSON dict is still checked, the arrays restore unchecked."""
    leaves = _leaves()
    monkeypatch.setattr(jax, "process_count", lambda: 2)
    saved = seal({"step": 3}, leaves)
    extra, record = unseal(saved)
    assert record["arrays"] is None and differences(record, extra, leaves) == []
    hurt = {**leaves, ("w",): leaves[("w",)].at[1, 1].set(2.0)}
    assert differences(record, {"step": 4}, hurt) == ["extra"]
