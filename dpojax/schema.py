"""Typed settings: dataclasses whose fields carry their default, their doc and the allowed choices.

One mechanism describes every group of settings dpojax reads: the config tree
(`dpojax.config.Config`), a workflow's options (e.g. the tic-tac-toe recipe) and the Customizer
client's settings. From such a dataclass come

- the `ml_collections.ConfigDict` of defaults that recipes edit and the command line overrides
  (`to_config_dict`);
- the checks of names, types and choices, one line per problem (`check_values`);
- the reference table of every key (`describe`, rendered into docs/config.md).

A field is declared with `setting(default, doc, choices=..., range=...)`; a nested group is a
field whose default is another such dataclass (`group(SubSettings)`). A number's `Range` sits on
its field, where the settings' owner declares it; `out_of_range` checks an instance against them.
"""

from __future__ import annotations

import dataclasses
import difflib
import json
import types
from collections.abc import Iterator, Mapping, Sequence
from typing import Any

import ml_collections


@dataclasses.dataclass(frozen=True)
class Range:
    """`low <= value <= high` (`<` where open; None: unbounded), or one of `also`."""

    low: float | None = None
    high: float | None = None
    low_open: bool = False
    high_open: bool = False
    also: tuple[float, ...] = ()
    why: str = ""  # what a value outside the range would do; said with the error

    def __contains__(self, value: float) -> bool:
        if value in self.also:
            return True
        above = self.low is None or (value > self.low if self.low_open else value >= self.low)
        below = self.high is None or (value < self.high if self.high_open else value <= self.high)
        return above and below

    def text(self) -> str:
        if self.low is not None and self.high is not None:
            left, right = "(" if self.low_open else "[", ")" if self.high_open else "]"
            out = f"in {left}{self.low:g}, {self.high:g}{right}"
        elif self.low is not None:
            out = f"{'>' if self.low_open else '>='} {self.low:g}"
        elif self.high is not None:
            out = f"{'<' if self.high_open else '<='} {self.high:g}"
        else:
            out = "finite"
        return out + "".join(f" or {a:g}" for a in self.also)


NON_NEGATIVE = Range(0)
POSITIVE = Range(0, low_open=True)
AT_LEAST_ONE = Range(1)
FRACTION = Range(0, 1)


def setting(
    default: Any,
    doc: str,
    *,
    choices: Sequence[Any] | None = None,
    range: Range | None = None,  # noqa: A002 - the field's range, as the tables name it
) -> Any:
    """A dataclass field with its default, one-sentence doc and, optionally, the allowed values
    or (a number) the allowed range."""
    metadata = {
        "doc": doc,
        "choices": tuple(choices) if choices is not None else None,
        "range": range,
    }
    if isinstance(default, list | dict):
        return dataclasses.field(default_factory=lambda: type(default)(default), metadata=metadata)
    return dataclasses.field(default=default, metadata=metadata)


def out_of_range(settings: Any, label: str = "") -> list[str]:
    """One line per number of the settings dataclass instance `settings` outside the range its
    field declares, naming `label` + the field. Values that are not plain numbers (a traced
    array) are not judged."""
    errors = []
    for field in dataclasses.fields(settings):
        bounds, value = field.metadata.get("range"), getattr(settings, field.name)
        number = isinstance(value, int | float) and not isinstance(value, bool)
        if bounds is not None and number and value not in bounds:
            why = f" ({bounds.why})" if bounds.why else ""
            errors.append(f"{label}{field.name} must be {bounds.text()}, got {value!r}{why}")
    return errors


def options(doc: str) -> Any:
    """A field that holds the sub-groups a settings group does not declare (a workflow's own
    options, `collect.<workflow>.*`): read-only mappings by name. No key of its own (`keys`,
    `to_config_dict` pass it over); `frozen_view` fills it, `as_dict` puts the sub-groups back
    beside the group's keys."""
    return dataclasses.field(
        default_factory=lambda: types.MappingProxyType({}), metadata={"doc": doc, "options": True}
    )


def _is_options(field: dataclasses.Field) -> bool:
    return bool(field.metadata.get("options"))


def group(cls: type, doc: str = "") -> Any:
    """A nested group of settings (`cls` is a settings dataclass)."""
    return dataclasses.field(default_factory=cls, metadata={"doc": doc or cls.__doc__ or ""})


