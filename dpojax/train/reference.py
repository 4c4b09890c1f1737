"""Precomputed reference log-probs: one pass over the data before training, cached on disk.

The cache key is derived from the reference weights (a hash of every parameter's bytes), the data
(a fingerprint the data pipeline provides, e.g. a hash of the tokenized pairs) and the settings that
change log-probs (max length, truncation, layout-independent options...). A training step with a
`PrecomputedReference` (`dpojax.train.reference_choice`) then skips the reference forward.

On one process the log-probs are also kept per pair, in a store keyed by the reference weights and
settings and, inside it, by each pair's tokens (`pair_content_keys`): a later run on other data
that repeats some of the pairs (the replayed pairs of a loop's rounds) computes only the new ones.
"""

from __future__ import annotations

import functools
import hashlib
import json
import logging
import os
import zipfile
from collections.abc import Callable, Iterable, Mapping, Sequence
from pathlib import Path
from typing import Any

import jax
import numpy as np
from flax import nnx
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from dpojax.data.pipeline import pair_token_bytes
from dpojax.data.tokenize import TokenizedPair
from dpojax.models.transformer import CausalLM
from dpojax.train import hosts
from dpojax.train.batches import step_arrays
from dpojax.train.forward import completion_logps
from dpojax.train.hosts import data_partition, spans_processes
from dpojax.train.loss_settings import LossSettings
from dpojax.train.state import StepConfig
from dpojax.train.step import mesh_context, place_batch

log = logging.getLogger(__name__)


def params_fingerprint(model: CausalLM) -> str:
    """A hash of the model's configuration and every parameter's path, dtype, shape and bytes.

    Parameters spread over several processes are hashed shard by shard where they live (each
    process its own shards, with their positions) and the processes' digests combined, so no
    process gathers the model; such a fingerprint also depends on the sharding."""
    digest = hashlib.blake2b(digest_size=16)
    # every layout gives the same log-probs: the rows' layout is not part of the weights
    digest.update(repr(model.config.replace(hf_config_json="", row_layout="")).encode())
    shards = None
    for path, var in nnx.to_flat_state(nnx.state(model, nnx.Param)):
        value = var.get_value()
        digest.update(f"{path}:{np.dtype(value.dtype)}:{tuple(value.shape)}".encode())
        if getattr(value, "is_fully_addressable", True):
            digest.update(np.ascontiguousarray(np.asarray(jax.device_get(value))).tobytes())
            continue
        shards = shards or hashlib.blake2b(digest_size=16)
        for shard in value.addressable_shards:
            if shard.replica_id == 0:
                shards.update(f"{path}:{shard.index}".encode())
                shards.update(np.ascontiguousarray(np.asarray(shard.data)).tobytes())
    if hosts.any_process(shards is not None):
        for part in hosts.allgather_json(shards.hexdigest() if shards else ""):
            digest.update(part.encode())
    return digest.hexdigest()


def cache_key(weights: str, data: str, settings: Mapping[str, Any]) -> str:
    blob = json.dumps({"weights": weights, "data": data, "settings": settings}, sort_keys=True)
    return hashlib.sha256(blob.encode()).hexdigest()[:32]


def _logps(cfg: StepConfig, model: CausalLM, batch: Mapping[str, jax.Array]):
    out = completion_logps(model, batch, cfg)
    return out["sums"][batch["chosen_index"]], out["sums"][batch["rejected_index"]]


@functools.lru_cache(maxsize=8)
def _jitted_logps(cfg: StepConfig):
    """The one-device reference pass of `cfg`, jitted once per process, so that later passes
    (a loop's rounds) reuse its compilations instead of compiling again (~1 s each on a CPU)."""
    return nnx.jit(functools.partial(_logps, cfg))


