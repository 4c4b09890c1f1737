"""Preference pairs from TTC events, with NeMo Agent Toolkit 1.9's DPO trajectory-builder semantics.

`build_pairs` reproduces NAT's builder exactly (docs/data.md#building-pairs): events whose `name` equals
`ttc_step_name` are grouped by the key `f"{example_id}::{turn_id}"` in first-appearance order; each
turn's candidates are stable-sorted by score, descending (ties keep their order); exhaustive mode
pairs every i < j in that order, keeps `d = s_i - s_j >= min_score_diff`, stable-sorts the turn's
pairs by `d` descending and keeps the first `max_pairs_per_turn`; best-vs-worst mode pairs the first
and the last candidate (same filter, the cap is ignored). Every pair uses the chosen candidate's
prompt; the reward is `d` or the chosen score; pairs are grouped by example in first-appearance
order.

One deliberate difference: a pair only ever joins two candidates that answered the same input.
A turn whose candidates answered different inputs (a producer bug, or ids containing `::`) is
paired within each input's candidates, as separate turns, and counted with its key in
`PairStats.mixed_input_turns` / `mixed_input_ids` (and logged); NAT would pair one prompt with
another prompt's answer.

`dedup_pairs` is NAT's trainer dedup (first occurrence wins); `sample_pairs` replaces NAT's unseeded
`random.sample` with a seeded, reproducible sample.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Hashable, Iterable, Sequence
from dataclasses import asdict, dataclass, field
from typing import Any

import numpy as np

from dpojax.data.events import DEFAULT_TTC_STEP_NAME, TTCEvent
from dpojax.data.records import Completion, Prompt, copy_prompt

logger = logging.getLogger("dpojax.data")
_MAX_LOGGED_IDS = 10


@dataclass(slots=True)
class PreferencePair:
    """A prompt (string or messages) with a preferred and a dispreferred completion (each a
    string, or chat messages: one assistant turn or several turns with tool calls and results).

    `tools` (JSON schemas) and `chat_kwargs` (e.g. `{"enable_thinking": False}`) are the record's
    own arguments to the chat template, as TRL reads them from a dataset's `tools` and
    `chat_template_kwargs` columns.

    Pairs from `build_pairs` carry NAT's trajectory metadata: `dpo_type`, `reward`,
    `score_diff`, `example_id`, `turn_id`, `chosen_score`, `rejected_score`, `chosen_index`,
    `rejected_index`, plus `chosen_raw_metadata` / `rejected_raw_metadata` (exhaustive mode) or
    `num_candidates` (best-vs-worst mode).
    """

    prompt: Prompt
    chosen: Completion
    rejected: Completion
    metadata: dict[str, Any] = field(default_factory=dict)
    tools: list[Any] | None = None
    chat_kwargs: dict[str, Any] | None = None

    @property
    def reward(self) -> float | None:
        return self.metadata.get("reward")

    @property
    def conversational(self) -> bool:
        """Whether the pair goes through the chat template (any part is a message list)."""
        return not all(isinstance(x, str) for x in (self.prompt, self.chosen, self.rejected))

    def to_dict(self) -> dict[str, Any]:
        out = {
            "prompt": copy_prompt(self.prompt),
            "chosen": copy_prompt(self.chosen),
            "rejected": copy_prompt(self.rejected),
            "metadata": dict(self.metadata),
        }
        if self.tools is not None:
            out["tools"] = self.tools
        if self.chat_kwargs is not None:
            out["chat_template_kwargs"] = dict(self.chat_kwargs)
        return out


@dataclass(slots=True)
class PairStats:
    """NAT's builder counters (`skipped_score_diff` counts filtered pairs, not the per-turn cap),
    and `mixed_input_turns`: turns whose candidates answered different inputs (paired only
    within the same input), their turn keys in `mixed_input_ids`."""

    total_examples: int = 0
    total_turns: int = 0
    total_candidates: int = 0
    total_pairs: int = 0
    total_trajectories: int = 0
    skipped_single_candidate: int = 0
    skipped_score_diff: int = 0
    mixed_input_turns: int = 0
    mixed_input_ids: list[str] = field(default_factory=list)

    def as_dict(self) -> dict[str, int]:
        """The counters (`mixed_input_ids` left out)."""
        out = asdict(self)
        del out["mixed_input_ids"]
        return out

    def __str__(self) -> str:
        text = (
            f"{self.total_examples} examples, {self.total_turns} turns, "
            f"{self.total_candidates} candidates, {self.total_pairs} pairs "
            f"(skipped: {self.skipped_single_candidate} single-candidate turns, "
            f"{self.skipped_score_diff} pairs below min_score_diff)"
        )
        if self.mixed_input_turns:
            text += f"; {self.mixed_input_turns} {_MIXED}: {_shown_ids(self.mixed_input_ids)}"
        return text


_MIXED = "turns whose candidates answered different inputs (paired only within the same input)"


def _shown_ids(ids: list[str]) -> str:
    shown = ", ".join(repr(i) for i in ids[:_MAX_LOGGED_IDS])
    more = len(ids) - _MAX_LOGGED_IDS
    return shown + (f" and {more} more" if more > 0 else "")


@dataclass(slots=True)
class PairBuildResult:
    """`groups`: one list of pairs per example (NAT's `trajectories`); `pairs`: them flattened."""

    groups: list[list[PreferencePair]]
    stats: PairStats

    @property
    def pairs(self) -> list[PreferencePair]:
        return [p for group in self.groups for p in group]


def _make_pair(
    chosen: TTCEvent,
    rejected: TTCEvent,
    reward_from_score_diff: bool,
    extra: dict[str, Any],
) -> PreferencePair:
    diff = chosen.score - rejected.score
    metadata = {
        "dpo_type": "preference_pair",
        "reward": diff if reward_from_score_diff else chosen.score,
        "score_diff": diff,
        "example_id": str(chosen.example_id),
        "turn_id": chosen.turn_id,
        "chosen_score": chosen.score,
        "rejected_score": rejected.score,
        "chosen_index": chosen.candidate_index,
        "rejected_index": rejected.candidate_index,
        **extra,
    }
    return PreferencePair(copy_prompt(chosen.input), chosen.output, rejected.output, metadata)


def _turn_pairs(
    ranked: list[TTCEvent],
    exhaustive: bool,
    min_score_diff: float,
    max_pairs_per_turn: int | None,
    reward_from_score_diff: bool,
    stats: PairStats,
) -> list[PreferencePair]:
    """Pairs of one turn whose candidates are already sorted best first."""
    if not exhaustive:
        if len(ranked) < 2:
            return []
        best, worst = ranked[0], ranked[-1]
        if best.score - worst.score < min_score_diff:
            stats.skipped_score_diff += 1
            return []
        extra = {"num_candidates": len(ranked)}
        return [_make_pair(best, worst, reward_from_score_diff, extra)]
    found: list[tuple[float, TTCEvent, TTCEvent]] = []
    for i, chosen in enumerate(ranked):
        for rejected in ranked[i + 1 :]:
            diff = chosen.score - rejected.score
            if diff < min_score_diff:
                stats.skipped_score_diff += 1
                continue
            found.append((diff, chosen, rejected))
    found.sort(key=lambda t: t[0], reverse=True)  # stable: equal d keep generation order
    if max_pairs_per_turn is not None:
        found = found[:max_pairs_per_turn]
    return [
        _make_pair(
            c,
            r,
            reward_from_score_diff,
            {
                "chosen_raw_metadata": dict(c.metadata or {}),
                "rejected_raw_metadata": dict(r.metadata or {}),
            },
        )
        for _, c, r in found
    ]


def build_pairs(
    events: Iterable[TTCEvent],
    *,
    ttc_step_name: str = DEFAULT_TTC_STEP_NAME,
    exhaustive_pairs: bool = True,
    min_score_diff: float = 0.0,
    max_pairs_per_turn: int | None = None,
    reward_from_score_diff: bool = True,
    require_multiple_candidates: bool = True,
) -> PairBuildResult:
    """Build preference pairs exactly as NAT's DPO trajectory builder does (see module docstring).

    Returns a `PairBuildResult`: `.groups` (per example), `.pairs` (flattened, NAT's order) and
    `.stats` (NAT's counters). `require_multiple_candidates` only changes the counter: a single
    candidate never yields a pair.
    """
    if min_score_diff < 0:
        raise ValueError(f"min_score_diff must be >= 0, got {min_score_diff}")
    if max_pairs_per_turn is not None and max_pairs_per_turn < 1:
        raise ValueError(f"max_pairs_per_turn must be None or >= 1, got {max_pairs_per_turn}")
    stats = PairStats()
    turns: dict[str, list[TTCEvent]] = {}
    for event in events:
        if event.name != ttc_step_name:
            continue
        stats.total_candidates += 1
        turns.setdefault(f"{event.example_id}::{event.turn_id}", []).append(event)
    stats.total_turns = len(turns)

    by_example: dict[str, list[PreferencePair]] = {}
    for key, candidates in turns.items():
        if len(candidates) < 2 and require_multiple_candidates:
            stats.skipped_single_candidate += 1
            continue
        same_input = _by_input(candidates)
        if len(same_input) > 1:
            stats.mixed_input_turns += 1
            stats.mixed_input_ids.append(key)
        for group in same_input:
            ranked = sorted(group, key=lambda e: e.score, reverse=True)  # stable
            for pair in _turn_pairs(
                ranked,
                exhaustive_pairs,
                min_score_diff,
                max_pairs_per_turn,
                reward_from_score_diff,
                stats,
            ):
                stats.total_pairs += 1
                by_example.setdefault(pair.metadata["example_id"], []).append(pair)
    groups = list(by_example.values())
    stats.total_trajectories = stats.total_pairs
    stats.total_examples = len(groups)
    if stats.mixed_input_turns:
        ids = _shown_ids(stats.mixed_input_ids)
        logger.warning("%d %s: %s", stats.mixed_input_turns, _MIXED, ids)
    return PairBuildResult(groups, stats)


def _by_input(candidates: list[TTCEvent]) -> list[list[TTCEvent]]:
    """A turn's candidates in groups that answered the same input, in first-appearance order."""
    groups: dict[Hashable, list[TTCEvent]] = {}
    for candidate in candidates:
        groups.setdefault(_hashable(candidate.input), []).append(candidate)
    return list(groups.values())


def _hashable(part: Prompt | Completion) -> Hashable:
    if isinstance(part, str):
        return part
    if all(set(m) <= {"role", "content"} for m in part):
        return tuple((m["role"], m["content"]) for m in part)
    return json.dumps(part, sort_keys=True, default=str)


def _template_args(pair: PreferencePair) -> str | None:
    """The record's own chat-template arguments (`tools`, `chat_kwargs`) as a key."""
    if pair.tools is None and pair.chat_kwargs is None:
        return None
    return json.dumps([pair.tools, pair.chat_kwargs], sort_keys=True, default=str)


def pair_key(pair: PreferencePair) -> Hashable:
    """The dedup key: everything that changes the pair's tokens. NAT's key (the prompt, every
    message's role and content, chosen and rejected; messages with more keys than role and
    content are compared whole), plus the record's `tools` and `chat_template_kwargs`."""
    parts = (_hashable(pair.prompt), _hashable(pair.chosen), _hashable(pair.rejected))
    return (*parts, _template_args(pair))


def dedup_pairs(pairs: Iterable[PreferencePair]) -> list[PreferencePair]:
    """Drop exact duplicates (no normalisation); the first occurrence wins and order is kept."""
    seen: set[Hashable] = set()
    kept: list[PreferencePair] = []
    for pair in pairs:
        key = pair_key(pair)
        if key not in seen:
            seen.add(key)
            kept.append(pair)
    return kept


def sample_pairs(
    pairs: Sequence[PreferencePair], max_pairs: int, seed: int
) -> list[PreferencePair]:
    """At most `max_pairs` pairs drawn without replacement, reproducibly from `seed`.

    Like NAT, returns the pairs unchanged when there are no more than `max_pairs`, and otherwise the
    sample in sample order. Each pair gets a key from PCG64(seed)'s raw stream (fixed across numpy
    versions and platforms); the pairs with the smallest keys are taken, smallest first.
    """
    if max_pairs < 1:
        raise ValueError(f"max_pairs must be >= 1, got {max_pairs}")
    if len(pairs) <= max_pairs:
        return list(pairs)
    keys = np.random.PCG64(seed).random_raw(len(pairs))
    order = np.argsort(keys, kind="stable")[:max_pairs]
    return [pairs[int(i)] for i in order]