@dataclasses.dataclass(frozen=True)
class Key:
    """One leaf of a settings tree, flattened: `name` is dotted (`optim.learning_rate`)."""

    name: str
    default: Any
    doc: str
    choices: tuple[Any, ...] | None
    range: Range | None = None


def _default(field: dataclasses.Field) -> Any:
    if field.default is not dataclasses.MISSING:
        return field.default
    if field.default_factory is not dataclasses.MISSING:
        return field.default_factory()
    return ""  # a required value: empty until set


def keys(cls: type, prefix: str = "") -> Iterator[Key]:
    """Every leaf setting of the dataclass `cls` (groups flattened), in declaration order."""
    for field in dataclasses.fields(cls):
        if _is_options(field):
            continue
        name = prefix + field.name
        default = _default(field)
        if dataclasses.is_dataclass(default):
            yield from keys(type(default), name + ".")
            continue
        meta = field.metadata
        yield Key(
            name,
            "" if default is None else default,
            meta.get("doc", ""),
            meta.get("choices"),
            meta.get("range"),
        )


def frozen_view(cls: type, values: Mapping[str, Any]) -> Any:
    """An instance of the settings dataclass `cls` holding `values` (a validated ConfigDict or
    mapping of the same tree): groups become their dataclasses, lists tuples. The sub-groups a
    group does not declare (a workflow's own options) go, read-only, into its `options` field,
    where it has one (else they are left out)."""
    kwargs = {}
    declared = {f.name for f in dataclasses.fields(cls)}
    for field in dataclasses.fields(cls):
        if _is_options(field):
            # a ConfigDict's items() and to_dict() are sorted; its JSON keeps the keys' own order
            given = values
            if isinstance(values, ml_collections.ConfigDict):
                given = json.loads(values.to_json_best_effort())
            kwargs[field.name] = types.MappingProxyType(
                {k: _read_only(v) for k, v in given.items() if k not in declared}
            )
            continue
        default = _default(field)
        value = values[field.name]
        if dataclasses.is_dataclass(default):
            kwargs[field.name] = frozen_view(type(default), value)
        else:
            kwargs[field.name] = tuple(value) if isinstance(value, list) else value
    return cls(**kwargs)


def _read_only(value: Any) -> Any:
    if isinstance(value, Mapping | ml_collections.ConfigDict):
        return types.MappingProxyType({k: _read_only(v) for k, v in value.items()})
    return tuple(value) if isinstance(value, list) else value


def plain(value: Any) -> Any:
    """A read-only mapping (an `options` field's) as nested plain dicts."""
    if isinstance(value, Mapping):
        return {k: plain(v) for k, v in value.items()}
    return value


def as_dict(settings: Any) -> dict[str, Any]:
    """The settings dataclass instance as a nested dict in declaration order (the shape of its
    ConfigDict's `to_dict()`: a group's options beside its keys)."""
    out: dict[str, Any] = {}
    for field in dataclasses.fields(settings):
        value = getattr(settings, field.name)
        if _is_options(field):
            out.update(plain(value))
        elif dataclasses.is_dataclass(value):
            out[field.name] = as_dict(value)
        else:
            out[field.name] = value
    return out


def replaced(settings: Any, changes: Mapping[str, Any]) -> Any:
    """A copy of the settings dataclass instance with `changes` (dotted key -> value) made; a
    key must name a field of the tree (KeyError otherwise). Lists become tuples."""
    by_group: dict[str, dict[str, Any]] = {}
    direct: dict[str, Any] = {}
    for key, value in changes.items():
        head, _, rest = key.partition(".")
        if rest:
            by_group.setdefault(head, {})[rest] = value
        else:
            direct[head] = tuple(value) if isinstance(value, list) else value
    fields = dataclasses.fields(settings)
    names = {f.name for f in fields}
    held = next((f.name for f in fields if _is_options(f)), None)
    opts = dict(getattr(settings, held)) if held else {}
    unknown = sorted(set(direct) - names) + sorted(set(by_group) - names - set(opts))
    if unknown:
        raise KeyError(f"{type(settings).__name__} has no setting {unknown[0]!r}")
    for head, sub in by_group.items():
        if head in names:
            direct[head] = replaced(getattr(settings, head), sub)
        else:  # a sub-group of the options
            opts[head] = _read_only({**opts[head], **sub})
    if held and set(by_group) - names:
        direct[held] = types.MappingProxyType(opts)
    return dataclasses.replace(settings, **direct)


