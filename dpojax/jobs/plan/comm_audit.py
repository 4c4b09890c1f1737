"""The communication audit of a compiled step: every collective in XLA's compiled HLO text, with
its operand shapes and bytes, the mesh axes its device groups span, how many times it runs per
step (the trip counts of the loops around it applied), the bytes each device moves for it, totals
per mesh axis, and a warning for any collective whose operand carries the global token dimension
(activations of the whole batch moved between devices: the sign of a lost activation sharding).

Pure text processing; docs/plan.md#communication explains the figures.
"""

from __future__ import annotations

import dataclasses
import itertools
import re
from collections.abc import Sequence
from typing import Any

import numpy as np

KINDS = (
    "all-reduce",
    "all-gather",
    "reduce-scatter",
    "all-to-all",
    "collective-permute",
    "collective-broadcast",
    "ragged-all-to-all",
)
_BYTES = {
    "pred": 1,
    "s4": 0.5,
    "u4": 0.5,
    "s8": 1,
    "u8": 1,
    "s16": 2,
    "u16": 2,
    "f16": 2,
    "bf16": 2,
    "s32": 4,
    "u32": 4,
    "f32": 4,
    "s64": 8,
    "u64": 8,
    "f64": 8,
    "c64": 8,
    "c128": 16,
}
_SHAPE = re.compile(r"\b(pred|[sucf]\d+|bf16|f8e\w+)\[([\d,]*)\]")
_HEADER = re.compile(r"^(?:ENTRY\s+)?%?([\w.\-]+)\s+\(.*\{\s*$")
_INSTRUCTION = re.compile(r"^\s*(?:ROOT\s+)?%?([\w.\-]+)\s*=\s*(.*?)\s([a-z][\w\-]*)\((.*)$")
_CALLS = re.compile(
    r"\b(calls|to_apply|body|condition|true_computation|false_computation)=%?([\w.\-]+)"
)
_BRANCHES = re.compile(r"branch_computations=\{([^}]*)\}")
_TRIP = re.compile(r'"known_trip_count":\{"n":"(\d+)"')


@dataclasses.dataclass
class _Op:
    name: str
    shape: str
    opcode: str
    rest: str


def _shapes(text: str) -> list[tuple[str, tuple[int, ...]]]:
    return [
        (dtype, tuple(int(d) for d in dims.split(",") if d)) for dtype, dims in _SHAPE.findall(text)
    ]


def _nbytes(shapes: Sequence[tuple[str, tuple[int, ...]]]) -> float:
    return float(sum(_BYTES.get(t, 1) * int(np.prod(d, dtype=np.int64)) for t, d in shapes))


def parse_module(text: str) -> tuple[dict[str, list[_Op]], str | None]:
    """({computation name: its instructions}, the entry computation's name) of HLO text."""
    computations: dict[str, list[_Op]] = {}
    entry, current = None, None
    for line in text.splitlines():
        header = _HEADER.match(line)
        if header and not line.startswith(" "):
            current = header.group(1)
            computations[current] = []
            if line.startswith("ENTRY"):
                entry = current
            continue
        if current is None:
            continue
        if line.startswith("}"):
            current = None
            continue
        op = _INSTRUCTION.match(line)
        if op:
            computations[current].append(_Op(*op.groups()))
    return computations, entry


def _trip_count(op: _Op, computations: dict[str, list[_Op]]) -> int | None:
    """A while loop's trip count: XLA's known_trip_count, else the constant its condition compares
    the induction variable with (`i < N`); None when neither is there."""
    known = _TRIP.search(op.rest)
    if known:
        return int(known.group(1))
    cond = re.search(r"condition=%?([\w.\-]+)", op.rest)
    constants = []
    for inner in computations.get(cond.group(1) if cond else "", []):
        if inner.opcode == "constant":
            value = re.match(r"\s*(-?\d+)\)", inner.rest)
            if value and re.match(r"s32\[\]|s64\[\]|u32\[\]", inner.shape):
                constants.append(int(value.group(1)))
    return constants[0] if len(constants) == 1 else None


