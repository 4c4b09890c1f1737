"""Runs over several processes: JAX's multi-controller runtime, one process per host (or per
GPU), every process running the same program on its own devices of one global mesh.

- `data_partition(mesh)`: which slice of each global batch this process reads. The batch axis is
  split over the mesh's (data, fsdp) devices into blocks; the processes whose devices hold the
  same blocks form one data partition (several processes share one when the tensor axis spans
  processes), and each partition reads its own pairs.
- `global_batch(...)`: a global batch from the per-process host batches. Each process builds
  its part with the same number of pairs; the parts are padded to one shape (agreed with one
  small all-gather, which also carries the pair ids), their completion slots renumbered so they
  do not collide, and the arrays assembled with `jax.make_array_from_process_local_data`.
- host values between processes: `allgather_json`, `broadcast_json`, `any_process`, `barrier`.

In a single process none of this changes anything: `global_batch` is not used there and the
exchange helpers return their input.
"""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Mapping
from typing import Any

import jax
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from dpojax.data.layouts import ROW_KEYS
from dpojax.train.forward import STEP_KEYS, score_slot_width, score_slots

BATCH_AXES = ("data", "fsdp")
# Per-token batch arrays [.., R, L] (ROW_KEYS) and their padding values (the others pad with 0).
_ROW_PAD = {"completion_ids": -1, "completion_pos": -1}


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
        raise ValueError(
            f"mesh {dict(mesh.shape)}: the processes hold overlapping or unequal parts of the "
            "batch axis (data x fsdp); give every process the same number of devices and make "
            "each data-parallel block belong to one group of processes"
        )
    of = {process: parts.index(tuple(sorted(b))) for process, b in held.items()}
    readers = tuple(min(q for q, p in of.items() if p == part) for part in range(len(parts)))
    return DataPartition(of[jax.process_index()], len(parts), tuple(parts), n, readers)


# -- host values between processes --------------------------------------------------------------


def _allgather(values: np.ndarray) -> np.ndarray:
    """[process_count, *values.shape]: every process's `values` (same shape and dtype on all)."""
    from jax.experimental import multihost_utils

    return np.asarray(multihost_utils.process_allgather(values, tiled=False))


def allgather_json(value: Any) -> list[Any]:
    """Every process's JSON-serialisable `value`, in process order (one process: [value])."""
    if jax.process_count() == 1:
        return [json.loads(json.dumps(value))]
    data = np.frombuffer(json.dumps(value).encode(), np.uint8)
    sizes = _allgather(np.asarray([data.size], np.int32))[:, 0]
    padded = np.zeros(int(sizes.max()), np.uint8)
    padded[: data.size] = data
    blobs = _allgather(padded)
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
    return bool(_allgather(np.asarray([int(bool(flag))], np.int32)).any())


def barrier(name: str) -> None:
    """Waits until every process has reached the barrier `name`."""
    if jax.process_count() > 1:
        from jax.experimental import multihost_utils

        multihost_utils.sync_global_devices(name)


# -- global batches -----------------------------------------------------------------------------


def _pad(value: np.ndarray, key: str, rows: int, length: int, lead: int) -> np.ndarray:
    shape = (*value.shape[:lead], rows, length)
    if value.shape == shape:
        return value
    out = np.full(shape, _ROW_PAD.get(key, 0), value.dtype)
    out[..., : value.shape[lead], : value.shape[lead + 1]] = value
    return out


def part_arrays(
    batch: Mapping[str, Any], *, rows: int, length: int, width: int, offset: int, lead: int
) -> dict[str, np.ndarray]:
    """One process's part of a global batch: the step arrays of its host `batch`, per-token
    arrays padded to [.., rows, length], completion slots renumbered from `offset`, and score
    slots `width` wide (none when `width` >= `length`). Parts made with the same rows, length
    and width and disjoint slot ranges concatenate (rows and pairs) into one batch."""
    if "completion_mask" in batch:
        raise ValueError("multi-process batches number completions 2 per pair (no completion_mask)")
    local = {k: np.asarray(v) for k, v in batch.items() if k in STEP_KEYS and k != "score_slots"}
    for key in ROW_KEYS:
        local[key] = _pad(local[key], key, rows, length, lead)
    ids = local["completion_ids"]
    local["completion_ids"] = np.where(ids >= 0, ids + offset, -1).astype(ids.dtype)
    for key in ("chosen_index", "rejected_index"):
        local[key] = (local[key] + offset).astype(local[key].dtype)
    if width < length:
        local["score_slots"] = score_slots(local["completion_ids"], width=width)
    return local


def global_batch(
    batch: Mapping[str, Any],
    mesh: Mesh,
    partition: DataPartition,
    *,
    micro_axis: bool,
) -> tuple[dict[str, jax.Array], np.ndarray]:
    """(the step's global arrays, the global batch's pair ids [.., P_global]) from this process's
    host batch (every process calls it with its partition's batch, all with the same number of
    pairs). One all-gather of each part's shape and pair ids sets the common row count and
    length (the largest part's) and score-slot width (the widest part's); partition p's
    completion slots are numbered from p * 2 * P_local (`part_arrays`)."""
    lead = 1 if micro_axis else 0
    pair_ids = np.asarray(batch["pair_ids"])
    per_part = pair_ids.shape[-1]
    rows, length = np.shape(batch["tokens"])[lead : lead + 2]
    scored = int((np.asarray(batch["completion_ids"]) >= 0).sum(-1).max(initial=0))
    info = np.concatenate([[rows, length, scored], pair_ids.ravel()]).astype(np.int32)
    gathered = _allgather(info)
    rows, length, scored = (int(x) for x in gathered[:, :3].max(0))
    blocks = partition.blocks_per_partition
    if rows % blocks or per_part % blocks:
        raise ValueError(
            f"a process's batch has {rows} rows and {per_part} pairs, not divisible by its "
            f"{blocks} data-parallel devices; change train.batch_size"
        )
    local = part_arrays(
        batch,
        rows=rows,
        length=length,
        width=score_slot_width(scored, length),
        offset=partition.index * 2 * per_part,
        lead=lead,
    )
    spec = PartitionSpec(*(None,) * lead, BATCH_AXES)
    out = {}
    for key, value in local.items():
        shape = list(value.shape)
        shape[lead] *= partition.count
        out[key] = jax.make_array_from_process_local_data(
            NamedSharding(mesh, spec), value, tuple(shape)
        )
    return out, _global_pair_ids(gathered[:, 3:], partition, pair_ids.shape)


def _global_pair_ids(
    gathered: np.ndarray, partition: DataPartition, local_shape: tuple[int, ...]
) -> np.ndarray:
    """The pair ids of the global batch in its order, from every process's gathered ids."""
    per_part = local_shape[-1]
    out = np.full((*local_shape[:-1], per_part * partition.count), -1, np.int64)
    positions = partition.positions(per_part)
    for p, reader in enumerate(partition.readers):
        out[..., positions[p]] = gathered[reader].reshape(local_shape)
    return out