def compute_reference_logps(
    model: CausalLM,
    batches: Iterable[Mapping[str, np.ndarray]],
    num_pairs: int,
    *,
    vocab_chunk: int | None = 4096,
    mesh: Mesh | None = None,
    ld_alpha: float | None = None,
    complete: bool = True,
) -> tuple[np.ndarray, np.ndarray]:
    """Sequence log-probs (chosen, rejected) [num_pairs] of `model` over every batch, indexed by
    the batches' `pair_ids` (padding pairs, id -1, are ignored). Every pair must be seen unless
    not `complete` (the ids no batch has stay NaN). With
    `ld_alpha` (LD-DPO) the sums are length-desensitised as the step's policy and frozen
    reference sums are.

    On a `mesh` that spans processes every process passes its data partition's batches and the
    passes run on the whole mesh; each process gets every pair's log-probs."""
    ld = LossSettings(ld_alpha=1.0 if ld_alpha is None else ld_alpha)
    cfg = StepConfig(vocab_chunk=vocab_chunk, loss=ld)
    logps = functools.partial(_logps, cfg)
    if spans_processes(mesh):
        graphdef, params = nnx.split(model)
        replicated = NamedSharding(mesh, PartitionSpec())
        jitted = jax.jit(lambda p, b: logps(nnx.merge(graphdef, p), b), out_shardings=replicated)
        partition = data_partition(mesh)

        def forward(batch):
            arrays, ids = place_batch(batch, mesh, micro_axis=False, partition=partition)
            with mesh_context(mesh):
                return (*jitted(params, arrays), ids)
    else:
        jitted = _jitted_logps(cfg)

        def forward(batch):
            return (*jitted(model, step_arrays(batch)), batch["pair_ids"])

    chosen = np.full(num_pairs, np.nan, np.float32)
    rejected = np.full(num_pairs, np.nan, np.float32)
    for batch in batches:
        c, r, ids = forward(batch)
        ids = np.asarray(ids)
        keep = ids >= 0
        chosen[ids[keep]] = np.asarray(c)[keep]
        rejected[ids[keep]] = np.asarray(r)[keep]
    missing = np.flatnonzero(np.isnan(chosen))
    if complete and missing.size:
        raise ValueError(
            f"reference pass saw no batch for {missing.size} of {num_pairs} pairs "
            f"(first missing pair ids: {missing[:5].tolist()})"
        )
    return chosen, rejected


def pair_content_keys(pairs: Sequence[TokenizedPair]) -> np.ndarray:
    """[n, 2] uint64: a 128-bit digest per pair of what its log-probs depend on (its prompt lengths
    and token ids; not its id), so the same pair in other data finds its stored log-probs."""
    out = np.empty((len(pairs), 2), np.uint64)
    for i, p in enumerate(pairs):
        h = hashlib.blake2b(digest_size=16)
        for part in pair_token_bytes(p):
            h.update(part)
        out[i] = np.frombuffer(h.digest(), np.uint64)
    return out


