"""Problem reporting shared by every reader: `file:line: reason`, summaries, strict mode.

Readers never raise bare parser exceptions. Each bad record becomes a `Problem`; by default the
record is skipped and counted by reason in a `ReadSummary` (logged once), and with `strict=True` the
reader raises a single `DataError` listing every problem. A file that cannot be read at all
(missing, or a single JSON document that does not parse) raises `DataError` in both modes.
"""

from __future__ import annotations

import collections
import json
import logging
import re
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from dpojax.errors import InputProblem

logger = logging.getLogger("dpojax.data")

# Reason codes (the keys of `ReadSummary.skipped` / `ReadSummary.flagged`).
INVALID_UTF8 = "invalid_utf8"
MALFORMED_JSON = "malformed_json"
NOT_AN_OBJECT = "not_an_object"
MISSING_FIELD = "missing_field"
WRONG_TYPE = "wrong_type"
NON_FINITE_SCORE = "non_finite_score"
EMPTY_COMPLETION = "empty_completion"
CHOSEN_EQUALS_REJECTED = "chosen_equals_rejected"
DUPLICATE_KEY = "duplicate_key"

_MAX_LOGGED = 5

# The number of records of a source -> the 0-based indices of those to read, in order.
Selection = Callable[[int], Sequence[int]]


@dataclass(frozen=True, slots=True)
class Problem:
    """One bad record: where it is (`source`, 1-based `line` or row) and what is wrong with it.

    `skipped` is False for records kept as NAT would keep them but flagged (e.g. a prompt replaced
    by its Python repr).
    """

    source: str
    line: int | None
    code: str
    reason: str
    skipped: bool = True
    unit: str = "line"

    def __str__(self) -> str:
        if self.line is None:
            return f"{self.source}: {self.reason}"
        where = str(self.line) if self.unit == "line" else f"{self.unit} {self.line}"
        return f"{self.source}:{where}: {self.reason}"


class DataError(InputProblem):
    """Bad input data. The message lists every problem as `file:line: reason`."""

    multi_line = True

    def __init__(self, problems: Iterable[Problem]):
        self.problems = list(problems)
        lines = [str(p) for p in self.problems]
        if len(lines) != 1:
            lines.insert(0, f"{len(lines)} problems in input data:")
        super().__init__("\n".join(lines))


def fatal(
    source: str | Path, reason: str, line: int | None = None, code: str = "error"
) -> DataError:
    """A `DataError` for a source that cannot be read at all."""
    return DataError([Problem(str(source), line, code, reason)])


@dataclass(slots=True)
class ReadSummary:
    """What a reader did: records seen, kept, and problems counted by reason code."""

    source: str
    records: int = 0
    kept: int = 0
    skipped: collections.Counter = field(default_factory=collections.Counter)
    flagged: collections.Counter = field(default_factory=collections.Counter)
    problems: list[Problem] = field(default_factory=list)

    @property
    def num_skipped(self) -> int:
        return sum(self.skipped.values())

    def add(self, problem: Problem) -> None:
        self.problems.append(problem)
        (self.skipped if problem.skipped else self.flagged)[problem.code] += 1

    def __str__(self) -> str:
        text = (
            f"{self.source}: {self.records} records, {self.kept} kept, {self.num_skipped} skipped"
        )
        if self.skipped:
            text += " (" + ", ".join(f"{k}: {v}" for k, v in sorted(self.skipped.items())) + ")"
        if self.flagged:
            flags = ", ".join(f"{k}: {v}" for k, v in sorted(self.flagged.items()))
            text += f"; flagged but kept ({flags})"
        return text

    def finish(self, strict: bool) -> ReadSummary:
        """Raise `DataError` in strict mode if anything was wrong; else log once and return self."""
        if not self.problems:
            return self
        self.problems.sort(key=lambda p: p.line or 0)  # stable: same-line problems keep order
        if strict:
            raise DataError(self.problems)
        shown = "\n  ".join(str(p) for p in self.problems[:_MAX_LOGGED])
        more = len(self.problems) - _MAX_LOGGED
        tail = f"\n  ... and {more} more" if more > 0 else ""
        logger.warning("%s\n  %s%s", self, shown, tail)
        return self


