"""Content checksums of a checkpoint: checksums of the saved arrays, and one of the JSON dict saved
with them, recorded in that dict when the checkpoint is saved and compared when it is restored
(`dpojax.train.checkpoint`). A byte of an array file that changed after the save (disk or
transfer corruption, an edit) changes the restored array and so its checksum, and the restore
says which arrays of which step differ instead of handing back whatever it read.

A checksum is 64 bits of BLAKE2b over an array's bytes in row-major order, computed on the host.
It is a checksum against accidents, not a signature against an attacker who rewrites the record
too. Its cost is one device-to-host read of the state per save and restore (docs/resume.md).

Single-process runs (record format 1) hash each array whole, read to the host one array at a
time, so the checksum is the same however the array is sharded.

Multi-process runs (format 2) hash shards: no process holds every array whole. Each process
hashes the data of its own shards with replica id 0 (every part of an array is held by exactly
one such shard), keyed by the array's name and the shard's place in it (`[0:4,0:12]`: start:stop
per dimension). The processes then exchange their records with a host all-gather (a JSON
exchange, `dpojax.train.hosts.allgather_json`, in the thread that calls `seal`, which every
process calls at every save), so process 0 writes the whole record. At a restore each process
compares its own replica-0 shards, and the checkpoint module gathers every process's findings, so
all processes refuse a corrupt checkpoint together. Arrays restored with another layout than they
were saved with (a resume on another mesh: a shard the record does not hold) cannot be compared
and restore unchecked (`compare` lists them; the restore logs one line). A format-1 record
restored in several processes checks the arrays each process holds whole (replicated ones), the
others restore unchecked.

Neither the hashes nor the exchange run jitted reductions over the state: the first version
summed each array on the devices with a jitted reduction, which aborted a single-process run
whose training runs in a worker thread (the local Customizer server's dpojax backend) at its
final save under pytest's captured output, and deadlocked a 2-process run with its weights
sharded over the processes at its first save.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Mapping
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from dpojax.train import hosts

# The key of the JSON dict saved with a checkpoint that holds the record.
KEY = "integrity"
WHOLE = 1  # format of a record of whole arrays ("arrays": {name: "dtype:hex"})
SHARDS = 2  # format of a record of shards ("shards": {name: {"[start:stop,...]": "dtype:hex"}})
FORMATS = (WHOLE, SHARDS)


def _name(path: tuple[str, ...]) -> str:
    return "/".join(path)


def _hash(data: Any, dtype: Any) -> str:
    """ "dtype:<16 hex digits>": 64 bits of BLAKE2b over `data`'s bytes in row-major order."""
    raw = np.asarray(data).tobytes()
    return f"{jnp.dtype(dtype).name}:{hashlib.blake2b(raw, digest_size=8).hexdigest()}"


def array_checksums(flat: Mapping[tuple[str, ...], jax.Array]) -> dict[str, str]:
    """{"params/.../kernel": "float32:<16 hex digits>"} for every array of `flat` (of a
    single-process run: each array is read whole, one at a time)."""
    return {_name(p): _hash(jax.device_get(x), x.dtype) for p, x in flat.items()}


def _place(index: tuple[slice, ...], shape: tuple[int, ...]) -> str:
    """A shard's place in its array as a stable string: "[0:4,0:12]" (start:stop per
    dimension; "[]" for a scalar)."""
    parts = []
    for size, part in zip(shape, index, strict=True):
        start, stop, _ = part.indices(size)
        parts.append(f"{start}:{stop}")
    return "[" + ",".join(parts) + "]"


def _own_shards(x: Any) -> list[tuple[str, Any]]:
    """(place, shard data) of this process's shards of `x` with replica id 0 (a value that is
    no jax.Array, e.g. a numpy array: itself, whole)."""
    if not isinstance(x, jax.Array):
        value = np.asarray(x)
        return [(_place(tuple(slice(None) for _ in value.shape), value.shape), value)]
    shape = tuple(x.shape)
    return [
        (_place(tuple(s.index), shape), s.data) for s in x.addressable_shards if s.replica_id == 0
    ]


def shard_checksums(flat: Mapping[tuple[str, ...], jax.Array]) -> dict[str, dict[str, str]]:
    """{"params/.../kernel": {"[0:4,0:12]": "float32:<16 hex digits>", ...}} for this process's
    replica-0 shards of every array of `flat` (read to the host one shard at a time)."""
    return {
        _name(p): {place: _hash(data, x.dtype) for place, data in _own_shards(x)}
        for p, x in flat.items()
    }


