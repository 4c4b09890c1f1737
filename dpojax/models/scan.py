"""Scanned decoder layers: one compiled layer body run by `jax.lax.scan` instead of a Python loop.

With `ModelConfig.scan_layers`, `CausalLM` keeps its decoder layers in `layer_stack`: the layers
are grouped by a period P of their kinds (sliding or full attention, MoE or dense MLP: 1 for
Llama, 2 for Gemma 2's alternation, 6 for Gemma 3's five sliding layers and one global), and
`layer_stack[j]` is one `DecoderLayer` whose parameters hold layers j, j + P, j + 2P, ... stacked
on a leading "layers" axis [L / P, ...]. The scan runs L / P steps of a body holding P layers,
so XLA compiles P layers instead of L. A model whose kinds have no period dividing L (Qwen2's
sliding window from `max_window_layers` up, Gemma 3 1B's 26 layers with a period of 6) is not
scanned (`scan_period` says why).

Checkpoint formats are per layer (`model.layers.{i}....` in HF and PEFT files):
`unstack_flat` / `layer_path` translate a stacked parameter path and its rows to the per-layer
paths of the unscanned model.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from typing import Any

import jax
import jax.numpy as jnp
from flax import nnx

SCAN_CHOICES = ("auto", "true", "false")
STACK = "layer_stack"  # the CausalLM attribute holding the stacked layers
LAYERS_AXIS = "layers"  # the logical axis of the stacked dimension (never sharded)


def scan_period(num_layers: int, kinds: Sequence[Any]) -> tuple[int, str]:
    """(P, "") with P the smallest period of the layer kinds that divides the layer count and
    is below it, or (0, why the layers cannot be scanned)."""
    for p in range(1, num_layers):
        if num_layers % p == 0 and all(kinds[i] == kinds[i % p] for i in range(num_layers)):
            return p, ""
    if num_layers == 1:
        return 0, "the model has one layer"
    return 0, (
        f"its {num_layers} layers' kinds (sliding or full attention, MoE or dense MLP) do not "
        f"repeat with a period that divides {num_layers}"
    )


def resolve(choice: str | bool, period: int, platform: str, remat: str = "none") -> bool:
    """Whether to scan: `choice` "true" / "false" (or a bool) as given; "auto" when the layer
    kinds have a period (`scan_period`) on TPUs and GPUs, and on CPUs when the layers are
    rematerialized (`remat` other than "none"). Unrematerialized, a CPU runs the per-layer loop
    no slower and holds less (0.89 against 1.11 GiB of temporaries for 8 pairs of 512 tokens on a
    4-layer model); rematerialized, the scan holds the least: it keeps XLA's CPU scheduler
    (jax 0.10.2's) from recomputing every layer at once and holding every layer's weight
    gradients to the end of the backward pass (full remat: 1.00 GiB looped, 0.28 scanned;
    docs/benchmarks.md)."""
    if isinstance(choice, bool):
        return choice
    if choice not in SCAN_CHOICES:
        raise ValueError(f"model.scan_layers must be one of {SCAN_CHOICES}, got {choice!r}")
    if choice == "auto":
        return period > 0 and (platform != "cpu" or remat != "none")
    return choice == "true"


def _stacked(var: nnx.Variable, values: list) -> nnx.Variable:
    axes = var.get_metadata().get("logical_axes")
    new = var.replace(jnp.stack(values))
    if axes is not None:
        new.set_metadata("logical_axes", (LAYERS_AXIS, *axes))
    return new


def stack_layers(layers: Sequence[nnx.Module], period: int) -> list[nnx.Module]:
    """`period` modules, the j-th holding the parameters of layers j, j + period, ... stacked on a
    leading axis (logical axis "layers" prepended)."""
    out = []
    for j in range(period):
        group = layers[j::period]
        graphdef, first = nnx.split(group[0])
        flats = [dict(nnx.to_flat_state(nnx.state(layer))) for layer in group]
        stacked = [
            (path, _stacked(var, [flat[path].get_value() for flat in flats]))
            for path, var in nnx.to_flat_state(first)
        ]
        out.append(nnx.merge(graphdef, nnx.from_flat_state(stacked)))
    return out


def _row(state: nnx.State, g: int) -> nnx.State:
    return jax.tree.map(lambda a: a[g], state)


def unstacked_layers(stack: Sequence[nnx.Module]) -> list[nnx.Module]:
    """The per-layer modules of stacked ones (each a slice of the stacked parameters), in layer
    order: for the KV-cache decoder, which runs the layers one at a time."""
    parts = [nnx.split(module) for module in stack]
    groups = jax.tree.leaves(parts[0][1])[0].shape[0]
    return [nnx.merge(gd, _row(state, g)) for g in range(groups) for gd, state in parts]


def layer_path(path: tuple, row: int, period: int) -> tuple:
    """The unscanned parameter path of row `row` of the stacked parameter `path`:
    ('layer_stack', j, ...) -> ('layers', row * period + j, ...)."""
    return ("layers", row * period + int(path[1]), *path[2:])


def unstack_flat(
    flat: Mapping[tuple, Any], period: int, rows: int, take: Callable[[Any, int], Any]
) -> dict[tuple, Any]:
    """A flat {path: x} of a scanned model as the unscanned model's: each stacked entry becomes
    `rows` per-layer entries `take(x, row)`; other entries are unchanged."""
    out = {}
    for path, x in flat.items():
        if path and path[0] == STACK:
            for g in range(rows):
                out[layer_path(path, g, period)] = take(x, g)
        else:
            out[path] = x
    return out


def run_stack(
    stack: Sequence[nnx.Module],
    x: jax.Array,
    layer_forward: Callable,
    tables: dict,
    rows: Any,
    policy: Any = None,
    remat: bool = False,
) -> tuple[jax.Array, list]:
    """Runs the stacked layers over the residual stream x with one `jax.lax.scan` (each step
    the `len(stack)` layers of one period, each under `jax.checkpoint` with `policy` when
    `remat`). Returns (x, router logits of the MoE layers in layer order)."""
    parts = [nnx.split(module) for module in stack]

    def one(graphdef, state, x, rows, cos, sin):
        return layer_forward(nnx.merge(graphdef, state), x, rows, cos, sin)

    calls = []
    for graphdef, _ in parts:
        fn = lambda state, x, rows, cos, sin, gd=graphdef: one(gd, state, x, rows, cos, sin)  # noqa: E731
        if remat:
            fn = jax.checkpoint(fn, policy=policy, prevent_cse=False)
        calls.append(fn)
    sliding = [module.sliding for module in stack]

    def body(x, states):
        logits = []
        for call, state, kind in zip(calls, states, sliding, strict=True):
            x, out = call(state, x, rows, *tables[kind])
            logits.append(out)
        return x, tuple(logits)

    x, ys = jax.lax.scan(body, x, tuple(state for _, state in parts))
    groups = jax.tree.leaves(parts[0][1])[0].shape[0]
    router = [ys[j][g] for g in range(groups) for j in range(len(stack)) if ys[j] is not None]
    return x, router