def _callees(op: _Op) -> list[tuple[str, str]]:
    """(role, computation) of every computation `op` calls."""
    callees = [m.groups() for m in _CALLS.finditer(op.rest)]
    for branch in _BRANCHES.findall(op.rest):
        callees += [("branch", b.strip().lstrip("%")) for b in branch.split(",")]
    return callees


def multiplicities(computations: dict[str, list[_Op]], entry: str) -> tuple[dict[str, int], int]:
    """How many times each computation runs per execution of `entry` (a while body: its loop's
    trip count times; nested loops multiply), and how many loops that hold a collective had no
    trip count (counted once)."""
    counts: dict[str, int] = {}
    unknown = 0
    holds: dict[str, bool] = {}

    def has_collective(name: str) -> bool:
        if name not in holds:
            holds[name] = False  # a cycle cannot occur in HLO; this only stops repeats
            holds[name] = any(
                _kind(op.opcode) is not None
                or any(has_collective(c) for r, c in _callees(op) if c in computations)
                for op in computations.get(name, [])
            )
        return holds[name]

    def visit(name: str, times: int) -> None:
        nonlocal unknown
        counts[name] = counts.get(name, 0) + times
        for op in computations.get(name, []):
            callees = _callees(op)
            trip = 1
            if op.opcode == "while":
                found = _trip_count(op, computations)
                body = dict(callees).get("body", "")
                unknown += found is None and has_collective(body)
                trip = found or 1
            for role, callee in callees:
                if callee in computations and role != "to_apply":
                    visit(callee, times * (trip if role in ("body", "condition") else 1))

    visit(entry, 1)
    return counts, unknown


def _groups(rest: str, devices: int) -> list[list[int]] | None:
    """The device groups of a collective: `replica_groups={{0,1},{2,3}}`, the iota form
    `[2,4]<=[4,2]T(1,0)`, the mesh form `mesh['a'=2,'b'=4] {'b'}`, or source_target_pairs; all
    devices when empty."""
    pairs = re.search(r"source_target_pairs=\{((?:\{\d+,\d+\},?)*)\}", rest)
    if pairs:
        return [[int(x) for x in p.split(",")] for p in re.findall(r"\{([\d,]+)\}", pairs.group(1))]
    mesh = re.search(r"replica_groups=mesh\[([^\]]*)\]\s*\{([^}]*)\}", rest)
    if mesh:
        axes = re.findall(r"'(\w+)'=(\d+)", mesh.group(1))
        names, sizes = [a for a, _ in axes], [int(s) for _, s in axes]
        if int(np.prod(sizes)) != devices:
            return None
        grid = np.arange(devices).reshape(sizes)
        spanned = [names.index(a) for a in re.findall(r"'(\w+)'", mesh.group(2))]
        kept = [i for i in range(len(sizes)) if i not in spanned]
        moved = np.transpose(grid, kept + spanned).reshape(
            -1, int(np.prod([sizes[i] for i in spanned]))
        )
        return moved.tolist()
    iota = re.search(r"replica_groups=\[(\d+),(\d+)\]<=\[([\d,]+)\](?:T\(([\d,]+)\))?", rest)
    if iota:
        g, s = int(iota.group(1)), int(iota.group(2))
        dims = [int(d) for d in iota.group(3).split(",")]
        grid = np.arange(int(np.prod(dims))).reshape(dims)
        if iota.group(4):
            grid = grid.transpose([int(p) for p in iota.group(4).split(",")])
        return grid.reshape(g, s).tolist()
    listed = re.search(r"replica_groups=\{((?:\{[\d,]*\},?)*)\}", rest)
    if listed:
        groups = [
            [int(x) for x in g.split(",") if x]
            for g in re.findall(r"\{([\d,]*)\}", listed.group(1))
        ]
        if groups and any(groups):
            return groups
    return [list(range(devices))]


