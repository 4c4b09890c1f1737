"""The input pipeline: tokenized pairs -> batches in a deterministic, resumable order.

Each epoch's order is a pure function of `(seed, epoch)` (a stable argsort of PCG64's raw stream,
fixed across numpy versions and platforms), so the iterator's position is just `(epoch, step)`:
`state()` returns it as a small JSON-serialisable dict and `restore(state)` continues exactly
where that state was taken, in this or another process.

Multi-host: the global batch of step s is `batch_pairs * process_count` consecutive pairs of the
epoch's order; host `process_index` takes its contiguous `batch_pairs` of them. Every host runs
the same number of steps, and over an epoch the hosts' pairs partition the dataset. (A "host"
here is a data partition: the processes of a multi-process run that feed the same devices'
part of the batch, `dpojax.train.hosts.data_partition`.) The position depends only on the
global batch, so a state restores on any number of hosts with the same global batch.

A state also carries the content fingerprint of the pairs (`content_fingerprint`: every token of
every prompt and completion, which is chosen and which rejected, the prompt lengths and the pair
ids), so a resume on edited data (a swapped label, a changed text) is refused even when the
pairs' count and lengths are unchanged.
"""

from __future__ import annotations

import functools
import hashlib
import zlib
from collections.abc import Hashable, Iterator, Sequence
from typing import Any

import numpy as np

from dpojax.data.layouts import PACKINGS, Buckets, build_batch, layout_record
from dpojax.data.tokenize import TokenizedPair

STATE_FORMAT = "dpojax.batch_iterator/1"


# State keys whose difference means other data (`restore(..., allow_data_change=True)` accepts it).
DATA_KEYS = ("num_pairs", "fingerprint", "content")


def content_fingerprint(pairs: Sequence[TokenizedPair]) -> str:
    """A sha256 over what training reads of `pairs`, in order: each pair's id, prompt lengths,
    prompt tokens and chosen then rejected tokens (each array prefixed by its length, so no two
    different sequences of pairs hash alike)."""
    h = hashlib.sha256()
    for p in pairs:
        h.update(np.int64(p.pair_id).tobytes())
        for part in pair_token_bytes(p):
            h.update(part)
    return h.hexdigest()


def pair_token_bytes(p: TokenizedPair) -> Iterator[bytes]:
    """What a pair's log-probs depend on, as bytes: its prompt lengths, then its prompt, chosen
    and rejected token ids, each prefixed by its length (so no two pairs give the same bytes)."""
    yield np.asarray((p.chosen_prompt_len, p.rejected_prompt_len), np.int64).tobytes()
    if p.label >= 0:  # an unpaired example's label (pairs' bytes unchanged)
        yield b"label" + np.int64(p.label).tobytes()
    for ids in (p.prompt_ids, p.chosen_ids, p.rejected_ids):
        yield np.int64(len(ids)).tobytes()
        yield np.asarray(ids, np.int32).tobytes()


def shuffled_order(n: int, seed: int, epoch: int) -> np.ndarray:
    """A permutation of range(n) determined by (seed, epoch)."""
    keys = np.random.PCG64(np.random.SeedSequence([seed, epoch])).random_raw(n)
    return np.argsort(keys, kind="stable")