def json_checksum(value: Any) -> str:
    """sha256 of `value` as canonical JSON."""
    text = json.dumps(value, sort_keys=True, separators=(",", ":"), allow_nan=False)
    return hashlib.sha256(text.encode()).hexdigest()


def seal(
    extra: dict[str, Any],
    flat: Mapping[tuple[str, ...], jax.Array],
    *,
    shards: bool | None = None,
) -> dict[str, Any]:
    """`extra` with the record of its own checksum and the arrays' (under `KEY`). Whole arrays
    in a single process, shards (`shards=True`) in several; there every process must call it,
    in the same order: the processes' records are exchanged (a host all-gather)."""
    if KEY in extra:
        raise ValueError(f"checkpoint extra must not hold the key {KEY!r} (the checksums' own)")
    if shards is None:
        shards = jax.process_count() > 1
    record: dict[str, Any] = {"format": SHARDS if shards else WHOLE, "extra": json_checksum(extra)}
    if not shards:
        record["arrays"] = array_checksums(flat)
    else:
        merged: dict[str, dict[str, str]] = {}
        for part in hosts.allgather_json(shard_checksums(flat)):
            for name, entries in part.items():
                merged.setdefault(name, {}).update(entries)
        record["shards"] = {name: dict(sorted(merged[name].items())) for name in sorted(merged)}
    return {**extra, KEY: record}


def unseal(saved: Mapping[str, Any]) -> tuple[dict[str, Any], dict[str, Any] | None]:
    """(the saved dict without the record, the record; None for a checkpoint saved without
    one, by an earlier build)."""
    extra = {k: v for k, v in saved.items() if k != KEY}
    record = saved.get(KEY)
    return extra, record if isinstance(record, dict) else None


def _whole_here(x: Any) -> Any | None:
    """`x`'s whole value on this host, or None where this process does not hold it whole."""
    if not isinstance(x, jax.Array) or x.is_fully_addressable:
        return jax.device_get(x)
    if x.is_fully_replicated:
        return x.addressable_data(0)
    return None


def compare(
    record: Mapping[str, Any],
    extra: Mapping[str, Any],
    restored: Mapping[tuple[str, ...], jax.Array],
) -> tuple[list[str], list[str]]:
    """(problems, unchecked) of a restored checkpoint against `record`, as this process sees
    it. Problems: the JSON dict ("extra"), the names of the arrays whose checksums differ (a
    shard's with its place: "w [0:4,0:12]"), of saved arrays the record lacks and of recorded
    arrays not restored. Unchecked: the arrays that cannot be compared here, because they were
    restored with another layout than the record's shards (another mesh) or, for a record of
    whole arrays, this process does not hold them whole. An array restored in another dtype
    than it was saved in (a cast the restore made, e.g. after model.param_dtype changed) is
    left out of both."""
    version = record.get("format")
    if version not in FORMATS:
        expected = " or ".join(map(str, FORMATS))
        return [f"the checksum record (format {version!r}, expected {expected})"], []
    problems = [] if record.get("extra") == json_checksum(dict(extra)) else ["extra"]
    if version == WHOLE and record.get("arrays") is None:
        return problems, []  # an earlier multi-process save: it recorded no arrays
    saved = dict(record.get("arrays" if version == WHOLE else "shards") or {})
    names = {_name(p) for p in restored}
    unchecked, differ = [], []
    for path, x in restored.items():
        name = _name(path)
        if name not in saved:
            continue
        dtype = jnp.dtype(x.dtype).name
        if version == WHOLE:
            if saved[name].split(":")[0] != dtype:
                continue  # cast at the restore
            value = _whole_here(x)
            if value is None:
                unchecked.append(name)
            elif _hash(value, dtype) != saved[name]:
                differ.append(name)
            continue
        recorded = saved[name]
        if any(str(v).split(":")[0] != dtype for v in recorded.values()):
            continue  # cast at the restore
        mine = _own_shards(x)
        if any(place not in recorded for place, _ in mine):
            unchecked.append(name)
            continue
        differ += [f"{name} {p}" for p, data in mine if _hash(data, dtype) != recorded[p]]
    for name in sorted(names | saved.keys()):
        if name not in saved:
            problems.append(f"{name} (no checksum recorded)")
        elif name not in names:
            problems.append(f"{name} (recorded, not restored)")
    problems += differ
    return in_order(problems), sorted(unchecked)


def _problem_order(problem: str) -> tuple[bool, str]:
    return problem != "extra", problem


def in_order(problems: list[str]) -> list[str]:
    """`problems` (several processes' together) without repeats, in the order `compare` gives:
    the JSON dict first, then by name."""
    return sorted(dict.fromkeys(problems), key=_problem_order)