def axes_of(groups: list[list[int]] | None, mesh_shape: dict[str, int]) -> list[str] | None:
    """The mesh axes along which the devices of one group differ (device ids are positions in the
    mesh's row-major device order)."""
    if groups is None:
        return None
    sizes = list(mesh_shape.values())
    spanned: set[str] = set()
    for group in groups:
        coords = np.array(np.unravel_index(np.asarray(group), sizes)).T
        for i, name in enumerate(mesh_shape):
            if len(set(coords[:, i].tolist())) > 1:
                spanned.add(name)
    return [name for name in mesh_shape if name in spanned]


def moved_bytes(kind: str, operand_bytes: float, group_size: int) -> float:
    """Bytes one device sends for one collective of `operand_bytes` (its own operand) over a group
    of `group_size` devices, for ring/bandwidth-optimal algorithms: all-reduce 2 (n-1)/n of the
    operand, all-gather (n-1) operands, reduce-scatter and all-to-all (n-1)/n, a permute all."""
    n = max(group_size, 1)
    if n == 1:
        return 0.0
    if kind == "all-reduce":
        return 2.0 * operand_bytes * (n - 1) / n
    if kind == "all-gather":
        return operand_bytes * (n - 1)
    if kind in ("reduce-scatter", "all-to-all", "ragged-all-to-all"):
        return operand_bytes * (n - 1) / n
    return operand_bytes


def _kind(opcode: str) -> str | None:
    base = opcode[: -len("-start")] if opcode.endswith("-start") else opcode
    return base if base in KINDS else None


def _activation_sized(shapes, token_shapes: Sequence[tuple[int, ...]], weights=frozenset()) -> bool:
    """Whether a shape (an operand, or what an all-gather gathers) is an activation of the whole
    batch: a dimension of all the batch's tokens (rows x length), or the batch's rows and length
    as two adjacent dimensions, and at least one more dimension of features (the token ids and
    per-token scalars of the batch are not activation-sized). Shapes in `weights` (the
    parameters', whole or sharded) are never activations."""
    for _, dims in shapes:
        if dims in weights:
            continue
        for rows, length in token_shapes:
            for i in range(len(dims)):
                span = 2 if dims[i : i + 2] == (rows, length) else int(dims[i] == rows * length)
                rest = dims[:i] + dims[i + span :]
                if span and any(d > 1 for d in rest):
                    return True
    return False


@dataclasses.dataclass(frozen=True)
class Layout:
    """What the audit knows of the program: the mesh's axis sizes (in the mesh's order), the host
    (process) of each device in the mesh's row-major order, the global batch's (rows, length) per
    model call, and the parameters' shapes (whole and sharded), which are never activations."""

    mesh_shape: dict[str, int]
    hosts: tuple[int, ...] = ()
    token_shapes: tuple[tuple[int, int], ...] = ()
    weight_shapes: frozenset = frozenset()


def collectives(text: str, layout: Layout) -> tuple[list[dict[str, Any]], int]:
    """(every collective of the HLO module `text` as a row, loops without a known trip count)."""
    mesh_shape, token_shapes = layout.mesh_shape, layout.token_shapes
    computations, entry = parse_module(text)
    if entry is None:
        return [], 0
    runs, unknown = multiplicities(computations, entry)
    symbols = {op.name: op.shape for ops in computations.values() for op in ops}
    devices = int(np.prod(list(mesh_shape.values())))
    rows = []
    for name, ops in computations.items():
        for op in ops:
            kind = _kind(op.opcode)
            if kind is None or not runs.get(name):
                continue
            operands = re.findall(r"%([\w.\-]+)", op.rest.split("),", 1)[0])
            shapes = list(
                itertools.chain.from_iterable(_shapes(symbols.get(o, "")) for o in operands)
            )
            groups = _groups(op.rest, devices)
            size = len(groups[0]) if groups else devices
            crosses = bool(layout.hosts) and (
                groups is None or any(len({layout.hosts[d] for d in g}) > 1 for g in groups)
            )
            operand = _nbytes(shapes)
            results = _shapes(op.shape)
            rows.append(
                {
                    "kind": kind,
                    "name": op.name,
                    "operand_shapes": [f"{t}[{','.join(map(str, d))}]" for t, d in shapes],
                    "operand_bytes": operand,
                    "group_size": size,
                    "axes": axes_of(groups, mesh_shape),
                    "count": runs[name],
                    "moved_bytes_per_device": moved_bytes(kind, operand, size) * runs[name],
                    "link": "dcn" if crosses else "local",
                    "activation_sized": bool(token_shapes)
                    and _activation_sized(shapes + results, token_shapes, layout.weight_shapes),
                }
            )
    return rows, unknown


