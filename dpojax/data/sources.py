"""Where preference records come from: local files and folders, and datasets by name.

`open_source(ref, ...)` gives the records of

- a `.jsonl` / `.json` file (JSON lines, or one array of records) or a `.parquet` file;
- a Customizer dataset folder (`training/training_file.jsonl`, `validation/validation_file.jsonl`);
- a `datasets.save_to_disk` folder;
- any other local folder that `datasets.load_dataset` reads: parquet, JSON or arrow shards, or a
  dataset repository with its README's `configs` (`subset` picks one);
- a Hugging Face Hub dataset id, `org/name` or `org/name@revision`, through
  `datasets.load_dataset` (its cache, `HF_TOKEN`, `HF_ENDPOINT` and `HF_HUB_OFFLINE` apply; offline,
  a snapshot in the Hub cache, e.g. from `hf download org/name --repo-type dataset`, is used
  when `datasets` has no prepared copy);

as `(position, record)` pairs plus how positions are shown in messages (`line` or `row`). `split`
picks a split (`train`, `test`) or a slice of one (`train[:1000]`, `train[10%:]`), for local
files as for datasets (`dpojax.data.splits`: a single file holds one split, `train`); a split
the source does not have is a `DataError` naming the splits it has. `streaming=True` reads
records one by one instead of preparing the whole dataset first (data larger than memory or
disk); slices need the records counted first, so they are refused there.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

from dpojax.data.problems import (
    ReadSummary,
    Selection,
    fatal,
    iter_jsonl,
    json_value_lines,
    load_json_document,
)
from dpojax.data.splits import SINGLE_FILE, SINGLE_FILE_HINT, Split, parse_split, require_split
from dpojax.models.hub import HubError, hub_error, is_hub_id, offline, split_revision, token

TRAINING_FILE = "training/training_file.jsonl"
VALIDATION_FILE = "validation/validation_file.jsonl"
# Single files that `datasets` streams, by suffix -> its builder.
_BUILDERS = {".jsonl": "json", ".json": "json", ".parquet": "parquet", ".arrow": "arrow"}

# `resolve` maps the positions of bad records to line numbers (JSON arrays).
Resolver = Callable[[list[int]], dict[int, int]]


def _identity(positions: list[int]) -> dict[int, int]:
    return {p: p for p in positions}


@dataclasses.dataclass
class Source:
    """Records `(position, record)` of one source; `shown` names it in messages, `unit` says
    whether positions are lines or rows."""

    records: Iterator[tuple[int, Any]]
    shown: str
    unit: str = "line"
    resolve: Resolver = _identity


def _starts_with_bracket(path: Path) -> bool:
    try:
        with path.open("rb") as f:
            head = f.read(4096)
    except OSError:
        return False  # read_bytes reports it
    return head.lstrip(b"\xef\xbb\xbf \t\r\n").startswith(b"[")


def _selected(items: list[Any], select: Selection | None, start: int) -> list[tuple[int, Any]]:
    """`(position, item)` of the items `select` picks (all without it); positions count from
    `start` in the whole list."""
    indices = range(len(items)) if select is None else select(len(items))
    return [(i + start, items[i]) for i in indices]


def _json_source(path: Path, summary: ReadSummary, select: Selection | None) -> Source:
    """JSON lines, or (a `.json` file starting with `[`) one array of records."""
    if path.suffix != ".json" or not _starts_with_bracket(path):
        return Source(iter_jsonl(path, summary, select), str(path))
    doc, text = load_json_document(path)
    records = _selected(doc, select, 0)
    summary.records = len(records)
    resolve = lambda positions: {
        i: line for (i,), line in json_value_lines(text, [(i,) for i in positions]).items()
    }
    return Source(iter(records), str(path), resolve=resolve)


def _pick_split(loaded: Any, split: Split | None, shown: str) -> Any:
    """One split of a (possibly streaming) DatasetDict: `split`, else the only one, else train.
    A single Dataset holds one split: its own name, else `train`."""
    import datasets

    if isinstance(loaded, datasets.DatasetDict | datasets.IterableDatasetDict):
        names = list(loaded)
        if split is not None:
            require_split(split, names, shown)
            return loaded[split.name]
        name = names[0] if len(names) == 1 else "train"
        if name not in loaded:
            raise fatal(shown, f"no split {name!r}; available: {', '.join(names)}")
        return loaded[name]
    if split is not None:
        own = str(loaded.split) if getattr(loaded, "split", None) else "train"
        require_split(split, [own.split("[")[0]], shown)
    return loaded


def _rows(
    loaded: Any, summary: ReadSummary, select: Selection | None = None
) -> Iterator[tuple[int, Any]]:
    """1-based row numbers and rows of a Dataset (counted; `select` picks rows) or an
    IterableDataset (streamed)."""
    if not hasattr(loaded, "__len__"):
        return enumerate(loaded, start=1)
    if select is None:
        summary.records = len(loaded)
        return enumerate(loaded, start=1)
    indices = list(select(len(loaded)))
    summary.records = len(indices)
    return zip((i + 1 for i in indices), loaded.select(indices), strict=True)


def _load_dataset(shown: str, *args, split: str | None, **kwargs) -> Any:
    """`datasets.load_dataset(*args, **kwargs)` of one split; failures become `DataError`."""
    import datasets

    try:
        loaded = datasets.load_dataset(*args, split=split, **kwargs)
    except HubError:
        raise
    except ValueError as exc:
        if "split" in str(exc).lower() and split is not None:
            raise fatal(shown, f"no split {split!r} ({exc})") from None
        raise fatal(shown, f"cannot read dataset ({type(exc).__name__}: {exc})") from None
    except Exception as exc:  # the libraries raise many types; report them all as DataError
        raise fatal(shown, f"cannot read dataset ({type(exc).__name__}: {exc})") from None
    return loaded if split is not None else _pick_split(loaded, None, shown)


def _hub_dataset(ref: str, split: str | None, subset: str | None, streaming: bool) -> Any:
    """A split of the Hub dataset `ref` (`org/name[@revision]`)."""

    repo_id, revision = split_revision(ref)
    kwargs = dict(name=subset or None, revision=revision, streaming=streaming, token=token())
    try:
        return _load_dataset(ref, repo_id, split=split, **kwargs)
    except Exception as exc:
        if not offline():
            raise
        first = exc
    # Offline and not prepared by `datasets`: a snapshot downloaded into the Hub cache will do.
    from huggingface_hub import snapshot_download

    from dpojax.models.hub import cache_dir

    try:
        local = snapshot_download(
            repo_id,
            repo_type="dataset",
            revision=revision,
            cache_dir=cache_dir(),
            local_files_only=True,
        )
    except Exception as exc:
        raise fatal(ref, str(hub_error("dataset", ref, exc))) from first
    del kwargs["revision"], kwargs["token"]
    return _load_dataset(ref, local, split=split, **kwargs)


def _save_to_disk(path: Path, split: Split | None, summary: ReadSummary) -> Source:
    import datasets

    try:
        loaded = datasets.load_from_disk(str(path))
    except Exception as exc:  # the libraries raise many types; report them all as DataError
        raise fatal(path, f"cannot read dataset ({type(exc).__name__}: {exc})") from None
    loaded = _pick_split(loaded, split, str(path))
    select = split.indices if split and split.sliced else None
    return Source(_rows(loaded, summary, select), str(path), "row")


_CUSTOMIZER_FILES = {"train": TRAINING_FILE, "training": TRAINING_FILE}
_CUSTOMIZER_FILES |= {"validation": VALIDATION_FILE, "val": VALIDATION_FILE}


def _customizer_source(path: Path, split: Split | None, summary: ReadSummary) -> Source:
    if split is None:
        file = path / TRAINING_FILE
        return Source(iter_jsonl(file, summary), str(file))
    if len(split.names) > 1 or split.name not in _CUSTOMIZER_FILES:
        require_split(split, ("train", "validation"), str(path))
    file = path / _CUSTOMIZER_FILES[split.name]
    select = split.indices if split.sliced else None
    return Source(iter_jsonl(file, summary, select), str(file))


def _folder_source(
    path: Path, split: Split | None, subset: str | None, streaming: bool, summary: ReadSummary
) -> Source:
    if (path / TRAINING_FILE).is_file():
        return _customizer_source(path, split, summary)
    if (path / "state.json").is_file() or (path / "dataset_dict.json").is_file():
        return _save_to_disk(path, split, summary)
    if not any(p.is_file() and not p.name.startswith(".") for p in path.rglob("*")):
        raise fatal(
            path,
            "folder is neither a datasets.save_to_disk folder nor a Customizer set, and holds "
            "no data files",
        )
    spec = split.spec if split else None
    loaded = _load_dataset(str(path), str(path), split=spec, name=subset, streaming=streaming)
    return Source(_rows(loaded, summary), str(path), "row")


def _parquet_rows(path: Path) -> list[Any]:
    try:
        import pyarrow.parquet as pq

        return pq.read_table(path).to_pylist()
    except Exception as exc:  # pyarrow raises many types; report them all as DataError
        raise fatal(path, f"cannot read dataset ({type(exc).__name__}: {exc})") from None


def _local_source(
    path: Path, split: Split | None, subset: str | None, streaming: bool, summary: ReadSummary
) -> Source:
    if path.is_dir():
        return _folder_source(path, split, subset, streaming, summary)
    if split is not None:  # a single file holds one split, `train`
        require_split(split, SINGLE_FILE, str(path), SINGLE_FILE_HINT)
    select = split.indices if split and split.sliced else None
    if streaming and path.suffix in _BUILDERS:
        builder = _BUILDERS[path.suffix]
        loaded = _load_dataset(
            str(path), builder, split="train", data_files=str(path), streaming=True
        )
        return Source(_rows(loaded, summary), str(path), "row")
    if path.suffix == ".parquet":
        rows = _selected(_parquet_rows(path), select, 1)
        summary.records = len(rows)
        return Source(iter(rows), str(path), "row")
    if path.suffix == ".arrow":
        loaded = _load_dataset(str(path), "arrow", split="train", data_files=str(path))
        return Source(_rows(loaded, summary, select), str(path), "row")
    return _json_source(path, summary, select)


def open_source(
    ref: str | Path,
    summary: ReadSummary,
    *,
    split: str | None = None,
    subset: str | None = None,
    streaming: bool = False,
) -> Source:
    """The records of a local file or folder, or of a Hub dataset id (module docstring)."""
    path = Path(ref)
    if not path.exists() and not is_hub_id(str(ref)):
        raise fatal(path, "no such file, folder or Hugging Face Hub dataset id (org/name)")
    request = parse_split(split, str(ref))
    if streaming and request is not None and request.sliced:
        raise fatal(
            ref,
            f"split {split!r} is a slice, which needs the records counted first: not with "
            "streaming (data.streaming); read the whole split, or drop streaming",
        )
    if path.exists():
        return _local_source(path, request, subset, streaming, summary)
    loaded = _hub_dataset(str(ref), split, subset, streaming)
    return Source(_rows(loaded, summary), str(ref), "row")