class BadRecord(Exception):
    """Raised by field validators; the reader turns it into a `Problem` for the record's line."""

    def __init__(self, code: str, reason: str):
        super().__init__(reason)
        self.code = code
        self.reason = reason


def read_bytes(path: str | Path) -> bytes:
    """Read a whole file, turning OS errors into `DataError`."""
    try:
        return Path(path).read_bytes()
    except FileNotFoundError:
        raise fatal(path, "no such file") from None
    except OSError as exc:
        raise fatal(path, f"cannot read ({exc.strerror or exc})") from None


def _utf8_reason(exc: UnicodeDecodeError, raw: bytes) -> str:
    return f"bytes are not valid UTF-8 (byte 0x{raw[exc.start]:02x} at column {exc.start + 1})"


_WIDE_BOMS = (
    (b"\xff\xfe\x00\x00", "UTF-32"),
    (b"\x00\x00\xfe\xff", "UTF-32"),
    (b"\xff\xfe", "UTF-16"),
    (b"\xfe\xff", "UTF-16"),
)


def check_utf8_family(path: str | Path, data: bytes) -> None:
    """Raises `DataError` naming the encoding of a UTF-16 / UTF-32 file (by its byte-order mark,
    or the zero bytes of ASCII text in UTF-16) instead of reporting every line as malformed."""
    head = data[:4096]
    found = next((name for bom, name in _WIDE_BOMS if head.startswith(bom)), None)
    if found is None and len(head) >= 2 and head.count(0) * 3 >= len(head):
        found = "UTF-16"  # ASCII text in UTF-16 without a mark: every other byte is zero
    if found is not None:
        raise fatal(
            path,
            f"the file is encoded in {found}; dpojax reads UTF-8: convert it (e.g. "
            f"`iconv -f {found} -t UTF-8 FILE > FILE.utf8`)",
            1,
            INVALID_UTF8,
        )


class DuplicateKeys(dict):
    """A JSON object in which a key appears more than once (`json` would keep the last value
    silently), or that holds such an object; `paths` names each repeated key (`chosen`,
    `prompt[0].role`)."""

    paths: list[str]

    def reason(self) -> str:
        keys = ", ".join(repr(p) for p in self.paths)
        verb = "key {} appears" if len(self.paths) == 1 else "keys {} appear"
        return (
            verb.format(keys) + " more than once in one object (which value is meant is "
            "unknown): keep one"
        )


def _nested_duplicates(obj: dict[str, Any]) -> Iterator[str]:
    """Paths of the repeated keys of the objects directly inside `obj` (as values, or as
    elements of list values)."""
    for key, value in obj.items():
        if type(value) is DuplicateKeys:
            yield from (f"{key}.{p}" for p in value.paths)
        elif type(value) is list:
            for i, item in enumerate(value):
                if type(item) is DuplicateKeys:
                    yield from (f"{key}[{i}].{p}" for p in item.paths)