def to_config_dict(cls: type) -> ml_collections.ConfigDict:
    """The defaults of `cls` as a ConfigDict (groups become nested ConfigDicts; None is "")."""
    out = ml_collections.ConfigDict()
    for field in dataclasses.fields(cls):
        if _is_options(field):
            continue
        default = _default(field)
        if dataclasses.is_dataclass(default):
            out[field.name] = to_config_dict(type(default))
        else:
            out[field.name] = "" if default is None else default
    return out


def leaves(tree: Mapping[str, Any], prefix: str = "") -> Iterator[tuple[str, Any]]:
    """(dotted name, value) of every leaf of a nested mapping or ConfigDict."""
    for name, value in tree.items():
        if isinstance(value, Mapping | ml_collections.ConfigDict):
            yield from leaves(value, f"{prefix}{name}.")
        else:
            yield prefix + name, value


def _type_ok(value: Any, want: Any) -> bool:
    if isinstance(want, bool) or isinstance(value, bool):
        return isinstance(value, bool) and isinstance(want, bool)
    if isinstance(want, float):
        return isinstance(value, int | float)
    if isinstance(want, tuple):
        return isinstance(value, tuple | list)
    return isinstance(value, type(want))


def _same_leaf(name: str, known: Sequence[str]) -> list[str]:
    """Known keys whose last part is (or is close to) `name`'s: a key given at the wrong level
    (`learning_rate` for `optim.learning_rate`)."""
    leaf = name.rsplit(".", 1)[-1]
    by_leaf: dict[str, list[str]] = {}
    for k in known:
        by_leaf.setdefault(k.rsplit(".", 1)[-1], []).append(k)
    close = difflib.get_close_matches(leaf, by_leaf, n=1)
    return sorted(by_leaf[close[0]]) if close else []


def closest_key(name: str, known: Sequence[str]) -> str | None:
    """The known key `name` most likely meant: the closest whole name whose last part is close to
    `name`'s too (`mesh.pipes` is not close to `mesh.tensor`, however alike the whole names),
    else the key whose last part is closest to `name`'s (a key given at the wrong level); None
    when nothing is close."""
    leaf = name.rsplit(".", 1)[-1]
    whole = [
        k
        for k in difflib.get_close_matches(name, known, n=3)
        if difflib.get_close_matches(leaf, [k.rsplit(".", 1)[-1]], n=1)
    ]
    close = whole or _same_leaf(name, known)
    return close[0] if close else None


def check_values(
    values: Mapping[str, Any], known: Sequence[Key], *, label: str = "config key"
) -> list[str]:
    """One line per unknown name (with the closest known one), value of the wrong type (compared
    with the default's type; ints pass for floats, lists for tuples) and value outside its
    choices. `values` maps dotted names to values (see `leaves`)."""
    by_name = {k.name: k for k in known}
    errors = []
    for name, value in values.items():
        key = by_name.get(name)
        if key is None:
            close = closest_key(name, list(by_name))
            hint = f"; did you mean '{close}'?" if close else ""
            errors.append(f"{label} '{name}' is unknown{hint}")
        elif not _type_ok(value, key.default):
            errors.append(
                f"{label} '{name}' must be {type(key.default).__name__}, got "
                f"{type(value).__name__} {value!r}"
            )
        elif key.choices is not None and value not in key.choices:
            errors.append(
                f"{label} '{name}' must be one of {', '.join(map(str, key.choices))}; got {value!r}"
            )
    return errors


def describe(known: Sequence[Key], ranges: Mapping[str, str] | None = None) -> list[str]:
    """A markdown table of `known`: key, default, choices (or, from `ranges`, the allowed range
    of a number, e.g. `>= 0`), doc."""
    head = "choices or range" if ranges is not None else "choices"
    lines = [f"| key | default | {head} | meaning |", "|---|---|---|---|"]
    for k in known:
        choices = ", ".join(f"`{c}`" for c in k.choices) if k.choices else ""
        if ranges and k.name in ranges:
            choices = f"{choices} {ranges[k.name]}".strip()
        doc = k.doc.replace("|", "\\|")
        lines.append(f"| `{k.name}` | `{k.default!r}` | {choices} | {doc} |")
    return lines
