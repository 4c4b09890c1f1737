"""Batch layouts (docs/layouts.md): tokenized pairs -> static-shape numpy arrays for the step.

Every layout is a set of *segments* placed in rows. A segment is a prompt followed by one or more
completions; within a segment the prompt is part 0 and completion j is part j + 1, each
completion's positions continue from the prompt's end, and the model's attention rule (same
segment, causal, prompt or same part) makes every completion see exactly its own sequence.
- `padded`: a segment per sequence and a row per segment; chosen rows 0..P-1, rejected P..2P-1.
- `packed`: a segment per sequence, packed several per row (first-fit or best-fit decreasing).
- `prefix_shared`: a segment per pair (prompt, chosen, rejected), packed.
- `grouped`: a segment per turn (its prompt once, then each distinct candidate), packed; pairs
  name their completions by slot.
A segment longer than the largest length bucket is split (the prompt is repeated).

Arrays (int32 [R, L] unless noted; see `dpojax.train.logprobs` for how they are consumed):
  tokens, positions, segment_ids (1.. per row, 0 = padding), parts, pred_index (the position whose
  hidden state predicts the token), completion_ids (completion slot 0..C-1, -1 = not scored),
  completion_pos (index of the scored token within its completion, -1 elsewhere);
  chosen_index, rejected_index int32 [P]; pair_mask float32 [P]; pair_ids int64 [P] (-1 = padding).
C = 2P completion slots in every layout (slot p / P + p are pair p's chosen / rejected except in the
grouped layout). R and L come from `Buckets`, so the step compiles for a bounded set of shapes.
"""

from __future__ import annotations

from collections.abc import Callable, Hashable, Sequence
from dataclasses import dataclass

import numpy as np

from dpojax.data.tokenize import TokenizedPair

PACKINGS = ("first_fit", "best_fit")
# The per-token arrays of a batch, each [rows, row length].
ROW_KEYS = (
    "tokens",
    "positions",
    "segment_ids",
    "parts",
    "pred_index",
    "completion_ids",
    "completion_pos",
)
PAIR_KEYS = ("chosen_index", "rejected_index", "pair_mask", "pair_ids")

# (prompt ids, [(slot, completion ids, unscored leading tokens), ...])
Segment = tuple[np.ndarray, list[tuple[int, np.ndarray, int]]]