def object_with_duplicates(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    """`json`'s `object_pairs_hook`: a dict, or a `DuplicateKeys` when a key repeats in this
    object or in an object inside it."""
    obj = dict(pairs)
    repeated: list[str] = []
    if len(obj) != len(pairs):
        counts = collections.Counter(k for k, _ in pairs)
        repeated = [k for k, c in counts.items() if c > 1]
    repeated.extend(_nested_duplicates(obj))
    if not repeated:
        return obj
    found = DuplicateKeys(obj)
    found.paths = repeated
    return found


def iter_jsonl(
    path: str | Path, summary: ReadSummary, select: Selection | None = None
) -> Iterator[tuple[int, dict[str, Any]]]:
    """Yield `(line_number, object)` for each JSON-object line; bad lines go into `summary`.

    Blank lines are ignored; a UTF-8 byte-order mark on the first line is tolerated. `select`
    (the number of records -> the 0-based indices of those to read, in order) reads a slice;
    the records it leaves out are neither read nor counted.
    """
    source = str(path)
    data = read_bytes(path)
    check_utf8_family(path, data)
    if data.startswith(b"\xef\xbb\xbf"):
        data = data[3:]
    lines = [(n, raw) for n, raw in enumerate(data.split(b"\n"), start=1) if raw.strip()]
    if select is not None:
        lines = [lines[i] for i in select(len(lines))]
    for number, raw in lines:
        summary.records += 1
        try:
            text = raw.decode("utf-8")
        except UnicodeDecodeError as exc:
            summary.add(Problem(source, number, INVALID_UTF8, _utf8_reason(exc, raw)))
            continue
        try:
            obj = json.loads(text, object_pairs_hook=object_with_duplicates)
        except json.JSONDecodeError as exc:
            reason = f"malformed JSON: {exc.msg} (column {exc.colno})"
            summary.add(Problem(source, number, MALFORMED_JSON, reason))
            continue
        if not isinstance(obj, dict):
            reason = f"expected a JSON object, got {type_name(obj)}"
            summary.add(Problem(source, number, NOT_AN_OBJECT, reason))
            continue
        if isinstance(obj, DuplicateKeys):
            summary.add(Problem(source, number, DUPLICATE_KEY, obj.reason()))
            continue
        yield number, obj


def load_json_document(path: str | Path) -> tuple[Any, str]:
    """Parse a whole JSON document into `(value, text)`; an unparseable file raises `DataError`."""
    data = read_bytes(path)
    check_utf8_family(path, data)
    if data.startswith(b"\xef\xbb\xbf"):
        data = data[3:]
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError as exc:
        line = data.count(b"\n", 0, exc.start) + 1
        start = data.rfind(b"\n", 0, exc.start) + 1
        col = exc.start - start + 1
        reason = f"bytes are not valid UTF-8 (byte 0x{data[exc.start]:02x} at column {col})"
        raise fatal(path, reason, line, INVALID_UTF8) from None
    try:
        return json.loads(text, object_pairs_hook=object_with_duplicates), text
    except json.JSONDecodeError as exc:
        reason = f"malformed JSON: {exc.msg} (column {exc.colno})"
        raise fatal(path, reason, exc.lineno, MALFORMED_JSON) from None


_WS = re.compile(r"[ \t\n\r]*")


def json_value_lines(text: str, paths: Iterable[tuple]) -> dict[tuple, int]:
    """1-based line on which the JSON value at each path (tuple of keys / indices) starts.

    Only containers on the way to a wanted path are walked; everything else is skipped by the C
    decoder, so this is cheap enough to run when a problem needs a line number. `text` must be
    valid JSON.
    """
    wanted = set(paths)
    prefixes = {p[:k] for p in wanted for k in range(len(p))}
    decoder = json.JSONDecoder()
    found: dict[tuple, int] = {}

    def skip(i: int) -> int:
        return _WS.match(text, i).end()

    def walk(i: int, path: tuple) -> int:
        i = skip(i)
        if path in wanted:
            found[path] = text.count("\n", 0, i) + 1
        opener = text[i]
        if path not in prefixes or opener not in "[{":
            return decoder.raw_decode(text, i)[1]
        i = skip(i + 1)
        closer = "]" if opener == "[" else "}"
        index = 0
        while text[i] != closer:
            if opener == "[":
                key = index
            else:
                key, i = decoder.raw_decode(text, i)
                i = skip(i) + 1  # the ':'
            i = skip(walk(i, (*path, key)))
            index += 1
            if text[i] == ",":
                i = skip(i + 1)
        return i + 1

    walk(0, ())
    return found


def type_name(value: Any) -> str:
    """JSON-ish name of a value's type, for messages."""
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "boolean"
    if isinstance(value, int | float):
        return "number"
    if isinstance(value, str):
        return "string"
    if isinstance(value, list | tuple):
        return "array"
    if isinstance(value, dict):
        return "object"
    return type(value).__name__
