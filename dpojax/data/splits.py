"""Splits of local sources, named and sliced as `datasets` names and slices them.

A split request is a split name, optionally sliced (`train`, `train[:20]`, `train[10%:]`,
`train[-50:]`, `train[:10]+train[20:]`): the grammar and the rounding of percentages are
`datasets.ReadInstruction`'s, so a slice selects the same records of a local file as of the
same data on the Hub. A single file holds one split, `train`; a Customizer folder holds `train`
and `validation`; a `datasets.save_to_disk` folder holds its own.
"""

from __future__ import annotations

import dataclasses
import re
from collections.abc import Sequence

from dpojax.data.problems import fatal

# The split name at the start of one `+`-joined part of a request.
_NAME = re.compile(r"\s*([^\[(\s]+)")
SINGLE_FILE = ("train",)
SINGLE_FILE_HINT = (
    " (a single file holds one split, 'train': give other data as a file of its own, e.g. "
    "data.eval_path)"
)
EXAMPLES = "e.g. train, train[:100], train[10%:], train[-50:]"


@dataclasses.dataclass(frozen=True)
class Split:
    """One split request: `spec` as given, the split names it reads (`+` joins several) and
    whether it is sliced."""

    spec: str
    names: tuple[str, ...]
    sliced: bool

    @property
    def name(self) -> str:
        return self.names[0]

    def indices(self, n: int) -> list[int]:
        """0-based indices of the records this request selects from a split of `n` records, in
        `datasets`' order (the parts of a `+` request one after another)."""
        import datasets

        instructions = datasets.ReadInstruction.from_spec(self.spec).to_absolute({self.name: n})
        return [i for ins in instructions for i in range(ins.from_, ins.to)]


def parse_split(spec: str | None, shown: str) -> Split | None:
    """The request `spec` (None or "": no request); a `DataError` naming `shown` when it is not a
    split name or slice."""
    if not spec:
        return None
    import datasets

    try:
        datasets.ReadInstruction.from_spec(spec)
    except (ValueError, AssertionError) as exc:
        raise fatal(
            shown, f"split {spec!r} is not a split name or slice ({exc}); {EXAMPLES}"
        ) from None
    names = dict.fromkeys(m.group(1) for m in map(_NAME.match, spec.split("+")) if m)
    return Split(spec, tuple(names), "[" in spec)


def require_split(split: Split, available: Sequence[str], shown: str, hint: str = "") -> None:
    """A `DataError` naming the source, the split asked and the splits it has, unless
    `split` reads one split and it is one of `available`."""
    if len(split.names) > 1:
        raise fatal(
            shown,
            f"split {split.spec!r} joins several splits ({', '.join(split.names)}); a local "
            "file or folder is read one split at a time",
        )
    if split.name in available:
        return
    asked = "" if split.spec == split.name else f" (asked: {split.spec!r})"
    raise fatal(shown, f"no split {split.name!r}{asked}; available: {', '.join(available)}{hint}")
