"""Splits of local files and folders (`data.train_split` / `data.eval_split`): a slice selects
the records `datasets` would select from the same data, a named split a source does not have is
an error naming the source, the split asked and the splits it has, and bad records keep their
own line or row numbers inside a slice."""

from __future__ import annotations

import json

import pytest

from dpojax.data import DataError, read_pairs
from dpojax.data.pair_files import iter_pairs
from dpojax.data.problems import ReadSummary
from dpojax.data.splits import parse_split

datasets = pytest.importorskip("datasets")

ROWS = [{"prompt": f"p{i}", "chosen": f" yes {i}", "rejected": f" no {i}"} for i in range(10)]


def _chosen(pairs):
    return [int(p.chosen.split()[-1]) for p in pairs]


@pytest.fixture
def jsonl(tmp_path):
    path = tmp_path / "pairs.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in ROWS))
    return path


# What `datasets.load_dataset("json", data_files=..., split=spec)` selects from 10 rows.
SLICES = {
    "train[:3]": [0, 1, 2],
    "train[50%:]": [5, 6, 7, 8, 9],
    "train[-2:]": [8, 9],
    "train[2:4]+train[:1]": [2, 3, 0],
    "train[33%:66%]": [3, 4, 5, 6],
}


@pytest.mark.parametrize(("spec", "expected"), SLICES.items())
def test_a_slice_of_a_local_file_selects_what_datasets_selects(tmp_path, jsonl, spec, expected):
    pairs, summary = read_pairs(jsonl, split=spec, strict=True)
    assert _chosen(pairs) == expected
    assert summary.records == len(expected)
    array = tmp_path / "pairs.json"
    array.write_text(json.dumps(ROWS, indent=1))
    assert _chosen(read_pairs(array, split=spec, strict=True)[0]) == expected
    parquet = tmp_path / "pairs.parquet"
    datasets.Dataset.from_list(ROWS).to_parquet(str(parquet))
    assert _chosen(read_pairs(parquet, split=spec, strict=True)[0]) == expected


def test_a_whole_file_is_its_train_split(jsonl):
    assert _chosen(read_pairs(jsonl)[0]) == list(range(10))
    assert _chosen(read_pairs(jsonl, split="train")[0]) == list(range(10))


@pytest.mark.parametrize("spec", ["validation", "test[:5]"])
def test_a_split_a_single_file_does_not_have_is_an_error(jsonl, spec):
    name = spec.split("[")[0]
    with pytest.raises(DataError) as info:
        read_pairs(jsonl, split=spec)
    message = str(info.value)
    assert message.startswith(f"{jsonl}: no split {name!r}")
    assert "available: train" in message and "data.eval_path" in message


def test_a_malformed_split_is_an_error_with_examples(jsonl):
    with pytest.raises(DataError, match=r"split 'train\[:3' is not a split name or slice.*e\.g\."):
        read_pairs(jsonl, split="train[:3")
    with pytest.raises(DataError, match="joins several splits"):
        read_pairs(jsonl, split="train+validation")


def test_bad_records_in_a_slice_keep_their_line_numbers(tmp_path):
    path = tmp_path / "pairs.jsonl"
    lines = [json.dumps(r) for r in ROWS]
    lines[6] = "{not json"
    lines[1] = json.dumps({**ROWS[1], "rejected": ROWS[1]["chosen"]})
    path.write_text("\n".join(lines) + "\n")
    pairs, summary = read_pairs(path, split="train[5:]")
    assert _chosen(pairs) == [5, 7, 8, 9]
    assert summary.records == 5 and summary.kept == 4
    assert [p.line for p in summary.problems] == [7]  # line 2's problem is outside the slice
    with pytest.raises(DataError, match=r":7: malformed JSON"):
        read_pairs(path, split="train[5:]", strict=True)


def test_customizer_folder_splits_slice_each_file(tmp_path):
    folder = tmp_path / "ds"
    for sub, rows in (("training", ROWS[:6]), ("validation", ROWS[6:])):
        (folder / sub).mkdir(parents=True)
        records = [
            {
                "prompt": r["prompt"],
                "chosen_response": r["chosen"],
                "rejected_response": r["rejected"],
            }
            for r in rows
        ]
        (folder / sub / f"{sub}_file.jsonl").write_text("\n".join(map(json.dumps, records)))
    assert _chosen(read_pairs(folder, split="validation[:1]")[0]) == [6]
    assert _chosen(read_pairs(folder, split="train[-2:]")[0]) == [4, 5]
    with pytest.raises(DataError, match="no split 'test' .*available: train, validation$"):
        read_pairs(folder, split="test[:1]")


def test_save_to_disk_folders_slice_and_name_their_splits(tmp_path):
    one = datasets.Dataset.from_list(ROWS)
    one.save_to_disk(str(tmp_path / "one"))
    assert _chosen(read_pairs(tmp_path / "one", split="train[:2]")[0]) == [0, 1]
    with pytest.raises(DataError, match="no split 'validation'; available: train"):
        read_pairs(tmp_path / "one", split="validation")
    dd = datasets.DatasetDict({"train": one, "test": one.select(range(7, 10))})
    dd.save_to_disk(str(tmp_path / "dd"))
    assert _chosen(read_pairs(tmp_path / "dd", split="test[1:]")[0]) == [8, 9]
    with pytest.raises(DataError, match=r"no split 'validation' \(asked: 'validation\[:1\]'\)"):
        read_pairs(tmp_path / "dd", split="validation[:1]")


def test_streaming_refuses_a_slice_and_checks_the_name(jsonl):
    with pytest.raises(DataError, match="is a slice.*streaming"):
        list(iter_pairs(jsonl, ReadSummary(str(jsonl)), split="train[:2]", streaming=True))
    with pytest.raises(DataError, match="no split 'validation'"):
        list(iter_pairs(jsonl, ReadSummary(str(jsonl)), split="validation", streaming=True))


def test_parse_split_reads_names_and_slices():
    assert parse_split(None, "x") is None and parse_split("", "x") is None
    split = parse_split("train_prefs[:10%]", "x")
    assert (split.names, split.sliced) == (("train_prefs",), True)
    assert parse_split("test+train", "x").names == ("test", "train")
