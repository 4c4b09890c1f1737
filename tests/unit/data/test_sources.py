"""Datasets by name and by folder through `datasets.load_dataset`: a local dataset repository with
subsets and splits, shards of parquet / JSON / arrow, streaming, and Hub ids served by an
HF-compatible endpoint on 127.0.0.1 or read from the cache offline. Bad records are reported by
source and row. No test reaches the internet."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from dpojax.data.pair_files import iter_pairs, read_pairs
from dpojax.data.problems import DataError, ReadSummary
from dpojax.data.shapes import RecordShape
from tests.helpers.hub_server import HubServer

datasets = pytest.importorskip("datasets")
ROOT = Path(__file__).resolve().parents[3]

README = """---
configs:
- config_name: default
  data_files:
  - split: train_prefs
    path: data/train_prefs-*.parquet
  - split: test_prefs
    path: data/test_prefs-*.parquet
- config_name: plain
  data_files:
  - split: train
    path: plain/train.parquet
---
# Preference pairs for the tests
"""


def _conv(i: int) -> dict:
    user = {"role": "user", "content": f"Question {i}?"}
    return {
        "prompt": f"Question {i}?",
        "chosen": [user, {"role": "assistant", "content": f"Good answer {i}."}],
        "rejected": [user, {"role": "assistant", "content": f"Bad {i}."}],
        "score_chosen": 8.0,
        "score_rejected": 2.0,
    }


def _dataset_repo(root: Path) -> Path:
    """A dataset repository like HuggingFaceH4/ultrafeedback_binarized: two splits of parquet
    shards in the default subset, and a plain-text subset with its own column names."""
    (root / "data").mkdir(parents=True)
    (root / "plain").mkdir()
    (root / "README.md").write_text(README)
    rows = [_conv(i) for i in range(6)]
    for i in range(2):
        part = datasets.Dataset.from_list(rows[i * 2 : i * 2 + 2])
        part.to_parquet(str(root / "data" / f"train_prefs-{i:05d}-of-00002.parquet"))
    datasets.Dataset.from_list(rows[4:]).to_parquet(str(root / "data" / "test_prefs-0.parquet"))
    plain = [{"q": f"Say {i}:", "good": f" {i}", "bad": f" {i + 1}"} for i in range(3)]
    plain.append({"q": "Say x:", "good": " same", "bad": " same"})  # a bad record (row 4)
    datasets.Dataset.from_list(plain).to_parquet(str(root / "plain" / "train.parquet"))
    return root


def test_local_dataset_repository_subsets_and_splits(tmp_path):
    repo = _dataset_repo(tmp_path / "repo")
    train, summary = read_pairs(repo, split="train_prefs", strict=True)
    assert [p.chosen for p in train] == [f"Good answer {i}." for i in range(4)]
    assert train[0].prompt == [{"role": "user", "content": "Question 0?"}]
    assert summary.records == 4 and summary.kept == 4
    test, _ = read_pairs(repo, split="test_prefs[:1]")
    assert [p.rejected for p in test] == ["Bad 4."]
    with pytest.raises(DataError, match="no split 'validation'"):
        read_pairs(repo, split="validation")

    shape = RecordShape.create({"prompt": "q", "chosen": "good", "rejected": "bad"})
    plain, summary = read_pairs(repo, subset="plain", shape=shape)
    assert [(p.prompt, p.chosen) for p in plain] == [
        ("Say 0:", " 0"),
        ("Say 1:", " 1"),
        ("Say 2:", " 2"),
    ]
    assert [str(p) for p in summary.problems] == [
        f"{repo}:row 4: 'chosen' and 'rejected' are identical"
    ]
    with pytest.raises(DataError, match=r"row 4: 'chosen' and 'rejected' are identical"):
        read_pairs(repo, subset="plain", shape=shape, strict=True)


def test_shard_folders_of_every_format(tmp_path):
    rows = [{"prompt": f"p{i}", "chosen": f" yes {i}", "rejected": f" no {i}"} for i in range(4)]
    for fmt in ("parquet", "json", "arrow"):
        folder = tmp_path / fmt
        folder.mkdir()
        for i in range(2):
            part = datasets.Dataset.from_list(rows[i * 2 : i * 2 + 2])
            target = str(folder / f"train-{i}.{'jsonl' if fmt == 'json' else fmt}")
            if fmt == "parquet":
                part.to_parquet(target)
            elif fmt == "json":
                part.to_json(target)
            else:
                part.save_to_disk(str(tmp_path / "tmp_arrow" / str(i)))
                arrow = next((tmp_path / "tmp_arrow" / str(i)).glob("*.arrow"))
                arrow.rename(target)
        pairs, _ = read_pairs(folder, strict=True)
        assert sorted(p.chosen for p in pairs) == [f" yes {i}" for i in range(4)], fmt


def test_streaming_reads_record_by_record(tmp_path):
    path = tmp_path / "pairs.jsonl"
    rows = [{"prompt": f"p{i}", "chosen": f" a{i}", "rejected": f" b{i}"} for i in range(5)]
    rows[2]["rejected"] = rows[2]["chosen"]
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    summary = ReadSummary(str(path))
    stream = iter_pairs(path, summary, streaming=True)
    first = next(stream)  # a generator: records are read as they are asked for
    assert first[0] == 1 and first[1].chosen == " a0"
    rest = list(stream)
    assert [position for position, _ in rest] == [2, 4, 5]
    assert summary.kept == 4 and summary.records == 5
    assert [str(p) for p in summary.problems] == [
        f"{path}:row 3: 'chosen' and 'rejected' are identical"
    ]
    repo = _dataset_repo(tmp_path / "repo")
    summary = ReadSummary(str(repo))
    streamed = [p for _, p in iter_pairs(repo, summary, split="train_prefs", streaming=True)]
    assert [p.chosen for p in streamed] == [f"Good answer {i}." for i in range(4)]


_READ = """
import json, sys
from dpojax.data.pair_files import read_pairs
pairs, summary = read_pairs(sys.argv[1], split=sys.argv[2] or None, subset=sys.argv[3] or None,
                            streaming=sys.argv[4] == "1")