def _axis_label(axes: list[str] | None) -> str:
    return "unknown" if axes is None else ("+".join(axes) or "none")


def audit(text: str, layout: Layout) -> dict[str, Any]:
    """The audit of one compiled step: collectives grouped by (kind, operand shapes, axes) with
    their counts per step, totals per mesh axis and per link (within a host or slice, or across
    hosts over DCN) and the activation-sized warnings."""
    rows, unknown = collectives(text, layout)
    grouped: dict[tuple, dict[str, Any]] = {}
    for row in rows:
        key = (row["kind"], tuple(row["operand_shapes"]), _axis_label(row["axes"]), row["link"])
        entry = grouped.setdefault(
            key,
            {
                "kind": row["kind"],
                "operand_shapes": row["operand_shapes"],
                "operand_bytes": row["operand_bytes"],
                "axes": _axis_label(row["axes"]),
                "group_size": row["group_size"],
                "link": row["link"],
                "count_per_step": 0,
                "moved_bytes_per_device": 0.0,
                "activation_sized": row["activation_sized"],
            },
        )
        entry["count_per_step"] += row["count"]
        entry["moved_bytes_per_device"] += row["moved_bytes_per_device"]
    table = sorted(grouped.values(), key=lambda e: -e["moved_bytes_per_device"])
    per_axis: dict[str, dict[str, float]] = {}
    per_link = {"local": 0.0, "dcn": 0.0}
    for e in table:
        total = per_axis.setdefault(
            e["axes"], {"collectives_per_step": 0, "moved_bytes_per_device": 0.0}
        )
        total["collectives_per_step"] += e["count_per_step"]
        total["moved_bytes_per_device"] += e["moved_bytes_per_device"]
        per_link[e["link"]] += e["moved_bytes_per_device"]
    warnings = [
        f"{e['kind']} of {' + '.join(e['operand_shapes'])} over {e['axes']} "
        f"({e['count_per_step']} per step) carries the global token dimension: activations of "
        "the whole batch move between devices"
        for e in table
        if e["activation_sized"]
    ]
    if unknown:
        warnings.append(f"{unknown} loop(s) without a known trip count were counted once")
    return {
        "collectives": table,
        "per_axis": per_axis,
        "moved_bytes_per_link": per_link,
        "collectives_per_step": sum(e["count_per_step"] for e in table),
        "moved_bytes_per_device": sum(e["moved_bytes_per_device"] for e in table),
        "warnings": warnings,
    }


# Instructions that move no HBM bytes of their own (aliases, control flow, bookkeeping).
_NO_TRAFFIC = {
    "parameter",
    "tuple",
    "get-tuple-element",
    "bitcast",
    "constant",
    "while",
    "conditional",
    "call",
    "after-all",
    "partition-id",
    "replica-id",
    "opt-barrier",
}


def _operands(op: _Op) -> list[str]:
    return re.findall(r"%([\w.\-]+)", op.rest.split("),", 1)[0])


def _op_bytes(shape: str) -> float:
    return _nbytes(_shapes(shape))


def _sliced(op: _Op, symbols: dict[str, str]) -> float | None:
    """Bytes a slicing instruction moves (None for any other): a slice or dynamic slice reads
    and writes its result, an in-place dynamic update slice reads and writes its update."""
    if op.opcode in ("dynamic-slice", "slice"):
        return 2 * _op_bytes(op.shape)
    if op.opcode == "dynamic-update-slice":
        return 2 * _op_bytes(symbols.get(_operands(op)[1], ""))
    return None


