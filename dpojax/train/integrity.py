"""Content checksums of a checkpoint: one per saved array, and one of the JSON dict saved with it,
recorded in that dict when the checkpoint is saved and compared when it is restored
(`dpojax.train.checkpoint`). A byte of an array file that changed after the save (disk or
transfer corruption, an edit) changes the restored array and so its checksum, and the restore
says which arrays of which step differ instead of handing back whatever it read.

An array's checksum is 64 bits of BLAKE2b over its bytes in row-major order, read to the host
one array at a time, so it is the same however the array is sharded. It is a checksum against
accidents, not a signature against an attacker who rewrites the record too. It was first a
jitted reduction on the devices (no host copy): in a single-process run whose training runs in a
worker thread (the local Customizer server's dpojax backend) that reduction aborted the process
at the final save under pytest's captured output, and in a 2-process run it deadlocked; the host
hash has neither problem. Its cost is one device-to-host read of the state per save and restore
(docs/resume.md).

Multi-process runs record the JSON dict's checksum only (`"arrays": null`), and their arrays
restore unchecked: no process holds every array whole. A process-local record, each process
hashing its own shards, is the way to cover them.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Mapping
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

# The key of the JSON dict saved with a checkpoint that holds the record.
KEY = "integrity"
FORMAT = 1


def _name(path: tuple[str, ...]) -> str:
    return "/".join(path)


def array_checksums(flat: Mapping[tuple[str, ...], jax.Array]) -> dict[str, str]:
    """{"params/.../kernel": "float32:<16 hex digits>"} for every array of `flat` (of a
    single-process run: each array is read whole)."""
    return {_name(p): f"{jnp.dtype(x.dtype).name}:{_digest(x)}" for p, x in flat.items()}


def _digest(x: jax.Array) -> str:
    """64 bits of BLAKE2b over the array's bytes in row-major order, read to the host one array at
    a time (the same bytes however the array is sharded)."""
    return hashlib.blake2b(np.asarray(jax.device_get(x)).tobytes(), digest_size=8).hexdigest()


def json_checksum(value: Any) -> str:
    """sha256 of `value` as canonical JSON."""
    text = json.dumps(value, sort_keys=True, separators=(",", ":"), allow_nan=False)
    return hashlib.sha256(text.encode()).hexdigest()


def seal(extra: dict[str, Any], flat: Mapping[tuple[str, ...], jax.Array]) -> dict[str, Any]:
    """`extra` with the record of its own checksum and the arrays' (under `KEY`)."""
    if KEY in extra:
        raise ValueError(f"checkpoint extra must not hold the key {KEY!r} (the checksums' own)")
    arrays = array_checksums(flat) if jax.process_count() == 1 else None
    record = {"format": FORMAT, "extra": json_checksum(extra), "arrays": arrays}
    return {**extra, KEY: record}


def unseal(saved: Mapping[str, Any]) -> tuple[dict[str, Any], dict[str, Any] | None]:
    """(the saved dict without the record, the record; None for a checkpoint saved without
    one, by an earlier build)."""
    extra = {k: v for k, v in saved.items() if k != KEY}
    record = saved.get(KEY)
    return extra, record if isinstance(record, dict) else None


def differences(
    record: Mapping[str, Any],
    extra: Mapping[str, Any],
    restored: Mapping[tuple[str, ...], jax.Array],
) -> list[str]:
    """What in a restored checkpoint does not match `record`: the JSON dict ("extra"), the names
    of the arrays whose checksums differ, of saved arrays the record lacks and of recorded arrays
    not restored. An array restored in another dtype than it was saved in (a cast the restore
    made, e.g. after model.param_dtype changed) cannot be compared and is left out."""
    if record.get("format") != FORMAT:
        return [f"the checksum record (format {record.get('format')!r}, expected {FORMAT})"]
    problems = [] if record.get("extra") == json_checksum(dict(extra)) else ["extra"]
    if record.get("arrays") is None:  # saved by a multi-process run: its arrays go unchecked
        return problems
    saved = dict(record.get("arrays") or {})
    comparable = {
        p: x
        for p, x in restored.items()
        if saved.get(_name(p), "").split(":")[0] == jnp.dtype(x.dtype).name
    }
    now = array_checksums(comparable) if comparable else {}
    names = {_name(p) for p in restored}
    for name in sorted(names | saved.keys()):
        if name not in saved:
            problems.append(f"{name} (no checksum recorded)")
        elif name not in names:
            problems.append(f"{name} (recorded, not restored)")
        elif name in now and now[name] != saved[name]:
            problems.append(name)
    return problems
