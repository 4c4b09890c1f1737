"""Unpaired examples in the collect and loop modes, for an unpaired loss (kto,
apo_zero_unpaired): a round's TTC events are labelled by `data.unpaired.*`
(`dpojax.data.unpaired.build_unpaired`: by score threshold, or the top / bottom k of each decision
point, so single-candidate turns count), deduplicated, capped by `collect.max_pairs` (seeded
sample) and written to the round's `unpaired.jsonl` (TRL unpaired records) beside its events and
pairs. A loop round trains on `train_unpaired.jsonl`: its examples and the replayed rounds'
(`loop.replay_rounds`, `loop.replay_dedup`, `loop.max_train_pairs`, `loop.whole_batches`, as for
pairs)."""

from __future__ import annotations

from typing import Any

from dpojax.data.events import TTCEvent
from dpojax.data.pairs import sample_pairs
from dpojax.data.unpaired import UnpairedExample, build_unpaired, dedup_unpaired

UNPAIRED_FILE = "unpaired.jsonl"
TRAIN_UNPAIRED_FILE = "train_unpaired.jsonl"


def label_events(
    config, events: list[TTCEvent], round_index: int
) -> tuple[list[UnpairedExample], dict[str, Any]]:
    """A round's unpaired examples and their counts (`num_examples`, `num_desirable`,
    `num_undesirable`, and `unpaired`: `UnpairedStats` of the labelling); the same on every
    process."""
    u = config.data.unpaired
    labelling = {"top_k": int(u.top_k)} if u.top_k else {"threshold": float(u.threshold)}
    result = build_unpaired(events, ttc_step_name=config.collect.ttc_step_name, **labelling)
    examples = result.examples
    if config.collect.max_pairs:
        examples = sample_pairs(examples, config.collect.max_pairs, config.seed + round_index)
    desirable = sum(e.label for e in examples)
    return examples, {
        "num_examples": len(examples),
        "num_desirable": desirable,
        "num_undesirable": len(examples) - desirable,
        "unpaired": result.stats.as_dict(),
    }


def dedup_examples(examples: list[UnpairedExample]) -> list[UnpairedExample]:
    """Replayed rounds' examples deduplicated (one label disagreeing across rounds drops every
    copy: `dedup_unpaired`)."""
    return dedup_unpaired(examples)[0]
