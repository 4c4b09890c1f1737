"""Data pipeline: TTC events, NAT import, preference pairs (NAT semantics), pair file formats,
tokenization, batch layouts and the resumable batch iterator."""

from dpojax.data.events import DEFAULT_TTC_STEP_NAME, TTCEvent, read_events, write_events
from dpojax.data.layouts import LAYOUTS, Buckets, build_batch, padding_fraction
from dpojax.data.nat_import import events_from_nat_items, import_nat_eval_output
from dpojax.data.pair_files import (
    TRAINING_FILE,
    VALIDATION_FILE,
    customizer_jsonl,
    customizer_prompt,
    customizer_record,
    customizer_split,
    pair_from_record,
    pairs_to_records,
    read_pairs,
    trl_record,
    write_customizer_files,
    write_pairs,
)
from dpojax.data.pairs import (
    PairBuildResult,
    PairStats,
    PreferencePair,
    build_pairs,
    dedup_pairs,
    pair_key,
    sample_pairs,
)
from dpojax.data.pipeline import BatchIterator
from dpojax.data.problems import DataError, Problem, ReadSummary
from dpojax.data.token_cache import tokenize_pairs_cached
from dpojax.data.tokenize import TokenizedPair, TokenizeResult, tokenize_pair, tokenize_pairs

__all__ = [
    "LAYOUTS",
    "BatchIterator",
    "Buckets",
    "TokenizeResult",
    "TokenizedPair",
    "build_batch",
    "padding_fraction",
    "tokenize_pair",
    "tokenize_pairs",
    "tokenize_pairs_cached",
    "DEFAULT_TTC_STEP_NAME",
    "TRAINING_FILE",
    "VALIDATION_FILE",
    "DataError",
    "PairBuildResult",
    "PairStats",
    "PreferencePair",
    "Problem",
    "ReadSummary",
    "TTCEvent",
    "build_pairs",
    "customizer_jsonl",
    "customizer_prompt",
    "customizer_record",
    "customizer_split",
    "dedup_pairs",
    "events_from_nat_items",
    "import_nat_eval_output",
    "pair_from_record",
    "pair_key",
    "pairs_to_records",
    "read_events",
    "read_pairs",
    "sample_pairs",
    "trl_record",
    "write_customizer_files",
    "write_events",
    "write_pairs",
]
