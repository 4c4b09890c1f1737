"""Content checksums of a checkpoint: one per saved array, and one of the JSON dict saved with it,
recorded in that dict when the checkpoint is saved and compared when it is restored
(`dpojax.train.checkpoint`). A byte of an array file that changed after the save (disk or
transfer corruption, an edit) changes the restored array and so its checksum, and the restore
says which arrays of which step differ instead of handing back whatever it read.

An array's checksum is computed where the array lives, on its devices, by a jitted reduction:
every element's bits are mixed with its position (murmur3's finaliser) and the mixed words are
summed in uint32, plain and weighted by position (64 bits an array). Wrapping integer sums do
not depend on the order of the additions, so the result is the same however the array is
sharded, on one process or many: each process reduces its own shards and the jitted reduction
combines them, every process gets the same value, and process 0 writes it with the JSON dict.
This costs one read of the state in device memory (8 ms for the tiny test model's state on a
CPU; milliseconds for a 1B model on a GPU) and one small compilation per array shape at a run's
first save and restore, instead of a second copy of the state in host memory and a host hash of
every byte on the training thread. It is a checksum against accidents, not a signature against
an attacker who rewrites the record too.

Multi-process runs record the JSON dict's checksum only (`"arrays": null`), and their arrays
restore unchecked: the collective reductions, run beside the train step and the checkpoint
library's own collectives, deadlocked a 2-process run with its weights sharded over the
processes at its first save (tests/multiprocess/test_multihost.py). A process-local record, each
process hashing its own shards, is the way to cover them.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Mapping
from typing import Any

import jax
import jax.numpy as jnp

# The key of the JSON dict saved with a checkpoint that holds the record.
KEY = "integrity"
FORMAT = 1
_GOLDEN, _SEED = 0x9E3779B1, 0x7F4A7C15


def _fmix(v: jax.Array) -> jax.Array:
    """murmur3's 32-bit finaliser: every input bit flips about half of the output bits."""
    v = v ^ (v >> 16)
    v = v * jnp.uint32(0x85EBCA6B)
    v = v ^ (v >> 13)
    v = v * jnp.uint32(0xC2B2AE35)
    return v ^ (v >> 16)


def _words(x: jax.Array) -> jax.Array:
    """The bits of `x` as uint32 words (8-byte elements: two words each, a trailing axis)."""
    if x.dtype == jnp.bool_:
        return x.astype(jnp.uint32)
    size = jnp.dtype(x.dtype).itemsize
    if size == 8:
        return jax.lax.bitcast_convert_type(x, jnp.uint32)
    return jax.lax.bitcast_convert_type(x, jnp.dtype(f"uint{8 * size}")).astype(jnp.uint32)


def _positions(shape: tuple[int, ...]) -> jax.Array:
    """Each element's row-major index (mod 2**32), built per axis so that it shards like the
    array (a reshape of a sharded array would gather it)."""
    index = jnp.zeros(shape, jnp.uint32)
    stride = 1
    for axis in reversed(range(len(shape))):
        iota = jax.lax.broadcasted_iota(jnp.uint32, shape, axis)
        index = index + iota * jnp.uint32(stride % 2**32)
        stride *= shape[axis]
    return index


@jax.jit
def _leaf_sums(x: jax.Array) -> jax.Array:
    """The two sums of one array, as uint32[2]: of every word mixed with its position, and of
    the same weighted by the (odd) position. Jitted per shape, dtype and sharding: the weights
    and the optimizer moments of one shape share one compilation."""
    words = _words(x)
    position = _positions(words.shape)
    mixed = _fmix(words ^ (position * jnp.uint32(_GOLDEN) + jnp.uint32(_SEED)))
    weighted = mixed * (position | jnp.uint32(1))
    return jnp.stack([mixed.sum(dtype=jnp.uint32), weighted.sum(dtype=jnp.uint32)])


def _name(path: tuple[str, ...]) -> str:
    return "/".join(path)


def array_checksums(flat: Mapping[tuple[str, ...], jax.Array]) -> dict[str, str]:
    """{"params/.../kernel": "float32:<16 hex digits>"} for every array of `flat` (every process
    of a multi-process run must call it: the reduction is collective)."""
    names = list(flat)
    sums = jax.device_get([_leaf_sums(flat[p]) for p in names])
    return {
        _name(p): f"{jnp.dtype(flat[p].dtype).name}:{int(a):08x}{int(b):08x}"
        for p, (a, b) in zip(names, sums, strict=True)
    }


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