class BatchIterator(Iterator[dict[str, np.ndarray]]):
    """Batches of `batch_pairs` pairs (per host) in `layout`, over `num_epochs` (None: forever).

    With `shuffle`, each epoch visits the pairs in a new seeded order; `shuffle_groups` (default:
    on for the grouped layout) shuffles whole groups (a turn's pairs stay together, so they share
    one prompt in the batch) instead of single pairs; with `group_size` a group larger than that
    is cut into pieces of at most `group_size` pairs (in the data's order), each shuffled on its
    own, so a batch holds more groups. The last batch of an epoch is filled with padding pairs
    (`pair_mask` 0) unless `drop_remainder`.
    """

    def __init__(
        self,
        pairs: Sequence[TokenizedPair],
        *,
        batch_pairs: int,
        layout: str = "padded",
        buckets: Buckets | None = None,
        seed: int = 0,
        shuffle: bool = True,
        shuffle_groups: bool | None = None,
        num_epochs: int | None = None,
        drop_remainder: bool = False,
        process_index: int = 0,
        process_count: int = 1,
        packing: str = "first_fit",
        pad_id: int = 0,
        group_size: int = 0,
    ):
        record = layout_record(layout)  # ValueError for an unknown layout
        if packing not in PACKINGS:
            raise ValueError(f"packing must be one of {PACKINGS}, got {packing!r}")
        if batch_pairs < 1:
            raise ValueError(f"batch_pairs must be >= 1, got {batch_pairs}")
        if not 0 <= process_index < process_count:
            raise ValueError(f"process_index {process_index} not in [0, {process_count})")
        if num_epochs is not None and num_epochs < 0:
            raise ValueError(f"num_epochs must be None or >= 0, got {num_epochs}")
        if not pairs:
            raise ValueError("no pairs to iterate over")
        if group_size < 0:
            raise ValueError(f"group_size must be >= 0, got {group_size}")
        self.pairs = pairs
        self.batch_pairs = batch_pairs
        self.layout = layout
        self.buckets = buckets or Buckets()
        self.seed = seed
        self.shuffle = shuffle
        self.shuffle_groups = record.grouped if shuffle_groups is None else shuffle_groups
        self.num_epochs = num_epochs
        self.drop_remainder = drop_remainder
        self.process_index = process_index
        self.process_count = process_count
        self.packing = packing
        self.pad_id = pad_id
        self.group_size = group_size
        self.global_batch = batch_pairs * process_count
        n = len(pairs)
        self.steps_per_epoch = (
            n // self.global_batch if drop_remainder else -(-n // self.global_batch)
        )
        if self.steps_per_epoch == 0:
            raise ValueError(f"{n} pairs do not fill one global batch of {self.global_batch}")
        self._groups = self._group_members() if self.shuffle_groups else None
        ids = np.fromiter((p.pair_id for p in pairs), np.int64, n)
        lengths = np.fromiter((p.num_tokens for p in pairs), np.int64, n)
        self.fingerprint = zlib.crc32(ids.tobytes() + lengths.tobytes())
        self.epoch = 0
        self.step = 0
        self._order: tuple[int, np.ndarray] | None = None

    @functools.cached_property
    def content(self) -> str:
        """`content_fingerprint` of the pairs (computed once, on first use)."""
        return content_fingerprint(self.pairs)

    def _group_members(self) -> list[np.ndarray]:
        groups: dict[Hashable, list[int]] = {}
        for i, p in enumerate(self.pairs):
            groups.setdefault(("pair", i) if p.group is None else p.group, []).append(i)
        size = self.group_size or len(self.pairs)
        return [
            np.asarray(m[start : start + size], np.int64)
            for m in groups.values()
            for start in range(0, len(m), size)
        ]

    def epoch_order(self, epoch: int) -> np.ndarray:
        """Indices into `pairs` in the order epoch `epoch` visits them (the same on every host)."""
        if self._order is not None and self._order[0] == epoch:
            return self._order[1]
        n = len(self.pairs)
        if not self.shuffle:
            order = np.arange(n)
        elif self._groups is not None:
            perm = shuffled_order(len(self._groups), self.seed, epoch)
            order = np.concatenate([self._groups[g] for g in perm])
        else:
            order = shuffled_order(n, self.seed, epoch)
        self._order = (epoch, order)
        return order

    def batch_indices(self, epoch: int, step: int) -> np.ndarray:
        """This host's indices into `pairs` for (epoch, step); fewer than `batch_pairs` at the end."""
        start = step * self.global_batch + self.process_index * self.batch_pairs
        return self.epoch_order(epoch)[start : start + self.batch_pairs]

    def batch(self, epoch: int, step: int) -> dict[str, np.ndarray]:
        """The batch arrays for (epoch, step), without moving the iterator."""
        chosen = [self.pairs[int(i)] for i in self.batch_indices(epoch, step)]
        return build_batch(
            chosen,
            self.batch_pairs,
            self.layout,
            self.buckets,
            packing=self.packing,
            pad_id=self.pad_id,
        )

    def __iter__(self) -> BatchIterator:
        return self

    def __next__(self) -> dict[str, np.ndarray]:
        if self.num_epochs is not None and self.epoch >= self.num_epochs:
            raise StopIteration
        out = self.batch(self.epoch, self.step)
        self.step += 1
        if self.step == self.steps_per_epoch:
            self.epoch, self.step = self.epoch + 1, 0
        return out

    def state(self) -> dict[str, Any]:
        """The iterator's position and what it depends on, as a JSON-serialisable dict."""
        return {
            "format": STATE_FORMAT,
            "epoch": self.epoch,
            "step": self.step,
            "seed": self.seed,
            "shuffle": self.shuffle,
            "shuffle_groups": self.shuffle_groups,
            "group_size": self.group_size,
            "batch_pairs": self.batch_pairs,
            "global_batch": self.global_batch,
            "process_count": self.process_count,
            "process_index": self.process_index,
            "drop_remainder": self.drop_remainder,
            "num_pairs": len(self.pairs),
            "fingerprint": self.fingerprint,
            "content": self.content,
        }

    def restore(self, state: dict[str, Any], *, allow_data_change: bool = False) -> list[str]:
        """Continue from `state()`; raises ValueError if it was taken on a different order or
        other data (the number of hosts may differ when the global batch is the same). With
        `allow_data_change` a difference in the data (`DATA_KEYS`) is accepted: the differences
        are returned ("key: saved ..., now ...") for the caller to record. A state saved before
        the content fingerprint existed is checked without it."""
        if state.get("format") != STATE_FORMAT:
            raise ValueError(f"not a {STATE_FORMAT} state: {state.get('format')!r}")
        mine = self.state()
        if "global_batch" not in state and "batch_pairs" in state:  # saved before global_batch
            state = {**state, "global_batch": state["batch_pairs"] * state["process_count"]}
        keys = (
            "seed",
            "shuffle",
            "shuffle_groups",
            "group_size",
            "global_batch",
            "drop_remainder",
            "num_pairs",
            "fingerprint",
            "content",
        )
        if "content" not in state:
            state = {**state, "content": mine["content"]}
        state = {"group_size": 0, **state}  # saved before group_size: whole groups
        diff = [k for k in keys if state.get(k) != mine[k]]
        accepted = [k for k in diff if allow_data_change and k in DATA_KEYS]
        lines = {k: f"{k}: saved {state.get(k)!r}, now {mine[k]!r}" for k in diff}
        if len(accepted) < len(diff):
            raise ValueError("cannot resume the data iterator: " + "; ".join(lines.values()))
        epoch, step = int(state["epoch"]), int(state["step"])
        if epoch < 0 or not 0 <= step < self.steps_per_epoch:
            raise ValueError(f"bad position in state: epoch {epoch}, step {step}")
        self.epoch, self.step = epoch, step
        return [lines[k] for k in accepted]


class StepBatches(Iterator[list[dict[str, np.ndarray]]]):
    """A training step's batches: each `next()` is the `micro_batches` micro-batches of one
    optimizer step (`train.grad_accum`), in order, from `batches`, so the training loop asks for
    the next step and nothing else. The position is the micro-batch iterator's (`state()`,
    `restore()`), taken between steps."""

    def __init__(self, batches: BatchIterator, micro_batches: int):
        if micro_batches < 1:
            raise ValueError(f"micro_batches must be >= 1, got {micro_batches}")
        self.batches, self.micro_batches = batches, micro_batches

    def __iter__(self) -> StepBatches:
        return self

    def __next__(self) -> list[dict[str, np.ndarray]]:
        return [next(self.batches) for _ in range(self.micro_batches)]

    @property
    def content(self) -> str:
        """The content fingerprint of the pairs (`BatchIterator.content`)."""
        return self.batches.content

    def state(self) -> dict[str, Any]:
        return self.batches.state()

    def restore(self, state: dict[str, Any], *, allow_data_change: bool = False) -> list[str]:
        return self.batches.restore(state, allow_data_change=allow_data_change)