def _read_store(path: Path) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(keys [m, 2], chosen [m], rejected [m]) of a per-pair store; empty when there is none or it
    cannot be read (a store is only ever a cache)."""
    empty = (np.empty((0, 2), np.uint64), np.empty(0, np.float32), np.empty(0, np.float32))
    if not path.is_file():
        return empty
    try:
        with np.load(path) as f:
            keys, chosen, rejected = f["keys"], f["chosen"], f["rejected"]
    except (OSError, ValueError, KeyError, EOFError, zipfile.BadZipFile) as e:
        log.warning("ignoring the unreadable reference log-prob store %s (%s)", path, e)
        return empty
    if keys.ndim != 2 or keys.shape[1] != 2 or not len(keys) == len(chosen) == len(rejected):
        log.warning("ignoring the malformed reference log-prob store %s", path)
        return empty
    return keys.astype(np.uint64), chosen.astype(np.float32), rejected.astype(np.float32)


def _write_npz(path: Path, **arrays: np.ndarray) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(".tmp.npz")
    np.savez(tmp, **arrays)
    os.replace(tmp, path)


def _stored_reference(
    model: CausalLM,
    pairs: Sequence[TokenizedPair],
    batches_for: Callable[[Sequence[TokenizedPair]], Iterable[Mapping[str, np.ndarray]]],
    num_pairs: int,
    path: Path,
    **compute: Any,
) -> tuple[np.ndarray, np.ndarray, bool]:
    """The per-pair store's log-probs for `pairs` (indexed by pair id), computing the pairs it
    lacks over `batches_for(those pairs)` and adding them to it."""
    keys = pair_content_keys(pairs)
    stored_keys, stored_chosen, stored_rejected = _read_store(path)
    index = {k.tobytes(): i for i, k in enumerate(stored_keys)}
    chosen = np.full(num_pairs, np.nan, np.float32)
    rejected = np.full(num_pairs, np.nan, np.float32)
    missing: dict[bytes, list[int]] = {}  # content key -> positions in `pairs` (repeats: once)
    for n, (p, k) in enumerate(zip(pairs, keys, strict=True)):
        i = index.get(k.tobytes())
        if i is None:
            missing.setdefault(k.tobytes(), []).append(n)
        else:
            chosen[p.pair_id], rejected[p.pair_id] = stored_chosen[i], stored_rejected[i]
    if missing:
        first = [pairs[ns[0]] for ns in missing.values()]
        new_chosen, new_rejected = compute_reference_logps(
            model, batches_for(first), num_pairs, complete=False, **compute
        )
        for ns in missing.values():
            ids = [pairs[n].pair_id for n in ns]
            chosen[ids], rejected[ids] = new_chosen[ids[0]], new_rejected[ids[0]]
        ids = np.asarray([p.pair_id for p in first])
        if np.isnan(chosen[ids]).any():
            raise ValueError(
                f"reference pass saw no batch for {int(np.isnan(chosen[ids]).sum())} pairs"
            )
        _write_npz(
            path,
            keys=np.concatenate([stored_keys, keys[[ns[0] for ns in missing.values()]]]),
            chosen=np.concatenate([stored_chosen, chosen[ids]]),
            rejected=np.concatenate([stored_rejected, rejected[ids]]),
        )
    log.info(
        "reference log-probs: %d of %d pairs from the store %s, %d distinct pairs computed",
        len(pairs) - sum(map(len, missing.values())),
        len(pairs),
        path.name,
        len(missing),
    )
    return chosen, rejected, not missing


def precomputed_reference(
    model: CausalLM,
    make_batches: Callable[[], Iterable[Mapping[str, np.ndarray]]],
    num_pairs: int,
    *,
    cache_dir: str | os.PathLike,
    data_fingerprint: str,
    settings: Mapping[str, Any],
    vocab_chunk: int | None = 4096,
    mesh: Mesh | None = None,
    ld_alpha: float | None = None,
    pairs: Sequence[TokenizedPair] | None = None,
    batches_for: Callable[[Sequence[TokenizedPair]], Iterable[Mapping[str, np.ndarray]]]
    | None = None,
) -> tuple[np.ndarray, np.ndarray, bool]:
    """(chosen, rejected, from_cache): loads the cached reference log-probs for this reference
    model, data and settings, or computes and caches them (written atomically, by process 0).
    Over several processes (a `mesh` that spans them) the cache is used only when every process
    finds it, and otherwise all compute together.

    Given the `pairs` (whose ids index the result) and `batches_for` (the batches of a subset of
    them), a single process uses the per-pair store of these weights and settings instead: only
    the pairs it does not hold are computed, then added to it; `from_cache` is True when none
    was."""
    settings = {**settings, **({"ld_alpha": ld_alpha} if ld_alpha is not None else {})}
    weights = params_fingerprint(model)
    compute = dict(vocab_chunk=vocab_chunk, mesh=mesh, ld_alpha=ld_alpha)
    if pairs is not None and batches_for is not None and jax.process_count() == 1:
        per_pair = {k: v for k, v in settings.items() if k not in ("split", "num_pairs")}
        path = Path(cache_dir) / f"reference_pairs_{cache_key(weights, 'per pair', per_pair)}.npz"
        return _stored_reference(model, pairs, batches_for, num_pairs, path, **compute)
    key = cache_key(weights, data_fingerprint, settings)
    path = Path(cache_dir) / f"reference_logps_{key}.npz"
    cached = None
    if path.is_file():
        with np.load(path) as f:
            if f["chosen"].shape == (num_pairs,):
                cached = f["chosen"], f["rejected"]
    if not hosts.any_process(cached is None):
        return *cached, True
    chosen, rejected = compute_reference_logps(model, make_batches(), num_pairs, **compute)
    if jax.process_index() == 0:
        _write_npz(path, chosen=chosen, rejected=rejected)
    return chosen, rejected, False


def attach_reference(
    batch: Mapping[str, np.ndarray], chosen: np.ndarray, rejected: np.ndarray
) -> dict[str, np.ndarray]:
    """`batch` plus `ref_chosen_logps` / `ref_rejected_logps` looked up by `pair_ids` (works with
    or without a leading micro-batch axis; padding pairs get 0)."""
    ids = np.asarray(batch["pair_ids"])
    safe = np.maximum(ids, 0)
    out = dict(batch)
    out["ref_chosen_logps"] = np.where(ids >= 0, chosen[safe], 0.0).astype(np.float32)
    out["ref_rejected_logps"] = np.where(ids >= 0, rejected[safe], 0.0).astype(np.float32)
    return out