@dataclass(frozen=True)
class Buckets:
    """Allowed batch shapes.

    `lengths`: row lengths L (the smallest that fits is used; packing layouts also try the next one
    and keep the shape with fewer tokens). `row_bits`: packed row counts R are rounded up to at most
    `row_bits` bits after the leading one (3: 1..15, 16, 18, ..., 30, 32, 36, ...: at most 12.5%
    extra rows). `row_multiple`:
    R is also a multiple of this (e.g. the number of data-parallel devices). `min_row_length`:
    packing layouts use rows at least this long (longer rows pack tighter).
    """

    lengths: tuple[int, ...] = (64, 128, 256, 512, 1024, 2048, 4096, 8192)
    row_bits: int = 3
    row_multiple: int = 1
    min_row_length: int = 0

    def __post_init__(self):
        if (
            not self.lengths
            or list(self.lengths) != sorted(set(self.lengths))
            or self.lengths[0] < 1
        ):
            raise ValueError(f"lengths must be increasing positive ints, got {self.lengths}")
        if self.row_bits < 0 or self.row_multiple < 1:
            raise ValueError("row_bits must be >= 0 and row_multiple >= 1")

    @property
    def max_length(self) -> int:
        return self.lengths[-1]

    def length(self, n: int) -> int:
        """The smallest row length >= n."""
        for b in self.lengths:
            if b >= n:
                return b
        raise ValueError(f"{n} tokens do not fit the largest length bucket {self.lengths[-1]}")

    def rows(self, n: int) -> int:
        """n rounded up to `row_bits` bits after its leading one, then to a multiple of
        `row_multiple`."""
        n = max(n, 1)
        shift = max(n.bit_length() - 1 - self.row_bits, 0)
        n = -(-n >> shift) << shift
        return -(-n // self.row_multiple) * self.row_multiple

    def row_counts(self, max_rows: int) -> list[int]:
        """Every row count `rows` can return for 1..max_rows segments."""
        return sorted({self.rows(n) for n in range(1, max_rows + 1)})


def _segment_length(segment: Segment) -> int:
    return len(segment[0]) + sum(len(ids) for _, ids, _ in segment[1])


def _split(segment: Segment, limit: int) -> list[Segment]:
    """A segment longer than `limit` as several, each with the prompt and some completions."""
    prompt, completions = segment
    if _segment_length(segment) <= limit:
        return [segment]
    out: list[Segment] = []
    current: list[tuple[int, np.ndarray, int]] = []
    used = len(prompt)
    for completion in completions:
        n = len(completion[1])
        if len(prompt) + n > limit:
            raise ValueError(
                f"a sequence of {len(prompt) + n} tokens does not fit the largest length bucket "
                f"{limit}; add a larger bucket or tokenize with a smaller max_length"
            )
        if current and used + n > limit:
            out.append((prompt, current))
            current, used = [], len(prompt)
        current.append(completion)
        used += n
    out.append((prompt, current))
    return out


def _pack(lengths: Sequence[int], capacity: int, packing: str) -> list[list[int]]:
    """Bins (lists of item indices) from first-fit or best-fit decreasing."""
    order = sorted(range(len(lengths)), key=lambda i: -lengths[i])  # stable
    bins: list[list[int]] = []
    free: list[int] = []
    most = -1  # max(free): when the item is larger, no bin can take it and the scan is skipped
    for i in order:
        n = lengths[i]
        chosen = -1
        if n <= most:
            if packing == "first_fit":
                for b, f in enumerate(free):
                    if f >= n:
                        chosen = b
                        break
            else:
                best = capacity + 1
                for b, f in enumerate(free):
                    if n <= f < best:
                        chosen, best = b, f
        if chosen < 0:
            bins.append([i])
            free.append(capacity - n)
            most = max(most, capacity - n)
        else:
            bins[chosen].append(i)
            was = free[chosen]
            free[chosen] = was - n
            if was == most:
                most = max(free)
    return bins


def _place(
    segments: list[Segment], buckets: Buckets, packing: str
) -> tuple[int, int, list[list[Segment]]]:
    """(R, L, rows of segments): for each candidate row length L, split the segments longer than
    L and pack them; keep the shape with the fewest R * L slots. Candidates run from the shortest
    bucket holding every prompt + completion to one past the first holding every segment whole."""
    piece = max(len(p) + len(ids) for p, completions in segments for _, ids, _ in completions)
    whole = max(_segment_length(s) for s in segments)
    first = buckets.lengths.index(buckets.length(max(piece, buckets.min_row_length)))
    best: tuple[int, int, list[list[Segment]]] | None = None
    fits = 0
    for length in buckets.lengths[first:]:
        pieces = [x for s in segments for x in _split(s, length)] if length < whole else segments
        bins = _pack([_segment_length(x) for x in pieces], length, packing)
        rows = buckets.rows(len(bins))
        if best is None or rows * length < best[0] * best[1]:
            best = (rows, length, [[pieces[i] for i in b] for b in bins])
        fits += length >= whole
        if fits == 2:
            break
    return best


def _write(
    rows: list[list[Segment]], num_rows: int, length: int, pad_id: int
) -> dict[str, np.ndarray]:
    """Row arrays for segments laid out row by row (each row's segments back to back)."""
    piece_ids: list[np.ndarray] = []
    # per piece: column, first position, segment id, part, slot, unscored tokens, pred0
    meta: list[tuple[int, int, int, int, int, int, int]] = []
    fill = np.zeros(num_rows, np.int64)  # tokens per row
    for r, segments in enumerate(rows):
        col = 0
        for sid, (prompt, completions) in enumerate(segments, start=1):
            n = len(prompt)
            if n:
                piece_ids.append(prompt)
                meta.append((col, 0, sid, 0, -1, n, col))
            last = col + n - 1
            col += n
            for part, (slot, ids, skip) in enumerate(completions, start=1):
                piece_ids.append(ids)
                meta.append((col, n, sid, part, slot, skip, last if n else col))
                col += len(ids)
        if col > length:
            raise AssertionError(f"row {r} holds {col} tokens > {length}")
        fill[r] = col

    shape = (num_rows, length)
    out = {
        "tokens": np.full(shape, pad_id, np.int32),
        "positions": np.zeros(shape, np.int32),
        "segment_ids": np.zeros(shape, np.int32),
        "parts": np.zeros(shape, np.int32),
        "pred_index": np.broadcast_to(np.arange(length, dtype=np.int32), shape).copy(),
        "completion_ids": np.full(shape, -1, np.int32),
        "completion_pos": np.full(shape, -1, np.int32),
    }
    if not meta:
        return out
    sizes = np.fromiter((len(x) for x in piece_ids), np.int32, len(piece_ids))
    starts = np.cumsum(sizes, dtype=np.int32) - sizes
    g = np.repeat(np.array(meta, np.int32).T, sizes, axis=1)  # per token, one row per field
    within = np.arange(g.shape[1], dtype=np.int32) - np.repeat(starts, sizes)
    col = g[0] + within
    rel = within - g[5]
    scored = rel >= 0
    values = {
        "tokens": np.concatenate(piece_ids),
        "positions": g[1] + within,
        "segment_ids": g[2],
        "parts": g[3],
        "pred_index": np.where(within == 0, g[6], col - 1),
        "completion_ids": np.where(scored, g[4], -1),
        "completion_pos": np.where(scored, rel, -1),
    }
    # Each row's pieces lie back to back from column 0, in row order, so the tokens in piece order
    # are exactly the filled slots in row-major order: a boolean mask places them.
    filled = np.arange(length)[None, :] < fill[:, None]
    for key, value in values.items():
        out[key][filled] = value
    return out


def _pair_arrays(
    pairs: Sequence[TokenizedPair], batch_pairs: int, chosen: Sequence[int], rejected: Sequence[int]
) -> dict[str, np.ndarray]:
    n = len(pairs)
    out = {
        "chosen_index": np.zeros(batch_pairs, np.int32),
        "rejected_index": np.zeros(batch_pairs, np.int32),
        "pair_mask": np.zeros(batch_pairs, np.float32),
        "pair_ids": np.full(batch_pairs, -1, np.int64),
    }
    out["chosen_index"][:n] = chosen
    out["rejected_index"][:n] = rejected
    out["pair_mask"][:n] = 1.0
    out["pair_ids"][:n] = [p.pair_id for p in pairs]
    if any(p.label >= 0 for p in pairs):  # unpaired examples: 1 desirable, 0 undesirable
        out["labels"] = np.zeros(batch_pairs, np.float32)
        out["labels"][:n] = [max(p.label, 0) for p in pairs]
    return out


def _sequence_segments(pairs: Sequence[TokenizedPair], batch_pairs: int) -> list[Segment]:
    """One segment per sequence: all chosen (slots 0..), then all rejected (slots P..)."""
    chosen = [(p.prompt_ids, [(i, p.chosen_ids, p.skip("chosen"))]) for i, p in enumerate(pairs)]
    rejected = [
        (p.prompt_ids, [(batch_pairs + i, p.rejected_ids, p.skip("rejected"))])
        for i, p in enumerate(pairs)
    ]
    return chosen + rejected


def _check(pairs: Sequence[TokenizedPair], batch_pairs: int) -> None:
    if batch_pairs < 1:
        raise ValueError(f"batch_pairs must be >= 1, got {batch_pairs}")
    if len(pairs) > batch_pairs:
        raise ValueError(f"{len(pairs)} pairs do not fit a batch of {batch_pairs}")


def padded_batch(
    pairs: Sequence[TokenizedPair],
    batch_pairs: int,
    buckets: Buckets = Buckets(),
    *,
    pad_id: int = 0,
) -> dict[str, np.ndarray]:
    """One sequence per row, right-padded: chosen rows 0..P-1, then rejected rows P..2P-1."""
    _check(pairs, batch_pairs)
    segments = _sequence_segments(pairs, batch_pairs)
    n = len(pairs)
    rows: list[list[Segment]] = [[] for _ in range(2 * batch_pairs)]
    for i in range(n):
        rows[i] = [segments[i]]
        rows[batch_pairs + i] = [segments[n + i]]
    longest = max([_segment_length(s) for s in segments], default=1)
    num_rows = -(-2 * batch_pairs // buckets.row_multiple) * buckets.row_multiple
    out = _write(rows, num_rows, buckets.length(longest), pad_id)
    slots = np.arange(n)
    return out | _pair_arrays(pairs, batch_pairs, slots, batch_pairs + slots)


def _packed(
    segments: list[Segment],
    pairs: Sequence[TokenizedPair],
    batch_pairs: int,
    chosen: Sequence[int],
    rejected: Sequence[int],
    buckets: Buckets,
    packing: str,
    pad_id: int,
) -> dict[str, np.ndarray]:
    if packing not in PACKINGS:
        raise ValueError(f"packing must be one of {PACKINGS}, got {packing!r}")
    if not segments:
        num_rows, length, rows = buckets.rows(1), buckets.length(1), []
    else:
        num_rows, length, rows = _place(segments, buckets, packing)
    return _write(rows, num_rows, length, pad_id) | _pair_arrays(
        pairs, batch_pairs, chosen, rejected
    )


def packed_batch(
    pairs: Sequence[TokenizedPair],
    batch_pairs: int,
    buckets: Buckets = Buckets(),
    *,
    packing: str = "first_fit",
    pad_id: int = 0,
) -> dict[str, np.ndarray]:
    """Each sequence (prompt + completion) its own segment, several segments per row."""
    _check(pairs, batch_pairs)
    slots = np.arange(len(pairs))
    segments = _sequence_segments(pairs, batch_pairs)
    return _packed(
        segments, pairs, batch_pairs, slots, batch_pairs + slots, buckets, packing, pad_id
    )


def prefix_shared_batch(
    pairs: Sequence[TokenizedPair],
    batch_pairs: int,
    buckets: Buckets = Buckets(),
    *,
    packing: str = "first_fit",
    pad_id: int = 0,
) -> dict[str, np.ndarray]:
    """Each pair one segment: its prompt once, then chosen (part 1), then rejected (part 2)."""
    _check(pairs, batch_pairs)
    segments = [
        (
            p.prompt_ids,
            [
                (i, p.chosen_ids, p.skip("chosen")),
                (batch_pairs + i, p.rejected_ids, p.skip("rejected")),
            ],
        )
        for i, p in enumerate(pairs)
    ]
    slots = np.arange(len(pairs))
    return _packed(
        segments, pairs, batch_pairs, slots, batch_pairs + slots, buckets, packing, pad_id
    )


def _common_prompt(prompts: list[np.ndarray]) -> int:
    """Length of the longest common prefix of the prompts."""
    first = prompts[0]
    n = min(len(p) for p in prompts)
    if all(np.array_equal(p[:n], first[:n]) for p in prompts[1:]):
        return n
    same = np.ones(n, bool)
    for p in prompts[1:]:
        same &= p[:n] == first[:n]
    return int(np.argmin(same))


def grouped_batch(
    pairs: Sequence[TokenizedPair],
    batch_pairs: int,
    buckets: Buckets = Buckets(),
    *,
    packing: str = "first_fit",
    pad_id: int = 0,
) -> dict[str, np.ndarray]:
    """Each group (a turn, or pairs with one prompt) one segment: the prompt once, then each of
    its distinct completions once; pairs point at their completions' slots."""
    _check(pairs, batch_pairs)
    groups: dict[Hashable, list[int]] = {}
    for i, p in enumerate(pairs):
        groups.setdefault(("pair", i) if p.group is None else p.group, []).append(i)
    segments: list[Segment] = []
    chosen = [0] * len(pairs)
    rejected = [0] * len(pairs)
    next_slot = 0
    for members in groups.values():
        shared = _common_prompt([pairs[i].prompt_ids for i in members])
        prompt = pairs[members[0]].prompt_ids[:shared]
        completions: list[tuple[int, np.ndarray, int]] = []
        slots: dict[tuple[bytes, int], int] = {}
        for i in members:
            p = pairs[i]
            for which, out in (("chosen", chosen), ("rejected", rejected)):
                tail = getattr(p, f"{which}_ids")
                if len(p.prompt_ids) > shared:
                    tail = np.concatenate([p.prompt_ids[shared:], tail])
                skip = p.skip(which) + len(p.prompt_ids) - shared
                key = (tail.tobytes(), skip)
                slot = slots.get(key)
                if slot is None:
                    slot = slots[key] = next_slot
                    next_slot += 1
                    completions.append((slot, tail, skip))
                out[i] = slot
        segments.append((prompt, completions))
    return _packed(segments, pairs, batch_pairs, chosen, rejected, buckets, packing, pad_id)


def build_batch(
    pairs: Sequence[TokenizedPair],
    batch_pairs: int,
    layout: str = "padded",
    buckets: Buckets = Buckets(),
    *,
    packing: str = "first_fit",
    pad_id: int = 0,
) -> dict[str, np.ndarray]:
    """The batch arrays of `pairs` (at most `batch_pairs`; the rest are padding pairs) in `layout`."""
    return layout_record(layout).build(pairs, batch_pairs, buckets, packing=packing, pad_id=pad_id)


def padding_fraction(batch: dict[str, np.ndarray]) -> float:
    """Fraction of the batch's token slots that hold no token (segment id 0)."""
    return float(np.mean(batch["segment_ids"] == 0))


def max_num_shapes(layout: str, batch_pairs: int, buckets: Buckets) -> int:
    """An upper bound on the distinct [R, L] shapes `layout` can produce (compilations)."""
    if layout_record(layout).fixed_rows:
        return len(buckets.lengths)
    # at most 2P segments (sequences, or pieces of split segments), so at most 2P rows
    return len(buckets.lengths) * len(buckets.row_counts(2 * batch_pairs))


def _padded(pairs, batch_pairs, buckets, *, packing: str, pad_id: int) -> dict[str, np.ndarray]:
    return padded_batch(pairs, batch_pairs, buckets, pad_id=pad_id)  # no packing: a row a sequence


@dataclass(frozen=True)
class Layout:
    """One batch layout: the only place a new one is registered (`LAYOUT_RECORDS`).

    `build(pairs, batch_pairs, buckets, *, packing, pad_id)` makes the batch arrays; the longest
    row it can need is `longest_row` times `data.max_length` (a prompt shared by two completions
    is twice as long as one sequence); `fixed_rows`: the row count is fixed by the batch (one
    row per sequence), so only the row length varies; `grouped`: a batch keeps the pairs of a
    turn together, so the iterator shuffles turns rather than pairs."""

    name: str
    build: Callable[..., dict[str, np.ndarray]]
    longest_row: int = 1
    fixed_rows: bool = False
    grouped: bool = False


LAYOUT_RECORDS = {
    record.name: record
    for record in (
        Layout("padded", _padded, fixed_rows=True),
        Layout("packed", packed_batch),
        Layout("prefix_shared", prefix_shared_batch, longest_row=2),
        Layout("grouped", grouped_batch, longest_row=2, grouped=True),
    )
}
LAYOUTS = tuple(LAYOUT_RECORDS)


def layout_record(layout: str) -> Layout:
    """The record of `layout`; ValueError naming the layouts for any other name."""
    if layout not in LAYOUT_RECORDS:
        raise ValueError(f"layout must be one of {LAYOUTS}, got {layout!r}")
    return LAYOUT_RECORDS[layout]


def bucket_lengths(
    layout: str, max_length: int, row_lengths: Sequence[int] = ()
) -> tuple[int, ...]:
    """The row lengths of `layout`'s batches: `row_lengths` (data.row_lengths), by default powers
    of two from 16, below the longest row the layout can need (`longest_row` x `max_length`),
    which is always the last."""
    longest = max_length * layout_record(layout).longest_row
    lengths = list(row_lengths)
    if not lengths:
        n = 16
        while n < longest:
            lengths.append(n)
            n *= 2
    return (*(n for n in lengths if n < longest), longest)
