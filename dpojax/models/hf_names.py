"""dpojax parameters <-> the tensors of a Hugging Face checkpoint.

Most parameters are one checkpoint tensor each, under the same dotted name (a `kernel` [in, out]
is the transposed `weight` [out, in]). Two families store parameters differently from the modules
dpojax runs:

- mixture-of-experts layers keep one tensor per expert (`mlp.experts.{e}.gate_proj.weight`), which
  dpojax stacks into one parameter [E, in, out] per projection;
- Phi-3 fuses q/k/v into `self_attn.qkv_proj` and gate/up into `mlp.gate_up_proj`, which dpojax
  splits by rows into its separate projections (so LoRA targets and sharding rules stay the
  same as for the other families).

`tensor_maps` lists how each parameter is read and written; `from_checkpoint` / `to_checkpoint`
apply one map.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Iterable, Mapping

import numpy as np

from dpojax.models.model_config import ModelConfig

SAME, STACK, SPLIT = "same", "stack", "split"
FUSED = {
    "qkv_proj": ("q_proj", "k_proj", "v_proj"),
    "gate_up_proj": ("gate_proj", "up_proj"),
}


def hf_name(path: tuple) -> str:
    """The HF tensor name of a dpojax parameter path, e.g. ('layers', 0, 'mlp', 'up_proj',
    'kernel') -> 'model.layers.0.mlp.up_proj.weight'."""
    if path == ("lm_head",):
        return "lm_head.weight"
    if path == ("embed_tokens",):
        return "model.embed_tokens.weight"
    parts = [str(p) for p in path]
    if parts[-1] == "kernel":
        parts[-1] = "weight"
    return "model." + ".".join(parts)


@dataclasses.dataclass(frozen=True)
class TensorMap:
    """Parameters `params` <-> checkpoint tensors `names`: SAME (one each), STACK (one parameter
    from the tensors of each expert) or SPLIT (several parameters from the rows of one tensor,
    `rows` each)."""

    params: tuple[tuple, ...]
    names: tuple[str, ...]
    kind: str = SAME
    rows: tuple[int, ...] = ()


def _fused_group(config: ModelConfig, path: tuple) -> str | None:
    """The fused checkpoint tensor a kernel belongs to, if the family fuses it."""
    if path[-1] != "kernel" or len(path) < 2:
        return None
    if config.fused_qkv and path[-2] in FUSED["qkv_proj"]:
        return "qkv_proj"
    if config.fused_gate_up and path[-2] in FUSED["gate_up_proj"]:
        return "gate_up_proj"
    return None


def tensor_maps(config: ModelConfig, shapes: Mapping[tuple, tuple[int, ...]]) -> list[TensorMap]:
    """How every parameter (path -> shape) maps to checkpoint tensors."""
    maps, fused = [], {}
    for path, shape in shapes.items():
        if len(path) >= 2 and path[-2] == "experts":
            prefix = hf_name(path[:-2])
            names = tuple(
                f"{prefix}.experts.{e}.{path[-1]}.weight" for e in range(config.num_experts)
            )
            maps.append(TensorMap((path,), names, STACK))
        elif (group := _fused_group(config, path)) is not None:
            fused.setdefault((path[:-2], group), {})[path[-2]] = (path, shape)
        else:
            maps.append(TensorMap((path,), (hf_name(path),)))
    for (owner, group), members in fused.items():
        order = [members[m] for m in FUSED[group] if m in members]
        if len(order) != len(FUSED[group]):
            raise ValueError(f"{group} of {owner}: missing {set(FUSED[group]) - set(members)}")
        name = hf_name((*owner, group, "kernel"))
        rows = tuple(shape[-1] for _, shape in order)
        maps.append(TensorMap(tuple(p for p, _ in order), (name,), SPLIT, rows))
    return maps


def expected_shapes(m: TensorMap, shapes: Mapping[tuple, tuple[int, ...]]) -> list[tuple]:
    """The checkpoint shape of each of `m.names`, from the parameter shapes."""
    first = shapes[m.params[0]]
    if m.kind == STACK:
        return [tuple(reversed(first[1:]))] * len(m.names)
    if m.kind == SPLIT:
        return [(sum(m.rows), first[0])]
    return [tuple(reversed(first)) if m.params[0][-1] == "kernel" else tuple(first)]


def from_checkpoint(m: TensorMap, read: Callable[[str], np.ndarray]) -> dict[tuple, np.ndarray]:
    """The parameter values of one map, from the tensors `read(name)` returns."""
    if m.kind == STACK:
        return {m.params[0]: np.stack([read(n).T for n in m.names])}
    if m.kind == SPLIT:
        parts = np.split(read(m.names[0]), np.cumsum(m.rows)[:-1], axis=0)
        return {p: part.T for p, part in zip(m.params, parts, strict=True)}
    (path,) = m.params
    arr = read(m.names[0])
    return {path: arr.T if path[-1] == "kernel" else arr}


def to_checkpoint(m: TensorMap, values: Mapping[tuple, np.ndarray]) -> dict[str, np.ndarray]:
    """The checkpoint tensors of one map, from the parameter values."""
    if m.kind == STACK:
        stacked = values[m.params[0]]
        return {n: stacked[e].T for e, n in enumerate(m.names)}
    if m.kind == SPLIT:
        return {m.names[0]: np.concatenate([values[p].T for p in m.params], axis=0)}
    (path,) = m.params
    arr = values[path]
    return {m.names[0]: arr.T if path[-1] == "kernel" else arr}


def all_names(maps: Iterable[TensorMap]) -> set[str]:
    return {n for m in maps for n in m.names}