def _fusion_io(
    ops: list[_Op], computations: dict[str, list[_Op]]
) -> tuple[dict[int, float], float | None]:
    """What a fusion moves at its boundary where it slices: per parameter index whose every use
    is a slice of it (operand 0 of a slice or dynamic slice, or an operand a nested fusion only
    slices) or the in-place update of its root, the slices' bytes; and where its root (the last
    instruction) updates a parameter in place (dynamic update slice), the update's bytes
    written. Other parameters and roots: their whole shapes (not listed / None)."""
    index = {
        op.name: int(re.match(r"\s*(\d+)", op.rest).group(1))
        for op in ops
        if op.opcode == "parameter"
    }
    root = ops[-1] if ops else None
    in_place = root is not None and root.opcode == "dynamic-update-slice"
    uses: dict[str, list[tuple[_Op, int]]] = {name: [] for name in index}
    for op in ops:
        for position, operand in enumerate(_operands(op)):
            if operand in uses:
                uses[operand].append((op, position))

    def sliced(op: _Op, position: int) -> float | None:
        if in_place and op is root and position == 0:
            return 0.0
        if position == 0 and op.opcode in ("dynamic-slice", "slice"):
            return _op_bytes(op.shape)
        if op.opcode == "fusion":
            inner = computations.get(dict(_callees(op)).get("calls", ""), [])
            return _fusion_io(inner, computations)[0].get(position)
        return None

    reads = {}
    for name, used in uses.items():
        parts = [sliced(op, position) for op, position in used]
        if parts and None not in parts:
            reads[index[name]] = sum(parts)
    written = None
    if in_place and index.get(_operands(root)[0]) in reads:
        written = _op_bytes({op.name: op.shape for op in ops}.get(_operands(root)[1], ""))
    return reads, written


def memory_traffic(text: str) -> float:
    """HBM bytes of one execution of the compiled module `text`, loops counted with their trip
    counts: every instruction outside fusions reads its operands and writes its result once (a
    fusion is counted at its boundary: what it reads and writes, not its insides), except where
    it slices: a (dynamic) slice moves its slice, an in-place dynamic update slice its update,
    and a fusion that only slices a parameter, or updates one in place, moves those slices
    (`_fusion_io`) — a loop that walks blocks of an array (flash attention, scanned layers'
    stacked weights) reads a block per trip, not the array. An estimate of the same kind as
    XLA's "bytes accessed", which counts a loop body once."""
    computations, entry = parse_module(text)
    if entry is None:
        return 0.0
    runs, _ = multiplicities(computations, entry)
    inner = {
        callee
        for ops in computations.values()
        for op in ops
        for role, callee in _callees(op)
        if op.opcode == "fusion" or role == "to_apply"
    }
    symbols = {op.name: op.shape for ops in computations.values() for op in ops}
    total = 0.0
    for name, ops in computations.items():
        if name in inner or not runs.get(name):
            continue
        for op in ops:
            if op.opcode in _NO_TRAFFIC or op.opcode.endswith("-done"):
                continue
            total += runs[name] * _moved(op, symbols, computations)
    return total


def _moved(op: _Op, symbols: dict[str, str], computations: dict[str, list[_Op]]) -> float:
    """HBM bytes one instruction outside fusions reads and writes (`memory_traffic`)."""
    sliced = _sliced(op, symbols)
    if sliced is not None:
        return sliced
    reads, written = {}, None
    if op.opcode == "fusion":
        callee = computations.get(dict(_callees(op)).get("calls", ""), [])
        reads, written = _fusion_io(callee, computations)
    moved = _op_bytes(op.shape) if written is None else written
    for position, operand in enumerate(_operands(op)):
        moved += reads.get(position, _op_bytes(symbols.get(operand, "")))
    return moved