print(json.dumps({"chosen": [p.chosen for p in pairs], "kept": summary.kept}))
"""


def _read_in_process(ref, env, split="", subset="", streaming=False):
    """read_pairs in a fresh process: `datasets` reads HF_ENDPOINT / HF_HUB_OFFLINE at import."""
    proc = subprocess.run(
        [sys.executable, "-c", _READ, ref, split, subset, "1" if streaming else "0"],
        env={**os.environ, **env},
        capture_output=True,
        text=True,
        cwd=ROOT,
        timeout=300,
    )
    return proc


@pytest.mark.slow
def test_hub_dataset_from_a_local_endpoint_then_offline(tmp_path):
    repo = _dataset_repo(tmp_path / "repo")
    server = HubServer(token="hf_secret")
    server.add_repo("dataset", "acme/prefs", repo)
    server.add_repo("dataset", "acme/private-prefs", repo, private=True)
    env = {"HF_HOME": str(tmp_path / "hf"), "HF_HUB_OFFLINE": "0"}
    with server:
        env["HF_ENDPOINT"] = server.url
        proc = _read_in_process("acme/prefs", env, split="test_prefs")
        assert proc.returncode == 0, proc.stderr[-2000:]
        assert json.loads(proc.stdout.splitlines()[-1]) == {
            "chosen": ["Good answer 4.", "Good answer 5."],
            "kept": 2,
        }
        proc = _read_in_process("acme/prefs", env, split="train", subset="plain", streaming=True)
        assert proc.returncode == 0, proc.stderr[-2000:]
        assert json.loads(proc.stdout.splitlines()[-1])["kept"] == 0  # no column mapping: bad
        proc = _read_in_process("acme/private-prefs", env, split="test_prefs")
        assert proc.returncode != 0 and "acme/private-prefs" in proc.stderr
        proc = _read_in_process(
            "acme/private-prefs", {**env, "HF_TOKEN": "hf_secret"}, split="test_prefs"
        )
        assert proc.returncode == 0, proc.stderr[-2000:]
        # a snapshot in the Hub cache, as `hf download --repo-type dataset` leaves it
        from huggingface_hub import snapshot_download

        snapshot_download(
            "acme/prefs",
            repo_type="dataset",
            cache_dir=str(tmp_path / "hf2" / "hub"),
            endpoint=server.url,
        )
    offline = {"HF_HUB_OFFLINE": "1", "HF_ENDPOINT": "http://127.0.0.1:9"}
    proc = _read_in_process("acme/prefs", {**env, **offline}, split="test_prefs")
    assert proc.returncode == 0, proc.stderr[-2000:]  # prepared by datasets before
    assert json.loads(proc.stdout.splitlines()[-1])["kept"] == 2
    proc = _read_in_process(
        "acme/prefs", {**env, **offline, "HF_HOME": str(tmp_path / "hf2")}, split="train_prefs"
    )
    assert proc.returncode == 0, proc.stderr[-2000:]  # only the Hub cache's snapshot
    assert json.loads(proc.stdout.splitlines()[-1])["kept"] == 4
    proc = _read_in_process("acme/other", {**env, **offline}, split="train")
    assert proc.returncode != 0
    assert "not in the Hugging Face cache" in proc.stderr and "HF_HUB_OFFLINE" in proc.stderr
