"""The host side of a batch, from the layouts' arrays to the step's: one module for the path.

- padding: every per-token array [.., R, L] (`ROW_KEYS`) pads with its own value (`ROW_PAD`:
  -1 for the completion ids and positions, 0 for the rest), `pad_rows` / `pad_batch`;
- micro-batches: `stack_micro_batches` stacks the `train.grad_accum` micro-batches of a step on a
  leading axis, padded to one shape;
- score slots: each row's scored positions (`score_slots`), so that the LM head runs only there
  (docs/layouts.md#score-slots); `step_arrays` is what the step reads of a host batch;
- per-process parts: in a multi-process run each process's part of the global batch
  (`part_arrays`) and the global arrays assembled from them (`global_batch`; the exchange
  between processes is `dpojax.train.hosts`).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import jax
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from dpojax.data.layouts import ROW_KEYS
from dpojax.train.hosts import BATCH_AXES, DataPartition, allgather_arrays

MODEL_KEYS = ("tokens", "positions", "segment_ids", "parts")
# The batch arrays the step reads (see dpojax.train.logprobs for their meaning).
STEP_KEYS = (
    *MODEL_KEYS,
    "pred_index",
    "completion_ids",
    "completion_pos",
    "completion_mask",
    "chosen_index",
    "rejected_index",
    "pair_mask",
    "labels",
    "ref_chosen_logps",
    "ref_rejected_logps",
    "score_slots",
)
# `score_slots` widths are multiples of SCORE_SLOT_MULTIPLE, or powers of two from SCORE_SLOT_MIN
# for rows that score a quarter of their length or less (few distinct shapes, few compilations).
SCORE_SLOT_MULTIPLE = 64
SCORE_SLOT_MIN = 8


def micro_batch_pairs(batch_size: int, grad_accum: int, partitions: int = 1) -> int:
    """Pairs in one micro-batch of a step of `batch_size` pairs over `grad_accum` micro-batches,
    as one of `partitions` data partitions reads it (`train.batch_size` must divide)."""
    return batch_size // max(grad_accum, 1) // max(partitions, 1)


def indivisible(count: int, devices: int, what: str) -> str | None:
    """The problem when `count` `what` cannot be split evenly over the `devices` data-parallel
    devices of the mesh (which split every batch array over mesh.data * mesh.fsdp); None when
    they can."""
    if devices <= 0 or count % devices == 0:
        return None
    return (
        f"{count} {what} are not divisible by the {devices} data-parallel devices "
        "(mesh.data * mesh.fsdp)"
    )


# Padding values of the per-token arrays (ROW_KEYS); the others pad with 0.
ROW_PAD = {"completion_ids": -1, "completion_pos": -1}


def pad_rows(value: np.ndarray, key: str, rows: int, length: int, lead: int = 0) -> np.ndarray:
    """The per-token array `key` [*lead, R, L] padded to [*lead, rows, length] with its padding
    value (`ROW_PAD`); `value` itself when it has that shape."""
    shape = (*value.shape[:lead], rows, length)
    if value.shape == shape:
        return value
    out = np.full(shape, ROW_PAD.get(key, 0), value.dtype)
    out[..., : value.shape[lead], : value.shape[lead + 1]] = value
    return out


def pad_batch(batch: Mapping[str, np.ndarray], rows: int, length: int) -> dict[str, np.ndarray]:
    """A micro-batch [R, L] with its per-token arrays padded to [rows, length]."""
    return {k: pad_rows(v, k, rows, length) if k in ROW_KEYS else v for k, v in batch.items()}


def stack_micro_batches(batches: Sequence[Mapping[str, np.ndarray]]) -> dict[str, np.ndarray]:
    """Stacks micro-batches along a new leading axis, padding their token arrays to one shape."""
    rows = max(b["tokens"].shape[0] for b in batches)
    length = max(b["tokens"].shape[1] for b in batches)
    padded = [pad_batch(b, rows, length) for b in batches]
    return {k: np.stack([b[k] for b in padded]) for k in padded[0]}


def score_slot_width(most: int, length: int, multiple: int = SCORE_SLOT_MULTIPLE) -> int:
    """The score-slot width S for rows of `length` whose fullest row scores `most` tokens: `most`
    rounded up to a multiple of `multiple` (at least one), never more than `length`. Rows that
    score at most a quarter of their length get the smallest power of two from SCORE_SLOT_MIN
    that holds `most` instead, when that is narrower (e.g. one-token answers behind a shared
    prompt: 8 slots of a 48-token row)."""
    width = min(length, max(multiple, -(-most // multiple) * multiple))
    if 4 * most <= length:
        narrow = SCORE_SLOT_MIN
        while narrow < most:
            narrow *= 2
        width = min(width, narrow)
    return width


def score_slots(
    completion_ids: np.ndarray, multiple: int = SCORE_SLOT_MULTIPLE, *, width: int | None = None
) -> np.ndarray:
    """Each row's scored positions (`completion_ids >= 0`), in order, padded with -1: int32
    [..., R, S] for `completion_ids` [..., R, L]. S is the most any row has, rounded up by
    `score_slot_width` and at most L (or `width`, at least that most, when given: several
    processes agree on one).

    With them (batch key `score_slots`) the step runs the LM head and the log-softmax over S slots
    per row instead of L: prompt tokens are never scored, and on agent data (long prompts, short
    completions) they are most of the row."""
    scored = np.asarray(completion_ids) >= 0
    length = scored.shape[-1]
    if width is None:
        width = score_slot_width(int(scored.sum(-1).max(initial=0)), length, multiple)
    order = np.argsort(~scored, axis=-1, kind="stable")[..., :width]
    return np.where(np.take_along_axis(scored, order, -1), order, -1).astype(np.int32)


def with_score_slots(batch: Mapping[str, Any]) -> dict[str, Any]:
    """`batch` plus `score_slots` (see `score_slots`) when they are fewer than the row length;
    `batch` unchanged when every slot would be kept."""
    slots = score_slots(batch["completion_ids"])
    if slots.shape[-1] >= np.shape(batch["completion_ids"])[-1]:
        return dict(batch)
    return {**batch, "score_slots": slots}


def step_arrays(batch: Mapping[str, Any]) -> dict[str, np.ndarray]:
    """The arrays of a host batch that the step reads (`STEP_KEYS`), with `score_slots` added
    when the batch has none (see `with_score_slots`). Host arrays: the caller puts them on the
    devices with their final sharding in one transfer (`dpojax.train.step.place_batch`)."""
    if "score_slots" not in batch:
        batch = with_score_slots(batch)
    return {k: np.asarray(v) for k, v in batch.items() if k in STEP_KEYS}


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
        local[key] = pad_rows(local[key], key, rows, length, lead)
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
    gathered = allgather_arrays(info)
    rows, length, scored = (int(x) for x in gathered[:, :3].max(0))
    blocks = partition.blocks_per_partition
    problem = indivisible(rows, blocks, "rows of a process's batch") or indivisible(
        per_part, blocks, "pairs of a process's batch"
    )
    if problem:
        raise ValueError(f"{problem} of this process; change train.batch_size")
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
