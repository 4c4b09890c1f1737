"""Ahead-of-time compilation of the DPO step for abstract inputs: what a step needs on each device
(memory) and what it costs (FLOPs, bytes), without allocating a parameter or a batch.

The state comes from `jax.eval_shape` over the real model and optimizer constructors, the batch
from a host batch's shapes; both carry the shardings a run would give them, on any devices —
this process's, or the abstract devices of a TPU topology (`jax.experimental.topologies`), for
which XLA's TPU compiler runs on the host. A compile that runs out of device memory raises
`OutOfMemory` with the figures from the compiler's message.

Caveat on `cost`: XLA's cost analysis counts the body of a loop once (the vocabulary chunks of the
log-softmax are a loop), so its FLOPs undercount the step and its bytes are a lower bound; model
FLOPs come from `dpojax.train.flops` instead.
"""

from __future__ import annotations

import dataclasses
import re
import time
from collections.abc import Mapping
from typing import Any

import jax
import numpy as np
import optax
from flax import nnx
from jax.sharding import Mesh, NamedSharding

from dpojax.models import ModelConfig, add_lora, init_model
from dpojax.train.batches import step_arrays
from dpojax.train.state import StepConfig, TrainState, create_train_state
from dpojax.train.step import Stepper, batch_sharding, check_batch_divisible, program_key

_UNITS = {"": 1, "K": 2**10, "M": 2**20, "G": 2**30, "T": 2**40}


class OutOfMemory(RuntimeError):
    """The compiler found that the program does not fit the device's memory. `needed` and
    `available` are bytes per device when the message states them (else None)."""

    def __init__(
        self, message: str, needed: float | None, available: float | None, seconds: float = 0.0
    ):
        super().__init__(message)
        self.needed, self.available, self.seconds = needed, available, seconds


@dataclasses.dataclass(frozen=True)
class Compiled:
    """One compiled step: compile time, per-device memory and XLA's cost analysis."""

    seconds: float
    memory: dict[str, int]
    flops: float | None
    bytes_accessed: float | None
    hlo_text: str = ""  # the compiled module, for the communication audit
    # The executable and its `program_key`: a run whose step lowers to the same program runs it
    # instead of compiling it again (`Stepper.adopt`).
    executable: Any = dataclasses.field(default=None, compare=False, repr=False)
    key: str = ""


def abstract_state(
    model_config: ModelConfig,
    optimizer: optax.GradientTransformation,
    cfg: StepConfig,
    *,
    lora: tuple[int, float, tuple[str, ...]] | None = None,
) -> tuple[nnx.GraphDef, TrainState]:
    """(graphdef, TrainState of ShapeDtypeStructs) of the policy `model_config` (with LoRA
    adapters when `lora` is (rank, alpha, targets)) and a frozen reference copy when `cfg` says so;
    nothing is allocated."""
    holder = {}

    def build() -> TrainState:
        model = init_model(model_config)
        if lora is not None:
            model = add_lora(model, *lora)
        holder["graphdef"], state = create_train_state(model, optimizer, cfg)
        return state

    state = jax.eval_shape(build)
    return holder["graphdef"], state


def with_shardings(shapes: Any, shardings: Any) -> Any:
    """`shapes` (a pytree of ShapeDtypeStructs) with the matching `shardings` attached."""
    return jax.tree.map(
        lambda s, sh: jax.ShapeDtypeStruct(s.shape, s.dtype, sharding=sh), shapes, shardings
    )


def batch_shapes(
    batch: Mapping[str, np.ndarray], mesh: Mesh | None, *, micro_axis: bool = True
) -> dict[str, jax.ShapeDtypeStruct]:
    """The step's input shapes of a host batch (`step_arrays`), sharded as `Stepper` shards them."""
    arrays = {k: np.asarray(v) for k, v in step_arrays(batch).items()}
    if mesh is None:
        return {k: jax.ShapeDtypeStruct(v.shape, v.dtype) for k, v in arrays.items()}
    check_batch_divisible(arrays, mesh, micro_axis=micro_axis)
    shardings = batch_sharding(arrays, mesh, micro_axis=micro_axis)
    return {
        k: jax.ShapeDtypeStruct(v.shape, v.dtype, sharding=shardings[k]) for k, v in arrays.items()
    }


