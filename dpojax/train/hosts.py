"""Runs over several processes: JAX's multi-controller runtime, one process per host (or per
GPU), every process running the same program on its own devices of one global mesh.

- `data_partition(mesh)`: which slice of each global batch this process reads. The batch axis is
  split over the mesh's (data, fsdp) devices into blocks; the processes whose devices hold the
  same blocks form one data partition (several processes share one when the tensor axis spans
  processes), and each partition reads its own pairs.
- host values between processes: `allgather_arrays`, `allgather_json`, `broadcast_json`,
  `any_process`, `barrier`.

A global batch from the per-process host batches is `dpojax.train.batches.global_batch`: each
process builds its part with the same number of pairs; the parts are padded to one shape (agreed
with one small all-gather, which also carries the pair ids), their completion slots renumbered so
they do not collide, and the arrays assembled with `jax.make_array_from_process_local_data`.

In a single process none of this changes anything: the exchange helpers return their input.
"""

from __future__ import annotations

import dataclasses
import json
from typing import Any

import jax
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from dpojax.errors import ConfigProblem

# The batch axis of every batch array is split over these; the mesh's context axis splits each
# row's length inside the model (its devices read the same rows), the tensor axis nothing.
BATCH_AXES = ("data", "fsdp")


@dataclasses.dataclass(frozen=True)
class DataPartition:
    """This process's slice of every global batch: partition `index` of `count`. `blocks[p]` are
    the blocks of the batch axis (in mesh order, `num_blocks` in all) that partition p's devices
    hold, ascending; `readers[p]` the lowest process index that reads partition p."""

    index: int
    count: int
    blocks: tuple[tuple[int, ...], ...]
    num_blocks: int
    readers: tuple[int, ...] = (0,)  # per partition: the lowest process that reads it

    @property
    def blocks_per_partition(self) -> int:
        return self.num_blocks // self.count

    def positions(self, local_size: int) -> np.ndarray:
        """[count, local_size]: where item i of partition p's part lies on the global axis of
        `local_size * count` items."""
        per_block = local_size // self.blocks_per_partition
        return np.stack(
            [
                np.concatenate([np.arange(b * per_block, (b + 1) * per_block) for b in blocks])
                for blocks in self.blocks
            ]
        )


SINGLE = DataPartition(0, 1, ((0,),), 1)


def spans_processes(mesh: Mesh | None) -> bool:
    """Whether `mesh` holds devices of other processes."""
    if mesh is None:
        return False
    me = jax.process_index()
    return any(d.process_index != me for d in mesh.devices.flat)


def data_partition(mesh: Mesh | None) -> DataPartition:
    """This process's data partition of the batch axis, which `global_batch` shards over
    (data, fsdp)."""
    if not spans_processes(mesh):
        return SINGLE
    n = mesh.shape["data"] * mesh.shape["fsdp"]
    index_map = NamedSharding(mesh, PartitionSpec(BATCH_AXES)).devices_indices_map((n,))
    held: dict[int, set[int]] = {}
    for device, (block,) in index_map.items():
        held.setdefault(device.process_index, set()).add(block.start or 0)
    parts = sorted({tuple(sorted(b)) for b in held.values()})
    flat = [b for part in parts for b in part]
    if len({len(p) for p in parts}) != 1 or sorted(flat) != list(range(n)):
        raise ConfigProblem(
            "config keys 'mesh.data', 'mesh.fsdp', 'mesh.context', 'mesh.tensor': the mesh "
            f"{dict(mesh.shape)} "
            "gives the processes overlapping or unequal parts of the batch axis (data x fsdp); "
            "give every process the same number of devices and choose sizes under which each "
            "data-parallel block belongs to one group of processes (docs/multihost.md)"
        )
    of = {process: parts.index(tuple(sorted(b))) for process, b in held.items()}
    readers = tuple(min(q for q, p in of.items() if p == part) for part in range(len(parts)))
    return DataPartition(of[jax.process_index()], len(parts), tuple(parts), n, readers)


# -- host values between processes --------------------------------------------------------------


def allgather_arrays(values: np.ndarray) -> np.ndarray:
    """[process_count, *values.shape]: every process's `values` (same shape and dtype on all)."""
    from jax.experimental import multihost_utils

    return np.asarray(multihost_utils.process_allgather(values, tiled=False))


def allgather_json(value: Any) -> list[Any]:
    """Every process's JSON-serialisable `value`, in process order (one process: [value])."""
    if jax.process_count() == 1:
        return [json.loads(json.dumps(value))]
    data = np.frombuffer(json.dumps(value).encode(), np.uint8)
    sizes = allgather_arrays(np.asarray([data.size], np.int32))[:, 0]
    padded = np.zeros(int(sizes.max()), np.uint8)
    padded[: data.size] = data
    blobs = allgather_arrays(padded)
    return [json.loads(bytes(b[:s])) for b, s in zip(blobs, sizes, strict=True)]


def broadcast_json(value: Any, source: int = 0) -> Any:
    """Process `source`'s JSON-serialisable `value` on every process (others may pass None)."""
    if jax.process_count() == 1:
        return json.loads(json.dumps(value))
    mine = value if jax.process_index() == source else None
    return allgather_json(mine)[source]


def any_process(flag: bool) -> bool:
    """True on every process when `flag` is true on any (one process: `flag`)."""
    if jax.process_count() == 1:
        return bool(flag)
    return bool(allgather_arrays(np.asarray([int(bool(flag))], np.int32)).any())


def barrier(name: str) -> None:
    """Waits until every process has reached the barrier `name`."""
    if jax.process_count() > 1:
        from jax.experimental import multihost_utils

        multihost_utils.sync_global_devices(name)
