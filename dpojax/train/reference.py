"""Precomputed reference log-probs: one pass over the data before training, cached on disk.

The cache key is derived from the reference weights (a hash of every parameter's bytes), the data
(a fingerprint the data pipeline provides, e.g. a hash of the tokenized pairs) and the settings that
change log-probs (max length, truncation, layout-independent options...). A training step with
`reference="precomputed"` then skips the reference forward entirely.
"""

from __future__ import annotations

import hashlib
import json
import os
from collections.abc import Callable, Iterable, Mapping
from pathlib import Path
from typing import Any

import jax
import numpy as np
from flax import nnx
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from dpojax.models.transformer import CausalLM
from dpojax.train import hosts
from dpojax.train.batches import step_arrays
from dpojax.train.forward import completion_logps
from dpojax.train.hosts import data_partition, spans_processes
from dpojax.train.state import StepConfig
from dpojax.train.step import mesh_context, place_batch


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


def compute_reference_logps(
    model: CausalLM,
    batches: Iterable[Mapping[str, np.ndarray]],
    num_pairs: int,
    *,
    vocab_chunk: int | None = 4096,
    mesh: Mesh | None = None,
    ld_alpha: float | None = None,
) -> tuple[np.ndarray, np.ndarray]:
    """Sequence log-probs (chosen, rejected) [num_pairs] of `model` over every batch, indexed by
    the batches' `pair_ids` (padding pairs, id -1, are ignored). Every pair must be seen. With
    `ld_alpha` (LD-DPO) the sums are length-desensitised as the step's policy and frozen
    reference sums are.

    On a `mesh` that spans processes every process passes its data partition's batches and the
    passes run on the whole mesh; each process gets every pair's log-probs."""
    cfg = StepConfig(vocab_chunk=vocab_chunk, ld_alpha=ld_alpha)

    def logps(m, batch):
        out = completion_logps(m, batch, cfg)
        return out["sums"][batch["chosen_index"]], out["sums"][batch["rejected_index"]]

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
        jitted = nnx.jit(logps)

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
    if missing.size:
        raise ValueError(
            f"reference pass saw no batch for {missing.size} of {num_pairs} pairs "
            f"(first missing pair ids: {missing[:5].tolist()})"
        )
    return chosen, rejected


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
) -> tuple[np.ndarray, np.ndarray, bool]:
    """(chosen, rejected, from_cache): loads the cached reference log-probs for this reference
    model, data and settings, or computes and caches them (written atomically, by process 0).
    Over several processes (a `mesh` that spans them) the cache is used only when every process
    finds it, and otherwise all compute together."""
    settings = {**settings, **({"ld_alpha": ld_alpha} if ld_alpha is not None else {})}
    key = cache_key(params_fingerprint(model), data_fingerprint, settings)
    path = Path(cache_dir) / f"reference_logps_{key}.npz"
    cached = None
    if path.is_file():
        with np.load(path) as f:
            if f["chosen"].shape == (num_pairs,):
                cached = f["chosen"], f["rejected"]
    if not hosts.any_process(cached is None):
        return *cached, True
    chosen, rejected = compute_reference_logps(
        model, make_batches(), num_pairs, vocab_chunk=vocab_chunk, mesh=mesh, ld_alpha=ld_alpha
    )
    if jax.process_index() == 0:
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_suffix(".tmp.npz")
        np.savez(tmp, chosen=chosen, rejected=rejected)
        os.replace(tmp, path)
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