def lower_steps(
    stepper: Stepper,
    state: TrainState,
    train_batch: Mapping[str, np.ndarray],
    eval_batch: Mapping[str, np.ndarray] | None = None,
) -> dict[str, jax.stages.Lowered]:
    """The train step (and the eval step, for `eval_batch`) lowered for the abstract `state`."""
    if stepper.mesh is not None:
        state = with_shardings(state, stepper.pin_state_shardings(state))
    lowered = {"train": stepper.lower(state, batch_shapes(train_batch, stepper.mesh))}
    if eval_batch is not None:
        shapes = batch_shapes(eval_batch, stepper.mesh, micro_axis=False)
        lowered["eval"] = stepper.lower(state, shapes, train=False)
    return lowered


def _bytes(number: str, unit: str) -> float:
    return float(number) * _UNITS[unit[:1].upper() if unit else ""]


def parse_out_of_memory(message: str) -> tuple[float | None, float | None]:
    """(needed, available) bytes from an XLA out-of-memory message, e.g. "HLO temporaries
    (39.66G) exceed available HBM (15.75G)" or "Used 20.5G of 15.75G hbm"."""
    size = r"([0-9.]+)\s*([KMGT]?)i?B?"
    exceed = re.search(rf"\({size}\)\s*exceeds?[^(]*\({size}\)", message)
    if exceed:
        return _bytes(*exceed.group(1, 2)), _bytes(*exceed.group(3, 4))
    used = re.search(rf"Used\s+{size}\s+of\s+{size}", message, re.IGNORECASE)
    if used:
        return _bytes(*used.group(1, 2)), _bytes(*used.group(3, 4))
    return None, None


def _is_out_of_memory(error: Exception) -> bool:
    text = str(error)
    return "RESOURCE_EXHAUSTED" in text or "Ran out of memory" in text or "out of memory" in text


def compile_step(lowered: jax.stages.Lowered) -> Compiled:
    """Compiles `lowered` and reads its memory and cost analyses; raises `OutOfMemory`."""
    start = time.perf_counter()
    try:
        compiled = lowered.compile()
    except Exception as e:  # XLA raises its runtime error type; only memory errors are ours
        if not _is_out_of_memory(e):
            raise
        message = " ".join(str(e).split())
        seconds = time.perf_counter() - start
        raise OutOfMemory(message, *parse_out_of_memory(message), seconds) from None
    seconds = time.perf_counter() - start
    stats = compiled.memory_analysis()
    fields = ("argument", "output", "alias", "temp", "generated_code")
    memory = {name: int(getattr(stats, f"{name}_size_in_bytes", 0) or 0) for name in fields}
    memory["peak"] = int(getattr(stats, "peak_memory_in_bytes", 0) or 0)
    cost = compiled.cost_analysis()
    cost = (cost[0] if cost else {}) if isinstance(cost, list | tuple) else (cost or {})
    return Compiled(
        seconds,
        memory,
        cost.get("flops"),
        cost.get("bytes accessed"),
        compiled.as_text() or "",
        compiled,
        program_key(lowered),
    )


def device_bytes(tree: Any) -> int:
    """Bytes one device holds of a pytree of (sharded) ShapeDtypeStructs: each leaf's shard."""
    total = 0
    for leaf in jax.tree.leaves(tree):
        sharding = getattr(leaf, "sharding", None)
        shape = (
            sharding.shard_shape(leaf.shape) if isinstance(sharding, NamedSharding) else leaf.shape
        )
        total += int(np.prod(shape, dtype=np.int64)) * np.dtype(leaf.dtype).itemsize
    return total


def state_bytes(stepper: Stepper, state: TrainState) -> dict[str, int]:
    """Per-device bytes of the parameters (trainable and frozen), the optimizer state and the
    reference of an abstract `state` on the stepper's mesh."""
    if stepper.mesh is not None:
        state = with_shardings(state, stepper.pin_state_shardings(state))
    return {
        "parameters": device_bytes(state.params) + device_bytes(state.frozen),
        "optimizer": device_bytes(state.opt_state),
        # device_bytes(None) is 0: no separate reference, or no TR-DPO adapters
        "reference": device_bytes(state.ref) + device_bytes(state.ref_adapters),
    }
