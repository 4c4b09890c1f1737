"""Logical axis names of parameters and activations -> PartitionSpecs on a (data, fsdp, context,
tensor) mesh.

Every parameter of `CausalLM` carries `logical_axes` metadata such as ("vocab", "embed"). A rule
table maps each logical name to a mesh axis (or None = replicated); the rules are config data.

Activations have their own table (`ACTIVATION_RULES`), applied by `constrain` where the model
decides a layout: the embedding's output, each layer's output, attention's inputs and output, the
MLP's hidden units, the log-softmax's vocabulary chunks. Without it XLA's sharding propagation
copies the parameters' fsdp-on-embed layout onto the residual stream, and every layer then
all-reduces activations of the global batch (docs/plan.md#activation-sharding).

The `context` axis splits each row's length: activations [B, T, ...] are sharded over it on T,
K and V are gathered over it for attention, and its devices are FSDP shards of the parameters as
well (`embed` is split over fsdp and context together), so a context device holds no more of the
weights than an fsdp one (docs/long_context.md).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import jax
import numpy as np
from flax import nnx
from jax.sharding import AbstractMesh, AxisType, Mesh, NamedSharding, PartitionSpec

from dpojax.errors import ConfigProblem

MeshAxes = str | tuple[str, ...] | None

# Megatron-style tensor parallelism on heads and MLP, FSDP on the embedding dimension (over the
# fsdp and the context devices: a context device is an FSDP shard too).
DEFAULT_RULES: dict[str, MeshAxes] = {
    "vocab": "tensor",
    "embed": ("fsdp", "context"),
    "mlp": "tensor",
    "heads": "tensor",
    "kv_heads": "tensor",
    "head_dim": None,
    "norm": None,
    "lora": None,
    # mixture of experts: every device holds every expert; their MLP dimension is split like a
    # dense MLP's
    "expert": None,
    # scanned layers (dpojax.models.scan): the stacked layer axis is never split, so each scan
    # step's slice of a parameter is laid out like the unscanned layer's
    "layers": None,
}


def _without_fsdp(axes: MeshAxes) -> MeshAxes:
    flat = () if axes is None else ((axes,) if isinstance(axes, str) else tuple(axes))
    kept = tuple(a for a in flat if a not in ("fsdp", "context"))
    return kept[0] if len(kept) == 1 else (kept or None)


# A weight as a matmul takes it on a mesh with a context axis: gathered over fsdp and context (the
# explicit FSDP all-gather), still split over tensor. Without it GSPMD may instead split the
# contraction of the split rows' tokens over the weight's `embed` shards and all-reduce the
# products: for Llama 3.1 8B at 131,072 tokens on context 8, 224 all-reduces of [262144, 14336]
# bf16 a step (docs/long_context.md).
GATHERED_RULES: dict[str, MeshAxes] = {
    name: _without_fsdp(axes) for name, axes in DEFAULT_RULES.items()
}


# FSDP shards the batch, never the activations' embedding: each device keeps its own rows whole and
# gathers the weights instead. Tensor parallelism splits heads, the MLP and the vocabulary; the
# context axis splits the length of every row (queries), while attention's keys and values
# ("kv_length") are gathered whole over it.
ACTIVATION_RULES: dict[str, MeshAxes] = {
    "batch": ("data", "fsdp"),
    "tokens": ("data", "fsdp", "context"),  # batch and length flattened: [B * T, ...]
    "length": "context",
    "kv_length": None,
    "embed": None,
    "heads": "tensor",
    "kv": "tensor",
    "head_dim": None,
    "mlp": "tensor",
    "vocab": "tensor",  # a log-softmax chunk's vocabulary entries
    "expert": None,
}


def kernel_axes(
    mesh: Mesh | AbstractMesh, heads: int, kv_heads: int
) -> tuple[tuple[str, ...] | None, str | None]:
    """The mesh axes an attention kernel inside `shard_map` splits its inputs over: the batch
    over data and fsdp (those larger than 1; None for neither), the heads over tensor where it
    divides both the query and the KV head counts (else None)."""
    shape = dict(zip(mesh.axis_names, mesh.axis_sizes, strict=True))
    batch = tuple(a for a in ("data", "fsdp") if shape.get(a, 1) > 1) or None
    tensor = shape.get("tensor", 1)
    split_heads = tensor > 1 and heads % tensor == 0 and kv_heads % tensor == 0
    return batch, "tensor" if split_heads else None


def constrain(
    x: jax.Array, names: Sequence[str], rules: Mapping[str, MeshAxes] = ACTIVATION_RULES
) -> jax.Array:
    """`x` pinned to the layout its logical axes `names` have under `rules` on the current mesh
    (`jax.set_mesh`); unchanged without a mesh, on one device, or inside `shard_map`. A dimension
    the mesh axes do not divide is left replicated (`spec_for`)."""
    mesh = jax.sharding.get_abstract_mesh()
    if mesh.empty or mesh.size == 1 or any(t == AxisType.Manual for t in mesh.axis_types):
        return x
    return jax.lax.with_sharding_constraint(x, spec_for(names, x.shape, rules, mesh))


def logical_axes(model: nnx.Module) -> nnx.State:
    """The logical axes tuple of every parameter, as a State shaped like `nnx.state(model)`."""
    state = nnx.state(model, nnx.Param)
    return jax.tree.map(
        lambda v: v.get_metadata().get("logical_axes"),
        state,
        is_leaf=lambda x: isinstance(x, nnx.Variable),
    )


def _axis_size(mesh: Mesh | AbstractMesh | None, axes: MeshAxes) -> int:
    if mesh is None or axes is None:
        return 1
    names = (axes,) if isinstance(axes, str) else axes
    size = 1
    for name in names:
        size *= mesh.shape[name]
    return size


def spec_for(
    names: Sequence[str] | None,
    shape: Sequence[int],
    rules: Mapping[str, MeshAxes] = DEFAULT_RULES,
    mesh: Mesh | AbstractMesh | None = None,
) -> PartitionSpec:
    """PartitionSpec for one parameter. With a mesh, a dimension that the mesh axis does not divide
    is replicated instead (e.g. a vocabulary of 1000 on tensor=8), and a mesh axis is used at most
    once per parameter."""
    if names is None:
        return PartitionSpec()
    if len(names) != len(shape):
        raise ValueError(f"logical axes {tuple(names)} do not match parameter shape {tuple(shape)}")
    used: set[str] = set()
    out: list[MeshAxes] = []
    for name, dim in zip(names, shape, strict=True):
        if name not in rules:
            raise KeyError(f"no sharding rule for logical axis {name!r}; add it to the rules")
        axes = rules[name]
        flat = () if axes is None else ((axes,) if isinstance(axes, str) else tuple(axes))
        if mesh is not None:
            flat = tuple(a for a in flat if mesh.shape.get(a, 1) > 1)
        if not flat or used & set(flat) or dim % _axis_size(mesh, flat):
            out.append(None)
            continue
        used.update(flat)
        out.append(flat[0] if len(flat) == 1 else flat)
    return PartitionSpec(*out)


def partition_specs(
    model: nnx.Module, rules: Mapping[str, MeshAxes] = DEFAULT_RULES, mesh: Mesh | None = None
) -> nnx.State:
    """PartitionSpec for every parameter of `model` (concrete or abstract)."""
    state = nnx.state(model, nnx.Param)
    return jax.tree.map(
        lambda v: spec_for(v.get_metadata().get("logical_axes"), v.shape, rules, mesh),
        state,
        is_leaf=lambda x: isinstance(x, nnx.Variable),
    )


def named_shardings(
    model: nnx.Module, mesh: Mesh, rules: Mapping[str, MeshAxes] = DEFAULT_RULES
) -> nnx.State:
    """NamedSharding for every parameter of `model` on `mesh`."""
    return jax.tree.map(
        lambda spec: NamedSharding(mesh, spec),
        partition_specs(model, rules, mesh),
        is_leaf=lambda x: isinstance(x, PartitionSpec),
    )


MESH_AXES = ("data", "fsdp", "context", "tensor")
# A mesh that cannot be made is a config problem (exit 2) in every process: these keys set it.
_MESH_KEYS = "config keys 'mesh.data', 'mesh.fsdp', 'mesh.context', 'mesh.tensor'"


def context_size(mesh: Mesh | AbstractMesh | None = None) -> int:
    """The size of `mesh`'s context axis (default: the current mesh, `jax.set_mesh`); 1 without
    a mesh or without the axis."""
    mesh = jax.sharding.get_abstract_mesh() if mesh is None else mesh
    if mesh.empty:
        return 1
    return dict(zip(mesh.axis_names, mesh.axis_sizes, strict=True)).get("context", 1)


def make_mesh(
    data: int = -1,
    fsdp: int = 1,
    tensor: int = 1,
    *,
    context: int = 1,
    devices: Sequence | None = None,
) -> Mesh:
    """A (data, fsdp, context, tensor) mesh over `devices` (default: all). One axis may be -1,
    meaning the devices that remain. Axes are in automatic (GSPMD) sharding mode. `context` is
    keyword-only so that the three-size calls of before keep their meaning."""
    devices = list(jax.devices() if devices is None else devices)
    sizes = [data, fsdp, context, tensor]
    if sizes.count(-1) > 1:
        raise ConfigProblem(f"{_MESH_KEYS}: at most one of data, fsdp, context, tensor may be -1")
    known = 1
    for s in sizes:
        if s != -1:
            if s < 1:
                raise ConfigProblem(f"{_MESH_KEYS}: axis sizes must be positive or -1, got {sizes}")
            known *= s
    if -1 in sizes:
        if len(devices) % known:
            raise ConfigProblem(
                f"{_MESH_KEYS}: {len(devices)} devices cannot be split into {sizes} (the fixed axes "
                f"multiply to {known})"
            )
        sizes[sizes.index(-1)] = len(devices) // known
    if np.prod(sizes) != len(devices):
        raise ConfigProblem(
            f"{_MESH_KEYS}: data*fsdp*context*tensor = {int(np.prod(sizes))} but there are "
            f"{len(devices)} devices"
        )
    return jax.make_mesh(tuple(sizes), MESH_AXES, axis_types=(AxisType.Auto,) * 4, devices=devices)
