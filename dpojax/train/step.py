"""The DPO train step: a pure function `(state, batch) -> (state, metrics)`, jitted once per shape.

Policy forward on the whole batch (chosen and rejected completions together) with gradient;
reference forward outside the differentiated function (or skipped when the batch carries
precomputed reference log-probs); the preference loss; an optax update (`dpojax.train.forward`
has the forward pass). Every batch array has a leading micro-batch axis [k, ...]; the step scans
over it and accumulates gradients and metric *sums*, normalising by the global number of pairs,
so k micro-batches give the same update as one batch of k times the size.

`Stepper` jits the train and eval steps for one model, optimizer and config, on one device or
sharded over a mesh (parameters by their logical axes, batches over (data, fsdp)). On a mesh
that spans several processes each process passes its own part of the batch
(`dpojax.train.hosts`).
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import hashlib
import math
from collections.abc import Mapping
from typing import Any

import jax
import jax.numpy as jnp
import optax
from flax import nnx
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from dpojax.errors import EXIT_NONFINITE, DpojaxError
from dpojax.models.sharding import DEFAULT_RULES, MeshAxes
from dpojax.train.batches import global_batch, indivisible, step_arrays
from dpojax.train.forward import (
    bco_losses,
    completion_logps,
    num_completions,
    pair_losses,
    reference_logps,
    unpaired_losses,
)
from dpojax.train.hosts import (
    BATCH_AXES,
    DataPartition,
    data_partition,
    spans_processes,
)
from dpojax.train.kto import finalize_unpaired
from dpojax.train.logprobs import completion_sums, sequence_sums
from dpojax.train.losses import finalize_metrics
from dpojax.train.state import (
    StepConfig,
    TrainState,
    policy_model,
    state_shardings,
    sync_reference,
)

# What a run does at a step whose loss, gradient or update is not finite: stop with an error, or
# skip the update (`StepConfig.skip_nonfinite`).
NONFINITE_POLICIES = ("stop", "skip")


class NonFiniteError(DpojaxError, RuntimeError):
    """The loss, the gradients or the updated parameters became NaN or infinite (with
    `train.nonfinite=stop`)."""

    exit_code = EXIT_NONFINITE


def nonfinite_cause(step: int, metrics: Mapping[str, float]) -> str:
    """What a non-finite training step (`metrics["nonfinite"]`, host floats) points at, with the
    fix: the learning rate is named only where it can be the cause."""
    loss, grad_norm = metrics["loss"], metrics["grad_norm"]
    seen = f"loss {loss}, grad_norm {grad_norm}"
    if math.isfinite(loss) and math.isfinite(grad_norm):
        return (
            f"the update or the updated parameters are not finite, though the loss and gradients "
            f"are ({seen}): the optimizer's settings make the update undefined (check optim.eps: "
            "Adam divides by sqrt(v) + eps), or parameters overflow model.param_dtype"
        )
    if step == 1:
        return (
            f"the loss or gradients of the initial weights are not finite ({seen}), before any "
            "update, so not because of the learning rate: check the model's weights (NaN or inf "
            "in its files) and the data (token ids outside the model's vocabulary, e.g. an eos "
            "id); train.nonfinite=skip skips such steps"
        )
    return (
        f"the loss or gradients are not finite ({seen}); lower optim.learning_rate or set "
        "train.nonfinite=skip"
    )


def all_finite(tree: Any) -> jax.Array:
    """Whether every element of every floating-point leaf of `tree` is finite (a boolean scalar).
    One reduction per leaf: in the train step, one more read of the new parameters, small next
    to the update's own reads of the parameters, the gradients and Adam's two moments."""
    checks = [
        jnp.isfinite(x).all()
        for x in jax.tree.leaves(tree)
        if jnp.issubdtype(jnp.result_type(x), jnp.inexact)
    ]
    return functools.reduce(jnp.logical_and, checks, jnp.asarray(True))


def _micro(batch: Mapping[str, jax.Array], i) -> dict[str, jax.Array]:
    return {k: v[i] for k, v in batch.items()}


def _sft_tokens_per_pair(
    batch: Mapping[str, jax.Array], total_pairs: jax.Array, cfg: StepConfig
) -> jax.Array:
    """The step's chosen tokens per pair (the token mean of the NLL losses over the step): of
    the chosen completions, or with `cfg.nll_prompt` of the whole chosen sequences."""
    chosen_tokens = 0.0
    for i in range(batch["pair_mask"].shape[0]):
        mb = _micro(batch, i)
        zeros = jnp.zeros(mb["tokens"].shape)
        if cfg.nll_prompt:
            _, counts = sequence_sums(zeros, mb, num_completions(mb))
        else:
            _, counts = completion_sums(zeros, mb["completion_ids"], num_completions(mb))
        chosen_tokens += (counts[mb["chosen_index"]] * mb["pair_mask"]).sum()
    return chosen_tokens / total_pairs


def batch_losses(policy, ref_c, ref_r, mb, cfg: StepConfig, sft_tokens, moments, update=True):
    """(per-pair losses, metric sums, running moments) of one micro-batch for the step's loss:
    bco (its running moments updated unless `update` is False), the other unpaired losses, or
    the paired ones (`moments` passed through)."""
    if cfg.running_moments:
        return bco_losses(policy, ref_c, mb, cfg, moments, update=update)
    if cfg.unpaired:
        return (*unpaired_losses(policy, ref_c, ref_r, mb, cfg), moments)
    return (*pair_losses(policy, ref_c, ref_r, mb, cfg, sft_tokens), moments)


def train_step(
    state: TrainState,
    batch: Mapping[str, jax.Array],
    *,
    graphdef: nnx.GraphDef,
    optimizer: optax.GradientTransformation,
    schedule: optax.Schedule | None,
    cfg: StepConfig,
    is_lora: bool,
) -> tuple[TrainState, dict[str, jax.Array]]:
    """One optimizer update from a batch with a leading micro-batch axis [k, ...]. bco's running
    moments (`state.moments`) go through the micro-batches in order, each updating them."""
    num_micro = batch["pair_mask"].shape[0]
    total_pairs = jnp.maximum(batch["pair_mask"].sum(), 1.0)
    sft_tokens = _sft_tokens_per_pair(batch, total_pairs, cfg) if cfg.needs_sft_tokens else None

    def loss_fn(params, mb, ref_c, ref_r, moments):
        model = policy_model(graphdef, state.replace(params=params), is_lora)
        policy = completion_logps(model, mb, cfg)
        per_pair, sums, moments = batch_losses(policy, ref_c, ref_r, mb, cfg, sft_tokens, moments)
        sums["tokens"] = (mb["segment_ids"] > 0).sum().astype(jnp.float32)
        loss = per_pair.sum() / total_pairs
        if "aux_loss" in policy:
            # each micro-batch's load-balancing loss, weighted by its share of the pairs
            share = mb["pair_mask"].sum()
            sums["aux_loss"] = policy["aux_loss"] * share
            loss = loss + cfg.router_aux_coef * policy["aux_loss"] * share / total_pairs
        return loss, (sums, moments)

    grad_fn = jax.value_and_grad(loss_fn, has_aux=True)

    def accumulate(carry, mb):
        """((grads + this micro-batch's gradients, the running moments after it), this
        micro-batch's metric sums)."""
        grads, moments = carry
        ref_c, ref_r = reference_logps(graphdef, state, mb, cfg, is_lora)
        (_, (mb_sums, moments)), mb_grads = grad_fn(state.params, mb, ref_c, ref_r, moments)
        return (jax.tree.map(jnp.add, grads, mb_grads), moments), mb_sums

    carry = (jax.tree.map(jnp.zeros_like, state.params), state.moments)
    if num_micro == 1:
        (grads, moments), sums = accumulate(carry, _micro(batch, 0))
    else:
        # Every micro-batch inside the scan: a first one peeled off before it left a scan of one
        # trip for k=2, which XLA inlines and then interleaves with the first, so two
        # micro-batches held as much memory as one (docs/benchmarks.md). Each trip's metric sums
        # come out stacked and are added after.
        (grads, moments), stacked = jax.lax.scan(accumulate, carry, batch)
        sums = jax.tree.map(lambda v: v.sum(axis=0), stacked)

    grad_norm = optax.tree.norm(grads)
    updates, opt_state = optimizer.update(grads, state.opt_state, state.params)
    new_params = optax.apply_updates(state.params, updates)
    metrics = finalize_unpaired(sums) if cfg.unpaired else finalize_metrics(sums)
    metrics["tokens"] = sums["tokens"]
    metrics["pairs"] = sums["count"]
    metrics["grad_norm"] = grad_norm
    # The new parameters too: a finite gradient can still give a NaN update (Adam's 0/0 without
    # epsilon) or parameters that overflow; a non-finite update makes them non-finite as well.
    finite = jnp.isfinite(metrics["loss"]) & jnp.isfinite(grad_norm) & all_finite(new_params)
    metrics["nonfinite"] = (~finite).astype(jnp.float32)
    if schedule is not None:
        metrics["learning_rate"] = schedule(state.step)
    new_state = state.replace(
        step=state.step + 1, params=new_params, opt_state=opt_state, moments=moments
    )
    new_state = sync_reference(new_state, cfg, is_lora)  # TR-DPO, after its N-th step
    if cfg.skip_nonfinite:
        new_state = jax.tree.map(lambda new, old: jnp.where(finite, new, old), new_state, state)
    return new_state, metrics


def eval_step(
    state: TrainState,
    batch: Mapping[str, jax.Array],
    *,
    graphdef: nnx.GraphDef,
    cfg: StepConfig,
    is_lora: bool,
) -> dict[str, jax.Array]:
    """Per-pair log-probs and losses of one batch (no micro-batch axis) and metric sums (bco:
    with the running moments as they are, not updated)."""
    ref_c, ref_r = reference_logps(graphdef, state, batch, cfg, is_lora)
    policy = completion_logps(policy_model(graphdef, state, is_lora), batch, cfg)
    per_pair, sums, _ = batch_losses(
        policy, ref_c, ref_r, batch, cfg, None, state.moments, update=False
    )
    ci, ri = batch["chosen_index"], batch["rejected_index"]
    return {
        "policy_chosen_logps": policy["sums"][ci],
        "policy_rejected_logps": policy["sums"][ri],
        "ref_chosen_logps": ref_c,
        "ref_rejected_logps": ref_r,
        "losses": per_pair,
        "sums": sums,
    }


# ---------------------------------------------------------------------------------------------
# jit + sharding


def batch_sharding(batch: Mapping[str, Any], mesh: Mesh, *, micro_axis: bool = True) -> dict:
    """Batch arrays sharded over (data, fsdp) on the row / pair axis (each context device reads
    its rows whole; the model splits their length)."""
    lead = (None,) if micro_axis else ()
    return {k: NamedSharding(mesh, PartitionSpec(*lead, BATCH_AXES)) for k in batch}


def check_batch_divisible(batch: Mapping[str, Any], mesh: Mesh, *, micro_axis: bool = True):
    n = mesh.shape["data"] * mesh.shape["fsdp"]
    axis = 1 if micro_axis else 0
    for k, v in batch.items():
        problem = indivisible(v.shape[axis], n, f"rows of batch array {k!r}")
        if problem:
            raise ValueError(f"{problem}; change train.batch_size or the mesh")


def place_batch(
    batch: Mapping[str, Any],
    mesh: Mesh | None,
    *,
    micro_axis: bool,
    partition: DataPartition | None = None,
) -> tuple[dict[str, jax.Array], Any]:
    """(the step's arrays, on `mesh` when given; the pair ids of the whole batch in the order of
    its pair arrays) from a host batch. On a mesh that spans processes `batch` is this process's
    part (its data partition's) and the arrays are global (`dpojax.train.batches.global_batch`)."""
    if spans_processes(mesh):
        partition = partition or data_partition(mesh)
        return global_batch(batch, mesh, partition, micro_axis=micro_axis)
    pair_ids = batch.get("pair_ids")
    batch = step_arrays(batch)
    if mesh is None:
        return batch, pair_ids
    check_batch_divisible(batch, mesh, micro_axis=micro_axis)
    return jax.device_put(batch, batch_sharding(batch, mesh, micro_axis=micro_axis)), pair_ids


def program_key(lowered: jax.stages.Lowered) -> str:
    """What determines a lowered step's executable on this process's devices: a digest of its
    program text (every shape, dtype, sharding, donation and constant — the learning-rate
    schedule's too) and of the devices it is compiled for."""
    digest = hashlib.sha256(lowered.as_text().encode())
    digest.update(f"{jax.default_backend()} {jax.devices()}".encode())
    return digest.hexdigest()


@dataclasses.dataclass
class Stepper:
    """The jitted train and eval steps for one model / optimizer / config, optionally sharded."""

    graphdef: nnx.GraphDef
    optimizer: optax.GradientTransformation
    schedule: optax.Schedule | None
    cfg: StepConfig
    is_lora: bool
    mesh: Mesh | None = None
    rules: Mapping[str, MeshAxes] = dataclasses.field(default_factory=lambda: dict(DEFAULT_RULES))

    def __post_init__(self):
        self._train_fn = functools.partial(
            train_step,
            graphdef=self.graphdef,
            optimizer=self.optimizer,
            schedule=self.schedule,
            cfg=self.cfg,
            is_lora=self.is_lora,
        )
        self._eval_fn = functools.partial(
            eval_step, graphdef=self.graphdef, cfg=self.cfg, is_lora=self.is_lora
        )
        self._train = jax.jit(self._train_fn, donate_argnums=0)
        self._eval = jax.jit(self._eval_fn)
        self._programs: dict[str, Any] = {}  # `adopt`
        self._calls: dict[tuple, Any] = {}  # (train?, batch signature) -> what runs it
        self.multi_process = spans_processes(self.mesh)
        self.partition = data_partition(self.mesh)

    def pin_state_shardings(self, state: TrainState) -> TrainState:
        """The shardings of `state` (concrete or abstract) on the mesh; the train step's output
        state is pinned to them, so that consecutive steps never recompile."""
        shardings = state_shardings(state, self.optimizer, self.mesh, self.rules)
        pinned = jax.tree.flatten(shardings)
        if getattr(self, "_pinned", None) == pinned:  # already: keep the compiled steps
            return shardings
        self._pinned = pinned
        replicated = NamedSharding(self.mesh, PartitionSpec())
        self._train = jax.jit(
            self._train_fn, donate_argnums=0, out_shardings=(shardings, replicated)
        )
        if self.multi_process:  # every process reads every pair's results
            self._eval = jax.jit(self._eval_fn, out_shardings=replicated)
        self._calls = {}
        return shardings

    def shard_state(self, state: TrainState) -> TrainState:
        """Places the state on the mesh (no-op without one), see `pin_state_shardings`."""
        if self.mesh is None:
            return state
        return jax.device_put(state, self.pin_state_shardings(state))

    def lower(self, state: TrainState, batch: Mapping[str, Any], *, train: bool = True):
        """The train (or eval) step lowered for `state` and `batch` given as ShapeDtypeStructs
        (with shardings when there is a mesh): ahead-of-time compilation without any data or
        parameters (`dpojax.train.aot`)."""
        with mesh_context(self.mesh):
            return (self._train if train else self._eval).lower(state, batch)

    def adopt(self, programs: Mapping[str, Any]) -> None:
        """Steps compiled ahead of time (auto-fit's `jax.stages.Compiled`), by `program_key`: a
        step whose lowering for a batch has one of these keys runs that executable instead of
        compiling its own; any other batch shape compiles as usual."""
        self._programs, self._calls = dict(programs), {}

    def _step(self, train: bool, state: TrainState, arrays: Mapping[str, jax.Array]):
        """The train or eval step for this batch's shapes: an adopted executable whose program
        is the one this batch lowers to, else the jitted step (lowered once per shape)."""
        jitted = self._train if train else self._eval
        if not self._programs:
            return jitted
        signature = (train, *((k, v.shape, v.dtype, v.sharding) for k, v in arrays.items()))
        if signature not in self._calls:
            key = program_key(jitted.lower(state, arrays))
            self._calls[signature] = self._programs.get(key, jitted)
        return self._calls[signature]

    def put(self, batch: Mapping[str, Any], *, micro_axis: bool) -> tuple[dict, Any]:
        """(the step's arrays on the mesh, the pair ids of the whole batch) (`place_batch`)."""
        return place_batch(batch, self.mesh, micro_axis=micro_axis, partition=self.partition)

    def train(self, state: TrainState, batch: Mapping[str, Any]):
        """One update; `batch` arrays have a leading micro-batch axis."""
        return self.train_placed(state, self.put(batch, micro_axis=True)[0])

    def train_placed(self, state: TrainState, arrays: Mapping[str, jax.Array]):
        """One update from a batch already on the devices (`put`); returns at once, before the
        devices finish (JAX's asynchronous dispatch)."""
        with mesh_context(self.mesh):
            return self._step(True, state, arrays)(state, arrays)

    def evaluate(self, state: TrainState, batch: Mapping[str, Any]):
        """Per-pair results and metric sums of one batch; `pair_ids` (host values) names the
        pairs in the order of the per-pair results (over all processes' parts)."""
        with mesh_context(self.mesh):
            arrays, pair_ids = self.put(batch, micro_axis=False)
            return {**self._step(False, state, arrays)(state, arrays), "pair_ids": pair_ids}

    def train_cache_size(self) -> int:
        return self._train._cache_size()


def mesh_context(mesh: Mesh | None):
    """`jax.set_mesh(mesh)`, or nothing without a mesh."""
    return jax.set_mesh(mesh) if mesh is not None else contextlib.nullcontext()
